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
//! Steps 1–5 are [`Loopback::start`], which the scenario examples (`examples/`) reuse. With
//! `mqtt` (the default) step 3 also starts the aggregator's embedded MQTT broker ([`start_mqtt`]);
//! the agents hear round announcements there and publish signed status heartbeats.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use fedfleet_testkit::sim::FleetOptions;
use fedfleet_aggregator::client::AggregatorClient;
use fedfleet_aggregator::config::{CampaignDefaults, Config as AggConfig, ModelConfig, MqttConfig};
use fedfleet_aggregator::mqtt::Mqtt;
use fedfleet_aggregator::publish::{Publisher, RegistryPublisher};
use fedfleet_aggregator::service::Aggregator;
use fedfleet_aggregator::wire::{CampaignOverrides, CampaignStatus, Request as AggRequest};
use fedfleet_certs::{Pki, ServerIdentity};
use fedfleet_learning::{Dataset, ModelSpec, OptimizerConfig, Partition, TrainConfig, evaluate, model::init_bundle, sim as lsim};
use fedfleet_protocol::{BundleLimits, DeviceId, FleetId, ModelRef, ModelVersion, TensorBundle};
use fedfleet_registry::client::RegistryClient;
use fedfleet_registry::metadata::{self, Lifetimes, MetadataSigner};
use fedfleet_registry::ops::Registry;
use fedfleet_registry::rollout::Phase;
use fedfleet_registry::server::{self as reg_server, ServerOptions};
use fedfleet_registry::store::{Store, StoreConfig};
use fedfleet_registry::wire::{AdminRequest, RolloutStart};
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use tokio::sync::oneshot;

use crate::attack::Attack;
use crate::fleet::{Fleet, FleetExtras, MqttLink};

pub const MODEL_NAME: &str = "digits";
const SERVER_NAME: &str = "localhost";

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
    pub lr: f32,
    /// FedProx μ (fedprox only).
    pub mu: f32,
    /// Server learning rate of FedAdam/FedYogi/FedAdagrad (their default when `None`).
    pub server_lr: Option<f64>,
    /// Where everything goes; a temporary directory when `None`.
    pub workdir: Option<PathBuf>,
    /// Keep the work directory.
    pub keep: bool,
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
            lr: 0.3,
            mu: 0.01,
            server_lr: None,
            workdir: None,
            keep: false,
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
    pub campaign_outcome: Option<String>,
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

// ----- 1. PKI -----

/// A throwaway fleet PKI: CA, `registry`, `aggregator` and `operator` service identities, and one
/// device identity per agent, valid for `days`.
pub fn make_pki(dir: &Path, fleet: &FleetId, devices: &[DeviceId], days: u32) -> anyhow::Result<Pki> {
    let pki = Pki::init(dir, fleet, days, false).context("creating the fleet CA")?;
    let sans = vec![SERVER_NAME.to_owned(), "127.0.0.1".to_owned()];
    for name in ["registry", "aggregator", "operator"] {
        pki.issue_server(name, &sans, days, false).with_context(|| format!("issuing the {name} identity"))?;
    }
    for d in devices {
        pki.enroll_device(d, days, false).with_context(|| format!("enrolling {d}"))?;
    }
    Ok(pki)
}

/// A running service: its address, a stop switch and its task.
pub struct Running {
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let _ = tokio::time::timeout(Duration::from_secs(30), self.task).await;
    }
}

// ----- 2. registry -----

/// Keys, root, store and the QUIC service. Operators: `operator` and `aggregator` (which
/// publishes global models).
pub async fn start_registry(dir: &Path, pki: &Pki) -> anyhow::Result<(Arc<Registry>, Running)> {
    std::fs::create_dir_all(dir)?;
    metadata::init_keys(dir, 30, false).context("registry signing keys")?;
    let lifetimes = Lifetimes { targets_ms: 7 * 24 * 3600 * 1000, timestamp_ms: 3600 * 1000 };
    let signer = MetadataSigner::load(dir, lifetimes)?;
    let store = Store::open(dir.join("store"), StoreConfig::default())?;
    let reg = Arc::new(Registry::new(store, pki.fleet().clone(), Some(signer), Default::default())?);
    let identity = ServerIdentity::load(pki.dir(), "registry")?;
    let revocation = Arc::new(fedfleet_certs::RevocationWatcher::open(pki.dir())?);
    let tls = fedfleet_certs::tls::server_config(pki.ca(), &identity, revocation, &[fedfleet_certs::ALPN_V1])?;
    let endpoint = fedfleet_net::server_endpoint(([127, 0, 0, 1], 0).into(), tls)?;
    let addr = endpoint.local_addr()?;
    let mut opts = ServerOptions::new(dir.join("incoming"));
    opts.operators = vec!["operator".into(), "aggregator".into()];
    let (tx, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(reg_server::run(endpoint, reg.clone(), opts, async move {
        let _ = rx.await;
    }));
    Ok((reg, Running { addr, stop: Some(tx), task }))
}

// ----- 3. aggregator -----

/// The aggregator's campaign settings from the demo options.
pub fn campaign_defaults(o: &DemoOptions, target: u32) -> anyhow::Result<CampaignDefaults> {
    let strategy = match o.strategy.as_str() {
        "clipped" | "clipped_fedavg" => "clipped_fedavg",
        s @ ("fedavg" | "fedprox" | "fedadam" | "fedyogi" | "fedadagrad" | "median" | "trimmed_mean" | "krum") => s,
        s => bail!("unknown strategy {s:?}: fedavg, fedprox, fedadam, fedyogi, fedadagrad, clipped, median, trimmed_mean, krum"),
    };
    let quantization = match o.quantization.as_str() {
        "f32" | "f16" | "bf16" => o.quantization.clone(),
        "int8" | "i8" => "i8".into(),
        q => bail!("unknown quantization {q:?}: f32, f16, bf16, int8"),
    };
    let d = CampaignDefaults::default();
    Ok(CampaignDefaults {
        rounds: o.rounds,
        strategy: strategy.into(),
        target,
        quorum: target.div_ceil(2).max(1),
        deadline_secs: 120,
        extension_secs: 60,
        sampling_rate: 1.0,
        local_epochs: o.local_epochs,
        batch_size: o.batch_size,
        lr: o.lr,
        mu: if strategy == "fedprox" { o.mu } else { 0.0 },
        quantization,
        server_lr: o.server_lr,
        max_updates: 4096,
        clip_norm: o.clip_norm.unwrap_or(d.clip_norm),
        trim_fraction: o.trim_fraction.unwrap_or(d.trim_fraction),
        byzantine: o.byzantine.unwrap_or(d.byzantine),
        ..d
    })
}

/// Writes the initial model (version 1), opens the service (sled state under `dir`) and serves it.
pub async fn start_aggregator(
    dir: &Path,
    pki: &Pki,
    spec: &ModelSpec,
    bundle: &TensorBundle,
    campaign: CampaignDefaults,
    publisher: Box<dyn Publisher>,
) -> anyhow::Result<(Aggregator, Running)> {
    std::fs::create_dir_all(dir)?;
    let initial = dir.join("initial.safetensors");
    std::fs::write(&initial, bundle.encode())?;
    let cfg = AggConfig {
        listen: ([127, 0, 0, 1], 0).into(),
        pki_dir: pki.dir().to_owned(),
        server_identity: "aggregator".into(),
        data_dir: dir.join("data"),
        metrics_addr: None,
        metrics_public: false,
        operators: vec!["operator".into()],
        publish_dir: None,
        publish: None,
        model: ModelConfig {
            name: MODEL_NAME.into(),
            spec: spec.clone(),
            initial,
            validation: Some("digits".into()),
        },
        campaign,
        compute: Default::default(),
    };
    let agg = Aggregator::open(cfg.clone(), publisher).context("opening the aggregator")?;
    let endpoint = agg.bind(cfg.listen)?;
    let addr = endpoint.local_addr()?;
    let (tx, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(agg.clone().run(endpoint, async move {
        let _ = rx.await;
    }));
    Ok((agg, Running { addr, stop: Some(tx), task }))
}

/// The aggregator's embedded MQTT broker (loopback, a free port, the fleet CA and the
/// aggregator's certificate) and its control client: every round it opens is announced, signed,
/// on the fleet's rounds topic; device status updates its presence table.
pub async fn start_mqtt(agg: &Aggregator, heartbeat: Duration) -> anyhow::Result<Mqtt> {
    let mut cfg = MqttConfig::embedded(([127, 0, 0, 1], 0).into());
    // A device is online while its last heartbeat is this recent.
    cfg.presence_ttl_secs = (heartbeat.as_secs() * 5).max(10);
    fedfleet_aggregator::mqtt::start(agg, &cfg)
        .await
        .map_err(|e| anyhow::anyhow!("MQTT control plane: {e}"))?
        .context("the MQTT control plane did not start")
}

fn operator_tls(pki: &Pki) -> anyhow::Result<rustls::ClientConfig> {
    let id = ServerIdentity::load(pki.dir(), "operator")?;
    Ok(fedfleet_certs::tls::service_client_config(pki.ca(), &id, &[fedfleet_certs::ALPN_V1])?)
}

// ----- 4. campaign start -----

/// Starts the campaign as the operator (QUIC); the aggregator publishes its initial model (v1)
/// first. Returns the status.
pub async fn start_campaign(pki: &Pki, agg_addr: SocketAddr, rounds: u32, seed: u64) -> anyhow::Result<CampaignStatus> {
    let client = AggregatorClient::connect(agg_addr, SERVER_NAME, operator_tls(pki)?)
        .await
        .map_err(|e| anyhow::anyhow!("operator connection to the aggregator: {e}"))?;
    let o = CampaignOverrides { rounds: Some(rounds), seed: Some(seed), ..Default::default() };
    client
        .campaign(AggRequest::CampaignStart(o))
        .await
        .map_err(|e| anyhow::anyhow!("campaign start: {e}"))
}

/// An operator connection to the registry.
pub async fn registry_operator(pki: &Pki, addr: SocketAddr) -> anyhow::Result<RegistryClient> {
    RegistryClient::connect(addr, SERVER_NAME, operator_tls(pki)?)
        .await
        .map_err(|e| anyhow::anyhow!("operator connection to the registry: {e}"))
}

// ----- 6. campaign -----

fn version_of(st: &CampaignStatus) -> Option<ModelVersion> {
    st.global.map(|(v, _)| v)
}

/// Drives the fleet round by round (agents in lockstep with the observer, so every counter read
/// between two steps belongs to one round) until the campaign ends.
#[allow(clippy::too_many_arguments)]
pub async fn run_campaign(
    ui: &Ui,
    agg: &Aggregator,
    fleet: &mut Fleet,
    spec: &ModelSpec,
    test: &Dataset,
    rounds: u32,
    report: &mut DemoReport,
) -> anyhow::Result<()> {
    let metrics = agg.metrics();
    let bar = ui.bar(rounds as u64, "rounds");
    let agents_bar = ui.bar(fleet.len() as u64, "agents");
    let mqtt = fleet.has_mqtt();
    let heard_header = if mqtt { " | heard via MQTT" } else { "" };
    ui.line(format!("{:>5} | {:>12} | {:>8} | {:>10} | {:>10}{heard_header}", "round", "participants", "accuracy", "bytes up", "round time"));
    ui.line(format!("{:-<5}-+-{:-<12}-+-{:-<8}-+-{:-<10}-+-{:-<10}{}", "", "", "", "", "", if mqtt { "-+----------------" } else { "" }));
    let round_timeout = Duration::from_secs(300);
    for r in 1..=rounds {
        let st = agg.status();
        if st.campaign.is_none() {
            report.failures.push(format!("the campaign ended after {} of {rounds} rounds ({:?})", r - 1, st.last_outcome));
            break;
        }
        let open = st.open_round;
        let v_before = version_of(&st);
        let (acc0, bytes0) = (metrics.accepted.get(), metrics.update_bytes.get());
        let t0 = Instant::now();
        if let Some(round) = open {
            // Announced over MQTT as the round opened: give the push a moment to arrive.
            fleet.wait_announced(round, Duration::from_secs(2)).await;
        }
        let mut outcome: Option<Option<ModelVersion>> = None; // Some(Some(v)) published; Some(None) failed
        while outcome.is_none() {
            if t0.elapsed() > round_timeout {
                bail!("round {r} did not finish in {} s", round_timeout.as_secs());
            }
            agents_bar.set_position(0);
            agents_bar.set_message(format!("round {r}"));
            match open {
                Some(round) => fleet.step_round(round, |_| agents_bar.inc(1)).await?,
                None => fleet.step(|_| agents_bar.inc(1)).await?,
            }
            // Wait for the round to close and its model to be published, or for it to stay open.
            let wait = Instant::now();
            loop {
                let st = agg.status();
                if version_of(&st) != v_before {
                    outcome = Some(version_of(&st));
                    break;
                }
                if st.open_round.is_some() && st.open_round != open {
                    outcome = Some(None); // a new round opened without a new model: this one failed
                    break;
                }
                if st.campaign.is_none() {
                    outcome = Some(None);
                    break;
                }
                if st.open_round == open && wait.elapsed() > Duration::from_millis(300) {
                    break; // still open: step again (stragglers, retries)
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        let version = outcome.flatten();
        let accuracy = match version {
            Some(_) => {
                let (_, bytes) = agg.global_model().context("the new global model is not readable")?;
                let bundle = TensorBundle::decode(&bytes, &BundleLimits::default())?;
                Some(evaluate(spec, &bundle, test)?.accuracy)
            }
            None => None,
        };
        let row = RoundRow {
            round: r,
            participants: metrics.accepted.get() - acc0,
            accuracy,
            bytes_up: metrics.update_bytes.get() - bytes0,
            round_time: t0.elapsed(),
            version,
            heard_over_mqtt: open.map(|r| fleet.heard_over_mqtt(r)).unwrap_or(0),
        };
        ui.line(format!(
            "{:>5} | {:>12} | {:>8} | {:>10} | {:>9.2}s{}",
            row.round,
            format!("{}/{}", row.participants, fleet.len()),
            row.accuracy.map(|a| format!("{:.2} %", a * 100.0)).unwrap_or_else(|| "failed".into()),
            human_bytes(row.bytes_up),
            row.round_time.as_secs_f64(),
            if mqtt { format!(" | {:>15}", format!("{}/{}", row.heard_over_mqtt, fleet.len())) } else { String::new() }
        ));
        if version.is_none() {
            report.failures.push(format!("round {r} failed"));
        }
        report.rounds.push(row);
        bar.inc(1);
        if let Some(a) = accuracy {
            bar.set_message(format!("accuracy {:.2} %", a * 100.0));
        }
    }
    agents_bar.finish_and_clear();
    bar.finish_and_clear();
    // The campaign finishes once its last round's model is in.
    let t = Instant::now();
    while agg.status().campaign.is_some() && t.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    report.campaign_outcome = agg.status().last_outcome;
    Ok(())
}

// ----- 7. baseline -----

/// The same model from the same initial weights, trained centrally on the whole training split
/// (SGD, momentum 0.9), evaluated on the same held-out split.
pub fn centralized_baseline(spec: &ModelSpec, train: &Dataset, test: &Dataset, epochs: usize, seed: u64) -> anyhow::Result<f64> {
    let init = init_bundle(spec, seed)?;
    let cfg = TrainConfig {
        epochs,
        batch_size: 16,
        lr: 0.05,
        optimizer: OptimizerConfig::Sgd { momentum: 0.9 },
        ..Default::default()
    };
    let out = fedfleet_learning::train_local(spec, &init, train, &cfg, seed)?;
    let model = lsim::apply_delta(&init, &out.delta, 1.0)?;
    Ok(evaluate(spec, &model, test)?.accuracy)
}

// ----- 8. rollout -----

/// A phased rollout: percent of the fleet per phase, soak per phase, and the auto-abort rule.
#[derive(Debug, Clone)]
pub struct RolloutPlan {
    pub percents: Vec<f64>,
    pub soak: Duration,
    /// Abort once more than this fraction of the reporting devices failed their health check.
    pub failure_threshold: f64,
    /// Reports needed before the failure rate counts.
    pub min_sample: u32,
}

impl RolloutPlan {
    /// The demo's: canary 10 % then 100 %, abort above a 20 % failure rate (3 reports at least).
    pub fn canary(soak: Duration) -> Self {
        RolloutPlan { percents: vec![10.0, 100.0], soak, failure_threshold: 0.2, min_sample: 3 }
    }
}

/// How a rollout ended.
#[derive(Debug, Clone)]
pub struct RolloutOutcome {
    /// The registry's final status: completed, aborted, ... (or timeout).
    pub status: String,
    pub phases: Vec<PhaseOutcome>,
    /// Agents serving the target at the end.
    pub agents_on_target: usize,
    /// The registry's counts when the rollout ended: devices reporting the target healthy, and
    /// devices whose install or health check of it failed.
    pub healthy: u64,
    pub failed: u64,
    /// The fleet's device states when the registry ended the rollout ([`Fleet::states_summary`]).
    pub states_at_end: String,
}

/// Rolls `target` out to the `stable` alias phase by phase, each phase soaking and waiting until
/// every device of its audience reports the new version healthy; the registry aborts by itself
/// when too many devices fail their health check. Prints each phase and the fleet's device
/// states at each phase change.
pub async fn rollout(ui: &Ui, op: &RegistryClient, fleet: &mut Fleet, target: &ModelRef, plan: &RolloutPlan) -> anyhow::Result<RolloutOutcome> {
    let id = format!("{}-stable-v{}", target.name, target.version.0);
    let percents = &plan.percents;
    let soak = plan.soak;
    let mut audiences: Vec<Vec<DeviceId>> = percents
        .iter()
        .map(|p| fleet.ids.iter().filter(|&d| fedfleet_registry::rollout::in_percent(&id, d, *p)).cloned().collect())
        .collect();
    let mut canary_cohort = false;
    if audiences[0].is_empty() {
        // No device falls in the first percentage at this fleet size: the canary is the one
        // device with the lowest bucket, as a named cohort.
        if let Some(d) = fleet.ids.iter().min_by_key(|d| fedfleet_registry::rollout::bucket(&id, d)) {
            audiences[0] = vec![d.clone()];
            canary_cohort = true;
        }
    }
    let phases: Vec<Phase> = percents
        .iter()
        .zip(&audiences)
        .enumerate()
        .map(|(i, (p, a))| {
            let mut ph = if i == 0 && canary_cohort {
                Phase::cohort("canary", a.iter().cloned(), soak.as_millis() as u64)
            } else {
                Phase::percent(*p, soak.as_millis() as u64)
            };
            ph.min_healthy = a.len() as u32;
            ph
        })
        .collect();
    let canaries: Vec<&str> = audiences[0].iter().map(|d| d.as_str()).collect();
    let later: Vec<String> = percents[1..].iter().zip(&audiences[1..]).map(|(p, a)| format!("{p} % ({} agents)", a.len())).collect();
    ui.line(format!(
        "rollout {id}: {} v{} -> stable, phases {} % ({} canar{}: {}{}){}{}, soak {:.1} s each",
        target.name,
        target.version.0,
        percents[0],
        canaries.len(),
        if canaries.len() == 1 { "y" } else { "ies" },
        if canaries.is_empty() { "none".into() } else { canaries.join(", ") },
        if canary_cohort { ", as a cohort: no device falls in the first phase at this fleet size" } else { "" },
        if later.is_empty() { "" } else { " -> " },
        later.join(" -> "),
        soak.as_secs_f64()
    ));
    ui.line(format!("  devices at start: {}", fleet.states_summary()));
    op.admin(AdminRequest::RolloutStart(RolloutStart {
        id: Some(id.clone()),
        model: target.name.clone(),
        alias: "stable".into(),
        target: target.version,
        phases,
        failure_threshold: plan.failure_threshold,
        min_sample: plan.min_sample,
    }))
    .await
    .map_err(|e| anyhow::anyhow!("rollout start: {e}"))?;
    let spinner = ui.spinner("rollout");
    let t0 = Instant::now();
    let mut phase = 0usize;
    let mut outcome =
        RolloutOutcome { status: String::new(), phases: Vec::new(), agents_on_target: 0, healthy: 0, failed: 0, states_at_end: String::new() };
    let status = loop {
        if t0.elapsed() > Duration::from_secs(300) {
            break "timeout".to_owned();
        }
        // Status first, then a step: the device states printed at a phase change are those the
        // registry judged, before the agents act on the next phase.
        let s = op
            .admin(AdminRequest::RolloutStatus { id: Some(id.clone()) })
            .await
            .map_err(|e| anyhow::anyhow!("rollout status: {e}"))?;
        let now_phase = s["phase"].as_u64().unwrap_or(0) as usize;
        let status = s["status"].as_str().unwrap_or("?").to_owned();
        let (healthy, failed) = (s["healthy"].as_u64().unwrap_or(0), s["failed"].as_u64().unwrap_or(0));
        spinner.set_message(format!(
            "phase {}/{} {} ({} healthy, {} failed, {} in progress)",
            now_phase + 1,
            percents.len(),
            status,
            healthy,
            failed,
            s["in_progress"].as_u64().unwrap_or(0)
        ));
        let finished = status != "running" && status != "paused";
        while phase < now_phase || (finished && phase < percents.len() && status == "completed") {
            let o = PhaseOutcome {
                phase,
                percent: percents[phase],
                audience: audiences[phase].len(),
                healthy: healthy.min(audiences[phase].len() as u64),
                failed,
                took: t0.elapsed(),
            };
            ui.line(format!(
                "  phase {}/{} ({:>3} %): {:>2} agents in audience, {:>2} healthy, {} failed; {} at {:.1} s",
                o.phase + 1,
                percents.len(),
                o.percent,
                o.audience,
                o.healthy,
                o.failed,
                if o.phase + 1 < percents.len() { "advanced" } else { "completed" },
                o.took.as_secs_f64()
            ));
            ui.line(format!("    devices: {}", fleet.states_summary()));
            outcome.phases.push(o);
            phase += 1;
        }
        if finished {
            outcome.states_at_end = fleet.states_summary();
            (outcome.healthy, outcome.failed) = (healthy, failed);
            if status != "completed" {
                ui.line(format!("  phase {}/{}: rollout {status} ({healthy} healthy, {failed} failed)", phase + 1, percents.len()));
                ui.line(format!("    devices: {}", outcome.states_at_end));
            }
            break status;
        }
        fleet.step(|_| {}).await?;
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    spinner.finish_and_clear();
    // Let every agent pick up its final assignment and report.
    for _ in 0..3 {
        fleet.step(|_| {}).await?;
    }
    ui.line(format!("  devices at end: {}", fleet.states_summary()));
    outcome.status = status;
    outcome.agents_on_target = fleet.active_on(target);
    Ok(outcome)
}

/// The demo's rollout of the final model; anything short of every agent on it is a failure.
async fn run_rollout(ui: &Ui, op: &RegistryClient, fleet: &mut Fleet, target: &ModelRef, soak: Duration, report: &mut DemoReport) -> anyhow::Result<()> {
    let o = rollout(ui, op, fleet, target, &RolloutPlan::canary(soak)).await?;
    report.phases = o.phases;
    report.agents_on_final = o.agents_on_target;
    report.rollout_status = Some(o.status.clone());
    if o.status == "timeout" {
        report.failures.push("the rollout did not finish in 300 s".into());
    } else if o.status != "completed" {
        report.failures.push(format!("rollout ended {}", o.status));
    }
    if report.agents_on_final != fleet.len() {
        report.failures.push(format!("{} of {} agents run v{}", report.agents_on_final, fleet.len(), target.version.0));
    }
    Ok(())
}

fn human_bytes(b: u64) -> String {
    if b >= 1 << 20 {
        format!("{:.2} MiB", b as f64 / (1u64 << 20) as f64)
    } else if b >= 1 << 10 {
        format!("{:.1} KiB", b as f64 / 1024.0)
    } else {
        format!("{b} B")
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

/// A fleet running on loopback: PKI, registry, aggregator (with its embedded MQTT broker), the
/// campaign started with the initial model published as v1 and `stable`, and the agents.
pub struct Loopback {
    pub pki: Pki,
    pub registry: Arc<Registry>,
    pub aggregator: Aggregator,
    pub aggregator_addr: SocketAddr,
    pub registry_addr: SocketAddr,
    /// The registry as the operator (QUIC).
    pub op: RegistryClient,
    pub mqtt: Option<Mqtt>,
    pub spec: ModelSpec,
    pub train: Dataset,
    pub test: Dataset,
    pub initial: ModelRef,
    pub fleet: Fleet,
    reg_run: Running,
    agg_run: Running,
}

impl Loopback {
    /// Steps 1 to 5 of the demo (one line each on `ui`); fills the report's setup figures.
    pub async fn start(o: &DemoOptions, ui: &Ui, work: &Path, report: &mut DemoReport) -> anyhow::Result<Loopback> {
        if o.agents == 0 {
            bail!("--agents must be at least 1");
        }
        // Alphanumeric: the embedded broker (rumqttd) refuses other fleet ids in certificates.
        let fleet_id = FleetId::new("demo").expect("valid fleet id");
        let devices: Vec<DeviceId> = (0..o.agents).map(|i| DeviceId::new(format!("agent-{i:03}")).expect("valid id")).collect();

        // 1. PKI
        let t = Instant::now();
        let pki = make_pki(&work.join("pki"), &fleet_id, &devices, 30)?;
        ui.line(format!(
            "[1/8] PKI: fleet CA (ed25519), identities for registry, aggregator, operator and {} devices ({:.1} s)",
            devices.len(),
            t.elapsed().as_secs_f64()
        ));

        // 2. registry
        let (registry, reg_run) = start_registry(&work.join("registry"), &pki).await?;
        let root = registry.signer().expect("keys loaded").root().clone();
        ui.line(format!("[2/8] registry: QUIC (mTLS) on {}, TUF root pinned by every device", reg_run.addr));

        // Data and round target (agents with training data; a share can be empty under label skew).
        let spec = o.model.as_ref().map_or_else(ModelSpec::digits_mlp, |m| m.spec.clone());
        let (train, test) = Dataset::digits_split()?;
        let partition = Partition::Dirichlet { alpha: o.alpha };
        let sizes = crate::fleet::shares(&partition, o.agents, o.seed)?;
        let trainers = sizes.iter().filter(|n| **n > 0).count() as u32;

        // 3. aggregator, publishing into the registry, with its MQTT control plane
        let campaign = campaign_defaults(o, trainers.max(1))?;
        let publisher: Box<dyn Publisher> = Box::new(
            RegistryPublisher::connect_lazy(pki.dir(), "aggregator", reg_run.addr, SERVER_NAME)
                .map_err(|e| anyhow::anyhow!("{e}"))?,
        );
        let initial = match &o.model {
            Some(m) => m.initial.clone(),
            None => init_bundle(&spec, o.seed)?,
        };
        let started = start_aggregator(&work.join("aggregator"), &pki, &spec, &initial, campaign, publisher).await;
        let (aggregator, agg_run) = match started {
            Ok(x) => x,
            Err(e) => {
                reg_run.stop().await;
                return Err(e);
            }
        };
        ui.line(format!(
            "[3/8] aggregator: QUIC (mTLS) on {}, sled state; publishes every global model to the registry over QUIC with its service certificate",
            agg_run.addr
        ));
        let mut lb = LoopbackParts { pki, registry, aggregator, reg_run, agg_run, mqtt: None };
        let rest = async {
            if o.mqtt {
                let m = start_mqtt(&lb.aggregator, o.heartbeat).await?;
                let addr = m.broker_addr().context("the embedded broker has no address")?;
                report.mqtt_broker = Some(addr);
                ui.line(format!(
                    "      MQTT control plane: embedded broker (TLS, client certificates of the fleet CA) on {addr}; rounds announced there, signed by the aggregator; devices publish signed status"
                ));
                lb.mqtt = Some(m);
            }

            // 4. campaign start (publishes v1) and the stable alias
            let st = start_campaign(&lb.pki, lb.agg_run.addr, o.rounds, o.seed).await?;
            let (v1, d1) = st.global.context("the aggregator has no initial model")?;
            let initial = ModelRef { name: MODEL_NAME.into(), version: v1, digest: d1 };
            let op = registry_operator(&lb.pki, lb.reg_run.addr).await?;
            op.admin(AdminRequest::AliasSet { name: MODEL_NAME.into(), alias: "stable".into(), version: v1 })
                .await
                .map_err(|e| anyhow::anyhow!("alias set: {e}"))?;
            let initial_bytes = std::fs::read(work.join("aggregator").join("initial.safetensors"))?;
            report.initial_accuracy = evaluate(&spec, &TensorBundle::decode(&initial_bytes, &BundleLimits::default())?, &test)?.accuracy;
            ui.line(format!(
                "[4/8] campaign {} started ({}, target {} updates per round); initial model published as {} v{}, alias stable -> v{}, accuracy {:.2} %",
                st.campaign.unwrap_or(0),
                st.strategy.clone().unwrap_or_default(),
                st.target,
                MODEL_NAME,
                v1.0,
                v1.0,
                report.initial_accuracy * 100.0
            ));
            report.initial = Some(initial.clone());

            // 5. the fleet: agents install stable (v1) through the registry, then join rounds.
            let mut fo = FleetOptions::new(
                lb.pki.dir(),
                fleet_id.clone(),
                devices.clone(),
                lb.agg_run.addr,
                lb.reg_run.addr,
                lb.aggregator.receipt_key(),
                root.clone(),
                MODEL_NAME,
                work.join("agents"),
            );
            fo.partition = partition.clone();
            fo.partition_seed = o.seed;
            let mqtt = report.mqtt_broker.map(|broker| MqttLink { broker, aggregator_key: lb.aggregator.receipt_key(), heartbeat: o.heartbeat });
            let fleet = Fleet::start_with(fo, FleetExtras { mqtt, attacks: o.attacks.clone() })?;
            let hostile = o.attacks.iter().filter(|a| a.is_some()).count();
            ui.line(format!(
                "[5/8] {} agents started (own certificate and key, sled store, QUIC clients{}, Dirichlet({}) share of the digits training split, 20 % kept as local holdout); training examples min {} / median {} / max {}{}",
                fleet.len(),
                if report.mqtt_broker.is_some() { ", MQTT client with signed heartbeats" } else { "" },
                o.alpha,
                sizes.iter().min().unwrap_or(&0),
                median(&sizes),
                sizes.iter().max().unwrap_or(&0),
                if hostile > 0 { format!("; {hostile} of them hostile") } else { String::new() }
            ));
            anyhow::Ok((op, initial, fleet))
        }
        .await;
        match rest {
            Ok((op, initial, fleet)) => Ok(Loopback {
                aggregator_addr: lb.agg_run.addr,
                registry_addr: lb.reg_run.addr,
                pki: lb.pki,
                registry: lb.registry,
                aggregator: lb.aggregator,
                op,
                mqtt: lb.mqtt,
                spec,
                train,
                test,
                initial,
                fleet,
                reg_run: lb.reg_run,
                agg_run: lb.agg_run,
            }),
            Err(e) => {
                lb.stop().await;
                Err(e)
            }
        }
    }

    /// Runs the campaign's rounds (step 6), a table row each.
    pub async fn train(&mut self, ui: &Ui, rounds: u32, report: &mut DemoReport) -> anyhow::Result<ModelRef> {
        run_campaign(ui, &self.aggregator, &mut self.fleet, &self.spec, &self.test, rounds, report).await?;
        let st = self.aggregator.status();
        let (vf, df) = st.global.context("no global model after the campaign")?;
        report.final_accuracy = report.rounds.iter().rev().find_map(|r| r.accuracy).unwrap_or(report.initial_accuracy);
        let final_model = ModelRef { name: MODEL_NAME.into(), version: vf, digest: df };
        report.final_model = Some(final_model.clone());
        Ok(final_model)
    }

    /// The current global model's weights.
    pub fn global_model(&self) -> anyhow::Result<TensorBundle> {
        let (_, bytes) = self.aggregator.global_model().context("the global model is not readable")?;
        Ok(TensorBundle::decode(&bytes, &BundleLimits::default())?)
    }

    /// What the aggregator saw over MQTT: devices online and known through their verified status.
    pub fn mqtt_devices(&self) -> (usize, usize) {
        self.aggregator.metrics().devices(fedfleet_aggregator::service::now_ms())
    }

    /// Stops the agents' MQTT clients, the broker, the aggregator and the registry.
    pub async fn stop(self) {
        self.op.close().await;
        self.fleet.shutdown().await;
        LoopbackParts { pki: self.pki, registry: self.registry, aggregator: self.aggregator, reg_run: self.reg_run, agg_run: self.agg_run, mqtt: self.mqtt }
            .stop()
            .await;
    }
}

/// The services of a [`Loopback`] while it starts.
struct LoopbackParts {
    pki: Pki,
    registry: Arc<Registry>,
    aggregator: Aggregator,
    reg_run: Running,
    agg_run: Running,
    mqtt: Option<Mqtt>,
}

impl LoopbackParts {
    async fn stop(self) {
        if let Some(m) = self.mqtt {
            m.shutdown().await;
        }
        self.agg_run.stop().await;
        self.reg_run.stop().await;
    }
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
    ui.line(format!("  versions             {} (initial) -> {} (final); {} versions published", v(&r.initial), v(&r.final_model), r.rounds.iter().filter(|x| x.version.is_some()).count() + 1));
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
