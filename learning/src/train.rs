//! Local training: a manual burn loop (autodiff; SGD with momentum or Adam), the FedProx
//! proximal term, SCAFFOLD control-variate corrections, weight deltas and metrics.

use crate::data::Dataset;
use crate::error::LearningError;
use crate::graph::{Plan, Task, updated_slots};
use crate::model::{Net, TrainCtx, read};
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
            OptimizerConfig::Sgd { momentum } if momentum > 0.0 => {
                SgdConfig::new().with_momentum(Some(MomentumConfig::new().with_momentum(momentum).with_dampening(0.0))).init()
            }
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
    #[serde(alias = "epochs")]
    pub local_epochs: usize,
    /// Mini-batch size (the last batch of an epoch may be smaller).
    pub batch_size: usize,
    /// Learning rate.
    #[serde(alias = "lr")]
    pub learning_rate: f64,
    /// Optimizer.
    pub optimizer: OptimizerConfig,
    /// FedProx proximal coefficient: the loss gets `mu/2 * ||w - w_global||²`. 0 = FedAvg.
    #[serde(alias = "prox_mu")]
    pub proximal_mu: f64,
    /// Stop after this many optimizer steps (None: run all epochs).
    pub max_steps: Option<usize>,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            local_epochs: 1,
            batch_size: 32,
            learning_rate: 0.05,
            optimizer: OptimizerConfig::Sgd { momentum: 0.9 },
            proximal_mu: 0.0,
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
        if !(self.learning_rate.is_finite() && self.learning_rate > 0.0) {
            return bad("learning_rate must be finite and > 0");
        }
        if !(self.proximal_mu.is_finite() && self.proximal_mu >= 0.0) {
            return bad("proximal_mu must be finite and >= 0");
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
    /// Mean task loss (cross-entropy, or MSE for regression/reconstruction), without the
    /// proximal/SCAFFOLD terms.
    pub loss: f64,
    /// Classification: fraction of examples predicted right (before each step's update).
    /// Other tasks: 0.
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
    /// `||local - global||₂` over the tensors of the update.
    pub delta_norm: f64,
    /// Size of the update (the delta as safetensors bytes, f32).
    #[serde(default)]
    pub update_bytes: usize,
}

/// Result of [`train_local`].
#[derive(Clone, Debug)]
pub struct TrainOutcome {
    /// `local - global` for the tensors an update carries ([`ModelSpec::update_layout`]): with
    /// full fine-tuning every tensor, frozen ones and FedBN-local ones left out, under LoRA only
    /// the adapters. f32.
    pub delta: TensorBundle,
    /// The trained values of tensors kept on the device (FedBN `local` batch norms); empty
    /// otherwise. Overlay them on the next global model before training again.
    pub local_state: TensorBundle,
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
    let client_c = sim::apply_delta(&neg_corr, &outcome.delta, (-1.0 / (k * config.learning_rate)) as f32)?;
    let client_c_delta = sim::apply_delta(&client_c, &scaffold.client_c, -1.0)?;
    Ok((outcome, ScaffoldOutcome { client_c, client_c_delta }))
}

/// The trainable tensors of `bundle` (a bundle with at least those), flat in the engine's
/// layout, on `device`: the constants of the FedProx and SCAFFOLD terms.
fn trainable_constants(plan: &Plan, bundle: &TensorBundle, device: &Device) -> Result<Vec<Tensor<1>>, LearningError> {
    let mut out = Vec::new();
    for s in plan.slots.iter().filter(|s| s.trainable) {
        let t = bundle.get(&s.name).ok_or_else(|| LearningError::Layout(format!("tensor {} missing", s.name)))?;
        if t.shape != s.shape {
            return Err(LearningError::Layout(format!("{} has shape {:?}, expected {:?}", s.name, t.shape, s.shape)));
        }
        let mut v = t.to_f32_vec();
        if s.transposed {
            v = crate::model::transpose(&v, s.shape[0], s.shape[1]);
        }
        let n = v.len();
        out.push(Tensor::from_data(TensorData::new(v, [n]), device));
    }
    Ok(out)
}

fn subset(bundle: &TensorBundle, names: &[&str]) -> Result<TensorBundle, LearningError> {
    let mut out = TensorBundle::new();
    for &n in names {
        let t = bundle.get(n).ok_or_else(|| LearningError::Layout(format!("tensor {n} missing")))?;
        out.insert(n, t.clone())?;
    }
    Ok(out)
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
    let plan = net.plan().clone();
    if !plan.slots.iter().any(|s| s.trainable) {
        return Err(LearningError::InvalidConfig("the model has no trainable tensors".into()));
    }
    let task = plan.task;
    // Constants (no autodiff) for the proximal and SCAFFOLD terms, in the engine's layout.
    let anchor: Option<Vec<Tensor<1>>> = (config.proximal_mu > 0.0).then(|| trainable_constants(&plan, global, &plain)).transpose()?;
    let corr: Option<Vec<Tensor<1>>> = correction.map(|c| trainable_constants(&plan, c, &plain)).transpose()?;
    let mut optim = config.optimizer.build();
    let mut r = rng::rng(seed, streams::SHUFFLE);
    // Dropout draws from its own stream so shuffling stays what it was for models without it.
    let mut dropout_rng = rng::rng(seed, streams::DROPOUT);
    let n = data.len();
    let f = data.example_len();
    let out_len: usize = plan.output.iter().product();
    let mut order: Vec<usize> = (0..n).collect();
    let mut epochs = Vec::new();
    let mut steps = 0usize;
    let mut processed = 0usize;
    let start = Instant::now();
    'outer: for _epoch in 0..config.local_epochs {
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
            let (x, target) = batch_tensors(data, task, batch, f, out_len, &device);
            let mut ctx = TrainCtx { rng: &mut dropout_rng, updates: Vec::new() };
            let out = net.forward(x, Some(&mut ctx))?;
            let updates = ctx.updates;
            let task_loss = match task {
                Task::Classification => {
                    let logits_val = read(out.clone().without_autodiff())?;
                    correct += count_correct(&logits_val, &data.labels, batch, out_len);
                    (log_softmax(out, 1) * target).sum().mul_scalar(-1.0 / b as f64)
                }
                // Mean over every output value, as torch.nn.MSELoss.
                Task::Regression | Task::Reconstruction => (out - target).powi_scalar(2).sum().mul_scalar(1.0 / (b * out_len) as f64),
            };
            let loss_val = task_loss.clone().into_scalar::<f32>();
            if !loss_val.is_finite() {
                return Err(LearningError::NonFinite { step: steps });
            }
            let mut loss = task_loss;
            if let Some(anchor) = &anchor {
                let mut prox: Option<Tensor<1>> = None;
                for (p, p0) in net.flat_params().into_iter().zip(anchor) {
                    let t = (p - p0.clone()).powi_scalar(2).sum();
                    prox = Some(match prox {
                        Some(acc) => acc + t,
                        None => t,
                    });
                }
                if let Some(prox) = prox {
                    loss = loss + prox.mul_scalar(config.proximal_mu / 2.0);
                }
            }
            if let Some(corr) = &corr {
                for (p, c) in net.flat_params().into_iter().zip(corr) {
                    loss = loss + (p * c.clone()).sum();
                }
            }
            let grads = loss.backward();
            let grads = GradientsParams::from_grads(grads, &net.params);
            net.params = optim.step(config.learning_rate, net.params, grads);
            net.apply_updates(updates);
            steps += 1;
            loss_sum += loss_val as f64 * b as f64;
            seen += b;
            processed += b;
        }
        epochs.push(EpochMetrics { loss: loss_sum / seen.max(1) as f64, accuracy: correct as f64 / seen.max(1) as f64 });
    }
    let wall_time = start.elapsed();
    let updated = updated_slots(&plan);
    let sent: Vec<&str> = plan.slots.iter().zip(&updated).filter(|(s, u)| **u && s.exchanged).map(|(s, _)| s.name.as_str()).collect();
    let local = net.to_bundle()?;
    let delta = sim::apply_delta(&subset(&local, &sent)?, &subset(global, &sent)?, -1.0)?;
    let kept: Vec<&str> = plan.slots.iter().zip(&updated).filter(|(s, u)| **u && !s.exchanged).map(|(s, _)| s.name.as_str()).collect();
    let local_state = subset(&local, &kept)?;
    let delta_norm = sim::l2_norm(&delta);
    let update_bytes = delta.encode().len();
    Ok(TrainOutcome {
        delta,
        local_state,
        num_examples: n,
        metrics: TrainMetrics {
            epochs,
            steps,
            examples_processed: processed,
            wall_time,
            examples_per_sec: processed as f64 / wall_time.as_secs_f64().max(1e-9),
            delta_norm,
            update_bytes,
        },
    })
}

/// Checks the data fits the model (and the task: labels below the classes, or one float
/// target per output value).
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
    match spec.task() {
        Task::Classification => {
            if let Some(&l) = data.labels.iter().find(|&&l| l as usize >= spec.classes()) {
                return Err(LearningError::InputMismatch(format!("label {l} is not below {} classes", spec.classes())));
            }
        }
        Task::Regression => {
            let k = spec.output_len();
            if data.targets.len() != data.len() * k {
                return Err(LearningError::InputMismatch(format!(
                    "regression needs {k} float targets per example ({} in all), the data set has {}",
                    data.len() * k,
                    data.targets.len()
                )));
            }
            if let Some(i) = data.targets.iter().position(|t| !t.is_finite()) {
                return Err(LearningError::InputMismatch(format!("target {} of example {} is not finite", i % k, i / k)));
            }
        }
        Task::Reconstruction => {}
    }
    Ok(())
}

/// Inputs `[b, f]` and the task's target: one-hot `[b, classes]`, float targets `[b, k]`, or
/// the inputs themselves (reconstruction).
fn batch_tensors(data: &Dataset, task: Task, batch: &[usize], f: usize, out_len: usize, device: &Device) -> (Tensor<2>, Tensor<2>) {
    let b = batch.len();
    let mut xs = Vec::with_capacity(b * f);
    for &i in batch {
        xs.extend_from_slice(data.example(i));
    }
    let ys = match task {
        Task::Classification => {
            let mut ys = vec![0.0f32; b * out_len];
            for (row, &i) in batch.iter().enumerate() {
                ys[row * out_len + data.labels[i] as usize] = 1.0;
            }
            ys
        }
        Task::Regression => batch.iter().flat_map(|&i| data.targets[i * out_len..(i + 1) * out_len].iter().copied()).collect(),
        Task::Reconstruction => xs.clone(),
    };
    (Tensor::from_data(TensorData::new(xs, [b, f]), device), Tensor::from_data(TensorData::new(ys, [b, out_len]), device))
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
