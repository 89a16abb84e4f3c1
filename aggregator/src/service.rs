//! The service shell: QUIC ingest, the round driver, sled state and publishing around the
//! sans-IO [`Coordinator`].
//!
//! Shaped like mini-redis: [`Aggregator::run`] `select!`s the accept loop against a shutdown
//! future; every connection and stream handler holds a clone of a completion sender, and
//! shutdown stops accepting, lets in-flight requests finish (each commit point is atomic, so a
//! cut-off upload simply gets no receipt), then flushes.
//!
//! One lock ([`Core`], a `std` mutex never held across an `.await`) guards the coordinator. An
//! upload does every check it can without it (identity, signature, size, digest, decoding,
//! layout, finite values) and takes it for admission + fold + commit, so the engine sees
//! updates one at a time. CPU-heavy work runs in `spawn_blocking`.
//!
//! See [`crate::wire`] for the protocol and [`crate::persist`] for the commit points.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ed25519_dalek::SigningKey;
use fedfleet_certs::{AllowList, DeviceStatus, PeerIdentity};
use fedfleet_learning::{Dataset, ModelSpec};
use fedfleet_net::FramedStream;
use fedfleet_protocol::framing::{Frame, FrameKind};
use fedfleet_protocol::messages::{self, ModelRef, RoundConfig};
use fedfleet_protocol::{
    BundleLimits, DType, Digest, Layout, Message, ModelVersion, PayloadCheck, Receipt, RejectReason,
    Rejection, RoundId, Signed, SignedUpdate, TensorBundle,
};
use tokio::sync::{Notify, watch};

use crate::config::{Config, FoldBackend};
use crate::coordinator::FoldMode;
use crate::engine::{
    CampaignId, CampaignSpec, EngineConfig, EngineEvent, Millis, RoundEngine, RoundPolicy,
    Invitation, UpdateMeta,
};
use crate::persist::{AcceptedRecord, Boundary, CampaignMeta, GlobalRef, ModelRecord, Store};
use crate::publish::{PublishRequest, Publisher};
use crate::strategy::{ServerStrategy, Strategy};
use crate::wire::{CampaignOverrides, CampaignStatus, MAX_WIRE_MESSAGE, Request, Response};
use crate::{Coordinator, metrics::Metrics};

/// Connections served at once.
const MAX_CONNECTIONS: usize = 1024;
/// Safetensors header slack allowed above `4 × params` in an update payload.
const HEADER_SLACK: u64 = 64 * 1024;

/// Why the service could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error(transparent)]
    Store(#[from] crate::persist::StoreError),
    #[error(transparent)]
    Certs(#[from] fedfleet_certs::CertError),
    #[error(transparent)]
    Net(#[from] fedfleet_net::NetError),
    #[error("{0}")]
    Other(String),
}

fn other(e: impl std::fmt::Display) -> ServiceError {
    ServiceError::Other(e.to_string())
}

pub fn now_ms() -> Millis {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The base model of the open round, decoded.
#[derive(Clone)]
struct Base {
    digest: Digest,
    version: ModelVersion,
    layout: Layout,
    values: Arc<Vec<f32>>,
    sent: Arc<Sent>,
}

/// The part of the model an update carries: the spec's update layout (every tensor, or only the
/// trainable ones when the spec freezes layers, trains LoRA adapters or keeps batch norms local).
/// Strategies fold and step over these coordinates only; the rest of the model is carried over.
struct Sent {
    layout: Layout,
    /// Where each sent tensor lies in the full flat model, in (sorted-name) bundle order.
    ranges: Vec<std::ops::Range<usize>>,
    dim: usize,
}

impl Sent {
    fn of(full: &Layout, sent: &Layout) -> Sent {
        let mut ranges = Vec::new();
        let mut offset = 0;
        for (name, shape) in full {
            let n: usize = shape.iter().product();
            if sent.contains_key(name) {
                ranges.push(offset..offset + n);
            }
            offset += n;
        }
        Sent { layout: sent.clone(), dim: ranges.iter().map(|r| r.len()).sum(), ranges }
    }
}

impl Base {
    fn new(digest: Digest, version: ModelVersion, layout: Layout, values: Vec<f32>, sent_layout: &Layout) -> Self {
        let sent = Arc::new(Sent::of(&layout, sent_layout));
        Base { digest, version, layout, values: Arc::new(values), sent }
    }
    /// Coordinates an update carries (what strategies fold).
    fn dim(&self) -> usize {
        self.sent.dim
    }
    fn max_payload(&self) -> u64 {
        self.dim() as u64 * 4 + HEADER_SLACK + self.sent.layout.len() as u64 * 512
    }
    fn limits(&self) -> BundleLimits {
        BundleLimits {
            max_bytes: self.max_payload() as usize,
            max_tensors: self.sent.layout.len(),
            max_params: self.dim(),
        }
    }
    /// The base's values at the sent coordinates: the global model the strategy steps.
    fn global(&self) -> Vec<f32> {
        if self.sent.dim == self.values.len() {
            return self.values.to_vec();
        }
        self.sent.ranges.iter().flat_map(|r| self.values[r.clone()].iter().copied()).collect()
    }
    /// The full model: the base with the sent coordinates replaced by `sent_values`.
    fn merged(&self, sent_values: Vec<f32>) -> Vec<f32> {
        if self.sent.dim == self.values.len() {
            return sent_values;
        }
        let mut out = self.values.to_vec();
        let mut offset = 0;
        for r in &self.sent.ranges {
            out[r.clone()].copy_from_slice(&sent_values[offset..offset + r.len()]);
            offset += r.len();
        }
        out
    }
}

struct Core {
    coord: Coordinator<ServerStrategy>,
    base: Option<Base>,
    global: Option<GlobalRef>,
    campaign: CampaignMeta,
    /// A closed round waiting for the driver to finalize and publish it.
    closing: Option<RoundId>,
}

struct Shared {
    cfg: Config,
    spec: ModelSpec,
    spec_json: String,
    store: Store,
    key: SigningKey,
    allow: AllowList,
    metrics: Arc<Metrics>,
    publisher: Box<dyn Publisher>,
    validation: Option<Dataset>,
    /// `[compute] fold = "tensor"`: the burn device the FedAvg family's rounds are folded on.
    tensor_device: Option<burn::tensor::Device>,
    core: Mutex<Core>,
    wake: Notify,
    /// The open round's signed announcement (encoded), for the MQTT control plane.
    announce: watch::Sender<Option<Vec<u8>>>,
}

/// Where an upload's payload comes from. Both transports go through [`Aggregator::ingest`].
pub enum Payload<'a> {
    /// QUIC: `Chunk` frames up to `End`, read only after the header passed every cheap check.
    Quic(&'a mut FramedStream),
    /// MQTT: the reassembled payload bytes.
    Bytes(Vec<u8>),
}

/// The aggregator service. Cheap to clone.
#[derive(Clone)]
pub struct Aggregator {
    shared: Arc<Shared>,
}

/// A refusal: counted under its reason and sent to the peer.
fn reject(reason: RejectReason, detail: impl Into<String>) -> Rejection {
    Rejection::new(reason, detail)
}

/// Flattens a delta bundle in canonical (sorted-name) order, dequantizing to f32.
pub fn flatten(bundle: &TensorBundle, dim: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(dim);
    for (_, t) in bundle.iter() {
        match &t.data {
            fedfleet_protocol::TensorData::F32(v) => out.extend_from_slice(v),
            _ => out.extend(t.to_f32_vec()),
        }
    }
    out
}

/// Splits a flat model into a bundle with `layout` (sorted-name order).
pub fn unflatten(layout: &Layout, values: &[f32]) -> TensorBundle {
    let mut b = TensorBundle::new();
    let mut off = 0;
    for (name, shape) in layout {
        let n: usize = shape.iter().product();
        b.insert_f32(name, shape.clone(), values[off..off + n].to_vec())
            .expect("layout from a valid bundle");
        off += n;
    }
    b
}

/// Decodes and checks an update payload against the base model: limits, layout, dtype, finite.
pub fn decode_update(
    payload: &[u8],
    base_layout: &Layout,
    limits: &BundleLimits,
    dtype: DType,
    dim: usize,
) -> Result<Vec<f32>, Rejection> {
    let bundle = TensorBundle::decode(payload, limits).map_err(|e| reject(e.reason(), e.to_string()))?;
    bundle
        .check_layout(base_layout)
        .map_err(|e| reject(e.reason(), e.to_string()))?;
    if let Some((name, t)) = bundle.iter().find(|(_, t)| t.dtype() != dtype) {
        return Err(reject(
            RejectReason::WrongDtype,
            format!("tensor {name:?} is {}, the header signs {}", t.dtype().as_str(), dtype.as_str()),
        ));
    }
    bundle
        .check_finite()
        .map_err(|e| reject(e.reason(), e.to_string()))?;
    Ok(flatten(&bundle, dim))
}

fn decode_base(bytes: &[u8]) -> Result<(Layout, Vec<f32>), String> {
    let b = TensorBundle::decode(bytes, &BundleLimits::default()).map_err(|e| e.to_string())?;
    b.check_finite().map_err(|e| e.to_string())?;
    let layout = b.layout();
    let dim = b.num_params();
    Ok((layout, flatten(&b, dim)))
}

/// Memory is ahead of disk: the only safe move is to stop and restart from disk.
fn abort_on_commit_failure(e: crate::persist::StoreError) -> ! {
    tracing::error!(error = %e, "cannot commit accepted updates to disk; aborting so a restart resumes from disk");
    std::process::abort()
}

/// Scalars an update carries for `spec` (all of them unless it freezes layers, trains LoRA
/// adapters or keeps batch norms local).
fn update_dim(spec: &ModelSpec) -> usize {
    spec.update_layout().values().map(|shape| shape.iter().product::<usize>()).sum()
}

/// Streaming unless the tensor path is on and `strategy` is a weighted mean.
fn fold_mode(tensor: bool, strategy: &ServerStrategy) -> FoldMode {
    if tensor && strategy.is_mean_based() { FoldMode::Deferred } else { FoldMode::Streaming }
}

/// The delta of an accepted update, read back from the update store and decoded again.
fn stored_delta(store: &Store, rec: &AcceptedRecord, base: &Base, dtype: DType) -> Result<Vec<f32>, String> {
    let bytes = store.read_update(&rec.payload_digest).map_err(|e| e.to_string())?;
    decode_update(&bytes, &base.sent.layout, &base.limits(), dtype, base.dim())
        .map_err(|r| format!("stored update {} no longer decodes: {}", rec.payload_digest, r.detail))
}

impl Aggregator {
    /// Opens the data directory (refusing damaged state), loads identities, restores the
    /// coordinator and refolds the current round's accepted updates.
    pub fn open(cfg: Config, publisher: Box<dyn Publisher>) -> Result<Aggregator, ServiceError> {
        // The compute device first: a missing GPU refuses the start before any state is touched.
        let metrics = Arc::new(Metrics::default());
        let tensor_device = match cfg.compute.fold {
            FoldBackend::Exact => None,
            FoldBackend::Tensor => {
                let picked = crate::accel::select_device(&cfg.compute.device).map_err(other)?;
                tracing::info!("FedAvg-family rounds are folded on burn tensors: {}", picked.adapter);
                metrics.compute_adapter(&picked.adapter);
                Some(picked.device)
            }
        };
        let store = Store::open(&cfg.data_dir)?;
        let key = crate::keys::load_or_create(&cfg.data_dir)
            .map_err(|e| other(format!("receipt key in {}: {e}", cfg.data_dir.display())))?;
        let allow = AllowList::load(fedfleet_certs::layout::allow_list(&cfg.pki_dir))?;
        let fleet = allow.fleet();
        let spec = cfg.model.spec.clone();
        let spec_json = cfg.spec_json();
        let validation = match cfg.model.validation.as_deref() {
            Some("digits") => Some(
                Dataset::digits_split()
                    .map_err(|e| other(format!("validation split: {e}")))?
                    .1,
            ),
            _ => None,
        };
        let engine = match store.engine()? {
            Some(b) => RoundEngine::from_bytes(&b).map_err(|e| {
                other(format!("{}: engine snapshot: {e}", cfg.data_dir.display()))
            })?,
            None => RoundEngine::new(
                fleet,
                EngineConfig {
                    nonce_retention_rounds: 8,
                },
                RoundId(1),
            ),
        };
        let strategy = match store.strategy()? {
            Some(b) => postcard::from_bytes(&b).map_err(|e| {
                other(format!("{}: strategy snapshot: {e}", cfg.data_dir.display()))
            })?,
            None => ServerStrategy::new(&cfg.campaign.strategy_config().map_err(other)?, update_dim(&spec))
                .map_err(other)?,
        };
        let global = store.global()?;
        let campaign = store.campaign_meta()?;
        let mode = fold_mode(tensor_device.is_some(), &strategy);
        let mut coord = Coordinator::new(engine, strategy);
        coord.set_mode(mode);
        let mut core = Core {
            coord,
            base: None,
            global,
            campaign,
            closing: None,
        };
        if let Some(g) = global {
            let bytes = store.read_model(&g.digest)?;
            let (layout, values) = decode_base(&bytes).map_err(other)?;
            core.base = Some(Base::new(g.digest, g.version, layout, values, &spec.update_layout()));
        }
        // Refold the current round (open, or closed and not yet published).
        let current = core
            .coord
            .engine()
            .round_status()
            .map(|s| s.round)
            .or_else(|| core.coord.engine().awaiting_model());
        if let Some(round) = current {
            let base = core.base.clone().ok_or_else(|| other("a round is open but no global model is recorded"))?;
            let dtype = core.campaign.payload_dtype();
            let records = store.accepted_in(round)?;
            // A deferred fold only counts here; its payloads are read when the round closes.
            let deferred = core.coord.mode() == FoldMode::Deferred;
            for rec in &records {
                let delta = if deferred { Vec::new() } else { stored_delta(&store, rec, &base, dtype).map_err(other)? };
                core.coord
                    .resume_fold(round, &delta, rec.weight)
                    .map_err(|e| other(format!("refold of {}: {e}", rec.payload_digest)))?;
            }
            if !records.is_empty() {
                tracing::info!(round = %round, updates = records.len(), "refolded the current round after restart");
            }
            core.closing = core.coord.engine().awaiting_model();
        }
        let _ = store.gc_updates(current.unwrap_or(RoundId(u64::MAX)), true);
        if let Some(s) = core.coord.engine().round_status() {
            metrics.open_round.set(s.round.0 as i64);
            metrics.round_accepted.set(s.accepted as i64);
        }
        let announce = watch::Sender::new(core.campaign.announcement.clone());
        let agg = Aggregator {
            shared: Arc::new(Shared {
                announce,
                cfg,
                spec,
                spec_json,
                store,
                key,
                allow,
                metrics,
                publisher,
                validation,
                tensor_device,
                core: Mutex::new(core),
                wake: Notify::new(),
            }),
        };
        {
            let mut core = agg.lock();
            agg.drain(&mut core, now_ms());
        }
        Ok(agg)
    }

    pub fn metrics(&self) -> Arc<Metrics> {
        self.shared.metrics.clone()
    }

    pub fn config(&self) -> &Config {
        &self.shared.cfg
    }

    /// The open round's encoded `Signed<RoundAnnouncement>` (`None` between rounds); changes
    /// when a round opens or ends.
    pub fn announcements(&self) -> watch::Receiver<Option<Vec<u8>>> {
        self.shared.announce.subscribe()
    }

    pub fn receipt_key(&self) -> ed25519_dalek::VerifyingKey {
        self.shared.key.verifying_key()
    }

    fn lock(&self) -> MutexGuard<'_, Core> {
        self.shared.core.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Binds the QUIC endpoint of the config.
    pub fn bind(&self, addr: SocketAddr) -> Result<quinn::Endpoint, ServiceError> {
        let cfg = &self.shared.cfg;
        let ca = fedfleet_certs::CaCert::load(fedfleet_certs::layout::ca_cert(&cfg.pki_dir))?;
        let id = fedfleet_certs::ServerIdentity::load(&cfg.pki_dir, &cfg.server_identity)?;
        let revocation = Arc::new(fedfleet_certs::RevocationWatcher::open(&cfg.pki_dir)?);
        let tls = fedfleet_certs::tls::server_config(&ca, &id, revocation, &[fedfleet_certs::ALPN_V1])?;
        // Clients of a crashed predecessor are reset at once (keys seeded from this identity).
        let secret = id.derive_secret("fedfleet-aggregator 2026 QUIC endpoint");
        Ok(fedfleet_net::server_endpoint_restartable(addr, tls, &secret)?)
    }

    /// Serves `endpoint` until `shutdown` resolves, then lets in-flight requests finish.
    pub async fn run(self, endpoint: quinn::Endpoint, shutdown: impl std::future::Future<Output = ()>) {
        let (stop_tx, _) = tokio::sync::broadcast::channel::<()>(1);
        let driver = {
            let me = self.clone();
            let mut stop = stop_tx.subscribe();
            tokio::spawn(async move {
                tokio::select! {
                    _ = me.drive() => {}
                    _ = stop.recv() => {}
                }
            })
        };
        let handlers = fedfleet_net::serve::accept_until(
            &endpoint,
            MAX_CONNECTIONS,
            async {
                shutdown.await;
                tracing::info!("shutting down: no new connections");
            },
            || self.shared.metrics.rejected(RejectReason::Overloaded),
            |incoming| {
                let me = self.clone();
                let stop = stop_tx.subscribe();
                async move { me.connection(incoming, stop).await }
            },
        )
        .await;
        let _ = stop_tx.send(());
        // In-flight uploads finish (their handlers stop taking new streams), but not forever.
        fedfleet_net::serve::drain(&endpoint, handlers, Duration::from_secs(20)).await;
        let _ = driver.await;
        tracing::info!("stopped");
    }

    async fn connection(
        &self,
        incoming: quinn::Incoming,
        mut stop: tokio::sync::broadcast::Receiver<()>,
    ) {
        let conn = match incoming.await {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!(error = %e, "handshake failed");
                return;
            }
        };
        let peer = conn
            .peer_identity()
            .and_then(|any| any.downcast::<Vec<rustls_pki_types::CertificateDer<'static>>>().ok())
            .and_then(|certs| fedfleet_certs::peer_identity(&certs).ok());
        let Some(peer) = peer else {
            conn.close(1u32.into(), b"no fleet identity");
            return;
        };
        // The connection's handler ends when its in-flight streams do (graceful shutdown).
        let mut streams = tokio::task::JoinSet::new();
        loop {
            let (send, recv) = tokio::select! {
                r = conn.accept_bi() => match r {
                    Ok(s) => s,
                    Err(_) => break,
                },
                _ = stop.recv() => break,
            };
            while streams.try_join_next().is_some() {}
            let me = self.clone();
            let peer = peer.clone();
            streams.spawn(async move {
                let mut stream = FramedStream::new(send, recv);
                me.stream(&peer, &mut stream).await;
            });
        }
        while streams.join_next().await.is_some() {}
    }

    async fn stream(&self, peer: &PeerIdentity, stream: &mut FramedStream) {
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
                    Err(e) => Err(reject(e.reason(), e.to_string())),
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
                let resp = match messages::decode::<Request>(&first.body, MAX_WIRE_MESSAGE) {
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

    /// Handles a non-upload request. `None` when the answer was already sent (a model).
    async fn request(&self, peer: &PeerIdentity, req: Request, stream: &mut FramedStream) -> Option<Response> {
        let is_operator = matches!(peer, PeerIdentity::Service(n) if self.shared.cfg.operators.contains(n));
        match req {
            Request::GetRound => {
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
                let store_bytes = {
                    let me = self.clone();
                    tokio::task::spawn_blocking(move || me.shared.store.read_model(&digest)).await
                };
                let bytes = match store_bytes {
                    Ok(Ok(b)) => b,
                    Ok(Err(e)) => return Some(Response::Error(reject(RejectReason::Internal, e.to_string()))),
                    Err(e) => return Some(Response::Error(reject(RejectReason::Internal, e.to_string()))),
                };
                let head = Response::Model { spec: rec.spec, length: bytes.len() as u64 };
                let body = messages::encode(&head, MAX_WIRE_MESSAGE).expect("encodes");
                if stream.send(FrameKind::Message, &body).await.is_err() {
                    return None;
                }
                for chunk in bytes.chunks(fedfleet_protocol::limits::MAX_CHUNK_BYTES) {
                    if stream.send(FrameKind::Chunk, chunk).await.is_err() {
                        return None;
                    }
                }
                let _ = stream.send(FrameKind::End, &[]).await;
                None
            }
            Request::CampaignStart(_) | Request::CampaignStatus | Request::CampaignStop if !is_operator => {
                Some(Response::Error(reject(
                    RejectReason::NotPermitted,
                    "campaign requests need an operator service certificate",
                )))
            }
            Request::CampaignStart(o) => Some(match self.start_campaign(o).await {
                Ok(s) => Response::Status(s),
                Err(e) => Response::Error(reject(RejectReason::Internal, e)),
            }),
            Request::CampaignStatus => Some(Response::Status(self.status())),
            Request::CampaignStop => {
                let mut core = self.lock();
                let r = core.coord.engine_mut().stop_campaign(now_ms());
                self.drain(&mut core, now_ms());
                drop(core);
                Some(match r {
                    Ok(()) => Response::Status(self.status()),
                    Err(e) => Response::Error(reject(RejectReason::Internal, e.to_string())),
                })
            }
        }
    }

    /// Where the campaign stands.
    pub fn status(&self) -> CampaignStatus {
        let core = self.lock();
        let e = core.coord.engine();
        let rs = e.round_status();
        CampaignStatus {
            campaign: e.campaign_id().map(|c| c.0),
            strategy: e.campaign_id().map(|_| core.coord.strategy().name().to_owned()),
            rounds_completed: e.rounds_completed(),
            open_round: rs.as_ref().map(|s| s.round),
            accepted: rs.as_ref().map(|s| s.accepted).unwrap_or(0),
            target: rs.as_ref().map(|s| s.target).unwrap_or(0),
            deadline_unix_ms: rs.as_ref().map(|s| s.deadline),
            global: core.global.map(|g| (g.version, g.digest)),
            last_outcome: core.campaign.last_outcome.clone(),
        }
    }

    /// The current global model's digest and bytes, if any.
    pub fn global_model(&self) -> Option<(GlobalRef, Vec<u8>)> {
        let g = self.lock().global?;
        self.shared.store.read_model(&g.digest).ok().map(|b| (g, b))
    }

    // ----- ingest -----

    /// Checks, folds and commits one upload from either transport; the answer is the signed
    /// receipt. `peer` is the identity the transport authenticated (the QUIC client certificate,
    /// or the MQTT topic's device, whose key the control client already checked). The caller
    /// counts and reports a rejection.
    pub async fn ingest(&self, peer: &PeerIdentity, update: SignedUpdate, payload: Payload<'_>) -> Result<Signed<Receipt>, Rejection> {
        let sh = &self.shared;
        let h = update.body().clone();
        // 1. The connection's certificate must be the header's device.
        match peer {
            PeerIdentity::Device(id) if *id == h.device => {}
            PeerIdentity::Device(id) => {
                return Err(reject(
                    RejectReason::IdentityMismatch,
                    format!("certificate is for device {id}, the header names {}", h.device),
                ));
            }
            PeerIdentity::Service(n) => {
                return Err(reject(RejectReason::NotPermitted, format!("service {n} cannot upload updates")));
            }
        }
        // 2. Enrollment and revocation (the allow-list is re-read when it changes).
        let key = match sh.allow.status(&h.device) {
            DeviceStatus::Unknown => return Err(reject(RejectReason::UnknownDevice, format!("{} is not enrolled", h.device))),
            DeviceStatus::Revoked => {
                self.lock().coord.engine_mut().revoke(h.device.clone());
                return Err(reject(RejectReason::Revoked, format!("{} is revoked", h.device)));
            }
            DeviceStatus::Enrolled(k) => k,
        };
        // 3. Signature.
        update.verify(&key).map_err(|e| reject(e.reason(), e.to_string()))?;
        // 4. A resend of an accepted update gets its receipt again (once the record is durable:
        // the first attempt may still be waiting for its flush).
        if let Ok(Some(rec)) = sh.store.accepted(&h.device, &h.nonce)
            && rec.payload_digest == h.payload_digest
            && rec.round == h.round
        {
            sh.store.sync_all().unwrap_or_else(|e| abort_on_commit_failure(e));
            return Signed::<Receipt>::decode(&rec.receipt).map_err(|e| reject(RejectReason::Internal, format!("stored receipt: {e}")));
        }
        // 5. Round, replay, duplicate, selection, sample count; size.
        let meta = UpdateMeta::from(&h);
        let (base, dtype) = {
            let mut core = self.lock();
            let now = now_ms();
            let r = core.coord.check_update(now, &meta);
            self.drain(&mut core, now);
            r.map_err(|r| reject(r.reason, format!("round {}: {}", h.round, r.reason)))?;
            let base = core.base.clone().ok_or_else(|| reject(RejectReason::Internal, "no base model"))?;
            (base, core.campaign.payload_dtype())
        };
        if h.payload_dtype != dtype {
            return Err(reject(
                RejectReason::WrongDtype,
                format!("the round asks for {}, the header signs {}", dtype.as_str(), h.payload_dtype.as_str()),
            ));
        }
        if h.payload_len > base.max_payload() {
            return Err(reject(
                RejectReason::TooLarge,
                format!("payload of {} bytes; the limit for this model is {}", h.payload_len, base.max_payload()),
            ));
        }
        // 6. The payload through the digest/length check (streamed over QUIC).
        let mut check = PayloadCheck::new(&h);
        let stream = match payload {
            Payload::Bytes(bytes) => {
                sh.metrics.update_bytes.inc_by(bytes.len() as u64);
                check.update(&bytes).map_err(|e| reject(e.reason(), e.to_string()))?;
                check.finish().map_err(|e| reject(e.reason(), e.to_string()))?;
                return self.commit_blocking(h, meta, bytes, base, dtype).await;
            }
            Payload::Quic(stream) => stream,
        };
        let mut payload = Vec::with_capacity(h.payload_len as usize);
        loop {
            match stream.recv().await {
                Ok(Some(Frame { kind: FrameKind::Chunk, body })) => {
                    sh.metrics.update_bytes.inc_by(body.len() as u64);
                    check.update(&body).map_err(|e| reject(e.reason(), e.to_string()))?;
                    payload.extend_from_slice(&body);
                }
                Ok(Some(Frame { kind: FrameKind::End, .. })) => break,
                Ok(Some(f)) => return Err(reject(RejectReason::Malformed, format!("unexpected {:?} frame in a payload", f.kind))),
                Ok(None) => return Err(reject(RejectReason::Malformed, "stream ended before the End frame")),
                Err(e) => return Err(reject(RejectReason::Malformed, e.to_string())),
            }
        }
        check.finish().map_err(|e| reject(e.reason(), e.to_string()))?;
        self.commit_blocking(h, meta, payload, base, dtype).await
    }

    /// 7. Decode, check, fold and commit, off the async threads.
    async fn commit_blocking(
        &self,
        h: fedfleet_protocol::UpdateHeader,
        meta: UpdateMeta,
        payload: Vec<u8>,
        base: Base,
        dtype: DType,
    ) -> Result<Signed<Receipt>, Rejection> {
        let me = self.clone();
        tokio::task::spawn_blocking(move || me.fold_and_commit(h, meta, payload, base, dtype))
            .await
            .map_err(|e| reject(RejectReason::Internal, e.to_string()))?
    }

    fn fold_and_commit(
        &self,
        h: fedfleet_protocol::UpdateHeader,
        meta: UpdateMeta,
        payload: Vec<u8>,
        base: Base,
        dtype: DType,
    ) -> Result<Signed<Receipt>, Rejection> {
        let sh = &self.shared;
        let delta = decode_update(&payload, &base.sent.layout, &base.limits(), dtype, base.dim())?;
        sh.store
            .put_update(&h.payload_digest, &payload)
            .map_err(|e| reject(RejectReason::Internal, e.to_string()))?;
        drop(payload);
        let mut core = self.lock();
        if core.base.as_ref().map(|b| b.digest) != Some(base.digest) {
            return Err(reject(RejectReason::StaleRound, "the round changed while the payload streamed"));
        }
        let now = now_ms();
        let t = Instant::now();
        let accepted = core.coord.handle_update(now, meta, &delta);
        let accepted = match accepted {
            Ok(a) => a,
            Err(r) => {
                self.drain(&mut core, now);
                return Err(reject(r.reason, format!("round {}: {}", h.round, r.reason)));
            }
        };
        if core.coord.mode() == FoldMode::Streaming {
            sh.metrics.folded(delta.len() as u64 * 4, t.elapsed());
        }
        let receipt = Signed::sign(
            Receipt {
                fleet: h.fleet.clone(),
                device: h.device.clone(),
                round: h.round,
                nonce: h.nonce,
                payload_digest: h.payload_digest,
                accepted_at_unix_ms: now,
            },
            &sh.key,
        );
        let rec = AcceptedRecord {
            round: accepted.round,
            device: h.device.clone(),
            payload_digest: h.payload_digest,
            weight: accepted.weight,
            receipt: receipt.encode(),
        };
        let seq = sh.store.apply_update(&core.coord.engine().to_bytes(), &h.nonce, &rec).unwrap_or_else(|e| abort_on_commit_failure(e));
        sh.metrics.accepted.inc();
        sh.metrics.round_accepted.set(accepted.accepted as i64);
        tracing::info!(device = %h.device, round = %accepted.round, accepted = accepted.accepted,
            target = accepted.target, "update accepted");
        self.drain(&mut core, now);
        drop(core);
        // Durable before the receipt leaves; concurrent uploads share this flush.
        sh.store.sync(seq).unwrap_or_else(|e| abort_on_commit_failure(e));
        Ok(receipt)
    }

    // ----- events, rounds, campaigns -----

    /// Processes engine events; commits a round boundary when one happened.
    fn drain(&self, core: &mut Core, now: Millis) {
        let sh = &self.shared;
        let mut boundary = false;
        while let Some(ev) = core.coord.poll_event() {
            match ev {
                EngineEvent::RoundOpened(a) => {
                    tracing::info!(round = %a.round, deadline = a.deadline, "round opened");
                    sh.metrics.round("opened");
                    sh.metrics.open_round.set(a.round.0 as i64);
                    sh.metrics.round_accepted.set(0);
                    let dtype = core.campaign.payload_dtype();
                    let ann = fedfleet_protocol::RoundAnnouncement {
                        fleet: a.fleet,
                        round: a.round,
                        base_model: ModelRef {
                            name: sh.cfg.model.name.clone(),
                            version: a.base_version,
                            digest: a.base_digest,
                        },
                        config: RoundConfig {
                            local_epochs: a.client.local_epochs,
                            batch_size: a.client.batch_size,
                            learning_rate: a.client.lr,
                            optimizer: "sgd".into(),
                            fedprox_mu: a.client.proximal_mu,
                            quantization: dtype,
                            min_samples: 1,
                            max_samples: Some(a.max_sample_count),
                            seed: a.round.0,
                        },
                        deadline_unix_ms: a.deadline,
                        selection: a.selection,
                    };
                    core.campaign.announcement = Some(Signed::sign(ann, &sh.key).encode());
                    sh.announce.send_replace(core.campaign.announcement.clone());
                    // The round driver may be sleeping on an older (or no) timer: it must
                    // re-read the deadline (a campaign started on an idle service opens its
                    // first round outside the driver).
                    sh.wake.notify_one();
                    boundary = true;
                }
                EngineEvent::RoundClosed { round, cause, contributions, .. } => {
                    tracing::info!(round = %round, ?cause, updates = contributions.len(), "round closed");
                    sh.metrics.round("closed");
                    sh.metrics.open_round.set(0);
                    core.campaign.announcement = None;
                    sh.announce.send_replace(None);
                    core.closing = Some(round);
                    sh.wake.notify_one();
                }
                EngineEvent::RoundFailed { round, reason } => {
                    tracing::warn!(round = %round, reason = reason.as_str(), "round failed");
                    sh.metrics.round("failed");
                    sh.metrics.open_round.set(0);
                    // Only the failed round's own updates are discarded (after a restart the
                    // strategy may already hold the refolded updates of a later round).
                    if core.coord.folding() == Some(round) || core.coord.folding().is_none() {
                        core.coord.discard_held();
                    }
                    core.campaign.announcement = None;
                    sh.announce.send_replace(None);
                    if core.closing == Some(round) {
                        core.closing = None;
                    }
                    boundary = true;
                }
                EngineEvent::CampaignFinished { campaign, outcome, rounds_completed } => {
                    tracing::info!(campaign = %campaign, outcome = outcome.as_str(), rounds_completed, "campaign finished");
                    core.campaign.last_outcome = Some(outcome.as_str().to_owned());
                    core.campaign.announcement = None;
                    sh.announce.send_replace(None);
                    boundary = true;
                }
                EngineEvent::RoundExtended { round, deadline, accepted } => {
                    tracing::info!(round = %round, deadline, accepted, "quorum not met: deadline extended once");
                    // Devices check the signed deadline: re-issue the announcement with the new
                    // one, or devices arriving after the old deadline skip a round still open.
                    let extended = core
                        .campaign
                        .announcement
                        .as_deref()
                        .and_then(|b| Signed::<fedfleet_protocol::RoundAnnouncement>::decode(b).ok())
                        .map(|signed| signed.body().clone())
                        .filter(|ann| ann.round == round);
                    if let Some(mut ann) = extended {
                        ann.deadline_unix_ms = deadline;
                        core.campaign.announcement = Some(Signed::sign(ann, &sh.key).encode());
                        sh.announce.send_replace(core.campaign.announcement.clone());
                        boundary = true;
                    }
                }
                EngineEvent::DeviceRevoked { device, contributed_to } => {
                    tracing::warn!(device = %device, ?contributed_to, "device revoked");
                }
            }
        }
        if boundary {
            self.commit_boundary(core, now);
        }
    }

    fn commit_boundary(&self, core: &mut Core, _now: Millis) {
        let sh = &self.shared;
        let strategy = (core.coord.strategy().folded() == 0)
            .then(|| postcard::to_stdvec(core.coord.strategy()).expect("strategy serializes"));
        let engine = core.coord.engine().to_bytes();
        let r = sh.store.commit_boundary(Boundary {
            engine: &engine,
            strategy: strategy.as_deref(),
            global: core.global,
            campaign: Some(&core.campaign),
        });
        if let Err(e) = r {
            tracing::error!(error = %e, "cannot commit a round boundary; aborting so a restart resumes from disk");
            std::process::abort();
        }
        let keep = core
            .coord
            .engine()
            .round_status()
            .map(|s| s.round)
            .unwrap_or(RoundId(u64::MAX));
        let _ = sh.store.gc_updates(keep, false);
    }

    /// The round driver: deadlines and finalize/publish of closed rounds.
    async fn drive(&self) {
        loop {
            let closing = self.lock().closing;
            if let Some(round) = closing {
                if let Err(e) = self.finalize(round).await {
                    tracing::error!(round = %round, error = %e, "publishing failed; retrying in 5 s");
                    tokio::time::sleep(Duration::from_secs(5)).await;
                }
                continue;
            }
            let next = self.lock().coord.poll_timeout();
            let sleep = match next {
                Some(t) => Duration::from_millis(t.saturating_sub(now_ms()).max(1)),
                None => Duration::from_secs(3600),
            };
            tokio::select! {
                _ = self.shared.wake.notified() => {}
                _ = tokio::time::sleep(sleep) => {
                    let mut core = self.lock();
                    let now = now_ms();
                    core.coord.handle_timeout(now);
                    self.drain(&mut core, now);
                }
            }
        }
    }

    /// Finalizes the closed `round`, evaluates, publishes, records, and opens the next round.
    async fn finalize(&self, round: RoundId) -> Result<(), String> {
        let sh = self.shared.clone();
        let me = self.clone();
        // Finalize under the lock (CPU), off the async threads.
        let out = tokio::task::spawn_blocking(move || {
            // Every update folded into this model is durable before the model exists.
            me.shared.store.sync_all().unwrap_or_else(|e| abort_on_commit_failure(e));
            let mut core = me.lock();
            if core.closing != Some(round) {
                return Ok(None);
            }
            let base = core.base.clone().ok_or("no base model")?;
            let result = match (core.coord.mode(), &me.shared.tensor_device) {
                (FoldMode::Deferred, Some(device)) => {
                    // Every accepted payload is on disk: fold them on the device in digest order.
                    let t0 = Instant::now();
                    let dtype = core.campaign.payload_dtype();
                    let mut records = me.shared.store.accepted_in(round).map_err(|e| e.to_string())?;
                    records.sort_by_key(|r| r.payload_digest);
                    let updates = records
                        .iter()
                        .map(|rec| Ok((stored_delta(&me.shared.store, rec, &base, dtype)?, rec.weight)));
                    let r = core.coord.finalize_with(now_ms(), round, |s| {
                        s.finalize_on(&crate::accel::TensorBackend::new(device), &base.global(), updates)
                    });
                    let elapsed = t0.elapsed();
                    if r.is_ok() {
                        me.shared.metrics.folded(records.len() as u64 * base.dim() as u64 * 4, elapsed);
                        me.shared.metrics.round("tensor_folded");
                    }
                    tracing::info!(round = %round, updates = records.len(), ms = elapsed.as_millis() as u64, "tensor fold");
                    r
                }
                _ => core.coord.finalize(now_ms(), round, &base.global()),
            };
            match result {
                Ok(sent) => Ok(Some((base.merged(sent), base))),
                Err(e) => {
                    core.closing = None;
                    me.drain(&mut core, now_ms());
                    Err(format!("finalize failed, round aborted: {e}"))
                }
            }
        })
        .await
        .map_err(|e| e.to_string())??;
        let Some((model, base)) = out else { return Ok(()) };
        // Evaluate and encode (CPU).
        let spec = sh.spec.clone();
        let sh2 = sh.clone();
        let layout = base.layout.clone();
        let (bytes, metrics, model) = tokio::task::spawn_blocking(move || {
            let bundle = unflatten(&layout, &model);
            let mut metrics = BTreeMap::new();
            if let Some(v) = &sh2.validation {
                match fedfleet_learning::evaluate(&spec, &bundle, v) {
                    Ok(r) => {
                        metrics.insert("accuracy".to_owned(), r.accuracy);
                        metrics.insert("loss".to_owned(), r.loss);
                        metrics.insert("eval_examples".to_owned(), r.num_examples as f64);
                    }
                    Err(e) => tracing::warn!(error = %e, "server-side evaluation failed"),
                }
            }
            (bundle.encode(), metrics, model)
        })
        .await
        .map_err(|e| e.to_string())?;
        let digest = Digest::of(&bytes);
        let req = PublishRequest {
            name: sh.cfg.model.name.clone(),
            bundle: bytes,
            spec: sh.spec_json.clone(),
            parent: Some(base.version),
            metrics: metrics.clone(),
            created_at_unix_ms: now_ms(),
        };
        let (version, published) = sh.publisher.publish(&req).await.map_err(|e| e.to_string())?;
        if published != digest {
            return Err(format!("publisher returned digest {published}, expected {digest}"));
        }
        let rec = ModelRecord {
            name: req.name.clone(),
            version,
            length: req.bundle.len() as u64,
            spec: req.spec.clone(),
            parent: req.parent,
            metrics: metrics.into_iter().collect(),
        };
        let me = self.clone();
        tokio::task::spawn_blocking(move || {
            me.shared.store.put_model(&digest, &req.bundle, &rec).map_err(|e| e.to_string())?;
            let mut core = me.lock();
            if core.closing != Some(round) {
                return Ok(());
            }
            core.closing = None;
            core.global = Some(GlobalRef { version, digest });
            core.base = Some(Base::new(digest, version, base.layout.clone(), model, &base.sent.layout));
            me.shared.metrics.round("published");
            tracing::info!(round = %round, version = %version, %digest, metrics = ?rec.metrics, "global model published");
            let now = now_ms();
            core.coord
                .model_ready(now, round, version, digest)
                .map_err(|e| e.to_string())?;
            me.drain(&mut core, now);
            Ok::<(), String>(())
        })
        .await
        .map_err(|e| e.to_string())?
    }

    /// Imports the configured initial model as the first global version (once).
    async fn ensure_global(&self) -> Result<(), String> {
        if self.lock().global.is_some() {
            return Ok(());
        }
        let sh = &self.shared;
        let path = &sh.cfg.model.initial;
        let bytes = std::fs::read(path).map_err(|e| {
            format!("initial model {}: {e} (create it with `fedfleet-aggregator init-model`)", path.display())
        })?;
        let (layout, values) = decode_base(&bytes).map_err(|e| format!("initial model {}: {e}", path.display()))?;
        let expected: Layout = sh.spec.params().into_iter().map(|p| (p.name, p.shape)).collect();
        if layout != expected {
            return Err(format!("initial model {} does not match model.spec", path.display()));
        }
        let mut metrics = BTreeMap::new();
        if let Some(v) = &sh.validation {
            let b = TensorBundle::decode(&bytes, &BundleLimits::default()).map_err(|e| e.to_string())?;
            if let Ok(r) = fedfleet_learning::evaluate(&sh.spec, &b, v) {
                metrics.insert("accuracy".to_owned(), r.accuracy);
                metrics.insert("loss".to_owned(), r.loss);
            }
        }
        let req = PublishRequest {
            name: sh.cfg.model.name.clone(),
            bundle: bytes,
            spec: sh.spec_json.clone(),
            parent: None,
            metrics: metrics.clone(),
            created_at_unix_ms: now_ms(),
        };
        let (version, digest) = sh.publisher.publish(&req).await.map_err(|e| e.to_string())?;
        let rec = ModelRecord {
            name: req.name.clone(),
            version,
            length: req.bundle.len() as u64,
            spec: req.spec.clone(),
            parent: None,
            metrics: metrics.into_iter().collect(),
        };
        sh.store.put_model(&digest, &req.bundle, &rec).map_err(|e| e.to_string())?;
        let mut core = self.lock();
        if core.global.is_none() {
            core.global = Some(GlobalRef { version, digest });
            core.base = Some(Base::new(digest, version, layout, values, &sh.spec.update_layout()));
        }
        Ok(())
    }

    /// Starts a campaign from the config defaults and `o`.
    pub async fn start_campaign(&self, o: CampaignOverrides) -> Result<CampaignStatus, String> {
        if let Some(c) = self.lock().coord.engine().campaign_id() {
            return Err(format!("campaign {c} is still running"));
        }
        self.ensure_global().await?;
        let sh = &self.shared;
        let d = &sh.cfg.campaign;
        let strategy_cfg = d.strategy_config().map_err(|e| e.to_string())?;
        let dtype = d.dtype().map_err(|e| e.to_string())?;
        let mut core = self.lock();
        if let Some(c) = core.coord.engine().campaign_id() {
            return Err(format!("campaign {c} is still running"));
        }
        let base = core.base.clone().ok_or("no global model")?;
        let strategy = ServerStrategy::new(&strategy_cfg, base.dim()).map_err(|e| e.to_string())?;
        let seed = o.seed.unwrap_or_else(|| rand_core::RngCore::next_u64(&mut rand_core::OsRng));
        let mut seed32 = [0u8; 32];
        seed32[..8].copy_from_slice(&seed.to_le_bytes());
        let id = CampaignId(core.campaign.last_campaign + 1);
        let target = o.target_count.unwrap_or(d.target);
        let spec = CampaignSpec {
            id,
            rounds: o.rounds.unwrap_or(d.rounds),
            base_version: base.version,
            base_digest: base.digest,
            client: strategy.configure(RoundId(0)),
            selection: Invitation::Rate { rate: d.sampling_rate },
            policy: RoundPolicy {
                target_count: target,
                min_quorum: o.min_quorum.unwrap_or(d.quorum).min(target),
                over_selection: d.over_selection,
                duration_ms: o.deadline_secs.unwrap_or(d.deadline_secs) * 1000,
                extension_ms: d.extension_secs * 1000,
                max_sample_count: d.max_sample_count,
            },
            seed: seed32,
            max_consecutive_failures: d.max_consecutive_failures,
        };
        let name = strategy.name().to_owned();
        let mode = fold_mode(self.shared.tensor_device.is_some(), &strategy);
        if self.shared.tensor_device.is_some() && mode == FoldMode::Streaming {
            tracing::warn!(strategy = %name, "[compute] fold = \"tensor\" covers the FedAvg family; this strategy folds exactly on the CPU");
        }
        let old_mode = core.coord.mode();
        core.coord.set_mode(mode);
        let old = std::mem::replace(core.coord.strategy_mut(), strategy);
        core.campaign.strategy = Some(name.clone());
        core.campaign.dtype = dtype.code();
        core.campaign.last_campaign = id.0;
        core.campaign.last_outcome = None;
        let now = now_ms();
        if let Err(e) = core.coord.engine_mut().start_campaign(now, spec) {
            *core.coord.strategy_mut() = old;
            core.coord.set_mode(old_mode);
            return Err(e.to_string());
        }
        tracing::info!(campaign = %id, strategy = %name, "campaign started");
        self.drain(&mut core, now);
        drop(core);
        Ok(self.status())
    }
}

impl std::fmt::Debug for Aggregator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Aggregator").finish_non_exhaustive()
    }
}
