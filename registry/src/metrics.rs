//! Prometheus metrics, in the text exposition format, served on a loopback address.
//!
//! Hand-written on purpose: a handful of counters needs neither the `prometheus` crate (protobuf
//! by default) nor `metrics` + `metrics-exporter-prometheus` (hyper), and keeps the build small.
//!
//! | metric | labels |
//! |---|---|
//! | `fedfleet_registry_requests_total` | `kind` |
//! | `fedfleet_registry_rejections_total` | `reason` (a `RejectReason` name) |
//! | `fedfleet_registry_bytes_served_total` | |
//! | `fedfleet_registry_chunks_served_total` | |
//! | `fedfleet_registry_connections_total` | |
//! | `fedfleet_registry_rollout_events_total` | `event` |
//! | `fedfleet_registry_device_reports_total` | `state` |

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The registry's counters.
#[derive(Debug, Default)]
pub struct Metrics {
    pub bytes_served: AtomicU64,
    pub chunks_served: AtomicU64,
    pub connections: AtomicU64,
    labeled: Mutex<BTreeMap<(&'static str, &'static str, String), u64>>,
}

impl Metrics {
    fn inc(&self, metric: &'static str, label: &'static str, value: &str) {
        let mut m = self.labeled.lock().unwrap_or_else(|p| p.into_inner());
        *m.entry((metric, label, value.to_owned())).or_default() += 1;
    }

    pub fn request(&self, kind: &str) {
        self.inc("fedfleet_registry_requests_total", "kind", kind);
    }

    pub fn rejection(&self, reason: fedfleet_protocol::RejectReason) {
        self.inc(
            "fedfleet_registry_rejections_total",
            "reason",
            reason.as_str(),
        );
    }

    /// A refusal that is not a protocol `RejectReason`: `not_found`, `denied`, `invalid_command`.
    pub fn rejection_named(&self, reason: &str) {
        self.inc("fedfleet_registry_rejections_total", "reason", reason);
    }

    pub fn rollout_event(&self, event: &str) {
        self.inc("fedfleet_registry_rollout_events_total", "event", event);
    }

    pub fn device_report(&self, state: &str) {
        self.inc("fedfleet_registry_device_reports_total", "state", state);
    }

    /// A labeled counter's value (tests).
    pub fn get(&self, metric: &str, value: &str) -> u64 {
        let m = self.labeled.lock().unwrap_or_else(|p| p.into_inner());
        m.iter()
            .filter(|((n, _, v), _)| *n == metric && v == value)
            .map(|(_, c)| *c)
            .sum()
    }

    /// The text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let mut plain = |name: &str, help: &str, v: u64| {
            out.push_str(&format!(
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}\n"
            ));
        };
        plain(
            "fedfleet_registry_bytes_served_total",
            "Artifact bytes sent to clients.",
            self.bytes_served.load(Ordering::Relaxed),
        );
        plain(
            "fedfleet_registry_chunks_served_total",
            "Chunks sent to clients.",
            self.chunks_served.load(Ordering::Relaxed),
        );
        plain(
            "fedfleet_registry_connections_total",
            "QUIC connections accepted.",
            self.connections.load(Ordering::Relaxed),
        );
        let m = self.labeled.lock().unwrap_or_else(|p| p.into_inner());
        let mut last = "";
        for ((name, label, value), v) in m.iter() {
            if *name != last {
                out.push_str(&format!("# TYPE {name} counter\n"));
                last = name;
            }
            let value = value.replace('\\', "\\\\").replace('"', "\\\"");
            out.push_str(&format!("{name}{{{label}=\"{value}\"}} {v}\n"));
        }
        out
    }
}

/// Serves `GET /metrics` (any path, in fact) on `listener` until the task is dropped.
pub async fn serve(listener: tokio::net::TcpListener, metrics: std::sync::Arc<Metrics>) {
    loop {
        let Ok((mut sock, _)) = listener.accept().await else {
            continue;
        };
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 1024];
            // Read the request head (ignored beyond the first read).
            let _ =
                tokio::time::timeout(std::time::Duration::from_secs(5), sock.read(&mut buf)).await;
            let body = metrics.render();
            let resp = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = sock.write_all(resp.as_bytes()).await;
            let _ = sock.shutdown().await;
        });
    }
}

/// Binds the metrics listener; refuses a non-loopback address unless `allow_public`.
pub async fn bind(
    addr: SocketAddr,
    allow_public: bool,
) -> std::io::Result<tokio::net::TcpListener> {
    if !addr.ip().is_loopback() && !allow_public {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("metrics address {addr} is not loopback (set metrics_public = true to allow)"),
        ));
    }
    tokio::net::TcpListener::bind(addr).await
}
