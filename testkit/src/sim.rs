//! Simulation mode: many agents in one process, each with its own key, store and data
//! partition, driven through the same [`Agent`] shell and lifecycle as the daemon, against the
//! in-memory services of [`crate::fakes`] and a fake clock. The "aggregator" step here is the
//! aggregator's own exact FedAvg fold (`fedfleet_rounds::strategy::PartialSum`); the real
//! aggregator service replaces it in loopback tests.

use std::path::Path;
use std::sync::Arc;

use ed25519_dalek::SigningKey;
use fedfleet_aggregator::service::flatten;
use fedfleet_aggregator::strategy::PartialSum;
use fedfleet_learning::{Dataset, ModelSpec, Partition, evaluate, model::init_bundle};
use fedfleet_protocol::{BundleLimits, DeviceId, FleetId, ModelRef, RoundAnnouncement, RoundConfig, RoundId, Selection, TensorBundle};

use crate::clock::FakeClock;
use crate::fakes::{FakeAggregator, FakeRegistry};
use fedfleet_agent::agent::{Agent, LocalData, ShellConfig};
use fedfleet_agent::lifecycle::{AgentError, CoreConfig, DurableLifecycle, HealthPolicy, SlotModel};
use fedfleet_agent::store::AgentStore;

/// A simulated fleet.
pub struct SimFleet {
    pub agents: Vec<Agent<FakeAggregator, FakeRegistry>>,
    pub agg: Arc<FakeAggregator>,
    pub reg: Arc<FakeRegistry>,
    pub clock: Arc<FakeClock>,
    pub fleet: FleetId,
    pub spec: ModelSpec,
    pub global: TensorBundle,
    pub global_ref: ModelRef,
    pub test: Dataset,
}

/// What one round did.
#[derive(Debug, Clone, PartialEq)]
pub struct RoundSummary {
    pub round: RoundId,
    pub updates: usize,
    pub test_accuracy: f64,
    pub activated: usize,
    pub model: ModelRef,
}

impl SimFleet {
    /// `n` agents on IID partitions of the digits training split, under `dir`.
    pub fn new(dir: &Path, n: usize, seed: u64) -> Result<Self, AgentError> {
        Self::with_spec(dir, n, seed, ModelSpec::digits_mlp())
    }

    /// The same, training `spec` (any model over 64 digit pixels) from a fresh initialisation.
    pub fn with_spec(dir: &Path, n: usize, seed: u64, spec: ModelSpec) -> Result<Self, AgentError> {
        let clock = Arc::new(FakeClock::new(1_700_000_000_000));
        let agg = Arc::new(FakeAggregator::new());
        let reg = Arc::new(FakeRegistry::new(seed as u8, u64::MAX / 2));
        let fleet = FleetId::new("sim").expect("valid");
        let spec_json = spec.to_json();
        let global = init_bundle(&spec, seed).expect("SimFleet needs a valid spec");
        let bytes = global.encode();
        let global_ref = reg.publish("digits", &spec_json, bytes.clone());
        let (train, test) = Dataset::digits_split().expect("embedded data");
        let parts = Partition::Iid.split_dataset(&train, n, seed);
        let mut agents = Vec::with_capacity(n);
        for (i, part) in parts.into_iter().enumerate() {
            let device = DeviceId::new(format!("sim-{i:04}")).expect("valid");
            let key = SigningKey::from_bytes(&fedfleet_protocol::Digest::of(format!("{seed}/{i}").as_bytes()).0);
            agg.enroll(device.clone(), key.verifying_key());
            let store = AgentStore::open(dir.join(device.as_str()))?;
            store.put_blob(&bytes)?;
            let (tr, holdout) = part.split(0.2, seed);
            let mut cfg = CoreConfig::new(device, fleet.clone());
            cfg.local_samples = tr.len() as u64;
            cfg.rng_seed = seed ^ i as u64;
            cfg.health = HealthPolicy { max_latency_ms: 1_000.0, accuracy_margin: 0.05 };
            let initial = SlotModel { model: global_ref.clone(), spec: spec_json.clone() };
            let core = DurableLifecycle::open(cfg, store, Some(reg.pinned_root()), Some(initial), 0)?;
            let shell = ShellConfig { latency_samples: 8, ..Default::default() };
            agents.push(Agent::new(core, agg.clone(), reg.clone(), key, LocalData { train: tr, holdout }, clock.clone(), shell));
        }
        Ok(SimFleet { agents, agg, reg, clock, fleet, spec, global, global_ref, test })
    }

    /// Polls and drives every agent once.
    pub async fn step(&mut self) -> Result<(), AgentError> {
        for a in &mut self.agents {
            a.poll_control().await?;
            a.drive().await?;
        }
        Ok(())
    }

    /// One federated round: announce, train everywhere, FedAvg the accepted updates, publish the
    /// result and roll it out to every agent.
    pub async fn run_round(&mut self, round: u64, config: RoundConfig) -> Result<RoundSummary, AgentError> {
        let now = fedfleet_protocol::ids::RoundId(round);
        self.agg.set_round(Some(RoundAnnouncement {
            fleet: self.fleet.clone(),
            round: now,
            base_model: self.global_ref.clone(),
            config,
            deadline_unix_ms: u64::MAX,
            selection: Selection::All,
        }));
        self.agg.add_base_model(&self.spec.to_json(), self.global.encode());
        self.step().await?;
        let updates = self.agg.drain_accepted();
        let deltas: Vec<(TensorBundle, u64)> = updates
            .iter()
            .filter_map(|(h, p)| TensorBundle::decode(p, &BundleLimits::default()).ok().map(|b| (b.dequantize(), h.body().sample_count)))
            .collect();
        if !deltas.is_empty() {
            self.global = exact_fedavg(&self.global, &deltas);
            self.global_ref = self.reg.publish("digits", &self.spec.to_json(), self.global.encode());
            self.reg.assign_all(Some(FakeRegistry::notice(&self.fleet, round, &self.global_ref)));
            self.step().await?;
        }
        let test_accuracy = evaluate(&self.spec, &self.global, &self.test).map(|r| r.accuracy).unwrap_or(0.0);
        let activated = self.agents.iter().filter(|a| a.core().active().is_some_and(|m| m.model == self.global_ref)).count();
        Ok(RoundSummary { round: now, updates: updates.len(), test_accuracy, activated, model: self.global_ref.clone() })
    }
}

/// `global` plus the sample-weighted mean of `deltas`, folded exactly as the aggregator folds a
/// FedAvg round (fixed point, order-independent). The deltas carry the trainable tensors only;
/// the others are carried over.
fn exact_fedavg(global: &TensorBundle, deltas: &[(TensorBundle, u64)]) -> TensorBundle {
    let carried = &deltas[0].0;
    let dim = carried.iter().map(|(_, t)| t.len()).sum();
    let mut sum = PartialSum::new(dim);
    for (delta, weight) in deltas {
        sum.fold(&flatten(delta, dim), *weight).expect("finite deltas of one layout");
    }
    // Both bundles iterate in name order, so the mean's values come in the global's order.
    let mut mean = sum.mean().expect("a positive total weight").into_iter();
    let mut out = TensorBundle::new();
    for (name, t) in global.iter() {
        match carried.get(name) {
            Some(_) => {
                let values = t.to_f32_vec().iter().map(|&v| (v as f64 + mean.next().expect("one mean per value")) as f32).collect();
                out.insert_f32(name, t.shape.clone(), values).expect("the global model's own shapes");
            }
            None => out.insert(name, t.clone()).expect("the global model's own tensors"),
        }
    }
    out
}

// ----- a fleet over the real services -----

/// The fewest digits examples a simulated device holds (tiled when the fleet outgrows the data).
pub const MIN_EXAMPLES_PER_DEVICE: usize = 5;

/// What [`RemoteFleet::start`] needs. Every device must already be enrolled in `pki_dir`
/// (`Pki::enroll_device`) and in the aggregator's allow list.
#[derive(Clone)]
pub struct FleetOptions {
    /// The fleet PKI directory (`ca.crt`, `devices/<id>.crt|.key`).
    pub pki_dir: std::path::PathBuf,
    /// The fleet id (as in the PKI's allow list: announcements for other fleets are ignored).
    pub fleet: FleetId,
    pub devices: Vec<DeviceId>,
    /// How the digits training split is dealt to the devices (20 % of each share is its holdout).
    pub partition: Partition,
    pub partition_seed: u64,
    pub aggregator_addr: std::net::SocketAddr,
    pub aggregator_server_name: String,
    pub registry_addr: std::net::SocketAddr,
    pub registry_server_name: String,
    /// The aggregator's receipt key (`data_dir/receipt.pub`), pinned by every agent.
    pub receipt_key: ed25519_dalek::VerifyingKey,
    /// The registry's root of trust, pinned by every agent.
    pub pinned_root: fedfleet_protocol::tuf::SignedMetadata<fedfleet_protocol::tuf::Root>,
    /// The model whose registry assignments the agents follow.
    pub model_name: String,
    /// Each agent's store lives in `data_dir/<device id>/`.
    pub data_dir: std::path::PathBuf,
    /// Upload/install retry backoff (short in tests).
    pub backoff: fedfleet_agent::lifecycle::Backoff,
    /// Time limit of each aggregator call (an unreachable aggregator is noticed after this).
    pub call_timeout: std::time::Duration,
    /// When an installed model counts as healthy on the agent's holdout.
    pub health: HealthPolicy,
    /// Light devices, for fleets of thousands in one process: state and outbox in memory
    /// ([`AgentStore::in_memory`]) and this many agents' QUIC connections per UDP socket. `None`:
    /// each agent has a sled store and one UDP socket for both its clients.
    pub light: Option<usize>,
    /// QUIC keep-alives on every agent's connections (none: an idle connection closes after
    /// 30 s, as a device's does). For thousands of agents stepped in turn on a loaded machine,
    /// where the pause between two polls of one agent outlasts the idle timeout (a daemon
    /// polls every 10 s).
    pub keep_alive: Option<std::time::Duration>,
    /// `[registry] mirrors`: artifact mirrors (a bucket's URL) tried before the registry.
    pub mirrors: Vec<String>,
    /// `[registry] round_bases`: a round's base from the registry before the aggregator.
    pub round_bases_from_registry: bool,
}

impl FleetOptions {
    /// Defaults: IID partition (seed 1), TLS names `localhost`, backoff 200 ms..2 s, 2 s call
    /// limit, health: latency under 1 s and accuracy at most 5 points below the active model.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        pki_dir: impl Into<std::path::PathBuf>,
        fleet: FleetId,
        devices: Vec<DeviceId>,
        aggregator_addr: std::net::SocketAddr,
        registry_addr: std::net::SocketAddr,
        receipt_key: ed25519_dalek::VerifyingKey,
        pinned_root: fedfleet_protocol::tuf::SignedMetadata<fedfleet_protocol::tuf::Root>,
        model_name: impl Into<String>,
        data_dir: impl Into<std::path::PathBuf>,
    ) -> Self {
        FleetOptions {
            pki_dir: pki_dir.into(),
            fleet,
            devices,
            partition: Partition::Iid,
            partition_seed: 1,
            aggregator_addr,
            aggregator_server_name: "localhost".into(),
            registry_addr,
            registry_server_name: "localhost".into(),
            receipt_key,
            pinned_root,
            model_name: model_name.into(),
            data_dir: data_dir.into(),
            backoff: fedfleet_agent::lifecycle::Backoff { base_ms: 200, max_ms: 2_000 },
            call_timeout: std::time::Duration::from_secs(2),
            health: HealthPolicy { max_latency_ms: 1_000.0, accuracy_margin: 0.05 },
            light: None,
            keep_alive: None,
            mirrors: Vec::new(),
            round_bases_from_registry: true,
        }
    }
}

/// One agent's state, for display and assertions.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentStatus {
    pub device: DeviceId,
    /// The model serving inference.
    pub active: Option<ModelRef>,
    /// Updates waiting for an acknowledgement.
    pub outbox: usize,
    /// The last round this agent trained in.
    pub last_round: Option<RoundId>,
    /// Uploads acknowledged so far (receipts and `Replay`/`Duplicate` answers).
    pub acknowledged: usize,
}

/// Agents with their own enrolled identity, sled store and data share, each talking to the
/// real aggregator and registry over QUIC + mTLS, on the system clock (same [`Agent`] shell as
/// the daemon). Drive it with [`RemoteFleet::step`] or [`RemoteFleet::run_until`].
///
/// `A`/`R` are the clients the agents use: the QUIC ones ([`RemoteFleet::start`]) or wrappers
/// around them ([`RemoteFleet::start_with`], e.g. the MQTT control plane of [`fedfleet_agent::mqtt`]).
pub struct RemoteFleet<A = fedfleet_agent::remote::RemoteAggregator, R = fedfleet_agent::remote::RemoteRegistry> {
    pub agents: Vec<Agent<A, R>>,
    aggs: Vec<Arc<fedfleet_agent::remote::RemoteAggregator>>,
}

/// One agent's QUIC clients and identity, handed to the `wrap` of [`RemoteFleet::start_with`].
pub struct AgentLinks {
    pub index: usize,
    pub device: DeviceId,
    pub identity: fedfleet_certs::DeviceIdentity,
    pub aggregator: Arc<fedfleet_agent::remote::RemoteAggregator>,
    pub registry: Arc<fedfleet_agent::remote::RemoteRegistry>,
}

impl RemoteFleet {
    /// Opens every agent (no handshake yet: clients connect on first use). Must be called inside
    /// a tokio runtime.
    pub fn start(o: FleetOptions) -> anyhow::Result<RemoteFleet> {
        Self::start_with(o, |l| Ok((l.aggregator.clone(), l.registry.clone())))
    }
}

impl<A: fedfleet_agent::clients::Aggregator, R: fedfleet_agent::clients::Registry> RemoteFleet<A, R> {
    /// As [`RemoteFleet::start`], with each agent's clients chosen by `wrap` from its QUIC
    /// clients and identity.
    pub fn start_with(o: FleetOptions, mut wrap: impl FnMut(&AgentLinks) -> anyhow::Result<(Arc<A>, Arc<R>)>) -> anyhow::Result<Self> {
        use anyhow::Context;
        let (mut train, _) = Dataset::digits_split().context("embedded digits data")?;
        // More devices than examples: the examples are reused (tiled) so that every device holds
        // at least MIN_EXAMPLES_PER_DEVICE: it can train and keep a holdout example.
        if o.devices.len() * MIN_EXAMPLES_PER_DEVICE > train.len() {
            let tiled: Vec<usize> = (0..o.devices.len() * MIN_EXAMPLES_PER_DEVICE).map(|i| i % train.len()).collect();
            train = train.subset(&tiled);
        }
        let parts = o.partition.split_dataset(&train, o.devices.len(), o.partition_seed);
        let clock: Arc<dyn fedfleet_agent::agent::Clock> = Arc::new(fedfleet_agent::agent::SystemClock);
        let mut agents = Vec::with_capacity(o.devices.len());
        let mut aggs = Vec::with_capacity(o.devices.len());
        let per_endpoint = o.light.unwrap_or(1).max(1);
        let mut endpoint = None;
        for (i, (device, part)) in o.devices.iter().zip(parts).enumerate() {
            let id = fedfleet_certs::DeviceIdentity::load(&o.pki_dir, device)
                .with_context(|| format!("identity of {device} in {} (enroll it first)", o.pki_dir.display()))?;
            if i % per_endpoint == 0 {
                let tls = fedfleet_certs::tls::client_config(id.ca(), &id, &[fedfleet_certs::ALPN_V1])?;
                endpoint = Some(device_endpoint(&o, i / per_endpoint, per_endpoint > 1, tls)?);
            }
            let endpoint = endpoint.clone().expect("made for the first agent");
            let (agent, agg) = open_agent(&o, i, id, part, endpoint, &clock, None, &mut wrap)?;
            aggs.push(agg);
            agents.push(agent);
        }
        Ok(RemoteFleet { agents, aggs })
    }

    /// The `i`-th agent's aggregator client (shared with the agent).
    pub fn aggregator(&self, i: usize) -> &Arc<fedfleet_agent::remote::RemoteAggregator> {
        &self.aggs[i]
    }

    /// Polls the services and drives every agent once (in turn).
    pub async fn step(&mut self) -> Result<(), AgentError> {
        for a in &mut self.agents {
            a.poll_control().await?;
            a.drive().await?;
        }
        Ok(())
    }

    /// Steps (every 50 ms) until `cond` holds or `timeout` passes; returns whether it held.
    pub async fn run_until(&mut self, mut cond: impl FnMut(&Self) -> bool, timeout: std::time::Duration) -> Result<bool, AgentError> {
        let end = tokio::time::Instant::now() + timeout;
        loop {
            if cond(self) {
                return Ok(true);
            }
            if tokio::time::Instant::now() >= end {
                return Ok(false);
            }
            self.step().await?;
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }

    /// Per-agent status.
    pub fn status(&self) -> Vec<AgentStatus> {
        self.agents
            .iter()
            .zip(&self.aggs)
            .map(|(a, g)| AgentStatus {
                device: a.core().state().device.clone(),
                active: a.core().active().map(|m| m.model.clone()),
                outbox: a.core().store().outbox().map(|o| o.len()).unwrap_or(0),
                last_round: a.core().state().last_round,
                acknowledged: g.acks().len(),
            })
            .collect()
    }

    /// Every acknowledged upload of every agent (see [`fedfleet_agent::remote::Ack`]); only uploads that
    /// went through the QUIC client (not an MQTT path of a [`RemoteFleet::start_with`] wrapper).
    pub fn acks(&self) -> Vec<fedfleet_agent::remote::Ack> {
        self.aggs.iter().flat_map(|g| g.acks()).collect()
    }

    /// Adds `other`'s agents (e.g. another region's, talking to another relay) to this fleet.
    pub fn extend(&mut self, other: RemoteFleet<A, R>) {
        self.agents.extend(other.agents);
        self.aggs.extend(other.aggs);
    }

    /// Total outbox entries still waiting.
    pub fn pending(&self) -> usize {
        self.status().iter().map(|s| s.outbox).sum()
    }
}

/// The UDP socket of simulated devices' connections number `socket`. Against services on
/// loopback, each socket gets a loopback address of its own (all of 127/8 is loopback on
/// Linux): a real fleet's devices come from many addresses, and the services bound what one
/// source address may have in progress. A socket `shared` by many agents' connections gets a
/// service's socket buffers: their downloads arrive in one burst.
pub(crate) fn device_endpoint(o: &FleetOptions, socket: usize, shared: bool, tls: rustls::ClientConfig) -> anyhow::Result<quinn::Endpoint> {
    let local = match o.aggregator_addr.ip() {
        std::net::IpAddr::V4(ip) if ip.is_loopback() => {
            std::net::Ipv4Addr::new(127, 1 + (socket / 250 % 250) as u8, 0, 2 + (socket % 250) as u8).into()
        }
        std::net::IpAddr::V4(_) => std::net::Ipv4Addr::UNSPECIFIED.into(),
        std::net::IpAddr::V6(_) => std::net::Ipv6Addr::UNSPECIFIED.into(),
    };
    let addr = std::net::SocketAddr::new(local, 0);
    Ok(if shared { fedfleet_net::shared_client_endpoint_at(addr, tls)? } else { fedfleet_net::client_endpoint_at(addr, tls)? })
}

/// Opens agent `index` of a fleet for `identity`: its QUIC clients on `endpoint` (shared with
/// other agents or not), its store under `o.data_dir`, its core, and its share of the data (20 %
/// of it, at least one example, kept for health checks). `tls`: the device's TLS config, if it
/// has one already (a config's session tickets resume only with that config). `wrap` picks the
/// clients it uses.
#[allow(clippy::too_many_arguments)]
pub(crate) fn open_agent<A: fedfleet_agent::clients::Aggregator, R: fedfleet_agent::clients::Registry>(
    o: &FleetOptions,
    index: usize,
    identity: fedfleet_certs::DeviceIdentity,
    share: Dataset,
    endpoint: quinn::Endpoint,
    clock: &Arc<dyn fedfleet_agent::agent::Clock>,
    tls: Option<rustls::ClientConfig>,
    wrap: &mut impl FnMut(&AgentLinks) -> anyhow::Result<(Arc<A>, Arc<R>)>,
) -> anyhow::Result<(Agent<A, R>, Arc<fedfleet_agent::remote::RemoteAggregator>)> {
    let device = identity.device_id().clone();
    let tls = match tls {
        Some(tls) => tls,
        None => fedfleet_certs::tls::client_config(identity.ca(), &identity, &[fedfleet_certs::ALPN_V1])?,
    };
    let mut agg_client = fedfleet_aggregator_client::client::AggregatorClient::on_endpoint(
        endpoint.clone(),
        o.aggregator_addr,
        &o.aggregator_server_name,
        tls.clone(),
    )
    .map_err(|e| anyhow::anyhow!("aggregator client: {e}"))?;
    let mut reg_client =
        fedfleet_registry_client::client::RegistryClient::on_endpoint(endpoint, o.registry_addr, &o.registry_server_name, tls)
            .map_err(|e| anyhow::anyhow!("registry client: {e}"))?;
    if let Some(interval) = o.keep_alive {
        agg_client = agg_client.keep_alive(interval);
        reg_client = reg_client.keep_alive(interval);
    }
    let agg = Arc::new(fedfleet_agent::remote::RemoteAggregator::new(agg_client, o.receipt_key).with_timeout(o.call_timeout));
    let reg = Arc::new(fedfleet_agent::remote::RemoteRegistry::with_clock(
        reg_client,
        o.model_name.clone(),
        o.pinned_root.clone(),
        clock.clone(),
    ));
    let key = identity.signing_key();
    let links = AgentLinks { index, device: device.clone(), identity, aggregator: agg.clone(), registry: reg };
    let (agent_agg, agent_reg) = wrap(&links)?;
    let dir = o.data_dir.join(device.as_str());
    let store = if o.light.is_some() { AgentStore::in_memory(dir)? } else { AgentStore::open(dir)? };
    let (mut tr, mut holdout) = share.split(0.2, o.partition_seed);
    if holdout.is_empty() && tr.len() >= 2 {
        // The split is stratified by class: a device with few examples of each class keeps one
        // for its health checks (an agent with no holdout refuses every install).
        let last = tr.len() - 1;
        holdout = tr.subset(&[last]);
        tr = tr.subset(&(0..last).collect::<Vec<_>>());
    }
    let mut cfg = CoreConfig::new(device, o.fleet.clone());
    cfg.local_samples = tr.len() as u64;
    cfg.rng_seed = o.partition_seed ^ index as u64;
    cfg.backoff = o.backoff;
    cfg.health = o.health;
    let core = DurableLifecycle::open(cfg, store, Some(o.pinned_root.clone()), None, clock.now_ms())?;
    let mirrors = match o.mirrors.is_empty() {
        true => None,
        false => Some(Arc::new(fedfleet_agent::mirror::Mirrors::new(&o.mirrors, true).map_err(anyhow::Error::msg)?)),
    };
    let shell = ShellConfig { latency_samples: 8, mirrors, round_bases_from_registry: o.round_bases_from_registry, ..Default::default() };
    Ok((Agent::new(core, agent_agg, agent_reg, key, LocalData { train: tr, holdout }, clock.clone(), shell), agg))
}
