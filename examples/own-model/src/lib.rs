//! A device team's own model in a fedfleet fleet: a gated MLP written directly in burn
//! (`h = value(x) ⊙ σ(gate(x))`, then a linear head; no built-in layer graph has a gate), wrapped
//! in a [`Trainer`] so that the stock agent runs the whole lifecycle around it: rounds, signing,
//! the outbox, installs, health checks, rollbacks and the inference socket.
//!
//! The aggregator and the registry only need the tensors, declared by [`spec`] (a
//! `{"arch":"custom"}` spec); the weights travel as a PyTorch-named `state_dict`.

use std::sync::Arc;

use burn::module::{Module, Param};
use burn::optim::{GradientsParams, ModuleOptimizer, SgdConfig};
use burn::tensor::activation::{log_softmax, sigmoid};
use burn::tensor::{Device, Tensor, TensorData};
use fedfleet_agent::{Evaluation, LocalUpdate, ModelView, RoundJob, Serve, Trainer};
use fedfleet_learning::{CustomSpec, Dataset, ModelSpec, Prediction, Task, TensorDecl};
use fedfleet_protocol::TensorBundle;
use rand::{Rng, SeedableRng, seq::SliceRandom};

/// Input values per example (8x8 digits), hidden units, classes.
pub const INPUT: usize = 64;
pub const HIDDEN: usize = 32;
pub const CLASSES: usize = 10;

/// The tensors as PyTorch would name them for `value`, `gate` and `head` `nn.Linear`s.
fn tensors() -> Vec<(&'static str, Vec<usize>)> {
    vec![
        ("value.weight", vec![HIDDEN, INPUT]),
        ("value.bias", vec![HIDDEN]),
        ("gate.weight", vec![HIDDEN, INPUT]),
        ("gate.bias", vec![HIDDEN]),
        ("head.weight", vec![CLASSES, HIDDEN]),
        ("head.bias", vec![CLASSES]),
    ]
}

/// The spec the aggregator's `[model] spec` holds: every tensor, all trained.
pub fn spec() -> ModelSpec {
    ModelSpec::Custom(CustomSpec {
        kind: "example/gated-mlp".into(),
        input: vec![INPUT],
        task: Task::Classification,
        output: CLASSES,
        tensors: tensors().into_iter().map(|(name, shape)| TensorDecl { name: name.into(), shape }).collect(),
        trainable: None,
    })
}

/// Fresh weights (PyTorch's `nn.Linear` default: uniform ±1/√fan_in), reproducible from `seed`.
pub fn init_weights(seed: u64) -> TensorBundle {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut b = TensorBundle::new();
    for (name, shape) in tensors() {
        let fan_in = if name.starts_with("head") { HIDDEN } else { INPUT };
        let bound = 1.0 / (fan_in as f32).sqrt();
        let values = (0..shape.iter().product()).map(|_| rng.gen_range(-bound..bound)).collect();
        b.insert_f32(name, shape, values).expect("distinct names");
    }
    b
}

/// The team's burn module.
#[derive(Module, Debug)]
pub struct GatedMlp {
    value_w: Param<Tensor<2>>,
    value_b: Param<Tensor<1>>,
    gate_w: Param<Tensor<2>>,
    gate_b: Param<Tensor<1>>,
    head_w: Param<Tensor<2>>,
    head_b: Param<Tensor<1>>,
}

impl GatedMlp {
    /// The module from `state_dict`-named weights.
    pub fn from_bundle(w: &TensorBundle, device: &Device) -> Result<Self, String> {
        let get = |name: &str| w.to_f32(name).ok_or_else(|| format!("weights lack {name}"));
        let m = |name: &str, rows: usize, cols: usize| -> Result<Param<Tensor<2>>, String> {
            Ok(Param::from_tensor(Tensor::from_data(TensorData::new(get(name)?, [rows, cols]), device)))
        };
        let v = |name: &str| -> Result<Param<Tensor<1>>, String> {
            let values = get(name)?;
            let n = values.len();
            Ok(Param::from_tensor(Tensor::from_data(TensorData::new(values, [n]), device)))
        };
        Ok(GatedMlp {
            value_w: m("value.weight", HIDDEN, INPUT)?,
            value_b: v("value.bias")?,
            gate_w: m("gate.weight", HIDDEN, INPUT)?,
            gate_b: v("gate.bias")?,
            head_w: m("head.weight", CLASSES, HIDDEN)?,
            head_b: v("head.bias")?,
        })
    }

    /// The weights, `state_dict`-named.
    pub fn to_bundle(&self) -> Result<TensorBundle, String> {
        let mut b = TensorBundle::new();
        let values = [
            read(self.value_w.val())?,
            read(self.value_b.val())?,
            read(self.gate_w.val())?,
            read(self.gate_b.val())?,
            read(self.head_w.val())?,
            read(self.head_b.val())?,
        ];
        for ((name, shape), v) in tensors().into_iter().zip(values) {
            b.insert_f32(name, shape, v).map_err(|e| e.to_string())?;
        }
        Ok(b)
    }

    /// Logits `[batch, CLASSES]`.
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let linear = |x: Tensor<2>, w: &Param<Tensor<2>>, b: &Param<Tensor<1>>| x.matmul(w.val().transpose()) + b.val().unsqueeze::<2>();
        let h = linear(x.clone(), &self.value_w, &self.value_b) * sigmoid(linear(x, &self.gate_w, &self.gate_b));
        linear(h, &self.head_w, &self.head_b)
    }
}

fn read<const D: usize>(t: Tensor<D>) -> Result<Vec<f32>, String> {
    t.into_data().try_into_vec::<f32>().map_err(|e| format!("{e:?}"))
}

fn inputs(data: &Dataset, rows: &[usize], device: &Device) -> Tensor<2> {
    let xs: Vec<f32> = rows.iter().flat_map(|&i| data.example(i).iter().copied()).collect();
    Tensor::from_data(TensorData::new(xs, [rows.len(), INPUT]), device)
}

/// The team's [`Trainer`]: trains on what the agent hands it (its `[data]` and inbox).
#[derive(Debug, Default, Clone, Copy)]
pub struct GatedTrainer;

impl Trainer for GatedTrainer {
    fn train(&self, model: ModelView<'_>, job: RoundJob<'_>) -> Result<LocalUpdate, String> {
        let data = job.data;
        if data.is_empty() || data.example_len() != INPUT {
            return Err(format!("need examples of {INPUT} values, have {} of {}", data.len(), data.example_len()));
        }
        let cfg = job.train_config();
        let device = fedfleet_learning::train_device();
        let mut net = GatedMlp::from_bundle(model.weights, &device)?;
        let mut optim: ModuleOptimizer = SgdConfig::new().init();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(job.seed);
        let mut order: Vec<usize> = (0..data.len()).collect();
        let mut last_loss = None;
        for _ in 0..cfg.local_epochs {
            order.shuffle(&mut rng);
            let (mut sum, mut seen) = (0.0f64, 0usize);
            for batch in order.chunks(cfg.batch_size) {
                let mut onehot = vec![0.0f32; batch.len() * CLASSES];
                for (row, &i) in batch.iter().enumerate() {
                    onehot[row * CLASSES + data.labels[i] as usize] = 1.0;
                }
                let y = Tensor::<2>::from_data(TensorData::new(onehot, [batch.len(), CLASSES]), &device);
                let loss = (log_softmax(net.forward(inputs(data, batch, &device)), 1) * y).sum().mul_scalar(-1.0 / batch.len() as f64);
                sum += loss.clone().into_scalar::<f32>() as f64 * batch.len() as f64;
                seen += batch.len();
                let grads = GradientsParams::from_grads(loss.backward(), &net);
                net = optim.step(cfg.learning_rate, net, grads);
            }
            last_loss = Some(sum / seen.max(1) as f64);
        }
        // The update is trained minus global, tensor by tensor.
        let trained = net.to_bundle()?;
        let mut delta = TensorBundle::new();
        for (name, t) in trained.iter() {
            let g = model.weights.to_f32(name).ok_or_else(|| format!("global model lacks {name}"))?;
            let d = t.to_f32_vec().iter().zip(&g).map(|(a, b)| a - b).collect();
            delta.insert_f32(name, t.shape.clone(), d).map_err(|e| e.to_string())?;
        }
        Ok(LocalUpdate { delta, num_examples: data.len(), loss: last_loss, local_state: TensorBundle::new() })
    }

    fn evaluate(&self, model: ModelView<'_>, holdout: &Dataset) -> Result<Evaluation, String> {
        let served = Gated(GatedMlp::from_bundle(model.weights, &fedfleet_learning::cpu_device())?);
        let rows: Vec<usize> = (0..holdout.len()).collect();
        let predictions = if rows.is_empty() { Vec::new() } else { served.predict(&holdout.features, rows.len())? };
        let correct = predictions.iter().zip(&holdout.labels).filter(|(p, l)| p.label == Some(**l as usize)).count();
        let finite = predictions.iter().all(|p| p.probs.iter().all(|v| v.is_finite()));
        let score = correct as f64 / rows.len().max(1) as f64;
        Ok(Evaluation { metric: "accuracy".into(), score, examples: rows.len(), finite })
    }

    fn load(&self, model: ModelView<'_>) -> Result<Arc<dyn Serve>, String> {
        Ok(Arc::new(Gated(GatedMlp::from_bundle(model.weights, &fedfleet_learning::cpu_device())?)))
    }
}

/// The module answering inference.
struct Gated(GatedMlp);

impl Serve for Gated {
    fn input_len(&self) -> usize {
        INPUT
    }
    fn predict(&self, inputs: &[f32], n: usize) -> Result<Vec<Prediction>, String> {
        if inputs.len() != n * INPUT {
            return Err(format!("{} values for {n} examples of {INPUT}", inputs.len()));
        }
        let device = fedfleet_learning::cpu_device();
        let x = Tensor::from_data(TensorData::new(inputs.to_vec(), [n, INPUT]), &device);
        let logits = read(self.0.forward(x))?;
        Ok(logits.chunks(CLASSES).map(Prediction::from_logits).collect())
    }
}

/// Accuracy of `weights` on `data` (for tests and the example's report).
pub fn accuracy(weights: &TensorBundle, data: &Dataset) -> Result<f64, String> {
    let spec = spec();
    GatedTrainer.evaluate(ModelView { spec: &spec, weights }, data).map(|e| e.score)
}
