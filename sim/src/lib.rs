//! fedfleet-sim: a core-only fleet harness. N device lifecycles ([`Lifecycle`], each with its own
//! [`DeviceId`], ed25519 key and in-memory store), the round [`Coordinator`] with FedAvg playing
//! the aggregator, a registry that signs real TUF metadata for every model it publishes, and a
//! phased [`Rollout`] — all sans-IO cores, driven together on a fake clock, in the style of
//! quinn-proto's test `Pair`: [`Fleet::step`] does one unit of work (delivers one message, fires
//! the timers that are due, or moves the clock to the next thing scheduled), and
//! [`Fleet::run_until_idle`] steps until nothing is pending.
//!
//! No sockets, no stores, no runtime, no burn, no wall clock: the time is a `u64` the harness
//! advances, and everything (keys, nonces, local updates, training times) is derived from the
//! seed, so a run is a function of its [`FleetConfig`] and the calls the test makes.
//!
//! What plays which part:
//! * **Devices**: the real [`Lifecycle`]; every [`Persist`] write is applied to the device's
//!   [`Disk`] before its next action is taken (what the agent's `DurableLifecycle` does). Its
//!   actions are answered by the harness: `Train` becomes a fake local update (a deterministic
//!   small delta, [`fake_delta`], in the model's layout, signed by the device) after a training
//!   time; `Upload` goes to the aggregator; `FetchMetadata`/`Download` to the registry;
//!   `HealthCheck` is answered healthy, or failing for a version marked broken
//!   ([`Fleet::break_version`]); `Report` goes to the rollout.
//! * **Aggregator** ([`Aggregator`]): verifies the update's signature and payload, answers a
//!   resend of an accepted update with its receipt again, and hands the rest to the
//!   [`Coordinator`] (admission and the exact streaming fold). A closed round is finalized, the
//!   model published in the registry, and the next round opened on it.
//! * **Registry** ([`Registry`]): the versions and their bytes, the `stable` alias, and TUF
//!   metadata signed with the keys of the root every device pinned.
//! * **Rollout**: the registry's pull path: each device is told what [`Rollout::assignment`]
//!   says for it (as a [`RolloutNotice`] with the whole fleet in, as `AssignmentBody::to_notice`
//!   does), whenever that changes; device reports reach [`Rollout::handle_report`] mapped as the
//!   registry maps them; `SetAlias` moves the registry's alias.
//!
//! Messages take [`FleetConfig::latency_ms`]. A crashed device ([`Fleet::crash`],
//! [`Fleet::crash_at`]) loses its core and every message addressed to it; its disk stays, and
//! [`Fleet::restart`] reopens the core from it.

use std::collections::{BTreeMap, BTreeSet};

use ed25519_dalek::{SigningKey, VerifyingKey};
use fedfleet_agent_core::lifecycle::{Action, Backoff, CoreConfig, HealthReport, Input, Lifecycle, MetadataSet, SlotModel, UploadOutcome};
use fedfleet_protocol::messages::BASIS_POINTS;
use fedfleet_protocol::tuf::{Root, SignedMetadata, sign_targets_and_timestamp};
use fedfleet_protocol::{
    BundleLimits, DType, DeviceId, DeviceState, DeviceStatus, Digest, FleetId, Layout, ModelInfo, ModelRef, ModelVersion, Receipt,
    RejectReason, Rejection, RolloutAction, RolloutNotice, RoundAnnouncement, RoundId, Signed, SignedUpdate, SpecJson, TensorBundle,
    UpdateHeader, verify_payload,
};
use fedfleet_rollout::{Event as RolloutEvent, Phase, Rollout, RolloutPlan, VersionReport};
use fedfleet_rounds::{
    CampaignId, CampaignOutcome, CampaignSpec, ClientConfig, Contribution, Coordinator, EngineConfig, EngineEvent, FailReason, Invitation,
    RoundEngine, RoundPolicy, ServerStrategy, StrategyConfig, UpdateMeta,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Unix time in milliseconds (the harness's clock).
pub type Millis = u64;

/// The default start of the clock.
pub const T0: Millis = 1_700_000_000_000;
/// The model every device runs and the campaign trains.
pub const MODEL: &str = "sim";
/// The alias rollouts move.
pub const ALIAS: &str = "stable";

/// What the fleet looks like.
#[derive(Debug, Clone)]
pub struct FleetConfig {
    pub devices: usize,
    /// Everything random (keys, nonces, updates, training times) derives from it.
    pub seed: u64,
    pub start: Millis,
    /// The model's tensors (names and shapes); updates and published models use it.
    pub layout: Layout,
    /// One-way delay of every message.
    pub latency_ms: u64,
    /// A local training takes between these (deterministic per device and round).
    pub train_ms: (u64, u64),
    pub health_ms: u64,
    /// The campaign's round policy ([`Fleet::start_campaign`]).
    pub policy: RoundPolicy,
}

impl FleetConfig {
    /// `devices` devices; every round waits for all of them (target = fleet size, quorum half).
    pub fn new(devices: usize, seed: u64) -> Self {
        let layout: Layout =
            [("dense.bias".to_owned(), vec![4]), ("dense.weight".to_owned(), vec![4, 8]), ("out.bias".to_owned(), vec![3])].into();
        FleetConfig {
            devices,
            seed,
            start: T0,
            layout,
            latency_ms: 20,
            train_ms: (1_000, 5_000),
            health_ms: 500,
            policy: RoundPolicy {
                target_count: devices as u32,
                min_quorum: (devices as u32 / 2).max(1),
                over_selection: 1.0,
                duration_ms: 10 * 60_000,
                extension_ms: 5 * 60_000,
                max_sample_count: 1 << 20,
            },
        }
    }

    pub fn dim(&self) -> usize {
        self.layout.values().map(|s| s.iter().product::<usize>()).sum()
    }
}

/// A seed mixed with a label and numbers: the harness's one source of derived randomness.
fn derive(seed: u64, label: &str, parts: &[&[u8]]) -> [u8; 32] {
    let mut h = fedfleet_protocol::Hasher::new();
    h.update(b"fedfleet-sim\0").update(&seed.to_le_bytes()).update(label.as_bytes()).update(&[0]);
    for p in parts {
        h.update(&(p.len() as u64).to_le_bytes()).update(p);
    }
    h.finalize().0
}

fn rng(seed: u64, label: &str, parts: &[&[u8]]) -> ChaCha8Rng {
    ChaCha8Rng::from_seed(derive(seed, label, parts))
}

/// The local update device `device` sends for `round`: `dim` values in [-0.01, 0.01), a
/// deterministic function of the seed, the device and the round (the same after a retrain).
pub fn fake_delta(seed: u64, device: &DeviceId, round: RoundId, dim: usize) -> Vec<f32> {
    let mut r = rng(seed, "delta", &[device.as_str().as_bytes(), &round.0.to_le_bytes()]);
    (0..dim).map(|_| r.gen_range(-0.01f32..0.01)).collect()
}

/// The samples device `index` trains on (its FedAvg weight): 20..=400, varied across devices.
pub fn local_samples(seed: u64, index: usize) -> u64 {
    20 + rng(seed, "samples", &[&(index as u64).to_le_bytes()]).gen_range(0..=380)
}

/// `values` (flat, in the layout's name order) as a tensor bundle.
pub fn bundle(layout: &Layout, values: &[f32]) -> TensorBundle {
    let mut b = TensorBundle::new();
    let mut off = 0;
    for (name, shape) in layout {
        let n: usize = shape.iter().product();
        b.insert_f32(name.clone(), shape.clone(), values[off..off + n].to_vec()).expect("layout is valid");
        off += n;
    }
    assert_eq!(off, values.len(), "values do not fit the layout");
    b
}

/// A bundle's values, flat, in name order (what the aggregator folds).
pub fn flatten(b: &TensorBundle) -> Vec<f32> {
    b.flat_f32()
}

/// The 64-bit id devices know a rollout by: the first 8 bytes of `blake3(id)` (as the registry
/// derives it).
pub fn rollout_number(id: &str) -> u64 {
    u64::from_be_bytes(Digest::of(id.as_bytes()).0[..8].try_into().expect("8 bytes"))
}

// ----- devices -----

/// A device's storage, as its writes left it. It outlives the core: a crash drops the core only.
pub use fedfleet_agent_core::MemoryStore as Disk;

/// An update a device trained (whether or not it was ever sent).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trained {
    pub round: RoundId,
    pub nonce: [u8; 16],
    pub payload_digest: Digest,
}

/// One device: its core (absent while crashed), disk, key, and what the harness saw it do.
pub struct SimDevice {
    pub id: DeviceId,
    pub index: usize,
    key: SigningKey,
    cfg: CoreConfig,
    pub disk: Disk,
    core: Option<Lifecycle>,
    /// Bumped at every crash: messages addressed to an earlier incarnation are lost.
    incarnation: u64,
    /// The model the device serves (its last `Serve`).
    pub serving: Option<SlotModel>,
    /// Every update the device trained.
    pub trained: Vec<Trained>,
    /// Every upload the device sent: (round, nonce).
    pub uploads: Vec<(RoundId, [u8; 16])>,
    /// Every receipt that reached it.
    pub receipts: Vec<Receipt>,
    /// Every rollout notice that reached it.
    pub notices: Vec<RolloutNotice>,
    /// Every model it fetched metadata for (started installing).
    pub fetched: Vec<ModelRef>,
    /// Every model it health-checked.
    pub health_checked: Vec<ModelRef>,
    /// Every candidate it rolled back.
    pub rolled_back: Vec<ModelRef>,
    pub crashes: u32,
    train_attempts: BTreeMap<RoundId, u32>,
    /// The last notice sent to this incarnation.
    last_notice: Option<RolloutNotice>,
}

impl SimDevice {
    /// The core, unless the device is down.
    pub fn core(&self) -> Option<&Lifecycle> {
        self.core.as_ref()
    }
    pub fn is_up(&self) -> bool {
        self.core.is_some()
    }
    pub fn verifying_key(&self) -> VerifyingKey {
        self.key.verifying_key()
    }
    pub fn local_samples(&self) -> u64 {
        self.cfg.local_samples
    }
    /// The active model (as persisted, when the device is down).
    pub fn active(&self) -> Option<ModelRef> {
        match &self.core {
            Some(c) => c.active().map(|m| m.model.clone()),
            None => {
                let st: fedfleet_agent_core::lifecycle::PersistedState = serde_json::from_slice(self.disk.state.as_ref()?).ok()?;
                st.active.map(|m| m.model)
            }
        }
    }
}

// ----- the registry -----

/// The registry's part: versions and their bytes, aliases, and TUF metadata signed with the keys
/// of the root every device pinned at enrollment.
pub struct Registry {
    root: SignedMetadata<Root>,
    targets_key: SigningKey,
    timestamp_key: SigningKey,
    expires: Millis,
    versions: Vec<(ModelInfo, Vec<u8>)>,
    meta_version: u64,
    pub aliases: BTreeMap<String, ModelVersion>,
}

impl Registry {
    fn new(seed: u64, expires: Millis) -> Self {
        let key = |role: &str| SigningKey::from_bytes(&derive(seed, "registry key", &[role.as_bytes()]));
        let (root_key, targets_key, timestamp_key) = (key("root"), key("targets"), key("timestamp"));
        let root = SignedMetadata::single_key_root(expires, &root_key, &targets_key.verifying_key(), &timestamp_key.verifying_key());
        Registry { root, targets_key, timestamp_key, expires, versions: Vec::new(), meta_version: 0, aliases: BTreeMap::new() }
    }

    /// The root devices pin.
    pub fn pinned_root(&self) -> SignedMetadata<Root> {
        self.root.clone()
    }

    /// Publishes `bytes` as the next version of `name`.
    pub fn publish(&mut self, name: &str, spec: &serde_json::Value, bytes: Vec<u8>, now: Millis) -> ModelRef {
        let prior = self.versions.iter().filter(|(i, _)| i.name == name).map(|(i, _)| i.version).max();
        let version = ModelVersion(prior.map_or(1, |v| v.0 + 1));
        let info = ModelInfo {
            name: name.to_owned(),
            version,
            length: bytes.len() as u64,
            digest: Digest::of(&bytes),
            spec: SpecJson(spec.clone()),
            parent: prior,
            metrics: BTreeMap::new(),
            created_at_unix_ms: now,
            publisher: "fedfleet-sim".into(),
            adapter: None,
        };
        let r = info.model_ref();
        self.versions.push((info, bytes));
        self.meta_version += 1;
        r
    }

    pub fn model_ref(&self, name: &str, version: ModelVersion) -> Option<ModelRef> {
        self.info(name, version).map(ModelInfo::model_ref)
    }

    pub fn info(&self, name: &str, version: ModelVersion) -> Option<&ModelInfo> {
        self.versions.iter().map(|(i, _)| i).find(|i| i.name == name && i.version == version)
    }

    /// The artifact with this digest.
    pub fn bytes(&self, digest: &Digest) -> Option<&[u8]> {
        self.versions.iter().find(|(i, _)| &i.digest == digest).map(|(_, b)| b.as_slice())
    }

    /// The signed metadata as served now (every published version; no root rotation).
    pub fn metadata(&self) -> MetadataSet {
        let version = self.meta_version.max(1);
        let models = self.versions.iter().map(|(i, _)| i.clone()).collect();
        let (targets, timestamp) = sign_targets_and_timestamp(version, self.expires, models, &self.targets_key, &self.timestamp_key);
        MetadataSet { roots: Vec::new(), timestamp, targets }
    }
}

/// The rollout engine's view of a device state, as the registry maps it (`None`: not about an
/// install; a storage deferral is the device's fault, not the model's).
fn version_report(s: &DeviceState) -> Option<VersionReport> {
    Some(match s {
        DeviceState::Downloaded => VersionReport::Downloaded,
        DeviceState::Verified => VersionReport::Verified,
        DeviceState::Healthy => VersionReport::Healthy,
        DeviceState::Active => VersionReport::Active,
        DeviceState::RolledBack { reason } => VersionReport::RolledBack { reason: reason.clone() },
        DeviceState::Failed { reason } => VersionReport::Failed { reason: reason.clone() },
        _ => return None,
    })
}

// ----- the aggregator -----

/// An update the coordinator accepted (and folded), with the delta it folded.
#[derive(Debug, Clone, PartialEq)]
pub struct AcceptedUpdate {
    pub round: RoundId,
    pub device: DeviceId,
    pub nonce: [u8; 16],
    pub weight: u64,
    pub payload_digest: Digest,
    pub delta: Vec<f32>,
    pub at: Millis,
}

/// A finished round: its base, what the engine says it accepted, and the model it produced.
#[derive(Debug, Clone, PartialEq)]
pub struct RoundRecord {
    pub round: RoundId,
    pub base: ModelRef,
    pub base_values: Vec<f32>,
    /// From `RoundClosed`, sorted by device.
    pub contributions: Vec<Contribution>,
    pub model: ModelRef,
    pub values: Vec<f32>,
}

/// The aggregator's part: the [`Coordinator`] (FedAvg) behind signature and payload checks.
pub struct Aggregator {
    pub coordinator: Coordinator<ServerStrategy>,
    keys: BTreeMap<DeviceId, VerifyingKey>,
    layout: Layout,
    /// The current global model and its published reference.
    pub global: Vec<f32>,
    pub global_ref: ModelRef,
    /// The open round's announcement.
    pub announcement: Option<RoundAnnouncement>,
    receipts: BTreeMap<(DeviceId, [u8; 16]), Receipt>,
    /// Every accepted update, in acceptance order.
    pub accepted: Vec<AcceptedUpdate>,
    /// Every refused upload: (device, round in the header, reason).
    pub rejected: Vec<(DeviceId, RoundId, RejectReason)>,
    /// Resends of accepted updates answered with their receipt again.
    pub receipts_resent: u64,
    pub rounds: Vec<RoundRecord>,
    pub failed_rounds: Vec<(RoundId, FailReason)>,
    pub outcome: Option<(CampaignOutcome, u32)>,
}

impl Aggregator {
    /// One upload: verified, then a resend answered from the stored receipts, then admitted and
    /// folded by the coordinator. `Ok((receipt, newly_accepted))`.
    fn ingest(&mut self, now: Millis, header: &[u8], payload: &[u8]) -> Result<(Receipt, bool), (RoundId, Rejection)> {
        let signed = SignedUpdate::decode(header).map_err(|e| (RoundId(0), Rejection::new(e.reason(), e.to_string())))?;
        let h = signed.body().clone();
        let refuse = |reason: RejectReason, detail: String| (h.round, Rejection::new(reason, detail));
        let key = self.keys.get(&h.device).ok_or_else(|| refuse(RejectReason::UnknownDevice, format!("{} is not enrolled", h.device)))?;
        signed.verify(key).map_err(|e| refuse(e.reason(), e.to_string()))?;
        verify_payload(&h, payload).map_err(|e| refuse(e.reason(), e.to_string()))?;
        if let Some(r) = self.receipts.get(&(h.device.clone(), h.nonce))
            && r.payload_digest == h.payload_digest
            && r.round == h.round
        {
            self.receipts_resent += 1;
            return Ok((r.clone(), false));
        }
        let meta = UpdateMeta::from(&h);
        self.coordinator.check_update(now, &meta).map_err(|r| refuse(r.reason, format!("round {}: {}", h.round, r.reason)))?;
        if h.payload_dtype != DType::F32 {
            return Err(refuse(RejectReason::WrongDtype, format!("header signs {}", h.payload_dtype)));
        }
        let b = TensorBundle::decode(payload, &BundleLimits::default()).map_err(|e| refuse(e.reason(), e.to_string()))?;
        b.check_layout(&self.layout).map_err(|e| refuse(e.reason(), e.to_string()))?;
        b.check_finite().map_err(|e| refuse(e.reason(), e.to_string()))?;
        let delta = flatten(&b);
        let accepted =
            self.coordinator.handle_update(now, meta, &delta).map_err(|r| refuse(r.reason, format!("round {}: {}", h.round, r.reason)))?;
        let receipt = Receipt {
            fleet: h.fleet.clone(),
            device: h.device.clone(),
            round: h.round,
            nonce: h.nonce,
            payload_digest: h.payload_digest,
            accepted_at_unix_ms: now,
        };
        self.receipts.insert((h.device.clone(), h.nonce), receipt.clone());
        self.accepted.push(AcceptedUpdate {
            round: accepted.round,
            device: h.device,
            nonce: h.nonce,
            weight: accepted.weight,
            payload_digest: h.payload_digest,
            delta,
            at: now,
        });
        Ok((receipt, true))
    }

    /// The accepted updates of `round`, in acceptance order.
    pub fn accepted_in(&self, round: RoundId) -> Vec<&AcceptedUpdate> {
        self.accepted.iter().filter(|a| a.round == round).collect()
    }
}

// ----- the harness -----

/// Where [`Fleet::crash_at`] crashes a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrashPoint {
    /// Right after the device started training for the round (the round is persisted, the
    /// update does not exist yet).
    Training,
    /// Right after the device sent its update (on the wire; the answer is lost).
    UploadSent,
    /// When the coordinator accepted the device's update, before the receipt leaves.
    Accepted,
}

#[derive(Debug, Clone)]
struct CrashPlan {
    device: usize,
    round: RoundId,
    point: CrashPoint,
    restart_after_ms: u64,
    fired: bool,
}

enum Delivery {
    /// An input for one incarnation of a device.
    Device {
        to: usize,
        incarnation: u64,
        input: Input,
    },
    /// An upload, at the aggregator; the answer goes back to `incarnation`.
    Upload {
        from: usize,
        incarnation: u64,
        outbox_id: u64,
        header: Vec<u8>,
        payload: Vec<u8>,
    },
    /// A status report, at the registry.
    Report(DeviceStatus),
    Restart(usize),
}

/// The whole fleet on one fake clock. See the crate docs.
pub struct Fleet {
    cfg: FleetConfig,
    fleet: FleetId,
    spec: serde_json::Value,
    now: Millis,
    pub devices: Vec<SimDevice>,
    pub aggregator: Aggregator,
    pub registry: Registry,
    /// The latest rollout, and every event it emitted.
    pub rollout: Option<Rollout>,
    pub rollout_events: Vec<RolloutEvent>,
    broken: BTreeSet<ModelVersion>,
    queue: BTreeMap<(Millis, u64), Delivery>,
    seq: u64,
    crash_plans: Vec<CrashPlan>,
    next_campaign: u64,
}

/// Steps [`Fleet::run_until_idle`] takes before it decides the fleet never settles.
const MAX_STEPS: u64 = 5_000_000;

impl Fleet {
    /// A fleet of enrolled devices, each running v1 of [`MODEL`] (published, and `stable`).
    pub fn new(cfg: FleetConfig) -> Self {
        let fleet = FleetId::new("sim").expect("fleet id");
        let now = cfg.start;
        let mut registry = Registry::new(cfg.seed, now + 365 * 24 * 3_600_000);
        let spec = serde_json::json!({ "arch": "sim", "layout": cfg.layout });
        let mut r = rng(cfg.seed, "initial model", &[]);
        let global: Vec<f32> = (0..cfg.dim()).map(|_| r.gen_range(-0.5f32..0.5)).collect();
        let v1 = registry.publish(MODEL, &spec, bundle(&cfg.layout, &global).encode(), now);
        registry.aliases.insert(ALIAS.into(), v1.version);
        let factory = SlotModel { model: v1.clone(), spec: spec.to_string() };

        let mut devices = Vec::with_capacity(cfg.devices);
        let mut keys = BTreeMap::new();
        for index in 0..cfg.devices {
            let id = DeviceId::new(format!("dev-{index:03}")).expect("device id");
            let key = SigningKey::from_bytes(&derive(cfg.seed, "device key", &[id.as_str().as_bytes()]));
            keys.insert(id.clone(), key.verifying_key());
            let mut core_cfg = CoreConfig::new(id.clone(), fleet.clone());
            core_cfg.local_samples = local_samples(cfg.seed, index);
            core_cfg.backoff = Backoff { base_ms: 1_000, max_ms: 60_000 };
            core_cfg.rng_seed = u64::from_le_bytes(derive(cfg.seed, "jitter", &[id.as_str().as_bytes()])[..8].try_into().expect("8"));
            let mut disk = Disk::default();
            let mut core = Lifecycle::open(core_cfg.clone(), disk.saved(), Some(registry.pinned_root()), Some(factory.clone()), now)
                .expect("a new device opens");
            while let Some(w) = core.poll_persist() {
                disk.apply(w);
            }
            devices.push(SimDevice {
                id,
                index,
                key,
                cfg: core_cfg,
                disk,
                core: Some(core),
                incarnation: 0,
                serving: None,
                trained: Vec::new(),
                uploads: Vec::new(),
                receipts: Vec::new(),
                notices: Vec::new(),
                fetched: Vec::new(),
                health_checked: Vec::new(),
                rolled_back: Vec::new(),
                crashes: 0,
                train_attempts: BTreeMap::new(),
                last_notice: None,
            });
        }
        let strategy = ServerStrategy::new(&StrategyConfig::FedAvg { client: ClientConfig::default() }, cfg.dim()).expect("FedAvg builds");
        let engine = RoundEngine::new(fleet.clone(), EngineConfig::default(), RoundId(1));
        let aggregator = Aggregator {
            coordinator: Coordinator::new(engine, strategy),
            keys,
            layout: cfg.layout.clone(),
            global,
            global_ref: v1,
            announcement: None,
            receipts: BTreeMap::new(),
            accepted: Vec::new(),
            rejected: Vec::new(),
            receipts_resent: 0,
            rounds: Vec::new(),
            failed_rounds: Vec::new(),
            outcome: None,
        };
        let mut me = Fleet {
            cfg,
            fleet,
            spec,
            now,
            devices,
            aggregator,
            registry,
            rollout: None,
            rollout_events: Vec::new(),
            broken: BTreeSet::new(),
            queue: BTreeMap::new(),
            seq: 0,
            crash_plans: Vec::new(),
            next_campaign: 1,
        };
        for i in 0..me.devices.len() {
            me.drive(i);
        }
        me
    }

    // ----- getters -----

    pub fn now(&self) -> Millis {
        self.now
    }
    pub fn config(&self) -> &FleetConfig {
        &self.cfg
    }
    pub fn fleet_id(&self) -> &FleetId {
        &self.fleet
    }
    pub fn device(&self, i: usize) -> &SimDevice {
        &self.devices[i]
    }
    /// Messages in flight.
    pub fn in_flight(&self) -> usize {
        self.queue.len()
    }
    /// The version `stable` points at.
    pub fn stable(&self) -> Option<ModelVersion> {
        self.registry.aliases.get(ALIAS).copied()
    }

    // ----- what a test sets up -----

    /// Starts a FedAvg campaign of `rounds` rounds over every device, on the current global model.
    pub fn start_campaign(&mut self, rounds: u32) {
        let base = self.aggregator.global_ref.clone();
        let spec = CampaignSpec {
            id: CampaignId(self.next_campaign),
            rounds,
            base_version: base.version,
            base_digest: base.digest,
            client: ClientConfig::default(),
            selection: Invitation::Explicit { devices: self.devices.iter().map(|d| d.id.clone()).collect() },
            policy: self.cfg.policy.clone(),
            seed: derive(self.cfg.seed, "campaign", &[&self.next_campaign.to_le_bytes()]),
            max_consecutive_failures: 3,
            buffer: None,
            privacy: None,
        };
        self.next_campaign += 1;
        self.aggregator.coordinator.engine_mut().start_campaign(self.now, spec).expect("campaign starts");
        self.pump_coordinator();
    }

    /// Publishes `values` as the next version of [`MODEL`] (not moving any alias).
    pub fn publish(&mut self, values: &[f32]) -> ModelRef {
        let bytes = bundle(&self.cfg.layout, values).encode();
        self.registry.publish(MODEL, &self.spec, bytes, self.now)
    }

    /// From now on, every device's health check of `version` fails (its holdout accuracy is far
    /// below the active model's).
    pub fn break_version(&mut self, version: ModelVersion) {
        self.broken.insert(version);
    }

    /// Starts a rollout of `target` from where `stable` points now (it replaces any earlier one).
    pub fn start_rollout(&mut self, id: &str, target: ModelVersion, phases: Vec<Phase>, failure_threshold: f64, min_sample: u32) {
        let plan = RolloutPlan {
            id: id.to_owned(),
            model: MODEL.to_owned(),
            alias: ALIAS.to_owned(),
            target,
            previous: self.stable(),
            phases,
            failure_threshold,
            min_sample,
        };
        self.rollout = Some(Rollout::start(plan, self.now).expect("rollout plan is valid"));
        self.pump_rollout();
    }

    /// Crashes device `i` now: its core and every message addressed to it are lost.
    pub fn crash(&mut self, i: usize) {
        let d = &mut self.devices[i];
        if d.core.take().is_some() {
            d.incarnation += 1;
            d.crashes += 1;
            d.last_notice = None;
            d.serving = None;
        }
    }

    /// Reopens device `i` from its disk (as the agent does at start: it asks for the current
    /// round and its assignment again).
    pub fn restart(&mut self, i: usize) {
        if self.devices[i].is_up() {
            return;
        }
        let root = self.registry.pinned_root();
        let d = &mut self.devices[i];
        let core = Lifecycle::open(d.cfg.clone(), d.disk.saved(), Some(root), None, self.now).expect("device reopens from its disk");
        d.core = Some(core);
        let incarnation = d.incarnation;
        self.drive(i);
        if let Some(a) = self.aggregator.announcement.clone() {
            self.send(Delivery::Device { to: i, incarnation, input: Input::RoundAnnounced(a) });
        }
        self.pump_rollout();
    }

    /// Crashes device `i` at `point` of `round`, and restarts it `restart_after_ms` later.
    pub fn crash_at(&mut self, i: usize, round: RoundId, point: CrashPoint, restart_after_ms: u64) {
        self.crash_plans.push(CrashPlan { device: i, round, point, restart_after_ms, fired: false });
    }

    // ----- driving -----

    /// One unit of work: delivers one message that is due, or fires the timers that are due, or
    /// moves the clock to the next thing scheduled. `false` when nothing is left at all.
    pub fn step(&mut self) -> bool {
        if self.work_now() {
            return true;
        }
        match self.next_time() {
            Some(t) => {
                self.now = t;
                true
            }
            None => false,
        }
    }

    /// Steps until nothing is scheduled: every message delivered, every timer fired.
    pub fn run_until_idle(&mut self) {
        let mut steps = 0;
        while self.step() {
            steps += 1;
            assert!(steps < MAX_STEPS, "the fleet did not settle in {MAX_STEPS} steps (now {})", self.now);
        }
    }

    /// Steps until `done` holds (checked before every step); `false` if the fleet went idle first.
    pub fn run_until(&mut self, mut done: impl FnMut(&Fleet) -> bool) -> bool {
        let mut steps = 0;
        loop {
            if done(self) {
                return true;
            }
            if !self.step() {
                return done(self);
            }
            steps += 1;
            assert!(steps < MAX_STEPS, "the condition did not hold in {MAX_STEPS} steps (now {})", self.now);
        }
    }

    /// Runs everything due up to `now + ms`, and leaves the clock there.
    pub fn advance(&mut self, ms: u64) {
        let until = self.now + ms;
        loop {
            if self.work_now() {
                continue;
            }
            match self.next_time() {
                Some(t) if t <= until => self.now = t,
                _ => break,
            }
        }
        self.now = until;
        while self.work_now() {}
    }

    /// Delivers one due message, or fires the due timers; `false` if nothing is due now.
    fn work_now(&mut self) -> bool {
        if let Some((&key, _)) = self.queue.first_key_value()
            && key.0 <= self.now
        {
            let d = self.queue.remove(&key).expect("first key exists");
            self.deliver(d);
            return true;
        }
        self.fire_timeouts()
    }

    /// The earliest time after now anything is scheduled.
    fn next_time(&self) -> Option<Millis> {
        let now = self.now;
        let later = |t: Option<Millis>| t.filter(|&t| t > now);
        self.queue
            .keys()
            .next()
            .map(|k| k.0.max(now))
            .into_iter()
            .chain(self.devices.iter().filter_map(|d| later(d.core.as_ref()?.poll_timeout())))
            .chain(later(self.aggregator.coordinator.poll_timeout()))
            .chain(later(self.rollout.as_ref().and_then(Rollout::poll_timeout)))
            .min()
    }

    fn fire_timeouts(&mut self) -> bool {
        let now = self.now;
        let mut fired = false;
        for i in 0..self.devices.len() {
            let Some(core) = self.devices[i].core.as_mut() else { continue };
            if core.poll_timeout().is_some_and(|t| t <= now) {
                core.handle_timeout(now);
                fired = true;
                self.drive(i);
            }
        }
        if self.aggregator.coordinator.poll_timeout().is_some_and(|t| t <= now) {
            self.aggregator.coordinator.handle_timeout(now);
            fired = true;
            self.pump_coordinator();
        }
        // A phase waiting for healthy reports keeps its timeout in the past: only a change counts.
        if let Some(r) = self.rollout.as_mut()
            && r.poll_timeout().is_some_and(|t| t <= now)
        {
            let before = (r.status(), r.phase());
            r.handle_timeout(now);
            if before != (r.status(), r.phase()) {
                fired = true;
                self.pump_rollout();
            }
        }
        fired
    }

    fn send(&mut self, d: Delivery) {
        self.send_at(self.now + self.cfg.latency_ms, d);
    }

    fn send_at(&mut self, at: Millis, d: Delivery) {
        self.seq += 1;
        self.queue.insert((at, self.seq), d);
    }

    fn deliver(&mut self, d: Delivery) {
        match d {
            Delivery::Device { to, incarnation, input } => {
                let now = self.now;
                let dev = &mut self.devices[to];
                if dev.incarnation != incarnation {
                    return;
                }
                let Some(core) = dev.core.as_mut() else { return };
                match &input {
                    Input::Assignment(n) => dev.notices.push(n.clone()),
                    Input::UploadResult { outcome: UploadOutcome::Receipt(r), .. } => dev.receipts.push(r.clone()),
                    _ => {}
                }
                core.handle(now, input).expect("the in-memory disk does not fail");
                self.drive(to);
            }
            Delivery::Upload { from, incarnation, outbox_id, header, payload } => {
                let result = self.aggregator.ingest(self.now, &header, &payload);
                self.pump_coordinator();
                let outcome = match result {
                    Ok((receipt, fresh)) => {
                        if fresh && self.crash_point(from, receipt.round, CrashPoint::Accepted) {
                            return;
                        }
                        UploadOutcome::Receipt(receipt)
                    }
                    Err((round, rejection)) => {
                        let device = self.devices[from].id.clone();
                        self.aggregator.rejected.push((device, round, rejection.reason));
                        UploadOutcome::Rejected(rejection)
                    }
                };
                self.send(Delivery::Device { to: from, incarnation, input: Input::UploadResult { outbox_id, outcome } });
            }
            Delivery::Report(status) => self.on_report(status),
            Delivery::Restart(i) => self.restart(i),
        }
    }

    /// Fires a crash plan of device `i` at `point` of `round`, if there is one; `true` if it did.
    fn crash_point(&mut self, i: usize, round: RoundId, point: CrashPoint) -> bool {
        let Some(plan) = self.crash_plans.iter_mut().find(|p| !p.fired && p.device == i && p.round == round && p.point == point) else {
            return false;
        };
        plan.fired = true;
        let after = plan.restart_after_ms;
        self.crash(i);
        self.send_at(self.now + after, Delivery::Restart(i));
        true
    }

    /// Applies device `i`'s writes to its disk and answers its actions, until it has none.
    fn drive(&mut self, i: usize) {
        loop {
            let dev = &mut self.devices[i];
            let Some(core) = dev.core.as_mut() else { return };
            while let Some(w) = core.poll_persist() {
                dev.disk.apply(w);
            }
            let Some(action) = core.poll_action() else { return };
            self.on_action(i, action);
        }
    }

    fn on_action(&mut self, i: usize, action: Action) {
        let now = self.now;
        let incarnation = self.devices[i].incarnation;
        let to_device = |input| Delivery::Device { to: i, incarnation, input };
        match action {
            Action::Serve { model, .. } => self.devices[i].serving = Some(model),
            Action::Train(a) => {
                if self.crash_point(i, a.round, CrashPoint::Training) {
                    return;
                }
                if self.registry.bytes(&a.base_model.digest).is_none() {
                    let input = Input::BaseModelUnavailable { round: a.round, reason: "base model not published".into() };
                    self.send(to_device(input));
                    return;
                }
                let (at, input) = self.train(i, &a);
                self.send_at(at, to_device(input));
            }
            Action::Upload { outbox_id } => {
                let dev = &mut self.devices[i];
                let Some(e) = dev.core.as_ref().and_then(|c| c.outbox_entry(outbox_id)).cloned() else { return };
                dev.uploads.push((e.round, e.nonce));
                self.send(Delivery::Upload { from: i, incarnation, outbox_id, header: e.header, payload: e.payload });
                self.crash_point(i, e.round, CrashPoint::UploadSent);
            }
            Action::FetchMetadata { model, .. } => {
                self.devices[i].fetched.push(model.clone());
                let input = Input::Metadata { model, result: Ok(self.registry.metadata()) };
                self.send(to_device(input));
            }
            Action::Download { model, .. } => {
                let input = match self.registry.bytes(&model.digest) {
                    Some(b) => Input::DownloadDone { length: b.len() as u64, digest: Digest::of(b), model },
                    None => Input::DownloadFailed { model, reason: "404".into() },
                };
                self.send(to_device(input));
            }
            Action::Discard { .. } => {}
            Action::HealthCheck { candidate, active, .. } => {
                self.devices[i].health_checked.push(candidate.model.clone());
                let broken = self.broken.contains(&candidate.model.version);
                let report = HealthReport {
                    holdout: 200,
                    non_finite: false,
                    latency_p50_ms: 1.0,
                    latency_p99_ms: 2.0,
                    candidate_score: if broken { 0.35 } else { 0.91 },
                    active_score: active.map(|_| 0.90),
                    chance_score: Some(0.1),
                    metric: "accuracy".into(),
                };
                let input = Input::HealthResult { model: candidate.model, result: Ok(report) };
                self.send_at(now + self.cfg.health_ms, to_device(input));
            }
            Action::Rollback { model, .. } => self.devices[i].rolled_back.push(model),
            Action::Report(status) => self.send(Delivery::Report(status)),
        }
    }

    /// Device `i`'s local training for `a`: when it finishes, and its result (a signed update).
    fn train(&mut self, i: usize, a: &RoundAnnouncement) -> (Millis, Input) {
        let seed = self.cfg.seed;
        let dim = self.cfg.dim();
        let (lo, hi) = self.cfg.train_ms;
        let dev = &mut self.devices[i];
        let attempt = dev.train_attempts.entry(a.round).or_insert(0);
        *attempt += 1;
        let parts: [&[u8]; 3] = [dev.id.as_str().as_bytes(), &a.round.0.to_le_bytes(), &attempt.to_le_bytes()];
        let took = rng(seed, "train time", &parts).gen_range(lo..=hi.max(lo));
        let nonce: [u8; 16] = derive(seed, "nonce", &parts)[..16].try_into().expect("16 bytes");
        let payload = bundle(&self.cfg.layout, &fake_delta(seed, &dev.id, a.round, dim)).encode();
        let h = UpdateHeader {
            device: dev.id.clone(),
            fleet: a.fleet.clone(),
            round: a.round,
            base_model: a.base_model.digest,
            nonce,
            sample_count: dev.cfg.local_samples,
            payload_len: payload.len() as u64,
            payload_digest: Digest::of(&payload),
            payload_dtype: DType::F32,
        };
        dev.trained.push(Trained { round: a.round, nonce, payload_digest: h.payload_digest });
        let header = Signed::sign(h, &dev.key).encode();
        (self.now + took, Input::TrainingDone { round: a.round, header, payload })
    }

    /// The coordinator's events: announcements out, closed rounds finalized and published.
    fn pump_coordinator(&mut self) {
        let now = self.now;
        while let Some(ev) = self.aggregator.coordinator.poll_event() {
            match ev {
                EngineEvent::RoundOpened(a) => {
                    let ann = RoundAnnouncement {
                        fleet: a.fleet,
                        round: a.round,
                        base_model: ModelRef { name: MODEL.into(), version: a.base_version, digest: a.base_digest },
                        config: a.client.round_config("sgd", DType::F32, Some(a.max_sample_count), a.round.0),
                        deadline_unix_ms: a.deadline,
                        selection: a.selection,
                    };
                    self.broadcast(ann);
                }
                EngineEvent::RoundExtended { round, deadline, .. } => {
                    if let Some(mut ann) = self.aggregator.announcement.clone().filter(|a| a.round == round) {
                        ann.deadline_unix_ms = deadline;
                        self.broadcast(ann);
                    }
                }
                EngineEvent::RoundClosed { round, contributions, .. } => {
                    self.aggregator.announcement = None;
                    let base = self.aggregator.global.clone();
                    let Ok(values) = self.aggregator.coordinator.finalize(now, round, &base) else {
                        continue; // the engine failed the round: RoundFailed follows
                    };
                    let model = self.publish(&values);
                    self.aggregator.rounds.push(RoundRecord {
                        round,
                        base: self.aggregator.global_ref.clone(),
                        base_values: base,
                        contributions,
                        model: model.clone(),
                        values: values.clone(),
                    });
                    self.aggregator.global = values;
                    self.aggregator.global_ref = model.clone();
                    self.aggregator.coordinator.model_ready(now, round, model.version, model.digest).expect("the round awaits its model");
                }
                EngineEvent::RoundFailed { round, reason } => {
                    if self.aggregator.announcement.as_ref().is_some_and(|a| a.round == round) {
                        self.aggregator.announcement = None;
                    }
                    if self.aggregator.coordinator.folding() == Some(round) {
                        self.aggregator.coordinator.discard_held();
                    }
                    self.aggregator.failed_rounds.push((round, reason));
                }
                EngineEvent::CampaignFinished { outcome, rounds_completed, .. } => {
                    self.aggregator.announcement = None;
                    self.aggregator.outcome = Some((outcome, rounds_completed));
                }
                EngineEvent::DeviceRevoked { .. } => {}
            }
        }
    }

    fn broadcast(&mut self, ann: RoundAnnouncement) {
        self.aggregator.announcement = Some(ann.clone());
        for i in 0..self.devices.len() {
            let d = &self.devices[i];
            if d.is_up() {
                let incarnation = d.incarnation;
                self.send(Delivery::Device { to: i, incarnation, input: Input::RoundAnnounced(ann.clone()) });
            }
        }
    }

    /// A device's status at the registry: recorded by the rollout of its model.
    fn on_report(&mut self, status: DeviceStatus) {
        let Some(state) = version_report(&status.state) else { return };
        let about = match state {
            VersionReport::Active => status.active.as_ref().or(status.staged.as_ref()),
            _ => status.staged.as_ref().or(status.active.as_ref()),
        };
        let Some(model) = about else { return };
        let Some(r) = self.rollout.as_mut().filter(|r| r.plan().model == model.name) else { return };
        r.handle_report(self.now, status.device.clone(), model.version, state);
        self.pump_rollout();
    }

    /// The rollout's events (the alias moves), then every device told its assignment where it
    /// changed; again while that produced events (an assignment applies due timeouts).
    fn pump_rollout(&mut self) {
        loop {
            let mut any = self.drain_rollout_events();
            self.send_assignments();
            any |= self.drain_rollout_events();
            if !any {
                return;
            }
        }
    }

    fn drain_rollout_events(&mut self) -> bool {
        let Some(r) = self.rollout.as_mut() else { return false };
        let mut any = false;
        while let Some(ev) = r.poll_event() {
            any = true;
            if let RolloutEvent::SetAlias { alias, version, .. } = &ev {
                match version {
                    Some(v) => self.registry.aliases.insert(alias.clone(), *v),
                    None => self.registry.aliases.remove(alias),
                };
            }
            self.rollout_events.push(ev);
        }
        any
    }

    /// What the registry's assignment path tells each device that is up (as
    /// `AssignmentBody::to_notice`: an `Install` of the assigned version, the whole fleet in),
    /// sent when it differs from the last notice that incarnation got.
    fn send_assignments(&mut self) {
        let now = self.now;
        let Some(r) = self.rollout.as_mut() else { return };
        let number = rollout_number(r.id());
        let mut notices = Vec::new();
        for d in self.devices.iter().filter(|d| d.is_up()) {
            let a = r.assignment(&d.id, now);
            let Some(model) = a.version.and_then(|v| self.registry.model_ref(&a.model, v)) else { continue };
            if d.last_notice.as_ref().is_some_and(|n| n.model == model && n.rollout_id == number) {
                continue;
            }
            let length = self.registry.info(&model.name, model.version).map_or(0, |i| i.length);
            let phase = match a.reason {
                fedfleet_rollout::Reason::InRollout { phase } | fedfleet_rollout::Reason::NotInAudience { phase } => phase as u32,
                _ => 0,
            };
            let notice = RolloutNotice {
                fleet: self.fleet.clone(),
                rollout_id: number,
                alias: String::new(),
                model,
                length,
                phase,
                percent_bp: BASIS_POINTS,
                cohort: None,
                action: RolloutAction::Install,
                issued_at_unix_ms: now,
            };
            notices.push((d.index, d.incarnation, notice));
        }
        for (i, incarnation, notice) in notices {
            self.devices[i].last_notice = Some(notice.clone());
            self.send(Delivery::Device { to: i, incarnation, input: Input::Assignment(notice) });
        }
    }
}
