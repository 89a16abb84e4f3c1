//! The signed revocation list (`revoked.json`) and the watcher that TLS servers consult on every
//! handshake.
//!
//! Signed bytes: `"fedfleet/revocation/v1\0"`, then `version` (u64 BE), `issued_at` (u64 BE, unix
//! seconds), the entry count (u32 BE), and per entry: `device_id`, `serial`, `revoked_at` (u64 BE),
//! `reason`, each string as u32 BE length + UTF-8 bytes. Entries are signed in file order.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use fedfleet_protocol::DeviceId;
use serde::{Deserialize, Serialize};

use crate::error::CertError;
use crate::fsutil::{self, Stamp};
use crate::identity::CaCert;

/// Domain separation prefix of the revocation list signature.
pub const REVOCATION_DOMAIN: &[u8] = b"fedfleet/revocation/v1\0";

/// One revoked device certificate.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RevocationEntry {
    pub device_id: DeviceId,
    /// Certificate serial, lowercase hex.
    pub serial: String,
    /// Unix seconds.
    pub revoked_at: u64,
    pub reason: String,
}

/// The list as stored in `revoked.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RevocationList {
    /// Increases with every change; a watcher refuses to go back to a lower version.
    pub version: u64,
    /// Unix seconds.
    pub issued_at: u64,
    pub entries: Vec<RevocationEntry>,
    /// ed25519 signature by the CA key over [`RevocationList::signed_bytes`], lowercase hex.
    pub signature: String,
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u32).to_be_bytes());
    out.extend_from_slice(s.as_bytes());
}

impl RevocationList {
    /// The canonical, domain-separated bytes the CA signs.
    pub fn signed_bytes(&self) -> Vec<u8> {
        let mut out = REVOCATION_DOMAIN.to_vec();
        out.extend_from_slice(&self.version.to_be_bytes());
        out.extend_from_slice(&self.issued_at.to_be_bytes());
        out.extend_from_slice(&(self.entries.len() as u32).to_be_bytes());
        for e in &self.entries {
            put_str(&mut out, e.device_id.as_str());
            put_str(&mut out, &e.serial);
            out.extend_from_slice(&e.revoked_at.to_be_bytes());
            put_str(&mut out, &e.reason);
        }
        out
    }

    /// Builds and signs a list (entries sorted by device id, then serial).
    pub fn signed(version: u64, issued_at: u64, mut entries: Vec<RevocationEntry>, ca_key: &SigningKey) -> Self {
        entries.sort_by(|a, b| (&a.device_id, &a.serial).cmp(&(&b.device_id, &b.serial)));
        let mut list = RevocationList { version, issued_at, entries, signature: String::new() };
        list.signature = hex::encode(ca_key.sign(&list.signed_bytes()).to_bytes());
        list
    }

    /// Whether the signature verifies against `ca_key` (strict verification).
    pub fn verify(&self, ca_key: &VerifyingKey) -> bool {
        let mut sig = [0u8; 64];
        if hex::decode_to_slice(&self.signature, &mut sig).is_err() {
            return false;
        }
        ca_key.verify_strict(&self.signed_bytes(), &Signature::from_bytes(&sig)).is_ok()
    }

    /// Whether `id` is on the list.
    pub fn contains(&self, id: &DeviceId) -> bool {
        self.entries.iter().any(|e| &e.device_id == id)
    }

    /// Reads and parses a list without checking the signature.
    pub fn read_unverified(path: &Path) -> Result<Self, CertError> {
        let text = fsutil::read(path)?;
        serde_json::from_slice(&text).map_err(|e| CertError::malformed(path, format!("not a revocation list: {e}")))
    }

    /// Reads a list and checks its signature.
    pub fn load(path: &Path, ca_key: &VerifyingKey) -> Result<Self, CertError> {
        let list = Self::read_unverified(path)?;
        if !list.verify(ca_key) {
            return Err(CertError::BadSignature { path: path.to_path_buf() });
        }
        Ok(list)
    }

    pub(crate) fn to_json(&self) -> Vec<u8> {
        let mut v = serde_json::to_vec_pretty(self).expect("revocation list serializes");
        v.push(b'\n');
        v
    }
}

struct WatchState {
    list: Arc<RevocationList>,
    revoked: HashSet<DeviceId>,
    stamp: Option<Stamp>,
    last_check: Option<Instant>,
}

/// Keeps the current revocation list of a PKI, re-reading `revoked.json` when its mtime, length or
/// inode change. A new file that fails to parse, fails the CA signature or has a lower version is
/// ignored with a warning and the last good list stays in force.
pub struct RevocationWatcher {
    path: PathBuf,
    ca_key: VerifyingKey,
    min_interval: Duration,
    state: Mutex<WatchState>,
}

impl std::fmt::Debug for RevocationWatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RevocationWatcher").field("path", &self.path).finish_non_exhaustive()
    }
}

impl RevocationWatcher {
    /// Loads `path` (it must exist and verify). By default the file is `stat`ed on every check
    /// (every TLS handshake), so a revocation applies to the next handshake.
    pub fn new(path: impl Into<PathBuf>, ca: &CaCert) -> Result<Self, CertError> {
        let path = path.into();
        let stamp = fsutil::stamp(&path).map_err(|e| CertError::io(&path, e))?;
        let list = RevocationList::load(&path, ca.public_key())?;
        let revoked = list.entries.iter().map(|e| e.device_id.clone()).collect();
        Ok(RevocationWatcher {
            path,
            ca_key: *ca.public_key(),
            min_interval: Duration::ZERO,
            state: Mutex::new(WatchState { list: Arc::new(list), revoked, stamp: Some(stamp), last_check: Some(Instant::now()) }),
        })
    }

    /// Loads `<pki_dir>/revoked.json` checked against `<pki_dir>/ca.crt`.
    pub fn open(pki_dir: impl AsRef<Path>) -> Result<Self, CertError> {
        let dir = pki_dir.as_ref();
        let ca = CaCert::load(crate::layout::ca_cert(dir))?;
        Self::new(crate::layout::revocation_list(dir), &ca)
    }

    /// Stat the file at most once per `interval` (default: on every check).
    pub fn with_min_interval(mut self, interval: Duration) -> Self {
        self.min_interval = interval;
        self
    }

    /// The file watched.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether `id` is revoked, after picking up a changed file.
    pub fn is_revoked(&self, id: &DeviceId) -> bool {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        self.refresh_locked(&mut st);
        st.revoked.contains(id)
    }

    /// The list in force, after picking up a changed file.
    pub fn current(&self) -> Arc<RevocationList> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        self.refresh_locked(&mut st);
        st.list.clone()
    }

    /// Re-reads the file now if it changed. Returns the error that made a new file be ignored.
    pub fn refresh(&self) -> Result<(), CertError> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.last_check = None;
        self.try_refresh(&mut st)
    }

    fn refresh_locked(&self, st: &mut WatchState) {
        if let Some(t) = st.last_check
            && !self.min_interval.is_zero()
            && t.elapsed() < self.min_interval
        {
            return;
        }
        if let Err(e) = self.try_refresh(st) {
            tracing::warn!(path = %self.path.display(), error = %e, "keeping the last good revocation list");
        }
    }

    fn try_refresh(&self, st: &mut WatchState) -> Result<(), CertError> {
        st.last_check = Some(Instant::now());
        let stamp = match fsutil::stamp(&self.path) {
            Ok(s) => s,
            Err(e) => {
                st.stamp = None;
                return Err(CertError::io(&self.path, e));
            }
        };
        if st.stamp == Some(stamp) {
            return Ok(());
        }
        // Remember the stamp even when the file is bad, so a bad file is reported once.
        st.stamp = Some(stamp);
        let list = RevocationList::load(&self.path, &self.ca_key)?;
        if list.version < st.list.version {
            return Err(CertError::Rollback { path: self.path.clone(), found: list.version, loaded: st.list.version });
        }
        st.revoked = list.entries.iter().map(|e| e.device_id.clone()).collect();
        if list != *st.list {
            tracing::info!(path = %self.path.display(), version = list.version, revoked = list.entries.len(), "revocation list reloaded");
        }
        st.list = Arc::new(list);
        Ok(())
    }
}
