//! Agent figures: peak RSS while training the digits MLP on one device's partition, and
//! inference latency through the local endpoint (the unix socket `fedfleet-agent run` serves).
//!
//! cargo run --release -p fedfleet-agent --example bench_agent
//! (binary size as shipped: `cargo build --profile device -p fedfleet-agent && ls -l target/device/fedfleet-agent`)

use std::sync::Arc;
use std::time::Instant;

use fedfleet_agent::agent::{Served, Serving};
use fedfleet_agent::inference::{Request, query, serve_unix};
use fedfleet_learning::{Dataset, ModelSpec, Partition, Predictor, TrainConfig, model::init_bundle, sim, train_local};
use fedfleet_protocol::{Digest, ModelRef, ModelVersion};

fn peak_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmHWM:")).map(str::to_owned))
        .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let profile = if cfg!(debug_assertions) { "dev" } else { "release" };
    println!("# cargo run --release -p fedfleet-agent --example bench_agent   (this run: {profile} profile)");
    let rss_start = peak_rss_kib();
    let spec = ModelSpec::digits_mlp();
    let global = init_bundle(&spec, 7)?;
    let (train, test) = Dataset::digits_split()?;
    let part = Partition::Dirichlet { alpha: 0.5 }.split_dataset(&train, 20, 42).swap_remove(0);
    let cfg = TrainConfig { local_epochs: 5, batch_size: 16, learning_rate: 0.05, ..Default::default() };
    let t = Instant::now();
    let out = train_local(&spec, &global, &part, &cfg, 1)?;
    println!(
        "training: {} examples x {} epochs in {:.3} s ({:.0} examples/s); peak RSS {} KiB (at start {} KiB)",
        out.num_examples,
        cfg.local_epochs,
        t.elapsed().as_secs_f64(),
        out.metrics.examples_per_sec,
        peak_rss_kib(),
        rss_start
    );

    let model = sim::apply_delta(&global, &out.delta, 1.0)?;
    let serving = Serving::default();
    let bytes = model.encode();
    serving.set(Served {
        model: ModelRef { name: "digits".into(), version: ModelVersion(1), digest: Digest::of(&bytes) },
        predictor: Arc::new(Predictor::new(&spec, &model)?),
    });
    let dir = tempfile::tempdir()?;
    let socket = dir.path().join("infer.sock");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn({
        let socket = socket.clone();
        async move {
            serve_unix(&socket, serving, fedfleet_learning::Normalization::None, async {
                let _ = stopped.await;
            })
            .await
        }
    });
    while !socket.exists() {
        tokio::task::yield_now().await;
    }
    let n = 2000;
    let mut rtt = Vec::with_capacity(n);
    let mut model_us = Vec::with_capacity(n);
    for i in 0..n {
        let row = test.example(i % test.len()).to_vec();
        let t = Instant::now();
        let resp = query(&socket, &Request { inputs: vec![row], feedback: false }).await?;
        rtt.push(t.elapsed().as_secs_f64() * 1e3);
        anyhow::ensure!(resp.error.is_none(), "endpoint error: {:?}", resp.error);
        model_us.push(resp.latency_us as f64 / 1e3);
    }
    rtt.sort_by(f64::total_cmp);
    model_us.sort_by(f64::total_cmp);
    println!(
        "inference through the unix-socket endpoint ({n} single-row requests, one connection each): \
         round trip p50 {:.3} ms p99 {:.3} ms; model p50 {:.3} ms p99 {:.3} ms",
        percentile(&rtt, 0.5),
        percentile(&rtt, 0.99),
        percentile(&model_us, 0.5),
        percentile(&model_us, 0.99)
    );
    println!("peak RSS overall {} KiB", peak_rss_kib());
    let _ = stop.send(());
    server.await??;
    Ok(())
}
