use crate::bits;
use fedfleet_learning::sim::{SimConfig, apply_delta, run_fedavg, weighted_average};
use fedfleet_learning::{Dataset, ModelSpec, Partition, TrainConfig};
use fedfleet_protocol::bundle::TensorBundle;
use std::time::Instant;

#[test]
fn fedavg_20_clients_dirichlet_05_reaches_92_percent() {
    let (train, test) = Dataset::digits_split().unwrap();
    let cfg = SimConfig {
        spec: ModelSpec::digits_mlp(),
        clients: 20,
        partition: Partition::Dirichlet { alpha: 0.5 },
        rounds: 30,
        train: TrainConfig { local_epochs: 2, batch_size: 16, learning_rate: 0.05, ..TrainConfig::default() },
        server_lr: 1.0,
        seed: 2024,
    };
    let t = Instant::now();
    println!("FedAvg, digits MLP 64-64-10, 20 clients, Dirichlet(0.5), {:?}", cfg.train);
    println!("round  test_acc  test_loss  client_train_loss");
    let (_, curve) =
        run_fedavg(&cfg, &train, &test, |r| println!("{:5}  {:8.4}  {:9.4}  {:17.4}", r.round, r.accuracy, r.loss, r.train_loss)).unwrap();
    let last = curve.last().unwrap().accuracy;
    println!("final test accuracy {last:.4} after {} rounds in {:.1?}", curve.len(), t.elapsed());
    assert_eq!(curve.len(), 30);
    assert!(last >= 0.92, "final accuracy {last}");
}

#[test]
fn averaging_helpers() {
    let mut a = TensorBundle::new();
    a.insert_f32("w", vec![2], vec![1.0, 2.0]).unwrap();
    let mut b = TensorBundle::new();
    b.insert_f32("w", vec![2], vec![3.0, 6.0]).unwrap();
    let avg = weighted_average(&[(&a, 1.0), (&b, 3.0)]).unwrap();
    assert_eq!(avg.to_f32("w").unwrap(), vec![2.5, 5.0]);
    assert_eq!(apply_delta(&a, &b, -1.0).unwrap().to_f32("w").unwrap(), vec![-2.0, -4.0]);
    assert_eq!(bits(&apply_delta(&a, &b, 0.0).unwrap()), bits(&a));
    let mut c = TensorBundle::new();
    c.insert_f32("v", vec![2], vec![0.0, 0.0]).unwrap();
    assert!(apply_delta(&a, &c, 1.0).is_err());
    assert!(weighted_average(&[]).is_err());
    assert!(weighted_average(&[(&a, 0.0)]).is_err());
}
