//! The daemon's lifecycle ([`AgentService`]: open → bind → run) and the CLI commands' logic
//! (`run`, `status`, `enroll`, `infer`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use fedfleet_certs::DeviceIdentity;
use fedfleet_learning::{CsvOptions, Dataset, ImageFolderOptions, LabelColumn, Partition};
use fedfleet_net::Shutdown;
use fedfleet_protocol::tuf::Verifier;
use fedfleet_protocol::tuf::{Root, SignedMetadata};
use fedfleet_protocol::{FleetId, ModelRef, ModelVersion, SharedClock};
use rand::RngCore;

use crate::agent::{Agent, Clock, LocalData, MonotonicClock, ShellConfig, SystemClock, run_agent};
use crate::clients::{Aggregator, Registry, Unlinked};
use crate::config::{AgentConfig, IdentityPaths};
use crate::inbox::{ExampleShape, Inbox};
use crate::inference;
use crate::lifecycle::{CoreConfig, DurableLifecycle, SlotModel};
use crate::mqtt::{MqttAggregator, MqttRegistry, MqttUploadOptions, StatusPublisher};
use crate::remote::{RemoteAggregator, RemoteRegistry};
use crate::store::{AgentStore, write_atomic};
use crate::trainer::{GraphTrainer, Trainer};
use fedfleet_aggregator_client::client::AggregatorClient;
use fedfleet_control::{ClientKind, ControlClient, ControlEvents, Role};
use fedfleet_registry_client::client::RegistryClient;

/// Loads the local data set and splits off the holdout (empty without a `[data]` source).
pub fn load_data(cfg: &AgentConfig) -> Result<LocalData> {
    let d = &cfg.data;
    let norm = d.normalization();
    let named = |path: &Path| format!("cannot load data set {}", path.display());
    let all = if let Some(p) = d.digits_partition {
        let (train, _) = Dataset::digits_split().context("embedded digits data")?;
        Partition::Iid.split_dataset(&train, p.clients, p.seed).swap_remove(p.index)
    } else if let Some(path) = &d.csv {
        let label = d.csv_targets.map_or(LabelColumn::Last, LabelColumn::Targets);
        let opts = CsvOptions { normalization: norm, label, ..CsvOptions::default() };
        Dataset::load_csv(path, &opts).with_context(|| named(path))?
    } else if let Some(n) = &d.npy {
        Dataset::load_npy(&n.features, n.labels.as_deref(), norm).with_context(|| named(&n.features))?
    } else if let Some(n) = &d.npz {
        Dataset::load_npz(&n.path, &n.features, n.labels.as_deref(), norm).with_context(|| named(&n.path))?
    } else if let Some(i) = &d.idx {
        Dataset::load_idx(&i.images, &i.labels).with_context(|| named(&i.images))?
    } else if let Some(i) = &d.images {
        let mut opts = ImageFolderOptions::for_input(&i.shape)?;
        opts.normalization = norm;
        Dataset::load_image_folder(&i.dir, &opts).with_context(|| named(&i.dir))?.0
    } else {
        return Ok(LocalData { train: Dataset::empty(), holdout: Dataset::empty() });
    };
    if d.holdout_fraction <= 0.0 {
        return Ok(LocalData { holdout: all.subset(&[]), train: all });
    }
    let (train, holdout) = all.split(d.holdout_fraction, 7);
    Ok(LocalData { train, holdout })
}

/// Reads the pinned registry root.
pub fn read_root(path: &Path) -> Result<SignedMetadata<Root>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read pinned registry root {} (run `fedfleet-agent enroll`)", path.display()))?;
    let root: SignedMetadata<Root> = serde_json::from_str(&text).with_context(|| format!("{} is not a signed root", path.display()))?;
    Verifier::new(root.clone()).with_context(|| format!("pinned registry root {} refused", path.display()))?;
    Ok(root)
}

/// Loads the device identity with an error that names the files (an expired certificate is
/// named as such: the fleet refuses it and it cannot renew itself).
pub fn load_identity(p: &IdentityPaths) -> Result<DeviceIdentity> {
    load_identity_at(p, crate::agent::SystemClock.now_ms())
}

/// [`load_identity`] judged at `now_ms` (the agent's clock).
pub fn load_identity_at(p: &IdentityPaths, now_ms: u64) -> Result<DeviceIdentity> {
    for (what, f) in [("certificate", &p.cert), ("private key", &p.key), ("CA certificate", &p.ca)] {
        if !f.exists() {
            bail!(
                "device {what} {} is missing: produce it with `fedfleet-certs enroll-device` and install it with `fedfleet-agent enroll`",
                f.display()
            );
        }
    }
    DeviceIdentity::from_files_at(&p.cert, &p.key, &p.ca, (now_ms / 1000) as i64)
        .with_context(|| format!("device identity ({}, {}, {}) is not valid", p.cert.display(), p.key.display(), p.ca.display()))
}

/// Builds the agent of a config with the given clients and model code.
pub fn build_agent<A: Aggregator, R: Registry>(
    cfg: &AgentConfig,
    agg: Arc<A>,
    reg: Arc<R>,
    clock: Arc<dyn Clock>,
    trainer: Arc<dyn Trainer>,
) -> Result<Agent<A, R>> {
    let ids = cfg.identity_paths();
    let identity = load_identity_at(&ids, clock.now_ms())?;
    let data = load_data(cfg)?;
    let store = AgentStore::open(cfg.store_dir())?;
    let fleet = FleetId::new(&cfg.fleet).map_err(|e| anyhow::anyhow!("fleet: {e}"))?;
    // The fleet CA names its fleet: a config naming another one would join no round, ever.
    if let Some(ca_fleet) = identity.ca().fleet()
        && *ca_fleet != fleet
    {
        bail!(
            "config fleet \"{fleet}\" differs from the fleet of this device's CA ({ca_fleet}): set `fleet = \"{ca_fleet}\"` in the config"
        );
    }
    let mut core_cfg = CoreConfig::new(identity.device_id().clone(), fleet);
    core_cfg.cohort = cfg.cohort.clone();
    core_cfg.local_samples = (data.train.len() + trainer.own_examples()) as u64;
    core_cfg.participation = cfg.participation.policy;
    core_cfg.health = cfg.health;
    core_cfg.backoff = cfg.backoff;
    core_cfg.rng_seed = rand::rngs::OsRng.next_u64();
    let fresh = store.load_state_raw()?.is_none();
    let (root, initial) = if fresh {
        let root = read_root(&ids.registry_root)?;
        let initial = match &cfg.initial_model {
            None => None,
            Some(m) => {
                let spec = std::fs::read_to_string(&m.spec).with_context(|| format!("initial model spec {}", m.spec.display()))?;
                let bytes = std::fs::read(&m.weights).with_context(|| format!("initial model weights {}", m.weights.display()))?;
                crate::ml::load_served(trainer.as_ref(), &spec, &bytes, None)
                    .map_err(|e| anyhow::anyhow!("initial model does not load: {e}"))?;
                let digest = store.put_blob(&bytes)?;
                Some(SlotModel { model: ModelRef { name: m.name.clone(), version: ModelVersion(m.version), digest }, spec })
            }
        };
        (Some(root), initial)
    } else {
        (None, None)
    };
    // Without `[data]`, pushed examples are shaped like the model the agent serves.
    let inbox = if data.train.is_empty() {
        Inbox::open_following_model(&store, cfg.inbox)?
    } else {
        Inbox::open(&store, cfg.inbox, ExampleShape::of(&data.train))?
    };
    let core = DurableLifecycle::open(core_cfg, store, root, initial, clock.now_ms())?;
    let mirrors = match &cfg.registry {
        Some(r) if !r.mirrors.is_empty() => {
            Some(Arc::new(crate::mirror::Mirrors::new(&r.mirrors, r.registry_fallback).map_err(anyhow::Error::msg)?))
        }
        _ => None,
    };
    let shell = ShellConfig {
        status_file: Some(cfg.status_path()),
        conditions_file: cfg.participation.status_file.clone(),
        mirrors,
        round_bases_from_registry: cfg.registry.as_ref().is_some_and(|r| r.round_bases),
        ..Default::default()
    };
    let mut agent = Agent::new(core, agg, reg, identity.signing_key(), data, clock, shell).with_trainer(trainer);
    agent.set_inbox(inbox, cfg.data.normalization());
    Ok(agent)
}

/// The agent daemon's lifecycle, the same for `fedfleet-agent run` and a team's own binary:
/// [`AgentService::open`] (the config, the identity, a clock passed in) →
/// [`AgentService::bind`] (the inference socket) → [`BoundAgent::run`] until a [`Shutdown`] is
/// triggered. Rounds, signing, the outbox, installs, health checks, rollbacks and the inference
/// socket are the agent's; training, scoring and predicting are the [`Trainer`]'s.
pub struct AgentService {
    cfg: AgentConfig,
    trainer: Arc<dyn Trainer>,
    clock: Arc<MonotonicClock>,
}

impl AgentService {
    /// Loads `config` and checks the device identity (a lapsed certificate refuses the start by
    /// name). The agent's time is `wall`, kept from stepping back by a monotonic clock.
    pub fn open(config: &Path, trainer: Arc<dyn Trainer>, wall: SharedClock) -> Result<AgentService> {
        let cfg = AgentConfig::load(config)?;
        let clock = Arc::new(MonotonicClock::over(wall));
        load_identity_at(&cfg.identity_paths(), clock.now_ms())?;
        if !cfg.data.is_configured() && trainer.own_examples() == 0 {
            tracing::warn!("no [data] source: this agent trains only on what the application pushes into its inbox");
        }
        Ok(AgentService { cfg, trainer, clock })
    }

    /// Binds the inference socket. Call inside a tokio runtime.
    pub fn bind(self) -> Result<BoundAgent> {
        let path = self.cfg.socket_path();
        let inference = inference::bind(&path).with_context(|| format!("inference socket {}", path.display()))?;
        Ok(BoundAgent { service: self, inference })
    }
}

/// An agent with its inference socket bound, ready to [`run`](BoundAgent::run).
pub struct BoundAgent {
    service: AgentService,
    inference: tokio::net::UnixListener,
}

impl BoundAgent {
    /// Connects its clients (lazily), renews its certificate, and runs rounds, installs and
    /// inference until `shutdown` is triggered.
    pub async fn run(self, shutdown: Shutdown) -> Result<()> {
        let BoundAgent { service: AgentService { cfg, trainer, clock }, inference } = self;
        let ids = cfg.identity_paths();
        let (agg, reg) = remote_clients(&ids, cfg.aggregator.as_ref(), cfg.registry.as_ref())?;
        let agg = agg.map(Arc::new);
        if agg.is_none() {
            tracing::warn!("no [aggregator] in the config: this agent will not train");
        }
        let reg = reg.map(Arc::new);
        if reg.is_none() {
            tracing::warn!("no [registry] in the config: this agent will not install new models");
        }
        let _renewal = match &reg {
            Some(r) => {
                let renewer = crate::renewal::Renewer::new(ids.clone(), cfg.renewal, r.clone(), agg.clone(), clock.clone());
                Some(AbortOnDrop(tokio::spawn(renewer.run())))
            }
            None => {
                let validity = load_identity_at(&ids, clock.now_ms())?.validity();
                tracing::warn!(not_after = %fedfleet_certs::renewal::rfc3339(validity.not_after), "no [registry] in the config: this device's certificate is not renewed");
                None
            }
        };
        let run = Run { cfg, trainer, clock, inference, shutdown };
        match (agg, reg) {
            (Some(a), Some(r)) => run_maybe_mqtt(run, a, r).await,
            (Some(a), None) => run_maybe_mqtt(run, a, Arc::new(Unlinked)).await,
            (None, Some(r)) => run_maybe_mqtt(run, Arc::new(Unlinked), r).await,
            (None, None) => run_maybe_mqtt(run, Arc::new(Unlinked), Arc::new(Unlinked)).await,
        }
    }
}

/// What a bound agent runs with, whatever its clients.
struct Run {
    cfg: AgentConfig,
    trainer: Arc<dyn Trainer>,
    clock: Arc<MonotonicClock>,
    inference: tokio::net::UnixListener,
    shutdown: Shutdown,
}

/// Runs the agent daemon of a config around a device team's own model code, the way
/// `fedfleet-agent run` runs the built-in engine ([`AgentService`] on the system clock until
/// SIGTERM or Ctrl-C).
///
/// ```no_run
/// # async fn f(my_trainer: std::sync::Arc<dyn fedfleet_agent::Trainer>) -> anyhow::Result<()> {
/// fedfleet_agent::daemon::AgentBuilder::new("agent.toml").trainer(my_trainer).run().await
/// # }
/// ```
pub struct AgentBuilder {
    config: PathBuf,
    trainer: Arc<dyn Trainer>,
}

impl AgentBuilder {
    /// An agent of `agent.toml` at `config` (the built-in trainer until [`Self::trainer`]).
    pub fn new(config: impl Into<PathBuf>) -> Self {
        AgentBuilder { config: config.into(), trainer: Arc::new(GraphTrainer) }
    }

    /// The model code rounds, health checks and inference run.
    pub fn trainer(mut self, trainer: Arc<dyn Trainer>) -> Self {
        self.trainer = trainer;
        self
    }

    /// Runs until SIGTERM or Ctrl-C.
    pub async fn run(self) -> Result<()> {
        AgentService::open(&self.config, self.trainer, SystemClock::shared())?.bind()?.run(Shutdown::on_signal()).await
    }
}

/// `fedfleet-agent run`.
pub async fn run(config: &Path) -> Result<()> {
    AgentBuilder::new(config).run().await
}

/// With `[mqtt]`: wraps the clients in [`MqttAggregator`]/[`MqttRegistry`] and runs status
/// heartbeats; without: runs them as they are.
async fn run_maybe_mqtt<A: Aggregator, R: Registry>(run: Run, agg: Arc<A>, reg: Arc<R>) -> Result<()> {
    let Some(m) = run.cfg.mqtt.clone() else { return run_with(run, agg, reg, None, None).await };
    let m = &m;
    let cfg = &run.cfg;
    let ids = cfg.identity_paths();
    let identity = load_identity_at(&ids, run.clock.now_ms())?;
    let key_path =
        m.receipt_key.clone().or_else(|| cfg.aggregator.as_ref().map(|a| a.receipt_key.clone())).context("[mqtt] needs receipt_key")?;
    let aggregator_key = read_receipt_key(&key_path)?;
    let (control, events) = mqtt_control(cfg, m, &identity, aggregator_key)?;
    tracing::info!(host = ?m.client.host, port = ?m.client.port, upload = ?m.upload, "MQTT control plane configured");
    let opts = MqttUploadOptions {
        path: m.upload,
        switch_after: m.switch_after,
        receipt_timeout: Duration::from_millis(m.receipt_timeout_ms),
        ..Default::default()
    };
    let publisher = StatusPublisher::new(control.clone(), identity.signing_key());
    let agg = Arc::new(MqttAggregator::new(agg, control.clone(), events, opts));
    let reg = Arc::new(MqttRegistry::new(reg, publisher.clone()));
    let hb = (m.heartbeat_interval_ms > 0).then(|| (publisher, Duration::from_millis(m.heartbeat_interval_ms)));
    let wake = agg.wake();
    let r = run_with(run, agg, reg, hb, Some(wake)).await;
    control.shutdown().await;
    r
}

/// The device's control-plane client of `[mqtt]` (connects in the background, reconnects by
/// itself).
pub fn mqtt_control(
    cfg: &AgentConfig,
    m: &crate::config::MqttSection,
    identity: &DeviceIdentity,
    aggregator_key: ed25519_dalek::VerifyingKey,
) -> Result<(ControlClient, ControlEvents)> {
    let own = FleetId::new(&cfg.fleet).map_err(|e| anyhow::anyhow!("fleet: {e}"))?;
    // The device's MQTT fleet is its own: a different `[mqtt] fleet` is refused, not followed.
    let fleet = m.client.fleet(&own).map_err(anyhow::Error::msg)?;
    let tls = fedfleet_control::device_tls(identity).context("[mqtt] TLS client config")?;
    let id = identity.device_id().clone();
    let (host, port) = m.client.address().map_err(anyhow::Error::msg)?;
    let options = m.client.options(ClientKind::Device(id.as_str()), host, port, fleet).map_err(anyhow::Error::msg)?;
    // Rollout notices are signed by the registry's timestamp key, named by the pinned root.
    let registry_key = match &cfg.registry {
        Some(_) => crate::mqtt::notice_key(&read_root(&cfg.identity_paths().registry_root)?),
        None => None,
    };
    if cfg.registry.is_some() && registry_key.is_none() {
        tracing::warn!("the pinned root names no single timestamp key: rollout notices over MQTT are ignored");
    }
    Ok(ControlClient::start(options, tls, Role::Device { id, aggregator_key, registry_key }))
}

/// The device's mTLS client config (ALPN `fedfleet/1`).
pub fn device_tls(ids: &IdentityPaths) -> Result<rustls::ClientConfig> {
    let identity = load_identity(ids)?;
    fedfleet_certs::tls::client_config(identity.ca(), &identity, &[fedfleet_certs::ALPN_V1])
        .with_context(|| format!("TLS client config from {}", ids.cert.display()))
}

/// Reads a pinned `receipt.pub` (hex ed25519 public key).
pub fn read_receipt_key(path: &Path) -> Result<ed25519_dalek::VerifyingKey> {
    fedfleet_aggregator_client::read_receipt_key(path).with_context(|| {
        format!("cannot read the aggregator's receipt key {} (copy the aggregator's data_dir/receipt.pub)", path.display())
    })
}

/// The clients of `[aggregator]` and `[registry]` (each connects lazily), on one UDP socket.
pub fn remote_clients(
    ids: &IdentityPaths,
    aggregator: Option<&crate::config::AggregatorEndpoint>,
    registry: Option<&crate::config::RegistryEndpoint>,
) -> Result<(Option<RemoteAggregator>, Option<RemoteRegistry>)> {
    let tls = device_tls(ids)?;
    let endpoint = fedfleet_net::client_endpoint(tls.clone()).context("a QUIC client socket")?;
    let agg = match aggregator {
        Some(a) => {
            let key = read_receipt_key(&a.receipt_key)?;
            let client = AggregatorClient::on_endpoint(endpoint.clone(), a.addr, &a.server_name, tls.clone())
                .with_context(|| format!("[aggregator] client for {}", a.addr))?;
            Some(RemoteAggregator::new(client, key))
        }
        None => None,
    };
    let reg = match registry {
        Some(r) => {
            let root = read_root(&ids.registry_root)?;
            let client = RegistryClient::on_endpoint(endpoint, r.addr, &r.server_name, tls)
                .with_context(|| format!("[registry] client for {}", r.addr))?;
            Some(RemoteRegistry::new(client, r.model.clone(), root))
        }
        None => None,
    };
    Ok((agg, reg))
}

async fn run_with<A: Aggregator, R: Registry>(
    run: Run,
    agg: Arc<A>,
    reg: Arc<R>,
    heartbeat: Option<(StatusPublisher, Duration)>,
    wake: Option<Arc<tokio::sync::Notify>>,
) -> Result<()> {
    let Run { cfg, trainer, clock: monotonic, inference, shutdown } = run;
    let clock: Arc<dyn Clock> = monotonic.clone();
    let mut agent = build_agent(&cfg, agg, reg, clock.clone(), trainer)?;
    // A restart on a clock stepped back still starts from the latest time this device saw.
    monotonic.raise_to(agent.core().state().latest_time);
    let _heartbeats = heartbeat.map(|(p, every)| {
        let initial = agent.core().status(clock.now_ms());
        let c = clock.clone();
        AbortOnDrop(tokio::spawn(crate::mqtt::heartbeats(p, initial, every, move || c.now_ms())))
    });
    tracing::info!(device = %agent.core().state().device, fleet = %cfg.fleet, pending = agent.core().pending_uploads().len(), "agent started");
    if agent.core().state().revoked {
        tracing::warn!("this device's certificate was revoked: it serves inference but joins no rounds; enroll it again to rejoin");
    }
    let socket = cfg.socket_path();
    let serving = agent.serving();
    let normalization = cfg.data.normalization();
    let inbox = agent.inbox();
    let server = tokio::spawn({
        let stop = shutdown.wait();
        async move { inference::serve_listener(inference, &socket, serving, normalization, inbox, stop).await }
    });
    let poll = Duration::from_millis(cfg.poll_interval_ms);
    let stop = shutdown.wait();
    match wake {
        Some(wake) => crate::mqtt::run_agent_with_wake(&mut agent, poll, wake, stop).await?,
        None => run_agent(&mut agent, poll, stop).await?,
    }
    tracing::info!("shutting down");
    server.await??;
    Ok(())
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// `fedfleet-agent status`: the last status the daemon wrote.
pub fn status(config: &Path) -> Result<String> {
    let cfg = AgentConfig::load(config)?;
    let path = cfg.status_path();
    match std::fs::read_to_string(&path) {
        Ok(s) => Ok(s),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            Ok(format!("no status yet: {} does not exist (the daemon has not reported)\n", path.display()))
        }
        Err(e) => Err(e).with_context(|| format!("cannot read {}", path.display())),
    }
}

/// `fedfleet-agent enroll`: checks and installs identity files and the pinned registry root.
pub fn enroll(cert: &Path, key: &Path, ca: &Path, root: &Path, state_dir: &Path, force: bool) -> Result<String> {
    let id = DeviceIdentity::from_files(cert, key, ca).with_context(|| {
        format!("identity files {}, {}, {} are not a valid device identity", cert.display(), key.display(), ca.display())
    })?;
    read_root(root)?;
    let dir = state_dir.join("identity");
    let dst = IdentityPaths::in_dir(&dir);
    if dst.key.exists() && !force {
        bail!("{} already holds an identity; pass --force to replace it", dir.display());
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    for (src, to) in [(cert, &dst.cert), (ca, &dst.ca), (root, &dst.registry_root), (key, &dst.key)] {
        let bytes = std::fs::read(src).with_context(|| format!("cannot read {}", src.display()))?;
        write_atomic(to, &bytes)?;
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&dst.key, std::fs::Permissions::from_mode(0o600))?;
    }
    Ok(format!("enrolled device {} into {}\n", id.device_id(), dir.display()))
}

/// How long `infer` waits for the running daemon's answer.
const INFER_TIMEOUT: Duration = Duration::from_secs(30);

/// `fedfleet-agent infer`: through the running daemon's socket, or (no daemon) from the store.
pub async fn infer(config: &Path, input: &Path) -> Result<String> {
    let cfg = AgentConfig::load(config)?;
    let text = std::fs::read_to_string(input).with_context(|| format!("cannot read {}", input.display()))?;
    let rows = inference::parse_csv_rows(&text).map_err(|e| anyhow::anyhow!("{}: {e}", input.display()))?;
    let req = inference::Request { inputs: rows, feedback: false };
    // A daemon that accepts but never answers (stopped, hung) is named, not waited on forever.
    let socket = cfg.socket_path();
    let resp = match tokio::time::timeout(INFER_TIMEOUT, inference::query(&socket, &req)).await {
        Ok(Ok(r)) => r,
        Ok(Err(_)) => {
            let served = load_active_offline(&cfg.store_dir())?;
            inference::answer(Some(served), &req, &cfg.data.normalization())
        }
        Err(_) => bail!("the daemon's socket {} took the request but gave no answer within {INFER_TIMEOUT:?}", socket.display()),
    };
    if let Some(e) = resp.error {
        bail!("inference failed: {e}");
    }
    // One CSV line per row: `label,confidence` (classification), the predicted values
    // (regression), or the anomaly score (reconstruction).
    let mut out = String::new();
    for p in &resp.predictions {
        let line = match (p.label, p.anomaly_score) {
            (Some(label), _) => format!("{label},{:.6}", p.confidence()),
            (None, Some(score)) => format!("{score:.6}"),
            (None, None) => p.values.iter().map(|v| format!("{v:.6}")).collect::<Vec<_>>().join(","),
        };
        out += &line;
        out.push('\n');
    }
    Ok(out)
}

fn load_active_offline(store_dir: &PathBuf) -> Result<crate::agent::Served> {
    let store = AgentStore::open(store_dir).context("no daemon answering and the store cannot be opened")?;
    let raw = store.load_state_raw()?.context("agent has no state yet")?;
    let st: crate::lifecycle::PersistedState = serde_json::from_slice(&raw)?;
    let m = st.active.context("agent has no active model")?;
    let bytes = store.get_blob(&m.model.digest)?.with_context(|| format!("active model blob {} missing", m.model.digest))?;
    let local = store.local_state()?;
    let predictor = crate::ml::load_served(&GraphTrainer, &m.spec, &bytes, local.as_ref()).map_err(|e| anyhow::anyhow!(e))?;
    Ok(crate::agent::Served { model: m.model, predictor })
}
