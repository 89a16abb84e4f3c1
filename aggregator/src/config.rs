//! `aggregator.toml`: the service configuration.
//!
//! ```toml
//! listen = "0.0.0.0:7400"            # QUIC (mTLS, ALPN fedfleet/1)
//! # operator_listen = "0.0.0.0:7401"  # optional: a QUIC address for operators and services only, on
//!                                    #   its own socket, so a device flood cannot crowd them out
//! pki_dir = "/etc/fedfleet/pki"      # fedfleet-certs directory (ca.crt, devices.json, revoked.json, servers/)
//! server_identity = "aggregator"     # servers/<server_identity>.crt|.key: this service's identity
//! data_dir = "/var/lib/fedfleet-aggregator"
//! metrics_addr = "127.0.0.1:9465"    # Prometheus /metrics (optional; loopback unless metrics_public = true)
//! operators = ["operator"]           # service certificates allowed to run `campaign ...`
//! publish_dir = "/var/lib/fedfleet-aggregator/published"  # DirPublisher target (default: data_dir/published)
//!
//! [publish]                          # optional: publish into a registry instead of publish_dir
//! registry = "127.0.0.1:7443"        # the registry's QUIC address; its `operators` must name
//! server_name = "localhost"          #   this service's certificate (server_identity above); the TLS name of the registry
//!
//! relays = ["relay-eu"]             # relays (service certificate names) whose partial sums this
//!                                    #   aggregator merges (plain weighted means: fedavg, fedprox, fedopt)
//!
//! [relay]                            # only for `fedfleet-aggregator relay`: a regional relay of `parent`
//! parent = "10.0.0.1:7401"           # the parent aggregator (root or relay); its `relays` names this
//!                                    #   service's certificate (server_identity), which is also its client certificate
//! parent_server_name = "localhost"   # the parent's TLS name
//! parent_receipt_key = "root-receipt.pub"  # the parent's data_dir/receipt.pub (pinned)
//! # region = ["dev-1", "dev-2"]      # the devices this relay takes (default: every enrolled device)
//! forward_margin_secs = 10           # forward the region's sum this long before the parent's deadline
//! poll_interval_ms = 1000            # how often the parent is asked for its round
//!
//! [secure_aggregation]               # optional: every round aggregated with SecAgg+ (the aggregator sees
//!                                    #   only the round's sum; plain uploads are refused); fedavg/fedprox/fedopt,
//!                                    #   or dp_fedavg with the noise split across the devices (1/sqrt(quorum) each);
//!                                    #   on a relay, over its region (not on a service with `relays`); in
//!                                    #   async mode only on relays (a region is one cohort per buffer)
//! degree = 16                        # neighbours per device (even)
//! threshold_fraction = 0.5           # shares needed to rebuild a device's secrets, of its neighbours (>= 2)
//! frac_bits = 24                     # fixed-point grid 2^-frac_bits of each sample_count x update value
//! clip = 1000.0                      # each weighted value clamped to +-clip before quantizing
//! stage_ends = [0.5, 0.6, 0.85, 0.95]  # keys, shares, masked input, unmask: fractions of the round's time
//!
//! [model]
//! name = "digits"
//! spec = { arch = "mlp", input = [64], hidden = [64], classes = 10 }
//! initial = "initial.safetensors"    # written by `fedfleet-aggregator init-model`
//! validation = "digits"              # server-side evaluation: "digits" (test split), or arrays:
//!                                    # { features = "val-x.npy", labels = "val-y.npy" } (labels:
//!                                    # int classes, float regression targets, absent for autoencoders)
//!
//! [campaign]                         # defaults of `campaign start`
//! rounds = 5                         # async: versions to publish
//! mode = "rounds"                    # rounds (synchronous) | async (FedBuff: a version every `target` updates,
//!                                    #   devices train on whatever recent version they hold)
//! # max_staleness = 32               # async: updates more versions behind are refused (too_stale);
//!                                    #   the rest weigh weight/sqrt(1+staleness)
//! strategy = "fedavg"                # fedavg fedprox clipped_fedavg fedadam fedyogi fedadagrad median trimmed_mean krum;
//!                                    # then only that strategy's own keys (defaults shown):
//! target = 10
//! quorum = 2
//! deadline_secs = 600
//! extension_secs = 300
//! sampling_rate = 1.0
//! local_epochs = 1
//! batch_size = 32
//! learning_rate = 0.1                # old key: lr
//! optimizer = "sgd"                  # the devices' local optimizer: sgd | adam
//! proximal_mu = 0.0                  # FedProx proximal weight (old keys: mu, fedprox_mu)
//! quantization = "f32"               # f32 f16 bf16 i8
//! # server_lr = 0.1                  # fedadam fedyogi fedadagrad: server learning rate (Flower's default)
//! # clip_norm = 10.0                 # clipped_fedavg: L2 bound of each update
//! # trim_fraction = 0.1              # trimmed_mean: fraction cut at each end
//! # byzantine = 1                    # krum: hostile updates tolerated
//! # select = 1                       # krum: best updates averaged (1 = Krum, >1 = Multi-Krum; old key krum_select)
//! # max_updates = 256                # median trimmed_mean krum: updates held per round
//! # [campaign.local_dp]              # local DP: each device clips its update to clip_norm and adds
//! # clip_norm = 1.0                  #   N(0, (noise_multiplier x clip_norm)^2) per coordinate before
//! # noise_multiplier = 1.0           #   signing it; campaign status: epsilon per device (not with dp_fedavg)
//! # delta = 1e-5
//!
//! [compute]                          # where the server math runs
//! fold = "exact"                     # exact (integer fold on the CPU, default) | tensor (burn)
//! device = "auto"                    # tensor only: cpu | gpu (build with --features wgpu) | auto
//!
//! [mqtt]                             # optional: the MQTT control plane (fedfleet-control)
//! mode = "embedded"                  # embedded (default when the section is present) | external | off
//! listen = "127.0.0.1:8883"          # embedded broker's fleet-facing address (TLS, client certs)
//! # host = "broker.example"          # external: broker host (must match its certificate)
//! # port = 8883                      # external: broker port
//! # fleet = "acme"                   # must equal the PKI's fleet (default: the PKI's)
//! client_id = "aggregator"           # MQTT client id of this service
//! presence_ttl_secs = 90             # a device counts as online this long after its last status
//! max_connections = 16384            # embedded: most connections, devices and services together
//! reconnect_max_secs = 5             # ceiling of the reconnect backoff after the broker is lost
//! ```
//! Relative paths are resolved against the config file's directory. Without `[mqtt]` there is no
//! MQTT (QUIC only). `[mqtt]` is read by [`Config::load_all`] into a separate [`MqttConfig`]
//! (not a field of [`Config`], so code that builds a `Config` literally is unaffected).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use fedfleet_control::{MqttClientConfig, UnknownKeys};
use fedfleet_protocol::{DType, SpecJson};
use serde::{Deserialize, Serialize};

use crate::strategy::{ClientConfig, FedOptParams, StrategyConfig};

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {cause}")]
    Read { path: PathBuf, cause: std::io::Error },
    #[error("{path}: {detail}")]
    Parse { path: PathBuf, detail: String },
    #[error("{0}")]
    Invalid(String),
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub listen: SocketAddr,
    /// Operators' and services' own QUIC address (devices are refused there): a second socket
    /// whose receive buffer the fleet's datagrams never fill.
    #[serde(default)]
    pub operator_listen: Option<SocketAddr>,
    pub pki_dir: PathBuf,
    /// This service's identity: `servers/<server_identity>.crt|.key` in `pki_dir` (a file name,
    /// not a TLS name; the key was called `server_name` before and that spelling still reads).
    #[serde(default = "default_server_name", alias = "server_name")]
    pub server_identity: String,
    pub data_dir: PathBuf,
    #[serde(default)]
    pub metrics_addr: Option<SocketAddr>,
    /// Allow a non-loopback `metrics_addr` (metrics carry no authentication).
    #[serde(default)]
    pub metrics_public: bool,
    #[serde(default = "default_operators")]
    pub operators: Vec<String>,
    #[serde(default)]
    pub publish_dir: Option<PathBuf>,
    /// `[publish] registry = ...`: publish into a registry (else into `publish_dir`).
    #[serde(default)]
    pub publish: Option<PublishConfig>,
    pub model: ModelConfig,
    #[serde(default)]
    pub campaign: CampaignDefaults,
    #[serde(default)]
    pub compute: ComputeConfig,
    #[serde(default)]
    pub admission: AdmissionLimits,
    /// Relays (service certificate names) whose partial sums are merged into the open round.
    #[serde(default)]
    pub relays: Vec<String>,
    /// `[relay]`: this service is a regional relay (`fedfleet-aggregator relay`).
    #[serde(default)]
    pub relay: Option<RelayConfig>,
    /// `[secure_aggregation]`: every round is aggregated with SecAgg+; plain uploads are refused.
    #[serde(default)]
    pub secure_aggregation: Option<SecureAggregationConfig>,
    /// `[console]`: the operator API and dashboard (`fedfleet_http::console`; off unless set).
    #[serde(default)]
    pub console: Option<fedfleet_http::console::ConsoleConfig>,
    /// `[promotion]`: a published global model moves `alias` only if it beats the champion.
    #[serde(default)]
    pub promotion: Option<PromotionConfig>,
}

/// `[promotion]`: the promotion gate. Every global model is published as a candidate; it moves
/// `alias` (default `stable`) only if its server-side `metric` beats the version `alias` points
/// at by `margin` (higher is better; lower for `loss` and `rmse`). The decision and the
/// champion's figures go into the version's metrics (`gate_passed`, `gate_champion_version`,
/// `gate_champion_value`, `gate_margin`), so the version page shows why. Needs `[publish]` and
/// `model.validation`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PromotionConfig {
    pub metric: String,
    #[serde(default)]
    pub margin: f64,
    #[serde(default = "default_promotion_alias")]
    pub alias: String,
}

fn default_promotion_alias() -> String {
    "stable".into()
}

/// `[secure_aggregation]`: SecAgg+ (`fedfleet-secagg`) for every round of every campaign. The
/// aggregator learns the round's sum and nothing about any one device's update, as long as
/// fewer than the threshold of a device's neighbours collude with it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SecureAggregationConfig {
    /// Neighbours per device (even, 2..=254): each device shares its secrets with this many.
    pub degree: u16,
    /// Shares needed to rebuild a device's secrets, as a fraction of its neighbours (at least 2
    /// shares). Also the fewest devices a stage may end with.
    pub threshold_fraction: f64,
    /// Fractional bits of the fixed-point grid updates are quantized to.
    pub frac_bits: u8,
    /// Every weighted value (sample count × update coordinate) is clamped to ±clip.
    pub clip: f64,
    /// When the keys, shares, masked-input and unmask stages end, as fractions of the round's
    /// time from its opening to its deadline. A device joins after its local training, so its
    /// training must end before the keys stage does.
    pub stage_ends: [f64; 4],
}

impl Default for SecureAggregationConfig {
    fn default() -> Self {
        SecureAggregationConfig { degree: 16, threshold_fraction: 0.5, frac_bits: 24, clip: 1000.0, stage_ends: [0.5, 0.6, 0.85, 0.95] }
    }
}

impl SecureAggregationConfig {
    /// The protocol's parameters for a roster of `n` devices.
    pub fn params(&self, n: usize) -> fedfleet_secagg::Params {
        let neighbours = (self.degree as usize).min(n.saturating_sub(1));
        let threshold = ((neighbours as f64 * self.threshold_fraction).ceil() as usize).max(2);
        fedfleet_secagg::Params {
            threshold: threshold.min(u16::MAX as usize) as u16,
            degree: self.degree,
            frac_bits: self.frac_bits,
            clip: self.clip,
        }
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let bad = |s: String| Err(ConfigError::Invalid(format!("secure_aggregation.{s}")));
        if !(self.threshold_fraction > 0.0 && self.threshold_fraction <= 1.0) {
            return bad(format!("threshold_fraction {} must be in (0, 1]", self.threshold_fraction));
        }
        let ends = self.stage_ends;
        if ends.iter().any(|f| !(*f > 0.0 && *f < 1.0)) || ends.windows(2).any(|w| w[0] >= w[1]) {
            return bad(format!("stage_ends {ends:?} must rise strictly, each in (0, 1)"));
        }
        // The grid, degree and clip checked for 3 devices and for 65,536 (more than one roster
        // message carries): no roster is refused for its grid mid-campaign.
        self.params(3).validate(3).and_then(|_| self.params(1 << 16).validate(1 << 16)).or_else(|e| bad(format!("{e}")))
    }
}

/// `[relay]`: what a regional relay follows and where it forwards.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RelayConfig {
    /// The parent aggregator's QUIC address (its `operator_listen`, if it has one).
    pub parent: SocketAddr,
    #[serde(default = "default_parent_server_name")]
    pub parent_server_name: String,
    /// The parent's `receipt.pub`: its announcements and receipts are checked against it.
    pub parent_receipt_key: PathBuf,
    /// The devices this relay takes; empty: every enrolled device.
    #[serde(default)]
    pub region: Vec<fedfleet_protocol::DeviceId>,
    /// The region's sum is forwarded this long before the parent's deadline.
    #[serde(default = "default_forward_margin_secs")]
    pub forward_margin_secs: u64,
    #[serde(default = "default_relay_poll_ms")]
    pub poll_interval_ms: u64,
}

fn default_parent_server_name() -> String {
    "localhost".into()
}
fn default_forward_margin_secs() -> u64 {
    10
}
fn default_relay_poll_ms() -> u64 {
    1000
}

/// `[admission]`: what the service takes at once. Connections are cheap (a QUIC connection holds
/// no file descriptor; about 10 KB once connected, an estimated 20 KB once it has uploaded, and an
/// agent lets an idle one go after 30 s); the bytes of updates being received
/// are what is bounded. Operators and services have their own connections, never counted here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdmissionLimits {
    /// Device connections held at once; past it a device is closed as `overloaded`.
    pub max_connections: usize,
    /// Update payload bytes received and not yet committed, all uploads together; past it a
    /// QUIC upload is refused as `overloaded` (with a retry-after) before its payload is read,
    /// and an MQTT upload (its payload already here) waits while the broker queues the rest.
    pub max_bytes_in_flight: u64,
    /// The retry-after an overloaded device is told, in ms (devices add jitter).
    pub retry_after_ms: u64,
    /// The highest rate a round's invited devices are asked to arrive at: each round opens
    /// with a start window of (expected participants / rate) seconds, at most half its deadline
    /// (half the keys stage under secure aggregation), over which devices spread their downloads
    /// and uploads. A fresh service starts at a quarter of this and doubles it after each clean
    /// round, then follows what the service took in its last round (`crate::pacing`). 0 opens
    /// rounds without a window.
    pub arrivals_per_second: u32,
}

impl AdmissionLimits {
    /// `max_bytes_in_flight` as the KiB permits the ingest path takes (at least one).
    pub fn in_flight_kib(&self) -> u32 {
        self.max_bytes_in_flight.div_ceil(1024).clamp(1, u64::from(u32::MAX)) as u32
    }
}

impl Default for AdmissionLimits {
    fn default() -> Self {
        AdmissionLimits { max_connections: 16_384, max_bytes_in_flight: 256 << 20, retry_after_ms: 1_000, arrivals_per_second: 500 }
    }
}

/// `[compute] fold`: how a round's accepted updates become the next global model.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FoldBackend {
    /// Integer fixed-point streaming fold on the CPU as updates arrive: bit-identical for any
    /// arrival order and across restarts, on any machine.
    #[default]
    Exact,
    /// Burn tensors on `device`: the round's stored updates are folded in one canonical order
    /// (payload digest) at the deadline, then the server step (FedAvg, clipping, FedOpt) runs
    /// on the device. Deterministic for one device and build; robust strategies stay exact.
    Tensor,
}

/// `[compute]`: where the server math runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ComputeConfig {
    #[serde(default)]
    pub fold: FoldBackend,
    /// `cpu` (burn flex), `gpu` (burn wgpu; a build with `--features wgpu`) or `auto`.
    #[serde(default = "default_compute_device")]
    pub device: String,
}

impl Default for ComputeConfig {
    fn default() -> Self {
        ComputeConfig { fold: FoldBackend::Exact, device: default_compute_device() }
    }
}

fn default_compute_device() -> String {
    "auto".into()
}

fn default_server_name() -> String {
    "aggregator".into()
}
fn default_operators() -> Vec<String> {
    vec!["operator".into()]
}

/// `[mqtt] mode`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MqttMode {
    /// Run rumqttd in-process (`listen`) with the fleet CA and this service's certificate.
    #[default]
    Embedded,
    /// Connect to a broker at `host`:`port`, or to a cluster (`brokers`), e.g. mosquitto or NATS.
    External,
    /// No MQTT.
    Off,
}

/// `[mqtt]`: the control plane (announcements, receipts, device status, fallback uploads).
/// `host` (external mode), `port`, `fleet`, `client_id` (default `aggregator`) and
/// `reconnect_max_secs` are the keys every program's `[mqtt]` shares ([`MqttClientConfig`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MqttConfig {
    #[serde(default)]
    pub mode: MqttMode,
    /// Embedded broker address (port 0 picks one).
    #[serde(default = "default_mqtt_listen")]
    pub listen: SocketAddr,
    #[serde(flatten)]
    pub client: MqttClientConfig,
    #[serde(default = "fedfleet_control::presence::default_ttl_secs")]
    pub presence_ttl_secs: u64,
    /// The open round's announcement is published again this often (0: only when it changes
    /// and after a reconnect), so a device that missed it (a broker node lost while it was
    /// published, a retained copy behind on the node the device failed over to) hears it.
    /// Devices drop repeats unread.
    #[serde(default = "default_announce_every_secs")]
    pub announce_every_secs: u64,
    /// Embedded broker: most client connections, the fleet's devices and the services (this
    /// one, the registry) together.
    #[serde(default = "default_broker_max_connections")]
    pub max_connections: usize,
    #[serde(flatten, skip_serializing)]
    unknown: UnknownKeys,
}

/// As many as QUIC admits (`[admission] max_connections`): the broker's former 10,000 (its held
/// readiness probe among them) left a fleet of 10,000 devices short once the services connected.
fn default_broker_max_connections() -> usize {
    AdmissionLimits::default().max_connections
}

fn default_announce_every_secs() -> u64 {
    30
}

/// The client id the aggregator connects under unless `[mqtt] client_id` says otherwise.
pub const MQTT_CLIENT_ID: &str = "aggregator";

fn default_mqtt_listen() -> SocketAddr {
    ([127, 0, 0, 1], fedfleet_control::config::DEFAULT_PORT).into()
}

impl MqttConfig {
    /// Embedded broker on `listen`, everything else default.
    pub fn embedded(listen: SocketAddr) -> MqttConfig {
        MqttConfig {
            mode: MqttMode::Embedded,
            listen,
            client: MqttClientConfig::default(),
            presence_ttl_secs: fedfleet_control::presence::DEFAULT_TTL_SECS,
            announce_every_secs: default_announce_every_secs(),
            max_connections: default_broker_max_connections(),
            unknown: UnknownKeys::default(),
        }
    }

    fn validate(&self) -> Result<(), ConfigError> {
        self.unknown.check("mqtt").map_err(ConfigError::Invalid)?;
        if self.max_connections == 0 {
            return Err(ConfigError::Invalid("mqtt.max_connections must be at least 1".into()));
        }
        match self.mode {
            MqttMode::External => {
                self.client.addresses().map_err(|e| ConfigError::Invalid(format!("mqtt.mode = \"external\": {e}")))?;
            }
            MqttMode::Embedded if self.client.brokers.is_some() => {
                return Err(ConfigError::Invalid("mqtt.brokers names an external broker cluster: set mqtt.mode = \"external\"".into()));
            }
            _ => {}
        }
        Ok(())
    }
}

/// `[publish]`: where finalized models go when not into a directory.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PublishConfig {
    /// The registry's QUIC address.
    pub registry: SocketAddr,
    /// The TLS name in the registry's certificate.
    #[serde(default = "default_registry_name")]
    pub server_name: String,
}

fn default_registry_name() -> String {
    "localhost".into()
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    pub name: String,
    pub spec: fedfleet_learning::ModelSpec,
    pub initial: PathBuf,
    #[serde(default)]
    pub validation: Option<Validation>,
}

/// The data the aggregator scores each new global model on (its metrics go into the registry).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Validation {
    /// A built-in set: `"digits"` (the digits test split).
    Builtin(String),
    /// `.npy` arrays, as the agents' `[data] npy` reads them.
    Npy {
        features: PathBuf,
        #[serde(default)]
        labels: Option<PathBuf>,
    },
}

impl Validation {
    /// Loads the set.
    pub fn load(&self) -> Result<fedfleet_learning::Dataset, String> {
        use fedfleet_learning::{Dataset, Normalization};
        match self {
            Validation::Builtin(name) if name == "digits" => Dataset::digits_split().map(|(_, test)| test).map_err(|e| e.to_string()),
            Validation::Builtin(name) => Err(format!("{name:?}: only \"digits\" (the digits test split) is built in")),
            Validation::Npy { features, labels } => {
                Dataset::load_npy(features, labels.as_deref(), Normalization::None).map_err(|e| format!("{}: {e}", features.display()))
            }
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct CampaignDefaults {
    pub rounds: u32,
    /// Synchronous rounds or asynchronous buffers (FedBuff).
    pub mode: CampaignMode,
    /// `mode = "async"` only (default 32).
    pub max_staleness: Option<u32>,
    /// `strategy = "<name>"` and that strategy's own keys, read from `[campaign]` straight into
    /// the tagged [`CampaignStrategy`] (fedavg when absent). Unknown keys are refused there.
    #[serde(flatten, deserialize_with = "strategy_or_fedavg")]
    pub strategy: CampaignStrategy,
    pub target: u32,
    pub quorum: u32,
    pub deadline_secs: u64,
    pub extension_secs: u64,
    pub sampling_rate: f64,
    pub over_selection: f64,
    pub max_sample_count: u64,
    pub local_epochs: u32,
    pub batch_size: u32,
    #[serde(alias = "lr")]
    pub learning_rate: f32,
    /// The devices' local optimizer: "sgd" or "adam" (sent in every announcement).
    pub optimizer: String,
    /// FedProx proximal weight; > 0 turns FedAvg into FedProx.
    #[serde(alias = "mu", alias = "fedprox_mu")]
    pub proximal_mu: f32,
    pub quantization: String,
    pub max_consecutive_failures: u32,
    /// `[campaign.local_dp]`: every device clips and noises its own update before signing it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub local_dp: Option<LocalDpConfig>,
}

/// `[campaign.local_dp]`: local differential privacy. Each device clips its update to
/// `clip_norm` and adds Gaussian noise of σ = `noise_multiplier · clip_norm` to every coordinate
/// before it signs it, so even the aggregator (and anything that reads its store) sees only
/// noised updates. Costs far more accuracy than DP-FedAvg's noise on the sum: for a fleet that
/// trusts nobody with an update. The ε each device's own releases spend (δ = `delta`) is
/// reported per campaign.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LocalDpConfig {
    pub clip_norm: f64,
    pub noise_multiplier: f64,
    #[serde(default = "defaults::dp_delta")]
    pub delta: f64,
}

impl LocalDpConfig {
    /// What each device does to its update.
    pub fn device_privacy(&self) -> fedfleet_protocol::DevicePrivacy {
        fedfleet_protocol::DevicePrivacy {
            clip_norm: self.clip_norm,
            noise_stddev: self.noise_multiplier * self.clip_norm,
            count_once: false,
        }
    }

    /// The (ε at `delta`) one device's releases in `rounds` rounds spend: a Gaussian mechanism
    /// each, of sensitivity 2·`clip_norm` (any two updates of one device differ by at most
    /// that), so noise multiplier `noise_multiplier / 2`, composed without sampling.
    pub fn epsilon_per_device(&self, rounds: u64) -> f64 {
        let spend =
            fedfleet_rounds::privacy::DpSpend { sampling_rate: 1.0, noise_multiplier: self.noise_multiplier / 2.0, delta: self.delta };
        spend.epsilon_after(rounds)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        self.device_privacy().validate().map_err(|e| ConfigError::Invalid(format!("campaign.local_dp: {e}")))?;
        if !(self.noise_multiplier > 0.0 && self.delta > 0.0 && self.delta < 1.0) {
            return Err(ConfigError::Invalid(format!(
                "campaign.local_dp: noise_multiplier {} must be > 0 and delta {} in (0, 1)",
                self.noise_multiplier, self.delta
            )));
        }
        Ok(())
    }
}

impl Default for CampaignDefaults {
    fn default() -> Self {
        CampaignDefaults {
            rounds: 5,
            mode: CampaignMode::Rounds,
            max_staleness: None,
            strategy: CampaignStrategy::FedAvg {},
            target: 10,
            quorum: 2,
            deadline_secs: 600,
            extension_secs: 300,
            sampling_rate: 1.0,
            over_selection: 1.0,
            max_sample_count: 1 << 32,
            local_epochs: 1,
            batch_size: 32,
            learning_rate: 0.1,
            optimizer: "sgd".into(),
            proximal_mu: 0.0,
            quantization: "f32".into(),
            max_consecutive_failures: 3,
            local_dp: None,
        }
    }
}

/// `[campaign] mode`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CampaignMode {
    /// Synchronous rounds: a round's updates are all trained on its base model.
    #[default]
    Rounds,
    /// FedBuff: a buffer of `target` updates, each trained on a recent version, per new version.
    Async,
}

impl CampaignMode {
    pub fn as_str(self) -> &'static str {
        match self {
            CampaignMode::Rounds => "rounds",
            CampaignMode::Async => "async",
        }
    }
}

/// The campaign's strategy with its own parameters, as `[campaign]` spells it: the `strategy`
/// key names the variant and only that variant's keys may follow (the flat keys of earlier
/// configs, e.g. `strategy = "krum"`, `byzantine = 2`, `krum_select = 4`, read unchanged).
/// A missing parameter takes the default named on it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "strategy", deny_unknown_fields)]
pub enum CampaignStrategy {
    #[serde(rename = "fedavg")]
    FedAvg {},
    /// FedAvg whose clients add the proximal term (`proximal_mu` of `[campaign]`).
    #[serde(rename = "fedprox")]
    FedProx {},
    /// FedAvg with each update clipped to L2 norm `clip_norm` (default 10).
    #[serde(rename = "clipped_fedavg")]
    ClippedFedAvg {
        #[serde(default = "defaults::clip_norm")]
        clip_norm: f64,
    },
    /// DP-FedAvg (client-level differential privacy, noise added by the aggregator): each
    /// update clipped to `clip_norm` (default 1) and counted once, Gaussian noise of σ =
    /// `noise_multiplier` (default 1) × `clip_norm` on the sum, divided by the round's target.
    /// The ε of (ε, `delta`)-DP (default δ = 1e-5) is accounted after every round; with
    /// `epsilon_budget`, no round opens that would spend more.
    #[serde(rename = "dp_fedavg")]
    DpFedAvg {
        #[serde(default = "defaults::dp_clip_norm")]
        clip_norm: f64,
        #[serde(default = "defaults::noise_multiplier")]
        noise_multiplier: f64,
        #[serde(default = "defaults::dp_delta")]
        delta: f64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        epsilon_budget: Option<f64>,
        /// Adaptive clipping (Andrew et al. 2021): the clipping norm follows this quantile of
        /// the update norms (e.g. 0.5), starting at `clip_norm`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        clip_quantile: Option<f64>,
        /// Its geometric learning rate (default 0.2).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        clip_learning_rate: Option<f64>,
        /// The noise on its count of unclipped updates (default: the larger of target / 20 and
        /// the noise multiplier; it must be more than half the noise multiplier).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        clip_count_stddev: Option<f64>,
    },
    #[serde(rename = "fedadam")]
    FedAdam(FedOptKeys),
    #[serde(rename = "fedyogi")]
    FedYogi(FedOptKeys),
    #[serde(rename = "fedadagrad")]
    FedAdagrad(FedOptKeys),
    /// Coordinate-wise median over at most `max_updates` (default 256) updates a round.
    #[serde(rename = "median")]
    Median {
        #[serde(default = "defaults::max_updates")]
        max_updates: usize,
    },
    /// Coordinate-wise mean without `trim_fraction` (default 0.1) of the values at each end.
    #[serde(rename = "trimmed_mean")]
    TrimmedMean {
        #[serde(default = "defaults::trim_fraction")]
        trim_fraction: f64,
        #[serde(default = "defaults::max_updates")]
        max_updates: usize,
    },
    /// (Multi-)Krum tolerating `byzantine` (default 1) hostile updates, averaging the `select`
    /// (old key `krum_select`; default 1 = Krum) best-scored ones.
    #[serde(rename = "krum")]
    Krum {
        #[serde(default = "defaults::one")]
        byzantine: usize,
        #[serde(default = "defaults::one", alias = "krum_select")]
        select: usize,
        #[serde(default = "defaults::max_updates")]
        max_updates: usize,
    },
}

/// The keys of the FedOpt strategies (fedadam, fedyogi, fedadagrad).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FedOptKeys {
    /// Server learning rate η; other FedOpt parameters take Flower's defaults.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_lr: Option<f64>,
}

mod defaults {
    /// `max_staleness` of an async campaign. The typical lag is the devices training at once
    /// divided by `target`: 32 covers about 300 at once with the default target of 10
    /// (`bench_async`: 4 refused most updates of the slower half of 100 devices).
    pub const MAX_STALENESS: u32 = 32;
    pub fn clip_norm() -> f64 {
        10.0
    }
    pub fn dp_clip_norm() -> f64 {
        1.0
    }
    pub fn noise_multiplier() -> f64 {
        1.0
    }
    pub fn dp_delta() -> f64 {
        1e-5
    }
    pub fn trim_fraction() -> f64 {
        0.1
    }
    pub fn max_updates() -> usize {
        256
    }
    pub fn one() -> usize {
        1
    }
}

/// `[campaign]` without a `strategy` key runs FedAvg.
fn strategy_or_fedavg<'de, D: serde::Deserializer<'de>>(d: D) -> Result<CampaignStrategy, D::Error> {
    let mut keys = toml::Table::deserialize(d)?;
    keys.entry("strategy").or_insert_with(|| "fedavg".into());
    toml::Value::Table(keys).try_into().map_err(|e: toml::de::Error| serde::de::Error::custom(format!("campaign: {}", e.message())))
}

impl CampaignStrategy {
    /// The strategy `name` with default parameters.
    pub fn named(name: &str) -> Result<Self, ConfigError> {
        let mut keys = toml::Table::new();
        keys.insert("strategy".into(), name.into());
        toml::Value::Table(keys)
            .try_into()
            .map_err(|e: toml::de::Error| ConfigError::Invalid(format!("campaign.strategy: {}", e.message())))
    }

    /// Its `strategy` key.
    pub fn name(&self) -> &'static str {
        match self {
            CampaignStrategy::FedAvg {} => "fedavg",
            CampaignStrategy::FedProx {} => "fedprox",
            CampaignStrategy::ClippedFedAvg { .. } => "clipped_fedavg",
            CampaignStrategy::DpFedAvg { .. } => "dp_fedavg",
            CampaignStrategy::FedAdam(_) => "fedadam",
            CampaignStrategy::FedYogi(_) => "fedyogi",
            CampaignStrategy::FedAdagrad(_) => "fedadagrad",
            CampaignStrategy::Median { .. } => "median",
            CampaignStrategy::TrimmedMean { .. } => "trimmed_mean",
            CampaignStrategy::Krum { .. } => "krum",
        }
    }
}

impl CampaignDefaults {
    pub fn client(&self) -> ClientConfig {
        ClientConfig {
            local_epochs: self.local_epochs,
            batch_size: self.batch_size,
            learning_rate: self.learning_rate,
            proximal_mu: self.proximal_mu,
        }
    }

    pub fn dtype(&self) -> Result<DType, ConfigError> {
        DType::ALL.into_iter().find(|d| d.as_str() == self.quantization).ok_or_else(|| {
            ConfigError::Invalid(format!("campaign.quantization {:?}: expected one of f32, f16, bf16, i8", self.quantization))
        })
    }

    /// The engine's privacy accounting, for a `dp_fedavg` campaign.
    pub fn privacy(&self) -> Option<fedfleet_rounds::PrivacyPolicy> {
        match self.strategy {
            CampaignStrategy::DpFedAvg { noise_multiplier, delta, epsilon_budget, .. } => {
                Some(fedfleet_rounds::PrivacyPolicy { noise_multiplier, delta, epsilon_budget })
            }
            _ => None,
        }
    }

    /// The engine's asynchronous mode, if `mode = "async"`.
    pub fn buffer(&self) -> Option<fedfleet_rounds::BufferPolicy> {
        (self.mode == CampaignMode::Async)
            .then(|| fedfleet_rounds::BufferPolicy { max_staleness: self.max_staleness.unwrap_or(defaults::MAX_STALENESS) })
    }

    fn validate_mode(&self) -> Result<(), ConfigError> {
        use CampaignStrategy as S;
        match self.mode {
            CampaignMode::Rounds if self.max_staleness.is_some() => {
                Err(ConfigError::Invalid("campaign.max_staleness applies to mode = \"async\" only".into()))
            }
            CampaignMode::Async if matches!(self.strategy, S::DpFedAvg { .. }) => Err(ConfigError::Invalid(
                "campaign.strategy \"dp_fedavg\" accounts privacy per sampled round: it runs with mode = \"rounds\"".into(),
            )),
            CampaignMode::Async if matches!(self.strategy, S::Median { .. } | S::TrimmedMean { .. } | S::Krum { .. }) => {
                Err(ConfigError::Invalid(format!(
                    "campaign.strategy {:?} does not weigh updates, so it cannot discount stale ones: mode = \"async\" takes fedavg, fedprox, clipped_fedavg, fedadam, fedyogi or fedadagrad",
                    self.strategy.name()
                )))
            }
            _ => Ok(()),
        }
    }

    /// The round engine's strategy config: the tagged strategy plus the client settings.
    pub fn strategy_config(&self) -> StrategyConfig {
        use CampaignStrategy as S;
        let client = self.client();
        let opt = |mut p: FedOptParams, keys: &FedOptKeys| {
            if let Some(eta) = keys.server_lr {
                p.eta = eta;
            }
            p.eta_l = self.learning_rate as f64;
            p
        };
        match &self.strategy {
            S::FedAvg {} => StrategyConfig::FedAvg { client },
            S::FedProx {} => StrategyConfig::FedProx { client, proximal_mu: self.proximal_mu },
            &S::ClippedFedAvg { clip_norm } => StrategyConfig::ClippedFedAvg { client, clip_norm },
            // The denominator and the noise key are the campaign's: `campaign start` sets both.
            &S::DpFedAvg { clip_norm, noise_multiplier, clip_quantile, clip_learning_rate, clip_count_stddev, .. } => {
                StrategyConfig::DpFedAvg {
                    client,
                    clip_norm,
                    noise_multiplier,
                    expected_count: u64::from(self.target),
                    noise_seed: [0; 32],
                    adaptive: clip_quantile.map(|target_quantile| fedfleet_rounds::AdaptiveClipping {
                        target_quantile,
                        learning_rate: clip_learning_rate.unwrap_or(0.2),
                        count_stddev: clip_count_stddev.unwrap_or((f64::from(self.target) / 20.0).max(noise_multiplier)),
                    }),
                    // Set by the service: under secure aggregation the devices noise.
                    noise_on_devices: false,
                }
            }
            S::FedAdam(k) => StrategyConfig::FedAdam { client, params: opt(FedOptParams::adam(), k) },
            S::FedYogi(k) => StrategyConfig::FedYogi { client, params: opt(FedOptParams::yogi(), k) },
            S::FedAdagrad(k) => StrategyConfig::FedAdagrad { client, params: opt(FedOptParams::adagrad(), k) },
            &S::Median { max_updates } => StrategyConfig::Median { client, max_updates },
            &S::TrimmedMean { trim_fraction, max_updates } => StrategyConfig::TrimmedMean { client, trim_fraction, max_updates },
            &S::Krum { byzantine, select, max_updates } => StrategyConfig::Krum { client, byzantine, select, max_updates },
        }
    }
}

impl Config {
    /// A config with the file's defaults for everything but where it listens, its PKI, its
    /// state and its model: identity `aggregator`, operator `operator`, no metrics endpoint,
    /// publishing into `data_dir`'s publish directory, the default campaign, the exact fold.
    pub fn new(listen: SocketAddr, pki_dir: PathBuf, data_dir: PathBuf, model: ModelConfig) -> Config {
        Config {
            listen,
            operator_listen: None,
            pki_dir,
            server_identity: default_server_name(),
            data_dir,
            metrics_addr: None,
            metrics_public: false,
            operators: default_operators(),
            publish_dir: None,
            publish: None,
            model,
            campaign: CampaignDefaults::default(),
            compute: ComputeConfig::default(),
            admission: AdmissionLimits::default(),
            relays: Vec::new(),
            relay: None,
            secure_aggregation: None,
            console: None,
            promotion: None,
        }
    }

    /// Reads and checks `path`; relative paths inside are resolved against its directory.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        Ok(Self::load_all(path)?.0)
    }

    /// [`Config::load`] plus the optional `[mqtt]` section (`None` when absent or `mode = "off"`).
    pub fn load_all(path: &Path) -> Result<(Config, Option<MqttConfig>), ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|cause| ConfigError::Read { path: path.to_owned(), cause })?;
        Self::parse_all(path, &text)
    }

    /// [`Config::load_all`] of `text`, the contents of `path` (which is not read: it names the
    /// file in errors, and relative paths inside are resolved against its directory).
    pub fn parse_all(path: &Path, text: &str) -> Result<(Config, Option<MqttConfig>), ConfigError> {
        let parse = |e: toml::de::Error| ConfigError::Parse { path: path.to_owned(), detail: e.message().to_owned() };
        let mut table: toml::Table = toml::from_str(text).map_err(parse)?;
        let mqtt = match table.remove("mqtt") {
            None => None,
            Some(v) => {
                let m: MqttConfig = v.try_into().map_err(|e: toml::de::Error| ConfigError::Parse {
                    path: path.to_owned(),
                    detail: format!("[mqtt]: {}", e.message()),
                })?;
                m.validate()?;
                (m.mode != MqttMode::Off).then_some(m)
            }
        };
        let mut cfg: Config = toml::Value::Table(table).try_into().map_err(parse)?;
        let base = path.parent().unwrap_or(Path::new("."));
        cfg.resolve(base);
        if let Some(c) = cfg.console.as_mut() {
            c.resolve(base).map_err(ConfigError::Invalid)?;
        }
        cfg.validate()?;
        Ok((cfg, mqtt))
    }

    fn resolve(&mut self, base: &Path) {
        let fix = |p: &mut PathBuf| {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        };
        fix(&mut self.pki_dir);
        fix(&mut self.data_dir);
        fix(&mut self.model.initial);
        if let Some(Validation::Npy { features, labels }) = &mut self.model.validation {
            fix(features);
            labels.iter_mut().for_each(fix);
        }
        if let Some(p) = &mut self.publish_dir {
            fix(p);
        }
        if let Some(r) = &mut self.relay {
            fix(&mut r.parent_receipt_key);
        }
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        self.model.spec.validate().map_err(|e| ConfigError::Invalid(format!("model.spec: {e}")))?;
        self.campaign.dtype()?;
        self.campaign.validate_mode()?;
        if let Some(l) = &self.campaign.local_dp {
            l.validate()?;
            if self.campaign.privacy().is_some() {
                return Err(ConfigError::Invalid(
                    "campaign.local_dp and strategy \"dp_fedavg\" both noise the updates: pick one (local DP noises each update, DP-FedAvg the sum)".into(),
                ));
            }
        }
        if !matches!(self.campaign.optimizer.as_str(), "sgd" | "adam") {
            return Err(ConfigError::Invalid(format!("campaign.optimizer {:?}: expected sgd or adam", self.campaign.optimizer)));
        }
        if let Some(Validation::Builtin(name)) = &self.model.validation
            && name != "digits"
        {
            return Err(ConfigError::Invalid(format!(
                "model.validation {name:?}: only \"digits\" (the digits test split) is built in, or {{ features = \"x.npy\", labels = \"y.npy\" }}"
            )));
        }
        if let Some(p) = &self.promotion {
            if self.publish.is_none() {
                return Err(ConfigError::Invalid("[promotion] needs [publish]: the gate moves a registry alias".into()));
            }
            if self.model.validation.is_none() {
                return Err(ConfigError::Invalid("[promotion] needs model.validation: the gate compares server-side metrics".into()));
            }
            if p.metric.is_empty() || p.alias.is_empty() {
                return Err(ConfigError::Invalid("[promotion] metric and alias must not be empty".into()));
            }
            if !(p.margin.is_finite() && p.margin >= 0.0) {
                return Err(ConfigError::Invalid(format!("[promotion] margin {} must be a finite number >= 0", p.margin)));
            }
        }
        for name in &self.relays {
            fedfleet_certs::layout::validate_name(name).map_err(|e| ConfigError::Invalid(format!("relays: {name:?}: {e}")))?;
        }
        if !self.relays.is_empty() || self.relay.is_some() {
            self.takes_only_sums("relays", "a relay forwards one sum of its region's updates", Buffers::Discounted)?;
        }
        if let Some(s) = &self.secure_aggregation {
            s.validate()?;
            // A relay's rounds follow its parent's rounds or buffers: each is one synchronous
            // cohort of its region, whose sum an async parent discounts as a whole.
            let buffers = if self.relay.is_some() { Buffers::Discounted } else { Buffers::Refused };
            self.takes_only_sums("secure_aggregation", "the aggregator learns only the round's sum, never an update", buffers)?;
            if !self.relays.is_empty() {
                return Err(ConfigError::Invalid(
                    "secure_aggregation with `relays`: this service's round closes when its own devices' stages end, before its relays \
                     forward; put [secure_aggregation] on the relays instead (each region aggregates securely and forwards only its sum)"
                        .into(),
                ));
            }
        }
        if let Some(r) = &self.relay {
            if r.poll_interval_ms == 0 {
                return Err(ConfigError::Invalid("relay.poll_interval_ms must be > 0".into()));
            }
            if self.publish.is_some() {
                return Err(ConfigError::Invalid("[relay] forwards to its parent and publishes nothing: remove [publish]".into()));
            }
        }
        Ok(())
    }

    /// Refuses a strategy, mode or fold that needs each update when `what` gives the
    /// aggregator only sums (`why`). Under secure aggregation DP-FedAvg's devices clip and noise
    /// (its adaptive clipping, which needs each update's norm, is refused). `buffers`: whether
    /// async mode's staleness discount may apply to a whole sum (a relay's, gathered for one
    /// buffer) or not (secure aggregation's stages are per round, except on a relay).
    fn takes_only_sums(&self, what: &str, why: &str, buffers: Buffers) -> Result<(), ConfigError> {
        use crate::strategy::Strategy as _;
        let strategy = crate::strategy::ServerStrategy::new(&self.strategy_config(), 1)
            .map_err(|e| ConfigError::Invalid(format!("{what}: campaign.strategy: {e}")))?;
        let async_refused = buffers == Buffers::Refused && self.campaign.buffer().is_some();
        if !strategy.takes_partial_sums() || async_refused {
            return Err(ConfigError::Invalid(format!(
                "{what}: {why}; campaign.strategy {:?}{} needs every update \
                 ({what} works with fedavg, fedprox, fedadam, fedyogi and fedadagrad in {}{}){}",
                strategy.name(),
                if async_refused { " in async mode" } else { "" },
                if buffers == Buffers::Discounted { "rounds and async mode" } else { "rounds mode" },
                if self.secure_aggregation.is_some() {
                    ", and dp_fedavg with its noise on the devices"
                } else {
                    ", without differential privacy"
                },
                if async_refused {
                    "; for async mode put [secure_aggregation] on relays: each region is then one SecAgg+ cohort per buffer"
                } else {
                    ""
                },
            )));
        }
        if self.compute.fold == FoldBackend::Tensor {
            return Err(ConfigError::Invalid(format!("{what}: sums are merged by the exact fold; set [compute] fold = \"exact\"")));
        }
        Ok(())
    }

    /// The campaign's strategy as this service runs it: under secure aggregation DP-FedAvg's
    /// noise is added by the devices, split across them ([`Self::device_privacy`]).
    pub fn strategy_config(&self) -> StrategyConfig {
        let mut cfg = self.campaign.strategy_config();
        if let StrategyConfig::DpFedAvg { noise_on_devices, .. } = &mut cfg {
            *noise_on_devices = self.secure_aggregation.is_some();
        }
        cfg
    }

    /// What each device does to its update in a round that needs `min_quorum` updates: local
    /// DP's clipping and noise, or, for DP-FedAvg under secure aggregation, clipping and a
    /// `1/√min_quorum` share of the noise (a round publishes only with `min_quorum` updates or
    /// more, so their sum holds at least the noise the accountant counts).
    pub fn device_privacy(&self, min_quorum: u32) -> Option<fedfleet_protocol::DevicePrivacy> {
        if let Some(l) = &self.campaign.local_dp {
            return Some(l.device_privacy());
        }
        match (&self.campaign.strategy, self.secure_aggregation) {
            (&CampaignStrategy::DpFedAvg { clip_norm, noise_multiplier, .. }, Some(_)) => Some(fedfleet_protocol::DevicePrivacy {
                clip_norm,
                noise_stddev: fedfleet_rounds::DpMean::device_noise_stddev(noise_multiplier, clip_norm, min_quorum),
                count_once: true,
            }),
            _ => None,
        }
    }

    pub fn publish_dir(&self) -> PathBuf {
        self.publish_dir.clone().unwrap_or_else(|| self.data_dir.join("published"))
    }

    /// The model spec as JSON (what manifests carry).
    pub fn spec_json(&self) -> SpecJson {
        self.model.spec.spec_json()
    }
}

/// What the operator commands (`campaign start|status|stop`) read of a config: the service's
/// own `aggregator.toml`, or an operator's file naming only `pki_dir` (and perhaps `listen`), on
/// a host that has nothing else of the service's.
#[derive(Debug, Clone, Deserialize)]
pub struct OperatorConfig {
    pub pki_dir: PathBuf,
    pub listen: Option<SocketAddr>,
    /// The service's operators' address, preferred over `listen` when set.
    #[serde(default)]
    pub operator_listen: Option<SocketAddr>,
    /// The service's `[model]`, if this is its config (`campaign status` says which digest it
    /// shows under LoRA).
    #[serde(default)]
    model: Option<toml::Value>,
    /// The service's console: where the operator commands send their API requests.
    #[serde(default)]
    pub console: Option<fedfleet_http::console::ConsoleConfig>,
}

impl OperatorConfig {
    pub fn load(path: &Path) -> Result<OperatorConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|cause| ConfigError::Read { path: path.to_owned(), cause })?;
        let mut cfg: OperatorConfig =
            toml::from_str(&text).map_err(|e| ConfigError::Parse { path: path.to_owned(), detail: e.message().to_owned() })?;
        if cfg.pki_dir.is_relative() {
            cfg.pki_dir = path.parent().unwrap_or(Path::new(".")).join(&cfg.pki_dir);
        }
        Ok(cfg)
    }

    /// Whether the service's model is fine-tuned with LoRA (false when the file does not say).
    pub fn lora(&self) -> bool {
        let spec = self.model.as_ref().and_then(|m| m.get("spec")).and_then(|s| s.clone().try_into::<fedfleet_learning::ModelSpec>().ok());
        spec.is_some_and(|s| matches!(s.finetune(), fedfleet_learning::FineTune::Lora { .. }))
    }
}

/// How a service that takes only sums stands to async mode (see `Config::takes_only_sums`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Buffers {
    /// A sum made for one buffer is discounted by its staleness as a whole (relays).
    Discounted,
    /// Async mode is refused (secure aggregation on a service that is not a relay: its stages
    /// need one synchronous cohort, which a relay's region is for each buffer it follows).
    Refused,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_example_parses() {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("aggregator.toml");
        let cfg = Config::load(&p).unwrap();
        assert_eq!(cfg.campaign.strategy_config(), StrategyConfig::FedAvg { client: cfg.campaign.client() });
        assert_eq!(cfg.model.spec, fedfleet_learning::ModelSpec::digits_mlp());
        let (_, mqtt) = Config::load_all(&p).unwrap();
        assert_eq!(mqtt, Some(MqttConfig::embedded("127.0.0.1:8883".parse().unwrap())));
    }

    #[test]
    fn mqtt_section_modes() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.toml");
        let base = "listen = \"127.0.0.1:1\"\npki_dir = \"p\"\ndata_dir = \"d\"\n[model]\nname = \"m\"\n\
             spec = { arch = \"mlp\", input = [4], hidden = [4], classes = 2 }\ninitial = \"i\"\n";
        std::fs::write(&p, base).unwrap();
        assert_eq!(Config::load_all(&p).unwrap().1, None);
        std::fs::write(&p, format!("{base}[mqtt]\n")).unwrap();
        assert_eq!(Config::load_all(&p).unwrap().1.unwrap().mode, MqttMode::Embedded);
        std::fs::write(&p, format!("{base}[mqtt]\nmode = \"off\"\n")).unwrap();
        assert_eq!(Config::load_all(&p).unwrap().1, None);
        std::fs::write(&p, format!("{base}[mqtt]\nmode = \"external\"\n")).unwrap();
        assert!(Config::load_all(&p).unwrap_err().to_string().contains("host is missing"));
        std::fs::write(&p, format!("{base}[mqtt]\nmode = \"external\"\nbrokers = [\"n1:1883\", \"n2:1883\"]\n")).unwrap();
        let m = Config::load_all(&p).unwrap().1.unwrap();
        assert_eq!(m.client.addresses().unwrap(), vec![("n1".to_owned(), 1883), ("n2".to_owned(), 1883)]);
        std::fs::write(&p, format!("{base}[mqtt]\nbrokers = [\"n1:1883\"]\n")).unwrap();
        assert!(Config::load_all(&p).unwrap_err().to_string().contains("set mqtt.mode = \"external\""));
        std::fs::write(&p, format!("{base}[mqtt]\nmode = \"external\"\nhost = \"b\"\nport = 1883\n")).unwrap();
        let m = Config::load_all(&p).unwrap().1.unwrap();
        assert_eq!((m.mode, m.client.host.as_deref(), m.client.port), (MqttMode::External, Some("b"), Some(1883)));
        std::fs::write(&p, format!("{base}[mqtt]\nmode = \"external\"\nhost = \"b\"\nclientid = \"x\"\n")).unwrap();
        assert!(Config::load_all(&p).unwrap_err().to_string().contains("unknown key(s) clientid"));
    }

    #[test]
    fn relays_take_plain_weighted_means_and_a_relay_publishes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.toml");
        let load = |top: &str, rest: &str| {
            let text = format!(
                "listen = \"127.0.0.1:1\"\npki_dir = \"p\"\ndata_dir = \"d\"\n{top}\n[model]\nname = \"m\"\n\
                 spec = {{ arch = \"mlp\", input = [4], hidden = [4], classes = 2 }}\ninitial = \"i\"\n{rest}"
            );
            std::fs::write(&p, text).unwrap();
            Config::load(&p).map_err(|e| e.to_string())
        };
        let cfg = load("relays = [\"relay-eu\"]", "").unwrap();
        assert_eq!(cfg.relays, ["relay-eu"]);
        let err = load("relays = [\"relay-eu\"]", "[campaign]\nstrategy = \"median\"\n").unwrap_err();
        assert!(err.contains("\"median\" needs every update"), "{err}");
        // A relay's sum in a buffer is discounted by its staleness as a whole.
        assert!(load("relays = [\"relay-eu\"]", "[campaign]\nmode = \"async\"\n").unwrap().campaign.buffer().is_some());
        assert!(load("relays = [\"../x\"]", "").is_err());
        let relay = "[relay]\nparent = \"10.0.0.1:7401\"\nparent_receipt_key = \"root.pub\"\nregion = [\"dev-1\"]\n";
        let cfg = load("", relay).unwrap();
        let r = cfg.relay.unwrap();
        assert_eq!((r.parent_receipt_key, r.forward_margin_secs, r.region.len()), (dir.path().join("root.pub"), 10, 1));
        let err = load("", &format!("{relay}[publish]\nregistry = \"127.0.0.1:2\"\n")).unwrap_err();
        assert!(err.contains("remove [publish]"), "{err}");
        // A region aggregates securely on its relay; a parent with relays cannot also.
        assert!(load("", &format!("{relay}[secure_aggregation]\n")).unwrap().secure_aggregation.is_some());
        // In async mode a relay's region is one SecAgg+ cohort per buffer; a lone service has none.
        let secure_async = "[secure_aggregation]\n[campaign]\nmode = \"async\"\n";
        assert!(load("", &format!("{relay}{secure_async}")).unwrap().secure_aggregation.is_some());
        let err = load("", secure_async).unwrap_err();
        assert!(err.contains("in async mode") && err.contains("put [secure_aggregation] on relays"), "{err}");
        let err = load("relays = [\"relay-eu\"]", "[secure_aggregation]\n").unwrap_err();
        assert!(err.contains("put [secure_aggregation] on the relays"), "{err}");
        let err = load("", &format!("{relay}[campaign]\nstrategy = \"krum\"\n")).unwrap_err();
        assert!(err.contains("needs every update"), "{err}");
        // Secure aggregation: sums only, like relays, and not (yet) through relays.
        let secagg = "[secure_aggregation]\ndegree = 8\n";
        let cfg = load("", secagg).unwrap();
        let s = cfg.secure_aggregation.unwrap();
        assert_eq!((s.degree, s.frac_bits, s.params(20).threshold, s.params(3).threshold), (8, 24, 4, 2));
        // DP-FedAvg under secure aggregation: the devices clip and split the noise, a
        // `1/√quorum` share each; adaptive clipping (each update's norm) is refused.
        let dp = "[campaign]\nstrategy = \"dp_fedavg\"\nnoise_multiplier = 1.0\nclip_norm = 2.0\nquorum = 4\n";
        let cfg = load("", &format!("{secagg}{dp}")).unwrap();
        let p = cfg.device_privacy(4).expect("the devices noise");
        assert_eq!((p.clip_norm, p.noise_stddev, p.count_once), (2.0, 1.0, true));
        assert!(load("", dp).unwrap().device_privacy(4).is_none(), "without secure aggregation the aggregator noises");
        for (rest, says) in [
            ("[campaign]\nstrategy = \"median\"\n", "\"median\" needs every update"),
            (&format!("{dp}clip_quantile = 0.5\n"), "adaptive clipping"),
            ("[compute]\nfold = \"tensor\"\n", "exact fold"),
        ] {
            let err = load("", &format!("{secagg}{rest}")).unwrap_err();
            assert!(err.contains("secure_aggregation") && err.contains(says), "{rest}: {err}");
        }
        let err = load("relays = [\"relay-eu\"]", secagg).unwrap_err();
        assert!(err.contains("put [secure_aggregation] on the relays"), "{err}");
        for (bad, says) in [
            ("degree = 3", "degree 3 must be even"),
            ("threshold_fraction = 0.0", "threshold_fraction"),
            ("stage_ends = [0.5, 0.4, 0.8, 0.9]", "rise strictly"),
            ("clip = 1e30", "overflow"),
        ] {
            let err = load("", &format!("[secure_aggregation]\n{bad}\n")).unwrap_err();
            assert!(err.contains(says), "{bad}: {err}");
        }
    }

    #[test]
    fn local_dp_noises_on_each_device_and_excludes_dp_fedavg() {
        let l = campaign_of("[campaign.local_dp]\nclip_norm = 0.5\nnoise_multiplier = 4.0\n").unwrap().local_dp.unwrap();
        let p = l.device_privacy();
        assert_eq!((p.clip_norm, p.noise_stddev, p.count_once), (0.5, 2.0, false));
        // One Gaussian release of noise multiplier 2 (sensitivity 2C), composed over rounds.
        let one = l.epsilon_per_device(1);
        assert!(one > 0.0 && l.epsilon_per_device(10) > 2.0 * one, "{one}");
        for (keys, says) in [
            ("[campaign.local_dp]\nclip_norm = 0.0\nnoise_multiplier = 1.0\n", "clip_norm"),
            ("[campaign.local_dp]\nclip_norm = 1.0\nnoise_multiplier = 0.0\n", "noise_multiplier"),
            ("[campaign.local_dp]\nclip_norm = 1.0\n", "noise_multiplier"),
            ("[campaign.local_dp]\nclip_norm = 1.0\nnoise_multiplier = 1.0\nsigma = 2\n", "sigma"),
            ("strategy = \"dp_fedavg\"\n[campaign.local_dp]\nclip_norm = 1.0\nnoise_multiplier = 1.0\n", "pick one"),
        ] {
            let err = campaign_of(keys).unwrap_err();
            assert!(err.contains(says), "{keys}: {err}");
        }
    }

    /// `[campaign]` with `keys` under a minimal config, loaded.
    fn campaign_of(keys: &str) -> Result<CampaignDefaults, String> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.toml");
        let base = "listen = \"127.0.0.1:1\"\npki_dir = \"p\"\ndata_dir = \"d\"\n[model]\nname = \"m\"\n\
             spec = { arch = \"mlp\", input = [4], hidden = [4], classes = 2 }\ninitial = \"i\"\n[campaign]\n";
        std::fs::write(&p, format!("{base}{keys}")).unwrap();
        Config::load(&p).map(|c| c.campaign).map_err(|e| e.to_string())
    }

    #[test]
    fn async_mode_reads_its_staleness_bound_and_refuses_what_cannot_discount() {
        let c = campaign_of("mode = \"async\"\nmax_staleness = 2\nstrategy = \"fedadam\"\n").unwrap();
        assert_eq!(c.buffer(), Some(fedfleet_rounds::BufferPolicy { max_staleness: 2 }));
        assert_eq!(campaign_of("mode = \"async\"\n").unwrap().buffer(), Some(fedfleet_rounds::BufferPolicy { max_staleness: 32 }));
        assert_eq!(campaign_of("").unwrap().buffer(), None);
        let e = campaign_of("max_staleness = 2\n").unwrap_err();
        assert!(e.contains("max_staleness applies to mode = \"async\" only"), "{e}");
        let e = campaign_of("mode = \"async\"\nstrategy = \"median\"\n").unwrap_err();
        assert!(e.contains("\"median\" does not weigh updates"), "{e}");
        let e = campaign_of("mode = \"fedbuff\"\n").unwrap_err();
        assert!(e.contains("fedbuff"), "{e}");
    }

    #[test]
    fn client_keys_take_their_old_names_too() {
        for (keys, optimizer) in [
            ("lr = 0.3\nmu = 0.02\n", "sgd"),
            ("lr = 0.3\nfedprox_mu = 0.02\n", "sgd"),
            ("learning_rate = 0.3\nproximal_mu = 0.02\noptimizer = \"adam\"\n", "adam"),
        ] {
            let c = campaign_of(keys).unwrap();
            assert_eq!((c.learning_rate, c.proximal_mu, c.optimizer.as_str()), (0.3, 0.02, optimizer), "{keys}");
            let client = c.client();
            assert_eq!((client.learning_rate, client.proximal_mu), (0.3, 0.02));
        }
        assert!(campaign_of("optimizer = \"lbfgs\"\n").unwrap_err().contains("campaign.optimizer \"lbfgs\""));
    }

    #[test]
    fn campaign_reads_the_tagged_strategy() {
        let load = |keys: &str| campaign_of(&format!("rounds = 3\n{keys}"));
        let c = load("").unwrap();
        assert_eq!((c.strategy, c.rounds), (CampaignStrategy::FedAvg {}, 3));
        // The flat keys of earlier configs, krum_select included.
        let c = load("strategy = \"krum\"\nbyzantine = 2\nkrum_select = 3\ntarget = 9\n").unwrap();
        assert_eq!((c.strategy, c.target), (CampaignStrategy::Krum { byzantine: 2, select: 3, max_updates: 256 }, 9));
        let c = load("strategy = \"fedyogi\"\nserver_lr = 0.5\nlr = 0.2\n").unwrap();
        match c.strategy_config() {
            StrategyConfig::FedYogi { params, .. } => assert_eq!((params.eta, params.eta_l), (0.5, 0.2f32 as f64)),
            other => panic!("{other:?}"),
        }
        assert_eq!(load("strategy = \"clipped_fedavg\"\n").unwrap().strategy, CampaignStrategy::ClippedFedAvg { clip_norm: 10.0 });
        assert_eq!(
            CampaignStrategy::named("trimmed_mean").unwrap(),
            CampaignStrategy::TrimmedMean { trim_fraction: 0.1, max_updates: 256 }
        );
        // Another strategy's key, or a misspelt one, is refused by name.
        let e = load("strategy = \"fedavg\"\nclip_norm = 1.0\n").unwrap_err();
        assert!(e.contains("clip_norm"), "{e}");
        let e = load("strategy = \"krum\"\nbyzantin = 2\n").unwrap_err();
        assert!(e.contains("byzantin"), "{e}");
        // It writes back as it reads.
        let d = CampaignDefaults { strategy: CampaignStrategy::Krum { byzantine: 2, select: 3, max_updates: 8 }, ..Default::default() };
        let back: CampaignDefaults = toml::from_str(&toml::to_string(&d).unwrap()).unwrap();
        assert_eq!(back.strategy, d.strategy);
    }

    #[test]
    fn dp_fedavg_reads_its_privacy_keys_and_runs_in_rounds_only() {
        let c = campaign_of("strategy = \"dp_fedavg\"\nnoise_multiplier = 1.3\nepsilon_budget = 4.0\nsampling_rate = 0.1\ntarget = 7\n")
            .unwrap();
        assert_eq!(
            c.strategy,
            CampaignStrategy::DpFedAvg {
                clip_norm: 1.0,
                noise_multiplier: 1.3,
                delta: 1e-5,
                epsilon_budget: Some(4.0),
                clip_quantile: None,
                clip_learning_rate: None,
                clip_count_stddev: None
            }
        );
        assert_eq!(c.privacy(), Some(fedfleet_rounds::PrivacyPolicy { noise_multiplier: 1.3, delta: 1e-5, epsilon_budget: Some(4.0) }));
        match c.strategy_config() {
            StrategyConfig::DpFedAvg { clip_norm, noise_multiplier, expected_count, .. } => {
                assert_eq!((clip_norm, noise_multiplier, expected_count), (1.0, 1.3, 7))
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(campaign_of("").unwrap().privacy(), None);
        let c = campaign_of("strategy = \"dp_fedavg\"\nclip_quantile = 0.5\ntarget = 100\n").unwrap();
        match c.strategy_config() {
            StrategyConfig::DpFedAvg { adaptive: Some(a), .. } => {
                assert_eq!((a.target_quantile, a.learning_rate, a.count_stddev), (0.5, 0.2, 5.0))
            }
            other => panic!("{other:?}"),
        }
        let e = campaign_of("strategy = \"dp_fedavg\"\nmode = \"async\"\n").unwrap_err();
        assert!(e.contains("dp_fedavg") && e.contains("rounds"), "{e}");
        let e = campaign_of("strategy = \"dp_fedavg\"\nepsilon = 4.0\n").unwrap_err();
        assert!(e.contains("epsilon"), "{e}");
    }

    #[test]
    fn multi_krum_is_configured() {
        let d = CampaignDefaults { strategy: CampaignStrategy::Krum { byzantine: 2, select: 4, max_updates: 256 }, ..Default::default() };
        match d.strategy_config() {
            StrategyConfig::Krum { byzantine, select, .. } => assert_eq!((byzantine, select), (2, 4)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn bad_values_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.toml");
        std::fs::write(
            &p,
            "listen = \"127.0.0.1:1\"\npki_dir = \"p\"\ndata_dir = \"d\"\n[model]\nname = \"m\"\n\
             spec = { arch = \"mlp\", input = [4], hidden = [4], classes = 2 }\ninitial = \"i\"\n\
             [campaign]\nstrategy = \"fedmagic\"\n",
        )
        .unwrap();
        let e = Config::load(&p).unwrap_err().to_string();
        assert!(e.contains("fedmagic") && e.contains("krum"), "{e}");
        std::fs::write(&p, "listen = 3\n").unwrap();
        let e = Config::load(&p).unwrap_err().to_string();
        assert!(e.starts_with(&format!("{}:", p.display())), "{e}");
    }
}
