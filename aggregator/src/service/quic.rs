//! The QUIC shell: bind, the accept loop with graceful shutdown, and one request per stream.

use super::*;
use fedfleet_net::admission::{Admission, AdmissionConfig, Refused};

/// Which of the service's QUIC endpoints a connection came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Listener {
    /// `listen`: devices, operators and services.
    Fleet,
    /// `operator_listen`: operators and services only.
    Operators,
}

impl Aggregator {
    /// Binds the QUIC endpoint of the config.
    pub fn bind(&self, addr: SocketAddr) -> Result<quinn::Endpoint, ServiceError> {
        let (ca, id) = (&self.shared.ca, &self.shared.identity);
        let clock = self.shared.clock.clone();
        let tls = fedfleet_certs::tls::server_config_at(
            ca,
            id,
            self.shared.revocation.clone(),
            &[fedfleet_certs::ALPN_V1],
            fedfleet_certs::tls::clock_time(move || clock.now_ms()),
        )?;
        // Clients of a crashed predecessor are reset at once (keys seeded from this identity).
        let secret = id.derive_secret("fedfleet-aggregator 2026 QUIC endpoint");
        Ok(fedfleet_net::server_endpoint_restartable(addr, tls, &secret)?)
    }

    /// The operator console's HTTPS config: this service's certificate; client certificates of
    /// the fleet CA optional (revoked devices refused in the handshake).
    pub fn console_tls(&self) -> Result<rustls::ServerConfig, ServiceError> {
        let clock = self.shared.clock.clone();
        Ok(fedfleet_certs::tls::console_server_config(
            &self.shared.ca,
            &self.shared.identity,
            self.shared.revocation.clone(),
            fedfleet_certs::tls::clock_time(move || clock.now_ms()),
        )?)
    }

    /// Serves `endpoint` (and `operators`, the operators' own endpoint, if any) until `shutdown`
    /// is triggered, then lets in-flight requests finish.
    pub async fn run(self, endpoint: quinn::Endpoint, operators: Option<quinn::Endpoint>, shutdown: fedfleet_net::Shutdown) {
        let driver = {
            let me = self.clone();
            let stop = shutdown.wait();
            tokio::spawn(async move {
                tokio::select! {
                    _ = me.drive() => {}
                    _ = me.follow_parent(), if me.shared.cfg.relay.is_some() => {}
                    _ = stop => {}
                }
            })
        };
        let limits = self.shared.cfg.admission;
        let fleet = AdmissionConfig {
            retry_after: Duration::from_millis(limits.retry_after_ms),
            ..AdmissionConfig::for_devices(limits.max_connections)
        };
        // The operators' endpoint admits a few devices only to tell them they are at the wrong
        // address (a device pool of 0 would say `overloaded`, and they would retry forever).
        let operators = operators.map(|endpoint| {
            let me = self.clone();
            let stop = shutdown.clone();
            let admission = AdmissionConfig { handshakes: 64, per_source: 16, devices: 4, ..fleet };
            tokio::spawn(async move { me.serve(endpoint, admission, Listener::Operators, stop).await })
        });
        self.serve(endpoint, fleet, Listener::Fleet, shutdown.clone()).await;
        if let Some(task) = operators {
            let _ = task.await;
        }
        let _ = driver.await;
        tracing::info!("stopped");
    }

    /// One endpoint's accept loop, then the drain of its connections once `shutdown` fires (or
    /// the endpoint closes by itself: every task of the service stops either way).
    async fn serve(&self, endpoint: quinn::Endpoint, admission: AdmissionConfig, listener: Listener, shutdown: fedfleet_net::Shutdown) {
        let admission = Admission::new(admission);
        let handlers = fedfleet_net::serve::accept_until(
            &endpoint,
            admission.config().total(),
            shutdown.wait(),
            || self.shared.metrics.rejected(RejectReason::Overloaded),
            |incoming| {
                let me = self.clone();
                let stop = shutdown.clone();
                let admission = admission.clone();
                // Boxed, as is the handshake below: a task is the size of its largest state for
                // as long as it lives, and a device may hold its connection for hours.
                let incoming = Box::new(incoming);
                async move { me.connection(incoming, &admission, listener, stop).await }
            },
        )
        .await;
        tracing::info!(?listener, "shutting down: no new connections");
        shutdown.trigger();
        // In-flight uploads finish (their handlers stop taking new streams), but not forever.
        fedfleet_net::serve::drain(&endpoint, handlers, Duration::from_secs(20)).await;
    }

    pub(super) async fn connection(
        &self,
        incoming: Box<quinn::Incoming>,
        admission: &Admission,
        listener: Listener,
        shutdown: fedfleet_net::Shutdown,
    ) {
        // The handshake's state (its Initial packet, the handshake, its timer) lives on the heap
        // while it lasts, not in every held connection's task (measured at the peak of a burst:
        // 4.7 KB a connection's task with it inline, 1.5 KB without).
        let Some((admitted, peer, peer_key)) = Box::pin(self.admit_connection(*incoming, admission, listener)).await else {
            return;
        };
        let conn = &admitted.conn;
        // The connection's handler ends when its in-flight streams do (graceful shutdown).
        let mut streams = tokio::task::JoinSet::new();
        let stop = shutdown.wait();
        tokio::pin!(stop);
        loop {
            let (send, recv) = tokio::select! {
                r = conn.accept_bi() => match r {
                    Ok(s) => s,
                    Err(_) => break,
                },
                // A finished stream's task is let go at once: until joined it holds memory the
                // size of the stream's future, and a held connection's next stream may be a
                // round away (measured: ~12 KB a connection, 117 MiB at ten thousand).
                Some(_) = streams.join_next(), if !streams.is_empty() => continue,
                _ = &mut stop => break,
            };
            let me = self.clone();
            let peer = peer.clone();
            streams.spawn(async move {
                let mut stream = FramedStream::new(send, recv);
                me.stream(&peer, peer_key, &mut stream).await;
            });
        }
        while streams.join_next().await.is_some() {}
    }

    /// The handshake, the peer's identity and where it may connect: the admitted connection,
    /// its peer and (for a service) its certificate's key, or `None` when it was refused.
    async fn admit_connection(
        &self,
        incoming: quinn::Incoming,
        admission: &Admission,
        listener: Listener,
    ) -> Option<(fedfleet_net::admission::Admitted, PeerIdentity, Option<ed25519_dalek::VerifyingKey>)> {
        let admitted = match admission.admit(incoming, fedfleet_net::peer::class).await {
            Ok(a) => a,
            Err(Refused::HandshakeFailed(e)) => {
                tracing::debug!(error = %e, "handshake failed");
                return None;
            }
            Err(r @ (Refused::HandshakeTimeout | Refused::Retried)) => {
                tracing::debug!(refused = ?r, "handshake not finished");
                return None;
            }
            Err(r) => {
                tracing::debug!(refused = ?r, "connection refused: overloaded");
                self.shared.metrics.rejected(RejectReason::Overloaded);
                return None;
            }
        };
        let conn = &admitted.conn;
        let peer = match fedfleet_net::peer::checked_identity(conn, self.shared.clock.now_ms()) {
            Ok(p) => p,
            Err(refused) => {
                tracing::info!(?refused, "connection refused after its handshake");
                if matches!(refused, fedfleet_net::peer::PeerRefusal::Expired(_)) {
                    self.shared.metrics.rejected(RejectReason::CertificateExpired);
                }
                return None;
            }
        };
        if matches!(peer, PeerIdentity::Device(_)) {
            self.shared.metrics.device_connections.inc();
        }
        // A relay (a service) signs its partial sums with its certificate's key; a device's
        // connection has no use for it.
        let peer_key = matches!(peer, PeerIdentity::Service(_))
            .then(|| fedfleet_net::peer::certificates(conn))
            .flatten()
            .and_then(|chain| chain.first().and_then(|leaf| fedfleet_certs::certificate_key(leaf).ok()));
        if listener == Listener::Operators && matches!(peer, PeerIdentity::Device(_)) {
            conn.close(1u32.into(), b"not_permitted: devices connect on the aggregator's `listen` address, not `operator_listen`");
            self.shared.metrics.rejected(RejectReason::NotPermitted);
            return None;
        }
        Some((admitted, peer, peer_key))
    }

    pub(super) async fn stream(&self, peer: &PeerIdentity, peer_key: Option<ed25519_dalek::VerifyingKey>, stream: &mut FramedStream) {
        let first = match stream.recv().await {
            Ok(Some(f)) => f,
            Ok(None) => return,
            Err(e) => {
                tracing::debug!(error = %e, "bad first frame");
                self.shared.metrics.rejected(RejectReason::Malformed);
                return;
            }
        };
        match first.kind {
            FrameKind::Signed => {
                let answer = match SignedUpdate::decode(&first.body) {
                    Ok(update) => self.ingest(peer, update, Payload::Quic(stream)).await,
                    Err(e) => match fedfleet_protocol::SignedRelay::decode(&first.body) {
                        Ok(partial) => self.ingest_relay(peer, peer_key, partial, Payload::Quic(stream)).await,
                        Err(_) => Err(reject(e.reason(), e.to_string())),
                    },
                };
                let sent = match answer {
                    Ok(receipt) => stream.send(FrameKind::Signed, &receipt.encode()).await,
                    Err(r) => {
                        self.shared.metrics.rejected(r.reason);
                        tracing::info!(peer = ?peer, reason = %r.reason, detail = %r.detail, "update refused");
                        let body = Message::Rejection(r).encode().expect("rejection encodes");
                        stream.send(FrameKind::Message, &body).await
                    }
                };
                if let Err(e) = sent {
                    tracing::debug!(error = %e, "answer not delivered");
                }
                stream.finish();
            }
            FrameKind::Message => {
                // A connection made before the revocation keeps no access: the signed list is
                // checked at every request, as at every handshake and every ingest.
                let revoked = matches!(peer, PeerIdentity::Device(id) if self.shared.revocation.is_revoked(id));
                let resp = match messages::decode::<Request>(&first.body, MAX_WIRE_MESSAGE) {
                    Ok(_) if revoked => Some(Response::Error(reject(RejectReason::Revoked, "this device's certificate is revoked"))),
                    Ok(req) => self.request(peer, req, stream).await,
                    Err(e) => Some(Response::Error(reject(e.reason(), e.to_string()))),
                };
                if let Some(resp) = resp {
                    if let Response::Error(r) = &resp {
                        self.shared.metrics.rejected(r.reason);
                    }
                    let body = messages::encode(&resp, MAX_WIRE_MESSAGE).expect("response encodes");
                    let _ = stream.send(FrameKind::Message, &body).await;
                }
                stream.finish();
            }
            _ => {
                self.shared.metrics.rejected(RejectReason::Malformed);
                let r = reject(RejectReason::Malformed, "a stream starts with a Signed or Message frame");
                let _ = stream.send(FrameKind::Message, &Message::Rejection(r).encode().expect("encodes")).await;
                stream.finish();
            }
        }
    }

    /// A held model's bytes, checked against its digest when read from the store; the last one
    /// read is kept in memory, since a round's devices all ask for the same base.
    async fn model_bytes(&self, digest: Digest) -> Result<Arc<Vec<u8>>, String> {
        let served = &self.shared.served_model;
        if let Some((d, bytes)) = &*served.lock().unwrap_or_else(|p| p.into_inner())
            && *d == digest
        {
            return Ok(bytes.clone());
        }
        let me = self.clone();
        let read = tokio::task::spawn_blocking(move || me.shared.store.read_model(&digest)).await;
        let bytes = Arc::new(read.map_err(|e| e.to_string())?.map_err(|e| e.to_string())?);
        *served.lock().unwrap_or_else(|p| p.into_inner()) = Some((digest, bytes.clone()));
        Ok(bytes)
    }

    /// Handles a non-upload request. `None` when the answer was already sent (a model).
    pub(super) async fn request(&self, peer: &PeerIdentity, req: Request, stream: &mut FramedStream) -> Option<Response> {
        let is_operator = matches!(peer, PeerIdentity::Service(n) if self.shared.cfg.operators.contains(n));
        match req {
            Request::GetRound => {
                self.shared.metrics.round_polls.inc();
                let core = self.lock();
                Some(Response::Round {
                    announcement: core.campaign.announcement.clone(),
                    receipt_key: self.shared.key.verifying_key().to_bytes(),
                })
            }
            Request::GetModel { digest } => {
                let known = self.shared.store.model_record(&digest).ok().flatten();
                let Some(rec) = known else {
                    return Some(Response::Error(reject(RejectReason::UnknownRound, format!("no model {digest}"))));
                };
                let bytes = match self.model_bytes(digest).await {
                    Ok(b) => b,
                    Err(e) => return Some(Response::Error(reject(RejectReason::Internal, e))),
                };
                let head = Response::Model { spec: rec.spec.to_string(), length: bytes.len() as u64 };
                let body = messages::encode(&head, MAX_WIRE_MESSAGE).expect("encodes");
                if stream.send(FrameKind::Message, &body).await.is_err() {
                    return None;
                }
                // Counted as served once the whole model, its `End` too, is sent.
                if stream.send_payload(&bytes).await.is_ok() {
                    self.shared.metrics.base_models_served.inc();
                }
                None
            }
            Request::CampaignStart(_) | Request::CampaignStatus | Request::CampaignStop if !is_operator => {
                Some(Response::Error(reject(RejectReason::NotPermitted, "campaign requests need an operator service certificate")))
            }
            Request::CampaignStart(o) => Some(match self.start_campaign(o).await {
                Ok(s) => Response::Status(s),
                Err(e) => Response::Error(reject(RejectReason::Internal, e)),
            }),
            Request::CampaignStatus => Some(Response::Status(self.status())),
            Request::SecAggRoster { round } => Some(self.secagg_roster(peer, round)),
            Request::SecAggPoll { round } => Some(self.secagg_poll(peer, round)),
            Request::SecAggSend { message, vector_len } => {
                Some(self.secagg_message(peer, &message, vector_len, secagg::Attached::Streamed(stream)).await)
            }
            Request::CampaignStop => Some(match self.stop_campaign() {
                Ok(s) => Response::Status(s),
                Err(e) => Response::Error(reject(RejectReason::Internal, e)),
            }),
        }
    }
}
