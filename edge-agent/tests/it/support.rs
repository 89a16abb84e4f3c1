use ed25519_dalek::SigningKey;
use fedfleet_agent::AgentStore;
use fedfleet_agent::lifecycle::{Action, Backoff, CoreConfig, DurableLifecycle, HealthPolicy, SlotModel};
use fedfleet_protocol::{
    DType, DeviceId, Digest, FleetId, ModelRef, Receipt, RoundAnnouncement, RoundConfig, RoundId, Selection, Signed, UpdateHeader,
};
use fedfleet_testkit::fakes::FakeRegistry;
use std::path::Path;

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

/// A registry with v1 published; returns it and v1's ref.
pub fn registry() -> (FakeRegistry, ModelRef) {
    let reg = FakeRegistry::new(1, u64::MAX / 2);
    let v1 = reg.publish("digits", SPEC, b"model v1 bytes".to_vec());
    (reg, v1)
}

pub fn open(dir: &Path, reg: &FakeRegistry, active: &ModelRef) -> DurableLifecycle {
    let store = AgentStore::open(dir).unwrap();
    let initial = SlotModel { model: active.clone(), spec: SPEC.into() };
    DurableLifecycle::open(core_cfg(), store, Some(reg.pinned_root()), Some(initial), T0).unwrap()
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

pub fn drain(lc: &mut DurableLifecycle) -> Vec<Action> {
    std::iter::from_fn(|| lc.poll_action()).collect()
}

pub fn uploads(actions: &[Action]) -> Vec<u64> {
    actions.iter().filter_map(|a| if let Action::Upload { outbox_id } = a { Some(*outbox_id) } else { None }).collect()
}
