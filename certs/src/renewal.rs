//! Certificate lifetimes and renewal: when a certificate expires, the issuer a fleet service uses
//! to renew a device's certificate over its current mTLS identity, and the warning services give
//! before their own certificate lapses.
//!
//! Renewal keeps the device's key (the key that signs its weight updates, pinned in the
//! aggregator's allow-list), its id and its fleet; only the validity and the serial change.

use std::path::{Path, PathBuf};

use ed25519_dalek::{SigningKey, VerifyingKey};
use fedfleet_protocol::{DeviceId, FleetId};
use rcgen::{CertificateParams, ExtendedKeyUsagePurpose};
use rustls_pki_types::CertificateDer;
use time::OffsetDateTime;

use crate::error::CertError;
use crate::identity::CaCert;
use crate::{PeerIdentity, keys, peer_identity, pki, x509};

/// A service warns when its own certificate expires within this many days, or within the last
/// third of its lifetime if that is shorter (a 30-day certificate is not "expiring" when issued).
pub const EXPIRY_WARNING_DAYS: u64 = 30;

/// An ed25519 public key as rcgen's subject key: renewal signs a certificate for a key whose
/// private half only the device holds.
pub(crate) struct Ed25519Public(pub VerifyingKey);

impl rcgen::PublicKeyData for Ed25519Public {
    fn der_bytes(&self) -> &[u8] {
        self.0.as_bytes()
    }
    fn algorithm(&self) -> &'static rcgen::SignatureAlgorithm {
        &rcgen::PKCS_ED25519
    }
}

/// A certificate's validity, unix seconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Validity {
    pub not_before: i64,
    pub not_after: i64,
}

impl Validity {
    /// Of a DER certificate.
    pub fn of(der: &[u8]) -> Result<Validity, CertError> {
        Ok(Validity::of_parsed(&x509::parse(der)?))
    }

    pub(crate) fn of_parsed(cert: &x509_parser::certificate::X509Certificate<'_>) -> Validity {
        let v = cert.validity();
        Validity { not_before: v.not_before.timestamp(), not_after: v.not_after.timestamp() }
    }

    /// Seconds from `now` until `not_after` (negative once expired).
    pub fn seconds_left(&self, now: i64) -> i64 {
        self.not_after - now
    }

    /// Whether a service should warn about its own certificate at `now`: within
    /// [`EXPIRY_WARNING_DAYS`] of its end, or within the last third of its lifetime if that is
    /// shorter, so that short-lived certificates do not warn from the moment they are issued.
    pub fn expiry_warning_due(&self, now: i64) -> bool {
        let lifetime = (self.not_after - self.not_before).max(0);
        self.seconds_left(now) < (EXPIRY_WARNING_DAYS as i64 * 86_400).min(lifetime / 3)
    }

    pub fn is_expired(&self, now: i64) -> bool {
        now > self.not_after
    }

    /// Whether a certificate should be renewed at `now`: within `renew_before` seconds of its
    /// end, or in the last third of its lifetime, whichever comes first.
    pub fn renewal_due(&self, now: i64, renew_before: i64) -> bool {
        let lifetime = (self.not_after - self.not_before).max(0);
        self.seconds_left(now) <= renew_before.max(lifetime / 3)
    }
}

/// `not_after` in RFC 3339, for messages.
pub fn rfc3339(unix: i64) -> String {
    OffsetDateTime::from_unix_timestamp(unix)
        .ok()
        .and_then(|t| t.format(&time::format_description::well_known::Rfc3339).ok())
        .unwrap_or_else(|| format!("unix {unix}"))
}

/// Logs a WARN when a service's own certificate `name` expires soon at `now`
/// ([`Validity::expiry_warning_due`]; an ERROR once it has), and returns the seconds left.
pub fn warn_if_expiring(name: &str, validity: Validity, now: i64) -> i64 {
    let left = validity.seconds_left(now);
    let not_after = rfc3339(validity.not_after);
    if left <= 0 {
        tracing::error!(certificate = name, %not_after, "this service's certificate has expired: clients refuse it; issue a new one (fedfleet-certs issue-server --force) and restart");
    } else if validity.expiry_warning_due(now) {
        tracing::warn!(certificate = name, %not_after, days_left = left / 86_400, "this service's certificate expires soon: issue a new one (fedfleet-certs issue-server --force) and restart");
    }
    left
}

/// What renewal issued.
#[derive(Debug, Clone)]
pub struct RenewedCertificate {
    pub device_id: DeviceId,
    /// The new certificate, PEM.
    pub pem: String,
    /// Lowercase hex.
    pub serial: String,
    /// Unix seconds.
    pub not_after: i64,
}

/// Signs renewed device certificates: the fleet CA certificate and its private key, held by the
/// service that renews (the registry's `[renewal] ca_key`).
pub struct DeviceIssuer {
    ca: CaCert,
    ca_key: SigningKey,
    fleet: FleetId,
}

impl std::fmt::Debug for DeviceIssuer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceIssuer").field("fleet", &self.fleet).finish_non_exhaustive()
    }
}

impl DeviceIssuer {
    /// The CA certificate at `ca_cert` and its key at `ca_key`, which must match.
    pub fn load(ca_cert: &Path, ca_key: &Path) -> Result<DeviceIssuer, CertError> {
        let ca = CaCert::load(ca_cert)?;
        let key = keys::load_signing_key(ca_key)?;
        if key.verifying_key() != *ca.public_key() {
            return Err(CertError::malformed(ca_key, format!("CA key does not match {}", ca_cert.display())));
        }
        let fleet = ca.fleet().cloned().ok_or_else(|| CertError::malformed(ca_cert, "CA subject carries no fleet name (O=)"))?;
        Ok(DeviceIssuer { ca, ca_key: key, fleet })
    }

    pub fn fleet(&self) -> &FleetId {
        &self.fleet
    }

    /// A new certificate for the device presenting `current` (its verified mTLS certificate):
    /// same id, fleet and key, valid from `now` for `days` (never past the CA).
    pub fn renew(&self, current: &CertificateDer<'_>, days: u32, now: i64) -> Result<RenewedCertificate, CertError> {
        let id = match peer_identity(std::slice::from_ref(current))? {
            PeerIdentity::Device(id) => id,
            PeerIdentity::Service(n) => return Err(CertError::NotADevice(format!("service {n}"))),
        };
        let parsed = x509::parse(current)?;
        let key = x509::ed25519_key(&parsed)?;
        if x509::organization(parsed.subject()) != Some(self.fleet.as_str()) {
            return Err(CertError::RenewalMismatch(format!("device {id} is not of fleet {}", self.fleet)));
        }
        drop(parsed);
        let mut params = CertificateParams::default();
        params.distinguished_name = pki::device_dn(&self.fleet, &id);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let now_t = OffsetDateTime::from_unix_timestamp(now).map_err(|e| CertError::BadCertificate(format!("time {now}: {e}")))?;
        let (cert, serial, not_after) = pki::sign_leaf_at(&self.ca, &self.ca_key, params, &Ed25519Public(key), days, now_t)?;
        Ok(RenewedCertificate { device_id: id, pem: cert.pem(), serial, not_after: not_after.unix_timestamp() })
    }

    /// Revokes device `id` in `pki`'s lists (`revoked.json` re-signed with this CA key,
    /// `devices.json` marked), as `fedfleet-certs revoke` does on the CA's host.
    pub fn revoke(&self, pki: &crate::Pki, id: &DeviceId, reason: &str) -> Result<crate::Revocation, CertError> {
        if pki.ca().public_key() != self.ca.public_key() {
            return Err(CertError::RenewalMismatch(format!("the PKI directory {} is of another CA than this key", pki.dir().display())));
        }
        pki.revoke_signed_by(id, reason, || Ok(self.ca_key.clone()))
    }
}

/// Parses the one certificate of a PEM text received from a renewing service.
pub(crate) fn parse_received_pem(origin: &Path, pem: &str) -> Result<CertificateDer<'static>, CertError> {
    let mut certs = x509::parse_pem_certs(origin, pem.as_bytes())?;
    if certs.len() != 1 {
        return Err(CertError::RenewalMismatch(format!("expected one certificate, got {}", certs.len())));
    }
    Ok(certs.swap_remove(0))
}

/// Where a renewal came from, for error messages.
pub(crate) fn renewal_origin() -> PathBuf {
    PathBuf::from("<renewed certificate>")
}
