//! What client-level differential privacy costs in accuracy: DP-FedAvg (the `dp_fedavg`
//! strategy, `rounds::DpMean`) at ε ∈ {1, 4, 8} (δ = 1e-5) beside the same campaign without
//! noise, on the vendored MNIST test images (8×8, as the digits) spread over a fleet of devices.
//!
//! ```text
//! cargo run --release -p fedfleet --example bench_dp -- [--devices 1000] [--rounds 200] [--sampling-rate 0.1]
//! ```
//!
//! Each round samples every device with probability `q` (Poisson, as the accountant assumes);
//! each sampled device trains its share locally from the global model; its delta is clipped to
//! `--clip`, the clipped deltas are summed exactly, Gaussian noise of σ = z·clip is added and the
//! sum divided by the expected count q·N — the aggregator's own `DpMean`, seeded. z for each ε is
//! the smallest noise whose ε after `--rounds` rounds (the aggregator's RDP accountant,
//! `rounds::privacy::DpSpend`) is within it. The non-private rows fold the same sampled updates
//! with a plain weighted mean, and with clipping but no noise. Accuracy is on 2,000 held-out
//! images after the last round (and the best of the rounds).

use clap::Parser;
use fedfleet::scenarios::mnist_as_digits;
use fedfleet_aggregator::privacy::DpSpend;
use fedfleet_aggregator::service::{flatten, unflatten};
use fedfleet_aggregator::{Aggregation, DpMean, WeightedMean};
use fedfleet_learning::model::init_bundle;
use fedfleet_learning::rng::{rng, uniform};
use fedfleet_learning::{Dataset, ModelSpec, OptimizerConfig, Partition, TrainConfig, evaluate, train_local};

#[derive(Parser, Debug)]
#[command(name = "bench_dp")]
struct Args {
    /// Devices; the 8,000 training images are split evenly among them.
    #[arg(long, default_value_t = 1000)]
    devices: usize,
    #[arg(long, default_value_t = 200)]
    rounds: u64,
    /// q: the probability a device takes part in a round.
    #[arg(long, default_value_t = 0.1)]
    sampling_rate: f64,
    /// Clipping norm of a device's delta.
    #[arg(long, default_value_t = 1.0)]
    clip: f64,
    /// The ε values to run (δ = 1e-5).
    #[arg(long, value_delimiter = ',', default_value = "1,4,8")]
    epsilons: Vec<f64>,
    #[arg(long, default_value_t = 1.0)]
    server_lr: f64,
    #[arg(long, default_value_t = 0.1)]
    lr: f64,
    #[arg(long, default_value_t = 1)]
    epochs: usize,
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

const DELTA: f64 = 1e-5;
const SAMPLING_STREAM: u64 = 201;

/// The smallest noise multiplier whose ε after `rounds` rounds is within `epsilon` (bisection on
/// the monotone accountant).
fn calibrate(epsilon: f64, q: f64, rounds: u64) -> f64 {
    let eps = |z: f64| DpSpend { sampling_rate: q, noise_multiplier: z, delta: DELTA }.epsilon_after(rounds);
    let (mut lo, mut hi) = (0.05, 100.0);
    for _ in 0..60 {
        let mid = (lo + hi) / 2.0;
        if eps(mid) <= epsilon { hi = mid } else { lo = mid }
    }
    hi
}

/// One campaign; returns (final accuracy, best accuracy).
fn campaign(args: &Args, shares: &[Dataset], test: &Dataset, mut agg: Box<dyn Aggregation>) -> anyhow::Result<(f64, f64)> {
    let spec = ModelSpec::digits_mlp();
    let init = init_bundle(&spec, args.seed)?;
    let layout = init.layout();
    let mut global: Vec<f32> = flatten(&init, spec.num_params());
    let train = TrainConfig {
        local_epochs: args.epochs,
        batch_size: 16,
        learning_rate: args.lr,
        optimizer: OptimizerConfig::Sgd { momentum: 0.0 },
        proximal_mu: 0.0,
        max_steps: None,
    };
    // The same devices are sampled in every campaign (one stream per seed).
    let mut sampler = rng(args.seed, SAMPLING_STREAM);
    let (mut last, mut best) = (0.0, 0.0);
    for round in 0..args.rounds {
        let model = unflatten(&layout, &global);
        for (d, data) in shares.iter().enumerate() {
            if uniform(&mut sampler, 0.0, 1.0) >= args.sampling_rate {
                continue;
            }
            let out = train_local(&spec, &model, data, &train, args.seed ^ (round << 24) ^ d as u64)?;
            agg.fold(&flatten(&out.delta, global.len()), data.len() as u64)?;
        }
        if agg.folded() == 0 {
            continue;
        }
        let step = agg.aggregate()?;
        for (g, s) in global.iter_mut().zip(&step) {
            *g += (args.server_lr * s) as f32;
        }
        if round % 10 == 9 || round + 1 == args.rounds {
            last = evaluate(&spec, &unflatten(&layout, &global), test)?.accuracy;
            best = f64::max(best, last);
        }
    }
    Ok((last, best))
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let (train, test) = mnist_as_digits()?.split(0.2, args.seed);
    let shares = Partition::Iid.split_dataset(&train, args.devices, args.seed);
    let dim = ModelSpec::digits_mlp().num_params();
    let expected = ((args.sampling_rate * args.devices as f64).round() as u64).max(1);
    println!(
        "DP-FedAvg on MNIST (8x8), {} devices of {} images, q = {}, {} rounds, clip {}, delta = {DELTA}",
        args.devices,
        train.len() / args.devices,
        args.sampling_rate,
        args.rounds,
        args.clip
    );
    println!("| privacy | noise multiplier z | ε spent (accountant) | accuracy after the last round | best (every 10 rounds) |");
    println!("|---|---|---|---|---|");
    let (last, best) = campaign(&args, &shares, &test, Box::new(WeightedMean::new(dim)))?;
    println!("| none (FedAvg) | – | ∞ | {:.2} % | {:.2} % |", last * 100.0, best * 100.0);
    let clipped = DpMean::new(dim, args.clip, 0.0, expected, [1; 32])?;
    let (last, best) = campaign(&args, &shares, &test, Box::new(clipped))?;
    println!("| clipped, no noise | 0 | ∞ | {:.2} % | {:.2} % |", last * 100.0, best * 100.0);
    for &epsilon in &args.epsilons {
        let z = calibrate(epsilon, args.sampling_rate, args.rounds);
        let spent = DpSpend { sampling_rate: args.sampling_rate, noise_multiplier: z, delta: DELTA }.epsilon_after(args.rounds);
        let dp = DpMean::new(dim, args.clip, z, expected, [args.seed as u8; 32])?;
        let (last, best) = campaign(&args, &shares, &test, Box::new(dp))?;
        println!("| ε = {epsilon} | {z:.3} | {spent:.3} | {:.2} % | {:.2} % |", last * 100.0, best * 100.0);
    }
    println!(
        "command: cargo run --release -p fedfleet --example bench_dp -- --devices {} --rounds {} --sampling-rate {} --clip {}",
        args.devices, args.rounds, args.sampling_rate, args.clip
    );
    Ok(())
}
