//! The aggregator's Prometheus metrics (prometheus-client), served at `GET /metrics` on the
//! configured (loopback) address by `fedfleet-http`.
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `fedfleet_aggregator_rounds_total` | counter | `event` = opened, closed, failed, published, tensor_folded |
//! | `fedfleet_aggregator_updates_accepted_total` | counter | |
//! | `fedfleet_aggregator_device_connections_total` | counter | device QUIC connections authenticated (a device connects when it has work: with sampled rounds, about the devices each round selects) |
//! | `fedfleet_aggregator_updates_rejected_total` | counter | `reason` (every `RejectReason`) |
//! | `fedfleet_aggregator_secagg_refused_total` | counter | `reason`: secure-aggregation messages the protocol refused (`bad_signature`, `wrong_session`, `inconsistent_shares`, `malformed_share`, …) |
//! | `fedfleet_aggregator_update_bytes_total` | counter | payload bytes of accepted updates |
//! | `fedfleet_aggregator_fold_bytes_total` | counter | f32 bytes folded |
//! | `fedfleet_aggregator_fold_seconds_total` | counter | time in folds (throughput = bytes / seconds) |
//! | `fedfleet_aggregator_ingest_seconds_total` | counter | `step` = authenticate, admit, receive, queue, signature, decode, store_payload, fold, record, sync: wall time of each ingest stage, summed over updates (÷ `updates_accepted_total`: where an update's milliseconds go) |
//! | `fedfleet_aggregator_round_polls_total` | counter | devices' (and relays') requests for the current round announcement (a device polls every `poll_interval_ms`, 10 s by default) |
//! | `fedfleet_aggregator_base_models_served_total` | counter | round base models sent to devices and relays (agents fetch them from the registry first: these are the ones it could not serve) |
//! | `fedfleet_aggregator_commit_flushes_total` | counter | group commits of accepted updates (÷ into `updates_accepted_total`: updates made durable per flush) |
//! | `fedfleet_aggregator_update_staleness` | histogram | versions between an accepted update's base model and the model it was folded into (0 in rounds; asynchronous campaigns: how far behind devices train) |
//! | `fedfleet_aggregator_open_round` | gauge | id of the open round (0 = none) |
//! | `fedfleet_aggregator_round_accepted` | gauge | updates accepted in the open round (0 between campaigns) |
//! | `fedfleet_aggregator_arrivals_per_second` | gauge | the arrival rate the last round's start window asked for (`[admission] arrivals_per_second` at most; lowered after an overloaded round) |
//! | `fedfleet_aggregator_global_version` | gauge | the last published global model's version |
//! | `fedfleet_aggregator_global_metric` | gauge | `metric` (`accuracy`, `loss`, `rmse`, ...): the last published model's server-side evaluation (the campaign's learning curve over time) |
//! | `fedfleet_aggregator_resident_memory_bytes` | gauge | VmRSS |
//! | `fedfleet_aggregator_peak_resident_memory_bytes` | gauge | VmHWM |
//! | `fedfleet_aggregator_mqtt_connected` | gauge | 1 while the MQTT control client is connected |
//! | `fedfleet_aggregator_mqtt_requests_total` | counter | `reason`: devices' requests over MQTT (secure-aggregation stages), `answered` or the refusal's reason |
//! | `fedfleet_aggregator_mqtt_rejected_total` | counter | `reason`: MQTT messages refused by the control client (signature, topic/device, assembly) and MQTT uploads refused by ingest (these also count in `updates_rejected_total`) |
//! | `fedfleet_aggregator_devices_online` | gauge | devices with a verified status within `presence_ttl_secs` |
//! | `fedfleet_aggregator_devices_known` | gauge | devices ever heard from over MQTT |
//! | `fedfleet_aggregator_device_last_seen_seconds` | gauge | `device`: Unix time of its last verified status |
//! | `fedfleet_aggregator_broker_refused_total` | counter | `reason` = oversized, acl, client_id, malformed, overloaded (past `[mqtt] max_connections`): MQTT connections the embedded broker closed |
//! | `fedfleet_aggregator_certificate_expiry_seconds` | gauge | seconds until the aggregator's own certificate expires (negative once expired) |
//! | `fedfleet_aggregator_compute_adapter` | gauge (1) | `kind`, `name`, `backend`, `driver`, `device_type`: the tensor path's device (absent with the exact fold) |

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use fedfleet_control::{BrokerMetrics, Presence};
use fedfleet_http::prometheus_client::metrics::counter::Counter;
use fedfleet_http::prometheus_client::metrics::family::Family;
use fedfleet_http::prometheus_client::metrics::gauge::Gauge;
use fedfleet_http::prometheus_client::metrics::histogram::Histogram;
use fedfleet_http::prometheus_client::registry::Registry;
use fedfleet_protocol::{DeviceId, DeviceStatus, RejectReason};

pub use fedfleet_http::process_memory as memory;

/// The stages of ingesting one update, timed in `ingest_seconds_total{step}`: identity,
/// enrolment and revocation; resend lookup, round checks and admission; the payload streamed in
/// and digested (waits on the network); the wait in the fold thread's queue (behind the earlier
/// uploads of its group too); the update's share of its batch's ed25519 check (none for an MQTT
/// upload its control client verified); decode and checks; the payload written and fsynced; the
/// exact fold and the receipt signature; the accepted record written; the group commit the
/// receipt waits for.
pub const INGEST_STEPS: [&str; 10] =
    ["authenticate", "admit", "receive", "queue", "signature", "decode", "store_payload", "fold", "record", "sync"];

/// Upper bounds of the `update_staleness` buckets, in versions.
const STALENESS_BUCKETS: [f64; 9] = [0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0];

/// Round events counted in `rounds_total`.
pub const ROUND_EVENTS: [&str; 5] = ["opened", "closed", "failed", "published", "tensor_folded"];

use fedfleet_http::labels::{Device as DeviceLabel, Event as EventLabel, Metric as MetricLabel, Reason as ReasonLabel, Step as StepLabel};

type FloatGauge = Gauge<f64, AtomicU64>;

/// The aggregator's metrics; handles are cheap clones of what the registry encodes.
#[derive(Debug)]
pub struct Metrics {
    pub accepted: Counter,
    pub device_connections: Counter,
    pub update_bytes: Counter,
    pub fold_bytes: Counter,
    pub update_staleness: Histogram,
    pub commit_flushes: Counter,
    pub round_polls: Counter,
    pub base_models_served: Counter,
    fold_seconds: Counter<f64, AtomicU64>,
    ingest_seconds: Family<StepLabel, Counter<f64, AtomicU64>>,
    pub open_round: Gauge,
    pub global_version: Gauge,
    global_metric: Family<MetricLabel, Gauge<f64, AtomicU64>>,
    pub round_accepted: Gauge,
    pub arrivals_per_second: Gauge,
    rejected: Family<ReasonLabel, Counter>,
    secagg_refused: Family<ReasonLabel, Counter>,
    rounds: Family<EventLabel, Counter>,
    pub mqtt_connected: Gauge,
    mqtt_rejected: Family<ReasonLabel, Counter>,
    mqtt_requests: Family<ReasonLabel, Counter>,
    devices_online: Gauge,
    devices_known: Gauge,
    last_seen: Family<DeviceLabel, FloatGauge>,
    resident: Gauge,
    peak_resident: Gauge,
    compute_adapter: Family<Vec<(String, String)>, Gauge>,
    /// Seconds until the aggregator's own certificate expires.
    pub certificate_expiry_seconds: Gauge,
    presence: Mutex<Presence>,
    pub presence_ttl_ms: AtomicU64,
    /// The embedded MQTT broker's refusals (`broker_refused_total{reason}`), handed to it.
    pub broker: BrokerMetrics,
    /// Presence is judged at scrape time by the service's clock.
    clock: fedfleet_protocol::SharedClock,
    registry: Registry,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new(fedfleet_protocol::SystemClock::shared())
    }
}

impl Metrics {
    pub fn new(clock: fedfleet_protocol::SharedClock) -> Self {
        let mut registry = Registry::with_prefix("fedfleet_aggregator");
        let m = Metrics {
            accepted: Counter::default(),
            device_connections: Counter::default(),
            update_bytes: Counter::default(),
            fold_bytes: Counter::default(),
            update_staleness: Histogram::new(STALENESS_BUCKETS),
            commit_flushes: Counter::default(),
            round_polls: Counter::default(),
            base_models_served: Counter::default(),
            fold_seconds: Counter::default(),
            ingest_seconds: Family::default(),
            open_round: Gauge::default(),
            global_version: Gauge::default(),
            global_metric: Family::default(),
            round_accepted: Gauge::default(),
            arrivals_per_second: Gauge::default(),
            rejected: Family::default(),
            secagg_refused: Family::default(),
            rounds: Family::default(),
            mqtt_connected: Gauge::default(),
            mqtt_rejected: Family::default(),
            mqtt_requests: Family::default(),
            devices_online: Gauge::default(),
            devices_known: Gauge::default(),
            last_seen: Family::default(),
            resident: Gauge::default(),
            peak_resident: Gauge::default(),
            compute_adapter: Family::default(),
            certificate_expiry_seconds: Gauge::default(),
            presence: Mutex::new(Presence::default()),
            presence_ttl_ms: AtomicU64::new(0),
            broker: BrokerMetrics::default(),
            clock,
            registry: Registry::default(),
        };
        // Every label value is present from the start (a scrape sees zeros, not gaps).
        for ev in ROUND_EVENTS {
            let _ = m.rounds.get_or_create(&EventLabel { event: ev.into() });
        }
        for step in INGEST_STEPS {
            let _ = m.ingest_seconds.get_or_create(&StepLabel { step: step.into() });
        }
        for r in RejectReason::ALL {
            let _ = m.rejected.get_or_create(&ReasonLabel { reason: r.as_str().into() });
            let _ = m.mqtt_rejected.get_or_create(&ReasonLabel { reason: r.as_str().into() });
        }
        registry.register("rounds", "Round events", m.rounds.clone());
        registry.register(
            "certificate_expiry_seconds",
            "Seconds until this service's own certificate expires",
            m.certificate_expiry_seconds.clone(),
        );
        registry.register("updates_accepted", "Updates accepted", m.accepted.clone());
        registry.register("device_connections", "Device QUIC connections authenticated", m.device_connections.clone());
        registry.register("updates_rejected", "Updates and requests refused, by reason", m.rejected.clone());
        registry.register("secagg_refused", "Secure-aggregation messages refused by the protocol, by its reason", m.secagg_refused.clone());
        registry.register("update_bytes", "Payload bytes of accepted updates", m.update_bytes.clone());
        registry.register("fold_bytes", "f32 bytes folded into partial sums", m.fold_bytes.clone());
        registry.register(
            "update_staleness",
            "Versions between an accepted update's base model and the model it was folded into",
            m.update_staleness.clone(),
        );
        registry.register("round_polls", "Requests for the current round announcement", m.round_polls.clone());
        registry.register(
            "base_models_served",
            "Round base models sent (agents fetch them from the registry first)",
            m.base_models_served.clone(),
        );
        registry.register("commit_flushes", "Group commits of accepted updates (one flush each)", m.commit_flushes.clone());
        registry.register("fold_seconds", "Seconds spent folding", m.fold_seconds.clone());
        registry.register("ingest_seconds", "Seconds spent in each stage of ingesting updates", m.ingest_seconds.clone());
        registry.register("open_round", "Open round id, 0 if none", m.open_round.clone());
        registry.register("global_version", "The last published global model's version", m.global_version.clone());
        registry.register("global_metric", "The last published global model's server-side evaluation, by metric", m.global_metric.clone());
        registry.register("round_accepted", "Updates accepted in the open round", m.round_accepted.clone());
        registry.register("arrivals_per_second", "The arrival rate the last round's start window asked for", m.arrivals_per_second.clone());
        registry.register("mqtt_connected", "1 while the MQTT control client is connected", m.mqtt_connected.clone());
        registry.register("mqtt_rejected", "MQTT messages and uploads refused, by reason", m.mqtt_rejected.clone());
        registry.register("mqtt_requests", "Devices' requests over MQTT: answered, or the refusal's reason", m.mqtt_requests.clone());
        registry.register("devices_online", "Devices with a recent verified status", m.devices_online.clone());
        registry.register("devices_known", "Devices ever heard from over MQTT", m.devices_known.clone());
        registry.register("device_last_seen_seconds", "Unix time of the device's last verified status", m.last_seen.clone());
        registry.register("resident_memory_bytes", "Resident set size", m.resident.clone());
        registry.register("peak_resident_memory_bytes", "Peak resident set size", m.peak_resident.clone());
        m.broker.register(&mut registry);
        registry.register("compute_adapter", "The device the tensor fold runs on (value 1)", m.compute_adapter.clone());
        Metrics { registry, ..m }
    }

    pub fn rejected(&self, reason: RejectReason) {
        self.rejected.get_or_create(&ReasonLabel { reason: reason.as_str().into() }).inc();
    }
    pub fn rejected_count(&self, reason: RejectReason) -> u64 {
        self.rejected.get_or_create(&ReasonLabel { reason: reason.as_str().into() }).get()
    }
    /// A secure-aggregation message refused, by the protocol's reason (`fedfleet_secagg::Refusal::name`).
    /// A global model was published: its version and server-side metrics.
    pub fn published(&self, version: u64, metrics: &std::collections::BTreeMap<String, f64>) {
        self.global_version.set(version as i64);
        for (name, value) in metrics.iter().filter(|(n, _)| !n.starts_with("gate_")) {
            self.global_metric.get_or_create(&MetricLabel { metric: name.clone() }).set(*value);
        }
    }

    /// Every refusal count by reason (the console's rejection table).
    pub fn rejections(&self) -> std::collections::BTreeMap<String, u64> {
        RejectReason::ALL.iter().map(|r| (r.as_str().to_owned(), self.rejected_count(*r))).collect()
    }

    pub fn secagg_refused(&self, reason: &'static str) {
        self.secagg_refused.get_or_create(&ReasonLabel { reason: reason.into() }).inc();
    }
    pub fn mqtt_rejected(&self, reason: RejectReason) {
        self.mqtt_rejected.get_or_create(&ReasonLabel { reason: reason.as_str().into() }).inc();
    }
    /// A device's request over MQTT answered (`answered`) or refused (the reason's name).
    pub fn mqtt_request(&self, outcome: &str) {
        self.mqtt_requests.get_or_create(&ReasonLabel { reason: outcome.into() }).inc();
    }
    pub fn mqtt_requests_count(&self, outcome: &str) -> u64 {
        self.mqtt_requests.get_or_create(&ReasonLabel { reason: outcome.into() }).get()
    }
    pub fn mqtt_rejected_count(&self, reason: RejectReason) -> u64 {
        self.mqtt_rejected.get_or_create(&ReasonLabel { reason: reason.as_str().into() }).get()
    }
    /// Records a verified device status received at `now_ms`.
    pub fn status(&self, status: &DeviceStatus, now_ms: u64) {
        let mut p = self.presence.lock().unwrap_or_else(|p| p.into_inner());
        p.record(status, now_ms);
        self.last_seen.get_or_create(&DeviceLabel { device: status.device.to_string() }).set(now_ms as f64 / 1e3);
    }
    /// (devices online at `now_ms`, devices known).
    pub fn devices(&self, now_ms: u64) -> (usize, usize) {
        let p = self.presence.lock().unwrap_or_else(|p| p.into_inner());
        (p.online(now_ms, self.presence_ttl_ms.load(Relaxed)), p.known())
    }
    pub fn last_seen(&self, device: &DeviceId) -> Option<u64> {
        self.presence.lock().unwrap_or_else(|p| p.into_inner()).last_seen(device)
    }
    /// Names the tensor path's device in `compute_adapter`.
    pub fn compute_adapter(&self, adapter: &crate::accel::AdapterInfo) {
        let labels = [
            ("kind", adapter.kind.to_string()),
            ("name", adapter.name.clone()),
            ("backend", adapter.backend.clone()),
            ("driver", adapter.driver.clone()),
            ("device_type", adapter.device_type.clone()),
        ];
        let labels = labels.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        self.compute_adapter.get_or_create(&labels).set(1);
    }
    pub fn round_count(&self, event: &str) -> u64 {
        self.rounds.get_or_create(&EventLabel { event: event.into() }).get()
    }
    pub fn round(&self, event: &'static str) {
        self.rounds.get_or_create(&EventLabel { event: event.into() }).inc();
    }
    /// Adds the time since `*since` to ingest stage `step` (one of [`INGEST_STEPS`]) and moves
    /// `*since` to now: consecutive calls time consecutive stages.
    pub fn ingest_step(&self, step: &'static str, since: &mut std::time::Instant) {
        debug_assert!(INGEST_STEPS.contains(&step), "{step}");
        let now = std::time::Instant::now();
        self.ingest_seconds.get_or_create(&StepLabel { step: step.into() }).inc_by((now - *since).as_secs_f64());
        *since = now;
    }

    /// Adds `elapsed` to ingest stage `step` (a stage timed for a batch, shared out).
    pub fn ingest_add(&self, step: &'static str, elapsed: std::time::Duration) {
        debug_assert!(INGEST_STEPS.contains(&step), "{step}");
        self.ingest_seconds.get_or_create(&StepLabel { step: step.into() }).inc_by(elapsed.as_secs_f64());
    }

    pub fn folded(&self, bytes: u64, elapsed: std::time::Duration) {
        self.fold_bytes.inc_by(bytes);
        self.fold_seconds.inc_by(elapsed.as_secs_f64());
    }

    /// The exposition text (gauges read at scrape time are refreshed first).
    pub fn render(&self) -> String {
        let (online, known) = self.devices(self.clock.now_ms());
        self.devices_online.set(online as i64);
        self.devices_known.set(known as i64);
        let (rss, hwm) = memory();
        self.resident.set(rss as i64);
        self.peak_resident.set(hwm as i64);
        fedfleet_http::encode(&self.registry)
    }
}

impl fedfleet_http::MetricsSource for Metrics {
    fn render(&self) -> String {
        Metrics::render(self)
    }
}
