//! The in-process services of the loopback and MQTT tests: the PKI, a real registry serving
//! QUIC on 127.0.0.1, a real aggregator publishing into it, and the checks both tests share.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use fedfleet_agent::remote::Ack;
use fedfleet_aggregator::config::Config;
use fedfleet_aggregator::publish::RegistryPublisher;
use fedfleet_aggregator::service::Aggregator;
use fedfleet_certs::{ALPN_V1, Pki, RevocationWatcher, ServerIdentity, tls};
use fedfleet_learning::ModelSpec;
use fedfleet_protocol::{DeviceId, FleetId, RoundId};
use fedfleet_registry::metadata::{self, Lifetimes, MetadataSigner};
use fedfleet_registry::metrics::Metrics;
use fedfleet_registry::ops::Registry;
use fedfleet_registry::server::{self, ServerOptions};
use fedfleet_registry::store::{Store, StoreConfig};
use fedfleet_registry::{Root, SignedMetadata};

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
        let pki = Pki::init(&pki_dir, &fleet_id, 30, false).unwrap();
        for name in servers {
            pki.issue_server(name, &[], 30, false).unwrap();
        }
        for d in devices {
            pki.enroll_device(d, 30, false).unwrap();
        }
        FleetDir { fleet_id, pki, pki_dir, dir }
    }

    pub fn root(&self) -> &Path {
        self.dir.path()
    }
}

/// The model's initial weights (seed 7) at `<root_dir>/initial.safetensors`.
pub fn write_initial_model(root_dir: &Path, spec: &ModelSpec) -> PathBuf {
    let path = root_dir.join("initial.safetensors");
    std::fs::write(&path, fedfleet_learning::model::init_bundle(spec, 7).unwrap().encode()).unwrap();
    path
}

/// A registry serving QUIC on 127.0.0.1 (any port) with the PKI's `registry` certificate.
pub struct RunningRegistry {
    pub reg: Arc<Registry>,
    /// The signed root the agents pin.
    pub pinned_root: SignedMetadata<Root>,
    pub addr: SocketAddr,
    pub data_dir: PathBuf,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl RunningRegistry {
    /// Fresh metadata keys and store in `<root>/registry`; the certificates named in
    /// `operators` may publish.
    pub fn start(fleet: &FleetDir, operators: &[&str]) -> RunningRegistry {
        let data_dir = fleet.root().join("registry");
        let (pki_dir, fleet_id) = (&fleet.pki_dir, &fleet.fleet_id);
        metadata::init_keys(&data_dir, 30, false).unwrap();
        let store = Store::open(data_dir.join("store"), StoreConfig::default()).unwrap();
        let signer = MetadataSigner::load(&data_dir, Lifetimes::default()).unwrap();
        let reg = Arc::new(Registry::new(store, fleet_id.clone(), Some(signer), Arc::new(Metrics::default())).unwrap());
        let pinned_root = reg.signer().unwrap().root().clone();
        let identity = ServerIdentity::load(pki_dir, "registry").unwrap();
        let revocation = Arc::new(RevocationWatcher::open(pki_dir).unwrap());
        let server_tls = tls::server_config(fleet.pki.ca(), &identity, revocation, &[ALPN_V1]).unwrap();
        let endpoint = fedfleet_net::server_endpoint(([127, 0, 0, 1], 0).into(), server_tls).unwrap();
        let addr = endpoint.local_addr().unwrap();
        let mut opts = ServerOptions::new(data_dir.join("incoming"));
        opts.operators = operators.iter().map(|o| o.to_string()).collect();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(server::run(endpoint, reg.clone(), opts, async move {
            let _ = stopped.await;
        }));
        RunningRegistry { reg, pinned_root, addr, data_dir, stop, task }
    }

    /// Stops serving; panics unless the server ends within 15 s.
    pub async fn stop(self) {
        drop(self.stop);
        tokio::time::timeout(Duration::from_secs(15), self.task).await.unwrap().unwrap();
    }
}

/// An aggregator serving QUIC, publishing into the registry at `reg_addr`.
pub struct RunningAggregator {
    pub agg: Aggregator,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl RunningAggregator {
    /// Opens `cfg`'s data directory and serves on `addr`.
    pub async fn start(cfg: &Config, reg_addr: SocketAddr, addr: SocketAddr) -> (RunningAggregator, SocketAddr) {
        let publisher = RegistryPublisher::connect_lazy(&cfg.pki_dir, "aggregator", reg_addr, "localhost").unwrap();
        let agg = Aggregator::open(cfg.clone(), Box::new(publisher)).unwrap();
        // A stopped predecessor's endpoint may still hold the port for a moment.
        let mut tries = 0;
        let endpoint = loop {
            match agg.bind(addr) {
                Ok(e) => break e,
                Err(_) if tries < 50 => {
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("rebinding {addr}: {e}"),
            }
        };
        let bound = endpoint.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(agg.clone().run(endpoint, async move {
            let _ = stopped.await;
        }));
        (RunningAggregator { agg, stop, task }, bound)
    }

    /// Stops serving and waits for the server task; other clones of the service stay usable.
    pub async fn stop(self) {
        drop(self.agg);
        drop(self.stop);
        self.task.await.unwrap();
    }
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
