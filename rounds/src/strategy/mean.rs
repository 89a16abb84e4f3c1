//! Weighted means: the aggregation step of FedAvg (McMahan et al. 2017), FedProx's server side
//! (Li et al. 2020), the FedOpt family, and the norm-clipped mean of DP-FedAvg.
//!
//! Aggregate = `Σ wᵢΔᵢ / Σ wᵢ` with `wᵢ` the (clamped) sample count of update `i` and
//! `Δᵢ = localᵢ − base`: the same model Flower's FedAvg computes from the clients' weights.

use serde::{Deserialize, Serialize};

use super::fixed::{FoldError, PartialSum};
use super::{Aggregation, StrategyError};

/// The weighted mean over a streaming, exact [`PartialSum`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WeightedMean {
    sum: PartialSum,
}

impl WeightedMean {
    pub fn new(dim: usize) -> Self {
        WeightedMean { sum: PartialSum::new(dim) }
    }
}

impl Aggregation for WeightedMean {
    fn name(&self) -> &'static str {
        "weighted_mean"
    }
    fn dim(&self) -> usize {
        self.sum.dim()
    }
    fn fold(&mut self, delta: &[f32], weight: u64) -> Result<(), StrategyError> {
        Ok(self.sum.fold(delta, weight)?)
    }
    fn folded(&self) -> u64 {
        self.sum.count()
    }
    fn aggregate(&mut self) -> Result<Vec<f64>, StrategyError> {
        let mean = self.sum.mean()?;
        self.sum.clear();
        Ok(mean)
    }
    fn abort_round(&mut self) {
        self.sum.clear();
    }
    fn is_weighted_mean(&self) -> bool {
        true
    }
    fn partial_sum(&self) -> Option<&PartialSum> {
        Some(&self.sum)
    }
    fn partial_sum_mut(&mut self) -> Option<&mut PartialSum> {
        Some(&mut self.sum)
    }
}

/// The weighted mean of deltas each scaled to L2 norm at most `clip_norm` (the clipping step of
/// DP-FedAvg, without noise). The mean of clipped deltas has norm `<= clip_norm` too.
///
/// The norm needs the whole delta, so this step cannot fold while a payload streams in: the
/// shell must hold the complete, verified delta before folding it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClippedMean {
    clip_norm: f64,
    sum: PartialSum,
    clipped: u64,
}

impl ClippedMean {
    pub fn new(dim: usize, clip_norm: f64) -> Result<Self, StrategyError> {
        if !(clip_norm.is_finite() && clip_norm > 0.0) {
            return Err(StrategyError::BadParameter(format!("clip_norm must be > 0, got {clip_norm}")));
        }
        Ok(ClippedMean { clip_norm, sum: PartialSum::new(dim), clipped: 0 })
    }
    pub fn clip_norm(&self) -> f64 {
        self.clip_norm
    }
    /// The factor (≤ 1) that brings `delta` to L2 norm at most `clip_norm`.
    pub fn clip_scale(&self, delta: &[f32]) -> Result<f64, StrategyError> {
        let norm = l2_norm(delta);
        if !norm.is_finite() {
            // NaN/inf somewhere (or an overflowing norm): name the element.
            let index = delta.iter().position(|x| !x.is_finite()).unwrap_or(0);
            return Err(FoldError::NonFinite { index }.into());
        }
        // Round the scale down a hair so rounding can never push the norm above the bound.
        Ok(if norm > self.clip_norm { self.clip_norm / norm * (1.0 - 1e-12) } else { 1.0 })
    }
    /// Updates of the current round whose norm was above the bound.
    pub fn clipped_this_round(&self) -> u64 {
        self.clipped
    }
}

/// L2 norm of `v`, summed in `f64` in index order (deterministic for a given vector).
pub fn l2_norm(v: &[f32]) -> f64 {
    let mut acc = [0f64; 4];
    let mut chunks = v.chunks_exact(4);
    for c in &mut chunks {
        for k in 0..4 {
            acc[k] += c[k] as f64 * c[k] as f64;
        }
    }
    let mut s = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    for &x in chunks.remainder() {
        s += x as f64 * x as f64;
    }
    s.sqrt()
}

impl Aggregation for ClippedMean {
    fn name(&self) -> &'static str {
        "clipped_mean"
    }
    fn dim(&self) -> usize {
        self.sum.dim()
    }
    fn fold(&mut self, delta: &[f32], weight: u64) -> Result<(), StrategyError> {
        if delta.len() != self.sum.dim() {
            return Err(FoldError::ShapeMismatch { expected: self.sum.dim(), got: delta.len() }.into());
        }
        let scale = self.clip_scale(delta)?;
        self.sum.fold_scaled(delta, weight, scale)?;
        if scale < 1.0 {
            self.clipped += 1;
        }
        Ok(())
    }
    fn folded(&self) -> u64 {
        self.sum.count()
    }
    fn aggregate(&mut self) -> Result<Vec<f64>, StrategyError> {
        let mean = self.sum.mean()?;
        self.abort_round();
        Ok(mean)
    }
    fn abort_round(&mut self) {
        self.sum.clear();
        self.clipped = 0;
    }
    fn is_weighted_mean(&self) -> bool {
        true
    }
    fn mean_scale(&self, delta: &[f32]) -> Result<f64, StrategyError> {
        self.clip_scale(delta)
    }
    fn partial_sum(&self) -> Option<&PartialSum> {
        Some(&self.sum)
    }
    fn partial_sum_mut(&mut self) -> Option<&mut PartialSum> {
        Some(&mut self.sum)
    }
}
