//! Exact, order-independent weighted sums in integer fixed point.
//!
//! Every streaming strategy (FedAvg, FedProx, clipped FedAvg, FedAdam/Yogi/Adagrad) keeps one
//! [`PartialSum`]: a vector of `i128`, one per model coordinate, holding `Σᵢ wᵢ·Δᵢⱼ` in units of
//! 2⁻⁴⁸, plus `Σᵢ wᵢ` and the number of folded updates. Integer addition is associative and
//! commutative, so the sum — and therefore the aggregated model — is **bit-identical whatever the
//! arrival order**, and the partial sums of several relays merge into exactly the sum over all
//! their devices.
//!
//! # Resolution and range
//!
//! * A weight is an integer `1..=`[`MAX_WEIGHT`] (2²⁴; callers clamp sample counts to it). A delta
//!   element is an `f32` (24 significant bits), so `w·Δ` has at most 48 significant bits and is
//!   computed **exactly** in `f64`. It is then rounded once, to nearest (ties to even), onto the
//!   grid of [`RESOLUTION`] = 2⁻⁴⁸ ≈ 3.6e-15. That single rounding is the only error in the sum;
//!   after division by `Σw` the mean is off by at most 2⁻⁴⁹ per coordinate before the final
//!   rounding to `f32` — far below the `f32` spacing of any weight bigger than about 1e-7.
//! * Each product must satisfy `|w·Δ| <` [`MAX_PRODUCT`] = 2⁵² (so with the largest weight,
//!   `|Δ| < 2²⁸`); larger or non-finite values are refused with [`FoldError::NonFinite`] /
//!   [`FoldError::OutOfRange`] and leave the sum untouched.
//! * At most [`MAX_FOLDS`] = 2²⁶ updates (merged relay partial sums count with their own folds)
//!   go into one sum. Then `|Σ| < 2²⁶·2¹⁰⁰ = 2¹²⁶` grid units: the `i128` cannot overflow, so the
//!   hot loop needs no checked arithmetic; [`FoldError::TooManyFolds`] guards the count.
//!
//! # The hot loop
//!
//! Per element: one `f32→f64` widening, one multiply (the weight is pre-scaled by 2⁴⁸, exact),
//! round-to-nearest with the 1.5·2⁵² trick (no libm call), one `f64→i64` conversion and one
//! `i128` add. Products of 8 or more (rare for deltas) take a second path that first splits off
//! a high part (a multiple of 2⁴⁰, exact) and rounds the remainder. No allocation; the range
//! check is folded into a flag per chunk. The accumulator uses wrapping adds, so undoing a chunk
//! (on a bad value found later) subtracts exactly what was added.
//!
//! Cost: the `i128` sums take 4× the model's `f32` size, and a fold moves 36 bytes per
//! coordinate (4 read, 16 read + 16 written), so it is memory-bound well below `memcpy`. Seen on
//! the 2-core dev VM: about 1 GB/s of `f32` input in the dev profile and 1.3–1.5 GB/s for the
//! kernel alone at `opt-level` 2–3, against about 10 GB/s for `memcpy`
//! (`cargo test -p fedfleet-aggregator --test service -- --ignored --nocapture fold_throughput`).

use serde::{Deserialize, Serialize};

/// Largest weight (sample count) one update may carry: 2²⁴, so `weight · f32` is exact in `f64`.
pub const MAX_WEIGHT: u64 = 1 << 24;
/// Fractional bits of the fixed-point grid.
pub const FRAC_BITS: u32 = 48;
/// Grid spacing of the accumulated products `w·Δ`: 2⁻⁴⁸.
pub const RESOLUTION: f64 = 1.0 / (1u64 << FRAC_BITS) as f64;
/// Exclusive bound on `|w·Δ|` for one element of one update: 2⁵².
pub const MAX_PRODUCT: f64 = (1u64 << 52) as f64;
/// Most updates (devices) one partial sum may hold: 2²⁶.
pub const MAX_FOLDS: u64 = 1 << 26;

const SCALE: f64 = (1u64 << FRAC_BITS) as f64;
const SPLIT: f64 = (1u64 << 40) as f64;
const INV_SPLIT: f64 = 1.0 / SPLIT;
/// 1.5·2⁵²: adding and subtracting it rounds any |x| < 2⁵¹ to the nearest integer (ties to even)
/// under the default rounding mode, which Rust guarantees.
const ROUND_MAGIC: f64 = 6_755_399_441_055_744.0;
/// Bound on the scaled product, in grid units: 2⁵² · 2⁴⁸ = 2¹⁰⁰.
const LIMIT_UNITS: f64 = MAX_PRODUCT * SCALE;
/// Below 2^51 units (|w·Δ| < 8) the magic-number rounding works directly on the product.
const FAST_UNITS: f64 = (1u64 << 51) as f64;
/// Elements per chunk of the hot loop (the range flag is checked once per chunk).
const CHUNK: usize = 4096;

/// Why a fold or merge was refused. The sum is unchanged when any of these is returned.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum FoldError {
    #[error("update has {got} elements, the model has {expected}")]
    ShapeMismatch { expected: usize, got: usize },
    #[error("element {index} is NaN or infinite")]
    NonFinite { index: usize },
    #[error("element {index}: |weight x delta| = {value:e} is at or above the fixed-point range 2^52")]
    OutOfRange { index: usize, value: f64 },
    #[error("weight {0} is outside 1..=2^24")]
    BadWeight(u64),
    #[error("more than 2^26 updates in one sum")]
    TooManyFolds,
    #[error("nothing was folded")]
    Empty,
}

/// `Σ wᵢΔᵢ` (fixed point), `Σ wᵢ` and the number of updates: the whole state of a streaming
/// weighted mean. Serializable, so the shell can persist it and a relay can forward it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartialSum {
    sums: Vec<i128>,
    total_weight: u64,
    count: u64,
}

impl PartialSum {
    /// An empty sum over a model of `dim` coordinates.
    pub fn new(dim: usize) -> Self {
        PartialSum { sums: vec![0; dim], total_weight: 0, count: 0 }
    }
    pub fn dim(&self) -> usize {
        self.sums.len()
    }
    /// `Σ wᵢ` over the folded updates.
    pub fn total_weight(&self) -> u64 {
        self.total_weight
    }
    /// Number of folded updates (a merged relay sum counts with all of its updates).
    pub fn count(&self) -> u64 {
        self.count
    }
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }
    /// The raw fixed-point sums, in units of [`RESOLUTION`].
    pub fn raw(&self) -> &[i128] {
        &self.sums
    }
    /// Forget everything folded (start of a new round); keeps the allocation.
    pub fn clear(&mut self) {
        self.sums.iter_mut().for_each(|s| *s = 0);
        self.total_weight = 0;
        self.count = 0;
    }

    /// Folds `weight · delta`. Atomic: on error nothing changed.
    pub fn fold(&mut self, delta: &[f32], weight: u64) -> Result<(), FoldError> {
        self.fold_scaled(delta, weight, 1.0)
    }

    /// Folds `weight · scale · delta` (used by norm clipping, `0 < scale <= 1`). With
    /// `scale != 1` the product is rounded once more in `f64` before the grid rounding; the
    /// result is still a deterministic function of the inputs, so order independence holds.
    pub fn fold_scaled(&mut self, delta: &[f32], weight: u64, scale: f64) -> Result<(), FoldError> {
        check_weight(weight)?;
        if delta.len() != self.sums.len() {
            return Err(FoldError::ShapeMismatch { expected: self.sums.len(), got: delta.len() });
        }
        if self.count + 1 > MAX_FOLDS {
            return Err(FoldError::TooManyFolds);
        }
        let ws = weight as f64 * SCALE * scale;
        let mut done = 0;
        for (acc, d) in self.sums.chunks_mut(CHUNK).zip(delta.chunks(CHUNK)) {
            if !add_chunk(acc, d, ws) {
                // Undo this chunk and every earlier one: wrapping arithmetic makes it exact.
                sub_chunk(acc, d, ws);
                sub_all(&mut self.sums[..done], &delta[..done], ws);
                return Err(first_bad(delta, ws));
            }
            done += d.len();
        }
        self.total_weight += weight;
        self.count += 1;
        Ok(())
    }

    /// A sum made elsewhere on this grid: `sums` in units of [`RESOLUTION`], `Σ w` and the
    /// number of updates in it. Secure aggregation unmasks such a sum exactly (on a coarser grid,
    /// shifted onto this one); from here it is finalized like any fold.
    pub fn from_raw(sums: Vec<i128>, total_weight: u64, count: u64) -> Result<Self, FoldError> {
        if count == 0 {
            return Err(FoldError::Empty);
        }
        if count > MAX_FOLDS {
            return Err(FoldError::TooManyFolds);
        }
        Ok(PartialSum { sums, total_weight, count })
    }

    /// The sums as a relay forwards them: `dim` little-endian `i128`s, in grid units.
    pub fn to_le_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.sums.len() * 16);
        for s in &self.sums {
            out.extend_from_slice(&s.to_le_bytes());
        }
        out
    }

    /// Reads [`to_le_bytes`](Self::to_le_bytes) of a sum over `count` updates of total weight
    /// `total_weight`, refusing a length other than `dim` sums, a count or weight that cannot
    /// be, and any sum beyond what `count` in-range products can reach.
    pub fn from_le_bytes(bytes: &[u8], dim: usize, total_weight: u64, count: u64) -> Result<Self, FoldError> {
        if bytes.len() != dim.saturating_mul(16) {
            return Err(FoldError::ShapeMismatch { expected: dim, got: bytes.len() / 16 });
        }
        if count == 0 {
            return Err(FoldError::Empty);
        }
        if count > MAX_FOLDS {
            return Err(FoldError::TooManyFolds);
        }
        if total_weight < count || total_weight > count * MAX_WEIGHT {
            return Err(FoldError::BadWeight(total_weight));
        }
        let bound = i128::from(count) << 100; // count × 2¹⁰⁰ grid units (LIMIT_UNITS)
        let mut sums = Vec::with_capacity(dim);
        for (index, b) in bytes.chunks_exact(16).enumerate() {
            let v = i128::from_le_bytes(b.try_into().expect("16 bytes"));
            if v.unsigned_abs() >= bound.unsigned_abs() {
                return Err(FoldError::OutOfRange { index, value: v as f64 * RESOLUTION });
            }
            sums.push(v);
        }
        Ok(PartialSum { sums, total_weight, count })
    }

    /// This sum discounted by FedBuff's staleness factor (`engine::staleness_factor_ppm`), as
    /// one contribution: every sum and the total weight times the same factor in parts per
    /// million, rounded toward zero (the weight never below 1), in integers, so the discounted
    /// sum is the same on every machine and after a restart. Staleness 0 is the sum itself.
    pub fn discounted(&self, staleness: u32) -> PartialSum {
        if staleness == 0 {
            return self.clone();
        }
        let factor = crate::engine::staleness_factor_ppm(staleness) as i128;
        let ppm = i128::from(fedfleet_protocol::messages::PPM);
        PartialSum {
            sums: self.sums.iter().map(|s| s * factor / ppm).collect(),
            total_weight: crate::engine::staleness_weight(self.total_weight, staleness),
            count: self.count,
        }
    }

    /// Adds another partial sum (a relay's, or a shard's). Exact.
    pub fn merge(&mut self, other: &PartialSum) -> Result<(), FoldError> {
        if other.sums.len() != self.sums.len() {
            return Err(FoldError::ShapeMismatch { expected: self.sums.len(), got: other.sums.len() });
        }
        if self.count + other.count > MAX_FOLDS {
            return Err(FoldError::TooManyFolds);
        }
        for (a, b) in self.sums.iter_mut().zip(&other.sums) {
            *a += *b;
        }
        self.total_weight += other.total_weight;
        self.count += other.count;
        Ok(())
    }

    /// The weighted mean `Σ wᵢΔᵢ / Σ wᵢ`, as `f64` per coordinate, written into `out`.
    pub fn mean_into(&self, out: &mut [f64]) -> Result<(), FoldError> {
        if self.total_weight == 0 {
            return Err(FoldError::Empty);
        }
        if out.len() != self.sums.len() {
            return Err(FoldError::ShapeMismatch { expected: self.sums.len(), got: out.len() });
        }
        // Σw ≤ 2^50, so Σw·2^48 is exact in f64.
        let denom = self.total_weight as f64 * SCALE;
        for (o, &s) in out.iter_mut().zip(&self.sums) {
            *o = s as f64 / denom;
        }
        Ok(())
    }

    /// The sum `Σ wᵢΔᵢ` itself, as `f64` per coordinate.
    pub fn sum(&self) -> Vec<f64> {
        self.sums.iter().map(|&s| s as f64 / SCALE).collect()
    }

    /// The weighted mean as a new vector.
    pub fn mean(&self) -> Result<Vec<f64>, FoldError> {
        let mut out = vec![0.0; self.sums.len()];
        self.mean_into(&mut out)?;
        Ok(out)
    }
}

pub fn check_weight(weight: u64) -> Result<(), FoldError> {
    if weight == 0 || weight > MAX_WEIGHT { Err(FoldError::BadWeight(weight)) } else { Ok(()) }
}

/// The grid value of one element, as an `i128`, and whether it is in range.
#[inline(always)]
fn to_units(d: f32, ws: f64) -> (i128, bool) {
    let x = ws * d as f64;
    let ok = x.abs() < LIMIT_UNITS; // false for NaN and ±inf
    let u = if x.abs() < FAST_UNITS {
        // Common case: one rounding, one conversion.
        ((x + ROUND_MAGIC) - ROUND_MAGIC) as i64 as i128
    } else {
        let hi = (x * INV_SPLIT) as i64; // truncates toward zero; exact for in-range x
        let rem = x - hi as f64 * SPLIT; // exact: the low bits of x, |rem| < 2^40
        let lo = ((rem + ROUND_MAGIC) - ROUND_MAGIC) as i64; // round to nearest, ties to even
        ((hi as i128) << 40) + lo as i128
    };
    (u, ok)
}

#[inline]
fn add_chunk(acc: &mut [i128], d: &[f32], ws: f64) -> bool {
    let mut ok = true;
    for (a, &v) in acc.iter_mut().zip(d) {
        let (u, good) = to_units(v, ws);
        ok &= good;
        *a = a.wrapping_add(u);
    }
    ok
}

#[inline]
fn sub_chunk(acc: &mut [i128], d: &[f32], ws: f64) {
    for (a, &v) in acc.iter_mut().zip(d) {
        *a = a.wrapping_sub(to_units(v, ws).0);
    }
}

fn sub_all(acc: &mut [i128], d: &[f32], ws: f64) {
    for (a, d) in acc.chunks_mut(CHUNK).zip(d.chunks(CHUNK)) {
        sub_chunk(a, d, ws);
    }
}

fn first_bad(delta: &[f32], ws: f64) -> FoldError {
    for (index, &d) in delta.iter().enumerate() {
        if !d.is_finite() {
            return FoldError::NonFinite { index };
        }
        // d and ws are finite and |ws·d| < 2^200: x is finite.
        let x = ws * d as f64;
        if x.abs() >= LIMIT_UNITS {
            return FoldError::OutOfRange { index, value: x / SCALE };
        }
    }
    unreachable!("add_chunk flagged an element that is in range")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_are_exact_rounding() {
        // w·Δ·2^48 exactly representable → exact integer.
        assert_eq!(to_units(1.0, SCALE).0, 1i128 << 48);
        assert_eq!(to_units(-0.5, 3.0 * SCALE).0, -(3i128 << 47));
        // Large values go through the high part.
        let big = (1u64 << 30) as f32;
        assert_eq!(to_units(big, 7.0 * SCALE).0, 7i128 << 78);
        assert_eq!(to_units(-big, 7.0 * SCALE).0, -(7i128 << 78));
        // Sub-grid values round to nearest, ties to even.
        assert_eq!(to_units(2f32.powi(-49), SCALE).0, 0); // 0.5 unit → 0 (even)
        assert_eq!(to_units(3.0 * 2f32.powi(-49), SCALE).0, 2); // 1.5 units → 2
        assert_eq!(to_units(-3.0 * 2f32.powi(-49), SCALE).0, -2);
        assert_eq!(to_units(2f32.powi(-60), SCALE).0, 0);
        // A value with both parts: 2^20 + 2^-30.
        let v = (1u32 << 20) as f32 + 2f32.powi(-3);
        assert_eq!(to_units(v, SCALE).0, (1i128 << 68) + (1i128 << 45));
        // Bounds.
        assert!(!to_units(f32::NAN, SCALE).1);
        assert!(!to_units(f32::INFINITY, SCALE).1);
        assert!(!to_units(2f32.powi(28), MAX_WEIGHT as f64 * SCALE).1);
        assert!(to_units(2f32.powi(28) * 0.99, MAX_WEIGHT as f64 * SCALE).1);
    }

    #[test]
    fn failed_fold_leaves_the_sum_untouched() {
        let mut s = PartialSum::new(10_000);
        let good: Vec<f32> = (0..10_000).map(|i| (i as f32 - 5000.0) * 1e-3).collect();
        s.fold(&good, 5).unwrap();
        let before = s.clone();
        let mut bad = good.clone();
        bad[9_000] = f32::NAN; // in the third chunk: two chunks must be undone
        assert_eq!(s.fold(&bad, 2), Err(FoldError::NonFinite { index: 9_000 }));
        bad[9_000] = 1e30;
        assert!(matches!(s.fold(&bad, 2), Err(FoldError::OutOfRange { index: 9_000, .. })));
        assert_eq!(s.fold(&good, 0), Err(FoldError::BadWeight(0)));
        assert_eq!(s.fold(&good, MAX_WEIGHT + 1), Err(FoldError::BadWeight(MAX_WEIGHT + 1)));
        assert!(matches!(s.fold(&good[1..], 1), Err(FoldError::ShapeMismatch { .. })));
        assert_eq!(s, before);
    }

    #[test]
    fn mean_is_weighted() {
        let mut s = PartialSum::new(2);
        s.fold(&[1.0, -2.0], 1).unwrap();
        s.fold(&[4.0, 2.0], 3).unwrap();
        assert_eq!(s.mean().unwrap(), vec![13.0 / 4.0, 4.0 / 4.0]);
        assert_eq!(s.total_weight(), 4);
        assert_eq!(s.count(), 2);
        assert_eq!(PartialSum::new(2).mean(), Err(FoldError::Empty));
    }
}
