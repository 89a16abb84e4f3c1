//! The arithmetic a server step runs on. One trait, two implementations: [`Exact`] here (the
//! integer fixed-point fold and `f64` element-wise math, bit-identical for any arrival order),
//! and burn tensors on CPU or GPU in the aggregator shell. The weighted mean and every server
//! optimizer are written once against this trait (see `ServerStrategy::finalize_on` and
//! [`ServerOptimizer::step`](super::ServerOptimizer::step)).

use super::StrategyError;
use super::fixed::PartialSum;

/// Element-wise vector arithmetic and a weighted-sum accumulator.
pub trait Backend {
    /// A model-sized vector on this backend.
    type Vector;
    /// A running weighted sum of deltas.
    type Sum;

    fn new_sum(&self, dim: usize) -> Self::Sum;
    /// Folds `scale·delta` with `weight` into `sum` (clipping scales a delta, not its weight).
    fn fold(&self, sum: &mut Self::Sum, delta: &[f32], weight: u64, scale: f64) -> Result<(), StrategyError>;
    /// `Σ wᵢ·sᵢ·Δᵢ / Σ wᵢ`.
    fn mean(&self, sum: &Self::Sum) -> Result<Self::Vector, StrategyError>;

    fn upload(&self, v: &[f32]) -> Self::Vector;
    fn download(&self, v: Self::Vector) -> Result<Vec<f32>, StrategyError>;

    fn add(&self, a: &Self::Vector, b: &Self::Vector) -> Self::Vector;
    fn sub(&self, a: &Self::Vector, b: &Self::Vector) -> Self::Vector;
    fn mul(&self, a: &Self::Vector, b: &Self::Vector) -> Self::Vector;
    fn div(&self, a: &Self::Vector, b: &Self::Vector) -> Self::Vector;
    /// `s·a`.
    fn scale(&self, a: &Self::Vector, s: f64) -> Self::Vector;
    fn add_scalar(&self, a: &Self::Vector, s: f64) -> Self::Vector;
    fn sqrt(&self, a: &Self::Vector) -> Self::Vector;
    /// numpy's `sign`: -1, 0 or 1 (0 for NaN).
    fn sign(&self, a: &Self::Vector) -> Self::Vector;
}

/// The exact backend: [`PartialSum`] folds, `f64` element-wise math, results rounded to `f32`
/// once at the end.
#[derive(Debug, Clone, Copy, Default)]
pub struct Exact;

fn zip(a: &[f64], b: &[f64], f: impl Fn(f64, f64) -> f64) -> Vec<f64> {
    a.iter().zip(b).map(|(&x, &y)| f(x, y)).collect()
}

impl Backend for Exact {
    type Vector = Vec<f64>;
    type Sum = PartialSum;

    fn new_sum(&self, dim: usize) -> PartialSum {
        PartialSum::new(dim)
    }
    fn fold(&self, sum: &mut PartialSum, delta: &[f32], weight: u64, scale: f64) -> Result<(), StrategyError> {
        Ok(sum.fold_scaled(delta, weight, scale)?)
    }
    fn mean(&self, sum: &PartialSum) -> Result<Vec<f64>, StrategyError> {
        Ok(sum.mean()?)
    }
    fn upload(&self, v: &[f32]) -> Vec<f64> {
        v.iter().map(|&x| x as f64).collect()
    }
    fn download(&self, v: Vec<f64>) -> Result<Vec<f32>, StrategyError> {
        Ok(v.into_iter().map(|x| x as f32).collect())
    }
    fn add(&self, a: &Vec<f64>, b: &Vec<f64>) -> Vec<f64> {
        zip(a, b, |x, y| x + y)
    }
    fn sub(&self, a: &Vec<f64>, b: &Vec<f64>) -> Vec<f64> {
        zip(a, b, |x, y| x - y)
    }
    fn mul(&self, a: &Vec<f64>, b: &Vec<f64>) -> Vec<f64> {
        zip(a, b, |x, y| x * y)
    }
    fn div(&self, a: &Vec<f64>, b: &Vec<f64>) -> Vec<f64> {
        zip(a, b, |x, y| x / y)
    }
    fn scale(&self, a: &Vec<f64>, s: f64) -> Vec<f64> {
        a.iter().map(|&x| s * x).collect()
    }
    fn add_scalar(&self, a: &Vec<f64>, s: f64) -> Vec<f64> {
        a.iter().map(|&x| x + s).collect()
    }
    fn sqrt(&self, a: &Vec<f64>) -> Vec<f64> {
        a.iter().map(|&x| x.sqrt()).collect()
    }
    fn sign(&self, a: &Vec<f64>) -> Vec<f64> {
        a.iter()
            .map(|&x| {
                if x > 0.0 {
                    1.0
                } else if x < 0.0 {
                    -1.0
                } else {
                    0.0
                }
            })
            .collect()
    }
}
