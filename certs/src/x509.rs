//! Reading certificates (PEM files and peer DER) with x509-parser.

use std::path::Path;

use ed25519_dalek::VerifyingKey;
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;
use x509_parser::oid_registry::Oid;
use x509_parser::prelude::*;

use crate::error::CertError;
use crate::fsutil;

/// OU of device certificates.
pub const OU_DEVICE: &str = "device";
/// OU of server (service) certificates.
pub const OU_SERVICE: &str = "service";

const OID_ED25519: &str = "1.3.101.112";

/// Reads every CERTIFICATE block of a PEM file (at least one).
pub(crate) fn load_pem_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, CertError> {
    let bytes = fsutil::read(path)?;
    parse_pem_certs(path, &bytes)
}

pub(crate) fn parse_pem_certs(path: &Path, bytes: &[u8]) -> Result<Vec<CertificateDer<'static>>, CertError> {
    let certs = CertificateDer::pem_slice_iter(bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| CertError::malformed(path, format!("corrupt PEM: {}", pem_error(&e))))?;
    if certs.is_empty() {
        return Err(CertError::malformed(path, "no PEM CERTIFICATE block found"));
    }
    for c in &certs {
        parse(c).map_err(|e| CertError::malformed(path, e.to_string()))?;
    }
    Ok(certs)
}

fn pem_error(e: &rustls_pki_types::pem::Error) -> String {
    use rustls_pki_types::pem::Error as E;
    match e {
        E::MissingSectionEnd { end_marker } => {
            format!("missing \"-----END {}-----\" line", String::from_utf8_lossy(end_marker))
        }
        E::IllegalSectionStart { line } => {
            format!("malformed BEGIN line {:?}", String::from_utf8_lossy(line))
        }
        other => other.to_string(),
    }
}

pub(crate) fn parse<'a>(der: &'a [u8]) -> Result<X509Certificate<'a>, CertError> {
    match X509Certificate::from_der(der) {
        Ok(([], cert)) => Ok(cert),
        Ok(_) => Err(CertError::BadCertificate("trailing bytes after the certificate".into())),
        Err(e) => Err(CertError::BadCertificate(format!("not an X.509 certificate: {e}"))),
    }
}

fn attr<'a>(name: &'a X509Name<'a>, oid: &Oid) -> Option<&'a str> {
    name.iter_attributes().find(|a| a.attr_type() == oid).and_then(|a| a.as_str().ok())
}

pub(crate) fn common_name<'a>(name: &'a X509Name<'a>) -> Option<&'a str> {
    attr(name, &x509_parser::oid_registry::OID_X509_COMMON_NAME)
}
pub(crate) fn org_unit<'a>(name: &'a X509Name<'a>) -> Option<&'a str> {
    attr(name, &x509_parser::oid_registry::OID_X509_ORGANIZATIONAL_UNIT)
}
pub(crate) fn organization<'a>(name: &'a X509Name<'a>) -> Option<&'a str> {
    attr(name, &x509_parser::oid_registry::OID_X509_ORGANIZATION_NAME)
}

/// The certificate's ed25519 public key.
pub(crate) fn ed25519_key(cert: &X509Certificate<'_>) -> Result<VerifyingKey, CertError> {
    let spki = cert.public_key();
    if spki.algorithm.algorithm.to_id_string() != OID_ED25519 {
        return Err(CertError::BadCertificate(format!("key type {} is not ed25519", spki.algorithm.algorithm.to_id_string())));
    }
    let bytes: [u8; 32] = spki
        .subject_public_key
        .data
        .as_ref()
        .try_into()
        .map_err(|_| CertError::BadCertificate("ed25519 public key is not 32 bytes".into()))?;
    VerifyingKey::from_bytes(&bytes).map_err(|_| CertError::BadCertificate("ed25519 public key is not a valid point".into()))
}

pub(crate) fn serial_hex(cert: &X509Certificate<'_>) -> String {
    hex::encode(cert.raw_serial())
}

/// Rebuilds the rcgen distinguished name of `name` (attribute order and string values kept), so
/// certificates issued by a CA loaded from disk carry the CA's subject byte for byte.
pub(crate) fn to_rcgen_dn(name: &X509Name<'_>) -> Result<rcgen::DistinguishedName, CertError> {
    use x509_parser::oid_registry as oids;
    let mut dn = rcgen::DistinguishedName::new();
    for a in name.iter_attributes() {
        let value = a.as_str().map_err(|_| CertError::BadCertificate("CA subject has a non-string attribute".into()))?;
        let oid = a.attr_type();
        let ty = if *oid == oids::OID_X509_COMMON_NAME {
            rcgen::DnType::CommonName
        } else if *oid == oids::OID_X509_ORGANIZATION_NAME {
            rcgen::DnType::OrganizationName
        } else if *oid == oids::OID_X509_ORGANIZATIONAL_UNIT {
            rcgen::DnType::OrganizationalUnitName
        } else {
            let arcs = oid.iter().ok_or_else(|| CertError::BadCertificate("CA subject has an unusual OID".into()))?.collect();
            rcgen::DnType::CustomDnType(arcs)
        };
        dn.push(ty, value);
    }
    Ok(dn)
}
