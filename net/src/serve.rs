//! The one accept loop every listener of fedfleet runs: the services' QUIC endpoints, the
//! embedded MQTT broker's TCP listener and the agent's inference socket. A connection limit
//! (over it, new connections are refused at once and counted, instead of queueing unbounded
//! handshakes), backoff on accept errors (a full file table does not end the endpoint or spin
//! the CPU), graceful shutdown (stop accepting, let handlers finish within a bound).

use std::future::Future;
use std::io;
use std::time::Duration;

use tokio::task::JoinSet;

/// Something connections arrive on.
pub trait Listener {
    /// One accepted connection (a QUIC `Incoming` still has its handshake ahead).
    type Conn: Send + 'static;

    /// The next connection; `None` once the listener is closed for good.
    fn accept(&self) -> impl Future<Output = Option<io::Result<Self::Conn>>> + Send;

    /// Turns a connection away when the limit is reached (dropping it, unless the transport
    /// has a cheaper answer).
    fn refuse(conn: Self::Conn) {
        drop(conn);
    }
}

impl Listener for quinn::Endpoint {
    type Conn = quinn::Incoming;

    async fn accept(&self) -> Option<io::Result<quinn::Incoming>> {
        quinn::Endpoint::accept(self).await.map(Ok)
    }

    fn refuse(conn: quinn::Incoming) {
        conn.refuse();
    }
}

impl Listener for tokio::net::TcpListener {
    type Conn = (tokio::net::TcpStream, std::net::SocketAddr);

    async fn accept(&self) -> Option<io::Result<Self::Conn>> {
        Some(tokio::net::TcpListener::accept(self).await)
    }
}

#[cfg(unix)]
impl Listener for tokio::net::UnixListener {
    type Conn = tokio::net::UnixStream;

    async fn accept(&self) -> Option<io::Result<Self::Conn>> {
        Some(tokio::net::UnixListener::accept(self).await.map(|(stream, _)| stream))
    }
}

/// First and last pause after a failed accept (doubling in between; reset by a success).
const ACCEPT_BACKOFF: (Duration, Duration) = (Duration::from_millis(5), Duration::from_secs(1));

/// Accepts connections on `listener` until `shutdown` resolves or the listener closes. Each
/// accepted connection runs `handle(conn)` as its own task while it holds one of
/// `max_connections` permits; past the limit the connection is refused and `on_overload` runs.
/// Returns the handlers still running, for [`drain`] (or `JoinSet::shutdown`).
pub async fn accept_until<L, F, Fut>(
    listener: &L,
    max_connections: usize,
    shutdown: impl Future<Output = ()>,
    mut on_overload: impl FnMut(),
    mut handle: F,
) -> JoinSet<()>
where
    L: Listener,
    F: FnMut(L::Conn) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let permits = std::sync::Arc::new(tokio::sync::Semaphore::new(max_connections));
    let mut handlers = JoinSet::new();
    let mut backoff = ACCEPT_BACKOFF.0;
    tokio::pin!(shutdown);
    loop {
        let conn = tokio::select! {
            accepted = listener.accept() => match accepted {
                None => break,
                Some(Ok(conn)) => {
                    backoff = ACCEPT_BACKOFF.0;
                    conn
                }
                Some(Err(e)) => {
                    tracing::warn!(error = %e, pause_ms = backoff.as_millis() as u64, "accept failed");
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = &mut shutdown => break,
                    }
                    backoff = (backoff * 2).min(ACCEPT_BACKOFF.1);
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        while handlers.try_join_next().is_some() {}
        match permits.clone().try_acquire_owned() {
            Ok(permit) => {
                let task = handle(conn);
                handlers.spawn(async move {
                    task.await;
                    drop(permit);
                });
            }
            Err(_) => {
                on_overload();
                L::refuse(conn);
            }
        }
    }
    handlers
}

/// Waits up to `within` for `handlers` to finish, then closes `endpoint` and waits (2 s at
/// most) for its connections to go idle. Handlers still running are aborted.
pub async fn drain(endpoint: &quinn::Endpoint, mut handlers: JoinSet<()>, within: Duration) {
    let _ = tokio::time::timeout(within, async { while handlers.join_next().await.is_some() {} }).await;
    handlers.abort_all();
    endpoint.close(0u32.into(), b"shutting down");
    let _ = tokio::time::timeout(Duration::from_secs(2), endpoint.wait_idle()).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Past the limit a TCP connection is dropped and counted; the ones within it are served.
    #[tokio::test]
    async fn connections_past_the_limit_are_refused_and_counted() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let refused = Arc::new(AtomicUsize::new(0));
        let shutdown = crate::Shutdown::new();
        let (hold, held) = tokio::sync::watch::channel(());
        let loop_task = {
            let refused = refused.clone();
            let stop = shutdown.wait();
            tokio::spawn(async move {
                let handlers = accept_until(
                    &listener,
                    2,
                    stop,
                    || {
                        refused.fetch_add(1, Ordering::SeqCst);
                    },
                    move |_conn| {
                        let mut held = held.clone();
                        async move {
                            let _ = held.changed().await;
                        }
                    },
                )
                .await;
                handlers.len()
            })
        };
        let mut clients = Vec::new();
        for _ in 0..3 {
            clients.push(tokio::net::TcpStream::connect(addr).await.unwrap());
        }
        for _ in 0..200 {
            if refused.load(Ordering::SeqCst) == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(refused.load(Ordering::SeqCst), 1, "the third connection is refused");
        shutdown.trigger();
        assert_eq!(loop_task.await.unwrap(), 2, "the two admitted handlers are still running at shutdown");
        drop(hold);
    }
}
