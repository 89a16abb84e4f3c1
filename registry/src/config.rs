//! `registry.toml`: the service's configuration (every field has a default).
//!
//! ```toml
//! listen = "0.0.0.0:7443"          # QUIC (mTLS) address
//! data_dir = "/var/lib/fedfleet-registry"
//! pki_dir = "/etc/fedfleet/pki"    # from `fedfleet-certs init`
//! server_identity = "registry"     # pki servers/<name>.crt|.key (`fedfleet-certs issue-server`)
//! server_name = "localhost"        # TLS name the CLI connects with (a SAN of the server cert)
//! metrics = "127.0.0.1:9464"       # Prometheus; loopback unless metrics_public = true
//! chunk_size = 1048576             # bytes per chunk for new publishes
//! operators = ["operator"]         # service certs allowed to send operator commands
//! operator_identity = "operator"   # the cert the CLI presents while `serve` holds the store
//! timestamp_ttl_secs = 3600        # timestamp and assignment lifetime
//! targets_ttl_days = 7
//! root_days = 365                  # validity of a root made by init-keys / first serve
//! max_connections = 16384         # device connections (a device that polls holds one; idle ones close after 30 s)
//!
//! [renewal]                        # optional: renew device certificates over their mTLS identity
//! ca_key = "pki/ca.key"            # the fleet CA key (this registry then holds it: guard the host)
//! days = 365                       # validity of a renewed certificate (never past the CA's)
//!
//! [object_store]                   # optional: artifacts also in an S3-compatible bucket (see `objects`)
//! bucket = "fedfleet-models"
//! endpoint = "http://127.0.0.1:8333"   # absent: AWS S3; credentials from AWS_* or the two keys below
//! allow_http = true                # a plain-HTTP endpoint (loopback or a private network)
//! # access_key_id = "..."  secret_access_key_file = "s3.secret"
//!
//! [mqtt]                           # optional: the MQTT control plane (see `mqtt`)
//! host = "127.0.0.1"               # the aggregator's embedded broker or an external one
//! port = 8883
//! ```

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::RegistryError;

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub listen: SocketAddr,
    pub data_dir: PathBuf,
    pub pki_dir: PathBuf,
    pub server_identity: String,
    pub server_name: String,
    pub metrics: Option<SocketAddr>,
    pub metrics_public: bool,
    pub chunk_size: u32,
    pub operators: Vec<String>,
    pub operator_identity: String,
    pub timestamp_ttl_secs: u64,
    pub targets_ttl_days: u64,
    pub root_days: u32,
    pub max_connections: usize,
    /// The MQTT control plane (absent: QUIC only).
    pub mqtt: Option<crate::mqtt::MqttConfig>,
    /// Device certificate renewal (absent: devices' renewal requests are refused).
    pub renewal: Option<RenewalConfig>,
    /// Artifacts mirrored to an S3-compatible bucket (absent: served by the registry only).
    pub object_store: Option<crate::objects::ObjectStoreConfig>,
    /// `[console]`: the operator API and dashboard (off unless set).
    pub console: Option<fedfleet_http::console::ConsoleConfig>,
}

/// `[renewal]`: the registry signs renewed device certificates with the fleet CA key. The
/// registry already holds the fleet's device state (reports, revocation); no other service
/// holds the CA key, so it is configured here explicitly.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RenewalConfig {
    /// The fleet CA private key (`ca.key` of the PKI directory); relative to the config file.
    pub ca_key: PathBuf,
    /// Validity of a renewed certificate, in days.
    #[serde(default = "default_renewal_days")]
    pub days: u32,
}

fn default_renewal_days() -> u32 {
    fedfleet_certs::LEAF_DAYS
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: ([0, 0, 0, 0], 7443).into(),
            data_dir: PathBuf::from("registry-data"),
            pki_dir: PathBuf::from("pki"),
            server_identity: "registry".into(),
            server_name: "localhost".into(),
            metrics: Some(([127, 0, 0, 1], 9464).into()),
            metrics_public: false,
            chunk_size: crate::store::DEFAULT_CHUNK_SIZE,
            operators: vec!["operator".into()],
            operator_identity: "operator".into(),
            timestamp_ttl_secs: 3600,
            targets_ttl_days: 7,
            root_days: 365,
            max_connections: 16384,
            mqtt: None,
            renewal: None,
            object_store: None,
            console: None,
        }
    }
}

impl Config {
    /// Reads `path`; relative directories are taken relative to the file's directory.
    pub fn load(path: &Path) -> Result<Self, RegistryError> {
        let text = std::fs::read_to_string(path).map_err(|cause| RegistryError::Io { path: path.to_owned(), cause })?;
        Self::parse(path, &text)
    }

    /// [`Config::load`] of `text`, the contents of `path` (which is not read: it names the file
    /// in errors, and relative directories are taken relative to its directory).
    pub fn parse(path: &Path, text: &str) -> Result<Self, RegistryError> {
        let mut c: Config = toml::from_str(text).map_err(|e| RegistryError::Config(format!("{}: {e}", path.display())))?;
        if let Some(m) = &c.mqtt {
            m.validate().map_err(|e| RegistryError::Config(format!("{}: {e}", path.display())))?;
        }
        if let Some(o) = &c.object_store {
            o.validate().map_err(|e| RegistryError::Config(format!("{}: {e}", path.display())))?;
        }
        let base = path.parent().unwrap_or(Path::new("."));
        if let Some(console) = c.console.as_mut() {
            console.resolve(base).map_err(|e| RegistryError::Config(format!("{}: {e}", path.display())))?;
        }
        let secret = c.object_store.as_mut().and_then(|o| o.secret_access_key_file.as_mut());
        for d in [&mut c.data_dir, &mut c.pki_dir].into_iter().chain(c.renewal.as_mut().map(|r| &mut r.ca_key)).chain(secret) {
            if d.is_relative() {
                *d = base.join(&*d);
            }
        }
        Ok(c)
    }

    pub fn store_dir(&self) -> PathBuf {
        self.data_dir.join("store")
    }

    pub fn spool_dir(&self) -> PathBuf {
        self.data_dir.join("incoming")
    }

    pub fn lifetimes(&self) -> crate::metadata::Lifetimes {
        crate::metadata::Lifetimes {
            targets_ms: self.targets_ttl_days.max(1) * 24 * 3600 * 1000,
            timestamp_ms: self.timestamp_ttl_secs.max(10) * 1000,
        }
    }
}
