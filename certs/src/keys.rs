//! ed25519 keys: generated with ed25519-dalek, stored as PKCS#8 PEM, handed to rcgen and rustls as
//! PKCS#8 DER. One key per identity serves X.509, TLS and (for devices) update signatures.

use std::path::Path;

use ed25519_dalek::pkcs8::{DecodePrivateKey, EncodePrivateKey, spki::der::pem::LineEnding};
use ed25519_dalek::{SigningKey, VerifyingKey};
use rustls_pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};

use crate::error::CertError;
use crate::fsutil;

pub(crate) fn generate() -> SigningKey {
    SigningKey::generate(&mut rand_core::OsRng)
}

pub(crate) fn to_pem(key: &SigningKey) -> Result<String, CertError> {
    key.to_pkcs8_pem(LineEnding::LF).map(|s| s.to_string()).map_err(|e| CertError::BadKey(format!("PKCS#8 encoding failed: {e}")))
}

pub(crate) fn to_pkcs8_der(key: &SigningKey) -> Result<Vec<u8>, CertError> {
    key.to_pkcs8_der().map(|d| d.as_bytes().to_vec()).map_err(|e| CertError::BadKey(format!("PKCS#8 encoding failed: {e}")))
}

/// The rcgen view of an ed25519 key (same key material).
pub(crate) fn to_rcgen(key: &SigningKey) -> Result<rcgen::KeyPair, CertError> {
    let der = to_pkcs8_der(key)?;
    rcgen::KeyPair::try_from(der.as_slice()).map_err(|e| CertError::BadKey(format!("rcgen refused the ed25519 key: {e}")))
}

/// The rustls view of an ed25519 key.
pub(crate) fn to_rustls(key: &SigningKey) -> Result<PrivateKeyDer<'static>, CertError> {
    Ok(PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(to_pkcs8_der(key)?)))
}

pub(crate) fn parse_pem(path: &Path, pem: &str) -> Result<SigningKey, CertError> {
    if !pem.contains("-----BEGIN PRIVATE KEY-----") {
        return Err(CertError::malformed(path, "not a PKCS#8 PEM private key (no BEGIN PRIVATE KEY block)"));
    }
    SigningKey::from_pkcs8_pem(pem).map_err(|e| CertError::malformed(path, format!("not an ed25519 PKCS#8 private key: {e}")))
}

/// Reads an ed25519 PKCS#8 PEM private key.
pub fn load_signing_key(path: &Path) -> Result<SigningKey, CertError> {
    let pem = fsutil::read_string(path)?;
    parse_pem(path, &pem)
}

/// Parses a hex-encoded ed25519 public key and refuses weak (small-order) keys.
pub fn parse_public_key_hex(s: &str) -> Result<VerifyingKey, CertError> {
    let mut bytes = [0u8; 32];
    hex::decode_to_slice(s, &mut bytes).map_err(|_| CertError::BadKey("public key must be 64 hex characters".into()))?;
    let key = VerifyingKey::from_bytes(&bytes).map_err(|_| CertError::BadKey("public key is not a valid ed25519 point".into()))?;
    if key.is_weak() {
        return Err(CertError::BadKey("public key is weak (small order)".into()));
    }
    Ok(key)
}
