//! The engine and a strategy glued together: what the shell drives.
//!
//! [`Coordinator::handle_update`] runs admission, the fold and the commit as one step, so an
//! update is either refused with a named reason and leaves no trace, or is both recorded by the
//! engine and folded by the strategy. Updates left in the strategy by a failed round are
//! discarded before the first fold of the next round. The whole coordinator is serializable:
//! persisting it after each accepted update is a complete commit point.

use fedfleet_protocol::{Digest, ModelVersion, RoundId};
use serde::{Deserialize, Serialize};

use crate::engine::{Accepted, EngineError, EngineEvent, Millis, Reject, RoundEngine, UpdateMeta};
use crate::strategy::{Strategy, StrategyError};

/// Why [`Coordinator::finalize`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FinalizeError {
    #[error("round {0} is not closed and waiting for its model")]
    NotAwaiting(RoundId),
    /// The strategy could not produce a model; the round was aborted with this as its detail.
    #[error("strategy failed, round aborted: {0}")]
    Strategy(#[from] StrategyError),
}

/// A [`RoundEngine`] and the [`Strategy`] that folds its accepted updates.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Coordinator<S> {
    engine: RoundEngine,
    strategy: S,
    /// The round the strategy's folded updates belong to.
    folding: Option<RoundId>,
}

impl<S: Strategy> Coordinator<S> {
    pub fn new(engine: RoundEngine, strategy: S) -> Self {
        Coordinator {
            engine,
            strategy,
            folding: None,
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
    pub fn handle_update(
        &mut self,
        now: Millis,
        meta: UpdateMeta,
        delta: &[f32],
    ) -> Result<Accepted, Reject> {
        let admitted = self.engine.check_update(now, &meta)?;
        if self.folding != Some(admitted.round) {
            if self.strategy.folded() > 0 {
                self.strategy.abort_round(); // left over from a failed round
            }
            self.folding = Some(admitted.round);
        }
        self.strategy
            .fold(delta, admitted.weight)
            .map_err(|e| Reject {
                reason: e.reason(),
                current_round: Some(admitted.round),
            })?;
        // Same `now`, no call in between: the engine answers exactly as `check_update` did.
        Ok(self
            .engine
            .handle_update(now, meta)
            .expect("admission is deterministic"))
    }

    /// Admission check only (see [`RoundEngine::check_update`]): call before reading a payload.
    pub fn check_update(&mut self, now: Millis, meta: &UpdateMeta) -> Result<Accepted, Reject> {
        self.engine.check_update(now, meta)
    }

    /// Refolds an update the engine already accepted into `round` (restart after a crash: the
    /// strategy was restored from the last round boundary and the round's accepted payloads are
    /// folded again; the exact fold makes the result bit-identical).
    pub fn resume_fold(
        &mut self,
        round: RoundId,
        delta: &[f32],
        weight: u64,
    ) -> Result<(), StrategyError> {
        if self.folding != Some(round) {
            if self.strategy.folded() > 0 {
                self.strategy.abort_round();
            }
            self.folding = Some(round);
        }
        self.strategy.fold(delta, weight)
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
    pub fn finalize(
        &mut self,
        now: Millis,
        round: RoundId,
        global: &[f32],
    ) -> Result<Vec<f32>, FinalizeError> {
        if self.engine.awaiting_model() != Some(round) || self.folding != Some(round) {
            return Err(FinalizeError::NotAwaiting(round));
        }
        match self.strategy.finalize(global) {
            Ok(model) => {
                self.folding = None;
                Ok(model)
            }
            Err(e) => {
                self.strategy.abort_round();
                self.folding = None;
                self.engine
                    .abort_round(now, round, e.to_string())
                    .expect("round is awaiting its model");
                Err(e.into())
            }
        }
    }

    /// The finalized model of `round` was published: open the next round.
    pub fn model_ready(
        &mut self,
        now: Millis,
        round: RoundId,
        version: ModelVersion,
        digest: Digest,
    ) -> Result<(), EngineError> {
        self.engine.model_ready(now, round, version, digest)
    }
}
