//! fedfleet-registry: where model versions live and how they reach the fleet.
//!
//! Three cores, each usable without the others, and none of them doing network I/O:
//!
//! - [`store`]: a versioned, content-addressed store on sled. Artifacts are split into fixed-size
//!   chunks keyed by their BLAKE3 digest, so a device that holds chunks of an earlier version
//!   fetches only what differs ([`Store::missing_chunks`]). Model versions are numbered per model
//!   name and carry a manifest (opaque spec, length, digest, parent, metrics, publisher);
//!   aliases (`stable`, `canary`, any name) point at versions. Publishing is atomic: a crash
//!   never leaves a half-visible version. A damaged database is refused on open, never replaced
//!   by an empty one.
//! - [`tuf`]: signed metadata in the spirit of TUF (root, targets, timestamp roles; Ed25519 with
//!   thresholds; domain-separated signatures) and the pure client-side [`Verifier`] that agents
//!   use to reject forged, under-signed, expired, rolled-back or mismatching metadata and
//!   artifacts, each with a named [`TufError`].
//! - [`rollout`]: the sans-IO rollout engine. It moves an alias to a new version in phases
//!   (deterministic percentages of the fleet or named cohorts) with soak times, pause, resume,
//!   abort, roll back, and an automatic abort when a phase's failure rate passes a threshold.
//!   Time is passed in; events are polled; the state serializes for the shell to persist.
//!
//! The QUIC download service and the operator CLI sit on top: the service answers
//! [`Store::manifest`], [`Store::missing_chunks`] and [`Store::chunk`] requests and serves the
//! signed metadata; the shell feeds device reports to [`Rollout::handle_report`], calls
//! [`Rollout::handle_timeout`] at [`Rollout::poll_timeout`], applies [`rollout::Event::SetAlias`]
//! with [`Store::set_alias`], and persists rollouts with [`Store::put_rollout`].
//!
//! The shell around them:
//!
//! - [`wire`]: the registry's request/response protocol over QUIC streams, and the signed
//!   "what should I run?" [`wire::SignedAssignment`].
//! - [`ops`]: [`ops::Registry`], one handle over the store, live rollouts and the
//!   [`metadata::MetadataSigner`]; every service and operator operation.
//! - [`server`]: the tokio/quinn service shell (mTLS, per-stream handlers, rollout timer,
//!   timestamp re-signing, graceful shutdown), [`metrics`] for Prometheus.
//! - [`client`]: [`client::RegistryClient`] for agents and operators: metadata, manifests,
//!   resumable delta downloads into a [`client::ChunkCache`], assignments, reports, admin.
//!
//! **Architecture invariant:** no sockets, no clock reads and no async in this crate's cores;
//! `now` is always a parameter (unix milliseconds).

pub mod config;
pub mod metadata;
pub mod metrics;
pub mod mqtt;
pub mod ops;
pub mod server;
pub mod store;

#[cfg(test)]
mod tests;

pub use fedfleet_protocol::{Digest, ModelVersion};
// The pure parts other crates share: TUF metadata (protocol), the rollout core, and the client
// with its wire types (what devices link instead of this crate).
pub use fedfleet_protocol::tuf;
pub use fedfleet_registry_client::{client, wire};
pub use fedfleet_rollout as rollout;
pub use rollout::{
    Assignment, Audience, Event as RolloutEvent, Phase, Reason, Rollout, RolloutError, VersionReport,
    RolloutPlan, Status as RolloutStatus,
};
pub use store::{
    Artifact, ChunkRef, Manifest, ModelInfo, NewVersion, Store, StoreConfig, StoreError,
};
pub use tuf::{Root, SignedMetadata, Targets, Timestamp, TufError, Verifier};

/// Errors of the service shell, the operator commands and the metadata signer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegistryError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Tuf(#[from] TufError),
    #[error(transparent)]
    Rollout(#[from] RolloutError),
    #[error("{path}: {source}")]
    Io {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("key {path}: {detail}")]
    Key {
        path: std::path::PathBuf,
        detail: String,
    },
    #[error("{0}")]
    Config(String),
    #[error("not found: {0}")]
    NotFound(String),
    #[error("invalid command: {0}")]
    Invalid(String),
    #[error(transparent)]
    Cert(#[from] fedfleet_certs::CertError),
    #[error(transparent)]
    Net(#[from] fedfleet_net::NetError),
}

/// Wall-clock unix milliseconds (shell only; the cores take `now` as a parameter).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
