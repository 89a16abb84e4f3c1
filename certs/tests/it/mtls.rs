//! A quinn server configured by `tls::server_config` on 127.0.0.1:0, and clients with a device
//! certificate, a foreign certificate, no certificate, and a certificate revoked while the server
//! runs. With quinn a refused client may see `connect()` succeed; the refusal shows on first use of
//! a stream, so every case opens a bi stream and asserts on the echo.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use fedfleet_certs::{
    ALPN_V1, CaCert, DeviceIdentity, PeerIdentity, Pki, RevocationWatcher, ServerIdentity, device_id_from_peer, peer_identity, tls,
};
use fedfleet_protocol::{DeviceId, FleetId};
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rustls_pki_types::CertificateDer;
use tokio::sync::mpsc;
use tokio::time::timeout;

const LIMIT: Duration = Duration::from_secs(10);

fn id(s: &str) -> DeviceId {
    DeviceId::new(s).unwrap()
}

fn init_pki(dir: &Path, fleet: &str) -> Pki {
    Pki::init(dir, &FleetId::new(fleet).unwrap(), 30, false).unwrap()
}

struct Server {
    addr: SocketAddr,
    endpoint: quinn::Endpoint,
    /// Device ids the server saw on accepted connections.
    seen: mpsc::UnboundedReceiver<DeviceId>,
}

/// Accepts connections; for each bi stream, echoes back the peer's device id.
fn start_server(pki_dir: &Path) -> Server {
    let ca = CaCert::load(pki_dir.join("ca.crt")).unwrap();
    let identity = ServerIdentity::load(pki_dir, "aggregator").unwrap();
    let revocation = Arc::new(RevocationWatcher::open(pki_dir).unwrap());
    let tls = tls::server_config(&ca, &identity, revocation, &[ALPN_V1]).unwrap();
    let quic = QuicServerConfig::try_from(tls).unwrap();
    let config = quinn::ServerConfig::with_crypto(Arc::new(quic));
    let endpoint = quinn::Endpoint::server(config, "127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = endpoint.local_addr().unwrap();
    let (tx, seen) = mpsc::unbounded_channel();
    let ep = endpoint.clone();
    tokio::spawn(async move {
        while let Some(incoming) = ep.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let Ok(conn) = incoming.await else { return };
                let certs = conn
                    .peer_identity()
                    .and_then(|p| p.downcast::<Vec<CertificateDer<'static>>>().ok())
                    .expect("mTLS connection has peer certificates");
                // Devices are reported; a service peer is answered with its name.
                let who = match device_id_from_peer(&certs) {
                    Ok(device) => {
                        let _ = tx.send(device.clone());
                        device.to_string()
                    }
                    Err(_) => match peer_identity(&certs).expect("peer has a fleet identity") {
                        PeerIdentity::Service(name) => format!("service:{name}"),
                        PeerIdentity::Device(_) => unreachable!(),
                    },
                };
                while let Ok((mut send, mut recv)) = conn.accept_bi().await {
                    let _ = recv.read_to_end(1024).await;
                    let _ = send.write_all(who.as_bytes()).await;
                    let _ = send.finish();
                    let _ = send.stopped().await;
                }
            });
        }
    });
    Server { addr, endpoint, seen }
}

/// Connects, sends on a bi stream, returns the server's echo (the device id it saw) or the error.
async fn exchange(client_tls: rustls::ClientConfig, addr: SocketAddr) -> Result<String, String> {
    let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    let quic = QuicClientConfig::try_from(client_tls).unwrap();
    endpoint.set_default_client_config(quinn::ClientConfig::new(Arc::new(quic)));
    let result = timeout(LIMIT, async {
        let conn = endpoint.connect(addr, "localhost").map_err(|e| e.to_string())?.await.map_err(|e| e.to_string())?;
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
        send.write_all(b"hello").await.map_err(|e| e.to_string())?;
        send.finish().map_err(|e| e.to_string())?;
        let echo = recv.read_to_end(1024).await.map_err(|e| e.to_string())?;
        conn.close(0u32.into(), b"done");
        Ok(String::from_utf8_lossy(&echo).into_owned())
    })
    .await
    .unwrap_or_else(|_| Err("timed out".into()));
    endpoint.wait_idle().await;
    result
}

fn assert_refused(result: Result<String, String>, what: &str) {
    match result {
        Ok(echo) => panic!("{what}: expected refusal, server answered {echo:?}"),
        Err(e) => {
            eprintln!("{what}: refused: {e}");
            assert!(!e.contains("timed out"), "{what}: expected a refusal, not a timeout")
        }
    }
}

#[tokio::test]
async fn mtls_accepts_enrolled_devices_and_refuses_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let pki = init_pki(dir.path(), "fleet-a");
    pki.issue_server("aggregator", &[], 30, false).unwrap();
    pki.enroll_device(&id("cam-1"), 30, false).unwrap();
    pki.enroll_device(&id("cam-2"), 30, false).unwrap();
    let mut server = start_server(dir.path());
    let ca = pki.ca().clone();

    // (a) An enrolled device connects and the server sees its id.
    let dev = DeviceIdentity::load(dir.path(), &id("cam-1")).unwrap();
    let echo = exchange(tls::client_config(&ca, &dev, &[ALPN_V1]).unwrap(), server.addr).await;
    assert_eq!(echo.unwrap(), "cam-1");
    assert_eq!(server.seen.recv().await.unwrap(), id("cam-1"));

    // (b) A device of another CA (trusting our CA for the server side) is refused.
    let other_dir = tempfile::tempdir().unwrap();
    let other = init_pki(other_dir.path(), "fleet-b");
    other.enroll_device(&id("cam-1"), 30, false).unwrap();
    let foreign = DeviceIdentity::load(other_dir.path(), &id("cam-1")).unwrap();
    assert_refused(exchange(tls::client_config(&ca, &foreign, &[ALPN_V1]).unwrap(), server.addr).await, "foreign CA");

    // (c) No client certificate: refused.
    assert_refused(exchange(tls::anonymous_client_config(&ca, &[ALPN_V1]).unwrap(), server.addr).await, "no cert");

    // (d) cam-2 works, is revoked while the server runs, and is refused on the next handshake.
    let dev2 = DeviceIdentity::load(dir.path(), &id("cam-2")).unwrap();
    let echo = exchange(tls::client_config(&ca, &dev2, &[ALPN_V1]).unwrap(), server.addr).await;
    assert_eq!(echo.unwrap(), "cam-2");
    pki.revoke(&id("cam-2"), "stolen").unwrap();
    assert_refused(exchange(tls::client_config(&ca, &dev2, &[ALPN_V1]).unwrap(), server.addr).await, "revoked");
    // cam-1 is unaffected.
    let echo = exchange(tls::client_config(&ca, &dev, &[ALPN_V1]).unwrap(), server.addr).await;
    assert_eq!(echo.unwrap(), "cam-1");

    // A service presenting its server certificate is accepted and told apart from devices.
    pki.issue_server("registry", &[], 30, false).unwrap();
    let registry = ServerIdentity::load(dir.path(), "registry").unwrap();
    let echo = exchange(tls::service_client_config(&ca, &registry, &[ALPN_V1]).unwrap(), server.addr).await;
    assert_eq!(echo.unwrap(), "service:registry");

    // Only the accepted device connections reached the device channel.
    assert_eq!(server.seen.recv().await.unwrap(), id("cam-2"));
    assert_eq!(server.seen.recv().await.unwrap(), id("cam-1"));
    assert!(server.seen.try_recv().is_err());

    server.endpoint.close(0u32.into(), b"bye");
    timeout(LIMIT, server.endpoint.wait_idle()).await.unwrap();
}

#[tokio::test]
async fn server_identity_is_checked_by_devices() {
    // A device of fleet A refuses a server certificate from fleet B.
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    let pki_a = init_pki(a.path(), "fleet-a");
    let pki_b = init_pki(b.path(), "fleet-b");
    pki_a.enroll_device(&id("cam-1"), 30, false).unwrap();
    pki_b.issue_server("aggregator", &[], 30, false).unwrap();
    let server = start_server(b.path());
    let dev = DeviceIdentity::load(a.path(), &id("cam-1")).unwrap();
    let result = exchange(tls::client_config(dev.ca(), &dev, &[ALPN_V1]).unwrap(), server.addr).await;
    assert_refused(result, "foreign server");
    server.endpoint.close(0u32.into(), b"bye");
}

#[tokio::test]
async fn a_batch_enrolled_in_memory_connects_and_a_refused_batch_enrolls_nobody() {
    let dir = tempfile::tempdir().unwrap();
    let pki = init_pki(dir.path(), "fleet-a");
    pki.issue_server("aggregator", &[], 30, false).unwrap();
    pki.enroll_device(&id("cam-1"), 30, false).unwrap();
    let batch: Vec<DeviceId> = (0..50).map(|i| id(&format!("sim-{i}"))).collect();
    let identities = pki.enroll_devices(&batch, 30, false).unwrap();
    let allowed = fedfleet_certs::AllowListFile::read(&pki.allow_list_path()).unwrap();
    assert_eq!(allowed.devices.len(), 51, "the batch and cam-1, in one devices.json");
    assert!(!dir.path().join("devices").join("sim-0.crt").exists(), "in memory: no files");
    assert_eq!(identities[7].device_id(), &id("sim-7"));
    assert_eq!(allowed.devices[&id("sim-7")].public_key, hex::encode(identities[7].verifying_key().to_bytes()));

    let mut server = start_server(dir.path());
    let echo = exchange(tls::client_config(pki.ca(), &identities[7], &[ALPN_V1]).unwrap(), server.addr).await;
    assert_eq!(echo.unwrap(), "sim-7");
    assert_eq!(server.seen.recv().await.unwrap(), id("sim-7"));

    // One enrolled id (or one repeated) refuses the whole batch before anything is issued.
    let before = std::fs::read(pki.allow_list_path()).unwrap();
    let err = pki.enroll_devices(&[id("new-1"), id("sim-3")], 30, true).unwrap_err();
    assert!(matches!(err, fedfleet_certs::CertError::AlreadyEnrolled(ref d) if d == "sim-3"), "{err}");
    let err = pki.enroll_devices(&[id("new-1"), id("new-1")], 30, true).unwrap_err();
    assert!(matches!(err, fedfleet_certs::CertError::AlreadyEnrolled(_)), "{err}");
    assert_eq!(std::fs::read(pki.allow_list_path()).unwrap(), before);
    assert!(!dir.path().join("devices").join("new-1.crt").exists());

    // With files, the batch is loadable as devices are provisioned.
    pki.enroll_devices(&[id("new-1"), id("new-2")], 30, true).unwrap();
    let loaded = DeviceIdentity::load(dir.path(), &id("new-2")).unwrap();
    let echo = exchange(tls::client_config(pki.ca(), &loaded, &[ALPN_V1]).unwrap(), server.addr).await;
    assert_eq!(echo.unwrap(), "new-2");

    server.endpoint.close(0u32.into(), b"bye");
    timeout(LIMIT, server.endpoint.wait_idle()).await.unwrap();
}

/// A device and a service, both on this crate's configs, settle on AES-128-GCM with SHA-256 (ring's
/// default order would give AES-256 with SHA-384, whose key schedule has no SHA extensions).
#[test]
fn fleet_connections_use_aes_128_gcm_with_sha_256() {
    let dir = tempfile::tempdir().unwrap();
    let pki = init_pki(dir.path(), "fleet-a");
    pki.issue_server("aggregator", &[], 30, false).unwrap();
    pki.enroll_device(&id("cam-1"), 30, false).unwrap();
    let identity = ServerIdentity::load(dir.path(), "aggregator").unwrap();
    let revocation = Arc::new(RevocationWatcher::open(dir.path()).unwrap());
    let server_tls = tls::server_config(pki.ca(), &identity, revocation, &[ALPN_V1]).unwrap();
    let device = DeviceIdentity::load(dir.path(), &id("cam-1")).unwrap();
    let client_tls = tls::client_config(pki.ca(), &device, &[ALPN_V1]).unwrap();

    let mut client = rustls::ClientConnection::new(Arc::new(client_tls), "localhost".try_into().unwrap()).unwrap();
    let mut server = rustls::ServerConnection::new(Arc::new(server_tls)).unwrap();
    // The handshake over memory: each side's flight handed to the other until both are done.
    for _ in 0..10 {
        if !client.is_handshaking() && !server.is_handshaking() {
            break;
        }
        let mut flight = Vec::new();
        client.write_tls(&mut flight).unwrap();
        server.read_tls(&mut &flight[..]).unwrap();
        server.process_new_packets().unwrap();
        flight.clear();
        server.write_tls(&mut flight).unwrap();
        client.read_tls(&mut &flight[..]).unwrap();
        client.process_new_packets().unwrap();
    }
    assert!(!client.is_handshaking() && !server.is_handshaking(), "the handshake did not finish");
    assert_eq!(server.negotiated_cipher_suite().unwrap().suite(), rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
    assert_eq!(client.negotiated_cipher_suite().unwrap().suite(), rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
}
