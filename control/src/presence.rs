//! Devices online and last seen, from verified [`DeviceStatus`] reports (heartbeats).

use std::collections::HashMap;

use fedfleet_protocol::{DeviceId, DeviceStatus};

/// How long a device counts as online after its last verified status unless a service's
/// `[mqtt] presence_ttl_secs` says otherwise (1.5 of the agent's default 60 s heartbeat).
pub const DEFAULT_TTL_SECS: u64 = 90;

/// `serde` default of `presence_ttl_secs`.
pub fn default_ttl_secs() -> u64 {
    DEFAULT_TTL_SECS
}

/// Last verified status per device, and when it was last seen: the signed `reported_at`, clamped
/// to the local time it arrived (so a retained report from long ago does not count as online, and
/// a device clock running ahead cannot keep a device online).
#[derive(Debug, Default, Clone)]
pub struct Presence {
    seen: HashMap<DeviceId, (u64, DeviceStatus)>,
}

impl Presence {
    pub fn new() -> Self {
        Self::default()
    }

    /// Records a verified status received at `now_ms` (local clock, Unix ms). A report older
    /// (by its signed `reported_at`) than the one held is ignored.
    pub fn record(&mut self, status: &DeviceStatus, now_ms: u64) {
        let newer = self.seen.get(&status.device).is_none_or(|(_, s)| s.reported_at_unix_ms <= status.reported_at_unix_ms);
        if newer {
            self.seen.insert(status.device.clone(), (status.reported_at_unix_ms.min(now_ms), status.clone()));
        }
    }

    /// When the device was last seen (Unix ms).
    pub fn last_seen(&self, device: &DeviceId) -> Option<u64> {
        self.seen.get(device).map(|(t, _)| *t)
    }

    pub fn status(&self, device: &DeviceId) -> Option<&DeviceStatus> {
        self.seen.get(device).map(|(_, s)| s)
    }

    /// Devices whose last report arrived within `ttl_ms` of `now_ms` (e.g. 3 heartbeat periods).
    pub fn online(&self, now_ms: u64, ttl_ms: u64) -> usize {
        self.seen.values().filter(|(t, _)| now_ms.saturating_sub(*t) <= ttl_ms).count()
    }

    /// Every device ever heard from.
    pub fn known(&self) -> usize {
        self.seen.len()
    }
}
