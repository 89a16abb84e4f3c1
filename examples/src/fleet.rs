//! The demo's view of a fleet of real edge agents in one process: a thin wrapper over
//! [`fedfleet_testkit::sim::RemoteFleet`] (each agent: its own enrolled identity, key, sled store
//! and data share, the daemon's `Agent` shell, QUIC + mTLS clients to the real aggregator and
//! registry) that adds per-agent progress and the numbers the demo prints.
//!
//! Optionally ([`FleetExtras`]):
//! - the MQTT control plane, wired as the daemon's `[mqtt]` section does: round announcements
//!   heard over MQTT ([`MqttAggregator`]), every status report also signed and published on the
//!   device's status topic ([`MqttRegistry`]) plus periodic heartbeats, uploads over QUIC with the
//!   MQTT upload path as fallback;
//! - hostile agents ([`crate::attack`]), whose upload path replaces their honest update.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use fedfleet_agent::clients::{Aggregator, BaseModel, MetadataSet, Registry, TransportError, UploadReply};
use fedfleet_agent::mqtt::{MqttAggregator, MqttRegistry, MqttUploadOptions, StatusPublisher};
use fedfleet_agent::remote::{RemoteAggregator, RemoteRegistry};
use fedfleet_agent::{Clock, SystemClock};
use fedfleet_control::{ClientOptions, ControlClient, Role};
use fedfleet_learning::{Dataset, Partition};
use fedfleet_protocol::{DeviceId, DeviceStatus, FleetId, ModelRef, ModelVersion, RolloutNotice, RoundAnnouncement, RoundId};
use fedfleet_testkit::sim::{AgentLinks, FleetOptions, RemoteFleet};

use crate::attack::{Attack, HostileUplink};

/// The agents' MQTT connection to the aggregator's broker.
#[derive(Debug, Clone)]
pub struct MqttLink {
    pub broker: SocketAddr,
    /// The aggregator's announcement (receipt) key, which signs round announcements.
    pub aggregator_key: ed25519_dalek::VerifyingKey,
    /// How often each agent re-publishes its status (presence).
    pub heartbeat: Duration,
}

/// What [`Fleet::start_with`] adds to plain QUIC agents.
#[derive(Debug, Clone, Default)]
pub struct FleetExtras {
    pub mqtt: Option<MqttLink>,
    /// `attacks[i]`: agent `i` sends hostile updates (missing or `None`: honest).
    pub attacks: Vec<Option<Attack>>,
}

/// An agent's aggregator client: QUIC, or QUIC with the MQTT control plane; possibly hostile.
pub struct Uplink {
    quic: Arc<RemoteAggregator>,
    mqtt: Option<MqttAggregator<RemoteAggregator>>,
    hostile: Option<HostileUplink>,
    /// Rounds this agent learned of from an MQTT announcement (not from the QUIC poll).
    heard: std::sync::Mutex<std::collections::BTreeSet<RoundId>>,
}

impl Uplink {
    /// Whether this agent learned of `round` from an MQTT announcement.
    pub fn heard_over_mqtt(&self, round: RoundId) -> bool {
        self.heard.lock().unwrap_or_else(|p| p.into_inner()).contains(&round)
    }

    async fn send(&self, signed_header: &[u8], payload: &[u8]) -> Result<UploadReply, TransportError> {
        match &self.mqtt {
            Some(m) => m.upload(signed_header, payload).await,
            None => self.quic.upload(signed_header, payload).await,
        }
    }
}

impl Aggregator for Uplink {
    async fn current_round(&self, fleet: &FleetId) -> Result<Option<RoundAnnouncement>, TransportError> {
        let Some(m) = &self.mqtt else { return self.quic.current_round(fleet).await };
        // MqttAggregator answers from the last announcement when there is one, else polls QUIC.
        let over_mqtt = m.announced().filter(|a| &a.fleet == fleet).map(|a| a.round);
        let round = m.current_round(fleet).await?;
        if let (Some(r), Some(heard)) = (&round, over_mqtt)
            && r.round == heard
        {
            self.heard.lock().unwrap_or_else(|p| p.into_inner()).insert(heard);
        }
        Ok(round)
    }

    async fn fetch_base_model(&self, model: &ModelRef) -> Result<BaseModel, TransportError> {
        self.quic.fetch_base_model(model).await
    }

    async fn upload(&self, signed_header: &[u8], payload: &[u8]) -> Result<UploadReply, TransportError> {
        match &self.hostile {
            None => self.send(signed_header, payload).await,
            Some(h) => {
                let (header, payload) = h.corrupt(signed_header, payload)?;
                let reply = self.send(&header, &payload).await?;
                Ok(h.as_honest_reply(signed_header, reply))
            }
        }
    }
}

/// An agent's registry client: QUIC, or QUIC plus every status report published over MQTT.
pub enum Downlink {
    Quic(Arc<RemoteRegistry>),
    Mqtt(Box<MqttRegistry<RemoteRegistry>>),
}

impl Registry for Downlink {
    async fn metadata(&self, have_root_version: u64) -> Result<MetadataSet, TransportError> {
        match self {
            Downlink::Quic(r) => r.metadata(have_root_version).await,
            Downlink::Mqtt(r) => r.metadata(have_root_version).await,
        }
    }
    async fn assignment(&self, device: &DeviceId) -> Result<Option<RolloutNotice>, TransportError> {
        match self {
            Downlink::Quic(r) => r.assignment(device).await,
            Downlink::Mqtt(r) => r.assignment(device).await,
        }
    }
    async fn download(&self, name: &str, version: ModelVersion, offset: u64, max_len: u32) -> Result<Vec<u8>, TransportError> {
        match self {
            Downlink::Quic(r) => r.download(name, version, offset, max_len).await,
            Downlink::Mqtt(r) => r.download(name, version, offset, max_len).await,
        }
    }
    async fn model_info(&self, name: &str, version: ModelVersion) -> Result<fedfleet_protocol::ModelInfo, TransportError> {
        match self {
            Downlink::Quic(r) => r.model_info(name, version).await,
            Downlink::Mqtt(r) => r.model_info(name, version).await,
        }
    }
    async fn report(&self, status: &DeviceStatus) -> Result<(), TransportError> {
        match self {
            Downlink::Quic(r) => r.report(status).await,
            Downlink::Mqtt(r) => r.report(status).await,
        }
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

pub struct Fleet {
    inner: RemoteFleet<Uplink, Downlink>,
    uplinks: Vec<Arc<Uplink>>,
    controls: Vec<ControlClient>,
    _heartbeats: Vec<AbortOnDrop>,
    pub ids: Vec<DeviceId>,
    /// Local training examples per agent (the share minus its 20 % holdout).
    pub train_sizes: Vec<usize>,
}

impl Fleet {
    /// Opens every agent over QUIC only (clients connect on first use).
    pub fn start(o: FleetOptions) -> anyhow::Result<Fleet> {
        Self::start_with(o, FleetExtras::default())
    }

    /// Opens every agent, with the MQTT control plane and hostile agents of `extras`.
    pub fn start_with(o: FleetOptions, extras: FleetExtras) -> anyhow::Result<Fleet> {
        let train_sizes = shares(&o.partition, o.devices.len(), o.partition_seed)?;
        let ids = o.devices.clone();
        let fleet_id = o.fleet.clone();
        let mut uplinks = Vec::new();
        let mut controls = Vec::new();
        let mut publishers = Vec::new();
        let inner = RemoteFleet::start_with(o, |l: &AgentLinks| {
            let hostile =
                extras.attacks.get(l.index).copied().flatten().map(|a| HostileUplink::new(a, l.identity.signing_key(), l.index as u64));
            let (mqtt, downlink) = match &extras.mqtt {
                None => (None, Downlink::Quic(l.registry.clone())),
                Some(m) => {
                    let (control, events) = device_control(m, &fleet_id, l)?;
                    let publisher = StatusPublisher::new(control.clone(), l.identity.signing_key());
                    let opts = MqttUploadOptions { receipt_timeout: Duration::from_secs(20), ..Default::default() };
                    let agg = MqttAggregator::new(l.aggregator.clone(), control.clone(), events, opts);
                    controls.push(control);
                    publishers.push(publisher.clone());
                    (Some(agg), Downlink::Mqtt(Box::new(MqttRegistry::new(l.registry.clone(), publisher))))
                }
            };
            let uplink = Arc::new(Uplink { quic: l.aggregator.clone(), mqtt, hostile, heard: Default::default() });
            uplinks.push(uplink.clone());
            Ok((uplink, Arc::new(downlink)))
        })?;
        // Heartbeats: each agent's current status, re-published with a fresh timestamp.
        let mut heartbeats = Vec::new();
        if let Some(m) = &extras.mqtt {
            let clock = SystemClock;
            for (a, p) in inner.agents.iter().zip(publishers) {
                let initial = a.core().status(clock.now_ms());
                let task = tokio::spawn(fedfleet_agent::mqtt::heartbeats(p, initial, m.heartbeat, move || SystemClock.now_ms()));
                heartbeats.push(AbortOnDrop(task));
            }
        }
        Ok(Fleet { inner, uplinks, controls, _heartbeats: heartbeats, ids, train_sizes })
    }

    /// Polls the services and drives every agent once, in turn; `on_agent` after each.
    pub async fn step(&mut self, mut on_agent: impl FnMut(usize)) -> anyhow::Result<()> {
        for (i, a) in self.inner.agents.iter_mut().enumerate() {
            a.poll_control().await?;
            a.drive().await?;
            on_agent(i);
        }
        Ok(())
    }

    /// Steps the agents that still owe `round` something: those that have not trained in it
    /// yet and those whose update is not acknowledged yet. Agents done with the round wait, so
    /// none of them moves on to the next round while the caller is still accounting for this one.
    pub async fn step_round(&mut self, round: RoundId, mut on_agent: impl FnMut(usize)) -> anyhow::Result<()> {
        for (i, a) in self.inner.agents.iter_mut().enumerate() {
            let done = a.core().state().last_round == Some(round) && a.core().pending_uploads().is_empty();
            if !done {
                a.poll_control().await?;
                a.drive().await?;
            }
            on_agent(i);
        }
        Ok(())
    }

    /// How many agents serve `model`.
    pub fn active_on(&self, model: &ModelRef) -> usize {
        self.inner.agents.iter().filter(|a| a.core().active().is_some_and(|m| m.model == *model)).count()
    }

    /// Agents grouped by the version they serve and their last lifecycle state, e.g.
    /// `18 on v31 (active), 2 on v30 (rolled_back)`.
    pub fn states_summary(&self) -> String {
        let mut groups: std::collections::BTreeMap<(Option<u64>, &'static str), usize> = Default::default();
        for a in &self.inner.agents {
            let v = a.core().active().map(|m| m.model.version.0);
            *groups.entry((v, a.core().state().last_state.as_str())).or_default() += 1;
        }
        let mut parts: Vec<((Option<u64>, &str), usize)> = groups.into_iter().collect();
        parts.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        parts
            .iter()
            .map(|((v, st), n)| format!("{n} on {} ({st})", v.map(|v| format!("v{v}")).unwrap_or_else(|| "no model".into())))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Agent `i`'s local data: its training share and its holdout.
    pub fn local_data(&self, i: usize) -> &fedfleet_agent::LocalData {
        self.inner.agents[i].data()
    }

    /// The model agent `i` serves.
    pub fn active_model(&self, i: usize) -> Option<&ModelRef> {
        self.inner.agents[i].core().active().map(|m| &m.model)
    }

    /// How many agents heard `round` announced over MQTT (0 without MQTT).
    pub fn heard_over_mqtt(&self, round: RoundId) -> usize {
        self.uplinks.iter().filter(|u| u.heard_over_mqtt(round)).count()
    }

    /// Waits (up to `timeout`) until every agent's MQTT client has received the announcement of
    /// `round`, so the next step finds it there rather than in a QUIC poll. Returns how many have.
    pub async fn wait_announced(&self, round: RoundId, timeout: Duration) -> usize {
        let announced =
            || self.uplinks.iter().filter_map(|u| u.mqtt.as_ref()).filter(|m| m.announced().is_some_and(|a| a.round == round)).count();
        let t = tokio::time::Instant::now();
        while self.has_mqtt() && announced() < self.len() && t.elapsed() < timeout {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        announced()
    }

    /// Uploads that went over the MQTT upload path (attempts).
    pub fn mqtt_uploads(&self) -> u32 {
        self.uplinks.iter().filter_map(|u| u.mqtt.as_ref()).map(|m| m.mqtt_uploads()).sum()
    }

    pub fn has_mqtt(&self) -> bool {
        !self.controls.is_empty()
    }

    pub fn len(&self) -> usize {
        self.inner.agents.len()
    }

    pub fn is_empty(&self) -> bool {
        self.inner.agents.is_empty()
    }

    pub fn inner(&self) -> &RemoteFleet<Uplink, Downlink> {
        &self.inner
    }

    /// Disconnects the agents' MQTT clients (heartbeats stop when the fleet is dropped).
    pub async fn shutdown(self) {
        drop(self._heartbeats);
        for c in &self.controls {
            c.shutdown().await;
        }
    }
}

/// A device's control-plane client on the aggregator's broker (connects in the background).
pub fn device_control(m: &MqttLink, fleet: &FleetId, l: &AgentLinks) -> anyhow::Result<(ControlClient, fedfleet_control::ControlEvents)> {
    let tls = fedfleet_control::device_tls(&l.identity).map_err(|e| anyhow::anyhow!("MQTT TLS for {}: {e}", l.device))?;
    let mut options = ClientOptions::new(m.broker.ip().to_string(), m.broker.port(), l.device.as_str(), fleet.clone());
    options.backoff_max = Duration::from_secs(2);
    let role = Role::Device { id: l.device.clone(), aggregator_key: m.aggregator_key, registry_key: None };
    Ok(ControlClient::start(options, tls, role))
}

/// Training-set sizes of the agents' shares, computed as `RemoteFleet::start` deals them.
pub fn shares(partition: &Partition, n: usize, seed: u64) -> anyhow::Result<Vec<usize>> {
    let (train, _) = Dataset::digits_split()?;
    Ok(partition.split_dataset(&train, n, seed).into_iter().map(|p| p.split(0.2, seed).0.len()).collect())
}
