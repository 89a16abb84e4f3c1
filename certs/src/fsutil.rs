//! File helpers: secret files are created 0600, nothing is overwritten unless asked, and every
//! write goes through a temporary file in the same directory and a rename, so readers (the
//! revocation and allow-list watchers) never see half a file.

use std::fs::{self, DirBuilder};
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::Path;
use std::time::SystemTime;

use fedfleet_durable::Mode;

use crate::error::CertError;

/// Mode of private key files.
pub const SECRET_MODE: u32 = 0o600;

pub(crate) fn read(path: &Path) -> Result<Vec<u8>, CertError> {
    fs::read(path).map_err(|e| CertError::io(path, e))
}

pub(crate) fn read_string(path: &Path) -> Result<String, CertError> {
    let bytes = read(path)?;
    String::from_utf8(bytes).map_err(|_| CertError::malformed(path, "not UTF-8 text"))
}

pub(crate) fn create_dir(path: &Path) -> Result<(), CertError> {
    DirBuilder::new().recursive(true).mode(0o700).create(path).map_err(|e| CertError::io(path, e))
}

/// Fails with [`CertError::Exists`] naming the first of `paths` that exists, unless `force`.
pub(crate) fn refuse_existing(paths: &[&Path], force: bool) -> Result<(), CertError> {
    if force {
        return Ok(());
    }
    for p in paths {
        if p.symlink_metadata().is_ok() {
            return Err(CertError::Exists { path: p.to_path_buf() });
        }
    }
    Ok(())
}

/// Writes `bytes` to `path` atomically and durably (see `fedfleet_durable::write_atomic`);
/// `secret` files are 0600 from creation on.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8], secret: bool) -> Result<(), CertError> {
    let mode = if secret { Mode::Secret } else { Mode::Public };
    fedfleet_durable::write_atomic(path, bytes, mode).map_err(|e| CertError::io(path, e))
}

/// What a cheap `stat` says about a file; a change means "read it again".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stamp {
    modified: Option<SystemTime>,
    len: u64,
    ino: u64,
}

pub(crate) fn stamp(path: &Path) -> std::io::Result<Stamp> {
    let m = fs::metadata(path)?;
    Ok(Stamp { modified: m.modified().ok(), len: m.len(), ino: m.ino() })
}
