//! The embedded MQTT broker: rumqttd, in-process, TLS with the fleet CA and client certificates
//! required (rumqttd's `verify-client-cert` feature).
//!
//! rumqttd has no way to stop: its router and listener threads run until the process ends. So
//! rumqttd listens on a private loopback port picked here, and the fleet-facing port is a small
//! TCP relay in front of it (bytes only; TLS is end to end between the client and rumqttd). Stopping
//! the broker closes the fleet-facing listener and every relayed connection, exactly what
//! clients see when a broker goes away; the rumqttd instance behind it is left idle (two threads
//! and a TLS-only loopback port that nothing connects to), and [`EmbeddedBroker::start`] starts a
//! fresh one, so a restart also loses retained messages like a real broker restart does (the
//! aggregator's [`ControlClient`](crate::ControlClient) republishes its retained messages on
//! every reconnect).
//!
//! The relay also covers a rumqttd weakness: it runs each TLS handshake inline in its accept loop,
//! so one silent connection would stall every other one. The relay only opens the backend
//! connection once the client has sent its first bytes, and drops clients that send nothing for
//! [`FIRST_BYTES_TIMEOUT`].
//!
//! Known rumqttd limits (use an external broker such as mosquitto where they matter): the broker
//! does not check the revocation list (revoked devices' messages are still refused by signature
//! checks, against the allow-list); it takes the certificate's `O=` as a tenant and refuses
//! non-alphanumeric ones, so the fleet id must be alphanumeric (checked at start).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use std::path::Path;

use fedfleet_certs::{CaCert, ServerIdentity};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// A client must send its first bytes (the TLS ClientHello) within this time.
pub const FIRST_BYTES_TIMEOUT: Duration = Duration::from_secs(10);

/// Where and how the embedded broker listens.
#[derive(Debug, Clone)]
pub struct BrokerConfig {
    /// Fleet-facing address; port 0 picks a free port (see [`EmbeddedBroker::local_addr`]).
    pub listen: SocketAddr,
    /// The fleet CA certificate (PEM): clients must present a certificate it issued.
    pub ca_cert: PathBuf,
    /// The broker's server certificate and key (PEM), e.g. the aggregator's.
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    /// Largest MQTT packet payload accepted.
    pub max_payload_bytes: usize,
    /// Most concurrent client connections.
    pub max_connections: usize,
}

impl BrokerConfig {
    pub fn new(
        listen: SocketAddr,
        ca_cert: PathBuf,
        server_cert: PathBuf,
        server_key: PathBuf,
    ) -> Self {
        BrokerConfig {
            listen,
            ca_cert,
            server_cert,
            server_key,
            max_payload_bytes: 2 * 1024 * 1024,
            max_connections: 10_000,
        }
    }
}

/// Why the broker did not start.
#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    #[error("broker certificates: {0}")]
    Certs(#[from] fedfleet_certs::CertError),
    #[error(
        "fleet id {0:?} is not alphanumeric: rumqttd refuses client certificates whose O= holds \
         other characters; use an alphanumeric fleet id or an external broker (e.g. mosquitto)"
    )]
    FleetName(String),
    #[error("the CA certificate names no fleet (O=)")]
    NoFleet,
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot start rumqttd: {0}")]
    Rumqttd(String),
}

/// A running embedded broker. Dropping it stops the fleet-facing side like
/// [`shutdown`](Self::shutdown) does, without waiting.
pub struct EmbeddedBroker {
    local_addr: SocketAddr,
    stop: watch::Sender<bool>,
    relay: Option<JoinHandle<()>>,
}

fn free_loopback_port() -> std::io::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

fn rumqttd_config(cfg: &BrokerConfig, backend: SocketAddr) -> rumqttd::Config {
    let connections = rumqttd::ConnectionSettings {
        connection_timeout_ms: 10_000,
        max_payload_size: cfg.max_payload_bytes,
        max_inflight_count: 256,
        auth: None,
        external_auth: None,
        dynamic_filters: true,
    };
    let server = rumqttd::ServerSettings {
        name: "fedfleet-v4".into(),
        listen: backend,
        tls: Some(rumqttd::TlsConfig::Rustls {
            capath: Some(cfg.ca_cert.display().to_string()),
            certpath: cfg.server_cert.display().to_string(),
            keypath: cfg.server_key.display().to_string(),
        }),
        next_connection_delay_ms: 0,
        connections,
    };
    let router = rumqttd::RouterConfig {
        max_connections: cfg.max_connections,
        max_outgoing_packet_count: 256,
        max_segment_size: 8 * 1024 * 1024,
        max_segment_count: 4,
        ..Default::default()
    };
    rumqttd::Config {
        id: 0,
        router,
        v4: Some(HashMap::from([("fedfleet".to_string(), server)])),
        ..Default::default()
    }
}

impl EmbeddedBroker {
    /// Checks the certificates, starts rumqttd on a private loopback port and the relay on
    /// `config.listen`. Needs a tokio runtime (the relay runs on it).
    pub async fn start(config: BrokerConfig) -> Result<EmbeddedBroker, BrokerError> {
        // Fail here with a clear error rather than on every connection inside rumqttd.
        let ca = CaCert::load(&config.ca_cert)?;
        let fleet = ca.fleet().ok_or(BrokerError::NoFleet)?;
        if !fleet.as_str().chars().all(|c| c.is_ascii_alphanumeric()) {
            return Err(BrokerError::FleetName(fleet.to_string()));
        }
        ServerIdentity::from_files(&config.server_cert, &config.server_key)?;

        let listener =
            TcpListener::bind(config.listen)
                .await
                .map_err(|source| BrokerError::Listen {
                    addr: config.listen,
                    source,
                })?;
        let local_addr = listener
            .local_addr()
            .map_err(|source| BrokerError::Listen {
                addr: config.listen,
                source,
            })?;

        let port = free_loopback_port().map_err(|source| BrokerError::Listen {
            addr: config.listen,
            source,
        })?;
        let backend = SocketAddr::from(([127, 0, 0, 1], port));
        let rcfg = rumqttd_config(&config, backend);
        std::thread::Builder::new()
            .name("fedfleet-rumqttd".into())
            .spawn(move || {
                let mut broker = rumqttd::Broker::new(rcfg);
                if let Err(e) = broker.start() {
                    tracing::error!(error = %e, "embedded rumqttd stopped");
                }
            })
            .map_err(|e| BrokerError::Rumqttd(e.to_string()))?;
        // Wait until rumqttd listens (a probe connection costs it one failed handshake).
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            if TcpStream::connect(backend).await.is_ok() {
                break;
            }
            if tokio::time::Instant::now() > deadline {
                return Err(BrokerError::Rumqttd(format!(
                    "rumqttd did not listen on {backend}"
                )));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }

        let (stop, stopped) = watch::channel(false);
        let relay = tokio::spawn(relay(listener, backend, stopped));
        tracing::info!(%local_addr, %backend, "embedded MQTT broker listening");
        Ok(EmbeddedBroker {
            local_addr,
            stop,
            relay: Some(relay),
        })
    }

    /// The fleet-facing address (with the port picked when `listen` had port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Closes the listener and every client connection, and waits until the port is free.
    pub async fn shutdown(mut self) {
        let _ = self.stop.send(true);
        if let Some(relay) = self.relay.take() {
            let _ = relay.await;
        }
    }
}

impl Drop for EmbeddedBroker {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

async fn relay(listener: TcpListener, backend: SocketAddr, mut stopped: watch::Receiver<bool>) {
    let mut conns = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            _ = stopped.changed() => break,
            accepted = listener.accept() => match accepted {
                Ok((client, _)) => {
                    let mut stop = stopped.clone();
                    conns.spawn(async move {
                        tokio::select! {
                            _ = stop.changed() => {}
                            _ = relay_one(client, backend) => {}
                        }
                    });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "embedded broker accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
    drop(listener);
    conns.shutdown().await;
}

async fn relay_one(mut client: TcpStream, backend: SocketAddr) {
    let _ = client.set_nodelay(true);
    let mut probe = [0u8; 1];
    match tokio::time::timeout(FIRST_BYTES_TIMEOUT, client.peek(&mut probe)).await {
        Ok(Ok(n)) if n > 0 => {}
        _ => return,
    }
    let Ok(mut server) = TcpStream::connect(backend).await else {
        return;
    };
    let _ = server.set_nodelay(true);
    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
}

/// Writes `key` (an ed25519 PKCS#8 PEM key as `fedfleet-certs` writes it) to `dest` as PKCS#8
/// v1 (without the embedded public key), mode 0600. OpenSSL 3.0 (Debian 12's, under mosquitto)
/// refuses the v2 form with "DECODER routines::unsupported"; rustls reads both.
pub fn export_key_pkcs8_v1(key: &Path, dest: &Path) -> Result<(), fedfleet_certs::CertError> {
    let signing = fedfleet_certs::load_signing_key(key)?;
    // RFC 8410: SEQUENCE { INTEGER 0, SEQUENCE { OID 1.3.101.112 }, OCTET STRING { OCTET STRING seed } }
    let mut der = vec![
        0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04,
        0x20,
    ];
    der.extend_from_slice(signing.as_bytes());
    let pem = pem::encode_config(
        &pem::Pem::new("PRIVATE KEY", der),
        pem::EncodeConfig::new().set_line_ending(pem::LineEnding::LF),
    );
    fedfleet_durable::write_atomic(dest, pem.as_bytes(), fedfleet_durable::Mode::Secret).map_err(
        |error| fedfleet_certs::CertError::Io {
            path: dest.to_path_buf(),
            error,
        },
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn exported_key_is_the_rfc8410_v1_encoding_of_the_seed() {
        let dir = tempfile::tempdir().unwrap();
        let seed = [7u8; 32];
        let key = ed25519_dalek::SigningKey::from_bytes(&seed);
        let src = dir.path().join("device.key");
        std::fs::write(
            &src,
            ed25519_dalek::pkcs8::EncodePrivateKey::to_pkcs8_pem(&key, Default::default())
                .unwrap()
                .as_bytes(),
        )
        .unwrap();
        let dest = dir.path().join("device.v1.key");
        super::export_key_pkcs8_v1(&src, &dest).unwrap();
        let pem = pem::parse(std::fs::read(&dest).unwrap()).unwrap();
        assert_eq!(pem.tag(), "PRIVATE KEY");
        assert_eq!(pem.contents().len(), 48);
        assert_eq!(&pem.contents()[16..], &seed);
    }
}
