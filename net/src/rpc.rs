//! The one reconnecting client connection every fedfleet client uses (aggregator and registry):
//! a lazily opened QUIC connection that is replaced when it closed (idle timeout, server
//! restart), and bounded retries with backoff for idempotent calls.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::sync::Mutex;

use crate::{FramedStream, NetError};

/// Consecutive transport failures an idempotent call survives before it gives up.
pub const DEFAULT_MAX_RETRIES: u32 = 5;

/// Backoff before retry `attempt` (1-based): 100 ms doubling, capped at 2 s.
pub fn backoff(attempt: u32) -> Duration {
    Duration::from_millis((50u64 << attempt.min(6)).min(2000))
}

/// A client's connection to one server, reconnected on demand.
pub struct RpcConnection {
    endpoint: quinn::Endpoint,
    /// Made for this connection alone (closing waits for it to go idle), or shared.
    owns_endpoint: bool,
    addr: SocketAddr,
    server_name: String,
    /// The TLS identity new connections present (replaced by [`RpcConnection::set_tls`]).
    config: std::sync::Mutex<quinn::ClientConfig>,
    /// See [`RpcConnection::keep_alive`].
    keep_alive: Option<std::time::Duration>,
    conn: Mutex<Option<quinn::Connection>>,
}

impl std::fmt::Debug for RpcConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RpcConnection").field("addr", &self.addr).field("server_name", &self.server_name).finish()
    }
}

impl RpcConnection {
    /// No handshake yet: the first call connects (a device can start while the server is down).
    /// Must be called inside a tokio runtime.
    pub fn new(addr: SocketAddr, server_name: &str, tls: rustls::ClientConfig) -> Result<Self, NetError> {
        let endpoint = crate::client_endpoint(tls.clone())?;
        Ok(RpcConnection { owns_endpoint: true, ..Self::on_endpoint(endpoint, addr, server_name, tls)? })
    }

    /// As [`new`](Self::new), on an endpoint (one UDP socket) shared with other connections:
    /// a device's aggregator and registry clients, or many simulated devices, each presenting
    /// its own `tls` identity.
    pub fn on_endpoint(
        endpoint: quinn::Endpoint,
        addr: SocketAddr,
        server_name: &str,
        tls: rustls::ClientConfig,
    ) -> Result<Self, NetError> {
        Ok(RpcConnection {
            endpoint,
            owns_endpoint: false,
            config: std::sync::Mutex::new(crate::quic_client_config(tls)?),
            addr,
            server_name: server_name.to_owned(),
            keep_alive: None,
            conn: Mutex::new(None),
        })
    }

    /// Keeps the connection open with a keep-alive every `interval`. Not for devices (an idle
    /// device lets go of its connection, which closes after the idle timeout): for a simulator
    /// whose in-process devices poll less often than real ones would, on a loaded machine.
    pub fn keep_alive(mut self, interval: Duration) -> Self {
        self.keep_alive = Some(interval);
        self.config.get_mut().unwrap_or_else(|p| p.into_inner()).transport_config(crate::client_transport(self.keep_alive));
        self
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The open connection, or a new one if there is none or it closed.
    pub async fn connection(&self) -> Result<quinn::Connection, NetError> {
        let mut guard = self.conn.lock().await;
        if let Some(c) = guard.as_ref()
            && c.close_reason().is_none()
        {
            return Ok(c.clone());
        }
        let config = self.config.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let connecting = self
            .endpoint
            .connect_with(config, self.addr, &self.server_name)
            .map_err(|cause| NetError::Connect { addr: self.addr, cause })?;
        let c = crate::handshake(connecting).await?;
        *guard = Some(c.clone());
        Ok(c)
    }

    /// A new request stream; a connection that cannot open one is dropped so the next call
    /// reconnects.
    pub async fn open_stream(&self) -> Result<FramedStream, NetError> {
        let conn = self.connection().await?;
        match FramedStream::open(&conn).await {
            Ok(s) => Ok(s),
            Err(e) => {
                self.forget().await;
                Err(e)
            }
        }
    }

    /// Presents `tls` (e.g. a renewed certificate) from the next connection on. The current
    /// connection is not closed: requests in flight on it finish with the old certificate.
    pub async fn set_tls(&self, tls: rustls::ClientConfig) -> Result<(), NetError> {
        let mut config = crate::quic_client_config(tls)?;
        if self.keep_alive.is_some() {
            config.transport_config(crate::client_transport(self.keep_alive));
        }
        *self.config.lock().unwrap_or_else(|p| p.into_inner()) = config;
        self.conn.lock().await.take();
        Ok(())
    }

    /// Drops the current connection (the next call reconnects).
    pub async fn forget(&self) {
        if let Some(c) = self.conn.lock().await.take() {
            c.close(0u32.into(), b"reconnecting");
        }
    }

    /// Runs an idempotent call, reconnecting and retrying with [`backoff`] while `is_transport`
    /// says the failure was the connection's, at most `max_retries` times.
    pub async fn retry<T, E, F, Fut>(&self, max_retries: u32, is_transport: impl Fn(&E) -> bool, mut call: F) -> Result<T, E>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, E>>,
        E: std::fmt::Display,
    {
        let mut attempt = 0;
        loop {
            match call().await {
                Err(e) if is_transport(&e) && attempt < max_retries => {
                    attempt += 1;
                    tracing::debug!(error = %e, attempt, addr = %self.addr, "call failed; reconnecting");
                    self.forget().await;
                    tokio::time::sleep(backoff(attempt)).await;
                }
                other => return other,
            }
        }
    }

    /// Closes the connection and, if the endpoint is its own, waits for it to go idle.
    pub async fn close(&self) {
        if let Some(c) = self.conn.lock().await.take() {
            c.close(0u32.into(), b"bye");
        }
        if self.owns_endpoint {
            self.endpoint.wait_idle().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A handshake nobody answers (a bound socket that reads nothing) ends at the services'
    /// handshake bound, not at the idle timeout three times as long.
    #[tokio::test(start_paused = true)]
    async fn a_handshake_nobody_answers_ends_at_the_services_bound() {
        let silent = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let tls = rustls::ClientConfig::builder_with_provider(fedfleet_certs::tls::provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth();
        let rpc = RpcConnection::new(silent.local_addr().unwrap(), "aggregator", tls).unwrap();
        let started = tokio::time::Instant::now();
        let err = rpc.connection().await.unwrap_err();
        assert!(matches!(err, NetError::Connection(quinn::ConnectionError::TimedOut)), "{err}");
        let waited = started.elapsed();
        assert!(waited >= crate::admission::HANDSHAKE_TIMEOUT && waited < crate::IDLE_TIMEOUT, "{waited:?}");
    }
}
