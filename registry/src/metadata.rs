//! The service's signing keys and the signed metadata it serves.
//!
//! # Files in the data directory
//! ```text
//! keys/root.key        root role key (PKCS#8 PEM, 0600). Only `init-keys` uses it: move it
//!                      offline after init; `serve` never reads it.
//! keys/targets.key     targets role key (0600); signs targets on every publish/alias change.
//! keys/timestamp.key   timestamp (online) key (0600); signs timestamps and device assignments.
//! root.json            the current signed root: agents pin it at enrollment.
//! metadata/root/N.json every root version, for agents that rotate forward.
//! metadata/targets.json, metadata/timestamp.json   the last signed metadata (version floors
//!                      survive restarts: versions only go up).
//! ```

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use ed25519_dalek::SigningKey;
use ed25519_dalek::pkcs8::{EncodePrivateKey, spki::der::pem::LineEnding};

use crate::RegistryError;
use crate::store::Store;
use crate::tuf::{Root, SignedMetadata, Targets, Timestamp};
use crate::wire::{AssignmentBody, MetadataSet, SignedAssignment};

pub const ROOT_KEY: &str = "keys/root.key";
pub const TARGETS_KEY: &str = "keys/targets.key";
pub const TIMESTAMP_KEY: &str = "keys/timestamp.key";
pub const ROOT_JSON: &str = "root.json";
const ROOTS_DIR: &str = "metadata/root";
const TARGETS_JSON: &str = "metadata/targets.json";
const TIMESTAMP_JSON: &str = "metadata/timestamp.json";

const DAY_MS: u64 = 24 * 3600 * 1000;

/// Lifetimes of signed metadata.
#[derive(Debug, Clone, Copy)]
pub struct Lifetimes {
    /// Targets expire this long after signing (re-signed at half-life). Default 7 days.
    pub targets_ms: u64,
    /// Timestamps and assignments expire this long after signing (re-signed at a quarter).
    /// Default 1 hour.
    pub timestamp_ms: u64,
}

impl Default for Lifetimes {
    fn default() -> Self {
        Lifetimes { targets_ms: 7 * DAY_MS, timestamp_ms: 3600 * 1000 }
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> RegistryError + '_ {
    move |cause| RegistryError::Io { path: path.to_owned(), cause }
}

/// Writes `bytes` atomically (`fedfleet_durable::write_atomic`), creating the directory;
/// `secret` files get mode 0600.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8], secret: bool) -> Result<(), RegistryError> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    }
    let mode = if secret { fedfleet_durable::Mode::Secret } else { fedfleet_durable::Mode::Public };
    fedfleet_durable::write_atomic(path, bytes, mode).map_err(io_err(path))
}

fn write_key(path: &Path, key: &SigningKey) -> Result<(), RegistryError> {
    let pem = key.to_pkcs8_pem(LineEnding::LF).map_err(|e| RegistryError::Key { path: path.to_owned(), detail: e.to_string() })?;
    write_atomic(path, pem.as_bytes(), true)
}

fn read_key(path: &Path) -> Result<SigningKey, RegistryError> {
    fedfleet_certs::load_signing_key(path).map_err(|e| RegistryError::Key {
        path: path.to_owned(),
        detail: format!("{e}; run `fedfleet-registry init-keys` to create the keys"),
    })
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<Option<T>, RegistryError> {
    match std::fs::read(path) {
        Ok(b) => serde_json::from_slice(&b).map(Some).map_err(|e| RegistryError::Config(format!("{}: {e}", path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io_err(path)(e)),
    }
}

/// Whether `data_dir` already holds the service keys.
pub fn keys_exist(data_dir: &Path) -> bool {
    data_dir.join(TARGETS_KEY).exists() && data_dir.join(TIMESTAMP_KEY).exists()
}

/// Creates the root, targets and timestamp keys and a root (version 1, valid `root_days`) in
/// `data_dir`. Refuses to overwrite existing keys unless `force` (devices pinned to the old root
/// would then refuse everything). `now`: unix ms the root's expiry counts from. Returns the
/// signed root.
pub fn init_keys(data_dir: &Path, root_days: u32, force: bool, now: u64) -> Result<SignedMetadata<Root>, RegistryError> {
    for f in [ROOT_KEY, TARGETS_KEY, TIMESTAMP_KEY, ROOT_JSON] {
        let p = data_dir.join(f);
        if p.exists() && !force {
            return Err(RegistryError::Config(format!(
                "{} exists; refusing to replace the registry keys (devices pin root.json). \
                 Pass --force to start a new root of trust",
                p.display()
            )));
        }
    }
    let new_key = || SigningKey::generate(&mut rand_core::OsRng);
    let (root_key, targets_key, ts_key) = (new_key(), new_key(), new_key());
    let expires = now + root_days.max(1) as u64 * DAY_MS;
    let root = SignedMetadata::single_key_root(expires, &root_key, &targets_key.verifying_key(), &ts_key.verifying_key());
    write_key(&data_dir.join(ROOT_KEY), &root_key)?;
    write_key(&data_dir.join(TARGETS_KEY), &targets_key)?;
    write_key(&data_dir.join(TIMESTAMP_KEY), &ts_key)?;
    let json = serde_json::to_vec_pretty(&root).expect("root serializes");
    let _ = std::fs::remove_dir_all(data_dir.join(ROOTS_DIR));
    let _ = std::fs::remove_file(data_dir.join(TARGETS_JSON));
    let _ = std::fs::remove_file(data_dir.join(TIMESTAMP_JSON));
    write_atomic(&data_dir.join(ROOTS_DIR).join("1.json"), &json, false)?;
    write_atomic(&data_dir.join(ROOT_JSON), &json, false)?;
    Ok(root)
}

/// Reads the pinned root from `data_dir/root.json`.
pub fn read_root(data_dir: &Path) -> Result<SignedMetadata<Root>, RegistryError> {
    let p = data_dir.join(ROOT_JSON);
    read_json(&p)?.ok_or_else(|| RegistryError::Config(format!("{} is missing; run `fedfleet-registry init-keys`", p.display())))
}

struct Current {
    targets_body: Targets,
    targets: SignedMetadata<Targets>,
    ts_body: Timestamp,
    timestamp: SignedMetadata<Timestamp>,
}

/// Holds the online keys and the current signed metadata.
pub struct MetadataSigner {
    dir: PathBuf,
    roots: Vec<SignedMetadata<Root>>,
    targets_key: SigningKey,
    timestamp_key: SigningKey,
    lifetimes: Lifetimes,
    current: Mutex<Option<Current>>,
}

impl std::fmt::Debug for MetadataSigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetadataSigner").field("dir", &self.dir).finish()
    }
}

impl MetadataSigner {
    /// Loads the targets and timestamp keys and every root version from `data_dir`.
    pub fn load(data_dir: &Path, lifetimes: Lifetimes) -> Result<Self, RegistryError> {
        let targets_key = read_key(&data_dir.join(TARGETS_KEY))?;
        let timestamp_key = read_key(&data_dir.join(TIMESTAMP_KEY))?;
        let current_root = read_root(data_dir)?;
        let mut roots = Vec::new();
        let mut v = 1;
        while let Some(r) = read_json::<SignedMetadata<Root>>(&data_dir.join(ROOTS_DIR).join(format!("{v}.json")))? {
            roots.push(r);
            v += 1;
        }
        if roots.last() != Some(&current_root) {
            roots.push(current_root);
        }
        let root = roots.last().unwrap().body_unverified()?;
        let tk = targets_key.verifying_key();
        let sk = timestamp_key.verifying_key();
        if !root.targets.keyids.contains(&crate::tuf::KeyId::of(&tk)) || !root.timestamp.keyids.contains(&crate::tuf::KeyId::of(&sk)) {
            return Err(RegistryError::Config(format!(
                "the keys in {} do not match {}: the targets/timestamp keys are not listed in the root",
                data_dir.join("keys").display(),
                data_dir.join(ROOT_JSON).display()
            )));
        }
        Ok(MetadataSigner { dir: data_dir.to_owned(), roots, targets_key, timestamp_key, lifetimes, current: Mutex::new(None) })
    }

    /// The current root (what agents pin).
    pub fn root(&self) -> &SignedMetadata<Root> {
        self.roots.last().expect("at least one root")
    }

    /// Re-signs targets from the store's versions if they changed (or are past half-life) and
    /// always signs a new timestamp. Persists both. Call after every publish/alias change.
    pub fn refresh(&self, store: &Store, now: u64) -> Result<(), RegistryError> {
        let mut targets = Vec::new();
        for name in store.models()? {
            for v in store.versions(&name)? {
                // One unreadable record must not stop the registry signing the others (and
                // with it every device's metadata): it is left out, so no device installs it.
                match store.version(&name, v) {
                    Ok(info) => targets.push(info),
                    Err(e) => tracing::error!(model = %name, version = %v, error = %e, "version left out of the signed targets"),
                }
            }
        }
        let mut cur = self.current.lock().unwrap_or_else(|p| p.into_inner());
        if cur.is_none() {
            *cur = self.load_current()?;
        }
        let (tv, sv) = match cur.as_ref() {
            Some(c) => {
                let stale = now + self.lifetimes.targets_ms / 2 >= c.targets_body.expires;
                if c.targets_body.targets == targets && !stale {
                    (None, c.ts_body.version)
                } else {
                    (Some(c.targets_body.version + 1), c.ts_body.version)
                }
            }
            None => (Some(1), 0),
        };
        let (targets_body, signed_targets) = match tv {
            Some(version) => {
                let body = Targets { version, expires: now + self.lifetimes.targets_ms, targets };
                let s = SignedMetadata::sign(&body, &[&self.targets_key]);
                write_atomic(&self.dir.join(TARGETS_JSON), &serde_json::to_vec(&s).expect("serializes"), false)?;
                (body, s)
            }
            None => {
                let c = cur.as_ref().unwrap();
                (c.targets_body.clone(), c.targets.clone())
            }
        };
        let ts_body = Timestamp::for_targets(sv + 1, now + self.lifetimes.timestamp_ms, &signed_targets)?;
        let ts = SignedMetadata::sign(&ts_body, &[&self.timestamp_key]);
        write_atomic(&self.dir.join(TIMESTAMP_JSON), &serde_json::to_vec(&ts).expect("serializes"), false)?;
        *cur = Some(Current { targets_body, targets: signed_targets, ts_body, timestamp: ts });
        Ok(())
    }

    fn load_current(&self) -> Result<Option<Current>, RegistryError> {
        let t: Option<SignedMetadata<Targets>> = read_json(&self.dir.join(TARGETS_JSON))?;
        let s: Option<SignedMetadata<Timestamp>> = read_json(&self.dir.join(TIMESTAMP_JSON))?;
        match (t, s) {
            (Some(targets), Some(timestamp)) => {
                Ok(Some(Current { targets_body: targets.body_unverified()?, ts_body: timestamp.body_unverified()?, targets, timestamp }))
            }
            _ => Ok(None),
        }
    }

    /// Whether the timestamp should be re-signed (a quarter of its lifetime left or less).
    pub fn timestamp_due(&self, now: u64) -> bool {
        let cur = self.current.lock().unwrap_or_else(|p| p.into_inner());
        match cur.as_ref() {
            Some(c) => {
                now + self.lifetimes.timestamp_ms / 4 * 3 >= c.ts_body.expires
                    || now + self.lifetimes.targets_ms / 2 >= c.targets_body.expires
            }
            None => true,
        }
    }

    /// What a client with root version `have_root_version` needs. `None` before the first
    /// [`MetadataSigner::refresh`].
    pub fn metadata(&self, have_root_version: u64) -> Option<MetadataSet> {
        let cur = self.current.lock().unwrap_or_else(|p| p.into_inner());
        let c = cur.as_ref()?;
        Some(MetadataSet {
            roots: self.roots.iter().filter(|r| r.body_unverified().is_ok_and(|b| b.version > have_root_version)).cloned().collect(),
            timestamp: c.timestamp.clone(),
            targets: c.targets.clone(),
        })
    }

    /// Signs an assignment with the timestamp key.
    pub fn sign_assignment(&self, body: &AssignmentBody) -> SignedAssignment {
        SignedAssignment::sign(body, &[&self.timestamp_key])
    }

    /// How long assignments stay valid.
    pub fn assignment_ttl_ms(&self) -> u64 {
        self.lifetimes.timestamp_ms
    }
}
