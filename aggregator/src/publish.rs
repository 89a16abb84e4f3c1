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

use std::collections::BTreeMap;
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

    /// The version `alias` of `name` points at, with its metrics (`None`: no such alias).
    fn alias_version<'a>(&'a self, name: &'a str, alias: &'a str) -> AliasFuture<'a, Option<(ModelVersion, BTreeMap<String, f64>)>> {
        let _ = (name, alias);
        Box::pin(async { Err(PublishError("this publisher keeps no aliases".into())) })
    }

    /// Points `alias` of `name` at `version`.
    fn set_alias<'a>(&'a self, name: &'a str, alias: &'a str, version: ModelVersion) -> AliasFuture<'a, ()> {
        let _ = (name, alias, version);
        Box::pin(async { Err(PublishError("this publisher keeps no aliases".into())) })
    }
}

/// What the alias calls of a [`Publisher`] return.
pub type AliasFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, PublishError>> + Send + 'a>>;

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

    fn alias_version<'a>(&'a self, name: &'a str, alias: &'a str) -> AliasFuture<'a, Option<(ModelVersion, BTreeMap<String, f64>)>> {
        Box::pin(async move {
            use fedfleet_registry_client::admin::AdminAnswer;
            use fedfleet_registry_client::wire::AdminRequest;
            let listing = self.client.admin(AdminRequest::List).await.map_err(|e| PublishError(format!("registry: {e}")))?;
            let AdminAnswer::Models { models } = listing else {
                return Err(PublishError(format!("registry answered a listing with {listing:?}")));
            };
            let Some(version) = models.iter().find(|m| m.name == name).and_then(|m| m.aliases.get(alias).copied()) else {
                return Ok(None);
            };
            let shown = self
                .client
                .admin(AdminRequest::Show { name: name.to_owned(), version: Some(version) })
                .await
                .map_err(|e| PublishError(format!("registry: {e}")))?;
            match shown {
                AdminAnswer::Version(v) => Ok(Some((version, v.model.metrics))),
                other => Err(PublishError(format!("registry answered show with {other:?}"))),
            }
        })
    }

    fn set_alias<'a>(&'a self, name: &'a str, alias: &'a str, version: ModelVersion) -> AliasFuture<'a, ()> {
        Box::pin(async move {
            use fedfleet_registry_client::wire::AdminRequest;
            let req = AdminRequest::AliasSet { name: name.to_owned(), alias: alias.to_owned(), version };
            self.client.admin(req).await.map(|_| ()).map_err(|e| PublishError(format!("registry: {e}")))
        })
    }
}

/// The promotion gate's decision for a candidate with `candidate` metrics against the
/// champion's (`None`: no champion yet, the candidate wins): `Ok` with the reason it wins, or
/// `Err` with the reason it stays a candidate. Higher `metric` is better, lower for `loss`
/// and `rmse`.
pub fn promotion_gate(
    candidate: &BTreeMap<String, f64>,
    champion: Option<(ModelVersion, &BTreeMap<String, f64>)>,
    metric: &str,
    margin: f64,
) -> Result<String, String> {
    let lower_is_better = matches!(metric, "loss" | "rmse");
    let Some(value) = candidate.get(metric).copied().filter(|v| v.is_finite()) else {
        return Err(format!("the candidate has no {metric} metric"));
    };
    let Some((version, champion)) = champion else {
        return Ok(format!("{metric} {value:.4}; no champion yet"));
    };
    let Some(best) = champion.get(metric).copied().filter(|v| v.is_finite()) else {
        return Ok(format!("{metric} {value:.4}; the champion v{version} has no {metric}"));
    };
    let gain = if lower_is_better { best - value } else { value - best };
    if gain > margin {
        Ok(format!("{metric} {value:.4} beats v{version}'s {best:.4} by {gain:.4} (margin {margin})"))
    } else {
        Err(format!("{metric} {value:.4} does not beat v{version}'s {best:.4} by more than {margin}"))
    }
}

/// Whether a published version whose signed `metrics` hold the gate's decision still has its
/// promotion to finish: it passed, and the alias (now at `alias_now`) still points at the
/// champion it was compared against (an alias moved since, by a later round or an operator,
/// stays where it is).
pub fn promotion_unfinished(metrics: &BTreeMap<String, f64>, alias_now: Option<ModelVersion>) -> bool {
    let champion = metrics.get("gate_champion_version").map(|v| ModelVersion(*v as u64));
    metrics.get("gate_passed") == Some(&1.0) && alias_now == champion
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_passed_promotion_is_finished_only_while_the_alias_is_still_at_the_champion() {
        let passed = BTreeMap::from([("gate_passed".to_owned(), 1.0), ("gate_champion_version".to_owned(), 2.0)]);
        assert!(promotion_unfinished(&passed, Some(ModelVersion(2))), "the alias never moved");
        assert!(!promotion_unfinished(&passed, Some(ModelVersion(3))), "it moved (to this version or by an operator)");
        let first = BTreeMap::from([("gate_passed".to_owned(), 1.0)]);
        assert!(promotion_unfinished(&first, None), "no champion then, no alias now");
        assert!(!promotion_unfinished(&first, Some(ModelVersion(1))));
        let failed = BTreeMap::from([("gate_passed".to_owned(), 0.0), ("gate_champion_version".to_owned(), 2.0)]);
        assert!(!promotion_unfinished(&failed, Some(ModelVersion(2))), "a candidate stays a candidate");
        assert!(!promotion_unfinished(&BTreeMap::new(), None), "no gate");
    }

    fn m(metric: &str, v: f64) -> BTreeMap<String, f64> {
        BTreeMap::from([(metric.to_owned(), v)])
    }

    #[test]
    fn the_gate_promotes_only_a_candidate_that_beats_the_champion_by_the_margin() {
        let champion = m("accuracy", 0.90);
        assert!(promotion_gate(&m("accuracy", 0.92), Some((ModelVersion(3), &champion)), "accuracy", 0.01).is_ok());
        let refused = promotion_gate(&m("accuracy", 0.905), Some((ModelVersion(3), &champion)), "accuracy", 0.01).unwrap_err();
        assert!(refused.contains("does not beat v3's 0.9000"), "{refused}");
        // Lower is better for the loss.
        let champion = m("loss", 0.5);
        assert!(promotion_gate(&m("loss", 0.4), Some((ModelVersion(2), &champion)), "loss", 0.05).is_ok());
        assert!(promotion_gate(&m("loss", 0.6), Some((ModelVersion(2), &champion)), "loss", 0.0).is_err());
        // No champion: the first candidate wins; a candidate without the metric never does.
        assert!(promotion_gate(&m("accuracy", 0.1), None, "accuracy", 0.5).is_ok());
        assert!(promotion_gate(&m("loss", 0.1), None, "accuracy", 0.0).unwrap_err().contains("no accuracy"));
        assert!(promotion_gate(&m("accuracy", f64::NAN), None, "accuracy", 0.0).is_err());
    }
}
