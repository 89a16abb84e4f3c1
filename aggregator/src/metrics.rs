//! Prometheus metrics in the text exposition format, served at `GET /metrics` on the configured
//! (loopback) address. Hand-written like the registry's: a few counters need no exporter crate.
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `fedfleet_aggregator_rounds_total` | counter | `event` = opened, closed, failed, published, tensor_folded |
//! | `fedfleet_aggregator_updates_accepted_total` | counter | |
//! | `fedfleet_aggregator_updates_rejected_total` | counter | `reason` (every `RejectReason`) |
//! | `fedfleet_aggregator_update_bytes_total` | counter | payload bytes received |
//! | `fedfleet_aggregator_fold_bytes_total` | counter | f32 bytes folded |
//! | `fedfleet_aggregator_fold_seconds_total` | counter | time in folds (throughput = bytes / seconds) |
//! | `fedfleet_aggregator_open_round` | gauge | id of the open round (0 = none) |
//! | `fedfleet_aggregator_round_accepted` | gauge | updates accepted in the open round |
//! | `fedfleet_aggregator_resident_memory_bytes` | gauge | VmRSS |
//! | `fedfleet_aggregator_peak_resident_memory_bytes` | gauge | VmHWM |
//! | `fedfleet_aggregator_mqtt_connected` | gauge | 1 while the MQTT control client is connected |
//! | `fedfleet_aggregator_mqtt_rejected_total` | counter | `reason`: MQTT messages refused by the control client (signature, topic/device, assembly) and MQTT uploads refused by ingest (these also count in `updates_rejected_total`) |
//! | `fedfleet_aggregator_devices_online` | gauge | devices with a verified status within `presence_ttl_secs` |
//! | `fedfleet_aggregator_devices_known` | gauge | devices ever heard from over MQTT |
//! | `fedfleet_aggregator_device_last_seen_seconds` | gauge | `device`: Unix time of its last verified status |

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use fedfleet_control::Presence;
use fedfleet_protocol::{DeviceId, DeviceStatus, RejectReason};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[derive(Debug, Default)]
pub struct Metrics {
    pub accepted: AtomicU64,
    pub update_bytes: AtomicU64,
    pub fold_bytes: AtomicU64,
    fold_nanos: AtomicU64,
    pub open_round: AtomicU64,
    pub round_accepted: AtomicU64,
    rejected: Mutex<std::collections::BTreeMap<&'static str, u64>>,
    rounds: Mutex<std::collections::BTreeMap<&'static str, u64>>,
    pub mqtt_connected: AtomicU64,
    mqtt_rejected: Mutex<std::collections::BTreeMap<&'static str, u64>>,
    presence: Mutex<(Presence, std::collections::BTreeSet<DeviceId>)>,
    pub presence_ttl_ms: AtomicU64,
}

impl Metrics {
    pub fn rejected(&self, reason: RejectReason) {
        *self.rejected.lock().unwrap_or_else(|p| p.into_inner()).entry(reason.as_str()).or_default() += 1;
    }
    pub fn rejected_count(&self, reason: RejectReason) -> u64 {
        self.rejected.lock().unwrap_or_else(|p| p.into_inner()).get(reason.as_str()).copied().unwrap_or(0)
    }
    pub fn mqtt_rejected(&self, reason: RejectReason) {
        *self.mqtt_rejected.lock().unwrap_or_else(|p| p.into_inner()).entry(reason.as_str()).or_default() += 1;
    }
    pub fn mqtt_rejected_count(&self, reason: RejectReason) -> u64 {
        self.mqtt_rejected.lock().unwrap_or_else(|p| p.into_inner()).get(reason.as_str()).copied().unwrap_or(0)
    }
    /// Records a verified device status received at `now_ms`.
    pub fn status(&self, status: &DeviceStatus, now_ms: u64) {
        let mut p = self.presence.lock().unwrap_or_else(|p| p.into_inner());
        p.0.record(status, now_ms);
        p.1.insert(status.device.clone());
    }
    /// (devices online at `now_ms`, devices known).
    pub fn devices(&self, now_ms: u64) -> (usize, usize) {
        let p = self.presence.lock().unwrap_or_else(|p| p.into_inner());
        (p.0.online(now_ms, self.presence_ttl_ms.load(Relaxed)), p.0.known())
    }
    pub fn last_seen(&self, device: &DeviceId) -> Option<u64> {
        self.presence.lock().unwrap_or_else(|p| p.into_inner()).0.last_seen(device)
    }
    pub fn round_count(&self, event: &str) -> u64 {
        self.rounds.lock().unwrap_or_else(|p| p.into_inner()).get(event).copied().unwrap_or(0)
    }
    pub fn round(&self, event: &'static str) {
        *self.rounds.lock().unwrap_or_else(|p| p.into_inner()).entry(event).or_default() += 1;
    }
    pub fn folded(&self, bytes: u64, elapsed: std::time::Duration) {
        self.fold_bytes.fetch_add(bytes, Relaxed);
        self.fold_nanos.fetch_add(elapsed.as_nanos() as u64, Relaxed);
    }

    /// The exposition text.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let counter = |s: &mut String, name: &str, help: &str| {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} counter");
        };
        counter(&mut s, "fedfleet_aggregator_rounds_total", "Round events.");
        let rounds = self.rounds.lock().unwrap_or_else(|p| p.into_inner()).clone();
        for ev in ["opened", "closed", "failed", "published", "tensor_folded"] {
            let _ = writeln!(s, "fedfleet_aggregator_rounds_total{{event=\"{ev}\"}} {}", rounds.get(ev).copied().unwrap_or(0));
        }
        counter(&mut s, "fedfleet_aggregator_updates_accepted_total", "Updates accepted.");
        let _ = writeln!(s, "fedfleet_aggregator_updates_accepted_total {}", self.accepted.load(Relaxed));
        counter(&mut s, "fedfleet_aggregator_updates_rejected_total", "Updates and requests refused, by reason.");
        let rejected = self.rejected.lock().unwrap_or_else(|p| p.into_inner()).clone();
        for r in RejectReason::ALL {
            let _ = writeln!(
                s,
                "fedfleet_aggregator_updates_rejected_total{{reason=\"{}\"}} {}",
                r.as_str(),
                rejected.get(r.as_str()).copied().unwrap_or(0)
            );
        }
        counter(&mut s, "fedfleet_aggregator_update_bytes_total", "Update payload bytes received.");
        let _ = writeln!(s, "fedfleet_aggregator_update_bytes_total {}", self.update_bytes.load(Relaxed));
        counter(&mut s, "fedfleet_aggregator_fold_bytes_total", "f32 bytes folded into partial sums.");
        let _ = writeln!(s, "fedfleet_aggregator_fold_bytes_total {}", self.fold_bytes.load(Relaxed));
        counter(&mut s, "fedfleet_aggregator_fold_seconds_total", "Seconds spent folding.");
        let _ = writeln!(s, "fedfleet_aggregator_fold_seconds_total {:.6}", self.fold_nanos.load(Relaxed) as f64 / 1e9);
        let gauge = |s: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        gauge(&mut s, "fedfleet_aggregator_open_round", "Open round id, 0 if none.", self.open_round.load(Relaxed));
        gauge(&mut s, "fedfleet_aggregator_round_accepted", "Updates accepted in the open round.", self.round_accepted.load(Relaxed));
        gauge(&mut s, "fedfleet_aggregator_mqtt_connected", "1 while the MQTT control client is connected.", self.mqtt_connected.load(Relaxed));
        counter(&mut s, "fedfleet_aggregator_mqtt_rejected_total", "MQTT messages and uploads refused, by reason.");
        let mqtt_rejected = self.mqtt_rejected.lock().unwrap_or_else(|p| p.into_inner()).clone();
        for r in RejectReason::ALL {
            let _ = writeln!(
                s,
                "fedfleet_aggregator_mqtt_rejected_total{{reason=\"{}\"}} {}",
                r.as_str(),
                mqtt_rejected.get(r.as_str()).copied().unwrap_or(0)
            );
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let (online, known) = self.devices(now);
        gauge(&mut s, "fedfleet_aggregator_devices_online", "Devices with a recent verified status.", online as u64);
        gauge(&mut s, "fedfleet_aggregator_devices_known", "Devices ever heard from over MQTT.", known as u64);
        {
            let p = self.presence.lock().unwrap_or_else(|p| p.into_inner());
            let _ = writeln!(
                s,
                "# HELP fedfleet_aggregator_device_last_seen_seconds Unix time of the device's last verified status.\n# TYPE fedfleet_aggregator_device_last_seen_seconds gauge"
            );
            for d in &p.1 {
                if let Some(t) = p.0.last_seen(d) {
                    let _ = writeln!(s, "fedfleet_aggregator_device_last_seen_seconds{{device=\"{d}\"}} {:.3}", t as f64 / 1e3);
                }
            }
        }
        let (rss, hwm) = memory();
        gauge(&mut s, "fedfleet_aggregator_resident_memory_bytes", "Resident set size.", rss);
        gauge(&mut s, "fedfleet_aggregator_peak_resident_memory_bytes", "Peak resident set size.", hwm);
        s
    }
}

/// (VmRSS, VmHWM) in bytes, from /proc/self/status (0 where unavailable).
pub fn memory() -> (u64, u64) {
    let text = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kb| kb * 1024)
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Serves `GET /metrics` on `listener` until the task is dropped.
pub async fn serve(listener: tokio::net::TcpListener, metrics: std::sync::Arc<Metrics>) {
    loop {
        let Ok((mut sock, _)) = listener.accept().await else { continue };
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 1024];
            let n = match tokio::time::timeout(std::time::Duration::from_secs(5), sock.read(&mut buf)).await {
                Ok(Ok(n)) => n,
                _ => return,
            };
            let req = String::from_utf8_lossy(&buf[..n]);
            let (status, body) = if req.starts_with("GET /metrics") {
                ("200 OK", metrics.render())
            } else {
                ("404 Not Found", "not found\n".to_owned())
            };
            let resp = format!(
                "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = sock.write_all(resp.as_bytes()).await;
        });
    }
}

/// Binds the metrics listener.
pub async fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await
}
