//! FedBuff against synchronous rounds on the same task and the same fleet, with long-tailed
//! device speeds: accuracy against (simulated) wall time for each, and the time each takes to a
//! target accuracy.
//!
//! ```text
//! cargo run --release -p fedfleet --example bench_async -- [--devices 100] [--buffer 10] \
//!     [--sigma 1.0] [--median-secs 10] [--target 0.85] [--max-staleness 32] [--deadline-secs 60] [--seed 42]
//! ```
//!
//! What runs for real: the aggregator's round engine and coordinator (admission, staleness
//! discount, the exact FedAvg fold, finalize), each device's local training on its own
//! Dirichlet(α) share of the digits training split, and the evaluation of every version on the
//! test split. What is simulated: time. Each device draws a speed once (log-normal: its median
//! training time is `median-secs × e^(σZ)`, so σ = 1 puts one device in six past 2.7× the
//! median) and each task a ±25 % jitter; a discrete-event loop advances a virtual clock to the
//! next finished task. Uploads and downloads take no time, so the comparison is between the two
//! admission rules, not the network.
//!
//! Devices behave alike in every mode, as `fedfleet-agent` does: an idle device joins the open
//! round if the round's selection includes it, trains on that round's model, uploads, and is idle
//! again; a device still training when a new round opens finishes first (it is busy). The modes:
//! - `sync (1.3K)`: rounds invite a sample of 1.3·K devices (`sampling_rate` = K/N,
//!   `over_selection` = 1.3) and close at K updates; late updates are refused (`stale_round`).
//! - `sync (all)`: rounds invite every device and close at the first K updates.
//! - `async`: FedBuff buffers of K over every device; an update up to `max-staleness` versions
//!   behind is folded into the open buffer, discounted 1/√(1+s).
//!
//! Output: a `RESULT` line per published version (mode, version, simulated seconds, accuracy),
//! then a table with each mode's time to the target and device trainings started (the device
//! cost, refused work included), and the ratios.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Parser;
use fedfleet_aggregator::service::{flatten, unflatten};
use fedfleet_aggregator::{
    BufferPolicy, CampaignId, CampaignSpec, ClientConfig, Coordinator, EngineConfig, EngineEvent, Invitation, Nonce, OpenedRound,
    RoundEngine, RoundPolicy, ServerStrategy, StrategyConfig, UpdateMeta,
};
use fedfleet_learning::model::init_bundle;
use fedfleet_learning::rng::{SeededRng, normal, rng, uniform};
use fedfleet_learning::{Dataset, ModelSpec, OptimizerConfig, Partition, TrainConfig, evaluate, train_local};
use fedfleet_protocol::{DeviceId, Digest, FleetId, ModelVersion, RoundId, TensorBundle};

/// FedBuff against synchronous rounds, long-tailed device speeds, simulated time.
#[derive(Parser, Debug, Clone)]
#[command(name = "bench_async")]
struct Args {
    /// Devices in the fleet (each holds a Dirichlet share of the digits training split).
    #[arg(long, default_value_t = 100)]
    devices: usize,
    /// Updates per round (sync) and per buffer (async): K.
    #[arg(long, default_value_t = 10)]
    buffer: u32,
    /// Spread of device speeds: the log-normal σ of a device's median training time.
    #[arg(long, default_value_t = 1.0)]
    sigma: f64,
    /// The fleet's median training time per task, in simulated seconds.
    #[arg(long, default_value_t = 10.0)]
    median_secs: f64,
    /// Test accuracy each mode runs to.
    #[arg(long, default_value_t = 0.85)]
    target: f64,
    /// async: versions an update may lag behind and still be folded (the service's default;
    /// the typical lag is the devices training at once divided by --buffer).
    #[arg(long, default_value_t = 32)]
    max_staleness: u32,
    /// Versions after which a mode stops even below the target.
    #[arg(long, default_value_t = 400)]
    max_versions: u32,
    /// A round or buffer closes at this deadline (simulated seconds) with what it has.
    #[arg(long, default_value_t = 60.0)]
    deadline_secs: f64,
    /// Dirichlet α of the label split (small = strong skew).
    #[arg(long, default_value_t = 0.5)]
    alpha: f64,
    #[arg(long, default_value_t = 1)]
    epochs: usize,
    #[arg(long, default_value_t = 16)]
    batch: usize,
    #[arg(long, default_value_t = 0.05)]
    lr: f64,
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

/// Random streams of this benchmark (beside the learning crate's own).
const SPEED_STREAM: u64 = 101;
const JITTER_STREAM: u64 = 102;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    SyncSampled,
    SyncAll,
    Async,
}

impl Mode {
    fn label(self) -> &'static str {
        match self {
            Mode::SyncSampled => "sync (1.3K)",
            Mode::SyncAll => "sync (all)",
            Mode::Async => "async",
        }
    }
}

/// One device: its data, its speed, what it is training.
struct Device {
    id: DeviceId,
    data: Dataset,
    median_ms: f64,
    /// The round it trains for, with that round's base model.
    task: Option<(RoundId, Digest, Arc<TensorBundle>)>,
    last_round: Option<RoundId>,
}

/// A mode's run: one point per published version.
struct Run {
    mode: Mode,
    points: Vec<(f64, f64)>,
    trainings: u64,
    refused: BTreeMap<String, u64>,
    cpu_seconds: f64,
}

impl Run {
    fn time_to(&self, target: f64) -> Option<f64> {
        self.points.iter().find(|(_, acc)| *acc >= target).map(|(t, _)| *t)
    }

    /// The accuracy of the last version published by simulated second `t`.
    fn accuracy_at(&self, t: f64) -> f64 {
        self.points.iter().take_while(|(at, _)| *at <= t).last().map_or(0.0, |p| p.1)
    }
}

struct Sim<'a> {
    args: &'a Args,
    spec: ModelSpec,
    train: TrainConfig,
    test: &'a Dataset,
    fleet: FleetId,
    devices: Vec<Device>,
    coord: Coordinator<ServerStrategy>,
    layout: fedfleet_protocol::bundle::Layout,
    global: Vec<f32>,
    /// `global` as a bundle, made once per version: the base every task started on it trains.
    model: Arc<TensorBundle>,
    open: Option<OpenedRound>,
    /// Finished tasks, earliest first: (simulated ms, device).
    queue: BinaryHeap<Reverse<(u64, usize)>>,
    rng: SeededRng,
    run: Run,
    done: bool,
}

impl Sim<'_> {
    /// An idle device joins the open round if it is invited and has not trained for it.
    fn maybe_start(&mut self, now: u64, d: usize) {
        let Some(a) = &self.open else { return };
        let dev = &self.devices[d];
        if dev.task.is_some() || dev.data.is_empty() || dev.last_round.is_some_and(|r| r >= a.round) || !a.selection.selects(&dev.id) {
            return;
        }
        let jitter = uniform(&mut self.rng, 0.75, 1.25);
        let finish = now + (dev.median_ms * jitter).max(1.0) as u64;
        let dev = &mut self.devices[d];
        dev.task = Some((a.round, a.base_digest, self.model.clone()));
        dev.last_round = Some(a.round);
        self.run.trainings += 1;
        self.queue.push(Reverse((finish, d)));
    }

    /// Acts on the engine's events: a closed round is finalized, evaluated and published.
    fn drain(&mut self, now: u64) -> anyhow::Result<()> {
        while let Some(ev) = self.coord.poll_event() {
            match ev {
                EngineEvent::RoundOpened(a) => {
                    self.open = Some(a);
                    for d in 0..self.devices.len() {
                        self.maybe_start(now, d);
                    }
                }
                EngineEvent::RoundClosed { round, .. } => {
                    self.open = None;
                    self.global = self.coord.finalize(now, round, &self.global).context("finalize")?;
                    let version = self.run.points.len() as u64 + 2;
                    self.model = Arc::new(unflatten(&self.layout, &self.global));
                    let accuracy = evaluate(&self.spec, &self.model, self.test)?.accuracy;
                    let secs = now as f64 / 1000.0;
                    println!("RESULT mode={:?} version={version} sim_seconds={secs:.1} accuracy={accuracy:.4}", self.run.mode.label());
                    self.run.points.push((secs, accuracy));
                    if accuracy >= self.args.target || self.run.points.len() as u32 >= self.args.max_versions {
                        self.done = true;
                        return Ok(());
                    }
                    let digest = Digest::of(&self.model.encode());
                    self.coord.model_ready(now, round, ModelVersion(version), digest)?;
                }
                EngineEvent::RoundFailed { .. } => self.open = None,
                EngineEvent::CampaignFinished { .. } => self.done = true,
                EngineEvent::RoundExtended { .. } | EngineEvent::DeviceRevoked { .. } => {}
            }
        }
        Ok(())
    }

    /// A device's task finished: admission first (as the aggregator checks the header before
    /// reading a payload), then the training it did, then the fold.
    fn finish(&mut self, now: u64, d: usize) -> anyhow::Result<()> {
        let Some((round, base_digest, base)) = self.devices[d].task.take() else { return Ok(()) };
        let dev = &self.devices[d];
        let mut nonce = [0u8; 16];
        nonce[..8].copy_from_slice(&(d as u64).to_le_bytes());
        nonce[8..].copy_from_slice(&round.0.to_le_bytes());
        let meta = UpdateMeta {
            fleet: self.fleet.clone(),
            device: dev.id.clone(),
            round,
            base_digest,
            nonce: Nonce(nonce),
            num_examples: dev.data.len() as u64,
            payload_digest: Digest::of(&nonce),
        };
        match self.coord.check_update(now, &meta) {
            Ok(_) => {
                let seed = self.args.seed ^ (round.0 << 20) ^ d as u64;
                let outcome = train_local(&self.spec, &base, &dev.data, &self.train, seed)?;
                let delta = flatten(&outcome.delta, self.global.len());
                if let Err(r) = self.coord.handle_update(now, meta, &delta) {
                    *self.run.refused.entry(r.reason.to_string()).or_default() += 1;
                }
            }
            Err(r) => *self.run.refused.entry(r.reason.to_string()).or_default() += 1,
        }
        self.drain(now)
    }
}

fn run(mode: Mode, args: &Args, shares: &[Dataset], test: &Dataset, speeds: &[f64]) -> anyhow::Result<Run> {
    let spec = ModelSpec::digits_mlp();
    let init = init_bundle(&spec, args.seed)?;
    let layout = init.layout();
    let global = flatten(&init, spec.num_params());
    let fleet = FleetId::new("bench").expect("valid fleet id");
    let devices: Vec<Device> = shares
        .iter()
        .zip(speeds)
        .enumerate()
        .map(|(i, (data, &median_ms))| Device {
            id: DeviceId::new(format!("device-{i:05}")).expect("valid device id"),
            data: data.clone(),
            median_ms,
            task: None,
            last_round: None,
        })
        .collect();
    let k = args.buffer;
    let (selection, over_selection) = match mode {
        Mode::SyncSampled => (Invitation::Rate { rate: (f64::from(k) / args.devices as f64).min(1.0) }, 1.3),
        Mode::SyncAll | Mode::Async => (Invitation::Rate { rate: 1.0 }, 1.0),
    };
    let client =
        ClientConfig { local_epochs: args.epochs as u32, batch_size: args.batch as u32, learning_rate: args.lr as f32, proximal_mu: 0.0 };
    let spec_c = CampaignSpec {
        id: CampaignId(1),
        rounds: args.max_versions + 1,
        base_version: ModelVersion(1),
        base_digest: Digest::of(&init.encode()),
        client: client.clone(),
        selection,
        policy: RoundPolicy {
            target_count: k,
            min_quorum: 1,
            over_selection,
            duration_ms: (args.deadline_secs * 1000.0) as u64,
            extension_ms: 0,
            max_sample_count: 1 << 32,
        },
        seed: [args.seed as u8; 32],
        max_consecutive_failures: 1000,
        buffer: (mode == Mode::Async).then_some(BufferPolicy { max_staleness: args.max_staleness }),
        privacy: None,
    };
    let strategy = ServerStrategy::new(&StrategyConfig::FedAvg { client }, global.len())?;
    let mut coord = Coordinator::new(RoundEngine::new(fleet.clone(), EngineConfig::default(), RoundId(1)), strategy);
    coord.engine_mut().start_campaign(0, spec_c)?;
    let mut sim = Sim {
        args,
        train: TrainConfig {
            local_epochs: args.epochs,
            batch_size: args.batch,
            learning_rate: args.lr,
            optimizer: OptimizerConfig::Sgd { momentum: 0.0 },
            proximal_mu: 0.0,
            max_steps: None,
        },
        spec,
        test,
        fleet,
        devices,
        coord,
        layout,
        global,
        model: Arc::new(init),
        open: None,
        queue: BinaryHeap::new(),
        rng: rng(args.seed, JITTER_STREAM),
        run: Run { mode, points: Vec::new(), trainings: 0, refused: BTreeMap::new(), cpu_seconds: 0.0 },
        done: false,
    };
    let t0 = Instant::now();
    sim.drain(0)?;
    while !sim.done {
        let next_timeout = sim.coord.poll_timeout();
        let next_finish = sim.queue.peek().map(|Reverse((t, _))| *t);
        match (next_finish, next_timeout) {
            (Some(t), timeout) if timeout.is_none_or(|to| t < to) => {
                let Reverse((t, d)) = sim.queue.pop().expect("peeked");
                sim.finish(t, d)?;
                sim.maybe_start(t, d);
            }
            (_, Some(to)) => {
                sim.coord.handle_timeout(to);
                sim.drain(to)?;
            }
            _ => bail!("{}: nothing left to happen before the target", mode.label()),
        }
    }
    sim.run.cpu_seconds = t0.elapsed().as_secs_f64();
    Ok(sim.run)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.devices == 0 || args.buffer == 0 || args.buffer as usize > args.devices {
        bail!("need 1 <= --buffer ({}) <= --devices ({})", args.buffer, args.devices);
    }
    if !(args.sigma >= 0.0 && args.median_secs > 0.0 && args.target > 0.0 && args.target <= 1.0) {
        bail!("need --sigma >= 0, --median-secs > 0 and 0 < --target <= 1");
    }
    let (train, test) = Dataset::digits_split()?;
    let shares = Partition::Dirichlet { alpha: args.alpha }.split_dataset(&train, args.devices, args.seed);
    // Each device's median training time: log-normal around the fleet's median.
    let mut draws = rng(args.seed, SPEED_STREAM);
    let speeds: Vec<f64> = (0..args.devices).map(|_| args.median_secs * 1000.0 * (args.sigma * normal(&mut draws)).exp()).collect();
    let mut sorted = speeds.clone();
    sorted.sort_by(f64::total_cmp);
    let pct = |p: f64| sorted[((sorted.len() - 1) as f64 * p) as usize] / 1000.0;
    println!(
        "RESULT config devices={} buffer={} sigma={} median_secs={} target={} max_staleness={} alpha={} seed={} \
         device_median_secs p10={:.1} p50={:.1} p90={:.1} max={:.1}",
        args.devices,
        args.buffer,
        args.sigma,
        args.median_secs,
        args.target,
        args.max_staleness,
        args.alpha,
        args.seed,
        pct(0.1),
        pct(0.5),
        pct(0.9),
        pct(1.0)
    );
    let mut runs = Vec::new();
    for mode in [Mode::SyncSampled, Mode::SyncAll, Mode::Async] {
        runs.push(run(mode, &args, &shares, &test, &speeds)?);
    }
    println!();
    let async_to = runs[2].time_to(args.target);
    let at = async_to.map_or("-".to_owned(), |t| format!("acc at {t:.0} s"));
    println!(
        "{:<12} {:>9} {:>16} {:>10} {:>14} {:>17} {:>8}  refused",
        "mode", "versions", "sim s to target", "final acc", at, "trainings started", "cpu s"
    );
    for r in &runs {
        let to = r.time_to(args.target).map_or("not reached".to_owned(), |t| format!("{t:.0}"));
        let refused = r.refused.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" ");
        println!(
            "{:<12} {:>9} {:>16} {:>10.4} {:>14} {:>17} {:>8.1}  {}",
            r.mode.label(),
            r.points.len(),
            to,
            r.points.last().map_or(0.0, |p| p.1),
            async_to.map_or("-".to_owned(), |t| format!("{:.4}", r.accuracy_at(t))),
            r.trainings,
            r.cpu_seconds,
            if refused.is_empty() { "-".into() } else { refused }
        );
    }
    for sync in &runs[..2] {
        match (sync.time_to(args.target), async_to) {
            (Some(s), Some(a)) => println!("RESULT speedup vs={:?} ratio={:.2}", sync.mode.label(), s / a),
            _ => println!("RESULT speedup vs={:?} ratio=none (a mode did not reach {})", sync.mode.label(), args.target),
        }
    }
    Ok(())
}
