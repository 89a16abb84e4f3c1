//! Safe rollout: a federated campaign produces a good version, which rolls out canary 10 % →
//! 100 %. Then a broken version (the good weights plus noise) is published and rolled out the
//! same way: its canaries download and verify it, fail the health check on their holdout (the
//! candidate is much less accurate than the model they run), roll back locally and report; the
//! registry auto-aborts the rollout and no other device is offered the broken version.
//!
//! Claim (exit code 1 if it fails): the good rollout completes with every agent on it; the
//! broken rollout is aborted after at least one failed health check, and every agent ends on the
//! good version.
//!
//!     cargo run --release -p fedfleet --example rollout [-- --agents 20 --rounds 10]

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use fedfleet::demo::Ui;
use fedfleet::scenarios::{RolloutScenarioOptions, rollout_with_abort};

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = RolloutScenarioOptions::default().agents)]
    agents: usize,
    #[arg(long, default_value_t = RolloutScenarioOptions::default().rounds)]
    rounds: u32,
    /// Soak time of each rollout phase, in seconds.
    #[arg(long, default_value_t = 1.0)]
    soak_secs: f64,
    /// Standard deviation of the noise that breaks the second version.
    #[arg(long, default_value_t = RolloutScenarioOptions::default().damage)]
    damage: f32,
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> ExitCode {
    let a = Args::parse();
    let o = RolloutScenarioOptions {
        agents: a.agents,
        rounds: a.rounds,
        soak: Duration::from_secs_f64(a.soak_secs.max(0.0)),
        damage: a.damage,
        seed: a.seed,
    };
    println!(
        "rollout: {} agents, {} rounds of FedAvg, then two rollouts (canary 10 % -> 100 %, auto-abort above 20 % failed health checks)",
        o.agents, o.rounds
    );
    let r = match rollout_with_abort(&o, &Ui::new(false)).await {
        Ok(r) => r,
        Err(e) => {
            eprintln!("rollout: {e:#}");
            return ExitCode::from(2);
        }
    };
    println!();
    println!(
        "good v{}: {:.2} % held-out accuracy; broken v{}: {:.2} %",
        r.good.version.0,
        r.good_accuracy * 100.0,
        r.broken.version.0,
        r.broken_accuracy * 100.0
    );
    println!();
    println!("{:<28} | {:<17} | devices (serving version, last state)", "phase", "rollout");
    println!("{:-<28}-+-{:-<17}-+-{:-<40}", "", "", "");
    for s in &r.steps {
        println!("{:<28} | {:<17} | {}", s.what, s.status, s.devices);
    }
    println!();
    let mut failures = Vec::new();
    if r.good_rollout != "completed" {
        failures.push(format!("the good rollout ended {}", r.good_rollout));
    }
    if r.broken_rollout != "aborted" {
        failures.push(format!("the broken rollout ended {}, not aborted", r.broken_rollout));
    }
    if r.failed_health_checks == 0 {
        failures.push("no device reported a failed health check".into());
    }
    if r.on_good != r.agents || r.on_broken != 0 {
        failures.push(format!("{} agents on the good version, {} on the broken one, of {}", r.on_good, r.on_broken, r.agents));
    }
    if failures.is_empty() {
        println!(
            "OK: broken v{} aborted after {} failed health check(s); all {} agents serve the good v{}",
            r.broken.version.0, r.failed_health_checks, r.agents, r.good.version.0
        );
        ExitCode::SUCCESS
    } else {
        for f in failures {
            println!("FAILED: {f}");
        }
        ExitCode::from(1)
    }
}
