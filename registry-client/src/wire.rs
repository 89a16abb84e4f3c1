//! The registry's wire protocol, version 1 (ALPN `fedfleet/1`, like every fleet service).
//!
//! Every request is one QUIC bidirectional stream. Frames are `fedfleet_protocol::framing`
//! frames; message bodies are postcard ([`fedfleet_protocol::messages::encode`]/`decode` with
//! [`MAX_MESSAGE_BYTES`]). postcard is positional: **append only** (new variants at the end,
//! never reorder fields).
//!
//! ```text
//! client                                   server
//! Message(Request) [Chunk.. End]  ──▶       (Chunk..End only after Admin(Publish))
//!                                  ◀──      Message(Response)
//!                                  ◀──      [Chunk .. End]   after Response::Chunks / ::Range
//! ```
//!
//! - `Chunks { indices }`: the server answers `Response::Chunks { count }`, then the chunks'
//!   bytes in the order asked, as `Chunk` frames of at most [`MAX_CHUNK_BYTES`] each (a chunk
//!   larger than one frame spans several; the client knows every chunk's length from the
//!   manifest), then `End`. If the server cannot read a chunk mid-way it sends a
//!   `Message(Response::Rejected)` instead of the next frame and finishes the stream.
//! - Identity comes from the mTLS certificate, never from a message: `Report` and `Assignment`
//!   need a device certificate (the status' `device` must equal the certificate's), `Admin`
//!   needs a service certificate whose name is in the service's operator list.
//! - Every refusal is `Response::Rejected(Rejection)` with a named [`RejectReason`].
//!
//! # Signed assignments
//! "What should I run?" is answered with a [`SignedAssignment`]: the postcard bytes of an
//! [`AssignmentBody`] signed with the registry's **timestamp (online) key(s)** over
//! `"fedfleet/registry/assignment/v1\0" || body`. The agent verifies it against the timestamp
//! role of its pinned (and rotated) TUF root ([`SignedAssignment::verify`]): the same threshold,
//! a different signing domain, so an assignment can never pass for timestamp metadata or the
//! reverse. It names the device and expires with the timestamp TTL, so it cannot be replayed to
//! another device or much later.

use ed25519_dalek::{Signer, SigningKey};
use fedfleet_protocol::limits::{MAX_CHUNK_BYTES, MAX_MESSAGE_BYTES};
use fedfleet_protocol::messages::{BASIS_POINTS, RolloutAction};
use fedfleet_protocol::{DeviceId, DeviceStatus, FleetId, ModelRef, ModelVersion, NewVersion, RejectReason, Rejection, RolloutNotice};
use serde::{Deserialize, Serialize};

use fedfleet_protocol::artifact::Manifest;
use fedfleet_protocol::tuf::{self, KeyId, Root, Targets, Timestamp};
use fedfleet_rollout::{Phase, Reason};

pub use fedfleet_protocol::messages::MessageError;

/// Largest request or response message.
pub const MAX_MESSAGE: usize = MAX_MESSAGE_BYTES;
/// Most chunk indices in one `Chunks` request.
pub const MAX_CHUNKS_PER_REQUEST: usize = 4096;
/// Largest `Range` answer.
pub const MAX_RANGE_LEN: u32 = 16 << 20;
/// Bytes per `Chunk` frame.
pub const FRAME_DATA: usize = MAX_CHUNK_BYTES;
/// Signing domain of assignments.
pub const ASSIGNMENT_DOMAIN: &[u8] = b"fedfleet/registry/assignment/v1\0";

/// Which version of a model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum VersionSel {
    Number(ModelVersion),
    Alias(String),
    Latest,
}

impl From<ModelVersion> for VersionSel {
    fn from(v: ModelVersion) -> Self {
        VersionSel::Number(v)
    }
}

/// A request: the first frame of every stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Request {
    /// Every root newer than `have_root_version`, the current timestamp and targets.
    Metadata { have_root_version: u64 },
    /// A version's manifest (with its chunk list).
    Manifest { name: String, version: VersionSel },
    /// The bytes of these chunks (indices into the manifest's chunk list), in this order.
    Chunks { name: String, version: ModelVersion, indices: Vec<u32> },
    /// Up to `max_len` bytes of the artifact from `offset` (for byte-range resumers).
    Range { name: String, version: ModelVersion, offset: u64, max_len: u32 },
    /// "What should I run?" for `model`. Device certificates only.
    Assignment { model: String },
    /// A device's status report. Device certificates only.
    Report(DeviceStatus),
    /// An operator command. Operator service certificates only.
    Admin(AdminRequest),
    /// A new certificate for the device's current one (same id, fleet and key), issued by a
    /// registry with `[renewal]`. Device certificates only: the mTLS handshake is the proof of
    /// the current key.
    RenewCertificate,
}

/// An answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Response {
    Rejected(Rejection),
    Metadata(MetadataSet),
    /// A version's manifest (the spec travels as JSON text). **Not signed**: see [`Manifest`].
    Manifest(Manifest),
    /// `count` chunks follow as `Chunk` frames, then `End`.
    Chunks {
        count: u32,
    },
    /// `len` bytes follow as `Chunk` frames, then `End`.
    Range {
        len: u32,
    },
    Assignment(SignedAssignment),
    Ok,
    /// An operator command's result, as JSON text.
    Admin(String),
    /// No such model, version, alias, rollout or device.
    NotFound(String),
    /// The certificate may not make this request (a service asking as a device, a device or
    /// an unlisted service sending an operator command).
    Denied(String),
    /// An operator command that does not apply (bad name, rollout in the wrong state, ...).
    Invalid(String),
    /// The renewed device certificate (PEM), answering `RenewCertificate`.
    Certificate {
        pem: String,
    },
}

/// Signed metadata for agents (postcard carries the signed JSON texts verbatim).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MetadataSet {
    /// Root versions after the one the client has, in order (usually empty).
    pub roots: Vec<tuf::SignedMetadata<Root>>,
    pub timestamp: tuf::SignedMetadata<Timestamp>,
    pub targets: tuf::SignedMetadata<Targets>,
}

/// Operator commands (service certificate in the operator list).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum AdminRequest {
    /// Publish: the artifact's bytes follow as `Chunk` frames, then `End`.
    /// The registry stamps `created_at_unix_ms` with its own clock and, when `publisher` is
    /// empty, names the publisher by its certificate.
    Publish(NewVersion),
    List,
    Show {
        name: String,
        version: Option<ModelVersion>,
    },
    AliasSet {
        name: String,
        alias: String,
        version: ModelVersion,
    },
    RolloutStart(RolloutStart),
    Rollout {
        id: String,
        command: RolloutCommand,
    },
    RolloutStatus {
        id: Option<String>,
    },
    DeviceStatus {
        device: Option<String>,
    },
}

/// What `rollout start` asks for; the registry fills in the previous version from the alias.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RolloutStart {
    /// `None`: `<model>-<alias>-v<target>-<unix ms>`.
    pub id: Option<String>,
    pub model: String,
    pub alias: String,
    pub target: ModelVersion,
    pub phases: Vec<Phase>,
    pub failure_threshold: f64,
    pub min_sample: u32,
}

/// Operator commands on a running rollout.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RolloutCommand {
    Pause,
    Resume,
    Abort { reason: String },
    Rollback,
}

/// Where an assignment came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum AssignmentSource {
    /// A rollout decided (its engine's reason).
    Rollout { id: String, reason: Reason },
    /// No active rollout: the model's `stable` alias.
    Alias { alias: String },
    /// Nothing published or aliased for this model.
    Nothing,
}

/// The answer to "what should I run?".
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AssignmentBody {
    pub fleet: FleetId,
    pub device: DeviceId,
    pub model: String,
    /// The version to run (length and digest to check the artifact with); `None`: nothing.
    pub target: Option<ModelRef>,
    pub length: Option<u64>,
    pub source: AssignmentSource,
    pub issued_at_unix_ms: u64,
    pub expires_unix_ms: u64,
}

impl AssignmentBody {
    /// The assignment as the protocol's [`RolloutNotice`] (what the edge agent's lifecycle
    /// consumes): `Install` of the target for this device; `None` when there is no target.
    /// The rollout id is the first 8 bytes of `blake3(rollout id)` (0 for an alias).
    pub fn to_notice(&self) -> Option<RolloutNotice> {
        let model = self.target.clone()?;
        let (rollout_id, phase, alias) = match &self.source {
            AssignmentSource::Rollout { id, reason } => (
                u64::from_be_bytes(blake3::hash(id.as_bytes()).as_bytes()[..8].try_into().ok()?),
                match reason {
                    Reason::InRollout { phase } | Reason::NotInAudience { phase } => *phase as u32,
                    _ => 0,
                },
                String::new(),
            ),
            AssignmentSource::Alias { alias } => (0, 0, alias.clone()),
            AssignmentSource::Nothing => return None,
        };
        Some(RolloutNotice {
            fleet: self.fleet.clone(),
            rollout_id,
            alias,
            model,
            length: self.length.unwrap_or(0),
            phase,
            // The registry already decided for this device: it is "in" at 100 %.
            percent_bp: BASIS_POINTS,
            cohort: None,
            action: RolloutAction::Install,
            issued_at_unix_ms: self.issued_at_unix_ms,
        })
    }
}

/// One signature of an assignment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AssignmentSignature {
    pub keyid: KeyId,
    pub sig: Vec<u8>,
}

/// An [`AssignmentBody`] as signed (postcard bytes kept verbatim) with its signatures.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SignedAssignment {
    pub body: Vec<u8>,
    pub signatures: Vec<AssignmentSignature>,
}

/// Why an assignment was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AssignmentError {
    #[error("assignment does not parse: {0}")]
    Malformed(String),
    #[error("assignment has {valid} valid timestamp-key signature(s), {threshold} required")]
    UnderThreshold { valid: u32, threshold: u32 },
    #[error("assignment is for device {got}, not {expected}")]
    WrongDevice { expected: String, got: String },
    #[error("assignment expired at {expires} (now {now})")]
    Expired { expires: u64, now: u64 },
}

fn assignment_message(body: &[u8]) -> Vec<u8> {
    let mut m = ASSIGNMENT_DOMAIN.to_vec();
    m.extend_from_slice(body);
    m
}

impl SignedAssignment {
    /// Signs `body` with every key given (the registry's timestamp keys).
    pub fn sign(body: &AssignmentBody, keys: &[&SigningKey]) -> Self {
        let body = postcard_bytes(body);
        let msg = assignment_message(&body);
        let signatures = keys
            .iter()
            .map(|k| AssignmentSignature { keyid: KeyId::of(&k.verifying_key()), sig: k.sign(&msg).to_bytes().to_vec() })
            .collect();
        SignedAssignment { body, signatures }
    }

    /// The body, unverified.
    pub fn body_unverified(&self) -> Result<AssignmentBody, AssignmentError> {
        fedfleet_protocol::messages::decode(&self.body, MAX_MESSAGE).map_err(|e| AssignmentError::Malformed(e.to_string()))
    }

    /// Verifies against the timestamp role of `root` (threshold of distinct keys, strict
    /// ed25519), checks that it names `device` and has not expired at `now` (unix ms).
    pub fn verify(&self, root: &Root, device: &DeviceId, now: u64) -> Result<AssignmentBody, AssignmentError> {
        let msg = assignment_message(&self.body);
        let count = root.timestamp.count_signatures(root, &msg, self.signatures.iter().map(|s| (&s.keyid, s.sig.as_slice())));
        if count.valid < count.threshold {
            return Err(AssignmentError::UnderThreshold { valid: count.valid, threshold: count.threshold });
        }
        let body = self.body_unverified()?;
        if &body.device != device {
            return Err(AssignmentError::WrongDevice { expected: device.to_string(), got: body.device.to_string() });
        }
        if now >= body.expires_unix_ms {
            return Err(AssignmentError::Expired { expires: body.expires_unix_ms, now });
        }
        Ok(body)
    }
}

fn postcard_bytes<T: Serialize>(v: &T) -> Vec<u8> {
    fedfleet_protocol::messages::encode(v, MAX_MESSAGE).expect("registry messages encode")
}

/// Encodes a request or response.
pub fn encode<T: Serialize>(v: &T) -> Result<Vec<u8>, MessageError> {
    fedfleet_protocol::messages::encode(v, MAX_MESSAGE)
}

/// Decodes a request or response (size-limited, no trailing bytes).
pub fn decode<T: serde::de::DeserializeOwned>(b: &[u8]) -> Result<T, MessageError> {
    fedfleet_protocol::messages::decode(b, MAX_MESSAGE)
}

/// A rejection response.
pub fn rejected(reason: RejectReason, detail: impl Into<String>) -> Response {
    Response::Rejected(Rejection::new(reason, detail))
}
