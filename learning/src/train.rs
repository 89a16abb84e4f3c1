//! Local training: a manual burn loop (autodiff; SGD with momentum or Adam), the FedProx
//! proximal term, SCAFFOLD control-variate corrections, weight deltas and metrics.

use crate::data::Dataset;
use crate::error::LearningError;
use crate::model::{Net, read};
use crate::rng::{self, streams};
use crate::sim;
use crate::spec::ModelSpec;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, GradientsParams, ModuleOptimizer, SgdConfig};
use burn::tensor::activation::log_softmax;
use burn::tensor::{Device, Tensor, TensorData};
use fedfleet_protocol::bundle::TensorBundle;
use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};

/// Optimizer of local training (serde: `{"kind":"sgd","momentum":0.9}`,
/// `{"kind":"adam","beta1":0.9,"beta2":0.999,"epsilon":1e-8}`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum OptimizerConfig {
    /// SGD with heavy-ball momentum (PyTorch semantics: no dampening); 0 = plain SGD.
    Sgd {
        /// Momentum factor in [0, 1).
        #[serde(default)]
        momentum: f64,
    },
    /// Adam.
    Adam {
        /// First-moment decay.
        beta1: f32,
        /// Second-moment decay.
        beta2: f32,
        /// Numerical-stability term.
        epsilon: f32,
    },
}

impl OptimizerConfig {
    /// Adam with the usual defaults (0.9, 0.999, 1e-8).
    pub fn adam() -> Self {
        OptimizerConfig::Adam { beta1: 0.9, beta2: 0.999, epsilon: 1e-8 }
    }

    fn build(&self) -> ModuleOptimizer {
        match *self {
            OptimizerConfig::Sgd { momentum } if momentum > 0.0 => SgdConfig::new()
                .with_momentum(Some(MomentumConfig::new().with_momentum(momentum).with_dampening(0.0)))
                .init(),
            OptimizerConfig::Sgd { .. } => SgdConfig::new().init(),
            OptimizerConfig::Adam { beta1, beta2, epsilon } => {
                AdamConfig::new().with_beta_1(beta1).with_beta_2(beta2).with_epsilon(epsilon).init()
            }
        }
    }
}

/// Local training hyper-parameters (what a round's configuration carries to the agents).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TrainConfig {
    /// Passes over the local data.
    pub epochs: usize,
    /// Mini-batch size (the last batch of an epoch may be smaller).
    pub batch_size: usize,
    /// Learning rate.
    pub lr: f64,
    /// Optimizer.
    pub optimizer: OptimizerConfig,
    /// FedProx proximal coefficient: the loss gets `mu/2 * ||w - w_global||²`. 0 = FedAvg.
    pub prox_mu: f64,
    /// Stop after this many optimizer steps (None: run all epochs).
    pub max_steps: Option<usize>,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            epochs: 1,
            batch_size: 32,
            lr: 0.05,
            optimizer: OptimizerConfig::Sgd { momentum: 0.9 },
            prox_mu: 0.0,
            max_steps: None,
        }
    }
}

impl TrainConfig {
    fn validate(&self) -> Result<(), LearningError> {
        let bad = |m: &str| Err(LearningError::InvalidConfig(m.to_string()));
        if self.batch_size == 0 {
            return bad("batch_size must be > 0");
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad("lr must be finite and > 0");
        }
        if !(self.prox_mu.is_finite() && self.prox_mu >= 0.0) {
            return bad("prox_mu must be finite and >= 0");
        }
        if let OptimizerConfig::Sgd { momentum } = self.optimizer
            && !(0.0..1.0).contains(&momentum)
        {
            return bad("momentum must be in [0, 1)");
        }
        Ok(())
    }
}

/// Loss and accuracy of one epoch, over the mini-batches as they were trained.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EpochMetrics {
    /// Mean cross-entropy (without the proximal/SCAFFOLD terms).
    pub loss: f64,
    /// Fraction of examples predicted right (before each step's update).
    pub accuracy: f64,
}

/// What a local training run measured.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainMetrics {
    /// One entry per epoch run.
    pub epochs: Vec<EpochMetrics>,
    /// Optimizer steps taken.
    pub steps: usize,
    /// Examples processed (counting repeats across epochs).
    pub examples_processed: usize,
    /// Wall-clock time of the loop.
    pub wall_time: Duration,
    /// `examples_processed / wall_time`.
    pub examples_per_sec: f64,
    /// `||local - global||₂` over all parameters.
    pub delta_norm: f64,
}

/// Result of [`train_local`].
#[derive(Clone, Debug)]
pub struct TrainOutcome {
    /// `local - global`, tensor by tensor, f32, same names/shapes as the global bundle.
    pub delta: TensorBundle,
    /// Number of distinct local examples (the FedAvg weight).
    pub num_examples: usize,
    /// Training metrics.
    pub metrics: TrainMetrics,
}

/// SCAFFOLD control variates (Karimireddy et al. 2020), both with the model's layout.
#[derive(Clone, Debug)]
pub struct ScaffoldState {
    /// Server control variate `c`.
    pub server_c: TensorBundle,
    /// This client's control variate `c_i`.
    pub client_c: TensorBundle,
}

/// What SCAFFOLD adds to a training outcome.
#[derive(Clone, Debug)]
pub struct ScaffoldOutcome {
    /// New client variate `c_i⁺ = c_i - c + (x - y_i) / (K·lr)` (option II), K = steps.
    pub client_c: TensorBundle,
    /// `c_i⁺ - c_i`, what the client sends next to its model delta.
    pub client_c_delta: TensorBundle,
}

/// Trains `spec` from `global` on `data` and returns the weight delta, the example count and
/// metrics. Deterministic: same inputs and `seed` ⇒ the same delta, bit for bit (CPU backend).
pub fn train_local(
    spec: &ModelSpec,
    global: &TensorBundle,
    data: &Dataset,
    config: &TrainConfig,
    seed: u64,
) -> Result<TrainOutcome, LearningError> {
    train_inner(spec, global, data, config, seed, None)
}

/// [`train_local`] with SCAFFOLD's gradient correction: every step follows
/// `g + c - c_i` (implemented as the loss term `Σ w·(c - c_i)`, whose gradient is exactly
/// that correction, so it also composes with momentum/Adam and FedProx). Returns the usual
/// outcome plus the client's new control variate. The aggregator owns the server variate.
pub fn train_local_scaffold(
    spec: &ModelSpec,
    global: &TensorBundle,
    data: &Dataset,
    config: &TrainConfig,
    seed: u64,
    scaffold: &ScaffoldState,
) -> Result<(TrainOutcome, ScaffoldOutcome), LearningError> {
    let correction = sim::apply_delta(&scaffold.server_c, &scaffold.client_c, -1.0)?; // c - c_i
    let outcome = train_inner(spec, global, data, config, seed, Some(&correction))?;
    let k = outcome.metrics.steps.max(1) as f64;
    // c_i+ = c_i - c - delta / (K lr) = -(c - c_i) - delta/(K lr)
    let neg_corr = sim::scale(&correction, -1.0)?;
    let client_c = sim::apply_delta(&neg_corr, &outcome.delta, (-1.0 / (k * config.lr)) as f32)?;
    let client_c_delta = sim::apply_delta(&client_c, &scaffold.client_c, -1.0)?;
    Ok((outcome, ScaffoldOutcome { client_c, client_c_delta }))
}

fn train_inner(
    spec: &ModelSpec,
    global: &TensorBundle,
    data: &Dataset,
    config: &TrainConfig,
    seed: u64,
    correction: Option<&TensorBundle>,
) -> Result<TrainOutcome, LearningError> {
    config.validate()?;
    check_data(spec, data)?;
    let device = crate::train_device();
    let plain = crate::cpu_device();
    let mut net = Net::from_bundle(spec, global, &device)?;
    // Constants (no autodiff) for the proximal and SCAFFOLD terms, in burn's layout.
    let anchor: Option<Vec<Tensor<1>>> =
        (config.prox_mu > 0.0).then(|| Net::from_bundle(spec, global, &plain).map(|n| n.flat_params())).transpose()?;
    let corr: Option<Vec<Tensor<1>>> =
        correction.map(|c| Net::from_bundle(spec, c, &plain).map(|n| n.flat_params())).transpose()?;
    let mut optim = config.optimizer.build();
    let mut r = rng::rng(seed, streams::SHUFFLE);
    let n = data.len();
    let f = data.example_len();
    let classes = spec.classes();
    let mut order: Vec<usize> = (0..n).collect();
    let mut epochs = Vec::new();
    let mut steps = 0usize;
    let mut processed = 0usize;
    let start = Instant::now();
    'outer: for _epoch in 0..config.epochs {
        rng::shuffle(&mut r, &mut order);
        let (mut loss_sum, mut correct, mut seen) = (0.0f64, 0usize, 0usize);
        for batch in order.chunks(config.batch_size) {
            if config.max_steps.is_some_and(|m| steps >= m) {
                if seen > 0 {
                    epochs.push(EpochMetrics { loss: loss_sum / seen as f64, accuracy: correct as f64 / seen as f64 });
                }
                break 'outer;
            }
            let b = batch.len();
            let (x, onehot) = batch_tensors(data, batch, f, classes, &device);
            let logits = net.forward_flat(spec, x);
            let logits_val = read(logits.clone().without_autodiff())?;
            correct += count_correct(&logits_val, &data.labels, batch, classes);
            let ce = (log_softmax(logits, 1) * onehot).sum().mul_scalar(-1.0 / b as f64);
            let ce_val = ce.clone().into_scalar::<f32>();
            if !ce_val.is_finite() {
                return Err(LearningError::NonFinite { step: steps });
            }
            let mut loss = ce;
            if let Some(anchor) = &anchor {
                let mut prox: Option<Tensor<1>> = None;
                for (p, p0) in net.flat_params().into_iter().zip(anchor) {
                    let t = (p - p0.clone()).powi_scalar(2).sum();
                    prox = Some(match prox { Some(acc) => acc + t, None => t });
                }
                loss = loss + prox.expect("params").mul_scalar(config.prox_mu / 2.0);
            }
            if let Some(corr) = &corr {
                for (p, c) in net.flat_params().into_iter().zip(corr) {
                    loss = loss + (p * c.clone()).sum();
                }
            }
            let grads = loss.backward();
            let grads = GradientsParams::from_grads(grads, &net);
            net = optim.step(config.lr, net, grads);
            steps += 1;
            loss_sum += ce_val as f64 * b as f64;
            seen += b;
            processed += b;
        }
        epochs.push(EpochMetrics { loss: loss_sum / seen.max(1) as f64, accuracy: correct as f64 / seen.max(1) as f64 });
    }
    let wall_time = start.elapsed();
    let local = net.to_bundle()?;
    let delta = sim::apply_delta(&local, global, -1.0)?;
    let delta_norm = sim::l2_norm(&delta);
    Ok(TrainOutcome {
        delta,
        num_examples: n,
        metrics: TrainMetrics {
            epochs,
            steps,
            examples_processed: processed,
            wall_time,
            examples_per_sec: processed as f64 / wall_time.as_secs_f64().max(1e-9),
            delta_norm,
        },
    })
}

/// Checks the data fits the model.
pub(crate) fn check_data(spec: &ModelSpec, data: &Dataset) -> Result<(), LearningError> {
    spec.validate()?;
    if data.is_empty() {
        return Err(LearningError::InputMismatch("the data set is empty".into()));
    }
    if data.example_len() != spec.input_len() {
        return Err(LearningError::InputMismatch(format!(
            "examples have shape {:?} ({} values), the {} expects {:?}",
            data.shape,
            data.example_len(),
            spec.arch(),
            spec.input_shape()
        )));
    }
    if data.features.len() != data.len() * data.example_len() {
        return Err(LearningError::InputMismatch("feature buffer length does not match labels".into()));
    }
    if let Some(&l) = data.labels.iter().find(|&&l| l as usize >= spec.classes()) {
        return Err(LearningError::InputMismatch(format!("label {l} is not below {} classes", spec.classes())));
    }
    Ok(())
}

fn batch_tensors(data: &Dataset, batch: &[usize], f: usize, classes: usize, device: &Device) -> (Tensor<2>, Tensor<2>) {
    let b = batch.len();
    let mut xs = Vec::with_capacity(b * f);
    let mut ys = vec![0.0f32; b * classes];
    for (row, &i) in batch.iter().enumerate() {
        xs.extend_from_slice(data.example(i));
        ys[row * classes + data.labels[i] as usize] = 1.0;
    }
    (
        Tensor::from_data(TensorData::new(xs, [b, f]), device),
        Tensor::from_data(TensorData::new(ys, [b, classes]), device),
    )
}

/// Index of the largest logit in each row (first one on ties).
pub(crate) fn argmax_rows(logits: &[f32], classes: usize) -> impl Iterator<Item = usize> + '_ {
    logits.chunks(classes).map(|row| {
        let mut best = 0;
        for (j, &v) in row.iter().enumerate() {
            if v > row[best] {
                best = j;
            }
        }
        best
    })
}

fn count_correct(logits: &[f32], labels: &[u32], batch: &[usize], classes: usize) -> usize {
    argmax_rows(logits, classes).zip(batch).filter(|&(p, &i)| p == labels[i] as usize).count()
}
