//! `aggregator.toml`: the service configuration.
//!
//! ```toml
//! listen = "0.0.0.0:7400"            # QUIC (mTLS, ALPN fedfleet/1)
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
//! [model]
//! name = "digits"
//! spec = { arch = "mlp", input = [64], hidden = [64], classes = 10 }
//! initial = "initial.safetensors"    # written by `fedfleet-aggregator init-model`
//! validation = "digits"              # server-side evaluation: "digits" (test split), or arrays:
//!                                    # { features = "val-x.npy", labels = "val-y.npy" } (labels:
//!                                    # int classes, float regression targets, absent for autoencoders)
//!
//! [campaign]                         # defaults of `campaign start`
//! rounds = 5
//! strategy = "fedavg"                # fedavg fedprox clipped_fedavg fedadam fedyogi fedadagrad median trimmed_mean krum
//! target = 10
//! quorum = 2
//! deadline_secs = 600
//! extension_secs = 300
//! sampling_rate = 1.0
//! local_epochs = 1
//! batch_size = 32
//! lr = 0.1
//! mu = 0.0                           # FedProx
//! quantization = "f32"               # f32 f16 bf16 i8
//! # clip_norm = 10.0                 # clipped_fedavg: L2 bound of each update
//! # trim_fraction = 0.1              # trimmed_mean: fraction cut at each end
//! # byzantine = 1                    # krum: hostile updates tolerated
//! # krum_select = 1                  # krum: best updates averaged (1 = Krum, >1 = Multi-Krum)
//! # max_updates = 256                # robust strategies: updates held per round
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
//! reconnect_max_secs = 5             # ceiling of the reconnect backoff after the broker is lost
//! ```
//! Relative paths are resolved against the config file's directory. Without `[mqtt]` there is no
//! MQTT (QUIC only). `[mqtt]` is read by [`Config::load_all`] into a separate [`MqttConfig`]
//! (not a field of [`Config`], so code that builds a `Config` literally is unaffected).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use fedfleet_protocol::DType;
use serde::{Deserialize, Serialize};

use crate::strategy::{ClientConfig, FedOptParams, StrategyConfig};

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {detail}")]
    Parse { path: PathBuf, detail: String },
    #[error("{0}")]
    Invalid(String),
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub listen: SocketAddr,
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
    /// Connect to a broker at `host`:`port` (e.g. mosquitto, see the control crate's README).
    External,
    /// No MQTT.
    Off,
}

/// `[mqtt]`: the control plane (announcements, receipts, device status, fallback uploads).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MqttConfig {
    #[serde(default)]
    pub mode: MqttMode,
    /// Embedded broker address (port 0 picks one).
    #[serde(default = "default_mqtt_listen")]
    pub listen: SocketAddr,
    /// External broker host name or IP (must match the broker certificate).
    #[serde(default)]
    pub host: Option<String>,
    #[serde(default)]
    pub port: Option<u16>,
    /// The fleet id; must equal the PKI's (default: the PKI's).
    #[serde(default)]
    pub fleet: Option<String>,
    #[serde(default = "default_server_name")]
    pub client_id: String,
    #[serde(default = "default_presence_ttl")]
    pub presence_ttl_secs: u64,
    /// Ceiling of the reconnect backoff after the broker is lost (doubling from 200 ms).
    #[serde(default = "fedfleet_control::default_service_reconnect_max")]
    pub reconnect_max_secs: u64,
}

fn default_mqtt_listen() -> SocketAddr {
    ([127, 0, 0, 1], 8883).into()
}
fn default_presence_ttl() -> u64 {
    90
}

impl MqttConfig {
    /// Embedded broker on `listen`, everything else default.
    pub fn embedded(listen: SocketAddr) -> MqttConfig {
        MqttConfig {
            mode: MqttMode::Embedded,
            listen,
            host: None,
            port: None,
            fleet: None,
            client_id: default_server_name(),
            presence_ttl_secs: default_presence_ttl(),
            reconnect_max_secs: fedfleet_control::default_service_reconnect_max(),
        }
    }

    fn validate(&self) -> Result<(), ConfigError> {
        if self.mode == MqttMode::External && self.host.is_none() {
            return Err(ConfigError::Invalid("mqtt.mode = \"external\" needs mqtt.host".into()));
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
            Validation::Npy { features, labels } => Dataset::load_npy(features, labels.as_deref(), Normalization::None)
                .map_err(|e| format!("{}: {e}", features.display())),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CampaignDefaults {
    pub rounds: u32,
    pub strategy: String,
    pub target: u32,
    pub quorum: u32,
    pub deadline_secs: u64,
    pub extension_secs: u64,
    pub sampling_rate: f64,
    pub over_selection: f64,
    pub max_sample_count: u64,
    pub local_epochs: u32,
    pub batch_size: u32,
    pub lr: f32,
    pub mu: f32,
    pub quantization: String,
    /// FedOpt server learning rate (η); other FedOpt parameters take Flower's defaults.
    pub server_lr: Option<f64>,
    pub clip_norm: f64,
    pub trim_fraction: f64,
    pub byzantine: usize,
    /// Krum: how many of the best-scored updates are averaged (1 = Krum, more = Multi-Krum).
    pub krum_select: usize,
    /// Robust strategies keep every update of a round in memory: at most this many.
    pub max_updates: usize,
    pub max_consecutive_failures: u32,
}

impl Default for CampaignDefaults {
    fn default() -> Self {
        CampaignDefaults {
            rounds: 5,
            strategy: "fedavg".into(),
            target: 10,
            quorum: 2,
            deadline_secs: 600,
            extension_secs: 300,
            sampling_rate: 1.0,
            over_selection: 1.0,
            max_sample_count: 1 << 32,
            local_epochs: 1,
            batch_size: 32,
            lr: 0.1,
            mu: 0.0,
            quantization: "f32".into(),
            server_lr: None,
            clip_norm: 10.0,
            trim_fraction: 0.1,
            byzantine: 1,
            krum_select: 1,
            max_updates: 256,
            max_consecutive_failures: 3,
        }
    }
}

impl CampaignDefaults {
    pub fn client(&self) -> ClientConfig {
        ClientConfig {
            local_epochs: self.local_epochs,
            batch_size: self.batch_size,
            lr: self.lr,
            proximal_mu: self.mu,
        }
    }

    pub fn dtype(&self) -> Result<DType, ConfigError> {
        DType::ALL
            .into_iter()
            .find(|d| d.as_str() == self.quantization)
            .ok_or_else(|| {
                ConfigError::Invalid(format!(
                    "campaign.quantization {:?}: expected one of f32, f16, bf16, i8",
                    self.quantization
                ))
            })
    }

    pub fn strategy_config(&self) -> Result<StrategyConfig, ConfigError> {
        let client = self.client();
        let opt = |mut p: FedOptParams| {
            if let Some(eta) = self.server_lr {
                p.eta = eta;
            }
            p.eta_l = self.lr as f64;
            p
        };
        Ok(match self.strategy.as_str() {
            "fedavg" => StrategyConfig::FedAvg { client },
            "fedprox" => StrategyConfig::FedProx {
                client,
                mu: self.mu,
            },
            "clipped_fedavg" => StrategyConfig::ClippedFedAvg {
                client,
                clip_norm: self.clip_norm,
            },
            "fedadam" => StrategyConfig::FedAdam {
                client,
                params: opt(FedOptParams::adam()),
            },
            "fedyogi" => StrategyConfig::FedYogi {
                client,
                params: opt(FedOptParams::yogi()),
            },
            "fedadagrad" => StrategyConfig::FedAdagrad {
                client,
                params: opt(FedOptParams::adagrad()),
            },
            "median" => StrategyConfig::Median {
                client,
                max_updates: self.max_updates,
            },
            "trimmed_mean" => StrategyConfig::TrimmedMean {
                client,
                trim_fraction: self.trim_fraction,
                max_updates: self.max_updates,
            },
            "krum" => StrategyConfig::Krum {
                client,
                byzantine: self.byzantine,
                select: self.krum_select,
                max_updates: self.max_updates,
            },
            other => {
                return Err(ConfigError::Invalid(format!(
                    "campaign.strategy {other:?}: expected fedavg, fedprox, clipped_fedavg, \
                     fedadam, fedyogi, fedadagrad, median, trimmed_mean or krum"
                )));
            }
        })
    }
}

impl Config {
    /// Reads and checks `path`; relative paths inside are resolved against its directory.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        Ok(Self::load_all(path)?.0)
    }

    /// [`Config::load`] plus the optional `[mqtt]` section (`None` when absent or `mode = "off"`).
    pub fn load_all(path: &Path) -> Result<(Config, Option<MqttConfig>), ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse_all(path, &text)
    }

    /// [`Config::load_all`] of `text`, the contents of `path` (which is not read: it names the
    /// file in errors, and relative paths inside are resolved against its directory).
    pub fn parse_all(path: &Path, text: &str) -> Result<(Config, Option<MqttConfig>), ConfigError> {
        let parse = |e: toml::de::Error| ConfigError::Parse {
            path: path.to_owned(),
            detail: e.message().to_owned(),
        };
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
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        self.model
            .spec
            .validate()
            .map_err(|e| ConfigError::Invalid(format!("model.spec: {e}")))?;
        self.campaign.strategy_config()?;
        self.campaign.dtype()?;
        if let Some(Validation::Builtin(name)) = &self.model.validation
            && name != "digits"
        {
            return Err(ConfigError::Invalid(format!(
                "model.validation {name:?}: only \"digits\" (the digits test split) is built in, or {{ features = \"x.npy\", labels = \"y.npy\" }}"
            )));
        }
        Ok(())
    }

    pub fn publish_dir(&self) -> PathBuf {
        self.publish_dir
            .clone()
            .unwrap_or_else(|| self.data_dir.join("published"))
    }

    /// The model spec as JSON text (what manifests carry).
    pub fn spec_json(&self) -> String {
        serde_json::to_string(&self.model.spec).expect("spec serializes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_example_parses() {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("aggregator.toml");
        let cfg = Config::load(&p).unwrap();
        assert_eq!(cfg.campaign.strategy_config().unwrap(), StrategyConfig::FedAvg { client: cfg.campaign.client() });
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
        assert!(Config::load_all(&p).unwrap_err().to_string().contains("mqtt.host"));
        std::fs::write(&p, format!("{base}[mqtt]\nmode = \"external\"\nhost = \"b\"\nport = 1883\n")).unwrap();
        let m = Config::load_all(&p).unwrap().1.unwrap();
        assert_eq!((m.mode, m.host.as_deref(), m.port), (MqttMode::External, Some("b"), Some(1883)));
    }

    #[test]
    fn multi_krum_is_configured() {
        let d = CampaignDefaults { strategy: "krum".into(), byzantine: 2, krum_select: 4, ..Default::default() };
        match d.strategy_config().unwrap() {
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
        assert!(e.contains("campaign.strategy \"fedmagic\""), "{e}");
        std::fs::write(&p, "listen = 3\n").unwrap();
        let e = Config::load(&p).unwrap_err().to_string();
        assert!(e.starts_with(&format!("{}:", p.display())), "{e}");
    }
}
