//! fedfleet-aggregator: the round engine and aggregation strategies (a sans-IO core), and the
//! service shell around them: QUIC ingest, sled state, publishing, metrics, the CLI.
//!
//! # Code map
//!
//! Shell (I/O): [`service`] ([`service::Aggregator`]: accept loop, ingest, round driver,
//! campaigns), [`wire`] (the QUIC protocol), [`client`] (its client, for agents and the CLI),
//! [`persist`] (sled state and commit points; crash recovery by exact refold), [`publish`]
//! ([`publish::Publisher`], [`publish::DirPublisher`]), [`config`] (`aggregator.toml`),
//! [`keys`] (the receipt key), [`metrics`] (Prometheus text).
//!
//! Core (no I/O):
//!
//! * [`engine`] — [`RoundEngine`], a deterministic state machine for campaigns and rounds:
//!   selection, quorum, deadline and one extension, straggler/duplicate/replay/revocation
//!   handling. Inputs take `now`; outputs are polled ([`RoundEngine::poll_event`],
//!   [`RoundEngine::poll_timeout`]).
//! * [`strategy`] — the [`Strategy`] trait and FedAvg, FedProx, clipped FedAvg, FedAdam,
//!   FedYogi, FedAdagrad (streaming, exact fixed-point sums in [`strategy::fixed`]) and median,
//!   trimmed mean, Krum (over a bounded [`SpillStore`]).
//! * [`coordinator`] — [`Coordinator`], engine + strategy: admission, fold and commit as one step.
//! * [`reject`] — [`RejectReason`], the named reason of every refusal.
//!
//! **Architecture invariant:** the engine and the strategies do no I/O, read no clock and draw no
//! randomness: time comes in as `now` (unix ms), seeds come in with the campaign spec, and all
//! state is `serde` serializable so the shell can persist it and resume after `kill -9`.
//! They do not depend on tokio, quinn, sled or burn.
//!
//! **Determinism:** the same accepted updates in any arrival order give a bit-identical model
//! (integer fixed-point sums for the streaming strategies, content-key order for the robust ones),
//! and FedAvg over relays' partial sums equals FedAvg over all their devices exactly.
//!
//! # Driving it (the shell's loop)
//!
//! ```text
//! coordinator.engine_mut().start_campaign(now, spec)?;
//! loop {
//!     while let Some(ev) = coordinator.poll_event() {
//!         match ev {
//!             RoundOpened(a)             => broadcast(a),
//!             RoundClosed { round, .. }  => { let m = coordinator.finalize(now, round, &base)?;
//!                                            let (v, d) = publish(m);
//!                                            coordinator.model_ready(now, round, v, d)?; }
//!             RoundFailed { .. } | RoundExtended { .. } | DeviceRevoked { .. } => log(ev),
//!             CampaignFinished { .. }    => break,
//!         }
//!     }
//!     persist(&coordinator);
//!     select! { update = ingest => reply(coordinator.handle_update(now, meta, &delta)),
//!               _ = sleep_until(coordinator.poll_timeout()) => coordinator.handle_timeout(now) }
//! }
//! ```

pub mod accel;
pub mod client;
pub mod config;
pub mod coordinator;
pub mod engine;
pub mod keys;
pub mod metrics;
pub mod mqtt;
pub mod persist;
pub mod publish;
pub mod reject;
pub mod service;
pub mod strategy;
pub mod wire;

pub use coordinator::{Coordinator, FinalizeError};
pub use engine::{
    Accepted, CampaignId, CampaignOutcome, CampaignSpec, CloseCause, Contribution, EngineConfig,
    EngineError, EngineEvent, FailReason, Millis, Nonce, Reject, RoundAnnouncement, RoundEngine,
    RoundPolicy, RoundStatus, Selection, UpdateMeta, rate_to_ppm, round_seed,
};
pub use reject::RejectReason;
pub use strategy::{
    ClientConfig, ClippedFedAvg, Evaluation, FedAvg, FedOpt, FedOptKind, FedOptParams, FoldError,
    Krum, Median, MemorySpill, PartialSum, ServerStrategy, SpillError, SpillStore, Strategy,
    StrategyConfig, StrategyError, TrimmedMean,
};
