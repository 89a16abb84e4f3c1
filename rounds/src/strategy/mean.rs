//! Weighted means: the aggregation step of FedAvg (McMahan et al. 2017), FedProx's server side
//! (Li et al. 2020), the FedOpt family, the norm-clipped mean, and DP-FedAvg's noised mean
//! (McMahan et al. 2018).
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

/// DP-FedAvg's aggregation (McMahan et al. 2018, the fixed-denominator estimator): each device's
/// delta clipped to L2 norm `clip_norm` and counted once (its sample count is not used: a
/// device's whole influence is bounded by `clip_norm`), Gaussian noise of standard deviation
/// `noise_multiplier · clip_norm` added to the exact sum, divided by the expected number of
/// updates per round (not the actual one, which would reveal membership).
///
/// The noise is drawn from a ChaCha20 stream keyed by `noise_seed` (a secret the shell draws
/// once per campaign and keeps with the strategy) and the round's index, so a restart after
/// `kill -9` publishes the bit-identical model; devices never see the seed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DpMean {
    clipped: ClippedMean,
    noise_multiplier: f64,
    expected_count: u64,
    noise_seed: [u8; 32],
    /// Rounds noised so far: the index of the next round's noise stream.
    rounds_noised: u64,
    adaptive: Option<AdaptiveClipping>,
    /// The devices clipped and noised their updates ([`DpMean::with_noise_on_devices`]).
    #[serde(default)]
    noise_on_devices: bool,
}

/// Adaptive clipping (Andrew et al. 2021): after each round the clipping norm moves
/// geometrically toward the `target_quantile` of the update norms, `C ← C·exp(−η(b̃ − γ))`, where
/// `b̃` is the noised fraction of updates that were not clipped (Gaussian noise of σ =
/// `count_stddev` on the count). The count is a second query on the same devices: the update
/// sum's noise multiplier becomes `z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2)`, so that the two together spend
/// what a noise multiplier `z` alone would (what the accountant counts).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdaptiveClipping {
    /// γ: the quantile of update norms the clipping norm tracks (0.5: the median).
    pub target_quantile: f64,
    /// η: the geometric learning rate of the clipping norm.
    pub learning_rate: f64,
    /// σ_b: the noise on the count of unclipped updates (Andrew et al. suggest expected / 20).
    pub count_stddev: f64,
}

impl DpMean {
    pub fn new(
        dim: usize,
        clip_norm: f64,
        noise_multiplier: f64,
        expected_count: u64,
        noise_seed: [u8; 32],
    ) -> Result<Self, StrategyError> {
        if !(noise_multiplier.is_finite() && noise_multiplier >= 0.0) {
            return Err(StrategyError::BadParameter(format!("noise_multiplier must be >= 0, got {noise_multiplier}")));
        }
        if expected_count == 0 {
            return Err(StrategyError::BadParameter("the expected number of updates per round must be >= 1".into()));
        }
        Ok(DpMean {
            clipped: ClippedMean::new(dim, clip_norm)?,
            noise_multiplier,
            expected_count,
            noise_seed,
            rounds_noised: 0,
            adaptive: None,
            noise_on_devices: false,
        })
    }

    /// The devices clip their updates and each adds its share of the noise (under secure
    /// aggregation the aggregator only ever sees the noised sum): this step merges that sum
    /// ([`Aggregation::partial_sum_mut`]) and divides it by the expected count, adding no noise.
    /// Each device adds `noise_multiplier · clip_norm / √m` for a round that needs `m`
    /// updates, so the sum of `≥ m` holds at least the noise the accountant counts. Adaptive
    /// clipping needs each update's norm, so it is refused here.
    pub fn with_noise_on_devices(mut self) -> Result<Self, StrategyError> {
        if self.adaptive.is_some() {
            return Err(StrategyError::BadParameter(
                "adaptive clipping needs each update's norm; with the noise on the devices the clipping norm is fixed".into(),
            ));
        }
        self.noise_on_devices = true;
        Ok(self)
    }

    pub fn noise_on_devices(&self) -> bool {
        self.noise_on_devices
    }

    /// The Gaussian noise each of `min_updates` devices adds so that their sum holds the
    /// noise of σ = `noise_multiplier · clip_norm` ([`DpMean::with_noise_on_devices`]).
    pub fn device_noise_stddev(noise_multiplier: f64, clip_norm: f64, min_updates: u32) -> f64 {
        noise_multiplier * clip_norm / f64::from(min_updates.max(1)).sqrt()
    }

    /// With adaptive clipping; refused when the count's noise leaves no noise for the updates
    /// (`2σ_b` must exceed the noise multiplier).
    pub fn with_adaptive_clipping(mut self, a: AdaptiveClipping) -> Result<Self, StrategyError> {
        if !(a.target_quantile > 0.0 && a.target_quantile < 1.0) {
            return Err(StrategyError::BadParameter(format!("clip_quantile must be in (0, 1), got {}", a.target_quantile)));
        }
        if !(a.learning_rate.is_finite() && a.learning_rate > 0.0) {
            return Err(StrategyError::BadParameter(format!("clip_learning_rate must be > 0, got {}", a.learning_rate)));
        }
        if !(a.count_stddev.is_finite() && 2.0 * a.count_stddev > self.noise_multiplier) {
            return Err(StrategyError::BadParameter(format!(
                "clip_count_stddev must be more than half the noise multiplier ({}), got {}: the count's noise would leave none for the updates",
                self.noise_multiplier, a.count_stddev
            )));
        }
        self.adaptive = Some(a);
        Ok(self)
    }

    /// The noise multiplier of the update sum: all of it, or what the count leaves.
    fn update_noise_multiplier(&self) -> f64 {
        match self.adaptive {
            None => self.noise_multiplier,
            Some(a) => (self.noise_multiplier.powi(-2) - (2.0 * a.count_stddev).powi(-2)).powf(-0.5),
        }
    }
    pub fn clip_norm(&self) -> f64 {
        self.clipped.clip_norm()
    }

    /// Standard normal draws for round `round`, `n` of them (Box-Muller over ChaCha20).
    fn gaussian(&self, round: u64, n: usize) -> Vec<f64> {
        use rand_chacha::rand_core::{RngCore, SeedableRng};
        let mut key = blake3::Hasher::new_derive_key("fedfleet dp-fedavg noise v1");
        key.update(&self.noise_seed);
        key.update(&round.to_le_bytes());
        let mut rng = rand_chacha::ChaCha20Rng::from_seed(*key.finalize().as_bytes());
        // 53 random bits to (0, 1].
        let mut uniform = || ((rng.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
        let mut out = Vec::with_capacity(n + 1);
        while out.len() < n {
            let (r, theta) = ((-2.0 * uniform().ln()).sqrt(), std::f64::consts::TAU * uniform());
            out.push(r * theta.cos());
            out.push(r * theta.sin());
        }
        out.truncate(n);
        out
    }
}

impl Aggregation for DpMean {
    fn name(&self) -> &'static str {
        "dp_mean"
    }
    fn dim(&self) -> usize {
        self.clipped.dim()
    }
    fn fold(&mut self, delta: &[f32], _weight: u64) -> Result<(), StrategyError> {
        self.clipped.fold(delta, 1)
    }
    fn folded(&self) -> u64 {
        self.clipped.folded()
    }
    fn aggregate(&mut self) -> Result<Vec<f64>, StrategyError> {
        if self.clipped.folded() == 0 {
            return Err(FoldError::Empty.into());
        }
        let sum = self.clipped.sum.sum();
        // With the noise on the devices, the sum already holds it.
        let sigma = if self.noise_on_devices { 0.0 } else { self.update_noise_multiplier() * self.clipped.clip_norm() };
        // One stream per round: the updates' noise, then the count's.
        let noise = self.gaussian(self.rounds_noised, sum.len() + 1);
        let denominator = self.expected_count as f64;
        let mean = sum.iter().zip(&noise).map(|(s, n)| (s + sigma * n) / denominator).collect();
        if let Some(a) = self.adaptive {
            let unclipped = (self.clipped.folded() - self.clipped.clipped_this_round()) as f64;
            let fraction = (unclipped + a.count_stddev * noise[sum.len()]) / denominator;
            self.clipped.clip_norm *= (-a.learning_rate * (fraction - a.target_quantile)).exp();
        }
        self.rounds_noised += 1;
        self.clipped.abort_round();
        Ok(mean)
    }
    fn abort_round(&mut self) {
        self.clipped.abort_round();
    }
    fn partial_sum(&self) -> Option<&PartialSum> {
        self.noise_on_devices.then_some(&self.clipped.sum)
    }
    fn partial_sum_mut(&mut self) -> Option<&mut PartialSum> {
        self.noise_on_devices.then_some(&mut self.clipped.sum)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dp_mean_clips_counts_each_device_once_and_adds_reproducible_noise() {
        let dim = 20_000;
        let big: Vec<f32> = vec![1.0; dim]; // norm √20000 ≈ 141, clipped to 1
        let small: Vec<f32> = (0..dim).map(|i| if i == 0 { 0.5 } else { 0.0 }).collect();
        // Without noise: (clip(big) + small) / expected, whatever the sample weights.
        let mut exact = DpMean::new(dim, 1.0, 0.0, 4, [7; 32]).unwrap();
        exact.fold(&big, 1000).unwrap();
        exact.fold(&small, 1).unwrap();
        let mean = exact.aggregate().unwrap();
        let clipped_value = 1.0 / (dim as f64).sqrt();
        assert!((mean[0] - (clipped_value + 0.5) / 4.0).abs() < 1e-9, "{}", mean[0]);
        assert!((mean[1] - clipped_value / 4.0).abs() < 1e-9);

        // With noise: the same seed and round give the same model; its noise has σ = z·C/expected.
        let noised = |seed| {
            let mut s = DpMean::new(dim, 1.0, 2.0, 4, seed).unwrap();
            s.fold(&small, 1).unwrap();
            s.aggregate().unwrap()
        };
        let (a, b, c) = (noised([7; 32]), noised([7; 32]), noised([8; 32]));
        assert_eq!(a, b, "a restart redraws the same noise");
        assert_ne!(a, c);
        let noise: Vec<f64> = a.iter().skip(1).copied().collect();
        let mean_noise = noise.iter().sum::<f64>() / noise.len() as f64;
        let sd = (noise.iter().map(|x| (x - mean_noise).powi(2)).sum::<f64>() / noise.len() as f64).sqrt();
        assert!(mean_noise.abs() < 0.02, "{mean_noise}");
        assert!((sd - 0.5).abs() < 0.02, "σ = z·C/expected = 0.5, measured {sd}");

        // The next round draws fresh noise.
        let mut s = DpMean::new(dim, 1.0, 2.0, 4, [7; 32]).unwrap();
        s.fold(&small, 1).unwrap();
        let first = s.aggregate().unwrap();
        s.fold(&small, 1).unwrap();
        assert_ne!(s.aggregate().unwrap(), first);
        assert!(s.aggregate().is_err(), "nothing folded");
    }
}

#[cfg(test)]
mod noise_on_devices_tests {
    use super::*;

    #[test]
    fn with_the_noise_on_the_devices_the_sum_is_divided_by_the_expected_count_and_nothing_added() {
        let dim = 1000;
        let mut s = DpMean::new(dim, 1.0, 2.0, 4, [7; 32]).unwrap().with_noise_on_devices().unwrap();
        // The devices' (already clipped and noised) sum, weight 1 each, merged as it is.
        let mut devices = PartialSum::new(dim);
        devices.fold(&vec![0.25; dim], 1).unwrap();
        devices.fold(&vec![0.5; dim], 1).unwrap();
        s.partial_sum_mut().expect("takes the devices' sum").merge(&devices).unwrap();
        let mean = s.aggregate().unwrap();
        assert!(mean.iter().all(|m| (m - 0.75 / 4.0).abs() < 1e-9), "{:?}", &mean[..3]);
        // Server-side noise has no sum to merge into.
        assert!(DpMean::new(dim, 1.0, 2.0, 4, [7; 32]).unwrap().partial_sum_mut().is_none());
        // m devices of σ·C/√m each: σ·C in their sum.
        let each = DpMean::device_noise_stddev(2.0, 1.5, 9);
        assert!((each * 3.0 - 3.0).abs() < 1e-12, "{each}");
        // Adaptive clipping needs each update.
        let a = AdaptiveClipping { target_quantile: 0.5, learning_rate: 0.2, count_stddev: 2.0 };
        let e = DpMean::new(dim, 1.0, 2.0, 4, [7; 32]).unwrap().with_adaptive_clipping(a).unwrap().with_noise_on_devices().unwrap_err();
        assert!(e.to_string().contains("adaptive"), "{e}");
    }
}

#[cfg(test)]
mod adaptive_tests {
    use super::*;

    fn rounds(updates_norm: f32, n: usize) -> Vec<f64> {
        let dim = 100;
        let adaptive = AdaptiveClipping { target_quantile: 0.5, learning_rate: 0.2, count_stddev: 0.6 };
        let mut s = DpMean::new(dim, 1.0, 1.0, 10, [3; 32]).unwrap().with_adaptive_clipping(adaptive).unwrap();
        let mut norms = vec![s.clip_norm()];
        for _ in 0..n {
            for _ in 0..10 {
                // Norm `updates_norm` each.
                s.fold(&vec![updates_norm / (dim as f32).sqrt(); dim], 1).unwrap();
            }
            s.aggregate().unwrap();
            norms.push(s.clip_norm());
        }
        norms
    }

    #[test]
    fn the_clipping_norm_follows_the_median_of_the_update_norms() {
        // Every update clipped: the norm grows by about e^(0.2·0.5) a round toward them.
        let up = rounds(50.0, 5);
        assert!(up.windows(2).all(|w| w[1] > w[0] * 1.05), "{up:?}");
        // Every update well under it: the norm shrinks.
        let down = rounds(0.01, 5);
        assert!(down.windows(2).all(|w| w[1] < w[0] * 0.95), "{down:?}");
        // Over many rounds at norm 3 it settles around 3.
        let settled = *rounds(3.0, 60).last().unwrap();
        assert!((2.0..4.5).contains(&settled), "{settled}");
    }

    #[test]
    fn the_count_must_leave_noise_for_the_updates() {
        let s = DpMean::new(10, 1.0, 1.0, 10, [3; 32]).unwrap();
        let a = AdaptiveClipping { target_quantile: 0.5, learning_rate: 0.2, count_stddev: 0.4 };
        let e = s.clone().with_adaptive_clipping(a).unwrap_err().to_string();
        assert!(e.contains("clip_count_stddev"), "{e}");
        // σ_b = 0.6, z = 1: z_Δ = (1 − 1/1.44)^(−1/2) ≈ 1.81.
        let s = s.with_adaptive_clipping(AdaptiveClipping { count_stddev: 0.6, ..a }).unwrap();
        assert!((s.update_noise_multiplier() - 1.8091).abs() < 1e-3, "{}", s.update_noise_multiplier());
    }
}
