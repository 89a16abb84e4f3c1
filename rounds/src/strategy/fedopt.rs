//! Adaptive server optimizers: FedAdam, FedYogi, FedAdagrad (Reddi et al., "Adaptive Federated
//! Optimization", ICLR 2021, Algorithm 2), following Flower's `FedAdam`/`FedYogi`/`FedAdagrad`.
//!
//! Each round, with `Δ = Σ wᵢΔᵢ / Σ wᵢ` (the FedAvg pseudo-gradient, folded exactly as in
//! [`FedAvg`](super::FedAvg)) and element-wise operations:
//!
//! ```text
//! m ← β₁·m + (1 − β₁)·Δ
//! Adam:    v ← β₂·v + (1 − β₂)·Δ²
//! Yogi:    v ← v − (1 − β₂)·Δ²·sign(v − Δ²)
//! Adagrad: v ← v + Δ²
//! x ← x + η·m / (√v + τ)
//! ```
//!
//! `m` and `v` start at zero (as in Flower; the paper allows `v₋₁ ≥ τ²`). With
//! `bias_correction` (off by default, as in the paper) Adam's step uses
//! `η·√(1 − β₂ᵗ)/(1 − β₁ᵗ)`, `t` counting finalized rounds from 1. Per element the arithmetic is
//! `f64`; `m`, `v` are stored as `f32` like Flower's float32 arrays. `m`, `v` and `t` are the
//! server optimizer state: serializable, kept across rounds and across failed rounds.

use fedfleet_protocol::RoundId;
use serde::{Deserialize, Serialize};

use super::fixed::PartialSum;
use super::{ClientConfig, Strategy, StrategyError};

/// Which adaptive optimizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FedOptKind {
    Adam,
    Yogi,
    Adagrad,
}

/// Hyperparameters, named as in the paper and in Flower.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct FedOptParams {
    /// Server learning rate η.
    pub eta: f64,
    /// Client learning rate η_l (sent to clients as `ClientConfig::lr`).
    pub eta_l: f64,
    /// First-moment decay β₁ (Flower's FedAdagrad uses 0).
    pub beta_1: f64,
    /// Second-moment decay β₂ (unused by Adagrad).
    pub beta_2: f64,
    /// Adaptivity τ.
    pub tau: f64,
    /// Adam only: scale the step by `√(1 − β₂ᵗ)/(1 − β₁ᵗ)`.
    #[serde(default)]
    pub bias_correction: bool,
}

impl FedOptParams {
    /// Flower's FedAdam defaults: η = 0.1, η_l = 0.1, β₁ = 0.9, β₂ = 0.99, τ = 1e-9.
    pub fn adam() -> Self {
        FedOptParams {
            eta: 0.1,
            eta_l: 0.1,
            beta_1: 0.9,
            beta_2: 0.99,
            tau: 1e-9,
            bias_correction: false,
        }
    }
    /// Flower's FedYogi defaults: η = 0.01, η_l = 0.0316, β₁ = 0.9, β₂ = 0.99, τ = 1e-3.
    pub fn yogi() -> Self {
        FedOptParams {
            eta: 1e-2,
            eta_l: 0.0316,
            beta_1: 0.9,
            beta_2: 0.99,
            tau: 1e-3,
            bias_correction: false,
        }
    }
    /// Flower's FedAdagrad defaults: η = 0.1, η_l = 0.1, β₁ = 0, τ = 1e-9.
    pub fn adagrad() -> Self {
        FedOptParams {
            eta: 0.1,
            eta_l: 0.1,
            beta_1: 0.0,
            beta_2: 0.0,
            tau: 1e-9,
            bias_correction: false,
        }
    }
    fn validate(&self) -> Result<(), StrategyError> {
        let ok = self.eta.is_finite()
            && self.eta > 0.0
            && self.eta_l.is_finite()
            && self.eta_l > 0.0
            && (0.0..1.0).contains(&self.beta_1)
            && (0.0..1.0).contains(&self.beta_2)
            && self.tau.is_finite()
            && self.tau > 0.0;
        if ok {
            Ok(())
        } else {
            Err(StrategyError::BadParameter(format!(
                "FedOpt parameters out of range: {self:?}"
            )))
        }
    }
}

/// A FedOpt server: FedAvg pseudo-gradient plus an adaptive server step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FedOpt {
    kind: FedOptKind,
    params: FedOptParams,
    client: ClientConfig,
    sum: PartialSum,
    /// First moment.
    m: Vec<f32>,
    /// Second moment.
    v: Vec<f32>,
    /// Finalized rounds so far.
    t: u64,
}

/// The server optimizer state, for a step computed outside the strategy (the tensor path).
#[derive(Debug, Clone, PartialEq)]
pub struct FedOptState {
    pub kind: FedOptKind,
    pub params: FedOptParams,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
    pub t: u64,
}

impl FedOpt {
    pub fn state(&self) -> FedOptState {
        FedOptState { kind: self.kind, params: self.params, m: self.m.clone(), v: self.v.clone(), t: self.t }
    }

    /// Installs the state after a step computed elsewhere; the round's fold is consumed.
    pub fn set_state(&mut self, state: FedOptState) -> Result<(), StrategyError> {
        let dim = self.sum.dim();
        for got in [state.m.len(), state.v.len()] {
            if got != dim {
                return Err(StrategyError::GlobalShape { expected: dim, got });
            }
        }
        if (state.kind, state.params) != (self.kind, self.params) {
            return Err(StrategyError::BadParameter("optimizer state of another kind".into()));
        }
        (self.m, self.v, self.t) = (state.m, state.v, state.t);
        self.sum.clear();
        Ok(())
    }

    pub fn new(
        kind: FedOptKind,
        dim: usize,
        mut client: ClientConfig,
        params: FedOptParams,
    ) -> Result<Self, StrategyError> {
        params.validate()?;
        client.lr = params.eta_l as f32;
        Ok(FedOpt {
            kind,
            params,
            client,
            sum: PartialSum::new(dim),
            m: vec![0.0; dim],
            v: vec![0.0; dim],
            t: 0,
        })
    }
    pub fn kind(&self) -> FedOptKind {
        self.kind
    }
    pub fn params(&self) -> &FedOptParams {
        &self.params
    }
    /// First moment `m`.
    pub fn m(&self) -> &[f32] {
        &self.m
    }
    /// Second moment `v`.
    pub fn v(&self) -> &[f32] {
        &self.v
    }
    /// Server steps taken.
    pub fn t(&self) -> u64 {
        self.t
    }
    pub fn partial_sum(&self) -> &PartialSum {
        &self.sum
    }
    pub fn partial_sum_mut(&mut self) -> &mut PartialSum {
        &mut self.sum
    }
}

impl Strategy for FedOpt {
    fn name(&self) -> &'static str {
        match self.kind {
            FedOptKind::Adam => "fedadam",
            FedOptKind::Yogi => "fedyogi",
            FedOptKind::Adagrad => "fedadagrad",
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
        if global.len() != self.sum.dim() {
            return Err(StrategyError::GlobalShape {
                expected: self.sum.dim(),
                got: global.len(),
            });
        }
        let delta = self.sum.mean()?;
        let p = self.params;
        let t = self.t + 1;
        let eta = match (self.kind, p.bias_correction) {
            (FedOptKind::Adam, true) => {
                p.eta * (1.0 - p.beta_2.powi(t.min(i32::MAX as u64) as i32)).sqrt()
                    / (1.0 - p.beta_1.powi(t.min(i32::MAX as u64) as i32))
            }
            _ => p.eta,
        };
        let mut out = Vec::with_capacity(global.len());
        for i in 0..global.len() {
            let d = delta[i];
            let m = p.beta_1 * self.m[i] as f64 + (1.0 - p.beta_1) * d;
            let v_prev = self.v[i] as f64;
            let d2 = d * d;
            let v = match self.kind {
                FedOptKind::Adam => p.beta_2 * v_prev + (1.0 - p.beta_2) * d2,
                FedOptKind::Yogi => v_prev - (1.0 - p.beta_2) * d2 * sign(v_prev - d2),
                FedOptKind::Adagrad => v_prev + d2,
            };
            self.m[i] = m as f32;
            self.v[i] = v as f32;
            out.push((global[i] as f64 + eta * m / (v.sqrt() + p.tau)) as f32);
        }
        self.t = t;
        self.sum.clear();
        Ok(out)
    }
    fn abort_round(&mut self) {
        self.sum.clear();
    }
}

/// numpy's `sign`: -1, 0 or 1.
fn sign(x: f64) -> f64 {
    if x > 0.0 {
        1.0
    } else if x < 0.0 {
        -1.0
    } else {
        0.0
    }
}
