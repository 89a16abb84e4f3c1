//! Seeded partitioners: split one data set's examples across clients (IID, Dirichlet label
//! skew, label shards), and the Synthetic(alpha, beta) generator of Li et al., "Federated
//! Optimization in Heterogeneous Networks" (FedProx, MLSys 2020).
//!
//! Every function is a pure function of its arguments and `seed`.

use crate::data::Dataset;
use crate::rng::{self, streams};
use serde::{Deserialize, Serialize};

/// A partitioning scheme (serde form: `{"kind":"dirichlet","alpha":0.5}`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Partition {
    /// Shuffle, then deal out equal shares.
    Iid,
    /// Per class, client proportions ~ Dirichlet(alpha); small alpha = strong label skew.
    Dirichlet {
        /// Concentration.
        alpha: f64,
    },
    /// Sort by label, cut into `clients * per_client` shards, give each client `per_client`
    /// random shards (McMahan et al. 2017).
    Shards {
        /// Shards per client.
        per_client: usize,
    },
}

impl Partition {
    /// Example indices per client (each index in exactly one client; each list sorted).
    pub fn split(&self, labels: &[u32], num_classes: usize, clients: usize, seed: u64) -> Vec<Vec<usize>> {
        match *self {
            Partition::Iid => iid(labels.len(), clients, seed),
            Partition::Dirichlet { alpha } => dirichlet(labels, num_classes, clients, alpha, seed),
            Partition::Shards { per_client } => shards(labels, clients, per_client, seed),
        }
    }

    /// Splits a data set into per-client data sets.
    pub fn split_dataset(&self, data: &Dataset, clients: usize, seed: u64) -> Vec<Dataset> {
        self.split(&data.labels, data.num_classes, clients, seed).iter().map(|idx| data.subset(idx)).collect()
    }
}

/// IID: a seeded permutation dealt into `clients` shares whose sizes differ by at most one.
pub fn iid(n: usize, clients: usize, seed: u64) -> Vec<Vec<usize>> {
    assert!(clients > 0, "clients must be > 0");
    let mut r = rng::rng(seed, streams::PARTITION);
    let mut idx: Vec<usize> = (0..n).collect();
    rng::shuffle(&mut r, &mut idx);
    let mut out: Vec<Vec<usize>> = (0..clients)
        .map(|c| {
            let (lo, hi) = (c * n / clients, (c + 1) * n / clients);
            idx[lo..hi].to_vec()
        })
        .collect();
    out.iter_mut().for_each(|v| v.sort_unstable());
    out
}

/// Dirichlet label skew (Hsu et al. 2019; the NIID-Bench procedure): for each class, draw
/// client proportions p ~ Dir(alpha), zero out clients that already hold more than n/clients,
/// and cut the class's shuffled examples at the cumulative proportions. Redrawn (from the same
/// seeded stream) until every client holds at least `min(10, n / (2 * clients))` examples,
/// or after 1,000 attempts the last draw is kept.
pub fn dirichlet(labels: &[u32], num_classes: usize, clients: usize, alpha: f64, seed: u64) -> Vec<Vec<usize>> {
    assert!(clients > 0, "clients must be > 0");
    assert!(alpha > 0.0 && alpha.is_finite(), "alpha must be > 0");
    let n = labels.len();
    let min_size = 10.min(n / (2 * clients));
    let mut r = rng::rng(seed, streams::PARTITION);
    let by_class: Vec<Vec<usize>> = (0..num_classes as u32).map(|k| (0..n).filter(|&i| labels[i] == k).collect()).collect();
    let mut parts: Vec<Vec<usize>> = Vec::new();
    for _attempt in 0..1000 {
        parts = vec![Vec::new(); clients];
        for class_idx in &by_class {
            let mut idx = class_idx.clone();
            rng::shuffle(&mut r, &mut idx);
            let mut p = rng::dirichlet(&mut r, alpha, clients);
            for (j, pj) in p.iter_mut().enumerate() {
                if parts[j].len() >= n / clients {
                    *pj = 0.0;
                }
            }
            let s: f64 = p.iter().sum();
            if s <= 0.0 {
                // Every client is full: spread this class evenly.
                p.iter_mut().for_each(|x| *x = 1.0 / clients as f64);
            } else {
                p.iter_mut().for_each(|x| *x /= s);
            }
            let mut start = 0usize;
            let mut acc = 0.0f64;
            for (j, pj) in p.iter().enumerate() {
                acc += pj;
                let end = if j + 1 == clients { idx.len() } else { ((acc * idx.len() as f64) as usize).min(idx.len()) };
                let end = end.max(start);
                parts[j].extend_from_slice(&idx[start..end]);
                start = end;
            }
        }
        if parts.iter().map(Vec::len).min().unwrap_or(0) >= min_size {
            break;
        }
    }
    parts.iter_mut().for_each(|v| v.sort_unstable());
    parts
}

/// Label shards: examples sorted by (label, seeded tie-break), cut into `clients * per_client`
/// equal shards; each client gets `per_client` shards chosen by a seeded permutation.
pub fn shards(labels: &[u32], clients: usize, per_client: usize, seed: u64) -> Vec<Vec<usize>> {
    assert!(clients > 0 && per_client > 0, "clients and per_client must be > 0");
    let mut r = rng::rng(seed, streams::PARTITION);
    let n = labels.len();
    let mut idx: Vec<usize> = (0..n).collect();
    rng::shuffle(&mut r, &mut idx);
    idx.sort_by_key(|&i| labels[i]); // stable: the shuffle breaks ties
    let total = clients * per_client;
    let mut shard_ids: Vec<usize> = (0..total).collect();
    rng::shuffle(&mut r, &mut shard_ids);
    let mut out = vec![Vec::new(); clients];
    for (pos, &s) in shard_ids.iter().enumerate() {
        let (lo, hi) = (s * n / total, (s + 1) * n / total);
        out[pos / per_client].extend_from_slice(&idx[lo..hi]);
    }
    out.iter_mut().for_each(|v| v.sort_unstable());
    out
}

/// Class histogram of each client's part.
pub fn label_histograms(labels: &[u32], num_classes: usize, parts: &[Vec<usize>]) -> Vec<Vec<usize>> {
    parts
        .iter()
        .map(|p| {
            let mut h = vec![0usize; num_classes];
            p.iter().for_each(|&i| h[labels[i] as usize] += 1);
            h
        })
        .collect()
}

/// Configuration of the Synthetic(alpha, beta) federated data set (Li et al. 2020, after
/// Shamir et al. 2014). `alpha` controls how much local models differ, `beta` how much local
/// input distributions differ. Synthetic(0,0), (0.5,0.5) and (1,1) are the paper's settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SyntheticConfig {
    /// Model heterogeneity.
    pub alpha: f64,
    /// Data heterogeneity.
    pub beta: f64,
    /// Number of clients (the paper uses 30).
    pub clients: usize,
    /// Input dimension (60).
    pub dim: usize,
    /// Classes (10).
    pub classes: usize,
    /// Examples per client: `None` = the paper's power law, `floor(LogNormal(4, 2)) + 50`,
    /// capped at `max_per_client`; `Some(n)` = n each.
    pub per_client: Option<usize>,
    /// Cap on the power-law sizes.
    pub max_per_client: usize,
}

impl SyntheticConfig {
    /// Synthetic(alpha, beta) with the paper's sizes (30 clients, 60 dims, 10 classes, power-law
    /// sample counts capped at 2,000).
    pub fn new(alpha: f64, beta: f64) -> Self {
        SyntheticConfig { alpha, beta, clients: 30, dim: 60, classes: 10, per_client: None, max_per_client: 2000 }
    }
}

/// Generates one data set per client. For client k (as in the paper's generator):
/// `u_k ~ N(0, alpha²)`, `B_k ~ N(0, beta²)`, `v_k[j] ~ N(B_k, 1)`,
/// `W_k[i][c] ~ N(u_k, 1)`, `b_k[c] ~ N(u_k, 1)`, `x ~ N(v_k, Σ)` with diagonal
/// `Σ_jj = (j+1)^-1.2`, and `y = argmax(softmax(W_kᵀ x + b_k))`.
pub fn synthetic(cfg: &SyntheticConfig, seed: u64) -> Vec<Dataset> {
    let mut r = rng::rng(seed, streams::SYNTHETIC);
    let sizes: Vec<usize> = (0..cfg.clients)
        .map(|_| match cfg.per_client {
            Some(n) => n,
            None => {
                let ln = (4.0 + 2.0 * rng::normal(&mut r)).exp();
                ((ln.floor() as usize).saturating_add(50)).min(cfg.max_per_client.max(1))
            }
        })
        .collect();
    let mean_w: Vec<f64> = (0..cfg.clients).map(|_| cfg.alpha * rng::normal(&mut r)).collect();
    let b_shift: Vec<f64> = (0..cfg.clients).map(|_| cfg.beta * rng::normal(&mut r)).collect();
    let sd: Vec<f64> = (0..cfg.dim).map(|j| ((j + 1) as f64).powf(-1.2).sqrt()).collect();
    (0..cfg.clients)
        .map(|k| {
            let v: Vec<f64> = (0..cfg.dim).map(|_| b_shift[k] + rng::normal(&mut r)).collect();
            let w: Vec<f64> = (0..cfg.dim * cfg.classes).map(|_| mean_w[k] + rng::normal(&mut r)).collect();
            let b: Vec<f64> = (0..cfg.classes).map(|_| mean_w[k] + rng::normal(&mut r)).collect();
            let mut features = Vec::with_capacity(sizes[k] * cfg.dim);
            let mut labels = Vec::with_capacity(sizes[k]);
            for _ in 0..sizes[k] {
                let x: Vec<f64> = (0..cfg.dim).map(|j| v[j] + sd[j] * rng::normal(&mut r)).collect();
                let mut best = (f64::NEG_INFINITY, 0usize);
                for c in 0..cfg.classes {
                    let mut z = b[c];
                    for j in 0..cfg.dim {
                        z += x[j] * w[j * cfg.classes + c];
                    }
                    if z > best.0 {
                        best = (z, c);
                    }
                }
                features.extend(x.iter().map(|&f| f as f32));
                labels.push(best.1 as u32);
            }
            Dataset { features, labels, targets: Vec::new(), shape: vec![cfg.dim], num_classes: cfg.classes }
        })
        .collect()
}
