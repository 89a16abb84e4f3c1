//! `devices.json`: the enrolled devices and their ed25519 public keys, as the aggregator reads it to
//! verify update signatures.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::RwLock;

use ed25519_dalek::VerifyingKey;
use fedfleet_protocol::{DeviceId, FleetId};
use serde::{Deserialize, Serialize};

use crate::error::CertError;
use crate::fsutil::{self, Stamp};
use crate::keys;

/// One enrolled device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllowEntry {
    /// ed25519 public key, lowercase hex (32 bytes).
    pub public_key: String,
    /// Certificate serial, lowercase hex.
    pub serial: String,
    /// Unix seconds.
    pub enrolled_at: u64,
    /// Unix seconds; set by `revoke` (the signed `revoked.json` is the authority for TLS).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revoked_at: Option<u64>,
}

/// The file format of `devices.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllowListFile {
    pub fleet: FleetId,
    pub devices: BTreeMap<DeviceId, AllowEntry>,
}

impl AllowListFile {
    /// Parses and checks every key (valid point, not weak).
    pub fn read(path: &Path) -> Result<Self, CertError> {
        let bytes = fsutil::read(path)?;
        let file: AllowListFile =
            serde_json::from_slice(&bytes).map_err(|e| CertError::malformed(path, format!("not a device allow-list: {e}")))?;
        for (id, e) in &file.devices {
            keys::parse_public_key_hex(&e.public_key).map_err(|err| CertError::malformed(path, format!("device {id}: {err}")))?;
        }
        Ok(file)
    }

    pub(crate) fn to_json(&self) -> Vec<u8> {
        let mut v = serde_json::to_vec_pretty(self).expect("allow-list serializes");
        v.push(b'\n');
        v
    }
}

/// What the allow-list says about a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceStatus {
    Unknown,
    Revoked,
    Enrolled(VerifyingKey),
}

struct Inner {
    file: AllowListFile,
    keys: HashMap<DeviceId, VerifyingKey>,
    stamp: Option<Stamp>,
}

fn index(file: &AllowListFile) -> HashMap<DeviceId, VerifyingKey> {
    file.devices
        .iter()
        .filter(|(_, e)| e.revoked_at.is_none())
        .filter_map(|(id, e)| keys::parse_public_key_hex(&e.public_key).ok().map(|k| (id.clone(), k)))
        .collect()
}

/// The allow-list, re-read when the file's mtime, length or inode change (checked with a `stat`
/// on every lookup). A changed file that fails to load is ignored with a warning; the last good
/// list stays in force.
pub struct AllowList {
    path: PathBuf,
    inner: RwLock<Inner>,
}

impl std::fmt::Debug for AllowList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AllowList").field("path", &self.path).finish_non_exhaustive()
    }
}

impl AllowList {
    /// Loads `devices.json`, refusing malformed and weak keys.
    pub fn load(path: impl Into<PathBuf>) -> Result<Self, CertError> {
        let path = path.into();
        let stamp = fsutil::stamp(&path).map_err(|e| CertError::io(&path, e))?;
        let file = AllowListFile::read(&path)?;
        let keys = index(&file);
        Ok(AllowList { path, inner: RwLock::new(Inner { file, keys, stamp: Some(stamp) }) })
    }

    /// Re-reads the file if it changed. `Ok(true)` when a new version was loaded.
    pub fn reload_if_changed(&self) -> Result<bool, CertError> {
        let stamp = fsutil::stamp(&self.path).ok();
        if self.inner.read().unwrap_or_else(|p| p.into_inner()).stamp == stamp {
            return Ok(false);
        }
        let mut inner = self.inner.write().unwrap_or_else(|p| p.into_inner());
        if inner.stamp == stamp {
            return Ok(false);
        }
        inner.stamp = stamp;
        if stamp.is_none() {
            return Err(CertError::io(&self.path, std::io::Error::from(std::io::ErrorKind::NotFound)));
        }
        let file = AllowListFile::read(&self.path)?;
        inner.keys = index(&file);
        inner.file = file;
        Ok(true)
    }

    fn refresh(&self) {
        if let Err(e) = self.reload_if_changed() {
            tracing::warn!(path = %self.path.display(), error = %e, "keeping the last good device allow-list");
        }
    }

    /// The enrolled, non-revoked device's public key.
    pub fn public_key(&self, id: &DeviceId) -> Option<VerifyingKey> {
        self.refresh();
        self.inner.read().unwrap_or_else(|p| p.into_inner()).keys.get(id).copied()
    }

    /// Unknown, revoked or enrolled (with its key): lets callers name the rejection reason.
    pub fn status(&self, id: &DeviceId) -> DeviceStatus {
        self.refresh();
        let inner = self.inner.read().unwrap_or_else(|p| p.into_inner());
        match (inner.keys.get(id), inner.file.devices.get(id)) {
            (Some(k), _) => DeviceStatus::Enrolled(*k),
            (None, Some(_)) => DeviceStatus::Revoked,
            (None, None) => DeviceStatus::Unknown,
        }
    }

    /// The entry of a device, revoked or not.
    pub fn entry(&self, id: &DeviceId) -> Option<AllowEntry> {
        self.refresh();
        self.inner.read().unwrap_or_else(|p| p.into_inner()).file.devices.get(id).cloned()
    }

    /// The fleet named in the file.
    pub fn fleet(&self) -> FleetId {
        self.inner.read().unwrap_or_else(|p| p.into_inner()).file.fleet.clone()
    }

    /// The enrolled, non-revoked devices, in id order.
    pub fn devices(&self) -> Vec<DeviceId> {
        self.refresh();
        let mut ids: Vec<DeviceId> = self.inner.read().unwrap_or_else(|p| p.into_inner()).keys.keys().cloned().collect();
        ids.sort();
        ids
    }

    /// Enrolled, non-revoked devices.
    pub fn len(&self) -> usize {
        self.refresh();
        self.inner.read().unwrap_or_else(|p| p.into_inner()).keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
