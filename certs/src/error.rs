//! The crate's typed error. Every variant names what was refused and, where there is one, the file.

use std::io;
use std::path::PathBuf;

use fedfleet_protocol::IdError;

/// Why a PKI operation, a load or a peer check failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CertError {
    /// Reading or writing a file failed.
    #[error("{}: {error}", path.display())]
    Io { path: PathBuf, error: io::Error },
    /// A file would be overwritten; the caller must ask for it explicitly.
    #[error("{} already exists; refusing to overwrite it (use --force to replace it)", path.display())]
    Exists { path: PathBuf },
    /// The directory holds no fleet PKI.
    #[error("{}: no fleet PKI here (ca.crt is missing); run `fedfleet-certs init` first", path.display())]
    NoPki { path: PathBuf },
    /// A file is not the PEM/JSON it should be.
    #[error("{}: {what}", path.display())]
    Malformed { path: PathBuf, what: String },
    /// A certificate (from a file or from a peer) could not be parsed or lacks what we need.
    #[error("bad certificate: {0}")]
    BadCertificate(String),
    /// A key could not be parsed or is unusable.
    #[error("bad key: {0}")]
    BadKey(String),
    /// A device or server name is not a valid id.
    #[error("invalid id {id:?}: {reason}")]
    InvalidId { id: String, reason: IdError },
    /// A subject alternative name is neither an IP address nor a DNS name.
    #[error("invalid subject alternative name {0:?}")]
    InvalidSan(String),
    /// The peer certificate is valid but is not a device certificate.
    #[error("peer certificate is not a device certificate (subject {0:?})")]
    NotADevice(String),
    /// The peer presented no certificate.
    #[error("peer presented no certificate")]
    NoPeerCertificate,
    /// The peer's certificate expired (seen after a resumed TLS session, which shows none).
    #[error("certificate_expired: the client certificate expired at {not_after}")]
    PeerExpired { not_after: String },
    /// A certificate does not chain to the fleet CA it is used with (another fleet's, expired,
    /// not yet valid, or forged).
    #[error("{}: not a valid certificate of the fleet CA {}: {reason}", path.display(), ca.display())]
    NotIssuedByCa { path: PathBuf, ca: PathBuf, reason: String },
    /// The device is not in the allow-list.
    #[error("device {0} is not enrolled")]
    NotEnrolled(String),
    /// The device is already in the allow-list.
    #[error("device {0} is already enrolled (use --force to enroll it again with a new key)")]
    AlreadyEnrolled(String),
    /// The device is already revoked.
    #[error("device {0} is on the revocation list")]
    Revoked(String),
    /// The revocation list's signature does not verify against the CA key.
    #[error("{}: revocation list signature does not verify against the fleet CA key", path.display())]
    BadSignature { path: PathBuf },
    /// A newer revocation list was replaced by an older one.
    #[error("{}: revocation list version {found} is older than the loaded version {loaded}", path.display())]
    Rollback { path: PathBuf, found: u64, loaded: u64 },
    /// Certificate generation failed inside rcgen.
    #[error("certificate generation failed: {0}")]
    Generate(String),
    /// A certificate is past its `not_after` at the time it was checked against.
    #[error("{}: certificate expired at {not_after} (now {now}); a lapsed certificate cannot be renewed over mTLS: re-enroll the device (`fedfleet-certs enroll-device --force`)", path.display())]
    Expired { path: PathBuf, not_after: String, now: String },
    /// A renewed certificate is not for the identity it should replace.
    #[error("renewed certificate refused: {0}")]
    RenewalMismatch(String),
    /// rustls refused the configuration.
    #[error("TLS configuration: {0}")]
    Tls(String),
}

impl CertError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: io::Error) -> Self {
        CertError::Io { path: path.into(), error: source }
    }
    pub(crate) fn malformed(path: impl Into<PathBuf>, what: impl Into<String>) -> Self {
        CertError::Malformed { path: path.into(), what: what.into() }
    }
}

impl From<rcgen::Error> for CertError {
    fn from(e: rcgen::Error) -> Self {
        CertError::Generate(e.to_string())
    }
}
