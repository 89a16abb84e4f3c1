//! fedfleet-aggregator: the service shell around the round core (`fedfleet-rounds`): QUIC
//! ingest, sled state, publishing, metrics, the CLI.
//!
//! # Code map
//!
//! Shell (I/O): [`lifecycle`] (open → bind → run, for the daemon and the test kit), [`service`] ([`service::Aggregator`]: accept loop, ingest, round driver,
//! campaigns), [`persist`] (sled state and commit points; crash recovery by exact refold),
//! [`publish`] ([`publish::Publisher`], [`publish::DirPublisher`]), [`config`]
//! (`aggregator.toml`), [`keys`] (the receipt key), [`metrics`] (Prometheus), [`accel`] (the
//! tensor fold on burn). The wire protocol and its client live in `fedfleet-aggregator-client`
//! (re-exported as [`wire`] and [`client`]); the engine, coordinator and strategies in
//! `fedfleet-rounds` (re-exported here under their module names).

pub mod accel;
pub mod config;
pub mod console;
pub mod keys;
pub mod lifecycle;
pub mod metrics;
pub mod mqtt;
pub mod pacing;
pub mod persist;
pub mod publish;
pub mod segments;
pub mod service;

pub use fedfleet_aggregator_client::{client, wire};
pub use fedfleet_rounds::*;
pub use fedfleet_rounds::{coordinator, engine, reject, strategy};
