//! fedfleet wire protocol: ids, signed envelopes, tensor bundles, messages and framing.
//!
//! **Architecture invariant:** no I/O, no clock reads, no burn. Every decoder returns a typed
//! error with a named reason and never panics, whatever the input.

pub mod ids;

pub use ids::{Digest, DeviceId, FleetId, Hasher, IdError, ModelVersion, RoundId};
