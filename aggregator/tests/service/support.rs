//! Fixtures: a fleet PKI in a tempdir, configs, in-process services, devices and updates.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use ed25519_dalek::SigningKey;
use fedfleet_aggregator::client::AggregatorClient;
pub use fedfleet_aggregator::config::CampaignStrategy;
use fedfleet_aggregator::config::{CampaignDefaults, Config, ModelConfig};
use fedfleet_aggregator::publish::DirPublisher;
use fedfleet_certs::{ALPN_V1, CaCert, DeviceIdentity, Pki, ServerIdentity};
use fedfleet_learning::ModelSpec;
use fedfleet_protocol::{DType, DeviceId, Digest, FleetId, RoundId, Signed, SignedUpdate, TensorBundle, UpdateHeader};
use fedfleet_testkit::services;
pub use fedfleet_testkit::services::RunningAggregator;
use rand::{Rng, SeedableRng};

pub fn spec() -> ModelSpec {
    ModelSpec::Mlp { input: vec![8], hidden: vec![4], classes: 3 }
}

pub fn dev(i: usize) -> DeviceId {
    DeviceId::new(format!("dev-{i:03}")).unwrap()
}

pub struct Fleet {
    pub dir: tempfile::TempDir,
    pub pki: Pki,
    pub fleet: FleetId,
}

impl Fleet {
    /// A PKI with the `aggregator` and `operator` service identities and `n` devices.
    pub fn new(n: usize) -> Fleet {
        Fleet::named(n, "fleet-t")
    }

    /// As [`Fleet::new`] with another fleet id (the embedded MQTT broker needs an alphanumeric one).
    pub fn named(n: usize, fleet: &str) -> Fleet {
        let dir = tempfile::tempdir().unwrap();
        let fleet = FleetId::new(fleet).unwrap();
        let devices: Vec<DeviceId> = (0..n).map(dev).collect();
        let pki = services::fleet_pki(&dir.path().join("pki"), &fleet, &["aggregator", "operator"], &devices, 30).unwrap();
        let initial = dir.path().join("initial.safetensors");
        let bundle = fedfleet_learning::model::init_bundle(&spec(), 7).unwrap();
        std::fs::write(&initial, bundle.encode()).unwrap();
        Fleet { dir, pki, fleet }
    }

    pub fn pki_dir(&self) -> PathBuf {
        self.pki.dir().to_owned()
    }

    pub fn config(&self, data: &str, target: u32, rounds: u32) -> Config {
        let model =
            ModelConfig { name: "tiny".into(), spec: spec(), initial: self.dir.path().join("initial.safetensors"), validation: None };
        Config {
            campaign: CampaignDefaults { rounds, target, quorum: 1, deadline_secs: 600, ..Default::default() },
            ..Config::new("127.0.0.1:0".parse().unwrap(), self.pki_dir(), self.dir.path().join(data), model)
        }
    }

    /// The same config as TOML, for a child process.
    pub fn write_toml(&self, cfg: &Config) -> PathBuf {
        let text = format!(
            "listen = \"{}\"\npki_dir = {:?}\ndata_dir = {:?}\n\n[model]\nname = \"tiny\"\n\
             spec = {{ arch = \"mlp\", input = [8], hidden = [4], classes = 3 }}\ninitial = {:?}\n\n\
             [campaign]\nrounds = {}\ntarget = {}\nquorum = 1\ndeadline_secs = 600\nmode = {:?}\n{}{}\n\
             [compute]\nfold = {:?}\ndevice = {:?}\n",
            cfg.listen,
            cfg.pki_dir,
            cfg.data_dir,
            cfg.model.initial,
            cfg.campaign.rounds,
            cfg.campaign.target,
            cfg.campaign.mode.as_str(),
            cfg.campaign.max_staleness.map(|s| format!("max_staleness = {s}\n")).unwrap_or_default(),
            toml::to_string(&cfg.campaign.strategy).unwrap(),
            format!("{:?}", cfg.compute.fold).to_lowercase(),
            cfg.compute.device,
        );
        let p = cfg.data_dir.with_extension("toml");
        std::fs::write(&p, text).unwrap();
        p
    }

    pub fn device_key(&self, i: usize) -> SigningKey {
        DeviceIdentity::load(self.pki.dir(), &dev(i)).unwrap().signing_key()
    }

    pub async fn device_client(&self, i: usize, addr: SocketAddr) -> AggregatorClient {
        let ca = CaCert::load(self.pki.ca_cert_path()).unwrap();
        let id = DeviceIdentity::load(self.pki.dir(), &dev(i)).unwrap();
        let tls = fedfleet_certs::tls::client_config(&ca, &id, &[ALPN_V1]).unwrap();
        AggregatorClient::connect(addr, "localhost", tls).await.unwrap()
    }

    pub async fn operator(&self, addr: SocketAddr) -> AggregatorClient {
        let ca = CaCert::load(self.pki.ca_cert_path()).unwrap();
        let id = ServerIdentity::load(self.pki.dir(), "operator").unwrap();
        let tls = fedfleet_certs::tls::service_client_config(&ca, &id, &[ALPN_V1]).unwrap();
        AggregatorClient::connect(addr, "localhost", tls).await.unwrap()
    }
}

/// The aggregator of `cfg` serving on 127.0.0.1:0, publishing into `cfg.publish_dir()`.
pub async fn start(cfg: Config) -> RunningAggregator {
    start_at(cfg, fedfleet_protocol::SystemClock::shared()).await
}

/// As [`start`], with the aggregator reading `clock` (deadlines move only when the test moves it).
pub async fn start_at(cfg: Config, clock: fedfleet_protocol::SharedClock) -> RunningAggregator {
    let key = fedfleet_aggregator::keys::load_or_create(&cfg.data_dir).unwrap();
    let publisher = DirPublisher::new(cfg.publish_dir(), key, "test");
    RunningAggregator::start_at(Config { listen: "127.0.0.1:0".parse().unwrap(), ..cfg }, Box::new(publisher), clock).await.unwrap()
}

/// A delta bundle for `spec()` from a seed (values in ±0.01).
pub fn delta(seed: u64) -> TensorBundle {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut b = TensorBundle::new();
    for p in spec().params() {
        let n: usize = p.shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| rng.gen_range(-0.01f32..0.01)).collect();
        b.insert_f32(&p.name, p.shape.clone(), v).unwrap();
    }
    b
}

pub fn nonce(device: usize, k: u64) -> [u8; 16] {
    let mut n = [0u8; 16];
    n[..8].copy_from_slice(&(device as u64).to_le_bytes());
    n[8..].copy_from_slice(&k.to_le_bytes());
    n
}

/// A signed header binding `payload`.
#[allow(clippy::too_many_arguments)]
pub fn header(
    fleet: &FleetId,
    device: &DeviceId,
    round: RoundId,
    base: Digest,
    nonce: [u8; 16],
    samples: u64,
    payload: &[u8],
    dtype: DType,
    key: &SigningKey,
) -> SignedUpdate {
    Signed::sign(
        UpdateHeader {
            device: device.clone(),
            fleet: fleet.clone(),
            round,
            base_model: base,
            nonce,
            sample_count: samples,
            payload_len: payload.len() as u64,
            payload_digest: Digest::of(payload),
            payload_dtype: dtype,
        },
        key,
    )
}

pub fn read_published(dir: &Path, name: &str) -> Vec<u8> {
    let m = DirPublisher::latest(dir, name).unwrap().expect("a published version");
    std::fs::read(DirPublisher::model_path(dir, name, m.version)).unwrap()
}

/// Waits (30 s at most) until `round` is announced; returns its base model's digest.
pub async fn wait_round(c: &AggregatorClient, round: RoundId) -> Digest {
    let t0 = std::time::Instant::now();
    loop {
        let info = c.current_round().await.unwrap();
        if let Some(a) = info.announcement {
            let a = a.verify(&info.receipt_key).unwrap();
            if a.round == round {
                return a.base_model.digest;
            }
        }
        assert!(t0.elapsed() < std::time::Duration::from_secs(30), "round {round} did not open");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}
