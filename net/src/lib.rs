//! The thin QUIC shell every fedfleet service and the agent share: endpoints built from the
//! certs crate's rustls configs, framed streams speaking `fedfleet_protocol::framing`, the one
//! accept loop ([`serve`]) and the one shutdown switch ([`Shutdown`]) of every service.
//!
//! **Architecture invariant:** no protocol decisions here. This crate moves frames; what a frame
//! means is decided by the protocol crate and by the service cores.

pub mod admission;
pub mod logging;
pub mod peer;
pub mod rpc;
pub mod serve;
pub mod shutdown;

pub use rpc::RpcConnection;
pub use shutdown::Shutdown;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

pub use fedfleet_protocol::framing::Frame;
use fedfleet_protocol::framing::{FrameDecoder, FrameError, FrameKind, encode_frame};

/// Most bytes taken from the stream per read (quinn hands over what it has buffered, no copy).
const READ_CHUNK: usize = 64 * 1024;
/// A connection with no traffic for this long is closed (long local training holds no connection).
const IDLE_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("QUIC/TLS config: {0}")]
    Config(String),
    #[error("cannot bind {addr}: {cause}")]
    Bind { addr: SocketAddr, cause: std::io::Error },
    #[error("cannot connect to {addr}: {cause}")]
    Connect { addr: SocketAddr, cause: quinn::ConnectError },
    #[error("connection lost: {0}")]
    Connection(quinn::ConnectionError),
    #[error("write failed: {0}")]
    Write(quinn::WriteError),
    #[error("read failed: {0}")]
    Read(quinn::ReadError),
    #[error("bad frame: {0}")]
    Frame(FrameError),
    #[error("peer closed the stream")]
    Closed,
}

// Printed in the message, so not also a `source`: a report of the chain would say it twice.
impl From<FrameError> for NetError {
    fn from(e: FrameError) -> Self {
        NetError::Frame(e)
    }
}

// Printed in the message, so not also a `source`: a report of the chain would say it twice.
// A lost connection is the connection's error, whose message carries the peer's close reason
// (an `overloaded` retry-after, a `not_permitted`); quinn's read error says only "connection lost".
impl From<quinn::ReadError> for NetError {
    fn from(e: quinn::ReadError) -> Self {
        match e {
            quinn::ReadError::ConnectionLost(c) => NetError::Connection(c),
            e => NetError::Read(e),
        }
    }
}

// Printed in the message, so not also a `source`: a report of the chain would say it twice.
impl From<quinn::WriteError> for NetError {
    fn from(e: quinn::WriteError) -> Self {
        match e {
            quinn::WriteError::ConnectionLost(c) => NetError::Connection(c),
            e => NetError::Write(e),
        }
    }
}

// Printed in the message, so not also a `source`: a report of the chain would say it twice.
impl From<quinn::ConnectionError> for NetError {
    fn from(e: quinn::ConnectionError) -> Self {
        NetError::Connection(e)
    }
}

/// TLS alert `certificate_revoked` (RFC 8446): the server refused a revoked client certificate.
pub const ALERT_CERTIFICATE_REVOKED: u8 = 44;
/// TLS alert `certificate_expired`: the server refused a client certificate past its validity.
pub const ALERT_CERTIFICATE_EXPIRED: u8 = 45;

/// The TLS alert a connection was closed with (QUIC carries it as a crypto error code; a
/// service that refuses a resumed session's certificate closes with the same number,
/// [`peer::CLOSE_CERTIFICATE_EXPIRED`]), if any: how a client learns why the server refused
/// its certificate.
pub fn tls_alert(e: &quinn::ConnectionError) -> Option<u8> {
    let code = match e {
        quinn::ConnectionError::ConnectionClosed(c) => u64::from(c.error_code),
        quinn::ConnectionError::TransportError(t) => u64::from(t.code),
        quinn::ConnectionError::ApplicationClosed(c) => u64::from(c.error_code),
        _ => return None,
    };
    (code & !0xff == 0x100).then_some((code & 0xff) as u8)
}

impl NetError {
    /// The service's named refusal behind this error, if it refused (`service` names it in the
    /// detail): turned away for load, `overloaded` with its retry-after, for the caller to come
    /// back then (not a quick reconnect); or its certificate refused, which arrives as a TLS
    /// alert on the connection (`revoked`, `certificate_expired`).
    pub fn refusal(&self, service: &str) -> Option<fedfleet_protocol::Rejection> {
        use fedfleet_protocol::{RejectReason, Rejection};
        if let Some(detail) = self.overloaded() {
            return Some(Rejection { reason: RejectReason::Overloaded, detail });
        }
        let reason = match self.tls_alert()? {
            ALERT_CERTIFICATE_EXPIRED => RejectReason::CertificateExpired,
            ALERT_CERTIFICATE_REVOKED => RejectReason::Revoked,
            _ => return None,
        };
        Some(Rejection { reason, detail: format!("the {service} refused this certificate ({self})") })
    }

    /// The `overloaded` detail, with its retry-after, when the service turned this connection
    /// away for load: closed with [`admission::OVERLOADED`] (its reason names the retry-after),
    /// or refused before the handshake, which QUIC's `CONNECTION_REFUSED` says without a reason
    /// (quinn sends none), so the admission's default retry-after is assumed.
    fn overloaded(&self) -> Option<String> {
        let NetError::Connection(e) = self else { return None };
        match e {
            quinn::ConnectionError::ApplicationClosed(c) if c.error_code == quinn::VarInt::from_u32(admission::OVERLOADED) => {
                Some(String::from_utf8_lossy(&c.reason).into_owned())
            }
            quinn::ConnectionError::ConnectionClosed(c) if c.error_code == quinn::TransportErrorCode::CONNECTION_REFUSED => {
                Some(fedfleet_protocol::reject::overloaded_detail(
                    "the service refused the connection before its handshake (admission)",
                    admission::DEFAULT_RETRY_AFTER.as_millis() as u64,
                ))
            }
            _ => None,
        }
    }

    /// The TLS alert behind this error, if the connection was closed with one.
    pub fn tls_alert(&self) -> Option<u8> {
        match self {
            NetError::Connection(e) => tls_alert(e),
            _ => None,
        }
    }
}

/// Bidirectional streams a client may have open at once on one connection to a service (a
/// client's next one waits for a free one). quinn keeps state for every stream the peer may
/// open: at its default (100 of each kind) ten thousand device connections held tens of MB.
const STREAMS_PER_CONNECTION: u32 = 32;

/// The server side's transport: no keep-alives (a device connects when it has work and lets go,
/// and a connection nobody uses closes after [`IDLE_TIMEOUT`], so ten thousand idle devices
/// hold no server state); clients open [`STREAMS_PER_CONNECTION`] request streams at most.
fn server_transport() -> Arc<quinn::TransportConfig> {
    let mut transport = common_transport();
    transport.max_concurrent_bidi_streams(STREAMS_PER_CONNECTION.into());
    Arc::new(transport)
}

/// The client side's transport: keep-alives every `keep_alive`, if any (see
/// [`RpcConnection::keep_alive`]; the next call reconnects otherwise,
/// [`RpcConnection::connection`]); services never open a stream to a client.
fn client_transport(keep_alive: Option<Duration>) -> Arc<quinn::TransportConfig> {
    let mut transport = common_transport();
    transport.max_concurrent_bidi_streams(0u32.into());
    transport.keep_alive_interval(keep_alive);
    Arc::new(transport)
}

/// Both sides: the idle timeout; no unidirectional streams, no datagrams (fedfleet uses neither);
/// one path MTU probe ([`one_mtu_probe`]).
fn common_transport() -> quinn::TransportConfig {
    let mut transport = quinn::TransportConfig::default();
    transport.max_idle_timeout(Some(IDLE_TIMEOUT.try_into().expect("30 s is a valid idle timeout")));
    transport.max_concurrent_uni_streams(0u32.into());
    transport.datagram_receive_buffer_size(None);
    transport.initial_mtu(INITIAL_MTU);
    transport.mtu_discovery_config(Some(one_mtu_probe()));
    transport
}

/// The UDP payload every QUIC path carries (RFC 9000's minimum).
const INITIAL_MTU: u16 = 1200;
/// The UDP payload a connection probes for (quinn's default upper bound: a 1500-byte Ethernet
/// path less IPv6 and UDP headers).
const PROBED_MTU: u16 = 1452;

/// Path MTU discovery that probes once, for [`PROBED_MTU`]: a device connects for one upload,
/// and quinn's default binary search sent four probes of 1.3–1.45 KB on every connection, mostly
/// padding that the receiver parses byte by byte; a 20 kB update took 30–31 datagrams on
/// loopback, 26–27 with one probe (measured, `benches/README.md`). A big transfer still gets
/// the larger packets; a path that drops the probe stays at [`INITIAL_MTU`] (the default search
/// would have found a size between).
fn one_mtu_probe() -> quinn::MtuDiscoveryConfig {
    let mut mtu = quinn::MtuDiscoveryConfig::default();
    mtu.upper_bound(PROBED_MTU);
    // Below this change quinn stops halving and probes the upper bound itself: the first probe.
    mtu.minimum_change(PROBED_MTU - INITIAL_MTU);
    mtu
}

/// A server endpoint on `addr` using an mTLS config from `fedfleet_certs::tls::server_config`.
/// Its stateless-reset key is random: clients of a previous process on the same address wait
/// out the idle timeout (see [`server_endpoint_restartable`]).
pub fn server_endpoint(addr: SocketAddr, tls: rustls::ServerConfig) -> Result<quinn::Endpoint, NetError> {
    bind_server(addr, tls, quinn::EndpointConfig::default())
}

/// [`server_endpoint`] for a service that restarts on the same address: the stateless-reset key
/// is derived from `secret` (a key the service keeps across restarts), so after a crash the new
/// process answers packets of the old connections with resets their clients accept, and they
/// reconnect at once instead of after the 30 s idle timeout.
pub fn server_endpoint_restartable(addr: SocketAddr, tls: rustls::ServerConfig, secret: &[u8]) -> Result<quinn::Endpoint, NetError> {
    let seed = blake3::derive_key("fedfleet-net 2026 QUIC stateless reset key v1", secret);
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &seed);
    let mut config = quinn::EndpointConfig::new(Arc::new(key));
    // The new process must also recognise the old connection ids as its own (tagged with a
    // stable key), or it drops their packets instead of resetting them.
    let cid_key = blake3::derive_key("fedfleet-net 2026 QUIC connection id key v2", secret);
    config.cid_generator(move || Box::new(KeyedConnectionIds { key: cid_key }));
    bind_server(addr, tls, config)
}

/// Connection ids a service can tell as its own after a restart: a random nonce and a keyed
/// tag of it. quinn's `HashedConnectionIdGenerator` does the same with a 3-byte nonce, but the
/// id a stateless retry hands out is not checked against live connections' ids, and at 24 bits
/// a burst of thousands of retries beside thousands of connections draws a live id every few
/// thousand (measured: 1-4 devices per 3,000-device burst whose handshakes hung until their
/// timeout, their Initials going to another connection). At 64 bits that does not happen.
struct KeyedConnectionIds {
    key: [u8; 32],
}

const CID_NONCE_LEN: usize = 8;
const CID_TAG_LEN: usize = 4;

impl KeyedConnectionIds {
    fn tag(&self, nonce: &[u8]) -> [u8; CID_TAG_LEN] {
        let hash = blake3::keyed_hash(&self.key, nonce);
        hash.as_bytes()[..CID_TAG_LEN].try_into().expect("a blake3 hash has 32 bytes")
    }
}

impl quinn_proto::ConnectionIdGenerator for KeyedConnectionIds {
    fn generate_cid(&mut self) -> quinn_proto::ConnectionId {
        let mut id = [0u8; CID_NONCE_LEN + CID_TAG_LEN];
        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut id[..CID_NONCE_LEN]).expect("the system's random source");
        let tag = self.tag(&id[..CID_NONCE_LEN]);
        id[CID_NONCE_LEN..].copy_from_slice(&tag);
        quinn_proto::ConnectionId::new(&id)
    }

    fn validate(&self, cid: &quinn_proto::ConnectionId) -> Result<(), quinn_proto::InvalidCid> {
        if cid.len() != CID_NONCE_LEN + CID_TAG_LEN {
            return Err(quinn_proto::InvalidCid);
        }
        let (nonce, tag) = cid.split_at(CID_NONCE_LEN);
        if self.tag(nonce) == tag { Ok(()) } else { Err(quinn_proto::InvalidCid) }
    }

    fn cid_len(&self) -> usize {
        CID_NONCE_LEN + CID_TAG_LEN
    }

    fn cid_lifetime(&self) -> Option<Duration> {
        None
    }
}

/// Socket buffers a service asks for: a fleet's handshakes and uploads arrive in bursts (a
/// round's uploads from 1,000 devices are 20 MB at once), and the kernel default (~208 KiB)
/// drops datagrams that QUIC then waits to retransmit, shrinking its window. The kernel caps
/// the request at `net.core.rmem_max`/`wmem_max`; a smaller buffer is not an error, but it is
/// said once, with the setting to raise.
const SERVICE_SOCKET_BUFFER: usize = 16 << 20;

fn widen_buffers(socket: &std::net::UdpSocket) {
    let Ok(state) = quinn::udp::UdpSocketState::new(socket.into()) else { return };
    let recv = state.set_recv_buffer_size(socket.into(), SERVICE_SOCKET_BUFFER);
    let send = state.set_send_buffer_size(socket.into(), SERVICE_SOCKET_BUFFER);
    let granted = state.recv_buffer_size(socket.into()).ok();
    tracing::debug!(recv = ?granted, send = ?state.send_buffer_size(socket.into()).ok(), ok = recv.is_ok() && send.is_ok(), "service UDP socket buffers");
    // Linux reports twice what it granted (half is its bookkeeping), so a full grant reads as
    // at least the request.
    if let Some(granted) = granted
        && granted < SERVICE_SOCKET_BUFFER
        && !SMALL_BUFFER_SAID.swap(true, std::sync::atomic::Ordering::Relaxed)
    {
        tracing::info!(
            asked = SERVICE_SOCKET_BUFFER,
            granted,
            "the UDP receive buffer is smaller than asked: bursts of uploads will be dropped and resent; \
             for fleets of thousands raise it (sysctl -w net.core.rmem_max=16777216 net.core.wmem_max=16777216)"
        );
    }
}

/// [`widen_buffers`]' advice is given once a process.
static SMALL_BUFFER_SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn bind_server(addr: SocketAddr, tls: rustls::ServerConfig, endpoint: quinn::EndpointConfig) -> Result<quinn::Endpoint, NetError> {
    let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(tls).map_err(|e| NetError::Config(e.to_string()))?;
    let mut config = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    config.transport_config(server_transport());
    endpoint_with_service_buffers(addr, endpoint, Some(config))
}

/// An endpoint on a socket bound to `addr` with a service's buffers ([`SERVICE_SOCKET_BUFFER`]).
fn endpoint_with_service_buffers(
    addr: SocketAddr,
    endpoint: quinn::EndpointConfig,
    server: Option<quinn::ServerConfig>,
) -> Result<quinn::Endpoint, NetError> {
    let socket = std::net::UdpSocket::bind(addr).map_err(|cause| NetError::Bind { addr, cause })?;
    widen_buffers(&socket);
    let runtime = quinn::default_runtime().ok_or_else(|| NetError::Config("no async runtime".into()))?;
    quinn::Endpoint::new(endpoint, server, socket, runtime).map_err(|cause| NetError::Bind { addr, cause })
}

/// The QUIC client config of a rustls config from `fedfleet_certs::tls::client_config`.
pub fn quic_client_config(tls: rustls::ClientConfig) -> Result<quinn::ClientConfig, NetError> {
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls).map_err(|e| NetError::Config(e.to_string()))?;
    let mut config = quinn::ClientConfig::new(Arc::new(crypto));
    config.transport_config(client_transport(None));
    Ok(config)
}

/// A client endpoint on an ephemeral local port, for configs from `fedfleet_certs::tls::client_config`.
pub fn client_endpoint(tls: rustls::ClientConfig) -> Result<quinn::Endpoint, NetError> {
    client_endpoint_at(([0, 0, 0, 0], 0).into(), tls)
}

/// [`client_endpoint`] bound to `addr` (e.g. a loopback address of its own, for a simulated
/// device whose source address the services should tell apart from others').
pub fn client_endpoint_at(addr: SocketAddr, tls: rustls::ClientConfig) -> Result<quinn::Endpoint, NetError> {
    let config = quic_client_config(tls)?;
    let mut endpoint = quinn::Endpoint::client(addr).map_err(|cause| NetError::Bind { addr, cause })?;
    endpoint.set_default_client_config(config);
    Ok(endpoint)
}

/// [`client_endpoint_at`] for a socket that many devices' connections share (a simulated fleet's):
/// their bursts arrive together as a service's do, so it gets a service's socket buffers.
pub fn shared_client_endpoint_at(addr: SocketAddr, tls: rustls::ClientConfig) -> Result<quinn::Endpoint, NetError> {
    let config = quic_client_config(tls)?;
    let mut endpoint = endpoint_with_service_buffers(addr, quinn::EndpointConfig::default(), None)?;
    endpoint.set_default_client_config(config);
    Ok(endpoint)
}

/// Connects and completes the handshake. A server that refuses our certificate may still let
/// this succeed: the refusal then surfaces on the first stream.
pub async fn connect(endpoint: &quinn::Endpoint, addr: SocketAddr, server_name: &str) -> Result<quinn::Connection, NetError> {
    let connecting = endpoint.connect(addr, server_name).map_err(|cause| NetError::Connect { addr, cause })?;
    handshake(connecting).await
}

/// Waits for a client handshake, up to [`admission::HANDSHAKE_TIMEOUT`]: a service drops a
/// handshake it has not finished by then, so waiting on (until the 30 s idle timeout) would
/// wait for nothing. The error is quinn's own for a handshake that timed out, so callers
/// retry it as they would that.
pub(crate) async fn handshake(connecting: quinn::Connecting) -> Result<quinn::Connection, NetError> {
    match tokio::time::timeout(admission::HANDSHAKE_TIMEOUT, connecting).await {
        Ok(c) => Ok(c?),
        Err(_) => Err(NetError::Connection(quinn::ConnectionError::TimedOut)),
    }
}

/// One bidirectional stream carrying length-prefixed frames.
pub struct FramedStream {
    send: quinn::SendStream,
    recv: quinn::RecvStream,
    decoder: FrameDecoder,
    bytes_read: u64,
}

impl FramedStream {
    pub fn new(send: quinn::SendStream, recv: quinn::RecvStream) -> Self {
        FramedStream { send, recv, decoder: FrameDecoder::new(), bytes_read: 0 }
    }

    /// Opens a stream on `conn`.
    pub async fn open(conn: &quinn::Connection) -> Result<Self, NetError> {
        let (send, recv) = conn.open_bi().await?;
        Ok(Self::new(send, recv))
    }

    /// Sends one frame.
    pub async fn send(&mut self, kind: FrameKind, body: &[u8]) -> Result<(), NetError> {
        let frame = encode_frame(kind, body)?;
        self.send.write_all(&frame).await?;
        Ok(())
    }

    /// Sends a payload (an update, a model, a masked vector) as `Chunk` frames and an `End`.
    pub async fn send_payload(&mut self, bytes: &[u8]) -> Result<(), NetError> {
        for chunk in bytes.chunks(fedfleet_protocol::limits::MAX_CHUNK_BYTES) {
            self.send(FrameKind::Chunk, chunk).await?;
        }
        self.send(FrameKind::End, &[]).await
    }

    /// Says we will send nothing more and reads the answer to what we wrote (`sent`: how the
    /// writing went). A server may answer and stop reading early (a refusal before the payload
    /// is read): a write error is then expected, and the answer, with its reason, is still read;
    /// the write error is returned only when no answer comes.
    pub async fn finish_and_answer(&mut self, sent: Result<(), NetError>) -> Result<Frame, NetError> {
        self.finish();
        match self.recv().await {
            Ok(Some(f)) => Ok(f),
            // Ended unanswered (a handler stopped mid-request): a lost exchange.
            Ok(None) => Err(sent.err().unwrap_or(NetError::Closed)),
            Err(e) => Err(sent.err().unwrap_or(e)),
        }
    }

    /// Says we will send nothing more.
    pub fn finish(&mut self) {
        // Already finished or reset: nothing left to say.
        let _ = self.send.finish();
    }

    /// The next frame; `Ok(None)` when the peer finished its side cleanly between frames.
    pub async fn recv(&mut self) -> Result<Option<Frame>, NetError> {
        loop {
            if let Some(frame) = self.decoder.poll()? {
                return Ok(Some(frame));
            }
            // No read buffer per stream: ten thousand open streams held 64 KiB each.
            match self.recv.read_chunk(READ_CHUNK, true).await? {
                Some(chunk) => {
                    self.bytes_read += chunk.bytes.len() as u64;
                    self.decoder.push(&chunk.bytes);
                }
                None => {
                    self.decoder.finish()?;
                    return Ok(None);
                }
            }
        }
    }

    /// The next frame, refusing the end of the stream.
    pub async fn expect(&mut self) -> Result<Frame, NetError> {
        self.recv().await?.ok_or(NetError::Closed)
    }

    /// Bytes received so far on this stream, frame prefixes included.
    pub fn bytes_read(&self) -> u64 {
        self.bytes_read
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn closed(e: quinn::ConnectionError) -> NetError {
        NetError::Connection(e)
    }

    /// The sysctl file a service host installs grants what the services ask for.
    #[test]
    fn the_shipped_sysctl_settings_grant_the_service_socket_buffers() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/sysctl/90-fedfleet.conf");
        let conf = std::fs::read_to_string(path).unwrap();
        for key in ["net.core.rmem_max", "net.core.wmem_max"] {
            let value = conf
                .lines()
                .filter_map(|l| l.split_once('='))
                .find(|(k, _)| k.trim() == key)
                .map(|(_, v)| v.trim().parse::<usize>().unwrap())
                .unwrap_or_else(|| panic!("{key} is not in {path}"));
            assert!(value >= SERVICE_SOCKET_BUFFER, "{key} = {value}");
        }
    }

    /// A connection probes its path's MTU once, and gets the larger packets from it.
    #[tokio::test]
    async fn a_connection_probes_its_path_mtu_once() {
        let dir = tempfile::tempdir().unwrap();
        let fleet = fedfleet_protocol::FleetId::new("fleet-a").unwrap();
        let device = fedfleet_protocol::DeviceId::new("cam-1").unwrap();
        let pki = fedfleet_certs::Pki::init(dir.path(), &fleet, 30, false).unwrap();
        pki.issue_server("aggregator", &[], 30, false).unwrap();
        pki.enroll_device(&device, 30, false).unwrap();
        let identity = fedfleet_certs::ServerIdentity::load(dir.path(), "aggregator").unwrap();
        let revocation = std::sync::Arc::new(fedfleet_certs::RevocationWatcher::open(dir.path()).unwrap());
        let alpn = [fedfleet_certs::ALPN_V1];
        let server_tls = fedfleet_certs::tls::server_config(pki.ca(), &identity, revocation, &alpn).unwrap();
        let device_identity = fedfleet_certs::DeviceIdentity::load(dir.path(), &device).unwrap();
        let client_tls = fedfleet_certs::tls::client_config(pki.ca(), &device_identity, &alpn).unwrap();
        let server = server_endpoint("127.0.0.1:0".parse().unwrap(), server_tls).unwrap();
        let addr = server.local_addr().unwrap();
        let served = tokio::spawn(async move {
            let conn = server.accept().await.unwrap().await.unwrap();
            let (mut send, mut recv) = conn.accept_bi().await.unwrap();
            let got = recv.read_to_end(1 << 20).await.unwrap();
            send.write_all(&(got.len() as u64).to_le_bytes()).await.unwrap();
            send.finish().unwrap();
            conn.closed().await;
        });
        let client = client_endpoint(client_tls).unwrap();
        let conn = connect(&client, addr, "localhost").await.unwrap();
        let (mut send, mut recv) = conn.open_bi().await.unwrap();
        send.write_all(&vec![7u8; 256 << 10]).await.unwrap();
        send.finish().unwrap();
        assert_eq!(recv.read_to_end(8).await.unwrap(), (256u64 << 10).to_le_bytes());
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while conn.stats().path.current_mtu != PROBED_MTU && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let path = conn.stats().path;
        assert_eq!(path.current_mtu, PROBED_MTU, "{path:?}");
        assert_eq!(path.sent_plpmtud_probes, 1, "{path:?}");
        conn.close(0u32.into(), b"done");
        served.await.unwrap();
    }

    /// A burst's worth of connection ids (every stateless retry of 3,000 devices and their
    /// connections' ids, twice over) has no two alike: quinn's 3-byte nonce gave about a dozen
    /// pairs here. Ids are recognised by a restarted process (same key) and by no other.
    #[test]
    fn connection_ids_do_not_collide_in_a_burst_and_are_recognised_across_a_restart() {
        use quinn_proto::ConnectionIdGenerator;
        let key = blake3::derive_key("test", b"secret");
        let mut ids = KeyedConnectionIds { key };
        let drawn: Vec<_> = (0..20_000).map(|_| ids.generate_cid()).collect();
        let distinct: std::collections::HashSet<_> = drawn.iter().map(|c| c.to_vec()).collect();
        assert_eq!(distinct.len(), drawn.len());
        let restarted = KeyedConnectionIds { key };
        let stranger = KeyedConnectionIds { key: blake3::derive_key("test", b"another secret") };
        assert!(drawn.iter().all(|c| restarted.validate(c).is_ok()));
        assert!(drawn.iter().all(|c| stranger.validate(c).is_err()));
        assert!(restarted.validate(&quinn_proto::ConnectionId::new(&drawn[0][..8])).is_err(), "a short id is not ours");
    }

    #[test]
    fn a_connection_turned_away_for_load_reads_as_overloaded_with_its_retry_after() {
        let app = quinn::ApplicationClose {
            error_code: quinn::VarInt::from_u32(admission::OVERLOADED),
            reason: fedfleet_protocol::reject::overloaded_detail("overloaded", 1_500).into_bytes().into(),
        };
        let detail = closed(quinn::ConnectionError::ApplicationClosed(app)).overloaded().expect("overloaded");
        assert_eq!(fedfleet_protocol::reject::retry_after_ms(&detail), Some(1_500));
        let named = closed(quinn::ConnectionError::ApplicationClosed(quinn::ApplicationClose {
            error_code: quinn::VarInt::from_u32(admission::OVERLOADED),
            reason: detail.clone().into_bytes().into(),
        }))
        .refusal("aggregator")
        .expect("a refusal");
        assert_eq!((named.reason, named.detail), (fedfleet_protocol::RejectReason::Overloaded, detail));

        let refused = quinn::ConnectionClose {
            error_code: quinn::TransportErrorCode::CONNECTION_REFUSED,
            frame_type: None,
            reason: Default::default(),
        };
        let detail = closed(quinn::ConnectionError::ConnectionClosed(refused)).overloaded().expect("overloaded");
        assert_eq!(fedfleet_protocol::reject::retry_after_ms(&detail), Some(admission::DEFAULT_RETRY_AFTER.as_millis() as u64));

        let other = quinn::ApplicationClose { error_code: quinn::VarInt::from_u32(7), reason: Default::default() };
        assert_eq!(closed(quinn::ConnectionError::ApplicationClosed(other)).overloaded(), None);
        assert_eq!(closed(quinn::ConnectionError::TimedOut).overloaded(), None);
    }
}
