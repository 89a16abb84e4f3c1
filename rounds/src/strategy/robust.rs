//! Byzantine-robust strategies: coordinate-wise median, coordinate-wise trimmed mean (Yin et al.
//! 2018) and (Multi-)Krum (Blanchard et al. 2017).
//!
//! Unlike the FedAvg family these need every update of the round at once, so they cannot fold
//! into O(model) memory. Each update is pushed into a [`SpillStore`], which is **bounded** (it
//! refuses updates past its capacity with [`SpillError::Full`], which the shell answers with
//! `overloaded`), and read back at finalize in blocks of coordinates: for a block of `B`
//! coordinates the strategy holds `n × B` floats (`B` is chosen so that this stays under
//! [`BLOCK_FLOATS`]), plus an `n × n` distance matrix for Krum. [`MemorySpill`] keeps updates in
//! RAM (tests, small fleets); a disk-backed store (files or sled, written by the shell) implements
//! the same trait so that memory stays bounded whatever the model size.
//!
//! These strategies are unweighted: sample counts are recorded but do not change the result, so
//! a device cannot buy influence by claiming more samples. Determinism: each update gets a content
//! key (BLAKE3 of its weight and bytes) and the strategies work in key order, never arrival order.

use serde::{Deserialize, Serialize};

use super::{Aggregation, StrategyError};

/// Floats of update data a robust strategy holds at once while finalizing (4 MiB).
pub const BLOCK_FLOATS: usize = 1 << 20;

/// Why the spill store refused or failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum SpillError {
    #[error("spill store is full ({capacity} updates)")]
    Full { capacity: usize },
    #[error("update has {got} elements, the model has {expected}")]
    ShapeMismatch { expected: usize, got: usize },
    #[error("element {index} is NaN or infinite")]
    NonFinite { index: usize },
    #[error("spill store index {index} out of range")]
    NoSuchUpdate { index: usize },
    /// A backing-store failure (disk implementations).
    #[error("spill store: {0}")]
    Backend(String),
}

/// Bounded storage for the updates of one round.
///
/// Implementations must return exactly the bytes pushed. Reads are by (update, coordinate range)
/// so a disk-backed store can serve column blocks without loading whole updates.
pub trait SpillStore {
    /// Coordinates per update.
    fn dim(&self) -> usize;
    /// Updates stored.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Most updates this store accepts.
    fn capacity(&self) -> usize;
    /// Stores one update; `key` is its content key. The delta has been validated (shape, finite).
    fn push(&mut self, delta: &[f32], weight: u64, key: [u8; 32]) -> Result<(), SpillError>;
    /// Weight of update `index`.
    fn weight(&self, index: usize) -> u64;
    /// Content key of update `index`.
    fn key(&self, index: usize) -> [u8; 32];
    /// Copies coordinates `offset .. offset + out.len()` of update `index` into `out`.
    fn read(&self, index: usize, offset: usize, out: &mut [f32]) -> Result<(), SpillError>;
    /// Drops every update (end of round).
    fn clear(&mut self) -> Result<(), SpillError>;
}

/// A [`SpillStore`] in RAM, bounded by `max_updates`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemorySpill {
    dim: usize,
    max_updates: usize,
    data: Vec<f32>,
    weights: Vec<u64>,
    keys: Vec<[u8; 32]>,
}

impl MemorySpill {
    pub fn new(dim: usize, max_updates: usize) -> Self {
        MemorySpill { dim, max_updates, data: Vec::new(), weights: Vec::new(), keys: Vec::new() }
    }
}

impl SpillStore for MemorySpill {
    fn dim(&self) -> usize {
        self.dim
    }
    fn len(&self) -> usize {
        self.weights.len()
    }
    fn capacity(&self) -> usize {
        self.max_updates
    }
    fn push(&mut self, delta: &[f32], weight: u64, key: [u8; 32]) -> Result<(), SpillError> {
        if self.len() >= self.max_updates {
            return Err(SpillError::Full { capacity: self.max_updates });
        }
        if delta.len() != self.dim {
            return Err(SpillError::ShapeMismatch { expected: self.dim, got: delta.len() });
        }
        self.data.extend_from_slice(delta);
        self.weights.push(weight);
        self.keys.push(key);
        Ok(())
    }
    fn weight(&self, index: usize) -> u64 {
        self.weights[index]
    }
    fn key(&self, index: usize) -> [u8; 32] {
        self.keys[index]
    }
    fn read(&self, index: usize, offset: usize, out: &mut [f32]) -> Result<(), SpillError> {
        if index >= self.len() || offset + out.len() > self.dim {
            return Err(SpillError::NoSuchUpdate { index });
        }
        let start = index * self.dim + offset;
        out.copy_from_slice(&self.data[start..start + out.len()]);
        Ok(())
    }
    fn clear(&mut self) -> Result<(), SpillError> {
        self.data.clear();
        self.weights.clear();
        self.keys.clear();
        Ok(())
    }
}

/// A robust step: it holds every update of the round whole (in its [`SpillStore`]) and combines
/// them when the round closes. Folding, counting and clearing are this one [`Aggregation`] impl;
/// a new robust step states only its name, its store and how it combines.
pub trait HoldsEveryUpdate {
    type Store: SpillStore;
    const NAME: &'static str;
    fn held(&self) -> &Self::Store;
    fn held_mut(&mut self) -> &mut Self::Store;
    /// The round's aggregate delta from the held updates (cleared afterwards).
    fn combine(&self) -> Result<Vec<f64>, StrategyError>;
}

impl<R: HoldsEveryUpdate> Aggregation for R {
    fn name(&self) -> &'static str {
        R::NAME
    }
    fn dim(&self) -> usize {
        self.held().dim()
    }
    fn fold(&mut self, delta: &[f32], weight: u64) -> Result<(), StrategyError> {
        spill(self.held_mut(), delta, weight)
    }
    fn folded(&self) -> u64 {
        self.held().len() as u64
    }
    fn aggregate(&mut self) -> Result<Vec<f64>, StrategyError> {
        let aggregate = self.combine()?;
        self.held_mut().clear()?;
        Ok(aggregate)
    }
    fn abort_round(&mut self) {
        let _ = self.held_mut().clear();
    }
}

/// Validates and pushes one update with its content key.
fn spill<S: SpillStore>(store: &mut S, delta: &[f32], weight: u64) -> Result<(), StrategyError> {
    if delta.len() != store.dim() {
        return Err(SpillError::ShapeMismatch { expected: store.dim(), got: delta.len() }.into());
    }
    if let Some(index) = delta.iter().position(|x| !x.is_finite()) {
        return Err(SpillError::NonFinite { index }.into());
    }
    super::fixed::check_weight(weight)?;
    let mut h = blake3::Hasher::new();
    h.update(&weight.to_le_bytes());
    for c in delta.chunks(4096) {
        for x in c {
            h.update(&x.to_le_bytes());
        }
    }
    store.push(delta, weight, *h.finalize().as_bytes())?;
    Ok(())
}

/// Update indices in canonical (content-key) order.
fn canonical_order<S: SpillStore>(store: &S) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..store.len()).collect();
    idx.sort_by_key(|&i| (store.key(i), store.weight(i)));
    idx
}

/// Walks the coordinates in blocks: `f(offset, width, rows)` where `rows[r*width..(r+1)*width]`
/// is block `offset..offset+width` of the `r`-th update in canonical order.
fn for_each_block<S: SpillStore>(store: &S, mut f: impl FnMut(usize, usize, &[f32])) -> Result<(), StrategyError> {
    let n = store.len();
    let dim = store.dim();
    let order = canonical_order(store);
    let width = (BLOCK_FLOATS / n.max(1)).clamp(1, dim.max(1));
    let mut rows = vec![0f32; n * width];
    let mut offset = 0;
    while offset < dim {
        let w = width.min(dim - offset);
        for (r, &i) in order.iter().enumerate() {
            store.read(i, offset, &mut rows[r * w..(r + 1) * w])?;
        }
        f(offset, w, &rows[..n * w]);
        offset += w;
    }
    Ok(())
}

/// Applies a per-coordinate statistic of the sorted column to every coordinate.
fn coordinatewise<S: SpillStore>(store: &S, mut stat: impl FnMut(&[f32]) -> f64) -> Result<Vec<f64>, StrategyError> {
    let n = store.len();
    let mut out = vec![0f64; store.dim()];
    let mut col = vec![0f32; n];
    for_each_block(store, |offset, w, rows| {
        for j in 0..w {
            for r in 0..n {
                col[r] = rows[r * w + j];
            }
            col.sort_unstable_by(f32::total_cmp);
            out[offset + j] = stat(&col);
        }
    })?;
    Ok(out)
}

/// Coordinate-wise median of the deltas (the mean of the two middle values for even counts).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Median<S> {
    store: S,
}

impl<S: SpillStore> Median<S> {
    pub fn new(store: S) -> Self {
        Median { store }
    }
}

impl<S: SpillStore> HoldsEveryUpdate for Median<S> {
    type Store = S;
    const NAME: &'static str = "median";
    fn held(&self) -> &S {
        &self.store
    }
    fn held_mut(&mut self) -> &mut S {
        &mut self.store
    }
    fn combine(&self) -> Result<Vec<f64>, StrategyError> {
        let n = self.store.len();
        if n == 0 {
            return Err(StrategyError::TooFewUpdates { strategy: Self::NAME, need: 1, got: 0 });
        }
        let med =
            coordinatewise(&self.store, |c| if n % 2 == 1 { c[n / 2] as f64 } else { (c[n / 2 - 1] as f64 + c[n / 2] as f64) / 2.0 })?;
        Ok(med)
    }
}

/// Coordinate-wise trimmed mean: drop the `⌊β·n⌋` smallest and largest values of each
/// coordinate, average the rest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrimmedMean<S> {
    trim_fraction: f64,
    store: S,
}

impl<S: SpillStore> TrimmedMean<S> {
    pub fn new(trim_fraction: f64, store: S) -> Result<Self, StrategyError> {
        if !(0.0..0.5).contains(&trim_fraction) {
            return Err(StrategyError::BadParameter(format!("trim_fraction must be in [0, 0.5), got {trim_fraction}")));
        }
        Ok(TrimmedMean { trim_fraction, store })
    }
}

impl<S: SpillStore> HoldsEveryUpdate for TrimmedMean<S> {
    type Store = S;
    const NAME: &'static str = "trimmed_mean";
    fn held(&self) -> &S {
        &self.store
    }
    fn held_mut(&mut self) -> &mut S {
        &mut self.store
    }
    fn combine(&self) -> Result<Vec<f64>, StrategyError> {
        let n = self.store.len();
        let k = (self.trim_fraction * n as f64).floor() as usize;
        if n == 0 || n <= 2 * k {
            return Err(StrategyError::TooFewUpdates { strategy: Self::NAME, need: 2 * k + 1, got: n });
        }
        let kept = (n - 2 * k) as f64;
        let mean = coordinatewise(&self.store, |c| c[k..n - k].iter().map(|&x| x as f64).sum::<f64>() / kept)?;
        Ok(mean)
    }
}

/// (Multi-)Krum: score each update by the sum of squared distances to its `n − f − 2` nearest
/// neighbours, average the `select` lowest-scoring updates (`select = 1` is plain Krum). Needs
/// `n ≥ 2f + 3`. Cost O(n²·dim) time, O(n² + BLOCK_FLOATS) memory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Krum<S> {
    byzantine: usize,
    select: usize,
    store: S,
}

impl<S: SpillStore> Krum<S> {
    pub fn new(byzantine: usize, select: usize, store: S) -> Result<Self, StrategyError> {
        if select == 0 {
            return Err(StrategyError::BadParameter("krum select must be >= 1".into()));
        }
        Ok(Krum { byzantine, select, store })
    }

    /// Indices (into the store) of the selected updates, best first.
    pub fn selection(&self) -> Result<Vec<usize>, StrategyError> {
        let n = self.store.len();
        let need = (2 * self.byzantine + 3).max(self.select);
        if n < need {
            return Err(StrategyError::TooFewUpdates { strategy: Self::NAME, need, got: n });
        }
        let order = canonical_order(&self.store);
        let mut dist = vec![0f64; n * n];
        for_each_block(&self.store, |_, w, rows| {
            for a in 0..n {
                let ra = &rows[a * w..(a + 1) * w];
                for b in a + 1..n {
                    let rb = &rows[b * w..(b + 1) * w];
                    let d: f64 = ra.iter().zip(rb).map(|(&x, &y)| (x as f64 - y as f64).powi(2)).sum();
                    dist[a * n + b] += d;
                    dist[b * n + a] += d;
                }
            }
        })?;
        let neighbours = n - self.byzantine - 2;
        let mut row = Vec::with_capacity(n);
        let mut scores: Vec<(f64, usize)> = (0..n)
            .map(|a| {
                row.clear();
                row.extend((0..n).filter(|&b| b != a).map(|b| dist[a * n + b]));
                row.sort_unstable_by(f64::total_cmp);
                (row[..neighbours].iter().sum::<f64>(), a)
            })
            .collect();
        // Ties break on canonical position, i.e. on content: never on arrival order.
        scores.sort_by(|x, y| x.0.total_cmp(&y.0).then(x.1.cmp(&y.1)));
        Ok(scores[..self.select].iter().map(|&(_, a)| order[a]).collect())
    }
}

impl<S: SpillStore> HoldsEveryUpdate for Krum<S> {
    type Store = S;
    const NAME: &'static str = "krum";
    fn held(&self) -> &S {
        &self.store
    }
    fn held_mut(&mut self) -> &mut S {
        &mut self.store
    }
    fn combine(&self) -> Result<Vec<f64>, StrategyError> {
        let mut chosen = self.selection()?;
        chosen.sort_by_key(|&i| (self.store.key(i), self.store.weight(i)));
        let dim = self.store.dim();
        let mut mean = vec![0f64; dim];
        let mut buf = vec![0f32; dim.min(BLOCK_FLOATS)];
        let mut offset = 0;
        while offset < dim {
            let w = buf.len().min(dim - offset);
            for &i in &chosen {
                self.store.read(i, offset, &mut buf[..w])?;
                for (m, &x) in mean[offset..offset + w].iter_mut().zip(&buf[..w]) {
                    *m += x as f64;
                }
            }
            offset += w;
        }
        let k = chosen.len() as f64;
        mean.iter_mut().for_each(|m| *m /= k);
        Ok(mean)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_cover_every_coordinate_in_canonical_order() {
        let mut s = MemorySpill::new(3, 10);
        spill(&mut s, &[1.0, 2.0, 3.0], 1).unwrap();
        spill(&mut s, &[4.0, 5.0, 6.0], 1).unwrap();
        let mut seen = 0;
        for_each_block(&s, |off, w, rows| {
            assert_eq!(off, 0);
            assert_eq!(w, 3);
            assert_eq!(rows.len(), 6);
            seen += 1;
        })
        .unwrap();
        assert_eq!(seen, 1);
        assert!(matches!(spill(&mut s, &[f32::NAN, 0.0, 0.0], 1), Err(StrategyError::Spill(SpillError::NonFinite { index: 0 }))));
        let mut full = MemorySpill::new(1, 1);
        spill(&mut full, &[1.0], 1).unwrap();
        assert!(matches!(spill(&mut full, &[1.0], 1), Err(StrategyError::Spill(SpillError::Full { capacity: 1 }))));
    }
}
