//! Some agents (20 % by default) are compromised: they train like everyone else, then replace
//! their update with a hostile one (sign-flipped ×10, or Gaussian noise) signed with their own
//! key, so the aggregator accepts it. The same fleet trains once without attackers (FedAvg) and
//! once per strategy with them; the table shows what each strategy makes of it.
//!
//! Claim (exit code 1 if it fails): FedAvg under attack ends at least 10 points below the clean
//! run, and every defence (clipped FedAvg, median, trimmed mean, Krum) keeps the model useful:
//! at least 70 % held-out accuracy at the end.
//!
//!     cargo run --release -p fedfleet --example poisoned [-- --agents 10 --rounds 15]

use std::process::ExitCode;

use clap::Parser;
use fedfleet::scenarios::{PoisonedOptions, PoisonedRow, poisoned};

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = PoisonedOptions::default().agents)]
    agents: usize,
    #[arg(long, default_value_t = PoisonedOptions::default().rounds)]
    rounds: u32,
    /// Share of hostile agents.
    #[arg(long, default_value_t = PoisonedOptions::default().hostile_fraction)]
    hostile_fraction: f64,
    /// clipped_fedavg's L2 bound on each update.
    #[arg(long, default_value_t = PoisonedOptions::default().clip_norm)]
    clip_norm: f64,
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

/// Every defence must end at least this accurate.
const DEFENDED_ACCURACY: f64 = 0.70;
/// FedAvg under attack must end at least this far below the clean run (else the attack is moot).
const ATTACK_EFFECT: f64 = 0.10;

#[tokio::main(flavor = "multi_thread")]
async fn main() -> ExitCode {
    let a = Args::parse();
    let o = PoisonedOptions {
        agents: a.agents,
        rounds: a.rounds,
        hostile_fraction: a.hostile_fraction,
        clip_norm: a.clip_norm,
        seed: a.seed,
        ..Default::default()
    };
    let hostile = fedfleet::scenarios::hostile_agents(o.agents, o.hostile_fraction, &o.attacks);
    let who: Vec<String> = hostile.iter().enumerate().filter_map(|(i, x)| x.map(|x| format!("agent-{i:03} ({x})"))).collect();
    println!("poisoned: {} agents, {} rounds, Dirichlet(0.5) shares; hostile: {}", o.agents, o.rounds, who.join(", "));
    println!("{:<16} | {:>7} | {:>14} | {:>13} | {:>6}", "strategy", "hostile", "final accuracy", "best accuracy", "rounds");
    println!("{:-<16}-+-{:->7}-+-{:->14}-+-{:->13}-+-{:->6}", "", "", "", "", "");
    let print = |r: &PoisonedRow| {
        println!(
            "{:<16} | {:>7} | {:>12.2} % | {:>11.2} % | {:>6}",
            r.strategy,
            r.hostile,
            r.final_accuracy * 100.0,
            r.best_accuracy * 100.0,
            r.rounds_completed
        )
    };
    let rows = match poisoned(&o, print).await {
        Ok(r) => r,
        Err(e) => {
            eprintln!("poisoned: {e:#}");
            return ExitCode::from(2);
        }
    };
    let clean = rows[0].final_accuracy;
    let attacked = |s: &str| rows.iter().skip(1).find(|r| r.strategy == s).map(|r| r.final_accuracy).unwrap_or(0.0);
    let mut failures = Vec::new();
    if attacked("fedavg") > clean - ATTACK_EFFECT {
        failures.push(format!(
            "FedAvg under attack ({:.2} %) is not {:.0} points below the clean run",
            attacked("fedavg") * 100.0,
            ATTACK_EFFECT * 100.0
        ));
    }
    for s in o.strategies.iter().filter(|s| *s != "fedavg") {
        if attacked(s) < DEFENDED_ACCURACY {
            failures.push(format!("{s} under attack ends at {:.2} %, below {:.0} %", attacked(s) * 100.0, DEFENDED_ACCURACY * 100.0));
        }
    }
    println!();
    if failures.is_empty() {
        println!(
            "OK: FedAvg under attack {:.2} % vs {:.2} % clean; every defence ends at or above {:.0} %",
            attacked("fedavg") * 100.0,
            clean * 100.0,
            DEFENDED_ACCURACY * 100.0
        );
        ExitCode::SUCCESS
    } else {
        for f in failures {
            println!("FAILED: {f}");
        }
        ExitCode::from(1)
    }
}
