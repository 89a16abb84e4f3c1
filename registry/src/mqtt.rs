//! The registry on the MQTT control plane (`fedfleet-control`), next to its QUIC service.
//!
//! The registry connects as a client ([`Role::Service`], device status only) to the fleet's
//! broker: the aggregator's embedded one or any external broker (`[mqtt]` in `registry.toml`).
//!
//! * **Rollout notices.** Whenever a rollout starts, advances a phase,
//!   pauses, resumes, completes, aborts or rolls back, the registry publishes a
//!   `Signed<RolloutNotice>` (QoS 1, retained) on `fedfleet/v1/<fleet>/rollouts`, signed with its
//!   online timestamp key: the key of the TUF root's timestamp role, which also signs every
//!   device's assignment, so devices already pin it through their root. A notice is a wake-up,
//!   not an order: the registry's engine decides per device (its own buckets and cohorts), so a
//!   device that hears one asks for its signed assignment at once instead of at its next poll.
//!   The rollout state is read from the store, where the engine persists every change, every
//!   [`NOTICE_POLL`].
//! * **Device status.** Every status verified by the control client (signed by the allow-list
//!   key of the device the topic names) feeds [`Registry::report`], exactly like a QUIC
//!   `Report`: install outcomes drive the rollout engine. Heartbeats (the same status, re-signed
//!   with a fresh time) only refresh presence; a status older than the one the store holds for
//!   the device (a retained message after a restart, the same report already taken over QUIC)
//!   is not fed again.
//! * **Metrics.** `fedfleet_registry_mqtt_connected`, `fedfleet_registry_devices_online` (a
//!   status within `presence_ttl_secs`), `fedfleet_registry_devices_known`,
//!   `fedfleet_registry_device_last_seen_seconds{device}`; refused MQTT messages count in
//!   `fedfleet_registry_rejections_total` by reason.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ed25519_dalek::SigningKey;
use fedfleet_certs::{AllowList, CaCert, ServerIdentity};
use fedfleet_control::{
    AssemblerLimits, ClientKind, ControlClient, ControlEvent, MqttClientConfig, Presence, Role, UnknownKeys, service_tls,
};
use fedfleet_protocol::{DeviceId, DeviceStatus, FleetId, ModelRef, RolloutAction, RolloutNotice, Signed};
use serde::Deserialize;
use tokio::task::JoinHandle;

use crate::RegistryError;
use crate::config::Config;
use crate::ops::Registry;
use crate::rollout::{Audience, Rollout, Status};

/// How often the rollout state is checked for a change to announce.
pub const NOTICE_POLL: Duration = Duration::from_millis(200);

/// `[mqtt]` in `registry.toml`: the broker to connect to (absent: no MQTT).
///
/// ```toml
/// [mqtt]
/// host = "127.0.0.1"          # the aggregator's embedded broker, or an external one
/// port = 8883                 # (its certificate must name `host`)
/// # fleet = "acme"            # must equal the PKI's fleet (default: the PKI's)
/// client_id = "registry"      # MQTT client id of this service (default: "registry")
/// presence_ttl_secs = 90      # a device counts as online this long after its last status
/// reconnect_max_secs = 5      # ceiling of the reconnect backoff after the broker is lost
/// ```
///
/// `host` … `reconnect_max_secs` are the keys every program's `[mqtt]` shares
/// ([`MqttClientConfig`]).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct MqttConfig {
    #[serde(flatten)]
    pub client: MqttClientConfig,
    #[serde(default = "fedfleet_control::presence::default_ttl_secs")]
    pub presence_ttl_secs: u64,
    #[serde(flatten)]
    unknown: UnknownKeys,
}

/// The client id the registry connects under unless `[mqtt] client_id` says otherwise.
pub const CLIENT_ID: &str = "registry";

impl MqttConfig {
    /// A broker at `host:port`, everything else default.
    pub fn new(host: impl Into<String>, port: u16) -> Self {
        MqttConfig {
            client: MqttClientConfig::broker(host, port),
            presence_ttl_secs: fedfleet_control::presence::DEFAULT_TTL_SECS,
            unknown: UnknownKeys::default(),
        }
    }

    /// Refuses unknown keys and a section without `host`.
    pub fn validate(&self) -> Result<(), String> {
        self.unknown.check("mqtt")?;
        self.client.address().map(drop)
    }
}

/// The running MQTT side of the registry; [`RegistryMqtt::shutdown`] stops it.
pub struct RegistryMqtt {
    client: ControlClient,
    presence: Arc<Mutex<Presence>>,
    ttl_ms: u64,
    task: JoinHandle<()>,
}

impl RegistryMqtt {
    pub fn client(&self) -> &ControlClient {
        &self.client
    }

    /// (devices online at `now_ms`, devices heard from).
    pub fn devices(&self, now_ms: u64) -> (usize, usize) {
        let p = self.presence.lock().unwrap_or_else(|p| p.into_inner());
        (p.online(now_ms, self.ttl_ms), p.known())
    }

    /// When `device`'s last verified status arrived (unix ms).
    pub fn last_seen(&self, device: &DeviceId) -> Option<u64> {
        self.presence.lock().unwrap_or_else(|p| p.into_inner()).last_seen(device)
    }

    pub async fn shutdown(self) {
        self.client.shutdown().await;
        self.task.abort();
        let _ = self.task.await;
    }
}

fn config_err(e: impl std::fmt::Display) -> RegistryError {
    RegistryError::Config(format!("[mqtt]: {e}"))
}

/// Connects the registry to the broker of `cfg.mqtt` (in the background; it reconnects by
/// itself) and starts publishing notices and consuming status. `Ok(None)` without `[mqtt]`.
pub async fn start(reg: Arc<Registry>, cfg: &Config) -> Result<Option<RegistryMqtt>, RegistryError> {
    let Some(m) = &cfg.mqtt else { return Ok(None) };
    let pki = &cfg.pki_dir;
    let allow = Arc::new(AllowList::load(fedfleet_certs::layout::allow_list(pki))?);
    let fleet: FleetId = allow.fleet();
    if &fleet != reg.fleet() {
        return Err(config_err(format!("the PKI's fleet {fleet} is not the registry's fleet {}", reg.fleet())));
    }
    let fleet = m.client.fleet(&fleet).map_err(RegistryError::Config)?;
    let (host, port) = m.client.address().map_err(RegistryError::Config)?;
    let notice_key = notice_key(&reg, cfg)?;
    let ca = CaCert::load(fedfleet_certs::layout::ca_cert(pki))?;
    let id = ServerIdentity::load(pki, &cfg.server_identity)?;
    let tls = service_tls(&ca, &id).map_err(config_err)?;
    let role = Role::Service { keys: allow, status: true, updates: false, limits: AssemblerLimits::default() };
    let options = m.client.options(ClientKind::Service(CLIENT_ID), host.clone(), port, fleet).map_err(RegistryError::Config)?;
    let (client, mut events) = ControlClient::start(options, tls, role);
    tracing::info!(%host, port, "registry MQTT control plane started");

    let presence = Arc::new(Mutex::new(Presence::new()));
    let ttl_ms = m.presence_ttl_secs.saturating_mul(1000);
    let task = {
        let client = client.clone();
        let presence = presence.clone();
        let mut state = Loop { reg, client, key: notice_key, presence, ttl_ms, announced: None, fed: HashMap::new() };
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(NOTICE_POLL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    ev = events.recv() => match ev {
                        None => break,
                        Some(ev) => state.on_event(ev),
                    },
                    _ = tick.tick() => {
                        state.announce().await;
                        state.export_presence();
                    }
                }
            }
        })
    };
    Ok(Some(RegistryMqtt { client, presence, ttl_ms, task }))
}

/// The online timestamp key, checked against the timestamp role of the registry's root.
fn notice_key(reg: &Registry, cfg: &Config) -> Result<SigningKey, RegistryError> {
    let signer = reg.signer().ok_or_else(|| config_err("rollout notices need the registry's signing keys"))?;
    let path = cfg.data_dir.join(crate::metadata::TIMESTAMP_KEY);
    let key = fedfleet_certs::load_signing_key(&path).map_err(|e| RegistryError::Key { path: path.clone(), detail: e.to_string() })?;
    let root = signer.root().body_unverified()?;
    let id = crate::tuf::KeyId::of(&key.verifying_key());
    if !root.timestamp.keyids.contains(&id) {
        return Err(config_err(format!("{} is not a timestamp key of the current root", path.display())));
    }
    Ok(key)
}

/// What a device's status says about installs; heartbeats repeat it with a fresh time.
type StatusContent = (fedfleet_protocol::DeviceState, Option<ModelRef>, Option<ModelRef>, Option<u64>);

fn content(s: &DeviceStatus) -> StatusContent {
    (s.state.clone(), s.active.clone(), s.staged.clone(), s.rollout_id)
}

/// Whether the stored record (as [`Registry::report`] writes it) is `s`.
fn same_report(stored: &serde_json::Value, s: &DeviceStatus) -> bool {
    let model = |m: &Option<ModelRef>| match m {
        Some(m) => {
            serde_json::json!({"name": m.name, "version": m.version.0, "digest": m.digest.to_hex()})
        }
        None => serde_json::Value::Null,
    };
    stored["state"] == s.state.as_str() && stored["active"] == model(&s.active) && stored["staged"] == model(&s.staged)
}

struct Loop {
    reg: Arc<Registry>,
    client: ControlClient,
    key: SigningKey,
    presence: Arc<Mutex<Presence>>,
    ttl_ms: u64,
    /// (status, phase) last announced per rollout id; `None` before the first look.
    announced: Option<HashMap<String, (Status, usize)>>,
    /// The last status content fed to the engine per device.
    fed: HashMap<DeviceId, StatusContent>,
}

impl Loop {
    fn on_event(&mut self, ev: ControlEvent) {
        let metrics = self.reg.metrics();
        match ev {
            ControlEvent::Connected { count } => {
                metrics.mqtt_connected.set(1);
                tracing::info!(count, "registry MQTT connected");
            }
            ControlEvent::Disconnected { error } => {
                metrics.mqtt_connected.set(0);
                tracing::warn!(%error, "registry MQTT disconnected; reconnecting");
            }
            ControlEvent::Status(s) => self.on_status(s.body()),
            ControlEvent::Rejected(r) => {
                metrics.rejection(r.reason);
                tracing::info!(topic = %r.topic, reason = %r.reason, detail = %r.detail, "MQTT message refused");
            }
            _ => {}
        }
    }

    fn on_status(&mut self, s: &DeviceStatus) {
        let now = self.reg.now_ms();
        self.presence.lock().unwrap_or_else(|p| p.into_inner()).record(s, now);
        let c = content(s);
        if self.fed.get(&s.device) == Some(&c) {
            return; // a heartbeat
        }
        // Not older than what the store holds (from QUIC, or from before a restart), and not
        // the very report the store already took over QUIC.
        let stored = self
            .reg
            .store()
            .device_status(s.device.as_str())
            .ok()
            .flatten()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok());
        if let Some(stored) = stored
            && let Some(at) = stored["reported_at"].as_u64()
            && (at > s.reported_at_unix_ms || (at == s.reported_at_unix_ms && same_report(&stored, s)))
        {
            self.fed.insert(s.device.clone(), c);
            return;
        }
        match self.reg.report(s, now) {
            Ok(()) => {
                tracing::debug!(device = %s.device, state = s.state.as_str(), "status over MQTT");
                self.fed.insert(s.device.clone(), c);
            }
            Err(e) => {
                tracing::error!(device = %s.device, error = %e, "recording an MQTT status failed")
            }
        }
    }

    fn export_presence(&self) {
        let now = self.reg.now_ms();
        let m = self.reg.metrics();
        let p = self.presence.lock().unwrap_or_else(|p| p.into_inner());
        m.set_presence(p.online(now, self.ttl_ms), p.known());
        for device in self.fed.keys() {
            if let Some(t) = p.last_seen(device) {
                m.set_last_seen(device.as_str(), t / 1000);
            }
        }
    }

    /// Publishes a notice for every rollout that started or changed state or phase since the
    /// last look, oldest start first (the retained notice is then the newest rollout's). On the
    /// first look only the most recently started rollout is announced: a device that connects
    /// learns the current one, and older ones have nothing new to say.
    async fn announce(&mut self) {
        let mut rollouts = match self.reg.store().rollouts() {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "reading rollouts for notices failed");
                return;
            }
        };
        rollouts.sort_by_key(|r| r.started_at());
        if self.announced.is_none() {
            let skip = rollouts.len().saturating_sub(1);
            self.announced = Some(rollouts[..skip].iter().map(|r| (r.id().to_owned(), (r.status(), r.phase()))).collect());
        }
        for r in &rollouts {
            let state = (r.status(), r.phase());
            let seen = self.announced.as_ref().and_then(|a| a.get(r.id()));
            if seen == Some(&state) {
                continue;
            }
            match notice(&self.reg, r, self.reg.now_ms()) {
                Ok(n) => {
                    let signed = Signed::sign(n, &self.key);
                    if let Err(e) = self.client.publish_rollout(&signed).await {
                        // Try again at the next look.
                        tracing::warn!(error = %e, "rollout notice not published");
                        return;
                    }
                    tracing::info!(rollout = r.id(), status = ?r.status(), phase = r.phase(), "rollout notice published");
                }
                Err(e) => {
                    tracing::warn!(rollout = r.id(), error = %e, "cannot describe the rollout in a notice")
                }
            }
            if let Some(a) = self.announced.as_mut() {
                a.insert(r.id().to_owned(), state);
            }
        }
    }
}

fn model_ref(reg: &Registry, model: &str, v: fedfleet_protocol::ModelVersion) -> Result<(ModelRef, u64), RegistryError> {
    let rec = reg.store().version(model, v)?;
    Ok((ModelRef { name: model.to_owned(), version: v, digest: rec.digest }, rec.length))
}

/// The notice describing `r` as it stands, issued at `now`.
pub fn notice(reg: &Registry, r: &Rollout, now: u64) -> Result<RolloutNotice, RegistryError> {
    let plan = r.plan();
    let (model, length) = model_ref(reg, &plan.model, plan.target)?;
    let phase = &plan.phases[r.phase().min(plan.phases.len() - 1)];
    let (percent_bp, cohort) = match &phase.audience {
        Audience::Percent(p) => ((p * 100.0).round().clamp(0.0, 10_000.0) as u32, None),
        Audience::Cohort { name, .. } => (10_000, Some(name.clone())),
    };
    let action = match r.status() {
        Status::Running | Status::Completed => RolloutAction::Install,
        Status::Paused => RolloutAction::Pause,
        Status::Aborted => RolloutAction::Abort,
        Status::RolledBack => match plan.previous {
            Some(v) => RolloutAction::RollBack { to: model_ref(reg, &plan.model, v)?.0 },
            None => RolloutAction::Abort,
        },
    };
    Ok(RolloutNotice {
        fleet: reg.fleet().clone(),
        // The same id an assignment from this rollout carries (`AssignmentBody::to_notice`).
        rollout_id: u64::from_be_bytes(blake3::hash(r.id().as_bytes()).as_bytes()[..8].try_into().expect("8 bytes")),
        alias: plan.alias.clone(),
        model,
        length,
        phase: r.phase() as u32,
        percent_bp: if r.status() == Status::Completed { 10_000 } else { percent_bp },
        cohort,
        action,
        issued_at_unix_ms: now,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mqtt_section_parses_with_defaults_and_refuses_unknown_keys() {
        let c: Config = toml::from_str("[mqtt]\nhost = \"broker.local\"\n").unwrap();
        let m = c.mqtt.unwrap();
        assert_eq!((m.client.address().unwrap(), m.presence_ttl_secs), (("broker.local".into(), 8883), 90));
        let c: Config = toml::from_str("").unwrap();
        assert_eq!(c.mqtt, None);
        let c: Config = toml::from_str("[mqtt]\nhost = \"h\"\nport = 1883\nclient_id = \"reg-2\"\n").unwrap();
        let m = c.mqtt.unwrap();
        assert_eq!((m.client.port, m.client.client_id.as_deref()), (Some(1883), Some("reg-2")));
        let parse = |t: &str| Config::parse(std::path::Path::new("registry.toml"), t).unwrap_err().to_string();
        assert!(parse("[mqtt]\nhost = \"h\"\nmode = \"embedded\"\n").contains("unknown key(s) mode"));
        assert!(parse("[mqtt]\nport = 1883\n").contains("host is missing"));
    }

    #[test]
    fn notices_describe_each_rollout_state() {
        use crate::metadata::{self, Lifetimes, MetadataSigner};
        use crate::rollout::Phase;
        use crate::store::{NewVersion, Store, StoreConfig};
        use crate::wire::{AdminRequest, RolloutCommand, RolloutStart};
        use fedfleet_protocol::ModelVersion;

        let dir = tempfile::tempdir().unwrap();
        metadata::init_keys(dir.path(), 30, false, 1_700_000_000_000).unwrap();
        let store = Store::open(dir.path().join("store"), StoreConfig::default()).unwrap();
        let signer = MetadataSigner::load(dir.path(), Lifetimes::default()).unwrap();
        let fleet = FleetId::new("demo").unwrap();
        let reg = Registry::new(store, fleet.clone(), Some(signer), Default::default(), fedfleet_protocol::SystemClock::shared()).unwrap();
        for body in [&b"v1"[..], &b"v2 bytes"[..]] {
            let meta = NewVersion {
                name: "m".into(),
                spec: serde_json::json!({}).into(),
                parent: None,
                metrics: Default::default(),
                created_at_unix_ms: 1,
                publisher: "t".into(),
                adapter: None,
            };
            reg.publish(meta, body).unwrap();
        }
        reg.store().set_alias("m", "stable", ModelVersion(1)).unwrap();
        let start = |id: &str, last: f64| {
            AdminRequest::RolloutStart(RolloutStart {
                id: Some(id.into()),
                model: "m".into(),
                alias: "stable".into(),
                target: ModelVersion(2),
                phases: vec![Phase::percent(10.0, 60_000), Phase::percent(last, 60_000)],
                failure_threshold: 0.5,
                min_sample: 5,
            })
        };
        let command = |id: &str, command| AdminRequest::Rollout { id: id.into(), command };
        let current = |id: &str| {
            let r = reg.store().rollouts().unwrap().into_iter().find(|r| r.id() == id).unwrap();
            notice(&reg, &r, 7).unwrap()
        };
        reg.admin(start("r1", 100.0), 1_000).unwrap();
        let n = current("r1");
        let v2 = reg.store().version("m", ModelVersion(2)).unwrap();
        assert_eq!((n.fleet.clone(), n.alias.as_str(), n.phase, n.percent_bp), (fleet, "stable", 0, 1_000));
        assert_eq!((n.model.version, n.model.digest, n.length), (ModelVersion(2), v2.digest, v2.length));
        assert_eq!((n.action.clone(), n.issued_at_unix_ms), (RolloutAction::Install, 7));
        reg.admin(command("r1", RolloutCommand::Pause), 2_000).unwrap();
        assert_eq!(current("r1").action, RolloutAction::Pause);
        reg.admin(command("r1", RolloutCommand::Abort { reason: "x".into() }), 3_000).unwrap();
        assert_eq!(current("r1").action, RolloutAction::Abort);
        reg.admin(command("r1", RolloutCommand::Rollback), 4_000).unwrap();
        let v1 = reg.store().version("m", ModelVersion(1)).unwrap();
        match current("r1").action {
            RolloutAction::RollBack { to } => {
                assert_eq!((to.version, to.digest), (ModelVersion(1), v1.digest))
            }
            other => panic!("rolled back rollout announced as {other:?}"),
        }
        // A completed rollout: every device, the target (even when the last phase was 50 %).
        reg.admin(start("r2", 50.0), 10_000).unwrap();
        // A device of the first phase runs the target healthy: the evidence a phase advances on.
        let canary = (0..)
            .map(|i| fedfleet_protocol::DeviceId::new(format!("d{i}")).unwrap())
            .find(|d| fedfleet_rollout::in_percent("r2", d, 10.0))
            .unwrap();
        let healthy = fedfleet_protocol::DeviceStatus {
            fleet: reg.fleet().clone(),
            device: canary,
            reported_at_unix_ms: 10_001,
            state: fedfleet_protocol::DeviceState::Healthy,
            active: Some(ModelRef { name: "m".into(), version: ModelVersion(2), digest: v2.digest }),
            staged: None,
            rollout_id: None,
        };
        reg.report(&healthy, 10_001).unwrap();
        reg.drive(10_000 + 60_000).unwrap();
        reg.drive(10_000 + 120_000).unwrap();
        let n = current("r2");
        assert_eq!((n.phase, n.percent_bp, n.action), (1, 10_000, RolloutAction::Install));
    }
}
