//! `fedfleet demo`: a whole fleet on loopback, from an empty directory.
//!
//! The orchestration, one function per step:
//! 1. [`make_pki`]: a throwaway fleet CA, service identities (registry, aggregator, operator)
//!    and one device identity per agent.
//! 2. [`start_registry`]: TUF keys + root, the sled store, the QUIC service (mTLS).
//! 3. [`start_aggregator`]: a seeded initial model, the service with its sled state, publishing
//!    every global model into the registry, the QUIC service (mTLS).
//! 4. [`start_campaign`] (operator certificate over QUIC): publishes the initial model as v1;
//!    the `stable` alias is pointed at it (every device ships with it as its factory model).
//! 5. [`partition`] + [`Fleet::start`]: N real agents, each with a Dirichlet(α) share of the
//!    vendored digits training split, its own store, key and QUIC clients.
//! 6. [`run_campaign`]: rounds until the campaign ends; a table row per round.
//! 7. [`centralized_baseline`]: the same model trained on all the training data at once.
//! 8. [`run_rollout`]: the final model rolled out canary 10 % → 100 % through the registry's
//!    operator API; agents download, verify, health-check on their holdout, activate, report.
//! 9. A summary; [`DemoReport::failures`] is empty only if everything worked.
//!
//! Here: options, the report and the run; `steps` (1–7), `rollout` (8), `harness` ([`Loopback`]).
//! Steps 1–5 are [`Loopback::start`], which the scenario examples (`examples/`) reuse. With
//! `mqtt` (the default) step 3 also starts the aggregator's embedded MQTT broker ([`start_mqtt`]);
//! the agents hear round announcements there and publish signed status heartbeats.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use fedfleet_aggregator::client::AggregatorClient;
use fedfleet_aggregator::config::{CampaignDefaults, CampaignStrategy, Config as AggConfig, ModelConfig, MqttConfig};
use fedfleet_aggregator::mqtt::Mqtt;
use fedfleet_aggregator::publish::{Publisher, RegistryPublisher};
use fedfleet_aggregator::service::Aggregator;
use fedfleet_aggregator::wire::{CampaignOverrides, CampaignStatus, Request as AggRequest};
use fedfleet_certs::Pki;
use fedfleet_learning::{Dataset, ModelSpec, OptimizerConfig, Partition, TrainConfig, evaluate, model::init_bundle, sim as lsim};
use fedfleet_protocol::{BundleLimits, DeviceId, FleetId, ModelRef, ModelVersion, TensorBundle};
use fedfleet_registry::client::RegistryClient;
use fedfleet_registry::ops::Registry;
use fedfleet_registry::rollout::Phase;
use fedfleet_registry::wire::{AdminRequest, RolloutStart};
use fedfleet_testkit::services::{self, RegistrySetup, RunningAggregator, RunningRegistry};
use fedfleet_testkit::sim::FleetOptions;
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::attack::Attack;
use crate::fleet::{Fleet, FleetExtras, MqttLink};

mod harness;
mod rollout;
mod steps;

pub use harness::*;
pub use rollout::*;
pub use steps::*;

pub const MODEL_NAME: &str = "digits";
use services::SERVER_NAME;

/// Everything `fedfleet demo` can be told.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    pub agents: usize,
    pub rounds: u32,
    /// fedavg fedprox fedadam fedyogi fedadagrad clipped (and the robust ones: median
    /// trimmed_mean krum).
    pub strategy: String,
    /// f32 f16 bf16 int8
    pub quantization: String,
    pub seed: u64,
    /// Dirichlet concentration of the label skew.
    pub alpha: f64,
    pub local_epochs: u32,
    pub batch_size: u32,
    /// Local learning rate (plain SGD on the agents).
    pub learning_rate: f32,
    /// The agents' local optimizer: "sgd" or "adam".
    pub optimizer: String,
    /// FedProx proximal weight μ (fedprox only).
    pub proximal_mu: f32,
    /// Server learning rate of FedAdam/FedYogi/FedAdagrad (their default when `None`).
    pub server_lr: Option<f64>,
    /// Where everything goes; a temporary directory when `None`.
    pub workdir: Option<PathBuf>,
    /// Keep the work directory.
    pub keep: bool,
    /// After the demo, keep the fleet and its dashboards up until Ctrl-C.
    pub stay_up: bool,
    pub min_accuracy: f64,
    /// Soak time of each rollout phase.
    pub soak: Duration,
    /// Progress bars (on a terminal) or plain lines.
    pub progress: bool,
    /// Epochs of the centralized baseline.
    pub baseline_epochs: usize,
    /// Start the aggregator's embedded MQTT broker and connect the agents to it.
    pub mqtt: bool,
    /// How often each agent publishes its signed status over MQTT (presence).
    pub heartbeat: Duration,
    /// clipped_fedavg: the L2 bound of each update (the aggregator's default when `None`).
    pub clip_norm: Option<f64>,
    /// trimmed_mean: the fraction dropped at each end (the aggregator's default when `None`).
    pub trim_fraction: Option<f64>,
    /// krum: how many hostile updates to tolerate (the aggregator's default when `None`).
    pub byzantine: Option<usize>,
    /// `attacks[i]`: agent `i` is hostile (see [`crate::attack`]); empty: every agent is honest.
    pub attacks: Vec<Option<Attack>>,
    /// The model the campaign starts from: a team's own spec and (pre-trained) weights. `None`:
    /// the digits MLP from a seeded initialisation.
    pub model: Option<ModelSetup>,
}

/// A team's own model for the loopback fleet: its spec (any layer graph, fine-tuning mode
/// included) and the weights of version 1.
#[derive(Debug, Clone)]
pub struct ModelSetup {
    pub spec: ModelSpec,
    pub initial: TensorBundle,
}

impl Default for DemoOptions {
    fn default() -> Self {
        DemoOptions {
            agents: 20,
            rounds: 30,
            strategy: "fedavg".into(),
            quantization: "f32".into(),
            seed: 42,
            alpha: 0.5,
            local_epochs: 2,
            batch_size: 16,
            learning_rate: 0.3,
            optimizer: "sgd".into(),
            proximal_mu: 0.01,
            server_lr: None,
            workdir: None,
            keep: false,
            stay_up: false,
            min_accuracy: 0.92,
            soak: Duration::from_secs(2),
            progress: std::io::stderr().is_terminal(),
            baseline_epochs: 30,
            mqtt: true,
            heartbeat: Duration::from_secs(1),
            clip_norm: None,
            trim_fraction: None,
            byzantine: None,
            attacks: Vec::new(),
            model: None,
        }
    }
}

/// One row of the round table.
#[derive(Debug, Clone)]
pub struct RoundRow {
    pub round: u32,
    pub participants: u64,
    /// Held-out (digits test split) accuracy of the new global model; `None` if the round failed.
    pub accuracy: Option<f64>,
    pub bytes_up: u64,
    pub round_time: Duration,
    pub version: Option<ModelVersion>,
    /// Agents that heard this round announced over MQTT (0 without MQTT).
    pub heard_over_mqtt: usize,
}

/// How one rollout phase went.
#[derive(Debug, Clone)]
pub struct PhaseOutcome {
    pub phase: usize,
    pub percent: f64,
    pub audience: usize,
    pub healthy: u64,
    pub failed: u64,
    /// Time from the rollout start until the phase was seen to end.
    pub took: Duration,
}

/// What the demo did.
#[derive(Debug, Clone, Default)]
pub struct DemoReport {
    pub rounds: Vec<RoundRow>,
    /// The operator consoles: (aggregator, registry).
    pub consoles: Option<(SocketAddr, SocketAddr)>,
    pub campaign_outcome: Option<String>,
    /// A DP-FedAvg campaign's spend.
    pub privacy: Option<fedfleet_aggregator::wire::PrivacyReport>,
    pub initial: Option<ModelRef>,
    pub final_model: Option<ModelRef>,
    pub initial_accuracy: f64,
    pub final_accuracy: f64,
    pub baseline_accuracy: f64,
    pub rollout_status: Option<String>,
    pub phases: Vec<PhaseOutcome>,
    pub agents_on_final: usize,
    pub agents: usize,
    /// The embedded MQTT broker's address, when started.
    pub mqtt_broker: Option<SocketAddr>,
    /// Devices the aggregator saw through MQTT presence (verified signed status): (online, known).
    pub mqtt_devices: (usize, usize),
    /// Uploads that took the MQTT upload path.
    pub mqtt_uploads: u32,
    pub wall: Duration,
    pub workdir: Option<PathBuf>,
    /// Empty iff the demo succeeded.
    pub failures: Vec<String>,
}

impl DemoReport {
    pub fn ok(&self) -> bool {
        self.failures.is_empty()
    }
}

/// Output: indicatif bars on a terminal, plain lines otherwise. Tables and lines go to stdout.
pub struct Ui {
    mp: Option<MultiProgress>,
    quiet: bool,
}

impl Ui {
    pub fn new(progress: bool) -> Self {
        Ui { mp: progress.then(|| MultiProgress::with_draw_target(ProgressDrawTarget::stderr())), quiet: false }
    }

    /// No lines and no bars (the examples print their own tables).
    pub fn quiet() -> Self {
        Ui { mp: None, quiet: true }
    }

    pub fn line(&self, s: impl AsRef<str>) {
        if self.quiet {
            return;
        }
        match &self.mp {
            Some(mp) => mp.suspend(|| println!("{}", s.as_ref())),
            None => println!("{}", s.as_ref()),
        }
    }

    /// A bar of `len` steps (hidden without a terminal).
    pub fn bar(&self, len: u64, prefix: &str) -> ProgressBar {
        match &self.mp {
            Some(mp) => {
                let pb = mp.add(ProgressBar::new(len));
                pb.set_style(
                    ProgressStyle::with_template("{prefix:>12.cyan.bold} [{bar:30.green/dim}] {pos}/{len} {msg}")
                        .expect("valid template")
                        .progress_chars("=> "),
                );
                pb.set_prefix(prefix.to_owned());
                pb
            }
            None => ProgressBar::hidden(),
        }
    }

    pub fn spinner(&self, prefix: &str) -> ProgressBar {
        match &self.mp {
            Some(mp) => {
                let pb = mp.add(ProgressBar::new_spinner());
                pb.set_style(ProgressStyle::with_template("{prefix:>12.cyan.bold} {spinner} {msg}").expect("valid template"));
                pb.set_prefix(prefix.to_owned());
                pb.enable_steady_tick(Duration::from_millis(120));
                pb
            }
            None => ProgressBar::hidden(),
        }
    }
}

// ----- the whole demo -----

/// Runs the demo. `Err` only for setup failures; everything the demo checks ends up in
/// [`DemoReport::failures`].
pub async fn run(o: &DemoOptions) -> anyhow::Result<DemoReport> {
    let started = Instant::now();
    let ui = Ui::new(o.progress);
    if o.agents == 0 {
        bail!("--agents must be at least 1");
    }
    if o.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    let mut tmp = None;
    let work = match &o.workdir {
        Some(d) => {
            std::fs::create_dir_all(d)?;
            if std::fs::read_dir(d)?.next().is_some() {
                bail!("work directory {} is not empty", d.display());
            }
            d.clone()
        }
        None => {
            let t = tempfile::Builder::new().prefix("fedfleet-demo-").tempdir()?;
            let p = t.path().to_owned();
            tmp = Some(t);
            p
        }
    };
    let mut report = DemoReport { agents: o.agents, ..Default::default() };
    let result = run_in(o, &ui, &work, &mut report).await;
    report.wall = started.elapsed();
    if o.keep {
        if let Some(t) = tmp.take() {
            let _ = t.keep();
        }
        report.workdir = Some(work.clone());
    } else if o.workdir.is_some() {
        let _ = std::fs::remove_dir_all(&work);
    }
    drop(tmp);
    result?;
    print_summary(&ui, o, &report);
    Ok(report)
}

async fn run_in(o: &DemoOptions, ui: &Ui, work: &Path, report: &mut DemoReport) -> anyhow::Result<()> {
    ui.line(format!(
        "fedfleet demo: {} agents, {} rounds, strategy {}, quantization {}, Dirichlet({}) label skew, seed {}",
        o.agents, o.rounds, o.strategy, o.quantization, o.alpha, o.seed
    ));
    ui.line(format!("work directory: {}", work.display()));
    let mut lb = Loopback::start(o, ui, work, report).await?;
    let outcome = async {
        // 6. training
        ui.line(format!("[6/8] training: {} rounds", o.rounds));
        let final_model = lb.train(ui, o.rounds, report).await?;
        let completed = report.rounds.iter().filter(|r| r.version.is_some()).count();
        if completed != o.rounds as usize {
            report.failures.push(format!("{completed} of {} rounds completed", o.rounds));
        }

        // 7. baseline
        let t = Instant::now();
        let sp = ui.spinner("baseline");
        sp.set_message("centralized training on all training data");
        let (spec2, train2, test2, epochs, seed) = (lb.spec.clone(), lb.train.clone(), lb.test.clone(), o.baseline_epochs, o.seed);
        report.baseline_accuracy =
            tokio::task::spawn_blocking(move || centralized_baseline(&spec2, &train2, &test2, epochs, seed)).await??;
        sp.finish_and_clear();
        ui.line(format!(
            "[7/8] centralized baseline ({} epochs on all {} training examples): {:.2} % ({:.1} s)",
            o.baseline_epochs,
            lb.train.len(),
            report.baseline_accuracy * 100.0,
            t.elapsed().as_secs_f64()
        ));

        // 8. rollout
        ui.line(format!("[8/8] rollout of {} v{}", MODEL_NAME, final_model.version.0));
        run_rollout(ui, &lb.op, &mut lb.fleet, &final_model, o.soak, report).await?;
        if report.final_accuracy < o.min_accuracy {
            report.failures.push(format!(
                "final accuracy {:.2} % is below the required {:.2} %",
                report.final_accuracy * 100.0,
                o.min_accuracy * 100.0
            ));
        }
        if o.mqtt {
            check_mqtt(&lb, o, report).await;
        }
        anyhow::Ok(())
    }
    .await;
    if o.stay_up && outcome.is_ok() {
        if let Some((agg, reg)) = report.consoles {
            ui.line(format!(
                "the fleet stays up: dashboards at http://{agg}/ (campaign) and http://{reg}/ (fleet, versions, rollouts); Ctrl-C stops it"
            ));
        }
        fedfleet_net::Shutdown::on_signal().wait().await;
    }
    lb.stop().await;
    outcome
}

/// The control plane worked if every device was seen through MQTT presence and the rounds were
/// heard announced over MQTT.
async fn check_mqtt(lb: &Loopback, o: &DemoOptions, report: &mut DemoReport) {
    // Heartbeats arrive every `o.heartbeat`; give them a few periods.
    let t = Instant::now();
    let wait = (o.heartbeat * 5).max(Duration::from_secs(10));
    while lb.mqtt_devices().1 < o.agents && t.elapsed() < wait {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    report.mqtt_devices = lb.mqtt_devices();
    report.mqtt_uploads = lb.fleet.mqtt_uploads();
    if report.mqtt_devices.1 < o.agents {
        report.failures.push(format!("only {} of {} devices were seen over MQTT", report.mqtt_devices.1, o.agents));
    }
    if report.rounds.iter().all(|r| r.heard_over_mqtt == 0) {
        report.failures.push("no round announcement arrived over MQTT".into());
    }
}

fn median(v: &[usize]) -> usize {
    let mut s = v.to_vec();
    s.sort_unstable();
    s.get(s.len() / 2).copied().unwrap_or(0)
}

fn print_summary(ui: &Ui, o: &DemoOptions, r: &DemoReport) {
    let bytes: u64 = r.rounds.iter().map(|x| x.bytes_up).sum();
    let v = |m: &Option<ModelRef>| m.as_ref().map(|m| format!("v{}", m.version.0)).unwrap_or_else(|| "-".into());
    ui.line("");
    ui.line("summary");
    ui.line(format!(
        "  federated accuracy   {:.2} % after {} rounds ({} agents, {}, {}); required {:.2} %",
        r.final_accuracy * 100.0,
        r.rounds.len(),
        r.agents,
        o.strategy,
        o.quantization,
        o.min_accuracy * 100.0
    ));
    ui.line(format!("  centralized baseline {:.2} % (same model, same initial weights, same held-out split)", r.baseline_accuracy * 100.0));
    ui.line(format!("  initial model        {:.2} %", r.initial_accuracy * 100.0));
    ui.line(format!(
        "  versions             {} (initial) -> {} (final); {} versions published",
        v(&r.initial),
        v(&r.final_model),
        r.rounds.iter().filter(|x| x.version.is_some()).count() + 1
    ));
    ui.line(format!("  bytes uploaded       {}", human_bytes(bytes)));
    if let Some(m) = &r.final_model {
        ui.line(format!("  final model digest   {}", m.digest.to_hex()));
    }
    ui.line(format!(
        "  rollout              {}; {}/{} agents active on {}",
        r.rollout_status.as_deref().unwrap_or("not run"),
        r.agents_on_final,
        r.agents,
        v(&r.final_model)
    ));
    ui.line(format!("  campaign             {}", r.campaign_outcome.as_deref().unwrap_or("-")));
    if let Some(p) = &r.privacy {
        ui.line(format!(
            "  privacy              DP-FedAvg, noise multiplier {}, sampling rate {}: (ε = {:.2}, δ = {:e}) spent",
            p.noise_multiplier, p.sampling_rate, p.epsilon_spent, p.delta
        ));
    }
    match r.mqtt_broker {
        Some(addr) => {
            let heard: usize = r.rounds.iter().map(|x| x.heard_over_mqtt).sum();
            let possible = r.rounds.len() * r.agents;
            ui.line(format!(
                "  MQTT control plane   broker {addr}; {}/{} devices seen through signed MQTT status ({} online now); round announcements heard over MQTT {heard}/{possible} (agent x round); {} uploads over the MQTT fallback path",
                r.mqtt_devices.1, r.agents, r.mqtt_devices.0, r.mqtt_uploads
            ));
        }
        None => ui.line("  MQTT control plane   off"),
    }
    ui.line(format!("  wall time            {:.1} s", r.wall.as_secs_f64()));
    if let Some(w) = &r.workdir {
        ui.line(format!("  kept                 {}", w.display()));
    }
    if r.ok() {
        ui.line("  result               OK");
    } else {
        for f in &r.failures {
            ui.line(format!("  FAILED               {f}"));
        }
    }
}
