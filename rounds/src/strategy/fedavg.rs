//! FedAvg (McMahan et al. 2017), FedProx's server side (Li et al. 2020) and norm-clipped FedAvg.
//!
//! New global = base + `Σ wᵢΔᵢ / Σ wᵢ` with `wᵢ` the (clamped) sample count of update `i` and
//! `Δᵢ = localᵢ − base`: the same model Flower's FedAvg computes from the clients' weights.

use fedfleet_protocol::RoundId;
use serde::{Deserialize, Serialize};

use super::fixed::{FoldError, PartialSum};
use super::{ClientConfig, Strategy, StrategyError, apply_delta};

/// Weighted federated averaging over a streaming [`PartialSum`]. FedProx is this strategy with a
/// non-zero `proximal_mu` in the client configuration: the proximal term acts on the clients.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FedAvg {
    client: ClientConfig,
    sum: PartialSum,
}

impl FedAvg {
    pub fn new(dim: usize, client: ClientConfig) -> Self {
        FedAvg {
            client,
            sum: PartialSum::new(dim),
        }
    }

    /// FedProx: FedAvg on the server, proximal term `mu` on the clients.
    pub fn fedprox(dim: usize, mut client: ClientConfig, mu: f32) -> Result<Self, StrategyError> {
        if !(mu.is_finite() && mu >= 0.0) {
            return Err(StrategyError::BadParameter(format!(
                "FedProx mu must be >= 0, got {mu}"
            )));
        }
        client.proximal_mu = mu;
        Ok(Self::new(dim, client))
    }

    /// The current round's partial sum (persist it; forward it from a relay).
    pub fn partial_sum(&self) -> &PartialSum {
        &self.sum
    }
    /// Mutable access, to merge relay partial sums.
    pub fn partial_sum_mut(&mut self) -> &mut PartialSum {
        &mut self.sum
    }
    /// Takes the round's partial sum out (a relay forwards it), leaving an empty one.
    pub fn take_partial_sum(&mut self) -> PartialSum {
        let dim = self.sum.dim();
        std::mem::replace(&mut self.sum, PartialSum::new(dim))
    }
}

impl Strategy for FedAvg {
    fn name(&self) -> &'static str {
        if self.client.proximal_mu > 0.0 {
            "fedprox"
        } else {
            "fedavg"
        }
    }
    fn dim(&self) -> usize {
        self.sum.dim()
    }
    fn configure(&self, _round: RoundId) -> ClientConfig {
        self.client.clone()
    }
    fn fold(&mut self, delta: &[f32], weight: u64) -> Result<(), StrategyError> {
        Ok(self.sum.fold(delta, weight)?)
    }
    fn folded(&self) -> u64 {
        self.sum.count()
    }
    fn finalize(&mut self, global: &[f32]) -> Result<Vec<f32>, StrategyError> {
        let out = apply_delta(global, &self.sum.mean()?)?;
        self.sum.clear();
        Ok(out)
    }
    fn abort_round(&mut self) {
        self.sum.clear();
    }
}

/// FedAvg with each delta scaled to L2 norm at most `clip_norm` before folding (the clipping
/// step of DP-FedAvg, without noise). The mean of clipped deltas has norm `<= clip_norm` too.
///
/// The norm needs the whole delta, so this strategy cannot fold while a payload streams in: the
/// shell must hold the complete, verified delta before calling [`Strategy::fold`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClippedFedAvg {
    client: ClientConfig,
    clip_norm: f64,
    sum: PartialSum,
    clipped: u64,
}

impl ClippedFedAvg {
    pub fn new(dim: usize, client: ClientConfig, clip_norm: f64) -> Result<Self, StrategyError> {
        if !(clip_norm.is_finite() && clip_norm > 0.0) {
            return Err(StrategyError::BadParameter(format!(
                "clip_norm must be > 0, got {clip_norm}"
            )));
        }
        Ok(ClippedFedAvg {
            client,
            clip_norm,
            sum: PartialSum::new(dim),
            clipped: 0,
        })
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
        Ok(if norm > self.clip_norm {
            self.clip_norm / norm * (1.0 - 1e-12)
        } else {
            1.0
        })
    }
    /// Updates of the current round whose norm was above the bound.
    pub fn clipped_this_round(&self) -> u64 {
        self.clipped
    }
    pub fn partial_sum(&self) -> &PartialSum {
        &self.sum
    }
    pub fn partial_sum_mut(&mut self) -> &mut PartialSum {
        &mut self.sum
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

impl Strategy for ClippedFedAvg {
    fn name(&self) -> &'static str {
        "clipped_fedavg"
    }
    fn dim(&self) -> usize {
        self.sum.dim()
    }
    fn configure(&self, _round: RoundId) -> ClientConfig {
        self.client.clone()
    }
    fn fold(&mut self, delta: &[f32], weight: u64) -> Result<(), StrategyError> {
        if delta.len() != self.sum.dim() {
            return Err(FoldError::ShapeMismatch {
                expected: self.sum.dim(),
                got: delta.len(),
            }
            .into());
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
    fn finalize(&mut self, global: &[f32]) -> Result<Vec<f32>, StrategyError> {
        let out = apply_delta(global, &self.sum.mean()?)?;
        self.sum.clear();
        self.clipped = 0;
        Ok(out)
    }
    fn abort_round(&mut self) {
        self.sum.clear();
        self.clipped = 0;
    }
}
