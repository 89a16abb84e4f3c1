//! The agent's side of the MQTT control plane (`fedfleet-control`).
//!
//! - [`MqttAggregator`] wraps the QUIC [`Aggregator`] client: round announcements come from MQTT
//!   (`ControlEvent::Announcement`, verified by the control client against the pinned aggregator
//!   key) and fall back to the inner client's poll while none has arrived; uploads go over QUIC,
//!   or over the MQTT upload path when configured (`upload = "mqtt"`) or, with `upload = "auto"`,
//!   after `switch_after` consecutive QUIC transport failures (QUIC is tried again after
//!   `quic_retry`). An MQTT upload is answered by the matching `ControlEvent::Receipt`, or by
//!   the aggregator's signed refusal (`ControlEvent::UploadRefused`, on the device's
//!   `rejections` topic), which is handed to the lifecycle as the same `Rejection` a QUIC
//!   refusal is; neither within `receipt_timeout` is a transport error, so the outbox re-sends
//!   the same bytes.
//!   Base models are always fetched through the inner (QUIC) client.
//! - Secure aggregation follows the upload path: while uploads go over MQTT, the SecAgg stages
//!   do too, as requests on `devices/<id>/requests` answered on `devices/<id>/answers` (the same
//!   requests and responses as over QUIC, each answer signed by the pinned aggregator key, see
//!   `fedfleet_control::exchange`); a request that does not fit in one MQTT packet (the masked
//!   vector of a model of some 250,000 parameters and more) goes over QUIC. An answer not
//!   received within `receipt_timeout` is a transport error, as for uploads.
//! - [`MqttRegistry`] wraps the [`Registry`] client: every status report is also signed and
//!   published on the device's status topic, and [`heartbeats`] re-publishes the last one
//!   periodically with a fresh `reported_at`.
//!
//! - Rollout notices (`ControlEvent::Rollout`, signed by the registry's timestamp key, which
//!   [`notice_key`] takes from the pinned TUF root) wake [`run_agent_with_wake`], which asks
//!   for the device's signed assignment at once instead of at the next poll. A notice is only a
//!   wake-up: the registry's per-device assignment decides what to install.
//!
//! Reconnecting and backoff are the control client's job.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ed25519_dalek::SigningKey;
use fedfleet_aggregator_client::client::{ClientError, secagg_roster_of, secagg_taken, secagg_view};
use fedfleet_aggregator_client::wire::{MAX_WIRE_MESSAGE, Request, Response, SecAggView};
use fedfleet_control::{ControlClient, ControlEvent, ControlEvents, UploadRejection};
use fedfleet_protocol::{
    DeviceId, DeviceStatus, FleetId, ModelRef, ModelVersion, Receipt, RejectReason, Rejection, RolloutNotice, RoundAnnouncement, RoundId,
    Signed, SignedUpdate,
};
use fedfleet_secagg::Roster;
use serde::Deserialize;
use tokio::sync::{Notify, oneshot};

use crate::clients::{Aggregator, BaseModel, MetadataSet, Registry, TransportError, UploadReply};
use crate::remote::{Ack, agg_err, check_view_receipt};

/// Which path uploads take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UploadPath {
    /// Always QUIC (the MQTT path is never used).
    Quic,
    /// Always the MQTT upload path.
    Mqtt,
    /// QUIC, switching to MQTT after `switch_after` consecutive QUIC transport failures.
    #[default]
    Auto,
}

/// How [`MqttAggregator`] chooses and waits.
#[derive(Debug, Clone)]
pub struct MqttUploadOptions {
    pub path: UploadPath,
    /// Consecutive QUIC transport failures before `Auto` switches to MQTT.
    pub switch_after: u32,
    /// How long an MQTT upload waits for its receipt.
    pub receipt_timeout: Duration,
    /// How long `Auto` stays on MQTT before trying QUIC again.
    pub quic_retry: Duration,
}

impl Default for MqttUploadOptions {
    fn default() -> Self {
        MqttUploadOptions {
            path: UploadPath::Auto,
            switch_after: 3,
            receipt_timeout: Duration::from_secs(30),
            quic_retry: Duration::from_secs(600),
        }
    }
}

#[derive(Default)]
struct Heard {
    round: Mutex<Option<RoundAnnouncement>>,
    receipts: Mutex<Vec<Receipt>>,
    refusals: Mutex<Vec<UploadRejection>>,
    /// A receipt or a refusal arrived.
    receipt_arrived: Notify,
    /// The last verified rollout notice and how many arrived.
    notice: Mutex<Option<RolloutNotice>>,
    notices: AtomicU64,
    /// Woken by every verified round announcement and rollout notice (one stored permit while
    /// nobody waits): the agent acts on it at once instead of at its next poll.
    wake: Arc<Notify>,
    /// Requests waiting for their answer, by id.
    waiting: Mutex<HashMap<u64, oneshot::Sender<Vec<u8>>>>,
}

/// [`Aggregator`] with announcements and an upload path over MQTT; see the module docs.
pub struct MqttAggregator<A> {
    inner: Arc<A>,
    control: ControlClient,
    heard: Arc<Heard>,
    opts: MqttUploadOptions,
    quic_failures: AtomicU32,
    switched_at: Mutex<Option<Instant>>,
    mqtt_uploads: AtomicU32,
    mqtt_acks: Mutex<Vec<Ack>>,
    mqtt_requests: AtomicU32,
}

impl<A: Aggregator> MqttAggregator<A> {
    /// Wraps `inner` and consumes `events` in a task on the current tokio runtime (other events
    /// than announcements and receipts are logged).
    pub fn new(inner: Arc<A>, control: ControlClient, mut events: ControlEvents, opts: MqttUploadOptions) -> Self {
        let heard = Arc::new(Heard::default());
        let h = heard.clone();
        tokio::spawn(async move {
            while let Some(ev) = events.recv().await {
                match ev {
                    ControlEvent::Announcement(s) => {
                        let a = s.body().clone();
                        tracing::info!(round = %a.round, "round announced over MQTT");
                        *h.round.lock().unwrap_or_else(|p| p.into_inner()) = Some(a);
                        h.wake.notify_one();
                    }
                    ControlEvent::Receipt(s) => {
                        let r = s.body().clone();
                        tracing::info!(round = %r.round, "receipt over MQTT");
                        push_recent(&h.receipts, r);
                        h.receipt_arrived.notify_waiters();
                    }
                    ControlEvent::UploadRefused(s) => {
                        let r = s.body().clone();
                        tracing::info!(round = %r.round, reason = %r.reason, detail = %r.detail, "MQTT upload refused by the aggregator");
                        push_recent(&h.refusals, r);
                        h.receipt_arrived.notify_waiters();
                    }
                    ControlEvent::Answer(s) => {
                        let a = s.body();
                        match h.waiting.lock().unwrap_or_else(|p| p.into_inner()).remove(&a.id) {
                            Some(waiter) => drop(waiter.send(a.bytes.clone())),
                            None => tracing::debug!(id = a.id, "an answer to no request waiting (late, or a repeat)"),
                        }
                    }
                    ControlEvent::Rollout(s) => {
                        let n = s.body().clone();
                        tracing::info!(rollout = n.rollout_id, phase = n.phase, action = ?n.action, "rollout notice over MQTT; checking the assignment");
                        *h.notice.lock().unwrap_or_else(|p| p.into_inner()) = Some(n);
                        h.notices.fetch_add(1, Ordering::Relaxed);
                        h.wake.notify_one();
                    }
                    ControlEvent::Connected { count } => tracing::info!(count, "MQTT control plane connected"),
                    ControlEvent::Disconnected { error } => tracing::debug!(%error, "MQTT control plane disconnected"),
                    ControlEvent::Rejected(r) => tracing::warn!(?r, "MQTT message refused"),
                    other => tracing::debug!(?other, "MQTT event ignored"),
                }
            }
        });
        MqttAggregator {
            inner,
            control,
            heard,
            opts,
            quic_failures: AtomicU32::new(0),
            switched_at: Mutex::new(None),
            mqtt_uploads: AtomicU32::new(0),
            mqtt_acks: Mutex::new(Vec::new()),
            mqtt_requests: AtomicU32::new(0),
        }
    }

    pub fn inner(&self) -> &A {
        &self.inner
    }

    pub fn control(&self) -> &ControlClient {
        &self.control
    }

    /// Uploads sent over the MQTT path so far (attempts, not receipts).
    pub fn mqtt_uploads(&self) -> u32 {
        self.mqtt_uploads.load(Ordering::Relaxed)
    }

    /// Requests (secure-aggregation stages) sent over MQTT so far, repeats included.
    pub fn mqtt_requests(&self) -> u32 {
        self.mqtt_requests.load(Ordering::Relaxed)
    }

    /// Every upload acknowledged over the MQTT path so far (by a signed receipt), in order;
    /// uploads over QUIC are recorded by the inner client.
    pub fn mqtt_acks(&self) -> Vec<Ack> {
        self.mqtt_acks.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Notified by every verified round announcement and rollout notice: pass it to
    /// [`run_agent_with_wake`] so the agent joins the round or asks for its assignment at once
    /// instead of at its next poll.
    pub fn wake(&self) -> Arc<Notify> {
        self.heard.wake.clone()
    }

    /// Verified rollout notices received so far, and the last one.
    pub fn rollout_notices(&self) -> (u64, Option<RolloutNotice>) {
        (self.heard.notices.load(Ordering::Relaxed), self.heard.notice.lock().unwrap_or_else(|p| p.into_inner()).clone())
    }

    /// The round last announced over MQTT, if any.
    pub fn announced(&self) -> Option<RoundAnnouncement> {
        self.heard.round.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn use_mqtt(&self) -> bool {
        match self.opts.path {
            UploadPath::Quic => false,
            UploadPath::Mqtt => true,
            UploadPath::Auto => {
                if self.quic_failures.load(Ordering::Relaxed) < self.opts.switch_after.max(1) {
                    return false;
                }
                let mut at = self.switched_at.lock().unwrap_or_else(|p| p.into_inner());
                let since = *at.get_or_insert_with(Instant::now);
                if since.elapsed() >= self.opts.quic_retry {
                    // Give QUIC another chance.
                    *at = None;
                    self.quic_failures.store(0, Ordering::Relaxed);
                    return false;
                }
                true
            }
        }
    }

    /// `request` (and its `attachment`) over MQTT, and the aggregator's answer, within
    /// `receipt_timeout`; `None` when it goes over QUIC: uploads take QUIC now, or it does not
    /// fit in one MQTT packet.
    async fn exchange(&self, request: &Request, attachment: &[u8]) -> Option<Result<Response, TransportError>> {
        if !self.use_mqtt() {
            return None;
        }
        let message = match fedfleet_protocol::messages::encode(request, MAX_WIRE_MESSAGE) {
            Ok(m) => m,
            Err(e) => return Some(Err(TransportError(format!("mqtt request: {e}")))),
        };
        if !self.control.request_fits(&message, attachment) {
            return None;
        }
        let id = rand::random::<u64>();
        let (tx, rx) = oneshot::channel();
        self.heard.waiting.lock().unwrap_or_else(|p| p.into_inner()).insert(id, tx);
        self.mqtt_requests.fetch_add(1, Ordering::Relaxed);
        let attempt = async {
            self.control.send_request(id, &message, attachment).await.map_err(|e| TransportError(format!("mqtt request: {e}")))?;
            rx.await.map_err(|_| TransportError("mqtt request: the control client stopped".into()))
        };
        let answer = tokio::time::timeout(self.opts.receipt_timeout, attempt).await;
        self.heard.waiting.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
        Some(match answer {
            Ok(Ok(bytes)) => fedfleet_protocol::messages::decode::<Response>(&bytes, MAX_WIRE_MESSAGE)
                .map_err(|e| TransportError(format!("mqtt answer: {e}"))),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(TransportError(format!("mqtt request: no answer within {:?}", self.opts.receipt_timeout))),
        })
    }

    fn receipt_key(&self) -> Result<ed25519_dalek::VerifyingKey, TransportError> {
        self.control.aggregator_key().ok_or_else(|| TransportError("the MQTT control client is not a device's".into()))
    }

    async fn upload_mqtt(&self, signed_header: &[u8], payload: &[u8]) -> Result<UploadReply, TransportError> {
        let signed = SignedUpdate::decode(signed_header).map_err(|e| TransportError(format!("mqtt upload: header: {e}")))?;
        let h = signed.body().clone();
        let matches =
            |r: &Receipt| r.round == h.round && r.nonce == h.nonce && r.payload_digest == h.payload_digest && r.device == h.device;
        self.mqtt_uploads.fetch_add(1, Ordering::Relaxed);
        // Queuing the frames can wait while the broker is away (the client's queue is bounded),
        // so the whole attempt, not only the wait for the receipt, is under the time limit.
        let attempt = async {
            self.control.upload_update(&signed, payload).await.map_err(|e| TransportError(format!("mqtt upload: {e}")))?;
            loop {
                let notified = self.heard.receipt_arrived.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if let Some(r) = self.heard.receipts.lock().unwrap_or_else(|p| p.into_inner()).iter().find(|r| matches(r)) {
                    return Ok(UploadReply::Receipt(r.clone()));
                }
                // A refusal answers one attempt (a transient `overloaded` must not answer the next).
                let refused = {
                    let mut refusals = self.heard.refusals.lock().unwrap_or_else(|p| p.into_inner());
                    refusals.iter().position(|r| r.refuses(&h)).map(|i| refusals.remove(i))
                };
                if let Some(r) = refused {
                    return Ok(UploadReply::Rejected(Rejection::new(r.reason, r.detail)));
                }
                notified.await;
            }
        };
        match tokio::time::timeout(self.opts.receipt_timeout, attempt).await {
            Ok(Ok(reply)) => {
                // As over QUIC: a receipt, or a `Replay`/`Duplicate` answer (the aggregator holds
                // the update already), acknowledges it.
                let acked = match &reply {
                    UploadReply::Receipt(_) => Some(true),
                    UploadReply::Rejected(r) if matches!(r.reason, RejectReason::Replay | RejectReason::Duplicate) => Some(false),
                    UploadReply::Rejected(_) => None,
                };
                if let Some(receipt) = acked {
                    self.mqtt_acks.lock().unwrap_or_else(|p| p.into_inner()).push(Ack {
                        device: h.device.clone(),
                        round: h.round,
                        nonce: h.nonce,
                        payload_digest: h.payload_digest,
                        receipt,
                    });
                }
                Ok(reply)
            }
            Ok(Err(e)) => Err(e),
            Err(_) => Err(TransportError(format!("mqtt upload: no receipt within {:?}", self.opts.receipt_timeout))),
        }
    }
}

impl<A: Aggregator> Aggregator for MqttAggregator<A> {
    async fn current_round(&self, fleet: &FleetId) -> Result<Option<RoundAnnouncement>, TransportError> {
        if let Some(a) = self.announced().filter(|a| &a.fleet == fleet) {
            return Ok(Some(a));
        }
        self.inner.current_round(fleet).await
    }

    async fn fetch_base_model(&self, model: &ModelRef) -> Result<BaseModel, TransportError> {
        self.inner.fetch_base_model(model).await
    }

    // Secure aggregation's stages take the upload path (see the module docs).
    async fn secagg_roster(&self, round: RoundId) -> Result<Roster, TransportError> {
        match self.exchange(&Request::SecAggRoster { round }, &[]).await {
            Some(answer) => secagg_roster_of(answer?, round, &self.receipt_key()?).map_err(agg_err),
            None => self.inner.secagg_roster(round).await,
        }
    }

    async fn secagg_send(&self, message: &[u8], vector: &[u8]) -> Result<Result<(), Rejection>, TransportError> {
        let request = Request::SecAggSend { message: message.to_vec(), vector_len: vector.len() as u64 };
        match self.exchange(&request, vector).await {
            Some(answer) => match secagg_taken(answer?) {
                Ok(()) => Ok(Ok(())),
                Err(ClientError::Refused(r)) => Ok(Err(r)),
                Err(e) => Err(agg_err(e)),
            },
            None => self.inner.secagg_send(message, vector).await,
        }
    }

    async fn secagg_poll(&self, round: RoundId) -> Result<SecAggView, TransportError> {
        match self.exchange(&Request::SecAggPoll { round }, &[]).await {
            Some(answer) => check_view_receipt(secagg_view(answer?).map_err(agg_err)?, &self.receipt_key()?),
            None => self.inner.secagg_poll(round).await,
        }
    }

    async fn upload(&self, signed_header: &[u8], payload: &[u8]) -> Result<UploadReply, TransportError> {
        if self.use_mqtt() {
            return self.upload_mqtt(signed_header, payload).await;
        }
        match self.inner.upload(signed_header, payload).await {
            Ok(r) => {
                self.quic_failures.store(0, Ordering::Relaxed);
                Ok(r)
            }
            Err(e) => {
                let n = self.quic_failures.fetch_add(1, Ordering::Relaxed) + 1;
                if self.opts.path == UploadPath::Auto && n >= self.opts.switch_after.max(1) {
                    tracing::warn!(failures = n, error = %e, "QUIC uploads failing; switching to the MQTT upload path");
                }
                Err(e)
            }
        }
    }
}

/// [`Registry`] that also publishes every status report, signed, over MQTT.
pub struct MqttRegistry<R> {
    inner: Arc<R>,
    status: StatusPublisher,
}

/// Signs and publishes device status on the device's status topic; remembers the last one for
/// [`heartbeats`].
#[derive(Clone)]
pub struct StatusPublisher {
    control: ControlClient,
    key: SigningKey,
    last: Arc<Mutex<Option<DeviceStatus>>>,
}

impl StatusPublisher {
    pub fn new(control: ControlClient, key: SigningKey) -> Self {
        StatusPublisher { control, key, last: Arc::new(Mutex::new(None)) }
    }

    /// Signs and publishes `status` (queued; the control client republishes it on reconnect).
    pub async fn publish(&self, status: &DeviceStatus) -> Result<(), TransportError> {
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Some(status.clone());
        let signed = Signed::sign(status.clone(), &self.key);
        self.control.publish_status(&signed).await.map_err(|e| TransportError(format!("mqtt status: {e}")))
    }

    /// The last status published, if any.
    pub fn last(&self) -> Option<DeviceStatus> {
        self.last.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl<R: Registry> MqttRegistry<R> {
    pub fn new(inner: Arc<R>, status: StatusPublisher) -> Self {
        MqttRegistry { inner, status }
    }

    pub fn publisher(&self) -> &StatusPublisher {
        &self.status
    }
}

impl<R: Registry> Registry for MqttRegistry<R> {
    async fn metadata(&self, have_root_version: u64) -> Result<MetadataSet, TransportError> {
        self.inner.metadata(have_root_version).await
    }
    async fn assignment(&self, device: &DeviceId) -> Result<Option<RolloutNotice>, TransportError> {
        self.inner.assignment(device).await
    }
    async fn download(&self, name: &str, version: ModelVersion, offset: u64, max_len: u32) -> Result<Vec<u8>, TransportError> {
        self.inner.download(name, version, offset, max_len).await
    }
    async fn model_info(&self, name: &str, version: ModelVersion) -> Result<fedfleet_protocol::ModelInfo, TransportError> {
        self.inner.model_info(name, version).await
    }
    /// Delivered if either path took it.
    async fn report(&self, status: &DeviceStatus) -> Result<(), TransportError> {
        let mqtt = self.status.publish(status).await;
        let quic = self.inner.report(status).await;
        match (mqtt, quic) {
            (Err(a), Err(b)) => Err(TransportError(format!("{a}; {b}"))),
            _ => Ok(()),
        }
    }
}

/// Re-publishes the last status every `interval` with a fresh `reported_at` (a heartbeat), or
/// `initial` (re-stamped) while nothing has been reported yet. Runs until the task is dropped.
pub async fn heartbeats(publisher: StatusPublisher, initial: DeviceStatus, interval: Duration, now_ms: impl Fn() -> u64) {
    let mut tick = tokio::time::interval(interval);
    loop {
        tick.tick().await;
        let mut s = publisher.last().unwrap_or_else(|| initial.clone());
        s.reported_at_unix_ms = now_ms();
        if let Err(e) = publisher.publish(&s).await {
            tracing::debug!(error = %e, "heartbeat not published");
        }
    }
}

/// The key rollout notices are signed with: the registry's online (timestamp) key, which the
/// root lists in its timestamp role and which also signs assignments. `None` when the role does
/// not name exactly one usable key (notices are then refused; the agent still polls).
pub fn notice_key(root: &fedfleet_protocol::tuf::SignedMetadata<fedfleet_protocol::tuf::Root>) -> Option<ed25519_dalek::VerifyingKey> {
    let root = root.body_unverified().ok()?;
    let mut ids = root.timestamp.keyids.iter();
    let (Some(id), None) = (ids.next(), ids.next()) else { return None };
    let k = root.keys.get(id)?;
    ed25519_dalek::VerifyingKey::from_bytes(&k.public).ok()
}

/// [`run_agent`](crate::agent::run_agent), also woken by `wake` (a round announcement or a
/// rollout notice): the agent then polls at once instead of sleeping out `poll`.
/// Only the sleep between polls is cut short; work in progress is never interrupted.
pub async fn run_agent_with_wake<A: Aggregator, R: Registry>(
    agent: &mut crate::agent::Agent<A, R>,
    poll: Duration,
    wake: Arc<Notify>,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), crate::lifecycle::AgentError> {
    tokio::pin!(shutdown);
    loop {
        let mut woken = false;
        let stop_or_wake = async {
            tokio::select! {
                _ = &mut shutdown => {}
                _ = wake.notified() => woken = true,
            }
        };
        crate::agent::run_agent(agent, poll, stop_or_wake).await?;
        if !woken {
            return Ok(());
        }
        tracing::debug!("woken by the control plane");
    }
}

/// Keeps the last 64 answers (receipts, refusals) for the uploader to match.
fn push_recent<T>(list: &std::sync::Mutex<Vec<T>>, item: T) {
    let mut g = list.lock().unwrap_or_else(|p| p.into_inner());
    g.push(item);
    let n = g.len();
    if n > 64 {
        g.drain(..n - 64);
    }
}
