//! fedfleet's private CA: the fleet PKI directory, server and device identities, enrollment, the
//! signed revocation list, and the rustls configurations for fleet mTLS.
//!
//! **API boundary:** no other fedfleet crate reads PEM or builds a rustls verifier; they load
//! identities and configs from here.
//!
//! **Architecture invariant:** ring is the only crypto provider; every rustls config is built with
//! `builder_with_provider(ring)`, never from the process default.
//!
//! PKI directory layout:
//! ```text
//! ca.crt  ca.key (0600)        fleet CA, ed25519
//! servers/<name>.crt|.key      server identities (EKU serverAuth + clientAuth)
//! devices/<id>.crt|.key        device identities (CN = device id, EKU clientAuth)
//! devices.json                 allow-list: id -> public key, serial, enrolled_at[, revoked_at]
//! revoked.json                 revocation list signed by the CA key
//! ca.crl                       the same list as an X.509 CRL, for brokers (mosquitto's crlfile)
//! ```

mod allowlist;
pub mod bundle;
pub mod crl;
mod error;
mod fsutil;
mod identity;
pub mod inspect;
mod keys;
pub mod layout;
mod pki;
pub mod renewal;
mod revocation;
pub mod tls;
mod x509;
/// The organizational units of a leaf certificate's subject (`OU=device` or `OU=service`).
pub use x509::{OU_DEVICE, OU_SERVICE};

#[cfg(test)]
mod tests;

pub use allowlist::{AllowEntry, AllowList, AllowListFile, DeviceStatus};
pub use error::CertError;
pub use fsutil::SECRET_MODE;
pub use identity::{CaCert, DeviceIdentity, ServerIdentity};
pub use keys::{load_signing_key, parse_public_key_hex};
pub use pki::{CA_DAYS, EnrolledDevice, IssuedServer, LEAF_DAYS, Pki, Revocation};
pub use renewal::{DeviceIssuer, RenewedCertificate, Validity};
pub use revocation::{REVOCATION_DOMAIN, RevocationEntry, RevocationList, RevocationWatcher};

use fedfleet_protocol::DeviceId;
use rustls_pki_types::CertificateDer;

/// ALPN of fleet protocol version 1, on every QUIC connection.
pub const ALPN_V1: &[u8] = b"fedfleet/1";

/// Who is on the other end of a verified connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerIdentity {
    /// A device certificate (OU=device); the id is the CN.
    Device(DeviceId),
    /// A service certificate (OU=service); the name is the CN.
    Service(String),
}

/// Classifies a peer's end-entity certificate (the first of `certs`) by its subject.
pub fn peer_identity(certs: &[CertificateDer<'_>]) -> Result<PeerIdentity, CertError> {
    let first = certs.first().ok_or(CertError::NoPeerCertificate)?;
    classify(&x509::parse(first)?)
}

/// [`peer_identity`], refused as [`CertError::PeerExpired`] when the end-entity certificate has
/// expired by `now_unix_s`. A full handshake refused such a certificate already; a resumed one
/// (a TLS 1.3 ticket) carries the chain verified when its ticket was issued, so services call
/// this on every connection.
pub fn current_peer_identity(certs: &[CertificateDer<'_>], now_unix_s: i64) -> Result<PeerIdentity, CertError> {
    let first = certs.first().ok_or(CertError::NoPeerCertificate)?;
    let cert = x509::parse(first)?;
    let validity = renewal::Validity::of_parsed(&cert);
    if validity.is_expired(now_unix_s) {
        return Err(CertError::PeerExpired { not_after: renewal::rfc3339(validity.not_after) });
    }
    classify(&cert)
}

/// A parsed end-entity certificate's fleet identity, from its subject.
fn classify(cert: &x509_parser::certificate::X509Certificate<'_>) -> Result<PeerIdentity, CertError> {
    let subject = cert.subject();
    let cn = x509::common_name(subject).ok_or_else(|| CertError::BadCertificate("subject has no CN".into()))?;
    match x509::org_unit(subject) {
        Some(x509::OU_DEVICE) => {
            DeviceId::new(cn).map(PeerIdentity::Device).map_err(|reason| CertError::InvalidId { id: cn.to_string(), reason })
        }
        Some(x509::OU_SERVICE) => Ok(PeerIdentity::Service(cn.to_string())),
        _ => Err(CertError::NotADevice(subject.to_string())),
    }
}

/// The ed25519 public key of a certificate (DER).
pub fn certificate_key(der: &CertificateDer<'_>) -> Result<ed25519_dalek::VerifyingKey, CertError> {
    x509::ed25519_key(&x509::parse(der)?)
}

/// The device id of a peer: the CN of its end-entity certificate, which must be a device
/// certificate. Use on `quinn::Connection::peer_identity()` downcast to `Vec<CertificateDer>`.
pub fn device_id_from_peer(certs: &[CertificateDer<'_>]) -> Result<DeviceId, CertError> {
    match peer_identity(certs)? {
        PeerIdentity::Device(id) => Ok(id),
        PeerIdentity::Service(name) => Err(CertError::NotADevice(format!("service {name}"))),
    }
}
