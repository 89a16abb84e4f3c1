//! fedfleet-agent-core: the device lifecycle, without I/O. See [`lifecycle`].
//!
//! **Architecture invariant:** this crate's dependencies (protocol, serde, rand, thiserror,
//! tracing) keep it from touching sockets, files, sled, tokio, burn or a clock; the shell in
//! `fedfleet-agent` owns all of those and feeds the core inputs and the time.

pub mod lifecycle;
pub mod privacy;

pub use lifecycle::*;
