//! fedfleet-registry: where model versions live and how they reach the fleet.
//!
//! The registry's own core is [`store`]: a versioned, content-addressed store on sled.
//! Artifacts are split into fixed-size chunks keyed by their BLAKE3 digest, so a device that
//! holds chunks of an earlier version fetches only what differs ([`Store::missing_chunks`]).
//! Model versions are numbered per model name and carry their [`ModelInfo`]; aliases
//! (`stable`, `canary`, any name) point at versions. Publishing is atomic: a crash never leaves
//! a half-visible version. A damaged database is refused on open, never replaced by an empty one.
//!
//! It drives two sans-IO cores that live in crates of their own (re-exported here): the TUF
//! metadata and its client-side [`Verifier`] (`fedfleet_protocol::tuf`), and the phased rollout
//! engine (`fedfleet-rollout`, tested there on its own). The shell feeds device reports to
//! [`Rollout::handle_report`], calls [`Rollout::handle_timeout`] at [`Rollout::poll_timeout`],
//! applies [`rollout::Event::SetAlias`] with [`Store::set_alias`], and persists rollouts with
//! [`Store::put_rollout`].
//!
//! The shell around them:
//!
//! - [`service`]: the lifecycle, `open(config, clock) → bind → run(shutdown)`, shared by
//!   `fedfleet-registry serve` and the test kit.
//! - [`ops`]: [`ops::Registry`], one handle over the store, live rollouts, the
//!   [`metadata::MetadataSigner`] and the service's clock; every service and operator operation.
//! - [`server`]: the tokio/quinn request handlers (mTLS, per-stream handlers, rollout timer,
//!   timestamp re-signing) on `fedfleet_net`'s accept loop, [`metrics`] for Prometheus,
//!   [`mqtt`] for the control plane.
//! - [`objects`]: artifacts mirrored, whole and content-addressed, to an S3-compatible bucket
//!   that agents (or a CDN in front of it) download from.
//! - [`wire`], [`client`] (from `fedfleet-registry-client`): the request/response protocol, the
//!   signed "what should I run?" [`wire::SignedAssignment`], and the client agents and
//!   operators link instead of this crate.
//!
//! **Architecture invariant:** time comes from the clock the service was opened with
//! ([`ops::Registry::now_ms`]); the cores take `now` as a parameter (unix milliseconds).

pub mod config;
pub mod console;
pub mod metadata;
pub mod metrics;
pub mod mqtt;
pub mod objects;
pub mod ops;
pub mod server;
pub mod service;
pub mod store;

#[cfg(test)]
mod tests;

pub use fedfleet_protocol::{Digest, ModelVersion};
// The pure parts other crates share: TUF metadata (protocol), the rollout core, and the client
// with its wire types (what devices link instead of this crate).
pub use fedfleet_protocol::tuf;
pub use fedfleet_registry_client::{admin, client, wire};
pub use fedfleet_rollout as rollout;
pub use rollout::{
    Assignment, Audience, Event as RolloutEvent, Phase, Reason, Rollout, RolloutError, RolloutPlan, Status as RolloutStatus, VersionReport,
};
pub use store::{Artifact, ChunkRef, Manifest, ModelInfo, NewVersion, Store, StoreConfig, StoreError};
pub use tuf::{Root, SignedMetadata, Targets, Timestamp, TufError, Verifier};

/// How a failed operation reads to its caller, the same over QUIC and in the console.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No such model, version, artifact, rollout or device.
    NotFound,
    /// The command does not apply, named (`invalid_command`, `not_a_model`).
    Invalid(&'static str),
    /// The registry's own failure.
    Internal,
}

impl RegistryError {
    pub fn refusal(&self) -> Refusal {
        match self {
            RegistryError::NotFound(_) | RegistryError::Store(StoreError::UnknownVersion { .. } | StoreError::UnknownArtifact(_)) => {
                Refusal::NotFound
            }
            RegistryError::Store(
                StoreError::InvalidName { .. }
                | StoreError::InvalidMetric(_)
                | StoreError::InvalidRecord(_)
                | StoreError::EmptyArtifact
                | StoreError::UnknownParent { .. },
            )
            | RegistryError::Rollout(_)
            | RegistryError::Invalid(_) => Refusal::Invalid("invalid_command"),
            RegistryError::NotAModel(_) => Refusal::Invalid("not_a_model"),
            _ => Refusal::Internal,
        }
    }
}

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
    #[error("{path}: {cause}")]
    Io { path: std::path::PathBuf, cause: std::io::Error },
    #[error("key {path}: {detail}")]
    Key { path: std::path::PathBuf, detail: String },
    #[error("{0}")]
    Config(String),
    #[error("not found: {0}")]
    NotFound(String),
    #[error("invalid command: {0}")]
    Invalid(String),
    /// An artifact that is not a model of its spec; nothing was stored.
    #[error("{0}")]
    NotAModel(String),
    /// The registry's own failure (a worker task panicked), not the request's.
    #[error("internal error: {0}")]
    Internal(String),
    #[error(transparent)]
    Cert(#[from] fedfleet_certs::CertError),
    #[error(transparent)]
    Net(#[from] fedfleet_net::NetError),
}
