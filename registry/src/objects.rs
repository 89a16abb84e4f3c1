//! Artifacts in an S3-compatible object store (`[object_store]` in `registry.toml`).
//!
//! The registry stays the signer and the source of truth for metadata. Every artifact it stores
//! is also written, whole, to `<prefix>artifacts/<BLAKE3 hex>` in a bucket, so agents, and any
//! HTTP mirror or CDN in front of the bucket, can serve it without the registry. The key is the
//! content's digest: an upload is idempotent, an object never changes meaning, and agents check
//! every byte against the signed TUF target, so the store and the mirrors need no trust.
//!
//! Uploads are multipart: S3 makes an object visible only when its upload completes, so a crash
//! never leaves half an artifact under its key. A publish waits for its upload; an upload that
//! fails is retried by [`ArtifactMirror::run`], which on start also uploads every artifact the
//! bucket lacks (versions published while the store was unreachable, or by the offline CLI).
//!
//! Credentials: `access_key_id` and `secret_access_key_file` in the section, else the standard
//! `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` (and `AWS_SESSION_TOKEN`) environment.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use fedfleet_protocol::Digest;
use object_store::aws::AmazonS3Builder;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, WriteMultipart};
use serde::Deserialize;

use crate::RegistryError;
use crate::ops::Registry;

/// `[object_store]`: where artifacts are mirrored.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ObjectStoreConfig {
    pub bucket: String,
    /// The S3 endpoint (`http://127.0.0.1:8333` for a local SeaweedFS); absent: AWS S3 itself.
    #[serde(default)]
    pub endpoint: Option<String>,
    #[serde(default = "default_region")]
    pub region: String,
    /// Key prefix inside the bucket (`fleet-a/` puts artifacts under `fleet-a/artifacts/`).
    #[serde(default)]
    pub prefix: String,
    /// Plain `http://` endpoints are refused unless set (a store on loopback or a private net).
    #[serde(default)]
    pub allow_http: bool,
    #[serde(default)]
    pub access_key_id: Option<String>,
    /// A file holding the secret key (relative to `registry.toml`).
    #[serde(default)]
    pub secret_access_key_file: Option<PathBuf>,
}

fn default_region() -> String {
    "us-east-1".into()
}

impl ObjectStoreConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.bucket.is_empty() {
            return Err("[object_store] bucket is empty".into());
        }
        if !self.prefix.is_empty() && (self.prefix.starts_with('/') || !self.prefix.ends_with('/')) {
            return Err(format!("[object_store] prefix {:?} must not start with '/' and must end with '/'", self.prefix));
        }
        if self.access_key_id.is_some() != self.secret_access_key_file.is_some() {
            return Err("[object_store] access_key_id and secret_access_key_file go together".into());
        }
        if let Some(e) = &self.endpoint
            && e.starts_with("http://")
            && !self.allow_http
        {
            return Err(format!("[object_store] endpoint {e} is plain HTTP; set allow_http = true to use it"));
        }
        Ok(())
    }
}

/// The object key of an artifact, under `prefix` (`""` or ending in `/`).
pub fn artifact_key(prefix: &str, digest: &Digest) -> String {
    format!("{prefix}artifacts/{}", digest.to_hex())
}

/// What [`ArtifactMirror::upload`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Upload {
    Written,
    AlreadyThere,
}

/// Bytes of an artifact handed to one multipart part (S3 needs at least 5 MiB but the last).
const PART_BYTES: usize = 8 << 20;
/// Parts in flight at once.
const PARTS_IN_FLIGHT: usize = 2;
/// How long a publish waits for its upload before answering (then the background retries it).
const PUBLISH_WAIT: Duration = Duration::from_secs(60);
/// Wait before an upload that failed is tried again.
const RETRY_AFTER: Duration = Duration::from_secs(15);

/// The registry's bucket, and the queue of artifacts it still lacks.
pub struct ArtifactMirror {
    store: Arc<dyn ObjectStore>,
    prefix: String,
    describe: String,
    retry_tx: tokio::sync::mpsc::UnboundedSender<Digest>,
    retry_rx: std::sync::Mutex<Option<tokio::sync::mpsc::UnboundedReceiver<Digest>>>,
}

impl std::fmt::Debug for ArtifactMirror {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe)
    }
}

impl ArtifactMirror {
    /// A client for the configured bucket (nothing is contacted yet).
    pub fn open(cfg: &ObjectStoreConfig) -> Result<ArtifactMirror, RegistryError> {
        cfg.validate().map_err(RegistryError::Config)?;
        // reqwest's rustls takes the process-wide provider: ring, as everywhere else here.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut b = AmazonS3Builder::from_env().with_bucket_name(&cfg.bucket).with_region(&cfg.region).with_allow_http(cfg.allow_http);
        if let Some(e) = &cfg.endpoint {
            b = b.with_endpoint(e);
        }
        if let (Some(id), Some(file)) = (&cfg.access_key_id, &cfg.secret_access_key_file) {
            let secret = std::fs::read_to_string(file).map_err(|cause| RegistryError::Io { path: file.clone(), cause })?;
            b = b.with_access_key_id(id).with_secret_access_key(secret.trim());
        }
        let store = b.build().map_err(|e| RegistryError::Config(format!("[object_store]: {e}")))?;
        let describe = format!("s3://{}/{} at {}", cfg.bucket, cfg.prefix, cfg.endpoint.as_deref().unwrap_or("AWS"));
        let (retry_tx, retry_rx) = tokio::sync::mpsc::unbounded_channel();
        Ok(ArtifactMirror {
            store: Arc::new(store),
            prefix: cfg.prefix.clone(),
            describe,
            retry_tx,
            retry_rx: std::sync::Mutex::new(Some(retry_rx)),
        })
    }

    fn key(&self, digest: &Digest) -> ObjectPath {
        ObjectPath::from(artifact_key(&self.prefix, digest))
    }

    /// Whether the bucket holds the artifact (its length checked; its bytes are the readers' to check).
    pub async fn contains(&self, digest: &Digest, length: u64) -> Result<bool, object_store::Error> {
        match self.store.head(&self.key(digest)).await {
            Ok(meta) => Ok(meta.size == length),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Writes the artifact `digest` from the registry's store, unless the bucket holds it.
    pub async fn upload(&self, reg: &Arc<Registry>, digest: Digest) -> Result<Upload, RegistryError> {
        let s3 = |e: object_store::Error| RegistryError::Config(format!("object store {}: {e}", self.describe));
        let art = reg.store().artifact(&digest)?;
        if self.contains(&digest, art.length).await.map_err(s3)? {
            return Ok(Upload::AlreadyThere);
        }
        let upload = self.store.put_multipart(&self.key(&digest)).await.map_err(s3)?;
        let mut w = WriteMultipart::new_with_chunk_size(upload, PART_BYTES);
        let mut hasher = fedfleet_protocol::Hasher::new();
        for c in art.chunks {
            let r = reg.clone();
            let bytes = tokio::task::spawn_blocking(move || r.store().chunk(&c.digest))
                .await
                .map_err(|e| RegistryError::Internal(format!("reading chunk {}: {e}", c.digest)))?;
            let bytes = match bytes {
                Ok(b) => b,
                Err(e) => {
                    let _ = w.abort().await;
                    return Err(e.into());
                }
            };
            hasher.update(&bytes);
            if let Err(e) = w.wait_for_capacity(PARTS_IN_FLIGHT).await {
                return Err(s3(e));
            }
            w.put(bytes.into());
        }
        // The chunks were each checked as read; the whole is checked before it becomes visible.
        if hasher.finalize() != digest {
            let _ = w.abort().await;
            return Err(RegistryError::Internal(format!("artifact {digest} reassembles to other bytes; not uploaded")));
        }
        w.finish().await.map_err(s3)?;
        reg.metrics().object_store_uploads.inc();
        tracing::info!(%digest, length = art.length, store = %self.describe, "artifact uploaded to the object store");
        Ok(Upload::Written)
    }

    /// Uploads a just-published artifact; a failure is logged and queued for [`ArtifactMirror::run`]
    /// (the version stays published: agents fall back to the registry meanwhile).
    pub async fn after_publish(&self, reg: &Arc<Registry>, digest: Digest) {
        let result = match tokio::time::timeout(PUBLISH_WAIT, self.upload(reg, digest)).await {
            Ok(r) => r,
            Err(_) => Err(RegistryError::Config(format!("no answer from {} in {PUBLISH_WAIT:?}", self.describe))),
        };
        if let Err(e) = result {
            reg.metrics().object_store_failures.inc();
            tracing::warn!(%digest, error = %e, "artifact not uploaded to the object store yet; retrying in the background");
            let _ = self.retry_tx.send(digest);
        }
    }

    /// Until `shutdown`: uploads every stored artifact the bucket lacks, then retries failed
    /// uploads every [`RETRY_AFTER`]. Runs once per mirror (a second call returns at once).
    pub async fn run(self: Arc<Self>, reg: Arc<Registry>, shutdown: fedfleet_net::Shutdown) {
        let Some(mut rx) = self.retry_rx.lock().unwrap_or_else(|p| p.into_inner()).take() else { return };
        let mut pending: std::collections::BTreeSet<Digest> = match reg.store().artifact_digests() {
            Ok(d) => d.into_iter().collect(),
            Err(e) => {
                tracing::error!(error = %e, "listing the store's artifacts for the object store failed");
                Default::default()
            }
        };
        loop {
            while let Ok(d) = rx.try_recv() {
                pending.insert(d);
            }
            let mut failed = std::collections::BTreeSet::new();
            for d in std::mem::take(&mut pending) {
                if shutdown.is_triggered() {
                    return;
                }
                match self.upload(&reg, d).await {
                    Ok(_) => {}
                    Err(RegistryError::Store(crate::StoreError::UnknownArtifact(_))) => {}
                    Err(e) => {
                        reg.metrics().object_store_failures.inc();
                        tracing::warn!(digest = %d, error = %e, "object store upload failed; will retry");
                        failed.insert(d);
                    }
                }
            }
            pending = failed;
            reg.metrics().object_store_pending.set(pending.len() as i64);
            let wait = if pending.is_empty() { Duration::from_secs(3600) } else { RETRY_AFTER };
            tokio::select! {
                _ = shutdown.wait() => return,
                d = rx.recv() => match d {
                    Some(d) => { pending.insert(d); }
                    None => return,
                },
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(toml_text: &str) -> ObjectStoreConfig {
        toml::from_str(toml_text).unwrap()
    }

    #[test]
    fn keys_are_content_addressed_under_the_prefix() {
        let d = Digest::of(b"model");
        assert_eq!(artifact_key("", &d), format!("artifacts/{}", d.to_hex()));
        assert_eq!(artifact_key("fleet-a/", &d), format!("fleet-a/artifacts/{}", d.to_hex()));
    }

    #[test]
    fn bad_sections_are_refused_by_name() {
        assert!(cfg(r#"bucket = "b""#).validate().is_ok());
        for (text, why) in [
            ("bucket = \"\"", "bucket is empty"),
            ("bucket = \"b\"\nprefix = \"/x/\"", "must not start"),
            ("bucket = \"b\"\nprefix = \"x\"", "must end"),
            ("bucket = \"b\"\naccess_key_id = \"k\"", "go together"),
            ("bucket = \"b\"\nendpoint = \"http://127.0.0.1:8333\"", "allow_http"),
        ] {
            let e = cfg(text).validate().unwrap_err();
            assert!(e.contains(why), "{text}: {e}");
        }
        assert!(toml::from_str::<ObjectStoreConfig>("bucket = \"b\"\nregoin = \"x\"").is_err(), "unknown keys are refused");
    }
}
