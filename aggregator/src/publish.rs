//! Publishing finalized global models.
//!
//! [`Publisher`] is what the service calls once per round. [`DirPublisher`] writes versions into a
//! directory (a stand-in for the registry, and what tests use):
//!
//! ```text
//! <dir>/<name>/<version, 8 digits>/model.safetensors
//!                                  manifest.json     (ModelManifest as JSON, for people)
//!                                  manifest.signed   (encoded Signed<ModelManifest>, receipt key)
//! ```
//!
//! A version directory is written under a temporary name, fsynced and renamed, so a crash never
//! leaves a half-visible version. Publishing is idempotent on `(parent, digest)`: after a crash
//! between publishing and recording it, the aggregator finalizes the round again (bit-identical)
//! and gets the same version back instead of a duplicate.
//!
//! A registry publisher over QUIC needs from the registry service: a `Publish` request carrying
//! name, spec, parent, metrics and the artifact (chunked, digest-checked), authorized for the
//! aggregator's service certificate, answered with the new `ModelManifest`, and idempotent on
//! `(name, parent, digest)` for the same reason.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;

use ed25519_dalek::SigningKey;
use fedfleet_protocol::{Digest, ModelManifest, ModelVersion, Signed};

/// One model to publish.
#[derive(Debug, Clone)]
pub struct PublishRequest {
    pub name: String,
    /// safetensors bytes.
    pub bundle: Vec<u8>,
    /// Model spec JSON.
    pub spec: String,
    pub parent: Option<ModelVersion>,
    pub metrics: BTreeMap<String, f64>,
    pub created_at_unix_ms: u64,
}

#[derive(Debug, thiserror::Error)]
#[error("publish failed: {0}")]
pub struct PublishError(pub String);

pub type PublishFuture<'a> =
    Pin<Box<dyn Future<Output = Result<(ModelVersion, Digest), PublishError>> + Send + 'a>>;

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
        DirPublisher {
            dir: dir.into(),
            key,
            publisher: publisher.into(),
        }
    }

    /// Path of a published version's model file.
    pub fn model_path(dir: &Path, name: &str, version: ModelVersion) -> PathBuf {
        dir.join(name).join(format!("{:08}", version.0)).join("model.safetensors")
    }

    /// The latest published version of `name` and its manifest.
    pub fn latest(dir: &Path, name: &str) -> std::io::Result<Option<ModelManifest>> {
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
        let latest = Self::latest(&self.dir, &req.name)?;
        if let Some(m) = &latest
            && m.digest == digest
            && m.parent == req.parent
        {
            return Ok((m.version, digest)); // a retry after a crash
        }
        let version = ModelVersion(latest.map(|m| m.version.0).unwrap_or(0) + 1);
        let manifest = ModelManifest {
            name: req.name.clone(),
            version,
            length: req.bundle.len() as u64,
            digest,
            spec: req.spec.clone(),
            parent: req.parent,
            metrics: req.metrics.clone(),
            created_at_unix_ms: req.created_at_unix_ms,
            publisher: self.publisher.clone(),
        };
        let model_dir = self.dir.join(&req.name);
        std::fs::create_dir_all(&model_dir)?;
        let tmp = model_dir.join(format!(".{:08}.tmp", version.0));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp)?;
        let json = serde_json::to_vec_pretty(&manifest).expect("manifest serializes");
        let signed = Signed::sign(manifest, &self.key).encode();
        for (file, bytes) in [
            ("model.safetensors", req.bundle.as_slice()),
            ("manifest.json", json.as_slice()),
            ("manifest.signed", signed.as_slice()),
        ] {
            crate::persist::write_atomic(&tmp.join(file), bytes)?;
        }
        std::fs::rename(&tmp, model_dir.join(format!("{:08}", version.0)))?;
        std::fs::File::open(&model_dir)?.sync_all()?;
        Ok((version, digest))
    }
}

impl Publisher for DirPublisher {
    fn publish<'a>(&'a self, req: &'a PublishRequest) -> PublishFuture<'a> {
        Box::pin(async move {
            self.publish_sync(req)
                .map_err(|e| PublishError(format!("{}: {e}", self.dir.display())))
        })
    }
}
