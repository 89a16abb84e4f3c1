use crate::bits;
use fedfleet_learning::eval::evaluate_model;
use fedfleet_learning::model::init_bundle;
use fedfleet_learning::train::OptimizerConfig;
use fedfleet_learning::{
    Dataset, LearningError, Model, ModelSpec, Predictor, ScaffoldState, TrainConfig, evaluate, sim, train_local, train_local_scaffold,
};

#[test]
fn centralized_mlp_on_digits_reaches_95_percent() {
    let spec = ModelSpec::digits_mlp();
    let (train, test) = Dataset::digits_split().unwrap();
    let g = init_bundle(&spec, 1).unwrap();
    let cfg = TrainConfig { local_epochs: 20, batch_size: 32, learning_rate: 0.05, ..TrainConfig::default() };
    let out = train_local(&spec, &g, &train, &cfg, 42).unwrap();
    let local = sim::apply_delta(&g, &out.delta, 1.0).unwrap();
    let r = evaluate(&spec, &local, &test).unwrap();
    println!(
        "centralized MLP: {} steps, {:.0} examples/s, train loss {:.4} -> {:.4}, test acc {:.4}, test loss {:.4}",
        out.metrics.steps,
        out.metrics.examples_per_sec,
        out.metrics.epochs[0].loss,
        out.metrics.epochs.last().unwrap().loss,
        r.accuracy,
        r.loss
    );
    assert_eq!(out.num_examples, train.len());
    assert_eq!(out.metrics.epochs.len(), 20);
    assert!(r.accuracy >= 0.95, "test accuracy {}", r.accuracy);
    // confusion counts are consistent
    assert_eq!(r.confusion.iter().flatten().sum::<u64>() as usize, test.len());
    let diag: u64 = (0..10).map(|k| r.confusion[k][k]).sum();
    assert!((diag as f64 / test.len() as f64 - r.accuracy).abs() < 1e-12);
    for (k, row) in r.confusion.iter().enumerate() {
        assert_eq!(row.iter().sum::<u64>() as usize, test.label_histogram()[k]);
    }
    // predictions agree between batch, single and evaluation
    let p = Predictor::new(&spec, &local).unwrap();
    let batch = p.predict_batch(&test.features, test.len()).unwrap();
    let correct = batch.predictions.iter().zip(&test.labels).filter(|(p, l)| p.label == Some(**l as usize)).count();
    assert_eq!(correct as f64 / test.len() as f64, r.accuracy);
    for i in 0..5 {
        let (one, latency) = p.predict(test.example(i)).unwrap();
        assert_eq!(one.label, batch.predictions[i].label);
        assert!((one.probs.iter().sum::<f32>() - 1.0).abs() < 1e-5);
        assert!(latency.as_nanos() > 0);
    }
    assert!(p.predict(&[0.0; 3]).is_err());
}

#[test]
fn adam_and_the_cnn_learn_digits() {
    let (train, test) = Dataset::digits_split().unwrap();
    let spec = ModelSpec::digits_mlp();
    let g = init_bundle(&spec, 2).unwrap();
    let cfg = TrainConfig { local_epochs: 5, learning_rate: 0.003, optimizer: OptimizerConfig::adam(), ..TrainConfig::default() };
    let out = train_local(&spec, &g, &train, &cfg, 1).unwrap();
    let acc = evaluate(&spec, &sim::apply_delta(&g, &out.delta, 1.0).unwrap(), &test).unwrap().accuracy;
    println!("MLP + Adam, 5 epochs: test acc {acc:.4}");
    assert!(acc > 0.93, "{acc}");

    let cnn = ModelSpec::digits_cnn();
    let (train_img, test_img) = (train.reshaped(vec![1, 8, 8]).unwrap(), test.reshaped(vec![1, 8, 8]).unwrap());
    let g = init_bundle(&cnn, 2).unwrap();
    let cfg = TrainConfig { local_epochs: 3, learning_rate: 0.05, ..TrainConfig::default() };
    let out = train_local(&cnn, &g, &train_img, &cfg, 1).unwrap();
    let model = Model::from_bundle(&cnn, &sim::apply_delta(&g, &out.delta, 1.0).unwrap()).unwrap();
    let acc = evaluate_model(&model, &test_img).unwrap().accuracy;
    println!("CNN, 3 epochs: test acc {acc:.4}, {:.0} examples/s", out.metrics.examples_per_sec);
    assert!(acc > 0.85, "{acc}");
}

#[test]
fn same_seed_same_weights_bit_for_bit() {
    let (train, _) = Dataset::digits_split().unwrap();
    let part = train.subset(&(0..300).collect::<Vec<_>>());
    for spec in [ModelSpec::digits_mlp(), ModelSpec::digits_cnn()] {
        let data = part.clone().reshaped(spec.input_shape().to_vec()).unwrap();
        let g = fedfleet_learning::Model::init(&spec, 9).unwrap().to_bundle().unwrap();
        for opt in [OptimizerConfig::Sgd { momentum: 0.9 }, OptimizerConfig::adam()] {
            let cfg = TrainConfig {
                local_epochs: 2,
                batch_size: 16,
                learning_rate: 0.01,
                optimizer: opt,
                proximal_mu: 0.1,
                ..TrainConfig::default()
            };
            let a = train_local(&spec, &g, &data, &cfg, 5).unwrap();
            let b = train_local(&spec, &g, &data, &cfg, 5).unwrap();
            assert_eq!(bits(&a.delta), bits(&b.delta), "{}", spec.arch());
            assert_eq!(a.metrics.epochs, b.metrics.epochs);
            let c = train_local(&spec, &g, &data, &cfg, 6).unwrap();
            assert_ne!(bits(&a.delta), bits(&c.delta), "another seed shuffles differently");
        }
    }
}

#[test]
fn fedprox_keeps_weights_closer_to_the_start() {
    let (train, _) = Dataset::digits_split().unwrap();
    // a skewed client: only digits 0..3
    let idx: Vec<usize> = (0..train.len()).filter(|&i| train.labels[i] < 3).collect();
    let data = train.subset(&idx);
    let spec = ModelSpec::digits_mlp();
    let g = init_bundle(&spec, 4).unwrap();
    let base = TrainConfig { local_epochs: 3, batch_size: 16, learning_rate: 0.05, ..TrainConfig::default() };
    let norms: Vec<f64> = [0.0, 0.1, 1.0]
        .iter()
        .map(|&mu| {
            let out = train_local(&spec, &g, &data, &TrainConfig { proximal_mu: mu, ..base.clone() }, 3).unwrap();
            assert!((sim::l2_norm(&out.delta) - out.metrics.delta_norm).abs() < 1e-9);
            out.metrics.delta_norm
        })
        .collect();
    println!("||local - global|| for mu = 0, 0.1, 1: {norms:?}");
    assert!(norms[1] < norms[0] && norms[2] < norms[1], "{norms:?}");
}

#[test]
fn scaffold_hooks() {
    let (train, _) = Dataset::digits_split().unwrap();
    let data = train.subset(&(0..200).collect::<Vec<_>>());
    let spec = ModelSpec::digits_mlp();
    let g = init_bundle(&spec, 4).unwrap();
    let zero = sim::scale(&g, 0.0).unwrap();
    let cfg = TrainConfig {
        local_epochs: 1,
        batch_size: 20,
        learning_rate: 0.05,
        optimizer: OptimizerConfig::Sgd { momentum: 0.0 },
        ..TrainConfig::default()
    };
    let plain = train_local(&spec, &g, &data, &cfg, 1).unwrap();
    let state = ScaffoldState { server_c: zero.clone(), client_c: zero.clone() };
    let (out, sc) = train_local_scaffold(&spec, &g, &data, &cfg, 1, &state).unwrap();
    // zero control variates: exactly FedAvg's local step
    assert_eq!(bits(&out.delta), bits(&plain.delta));
    // c_i+ = -delta / (K lr)
    let k = out.metrics.steps as f32;
    let want = sim::scale(&out.delta, -1.0 / (k * 0.05)).unwrap();
    for (n, _) in want.layout() {
        for (a, b) in want.to_f32(&n).unwrap().iter().zip(sc.client_c.to_f32(&n).unwrap()) {
            assert!((a - b).abs() <= 1e-5 * a.abs().max(1.0), "{n}: {a} vs {b}");
        }
    }
    // a non-zero correction c - c_i shifts every step by -lr (c - c_i)
    let c = sim::apply_delta(&zero, &sc.client_c, 1.0).unwrap();
    let state = ScaffoldState { server_c: c, client_c: zero };
    let (shifted, _) = train_local_scaffold(&spec, &g, &data, &cfg, 1, &state).unwrap();
    assert_ne!(bits(&shifted.delta), bits(&plain.delta));
}

#[test]
fn training_rejects_bad_inputs() {
    let spec = ModelSpec::digits_mlp();
    let g = init_bundle(&spec, 1).unwrap();
    let (train, _) = Dataset::digits_split().unwrap();
    let img = train.clone().reshaped(vec![1, 8, 8]).unwrap();
    // shape [1,8,8] has 64 values: fine for the MLP; the CNN wants exactly that too
    assert!(train_local(&spec, &g, &img, &TrainConfig { max_steps: Some(1), ..TrainConfig::default() }, 1).is_ok());
    let narrow = Dataset { features: vec![0.0; 10], labels: vec![0; 1], targets: vec![], shape: vec![10], num_classes: 10 };
    assert!(matches!(train_local(&spec, &g, &narrow, &TrainConfig::default(), 1), Err(LearningError::InputMismatch(_))));
    let empty = train.subset(&[]);
    assert!(matches!(train_local(&spec, &g, &empty, &TrainConfig::default(), 1), Err(LearningError::InputMismatch(_))));
    let bad = TrainConfig { batch_size: 0, ..TrainConfig::default() };
    assert!(matches!(train_local(&spec, &g, &train, &bad, 1), Err(LearningError::InvalidConfig(_))));
    let diverge = TrainConfig { learning_rate: 1e30, ..TrainConfig::default() };
    assert!(matches!(train_local(&spec, &g, &train, &diverge, 1), Err(LearningError::NonFinite { .. })));
    let wrong = init_bundle(&ModelSpec::digits_cnn(), 1).unwrap();
    assert!(matches!(train_local(&spec, &wrong, &train, &TrainConfig::default(), 1), Err(LearningError::Layout(_))));
    // config is serde-friendly with defaults
    let cfg: TrainConfig = serde_json::from_str(r#"{"epochs":2,"optimizer":{"kind":"sgd","momentum":0.5},"prox_mu":0.01}"#).unwrap();
    assert_eq!((cfg.local_epochs, cfg.batch_size, cfg.proximal_mu), (2, 32, 0.01));
    // ... under the round configuration's names, and the older ones above still read.
    let cfg: TrainConfig = serde_json::from_str(r#"{"local_epochs":3,"learning_rate":0.2,"proximal_mu":0.5}"#).unwrap();
    assert_eq!((cfg.local_epochs, cfg.learning_rate, cfg.proximal_mu), (3, 0.2, 0.5));
}
