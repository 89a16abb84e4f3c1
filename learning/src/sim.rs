//! Minimal bundle arithmetic and an in-process FedAvg simulation (no network).
//!
//! The aggregator owns the real, streaming, signed strategies; these helpers exist for
//! tests, demos and SCAFFOLD bookkeeping.

use crate::data::Dataset;
use crate::error::LearningError;
use crate::eval::evaluate;
use crate::partition::Partition;
use crate::spec::ModelSpec;
use crate::train::{TrainConfig, train_local};
use fedfleet_protocol::bundle::TensorBundle;
use serde::{Deserialize, Serialize};

fn same_layout(a: &TensorBundle, b: &TensorBundle) -> Result<(), LearningError> {
    if a.layout() != b.layout() {
        return Err(LearningError::Layout(format!(
            "bundles differ: {:?} vs {:?}",
            a.layout().keys().collect::<Vec<_>>(),
            b.layout().keys().collect::<Vec<_>>()
        )));
    }
    Ok(())
}

fn values(b: &TensorBundle, name: &str) -> Result<Vec<f32>, LearningError> {
    b.to_f32(name).ok_or_else(|| LearningError::Layout(format!("{name} is not convertible to f32")))
}

/// `base + factor * delta`, tensor by tensor in f32 (`factor = ±1` is a plain f32 add/sub).
pub fn apply_delta(base: &TensorBundle, delta: &TensorBundle, factor: f32) -> Result<TensorBundle, LearningError> {
    same_layout(base, delta)?;
    let mut out = TensorBundle::new();
    for (name, shape) in base.layout() {
        let b = values(base, &name)?;
        let d = values(delta, &name)?;
        let v = b.iter().zip(&d).map(|(x, y)| x + factor * y).collect();
        out.insert_f32(&name, shape, v)?;
    }
    Ok(out)
}

/// `base + factor * update` for the tensors an update carries (frozen, LoRA or FedBN
/// training sends a subset of the model); the other tensors of `base` are copied unchanged.
/// Every tensor of `update` must be in `base` with the same shape.
pub fn apply_update(base: &TensorBundle, update: &TensorBundle, factor: f32) -> Result<TensorBundle, LearningError> {
    let layout = base.layout();
    for (name, shape) in update.layout() {
        match layout.get(&name) {
            Some(s) if *s == shape => {}
            Some(s) => return Err(LearningError::Layout(format!("update {name} has shape {shape:?}, the model {s:?}"))),
            None => return Err(LearningError::Layout(format!("update tensor {name} is not in the model"))),
        }
    }
    let mut out = TensorBundle::new();
    for (name, t) in base.iter() {
        if update.get(name).is_some() {
            let b = values(base, name)?;
            let d = values(update, name)?;
            out.insert_f32(name, t.shape.clone(), b.iter().zip(&d).map(|(x, y)| x + factor * y).collect())?;
        } else {
            out.insert(name, t.clone())?;
        }
    }
    Ok(out)
}

/// `factor * bundle`.
pub fn scale(bundle: &TensorBundle, factor: f32) -> Result<TensorBundle, LearningError> {
    let mut out = TensorBundle::new();
    for (name, shape) in bundle.layout() {
        let v = values(bundle, &name)?.iter().map(|x| factor * x).collect();
        out.insert_f32(&name, shape, v)?;
    }
    Ok(out)
}

/// Euclidean norm over every value.
pub fn l2_norm(bundle: &TensorBundle) -> f64 {
    bundle.layout().keys().filter_map(|n| bundle.to_f32(n)).flatten().map(|x| (x as f64) * (x as f64)).sum::<f64>().sqrt()
}

/// `Σ wᵢ·bᵢ / Σ wᵢ`, summed in f64 in the given order, rounded to f32 once.
pub fn weighted_average(items: &[(&TensorBundle, f64)]) -> Result<TensorBundle, LearningError> {
    let (first, _) = items.first().ok_or_else(|| LearningError::InvalidConfig("nothing to average".into()))?;
    let total: f64 = items.iter().map(|(_, w)| w).sum();
    if !(total > 0.0 && total.is_finite()) {
        return Err(LearningError::InvalidConfig("weights must sum to a positive finite value".into()));
    }
    let mut out = TensorBundle::new();
    for (name, shape) in first.layout() {
        let mut acc = vec![0.0f64; shape.iter().product()];
        for (b, w) in items {
            same_layout(first, b)?;
            for (a, v) in acc.iter_mut().zip(values(b, &name)?) {
                *a += w * v as f64;
            }
        }
        out.insert_f32(&name, shape, acc.iter().map(|a| (a / total) as f32).collect())?;
    }
    Ok(out)
}

/// Configuration of [`run_fedavg`].
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SimConfig {
    /// Model.
    pub spec: ModelSpec,
    /// Number of clients.
    pub clients: usize,
    /// How the training data is split.
    pub partition: Partition,
    /// Rounds.
    pub rounds: usize,
    /// Local training of every client.
    pub train: TrainConfig,
    /// Server learning rate on the averaged delta (1.0 = FedAvg).
    pub server_lr: f32,
    /// Seed for init, partition and local shuffles.
    pub seed: u64,
}

/// One round of the simulation.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RoundRecord {
    /// 1-based round.
    pub round: usize,
    /// Test accuracy of the new global model.
    pub accuracy: f64,
    /// Test loss of the new global model.
    pub loss: f64,
    /// Mean over clients of their last-epoch training loss.
    pub train_loss: f64,
}

/// Per-(round, client) training seed.
pub fn client_seed(seed: u64, round: usize, client: usize) -> u64 {
    let mut z = seed ^ ((round as u64) << 32) ^ (client as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// FedAvg over local deltas, every client every round, in process: returns the final global
/// bundle and the per-round test curve. `on_round` is called after each round.
pub fn run_fedavg(
    cfg: &SimConfig,
    train: &Dataset,
    test: &Dataset,
    mut on_round: impl FnMut(&RoundRecord),
) -> Result<(TensorBundle, Vec<RoundRecord>), LearningError> {
    let parts = cfg.partition.split_dataset(train, cfg.clients, cfg.seed);
    let mut global = crate::model::init_bundle(&cfg.spec, cfg.seed)?;
    let mut curve = Vec::with_capacity(cfg.rounds);
    for round in 1..=cfg.rounds {
        let mut outcomes = Vec::with_capacity(parts.len());
        for (c, part) in parts.iter().enumerate() {
            if part.is_empty() {
                continue;
            }
            outcomes.push(train_local(&cfg.spec, &global, part, &cfg.train, client_seed(cfg.seed, round, c))?);
        }
        let items: Vec<(&TensorBundle, f64)> = outcomes.iter().map(|o| (&o.delta, o.num_examples as f64)).collect();
        let avg = weighted_average(&items)?;
        global = apply_delta(&global, &avg, cfg.server_lr)?;
        let report = evaluate(&cfg.spec, &global, test)?;
        let train_loss =
            outcomes.iter().filter_map(|o| o.metrics.epochs.last().map(|e| e.loss)).sum::<f64>() / outcomes.len().max(1) as f64;
        let rec = RoundRecord { round, accuracy: report.accuracy, loss: report.loss, train_loss };
        on_round(&rec);
        curve.push(rec);
    }
    Ok((global, curve))
}
