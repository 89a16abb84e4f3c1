//! The registry's Prometheus metrics (prometheus-client), served on a loopback address by
//! `fedfleet-http`.
//!
//! | metric | labels |
//! |---|---|
//! | `fedfleet_registry_requests_total` | `kind` |
//! | `fedfleet_registry_rejections_total` | `reason` (a `RejectReason` name, or `not_found`, `denied`, `invalid_command`, `handshake`) |
//! | `fedfleet_registry_bytes_served_total` | |
//! | `fedfleet_registry_chunks_served_total` | |
//! | `fedfleet_registry_connections_total` | |
//! | `fedfleet_registry_rollout_events_total` | `event` |
//! | `fedfleet_registry_device_reports_total` | `state` |
//! | `fedfleet_registry_certificates_renewed_total` | |
//! | `fedfleet_registry_certificate_expiry_seconds` | | (the registry's own certificate; negative once expired)
//! | `fedfleet_registry_object_store_uploads_total` | | artifacts written to the object store
//! | `fedfleet_registry_object_store_failures_total` | | uploads that failed (retried)
//! | `fedfleet_registry_object_store_pending` | | artifacts the object store still lacks
//! | `fedfleet_registry_rollout_phase` | `rollout` | its current phase, 0 the first
//! | `fedfleet_registry_rollout_phases` | `rollout` | how many phases it has
//! | `fedfleet_registry_rollout_devices` | `rollout`, `outcome` | its audience so far: `healthy`, `failed`, `in_progress`
//! | `fedfleet_registry_rollout_failure_rate` | `rollout` | failed / reporting (absent before a report)
//! | `fedfleet_registry_rollout_status` | `rollout`, `status` | 1 for its status, 0 for the others
//!
//! The rollout gauges are set whenever a rollout's state changes, and for every stored rollout
//! at start.
//!
//! Gauges set by the MQTT side ([`crate::mqtt`]): `fedfleet_registry_mqtt_connected`,
//! `fedfleet_registry_devices_online`, `fedfleet_registry_devices_known`,
//! `fedfleet_registry_device_last_seen_seconds{device}`.

use fedfleet_http::labels::{Device, Event, Reason};
use fedfleet_http::prometheus_client::encoding::EncodeLabelSet;
use fedfleet_http::prometheus_client::metrics::counter::Counter;
use fedfleet_http::prometheus_client::metrics::family::Family;
use fedfleet_http::prometheus_client::metrics::gauge::Gauge;
use fedfleet_http::prometheus_client::registry::Registry;

/// One label, named after what it carries.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Kind {
    kind: String,
}
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct State {
    state: String,
}
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RolloutLabel {
    rollout: String,
}
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RolloutOutcome {
    rollout: String,
    outcome: &'static str,
}
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RolloutStatus {
    rollout: String,
    status: &'static str,
}

/// The registry's metrics; handles are cheap clones of what the registry encodes.
#[derive(Debug)]
pub struct Metrics {
    pub bytes_served: Counter,
    pub chunks_served: Counter,
    pub connections: Counter,
    pub certificates_renewed: Counter,
    /// Seconds until the registry's own certificate expires.
    pub certificate_expiry_seconds: Gauge,
    pub object_store_uploads: Counter,
    pub object_store_failures: Counter,
    pub object_store_pending: Gauge,
    requests: Family<Kind, Counter>,
    rejections: Family<Reason, Counter>,
    rollout_events: Family<Event, Counter>,
    device_reports: Family<State, Counter>,
    rollout_phase: Family<RolloutLabel, Gauge>,
    rollout_phases: Family<RolloutLabel, Gauge>,
    rollout_devices: Family<RolloutOutcome, Gauge>,
    rollout_failure_rate: Family<RolloutLabel, Gauge<f64, std::sync::atomic::AtomicU64>>,
    rollout_status: Family<RolloutStatus, Gauge>,
    pub mqtt_connected: Gauge,
    devices_online: Gauge,
    devices_known: Gauge,
    last_seen: Family<Device, Gauge>,
    registry: Registry,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("fedfleet_registry");
        let m = Metrics {
            bytes_served: Counter::default(),
            chunks_served: Counter::default(),
            connections: Counter::default(),
            certificates_renewed: Counter::default(),
            certificate_expiry_seconds: Gauge::default(),
            object_store_uploads: Counter::default(),
            object_store_failures: Counter::default(),
            object_store_pending: Gauge::default(),
            requests: Family::default(),
            rejections: Family::default(),
            rollout_events: Family::default(),
            device_reports: Family::default(),
            rollout_phase: Family::default(),
            rollout_phases: Family::default(),
            rollout_devices: Family::default(),
            rollout_failure_rate: Family::default(),
            rollout_status: Family::default(),
            mqtt_connected: Gauge::default(),
            devices_online: Gauge::default(),
            devices_known: Gauge::default(),
            last_seen: Family::default(),
            registry: Registry::default(),
        };
        registry.register("requests", "Requests served, by kind", m.requests.clone());
        registry.register("rejections", "Requests and connections refused, by reason", m.rejections.clone());
        registry.register("bytes_served", "Artifact bytes sent to clients", m.bytes_served.clone());
        registry.register("chunks_served", "Chunks sent to clients", m.chunks_served.clone());
        registry.register("connections", "QUIC connections accepted", m.connections.clone());
        registry.register("certificates_renewed", "Device certificates renewed", m.certificates_renewed.clone());
        registry.register(
            "certificate_expiry_seconds",
            "Seconds until this service's own certificate expires",
            m.certificate_expiry_seconds.clone(),
        );
        registry.register("object_store_uploads", "Artifacts written to the object store", m.object_store_uploads.clone());
        registry.register("object_store_failures", "Object store uploads that failed (retried)", m.object_store_failures.clone());
        registry.register("object_store_pending", "Artifacts the object store still lacks", m.object_store_pending.clone());
        registry.register("rollout_events", "Rollout engine events", m.rollout_events.clone());
        registry.register("device_reports", "Device reports, by state", m.device_reports.clone());
        registry.register("rollout_phase", "A rollout's current phase (0 the first)", m.rollout_phase.clone());
        registry.register("rollout_phases", "A rollout's phases", m.rollout_phases.clone());
        registry.register("rollout_devices", "A rollout's audience so far, by outcome", m.rollout_devices.clone());
        registry.register("rollout_failure_rate", "A rollout's failed / reporting devices", m.rollout_failure_rate.clone());
        registry.register("rollout_status", "1 for a rollout's status, 0 for the others", m.rollout_status.clone());
        registry.register("mqtt_connected", "1 while the MQTT control client is connected", m.mqtt_connected.clone());
        registry.register("devices_online", "Devices with a recent verified status", m.devices_online.clone());
        registry.register("devices_known", "Devices ever heard from over MQTT", m.devices_known.clone());
        registry.register("device_last_seen_seconds", "Unix time of the device's last verified status", m.last_seen.clone());
        Metrics { registry, ..m }
    }

    pub fn request(&self, kind: &str) {
        self.requests.get_or_create(&Kind { kind: kind.into() }).inc();
    }

    pub fn rejection(&self, reason: fedfleet_protocol::RejectReason) {
        self.rejection_named(reason.as_str());
    }

    /// A refusal that is not a protocol `RejectReason`: `not_found`, `denied`, `invalid_command`.
    pub fn rejection_named(&self, reason: &str) {
        self.rejections.get_or_create(&Reason { reason: reason.into() }).inc();
    }

    pub fn rollout_event(&self, event: &str) {
        self.rollout_events.get_or_create(&Event { event: event.into() }).inc();
    }

    pub fn device_report(&self, state: &str) {
        self.device_reports.get_or_create(&State { state: state.into() }).inc();
    }

    /// Sets rollout `id`'s gauges from its summary.
    pub fn rollout_summary(&self, id: &str, s: &fedfleet_rollout::Summary) {
        let rollout = || RolloutLabel { rollout: id.to_owned() };
        self.rollout_phase.get_or_create(&rollout()).set(s.phase as i64);
        self.rollout_phases.get_or_create(&rollout()).set(s.phases as i64);
        for (outcome, n) in [("healthy", s.healthy), ("failed", s.failed), ("in_progress", s.in_progress)] {
            self.rollout_devices.get_or_create(&RolloutOutcome { rollout: id.to_owned(), outcome }).set(i64::from(n));
        }
        if let Some(rate) = s.failure_rate {
            self.rollout_failure_rate.get_or_create(&rollout()).set(rate);
        }
        use fedfleet_rollout::Status;
        for status in [Status::Running, Status::Paused, Status::Completed, Status::Aborted, Status::RolledBack] {
            let is = i64::from(status == s.status);
            self.rollout_status.get_or_create(&RolloutStatus { rollout: id.to_owned(), status: status.name() }).set(is);
        }
    }

    /// Devices online and known, from the MQTT presence view.
    pub fn set_presence(&self, online: usize, known: usize) {
        self.devices_online.set(online as i64);
        self.devices_known.set(known as i64);
    }

    /// (devices online, devices known) as last set.
    pub fn presence(&self) -> (u64, u64) {
        (self.devices_online.get() as u64, self.devices_known.get() as u64)
    }

    pub fn set_last_seen(&self, device: &str, unix_secs: u64) {
        self.last_seen.get_or_create(&Device { device: device.into() }).set(unix_secs as i64);
    }

    /// A device's last-seen gauge, if set.
    pub fn last_seen(&self, device: &str) -> Option<u64> {
        self.last_seen.get(&Device { device: device.into() }).map(|g| g.get() as u64)
    }

    /// A labelled counter's value by its exposition name and label value (tests).
    pub fn get(&self, metric: &str, value: &str) -> u64 {
        let v = value.to_owned();
        match metric {
            "fedfleet_registry_requests_total" => self.requests.get(&Kind { kind: v }).map(|c| c.get()),
            "fedfleet_registry_rejections_total" => self.rejections.get(&Reason { reason: v }).map(|c| c.get()),
            "fedfleet_registry_rollout_events_total" => self.rollout_events.get(&Event { event: v }).map(|c| c.get()),
            "fedfleet_registry_device_reports_total" => self.device_reports.get(&State { state: v }).map(|c| c.get()),
            _ => None,
        }
        .unwrap_or(0)
    }

    /// The exposition text.
    pub fn render(&self) -> String {
        fedfleet_http::encode(&self.registry)
    }
}

impl fedfleet_http::MetricsSource for Metrics {
    fn render(&self) -> String {
        Metrics::render(self)
    }
}
