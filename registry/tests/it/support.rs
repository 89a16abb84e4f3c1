use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use fedfleet_certs::{ALPN_V1, DeviceIdentity, Pki, ServerIdentity, tls};
use fedfleet_protocol::{DeviceId, FleetId, ModelVersion};
use fedfleet_registry::client::RegistryClient;
use fedfleet_registry::ops::Registry;
use fedfleet_registry::server::Faults;
use fedfleet_registry::store::{Manifest, NewVersion};
use fedfleet_testkit::services::{self, RegistrySetup, RunningRegistry};

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
    running: RunningRegistry,
}

impl Harness {
    pub async fn start() -> Harness {
        let dir = tempfile::tempdir().unwrap();
        let fleet = FleetId::new("test-fleet").unwrap();
        let pki = services::fleet_pki(&dir.path().join("pki"), &fleet, &["registry", "operator", "intruder"], &[], 30).unwrap();
        let setup = RegistrySetup { operators: vec!["operator".into()], chunk_size: CHUNK, ..Default::default() };
        let running = RunningRegistry::start(&pki, &dir.path().join("data"), setup).unwrap();
        Harness { addr: running.addr, reg: running.reg.clone(), faults: running.faults.clone(), dir, pki, running }
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

    pub async fn stop(self) {
        self.running.stop().await;
    }
}

pub fn v(n: u64) -> ModelVersion {
    ModelVersion(n)
}

/// Runs a test body with an overall deadline.
pub async fn deadline<F: std::future::Future<Output = ()>>(secs: u64, f: F) {
    tokio::time::timeout(Duration::from_secs(secs), f).await.expect("test timed out");
}

impl Harness {
    /// TLS config of an already enrolled device.
    pub fn device_tls_no_enroll(&self, id: &str) -> rustls::ClientConfig {
        let id = DeviceId::new(id).unwrap();
        let ident = DeviceIdentity::load(self.pki_dir(), &id).unwrap();
        tls::client_config(self.pki.ca(), &ident, &[ALPN_V1]).unwrap()
    }
}

/// The wall clock the registry under test runs on, read.
pub fn unix_ms() -> u64 {
    fedfleet_protocol::Clock::now_ms(&fedfleet_protocol::SystemClock)
}
