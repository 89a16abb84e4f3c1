//! The server optimizer: the second step of every strategy, applied to the round's aggregate
//! delta `Δ`. [`ServerOptimizer::Plain`] is `x ← x + Δ` (FedAvg and the robust means); the
//! adaptive ones are FedAdam, FedYogi, FedAdagrad (Reddi et al., "Adaptive Federated
//! Optimization", ICLR 2021, Algorithm 2), following Flower's `FedAdam`/`FedYogi`/`FedAdagrad`,
//! with element-wise operations:
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
//! `f64` on the exact backend (`f32` on tensors); `m`, `v` are stored as `f32` like Flower's
//! float32 arrays. `m`, `v` and `t` are the server optimizer state: serializable, kept across
//! rounds and across failed rounds. The rule is written once, against [`Backend`].

use serde::{Deserialize, Serialize};

use super::StrategyError;
use super::backend::Backend;

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
    /// Client learning rate η_l (sent to clients as `ClientConfig::learning_rate`).
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
        FedOptParams { eta: 0.1, eta_l: 0.1, beta_1: 0.9, beta_2: 0.99, tau: 1e-9, bias_correction: false }
    }
    /// Flower's FedYogi defaults: η = 0.01, η_l = 0.0316, β₁ = 0.9, β₂ = 0.99, τ = 1e-3.
    pub fn yogi() -> Self {
        FedOptParams { eta: 1e-2, eta_l: 0.0316, beta_1: 0.9, beta_2: 0.99, tau: 1e-3, bias_correction: false }
    }
    /// Flower's FedAdagrad defaults: η = 0.1, η_l = 0.1, β₁ = 0, τ = 1e-9.
    pub fn adagrad() -> Self {
        FedOptParams { eta: 0.1, eta_l: 0.1, beta_1: 0.0, beta_2: 0.0, tau: 1e-9, bias_correction: false }
    }
    pub(crate) fn validate(&self) -> Result<(), StrategyError> {
        let ok = self.eta.is_finite()
            && self.eta > 0.0
            && self.eta_l.is_finite()
            && self.eta_l > 0.0
            && (0.0..1.0).contains(&self.beta_1)
            && (0.0..1.0).contains(&self.beta_2)
            && self.tau.is_finite()
            && self.tau > 0.0;
        if ok { Ok(()) } else { Err(StrategyError::BadParameter(format!("FedOpt parameters out of range: {self:?}"))) }
    }
}

/// The second step of a strategy: how the aggregate delta moves the global model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ServerOptimizer {
    /// `x ← x + Δ`.
    Plain,
    /// FedAdam, FedYogi or FedAdagrad, with its state.
    Adaptive(AdaptiveOptimizer),
}

/// An adaptive server optimizer and its state (`m`, `v`, `t`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdaptiveOptimizer {
    kind: FedOptKind,
    params: FedOptParams,
    /// First moment.
    m: Vec<f32>,
    /// Second moment.
    v: Vec<f32>,
    /// Server steps taken.
    t: u64,
}

impl AdaptiveOptimizer {
    pub fn new(kind: FedOptKind, params: FedOptParams, dim: usize) -> Result<Self, StrategyError> {
        params.validate()?;
        Ok(AdaptiveOptimizer { kind, params, m: vec![0.0; dim], v: vec![0.0; dim], t: 0 })
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
    pub fn name(&self) -> &'static str {
        match self.kind {
            FedOptKind::Adam => "fedadam",
            FedOptKind::Yogi => "fedyogi",
            FedOptKind::Adagrad => "fedadagrad",
        }
    }

    /// One step of Reddi et al.'s Algorithm 2 on backend `b`; the state is updated only when
    /// the step succeeds.
    fn step<B: Backend>(&mut self, b: &B, global: &[f32], delta: &B::Vector) -> Result<Vec<f32>, StrategyError> {
        let p = self.params;
        let t = self.t + 1;
        let eta = match (self.kind, p.bias_correction) {
            (FedOptKind::Adam, true) => {
                let t = t.min(i32::MAX as u64) as i32;
                p.eta * (1.0 - p.beta_2.powi(t)).sqrt() / (1.0 - p.beta_1.powi(t))
            }
            _ => p.eta,
        };
        let (m_prev, v_prev) = (b.upload(&self.m), b.upload(&self.v));
        let m = b.add(&b.scale(&m_prev, p.beta_1), &b.scale(delta, 1.0 - p.beta_1));
        let d2 = b.mul(delta, delta);
        let v = match self.kind {
            FedOptKind::Adam => b.add(&b.scale(&v_prev, p.beta_2), &b.scale(&d2, 1.0 - p.beta_2)),
            FedOptKind::Yogi => {
                let sign = b.sign(&b.sub(&v_prev, &d2));
                b.sub(&v_prev, &b.mul(&b.scale(&d2, 1.0 - p.beta_2), &sign))
            }
            FedOptKind::Adagrad => b.add(&v_prev, &d2),
        };
        let step = b.div(&b.scale(&m, eta), &b.add_scalar(&b.sqrt(&v), p.tau));
        let out = b.download(b.add(&b.upload(global), &step))?;
        (self.m, self.v, self.t) = (b.download(m)?, b.download(v)?, t);
        Ok(out)
    }
}

impl ServerOptimizer {
    /// The next global model from `global` and the round's aggregate `delta`, on backend `b`.
    pub fn step<B: Backend>(&mut self, b: &B, global: &[f32], delta: &B::Vector) -> Result<Vec<f32>, StrategyError> {
        match self {
            ServerOptimizer::Plain => b.download(b.add(&b.upload(global), delta)),
            ServerOptimizer::Adaptive(opt) => opt.step(b, global, delta),
        }
    }
}
