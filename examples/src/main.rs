//! `fedfleet`: the umbrella CLI. `fedfleet demo` runs a whole fleet on loopback; `fedfleet
//! init-local DIR` writes a ready local deployment to run by hand.
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use fedfleet::demo::{self, DemoOptions};
use fedfleet::scenarios::{PRETRAIN_EPOCHS, mnist_pretrained};
use fedfleet_cli::{InitLocalArgs, init_local_main};

#[derive(Parser)]
#[command(name = "fedfleet", version, about = "fedfleet umbrella CLI")]
enum Cli {
    /// A throwaway PKI, a registry, an aggregator and N agents on loopback: federated training
    /// of the digits model, then a canary 10 % -> 100 % rollout of the result.
    Demo(DemoArgs),
    /// Write a ready local deployment into DIR (the same as `fedfleet-init-local DIR`).
    InitLocal(InitLocalArgs),
}

#[derive(Clone, Copy, ValueEnum)]
enum Strategy {
    Fedavg,
    Fedprox,
    Fedadam,
    Fedyogi,
    Fedadagrad,
    /// FedAvg with every update clipped to `--clip-norm`.
    #[value(alias = "clipped_fedavg")]
    Clipped,
    /// Coordinate-wise median.
    Median,
    /// Coordinate-wise trimmed mean (`--trim-fraction` dropped at each end).
    #[value(name = "trimmed_mean", alias = "trimmed-mean")]
    TrimmedMean,
    /// Multi-Krum tolerating `--byzantine` hostile updates.
    Krum,
    /// DP-FedAvg: updates clipped to `--clip-norm` (default 1), Gaussian noise (multiplier 1) on
    /// the sum; `campaign status` and the demo's end show the ε spent (δ = 1e-5).
    #[value(name = "dp_fedavg", alias = "dp-fedavg")]
    DpFedavg,
}

#[derive(Clone, Copy, ValueEnum)]
enum Quantization {
    F32,
    F16,
    Bf16,
    Int8,
}

#[derive(clap::Args)]
struct DemoArgs {
    /// Number of agents.
    #[arg(long, default_value_t = 20)]
    agents: usize,
    /// Training rounds.
    #[arg(long, default_value_t = DemoOptions::default().rounds)]
    rounds: u32,
    /// Aggregation strategy.
    #[arg(long, value_enum, default_value = "fedavg")]
    strategy: Strategy,
    /// Encoding of the weight updates agents send.
    #[arg(long, value_enum, default_value = "f32")]
    quantization: Quantization,
    /// Seed of the initial model, the data partition and round sampling.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Dirichlet concentration of the per-agent label skew.
    #[arg(long, default_value_t = 0.5)]
    alpha: f64,
    /// Local learning rate (SGD on the agents).
    #[arg(long, visible_alias = "lr", default_value_t = DemoOptions::default().learning_rate)]
    learning_rate: f32,
    /// Local epochs per round.
    #[arg(long, default_value_t = DemoOptions::default().local_epochs)]
    local_epochs: u32,
    /// Server learning rate for fedadam/fedyogi/fedadagrad.
    #[arg(long)]
    server_lr: Option<f64>,
    /// clipped: L2 bound of each update (aggregator default 10).
    #[arg(long)]
    clip_norm: Option<f64>,
    /// trimmed_mean: fraction of values dropped at each end (aggregator default 0.1).
    #[arg(long)]
    trim_fraction: Option<f64>,
    /// krum: hostile updates to tolerate (aggregator default 1).
    #[arg(long)]
    byzantine: Option<usize>,
    /// Do not start the aggregator's embedded MQTT broker (agents use QUIC polling only).
    #[arg(long)]
    no_mqtt: bool,
    /// Work directory (must be empty or absent); default: a temporary directory.
    #[arg(long)]
    workdir: Option<PathBuf>,
    /// Keep the work directory (PKI, stores, agents' state) afterwards.
    #[arg(long)]
    keep: bool,
    /// After the demo, keep the fleet and its dashboards up (addresses printed) until Ctrl-C.
    #[arg(long)]
    stay_up: bool,
    /// Fail unless the final held-out accuracy reaches this.
    #[arg(long, default_value_t = 0.92)]
    min_accuracy: f64,
    /// Soak time of each rollout phase, in seconds.
    #[arg(long, default_value_t = 2.0)]
    soak_secs: f64,
    /// Plain lines instead of progress bars (the default when stderr is not a terminal).
    #[arg(long)]
    no_progress: bool,
    /// Start from a model pre-trained centrally on another distribution (MNIST, reduced the
    /// way the digits were) instead of from scratch: the fleet fine-tunes it on its own digits.
    #[arg(long)]
    pretrained: bool,
}

fn main() -> ExitCode {
    match Cli::parse() {
        Cli::Demo(a) => demo_main(a),
        Cli::InitLocal(a) => init_local_main("fedfleet init-local", a),
    }
}

fn demo_main(a: DemoArgs) -> ExitCode {
    // rumqttd logs every client disconnect at shutdown as an error (rumqttc closes TLS without
    // close_notify); the demo checks the control plane itself.
    fedfleet_net::logging::init("error,rumqttd=off");
    let d = DemoOptions::default();
    let model = if a.pretrained {
        match mnist_pretrained(a.seed, PRETRAIN_EPOCHS) {
            Ok((setup, mnist_accuracy)) => {
                eprintln!("pre-trained on MNIST ({PRETRAIN_EPOCHS} epochs): {:.2} % on held-out MNIST", mnist_accuracy * 100.0);
                Some(setup)
            }
            Err(e) => {
                eprintln!("fedfleet demo: pre-training: {e:#}");
                return ExitCode::from(2);
            }
        }
    } else {
        None
    };
    let o = DemoOptions {
        model,
        agents: a.agents,
        rounds: a.rounds,
        strategy: match a.strategy {
            Strategy::Fedavg => "fedavg",
            Strategy::Fedprox => "fedprox",
            Strategy::Fedadam => "fedadam",
            Strategy::Fedyogi => "fedyogi",
            Strategy::Fedadagrad => "fedadagrad",
            Strategy::Clipped => "clipped",
            Strategy::Median => "median",
            Strategy::TrimmedMean => "trimmed_mean",
            Strategy::Krum => "krum",
            Strategy::DpFedavg => "dp_fedavg",
        }
        .into(),
        quantization: match a.quantization {
            Quantization::F32 => "f32",
            Quantization::F16 => "f16",
            Quantization::Bf16 => "bf16",
            Quantization::Int8 => "int8",
        }
        .into(),
        seed: a.seed,
        alpha: a.alpha,
        learning_rate: a.learning_rate,
        local_epochs: a.local_epochs,
        server_lr: a.server_lr,
        clip_norm: a.clip_norm,
        trim_fraction: a.trim_fraction,
        byzantine: a.byzantine,
        mqtt: !a.no_mqtt,
        workdir: a.workdir,
        keep: a.keep,
        stay_up: a.stay_up,
        min_accuracy: a.min_accuracy,
        soak: Duration::from_secs_f64(a.soak_secs.max(0.0)),
        progress: d.progress && !a.no_progress,
        ..d
    };
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("fedfleet: tokio runtime: {e}");
            return ExitCode::from(2);
        }
    };
    match rt.block_on(demo::run(&o)) {
        Ok(r) if r.ok() => ExitCode::SUCCESS,
        Ok(_) => ExitCode::from(1),
        Err(e) => {
            eprintln!("fedfleet demo: {e:#}");
            ExitCode::from(2)
        }
    }
}
