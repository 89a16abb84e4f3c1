//! The files each host of a deployment needs from the PKI, copied into a directory of their
//! own with the PKI's layout (so `pki_dir` points at it as it is). The CA key stays on the CA
//! host unless asked for (a registry that renews device certificates needs it).

use std::path::{Path, PathBuf};

use fedfleet_protocol::DeviceId;

use crate::error::CertError;
use crate::fsutil;
use crate::layout::{self, CA_CERT, CA_CRL, CA_KEY, DEVICES_JSON, REVOKED_JSON};

/// Whose files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// A registry host: the CA certificate, the allow-list, the revocation list and its service
    /// identity; with `ca_key`, the CA key too (`[renewal]`).
    Registry { name: String, ca_key: bool },
    /// An aggregator host: the CA certificate, the allow-list, the revocation list and its
    /// service identity.
    Aggregator { name: String },
    /// An operator's host: the CA certificate and the operator's service identity.
    Operator { name: String },
    /// An MQTT broker host: the CA certificate, the CRL (`crlfile`), the allow-list and the
    /// revocation list (for `broker-access --watch`) and the broker's server identity.
    Broker { name: String },
    /// A device: the CA certificate and its own certificate and key (`fedfleet-agent enroll`).
    Device(DeviceId),
}

impl Role {
    /// The files, relative to a PKI directory, and whether each is secret.
    pub fn files(&self) -> Vec<(PathBuf, bool)> {
        let server = |name: &str| {
            let (crt, key) = layout::server_paths(Path::new(""), name);
            [(crt, false), (key, true)]
        };
        let lists = [(PathBuf::from(DEVICES_JSON), false), (PathBuf::from(REVOKED_JSON), false)];
        let mut files = vec![(PathBuf::from(CA_CERT), false)];
        match self {
            Role::Registry { name, ca_key } => {
                files.extend(lists);
                files.extend(server(name));
                if *ca_key {
                    files.push((PathBuf::from(CA_KEY), true));
                }
            }
            Role::Aggregator { name } => {
                files.extend(lists);
                files.extend(server(name));
            }
            Role::Operator { name } => files.extend(server(name)),
            Role::Broker { name } => {
                files.extend(lists);
                files.push((PathBuf::from(CA_CRL), false));
                files.extend(server(name));
            }
            Role::Device(id) => {
                let (crt, key) = layout::device_paths(Path::new(""), id);
                files.extend([(crt, false), (key, true)]);
            }
        }
        files
    }
}

/// Copies `role`'s files from the PKI at `pki` into `out` (keys 0600). Refuses to replace a
/// file in `out` unless `force`; a missing source file is named (issue it first). Returns the
/// files written.
pub fn write_bundle(pki: &Path, role: &Role, out: &Path, force: bool) -> Result<Vec<PathBuf>, CertError> {
    if !layout::ca_cert(pki).exists() {
        return Err(CertError::NoPki { path: pki.to_owned() });
    }
    let files = role.files();
    let targets: Vec<PathBuf> = files.iter().map(|(rel, _)| out.join(rel)).collect();
    fsutil::refuse_existing(&targets.iter().map(PathBuf::as_path).collect::<Vec<_>>(), force)?;
    // Every source is read before anything is written: a missing one leaves `out` untouched.
    let contents = files.iter().map(|(rel, _)| fsutil::read(&pki.join(rel))).collect::<Result<Vec<_>, _>>()?;
    for ((to, bytes), (_, secret)) in targets.iter().zip(&contents).zip(&files) {
        if let Some(dir) = to.parent() {
            fsutil::create_dir(dir)?;
        }
        fsutil::write_atomic(to, bytes, *secret)?;
    }
    Ok(targets)
}
