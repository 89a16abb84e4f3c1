//! rustls configurations for fleet mTLS, built on the ring provider only (never the process
//! default, so a second provider elsewhere in the tree changes nothing).

use std::sync::Arc;

use rustls::client::danger::HandshakeSignatureValid;
use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{CertificateError, ClientConfig, DigitallySignedStruct, DistinguishedName, ServerConfig, SignatureScheme};
use rustls_pki_types::{CertificateDer, UnixTime};

use crate::error::CertError;
use crate::identity::{CaCert, DeviceIdentity, ServerIdentity};
use crate::revocation::RevocationWatcher;
use crate::{PeerIdentity, peer_identity};

/// The ring crypto provider every fleet TLS config uses, AES-128-GCM with SHA-256 first (TLS 1.3's
/// mandatory suite; ring's default puts AES-256 with SHA-384 first): a resumed handshake is
/// mostly key schedule, and SHA-256 runs on the CPU's SHA extensions where SHA-384 has none.
pub fn provider() -> Arc<CryptoProvider> {
    let mut provider = rustls::crypto::ring::default_provider();
    provider.cipher_suites.sort_by_key(|s| s.suite() != rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
    Arc::new(provider)
}

/// The clock TLS judges certificate validity by: the system clock by default, a test's fake
/// clock (unix milliseconds) through [`clock_time`].
pub type TimeSource = Arc<dyn rustls::time_provider::TimeProvider>;

/// The system clock.
pub fn system_time() -> TimeSource {
    Arc::new(rustls::time_provider::DefaultTimeProvider)
}

struct ClockTime<F>(F);

impl<F> std::fmt::Debug for ClockTime<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClockTime")
    }
}

impl<F: Fn() -> u64 + Send + Sync> rustls::time_provider::TimeProvider for ClockTime<F> {
    fn current_time(&self) -> Option<UnixTime> {
        Some(UnixTime::since_unix_epoch(std::time::Duration::from_millis((self.0)())))
    }
}

/// A time source reading `now_ms` (unix milliseconds), e.g. a service's or an agent's clock.
pub fn clock_time(now_ms: impl Fn() -> u64 + Send + Sync + 'static) -> TimeSource {
    Arc::new(ClockTime(now_ms))
}

fn tls_err(e: impl std::fmt::Display) -> CertError {
    CertError::Tls(e.to_string())
}

fn alpn_vec(alpn: &[&[u8]]) -> Vec<Vec<u8>> {
    alpn.iter().map(|p| p.to_vec()).collect()
}

/// Client certificate verifier: the webpki checks (chain to the fleet CA, validity, EKU
/// clientAuth, handshake signature), then refuses device certificates on the revocation list.
#[derive(Debug)]
pub struct RevocationCheckingVerifier {
    inner: Arc<dyn ClientCertVerifier>,
    revocation: Arc<RevocationWatcher>,
    /// Fleet endpoints require a certificate; the operator console also takes bearer tokens.
    mandatory: bool,
}

/// Checks `leaf` (with `intermediates`) the way the fleet's servers will on every handshake:
/// issued by `ca`, valid now, usable as a client certificate. The reason, in rustls's words.
pub fn verify_issued_by(
    ca: &CaCert,
    leaf: &rustls::pki_types::CertificateDer<'static>,
    intermediates: &[rustls::pki_types::CertificateDer<'static>],
) -> Result<(), String> {
    verify_issued_by_at(ca, leaf, intermediates, UnixTime::now())
}

/// [`verify_issued_by`] at time `now`.
pub fn verify_issued_by_at(
    ca: &CaCert,
    leaf: &rustls::pki_types::CertificateDer<'static>,
    intermediates: &[rustls::pki_types::CertificateDer<'static>],
    now: UnixTime,
) -> Result<(), String> {
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(ca.root_store().map_err(|e| e.to_string())?), provider())
        .build()
        .map_err(|e| e.to_string())?;
    verifier.verify_client_cert(leaf, intermediates, now).map(|_| ()).map_err(|e| e.to_string())
}

impl RevocationCheckingVerifier {
    pub fn new(ca: &CaCert, revocation: Arc<RevocationWatcher>) -> Result<Self, CertError> {
        let inner = WebPkiClientVerifier::builder_with_provider(Arc::new(ca.root_store()?), provider()).build().map_err(tls_err)?;
        Ok(RevocationCheckingVerifier { inner, revocation, mandatory: true })
    }
}

impl ClientCertVerifier for RevocationCheckingVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }
    fn client_auth_mandatory(&self) -> bool {
        self.mandatory
    }
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let verified = match self.inner.verify_client_cert(end_entity, intermediates, now) {
            Ok(v) => v,
            Err(e @ rustls::Error::InvalidCertificate(CertificateError::Expired | CertificateError::ExpiredContext { .. })) => {
                // The client reads the certificate_expired alert as the named reason.
                let who = peer_identity(std::slice::from_ref(end_entity)).map(|p| format!("{p:?}")).unwrap_or_default();
                tracing::info!(peer = %who, reason = "certificate_expired", "refused expired client certificate");
                return Err(e);
            }
            Err(e) => return Err(e),
        };
        match peer_identity(std::slice::from_ref(end_entity)) {
            Ok(PeerIdentity::Device(id)) => {
                if self.revocation.is_revoked(&id) {
                    tracing::info!(device = %id, "refused revoked device certificate");
                    return Err(rustls::Error::InvalidCertificate(CertificateError::Revoked));
                }
                Ok(verified)
            }
            // Service certificates are not on the device revocation list.
            Ok(PeerIdentity::Service(_)) => Ok(verified),
            Err(e) => {
                tracing::info!(error = %e, "refused client certificate without a fleet identity");
                Err(rustls::Error::InvalidCertificate(CertificateError::BadEncoding))
            }
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// Server side of fleet mTLS: client certificates are required, must chain to `ca`, and device
/// certificates on the revocation list are refused (checked on every handshake).
pub fn server_config(
    ca: &CaCert,
    identity: &ServerIdentity,
    revocation: Arc<RevocationWatcher>,
    alpn: &[&[u8]],
) -> Result<ServerConfig, CertError> {
    server_config_at(ca, identity, revocation, alpn, system_time())
}

/// [`server_config`] judging client certificates' validity by `time`.
pub fn server_config_at(
    ca: &CaCert,
    identity: &ServerIdentity,
    revocation: Arc<RevocationWatcher>,
    alpn: &[&[u8]],
    time: TimeSource,
) -> Result<ServerConfig, CertError> {
    let mut config = server_config_with(RevocationCheckingVerifier::new(ca, revocation)?, identity, alpn, time)?;
    // Stateless resumption: a device's next connection (its next round) skips the certificate
    // exchange and its signatures. The ticket, sealed with a key only this process holds
    // (rotated every 6 h), carries the chain verified at the full handshake, so the server keeps
    // nothing per device. What the full handshake checked and a resumed one does not, the
    // services check on every connection or request: expiry ([`crate::current_peer_identity`]) and
    // revocation.
    config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    config.ticketer = rustls::crypto::ring::Ticketer::new().map_err(tls_err)?;
    Ok(config)
}

/// TLS 1.3 with `identity`'s certificate, client certificates judged by `verifier`.
fn server_config_with(
    verifier: RevocationCheckingVerifier,
    identity: &ServerIdentity,
    alpn: &[&[u8]],
    time: TimeSource,
) -> Result<ServerConfig, CertError> {
    let mut config = ServerConfig::builder_with_details(provider(), time)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_err)?
        .with_client_cert_verifier(Arc::new(verifier))
        .with_single_cert(identity.cert_chain().to_vec(), identity.private_key_der()?)
        .map_err(tls_err)?;
    config.alpn_protocols = alpn_vec(alpn);
    Ok(config)
}

/// Server side of the operator console's HTTPS: a client certificate is optional (operators may
/// bring a bearer token instead) but, when presented, checked like [`server_config`]'s; the
/// console decides what the identity may do. ALPN `http/1.1`.
pub fn console_server_config(
    ca: &CaCert,
    identity: &ServerIdentity,
    revocation: Arc<RevocationWatcher>,
    time: TimeSource,
) -> Result<ServerConfig, CertError> {
    let mut verifier = RevocationCheckingVerifier::new(ca, revocation)?;
    verifier.mandatory = false;
    let mut config = server_config_with(verifier, identity, &[b"http/1.1"], time)?;
    // Every console connection shows its certificate: operators are few, and nothing would
    // check a resumed session's certificate after the fact.
    config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    config.send_tls13_tickets = 0;
    Ok(config)
}

fn client_builder(ca: &CaCert) -> Result<rustls::ConfigBuilder<ClientConfig, rustls::client::WantsClientCert>, CertError> {
    client_builder_at(ca, system_time())
}

fn client_builder_at(
    ca: &CaCert,
    time: TimeSource,
) -> Result<rustls::ConfigBuilder<ClientConfig, rustls::client::WantsClientCert>, CertError> {
    Ok(ClientConfig::builder_with_details(provider(), time)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_err)?
        .with_root_certificates(ca.root_store()?))
}

/// Device side of fleet mTLS: trusts only `ca`, presents the device certificate.
pub fn client_config(ca: &CaCert, device: &DeviceIdentity, alpn: &[&[u8]]) -> Result<ClientConfig, CertError> {
    client_config_at(ca, device, alpn, system_time())
}

/// [`client_config`] judging the server certificate's validity by `time`.
pub fn client_config_at(ca: &CaCert, device: &DeviceIdentity, alpn: &[&[u8]], time: TimeSource) -> Result<ClientConfig, CertError> {
    let mut config =
        client_builder_at(ca, time)?.with_client_auth_cert(vec![device.cert().clone()], device.private_key_der()?).map_err(tls_err)?;
    config.alpn_protocols = alpn_vec(alpn);
    Ok(config)
}

/// A service (e.g. the aggregator publishing to the registry) connecting to another service,
/// presenting its own server certificate (which carries EKU clientAuth too).
pub fn service_client_config(ca: &CaCert, service: &ServerIdentity, alpn: &[&[u8]]) -> Result<ClientConfig, CertError> {
    let mut config =
        client_builder(ca)?.with_client_auth_cert(service.cert_chain().to_vec(), service.private_key_der()?).map_err(tls_err)?;
    config.alpn_protocols = alpn_vec(alpn);
    Ok(config)
}

/// Verifies the server against `ca` and presents no client certificate (operator tools, tests).
/// Fleet servers built with [`server_config`] refuse such clients.
pub fn anonymous_client_config(ca: &CaCert, alpn: &[&[u8]]) -> Result<ClientConfig, CertError> {
    let mut config = client_builder(ca)?.with_no_client_auth();
    config.alpn_protocols = alpn_vec(alpn);
    Ok(config)
}
