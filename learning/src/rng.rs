//! Seeded randomness: one ChaCha8 stream per purpose, and the few distributions we need
//! (normal, gamma, Dirichlet, log-normal), implemented here so that results depend only on the
//! seed and this file, not on the version of a distributions crate.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The generator used everywhere in this crate.
pub type SeededRng = ChaCha8Rng;

/// A generator for `seed`, separated by `stream` so different purposes (init, shuffling,
/// partitioning) never share draws.
pub fn rng(seed: u64, stream: u64) -> SeededRng {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    r.set_stream(stream);
    r
}

/// Stream ids.
pub mod streams {
    /// Weight initialisation.
    pub const INIT: u64 = 1;
    /// Mini-batch shuffling.
    pub const SHUFFLE: u64 = 2;
    /// Partitioners.
    pub const PARTITION: u64 = 3;
    /// Train/test splits.
    pub const SPLIT: u64 = 4;
    /// Synthetic data generation.
    pub const SYNTHETIC: u64 = 5;
    /// Dropout masks during training.
    pub const DROPOUT: u64 = 6;
}

/// Uniform in [lo, hi).
pub fn uniform(r: &mut SeededRng, lo: f64, hi: f64) -> f64 {
    lo + (hi - lo) * r.r#gen::<f64>()
}

/// Standard normal (Box-Muller; one value per call, deterministic).
pub fn normal(r: &mut SeededRng) -> f64 {
    loop {
        let u1: f64 = r.r#gen::<f64>();
        let u2: f64 = r.r#gen::<f64>();
        if u1 > f64::MIN_POSITIVE {
            return (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
        }
    }
}

/// Gamma(shape, 1) by Marsaglia & Tsang; shape < 1 via the boost `G(a+1) * U^(1/a)`.
pub fn gamma(r: &mut SeededRng, shape: f64) -> f64 {
    assert!(shape > 0.0, "gamma shape must be > 0");
    if shape < 1.0 {
        let g = gamma(r, shape + 1.0);
        let u: f64 = r.r#gen::<f64>();
        return g * u.max(f64::MIN_POSITIVE).powf(1.0 / shape);
    }
    let d = shape - 1.0 / 3.0;
    let c = 1.0 / (9.0 * d).sqrt();
    loop {
        let x = normal(r);
        let v = 1.0 + c * x;
        if v <= 0.0 {
            continue;
        }
        let v = v * v * v;
        let u: f64 = r.r#gen::<f64>();
        if u < 1.0 - 0.0331 * x * x * x * x || u.ln() < 0.5 * x * x + d * (1.0 - v + v.ln()) {
            return d * v;
        }
    }
}

/// Symmetric Dirichlet(alpha, ..., alpha) over `k` categories.
pub fn dirichlet(r: &mut SeededRng, alpha: f64, k: usize) -> Vec<f64> {
    let mut g: Vec<f64> = (0..k).map(|_| gamma(r, alpha)).collect();
    let s: f64 = g.iter().sum();
    if s <= 0.0 || !s.is_finite() {
        // Every draw underflowed (tiny alpha): put all mass on one category.
        let j = r.gen_range(0..k);
        g.iter_mut().for_each(|x| *x = 0.0);
        g[j] = 1.0;
        return g;
    }
    g.iter_mut().for_each(|x| *x /= s);
    g
}

/// Fisher-Yates shuffle (own implementation so the permutation is fixed by the seed alone).
pub fn shuffle<T>(r: &mut SeededRng, v: &mut [T]) {
    for i in (1..v.len()).rev() {
        let j = r.gen_range(0..=i);
        v.swap(i, j);
    }
}
