//! The engine and a strategy glued together: what the shell drives.
//!
//! [`Coordinator::handle_update`] runs admission, the fold and the commit as one step, so an
//! update is either refused with a named reason and leaves no trace, or is both recorded by the
//! engine and folded by the strategy. Updates left in the strategy by a failed round are
//! discarded before the first fold of the next round. The whole coordinator is serializable:
//! persisting it after each accepted update is a complete commit point.

use fedfleet_protocol::{Digest, ModelVersion, RoundId};
use serde::{Deserialize, Serialize};

use crate::engine::{Accepted, EngineError, EngineEvent, Millis, Reject, RelayMeta, RoundEngine, UpdateMeta};
use crate::strategy::ServerStrategy;
use crate::strategy::fixed::PartialSum;
use crate::strategy::{Strategy, StrategyError};

/// Why [`Coordinator::finalize`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FinalizeError {
    #[error("round {0} is not closed and waiting for its model")]
    NotAwaiting(RoundId),
    /// The strategy could not produce a model; the round was aborted with this as its detail.
    #[error("strategy failed, round aborted: {0}")]
    Strategy(StrategyError),
}

// Printed in the message, so not also a `source`: a report of the chain would say it twice.
impl From<StrategyError> for FinalizeError {
    fn from(e: StrategyError) -> Self {
        FinalizeError::Strategy(e)
    }
}

/// Where accepted deltas go.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum FoldMode {
    /// Folded into the strategy as they arrive (the exact streaming fold).
    #[default]
    Streaming,
    /// Only counted: the shell keeps every accepted payload and folds them itself at finalize
    /// ([`Coordinator::finalize_with`]), e.g. on burn tensors in one canonical order.
    Deferred,
}

/// A [`RoundEngine`] and the [`Strategy`] that folds its accepted updates.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Coordinator<S> {
    engine: RoundEngine,
    strategy: S,
    /// The round the strategy's folded updates belong to.
    folding: Option<RoundId>,
    /// How the shell folds: its choice, made again at every open ([`Coordinator::set_mode`]),
    /// so never part of the persisted state.
    #[serde(skip)]
    mode: FoldMode,
    /// Updates of the `folding` round held back in [`FoldMode::Deferred`] (counted again when
    /// the shell refolds the round after a restart).
    #[serde(skip)]
    deferred: u64,
}

impl<S: Strategy> Coordinator<S> {
    pub fn new(engine: RoundEngine, strategy: S) -> Self {
        Coordinator { engine, strategy, folding: None, mode: FoldMode::Streaming, deferred: 0 }
    }
    pub fn mode(&self) -> FoldMode {
        self.mode
    }
    /// Switches the fold mode; the current round's updates (if any) are dropped, so call it
    /// before the first update of a round (at startup before the refold, or at campaign start).
    pub fn set_mode(&mut self, mode: FoldMode) {
        if mode != self.mode {
            self.discard_held();
            self.folding = None;
            self.mode = mode;
        }
    }
    /// Updates of the current round folded (streaming) or held back (deferred).
    pub fn held(&self) -> u64 {
        self.strategy.folded() + self.deferred
    }
    /// Drops the current round's folded or held-back updates (a failed round).
    pub fn discard_held(&mut self) {
        if self.held() > 0 {
            self.strategy.abort_round();
            self.deferred = 0;
        }
    }
    /// Folds (or, deferred, counts) one update of `round`, first dropping what a failed
    /// earlier round left behind.
    /// Makes `round` the one being folded: what a failed round left behind is dropped first.
    fn enter(&mut self, round: RoundId) {
        if self.folding != Some(round) {
            self.discard_held();
            self.folding = Some(round);
        }
    }

    fn take(&mut self, round: RoundId, delta: &[f32], weight: u64) -> Result<(), StrategyError> {
        self.enter(round);
        match self.mode {
            FoldMode::Streaming => self.strategy.fold(delta, weight),
            FoldMode::Deferred => {
                self.deferred += 1;
                Ok(())
            }
        }
    }
    pub fn engine(&self) -> &RoundEngine {
        &self.engine
    }
    /// For inputs that do not touch the strategy (start/stop campaign, revoke, timeouts).
    pub fn engine_mut(&mut self) -> &mut RoundEngine {
        &mut self.engine
    }
    pub fn strategy(&self) -> &S {
        &self.strategy
    }
    pub fn strategy_mut(&mut self) -> &mut S {
        &mut self.strategy
    }

    /// Admits, folds and records one verified update (`delta` in canonical tensor order).
    pub fn handle_update(&mut self, now: Millis, meta: UpdateMeta, delta: &[f32]) -> Result<Accepted, Reject> {
        let admitted = self.engine.check_update(now, &meta)?;
        self.take(admitted.round, delta, admitted.weight)
            .map_err(|e| Reject { reason: e.reason(), current_round: Some(admitted.round) })?;
        // Same `now`, no call in between: the engine answers exactly as `check_update` did.
        Ok(self.engine.handle_update(now, meta).expect("admission is deterministic"))
    }

    /// Admission check only (see [`RoundEngine::check_update`]): call before reading a payload.
    pub fn check_update(&mut self, now: Millis, meta: &UpdateMeta) -> Result<Accepted, Reject> {
        self.engine.check_update(now, meta)
    }

    /// Refolds an update the engine already accepted into `round` (restart after a crash: the
    /// strategy was restored from the last round boundary and the round's accepted payloads are
    /// folded again; the exact fold makes the result bit-identical).
    pub fn resume_fold(&mut self, round: RoundId, delta: &[f32], weight: u64) -> Result<(), StrategyError> {
        self.take(round, delta, weight)
    }

    /// The round whose updates the strategy currently holds.
    pub fn folding(&self) -> Option<RoundId> {
        self.folding
    }

    pub fn handle_timeout(&mut self, now: Millis) {
        self.engine.handle_timeout(now)
    }
    pub fn poll_event(&mut self) -> Option<EngineEvent> {
        self.engine.poll_event()
    }
    pub fn poll_timeout(&self) -> Option<Millis> {
        self.engine.poll_timeout()
    }

    /// Computes the next global model of the closed round `round` from its base `global`. On a
    /// strategy error the round is aborted (the engine emits `RoundFailed` and goes on).
    pub fn finalize(&mut self, now: Millis, round: RoundId, global: &[f32]) -> Result<Vec<f32>, FinalizeError> {
        self.finalize_with(now, round, |s| s.finalize(global))
    }

    /// [`Coordinator::finalize`] with the model computed by `compute` from the strategy (its
    /// server state; in [`FoldMode::Deferred`] the shell folds the round's stored updates).
    pub fn finalize_with(
        &mut self,
        now: Millis,
        round: RoundId,
        compute: impl FnOnce(&mut S) -> Result<Vec<f32>, StrategyError>,
    ) -> Result<Vec<f32>, FinalizeError> {
        if self.engine.awaiting_model() != Some(round) || self.folding != Some(round) {
            return Err(FinalizeError::NotAwaiting(round));
        }
        // Whatever computed it (exact fold, tensor fold, optimizer), a model with a NaN or an
        // infinity is never handed out to be signed and published: the round fails instead.
        let result = compute(&mut self.strategy).and_then(|model| match model.iter().position(|v| !v.is_finite()) {
            Some(index) => Err(StrategyError::NonFiniteModel { index, value: model[index] }),
            None => Ok(model),
        });
        self.deferred = 0;
        match result {
            Ok(model) => {
                self.folding = None;
                Ok(model)
            }
            Err(e) => {
                self.strategy.abort_round();
                self.folding = None;
                self.engine.abort_round(now, round, e.to_string()).expect("round is awaiting its model");
                Err(e.into())
            }
        }
    }

    /// The finalized model of `round` was published: open the next round.
    pub fn model_ready(&mut self, now: Millis, round: RoundId, version: ModelVersion, digest: Digest) -> Result<(), EngineError> {
        self.engine.model_ready(now, round, version, digest)
    }
}

/// A relay's partial sum: merged exactly into the round's streaming sum (weighted means only).
impl Coordinator<ServerStrategy> {
    /// Admission, merge and record of a relay's partial sum as one step, as
    /// [`handle_update`](Self::handle_update) for one update. Under a deferred fold there is no
    /// streaming sum to merge into: refused as `not_permitted`.
    pub fn handle_relay(&mut self, now: Millis, meta: RelayMeta, partial: &PartialSum) -> Result<Accepted, Reject> {
        let admitted = self.engine.check_relay(now, &meta)?;
        let refused = |reason| Reject { reason, current_round: Some(admitted.round) };
        if self.mode != FoldMode::Streaming {
            return Err(refused(crate::RejectReason::NotPermitted));
        }
        if partial.count() != meta.update_count || partial.total_weight() != meta.total_weight {
            return Err(refused(crate::RejectReason::Malformed));
        }
        // A sum for an earlier buffer is discounted by its staleness, as its updates would be.
        self.merge(admitted.round, &partial.discounted(admitted.staleness)).map_err(|e| refused(e.reason()))?;
        Ok(self.engine.handle_relay(now, meta).expect("admission is deterministic"))
    }

    /// Merges a partial sum accepted into `round` before a restart (the refold); `made_for` is
    /// the round it was made for (a relay's receipt names it), which sets its staleness in a
    /// buffer as at its admission.
    pub fn resume_merge(&mut self, round: RoundId, made_for: RoundId, partial: &PartialSum) -> Result<(), StrategyError> {
        let staleness = self.engine.staleness_of(made_for);
        self.merge(round, &partial.discounted(staleness))
    }

    fn merge(&mut self, round: RoundId, partial: &PartialSum) -> Result<(), StrategyError> {
        self.enter(round);
        self.strategy.merge_partial(partial)
    }
}
