//! Who is at the other end of an mTLS QUIC connection: the one reading of the client
//! certificate chain the handshake verified, for every service.

use fedfleet_certs::PeerIdentity;
use rustls::pki_types::CertificateDer;

use crate::admission::PeerClass;

/// The client's certificate chain, end entity first, as the handshake verified it.
pub fn certificates(conn: &quinn::Connection) -> Option<Vec<CertificateDer<'static>>> {
    conn.peer_identity()?.downcast::<Vec<CertificateDer<'static>>>().ok().map(|b| *b)
}

/// The client's fleet identity (a device or a service), from its end-entity certificate.
pub fn identity(conn: &quinn::Connection) -> Result<PeerIdentity, String> {
    let certs = certificates(conn).ok_or("no client certificate")?;
    fedfleet_certs::peer_identity(&certs).map_err(|e| e.to_string())
}

/// Application close code of a connection whose certificate is refused after its handshake:
/// QUIC's code for the TLS alert `certificate_expired` (0x100 + 45), so that a client reads the
/// same reason as from a refused full handshake ([`crate::tls_alert`]).
pub const CLOSE_CERTIFICATE_EXPIRED: u32 = 0x100 + crate::ALERT_CERTIFICATE_EXPIRED as u32;

/// Why [`checked_identity`] turned a connection away (it is closed already).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerRefusal {
    /// The certificate expired after the session ticket the connection resumed was issued.
    Expired(String),
    /// No client certificate with a fleet identity.
    NoIdentity(String),
}

/// The client's fleet identity, once its certificate is checked again as a resumed session
/// needs: a resumption (a TLS 1.3 ticket) skips the certificate exchange and carries the chain
/// verified up to a ticket's lifetime ago, so expiry is checked here, at `now_ms` (unix ms), on
/// every connection (revocation is checked on every request). A refused connection is closed
/// with its reason.
pub fn checked_identity(conn: &quinn::Connection, now_ms: u64) -> Result<PeerIdentity, PeerRefusal> {
    let refuse = |code: u32, detail: String| {
        conn.close(code.into(), detail.as_bytes());
        detail
    };
    let certs = certificates(conn).unwrap_or_default();
    fedfleet_certs::current_peer_identity(&certs, (now_ms / 1000) as i64).map_err(|e| match e {
        fedfleet_certs::CertError::PeerExpired { .. } => PeerRefusal::Expired(refuse(CLOSE_CERTIFICATE_EXPIRED, e.to_string())),
        e => PeerRefusal::NoIdentity(refuse(1, format!("no fleet identity: {e}"))),
    })
}

/// The admission pool of an authenticated connection: services have their own, so that no
/// fleet of devices can fill it.
pub fn class(conn: &quinn::Connection) -> PeerClass {
    match identity(conn) {
        Ok(PeerIdentity::Service(_)) => PeerClass::Service,
        _ => PeerClass::Device,
    }
}
