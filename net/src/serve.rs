//! The one QUIC accept loop both services run: a connection limit (over it, new connections are
//! refused at once and counted, instead of queueing unbounded handshakes), graceful shutdown
//! (stop accepting, let handlers finish within a bound, close the endpoint).

use std::future::Future;
use std::time::Duration;

use tokio::task::JoinSet;

/// Accepts connections on `endpoint` until `shutdown` resolves or the endpoint closes. Each
/// accepted connection runs `handle(incoming)` as its own task while it holds one of
/// `max_connections` permits; past the limit the connection is refused and `on_overload` runs.
/// Returns the handlers still running, for [`drain`].
pub async fn accept_until<F, Fut>(
    endpoint: &quinn::Endpoint,
    max_connections: usize,
    shutdown: impl Future<Output = ()>,
    mut on_overload: impl FnMut(),
    mut handle: F,
) -> JoinSet<()>
where
    F: FnMut(quinn::Incoming) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let permits = std::sync::Arc::new(tokio::sync::Semaphore::new(max_connections));
    let mut handlers = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            incoming = endpoint.accept() => {
                let Some(incoming) = incoming else { break };
                while handlers.try_join_next().is_some() {}
                match permits.clone().try_acquire_owned() {
                    Ok(permit) => {
                        let task = handle(incoming);
                        handlers.spawn(async move {
                            task.await;
                            drop(permit);
                        });
                    }
                    Err(_) => {
                        on_overload();
                        incoming.refuse();
                    }
                }
            }
            _ = &mut shutdown => break,
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
