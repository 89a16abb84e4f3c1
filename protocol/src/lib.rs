//! fedfleet wire protocol: ids, signed envelopes, tensor bundles, messages and framing.
//!
//! **Architecture invariant:** no I/O, no clock reads, no burn. Every decoder checks its size
//! limits before allocating, returns a typed error with a named [`RejectReason`], and never
//! panics, whatever the input.
//!
//! - [`ids`]: device, fleet, round and model ids; the BLAKE3 [`Digest`].
//! - [`envelope`]: domain-separated ed25519 signatures over canonical bytes ([`SignedUpdate`],
//!   [`verify_batch`], [`verify_payload`]).
//! - [`bundle`]: named tensors as safetensors, with f16/bf16/int8 quantization.
//! - [`messages`]: postcard control messages (rounds, receipts, manifests, rollouts, status).
//! - [`framing`]: length-prefixed frames for QUIC streams and a sans-IO [`FrameDecoder`].
//! - [`limits`]: every size limit.
//! - [`reject`]: the named rejection reasons shared by every service.
//! - [`tuf`]: signed model metadata in the spirit of TUF (root, targets, timestamp) and the
//!   client-side [`tuf::Verifier`] every device runs; [`artifact`]: a version's chunk manifest.
//! - [`model`]: the one model-metadata type ([`ModelInfo`]) and what a publisher states
//!   ([`NewVersion`]).
//! - [`time`]: unix milliseconds and the one [`Clock`] abstraction the shells are handed
//!   ([`SystemClock`] is the tree's one wall-clock reading; no core calls it).

pub mod artifact;
pub mod bundle;
pub mod envelope;
pub mod framing;
pub mod ids;
pub mod limits;
pub mod messages;
pub mod model;
pub mod reject;
pub mod serde_hex;
pub mod time;
pub mod tuf;

pub use bundle::{BundleError, BundleLimits, DType, Layout, Tensor, TensorBundle, TensorData};
pub use envelope::{
    EnvelopeError, Kind, PayloadCheck, RelayHeader, Signable, Signed, SignedRelay, SignedUpdate, UpdateHeader, random_nonce, verify_batch,
    verify_payload,
};
pub use framing::{Frame, FrameDecoder, FrameError, FrameKind, encode_frame};
pub use ids::{DeviceId, Digest, FleetId, Hasher, IdError, ModelVersion, RoundId};
pub use messages::{
    DevicePrivacy, DeviceState, DeviceStatus, Message, MessageError, ModelRef, Receipt, Rejection, RolloutAction, RolloutNotice,
    RoundAnnouncement, RoundConfig, Selection, StorageFault,
};
pub use model::{AdapterLineage, ModelInfo, NewVersion, SpecJson};
pub use reject::RejectReason;
pub use time::{Clock, Millis, SharedClock, SystemClock};
