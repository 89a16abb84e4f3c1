//! In-process FedAvg on the digits task (`sim::run_fedavg`), printing machine-readable lines,
//! for the side-by-side comparison with Flower (`benches/flower/`).
//!
//! ```text
//! cargo run --release -p fedfleet-learning --example fl_digits -- \
//!     --clients 20 --alpha 0.5 --rounds 30 --seed 42 [--epochs 2] [--batch 16] [--lr 0.05] \
//!     [--momentum 0.9] [--dump-partition PATH]
//! ```
//!
//! Output (one line each, `key=value` separated by spaces):
//!
//! ```text
//! RESULT config clients=20 alpha=0.5 rounds=30 seed=42 epochs=2 batch=16 lr=0.05 momentum=0.9 params=4810
//! RESULT round=1 accuracy=0.612813 loss=1.234567 train_loss=1.5
//! ...
//! RESULT wall_seconds=12.345
//! RESULT peak_rss_kib=23456
//! ```
//!
//! `wall_seconds` covers `run_fedavg` only (partition, init, every round's local training of
//! every client, averaging and test evaluation); loading the embedded data set is excluded.
//!
//! `--dump-partition PATH` writes, before training, a JSON file with everything another
//! implementation needs to run the *same* experiment: the digits train/test split as row
//! indices into `learning/data/digits.csv.gz`, each client's example indices (into the train
//! part, exactly as `run_fedavg` partitions it), the initial global weights (PyTorch names and
//! layouts, f32 values), the hyper-parameters, and checksums of the train/test features.

use fedfleet_learning::data::{DIGITS_SPLIT_SEED, DIGITS_TEST_FRACTION};
use fedfleet_learning::model::init_bundle;
use fedfleet_learning::sim::{SimConfig, run_fedavg};
use fedfleet_learning::{Dataset, ModelSpec, OptimizerConfig, Partition, TrainConfig};
use serde_json::{Value, json};
use std::time::Instant;

struct Args {
    clients: usize,
    alpha: f64,
    rounds: usize,
    seed: u64,
    epochs: usize,
    batch: usize,
    lr: f64,
    momentum: f64,
    dump: Option<String>,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args { clients: 20, alpha: 0.5, rounds: 30, seed: 42, epochs: 2, batch: 16, lr: 0.05, momentum: 0.9, dump: None };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        let bad = |e: &dyn std::fmt::Display| format!("{flag}: {e}");
        match flag.as_str() {
            "--clients" => a.clients = val()?.parse().map_err(|e| bad(&e))?,
            "--alpha" => a.alpha = val()?.parse().map_err(|e| bad(&e))?,
            "--rounds" => a.rounds = val()?.parse().map_err(|e| bad(&e))?,
            "--seed" => a.seed = val()?.parse().map_err(|e| bad(&e))?,
            "--epochs" => a.epochs = val()?.parse().map_err(|e| bad(&e))?,
            "--batch" => a.batch = val()?.parse().map_err(|e| bad(&e))?,
            "--lr" => a.lr = val()?.parse().map_err(|e| bad(&e))?,
            "--momentum" => a.momentum = val()?.parse().map_err(|e| bad(&e))?,
            "--dump-partition" => a.dump = Some(val()?),
            "-h" | "--help" => {
                println!(
                    "fl_digits [--clients N] [--alpha A] [--rounds R] [--seed S] [--epochs E] [--batch B] \
                     [--lr LR] [--momentum M] [--dump-partition PATH]"
                );
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if a.clients == 0 || a.rounds == 0 {
        return Err("--clients and --rounds must be > 0".into());
    }
    Ok(a)
}

fn peak_rss_kib() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines().find(|l| l.starts_with("VmHWM:"))?.split_whitespace().nth(1)?.parse().ok()
}

/// Row indices (into the digits CSV) of the canonical train/test split, recovered through the
/// public API: `Dataset::split` depends only on the labels and the seed and keeps the order of
/// `subset`, so splitting a data set whose single feature is the row index yields the indices.
fn split_indices(full: &Dataset) -> (Vec<usize>, Vec<usize>) {
    let index_set = Dataset {
        features: (0..full.len()).map(|i| i as f32).collect(),
        labels: full.labels.clone(),
        targets: Vec::new(),
        shape: vec![1],
        num_classes: full.num_classes,
    };
    let (tr, te) = index_set.split(DIGITS_TEST_FRACTION, DIGITS_SPLIT_SEED);
    let idx = |d: &Dataset| d.features.iter().map(|&v| v as usize).collect::<Vec<_>>();
    (idx(&tr), idx(&te))
}

fn checksum(d: &Dataset) -> f64 {
    d.features.iter().map(|&v| v as f64).sum()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = parse_args().map_err(|e| {
        eprintln!("fl_digits: {e}");
        std::process::exit(2)
    })?;
    let spec = ModelSpec::digits_mlp();
    let (train, test) = Dataset::digits_split()?;
    let partition = Partition::Dirichlet { alpha: a.alpha };
    let cfg = SimConfig {
        spec: spec.clone(),
        clients: a.clients,
        partition: partition.clone(),
        rounds: a.rounds,
        train: TrainConfig {
            local_epochs: a.epochs,
            batch_size: a.batch,
            learning_rate: a.lr,
            optimizer: OptimizerConfig::Sgd { momentum: a.momentum },
            proximal_mu: 0.0,
            max_steps: None,
        },
        server_lr: 1.0,
        seed: a.seed,
    };
    println!(
        "RESULT config clients={} alpha={} rounds={} seed={} epochs={} batch={} lr={} momentum={} params={} train={} test={}",
        a.clients,
        a.alpha,
        a.rounds,
        a.seed,
        a.epochs,
        a.batch,
        a.lr,
        a.momentum,
        spec.num_params(),
        train.len(),
        test.len()
    );

    if let Some(path) = &a.dump {
        let full = Dataset::digits()?;
        let (train_idx, test_idx) = split_indices(&full);
        // The recovered indices must reproduce digits_split() exactly.
        assert_eq!(full.subset(&train_idx).features, train.features, "train split mismatch");
        assert_eq!(full.subset(&test_idx).features, test.features, "test split mismatch");
        assert_eq!(full.subset(&train_idx).labels, train.labels, "train labels mismatch");
        // Same call run_fedavg makes (partition of the train part with cfg.seed).
        let parts = partition.split(&train.labels, train.num_classes, a.clients, a.seed);
        let init = init_bundle(&spec, a.seed)?;
        let mut init_json = serde_json::Map::new();
        for p in spec.params() {
            let v = init.to_f32(&p.name).ok_or("init tensor is not f32")?;
            init_json.insert(p.name.clone(), json!({ "shape": p.shape, "values": v }));
        }
        let doc: Value = json!({
            "format": "fedfleet-fl-digits-v1",
            "data": "learning/data/digits.csv.gz",
            "normalization": "scale 1/16 (f32)",
            "label_column": "last",
            "spec": serde_json::from_str::<Value>(&spec.to_json())?,
            "param_order": spec.params().iter().map(|p| p.name.clone()).collect::<Vec<_>>(),
            "clients": a.clients,
            "alpha": a.alpha,
            "rounds": a.rounds,
            "seed": a.seed,
            "train_config": serde_json::to_value(&cfg.train)?,
            "server_lr": cfg.server_lr,
            "split": { "train": train_idx, "test": test_idx },
            "partition": parts,
            "init": Value::Object(init_json),
            "checksum": { "train_features": checksum(&train), "test_features": checksum(&test) },
        });
        std::fs::write(path, serde_json::to_vec(&doc)?)?;
        eprintln!("fl_digits: wrote partition/split/init to {path}");
    }

    let t = Instant::now();
    let (_, curve) = run_fedavg(&cfg, &train, &test, |r| {
        println!("RESULT round={} accuracy={:.6} loss={:.6} train_loss={:.6}", r.round, r.accuracy, r.loss, r.train_loss)
    })?;
    let wall = t.elapsed().as_secs_f64();
    println!("RESULT wall_seconds={wall:.3}");
    if let Some(k) = peak_rss_kib() {
        println!("RESULT peak_rss_kib={k}");
    }
    if let Some(last) = curve.last() {
        eprintln!("fl_digits: final accuracy {:.4} after {} rounds in {wall:.1}s", last.accuracy, curve.len());
    }
    Ok(())
}
