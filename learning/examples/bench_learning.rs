//! Local training throughput and inference latency for the MLP and the CNN, with peak RSS.
//!
//! Reproduce (release build, one CPU thread as burn's flex backend is built here):
//!
//! ```text
//! cargo run --release -p fedfleet-learning --example bench_learning [-- --quick]
//! ```
//!
//! `--quick`: the digits models only (no MNIST).
//!
//! Prints figures only; asserts nothing about time.

use fedfleet_learning::model::init_bundle;
use fedfleet_learning::{Dataset, ModelSpec, Predictor, TrainConfig, train_local};
use std::path::Path;
use std::time::{Duration, Instant};

fn peak_rss_kib() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines().find(|l| l.starts_with("VmHWM:"))?.split_whitespace().nth(1)?.parse().ok()
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn bench(name: &str, spec: &ModelSpec, train: &Dataset, test: &Dataset, epochs: usize) {
    let g = init_bundle(spec, 1).unwrap();
    let cfg = TrainConfig { local_epochs: epochs, batch_size: 32, learning_rate: 0.05, ..TrainConfig::default() };
    // warm-up
    let _ = train_local(spec, &g, &train.subset(&(0..64).collect::<Vec<_>>()), &cfg, 0).unwrap();
    let out = train_local(spec, &g, train, &cfg, 1).unwrap();
    let local = fedfleet_learning::sim::apply_delta(&g, &out.delta, 1.0).unwrap();
    let p = Predictor::new(spec, &local).unwrap();
    let n = 1000.min(test.len());
    let mut single: Vec<Duration> = (0..n).map(|i| p.predict(test.example(i % test.len())).unwrap().1).collect();
    single.sort();
    let bs = 64.min(test.len());
    let mut batched: Vec<Duration> = (0..50)
        .map(|k| {
            let lo = (k * bs) % (test.len() - bs + 1);
            p.predict_batch(&test.features[lo * test.example_len()..(lo + bs) * test.example_len()], bs).unwrap().latency
        })
        .collect();
    batched.sort();
    let acc = fedfleet_learning::evaluate(spec, &local, test).unwrap().accuracy;
    println!(
        "{name:<28} params {:>7}  train {:>9.0} ex/s ({} ex, {} steps, batch 32)  infer single p50 {:>7.1?} p99 {:>7.1?}  batch{bs} p50 {:>7.1?} p99 {:>7.1?} ({:>8.0} ex/s)  test acc {:.3}",
        spec.num_params(),
        out.metrics.examples_per_sec,
        out.metrics.examples_processed,
        out.metrics.steps,
        pct(&single, 0.5),
        pct(&single, 0.99),
        pct(&batched, 0.5),
        pct(&batched, 0.99),
        bs as f64 / pct(&batched, 0.5).as_secs_f64(),
        acc,
    );
}

fn main() {
    let t = Instant::now();
    if cfg!(debug_assertions) {
        println!(
            "command: cargo run -p fedfleet-learning --example bench_learning   (dev profile: this crate opt-level 1, deps opt-level 2)"
        );
    } else {
        println!("command: cargo run --release -p fedfleet-learning --example bench_learning");
    }
    println!("backend: burn 0.22.1 flex (pure-Rust CPU, single thread), f32");
    let (train, test) = Dataset::digits_split().unwrap();
    bench("digits MLP 64-64-10", &ModelSpec::digits_mlp(), &train, &test, 5);
    let (ti, si) = (train.clone().reshaped(vec![1, 8, 8]).unwrap(), test.clone().reshaped(vec![1, 8, 8]).unwrap());
    bench("digits CNN 8x8 c16-c32-64", &ModelSpec::digits_cnn(), &ti, &si, 2);
    // `--quick` (benches/smoke.sh): the digits models only.
    if std::env::args().any(|a| a == "--quick") {
        println!("peak RSS (VmHWM): {} KiB; total {:.1?} (--quick: MNIST skipped)", peak_rss_kib().unwrap_or(0), t.elapsed());
        return;
    }
    let mnist_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/mnist-t10k");
    match Dataset::load_mnist_dir(&mnist_dir, "t10k") {
        Ok(m) => {
            let (mtr, mte) = m.split(0.2, 1);
            let mtr = mtr.subset(&(0..2000).collect::<Vec<_>>());
            bench("mnist CNN 28x28 c16-c32-128", &ModelSpec::mnist_cnn(), &mtr, &mte, 1);
            let flat = |d: Dataset| d.reshaped(vec![784]).unwrap();
            let mlp = ModelSpec::Mlp { input: vec![784], hidden: vec![128], classes: 10 };
            bench("mnist MLP 784-128-10", &mlp, &flat(mtr), &flat(mte), 1);
        }
        Err(e) => println!("mnist: skipped ({e})"),
    }
    println!("peak RSS (VmHWM): {} KiB; total {:.1?}", peak_rss_kib().unwrap_or(0), t.elapsed());
}
