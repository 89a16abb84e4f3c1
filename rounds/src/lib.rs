//! fedfleet-rounds: the aggregator's sans-IO core — the round engine, the coordinator and the
//! aggregation strategies. The aggregator service (`fedfleet-aggregator`) is the shell around it.
//!
//! * [`engine`] — [`RoundEngine`], a deterministic state machine for campaigns and rounds:
//!   selection, quorum, deadline and one extension, straggler/duplicate/replay/revocation
//!   handling. Inputs take `now`; outputs are polled ([`RoundEngine::poll_event`],
//!   [`RoundEngine::poll_timeout`]).
//! * [`strategy`] — a strategy is an aggregation step (weighted mean, clipped mean, median,
//!   trimmed mean, Krum; exact fixed-point sums in [`strategy::fixed`], robust steps over a
//!   bounded [`SpillStore`]) plus a server optimizer (plain, Adam, Yogi, Adagrad), on an
//!   arithmetic [`Backend`]: FedAvg, FedProx, clipped FedAvg, FedAdam, FedYogi, FedAdagrad,
//!   median, trimmed mean, Krum.
//! * [`coordinator`] — [`Coordinator`], engine + strategy: admission, fold and commit as one step.
//! * [`privacy`] — the Rényi-DP accountant of the sampled Gaussian mechanism (DP-FedAvg's ε).
//! * [`reject`] — [`RejectReason`], the named reason of every refusal.
//!
//! **Architecture invariant:** the engine and the strategies do no I/O, read no clock and draw no
//! randomness: time comes in as `now` (unix ms), seeds come in with the campaign spec (and
//! DP-FedAvg's noise is a ChaCha20 stream keyed by a secret the shell hands in), and all
//! state is `serde` serializable so the shell can persist it and resume after `kill -9`.
//! This crate's dependencies (protocol, serde, postcard, rand_chacha, thiserror) make that a compiler-checked
//! fact: it cannot import tokio, quinn, sled, burn or a clock.
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

pub mod coordinator;
pub mod engine;
pub mod privacy;
pub mod reject;
pub mod strategy;

pub use coordinator::{Coordinator, FinalizeError};
pub use engine::{
    Accepted, BufferPolicy, CampaignId, CampaignOutcome, CampaignSpec, CloseCause, Contribution, EngineConfig, EngineError, EngineEvent,
    FailReason, FollowedRound, Invitation, Millis, Nonce, OpenedRound, PrivacyPolicy, PrivacyStatus, Reject, RelayMeta, RoundEngine,
    RoundPolicy, RoundStatus, UpdateMeta, rate_to_ppm, round_seed, staleness_weight,
};
pub use reject::RejectReason;
pub use strategy::{
    AdaptiveClipping, AdaptiveOptimizer, Aggregation, AggregationStep, Backend, ClientConfig, ClippedMean, DpMean, Evaluation, Exact,
    FedOptKind, FedOptParams, FoldError, Krum, Median, MemorySpill, PartialSum, ServerOptimizer, ServerStrategy, SpillError, SpillStore,
    Strategy, StrategyConfig, StrategyError, TrimmedMean, WeightedMean,
};
