//! The one way a fedfleet process stops: a [`Shutdown`] switch every task of a service holds a
//! clone of, flipped once by the operator's signal ([`Shutdown::on_signal`]), a test, or the
//! service itself. Waiting on it is cheap and can be done by any number of tasks at once.

use std::future::Future;
use std::sync::Arc;

use tokio::sync::watch;

/// A shutdown switch. Cheap to clone; every clone sees the same switch.
#[derive(Clone, Debug)]
pub struct Shutdown {
    switch: Arc<watch::Sender<bool>>,
}

impl Default for Shutdown {
    fn default() -> Self {
        Shutdown::new()
    }
}

impl Shutdown {
    /// A switch that is not flipped yet.
    pub fn new() -> Self {
        Shutdown { switch: Arc::new(watch::channel(false).0) }
    }

    /// A switch flipped by SIGTERM or Ctrl-C (the one signal handler of every fedfleet daemon).
    /// Call inside a tokio runtime.
    pub fn on_signal() -> Self {
        let shutdown = Shutdown::new();
        let flip = shutdown.clone();
        tokio::spawn(async move {
            operator_signal().await;
            tracing::info!("signal received: shutting down");
            flip.trigger();
        });
        shutdown
    }

    /// Flips the switch (idempotent).
    pub fn trigger(&self) {
        self.switch.send_replace(true);
    }

    pub fn is_triggered(&self) -> bool {
        *self.switch.borrow()
    }

    /// Resolves once the switch is flipped (at once if it already is). Owns what it needs, so
    /// it can be moved into a spawned task.
    pub fn wait(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut seen = self.switch.subscribe();
        async move {
            // Every clone of the switch dropped (nobody can flip it any more) counts as flipped.
            let _ = seen.wait_for(|flipped| *flipped).await;
        }
    }
}

/// SIGTERM or Ctrl-C (SIGINT). Where no SIGTERM handler can be installed, Ctrl-C alone.
async fn operator_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn every_clone_sees_one_trigger() {
        let a = Shutdown::new();
        let b = a.clone();
        let waiting = tokio::spawn(b.wait());
        assert!(!a.is_triggered());
        a.trigger();
        waiting.await.unwrap();
        assert!(b.is_triggered());
        // Waiting after the fact resolves at once.
        b.wait().await;
    }
}
