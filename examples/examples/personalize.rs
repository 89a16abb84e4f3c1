//! Personalization after federated training: a campaign on strongly non-IID shares
//! (Dirichlet(0.1): most devices hold one or two digits), then every device fine-tunes the
//! global model on its own training share. The table compares, on each device's own holdout,
//! the global model and the personalized one.
//!
//! Claim (exit code 1 if it fails): the personalized models are more accurate on their devices'
//! holdouts than the global model, on average.
//!
//!     cargo run --release -p fedfleet --example personalize [-- --agents 20 --rounds 20]

use std::process::ExitCode;

use clap::Parser;
use fedfleet::scenarios::{PersonalizeOptions, personalize};

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = PersonalizeOptions::default().agents)]
    agents: usize,
    #[arg(long, default_value_t = PersonalizeOptions::default().rounds)]
    rounds: u32,
    /// Dirichlet concentration of the label skew.
    #[arg(long, default_value_t = PersonalizeOptions::default().alpha)]
    alpha: f64,
    /// Fine-tuning epochs on each device.
    #[arg(long, default_value_t = PersonalizeOptions::default().epochs)]
    epochs: usize,
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> ExitCode {
    let a = Args::parse();
    let o = PersonalizeOptions { agents: a.agents, rounds: a.rounds, alpha: a.alpha, epochs: a.epochs, seed: a.seed, ..Default::default() };
    println!(
        "personalize: {} agents, {} rounds of FedAvg on Dirichlet({}) shares, then {} epochs of local fine-tuning (SGD, lr {}, momentum 0.9)",
        o.agents, o.rounds, o.alpha, o.epochs, o.lr
    );
    let r = match personalize(&o).await {
        Ok(r) => r,
        Err(e) => {
            eprintln!("personalize: {e:#}");
            return ExitCode::from(2);
        }
    };
    println!("global model v{}: {:.2} % on the shared held-out test split", r.global_version.0, r.global_test_accuracy * 100.0);
    println!();
    println!("{:<10} | {:>5} | {:>7} | {:>13} | {:>13}", "device", "train", "holdout", "global (local)", "personalized");
    println!("{:-<10}-+-{:->5}-+-{:->7}-+-{:->14}-+-{:->13}", "", "", "", "", "");
    for d in &r.devices {
        println!(
            "{:<10} | {:>5} | {:>7} | {:>12.2} % | {:>11.2} %",
            d.device,
            d.train_examples,
            d.holdout_examples,
            d.global * 100.0,
            d.personalized * 100.0
        );
    }
    let (global, personalized) = r.means();
    println!("{:<10} | {:>5} | {:>7} | {:>12.2} % | {:>11.2} %", "mean", "", "", global * 100.0, personalized * 100.0);
    let better = r.devices.iter().filter(|d| d.personalized > d.global).count();
    let worse = r.devices.iter().filter(|d| d.personalized < d.global).count();
    println!();
    println!("{better} devices better, {worse} worse, {} unchanged after personalization", r.devices.len() - better - worse);
    if personalized > global {
        println!("OK: personalized {:.2} % vs global {:.2} % on the devices' own holdouts (mean)", personalized * 100.0, global * 100.0);
        ExitCode::SUCCESS
    } else {
        println!("FAILED: personalized {:.2} % is not above global {:.2} % (mean)", personalized * 100.0, global * 100.0);
        ExitCode::from(1)
    }
}
