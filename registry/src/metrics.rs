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
//!
//! Gauges set by the MQTT side ([`crate::mqtt`]): `fedfleet_registry_mqtt_connected`,
//! `fedfleet_registry_devices_online`, `fedfleet_registry_devices_known`,
//! `fedfleet_registry_device_last_seen_seconds{device}`.

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
    gauges: Mutex<BTreeMap<GaugeKey, u64>>,
}

/// A gauge's name and its one optional label (name, value).
type GaugeKey = (&'static str, Option<(&'static str, String)>);

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

    /// Sets a gauge, optionally with one label.
    pub fn set_gauge(&self, metric: &'static str, label: Option<(&'static str, &str)>, value: u64) {
        let mut g = self.gauges.lock().unwrap_or_else(|p| p.into_inner());
        g.insert((metric, label.map(|(l, v)| (l, v.to_owned()))), value);
    }

    /// A gauge's value, if set (tests).
    pub fn gauge(&self, metric: &str, label_value: Option<&str>) -> Option<u64> {
        let g = self.gauges.lock().unwrap_or_else(|p| p.into_inner());
        g.iter()
            .find(|((n, l), _)| *n == metric && l.as_ref().map(|(_, v)| v.as_str()) == label_value)
            .map(|(_, v)| *v)
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
        drop(m);
        let g = self.gauges.lock().unwrap_or_else(|p| p.into_inner());
        let mut last = "";
        for ((name, label), v) in g.iter() {
            if *name != last {
                out.push_str(&format!("# TYPE {name} gauge\n"));
                last = name;
            }
            match label {
                Some((l, value)) => {
                    let value = value.replace('\\', "\\\\").replace('"', "\\\"");
                    out.push_str(&format!("{name}{{{l}=\"{value}\"}} {v}\n"));
                }
                None => out.push_str(&format!("{name} {v}\n")),
            }
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
