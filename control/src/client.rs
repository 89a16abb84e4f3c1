//! [`ControlClient`]: one MQTT connection (rumqttc, TLS with a fleet certificate) that publishes
//! typed, signed messages and turns what arrives into verified [`ControlEvent`]s.
//!
//! The connection is driven by a tokio task. When it drops, the task polls again after a backoff
//! (doubling from `backoff_initial` to `backoff_max`, with jitter), and on every (re)connect it
//! subscribes again and republishes the retained messages this client published last (so a
//! broker that restarted empty gets the current round and rollout back). MQTT sessions are
//! clean: whatever was queued while the connection was down may be lost, so callers repeat what
//! must arrive until it is acknowledged (a device re-uploads until it has a receipt).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ed25519_dalek::VerifyingKey;
use fedfleet_protocol::{
    DeviceId, DeviceStatus, FleetId, Receipt, RejectReason, RolloutNotice, RoundAnnouncement, RoundId, Signed, SignedUpdate,
};
use rumqttc::{AsyncClient, Event, EventLoop, MqttOptions, Packet, QoS, Request, TlsConfiguration, Transport};
use tokio::sync::{mpsc, watch};

use crate::exchange::{self, DeviceRequest, SignedAnswer};
use crate::rejection::SignedRejection;
use crate::topics::{self, Topic};
use crate::upload::{self, Assembled, AssemblerLimits, UpdateAssembler, VerifiedUpload};
use crate::verify::{self, DeviceKeys, Rejected};

/// Where the broker is and how to behave on the connection.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// Broker host name or IP address; must match the broker certificate's SAN.
    pub host: String,
    pub port: u16,
    /// More nodes of the broker's cluster: after a lost or refused connection the client tries
    /// the next address (round `host:port` and these), so a dead node costs one reconnect.
    pub failover: Vec<(String, u16)>,
    /// MQTT client id; unique per connection (the broker drops an older connection with the
    /// same id). Use the device id for devices, the service name for services.
    pub client_id: String,
    pub fleet: FleetId,
    pub keep_alive: Duration,
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    /// Largest MQTT packet sent or accepted.
    pub max_packet_bytes: usize,
    /// Payload bytes per upload chunk frame.
    pub chunk_bytes: usize,
}

impl ClientOptions {
    pub fn new(host: impl Into<String>, port: u16, client_id: impl Into<String>, fleet: FleetId) -> Self {
        ClientOptions {
            host: host.into(),
            port,
            failover: Vec::new(),
            client_id: client_id.into(),
            fleet,
            keep_alive: Duration::from_secs(15),
            backoff_initial: Duration::from_millis(200),
            backoff_max: Duration::from_secs(crate::config::DEVICE_RECONNECT_MAX_SECS),
            max_packet_bytes: 2 * 1024 * 1024,
            chunk_bytes: upload::DEFAULT_CHUNK_BYTES,
        }
    }
}

/// What this client is, which decides what it subscribes to and how it verifies.
#[allow(clippy::large_enum_variant)] // one per client
pub enum Role {
    /// An edge device: hears round announcements (signed by the pinned aggregator key), rollout
    /// notices (signed by the pinned registry key, if given) and its own receipts.
    Device { id: DeviceId, aggregator_key: VerifyingKey, registry_key: Option<VerifyingKey> },
    /// A fleet service (aggregator, registry): hears device status and/or device uploads,
    /// verified against the allow-list key of the device named in the topic and in the body.
    /// `updates` also hears devices' requests ([`crate::exchange`]): the aggregator's.
    Service { keys: Arc<dyn DeviceKeys>, status: bool, updates: bool, limits: AssemblerLimits },
}

/// Something verified that arrived, or a change of connection.
#[derive(Debug, Clone, PartialEq)]
pub enum ControlEvent {
    /// Connected (again) and subscribed: sent once the broker acknowledged the subscriptions,
    /// so what is published after it reaches this client. `count` starts at 1.
    Connected { count: u64 },
    /// The connection dropped; the client reconnects by itself.
    Disconnected { error: String },
    /// A round announcement (new, or changed for the same round).
    Announcement(Signed<RoundAnnouncement>),
    /// A rollout notice (new or changed).
    Rollout(Signed<RolloutNotice>),
    /// A receipt for this device's update.
    Receipt(Signed<Receipt>),
    /// The aggregator's signed refusal of one of this device's MQTT uploads.
    UploadRefused(SignedRejection),
    /// The aggregator's signed answer to one of this device's requests.
    Answer(SignedAnswer),
    /// A device's request (for a service that hears uploads); its signed parts are the
    /// service's to verify.
    Request(DeviceRequest),
    /// A device's status or heartbeat.
    Status(Signed<DeviceStatus>),
    /// A complete update over the MQTT upload path.
    Update(VerifiedUpload),
    /// Something refused, with its reason.
    Rejected(Rejected),
}

/// Counters of one client, for metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ControlStats {
    pub connects: u64,
    pub disconnects: u64,
    /// Verified messages delivered as events.
    pub accepted: u64,
    /// Verified repeats dropped (retained redelivery, QoS 1 duplicates).
    pub duplicates: u64,
    pub rejected: BTreeMap<RejectReason, u64>,
}

impl ControlStats {
    pub fn rejected(&self, reason: RejectReason) -> u64 {
        self.rejected.get(&reason).copied().unwrap_or(0)
    }
}

/// Why a publish was not queued.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("TLS configuration: {0}")]
    Certs(fedfleet_certs::CertError),
    #[error("the control client has stopped")]
    Closed,
    #[error("this client's role cannot {0}")]
    Role(&'static str),
    #[error("the message names fleet {found}; this client serves {expected}")]
    WrongFleet { expected: FleetId, found: FleetId },
    #[error("the update header names device {found}; this client is {expected}")]
    WrongDevice { expected: DeviceId, found: DeviceId },
    #[error("update payload of {len} bytes does not match its signed length {signed}")]
    PayloadLength { len: u64, signed: u64 },
}

// Printed in the message, so not also a `source`: a report of the chain would say it twice.
impl From<fedfleet_certs::CertError> for ControlError {
    fn from(e: fedfleet_certs::CertError) -> Self {
        ControlError::Certs(e)
    }
}

/// Events a client holds for its owner. Each may be an assembled update (to a service), so the
/// queue is short: an owner that falls behind holds the broker's deliveries back (the broker
/// queues them), not the client's memory.
const EVENT_QUEUE: usize = 64;

/// The receiving end of a client's events. Read it promptly: the connection task waits while
/// it is full (so nothing verified is dropped), and a stalled connection misses its pings.
pub struct ControlEvents {
    rx: mpsc::Receiver<ControlEvent>,
}

impl ControlEvents {
    /// The next event; `None` once the client has shut down.
    pub async fn recv(&mut self) -> Option<ControlEvent> {
        self.rx.recv().await
    }
}

#[derive(Default)]
struct Sticky {
    round: Option<Vec<u8>>,
    rollout: Option<Vec<u8>>,
    status: Option<(String, Vec<u8>)>,
}

struct Shared {
    stats: Mutex<ControlStats>,
    sticky: Mutex<Sticky>,
}

/// A connected (or reconnecting) control-plane client. Cheap to clone.
#[derive(Clone)]
pub struct ControlClient {
    mqtt: AsyncClient,
    fleet: FleetId,
    device: Option<DeviceId>,
    /// A device's pinned aggregator key (what its announcements, receipts and answers verify against).
    aggregator_key: Option<VerifyingKey>,
    chunk_bytes: usize,
    max_packet_bytes: usize,
    shared: Arc<Shared>,
    stop: Arc<watch::Sender<bool>>,
}

/// TLS for a device: its certificate and key, trusting only the fleet CA.
pub fn device_tls(identity: &fedfleet_certs::DeviceIdentity) -> Result<Arc<rustls::ClientConfig>, ControlError> {
    Ok(Arc::new(fedfleet_certs::tls::client_config(identity.ca(), identity, &[])?))
}

/// TLS for a service (aggregator, registry): its server certificate, which carries clientAuth.
pub fn service_tls(
    ca: &fedfleet_certs::CaCert,
    identity: &fedfleet_certs::ServerIdentity,
) -> Result<Arc<rustls::ClientConfig>, ControlError> {
    Ok(Arc::new(fedfleet_certs::tls::service_client_config(ca, identity, &[])?))
}

impl ControlClient {
    /// Starts the connection task on the current tokio runtime. Connecting happens in the
    /// background: the first event is [`ControlEvent::Connected`] once the broker has answered.
    pub fn start(options: ClientOptions, tls: Arc<rustls::ClientConfig>, role: Role) -> (ControlClient, ControlEvents) {
        let mqtt = mqtt_options(&options, (options.host.clone(), options.port), &tls);
        let (client, eventloop) = AsyncClient::new(mqtt, 256);
        let (events_tx, rx) = mpsc::channel(EVENT_QUEUE);
        let (stop, stopped) = watch::channel(false);
        let shared = Arc::new(Shared { stats: Mutex::new(ControlStats::default()), sticky: Mutex::new(Sticky::default()) });
        let (device, aggregator_key) = match &role {
            Role::Device { id, aggregator_key, .. } => (Some(id.clone()), Some(*aggregator_key)),
            Role::Service { .. } => (None, None),
        };
        let driver = Driver {
            inbound: Inbound::new(options.fleet.clone(), role),
            tls,
            broker: 0,
            options: options.clone(),
            events: events_tx,
            shared: shared.clone(),
            requests: client.clone(),
        };
        tokio::spawn(driver.run(eventloop, stopped));
        (
            ControlClient {
                mqtt: client,
                fleet: options.fleet,
                device,
                aggregator_key,
                chunk_bytes: options.chunk_bytes,
                max_packet_bytes: options.max_packet_bytes,
                shared,
                stop: Arc::new(stop),
            },
            ControlEvents { rx },
        )
    }

    /// A device's pinned aggregator key (`None` for a service).
    pub fn aggregator_key(&self) -> Option<VerifyingKey> {
        self.aggregator_key
    }

    /// Whether a request of `message` and `attachment` fits in one MQTT packet of this client.
    pub fn request_fits(&self, message: &[u8], attachment: &[u8]) -> bool {
        // The frame's prefix, and the publish's topic and header, with room to spare.
        exchange::REQUEST_PREFIX_LEN + message.len() + attachment.len() + 512 <= self.max_packet_bytes
    }

    fn check_fleet(&self, fleet: &FleetId) -> Result<(), ControlError> {
        if fleet != &self.fleet {
            return Err(ControlError::WrongFleet { expected: self.fleet.clone(), found: fleet.clone() });
        }
        Ok(())
    }

    /// Publishes the current round (QoS 1, retained), and republishes it after every reconnect.
    pub async fn publish_announcement(&self, signed: &Signed<RoundAnnouncement>) -> Result<(), ControlError> {
        self.check_fleet(&signed.body().fleet)?;
        let bytes = signed.encode();
        self.shared.sticky.lock().unwrap().round = Some(bytes.clone());
        self.publish_raw(&topics::rounds(&self.fleet), bytes, QoS::AtLeastOnce, true).await
    }

    /// Publishes the current rollout notice (QoS 1, retained), and republishes it after every
    /// reconnect.
    pub async fn publish_rollout(&self, signed: &Signed<RolloutNotice>) -> Result<(), ControlError> {
        self.check_fleet(&signed.body().fleet)?;
        let bytes = signed.encode();
        self.shared.sticky.lock().unwrap().rollout = Some(bytes.clone());
        self.publish_raw(&topics::rollouts(&self.fleet), bytes, QoS::AtLeastOnce, true).await
    }

    /// Publishes this device's status or heartbeat on its own status topic (QoS 1, retained),
    /// and the last one again after every reconnect.
    pub async fn publish_status(&self, signed: &Signed<DeviceStatus>) -> Result<(), ControlError> {
        self.check_fleet(&signed.body().fleet)?;
        let topic = topics::status(&self.fleet, &signed.body().device);
        let bytes = signed.encode();
        self.shared.sticky.lock().unwrap().status = Some((topic.clone(), bytes.clone()));
        self.publish_raw(&topic, bytes, QoS::AtLeastOnce, true).await
    }

    /// Publishes a receipt to the device it names (QoS 1, not retained).
    pub async fn publish_receipt(&self, signed: &Signed<Receipt>) -> Result<(), ControlError> {
        self.check_fleet(&signed.body().fleet)?;
        let topic = topics::receipts(&self.fleet, &signed.body().device);
        self.publish_raw(&topic, signed.encode(), QoS::AtLeastOnce, false).await
    }

    /// Publishes a refusal of an MQTT upload to the device it names (QoS 1, not retained).
    pub async fn publish_rejection(&self, signed: &SignedRejection) -> Result<(), ControlError> {
        self.check_fleet(&signed.body().fleet)?;
        let topic = topics::rejections(&self.fleet, &signed.body().device);
        self.publish_raw(&topic, signed.encode(), QoS::AtLeastOnce, false).await
    }

    /// Sends an update over the MQTT upload path: the signed header, then the payload in
    /// chunks, on this device's updates topic (QoS 1). Queued, not confirmed: wait for the
    /// [`ControlEvent::Receipt`] and send again (same signed header) if none comes.
    pub async fn upload_update(&self, signed: &SignedUpdate, payload: &[u8]) -> Result<(), ControlError> {
        let Some(device) = &self.device else {
            return Err(ControlError::Role("upload updates (not a device)"));
        };
        let h = signed.body();
        self.check_fleet(&h.fleet)?;
        if &h.device != device {
            return Err(ControlError::WrongDevice { expected: device.clone(), found: h.device.clone() });
        }
        if h.payload_len != payload.len() as u64 {
            return Err(ControlError::PayloadLength { len: payload.len() as u64, signed: h.payload_len });
        }
        let topic = topics::updates(&self.fleet, device);
        for frame in upload::encode_frames(signed, payload, self.chunk_bytes) {
            self.publish_raw(&topic, frame, QoS::AtLeastOnce, false).await?;
        }
        Ok(())
    }

    /// Sends a request (`message`, then `attachment`) on this device's requests topic (QoS 0),
    /// queued, not confirmed: wait for the [`ControlEvent::Answer`] naming `id`, and send again
    /// if none comes.
    pub async fn send_request(&self, id: u64, message: &[u8], attachment: &[u8]) -> Result<(), ControlError> {
        let Some(device) = &self.device else {
            return Err(ControlError::Role("send requests (not a device)"));
        };
        let topic = Topic::Requests { fleet: self.fleet.clone(), device: device.clone() };
        self.publish_raw(&topic.path(), exchange::encode_request(id, message, attachment), topic.qos(), false).await
    }

    /// Publishes an answer to the device it names (QoS 0, not retained).
    pub async fn publish_answer(&self, signed: &SignedAnswer) -> Result<(), ControlError> {
        self.check_fleet(&signed.body().fleet)?;
        let topic = Topic::Answers { fleet: self.fleet.clone(), device: signed.body().device.clone() };
        self.publish_raw(&topic.path(), signed.encode(), topic.qos(), false).await
    }

    /// Publishes arbitrary bytes on any topic. For tools and tests (the broker enforces no
    /// topic access, which is why receivers verify everything).
    pub async fn publish_raw(&self, topic: &str, bytes: Vec<u8>, qos: QoS, retain: bool) -> Result<(), ControlError> {
        self.mqtt.publish(topic, qos, retain, bytes).await.map_err(|_| ControlError::Closed)
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> ControlStats {
        self.shared.stats.lock().unwrap().clone()
    }

    /// Disconnects and stops the connection task; the event stream ends.
    pub async fn shutdown(&self) {
        let _ = self.mqtt.try_disconnect();
        let _ = self.stop.send(true);
    }
}

/// rumqttc's options for one broker address.
fn mqtt_options(options: &ClientOptions, (host, port): (String, u16), tls: &Arc<rustls::ClientConfig>) -> MqttOptions {
    let mut mqtt = MqttOptions::new(options.client_id.clone(), host, port);
    mqtt.set_keep_alive(options.keep_alive)
        .set_clean_session(true)
        .set_max_packet_size(options.max_packet_bytes, options.max_packet_bytes)
        .set_transport(Transport::tls_with_config(TlsConfiguration::Rustls(tls.clone())));
    mqtt
}

struct Driver {
    options: ClientOptions,
    tls: Arc<rustls::ClientConfig>,
    /// Which of the broker addresses (`host:port`, then `failover`) the event loop uses.
    broker: usize,
    events: mpsc::Sender<ControlEvent>,
    shared: Arc<Shared>,
    inbound: Inbound,
    /// The request channel's sending side, for subscribing again to refused filters.
    requests: AsyncClient,
}

/// What one incoming publish came to (see [`Inbound::receive`]).
// One value per publish, moved once into the event channel: boxing the event would only add an
// allocation to every delivered message.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Received {
    /// Deliver this (a verified message, or [`ControlEvent::Rejected`] with its reason).
    Event(ControlEvent),
    /// A verified repeat (retained redelivery, QoS 1 duplicate, a re-sent upload frame): counted
    /// as a duplicate, not delivered.
    Duplicate,
    /// Nothing to report: a cleared retained message, an upload frame of an upload still in
    /// progress, or a topic this role does not listen to.
    Nothing,
}

/// The receiving half of a [`ControlClient`], sans IO: turns one incoming MQTT publish (topic
/// and payload bytes) into what the client delivers. It parses the topic, decodes and verifies
/// the payload for this [`Role`] (pinned keys or the allow-list), drops repeats and refuses stale
/// announcements and rollout notices, and reassembles upload frames. The connection task calls
/// it for every publish; it is public so the fuzz harness (`control/fuzz`) drives the same code.
pub struct Inbound {
    fleet: FleetId,
    role: Role,
    assembler: Option<UpdateAssembler>,
    last_round: Option<(RoundId, Vec<u8>)>,
    last_rollout: Option<(u64, Vec<u8>)>,
}

/// Sleeps `d`, or less when the client is stopped meanwhile; returns whether it was.
async fn pause(stopped: &mut watch::Receiver<bool>, d: Duration) -> bool {
    tokio::select! {
        _ = stopped.changed() => true,
        _ = tokio::time::sleep(d) => false,
    }
}

/// The filters of a subscription the broker refused (a missing answer counts as refused).
fn refused_filters(filters: Vec<rumqttc::SubscribeFilter>, codes: &[rumqttc::SubscribeReasonCode]) -> Vec<rumqttc::SubscribeFilter> {
    filters
        .into_iter()
        .enumerate()
        .filter(|(i, _)| !matches!(codes.get(*i), Some(rumqttc::SubscribeReasonCode::Success(_))))
        .map(|(_, f)| f)
        .collect()
}

/// Subscribing again to refused filters, after a pause that doubles from the backoff's start
/// to its ceiling. A task sends the subscription through the request channel, so the connection
/// task goes on polling (keep-alives, deliveries) meanwhile; a lost connection cancels it (the
/// reconnect subscribes to everything).
struct Resubscribe {
    task: Option<tokio::task::JoinHandle<()>>,
    initial: Duration,
    max: Duration,
    next: Duration,
}

impl Resubscribe {
    fn new(initial: Duration, max: Duration) -> Resubscribe {
        Resubscribe { task: None, initial, max, next: initial }
    }

    /// Subscribes to `filters` again after the next pause; returns the pause.
    fn schedule(&mut self, requests: &AsyncClient, filters: Vec<rumqttc::SubscribeFilter>) -> Duration {
        let pause = jitter(self.next);
        self.next = (self.next * 2).min(self.max);
        let requests = requests.clone();
        let task = tokio::spawn(async move {
            tokio::time::sleep(pause).await;
            let _ = requests.subscribe_many(filters).await;
        });
        if let Some(old) = self.task.replace(task) {
            old.abort();
        }
        pause
    }

    /// Drops a pending resubscription; the next pause starts again from the backoff's start.
    fn cancel(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
        self.next = self.initial;
    }
}

fn jitter(d: Duration) -> Duration {
    // A fresh randomly keyed hasher is a random number without a clock or an RNG crate.
    use std::hash::BuildHasher;
    let random = std::collections::hash_map::RandomState::new().hash_one(0u8);
    // 75 %..125 % of d.
    d.mul_f64(0.75 + (random % 1000) as f64 / 2000.0)
}

impl Driver {
    fn subscriptions(&self) -> Vec<rumqttc::SubscribeFilter> {
        let f = &self.options.fleet;
        let mut subs = Vec::new();
        let mut add_with = |path: String, qos: QoS| subs.push(rumqttc::SubscribeFilter::new(path, qos));
        match &self.inbound.role {
            Role::Device { id, registry_key, .. } => {
                let answers = Topic::Answers { fleet: f.clone(), device: id.clone() };
                let mut add = |path: String| add_with(path, QoS::AtLeastOnce);
                add(topics::rounds(f));
                if registry_key.is_some() {
                    add(topics::rollouts(f));
                }
                add(topics::receipts(f, id));
                add(topics::rejections(f, id));
                add_with(answers.path(), answers.qos());
            }
            Role::Service { status, updates, .. } => {
                let mut add = |path: String| add_with(path, QoS::AtLeastOnce);
                if *status {
                    add(topics::all_status(f));
                }
                if *updates {
                    add(topics::all_updates(f));
                    // Requests at QoS 0 (see `Topic::Requests`).
                    add_with(topics::all_requests(f), QoS::AtMostOnce);
                }
            }
        }
        subs
    }

    async fn emit(&self, event: ControlEvent) {
        {
            let mut s = self.shared.stats.lock().unwrap();
            match &event {
                ControlEvent::Connected { .. } => {} // counted at the broker's ConnAck
                ControlEvent::Disconnected { .. } => s.disconnects += 1,
                ControlEvent::Rejected(r) => *s.rejected.entry(r.reason).or_default() += 1,
                _ => s.accepted += 1,
            }
        }
        if let ControlEvent::Rejected(r) = &event {
            tracing::info!(reason = %r.reason, topic = %r.topic, detail = %r.detail, "control message rejected");
        }
        let _ = self.events.send(event).await;
    }

    fn duplicate(&self) {
        self.shared.stats.lock().unwrap().duplicates += 1;
    }

    async fn run(mut self, mut eventloop: EventLoop, mut stopped: watch::Receiver<bool>) {
        let mut backoff = self.options.backoff_initial;
        let mut connected = false;
        // Connected is announced once the broker has acknowledged every subscription, so a
        // message published after it reaches this client. These are the filters whose
        // acknowledgement is awaited, and the task that subscribes to refused ones again.
        let mut awaiting: Vec<rumqttc::SubscribeFilter> = Vec::new();
        let mut resubscribe = Resubscribe::new(self.options.backoff_initial, self.options.backoff_max);
        loop {
            let polled = tokio::select! {
                _ = stopped.changed() => break,
                p = eventloop.poll() => p,
            };
            match polled {
                Ok(Event::Incoming(Packet::ConnAck(_))) => {
                    connected = true;
                    backoff = self.options.backoff_initial;
                    resubscribe.cancel();
                    // Counted at once: the stats say whether the broker took the connection.
                    self.shared.stats.lock().unwrap().connects += 1;
                    awaiting = self.on_connect(&mut eventloop);
                    if awaiting.is_empty() {
                        self.emit_connected().await;
                    }
                }
                Ok(Event::Incoming(Packet::SubAck(ack))) if !awaiting.is_empty() => {
                    let refused = refused_filters(std::mem::take(&mut awaiting), &ack.return_codes);
                    if refused.is_empty() {
                        self.emit_connected().await;
                        continue;
                    }
                    // Connected without hearing everything is worse than not connected (a device
                    // would miss rounds), so Connected waits. A NATS node refuses a subscription
                    // whose JetStream consumer it could not create in time (placed on a peer that
                    // died, leaders still being elected). Only the refused filters are asked
                    // again, on this connection: reconnecting would cost the node a session and
                    // the deletion of the last one's consumers, which time out the same way.
                    let topics: Vec<&str> = refused.iter().map(|f| f.path.as_str()).collect();
                    let wait = resubscribe.schedule(&self.requests, refused.clone());
                    tracing::warn!(?topics, ?wait, "the broker refused subscriptions; subscribing to them again");
                    awaiting = refused;
                }
                Ok(Event::Incoming(Packet::Publish(p))) => self.on_publish(&p.topic, &p.payload).await,
                Ok(_) => {}
                Err(e) => {
                    awaiting.clear();
                    resubscribe.cancel();
                    if connected {
                        connected = false;
                        self.emit(ControlEvent::Disconnected { error: e.to_string() }).await;
                    }
                    tracing::debug!(error = %e, ?backoff, "MQTT connection failed; retrying");
                    self.next_broker(&mut eventloop);
                    if pause(&mut stopped, jitter(backoff)).await {
                        break;
                    }
                    backoff = (backoff * 2).min(self.options.backoff_max);
                }
            }
            if *stopped.borrow() {
                break;
            }
        }
        resubscribe.cancel();
    }

    /// After a lost or refused connection, points the event loop at the next node of the
    /// broker's cluster (if there is more than one). The subscriptions and retained messages are
    /// sent again on connect, as after any reconnect.
    fn next_broker(&mut self, eventloop: &mut EventLoop) {
        let o = &self.options;
        if o.failover.is_empty() {
            return;
        }
        self.broker = (self.broker + 1) % (o.failover.len() + 1);
        let addr = match self.broker {
            0 => (o.host.clone(), o.port),
            i => o.failover[i - 1].clone(),
        };
        tracing::info!(host = %addr.0, port = addr.1, "MQTT: trying the next broker of the cluster");
        eventloop.mqtt_options = mqtt_options(o, addr, &self.tls);
    }

    /// Subscriptions and retained republishes for a fresh connection. They go to the front of
    /// the event loop's queue (never through the request channel, which this task drains and
    /// so must not wait on). Returns the filters whose acknowledgement is awaited.
    fn on_connect(&mut self, eventloop: &mut EventLoop) -> Vec<rumqttc::SubscribeFilter> {
        let subs = self.subscriptions();
        let mut requests = Vec::new();
        if !subs.is_empty() {
            requests.push(Request::Subscribe(rumqttc::Subscribe::new_many(subs.clone())));
        }
        {
            let s = self.shared.sticky.lock().unwrap();
            let f = &self.options.fleet;
            let sticky = s
                .round
                .iter()
                .map(|b| (topics::rounds(f), b.clone()))
                .chain(s.rollout.iter().map(|b| (topics::rollouts(f), b.clone())))
                .chain(s.status.iter().cloned());
            for (topic, bytes) in sticky {
                let mut p = rumqttc::Publish::new(topic, QoS::AtLeastOnce, bytes);
                p.retain = true;
                requests.push(Request::Publish(p));
            }
        }
        for r in requests.into_iter().rev() {
            eventloop.pending.push_front(r);
        }
        subs
    }

    async fn emit_connected(&self) {
        let count = self.shared.stats.lock().unwrap().connects;
        self.emit(ControlEvent::Connected { count }).await;
    }

    async fn on_publish(&mut self, topic: &str, payload: &[u8]) {
        match self.inbound.receive(topic, payload, Instant::now()) {
            Received::Event(event) => self.emit(event).await,
            Received::Duplicate => self.duplicate(),
            Received::Nothing => {}
        }
    }
}

impl Inbound {
    /// The receiver of a client of `role` in `fleet` (with an [`UpdateAssembler`] if the role
    /// takes uploads).
    pub fn new(fleet: FleetId, role: Role) -> Self {
        let assembler = match &role {
            Role::Service { updates: true, limits, .. } => Some(UpdateAssembler::new(fleet.clone(), limits.clone())),
            _ => None,
        };
        Inbound { fleet, role, assembler, last_round: None, last_rollout: None }
    }

    /// One publish received on `topic_str` at `now`.
    pub fn receive(&mut self, topic_str: &str, payload: &[u8], now: Instant) -> Received {
        let rejected = |r| Received::Event(ControlEvent::Rejected(r));
        let fleet = self.fleet.clone();
        let topic = match topics::parse(topic_str) {
            Ok(t) => t,
            Err(e) => {
                let r = Rejected::new(topic_str, None, RejectReason::Malformed, e.to_string());
                return rejected(r);
            }
        };
        if topic.fleet() != &fleet {
            let r = Rejected::new(topic_str, topic.device(), RejectReason::WrongFleet, "topic of another fleet");
            return rejected(r);
        }
        if payload.is_empty() {
            // A cleared retained message: nothing to verify, nothing to report.
            return Received::Nothing;
        }
        let result = match (&self.role, &topic) {
            (Role::Device { aggregator_key, .. }, Topic::Rounds { .. }) => verify::announcement(topic_str, payload, &fleet, aggregator_key)
                .and_then(|s| {
                    let round = s.body().round;
                    match &self.last_round {
                        Some((r, bytes)) if *r == round && bytes == s.body_bytes() => Ok(None),
                        Some((r, _)) if *r > round => Err(Rejected::new(
                            topic_str,
                            None,
                            RejectReason::StaleRound,
                            format!("round {round} announced after round {r}"),
                        )),
                        _ => {
                            self.last_round = Some((round, s.body_bytes().to_vec()));
                            Ok(Some(ControlEvent::Announcement(s)))
                        }
                    }
                }),
            (Role::Device { registry_key: Some(key), .. }, Topic::Rollouts { .. }) => verify::rollout(topic_str, payload, &fleet, key)
                .and_then(|s| {
                    let issued = s.body().issued_at_unix_ms;
                    match &self.last_rollout {
                        Some((t, bytes)) if *t == issued && bytes == s.body_bytes() => Ok(None),
                        Some((t, _)) if *t > issued => {
                            Err(Rejected::new(topic_str, None, RejectReason::Replay, "rollout notice older than the last one seen"))
                        }
                        _ => {
                            self.last_rollout = Some((issued, s.body_bytes().to_vec()));
                            Ok(Some(ControlEvent::Rollout(s)))
                        }
                    }
                }),
            (Role::Device { id, aggregator_key, .. }, Topic::Receipts { device, .. }) if device == id => {
                verify::receipt(topic_str, payload, &fleet, id, aggregator_key).map(|s| Some(ControlEvent::Receipt(s)))
            }
            (Role::Device { id, aggregator_key, .. }, Topic::Rejections { device, .. }) if device == id => {
                verify::rejection(topic_str, payload, &fleet, id, aggregator_key).map(|s| Some(ControlEvent::UploadRefused(s)))
            }
            (Role::Device { id, aggregator_key, .. }, Topic::Answers { device, .. }) if device == id => {
                verify::answer(topic_str, payload, &fleet, id, aggregator_key).map(|s| Some(ControlEvent::Answer(s)))
            }
            (Role::Service { updates: true, .. }, Topic::Requests { device, .. }) => exchange::decode_request(device, payload)
                .map(|r| Some(ControlEvent::Request(r)))
                .map_err(|e| Rejected::new(topic_str, Some(device), e.reason(), e.to_string())),
            (Role::Service { keys, status: true, .. }, Topic::Status { device, .. }) => {
                verify::status(topic_str, payload, &fleet, device, keys.as_ref()).map(|s| Some(ControlEvent::Status(s)))
            }
            (Role::Service { keys, updates: true, .. }, Topic::Updates { device, .. }) => {
                let keys = keys.clone();
                let asm = self.assembler.as_mut().expect("assembler exists for update subscribers");
                match asm.push(topic_str, device, keys.as_ref(), payload, now) {
                    Ok(Assembled::Complete(v)) => Ok(Some(ControlEvent::Update(v))),
                    Ok(Assembled::Pending) => return Received::Nothing,
                    Ok(Assembled::Ignored) => Ok(None),
                    Err(r) => Err(r),
                }
            }
            // Something we did not subscribe to (another client's echo, a broker quirk).
            _ => return Received::Nothing,
        };
        match result {
            Ok(Some(event)) => Received::Event(event),
            Ok(None) => Received::Duplicate,
            Err(r) => rejected(r),
        }
    }
}

#[cfg(test)]
mod tests {
    use rumqttc::{SubscribeFilter, SubscribeReasonCode};

    use super::*;

    #[test]
    fn only_the_refused_filters_are_asked_again_and_a_missing_answer_counts_as_refused() {
        let filters: Vec<SubscribeFilter> =
            ["a", "b", "c", "d"].iter().map(|p| SubscribeFilter::new(p.to_string(), QoS::AtLeastOnce)).collect();
        let codes =
            [SubscribeReasonCode::Success(QoS::AtLeastOnce), SubscribeReasonCode::Failure, SubscribeReasonCode::Success(QoS::AtMostOnce)];
        let refused: Vec<String> = refused_filters(filters.clone(), &codes).into_iter().map(|f| f.path).collect();
        assert_eq!(refused, ["b", "d"]);
        let all_granted = [SubscribeReasonCode::Success(QoS::AtLeastOnce); 4];
        assert!(refused_filters(filters, &all_granted).is_empty());
    }
}
