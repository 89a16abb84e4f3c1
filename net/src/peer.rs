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

/// The admission pool of an authenticated connection: services have their own, so that no
/// fleet of devices can fill it.
pub fn class(conn: &quinn::Connection) -> PeerClass {
    match identity(conn) {
        Ok(PeerIdentity::Service(_)) => PeerClass::Service,
        _ => PeerClass::Device,
    }
}
