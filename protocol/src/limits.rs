//! Every size limit the protocol enforces, in one place.
//!
//! Decoders check these before they allocate: a length prefix, a tensor count or a shape is
//! compared against its limit first, so a hostile peer cannot make us reserve memory by claiming
//! a large size.

pub use crate::ids::MAX_ID_LEN;

const KIB: usize = 1024;
const MIB: usize = 1024 * KIB;
const GIB: usize = 1024 * MIB;

/// Canonical `UpdateHeader` / `RelayHeader` bytes: two ids plus fixed-width fields, well under
/// this.
pub const MAX_CANONICAL_HEADER_BYTES: usize = 512;

/// Body of a signed envelope whose canonical bytes are a postcard message (round announcements
/// with a device list are the largest).
pub const MAX_SIGNED_BODY_BYTES: usize = MAX_MESSAGE_BYTES;

/// A whole encoded `Signed<T>`: kind, length, body and signature.
pub const MAX_SIGNED_ENVELOPE_BYTES: usize = MAX_SIGNED_BODY_BYTES + 1 + 4 + 64;

/// One postcard-encoded control message. About 15 000 device ids fit in an explicit selection;
/// larger fleets use sampling.
pub const MAX_MESSAGE_BYTES: usize = MIB;

/// One payload or artifact chunk in a stream frame; payloads are streamed chunk by chunk so the
/// receiver can hash while it reads.
pub const MAX_CHUNK_BYTES: usize = MIB;

/// A whole tensor bundle (safetensors bytes).
pub const MAX_BUNDLE_BYTES: usize = GIB;

/// Tensors in one bundle.
pub const MAX_BUNDLE_TENSORS: usize = 4096;

/// Parameters (elements, all tensors together) in one bundle: 1 GiB of f32.
pub const MAX_BUNDLE_PARAMS: usize = 256 * 1024 * 1024;

/// The JSON header of a safetensors file (names, shapes, offsets, scales).
pub const MAX_SAFETENSORS_HEADER_BYTES: usize = 8 * MIB;

/// A tensor name, in bytes.
pub const MAX_TENSOR_NAME_LEN: usize = 256;

/// Dimensions of one tensor.
pub const MAX_TENSOR_RANK: usize = 8;

/// Free-text detail in a rejection or a device status.
pub const MAX_DETAIL_LEN: usize = 1024;
