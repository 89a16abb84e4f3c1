//! Where things live in a PKI directory.

use std::path::{Path, PathBuf};

use fedfleet_protocol::DeviceId;

use crate::error::CertError;

pub const CA_CERT: &str = "ca.crt";
pub const CA_KEY: &str = "ca.key";
pub const DEVICES_JSON: &str = "devices.json";
pub const REVOKED_JSON: &str = "revoked.json";
pub const CA_CRL: &str = "ca.crl";
pub const SERVERS_DIR: &str = "servers";
pub const DEVICES_DIR: &str = "devices";

pub fn ca_cert(dir: &Path) -> PathBuf {
    dir.join(CA_CERT)
}
pub fn ca_key(dir: &Path) -> PathBuf {
    dir.join(CA_KEY)
}
pub fn allow_list(dir: &Path) -> PathBuf {
    dir.join(DEVICES_JSON)
}
pub fn revocation_list(dir: &Path) -> PathBuf {
    dir.join(REVOKED_JSON)
}
/// The revocation list as an X.509 CRL (for brokers' `crlfile`).
pub fn crl(dir: &Path) -> PathBuf {
    dir.join(CA_CRL)
}
/// `(cert, key)` of a server.
pub fn server_paths(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
    let d = dir.join(SERVERS_DIR);
    (d.join(format!("{name}.crt")), d.join(format!("{name}.key")))
}
/// `(cert, key)` of a device.
pub fn device_paths(dir: &Path, id: &DeviceId) -> (PathBuf, PathBuf) {
    let d = dir.join(DEVICES_DIR);
    (d.join(format!("{id}.crt")), d.join(format!("{id}.key")))
}

/// Server names follow the device id rules (they become file names and CNs).
pub fn validate_name(name: &str) -> Result<(), CertError> {
    DeviceId::new(name).map(|_| ()).map_err(|reason| CertError::InvalidId { id: name.to_string(), reason })
}
