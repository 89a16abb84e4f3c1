//! Publishing finalized global models.
//!
//! [`Publisher`] is what the service calls once per round. [`DirPublisher`] writes versions into a
//! directory (a stand-in for the registry, and what tests use):
//!
//! ```text
//! <dir>/<name>/<version, 8 digits>/model.safetensors
//!                                  manifest.json     (ModelInfo as JSON, for people)
//!                                  manifest.signed   (encoded Signed<ModelInfo>, receipt key)
//! ```
//!
//! A version directory is written under a temporary name, fsynced and renamed, so a crash never
//! leaves a half-visible version. Publishing is idempotent on `(parent, digest)`: after a crash
//! between publishing and recording it, the aggregator finalizes the round again (bit-identical)
//! and gets the same version back instead of a duplicate.
//!
//! [`RegistryPublisher`] publishes into a running `fedfleet-registry` over QUIC (mTLS with the
//! aggregator's **service** certificate, which the registry's `operators` list must name): an
//! `AdminRequest::Publish` carrying the [`NewVersion`] (with this publisher's name), then the
//! artifact. The registry answers with the version; it is idempotent on `(name, parent, digest)`
//! against the head version (same crash-retry reason as above), and the digest it reports is
//! checked against the bytes sent.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;

use ed25519_dalek::SigningKey;
use fedfleet_protocol::{Digest, ModelInfo, ModelVersion, NewVersion, Signed};

/// One model to publish: what the service states about it, and its bytes. Each [`Publisher`]
/// names itself in `model.publisher`.
#[derive(Debug, Clone)]
pub struct PublishRequest {
    pub model: NewVersion,
    /// safetensors bytes.
    pub bundle: Vec<u8>,
}

#[derive(Debug, thiserror::Error)]
#[error("publish failed: {0}")]
pub struct PublishError(pub String);

pub type PublishFuture<'a> = Pin<Box<dyn Future<Output = Result<(ModelVersion, Digest), PublishError>> + Send + 'a>>;

/// Where finalized models go.
pub trait Publisher: Send + Sync + 'static {
    fn publish<'a>(&'a self, req: &'a PublishRequest) -> PublishFuture<'a>;
}

/// Versions in a directory (see the module docs).
pub struct DirPublisher {
    dir: PathBuf,
    key: SigningKey,
    publisher: String,
}

impl DirPublisher {
    pub fn new(dir: impl Into<PathBuf>, key: SigningKey, publisher: impl Into<String>) -> Self {
        DirPublisher { dir: dir.into(), key, publisher: publisher.into() }
    }

    /// Path of a published version's model file.
    pub fn model_path(dir: &Path, name: &str, version: ModelVersion) -> PathBuf {
        dir.join(name).join(format!("{:08}", version.0)).join("model.safetensors")
    }

    /// The latest published version of `name` and its manifest.
    pub fn latest(dir: &Path, name: &str) -> std::io::Result<Option<ModelInfo>> {
        let mut best: Option<u64> = None;
        match std::fs::read_dir(dir.join(name)) {
            Ok(rd) => {
                for e in rd {
                    let e = e?;
                    if let Some(v) = e.file_name().to_str().and_then(|s| s.parse::<u64>().ok()) {
                        best = best.max(Some(v));
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        }
        let Some(v) = best else { return Ok(None) };
        let p = dir.join(name).join(format!("{v:08}")).join("manifest.json");
        let text = std::fs::read(&p)?;
        serde_json::from_slice(&text)
            .map(Some)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{}: {e}", p.display())))
    }

    fn publish_sync(&self, req: &PublishRequest) -> std::io::Result<(ModelVersion, Digest)> {
        let digest = Digest::of(&req.bundle);
        let name = &req.model.name;
        let latest = Self::latest(&self.dir, name)?;
        if let Some(m) = &latest
            && m.digest == digest
            && m.parent == req.model.parent
        {
            return Ok((m.version, digest)); // a retry after a crash
        }
        let version = ModelVersion(latest.map(|m| m.version.0).unwrap_or(0) + 1);
        let new = NewVersion { publisher: self.publisher.clone(), ..req.model.clone() };
        let manifest = ModelInfo::published(new, version, req.bundle.len() as u64, digest);
        let model_dir = self.dir.join(name);
        std::fs::create_dir_all(&model_dir)?;
        let tmp = model_dir.join(format!(".{:08}.tmp", version.0));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp)?;
        let json = serde_json::to_vec_pretty(&manifest).expect("manifest serializes");
        let signed = Signed::sign(manifest, &self.key).encode();
        for (file, bytes) in
            [("model.safetensors", req.bundle.as_slice()), ("manifest.json", json.as_slice()), ("manifest.signed", signed.as_slice())]
        {
            crate::persist::write_atomic(&tmp.join(file), bytes)?;
        }
        let version_dir = model_dir.join(format!("{:08}", version.0));
        std::fs::rename(&tmp, &version_dir)?;
        fedfleet_durable::sync_parent(&version_dir)?;
        Ok((version, digest))
    }
}

impl Publisher for DirPublisher {
    fn publish<'a>(&'a self, req: &'a PublishRequest) -> PublishFuture<'a> {
        Box::pin(async move { self.publish_sync(req).map_err(|e| PublishError(format!("{}: {e}", self.dir.display()))) })
    }
}

/// Versions in a running registry (see the module docs).
pub struct RegistryPublisher {
    client: fedfleet_registry_client::client::RegistryClient,
    publisher: String,
}

impl RegistryPublisher {
    /// Wraps a client built with `fedfleet_certs::tls::service_client_config` for this
    /// aggregator's service identity. `publisher` is recorded with every version.
    pub fn new(client: fedfleet_registry_client::client::RegistryClient, publisher: impl Into<String>) -> Self {
        RegistryPublisher { client, publisher: publisher.into() }
    }

    /// A client for the registry at `addr` (TLS name `server_name`) with the service identity
    /// `service_name` of `pki_dir` (`servers/<service_name>.crt|.key`). Connects lazily; must
    /// be called inside a tokio runtime.
    pub fn connect_lazy(pki_dir: &Path, service_name: &str, addr: std::net::SocketAddr, server_name: &str) -> Result<Self, PublishError> {
        let ca = fedfleet_certs::CaCert::load(fedfleet_certs::layout::ca_cert(pki_dir))
            .map_err(|e| PublishError(format!("CA of {}: {e}", pki_dir.display())))?;
        let id = fedfleet_certs::ServerIdentity::load(pki_dir, service_name)
            .map_err(|e| PublishError(format!("service identity {service_name} in {}: {e}", pki_dir.display())))?;
        let tls = fedfleet_certs::tls::service_client_config(&ca, &id, &[fedfleet_certs::ALPN_V1])
            .map_err(|e| PublishError(format!("TLS config: {e}")))?;
        let client = fedfleet_registry_client::client::RegistryClient::new(addr, server_name, tls)
            .map_err(|e| PublishError(format!("registry client for {addr}: {e}")))?;
        Ok(Self::new(client, format!("fedfleet-aggregator/{service_name}")))
    }

    pub fn client(&self) -> &fedfleet_registry_client::client::RegistryClient {
        &self.client
    }
}

impl Publisher for RegistryPublisher {
    fn publish<'a>(&'a self, req: &'a PublishRequest) -> PublishFuture<'a> {
        Box::pin(async move {
            use fedfleet_registry_client::wire::AdminRequest;
            let admin = AdminRequest::Publish(NewVersion { publisher: self.publisher.clone(), ..req.model.clone() });
            let v = self.client.publish(admin, req.bundle.as_slice()).await.map_err(|e| PublishError(format!("registry: {e}")))?;
            let fedfleet_registry_client::admin::AdminAnswer::Published(p) = v else {
                return Err(PublishError(format!("registry answered a publish with {v:?}")));
            };
            let (version, digest) = (p.version, p.digest);
            if digest != Digest::of(&req.bundle) {
                return Err(PublishError(format!("registry stored digest {digest}, not the one sent")));
            }
            Ok((version, digest))
        })
    }
}
