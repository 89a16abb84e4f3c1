//! The aggregator's QUIC protocol (ALPN `fedfleet/1`), on top of `fedfleet_protocol::framing`.
//!
//! One request per bidirectional stream; the first frame says what the stream is:
//!
//! | first frame (client → server)            | rest of the request         | answer (server → client)                                   |
//! |------------------------------------------|-----------------------------|------------------------------------------------------------|
//! | `Signed` = encoded [`SignedUpdate`]       | `Chunk`* (payload), `End`   | `Signed` = encoded `Signed<Receipt>`, or `Message` = `Message::Rejection` |
//! | `Message` = postcard [`Request`]          | —                           | `Message` = postcard [`Response`] (+ `Chunk`*, `End` for a model) |
//!
//! **Upload.** The payload is the safetensors bundle of the update's *delta* (`local − base`),
//! in the round's dtype, with exactly the base model's tensor names and shapes. The server checks
//! cheap things before reading any payload byte (peer certificate = header device, allow-list
//! enrollment and revocation, signature, size, round/replay/duplicate admission) and may answer
//! and stop the stream early; a client whose write fails must still read the answer. The payload
//! is hashed as it streams (the first byte past the signed length is refused), then decoded and
//! checked (layout, dtype, finite values), folded and persisted (sled flush) — only then is the
//! receipt sent. Resending an accepted update (same device, nonce and payload digest) returns the
//! same receipt again, so an agent that lost the receipt can retry safely.
//!
//! **Receipts** are signed with the aggregator's *receipt key*, an ed25519 key kept in the data
//! directory (`receipt.key`, 0600; public half in `receipt.pub`, hex) — not the TLS key. Agents
//! pin the public key (or take it from [`Response::Round`]'s `receipt_key` on first contact).
//!
//! **Base models** are fetched here ([`Request::GetModel`]), by digest: the one documented path
//! for base models in this slice (the registry serves published versions for rollout).
//!
//! **Secure aggregation** (a round whose `RoundConfig::secure_aggregation` is set; plain uploads
//! are then refused as `not_permitted`): a device fetches the round's roster
//! ([`Request::SecAggRoster`], signed with the receipt key), sends its signed stage messages
//! ([`Request::SecAggSend`]; the masked vector as `Chunk` frames) and polls for what each stage
//! hands it ([`Request::SecAggPoll`]) until the round's sum is unmasked (a receipt naming its
//! masked vector) or the stages fail (`secagg_failed`). A refused message is `secagg_refused`,
//! its detail starting with the protocol's reason.
//!
//! **Admin** requests ([`Request::CampaignStart`] / [`Request::CampaignStatus`] /
//! [`Request::CampaignStop`]) are only served to a *service* certificate whose name is in the
//! config's `operators` list (`fedfleet-certs issue-server --name operator`).
//!
//! postcard is positional: append variants and fields at the end only.

use fedfleet_protocol::{DeviceId, Digest, ModelVersion, Rejection, RoundId};
pub use fedfleet_secagg::{Stage, UnmaskRequest};
use serde::{Deserialize, Serialize};

#[allow(unused_imports)] // doc links
use fedfleet_protocol::SignedUpdate;

/// Largest postcard [`Request`]/[`Response`] frame.
pub const MAX_WIRE_MESSAGE: usize = fedfleet_protocol::limits::MAX_MESSAGE_BYTES;

/// A non-upload request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Request {
    /// The open round's announcement, signed with the receipt key.
    GetRound,
    /// The bytes of a model the aggregator holds (a round's base model), by digest.
    GetModel { digest: Digest },
    /// Operator: start a campaign; `None` fields take the config's `[campaign]` defaults.
    CampaignStart(CampaignOverrides),
    /// Operator: where the running campaign stands.
    CampaignStatus,
    /// Operator: stop the running campaign (its open round fails).
    CampaignStop,
    /// Secure aggregation (a round whose config says `secure_aggregation`): the round's roster,
    /// signed with the receipt key.
    SecAggRoster { round: RoundId },
    /// Secure aggregation: one stage message of this device (an encoded
    /// `Signed<fedfleet_secagg::Message>`). At the masked stage `vector_len` bytes of the masked
    /// vector (little-endian u64s) follow as `Chunk` frames and an `End` frame; otherwise 0.
    SecAggSend { message: Vec<u8>, vector_len: u64 },
    /// Secure aggregation: what the round's current stage hands this device.
    SecAggPoll { round: RoundId },
}

/// Per-campaign overrides of the config defaults.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CampaignOverrides {
    pub rounds: Option<u32>,
    pub target_count: Option<u32>,
    pub min_quorum: Option<u32>,
    pub deadline_secs: Option<u64>,
    /// Campaign seed (round sampling); random when `None`.
    pub seed: Option<u64>,
}

/// The answer to a [`Request`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Response {
    /// `announcement`: an encoded `Signed<fedfleet_protocol::RoundAnnouncement>` (kind
    /// `Round`), `None` when no round is open. `receipt_key`: the key that signs it and receipts.
    Round { announcement: Option<Vec<u8>>, receipt_key: [u8; 32] },
    /// The model follows as `Chunk` frames and an `End` frame; `length` bytes hashing to the
    /// requested digest. `spec` is the model spec JSON.
    Model { spec: String, length: u64 },
    /// Campaign status (also the answer to start and stop).
    Status(CampaignStatus),
    /// The request was refused.
    Error(Rejection),
    /// The answer to [`Request::SecAggRoster`]: the postcard roster and the receipt key's
    /// signature over `Roster::signing_bytes`.
    SecAggRoster { roster: Vec<u8>, signature: Vec<u8> },
    /// The answer to [`Request::SecAggSend`]: the message was taken.
    SecAggTaken,
    /// The answer to [`Request::SecAggPoll`].
    SecAgg(SecAggView),
}

/// One device's view of a securely aggregated round at its current stage.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SecAggView {
    pub stage: Stage,
    /// At the shares stage: the neighbours' signed key adverts (encoded `Signed<Message>`).
    pub keys: Vec<Vec<u8>>,
    /// At the masked stage: the share ciphertexts the neighbours addressed to this device.
    pub shares: Vec<(DeviceId, Vec<u8>)>,
    /// At the unmask stage: which neighbours survived and which dropped out.
    pub unmask: Option<UnmaskRequest>,
    /// Done, this device among the survivors: its receipt (an encoded `Signed<Receipt>` whose
    /// payload digest is its masked vector's, nonce all zero).
    pub receipt: Option<Vec<u8>>,
    /// Failed: the protocol's reason (`below_threshold: …`).
    pub failure: Option<String>,
}

/// What `campaign status` prints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CampaignStatus {
    pub campaign: Option<u64>,
    pub strategy: Option<String>,
    pub rounds_completed: Option<u32>,
    pub open_round: Option<RoundId>,
    pub accepted: u32,
    pub target: u32,
    pub deadline_unix_ms: Option<u64>,
    /// The current global model (base of the open round, or the last published one).
    pub global: Option<(ModelVersion, Digest)>,
    /// The last campaign's outcome, once it finished.
    pub last_outcome: Option<String>,
    /// A differentially private campaign's spend: of the running campaign, or the last one's.
    pub privacy: Option<PrivacyReport>,
    /// Local differential privacy, when the devices noise their own updates (while a campaign
    /// runs).
    #[serde(default)]
    pub local_dp: Option<LocalDpReport>,
    /// The service aggregates securely (SecAgg+): its parameters, and the open round's stage.
    pub secure_aggregation: Option<SecAggReport>,
}

/// `[secure_aggregation]` as the service runs it, and where the open round's stages stand.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SecAggReport {
    /// Neighbours per device (configured; a smaller roster uses every other device).
    pub degree: u16,
    /// Shares needed to rebuild a device's secrets, as a fraction of its neighbours.
    pub threshold_fraction: f64,
    /// Every weighted value is clamped to ±clip before quantizing.
    pub clip: f64,
    pub frac_bits: u8,
    /// The open round's stages, once it has a roster.
    pub open_round: Option<SecAggRoundReport>,
}

/// One securely aggregated round at the moment of asking.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SecAggRoundReport {
    pub round: RoundId,
    pub stage: Stage,
    /// Devices on the round's roster.
    pub roster: u32,
    /// Shares needed to rebuild one device's secrets in this round.
    pub threshold: u16,
    /// Why the stages failed (the round then fails: never a wrong model).
    pub failure: Option<String>,
}

/// The (ε, δ) a DP-FedAvg campaign has spent (see `fedfleet_rounds::privacy`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PrivacyReport {
    pub noise_multiplier: f64,
    /// The probability that a device is invited to a round.
    pub sampling_rate: f64,
    pub delta: f64,
    pub epsilon_spent: f64,
    pub epsilon_budget: Option<f64>,
    #[serde(default)]
    pub noise_added_by: NoiseSource,
}

/// Who adds DP-FedAvg's noise.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NoiseSource {
    /// The aggregator, to the sum it folded.
    #[default]
    Aggregator,
    /// The devices, each a share before masking (secure aggregation): no party sees the
    /// noise-free sum.
    Devices,
}

/// `[campaign.local_dp]`: every device clips and noises its own update.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LocalDpReport {
    pub clip_norm: f64,
    pub noise_multiplier: f64,
    pub delta: f64,
    /// Rounds the running campaign has published.
    pub rounds: u32,
    /// What one device's releases in those rounds spend, at most (a device that sat rounds
    /// out spends less).
    pub epsilon_per_device: f64,
}
