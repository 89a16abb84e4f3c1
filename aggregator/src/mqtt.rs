//! The MQTT control plane of the service (`fedfleet-control`), next to QUIC ingest:
//!
//! * `mode = "embedded"`: an [`EmbeddedBroker`] on `listen` with the fleet CA and this service's
//!   certificate; `external`: a broker at `host`:`port`.
//! * A [`ControlClient`] with [`Role::Service`] (allow-list keys, status and updates): every
//!   round the service opens is published as its signed `RoundAnnouncement` (retained, the same
//!   bytes `GetRound` serves over QUIC); every [`ControlEvent::Update`] goes through
//!   [`Aggregator::ingest`] — the same checks, fold and commit as a QUIC upload — and an accepted
//!   update (or a resend of one) gets its signed receipt on `devices/<id>/receipts`; every
//!   verified status updates presence (devices online / last seen in the metrics).
//! * An update (or a secure-aggregation request's masked vector) waits for its share of
//!   `[admission] max_bytes_in_flight` before its ingest starts ([`Aggregator::wait_for_bytes`]):
//!   its payload is in memory already, so it is not refused as `overloaded` as a QUIC upload is;
//!   while the budget is spent no further event is read, and the broker queues the fleet's
//!   uploads. It waits half the connection's keep-alive at most (meanwhile the control client
//!   sends no ping); past that it is refused as `overloaded`, with the retry-after.
//! * Refusals (by the control client or by ingest) are counted by reason in
//!   `fedfleet_aggregator_mqtt_rejected_total`. An upload refused by ingest (its signed header
//!   and payload digest verified, so the refusal is about what the device signed) is answered with
//!   a [`SignedRejection`] on `devices/<id>/rejections`, signed with the receipt key, which the
//!   device's lifecycle handles like a QUIC refusal. Uploads the control client refuses (bad
//!   signature, digest mismatch: possibly forged or damaged by the broker) get no answer; the
//!   device re-sends.
//! * A device's request ([`ControlEvent::Request`]: its secure-aggregation stages, when it
//!   uploads over MQTT) goes to [`Aggregator::secagg_over_mqtt`], the same handlers as over QUIC;
//!   the response is published as a [`SignedAnswer`] on `devices/<id>/answers`, signed with the
//!   receipt key. Requests are counted by outcome in `fedfleet_aggregator_mqtt_requests_total`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use ed25519_dalek::SigningKey;
use fedfleet_certs::PeerIdentity;
use fedfleet_control::{
    Answer, AssemblerLimits, BrokerConfig, ClientKind, ControlClient, ControlEvent, EmbeddedBroker, Role, SignedAnswer, SignedRejection,
    UploadRejection, service_tls,
};
use fedfleet_protocol::{FleetId, RoundAnnouncement, Signed, messages};
use tokio::task::JoinHandle;

use crate::config::{MQTT_CLIENT_ID, MqttConfig, MqttMode};
use crate::service::{Aggregator, Payload, ServiceError};
use crate::wire::{MAX_WIRE_MESSAGE, Response};

/// The running control plane; [`Mqtt::shutdown`] stops it.
pub struct Mqtt {
    broker: Option<EmbeddedBroker>,
    /// How the embedded broker was started, with the port it got, for [`Mqtt::restart_broker`].
    broker_config: Option<BrokerConfig>,
    client: ControlClient,
    /// Publishes the round announcements.
    announcer: JoinHandle<()>,
    /// Handles what the control client hands up.
    events: JoinHandle<()>,
}

impl Mqtt {
    /// The embedded broker's fleet-facing address (with the port picked for port 0).
    pub fn broker_addr(&self) -> Option<SocketAddr> {
        self.broker.as_ref().map(|b| b.local_addr())
    }

    pub fn client(&self) -> &ControlClient {
        &self.client
    }

    /// Stops the embedded broker: every client's connection drops (clients keep retrying) and
    /// retained messages are gone, as when a real broker goes down. [`Mqtt::start_broker`] brings
    /// a fresh one back on the same address. Does nothing in external mode or when stopped.
    pub async fn stop_broker(&mut self) {
        if let Some(b) = self.broker.take() {
            b.shutdown().await;
            tracing::info!("embedded MQTT broker stopped");
        }
    }

    /// Starts a fresh embedded broker on the address of the first one, if it is stopped; clients
    /// (this service's included) reconnect by themselves and republish what they retain.
    /// Returns the broker's address (`None` in external mode).
    pub async fn start_broker(&mut self) -> Result<Option<SocketAddr>, ServiceError> {
        let Some(cfg) = self.broker_config.clone() else { return Ok(None) };
        if let Some(b) = &self.broker {
            return Ok(Some(b.local_addr()));
        }
        // Retry briefly in case the OS is slow to let the old listener's port go.
        let mut tries = 0;
        let broker = loop {
            match EmbeddedBroker::start(cfg.clone()).await {
                Ok(b) => break b,
                Err(fedfleet_control::BrokerError::Listen { .. }) if tries < 50 => {
                    tries += 1;
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
                Err(e) => return Err(mqtt_err(format!("starting the embedded broker on {}: {e}", cfg.listen))),
            }
        };
        let addr = broker.local_addr();
        self.broker = Some(broker);
        tracing::info!(%addr, "embedded MQTT broker started again");
        Ok(Some(addr))
    }

    /// [`Mqtt::stop_broker`] then [`Mqtt::start_broker`] (e.g. after new broker certificates
    /// were written to disk).
    pub async fn restart_broker(&mut self) -> Result<Option<SocketAddr>, ServiceError> {
        self.stop_broker().await;
        self.start_broker().await
    }

    pub async fn shutdown(self) {
        self.client.shutdown().await;
        for task in [self.announcer, self.events] {
            task.abort();
            let _ = task.await;
        }
        if let Some(b) = self.broker {
            b.shutdown().await;
        }
    }
}

fn mqtt_err(e: impl std::fmt::Display) -> ServiceError {
    ServiceError::Mqtt(e.to_string())
}

/// Starts the broker (embedded mode) and the service's control client for `agg`.
pub async fn start(agg: &Aggregator, cfg: &MqttConfig) -> Result<Option<Mqtt>, ServiceError> {
    let scfg = agg.config();
    let pki = &scfg.pki_dir;
    let allow = agg.allow_list();
    let fleet: FleetId = allow.fleet();
    let fleet = cfg.client.fleet(&fleet).map_err(mqtt_err)?;
    let (broker, broker_config, host, port) = match cfg.mode {
        MqttMode::Off => return Ok(None),
        MqttMode::Embedded => {
            let (crt, key) = fedfleet_certs::layout::server_paths(pki, &scfg.server_identity);
            let mut bc = BrokerConfig::new(cfg.listen, fedfleet_certs::layout::ca_cert(pki), crt, key);
            bc.metrics = agg.metrics().broker.clone();
            bc.max_connections = cfg.max_connections;
            let broker =
                EmbeddedBroker::start(bc.clone()).await.map_err(|e| mqtt_err(format!("embedded broker on {}: {e}", cfg.listen)))?;
            // A restart listens where this one does (the port picked for port 0 included).
            bc.listen = broker.local_addr();
            let mut addr = broker.local_addr();
            if addr.ip().is_unspecified() {
                addr.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
            }
            (Some(broker), Some(bc), addr.ip().to_string(), addr.port())
        }
        MqttMode::External => {
            let (host, port) = cfg.client.address().map_err(mqtt_err)?;
            (None, None, host, port)
        }
    };
    let receipt_key = agg.receipt_signing_key();
    let tls = service_tls(agg.ca(), agg.identity()).map_err(mqtt_err)?;
    let role = Role::Service { keys: allow, status: true, updates: true, limits: AssemblerLimits::default() };
    let options = cfg.client.options(ClientKind::Service(MQTT_CLIENT_ID), host.clone(), port, fleet).map_err(mqtt_err)?;
    // Half the keep-alive: the broker drops a client silent for 1.5 of it, and with a clean
    // session the uploads it queued for the service.
    let budget_wait = options.keep_alive / 2;
    let (client, mut events) = ControlClient::start(options, tls, role);
    let metrics = agg.metrics();
    metrics.presence_ttl_ms.store(cfg.presence_ttl_secs.saturating_mul(1000), Relaxed);
    tracing::info!(%host, port, mode = ?cfg.mode, "MQTT control plane started");

    // Two tasks: the events task may wait for the byte budget, and while it does the control
    // client stops; an announcement waiting to be published must not wait behind it.
    let announcer = {
        let client = client.clone();
        let mut ann = agg.announcements();
        let every = std::time::Duration::from_secs(cfg.announce_every_secs);
        tokio::spawn(async move {
            // The current round first (after a restart mid-round), then every change, and again
            // every `announce_every_secs` for devices that missed it.
            let mut current = ann.borrow_and_update().clone();
            let mut again = (!every.is_zero()).then(|| tokio::time::interval_at(tokio::time::Instant::now() + every, every));
            loop {
                if let Some(bytes) = current.take() {
                    match Signed::<RoundAnnouncement>::decode(&bytes) {
                        Ok(s) => {
                            if let Err(e) = client.publish_announcement(&s).await {
                                tracing::warn!(error = %e, "announcement not published over MQTT");
                            }
                        }
                        Err(e) => tracing::error!(error = %e, "own announcement does not decode"),
                    }
                }
                tokio::select! {
                    changed = ann.changed() => {
                        if changed.is_err() { break; }
                        current = ann.borrow_and_update().clone();
                    }
                    _ = async { again.as_mut().expect("guarded").tick().await }, if again.is_some() => {
                        current = ann.borrow().clone();
                    }
                }
            }
        })
    };
    let handler = {
        let agg = agg.clone();
        let client = client.clone();
        tokio::spawn(async move {
            while let Some(ev) = events.recv().await {
                handle(&agg, &client, &receipt_key, budget_wait, ev).await;
            }
        })
    };
    Ok(Some(Mqtt { broker, broker_config, client, announcer, events: handler }))
}

/// `budget_wait`: how long an upload waits for its share of the byte budget (while it waits, the
/// control client reads nothing and sends no keep-alive) before it is refused as `overloaded`.
async fn handle(agg: &Aggregator, client: &ControlClient, receipt_key: &Arc<SigningKey>, budget_wait: Duration, ev: ControlEvent) {
    let metrics = agg.metrics();
    match ev {
        ControlEvent::Connected { count } => {
            metrics.mqtt_connected.set(1);
            tracing::info!(count, "MQTT connected");
        }
        ControlEvent::Disconnected { error } => {
            metrics.mqtt_connected.set(0);
            tracing::warn!(%error, "MQTT disconnected; reconnecting");
        }
        ControlEvent::Status(s) => metrics.status(s.body(), agg.now_ms()),
        ControlEvent::Rejected(r) => {
            metrics.mqtt_rejected(r.reason);
            tracing::info!(topic = %r.topic, device = ?r.device, reason = %r.reason, detail = %r.detail, "MQTT message refused");
        }
        ControlEvent::Update(v) => {
            // The update's share of the in-flight budget first, waiting here: while it is spent,
            // this loop reads no further event, the control client stops reading, and the broker
            // queues the fleet's uploads (its `max_queued_messages` must hold a round's burst).
            let in_flight = agg.wait_for_bytes(v.signed().body().payload_len, budget_wait).await;
            // Off the event loop: ingest folds on a blocking thread and commits to disk.
            let agg = agg.clone();
            let client = client.clone();
            let key = receipt_key.clone();
            tokio::spawn(async move {
                let device = v.device().clone();
                let peer = PeerIdentity::Device(device.clone());
                let header = v.signed().body().clone();
                let outcome = match in_flight {
                    Ok(in_flight) => {
                        // Boxed, so that the task waiting below to publish the answer keeps none of it.
                        let outcome = Box::pin(agg.ingest(&peer, v.signed().clone(), Payload::Mqtt(Box::new(v), &in_flight))).await;
                        // The share goes back before the answer is published: publishing waits for
                        // the control client, which waits while the events task waits for the budget.
                        drop(in_flight);
                        outcome
                    }
                    Err(overloaded) => Err(overloaded),
                };
                match outcome {
                    Ok(receipt) => {
                        if let Err(e) = client.publish_receipt(&receipt).await {
                            tracing::warn!(device = %device, error = %e, "receipt not published; the device will resend");
                        }
                    }
                    Err(r) => {
                        let m = agg.metrics();
                        m.rejected(r.reason);
                        m.mqtt_rejected(r.reason);
                        tracing::info!(device = %device, reason = %r.reason, detail = %r.detail, "MQTT update refused");
                        let refusal = SignedRejection::sign(UploadRejection::of(&header, r.reason, r.detail, agg.now_ms()), &key);
                        if let Err(e) = client.publish_rejection(&refusal).await {
                            tracing::warn!(device = %device, error = %e, "rejection not published; the device will resend");
                        }
                    }
                }
            });
        }
        ControlEvent::Request(r) => {
            let agg = agg.clone();
            let client = client.clone();
            let key = receipt_key.clone();
            // A masked vector waits for its budget share like an update.
            let in_flight = match r.attachment.len() {
                0 => Ok(None),
                len => agg.wait_for_bytes(len as u64, budget_wait).await.map(Some),
            };
            tokio::spawn(async move {
                let response = match in_flight {
                    Ok(in_flight) => agg.secagg_over_mqtt(&r.device, &r.message, &r.attachment, in_flight.as_ref()).await,
                    Err(overloaded) => Response::Error(overloaded),
                };
                let outcome = match &response {
                    Response::Error(e) => e.reason.as_str(),
                    _ => "answered",
                };
                agg.metrics().mqtt_request(outcome);
                let bytes = match messages::encode(&response, MAX_WIRE_MESSAGE) {
                    Ok(b) => b,
                    Err(e) => return tracing::error!(device = %r.device, error = %e, "an MQTT answer does not encode"),
                };
                let answer =
                    SignedAnswer::sign(Answer { fleet: agg.allow_list().fleet(), device: r.device.clone(), id: r.id, bytes }, &key);
                if let Err(e) = client.publish_answer(&answer).await {
                    tracing::warn!(device = %r.device, error = %e, "answer not published; the device will ask again");
                }
            });
        }
        // A service does not subscribe to these.
        ControlEvent::Announcement(_)
        | ControlEvent::Rollout(_)
        | ControlEvent::Receipt(_)
        | ControlEvent::UploadRefused(_)
        | ControlEvent::Answer(_) => {}
    }
}
