//! The round engine: a sans-IO state machine for training campaigns.
//!
//! Shaped like `quinn_proto::Connection`: the caller passes the current time (`now`, unix
//! milliseconds) into every input, and polls outputs.
//!
//! * **Inputs:** [`RoundEngine::start_campaign`] (or, on a relay, [`RoundEngine::follow_round`]),
//!   [`RoundEngine::check_update`] / [`RoundEngine::handle_update`] (a relay's partial sum:
//!   [`RoundEngine::check_relay`] / [`RoundEngine::handle_relay`]), [`RoundEngine::handle_timeout`],
//!   [`RoundEngine::model_ready`], [`RoundEngine::abort_round`], [`RoundEngine::stop_campaign`],
//!   [`RoundEngine::revoke`] / [`RoundEngine::reinstate`].
//! * **Outputs:** [`RoundEngine::poll_event`] (a queue of [`EngineEvent`]s) and
//!   [`RoundEngine::poll_timeout`] (when to call `handle_timeout` next).
//!
//! # Lifecycle
//!
//! A campaign runs `rounds` successful rounds. Each round (a fresh [`RoundId`], increasing across
//! campaigns) is announced with [`EngineEvent::RoundOpened`] and accepts updates until either
//! `target_count` updates were accepted (it closes early) or the deadline passes. At the deadline,
//! with at least `min_quorum` updates it closes; without, it is extended once by `extension_ms`
//! (if non-zero), and if the quorum is still missing at the new deadline it fails with
//! [`FailReason::QuorumNotMet`]. A round never waits longer than `duration_ms + extension_ms`.
//!
//! After [`EngineEvent::RoundClosed`] the engine waits for the shell to finalize the strategy and
//! publish the new model, then [`RoundEngine::model_ready`] opens the next round on that model
//! (or finishes the campaign). After [`EngineEvent::RoundFailed`] the global model is unchanged
//! and the next round opens at once on the same base, unless `max_consecutive_failures` failures
//! in a row end the campaign ([`CampaignOutcome::TooManyFailures`]).
//!
//! # Admission of an update (in this order)
//!
//! wrong fleet → `wrong_fleet`; revoked device → `revoked`; (device, nonce) seen before in any
//! retained round → `replay`; round older than the open one, or closed/failed → `stale_round`;
//! round not yet announced → `unknown_round`; other base model → `wrong_base_model`; device not
//! selected → `not_selected`; second update of the device in this round → `duplicate`; zero or
//! too many samples → `bad_sample_count`. Timeouts due at `now` are processed first, so an update
//! arriving after the deadline is `stale_round` even if the shell has not called
//! `handle_timeout` yet.
//!
//! Only accepted updates record their nonce: a device whose update was refused (say, for
//! overload) may resend it unchanged. Nonces are retained for `nonce_retention_rounds` rounds
//! (older rounds are `stale_round` anyway, and the signed header binds the round id).
//!
//! # Revocation policy
//!
//! [`RoundEngine::revoke`] takes effect at once: every later update of the device is refused with
//! `revoked`. An update it already had **accepted** in the open round stays in the round — it was
//! verified against a then-valid certificate, and the exact-integer fold could only be undone
//! with the payload at hand. The engine reports it in [`EngineEvent::DeviceRevoked`]
//! (`contributed_to`); if the revocation means the key was compromised, the operator or shell
//! calls [`RoundEngine::abort_round`], which fails the round and discards all its updates.
//!
//! # Asynchronous mode (FedBuff)
//!
//! With [`CampaignSpec::buffer`] set, a campaign runs FedBuff (Nguyen et al. 2022) instead of
//! synchronous rounds: each "round" is a buffer that closes after `target_count` accepted updates
//! (or at its deadline, as a round does) and publishes the next version, and devices train on
//! whatever recent version they hold. An update made for an earlier buffer `r` of the campaign is
//! admitted into the open buffer when its base — the model `r` announced — is at most
//! [`BufferPolicy::max_staleness`] versions behind the current one (else `too_stale`); it must
//! name `r`'s base model and `r`'s selection must include the device. Its weight is discounted
//! by its staleness `s` (versions published since its base) with [`staleness_weight`]:
//! `weight × 1/√(1+s)` on the integer grid, so the fold stays exact and order-independent. While
//! a closed buffer waits for its model, updates are refused as `overloaded` (retry shortly), not
//! `stale_round`: they are still wanted. One update per device per buffer (`duplicate`).
//!
//! A relay's partial sum is admitted the same way, as one contribution of all its updates: it
//! names the buffer it was gathered for, counts its updates towards the open buffer's target,
//! and the whole sum is discounted by its staleness (sums and weight by the same factor,
//! [`staleness_factor_ppm`], see `PartialSum::discounted`). One sum per relay per buffer: a
//! second one is `overloaded` (the relay forwards it again, into the next buffer).
//!
//! # Weights
//!
//! An accepted update's weight is its sample count clamped to
//! [`MAX_WEIGHT`] (2²⁴), so one device cannot dominate by
//! claiming more, and weighted products stay exact (see [`crate::strategy::fixed`]).
//!
//! # Persistence
//!
//! The whole engine, pending events included, is `serde` serializable
//! ([`RoundEngine::to_bytes`] / [`RoundEngine::from_bytes`] use postcard). The shell stores it at
//! each commit point (after each accepted update, with the strategy's partial sum), and after a
//! crash restores the last snapshot and replays updates it is unsure about: already-accepted ones
//! come back as `replay` (their nonce is in the snapshot), the rest are admitted as before, so
//! the result is the same. Pending events are delivered at least once; acting on them must be
//! idempotent.
//!
//! **Architecture invariant:** no I/O, no clock reads, no randomness: the campaign seed comes in
//! with the [`CampaignSpec`].

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;

use fedfleet_protocol::messages::PPM;
use fedfleet_protocol::{DeviceId, Digest, FleetId, ModelVersion, RoundId, Selection as WireSelection};
use serde::{Deserialize, Serialize};

use crate::reject::RejectReason;
use crate::strategy::ClientConfig;
use crate::strategy::fixed::MAX_WEIGHT;

/// Unix time in milliseconds, as passed in by the shell.
pub use fedfleet_protocol::Millis;

/// A device's per-update nonce (random, chosen by the device, bound by the signed header).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Nonce(pub [u8; 16]);

/// A training campaign, chosen by the operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct CampaignId(pub u64);

impl fmt::Display for CampaignId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Which devices a round invites.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Invitation {
    /// Each device is selected independently with probability `rate × over_selection` (capped at
    /// 1, in parts per million), decided by the wire protocol's
    /// [`Selection::Sample`](WireSelection::Sample) hash of the round's seed ([`round_seed`]) and
    /// the device id, so devices check their own selection from the announcement and agree with
    /// the engine.
    Rate { rate: f64 },
    /// Exactly these devices (`over_selection` does not apply).
    Explicit { devices: BTreeSet<DeviceId> },
}

/// Counts and times of every round of a campaign.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoundPolicy {
    /// The round closes as soon as this many updates are accepted.
    pub target_count: u32,
    /// At the deadline, the round closes if it has at least this many updates.
    pub min_quorum: u32,
    /// Rate selection invites `rate × over_selection` of the fleet, expecting drop-outs (≥ 1).
    pub over_selection: f64,
    /// From opening to the deadline.
    pub duration_ms: u64,
    /// One extension of the deadline when the quorum is not met; 0 = fail at once.
    pub extension_ms: u64,
    /// Updates claiming more samples than this are refused (`bad_sample_count`).
    pub max_sample_count: u64,
}

impl Default for RoundPolicy {
    fn default() -> Self {
        RoundPolicy {
            target_count: 10,
            min_quorum: 2,
            over_selection: 1.3,
            duration_ms: 10 * 60_000,
            extension_ms: 5 * 60_000,
            max_sample_count: 1 << 32,
        }
    }
}

/// Asynchronous mode: see the module docs ("Asynchronous mode"). The buffer size is the
/// policy's `target_count`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BufferPolicy {
    /// Updates whose base is more versions behind the current model than this are refused
    /// (`too_stale`). 0 accepts only updates trained on the current model.
    pub max_staleness: u32,
}

/// The weight of an update `staleness` versions behind, FedBuff's polynomial discount
/// `weight / √(1 + staleness)`: the factor is rounded to parts per million, the product rounded
/// down and never below 1. Integer in, integer out, the same on every machine (`f64::sqrt` is
/// correctly rounded), so the exact fold stays exact.
pub fn staleness_weight(weight: u64, staleness: u32) -> u64 {
    if staleness == 0 {
        return weight;
    }
    ((u128::from(weight) * staleness_factor_ppm(staleness) / u128::from(PPM)) as u64).max(1)
}

/// FedBuff's discount `1/√(1 + staleness)` in parts per million (rounded), the one factor every
/// stale weight and relay sum is scaled by.
pub fn staleness_factor_ppm(staleness: u32) -> u128 {
    (PPM as f64 / (1.0 + f64::from(staleness)).sqrt()).round() as u128
}

/// Everything needed to run a campaign.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CampaignSpec {
    pub id: CampaignId,
    /// Successful rounds to run.
    pub rounds: u32,
    /// The model the first round trains from.
    pub base_version: ModelVersion,
    pub base_digest: Digest,
    /// What clients do each round (from `Strategy::configure`).
    pub client: ClientConfig,
    pub selection: Invitation,
    pub policy: RoundPolicy,
    /// Seed of every round's sampling (see [`round_seed`]). Chosen
    /// by the shell (randomly, or fixed for reproducible runs).
    pub seed: [u8; 32],
    /// Failed rounds in a row after which the campaign gives up (≥ 1).
    pub max_consecutive_failures: u32,
    /// `Some`: asynchronous buffers (FedBuff) instead of synchronous rounds.
    pub buffer: Option<BufferPolicy>,
    /// `Some`: client-level differential privacy (DP-FedAvg): the ε every published round
    /// spends is accounted, and no round opens past the budget.
    pub privacy: Option<PrivacyPolicy>,
}

/// A DP-FedAvg campaign's accounting. The strategy clips and noises
/// ([`crate::StrategyConfig::DpFedAvg`] with the same noise multiplier); the engine counts what
/// that spends: each published round is one sampled Gaussian mechanism, sampled at the
/// campaign's per-device selection probability ([`crate::privacy`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PrivacyPolicy {
    pub noise_multiplier: f64,
    /// The δ of the reported (ε, δ).
    pub delta: f64,
    /// No round opens whose publication would take ε above this. `None`: accounted, unbounded.
    pub epsilon_budget: Option<f64>,
}

/// A campaign's privacy spend so far.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PrivacyStatus {
    /// What each published round spends (its sampling rate is the probability that a device
    /// is invited to a round).
    pub spend: crate::privacy::DpSpend,
    /// After the rounds published so far.
    pub epsilon_spent: f64,
    pub epsilon_budget: Option<f64>,
}

/// What the shell broadcasts when a round opens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OpenedRound {
    pub fleet: FleetId,
    pub campaign: CampaignId,
    pub round: RoundId,
    pub base_version: ModelVersion,
    pub base_digest: Digest,
    pub client: ClientConfig,
    /// Who is invited, in wire form (`Sample { rate_ppm, seed }` or `Devices`): a device is in
    /// iff `selection.selects(device)`.
    pub selection: WireSelection,
    pub opened_at: Millis,
    pub deadline: Millis,
    pub target_count: u32,
    pub max_sample_count: u64,
}

/// The signed header of an update, as far as the engine cares. The shell has already verified
/// the signature; the engine decides admission.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpdateMeta {
    pub fleet: FleetId,
    pub device: DeviceId,
    pub round: RoundId,
    pub base_digest: Digest,
    pub nonce: Nonce,
    pub num_examples: u64,
    pub payload_digest: Digest,
}

impl From<&fedfleet_protocol::UpdateHeader> for UpdateMeta {
    /// The admission-relevant fields of a verified, signed update header.
    fn from(h: &fedfleet_protocol::UpdateHeader) -> Self {
        UpdateMeta {
            fleet: h.fleet.clone(),
            device: h.device.clone(),
            round: h.round,
            base_digest: h.base_model,
            nonce: Nonce(h.nonce),
            num_examples: h.sample_count,
            payload_digest: h.payload_digest,
        }
    }
}

/// The signed header of a relay's partial sum, as far as the engine cares (the shell verified
/// the relay's identity, signature and payload).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RelayMeta {
    pub fleet: FleetId,
    pub relay: DeviceId,
    pub round: RoundId,
    pub base_digest: Digest,
    pub nonce: Nonce,
    /// Device updates folded into the partial sum.
    pub update_count: u64,
    /// Their weights' sum (each already clamped to `MAX_WEIGHT` by the relay's engine).
    pub total_weight: u64,
    pub payload_digest: Digest,
}

impl From<&fedfleet_protocol::RelayHeader> for RelayMeta {
    fn from(h: &fedfleet_protocol::RelayHeader) -> Self {
        RelayMeta {
            fleet: h.fleet.clone(),
            relay: h.relay.clone(),
            round: h.round,
            base_digest: h.base_model,
            nonce: Nonce(h.nonce),
            update_count: h.update_count,
            total_weight: h.total_samples,
            payload_digest: h.payload_digest,
        }
    }
}

/// A round announced by a relay's parent (see [`RoundEngine::follow_round`]).
#[derive(Debug, Clone, PartialEq)]
pub struct FollowedRound {
    pub round: RoundId,
    pub base_version: ModelVersion,
    pub base_digest: Digest,
    pub client: ClientConfig,
    pub selection: WireSelection,
    /// The relay's own deadline (before the parent's, to leave time to forward).
    pub deadline: Millis,
    /// Devices of the relay's region the round invites: the round closes when all have sent.
    pub expected: u32,
    pub max_sample_count: u64,
}

/// One accepted update, as recorded in the round.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Contribution {
    pub device: DeviceId,
    pub nonce: Nonce,
    pub num_examples: u64,
    /// `num_examples` clamped to `MAX_WEIGHT`: pass this to `Strategy::fold`.
    pub weight: u64,
    pub payload_digest: Digest,
    pub accepted_at: Millis,
    /// Device updates in it: 1, or a relay's partial sum's count.
    pub updates: u64,
}

/// Answer to an admitted update.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Accepted {
    pub round: RoundId,
    /// The weight to fold the update with.
    pub weight: u64,
    /// Versions published since the update's base model (asynchronous mode; 0 in rounds).
    pub staleness: u32,
    /// Updates accepted in the round, this one included.
    pub accepted: u32,
    pub target: u32,
    /// This update reached the target: the round closed.
    pub closed_round: bool,
}

/// A refused update.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("update refused: {reason}")]
pub struct Reject {
    pub reason: RejectReason,
    /// The round currently open, if any (lets a device resynchronise).
    pub current_round: Option<RoundId>,
}

/// Why a round closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CloseCause {
    TargetReached,
    Deadline,
}

/// Why a round failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailReason {
    /// Fewer than `min_quorum` updates by the (extended) deadline.
    QuorumNotMet { accepted: u32, quorum: u32 },
    /// [`RoundEngine::abort_round`] (operator, compromised key, finalize error…).
    Aborted { detail: String },
    /// [`RoundEngine::stop_campaign`].
    CampaignStopped,
}

impl FailReason {
    pub fn as_str(&self) -> &'static str {
        match self {
            FailReason::QuorumNotMet { .. } => "quorum_not_met",
            FailReason::Aborted { .. } => "aborted",
            FailReason::CampaignStopped => "campaign_stopped",
        }
    }
}

/// How a campaign ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CampaignOutcome {
    Completed,
    TooManyFailures,
    Stopped,
    /// The next round would have spent more ε than the campaign's budget.
    PrivacyBudgetSpent,
}

impl CampaignOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            CampaignOutcome::Completed => "completed",
            CampaignOutcome::TooManyFailures => "too_many_failures",
            CampaignOutcome::Stopped => "stopped",
            CampaignOutcome::PrivacyBudgetSpent => "privacy_budget_spent",
        }
    }
}

/// Something the shell must act on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EngineEvent {
    /// Broadcast the announcement.
    RoundOpened(OpenedRound),
    /// The quorum was missing at the deadline; the deadline moved once.
    RoundExtended { round: RoundId, deadline: Millis, accepted: u32 },
    /// Finalize the strategy on `base_*`, publish, then call [`RoundEngine::model_ready`].
    /// `contributions` are sorted by device id.
    RoundClosed { round: RoundId, cause: CloseCause, base_version: ModelVersion, base_digest: Digest, contributions: Vec<Contribution> },
    /// Discard the round's folded updates (`Strategy::abort_round`).
    RoundFailed { round: RoundId, reason: FailReason },
    /// A device was revoked; `contributed_to` names the open round if it had an accepted update
    /// in it (kept, see the module docs).
    DeviceRevoked { device: DeviceId, contributed_to: Option<RoundId> },
    CampaignFinished {
        campaign: CampaignId,
        outcome: CampaignOutcome,
        rounds_completed: u32,
        /// A DP campaign's final spend.
        privacy: Option<PrivacyStatus>,
    },
}

/// Misuse of the engine's API (as opposed to a refused update).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    #[error("campaign {0} is still running")]
    CampaignRunning(CampaignId),
    #[error("no campaign is running")]
    NoCampaign,
    #[error("invalid campaign spec: {0}")]
    InvalidSpec(String),
    #[error("round {0} is not waiting for a model")]
    NotAwaitingModel(RoundId),
    #[error("round {0} is not the current round")]
    NotCurrentRound(RoundId),
    #[error("snapshot does not decode: {0}")]
    Snapshot(String),
}

/// Engine-wide settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineConfig {
    /// Rounds for which accepted (device, nonce) pairs are remembered.
    pub nonce_retention_rounds: u64,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig { nonce_retention_rounds: 1024 }
    }
}

/// A read-only view of the open round.
#[derive(Debug, Clone, PartialEq)]
pub struct RoundStatus {
    pub round: RoundId,
    pub opened_at: Millis,
    pub deadline: Millis,
    pub extended: bool,
    pub accepted: u32,
    pub target: u32,
    pub quorum: u32,
}

/// Where the current campaign stands.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum Phase {
    Open(OpenRound),
    /// Closed; waiting for the shell to finalize and publish.
    AwaitingModel {
        round: RoundId,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct OpenRound {
    id: RoundId,
    /// The announced selection (for `Rate` campaigns; explicit lists are checked on the spec).
    selection: WireSelection,
    opened_at: Millis,
    deadline: Millis,
    extended: bool,
    contributions: BTreeMap<DeviceId, Contribution>,
    /// Σ (updates − 1) over the contributions (relays' partial sums count their updates).
    /// Derived, not stored: recounted when a snapshot is restored.
    #[serde(skip)]
    relayed_extra: u64,
}

impl OpenRound {
    /// Device updates accepted so far (a relay's partial sum counts with all of its updates).
    fn accepted(&self) -> u32 {
        (self.contributions.len() as u64 + self.relayed_extra).min(u64::from(u32::MAX)) as u32
    }

    fn insert(&mut self, c: Contribution) {
        self.relayed_extra += c.updates.saturating_sub(1);
        self.contributions.insert(c.device.clone(), c);
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Campaign {
    spec: CampaignSpec,
    base_version: ModelVersion,
    base_digest: Digest,
    completed: u32,
    consecutive_failures: u32,
    phase: Phase,
    /// The campaign's first round: earlier ids belong to other campaigns.
    first_round: RoundId,
    /// Asynchronous mode: the buffers opened on the last `max_staleness + 1` versions, oldest
    /// first (empty in rounds mode).
    recent: VecDeque<BufferBase>,
}

impl Campaign {
    /// A campaign whose first round (opened by the caller at once) is `first_round`.
    fn new(spec: CampaignSpec, first_round: RoundId) -> Self {
        Campaign {
            base_version: spec.base_version,
            base_digest: spec.base_digest,
            spec,
            completed: 0,
            consecutive_failures: 0,
            phase: Phase::AwaitingModel { round: RoundId(0) }, // replaced by the round opened next
            first_round,
            recent: VecDeque::new(),
        }
    }
}

/// What a buffer announced, kept while updates trained for it may still arrive.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct BufferBase {
    round: RoundId,
    digest: Digest,
    /// Versions the campaign had published when the buffer opened.
    published: u32,
    selection: WireSelection,
}

/// The round engine. See the module docs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoundEngine {
    fleet: FleetId,
    config: EngineConfig,
    /// The id the next round will get; every id below it has been used.
    next_round: RoundId,
    campaign: Option<Campaign>,
    revoked: BTreeSet<DeviceId>,
    seen_nonces: BTreeSet<(DeviceId, Nonce)>,
    nonce_log: VecDeque<(RoundId, DeviceId, Nonce)>,
    events: VecDeque<EngineEvent>,
}

/// The sampling seed of a round: the first 8 bytes (little-endian) of
/// `blake3(campaign_seed ‖ round_id as u64 LE)`.
pub fn round_seed(campaign_seed: &[u8; 32], round: RoundId) -> u64 {
    let mut h = blake3::Hasher::new();
    h.update(campaign_seed);
    h.update(&round.0.to_le_bytes());
    u64::from_le_bytes(h.finalize().as_bytes()[..8].try_into().expect("8 bytes"))
}

/// A rate in `[0, 1]` as parts per million, rounded to nearest.
pub fn rate_to_ppm(rate: f64) -> u32 {
    (rate.clamp(0.0, 1.0) * PPM as f64).round() as u32
}

impl RoundEngine {
    /// A fresh engine; the first round will be `first_round` (resume numbering from the registry
    /// or sled when starting over an existing fleet).
    pub fn new(fleet: FleetId, config: EngineConfig, first_round: RoundId) -> Self {
        RoundEngine {
            fleet,
            config,
            next_round: first_round,
            campaign: None,
            revoked: BTreeSet::new(),
            seen_nonces: BTreeSet::new(),
            nonce_log: VecDeque::new(),
            events: VecDeque::new(),
        }
    }

    // ----- getters -----

    pub fn fleet(&self) -> &FleetId {
        &self.fleet
    }
    /// The id the next round will get: every id below it has been used.
    pub fn next_round(&self) -> RoundId {
        self.next_round
    }
    /// The running campaign, if any.
    pub fn campaign_id(&self) -> Option<CampaignId> {
        self.campaign.as_ref().map(|c| c.spec.id)
    }
    /// Successful rounds of the running campaign.
    pub fn rounds_completed(&self) -> Option<u32> {
        self.campaign.as_ref().map(|c| c.completed)
    }
    /// The open round, if any.
    pub fn round_status(&self) -> Option<RoundStatus> {
        let c = self.campaign.as_ref()?;
        match &c.phase {
            Phase::Open(r) => Some(RoundStatus {
                round: r.id,
                opened_at: r.opened_at,
                deadline: r.deadline,
                extended: r.extended,
                accepted: r.accepted(),
                target: self.round_target(c),
                quorum: c.spec.policy.min_quorum,
            }),
            Phase::AwaitingModel { .. } => None,
        }
    }
    /// The closed round waiting for [`model_ready`](Self::model_ready), if any.
    pub fn awaiting_model(&self) -> Option<RoundId> {
        match &self.campaign.as_ref()?.phase {
            Phase::AwaitingModel { round } => Some(*round),
            Phase::Open(_) => None,
        }
    }
    /// Accepted updates of the open round, by device.
    pub fn contributions(&self) -> impl Iterator<Item = &Contribution> {
        let open = match self.campaign.as_ref().map(|c| &c.phase) {
            Some(Phase::Open(r)) => Some(r.contributions.values()),
            _ => None,
        };
        open.into_iter().flatten()
    }
    /// Whether `device` is invited to the open round.
    pub fn is_selected(&self, device: &DeviceId) -> bool {
        match &self.campaign {
            Some(c) => match &c.phase {
                Phase::Open(r) => selected(&c.spec, &r.selection, device),
                _ => false,
            },
            None => false,
        }
    }
    pub fn is_revoked(&self, device: &DeviceId) -> bool {
        self.revoked.contains(device)
    }

    // ----- inputs -----

    /// Starts a campaign and opens its first round.
    pub fn start_campaign(&mut self, now: Millis, spec: CampaignSpec) -> Result<(), EngineError> {
        if let Some(c) = &self.campaign {
            return Err(EngineError::CampaignRunning(c.spec.id));
        }
        validate(&spec)?;
        self.campaign = Some(Campaign::new(spec, self.next_round));
        self.open_round(now);
        Ok(())
    }

    /// Admission check without recording anything (timeouts due at `now` are processed). Call it
    /// before receiving a payload, then fold, then [`handle_update`](Self::handle_update) with
    /// the same `now` and no engine call in between: it will accept.
    pub fn check_update(&mut self, now: Millis, meta: &UpdateMeta) -> Result<Accepted, Reject> {
        self.handle_timeout(now);
        self.admit(meta)
    }

    /// Admits and records an update whose payload has been verified and folded.
    pub fn handle_update(&mut self, now: Millis, meta: UpdateMeta) -> Result<Accepted, Reject> {
        self.handle_timeout(now);
        let accepted = self.admit(&meta)?;
        self.record(
            &accepted,
            Contribution {
                device: meta.device,
                nonce: meta.nonce,
                num_examples: meta.num_examples,
                weight: accepted.weight,
                payload_digest: meta.payload_digest,
                accepted_at: now,
                updates: 1,
            },
        );
        Ok(accepted)
    }

    /// Admission of a relay's partial sum without recording it (see
    /// [`check_update`](Self::check_update)): the open round's id and base model, no earlier
    /// partial of the relay in the round, a count and weight that fit. The relay checked each of
    /// its devices' updates as this engine checks one (its own engine, following this round).
    pub fn check_relay(&mut self, now: Millis, meta: &RelayMeta) -> Result<Accepted, Reject> {
        self.handle_timeout(now);
        self.admit_relay(meta)
    }

    /// Admits and records a relay's partial sum whose payload has been verified and merged.
    pub fn handle_relay(&mut self, now: Millis, meta: RelayMeta) -> Result<Accepted, Reject> {
        self.handle_timeout(now);
        let accepted = self.admit_relay(&meta)?;
        self.record(
            &accepted,
            Contribution {
                device: meta.relay,
                nonce: meta.nonce,
                num_examples: meta.total_weight,
                weight: accepted.weight,
                payload_digest: meta.payload_digest,
                accepted_at: now,
                updates: meta.update_count,
            },
        );
        Ok(accepted)
    }

    fn record(&mut self, accepted: &Accepted, contribution: Contribution) {
        let c = self.campaign.as_mut().expect("admitted ⇒ campaign");
        let Phase::Open(r) = &mut c.phase else { unreachable!("admitted ⇒ open round") };
        self.seen_nonces.insert((contribution.device.clone(), contribution.nonce));
        self.nonce_log.push_back((r.id, contribution.device.clone(), contribution.nonce));
        r.insert(contribution);
        if accepted.closed_round {
            self.close_round(CloseCause::TargetReached);
        }
    }

    /// A relay runs its parent's round `f` for the devices of its region: a campaign of that one
    /// round, with the parent's id, base model, selection and a deadline before the parent's,
    /// that closes when every invited device of the region has sent (`expected`) and whose
    /// closed round is forwarded as one partial sum instead of published. Every update is
    /// admitted exactly as the parent would admit it. After [`model_ready`](Self::model_ready)
    /// (forwarded) or a failure the campaign is over and the next followed round can start.
    pub fn follow_round(&mut self, now: Millis, f: FollowedRound) -> Result<(), EngineError> {
        if let Some(c) = &self.campaign {
            return Err(EngineError::CampaignRunning(c.spec.id));
        }
        if f.round < self.next_round {
            return Err(EngineError::NotCurrentRound(f.round));
        }
        let selection = match &f.selection {
            WireSelection::Devices(devices) => Invitation::Explicit { devices: devices.iter().cloned().collect() },
            _ => Invitation::Rate { rate: 1.0 },
        };
        let spec = CampaignSpec {
            id: CampaignId(f.round.0),
            rounds: 1,
            base_version: f.base_version,
            base_digest: f.base_digest,
            client: f.client,
            selection,
            policy: RoundPolicy {
                target_count: f.expected.max(1),
                min_quorum: 1,
                over_selection: 1.0,
                duration_ms: f.deadline.saturating_sub(now).max(1),
                extension_ms: 0,
                max_sample_count: f.max_sample_count,
            },
            seed: [0; 32],
            max_consecutive_failures: 1,
            buffer: None,
            privacy: None,
        };
        validate(&spec)?;
        self.next_round = f.round;
        self.campaign = Some(Campaign::new(spec, f.round));
        self.open_round_as(now, Some((f.selection, f.deadline.max(now.saturating_add(1)))));
        Ok(())
    }

    /// Re-admits an update accepted into the open round `round` before a restart, from the
    /// shell's durable record of it. The shell snapshots the engine at round boundaries, not at
    /// every update (each snapshot copies every contribution and retained nonce: quadratic in a
    /// round's size), so on restart it hands the open round's accepted updates back here. Returns
    /// false for one the snapshot already holds. Closes the round when the count reaches the
    /// target, as the original acceptance did. The engine reads `num_examples` nowhere else: a
    /// record that kept only the weight may pass the weight.
    pub fn readmit(&mut self, round: RoundId, contribution: Contribution) -> Result<bool, EngineError> {
        let c = self.campaign.as_mut().ok_or(EngineError::NoCampaign)?;
        let Phase::Open(r) = &mut c.phase else { return Err(EngineError::NotCurrentRound(round)) };
        if r.id != round {
            return Err(EngineError::NotCurrentRound(round));
        }
        if let Some(have) = r.contributions.get(&contribution.device) {
            if have.nonce == contribution.nonce {
                return Ok(false);
            }
            return Err(EngineError::Snapshot(format!("round {round} holds another update of {}", contribution.device)));
        }
        self.seen_nonces.insert((contribution.device.clone(), contribution.nonce));
        self.nonce_log.push_back((round, contribution.device.clone(), contribution.nonce));
        r.insert(contribution);
        let accepted = r.accepted();
        let c = self.campaign.as_ref().expect("checked above");
        if accepted >= self.round_target(c) {
            self.close_round(CloseCause::TargetReached);
        }
        Ok(true)
    }

    /// Processes every deadline due at `now`. Idempotent; call it when
    /// [`poll_timeout`](Self::poll_timeout) says, or whenever.
    pub fn handle_timeout(&mut self, now: Millis) {
        loop {
            let Some(c) = self.campaign.as_mut() else {
                return;
            };
            let Phase::Open(r) = &mut c.phase else { return };
            if now < r.deadline {
                return;
            }
            let accepted = r.accepted();
            let policy = &c.spec.policy;
            if accepted >= policy.min_quorum {
                self.close_round(CloseCause::Deadline);
            } else if !r.extended && policy.extension_ms > 0 {
                r.extended = true;
                r.deadline = r.deadline.saturating_add(policy.extension_ms);
                let ev = EngineEvent::RoundExtended { round: r.id, deadline: r.deadline, accepted };
                self.events.push_back(ev);
                // Loop: a shell that wakes up late may already be past the new deadline.
            } else {
                let quorum = policy.min_quorum;
                self.fail_round(now, FailReason::QuorumNotMet { accepted, quorum });
            }
        }
    }

    /// The closed round `round` has been finalized and published as `version`/`digest`: open the
    /// next round on it, or finish the campaign.
    pub fn model_ready(&mut self, now: Millis, round: RoundId, version: ModelVersion, digest: Digest) -> Result<(), EngineError> {
        let c = self.campaign.as_mut().ok_or(EngineError::NoCampaign)?;
        match c.phase {
            Phase::AwaitingModel { round: r } if r == round => {}
            _ => return Err(EngineError::NotAwaitingModel(round)),
        }
        c.base_version = version;
        c.base_digest = digest;
        c.completed += 1;
        c.consecutive_failures = 0;
        let over_budget = privacy_spend(&c.spec)
            .is_some_and(|(spend, budget)| budget.is_some_and(|b| spend.epsilon_after(u64::from(c.completed) + 1) > b));
        if c.completed >= c.spec.rounds {
            self.finish(CampaignOutcome::Completed);
        } else if over_budget {
            self.finish(CampaignOutcome::PrivacyBudgetSpent);
        } else {
            self.open_round(now);
        }
        Ok(())
    }

    /// Closes the open round `round` now with what it holds, as its deadline would but with no
    /// extension: published if it has its quorum, failed otherwise. For a round that can get
    /// nothing more (a securely aggregated round's one sum has arrived).
    pub fn close_round_now(&mut self, now: Millis, round: RoundId) -> Result<(), EngineError> {
        let c = self.campaign.as_mut().ok_or(EngineError::NoCampaign)?;
        match &mut c.phase {
            Phase::Open(r) if r.id == round => {
                r.deadline = r.deadline.min(now);
                r.extended = true;
            }
            _ => return Err(EngineError::NotCurrentRound(round)),
        }
        self.handle_timeout(now);
        Ok(())
    }

    /// Fails the current round — open, or closed and awaiting its model (e.g. finalize failed) —
    /// discarding its updates; the campaign goes on as after any failed round.
    pub fn abort_round(&mut self, now: Millis, round: RoundId, detail: impl Into<String>) -> Result<(), EngineError> {
        let c = self.campaign.as_ref().ok_or(EngineError::NoCampaign)?;
        let current = match &c.phase {
            Phase::Open(r) => r.id,
            Phase::AwaitingModel { round } => *round,
        };
        if current != round {
            return Err(EngineError::NotCurrentRound(round));
        }
        self.fail_round(now, FailReason::Aborted { detail: detail.into() });
        Ok(())
    }

    /// Stops the campaign; an open or closed-but-unpublished round fails.
    pub fn stop_campaign(&mut self, _now: Millis) -> Result<(), EngineError> {
        let c = self.campaign.as_ref().ok_or(EngineError::NoCampaign)?;
        let round = match &c.phase {
            Phase::Open(r) => r.id,
            Phase::AwaitingModel { round } => *round,
        };
        self.events.push_back(EngineEvent::RoundFailed { round, reason: FailReason::CampaignStopped });
        self.finish(CampaignOutcome::Stopped);
        Ok(())
    }

    /// Revokes a device: its later updates are refused with `revoked`. See the module docs for
    /// what happens to an update it already had accepted.
    pub fn revoke(&mut self, device: DeviceId) {
        if !self.revoked.insert(device.clone()) {
            return;
        }
        let contributed_to = match self.campaign.as_ref().map(|c| &c.phase) {
            Some(Phase::Open(r)) if r.contributions.contains_key(&device) => Some(r.id),
            _ => None,
        };
        self.events.push_back(EngineEvent::DeviceRevoked { device, contributed_to });
        // The open round may have every update it can still get.
        let reached = match &self.campaign {
            Some(c) => match &c.phase {
                Phase::Open(r) => r.accepted() >= self.round_target(c),
                _ => false,
            },
            None => false,
        };
        if reached {
            self.close_round(CloseCause::TargetReached);
        }
    }

    /// Undoes [`revoke`](Self::revoke) (a re-enrolled device).
    pub fn reinstate(&mut self, device: &DeviceId) {
        self.revoked.remove(device);
    }

    // ----- outputs -----

    /// Next event for the shell.
    pub fn poll_event(&mut self) -> Option<EngineEvent> {
        self.events.pop_front()
    }

    /// When [`handle_timeout`](Self::handle_timeout) should next be called.
    pub fn poll_timeout(&self) -> Option<Millis> {
        match &self.campaign.as_ref()?.phase {
            Phase::Open(r) => Some(r.deadline),
            Phase::AwaitingModel { .. } => None,
        }
    }

    // ----- persistence -----

    /// The whole engine as postcard bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        postcard::to_stdvec(self).expect("engine state serializes")
    }

    /// Restores an engine from [`to_bytes`](Self::to_bytes).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, EngineError> {
        let mut engine: RoundEngine = postcard::from_bytes(bytes).map_err(|e| EngineError::Snapshot(e.to_string()))?;
        if let Some(Phase::Open(r)) = engine.campaign.as_mut().map(|c| &mut c.phase) {
            r.relayed_extra = r.contributions.values().map(|c| c.updates.saturating_sub(1)).sum();
        }
        Ok(engine)
    }

    // ----- internals -----

    fn reject(&self, reason: RejectReason) -> Reject {
        let current_round = match self.campaign.as_ref().map(|c| &c.phase) {
            Some(Phase::Open(r)) => Some(r.id),
            _ => None,
        };
        Reject { reason, current_round }
    }

    fn admit(&self, meta: &UpdateMeta) -> Result<Accepted, Reject> {
        if meta.fleet != self.fleet {
            return Err(self.reject(RejectReason::WrongFleet));
        }
        if self.revoked.contains(&meta.device) {
            return Err(self.reject(RejectReason::Revoked));
        }
        let c = self.fresh_into_campaign(&meta.device, meta.nonce, meta.round)?;
        if let Some(buffer) = &c.spec.buffer {
            return self.admit_buffered(c, buffer, meta);
        }
        let r = self.open_round_named(c, meta.round)?;
        self.admit_into(c, r, (c.base_digest, &r.selection), 0, meta)
    }

    /// A nonce the sender has not used, and a running campaign for `round`.
    fn fresh_into_campaign(&self, sender: &DeviceId, nonce: Nonce, round: RoundId) -> Result<&Campaign, Reject> {
        if self.seen_nonces.contains(&(sender.clone(), nonce)) {
            return Err(self.reject(RejectReason::Replay));
        }
        self.campaign
            .as_ref()
            .ok_or_else(|| self.reject(if round < self.next_round { RejectReason::StaleRound } else { RejectReason::UnknownRound }))
    }

    /// The open round, if it is `round`; else why not.
    fn open_round_named<'c>(&self, c: &'c Campaign, round: RoundId) -> Result<&'c OpenRound, Reject> {
        match &c.phase {
            Phase::Open(r) if r.id == round => Ok(r),
            _ if round >= self.next_round => Err(self.reject(RejectReason::UnknownRound)),
            _ => Err(self.reject(RejectReason::StaleRound)),
        }
    }

    fn admit_relay(&self, meta: &RelayMeta) -> Result<Accepted, Reject> {
        if meta.fleet != self.fleet {
            return Err(self.reject(RejectReason::WrongFleet));
        }
        let c = self.fresh_into_campaign(&meta.relay, meta.nonce, meta.round)?;
        // (DP-FedAvg takes a sum only when its devices clipped and noised: the strategy refuses
        // the merge otherwise.)
        let (r, base_digest, staleness) = match &c.spec.buffer {
            Some(buffer) => {
                let (r, base, staleness) = self.buffered_base(c, buffer, meta.round)?;
                (r, base.digest, staleness)
            }
            None => (self.open_round_named(c, meta.round)?, c.base_digest, 0),
        };
        if meta.base_digest != base_digest {
            return Err(self.reject(RejectReason::WrongBaseModel));
        }
        if r.contributions.contains_key(&meta.relay) {
            // In a buffer it holds the relay's sum made for an earlier one: the next buffer takes this.
            return Err(self.reject(if c.spec.buffer.is_some() { RejectReason::Overloaded } else { RejectReason::Duplicate }));
        }
        let max_weight = meta.update_count.saturating_mul(c.spec.policy.max_sample_count.min(MAX_WEIGHT));
        if meta.update_count == 0 || meta.total_weight < meta.update_count || meta.total_weight > max_weight {
            return Err(self.reject(RejectReason::BadSampleCount));
        }
        let accepted = (u64::from(r.accepted()) + meta.update_count).min(u64::from(u32::MAX)) as u32;
        let target = self.round_target(c);
        let weight = staleness_weight(meta.total_weight, staleness);
        Ok(Accepted { round: r.id, weight, staleness, accepted, target, closed_round: accepted >= target })
    }

    /// Asynchronous mode: the open buffer, and the base and staleness of an update or sum made
    /// for buffer `round` (refused when it is unknown, too old, or while no buffer is open).
    fn buffered_base<'c>(
        &self,
        c: &'c Campaign,
        buffer: &BufferPolicy,
        round: RoundId,
    ) -> Result<(&'c OpenRound, &'c BufferBase, u32), Reject> {
        if round >= self.next_round {
            return Err(self.reject(RejectReason::UnknownRound));
        }
        if round < c.first_round {
            return Err(self.reject(RejectReason::StaleRound));
        }
        let Phase::Open(r) = &c.phase else {
            // The buffer is being published; the next one wants this update.
            return Err(self.reject(RejectReason::Overloaded));
        };
        let Some(base) = c.recent.iter().find(|b| b.round == round) else {
            return Err(self.reject(RejectReason::TooStale));
        };
        let staleness = c.completed - base.published;
        if staleness > buffer.max_staleness {
            return Err(self.reject(RejectReason::TooStale));
        }
        Ok((r, base, staleness))
    }

    /// Asynchronous mode: the staleness in the open buffer of what was made for buffer `round`
    /// (what its admission discounted it by, the same until the buffer closes); 0 in rounds mode.
    pub fn staleness_of(&self, round: RoundId) -> u32 {
        match &self.campaign {
            Some(c @ Campaign { spec: CampaignSpec { buffer: Some(b), .. }, .. }) => {
                self.buffered_base(c, b, round).map_or(0, |(_, _, staleness)| staleness)
            }
            _ => 0,
        }
    }

    /// Admission in asynchronous mode (see the module docs): into the open buffer, from any
    /// retained buffer's base.
    fn admit_buffered(&self, c: &Campaign, buffer: &BufferPolicy, meta: &UpdateMeta) -> Result<Accepted, Reject> {
        let (r, base, staleness) = self.buffered_base(c, buffer, meta.round)?;
        self.admit_into(c, r, (base.digest, &base.selection), staleness, meta)
    }

    /// The checks both modes share once the update's round is known: it names that round's
    /// base model and the round invited the device; one update per device in the open round;
    /// a sample count within the cap. The weight is discounted by `staleness`.
    fn admit_into(
        &self,
        c: &Campaign,
        open: &OpenRound,
        (base_digest, selection): (Digest, &WireSelection),
        staleness: u32,
        meta: &UpdateMeta,
    ) -> Result<Accepted, Reject> {
        if meta.base_digest != base_digest {
            return Err(self.reject(RejectReason::WrongBaseModel));
        }
        if !selected(&c.spec, selection, &meta.device) {
            return Err(self.reject(RejectReason::NotSelected));
        }
        if open.contributions.contains_key(&meta.device) {
            return Err(self.reject(RejectReason::Duplicate));
        }
        let policy = &c.spec.policy;
        if meta.num_examples == 0 || meta.num_examples > policy.max_sample_count {
            return Err(self.reject(RejectReason::BadSampleCount));
        }
        let accepted = open.accepted() + 1;
        let target = self.round_target(c);
        let weight = staleness_weight(meta.num_examples.min(MAX_WEIGHT), staleness);
        Ok(Accepted { round: open.id, weight, staleness, accepted, target, closed_round: accepted >= target })
    }

    /// Updates that close a round early: the policy's target, or fewer when an explicit
    /// invitation has fewer devices left that are not revoked (a revoked device's update never
    /// comes; waiting for it would hold every round to its deadline). Never below the quorum.
    fn round_target(&self, c: &Campaign) -> u32 {
        let policy = &c.spec.policy;
        match &c.spec.selection {
            Invitation::Explicit { devices } => {
                let reachable = devices.iter().filter(|d| !self.revoked.contains(*d)).count() as u32;
                policy.target_count.min(reachable).max(policy.min_quorum)
            }
            Invitation::Rate { .. } => policy.target_count,
        }
    }

    fn open_round(&mut self, now: Millis) {
        self.open_round_as(now, None)
    }

    /// Opens the next round; `followed` gives its selection and deadline (a relay's round,
    /// announced by its parent) instead of the campaign's.
    fn open_round_as(&mut self, now: Millis, followed: Option<(WireSelection, Millis)>) {
        let id = self.next_round;
        self.next_round = RoundId(id.0 + 1);
        let c = self.campaign.as_mut().expect("open_round needs a campaign");
        if let Some(buffer) = &c.spec.buffer {
            let oldest = c.completed.saturating_sub(buffer.max_staleness);
            while c.recent.front().is_some_and(|b| b.published < oldest) {
                c.recent.pop_front();
            }
        }
        // Forget nonces of rounds that left the retention window. An asynchronous campaign keeps
        // those of every buffer since the oldest base it still admits updates for: an update is
        // folded into a buffer at or after the one it names, so its replay finds its nonce.
        let mut keep_from = id.0.saturating_sub(self.config.nonce_retention_rounds);
        if let Some(oldest) = c.recent.front() {
            keep_from = keep_from.min(oldest.round.0);
        }
        while let Some((r, _, _)) = self.nonce_log.front() {
            if r.0 >= keep_from {
                break;
            }
            let (_, d, n) = self.nonce_log.pop_front().expect("front exists");
            self.seen_nonces.remove(&(d, n));
        }
        let c = self.campaign.as_mut().expect("open_round needs a campaign");
        let policy = &c.spec.policy;
        let (selection, deadline) = match followed {
            Some(given) => given,
            None => {
                let selection = match &c.spec.selection {
                    Invitation::Rate { rate } => {
                        WireSelection::Sample { rate_ppm: effective_ppm(*rate, policy), seed: round_seed(&c.spec.seed, id) }
                    }
                    Invitation::Explicit { devices } => WireSelection::Devices(devices.iter().cloned().collect()),
                };
                (selection, now.saturating_add(policy.duration_ms))
            }
        };
        let announcement = OpenedRound {
            fleet: self.fleet.clone(),
            campaign: c.spec.id,
            round: id,
            base_version: c.base_version,
            base_digest: c.base_digest,
            client: c.spec.client.clone(),
            selection: selection.clone(),
            opened_at: now,
            deadline,
            target_count: policy.target_count,
            max_sample_count: policy.max_sample_count,
        };
        let selection = match selection {
            WireSelection::Devices(_) => WireSelection::All, // checked on the spec's set
            other => other,
        };
        if c.spec.buffer.is_some() {
            let selection = selection.clone();
            c.recent.push_back(BufferBase { round: id, digest: c.base_digest, published: c.completed, selection });
        }
        c.phase = Phase::Open(OpenRound {
            id,
            selection,
            opened_at: now,
            deadline,
            extended: false,
            contributions: BTreeMap::new(),
            relayed_extra: 0,
        });
        self.events.push_back(EngineEvent::RoundOpened(announcement));
    }

    fn close_round(&mut self, cause: CloseCause) {
        let c = self.campaign.as_mut().expect("close_round needs a campaign");
        let Phase::Open(r) = &mut c.phase else { return };
        let round = r.id;
        let contributions = std::mem::take(&mut r.contributions).into_values().collect();
        c.phase = Phase::AwaitingModel { round };
        self.events.push_back(EngineEvent::RoundClosed {
            round,
            cause,
            base_version: c.base_version,
            base_digest: c.base_digest,
            contributions,
        });
    }

    fn fail_round(&mut self, now: Millis, reason: FailReason) {
        let c = self.campaign.as_mut().expect("fail_round needs a campaign");
        let round = match &c.phase {
            Phase::Open(r) => r.id,
            Phase::AwaitingModel { round } => *round,
        };
        c.consecutive_failures += 1;
        let give_up = c.consecutive_failures >= c.spec.max_consecutive_failures;
        self.events.push_back(EngineEvent::RoundFailed { round, reason });
        if give_up {
            self.finish(CampaignOutcome::TooManyFailures);
        } else {
            self.open_round(now);
        }
    }

    /// The current campaign's privacy spend, if it is a DP campaign.
    pub fn privacy(&self) -> Option<PrivacyStatus> {
        let c = self.campaign.as_ref()?;
        let (spend, budget) = privacy_spend(&c.spec)?;
        Some(PrivacyStatus { spend, epsilon_spent: spend.epsilon_after(u64::from(c.completed)), epsilon_budget: budget })
    }

    fn finish(&mut self, outcome: CampaignOutcome) {
        let privacy = self.privacy();
        let c = self.campaign.take().expect("finish needs a campaign");
        self.events.push_back(EngineEvent::CampaignFinished { campaign: c.spec.id, outcome, rounds_completed: c.completed, privacy });
    }
}

fn effective_ppm(rate: f64, policy: &RoundPolicy) -> u32 {
    rate_to_ppm(rate * policy.over_selection)
}

/// What each round of a DP campaign spends (sampled at the probability that a device is
/// invited: the effective rate, or 1 for an explicit list), and its budget.
fn privacy_spend(spec: &CampaignSpec) -> Option<(crate::privacy::DpSpend, Option<f64>)> {
    let p = spec.privacy.as_ref()?;
    let sampling_rate = match &spec.selection {
        Invitation::Rate { rate } => f64::from(effective_ppm(*rate, &spec.policy)) / f64::from(PPM),
        Invitation::Explicit { .. } => 1.0,
    };
    Some((crate::privacy::DpSpend { sampling_rate, noise_multiplier: p.noise_multiplier, delta: p.delta }, p.epsilon_budget))
}

fn selected(spec: &CampaignSpec, announced: &WireSelection, device: &DeviceId) -> bool {
    match &spec.selection {
        Invitation::Rate { .. } => announced.selects(device),
        Invitation::Explicit { devices } => devices.contains(device),
    }
}

fn validate(spec: &CampaignSpec) -> Result<(), EngineError> {
    let p = &spec.policy;
    let bad = |m: String| Err(EngineError::InvalidSpec(m));
    if spec.rounds == 0 {
        return bad("rounds must be >= 1".into());
    }
    if p.target_count == 0 || p.min_quorum == 0 || p.min_quorum > p.target_count {
        return bad(format!("need 1 <= min_quorum ({}) <= target_count ({})", p.min_quorum, p.target_count));
    }
    if !(p.over_selection.is_finite() && p.over_selection >= 1.0) {
        return bad(format!("over_selection must be >= 1, got {}", p.over_selection));
    }
    if p.duration_ms == 0 {
        return bad("duration_ms must be > 0".into());
    }
    if p.max_sample_count == 0 {
        return bad("max_sample_count must be > 0".into());
    }
    if spec.max_consecutive_failures == 0 {
        return bad("max_consecutive_failures must be >= 1".into());
    }
    if let Some(p) = &spec.privacy {
        if !(p.noise_multiplier.is_finite() && p.noise_multiplier > 0.0) {
            return bad(format!("a DP campaign needs a noise multiplier > 0, got {}", p.noise_multiplier));
        }
        if !(p.delta > 0.0 && p.delta < 1.0) {
            return bad(format!("delta must be in (0, 1), got {}", p.delta));
        }
        if spec.buffer.is_some() {
            return bad("differential privacy is accounted per sampled round; asynchronous buffers are not sampled rounds".into());
        }
        if let Some((spend, Some(budget))) = privacy_spend(spec) {
            let one = spend.epsilon_after(1);
            if !(budget.is_finite() && budget > 0.0) || one > budget {
                return bad(format!("the privacy budget ε = {budget} allows no round: one round spends ε = {one:.4}"));
            }
        }
    }
    match &spec.selection {
        Invitation::Rate { rate } if !(*rate > 0.0 && *rate <= 1.0) || rate_to_ppm(*rate) == 0 => {
            bad(format!("rate must be in [1e-6, 1], got {rate}"))
        }
        Invitation::Explicit { devices } if (devices.len() as u64) < p.min_quorum as u64 => {
            bad(format!("{} explicit devices can never reach min_quorum {}", devices.len(), p.min_quorum))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_seeds_and_rates() {
        assert_ne!(round_seed(&[7; 32], RoundId(1)), round_seed(&[7; 32], RoundId(2)));
        assert_eq!(round_seed(&[7; 32], RoundId(1)), round_seed(&[7; 32], RoundId(1)));
        assert_eq!(rate_to_ppm(0.25), 250_000);
        assert_eq!(rate_to_ppm(3.0), PPM);
        assert_eq!(rate_to_ppm(f64::NAN), 0);
    }
}
