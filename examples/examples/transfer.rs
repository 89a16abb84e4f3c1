//! Bring your own model: a model pre-trained centrally on one distribution (MNIST, downsampled
//! to 8x8) is published as version 1, then the fleet fine-tunes it federatedly on another (the
//! UCI digits set: other writers, scanner and preprocessing), once per fine-tuning mode: every
//! weight (`full`), the last layer only (`head`), and rank-1 LoRA adapters on every layer (`lora`).
//! Each row is a campaign over the real registry, aggregator and agents on loopback; the
//! aggregator folds only the tensors an update carries.
//!
//! Claims (exit code 1 if one fails): `head` and `lora` move at most 5 % of `full`'s bytes per
//! update; every mode beats the pre-trained model on the digits test split; `head` ends within 3
//! points of `full`, `lora` within 1.5.
//!
//!     cargo run --release -p fedfleet --example transfer [-- --agents 20 --rounds 15]

use std::process::ExitCode;

use clap::Parser;
use fedfleet::scenarios::{TransferOptions, transfer};

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = TransferOptions::default().agents)]
    agents: usize,
    #[arg(long, default_value_t = TransferOptions::default().rounds)]
    rounds: u32,
    /// Epochs of central pre-training on MNIST.
    #[arg(long, default_value_t = TransferOptions::default().pretrain_epochs)]
    pretrain_epochs: usize,
    #[arg(long, default_value_t = TransferOptions::default().lora_rank)]
    lora_rank: usize,
    /// Layers LoRA adapts (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = TransferOptions::default().lora_targets)]
    lora_targets: Vec<String>,
    /// Parameters that also train in full under LoRA (e.g. `*.bias`).
    #[arg(long, value_delimiter = ',')]
    lora_also_train: Vec<String>,
    /// Keep the adapters' A at their initial values and train only B (FFA-LoRA).
    #[arg(long, action = clap::ArgAction::Set, default_value_t = TransferOptions::default().lora_freeze_a)]
    lora_freeze_a: bool,
    /// How each adapter's A starts: `principal` (the pre-trained weight's top right singular
    /// vectors) or `random` (peft's kaiming-uniform).
    #[arg(long, value_parser = ["principal", "random"], default_value = "principal")]
    lora_init_a: String,
    /// The agents' learning rate for full fine-tuning, head only and LoRA.
    #[arg(long, value_delimiter = ',', default_values_t = TransferOptions::default().lr)]
    lr: Vec<f32>,
    /// The agents' local optimizer (sgd or adam) for full fine-tuning, head only and LoRA.
    #[arg(long, value_delimiter = ',', default_values_t = TransferOptions::default().optimizers.map(String::from))]
    optimizers: Vec<String>,
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> ExitCode {
    let a = Args::parse();
    // Quiet unless RUST_LOG asks (e.g. RUST_LOG=info shows the services and agents at work).
    fedfleet_net::logging::init("off");
    let [full_lr, head_lr, lora_lr] = a.lr[..] else {
        eprintln!("transfer: --lr takes three values (full, head, lora), e.g. --lr 0.2,0.5,0.2");
        return ExitCode::from(2);
    };
    let optimizer = |i: usize| match a.optimizers.get(i).map(String::as_str) {
        Some("adam") => Some("adam"),
        Some("sgd") => Some("sgd"),
        _ => None,
    };
    let (Some(full_opt), Some(head_opt), Some(lora_opt)) = (optimizer(0), optimizer(1), optimizer(2)) else {
        eprintln!("transfer: --optimizers takes three of sgd|adam (full, head, lora), e.g. --optimizers sgd,sgd,adam");
        return ExitCode::from(2);
    };
    let o = TransferOptions {
        agents: a.agents,
        rounds: a.rounds,
        pretrain_epochs: a.pretrain_epochs,
        lora_rank: a.lora_rank,
        lora_targets: a.lora_targets,
        lora_also_train: a.lora_also_train,
        lora_freeze_a: a.lora_freeze_a,
        lora_init_a: if a.lora_init_a == "random" {
            fedfleet_learning::AdapterInit::Random
        } else {
            fedfleet_learning::AdapterInit::Principal
        },
        lr: [full_lr, head_lr, lora_lr],
        optimizers: [full_opt, head_opt, lora_opt],
        seed: a.seed,
    };
    println!(
        "transfer: MLP 64-128-64-10 pre-trained on MNIST (8x8, {} epochs); {} agents fine-tune it on digits for {} rounds per mode",
        o.pretrain_epochs, o.agents, o.rounds
    );
    println!();
    println!("{:<5} | {:>9} | {:>14} | {:>9} | {:>9}", "mode", "trainable", "bytes/update", "before", "after");
    println!("{:-<5}-+-{:->9}-+-{:->14}-+-{:->9}-+-{:->9}", "", "", "", "", "");
    let r = match transfer(&o, |row| {
        println!(
            "{:<5} | {:>9} | {:>14.0} | {:>7.2} % | {:>7.2} %",
            row.mode,
            row.trainable,
            row.bytes_per_update,
            row.before * 100.0,
            row.after * 100.0
        );
    })
    .await
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("transfer: {e:#}");
            return ExitCode::from(2);
        }
    };
    println!();
    println!("pre-trained model on held-out MNIST (its own distribution): {:.2} %", r.source_accuracy * 100.0);
    let full = &r.rows[0];
    let mut ok = true;
    for row in &r.rows {
        let share = row.bytes_per_update / full.bytes_per_update;
        let gap = (full.after - row.after) * 100.0;
        println!(
            "{:<5}: {:.1} % of full's bytes; {:+.2} points vs the pre-trained model; {:.2} points below full",
            row.mode,
            share * 100.0,
            (row.after - row.before) * 100.0,
            gap
        );
        if row.mode != "full" && share > 0.05 {
            println!("FAIL: {} moves more than 5 % of full's bytes", row.mode);
            ok = false;
        }
        if row.after <= row.before {
            println!("FAIL: {} does not beat the pre-trained model", row.mode);
            ok = false;
        }
        let allowed = match row.mode {
            "head" => 3.0,
            "lora" => 1.5,
            _ => f64::INFINITY,
        };
        if gap > allowed {
            println!("FAIL: {} ends {gap:.2} points below full (allowed: {allowed})", row.mode);
            ok = false;
        }
    }
    if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE }
}
