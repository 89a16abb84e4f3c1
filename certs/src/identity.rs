//! Loaded identities: the fleet CA certificate (trust anchor), a server's certificate and key, and
//! a device's certificate and key. The only place PEM files are read for TLS.

use std::fmt;
use std::path::{Path, PathBuf};

use ed25519_dalek::{SigningKey, VerifyingKey};
use fedfleet_protocol::{DeviceId, FleetId};
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use crate::error::CertError;
use crate::{keys, layout, x509};

/// The fleet CA certificate: the one trust anchor of both TLS sides, and the key that signs the
/// revocation list.
#[derive(Clone)]
pub struct CaCert {
    der: CertificateDer<'static>,
    key: VerifyingKey,
    fleet: Option<FleetId>,
    path: PathBuf,
}

impl fmt::Debug for CaCert {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CaCert").field("path", &self.path).field("fleet", &self.fleet).finish()
    }
}

impl CaCert {
    /// Reads `ca.crt` (PEM) and checks it is an ed25519 CA certificate.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, CertError> {
        let path = path.as_ref();
        let mut certs = x509::load_pem_certs(path)?;
        let der = certs.swap_remove(0);
        Self::from_der(der, path)
    }

    pub(crate) fn from_der(der: CertificateDer<'static>, path: &Path) -> Result<Self, CertError> {
        let bad = |e: CertError| CertError::malformed(path, e.to_string());
        let cert = x509::parse(&der).map_err(bad)?;
        if !cert.is_ca() {
            return Err(CertError::malformed(path, "certificate is not a CA certificate"));
        }
        let key = x509::ed25519_key(&cert).map_err(bad)?;
        let fleet = x509::organization(cert.subject()).and_then(|o| FleetId::new(o).ok());
        drop(cert);
        Ok(CaCert { der, key, fleet, path: path.to_path_buf() })
    }

    /// The certificate in DER form.
    pub fn der(&self) -> &CertificateDer<'static> {
        &self.der
    }
    /// The CA's ed25519 public key (verifies the revocation list).
    pub fn public_key(&self) -> &VerifyingKey {
        &self.key
    }
    /// The fleet named in the CA subject (O=), if it is a valid fleet id.
    pub fn fleet(&self) -> Option<&FleetId> {
        self.fleet.as_ref()
    }
    /// Where it was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }
    /// A root store holding only this CA.
    pub fn root_store(&self) -> Result<rustls::RootCertStore, CertError> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.der.clone()).map_err(|e| CertError::Tls(format!("CA certificate refused as trust anchor: {e}")))?;
        Ok(roots)
    }
}

fn load_key_matching(cert_path: &Path, cert: &CertificateDer<'_>, key_path: &Path) -> Result<SigningKey, CertError> {
    let key = keys::load_signing_key(key_path)?;
    let parsed = x509::parse(cert).map_err(|e| CertError::malformed(cert_path, e.to_string()))?;
    let cert_key = x509::ed25519_key(&parsed).map_err(|e| CertError::malformed(cert_path, e.to_string()))?;
    if cert_key != key.verifying_key() {
        return Err(CertError::malformed(key_path, format!("private key does not match the certificate {}", cert_path.display())));
    }
    Ok(key)
}

/// A server's (aggregator, registry) certificate chain and private key.
pub struct ServerIdentity {
    name: String,
    chain: Vec<CertificateDer<'static>>,
    key: SigningKey,
}

impl fmt::Debug for ServerIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerIdentity").field("name", &self.name).finish_non_exhaustive()
    }
}

impl ServerIdentity {
    /// Loads `servers/<name>.crt` and `servers/<name>.key` from a PKI directory.
    pub fn load(pki_dir: impl AsRef<Path>, name: &str) -> Result<Self, CertError> {
        layout::validate_name(name)?;
        let (crt, key) = layout::server_paths(pki_dir.as_ref(), name);
        Self::from_files(&crt, &key)
    }

    /// Loads a server identity from explicit files.
    pub fn from_files(cert: &Path, key: &Path) -> Result<Self, CertError> {
        let chain = x509::load_pem_certs(cert)?;
        let signing = load_key_matching(cert, &chain[0], key)?;
        let parsed = x509::parse(&chain[0]).map_err(|e| CertError::malformed(cert, e.to_string()))?;
        let name = x509::common_name(parsed.subject()).unwrap_or_default().to_string();
        drop(parsed);
        Ok(ServerIdentity { name, chain, key: signing })
    }

    /// The leaf certificate's validity.
    pub fn validity(&self) -> Result<crate::renewal::Validity, CertError> {
        crate::renewal::Validity::of(&self.chain[0])
    }

    /// The certificate's CN.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// The service's ed25519 key: its TLS key and, on a relay, the key that signs the partial
    /// sums it forwards (its parent checks them against the connection's certificate).
    pub fn signing_key(&self) -> SigningKey {
        self.key.clone()
    }
    /// Leaf first.
    pub fn cert_chain(&self) -> &[CertificateDer<'static>] {
        &self.chain
    }
    pub(crate) fn private_key_der(&self) -> Result<PrivateKeyDer<'static>, CertError> {
        keys::to_rustls(&self.key)
    }
    /// 32 bytes derived from the private key for `context` (never the key itself): a secret
    /// that lives as long as this identity, e.g. to seed a QUIC stateless-reset key.
    pub fn derive_secret(&self, context: &str) -> [u8; 32] {
        blake3::derive_key(context, &self.key.to_bytes())
    }
}

/// A device's certificate, private key and the fleet CA it trusts.
#[derive(Clone)]
pub struct DeviceIdentity {
    id: DeviceId,
    cert: CertificateDer<'static>,
    key: SigningKey,
    /// Shared: a simulator holds a hundred thousand identities of one fleet.
    ca: std::sync::Arc<CaCert>,
}

impl fmt::Debug for DeviceIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceIdentity").field("id", &self.id).finish_non_exhaustive()
    }
}

impl DeviceIdentity {
    /// Loads `devices/<id>.crt|.key` and `ca.crt` from a PKI directory.
    pub fn load(pki_dir: impl AsRef<Path>, id: &DeviceId) -> Result<Self, CertError> {
        let dir = pki_dir.as_ref();
        let (crt, key) = layout::device_paths(dir, id);
        Self::from_files(&crt, &key, &layout::ca_cert(dir))
    }

    /// Loads a device identity from explicit files (what an agent is provisioned with).
    pub fn from_files(cert: &Path, key: &Path, ca: &Path) -> Result<Self, CertError> {
        Self::from_files_at(cert, key, ca, rustls_pki_types::UnixTime::now().as_secs() as i64)
    }

    /// [`DeviceIdentity::from_files`] judged at `now` (unix seconds, the caller's clock): an
    /// expired certificate is [`CertError::Expired`], named as such.
    pub fn from_files_at(cert: &Path, key: &Path, ca: &Path, now: i64) -> Result<Self, CertError> {
        let ca = CaCert::load(ca)?;
        let mut chain = x509::load_pem_certs(cert)?;
        let der = chain.swap_remove(0);
        let signing = load_key_matching(cert, &der, key)?;
        Self::checked(cert, ca, der, chain, signing, now)
    }

    fn checked(
        cert: &Path,
        ca: CaCert,
        der: CertificateDer<'static>,
        chain: Vec<CertificateDer<'static>>,
        signing: SigningKey,
        now: i64,
    ) -> Result<Self, CertError> {
        let validity = crate::renewal::Validity::of(&der).map_err(|e| CertError::malformed(cert, e.to_string()))?;
        if validity.is_expired(now) {
            return Err(CertError::Expired {
                path: cert.to_owned(),
                not_after: crate::renewal::rfc3339(validity.not_after),
                now: crate::renewal::rfc3339(now),
            });
        }
        let at = rustls_pki_types::UnixTime::since_unix_epoch(std::time::Duration::from_secs(now.max(0) as u64));
        crate::tls::verify_issued_by_at(&ca, &der, &chain, at).map_err(|reason| CertError::NotIssuedByCa {
            path: cert.to_owned(),
            ca: ca.path().to_owned(),
            reason,
        })?;
        let id = crate::device_id_from_peer(std::slice::from_ref(&der)).map_err(|e| CertError::malformed(cert, e.to_string()))?;
        Ok(DeviceIdentity { id, cert: der, key: signing, ca: std::sync::Arc::new(ca) })
    }

    /// An identity the CA has just issued (no file, nothing to check).
    pub(crate) fn issued(id: DeviceId, cert: CertificateDer<'static>, key: SigningKey, ca: std::sync::Arc<CaCert>) -> Self {
        DeviceIdentity { id, cert, key, ca }
    }

    /// A renewed certificate (PEM, from the renewing service) for this identity: it must name
    /// the same device, carry the same key and chain to the same CA, valid at `now`.
    pub fn renewed(&self, pem: &str, now: i64) -> Result<DeviceIdentity, CertError> {
        let origin = crate::renewal::renewal_origin();
        let der = crate::renewal::parse_received_pem(&origin, pem)?;
        let parsed = x509::parse(&der)?;
        if x509::ed25519_key(&parsed)? != self.key.verifying_key() {
            return Err(CertError::RenewalMismatch("it carries another key".into()));
        }
        drop(parsed);
        let renewed = Self::checked(&origin, CaCert::clone(&self.ca), der, Vec::new(), self.key.clone(), now)?;
        if renewed.id != self.id {
            return Err(CertError::RenewalMismatch(format!("it names {} instead of {}", renewed.id, self.id)));
        }
        Ok(renewed)
    }

    /// The certificate's validity.
    pub fn validity(&self) -> crate::renewal::Validity {
        crate::renewal::Validity::of(&self.cert).expect("checked when loaded")
    }

    /// The device id (the certificate's CN).
    pub fn device_id(&self) -> &DeviceId {
        &self.id
    }
    /// The device's ed25519 key: the TLS client key and the key that signs weight updates.
    pub fn signing_key(&self) -> SigningKey {
        self.key.clone()
    }
    /// The public half of [`signing_key`](Self::signing_key).
    pub fn verifying_key(&self) -> VerifyingKey {
        self.key.verifying_key()
    }
    /// The device certificate (DER).
    pub fn cert(&self) -> &CertificateDer<'static> {
        &self.cert
    }
    /// The fleet CA the device trusts.
    pub fn ca(&self) -> &CaCert {
        &self.ca
    }
    pub(crate) fn private_key_der(&self) -> Result<PrivateKeyDer<'static>, CertError> {
        keys::to_rustls(&self.key)
    }
}
