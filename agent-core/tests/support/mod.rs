//! Test support for the lifecycle core, without sled or sockets: an in-memory "disk" that applies
//! the core's [`Persist`] writes (as edge-agent's `AgentStore` does), a harness that writes them
//! after every input (as `DurableLifecycle` does) and reopens from them, and a registry that signs
//! real TUF metadata (the part of testkit's `FakeRegistry` the core sees). Times are plain `u64`.

#![allow(dead_code)]

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ops::Deref;
use std::rc::Rc;

use ed25519_dalek::SigningKey;
use fedfleet_agent_core::lifecycle::{
    Action, Backoff, CoreConfig, HealthPolicy, Input, Lifecycle, LifecycleError, MetadataSet, Millis, SlotModel,
};
use fedfleet_protocol::tuf::{Root, SignedMetadata, sign_targets_and_timestamp};
use fedfleet_protocol::{
    DType, DeviceId, Digest, FleetId, ModelInfo, ModelRef, ModelVersion, Receipt, RolloutAction, RolloutNotice, RoundAnnouncement,
    RoundConfig, RoundId, Selection, Signed, SpecJson, UpdateHeader,
};

pub const T0: u64 = 1_700_000_000_000;
pub const SPEC: &str = r#"{"arch":"mlp","input":[64],"hidden":[64],"classes":10}"#;

pub fn device() -> DeviceId {
    DeviceId::new("dev-1").unwrap()
}
pub fn fleet() -> FleetId {
    FleetId::new("f1").unwrap()
}
pub fn key() -> SigningKey {
    SigningKey::from_bytes(&[9; 32])
}

pub fn core_cfg() -> CoreConfig {
    let mut c = CoreConfig::new(device(), fleet());
    c.local_samples = 100;
    c.backoff = Backoff { base_ms: 1_000, max_ms: 60_000 };
    c.health = HealthPolicy { max_latency_ms: 50.0, accuracy_margin: 0.02 };
    c.rng_seed = 7;
    c
}

/// What the shell made durable: the last state and the outbox, as the core's writes left them.
pub use fedfleet_agent_core::MemoryStore as Stored;

/// The device's storage; it outlives a [`Device`] (a crash drops the device, not the disk).
#[derive(Debug, Default, Clone)]
pub struct Disk(Rc<RefCell<Stored>>);

impl Disk {
    pub fn new() -> Self {
        Disk::default()
    }
    pub fn outbox_ids(&self) -> Vec<u64> {
        self.0.borrow().outbox.keys().copied().collect()
    }
    pub fn has_outbox_entry(&self, id: u64) -> bool {
        self.0.borrow().outbox.contains_key(&id)
    }
    pub fn state(&self) -> Option<Vec<u8>> {
        self.0.borrow().state.clone()
    }
}

/// The core with its disk: every write the core returns is applied before the input returns, so
/// [`poll_action`](Self::poll_action) never runs ahead of the disk (what `DurableLifecycle` does).
pub struct Device {
    core: Lifecycle,
    disk: Disk,
}

impl Device {
    pub fn open(
        cfg: CoreConfig,
        disk: &Disk,
        pinned_root: Option<SignedMetadata<Root>>,
        initial: Option<SlotModel>,
        now: Millis,
    ) -> Result<Self, LifecycleError> {
        let saved = disk.0.borrow().saved();
        let core = Lifecycle::open(cfg, saved, pinned_root, initial, now)?;
        let mut me = Device { core, disk: disk.clone() };
        me.persist();
        Ok(me)
    }

    fn persist(&mut self) {
        while let Some(write) = self.core.poll_persist() {
            self.disk.0.borrow_mut().apply(write);
        }
    }

    pub fn handle(&mut self, now: Millis, input: Input) -> Result<(), LifecycleError> {
        let handled = self.core.handle(now, input);
        self.persist();
        handled
    }

    pub fn handle_timeout(&mut self, now: Millis) {
        self.core.handle_timeout(now);
        self.persist();
    }

    pub fn poll_action(&mut self) -> Option<Action> {
        self.core.poll_action()
    }

    pub fn disk(&self) -> &Disk {
        &self.disk
    }
}

impl Deref for Device {
    type Target = Lifecycle;
    fn deref(&self) -> &Lifecycle {
        &self.core
    }
}

/// Opens (or reopens, after a crash) the device on `disk`, enrolled with `reg`'s root and `active`
/// as its factory model.
pub fn open(disk: &Disk, reg: &Registry, active: &ModelRef) -> Device {
    let initial = SlotModel { model: active.clone(), spec: SPEC.into() };
    Device::open(core_cfg(), disk, Some(reg.pinned_root()), Some(initial), T0).unwrap()
}

/// A registry with v1 published; returns it and v1's ref.
pub fn registry() -> (Registry, ModelRef) {
    let reg = Registry::new(1, u64::MAX / 2);
    let v1 = reg.publish("digits", SPEC, b"model v1 bytes".to_vec());
    (reg, v1)
}

struct RegInner {
    targets: Vec<ModelInfo>,
    meta_version: u64,
    forge_targets: bool,
}

/// A registry's signing side, in memory: a root, and targets and timestamp signed with the keys
/// it names (or, when told to forge, targets signed with a key it does not trust).
pub struct Registry {
    root: SignedMetadata<Root>,
    targets_key: SigningKey,
    timestamp_key: SigningKey,
    /// Expiry of targets and timestamp (and of the root).
    expires: u64,
    inner: RefCell<RegInner>,
}

impl Registry {
    /// Keys derived from `seed`; metadata expires at `expires` (unix ms).
    pub fn new(seed: u8, expires: u64) -> Self {
        let root_key = SigningKey::from_bytes(&[seed.wrapping_add(1); 32]);
        let targets_key = SigningKey::from_bytes(&[seed.wrapping_add(2); 32]);
        let timestamp_key = SigningKey::from_bytes(&[seed.wrapping_add(3); 32]);
        let root = SignedMetadata::single_key_root(expires, &root_key, &targets_key.verifying_key(), &timestamp_key.verifying_key());
        Registry {
            root,
            targets_key,
            timestamp_key,
            expires,
            inner: RefCell::new(RegInner { targets: Vec::new(), meta_version: 0, forge_targets: false }),
        }
    }

    /// The root to pin at enrollment.
    pub fn pinned_root(&self) -> SignedMetadata<Root> {
        self.root.clone()
    }

    /// Publishes a version; returns its reference.
    pub fn publish(&self, name: &str, spec_json: &str, bytes: Vec<u8>) -> ModelRef {
        let mut i = self.inner.borrow_mut();
        let version = ModelVersion(i.targets.iter().filter(|t| t.name == name).count() as u64 + 1);
        let digest = Digest::of(&bytes);
        i.targets.push(ModelInfo {
            name: name.to_owned(),
            version,
            length: bytes.len() as u64,
            digest,
            spec: SpecJson(serde_json::from_str(spec_json).expect("spec is JSON")),
            parent: None,
            metrics: BTreeMap::new(),
            created_at_unix_ms: 0,
            publisher: String::new(),
            adapter: None,
        });
        i.meta_version += 1;
        ModelRef { name: name.to_owned(), version, digest }
    }

    /// From now on, targets are signed by an untrusted key.
    pub fn forge_targets(&self, on: bool) {
        let mut i = self.inner.borrow_mut();
        i.forge_targets = on;
        i.meta_version += 1;
    }

    /// The signed metadata as the registry serves it now (no root updates).
    pub fn metadata(&self) -> MetadataSet {
        let i = self.inner.borrow();
        let forged = SigningKey::from_bytes(&[0xEE; 32]);
        let tkey = if i.forge_targets { &forged } else { &self.targets_key };
        let (targets, timestamp) =
            sign_targets_and_timestamp(i.meta_version.max(1), self.expires, i.targets.clone(), tkey, &self.timestamp_key);
        MetadataSet { roots: Vec::new(), timestamp, targets }
    }

    /// A notice installing `model` on the whole fleet.
    pub fn notice(fleet: &FleetId, rollout_id: u64, model: &ModelRef) -> RolloutNotice {
        RolloutNotice {
            fleet: fleet.clone(),
            rollout_id,
            alias: "stable".into(),
            model: model.clone(),
            length: 0,
            phase: 1,
            percent_bp: fedfleet_protocol::messages::BASIS_POINTS,
            cohort: None,
            action: RolloutAction::Install,
            issued_at_unix_ms: 0,
        }
    }
}

pub fn announcement(round: u64, base: &ModelRef) -> RoundAnnouncement {
    RoundAnnouncement {
        fleet: fleet(),
        round: RoundId(round),
        base_model: base.clone(),
        config: RoundConfig::default(),
        deadline_unix_ms: T0 + 3_600_000,
        selection: Selection::All,
    }
}

/// A signed update for `round` with `payload`.
pub fn signed_update(round: u64, base: &ModelRef, payload: &[u8], nonce: u8) -> Vec<u8> {
    let h = UpdateHeader {
        device: device(),
        fleet: fleet(),
        round: RoundId(round),
        base_model: base.digest,
        nonce: [nonce; 16],
        sample_count: 100,
        payload_len: payload.len() as u64,
        payload_digest: Digest::of(payload),
        payload_dtype: DType::F32,
    };
    Signed::sign(h, &key()).encode()
}

pub fn receipt(round: u64, payload: &[u8], nonce: u8) -> Receipt {
    Receipt {
        fleet: fleet(),
        device: device(),
        round: RoundId(round),
        nonce: [nonce; 16],
        payload_digest: Digest::of(payload),
        accepted_at_unix_ms: T0,
    }
}

pub fn drain(lc: &mut Device) -> Vec<Action> {
    std::iter::from_fn(|| lc.poll_action()).collect()
}

pub fn uploads(actions: &[Action]) -> Vec<u64> {
    actions.iter().filter_map(|a| if let Action::Upload { outbox_id } = a { Some(*outbox_id) } else { None }).collect()
}
