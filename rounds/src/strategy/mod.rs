//! Aggregation strategies behind one trait, in the spirit of Flower's `Strategy`.
//!
//! A round, seen from a strategy: [`Strategy::configure`] says what clients should do,
//! [`Strategy::fold`] takes each accepted update (the delta `local − base`, flattened in the
//! canonical tensor order, and its weight — the clamped sample count), [`Strategy::finalize`]
//! turns the folded round into the next global model, [`Strategy::abort_round`] forgets a failed
//! round, and [`Strategy::evaluate`] optionally scores a model.
//!
//! * **Streaming** ([`FedAvg`], FedProx, [`ClippedFedAvg`], [`FedOpt`] = FedAdam / FedYogi /
//!   FedAdagrad) fold into a [`PartialSum`]: memory O(model) whatever the number of clients, and
//!   the result is bit-identical for any arrival order (see [`fixed`]).
//! * **Robust** ([`Median`], [`TrimmedMean`], [`Krum`]) need every update at once: they push
//!   updates into a bounded [`SpillStore`] and read them back in blocks of coordinates at
//!   finalize (see [`robust`]).
//!
//! **Architecture invariant:** strategies do no I/O and read no clock; all state is `serde`
//! serializable ([`ServerStrategy`] is the persisted form), so the shell can store it and resume.
//! The spill store is the only place a strategy's memory can grow with the number of clients, and
//! it is bounded and replaceable by a disk-backed implementation.

pub mod fedavg;
pub mod fedopt;
pub mod fixed;
pub mod robust;

use fedfleet_protocol::RoundId;
use serde::{Deserialize, Serialize};

pub use fedavg::{ClippedFedAvg, FedAvg};
pub use fedopt::{FedOpt, FedOptKind, FedOptParams, FedOptState};
pub use fixed::{FoldError, PartialSum};
pub use robust::{Krum, Median, MemorySpill, SpillError, SpillStore, TrimmedMean};

use crate::reject::RejectReason;

/// What a round asks clients to do (sent in the round announcement).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClientConfig {
    /// Local epochs over the device's data.
    pub local_epochs: u32,
    /// Local mini-batch size.
    pub batch_size: u32,
    /// Client learning rate (FedOpt's `eta_l`).
    pub lr: f32,
    /// FedProx proximal term `mu` (0 = plain local SGD, i.e. FedAvg).
    pub proximal_mu: f32,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            local_epochs: 1,
            batch_size: 32,
            lr: 0.1,
            proximal_mu: 0.0,
        }
    }
}

/// Scores of a model, from [`Strategy::evaluate`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Evaluation {
    pub loss: f64,
    pub metrics: Vec<(String, f64)>,
}

/// Why a strategy refused an update or could not finish a round.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StrategyError {
    #[error(transparent)]
    Fold(#[from] FoldError),
    #[error(transparent)]
    Spill(#[from] SpillError),
    #[error("{strategy} needs at least {need} updates, got {got}")]
    TooFewUpdates {
        strategy: &'static str,
        need: usize,
        got: usize,
    },
    #[error("global model has {got} elements, the strategy was built for {expected}")]
    GlobalShape { expected: usize, got: usize },
    #[error("invalid strategy parameter: {0}")]
    BadParameter(String),
    /// The finalized model holds a NaN or an infinity (first at `index`); it is not published.
    #[error("the aggregated model is not finite (element {index} is {value})")]
    NonFiniteModel { index: usize, value: f32 },
    /// The shell's fold (tensor path) failed: a stored update unreadable, a device error.
    #[error("compute: {0}")]
    Compute(String),
}

impl StrategyError {
    /// The named reason to answer the device with, when this came from folding its update.
    pub fn reason(&self) -> RejectReason {
        match self {
            StrategyError::Fold(FoldError::ShapeMismatch { .. }) => RejectReason::ShapeMismatch,
            StrategyError::Spill(SpillError::ShapeMismatch { .. }) => RejectReason::ShapeMismatch,
            StrategyError::Fold(FoldError::NonFinite { .. }) => RejectReason::NonFinite,
            StrategyError::Spill(SpillError::NonFinite { .. }) => RejectReason::NonFinite,
            StrategyError::Fold(FoldError::OutOfRange { .. }) => RejectReason::TooLarge,
            StrategyError::Fold(FoldError::BadWeight(_)) => RejectReason::BadSampleCount,
            StrategyError::Fold(FoldError::TooManyFolds) => RejectReason::Overloaded,
            StrategyError::Spill(SpillError::Full { .. }) => RejectReason::Overloaded,
            _ => RejectReason::Internal,
        }
    }
}

/// One aggregation strategy.
pub trait Strategy {
    /// Stable name, for logs and metrics.
    fn name(&self) -> &'static str;
    /// Number of model coordinates this strategy aggregates.
    fn dim(&self) -> usize;
    /// The client configuration for `round`.
    fn configure(&self, round: RoundId) -> ClientConfig;
    /// Folds one accepted update. Atomic: on error the round's state is unchanged, so the shell
    /// can reject the update with [`StrategyError::reason`] and go on.
    fn fold(&mut self, delta: &[f32], weight: u64) -> Result<(), StrategyError>;
    /// Number of updates folded into the current round.
    fn folded(&self) -> u64;
    /// Ends the round: returns the new global model computed from `global` (the round's base) and
    /// the folded updates, updates any server optimizer state, and clears the round.
    fn finalize(&mut self, global: &[f32]) -> Result<Vec<f32>, StrategyError>;
    /// Forgets the current round's updates (a failed round); server optimizer state is kept.
    fn abort_round(&mut self);
    /// Optional server-side evaluation of a model.
    fn evaluate(&self, _round: RoundId, _global: &[f32]) -> Option<Evaluation> {
        None
    }
}

/// Which strategy to build, with its parameters (e.g. from the service's TOML config).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StrategyConfig {
    FedAvg {
        client: ClientConfig,
    },
    /// FedAvg on the server; clients add the proximal term `mu/2·‖w − w_global‖²`.
    FedProx {
        client: ClientConfig,
        mu: f32,
    },
    /// FedAvg with each delta clipped to L2 norm `clip_norm` before folding.
    ClippedFedAvg {
        client: ClientConfig,
        clip_norm: f64,
    },
    FedAdam {
        client: ClientConfig,
        params: FedOptParams,
    },
    FedYogi {
        client: ClientConfig,
        params: FedOptParams,
    },
    FedAdagrad {
        client: ClientConfig,
        params: FedOptParams,
    },
    /// Coordinate-wise median, spilled in memory up to `max_updates`.
    Median {
        client: ClientConfig,
        max_updates: usize,
    },
    /// Coordinate-wise trimmed mean dropping `trim_fraction` of the values at each end.
    TrimmedMean {
        client: ClientConfig,
        trim_fraction: f64,
        max_updates: usize,
    },
    /// (Multi-)Krum tolerating `byzantine` bad updates, averaging the `select` best.
    Krum {
        client: ClientConfig,
        byzantine: usize,
        select: usize,
        max_updates: usize,
    },
}

/// Every built-in strategy, as one serializable value: the form the shell persists (externally
/// tagged, so non-self-describing formats such as postcard work).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ServerStrategy {
    FedAvg(FedAvg),
    ClippedFedAvg(ClippedFedAvg),
    FedOpt(FedOpt),
    Median(Median<MemorySpill>),
    TrimmedMean(TrimmedMean<MemorySpill>),
    Krum(Krum<MemorySpill>),
}

impl ServerStrategy {
    /// Builds a strategy for a model of `dim` coordinates.
    pub fn new(config: &StrategyConfig, dim: usize) -> Result<Self, StrategyError> {
        Ok(match config.clone() {
            StrategyConfig::FedAvg { client } => ServerStrategy::FedAvg(FedAvg::new(dim, client)),
            StrategyConfig::FedProx { client, mu } => {
                ServerStrategy::FedAvg(FedAvg::fedprox(dim, client, mu)?)
            }
            StrategyConfig::ClippedFedAvg { client, clip_norm } => {
                ServerStrategy::ClippedFedAvg(ClippedFedAvg::new(dim, client, clip_norm)?)
            }
            StrategyConfig::FedAdam { client, params } => {
                ServerStrategy::FedOpt(FedOpt::new(FedOptKind::Adam, dim, client, params)?)
            }
            StrategyConfig::FedYogi { client, params } => {
                ServerStrategy::FedOpt(FedOpt::new(FedOptKind::Yogi, dim, client, params)?)
            }
            StrategyConfig::FedAdagrad { client, params } => {
                ServerStrategy::FedOpt(FedOpt::new(FedOptKind::Adagrad, dim, client, params)?)
            }
            StrategyConfig::Median {
                client,
                max_updates,
            } => ServerStrategy::Median(Median::new(client, MemorySpill::new(dim, max_updates))),
            StrategyConfig::TrimmedMean {
                client,
                trim_fraction,
                max_updates,
            } => ServerStrategy::TrimmedMean(TrimmedMean::new(
                client,
                trim_fraction,
                MemorySpill::new(dim, max_updates),
            )?),
            StrategyConfig::Krum {
                client,
                byzantine,
                select,
                max_updates,
            } => ServerStrategy::Krum(Krum::new(
                client,
                byzantine,
                select,
                MemorySpill::new(dim, max_updates),
            )?),
        })
    }

    fn inner(&self) -> &dyn Strategy {
        match self {
            ServerStrategy::FedAvg(s) => s,
            ServerStrategy::ClippedFedAvg(s) => s,
            ServerStrategy::FedOpt(s) => s,
            ServerStrategy::Median(s) => s,
            ServerStrategy::TrimmedMean(s) => s,
            ServerStrategy::Krum(s) => s,
        }
    }

    fn inner_mut(&mut self) -> &mut dyn Strategy {
        match self {
            ServerStrategy::FedAvg(s) => s,
            ServerStrategy::ClippedFedAvg(s) => s,
            ServerStrategy::FedOpt(s) => s,
            ServerStrategy::Median(s) => s,
            ServerStrategy::TrimmedMean(s) => s,
            ServerStrategy::Krum(s) => s,
        }
    }

    /// The streaming partial sum of the current round, for strategies that have one (to persist
    /// it, or to forward it from a relay).
    /// Whether the shell may fold this strategy's updates itself (a weighted mean, optionally
    /// clipped, then the server step): the FedAvg family. Robust strategies need every update.
    pub fn is_mean_based(&self) -> bool {
        matches!(self, ServerStrategy::FedAvg(_) | ServerStrategy::ClippedFedAvg(_) | ServerStrategy::FedOpt(_))
    }

    pub fn partial_sum(&self) -> Option<&PartialSum> {
        match self {
            ServerStrategy::FedAvg(s) => Some(s.partial_sum()),
            ServerStrategy::ClippedFedAvg(s) => Some(s.partial_sum()),
            ServerStrategy::FedOpt(s) => Some(s.partial_sum()),
            _ => None,
        }
    }

    /// Merges a relay's partial sum into the current round (streaming strategies only).
    pub fn merge_partial(&mut self, partial: &PartialSum) -> Result<(), StrategyError> {
        let sum = match self {
            ServerStrategy::FedAvg(s) => s.partial_sum_mut(),
            ServerStrategy::ClippedFedAvg(s) => s.partial_sum_mut(),
            ServerStrategy::FedOpt(s) => s.partial_sum_mut(),
            _ => {
                return Err(StrategyError::BadParameter(format!(
                    "{} cannot merge partial sums",
                    self.name()
                )));
            }
        };
        Ok(sum.merge(partial)?)
    }
}

impl Strategy for ServerStrategy {
    fn name(&self) -> &'static str {
        self.inner().name()
    }
    fn dim(&self) -> usize {
        self.inner().dim()
    }
    fn configure(&self, round: RoundId) -> ClientConfig {
        self.inner().configure(round)
    }
    fn fold(&mut self, delta: &[f32], weight: u64) -> Result<(), StrategyError> {
        self.inner_mut().fold(delta, weight)
    }
    fn folded(&self) -> u64 {
        self.inner().folded()
    }
    fn finalize(&mut self, global: &[f32]) -> Result<Vec<f32>, StrategyError> {
        self.inner_mut().finalize(global)
    }
    fn abort_round(&mut self) {
        self.inner_mut().abort_round()
    }
    fn evaluate(&self, round: RoundId, global: &[f32]) -> Option<Evaluation> {
        self.inner().evaluate(round, global)
    }
}

/// `global + mean` rounded to `f32`, checking the shape.
pub(crate) fn apply_delta(global: &[f32], mean: &[f64]) -> Result<Vec<f32>, StrategyError> {
    if global.len() != mean.len() {
        return Err(StrategyError::GlobalShape {
            expected: mean.len(),
            got: global.len(),
        });
    }
    Ok(global
        .iter()
        .zip(mean)
        .map(|(&g, &m)| (g as f64 + m) as f32)
        .collect())
}
