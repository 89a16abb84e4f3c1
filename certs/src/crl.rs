//! The revocation list as an X.509 CRL (`ca.crl`, PEM), for the TLS servers that are not
//! fedfleet's own: mosquitto's `crlfile`, an HTTPS mirror in front of the registry. fedfleet's
//! servers read `revoked.json`; the CRL lists the same certificate serials, is signed by the same
//! CA key and is numbered by the list's version, so a broker can tell it is current.
//!
//! Its `thisUpdate` is the list's `issued_at`, which [`crate::Pki::revoke`] keeps strictly
//! increasing: OpenSSL keeps every CRL a server ever loaded and, between two from the same
//! issuer, uses the one with the later `thisUpdate` — a tie would keep the older list in force.
//! Its `nextUpdate` is the CA's own expiry: the CRL is replaced on every revocation, never on a
//! schedule, and an expired CRL would lock every device out of the broker.

use std::path::{Path, PathBuf};

use ed25519_dalek::SigningKey;
use rcgen::{CertificateRevocationListParams, KeyIdMethod, RevokedCertParams, SerialNumber};
use time::OffsetDateTime;

use crate::error::CertError;
use crate::identity::CaCert;
use crate::revocation::RevocationList;
use crate::{fsutil, layout, pki};

/// What a CRL on disk says about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CrlSummary {
    /// The CRL number: the `revoked.json` version it was written from.
    pub number: u64,
    /// Serials listed.
    pub revoked: usize,
}

/// Writes `ca.crl` in `dir` for `list`, signed with `ca_key`.
pub(crate) fn write(dir: &Path, ca: &CaCert, ca_key: &SigningKey, list: &RevocationList) -> Result<PathBuf, CertError> {
    let (issuer, ca_not_after) = pki::ca_issuer(ca, ca_key)?;
    let at = |secs: u64| {
        OffsetDateTime::from_unix_timestamp(secs as i64).map_err(|e| CertError::Generate(format!("time {secs} out of range: {e}")))
    };
    let mut revoked_certs = Vec::with_capacity(list.entries.len());
    for e in &list.entries {
        let serial = hex::decode(&e.serial).map_err(|err| {
            CertError::malformed(layout::revocation_list(dir), format!("serial {:?} of {}: {err}", e.serial, e.device_id))
        })?;
        revoked_certs.push(RevokedCertParams {
            serial_number: SerialNumber::from_slice(&serial),
            revocation_time: at(e.revoked_at)?,
            reason_code: None,
            invalidity_date: None,
        });
    }
    let this_update = at(list.issued_at)?;
    let params = CertificateRevocationListParams {
        this_update,
        next_update: ca_not_after.max(this_update + time::Duration::days(1)),
        crl_number: SerialNumber::from(list.version),
        issuing_distribution_point: None,
        revoked_certs,
        key_identifier_method: KeyIdMethod::Sha256,
    };
    let pem = params.signed_by(&issuer)?.pem()?;
    let path = layout::crl(dir);
    fsutil::write_atomic(&path, pem.as_bytes(), false)?;
    Ok(path)
}

/// Reads the CRL at `path` (PEM) and says which list version it carries and how many serials.
pub fn summary(path: &Path) -> Result<CrlSummary, CertError> {
    let bytes = fsutil::read(path)?;
    let bad = |what: String| CertError::malformed(path, what);
    let (_, pem) = x509_parser::pem::parse_x509_pem(&bytes).map_err(|e| bad(format!("not a PEM CRL: {e}")))?;
    let (_, crl) = x509_parser::parse_x509_crl(&pem.contents).map_err(|e| bad(format!("not an X.509 CRL: {e}")))?;
    let digits = crl.crl_number().map(|n| n.to_u64_digits()).ok_or_else(|| bad("the CRL carries no CRL number".into()))?;
    let number = match digits.as_slice() {
        [] => 0,
        [n] => *n,
        _ => return Err(bad("CRL number past 64 bits".into())),
    };
    Ok(CrlSummary { number, revoked: crl.iter_revoked_certificates().count() })
}
