//! What the loopback and MQTT tests share beside `fedfleet_testkit::services`: a fleet PKI in a
//! tempdir, the initial model, and the checks of acknowledgements against the aggregator's records.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use fedfleet_agent::remote::Ack;
use fedfleet_certs::Pki;
use fedfleet_learning::ModelSpec;
use fedfleet_protocol::{DeviceId, FleetId, RoundId};
use fedfleet_testkit::services::{self, RegistrySetup, RunningRegistry};

/// `edge-00`, `edge-01`, …
pub fn edge_devices(n: usize) -> Vec<DeviceId> {
    (0..n).map(|i| DeviceId::new(format!("edge-{i:02}")).unwrap()).collect()
}

/// A temporary directory holding a fresh PKI (`<root>/pki`) for one fleet.
pub struct FleetDir {
    pub fleet_id: FleetId,
    pub pki: Pki,
    pub pki_dir: PathBuf,
    dir: tempfile::TempDir,
}

impl FleetDir {
    /// Issues a certificate to each of `servers` and enrolls every device.
    pub fn new(fleet: &str, servers: &[&str], devices: &[DeviceId]) -> FleetDir {
        let dir = tempfile::tempdir().unwrap();
        let pki_dir = dir.path().join("pki");
        let fleet_id = FleetId::new(fleet).unwrap();
        let pki = services::fleet_pki(&pki_dir, &fleet_id, servers, devices, 30).unwrap();
        FleetDir { fleet_id, pki, pki_dir, dir }
    }

    pub fn root(&self) -> &Path {
        self.dir.path()
    }

    /// A registry with fresh keys and store in `<root>/registry`; the certificates named in
    /// `operators` may publish.
    pub fn start_registry(&self, operators: &[&str]) -> RunningRegistry {
        let setup = RegistrySetup { operators: operators.iter().map(|o| o.to_string()).collect(), ..Default::default() };
        RunningRegistry::start(&self.pki, &self.root().join("registry"), setup).unwrap()
    }
}

/// The model's initial weights (seed 7) at `<root_dir>/initial.safetensors`.
pub fn write_initial_model(root_dir: &Path, spec: &ModelSpec) -> PathBuf {
    let path = root_dir.join("initial.safetensors");
    std::fs::write(&path, fedfleet_learning::model::init_bundle(spec, 7).unwrap().encode()).unwrap();
    path
}

/// Polls `cond` every 50 ms; panics after `secs`.
pub async fn wait_until(what: &str, secs: u64, mut cond: impl FnMut() -> bool) {
    let end = tokio::time::Instant::now() + Duration::from_secs(secs);
    while !cond() {
        assert!(tokio::time::Instant::now() < end, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Checks the aggregator's committed records of rounds `1..=rounds` against the agents'
/// acknowledgements: `expected` records, none recorded twice, none acknowledged twice, and the
/// acknowledged updates are exactly the recorded ones.
pub fn assert_acks_match_records(store: &fedfleet_aggregator::persist::Store, rounds: u64, expected: usize, acks: &[Ack]) {
    let mut accepted = Vec::new();
    for r in 1..=rounds {
        for rec in store.accepted_in(RoundId(r)).unwrap() {
            accepted.push((rec.device.clone(), rec.round, rec.payload_digest));
        }
    }
    let ack_keys: Vec<_> = acks.iter().map(|a| (a.device.clone(), a.round, a.payload_digest)).collect();
    let ack_set: BTreeSet<_> = ack_keys.iter().cloned().collect();
    let acc_set: BTreeSet<_> = accepted.iter().cloned().collect();
    assert_eq!(accepted.len(), expected, "aggregator records: {accepted:?}");
    assert_eq!(acc_set.len(), accepted.len(), "an update recorded twice");
    assert_eq!(ack_keys.len(), ack_set.len(), "an update acknowledged twice: {acks:?}");
    assert_eq!(ack_set, acc_set, "agents' acknowledged updates differ from the aggregator's records");
}
