//! The service shell: QUIC ingest, the round driver, sled state and publishing around the
//! sans-IO [`Coordinator`].
//!
//! The daemon and the test kit start it through [`crate::lifecycle`], which wraps
//! `Aggregator::open(config, publisher, clock)` → [`Aggregator::bind`] →
//! [`Aggregator::run`]`(endpoint, shutdown)` with `/metrics` and MQTT. `run`
//! serves on `fedfleet_net`'s accept loop until the [`fedfleet_net::Shutdown`] switch flips;
//! every connection handler waits on the same switch, so shutdown stops accepting, lets
//! in-flight requests finish (each commit point is atomic, so a cut-off upload simply gets no
//! receipt), then flushes. Every deadline and stamp is read from the clock it was opened with.
//!
//! One lock ([`Core`], a `std` mutex never held across an `.await`) guards the coordinator. An
//! upload does every check it can without it (identity, signature, size, digest, decoding,
//! layout, finite values) and takes it for admission + fold + commit, so the engine sees
//! updates one at a time. Accepted uploads are decoded, folded and recorded by one fold
//! thread and made durable in groups by one sync thread (`ingest::CommitQueue`); other
//! CPU-heavy work runs in `spawn_blocking`.
//!
//! See [`crate::wire`] for the protocol and [`crate::persist`] for the commit points.
//!
//! Here: opening (recovery of the state and the current round) and status. By concern:
//! `quic` (bind, accept loop, one request per stream), `ingest` (one upload from either
//! transport, to its durable commit), `rounds` (engine events, deadlines, finalizing and
//! publishing a round, starting campaigns), `base` (the round's base model and the tensors an
//! update carries).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ed25519_dalek::SigningKey;
use fedfleet_certs::{AllowList, CaCert, DeviceStatus, PeerIdentity, ServerIdentity};
use fedfleet_learning::{Dataset, ModelSpec};
use fedfleet_net::FramedStream;
use fedfleet_protocol::framing::{Frame, FrameKind};
use fedfleet_protocol::messages::{self, ModelRef};
use fedfleet_protocol::{
    AdapterLineage, BundleLimits, DType, Digest, Layout, Message, ModelInfo, ModelVersion, NewVersion, PayloadCheck, Receipt, RejectReason,
    Rejection, RoundId, SharedClock, Signed, SignedUpdate, SpecJson, TensorBundle,
};
use tokio::sync::{Notify, watch};

use crate::config::{Config, FoldBackend};
use crate::coordinator::FoldMode;
use crate::engine::{CampaignId, CampaignSpec, EngineConfig, EngineEvent, Invitation, Millis, RoundEngine, RoundPolicy, UpdateMeta};
use crate::persist::{AcceptedRecord, Boundary, CampaignMeta, GlobalRef, Store};
use crate::publish::{PublishRequest, Publisher};
use crate::strategy::{ServerStrategy, Strategy};
use crate::wire::{CampaignOverrides, CampaignStatus, LocalDpReport, MAX_WIRE_MESSAGE, NoiseSource, PrivacyReport, Request, Response};
use crate::{Coordinator, metrics::Metrics};

mod base;
mod history;
mod ingest;
mod quic;
mod relay;
mod rounds;
mod secagg;

use base::Base;
pub use history::RoundRecord;
use ingest::{decode_base, stored_delta};
pub use ingest::{decode_update, flatten, unflatten};

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
    /// `[compute]` asks for a device this machine does not have.
    #[error("{0}")]
    Compute(String),
    /// The receipt signing key could not be read or created.
    #[error("receipt key in {path}: {cause}")]
    ReceiptKey { path: std::path::PathBuf, cause: String },
    /// `[model] validation` could not be loaded.
    #[error("model.validation: {0}")]
    Validation(String),
    /// The state on disk cannot be resumed (a snapshot that does not decode, a round without
    /// its base model, an accepted update that does not refold).
    #[error("{path}: cannot resume: {detail}")]
    Resume { path: std::path::PathBuf, detail: String },
    /// `[campaign]`'s strategy settings.
    #[error("[campaign] strategy: {0}")]
    Strategy(String),
    /// `[mqtt]`: the fleet, the broker or the control client.
    #[error("[mqtt]: {0}")]
    Mqtt(String),
    /// `[model] spec` no longer describes the campaign's global model (e.g. full fine-tuning
    /// switched to LoRA): resuming would refuse every update.
    #[error(
        "{data_dir}: model.spec changed since global model v{version} was made ({detail}); keep the old spec, or start the new \
         lineage in a fresh data_dir from `fedfleet-aggregator init-model` (with --pretrained for LoRA over trained weights)"
    )]
    SpecChanged { data_dir: std::path::PathBuf, version: u64, detail: String },
    /// `[publish]`: the registry publisher could not be set up.
    #[error("{0}")]
    Publisher(String),
    /// `metrics_addr` could not be bound.
    #[error("metrics_addr {addr}: {cause}")]
    Metrics { addr: SocketAddr, cause: std::io::Error },
    /// `[console]`: its address could not be bound, or its tokens file is bad.
    #[error("[console] {0}")]
    Console(String),
}

struct Core {
    coord: Coordinator<ServerStrategy>,
    base: Option<Base>,
    global: Option<GlobalRef>,
    campaign: CampaignMeta,
    /// A closed round waiting for the driver to finalize and publish it.
    closing: Option<RoundId>,
    /// The model finalized for the closing round, kept until it is published: finalizing
    /// consumes the round's fold, so a publish that failed (registry down) is retried with this
    /// model instead of folding again. (After a crash the round is refolded from the store.)
    finalized: Option<(RoundId, Vec<f32>)>,
    /// `[secure_aggregation]`: the open round's stages (lost in a restart).
    secagg: Option<secagg::SecAggRound>,
    /// The round before's, for devices that ask for its receipt or failure after it ended.
    secagg_before: Option<secagg::SecAggRound>,
    /// What the history will record of the open or closing round (lost in a restart: the
    /// round's record then has no opening facts).
    round_log: Option<history::RoundRecord>,
    /// The arrival rate the next round's start window asks for (lost in a restart).
    pacer: crate::pacing::ArrivalPacer,
}

struct Shared {
    cfg: Config,
    /// Every deadline, receipt and record is stamped by this clock (a fake one in tests).
    clock: SharedClock,
    spec: ModelSpec,
    spec_json: SpecJson,
    store: Store,
    key: Arc<SigningKey>,
    /// Shared with the MQTT control client, which checks device signatures with it.
    allow: Arc<AllowList>,
    /// The CA-signed revocation list (`revoked.json`), reread when it changes: the one source
    /// of revocation, checked by the TLS handshake and again by every upload (a connection
    /// opened before the revocation stays open).
    revocation: Arc<fedfleet_certs::RevocationWatcher>,
    /// The fleet CA and this service's certificate and key (QUIC server, MQTT client, expiry gauge).
    ca: CaCert,
    identity: ServerIdentity,
    metrics: Arc<Metrics>,
    publisher: Box<dyn Publisher>,
    validation: Option<Dataset>,
    /// `[compute] fold = "tensor"`: the burn device the FedAvg family's rounds are folded on.
    tensor_device: Option<burn::tensor::Device>,
    core: Mutex<Core>,
    wake: Notify,
    /// `[admission] max_bytes_in_flight` in KiB permits.
    in_flight: Arc<tokio::sync::Semaphore>,
    /// The open round's signed announcement (encoded), for the MQTT control plane.
    announce: watch::Sender<Option<Vec<u8>>>,
    /// Every round's outcome, newest last (the console's campaign view).
    history: fedfleet_durable::Journal,
    /// A relay's link to its parent, made on first use (inside the runtime).
    parent: std::sync::OnceLock<relay::Parent>,
    /// Checked uploads on their way to the commit thread.
    commits: ingest::CommitQueue,
    /// The model most recently served to devices (each asks for the round's base once).
    served_model: Mutex<Option<(Digest, Arc<Vec<u8>>)>>,
}

/// Where an upload's payload comes from. Both transports go through [`Aggregator::ingest`].
pub enum Payload<'a> {
    /// QUIC: `Chunk` frames up to `End`, read only after the header passed every cheap check.
    Quic(&'a mut FramedStream),
    /// MQTT: the upload the control client reassembled and verified, with the budget share its
    /// caller holds for it ([`Aggregator::wait_for_bytes`]). Boxed: its signed header is a few
    /// hundred bytes, which every ingest future would carry.
    Mqtt(Box<fedfleet_control::VerifiedUpload>, &'a BytesInFlight),
}

/// A share of the `[admission] max_bytes_in_flight` budget, held while an upload that arrived
/// whole (over MQTT) is checked, folded and made durable.
pub struct BytesInFlight {
    _permit: tokio::sync::OwnedSemaphorePermit,
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

/// What differs between the global model's tensors and the spec's, named (at most a few of
/// each kind); `None` when they agree.
fn layout_change(global: &Layout, spec: &Layout) -> Option<String> {
    let list = |names: Vec<String>| {
        let more = names.len().saturating_sub(4);
        let mut s = names.into_iter().take(4).collect::<Vec<_>>().join(", ");
        if more > 0 {
            s += &format!(" and {more} more");
        }
        s
    };
    let diff = fedfleet_protocol::bundle::LayoutDiff::between(spec, global);
    let added: Vec<String> = diff.missing.iter().map(|(n, s)| format!("{n} {s:?}")).collect();
    let removed = diff.unexpected.iter().map(|(n, s)| format!("{n} {s:?}")).collect();
    let reshaped = diff.reshaped.iter().map(|(n, g, s)| format!("{n} {g:?} -> {s:?}")).collect();
    let mut parts = Vec::new();
    for (what, names) in [("the spec adds", added), ("the spec drops", removed), ("the spec reshapes", reshaped)] {
        if !names.is_empty() {
            parts.push(format!("{what} {}", list(names)));
        }
    }
    (!parts.is_empty()).then(|| parts.join("; "))
}

/// Streaming unless the tensor path is on and `strategy` is a weighted mean.
fn fold_mode(tensor: bool, strategy: &ServerStrategy) -> FoldMode {
    if tensor && strategy.is_mean_based() { FoldMode::Deferred } else { FoldMode::Streaming }
}
impl Aggregator {
    /// Opens the data directory (refusing damaged state), loads identities, restores the
    /// coordinator and refolds the current round's accepted updates.
    pub fn open(cfg: Config, publisher: Box<dyn Publisher>, clock: SharedClock) -> Result<Aggregator, ServiceError> {
        // The compute device first: a missing GPU refuses the start before any state is touched.
        let metrics = Arc::new(Metrics::new(clock.clone()));
        let resume = |detail: String| ServiceError::Resume { path: cfg.data_dir.clone(), detail };
        let tensor_device = match cfg.compute.fold {
            FoldBackend::Exact => None,
            FoldBackend::Tensor => {
                let picked = crate::accel::select_device(&cfg.compute.device).map_err(|e| ServiceError::Compute(e.to_string()))?;
                tracing::info!("FedAvg-family rounds are folded on burn tensors: {}", picked.adapter);
                metrics.compute_adapter(&picked.adapter);
                Some(picked.device)
            }
        };
        let store = Store::open(&cfg.data_dir)?;
        let key = crate::keys::load_or_create(&cfg.data_dir)
            .map(Arc::new)
            .map_err(|e| ServiceError::ReceiptKey { path: cfg.data_dir.clone(), cause: e.to_string() })?;
        let allow = Arc::new(AllowList::load(fedfleet_certs::layout::allow_list(&cfg.pki_dir))?);
        let revocation = Arc::new(fedfleet_certs::RevocationWatcher::open(&cfg.pki_dir)?);
        let ca = CaCert::load(fedfleet_certs::layout::ca_cert(&cfg.pki_dir))?;
        let identity = ServerIdentity::load(&cfg.pki_dir, &cfg.server_identity)?;
        let fleet = allow.fleet();
        let spec = cfg.model.spec.clone();
        let spec_json = cfg.spec_json();
        let validation = match &cfg.model.validation {
            Some(v) => Some(v.load().map_err(|e| ServiceError::Validation(e.to_string()))?),
            None => None,
        };
        let engine = match store.engine()? {
            Some(b) => RoundEngine::from_bytes(&b)
                .map_err(|e| ServiceError::Resume { path: cfg.data_dir.clone(), detail: format!("engine snapshot: {e}") })?,
            None => RoundEngine::new(fleet, EngineConfig { nonce_retention_rounds: 8 }, RoundId(1)),
        };
        let strategy = match store.strategy()? {
            Some(b) => postcard::from_bytes(&b)
                .map_err(|e| ServiceError::Resume { path: cfg.data_dir.clone(), detail: format!("strategy snapshot: {e}") })?,
            None => ServerStrategy::new(&cfg.strategy_config(), update_dim(&spec)).map_err(|e| ServiceError::Strategy(e.to_string()))?,
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
            finalized: None,
            secagg: None,
            secagg_before: None,
            round_log: None,
            pacer: crate::pacing::ArrivalPacer::resume(cfg.admission.arrivals_per_second, store.arrival_rate()?),
        };
        if let Some(g) = global {
            let bytes = store.read_model(&g.digest)?;
            let (layout, values) = decode_base(&bytes).map_err(|e| resume(format!("global model {}: {e}", g.digest)))?;
            if let Some(detail) = layout_change(&layout, &spec.layout()) {
                return Err(ServiceError::SpecChanged { data_dir: cfg.data_dir.clone(), version: g.version.0, detail });
            }
            core.base = Some(Base::new(g.digest, g.version, layout, values, &spec.update_layout()));
        }
        // Refold the current round (open, or closed and not yet published).
        let current = core.coord.engine().round_status().map(|s| s.round).or_else(|| core.coord.engine().awaiting_model());
        if let Some(round) = current {
            let base = core.base.clone().ok_or_else(|| resume("a round is open but no global model is recorded".into()))?;
            let dtype = core.campaign.payload_dtype();
            let mut records = store.accepted_in(round)?;
            let receipt_of =
                |rec: &AcceptedRecord| Signed::<Receipt>::decode(&rec.receipt).map_err(|e| resume(format!("stored receipt: {e}")));
            // The engine was snapshotted at the round's last boundary: updates accepted since
            // are re-admitted from their records (an open round only; a closed one holds them).
            if core.coord.engine().round_status().is_some_and(|s| s.round == round) {
                // A record whose payload did not survive was never acknowledged (the group commit
                // syncs payloads before records; sled may flush a record on its own): drop it,
                // and the device's resend is taken.
                let (kept, lost): (Vec<_>, Vec<_>) = records.into_iter().partition(|r| store.has_update(&r.payload_digest));
                for rec in &lost {
                    let receipt = receipt_of(rec)?;
                    store.forget_accepted(&receipt.body().nonce, rec)?;
                    tracing::warn!(device = %rec.device, payload = %rec.payload_digest, "dropped an update accepted but never acknowledged: its payload was not synced before the crash");
                }
                records = kept;
                for rec in &records {
                    let receipt = receipt_of(rec)?;
                    // A relay's sum was admitted discounted by its staleness in a buffer (a
                    // device's record keeps its discounted weight already).
                    let weight = match rec.relayed {
                        0 => rec.weight,
                        _ => fedfleet_rounds::staleness_weight(rec.weight, core.coord.engine().staleness_of(receipt.body().round)),
                    };
                    let contribution = fedfleet_rounds::engine::Contribution {
                        device: rec.device.clone(),
                        nonce: fedfleet_rounds::Nonce(receipt.body().nonce),
                        num_examples: rec.weight,
                        weight,
                        payload_digest: rec.payload_digest,
                        accepted_at: receipt.body().accepted_at_unix_ms,
                        updates: rec.relayed.max(1),
                    };
                    core.coord
                        .engine_mut()
                        .readmit(round, contribution)
                        .map_err(|e| resume(format!("re-admitting {}: {e}", rec.payload_digest)))?;
                }
            }
            // A deferred fold only counts here; its payloads are read when the round closes.
            let deferred = core.coord.mode() == FoldMode::Deferred;
            for rec in &records {
                let refolded = if rec.relayed > 0 {
                    let partial = relay::stored_partial(&store, rec, &base).map_err(resume)?;
                    let receipt = receipt_of(rec)?;
                    core.coord.resume_merge(round, receipt.body().round, &partial)
                } else {
                    let delta = if deferred { Vec::new() } else { stored_delta(&store, rec, &base, dtype).map_err(resume)? };
                    core.coord.resume_fold(round, &delta, rec.weight)
                };
                refolded.map_err(|e| resume(format!("refold of {}: {e}", rec.payload_digest)))?;
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
        let history = store.journal("round_history", history::KEEP)?;
        let in_flight_kib = cfg.admission.in_flight_kib();
        let commits = ingest::CommitQueue::start().map_err(|e| resume(format!("starting the commit pipeline's threads: {e}")))?;
        let agg = Aggregator {
            shared: Arc::new(Shared {
                announce,
                history,
                cfg,
                clock,
                revocation,
                spec,
                spec_json,
                store,
                key,
                allow,
                ca,
                identity,
                metrics,
                publisher,
                validation,
                tensor_device,
                core: Mutex::new(core),
                wake: Notify::new(),
                in_flight: Arc::new(tokio::sync::Semaphore::new(in_flight_kib as usize)),
                parent: std::sync::OnceLock::new(),
                commits,
                served_model: Mutex::new(None),
            }),
        };
        {
            let mut core = agg.lock();
            agg.drain(&mut core, agg.now_ms());
        }
        Ok(agg)
    }

    /// `device`'s key while it is enrolled (the allow-list) and not revoked (the signed list):
    /// a device that may still send updates.
    fn sending_key(&self, device: &fedfleet_protocol::DeviceId) -> Option<ed25519_dalek::VerifyingKey> {
        match self.shared.allow.status(device) {
            DeviceStatus::Enrolled(k) if !self.shared.revocation.is_revoked(device) => Some(k),
            _ => None,
        }
    }

    /// The service's clock, read (unix ms).
    pub fn now_ms(&self) -> Millis {
        self.shared.clock.now_ms()
    }

    /// Tells the round driver the clock moved (a test's fake clock): deadlines now due are
    /// handled without waiting for the driver's timer.
    pub fn clock_moved(&self) {
        self.shared.wake.notify_one();
    }

    pub fn metrics(&self) -> Arc<Metrics> {
        self.shared.metrics.clone()
    }

    /// The clock the service was opened with.
    pub fn clock(&self) -> SharedClock {
        self.shared.clock.clone()
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

    /// The receipt key itself, for the MQTT control plane (it signs refusals over MQTT too).
    pub(crate) fn receipt_signing_key(&self) -> Arc<SigningKey> {
        self.shared.key.clone()
    }

    /// The fleet's allow-list (enrolled device keys, revocations), re-read when the file changes.
    pub(crate) fn allow_list(&self) -> Arc<AllowList> {
        self.shared.allow.clone()
    }

    /// The fleet CA this service trusts.
    pub fn ca(&self) -> &CaCert {
        &self.shared.ca
    }

    /// This service's certificate and key, loaded once at [`Aggregator::open`].
    pub fn identity(&self) -> &ServerIdentity {
        &self.shared.identity
    }

    fn lock(&self) -> MutexGuard<'_, Core> {
        self.shared.core.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Where the campaign stands.
    pub fn status(&self) -> CampaignStatus {
        let core = self.lock();
        let e = core.coord.engine();
        let rs = e.round_status();
        let sh_cfg = &self.shared.cfg;
        CampaignStatus {
            campaign: e.campaign_id().map(|c| c.0),
            // The label the campaign started with (strategy and mode), kept across restarts.
            strategy: e.campaign_id().map(|_| core.campaign.strategy.clone().unwrap_or_else(|| core.coord.strategy().name().to_owned())),
            rounds_completed: e.rounds_completed(),
            open_round: rs.as_ref().map(|s| s.round),
            accepted: rs.as_ref().map(|s| s.accepted).unwrap_or(0),
            target: rs.as_ref().map(|s| s.target).unwrap_or(0),
            deadline_unix_ms: rs.as_ref().map(|s| s.deadline),
            global: core.global.map(|g| (g.version, g.digest)),
            last_outcome: core.campaign.last_outcome.clone(),
            privacy: e.privacy().or(core.campaign.last_privacy).map(|p| PrivacyReport {
                noise_multiplier: p.spend.noise_multiplier,
                sampling_rate: p.spend.sampling_rate,
                delta: p.spend.delta,
                epsilon_spent: p.epsilon_spent,
                epsilon_budget: p.epsilon_budget,
                noise_added_by: if sh_cfg.secure_aggregation.is_some() { NoiseSource::Devices } else { NoiseSource::Aggregator },
            }),
            // The running campaign's spend (a finished one's is in its published versions).
            local_dp: sh_cfg.campaign.local_dp.zip(e.rounds_completed()).map(|(l, rounds)| LocalDpReport {
                clip_norm: l.clip_norm,
                noise_multiplier: l.noise_multiplier,
                delta: l.delta,
                rounds,
                epsilon_per_device: l.epsilon_per_device(u64::from(rounds)),
            }),
            secure_aggregation: self.secagg_report(&core),
        }
    }

    /// An append-only journal in the service's store (the console's audit trail).
    pub fn journal(&self, name: &str, keep: usize) -> Result<fedfleet_durable::Journal, ServiceError> {
        Ok(self.shared.store.journal(name, keep)?)
    }

    /// Stops the running campaign (its open round fails).
    pub fn stop_campaign(&self) -> Result<CampaignStatus, String> {
        let mut core = self.lock();
        let r = core.coord.engine_mut().stop_campaign(self.now_ms());
        self.drain(&mut core, self.now_ms());
        drop(core);
        r.map_err(|e| e.to_string())?;
        Ok(self.status())
    }

    /// The current global model's digest and bytes, if any.
    pub fn global_model(&self) -> Option<(GlobalRef, Vec<u8>)> {
        let g = self.lock().global?;
        self.shared.store.read_model(&g.digest).ok().map(|b| (g, b))
    }
}

impl std::fmt::Debug for Aggregator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Aggregator").finish_non_exhaustive()
    }
}
