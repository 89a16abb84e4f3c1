//! File helpers: secret files are created 0600, nothing is overwritten unless asked, and every
//! write goes through a temporary file in the same directory and a rename, so readers (the
//! revocation and allow-list watchers) never see half a file.

use std::fs::{self, DirBuilder, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use crate::error::CertError;

/// Mode of private key files.
pub const SECRET_MODE: u32 = 0o600;
const PUBLIC_MODE: u32 = 0o644;

pub(crate) fn read(path: &Path) -> Result<Vec<u8>, CertError> {
    fs::read(path).map_err(|e| CertError::io(path, e))
}

pub(crate) fn read_string(path: &Path) -> Result<String, CertError> {
    let bytes = read(path)?;
    String::from_utf8(bytes).map_err(|_| CertError::malformed(path, "not UTF-8 text"))
}

pub(crate) fn create_dir(path: &Path) -> Result<(), CertError> {
    DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(path)
        .map_err(|e| CertError::io(path, e))
}

/// Fails with [`CertError::Exists`] naming the first of `paths` that exists, unless `force`.
pub(crate) fn refuse_existing(paths: &[&Path], force: bool) -> Result<(), CertError> {
    if force {
        return Ok(());
    }
    for p in paths {
        if p.symlink_metadata().is_ok() {
            return Err(CertError::Exists {
                path: p.to_path_buf(),
            });
        }
    }
    Ok(())
}

/// Writes `bytes` to `path` atomically (temp file + fsync + rename). `secret` files get mode 0600
/// from creation on; the temp file is created with `create_new`, so it never reuses a file.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8], secret: bool) -> Result<(), CertError> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut nonce = [0u8; 6];
    rand_core::RngCore::fill_bytes(&mut rand_core::OsRng, &mut nonce);
    let tmp: PathBuf = dir.join(format!(".{name}.tmp-{}", hex::encode(nonce)));
    let mode = if secret { SECRET_MODE } else { PUBLIC_MODE };
    let result = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        fs::rename(&tmp, path)
    })();
    if let Err(e) = result {
        let _ = fs::remove_file(&tmp);
        return Err(CertError::io(path, e));
    }
    if let Ok(d) = fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
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
    Ok(Stamp {
        modified: m.modified().ok(),
        len: m.len(),
        ino: m.ino(),
    })
}
