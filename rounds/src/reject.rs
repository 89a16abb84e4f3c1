//! Named reasons for refusing an update: the fleet-wide [`RejectReason`] of the protocol crate
//! (stable snake_case names via `as_str()`, used as metric labels).
//!
//! The core produces: `wrong_fleet`, `revoked`, `replay`, `stale_round`, `unknown_round`,
//! `wrong_base_model`, `not_selected`, `duplicate`, `bad_sample_count`, `too_stale` (engine
//! admission; asynchronous campaigns also `overloaded` while a buffer publishes) and
//! `shape_mismatch`, `non_finite`, `too_large`, `overloaded`, `internal` (strategy folds, see
//! `StrategyError::reason`).

pub use fedfleet_protocol::RejectReason;
