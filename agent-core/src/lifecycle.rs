//! The agent lifecycle: a sans-IO state machine.
//!
//! **Architecture invariant:** no sockets, no clock reads, no async here. Time (`now`, unix
//! milliseconds) is passed in; inputs go to [`Lifecycle::handle`] and
//! [`Lifecycle::handle_timeout`]; the shell polls [`Lifecycle::poll_action`] and
//! [`Lifecycle::poll_timeout`]. The core owns no store: every transition is returned as a
//! [`Persist`] (the new state, an outbox write or removal; [`Lifecycle::poll_persist`]) that the
//! shell writes and flushes **before** it takes the next [`Action`], as quinn-proto hands out
//! transmits. A crash at any point restarts into a state consistent with what was done:
//! [`Lifecycle::open`] takes what the shell saved ([`Saved`]) and re-queues whatever was in
//! flight.
//!
//! Slots: the active model serves inference; a new version is verified (the registry's TUF
//! [`Verifier`], held and persisted here), staged in the other slot, health-checked, and only
//! then activated, by one state write that flips the slots. A crash before that write leaves the
//! previous model active.

use std::collections::{BTreeMap, VecDeque};

use fedfleet_protocol::tuf::Verifier;
use fedfleet_protocol::tuf::{Root, SignedMetadata, Targets, Timestamp};
use fedfleet_protocol::{
    DeviceId, DeviceState, DeviceStatus, Digest, FleetId, ModelRef, Receipt, RejectReason, Rejection, RolloutAction, RolloutNotice,
    RoundAnnouncement, RoundId, SignedUpdate, StorageFault,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// A signed update waiting for the aggregator's receipt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutboxEntry {
    pub id: u64,
    pub round: RoundId,
    pub nonce: [u8; 16],
    pub payload_digest: Digest,
    /// The encoded `SignedUpdate` envelope, exactly as signed.
    #[serde(with = "fedfleet_protocol::serde_hex::vec")]
    pub header: Vec<u8>,
    /// The safetensors payload (hex in the store's JSON record).
    #[serde(with = "fedfleet_protocol::serde_hex::vec")]
    pub payload: Vec<u8>,
    pub created_at_ms: u64,
}

/// A write the shell must make durable before it runs the next [`Action`].
#[derive(Debug, Clone, PartialEq)]
pub enum Persist {
    /// The whole persisted state (JSON), replacing the previous one.
    State(Vec<u8>),
    /// A new outbox entry.
    PutOutbox(OutboxEntry),
    /// An outbox entry acknowledged or dropped.
    RemoveOutbox(u64),
}

/// What the shell saved: the last [`Persist::State`] and the outbox entries.
#[derive(Debug, Clone, Default)]
pub struct Saved {
    pub state: Option<Vec<u8>>,
    pub outbox: Vec<OutboxEntry>,
}

/// The core's writes applied in memory: what any store holds after them (the agent's sled store
/// applies the same writes durably). The store of the core-only tests and of `fedfleet-sim`.
#[derive(Debug, Clone, Default)]
pub struct MemoryStore {
    pub state: Option<Vec<u8>>,
    pub outbox: BTreeMap<u64, OutboxEntry>,
}

impl MemoryStore {
    pub fn apply(&mut self, write: Persist) {
        match write {
            Persist::State(bytes) => self.state = Some(bytes),
            Persist::PutOutbox(entry) => {
                self.outbox.insert(entry.id, entry);
            }
            Persist::RemoveOutbox(id) => {
                self.outbox.remove(&id);
            }
        }
    }

    /// What a reopened core starts from.
    pub fn saved(&self) -> Saved {
        Saved { state: self.state.clone(), outbox: self.outbox.values().cloned().collect() }
    }
}

/// Unix time in milliseconds.
pub use fedfleet_protocol::Millis;

/// Why a device does not join a round (logged once per round and reason; never an error).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RoundRefusal {
    #[error("round for fleet {round}, device is in {device}")]
    OtherFleet { round: FleetId, device: FleetId },
    #[error("this device's certificate was revoked (the aggregator refused its update as revoked)")]
    Revoked,
    #[error("round {0} already done")]
    AlreadyDone(RoundId),
    #[error("busy training round {0}")]
    Busy(RoundId),
    #[error("deadline passed")]
    DeadlinePassed,
    #[error("not selected")]
    NotSelected,
    #[error("device not idle")]
    NotIdle,
    #[error("device not charging")]
    NotCharging,
    #[error("{have} fresh samples, {need} required")]
    TooFewFreshSamples { have: u64, need: u64 },
    #[error("{have} local samples, round needs {need}")]
    TooFewLocalSamples { have: u64, need: u64 },
}

/// Why a staged model fails its health check (the device rolls back and reports this text).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum HealthFailure {
    #[error("no holdout examples to check the model on")]
    NoHoldout,
    #[error("outputs contain NaN/Inf")]
    NonFinite,
    #[error("p99 latency {p99_ms:.2} ms over the {budget_ms:.2} ms budget")]
    TooSlow { p99_ms: f64, budget_ms: f64 },
    #[error("{metric} is not finite")]
    ScoreNotFinite { metric: String },
    #[error("holdout {metric} {candidate:.4} is worse than the active model's {active:.4} by more than {allowed:.4}")]
    Worse { metric: String, candidate: f64, active: f64, allowed: f64 },
    #[error("holdout {metric} {candidate:.4} is below guessing's {chance:.4} by more than {allowed:.4}: the model is broken")]
    BelowChance { metric: String, candidate: f64, chance: f64, allowed: f64 },
}

/// Errors of the lifecycle (only persistence can fail; bad inputs are reported, not errors).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LifecycleError {
    #[error("saved agent state is unreadable ({0}); move the store aside and enroll again")]
    CorruptState(String),
    #[error("no persisted state and no pinned registry root: run `fedfleet-agent enroll` first")]
    NotEnrolled,
    #[error("pinned registry root refused: {0}")]
    BadRoot(fedfleet_protocol::tuf::TufError),
    #[error("persisted state belongs to device {found}, but the identity is {expected}")]
    WrongDevice { expected: DeviceId, found: DeviceId },
    /// Rounds of the configured fleet would all be refused as another fleet's: refuse to start.
    #[error(
        "this device's store is in fleet {saved}, but the config says fleet {configured}: fix `fleet` in the config (or move the store aside to enroll the device in the new fleet)"
    )]
    WrongFleet { configured: FleetId, saved: FleetId },
}

/// Which slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Slot {
    A,
    B,
}

impl Slot {
    pub fn other(self) -> Slot {
        match self {
            Slot::A => Slot::B,
            Slot::B => Slot::A,
        }
    }
}

/// A model held in a slot: its reference and its spec (JSON, as in the signed targets).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SlotModel {
    pub model: ModelRef,
    pub spec: String,
}

/// Local conditions for joining rounds (from config or the device's status file).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Conditions {
    pub idle: bool,
    pub charging: bool,
    /// Samples collected since the last round this device trained in.
    pub fresh_samples: u64,
}

impl Default for Conditions {
    fn default() -> Self {
        Conditions { idle: true, charging: true, fresh_samples: u64::MAX }
    }
}

/// When the device may train.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ParticipationPolicy {
    pub require_idle: bool,
    pub require_charging: bool,
    pub min_fresh_samples: u64,
}

impl Default for ParticipationPolicy {
    fn default() -> Self {
        ParticipationPolicy { require_idle: true, require_charging: false, min_fresh_samples: 0 }
    }
}

/// Health-check thresholds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct HealthPolicy {
    /// Budget for the p99 single-example latency on the local holdout.
    pub max_latency_ms: f64,
    /// The candidate may be at most this much less accurate than the active model (0.02 = 2
    /// points), or one standard error of the accuracy difference on the holdout where that is larger.
    pub accuracy_margin: f64,
}

impl Default for HealthPolicy {
    fn default() -> Self {
        HealthPolicy { max_latency_ms: 50.0, accuracy_margin: 0.02 }
    }
}

/// Retry timing: exponential backoff with jitter, `delay = d/2 + U(0, d/2)`, `d = min(max,
/// base·2^(attempt-1))`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Backoff {
    pub base_ms: u64,
    pub max_ms: u64,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff { base_ms: 1_000, max_ms: 300_000 }
    }
}

impl Backoff {
    /// The delay before attempt `attempt + 1`, given `attempt >= 1` failures.
    pub fn delay(&self, attempt: u32, rng: &mut impl Rng) -> u64 {
        let exp = attempt.saturating_sub(1).min(32);
        let d = self.base_ms.saturating_mul(1u64 << exp).min(self.max_ms).max(1);
        d / 2 + rng.gen_range(0..=d - d / 2)
    }
}

/// Static configuration of the core.
#[derive(Debug, Clone, PartialEq)]
pub struct CoreConfig {
    pub device: DeviceId,
    pub fleet: FleetId,
    /// Named rollout cohort of this device, if any.
    pub cohort: Option<String>,
    /// Size of the local training set.
    pub local_samples: u64,
    pub participation: ParticipationPolicy,
    pub health: HealthPolicy,
    pub backoff: Backoff,
    /// Metadata/download attempts before an install is given up (and reported failed).
    pub max_install_attempts: u32,
    /// Seed of the jitter RNG (from the OS in the daemon, fixed in tests).
    pub rng_seed: u64,
}

impl CoreConfig {
    pub fn new(device: DeviceId, fleet: FleetId) -> Self {
        CoreConfig {
            device,
            fleet,
            cohort: None,
            local_samples: 0,
            participation: ParticipationPolicy::default(),
            health: HealthPolicy::default(),
            backoff: Backoff::default(),
            max_install_attempts: 5,
            rng_seed: 0,
        }
    }
}

/// Where an install is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum InstallPhase {
    /// Fetching signed metadata (root updates, timestamp, targets).
    Metadata,
    /// Metadata verified; downloading `length` bytes.
    Downloading { length: u64, spec: String },
    /// Artifact verified and staged in the inactive slot; health check pending.
    Staged,
}

/// An install in progress.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InstallJob {
    pub rollout_id: u64,
    pub model: ModelRef,
    pub phase: InstallPhase,
    pub attempts: u32,
    /// Health checks of the staged candidate started (committed before each one runs): a
    /// check that kills the agent is not retried on every start for ever.
    #[serde(default)]
    pub health_checks_started: u32,
}

/// Starts of a candidate's health check that may end without a result (the agent died during
/// it) before the candidate is given up and reported failed.
pub const MAX_HEALTH_CHECK_STARTS: u32 = 3;

/// A device reports its round progress (joined a round, trained) at most this often, and the
/// state in between rides on the next report. Two reports a round from every device were two of
/// the registry's five requests per update (issue 27). Failures, revocation and every rollout
/// state are reported at once.
pub const ROUND_PROGRESS_REPORT_MS: Millis = 60_000;

/// Everything that survives a restart (besides the outbox and blobs).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PersistedState {
    pub format: u32,
    pub device: DeviceId,
    pub fleet: FleetId,
    /// The slot the active model is in; the staged one is in the other.
    pub active_slot: Slot,
    pub active: Option<SlotModel>,
    pub staged: Option<SlotModel>,
    /// The model active before the current one (for rollout roll-backs).
    pub previous: Option<SlotModel>,
    /// A round the device is training for (re-trained after a crash).
    pub round: Option<RoundAnnouncement>,
    /// Highest round this device trained for or gave up on.
    pub last_round: Option<RoundId>,
    /// The base model of `last_round`: a round id at or below it with another base is a fresh
    /// aggregator instance counting from 1 again, not a round already done.
    #[serde(default)]
    pub last_round_base: Option<Digest>,
    pub install: Option<InstallJob>,
    /// Last install that failed (rollout id, digest): not retried for the same rollout.
    pub last_failed: Option<(u64, Digest)>,
    pub verifier: Verifier,
    pub last_state: DeviceState,
    /// The next outbox id (ids are never reused).
    #[serde(default)]
    pub next_outbox_id: u64,
    /// The aggregator refused an update because this device's certificate is revoked: the
    /// device trains no more rounds (until it is enrolled again with a new store).
    #[serde(default)]
    pub revoked: bool,
    /// The latest time this device has seen (Unix ms), never lowered: every input is judged at
    /// no earlier a time, so a clock stepped back (after a restart too) does not make expired
    /// metadata fresh again or push timers into the future. Saved with the next commit.
    #[serde(default)]
    pub latest_time: Millis,
}

impl PersistedState {
    /// The digests of the models in the slots: active, previous and staged. Their blobs stay.
    pub fn slot_digests(&self) -> impl Iterator<Item = Digest> + '_ {
        [&self.active, &self.previous, &self.staged].into_iter().flatten().map(|m| m.model.digest)
    }
}

/// What the health check measured (the shell runs it; the core judges it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HealthReport {
    pub holdout: usize,
    /// Candidate outputs contained NaN or Inf.
    pub non_finite: bool,
    pub latency_p50_ms: f64,
    pub latency_p99_ms: f64,
    /// The task's metric on the holdout, higher is better: accuracy for classification, minus
    /// the RMSE for regression and reconstruction (named in `metric`).
    pub candidate_score: f64,
    /// `None` when there is no active model (first install).
    pub active_score: Option<f64>,
    /// What guessing scores on this task (1/classes for accuracy): the floor every candidate is
    /// judged against, a first install included. `None` where the metric has no such level.
    #[serde(default)]
    pub chance_score: Option<f64>,
    /// What the scores are (`accuracy`, `-rmse`).
    pub metric: String,
}

/// One standard error of the difference of two accuracies measured on the same `n` examples
/// (0 for other metrics), Agresti–Caffo (one right and one wrong answer added to each, so a
/// perfect score on a few examples still has an error). On a device's small holdout a gap under
/// it is noise, not a regression: on 14 examples, 14 right against 13 right is one example,
/// 7 points, and a fixed 2-point margin would refuse that model on chance alone.
fn accuracy_difference_error(metric: &str, active: f64, candidate: f64, n: usize) -> f64 {
    if metric != "accuracy" || n == 0 {
        return 0.0;
    }
    let n = n as f64;
    let variance = |a: f64| {
        let p = (a.clamp(0.0, 1.0) * n + 1.0) / (n + 2.0);
        p * (1.0 - p) / (n + 2.0)
    };
    (variance(active) + variance(candidate)).sqrt()
}

/// Outcome of one upload attempt.
#[derive(Debug, Clone, PartialEq)]
pub enum UploadOutcome {
    Receipt(Receipt),
    /// The round aggregated securely and its sum holds this update: the aggregator's receipt
    /// names the masked vector the device sent (the update itself never left the device).
    SecurelyAggregated(Receipt),
    Rejected(Rejection),
    TransportError(String),
}

/// Signed metadata as fetched from the registry.
#[derive(Debug, Clone)]
pub struct MetadataSet {
    /// Root versions after the trusted one, in order (usually empty).
    pub roots: Vec<SignedMetadata<Root>>,
    pub timestamp: SignedMetadata<Timestamp>,
    pub targets: SignedMetadata<Targets>,
}

/// Inputs to the core.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Input {
    Conditions(Conditions),
    RoundAnnounced(RoundAnnouncement),
    /// Training finished: the encoded `SignedUpdate` and its payload.
    TrainingDone {
        round: RoundId,
        header: Vec<u8>,
        payload: Vec<u8>,
    },
    TrainingFailed {
        round: RoundId,
        reason: String,
    },
    /// The round's base model could not be fetched (a transient failure): retried with
    /// backoff while the round is open.
    BaseModelUnavailable {
        round: RoundId,
        reason: String,
    },
    UploadResult {
        outbox_id: u64,
        outcome: UploadOutcome,
    },
    Assignment(RolloutNotice),
    Metadata {
        model: ModelRef,
        result: Result<MetadataSet, String>,
    },
    /// The artifact is fully downloaded (partial file complete); length and digest as computed
    /// while writing it.
    DownloadDone {
        model: ModelRef,
        length: u64,
        digest: Digest,
    },
    DownloadFailed {
        model: ModelRef,
        reason: String,
    },
    /// The device's storage refused the artifact (disk full, I/O error): the install is
    /// deferred, not failed. What was written of it is discarded and the download retried with
    /// backoff, without limit: the space may come back, and the model is not at fault.
    StorageFailed {
        model: ModelRef,
        fault: StorageFault,
        detail: String,
    },
    HealthResult {
        model: ModelRef,
        result: Result<HealthReport, String>,
    },
    /// A service refused this device's certificate as revoked (at the handshake, or on a
    /// connection made before the revocation): like an update refused as revoked, the device
    /// joins no more rounds and reports why.
    CertificateRevoked {
        detail: String,
    },
}

/// Actions for the shell, polled in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Load this model for inference (on start and after activation/rollback).
    Serve { slot: Slot, model: SlotModel },
    /// Train for this round (base model by digest; fetch it if not cached).
    Train(RoundAnnouncement),
    /// Send outbox entry `outbox_id`.
    Upload { outbox_id: u64 },
    /// Fetch signed metadata for an install (the trusted root version is in the verifier).
    FetchMetadata { model: ModelRef, root_version: u64 },
    /// Download (resume) the artifact into the partial file, at most `length` bytes.
    Download { model: ModelRef, length: u64 },
    /// Discard a downloaded or staged artifact that failed.
    Discard { digest: Digest },
    /// Health-check the staged candidate against the active model.
    HealthCheck { slot: Slot, candidate: SlotModel, active: Option<SlotModel> },
    /// The candidate was refused; the active model keeps serving.
    Rollback { model: ModelRef, reason: String },
    /// Report status to the control plane.
    Report(DeviceStatus),
}

#[derive(Debug, Clone, Default)]
struct UploadTrack {
    attempts: u32,
    next_at: Option<Millis>,
    in_flight: bool,
}

/// The lifecycle core.
pub struct Lifecycle {
    cfg: CoreConfig,
    state: PersistedState,
    /// Entries not yet acknowledged, as saved.
    outbox: BTreeMap<u64, OutboxEntry>,
    /// Writes the shell makes durable before the next action.
    persists: VecDeque<Persist>,
    conditions: Conditions,
    uploads: BTreeMap<u64, UploadTrack>,
    install_retry_at: Option<Millis>,
    /// When to start (or, after the base model was unavailable, retry) training for the
    /// current round.
    train_at: Option<Millis>,
    /// Failed asks for the current round's base model.
    train_attempts: u32,
    /// Deferrals of the current install for want of storage (its backoff).
    storage_attempts: u32,
    /// The last round refusal logged at INFO (logged once per round and reason).
    last_refusal: Option<(RoundId, RoundRefusal)>,
    /// Whether this process has told the registry that it runs the model its assignment names
    /// (it activated it, or reported it once on hearing the assignment). A report lost to a crash
    /// right after the activation would leave the rollout waiting for this device for ever; one
    /// the network lost the shell sends again.
    assignment_reported: bool,
    /// When this process last reported its status.
    last_report_at: Option<Millis>,
    /// A round's progress not yet reported, and when it will be ([`ROUND_PROGRESS_REPORT_MS`]).
    report_at: Option<Millis>,
    actions: VecDeque<Action>,
    rng: ChaCha8Rng,
}

const FORMAT: u32 = 1;

impl Lifecycle {
    /// Opens the core on what the shell saved. Without a saved state, `pinned_root` (from enrollment)
    /// starts the verifier and `initial` becomes the active model (e.g. a factory model). With
    /// persisted state both are ignored, and whatever was in flight is queued again: the active
    /// model is served, an interrupted round retrained, an unfinished install resumed (a staged
    /// candidate is health-checked again, never activated unchecked), and every outbox entry
    /// re-sent.
    pub fn open(
        cfg: CoreConfig,
        saved: Saved,
        pinned_root: Option<SignedMetadata<Root>>,
        initial: Option<SlotModel>,
        now: Millis,
    ) -> Result<Self, LifecycleError> {
        let mut persists = VecDeque::new();
        let state = match saved.state {
            Some(raw) => {
                let st: PersistedState = serde_json::from_slice(&raw).map_err(|e| LifecycleError::CorruptState(e.to_string()))?;
                if st.device != cfg.device {
                    return Err(LifecycleError::WrongDevice { expected: cfg.device.clone(), found: st.device });
                }
                if st.fleet != cfg.fleet {
                    return Err(LifecycleError::WrongFleet { configured: cfg.fleet.clone(), saved: st.fleet });
                }
                st
            }
            None => {
                let root = pinned_root.ok_or(LifecycleError::NotEnrolled)?;
                let verifier = Verifier::new(root).map_err(LifecycleError::BadRoot)?;
                let st = PersistedState {
                    format: FORMAT,
                    device: cfg.device.clone(),
                    fleet: cfg.fleet.clone(),
                    active_slot: Slot::A,
                    active: initial,
                    staged: None,
                    previous: None,
                    round: None,
                    last_round: None,
                    last_round_base: None,
                    install: None,
                    last_failed: None,
                    verifier,
                    last_state: DeviceState::Idle,
                    next_outbox_id: 0,
                    revoked: false,
                    latest_time: now,
                };
                persists.push_back(Persist::State(serde_json::to_vec(&st).expect("state serializes")));
                st
            }
        };
        let rng = ChaCha8Rng::seed_from_u64(cfg.rng_seed);
        let mut lc = Lifecycle {
            cfg,
            state,
            outbox: saved.outbox.into_iter().map(|e| (e.id, e)).collect(),
            persists,
            conditions: Conditions::default(),
            uploads: BTreeMap::new(),
            install_retry_at: None,
            train_at: None,
            train_attempts: 0,
            storage_attempts: 0,
            last_refusal: None,
            assignment_reported: false,
            last_report_at: None,
            report_at: None,
            actions: VecDeque::new(),
            rng,
        };
        lc.resume(now)?;
        Ok(lc)
    }

    fn resume(&mut self, now: Millis) -> Result<(), LifecycleError> {
        if let Some(m) = self.state.active.clone() {
            self.actions.push_back(Action::Serve { slot: self.state.active_slot, model: m });
        }
        let outbox: Vec<OutboxEntry> = self.outbox.values().cloned().collect();
        // A crash after the outbox write but before the state write: the round is done.
        if let Some(r) = &self.state.round
            && outbox.iter().any(|e| e.round == r.round)
        {
            let mut next = self.state.clone();
            let round = r.round;
            close_round(&mut next, round);
            self.commit(next)?;
        }
        for e in &outbox {
            self.uploads.insert(e.id, UploadTrack { in_flight: true, ..Default::default() });
            self.actions.push_back(Action::Upload { outbox_id: e.id });
        }
        if let Some(r) = self.state.round.clone() {
            self.actions.push_back(Action::Train(r));
        }
        if let Some(job) = self.state.install.clone() {
            self.queue_install_step(&job, now)?;
        }
        Ok(())
    }

    // ----- getters -----

    pub fn state(&self) -> &PersistedState {
        &self.state
    }
    pub fn config(&self) -> &CoreConfig {
        &self.cfg
    }
    /// An outbox entry not yet acknowledged.
    pub fn outbox_entry(&self, id: u64) -> Option<&OutboxEntry> {
        self.outbox.get(&id)
    }
    /// Every outbox entry not yet acknowledged, oldest first.
    pub fn outbox(&self) -> impl Iterator<Item = &OutboxEntry> {
        self.outbox.values()
    }
    pub fn active(&self) -> Option<&SlotModel> {
        self.state.active.as_ref()
    }
    pub fn staged(&self) -> Option<&SlotModel> {
        self.state.staged.as_ref()
    }
    pub fn conditions(&self) -> Conditions {
        self.conditions
    }
    /// Outbox ids not yet acknowledged.
    pub fn pending_uploads(&self) -> Vec<u64> {
        self.uploads.keys().copied().collect()
    }
    /// The status report as of now.
    pub fn status(&self, now: Millis) -> DeviceStatus {
        DeviceStatus {
            fleet: self.state.fleet.clone(),
            device: self.state.device.clone(),
            reported_at_unix_ms: now,
            state: self.state.last_state.clone(),
            active: self.state.active.as_ref().map(|m| m.model.clone()),
            staged: self.state.staged.as_ref().map(|m| m.model.clone()),
            rollout_id: self.state.install.as_ref().map(|j| j.rollout_id),
        }
    }

    // ----- outputs -----

    /// The next write to make durable. The shell drains these (and flushes) before every
    /// [`poll_action`](Self::poll_action): an action never runs ahead of the state it implies.
    pub fn poll_persist(&mut self) -> Option<Persist> {
        self.persists.pop_front()
    }

    /// The next action; `None` while writes are pending (see [`poll_persist`](Self::poll_persist)).
    pub fn poll_action(&mut self) -> Option<Action> {
        if !self.persists.is_empty() {
            return None;
        }
        self.actions.pop_front()
    }

    /// The earliest time [`handle_timeout`](Self::handle_timeout) has work.
    pub fn poll_timeout(&self) -> Option<Millis> {
        self.uploads.values().filter_map(|t| t.next_at).chain(self.install_retry_at).chain(self.train_at).chain(self.report_at).min()
    }

    // ----- inputs -----

    /// `now`, or the latest time already seen if the clock went back; remembers it.
    fn observe(&mut self, now: Millis) -> Millis {
        self.state.latest_time = self.state.latest_time.max(now);
        self.state.latest_time
    }

    pub fn handle_timeout(&mut self, now: Millis) {
        let now = self.observe(now);
        for (id, t) in self.uploads.iter_mut() {
            if t.next_at.is_some_and(|at| at <= now) {
                t.next_at = None;
                t.in_flight = true;
                self.actions.push_back(Action::Upload { outbox_id: *id });
            }
        }
        if self.report_at.is_some_and(|at| at <= now) {
            self.report(now);
        }
        if self.train_at.is_some_and(|at| at <= now) {
            self.train_at = None;
            if let Some(round) = self.state.round.clone() {
                self.actions.push_back(Action::Train(round));
            }
        }
        if self.install_retry_at.is_some_and(|at| at <= now) {
            self.install_retry_at = None;
            if let Some(job) = self.state.install.clone()
                && let Err(e) = self.queue_install_step(&job, now)
            {
                tracing::warn!(error = %e, "install step not queued");
            }
        }
    }

    /// Feeds one input. Errors are persistence failures: the transition did not happen.
    pub fn handle(&mut self, now: Millis, input: Input) -> Result<(), LifecycleError> {
        let now = self.observe(now);
        match input {
            Input::Conditions(c) => {
                self.conditions = c;
                Ok(())
            }
            Input::RoundAnnounced(a) => self.on_round(now, a),
            Input::TrainingDone { round, header, payload } => self.on_trained(now, round, header, payload),
            Input::BaseModelUnavailable { round, reason } => {
                let Some(deadline) = self.state.round.as_ref().filter(|r| r.round == round).map(|r| r.deadline_unix_ms) else {
                    return Ok(());
                };
                self.train_attempts += 1;
                let at = now + self.cfg.backoff.delay(self.train_attempts, &mut self.rng);
                if at >= deadline {
                    return self.handle(now, Input::TrainingFailed { round, reason });
                }
                tracing::info!(%round, attempt = self.train_attempts, retry_in_ms = at - now, %reason, "base model unavailable; will ask again");
                self.train_at = Some(at);
                Ok(())
            }
            Input::TrainingFailed { round, reason } => {
                if self.state.round.as_ref().map(|r| r.round) != Some(round) {
                    return Ok(());
                }
                self.train_at = None;
                tracing::warn!(%round, %reason, "training failed; skipping the round");
                let mut next = self.state.clone();
                close_round(&mut next, round);
                next.last_state = DeviceState::Failed { reason: format!("training round {round}: {reason}") };
                self.commit(next)?;
                self.report(now);
                Ok(())
            }
            Input::UploadResult { outbox_id, outcome } => self.on_upload(now, outbox_id, outcome),
            Input::Assignment(n) => self.on_assignment(now, n),
            Input::Metadata { model, result } => self.on_metadata(now, model, result),
            Input::DownloadDone { model, length, digest } => self.on_downloaded(now, model, length, digest),
            Input::DownloadFailed { model, reason } => {
                if !self.install_is(&model) {
                    return Ok(());
                }
                // A registry turned away for load names when to come back: that is not the
                // model's fault, so it does not count against the install's attempts.
                if let Some(after) = fedfleet_protocol::reject::retry_after_ms(&reason) {
                    let delay = after + self.cfg.backoff.delay(1, &mut self.rng);
                    tracing::info!(%reason, delay_ms = delay, "download turned away for load; will come back");
                    self.install_retry_at = Some(now + delay);
                    return Ok(());
                }
                self.install_retry(now, format!("download: {reason}"))
            }
            Input::StorageFailed { model, fault, detail } => self.on_storage_failed(now, model, fault, detail),
            Input::HealthResult { model, result } => self.on_health(now, model, result),
            Input::CertificateRevoked { detail } => self.on_certificate_revoked(now, detail),
        }
    }

    // ----- rounds -----

    /// Why the device would not join `a` now, or `None` if it would.
    pub fn round_refusal(&self, now: Millis, a: &RoundAnnouncement) -> Option<RoundRefusal> {
        let p = &self.cfg.participation;
        let c = &self.conditions;
        Some(if a.fleet != self.state.fleet {
            RoundRefusal::OtherFleet { round: a.fleet.clone(), device: self.state.fleet.clone() }
        } else if self.state.revoked {
            RoundRefusal::Revoked
        } else if self.already_done(a) {
            RoundRefusal::AlreadyDone(a.round)
        } else if let Some(r) = &self.state.round {
            RoundRefusal::Busy(r.round)
        } else if now >= a.deadline_unix_ms {
            RoundRefusal::DeadlinePassed
        } else if !a.selection.selects(&self.state.device) {
            RoundRefusal::NotSelected
        } else if p.require_idle && !c.idle {
            RoundRefusal::NotIdle
        } else if p.require_charging && !c.charging {
            RoundRefusal::NotCharging
        } else if c.fresh_samples < p.min_fresh_samples {
            RoundRefusal::TooFewFreshSamples { have: c.fresh_samples, need: p.min_fresh_samples }
        } else if self.cfg.local_samples < a.config.min_samples {
            RoundRefusal::TooFewLocalSamples { have: self.cfg.local_samples, need: a.config.min_samples }
        } else {
            return None;
        })
    }

    /// Whether `a` is a round this device already trained for or gave up on: at or below the
    /// last one, with the same base model where the last one's base is known (a lower id with
    /// another base comes from a fresh aggregator instance).
    fn already_done(&self, a: &RoundAnnouncement) -> bool {
        self.state.last_round.is_some_and(|r| r >= a.round) && self.state.last_round_base.is_none_or(|b| b == a.base_model.digest)
    }

    fn on_round(&mut self, now: Millis, a: RoundAnnouncement) -> Result<(), LifecycleError> {
        if self.state.last_round.is_some_and(|r| r >= a.round) && !self.already_done(&a) && self.state.round.is_none() {
            tracing::info!(round = %a.round, last = ?self.state.last_round, "round ids started over with another base model: a fresh aggregator instance");
        }
        if let Some(why) = self.round_refusal(now, &a) {
            // A round this device skips says why at INFO, once per round and reason; a round it
            // already did or is training for is routine (every poll sees it again).
            let routine = self.already_done(&a) || self.state.round.is_some();
            let said = self.last_refusal.as_ref().is_some_and(|(r, w)| *r == a.round && *w == why);
            if routine || said {
                tracing::debug!(round = %a.round, %why, "not joining round");
            } else {
                tracing::info!(round = %a.round, %why, "not joining round");
                self.last_refusal = Some((a.round, why));
            }
            return Ok(());
        }
        let mut next = self.state.clone();
        next.round = Some(a.clone());
        next.last_state = DeviceState::Training { round: a.round };
        self.commit(next)?;
        self.train_attempts = 0;
        // The round's start window spreads the fleet's downloads and uploads; never more than
        // half the time left, so a late hearing still leaves time to train.
        let offset = a.start_offset_ms(&self.state.device).min(a.deadline_unix_ms.saturating_sub(now) / 2);
        if offset == 0 {
            self.train_at = None;
            self.actions.push_back(Action::Train(a));
        } else {
            tracing::debug!(round = %a.round, start_in_ms = offset, "joining round at its point in the start window");
            self.train_at = Some(now + offset);
        }
        self.report_progress(now);
        Ok(())
    }

    fn on_trained(&mut self, now: Millis, round: RoundId, header: Vec<u8>, payload: Vec<u8>) -> Result<(), LifecycleError> {
        if self.state.round.as_ref().map(|r| r.round) != Some(round) {
            tracing::warn!(%round, "training result for a round not in progress; dropped");
            return Ok(());
        }
        let signed = match SignedUpdate::decode(&header) {
            Ok(s) if s.body().round == round && s.body().device == self.state.device => s,
            Ok(_) => {
                return self.handle(now, Input::TrainingFailed { round, reason: "update header names another round or device".into() });
            }
            Err(e) => return self.handle(now, Input::TrainingFailed { round, reason: format!("update header: {e}") }),
        };
        let h = signed.body();
        let entry = OutboxEntry {
            id: self.next_outbox_id(),
            round,
            nonce: h.nonce,
            payload_digest: h.payload_digest,
            header,
            payload,
            created_at_ms: now,
        };
        // Commit point 1: the result is durable before anything else happens.
        self.persists.push_back(Persist::PutOutbox(entry.clone()));
        self.outbox.insert(entry.id, entry.clone());
        self.train_at = None;
        let mut next = self.state.clone();
        close_round(&mut next, round);
        next.last_state = DeviceState::Idle;
        self.commit(next)?;
        self.uploads.insert(entry.id, UploadTrack { in_flight: true, ..Default::default() });
        self.actions.push_back(Action::Upload { outbox_id: entry.id });
        self.report_progress(now);
        Ok(())
    }

    fn on_upload(&mut self, now: Millis, id: u64, outcome: UploadOutcome) -> Result<(), LifecycleError> {
        let Some(entry) = self.outbox.get(&id).cloned() else {
            self.uploads.remove(&id);
            return Ok(());
        };
        let retry = |lc: &mut Self, why: String| {
            // An overloaded service names when to come back; the jitter of the backoff is
            // added on top, so a refused crowd does not return in lockstep.
            let after = fedfleet_protocol::reject::retry_after_ms(&why).unwrap_or(0);
            let t = lc.uploads.entry(id).or_default();
            t.attempts += 1;
            t.in_flight = false;
            let delay = after + lc.cfg.backoff.delay(t.attempts, &mut lc.rng);
            t.next_at = Some(now + delay);
            tracing::info!(outbox_id = id, attempt = t.attempts, delay_ms = delay, %why, "upload will be retried");
        };
        match outcome {
            UploadOutcome::Receipt(r) => {
                let valid = r.device == self.state.device
                    && r.fleet == self.state.fleet
                    && r.round == entry.round
                    && r.nonce == entry.nonce
                    && r.payload_digest == entry.payload_digest;
                if !valid {
                    retry(self, "receipt does not match the update".into());
                    return Ok(());
                }
                self.remove_outbox(id);
                self.uploads.remove(&id);
                tracing::info!(outbox_id = id, round = %entry.round, "update acknowledged");
            }
            UploadOutcome::SecurelyAggregated(r) => {
                if r.device != self.state.device || r.fleet != self.state.fleet || r.round != entry.round {
                    retry(self, "secure-aggregation receipt does not match the update".into());
                    return Ok(());
                }
                self.remove_outbox(id);
                self.uploads.remove(&id);
                tracing::info!(outbox_id = id, round = %entry.round, "update securely aggregated");
            }
            UploadOutcome::Rejected(rej) => match rej.reason {
                // The aggregator already holds this update (a lost receipt): acknowledged.
                RejectReason::Replay | RejectReason::Duplicate => {
                    self.remove_outbox(id);
                    self.uploads.remove(&id);
                    tracing::info!(outbox_id = id, reason = %rej.reason, "update already held by the aggregator");
                }
                RejectReason::Overloaded | RejectReason::Internal => retry(self, format!("{}: {}", rej.reason, rej.detail)),
                reason => {
                    // A named, permanent refusal: resending the same bytes cannot succeed.
                    self.remove_outbox(id);
                    self.uploads.remove(&id);
                    tracing::warn!(outbox_id = id, %reason, detail = %rej.detail, "update rejected; dropped");
                    let mut next = self.state.clone();
                    next.last_state = DeviceState::Failed { reason: format!("update for round {} rejected: {reason}", entry.round) };
                    if reason == RejectReason::Revoked {
                        tracing::warn!("this device's certificate is revoked: it joins no more rounds");
                        next.revoked = true;
                    }
                    self.commit(next)?;
                    self.report(now);
                }
            },
            UploadOutcome::TransportError(e) => retry(self, e),
        }
        Ok(())
    }

    fn on_certificate_revoked(&mut self, now: Millis, detail: String) -> Result<(), LifecycleError> {
        if self.state.revoked {
            return Ok(());
        }
        tracing::warn!(%detail, "this device's certificate is revoked: it joins no more rounds");
        let mut next = self.state.clone();
        next.last_state = DeviceState::Failed { reason: format!("certificate revoked: {detail}") };
        next.revoked = true;
        self.commit(next)?;
        self.report(now);
        Ok(())
    }

    // ----- installs -----

    fn install_is(&self, model: &ModelRef) -> bool {
        self.state.install.as_ref().is_some_and(|j| &j.model == model)
    }

    fn on_assignment(&mut self, now: Millis, n: RolloutNotice) -> Result<(), LifecycleError> {
        if n.fleet != self.state.fleet || !n.includes(&self.state.device, self.cfg.cohort.as_deref()) {
            return Ok(());
        }
        match n.action.clone() {
            RolloutAction::Install => self.start_install(now, n.rollout_id, n.model),
            RolloutAction::RollBack { to } => self.start_install(now, n.rollout_id, to),
            RolloutAction::Pause => Ok(()),
            RolloutAction::Abort => {
                let Some(job) = self.state.install.clone().filter(|j| j.rollout_id == n.rollout_id) else {
                    return Ok(());
                };
                self.fail_install(now, job, "rollout aborted".into(), true)
            }
        }
    }

    fn start_install(&mut self, now: Millis, rollout_id: u64, model: ModelRef) -> Result<(), LifecycleError> {
        if self.state.active.as_ref().is_some_and(|a| a.model == model) {
            if self.state.install.is_none() && self.state.last_state != DeviceState::Active {
                let mut next = self.state.clone();
                next.last_state = DeviceState::Active;
                self.commit(next)?;
                self.report(now);
            } else if !self.assignment_reported {
                // Once per process: the report of the activation may not have left before a crash.
                self.report(now);
            }
            self.assignment_reported = true;
            return Ok(());
        }
        if self.install_is(&model) || self.state.last_failed == Some((rollout_id, model.digest)) {
            return Ok(());
        }
        if self.state.install.is_some() {
            tracing::info!(model = %model.name, version = %model.version, "install in progress; newer assignment replaces it");
        }
        // Roll back to the previous model: it passed its health check before; re-verify anyway.
        let job = InstallJob { rollout_id, model, phase: InstallPhase::Metadata, attempts: 0, health_checks_started: 0 };
        let mut next = self.state.clone();
        if let Some(staged) = next.staged.take() {
            self.actions.push_back(Action::Discard { digest: staged.model.digest });
        }
        next.install = Some(job.clone());
        next.last_state = DeviceState::Downloading;
        self.commit(next)?;
        self.install_retry_at = None;
        self.storage_attempts = 0;
        self.queue_install_step(&job, now)?;
        self.report(now);
        Ok(())
    }

    fn queue_install_step(&mut self, job: &InstallJob, now: Millis) -> Result<(), LifecycleError> {
        match &job.phase {
            InstallPhase::Metadata => {
                self.actions.push_back(Action::FetchMetadata { model: job.model.clone(), root_version: self.state.verifier.root().version })
            }
            InstallPhase::Downloading { length, .. } => {
                self.actions.push_back(Action::Download { model: job.model.clone(), length: *length })
            }
            InstallPhase::Staged => {
                let Some(c) = self.state.staged.clone() else { return Ok(()) };
                if job.health_checks_started >= MAX_HEALTH_CHECK_STARTS {
                    let reason = format!(
                        "health check started {} times without finishing (the agent stopped during it): candidate given up",
                        job.health_checks_started
                    );
                    return self.fail_install(now, job.clone(), reason, true);
                }
                // Commit point: the start is counted before the check can take the agent down.
                let mut next = self.state.clone();
                next.install = Some(InstallJob { health_checks_started: job.health_checks_started + 1, ..job.clone() });
                self.commit(next)?;
                self.actions.push_back(Action::HealthCheck {
                    slot: self.state.active_slot.other(),
                    candidate: c,
                    active: self.state.active.clone(),
                });
            }
        }
        Ok(())
    }

    fn install_retry(&mut self, now: Millis, reason: String) -> Result<(), LifecycleError> {
        let Some(mut job) = self.state.install.clone() else { return Ok(()) };
        job.attempts += 1;
        if job.attempts >= self.cfg.max_install_attempts {
            return self.fail_install(now, job, format!("{reason} (after {} attempts)", self.cfg.max_install_attempts), false);
        }
        let mut next = self.state.clone();
        next.install = Some(job.clone());
        self.commit(next)?;
        let delay = self.cfg.backoff.delay(job.attempts, &mut self.rng);
        tracing::info!(%reason, attempt = job.attempts, delay_ms = delay, "install step will be retried");
        self.install_retry_at = Some(now + delay);
        Ok(())
    }

    fn on_storage_failed(&mut self, now: Millis, model: ModelRef, fault: StorageFault, detail: String) -> Result<(), LifecycleError> {
        let downloading = |j: &InstallJob| j.model == model && matches!(j.phase, InstallPhase::Downloading { .. });
        let Some(job) = self.state.install.clone().filter(downloading) else { return Ok(()) };
        self.storage_attempts += 1;
        let delay = self.cfg.backoff.delay(self.storage_attempts, &mut self.rng);
        let mut next = self.state.clone();
        next.last_state = DeviceState::InstallDeferred { fault, detail: detail.clone() };
        self.commit(next)?;
        tracing::warn!(model = %model.name, version = %model.version, %fault, %detail, attempt = self.storage_attempts, retry_in_ms = delay, "install deferred: storage refused it; active model unchanged");
        // Nothing half-written stays; the retry downloads from the start.
        self.actions.push_back(Action::Discard { digest: model.digest });
        // Names the version it could not store, as a failure report does.
        let mut deferred = self.status(now);
        deferred.staged = Some(job.model);
        self.actions.push_back(Action::Report(deferred));
        self.install_retry_at = Some(now + delay);
        Ok(())
    }

    /// Ends an install without activating; the active model keeps serving.
    fn fail_install(&mut self, now: Millis, job: InstallJob, reason: String, rolled_back: bool) -> Result<(), LifecycleError> {
        let mut next = self.state.clone();
        let staged = next.staged.take();
        next.install = None;
        next.last_failed = Some((job.rollout_id, job.model.digest));
        next.last_state = if rolled_back || staged.is_some() {
            DeviceState::RolledBack { reason: reason.clone() }
        } else {
            DeviceState::Failed { reason: reason.clone() }
        };
        self.commit(next)?;
        self.install_retry_at = None;
        tracing::warn!(model = %job.model.name, version = %job.model.version, %reason, "install failed; active model unchanged");
        self.actions.push_back(Action::Discard { digest: job.model.digest });
        // The report names the failed candidate (as `staged`) and its rollout: the registry
        // attributes a failure to the staged model, else to the active one, which did not fail.
        let mut failed = self.status(now);
        failed.staged = Some(job.model.clone());
        failed.rollout_id = Some(job.rollout_id);
        if staged.is_some() || rolled_back {
            self.actions.push_back(Action::Rollback { model: job.model, reason });
        }
        self.actions.push_back(Action::Report(failed));
        Ok(())
    }

    fn on_metadata(&mut self, now: Millis, model: ModelRef, result: Result<MetadataSet, String>) -> Result<(), LifecycleError> {
        let Some(job) = self.state.install.clone().filter(|j| j.model == model && j.phase == InstallPhase::Metadata) else {
            return Ok(());
        };
        let set = match result {
            Ok(s) => s,
            Err(e) => return self.install_retry(now, format!("metadata fetch: {e}")),
        };
        // Verify on a copy: nothing is trusted unless the whole chain verifies.
        let mut v = self.state.verifier.clone();
        let checked = (|| {
            for r in &set.roots {
                v.update_root(r)?;
            }
            v.update_timestamp(&set.timestamp, now)?;
            v.update_targets(&set.targets, now)?;
            v.target(&model.name, model.version, now).cloned()
        })();
        let target = match checked {
            Ok(t) => t,
            Err(e) => return self.fail_install(now, job, format!("metadata refused: {e}"), false),
        };
        if target.digest != model.digest {
            return self.fail_install(
                now,
                job,
                format!("assignment digest {} differs from signed targets' {}", model.digest, target.digest),
                false,
            );
        }
        let spec = target.spec.to_string();
        let mut next = self.state.clone();
        next.verifier = v;
        let job = InstallJob { phase: InstallPhase::Downloading { length: target.length, spec }, attempts: 0, ..job };
        next.install = Some(job.clone());
        self.commit(next)?;
        self.queue_install_step(&job, now)?;
        Ok(())
    }

    fn on_downloaded(&mut self, now: Millis, model: ModelRef, length: u64, digest: Digest) -> Result<(), LifecycleError> {
        let Some(job) = self.state.install.clone().filter(|j| j.model == model) else { return Ok(()) };
        let InstallPhase::Downloading { spec, .. } = &job.phase else { return Ok(()) };
        if let Err(e) = self.state.verifier.verify_artifact_digest(&model.name, model.version, length, digest, now) {
            return self.fail_install(now, job, format!("artifact refused: {e}"), false);
        }
        let candidate = SlotModel { model: model.clone(), spec: spec.clone() };
        let mut next = self.state.clone();
        next.staged = Some(candidate);
        let job = InstallJob { phase: InstallPhase::Staged, ..job };
        next.install = Some(job.clone());
        next.last_state = DeviceState::Verified;
        // Commit point: staged in the inactive slot; the active model is untouched.
        self.commit(next)?;
        self.report(now);
        self.queue_install_step(&job, now)?;
        Ok(())
    }

    /// Judges a health report against the policy.
    pub fn judge(&self, r: &HealthReport) -> Result<(), HealthFailure> {
        let p = &self.cfg.health;
        if r.holdout == 0 {
            return Err(HealthFailure::NoHoldout);
        }
        if r.non_finite {
            return Err(HealthFailure::NonFinite);
        }
        // A NaN latency fails the check too (it is not within the budget).
        if !matches!(r.latency_p99_ms.partial_cmp(&p.max_latency_ms), Some(std::cmp::Ordering::Less | std::cmp::Ordering::Equal)) {
            return Err(HealthFailure::TooSlow { p99_ms: r.latency_p99_ms, budget_ms: p.max_latency_ms });
        }
        if !r.candidate_score.is_finite() {
            return Err(HealthFailure::ScoreNotFinite { metric: r.metric.clone() });
        }
        // How far below `reference` the candidate may score: the margin, or one standard error
        // of the difference where that is larger; `Some(allowed)` when it is further below.
        let too_far_below = |reference: f64| {
            let allowed = p.accuracy_margin.max(accuracy_difference_error(&r.metric, reference, r.candidate_score, r.holdout));
            (r.candidate_score < reference - allowed).then_some(allowed)
        };
        // The floor holds with no active model to compare with: a device's first install of a
        // model that answers worse than guessing (classes swapped, say) is refused, not served.
        if let Some(chance) = r.chance_score
            && let Some(allowed) = too_far_below(chance)
        {
            return Err(HealthFailure::BelowChance { metric: r.metric.clone(), candidate: r.candidate_score, chance, allowed });
        }
        if let Some(active) = r.active_score
            && let Some(allowed) = too_far_below(active)
        {
            return Err(HealthFailure::Worse { metric: r.metric.clone(), candidate: r.candidate_score, active, allowed });
        }
        Ok(())
    }

    fn on_health(&mut self, now: Millis, model: ModelRef, result: Result<HealthReport, String>) -> Result<(), LifecycleError> {
        let Some(job) = self.state.install.clone().filter(|j| j.model == model && j.phase == InstallPhase::Staged) else {
            return Ok(());
        };
        let verdict = result.and_then(|r| self.judge(&r).map_err(|e| e.to_string()));
        if let Err(reason) = verdict {
            return self.fail_install(now, job, format!("health check failed: {reason}"), true);
        }
        let mut healthy = self.status(now);
        healthy.state = DeviceState::Healthy;
        self.actions.push_back(Action::Report(healthy));
        let mut next = self.state.clone();
        let candidate = next.staged.take().expect("staged phase has a staged model");
        next.previous = next.active.replace(candidate.clone());
        next.active_slot = next.active_slot.other();
        next.install = None;
        next.last_state = DeviceState::Active;
        // Commit point: the one write that activates (flips the slots).
        self.commit(next)?;
        self.actions.push_back(Action::Serve { slot: self.state.active_slot, model: candidate });
        self.report(now);
        self.assignment_reported = true;
        Ok(())
    }

    // ----- helpers -----

    fn commit(&mut self, next: PersistedState) -> Result<(), LifecycleError> {
        self.persists.push_back(Persist::State(serde_json::to_vec(&next).expect("state serializes")));
        self.state = next;
        Ok(())
    }

    fn remove_outbox(&mut self, id: u64) {
        self.outbox.remove(&id);
        self.persists.push_back(Persist::RemoveOutbox(id));
    }

    /// A fresh outbox id, above every id saved so far; the counter is saved with the state
    /// written right after the entry (a crash between the two finds the entry, and skips it).
    fn next_outbox_id(&mut self) -> u64 {
        let above_saved = self.outbox.keys().next_back().map_or(0, |id| id + 1);
        let id = self.state.next_outbox_id.max(above_saved);
        self.state.next_outbox_id = id + 1;
        id
    }

    /// Reports the status now; it carries any round progress not yet reported.
    fn report(&mut self, now: Millis) {
        self.last_report_at = Some(now);
        self.report_at = None;
        self.actions.push_back(Action::Report(self.status(now)));
    }

    /// Reports round progress now, or [`ROUND_PROGRESS_REPORT_MS`] after the last report.
    fn report_progress(&mut self, now: Millis) {
        match self.last_report_at {
            Some(at) if now < at.saturating_add(ROUND_PROGRESS_REPORT_MS) => {
                self.report_at.get_or_insert(at.saturating_add(ROUND_PROGRESS_REPORT_MS));
            }
            _ => self.report(now),
        }
    }
}

/// The round in progress is over (trained, given up, or found already uploaded): remember it
/// and its base model.
fn close_round(next: &mut PersistedState, round: RoundId) {
    let base = next.round.take().filter(|r| r.round == round).map(|r| r.base_model.digest);
    next.last_round = Some(round);
    next.last_round_base = base.or(next.last_round_base);
}

#[cfg(test)]
mod tests {
    use super::*;
    use ed25519_dalek::SigningKey;
    use fedfleet_protocol::ModelVersion;

    fn pinned_root() -> SignedMetadata<Root> {
        let k = SigningKey::from_bytes(&[7; 32]);
        let body = Root::new(1, u64::MAX / 2, (&[&k.verifying_key()], 1), (&[&k.verifying_key()], 1), (&[&k.verifying_key()], 1));
        SignedMetadata::sign(&body, &[&k])
    }

    fn cfg() -> CoreConfig {
        CoreConfig::new(DeviceId::new("cam-1").unwrap(), FleetId::new("f").unwrap())
    }

    fn initial() -> SlotModel {
        let model = fedfleet_protocol::ModelRef { name: "m".into(), version: ModelVersion(1), digest: Digest::of(b"v1") };
        SlotModel { model, spec: "{}".into() }
    }

    /// The core hands out what to persist first, and holds its actions back until the shell
    /// took every write: an action never runs ahead of the state it implies.
    #[test]
    fn writes_come_before_the_actions_they_imply_and_reopen_from_them() {
        let mut lc = Lifecycle::open(cfg(), Saved::default(), Some(pinned_root()), Some(initial()), 1_000).unwrap();
        let Some(Persist::State(saved)) = lc.poll_persist() else { panic!("the first state is persisted first") };
        assert!(lc.poll_persist().is_none());
        assert!(matches!(lc.poll_action(), Some(Action::Serve { .. })));

        lc.handle(2_000, Input::Conditions(Conditions { idle: true, charging: true, fresh_samples: 10 })).unwrap();
        while lc.poll_action().is_some() {}
        // Reopening on the saved bytes gives the same state, with nothing to write.
        let again = Lifecycle::open(cfg(), Saved { state: Some(saved), outbox: vec![] }, None, None, 3_000).unwrap();
        assert_eq!(again.active(), lc.active());
        assert!(matches!(
            Lifecycle::open(cfg(), Saved { state: Some(b"{".to_vec()), outbox: vec![] }, None, None, 0),
            Err(LifecycleError::CorruptState(_))
        ));
    }

    /// An agent whose config names another fleet than its saved state would drop every round
    /// (issue: silently); it now refuses to start and says which setting to fix.
    #[test]
    fn a_config_naming_another_fleet_than_the_store_is_refused_at_start() {
        let mut lc = Lifecycle::open(cfg(), Saved::default(), Some(pinned_root()), Some(initial()), 1_000).unwrap();
        let Some(Persist::State(saved)) = lc.poll_persist() else { panic!() };
        let mut moved = cfg();
        moved.fleet = FleetId::new("other").unwrap();
        match Lifecycle::open(moved, Saved { state: Some(saved), outbox: vec![] }, None, None, 2_000) {
            Err(e @ LifecycleError::WrongFleet { .. }) => assert!(e.to_string().contains("fix `fleet` in the config"), "{e}"),
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("opened a store of fleet f with fleet other configured"),
        }
    }
}
