//! The embedded MQTT broker: rumqttd, in-process, behind a gate that holds the fleet's access
//! rules.
//!
//! The gate is the fleet-facing listener. It terminates TLS itself with the fleet's mTLS
//! configuration (client certificate of the fleet CA required, revoked devices refused on every
//! handshake), reads the client's MQTT packets with rumqttc's codec and applies the rules of
//! [`topics::may_publish`] and [`topics::may_subscribe`] by the identity in the client
//! certificate: a device publishes only its own status and updates and hears only the fleet's
//! announcements and its own receipts. A device must connect under its own id as MQTT client id
//! (the broker drops an older session with the same id, so another id would be a way to cut a
//! device off). What breaks a rule closes the connection (MQTT 3.1.1 has no per-message refusal)
//! and is counted by reason in [`BrokerMetrics`], as is a packet over `max_payload_bytes`.
//! Packets that pass are forwarded as they came; the broker's answers flow back untouched.
//!
//! rumqttd listens on a private loopback port that only the gate can use: it asks for a
//! password drawn at start, which the gate puts in every CONNECT.
//!
//! rumqttd has no way to stop: its router and listener threads run until the process ends.
//! Stopping the broker closes the gate's listener and every client connection, exactly what
//! clients see when a broker goes away; the rumqttd instance behind it is left idle, and
//! [`EmbeddedBroker::start`] starts a fresh one, so a restart also loses retained messages like
//! a real broker restart does (the owners of retained messages — the aggregator's and the
//! registry's [`ControlClient`](crate::ControlClient)s, each device for its status — republish
//! them on every reconnect).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use fedfleet_certs::{CaCert, PeerIdentity, RevocationWatcher, ServerIdentity};
use fedfleet_net::Shutdown;
use fedfleet_protocol::FleetId;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use rumqttc::mqttbytes::{self, PacketType};
use rumqttc::tokio_rustls::TlsAcceptor;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use crate::topics;

/// A client must finish its TLS handshake within this time.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The user name the gate logs in to rumqttd with.
const GATE_USER: &str = "fedfleet-gate";

/// Where and how the embedded broker listens.
#[derive(Debug, Clone)]
pub struct BrokerConfig {
    /// Fleet-facing address; port 0 picks a free port (see [`EmbeddedBroker::local_addr`]).
    pub listen: SocketAddr,
    /// The fleet CA certificate (PEM): clients must present a certificate it issued.
    pub ca_cert: PathBuf,
    /// The CA-signed revocation list checked on every handshake (default: `revoked.json` beside
    /// the CA certificate, where the PKI keeps it).
    pub revocation_list: PathBuf,
    /// The broker's server certificate and key (PEM), e.g. the aggregator's.
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    /// Largest MQTT packet payload accepted; a larger one closes the connection and is counted.
    pub max_payload_bytes: usize,
    /// Most concurrent client connections (devices and services); the gate closes the next one
    /// at once, counted as `overloaded`.
    pub max_connections: usize,
    /// The service certificates (by name) that may publish on the fleet's topics: by default
    /// the broker's own (the aggregator's, from `server_cert`'s file name) and `registry`. Any
    /// other service certificate, an operator's, may subscribe but not publish: it could
    /// otherwise replace the retained round announcement and leave late joiners without one.
    pub publishers: Vec<String>,
    /// Where refusals are counted (share it with the service's metrics registry).
    pub metrics: BrokerMetrics,
}

impl BrokerConfig {
    pub fn new(listen: SocketAddr, ca_cert: PathBuf, server_cert: PathBuf, server_key: PathBuf) -> Self {
        let own_name = server_cert.file_stem().map(|n| n.to_string_lossy().into_owned());
        BrokerConfig {
            listen,
            publishers: own_name.into_iter().chain(["registry".to_owned()]).collect(),
            revocation_list: ca_cert.with_file_name(fedfleet_certs::layout::REVOKED_JSON),
            ca_cert,
            server_cert,
            server_key,
            max_payload_bytes: 2 * 1024 * 1024,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            metrics: BrokerMetrics::default(),
        }
    }
}

/// Why the gate closed a client's connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// A packet larger than `max_payload_bytes`.
    Oversized,
    /// A publish or subscription outside the client's topics.
    Acl,
    /// A device connecting under another client id than its device id.
    ClientId,
    /// Bytes that are not MQTT 3.1.1.
    Malformed,
    /// A connection past the broker's connection limit.
    Overloaded,
}

impl Refusal {
    pub const ALL: [Refusal; 5] = [Refusal::Oversized, Refusal::Acl, Refusal::ClientId, Refusal::Malformed, Refusal::Overloaded];

    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::Oversized => "oversized",
            Refusal::Acl => "acl",
            Refusal::ClientId => "client_id",
            Refusal::Malformed => "malformed",
            Refusal::Overloaded => "overloaded",
        }
    }
}

/// The broker's counters, prometheus-client handles: register them in the service's registry
/// with [`BrokerMetrics::register`]; clones count into the same values.
#[derive(Debug, Clone, Default)]
pub struct BrokerMetrics {
    refused: Family<Vec<(String, String)>, Counter>,
}

impl BrokerMetrics {
    /// Adds `broker_refused_total{reason}` to `registry`, every reason present from the start.
    pub fn register(&self, registry: &mut prometheus_client::registry::Registry) {
        for r in Refusal::ALL {
            let _ = self.refused.get_or_create(&Self::labels(r));
        }
        registry.register(
            "broker_refused",
            "MQTT connections the embedded broker closed, by reason (oversized, acl, client_id, malformed, overloaded)",
            self.refused.clone(),
        );
    }

    pub fn refused(&self, reason: Refusal) -> u64 {
        self.refused.get_or_create(&Self::labels(reason)).get()
    }

    fn count(&self, reason: Refusal) {
        self.refused.get_or_create(&Self::labels(reason)).inc();
    }

    fn labels(reason: Refusal) -> Vec<(String, String)> {
        vec![("reason".into(), reason.as_str().into())]
    }
}

/// Why the broker did not start.
#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    #[error("broker certificates: {0}")]
    Certs(fedfleet_certs::CertError),
    #[error("the CA certificate names no fleet (O=)")]
    NoFleet,
    #[error("cannot listen on {addr}: {cause}")]
    Listen { addr: SocketAddr, cause: std::io::Error },
    #[error("cannot start rumqttd: {0}")]
    Rumqttd(String),
}

// Printed in the message, so not also a `source`: a report of the chain would say it twice.
impl From<fedfleet_certs::CertError> for BrokerError {
    fn from(e: fedfleet_certs::CertError) -> Self {
        BrokerError::Certs(e)
    }
}

/// A running embedded broker. Dropping it stops the fleet-facing side like
/// [`shutdown`](Self::shutdown) does, without waiting.
pub struct EmbeddedBroker {
    local_addr: SocketAddr,
    stop: Shutdown,
    gate: Option<JoinHandle<()>>,
}

fn free_loopback_port() -> std::io::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

fn rumqttd_config(cfg: &BrokerConfig, backend: SocketAddr, password: &str) -> rumqttd::Config {
    let connections = rumqttd::ConnectionSettings {
        connection_timeout_ms: 10_000,
        max_payload_size: cfg.max_payload_bytes,
        max_inflight_count: 256,
        auth: Some(HashMap::from([(GATE_USER.to_string(), password.to_string())])),
        external_auth: None,
        dynamic_filters: true,
    };
    let server =
        rumqttd::ServerSettings { name: "fedfleet-v4".into(), listen: backend, tls: None, next_connection_delay_ms: 0, connections };
    let router = rumqttd::RouterConfig {
        // The gate refuses first, cleanly. rumqttd's own cap must stay out of reach: it leaves a
        // connection over it without a CONNACK, and a reconnect of that client can then panic
        // its server thread (rumqttd 0.20, `will_handlers`). It counts the gate's held probe,
        // and connections the gate has closed that its router has not dropped yet.
        max_connections: 2 * cfg.max_connections + 1,
        max_outgoing_packet_count: 256,
        max_segment_size: 8 * 1024 * 1024,
        max_segment_count: 4,
        ..Default::default()
    };
    rumqttd::Config { id: 0, router, v4: Some(HashMap::from([("fedfleet".to_string(), server)])), ..Default::default() }
}

/// What every gated connection shares.
struct Gate {
    tls: TlsAcceptor,
    fleet: FleetId,
    backend: SocketAddr,
    password: String,
    max_payload_bytes: usize,
    max_connections: usize,
    publishers: Vec<String>,
    metrics: BrokerMetrics,
}

impl EmbeddedBroker {
    /// Checks the certificates, starts rumqttd on a private loopback port and the gate on
    /// `config.listen`. Needs a tokio runtime (the gate runs on it).
    pub async fn start(config: BrokerConfig) -> Result<EmbeddedBroker, BrokerError> {
        let ca = CaCert::load(&config.ca_cert)?;
        let fleet = ca.fleet().ok_or(BrokerError::NoFleet)?.clone();
        let identity = ServerIdentity::from_files(&config.server_cert, &config.server_key)?;
        let revocation = Arc::new(RevocationWatcher::new(&config.revocation_list, &ca)?);
        let tls = fedfleet_certs::tls::server_config(&ca, &identity, revocation, &[])?;

        let listener = TcpListener::bind(config.listen).await.map_err(|cause| BrokerError::Listen { addr: config.listen, cause })?;
        let local_addr = listener.local_addr().map_err(|cause| BrokerError::Listen { addr: config.listen, cause })?;

        let port = free_loopback_port().map_err(|cause| BrokerError::Listen { addr: config.listen, cause })?;
        let backend = SocketAddr::from(([127, 0, 0, 1], port));
        let password = {
            let mut secret = [0u8; 24];
            rand_core::RngCore::fill_bytes(&mut rand_core::OsRng, &mut secret);
            secret.iter().map(|b| format!("{b:02x}")).collect::<String>()
        };
        let rcfg = rumqttd_config(&config, backend, &password);
        std::thread::Builder::new()
            .name("fedfleet-rumqttd".into())
            .spawn(move || {
                let mut broker = rumqttd::Broker::new(rcfg);
                if let Err(e) = broker.start() {
                    tracing::error!(error = %e, "embedded rumqttd stopped");
                }
            })
            .map_err(|e| BrokerError::Rumqttd(e.to_string()))?;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let probe = loop {
            if let Some(probe) = rumqttd_answers(backend, &password).await {
                break probe;
            }
            if tokio::time::Instant::now() > deadline {
                return Err(BrokerError::Rumqttd(format!("rumqttd did not listen on {backend}")));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };

        let gate = Arc::new(Gate {
            tls: TlsAcceptor::from(Arc::new(tls)),
            fleet,
            backend,
            password,
            max_payload_bytes: config.max_payload_bytes,
            max_connections: config.max_connections,
            publishers: config.publishers.clone(),
            metrics: config.metrics.clone(),
        });
        let stop = Shutdown::new();
        let gate = tokio::spawn(accept_loop(listener, gate, stop.clone()));
        tracing::info!(%local_addr, %backend, "embedded MQTT broker listening");
        tokio::spawn(hold_probe(probe, stop.clone()));
        Ok(EmbeddedBroker { local_addr, stop, gate: Some(gate) })
    }

    /// The fleet-facing address (with the port picked when `listen` had port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Closes the listener and every client connection, and waits until the port is free.
    pub async fn shutdown(mut self) {
        self.stop.trigger();
        if let Some(gate) = self.gate.take() {
            let _ = gate.await;
        }
    }
}

impl Drop for EmbeddedBroker {
    fn drop(&mut self) {
        self.stop.trigger();
    }
}

/// Client connections the broker's TLS gate serves at once, unless configured: as many as the
/// aggregator admits over QUIC.
pub const DEFAULT_MAX_CONNECTIONS: usize = 16_384;

async fn accept_loop(listener: TcpListener, gate: Arc<Gate>, stop: Shutdown) {
    let metrics = gate.metrics.clone();
    let mut conns = fedfleet_net::serve::accept_until(
        &listener,
        gate.max_connections,
        stop.wait(),
        || metrics.count(Refusal::Overloaded),
        |(client, peer)| serve_client(gate.clone(), client, peer),
    )
    .await;
    drop(listener);
    conns.shutdown().await;
}

async fn serve_client(gate: Arc<Gate>, client: TcpStream, peer: SocketAddr) {
    let _ = client.set_nodelay(true);
    let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, gate.tls.accept(client)).await {
        Ok(Ok(tls)) => tls,
        Ok(Err(e)) => {
            tracing::info!(%peer, error = %e, "MQTT client refused at the TLS handshake");
            return;
        }
        Err(_) => return,
    };
    let who = match tls.get_ref().1.peer_certificates().map(fedfleet_certs::peer_identity) {
        Some(Ok(who)) => who,
        _ => return, // the verifier admits only fleet identities; nothing else gets here
    };
    let Ok(server) = TcpStream::connect(gate.backend).await else {
        return;
    };
    let _ = server.set_nodelay(true);
    let (client_rx, mut client_tx) = tokio::io::split(tls);
    let (server_rx, server_tx) = server.into_split();
    let refused = tokio::select! {
        r = forward_checked(&gate, &who, client_rx, server_tx) => r,
        _ = async { let mut server_rx = server_rx; tokio::io::copy(&mut server_rx, &mut client_tx).await } => None,
    };
    if let Some((reason, detail)) = refused {
        gate.metrics.count(reason);
        tracing::warn!(client = ?who, %peer, reason = reason.as_str(), detail, "MQTT connection closed by the broker's rules");
    }
}

/// Seconds between the readiness probe's pings (its MQTT keep-alive is twice that).
const PROBE_PING_SECS: u64 = 60;

/// A connection to rumqttd at `backend` logged in as the gate (CONNECT answered by an accepting
/// CONNACK), or `None` while it does not answer. The probe speaks MQTT and then stays connected
/// (see [`hold_probe`]): rumqttd logs a bare TCP probe, and any disconnect, as an ERROR.
async fn rumqttd_answers(backend: SocketAddr, password: &str) -> Option<TcpStream> {
    let mut s = TcpStream::connect(backend).await.ok()?;
    let mut connect = rumqttc::Connect::new("fedfleet-gate-probe");
    connect.keep_alive = 2 * PROBE_PING_SECS as u16;
    connect.login = Some(rumqttc::Login::new(GATE_USER, password));
    let mut out = BytesMut::new();
    connect.write(&mut out).ok()?;
    s.write_all(&out).await.ok()?;
    // CONNACK: 0x20, remaining length 2, session-present flags, return code (0: accepted).
    let mut ack = [0u8; 4];
    tokio::time::timeout(Duration::from_secs(2), s.read_exact(&mut ack)).await.ok()?.ok()?;
    (ack[0] == 0x20 && ack[3] == 0).then_some(s)
}

/// Keeps the readiness probe connected, pinging, until the broker stops: closing it would log
/// an ERROR at every start.
async fn hold_probe(mut probe: TcpStream, stop: Shutdown) {
    let stopped = stop.wait();
    tokio::pin!(stopped);
    loop {
        tokio::select! {
            _ = &mut stopped => return,
            _ = tokio::time::sleep(Duration::from_secs(PROBE_PING_SECS)) => {
                let mut pong = [0u8; 2];
                if probe.write_all(&[0xC0, 0x00]).await.is_err() || probe.read_exact(&mut pong).await.is_err() {
                    return;
                }
            }
        }
    }
}

/// Copies the client's packets to rumqttd, each checked against the rules. Returns why it
/// stopped when a rule did it (`None`: the client or the broker went away).
async fn forward_checked(
    gate: &Gate,
    who: &PeerIdentity,
    mut from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
) -> Option<(Refusal, String)> {
    let mut buf = BytesMut::with_capacity(8 * 1024);
    loop {
        let header = match mqttbytes::check(buf.iter(), gate.max_payload_bytes) {
            Ok(h) => h,
            Err(mqttbytes::Error::InsufficientBytes(_)) => match from.read_buf(&mut buf).await {
                Ok(0) | Err(_) => return None,
                Ok(_) => continue,
            },
            Err(mqttbytes::Error::PayloadSizeLimitExceeded(n)) => {
                return Some((Refusal::Oversized, format!("{n} byte packet, limit {}", gate.max_payload_bytes)));
            }
            Err(e) => return Some((Refusal::Malformed, e.to_string())),
        };
        let frame = buf.split_to(header.frame_length()).freeze();
        let out = match judge(gate, who, header, frame) {
            Ok(out) => out,
            Err(refused) => return Some(refused),
        };
        if to.write_all(&out).await.is_err() {
            return None;
        }
    }
}

/// The bytes to forward for one client packet, or why it breaks the rules.
fn judge(gate: &Gate, who: &PeerIdentity, header: mqttbytes::FixedHeader, frame: Bytes) -> Result<Bytes, (Refusal, String)> {
    let malformed = |e: mqttbytes::Error| (Refusal::Malformed, e.to_string());
    match header.packet_type().map_err(malformed)? {
        PacketType::Connect => {
            let mut connect = rumqttc::Connect::read(header, frame).map_err(malformed)?;
            if let PeerIdentity::Device(id) = who
                && connect.client_id != id.as_str()
            {
                return Err((Refusal::ClientId, format!("client id {:?}", connect.client_id)));
            }
            // Whoever the client claimed to be, rumqttd admits only the gate.
            connect.login = Some(rumqttc::Login::new(GATE_USER, gate.password.clone()));
            let mut out = BytesMut::new();
            connect.write(&mut out).map_err(malformed)?;
            Ok(out.freeze())
        }
        PacketType::Publish => {
            let publish = rumqttc::Publish::read(header, frame.clone()).map_err(malformed)?;
            let topic = &publish.topic;
            if !topics::may_publish(who, &gate.fleet, &gate.publishers, topic) {
                return Err((Refusal::Acl, format!("publish on {topic}")));
            }
            Ok(frame)
        }
        PacketType::Subscribe => {
            let subscribe = rumqttc::Subscribe::read(header, frame.clone()).map_err(malformed)?;
            if let Some(f) = subscribe.filters.iter().find(|f| !topics::may_subscribe(who, &gate.fleet, &f.path)) {
                return Err((Refusal::Acl, format!("subscribe to {}", f.path)));
            }
            Ok(frame)
        }
        _ => Ok(frame),
    }
}

/// Writes `key` (an ed25519 PKCS#8 PEM key as `fedfleet-certs` writes it) to `dest` as PKCS#8
/// v1 (without the embedded public key), mode 0600. OpenSSL 3.0 (Debian 12's, under mosquitto)
/// refuses the v2 form with "DECODER routines::unsupported"; rustls reads both.
pub fn export_key_pkcs8_v1(key: &Path, dest: &Path) -> Result<(), fedfleet_certs::CertError> {
    let signing = fedfleet_certs::load_signing_key(key)?;
    // RFC 8410: SEQUENCE { INTEGER 0, SEQUENCE { OID 1.3.101.112 }, OCTET STRING { OCTET STRING seed } }
    let mut der = vec![0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04, 0x20];
    der.extend_from_slice(signing.as_bytes());
    let pem = pem::encode_config(&pem::Pem::new("PRIVATE KEY", der), pem::EncodeConfig::new().set_line_ending(pem::LineEnding::LF));
    fedfleet_durable::write_atomic(dest, pem.as_bytes(), fedfleet_durable::Mode::Secret)
        .map_err(|error| fedfleet_certs::CertError::Io { path: dest.to_path_buf(), error })
}

#[cfg(test)]
mod tests {
    #[test]
    fn exported_key_is_the_rfc8410_v1_encoding_of_the_seed() {
        let dir = tempfile::tempdir().unwrap();
        let seed = [7u8; 32];
        let key = ed25519_dalek::SigningKey::from_bytes(&seed);
        let src = dir.path().join("device.key");
        std::fs::write(&src, ed25519_dalek::pkcs8::EncodePrivateKey::to_pkcs8_pem(&key, Default::default()).unwrap().as_bytes()).unwrap();
        let dest = dir.path().join("device.v1.key");
        super::export_key_pkcs8_v1(&src, &dest).unwrap();
        let pem = pem::parse(std::fs::read(&dest).unwrap()).unwrap();
        assert_eq!(pem.tag(), "PRIVATE KEY");
        assert_eq!(pem.contents().len(), 48);
        assert_eq!(&pem.contents()[16..], &seed);
    }
}
