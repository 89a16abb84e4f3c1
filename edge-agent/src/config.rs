//! `agent.toml`. Relative paths are relative to the file's own directory.
//!
//! ```toml
//! fleet = "default"
//! state_dir = "/var/lib/fedfleet-agent"   # store, blobs, identity/, status.json, agent.sock
//! poll_interval_ms = 10000
//! # cohort = "canary"
//!
//! [identity]        # defaults: <state_dir>/identity/{device.crt,device.key,ca.crt,root.json}
//! # cert = "..."; key = "..."; ca = "..."; registry_root = "..."
//!
//! [data]            # one of csv / npy / npz / idx / images / digits_partition
//! csv = "/var/lib/fedfleet-agent/data.csv"     # label in the last column, no header
//! # csv_targets = 1                            # regression: the last column is the target
//! # npy = { features = "x.npy", labels = "y.npy" }  # int labels: classes; float: regression; none: autoencoder
//! # npz = { path = "data.npz", features = "x", labels = "y" }
//! # idx = { images = "images-idx3-ubyte.gz", labels = "labels-idx1-ubyte.gz" }
//! # images = { dir = "photos", shape = [3, 32, 32] }   # one folder per class, PNG/JPEG
//! # digits_partition = { clients = 10, index = 0, seed = 1 }
//! # scale = 0.0625                             # features × scale, in training and at inference
//! holdout_fraction = 0.2
//!
//! [participation]   # require_idle = true, require_charging = false, min_fresh_samples = 0
//! # status_file = "/run/device/status.json"   # {"idle":true,"charging":false,"fresh_samples":120}
//!
//! [health]          # max_latency_ms = 50.0, accuracy_margin = 0.02
//! [backoff]         # base_ms = 1000, max_ms = 300000
//!
//! # [initial_model] # optional factory model for the active slot (spec and weights required)
//! # spec = "spec.json"; weights = "model.safetensors"; name = "digits"; version = 0
//!
//! [inference]
//! # socket = "<state_dir>/agent.sock"
//!
//! [inbox]           # labelled examples the application pushes through the socket
//! # max_examples = 10000; max_bytes = 16777216; holdout_every = 5   (oldest dropped first)
//! # max_asked = 1000                           # predictions asked with "feedback": true kept for answers
//!
//! [aggregator]      # QUIC + mTLS with the device identity; absent: no training
//! addr = "10.0.0.5:7400"
//! server_name = "localhost"                    # name in the aggregator's certificate
//! receipt_key = "/etc/fedfleet/receipt.pub"    # the aggregator's data_dir/receipt.pub (pinned)
//!
//! [registry]        # absent: no installs
//! addr = "10.0.0.5:7443"
//! server_name = "localhost"
//! model = "digits"                             # the model whose assignments this device follows
//! # mirrors = ["https://cdn.example/fedfleet-models"]  # artifacts at <mirror>/artifacts/<digest>,
//! #                                            # tried first (untrusted: checked against signed metadata)
//! # registry_fallback = true                   # false: artifact bytes come from mirrors only
//! # round_bases = true                         # a round's base model from here (and the mirrors)
//! #                                            # before the aggregator; false: the aggregator only
//!
//! [renewal]         # the device certificate is renewed through [registry] before it expires
//! # renew_before_days = 30; check_interval_secs = 3600   (also renewed in its last third)
//!
//! [mqtt]            # MQTT control plane (fedfleet-control); absent: QUIC only. With [registry],
//!                   # rollout notices (verified against the pinned root) trigger an assignment check
//! host = "10.0.0.5"                            # must match the broker certificate's SAN
//! port = 8883
//! # fleet = "<fleet>"                          # MQTT fleet id (default: the agent's fleet)
//! # reconnect_max_secs = 30                    # ceiling of the reconnect backoff
//! upload = "auto"                              # quic | mqtt | auto (MQTT after switch_after QUIC failures)
//! # switch_after = 3; receipt_timeout_ms = 30000; heartbeat_interval_ms = 60000
//! # receipt_key = "..."                        # default: [aggregator] receipt_key
//! ```

use std::path::{Path, PathBuf};

use fedfleet_control::{MqttClientConfig, UnknownKeys};
use serde::Deserialize;

use crate::lifecycle::{Backoff, HealthPolicy, ParticipationPolicy};

/// `--config` of every agent command (the stock agent's and a team's own binary's): the TOML
/// file, also from `FEDFLEET_AGENT_CONFIG`.
#[derive(Debug, Clone, clap::Args)]
pub struct ConfigArg {
    #[arg(long, short, env = "FEDFLEET_AGENT_CONFIG", default_value = "/etc/fedfleet/agent.toml")]
    pub config: PathBuf,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    pub fleet: String,
    pub state_dir: PathBuf,
    #[serde(default = "default_poll")]
    pub poll_interval_ms: u64,
    #[serde(default)]
    pub cohort: Option<String>,
    #[serde(default)]
    pub identity: IdentityFiles,
    /// Absent: the agent trains only on what the application pushes or its trainer holds.
    #[serde(default)]
    pub data: DataConfig,
    #[serde(default)]
    pub participation: Participation,
    #[serde(default)]
    pub health: HealthPolicy,
    #[serde(default)]
    pub backoff: Backoff,
    #[serde(default)]
    pub initial_model: Option<InitialModel>,
    #[serde(default)]
    pub inference: InferenceConfig,
    /// Bounds of the inbox the application pushes labelled examples into (`inbox.rs`).
    #[serde(default)]
    pub inbox: crate::inbox::InboxConfig,
    /// The aggregator to train with (absent: the agent does not train).
    #[serde(default)]
    pub aggregator: Option<AggregatorEndpoint>,
    /// The registry to install from (absent: the agent keeps its active model).
    #[serde(default)]
    pub registry: Option<RegistryEndpoint>,
    /// The MQTT control plane (absent: QUIC only).
    #[serde(default)]
    pub mqtt: Option<MqttSection>,
    /// When the device certificate is renewed (through `[registry]`).
    #[serde(default)]
    pub renewal: crate::renewal::RenewalConfig,
}

/// `[mqtt]`: `host`, `port`, `fleet` and `reconnect_max_secs` are the keys every program's
/// `[mqtt]` shares ([`MqttClientConfig`]; a device connects under its own id); the rest is the
/// agent's own.
#[derive(Debug, Clone, Deserialize)]
pub struct MqttSection {
    #[serde(flatten)]
    pub client: MqttClientConfig,
    #[serde(default)]
    pub upload: crate::mqtt::UploadPath,
    /// Consecutive QUIC upload failures before `upload = "auto"` switches to MQTT.
    #[serde(default = "default_switch_after")]
    pub switch_after: u32,
    #[serde(default = "default_receipt_timeout")]
    pub receipt_timeout_ms: u64,
    /// Signed status heartbeats on `devices/<id>/status` (0: only on state changes).
    #[serde(default = "default_heartbeat")]
    pub heartbeat_interval_ms: u64,
    /// The aggregator's `receipt.pub` that announcements and receipts must be signed with
    /// (default: `[aggregator] receipt_key`).
    #[serde(default)]
    pub receipt_key: Option<PathBuf>,
    #[serde(flatten)]
    unknown: UnknownKeys,
}
fn default_switch_after() -> u32 {
    3
}
fn default_receipt_timeout() -> u64 {
    30_000
}
fn default_heartbeat() -> u64 {
    60_000
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AggregatorEndpoint {
    pub addr: std::net::SocketAddr,
    #[serde(default = "default_server_name")]
    pub server_name: String,
    /// The aggregator's `receipt.pub` (hex ed25519 public key): announcements and receipts
    /// signed with another key are refused.
    pub receipt_key: PathBuf,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegistryEndpoint {
    pub addr: std::net::SocketAddr,
    #[serde(default = "default_server_name")]
    pub server_name: String,
    /// The model name whose assignments this device follows.
    pub model: String,
    /// HTTP(S) mirrors of the registry's object store, tried before the registry.
    #[serde(default)]
    pub mirrors: Vec<String>,
    /// Whether the registry serves artifact bytes that no mirror could (default true).
    #[serde(default = "default_true")]
    pub registry_fallback: bool,
    /// Whether a round's base model comes from the registry (and its mirrors) before the
    /// aggregator (default true: it halves the bytes each update costs the aggregator).
    #[serde(default = "default_true")]
    pub round_bases: bool,
}

fn default_true() -> bool {
    true
}

fn default_server_name() -> String {
    "localhost".into()
}

fn default_poll() -> u64 {
    10_000
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IdentityFiles {
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    pub ca: Option<PathBuf>,
    pub registry_root: Option<PathBuf>,
}

/// Resolved identity paths.
#[derive(Debug, Clone)]
pub struct IdentityPaths {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
    pub registry_root: PathBuf,
}

impl IdentityPaths {
    /// The layout `enroll` installs into.
    pub fn in_dir(dir: &Path) -> Self {
        IdentityPaths {
            cert: dir.join("device.crt"),
            key: dir.join("device.key"),
            ca: dir.join("ca.crt"),
            registry_root: dir.join("root.json"),
        }
    }
}

/// The device's own data: one source, or none for an agent whose trainer brings its own.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    /// Numeric columns and an integer class label in the last column, no header (gzip ok).
    pub csv: Option<PathBuf>,
    /// The CSV's last K columns are regression targets instead of a class label.
    pub csv_targets: Option<usize>,
    /// `.npy` arrays: features `[n, ...]` and optional labels (integers: classes; floats:
    /// regression targets; none: reconstruction).
    pub npy: Option<NpyFiles>,
    /// One `.npz` archive holding the features and optional labels arrays.
    pub npz: Option<NpzFile>,
    /// MNIST-style IDX images and labels (gzip ok); pixels scaled to [0, 1].
    pub idx: Option<IdxFiles>,
    /// One folder per class of PNG/JPEG images, resized to the model's input.
    pub images: Option<ImageFolder>,
    /// A partition of the embedded digits set (demos and tests).
    pub digits_partition: Option<DigitsPartition>,
    /// Feature scaling for values read from files, in training and at inference alike (e.g.
    /// 0.0625 for 0..16 pixel counts; images default to 1/255).
    #[serde(alias = "csv_scale")]
    pub scale: Option<f32>,
    #[serde(default = "default_holdout")]
    pub holdout_fraction: f64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NpyFiles {
    pub features: PathBuf,
    pub labels: Option<PathBuf>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NpzFile {
    pub path: PathBuf,
    /// The features array's name (`np.savez(path, x=..., y=...)`: `"x"`).
    #[serde(default = "default_features_key")]
    pub features: String,
    /// The labels array's name; absent: no labels (reconstruction).
    pub labels: Option<String>,
}

fn default_features_key() -> String {
    "x".into()
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IdxFiles {
    pub images: PathBuf,
    pub labels: PathBuf,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageFolder {
    pub dir: PathBuf,
    /// `[channels, height, width]` the images become (channels 1 or 3).
    pub shape: Vec<usize>,
}

impl DataConfig {
    /// How features read from files are scaled, in training and at inference alike (the
    /// embedded digits partition and IDX images come already scaled).
    pub fn normalization(&self) -> fedfleet_learning::Normalization {
        let default = self.images.as_ref().map(|_| 1.0 / 255.0);
        self.scale.or(default).map_or(fedfleet_learning::Normalization::None, fedfleet_learning::Normalization::Scale)
    }

    /// The configured sources by their key.
    fn sources(&self) -> Vec<&'static str> {
        let set = [
            ("csv", self.csv.is_some()),
            ("npy", self.npy.is_some()),
            ("npz", self.npz.is_some()),
            ("idx", self.idx.is_some()),
            ("images", self.images.is_some()),
            ("digits_partition", self.digits_partition.is_some()),
        ];
        set.into_iter().filter(|(_, on)| *on).map(|(k, _)| k).collect()
    }

    /// Whether a source is configured.
    pub fn is_configured(&self) -> bool {
        !self.sources().is_empty()
    }
}

fn default_holdout() -> f64 {
    0.2
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DigitsPartition {
    pub clients: usize,
    pub index: usize,
    #[serde(default)]
    pub seed: u64,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct Participation {
    #[serde(flatten)]
    pub policy: ParticipationPolicy,
    pub status_file: Option<PathBuf>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InitialModel {
    pub spec: PathBuf,
    pub weights: PathBuf,
    #[serde(default = "default_name")]
    pub name: String,
    #[serde(default)]
    pub version: u64,
}

fn default_name() -> String {
    "model".into()
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InferenceConfig {
    pub socket: Option<PathBuf>,
}

/// Why a config could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("config {path} is invalid: {detail}")]
    Invalid { path: PathBuf, detail: String },
}

impl AgentConfig {
    /// Reads and checks `path`; relative paths inside are resolved against its directory, as
    /// the services' configs are (not against the working directory).
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.to_owned(), source })?;
        let mut cfg = Self::parse(&text).map_err(|detail| ConfigError::Invalid { path: path.to_owned(), detail })?;
        cfg.resolve(path.parent().unwrap_or(Path::new(".")));
        Ok(cfg)
    }

    /// Every relative path made relative to `base` (the config file's directory).
    fn resolve(&mut self, base: &Path) {
        let fix = |p: &mut PathBuf| {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        };
        fix(&mut self.state_dir);
        let id = &mut self.identity;
        [&mut id.cert, &mut id.key, &mut id.ca, &mut id.registry_root].into_iter().flatten().for_each(fix);
        let d = &mut self.data;
        d.csv.iter_mut().for_each(fix);
        if let Some(n) = &mut d.npy {
            fix(&mut n.features);
            n.labels.iter_mut().for_each(fix);
        }
        if let Some(n) = &mut d.npz {
            fix(&mut n.path);
        }
        if let Some(i) = &mut d.idx {
            fix(&mut i.images);
            fix(&mut i.labels);
        }
        if let Some(i) = &mut d.images {
            fix(&mut i.dir);
        }
        self.participation.status_file.iter_mut().for_each(fix);
        if let Some(m) = &mut self.initial_model {
            fix(&mut m.spec);
            fix(&mut m.weights);
        }
        self.inference.socket.iter_mut().for_each(fix);
        if let Some(a) = &mut self.aggregator {
            fix(&mut a.receipt_key);
        }
        if let Some(m) = &mut self.mqtt {
            m.receipt_key.iter_mut().for_each(fix);
        }
    }

    pub fn parse(text: &str) -> Result<Self, String> {
        let c: AgentConfig = toml::from_str(text).map_err(|e| e.to_string())?;
        if let [a, b, ..] = c.data.sources()[..] {
            return Err(format!("[data]: set one source, not both {a} and {b}"));
        }
        if c.data.csv_targets.is_some() && c.data.csv.is_none() {
            return Err("[data] csv_targets needs csv".into());
        }
        if let Some(i) = &c.data.images
            && !matches!(i.shape[..], [1 | 3, h, w] if h > 0 && w > 0)
        {
            return Err(format!("[data] images: shape must be [1 or 3, height, width], got {:?}", i.shape));
        }
        if let Some(p) = c.data.digits_partition
            && (p.clients == 0 || p.index >= p.clients)
        {
            return Err(format!("[data] digits_partition: index {} not below clients {}", p.index, p.clients));
        }
        if !(0.0..1.0).contains(&c.data.holdout_fraction) {
            return Err("[data] holdout_fraction must be in [0, 1)".into());
        }
        fedfleet_protocol::FleetId::new(&c.fleet).map_err(|e| format!("fleet {:?}: {e}", c.fleet))?;
        if let Some(r) = &c.registry {
            if !r.registry_fallback && r.mirrors.is_empty() {
                return Err("[registry] registry_fallback = false needs at least one mirror".into());
            }
            crate::mirror::check_urls(&r.mirrors).map_err(|e| format!("[registry] {e}"))?;
        }
        if let Some(m) = &c.mqtt {
            m.unknown.check("mqtt")?;
            m.client.address()?;
            if let Some(f) = &m.client.fleet {
                fedfleet_protocol::FleetId::new(f).map_err(|e| format!("[mqtt] fleet {f:?}: {e}"))?;
            }
            if m.receipt_key.is_none() && c.aggregator.is_none() {
                return Err("[mqtt]: set receipt_key (there is no [aggregator] receipt_key to default to)".into());
            }
            if m.upload == crate::mqtt::UploadPath::Quic && c.aggregator.is_none() {
                tracing::warn!("[mqtt] upload = \"quic\" without [aggregator]: updates cannot be sent");
            }
        }
        Ok(c)
    }

    pub fn identity_paths(&self) -> IdentityPaths {
        let d = IdentityPaths::in_dir(&self.state_dir.join("identity"));
        IdentityPaths {
            cert: self.identity.cert.clone().unwrap_or(d.cert),
            key: self.identity.key.clone().unwrap_or(d.key),
            ca: self.identity.ca.clone().unwrap_or(d.ca),
            registry_root: self.identity.registry_root.clone().unwrap_or(d.registry_root),
        }
    }
    pub fn socket_path(&self) -> PathBuf {
        self.inference.socket.clone().unwrap_or_else(|| self.state_dir.join("agent.sock"))
    }
    pub fn status_path(&self) -> PathBuf {
        self.state_dir.join("status.json")
    }
    pub fn store_dir(&self) -> PathBuf {
        self.state_dir.join("store")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 31 defect 9: an agent config's relative paths are the config file's, as the
    /// services' are, whatever directory the agent starts in.
    #[test]
    fn relative_paths_are_relative_to_the_config_file() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("agents")).unwrap();
        let path = dir.path().join("agents/a1.toml");
        std::fs::write(
            &path,
            "fleet = \"f\"\nstate_dir = \"a1\"\n[data]\ncsv = \"data/a1.csv\"\n\
             [aggregator]\naddr = \"127.0.0.1:1\"\nreceipt_key = \"../aggregator/receipt.pub\"\n\
             [inference]\nsocket = \"/run/agent.sock\"\n",
        )
        .unwrap();
        let c = AgentConfig::load(&path).unwrap();
        let agents = dir.path().join("agents");
        assert_eq!(c.state_dir, agents.join("a1"));
        assert_eq!(c.data.csv, Some(agents.join("data/a1.csv")));
        assert_eq!(c.aggregator.as_ref().unwrap().receipt_key, agents.join("../aggregator/receipt.pub"));
        assert_eq!(c.identity_paths().cert, agents.join("a1/identity/device.crt"));
        assert_eq!(c.socket_path(), PathBuf::from("/run/agent.sock"), "absolute paths stay as written");
    }
}
