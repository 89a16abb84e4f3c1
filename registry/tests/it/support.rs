use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use fedfleet_certs::{ALPN_V1, DeviceIdentity, Pki, RevocationWatcher, ServerIdentity, tls};
use fedfleet_protocol::{DeviceId, FleetId, ModelVersion};
use fedfleet_registry::client::RegistryClient;
use fedfleet_registry::metadata::{self, Lifetimes, MetadataSigner};
use fedfleet_registry::metrics::Metrics;
use fedfleet_registry::ops::Registry;
use fedfleet_registry::server::{self, Faults, ServerOptions};
use fedfleet_registry::store::{Manifest, NewVersion, Store, StoreConfig};

pub const CHUNK: u32 = 64 * 1024;

/// Deterministic pseudo-random bytes.
pub fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    let mut h = blake3::Hasher::new();
    h.update(&seed.to_le_bytes());
    h.finalize_xof().fill(&mut out);
    out
}

/// A running registry on 127.0.0.1:0 with a fresh PKI and keys in a tempdir.
pub struct Harness {
    pub dir: tempfile::TempDir,
    pub pki: Pki,
    pub addr: SocketAddr,
    pub reg: Arc<Registry>,
    pub faults: Arc<Faults>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Harness {
    pub async fn start() -> Harness {
        let dir = tempfile::tempdir().unwrap();
        let pki_dir = dir.path().join("pki");
        let fleet = FleetId::new("test-fleet").unwrap();
        let pki = Pki::init(&pki_dir, &fleet, 30, false).unwrap();
        pki.issue_server("registry", &[], 30, false).unwrap();
        pki.issue_server("operator", &[], 30, false).unwrap();
        pki.issue_server("intruder", &[], 30, false).unwrap();
        let data = dir.path().join("data");
        metadata::init_keys(&data, 30, false).unwrap();
        let store = Store::open(
            data.join("store"),
            StoreConfig {
                chunk_size: CHUNK,
                ..StoreConfig::default()
            },
        )
        .unwrap();
        let signer = MetadataSigner::load(&data, Lifetimes::default()).unwrap();
        let reg = Arc::new(
            Registry::new(store, fleet, Some(signer), Arc::new(Metrics::default())).unwrap(),
        );
        let identity = ServerIdentity::load(&pki_dir, "registry").unwrap();
        let revocation = Arc::new(RevocationWatcher::open(&pki_dir).unwrap());
        let tls = tls::server_config(pki.ca(), &identity, revocation, &[ALPN_V1]).unwrap();
        let endpoint = fedfleet_net::server_endpoint(([127, 0, 0, 1], 0).into(), tls).unwrap();
        let addr = endpoint.local_addr().unwrap();
        let opts = ServerOptions::new(data.join("incoming"));
        let faults = opts.faults.clone();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(server::run(endpoint, reg.clone(), opts, async move {
            let _ = rx.await;
        }));
        Harness {
            dir,
            pki,
            addr,
            reg,
            faults,
            stop: Some(tx),
            task: Some(task),
        }
    }

    pub fn pki_dir(&self) -> PathBuf {
        self.dir.path().join("pki")
    }

    pub fn device_tls(&self, id: &str) -> rustls::ClientConfig {
        let id = DeviceId::new(id).unwrap();
        self.pki.enroll_device(&id, 30, true).unwrap();
        let ident = DeviceIdentity::load(self.pki_dir(), &id).unwrap();
        tls::client_config(self.pki.ca(), &ident, &[ALPN_V1]).unwrap()
    }

    pub fn service_tls(&self, name: &str) -> rustls::ClientConfig {
        let ident = ServerIdentity::load(self.pki_dir(), name).unwrap();
        tls::service_client_config(self.pki.ca(), &ident, &[ALPN_V1]).unwrap()
    }

    pub fn client(&self, tls: rustls::ClientConfig) -> RegistryClient {
        RegistryClient::new(self.addr, "localhost", tls).unwrap()
    }

    pub fn device(&self, id: &str) -> RegistryClient {
        self.client(self.device_tls(id))
    }

    pub fn publish(&self, name: &str, data: &[u8]) -> Manifest {
        self.reg
            .publish(
                NewVersion {
                    name: name.into(),
                    spec: serde_json::json!({"arch": "mlp"}).into(),
                    parent: None,
                    metrics: Default::default(),
                    created_at_unix_ms: 1,
                    publisher: "test".into(),
                    adapter: None,
                },
                data,
            )
            .unwrap()
    }

    pub fn root(&self) -> fedfleet_registry::tuf::Root {
        self.reg.signer().unwrap().root().body_unverified().unwrap()
    }

    pub async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        tokio::time::timeout(Duration::from_secs(15), self.task.take().unwrap())
            .await
            .expect("server stops within 15 s")
            .unwrap();
    }
}

pub fn v(n: u64) -> ModelVersion {
    ModelVersion(n)
}

/// Runs a test body with an overall deadline.
pub async fn deadline<F: std::future::Future<Output = ()>>(secs: u64, f: F) {
    tokio::time::timeout(Duration::from_secs(secs), f)
        .await
        .expect("test timed out");
}

impl Harness {
    /// TLS config of an already enrolled device.
    pub fn device_tls_no_enroll(&self, id: &str) -> rustls::ClientConfig {
        let id = DeviceId::new(id).unwrap();
        let ident = DeviceIdentity::load(self.pki_dir(), &id).unwrap();
        tls::client_config(self.pki.ca(), &ident, &[ALPN_V1]).unwrap()
    }
}
