//! Aggregation strategies, in the spirit of Flower's `Strategy` and FedOpt-on-FedAvg: every
//! strategy is an **aggregation step** ([`Aggregation`]: weighted mean, clipped mean, median,
//! trimmed mean, Krum) that folds the round's deltas into one aggregate delta, followed by a
//! **server optimizer** ([`ServerOptimizer`]: plain `x + Δ`, or Adam, Yogi, Adagrad).
//! [`ServerStrategy`] composes the two; the arithmetic runs on a [`Backend`]: [`Exact`]
//! (fixed-point folds, `f64` math) here, burn tensors in the aggregator shell.
//!
//! A round, seen from a strategy: [`Strategy::configure`] says what clients should do,
//! [`Strategy::fold`] takes each accepted update (the delta `local − base`, flattened in the
//! canonical tensor order, and its weight — the clamped sample count), [`Strategy::finalize`]
//! turns the folded round into the next global model, [`Strategy::abort_round`] forgets a failed
//! round, and [`Strategy::evaluate`] optionally scores a model.
//!
//! * **Weighted means** ([`WeightedMean`], [`ClippedMean`]) fold into a [`PartialSum`]: memory
//!   O(model) whatever the number of clients, and the result is bit-identical for any arrival
//!   order (see [`fixed`]). They can also fold later on any backend
//!   ([`ServerStrategy::finalize_on`]).
//! * **Robust** steps ([`Median`], [`TrimmedMean`], [`Krum`]) need every update at once: they push
//!   updates into a bounded [`SpillStore`] and read them back in blocks of coordinates at
//!   finalize (see [`robust`]).
//!
//! **Adding a step or an optimizer:** a type implementing [`Aggregation`] plus one line in
//! `aggregation_steps!` below; an optimizer is a variant of [`ServerOptimizer`] with its rule
//! written against [`Backend`]. A [`StrategyConfig`] variant names the combination.
//!
//! **Architecture invariant:** strategies do no I/O and read no clock; all state is `serde`
//! serializable ([`ServerStrategy`] is the persisted form), so the shell can store it and resume.
//! The spill store is the only place a strategy's memory can grow with the number of clients, and
//! it is bounded and replaceable by a disk-backed implementation.

pub mod backend;
pub mod fixed;
pub mod mean;
pub mod optimizer;
pub mod robust;

use fedfleet_protocol::RoundId;
use serde::{Deserialize, Serialize};

pub use backend::{Backend, Exact};
pub use fixed::{FRAC_BITS, FoldError, PartialSum};
pub use mean::{AdaptiveClipping, ClippedMean, DpMean, WeightedMean, l2_norm};
pub use optimizer::{AdaptiveOptimizer, FedOptKind, FedOptParams, ServerOptimizer};
pub use robust::{Krum, Median, MemorySpill, SpillError, SpillStore, TrimmedMean};

use crate::reject::RejectReason;

/// What a round asks clients to do: the strategy's part of the announcement's
/// [`RoundConfig`](fedfleet_protocol::RoundConfig), with the same field names (see
/// [`ClientConfig::round_config`]). Persisted with postcard inside the engine snapshot and the
/// strategy: fields are positional, so do not reorder or add fields here (the local optimizer,
/// which is not the strategy's choice, is passed to `round_config`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClientConfig {
    /// Local epochs over the device's data.
    pub local_epochs: u32,
    /// Local mini-batch size.
    pub batch_size: u32,
    /// Client learning rate (FedOpt's `eta_l`).
    #[serde(alias = "lr")]
    pub learning_rate: f32,
    /// FedProx proximal term `mu` (0 = plain local SGD, i.e. FedAvg).
    #[serde(alias = "mu", alias = "fedprox_mu")]
    pub proximal_mu: f32,
}

impl ClientConfig {
    /// The announcement's round configuration: these settings plus the round's local
    /// `optimizer`, upload dtype, sample cap and seed.
    pub fn round_config(
        &self,
        optimizer: &str,
        quantization: fedfleet_protocol::DType,
        max_samples: Option<u64>,
        seed: u64,
    ) -> fedfleet_protocol::RoundConfig {
        fedfleet_protocol::RoundConfig {
            local_epochs: self.local_epochs,
            batch_size: self.batch_size,
            learning_rate: self.learning_rate,
            optimizer: optimizer.to_owned(),
            proximal_mu: self.proximal_mu,
            quantization,
            min_samples: 1,
            max_samples,
            seed,
            secure_aggregation: false,
            start_window_ms: 0,
            device_privacy: None,
        }
    }
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig { local_epochs: 1, batch_size: 32, learning_rate: 0.1, proximal_mu: 0.0 }
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
    TooFewUpdates { strategy: &'static str, need: usize, got: usize },
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

/// The first step of a strategy: the round's deltas folded into one aggregate delta.
pub trait Aggregation {
    /// Stable name, for logs.
    fn name(&self) -> &'static str;
    /// Number of model coordinates.
    fn dim(&self) -> usize;
    /// Folds one accepted update. Atomic: on error the round's state is unchanged.
    fn fold(&mut self, delta: &[f32], weight: u64) -> Result<(), StrategyError>;
    /// Updates folded into the current round.
    fn folded(&self) -> u64;
    /// The round's aggregate delta, clearing the round.
    fn aggregate(&mut self) -> Result<Vec<f64>, StrategyError>;
    /// Forgets the current round's updates.
    fn abort_round(&mut self);
    /// Weighted means can also be folded later on any [`Backend`] (the tensor path); the robust
    /// steps need every update at once and cannot.
    fn is_weighted_mean(&self) -> bool {
        false
    }
    /// The factor a delta is scaled by before it is weighted (clipping; 1 for a plain mean).
    fn mean_scale(&self, _delta: &[f32]) -> Result<f64, StrategyError> {
        Ok(1.0)
    }
    /// The streaming sum of the current round, where there is one (persist it; a relay forwards it).
    fn partial_sum(&self) -> Option<&PartialSum> {
        None
    }
    fn partial_sum_mut(&mut self) -> Option<&mut PartialSum> {
        None
    }
}

/// The persisted form of every aggregation step: one variant per step, dispatched in one place.
macro_rules! aggregation_steps {
    ($($variant:ident($ty:ty)),* $(,)?) => {
        /// Every aggregation step, as one serializable value (externally tagged, so
        /// non-self-describing formats such as postcard work).
        #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
        #[serde(rename_all = "snake_case")]
        pub enum AggregationStep {
            $($variant($ty)),*
        }

        impl AggregationStep {
            pub fn get(&self) -> &dyn Aggregation {
                match self {
                    $(AggregationStep::$variant(s) => s),*
                }
            }
            pub fn get_mut(&mut self) -> &mut dyn Aggregation {
                match self {
                    $(AggregationStep::$variant(s) => s),*
                }
            }
        }
    };
}

aggregation_steps! {
    WeightedMean(WeightedMean),
    ClippedMean(ClippedMean),
    DpMean(DpMean),
    Median(Median<MemorySpill>),
    TrimmedMean(TrimmedMean<MemorySpill>),
    Krum(Krum<MemorySpill>),
}

/// Which strategy to build, with its parameters (e.g. from the service's TOML config).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StrategyConfig {
    FedAvg {
        client: ClientConfig,
    },
    /// FedAvg on the server; clients add the proximal term `proximal_mu/2·‖w − w_global‖²`.
    FedProx {
        client: ClientConfig,
        proximal_mu: f32,
    },
    /// FedAvg with each delta clipped to L2 norm `clip_norm` before folding.
    ClippedFedAvg {
        client: ClientConfig,
        clip_norm: f64,
    },
    /// DP-FedAvg (client-level, central): deltas clipped to `clip_norm`, each device counted
    /// once, Gaussian noise of σ = `noise_multiplier · clip_norm` on the sum, divided by
    /// `expected_count` ([`DpMean`]). `noise_seed` is the campaign's secret noise key.
    DpFedAvg {
        client: ClientConfig,
        clip_norm: f64,
        noise_multiplier: f64,
        expected_count: u64,
        noise_seed: [u8; 32],
        /// `Some`: `clip_norm` is where the clipping norm starts ([`AdaptiveClipping`]).
        adaptive: Option<AdaptiveClipping>,
        /// The devices clip and add the noise (split across them under secure aggregation):
        /// the aggregator merges their masked sum as it is, adding no noise of its own.
        #[serde(default)]
        noise_on_devices: bool,
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

/// A strategy: the client configuration, an aggregation step and a server optimizer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServerStrategy {
    client: ClientConfig,
    aggregation: AggregationStep,
    optimizer: ServerOptimizer,
}

impl ServerStrategy {
    /// Composes a strategy from its two steps.
    pub fn compose(client: ClientConfig, aggregation: AggregationStep, optimizer: ServerOptimizer) -> Self {
        ServerStrategy { client, aggregation, optimizer }
    }

    /// Builds a strategy for a model of `dim` coordinates.
    pub fn new(config: &StrategyConfig, dim: usize) -> Result<Self, StrategyError> {
        use AggregationStep as A;
        let mean = || A::WeightedMean(WeightedMean::new(dim));
        let adaptive = |mut client: ClientConfig, kind, params: FedOptParams| -> Result<Self, StrategyError> {
            let opt = AdaptiveOptimizer::new(kind, params, dim)?;
            client.learning_rate = params.eta_l as f32;
            Ok(Self::compose(client, mean(), ServerOptimizer::Adaptive(opt)))
        };
        let plain = |client, aggregation| Self::compose(client, aggregation, ServerOptimizer::Plain);
        Ok(match config.clone() {
            StrategyConfig::FedAvg { client } => plain(client, mean()),
            StrategyConfig::FedProx { mut client, proximal_mu } => {
                if !(proximal_mu.is_finite() && proximal_mu >= 0.0) {
                    return Err(StrategyError::BadParameter(format!("FedProx proximal_mu must be >= 0, got {proximal_mu}")));
                }
                client.proximal_mu = proximal_mu;
                plain(client, mean())
            }
            StrategyConfig::ClippedFedAvg { client, clip_norm } => plain(client, A::ClippedMean(ClippedMean::new(dim, clip_norm)?)),
            StrategyConfig::DpFedAvg { client, clip_norm, noise_multiplier, expected_count, noise_seed, adaptive, noise_on_devices } => {
                let mut step = DpMean::new(dim, clip_norm, noise_multiplier, expected_count, noise_seed)?;
                if let Some(a) = adaptive {
                    step = step.with_adaptive_clipping(a)?;
                }
                if noise_on_devices {
                    step = step.with_noise_on_devices()?;
                }
                plain(client, A::DpMean(step))
            }
            StrategyConfig::FedAdam { client, params } => adaptive(client, FedOptKind::Adam, params)?,
            StrategyConfig::FedYogi { client, params } => adaptive(client, FedOptKind::Yogi, params)?,
            StrategyConfig::FedAdagrad { client, params } => adaptive(client, FedOptKind::Adagrad, params)?,
            StrategyConfig::Median { client, max_updates } => plain(client, A::Median(Median::new(MemorySpill::new(dim, max_updates)))),
            StrategyConfig::TrimmedMean { client, trim_fraction, max_updates } => {
                plain(client, A::TrimmedMean(TrimmedMean::new(trim_fraction, MemorySpill::new(dim, max_updates))?))
            }
            StrategyConfig::Krum { client, byzantine, select, max_updates } => {
                plain(client, A::Krum(Krum::new(byzantine, select, MemorySpill::new(dim, max_updates))?))
            }
        })
    }

    pub fn aggregation(&self) -> &AggregationStep {
        &self.aggregation
    }
    pub fn aggregation_mut(&mut self) -> &mut AggregationStep {
        &mut self.aggregation
    }
    pub fn optimizer(&self) -> &ServerOptimizer {
        &self.optimizer
    }

    /// Whether the shell may fold this strategy's updates itself on another backend: the
    /// weighted means. Robust steps need every update.
    pub fn is_mean_based(&self) -> bool {
        self.aggregation.get().is_weighted_mean()
    }

    /// The streaming partial sum of the current round, for strategies that have one (to persist
    /// it, or to forward it from a relay).
    pub fn partial_sum(&self) -> Option<&PartialSum> {
        self.aggregation.get().partial_sum()
    }

    /// Whether a partial sum can be merged (a relay's, or a securely aggregated round's): a
    /// plain weighted mean of the deltas, or DP-FedAvg whose devices clip and noise.
    pub fn takes_partial_sums(&self) -> bool {
        match &self.aggregation {
            AggregationStep::WeightedMean(_) => true,
            AggregationStep::DpMean(d) => d.noise_on_devices(),
            _ => false,
        }
    }

    /// Takes the round's partial sum out (a relay forwards it), leaving an empty one.
    pub fn take_partial_sum(&mut self) -> Option<PartialSum> {
        let sum = self.aggregation.get_mut().partial_sum_mut()?;
        let dim = sum.dim();
        Some(std::mem::replace(sum, PartialSum::new(dim)))
    }

    /// Merges a relay's partial sum into the current round: plain weighted means only (FedAvg,
    /// FedProx, the FedOpt family), since clipping and DP act on each update, which a partial sum
    /// has folded away.
    pub fn merge_partial(&mut self, partial: &PartialSum) -> Result<(), StrategyError> {
        let name = self.name();
        if !self.takes_partial_sums() {
            return Err(StrategyError::BadParameter(format!("{name} needs every update: it cannot merge partial sums")));
        }
        let sum = self
            .aggregation
            .get_mut()
            .partial_sum_mut()
            .ok_or_else(|| StrategyError::BadParameter(format!("{name} cannot merge partial sums")))?;
        Ok(sum.merge(partial)?)
    }

    fn check_global(&self, global: &[f32]) -> Result<(), StrategyError> {
        let expected = self.aggregation.get().dim();
        if global.len() != expected {
            return Err(StrategyError::GlobalShape { expected, got: global.len() });
        }
        Ok(())
    }

    /// The round's model from `updates` folded on backend `b` in the order given (pass a
    /// canonical order for a reproducible result), then the server optimizer on `b`. For weighted
    /// means only; the streaming sum is not used (the shell deferred every fold to here).
    pub fn finalize_on<B: Backend>(
        &mut self,
        b: &B,
        global: &[f32],
        updates: impl IntoIterator<Item = Result<(Vec<f32>, u64), String>>,
    ) -> Result<Vec<f32>, StrategyError> {
        if !self.is_mean_based() {
            return Err(StrategyError::BadParameter(format!("{} has no deferred fold", self.name())));
        }
        self.check_global(global)?;
        let mut sum = b.new_sum(global.len());
        for update in updates {
            let (delta, weight) = update.map_err(StrategyError::Compute)?;
            let scale = self.aggregation.get().mean_scale(&delta)?;
            b.fold(&mut sum, &delta, weight, scale)?;
        }
        let delta = b.mean(&sum)?;
        // Nothing was folded into the step itself; this resets its per-round counters.
        self.aggregation.get_mut().abort_round();
        self.optimizer.step(b, global, &delta)
    }
}

impl Strategy for ServerStrategy {
    fn name(&self) -> &'static str {
        match (&self.optimizer, &self.aggregation) {
            (ServerOptimizer::Adaptive(opt), _) => opt.name(),
            (ServerOptimizer::Plain, AggregationStep::WeightedMean(_)) if self.client.proximal_mu > 0.0 => "fedprox",
            (ServerOptimizer::Plain, AggregationStep::WeightedMean(_)) => "fedavg",
            (ServerOptimizer::Plain, AggregationStep::ClippedMean(_)) => "clipped_fedavg",
            (ServerOptimizer::Plain, AggregationStep::DpMean(_)) => "dp_fedavg",
            (ServerOptimizer::Plain, step) => step.get().name(),
        }
    }
    fn dim(&self) -> usize {
        self.aggregation.get().dim()
    }
    fn configure(&self, _round: RoundId) -> ClientConfig {
        self.client.clone()
    }
    fn fold(&mut self, delta: &[f32], weight: u64) -> Result<(), StrategyError> {
        self.aggregation.get_mut().fold(delta, weight)
    }
    fn folded(&self) -> u64 {
        self.aggregation.get().folded()
    }
    fn finalize(&mut self, global: &[f32]) -> Result<Vec<f32>, StrategyError> {
        self.check_global(global)?;
        let delta = self.aggregation.get_mut().aggregate()?;
        self.optimizer.step(&Exact, global, &delta)
    }
    fn abort_round(&mut self) {
        self.aggregation.get_mut().abort_round()
    }
}
