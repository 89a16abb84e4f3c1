//! The engine that runs every model (presets and user graphs) on burn, and exact conversion
//! between it and tensor bundles.
//!
//! Tensors are kept flat (`Tensor<1>`) and reshaped where a layer uses them, so one burn module
//! ([`Params`]) holds any architecture. Bundle names and layouts follow PyTorch's `state_dict`
//! (see [`crate::graph`]); linear weights are the one exception inside the engine: they are
//! kept as `[in, out]` (burn's layout), so that the MLP and CNN presets run exactly the
//! operations of the hand-written modules they replaced, bit for bit.

use crate::error::LearningError;
use crate::graph::{LoraSlots, Node, Op, Plan};
use crate::rng::{self, SeededRng, streams};
use crate::spec::ModelSpec;
use burn::module::{Module, Param};
use burn::tensor::activation::{gelu, leaky_relu, relu, sigmoid, silu, softmax, tanh};
use burn::tensor::module::{avg_pool1d, avg_pool2d, batch_norm, batch_norm_train, conv1d, conv2d, linear, max_pool1d, max_pool2d};
use burn::tensor::ops::{AvgPoolOptions, ConvOptions, MaxPoolOptions};
use burn::tensor::{Device, Int, Tensor, TensorData};
use fedfleet_protocol::bundle::TensorBundle;
use std::path::Path;
use std::sync::Arc;

/// The trainable tensors of a model, flat, in [`Plan::slots`] order (the burn module the
/// optimizer sees).
#[derive(Module, Debug)]
pub struct Params {
    /// One flat tensor per trainable slot.
    pub tensors: Vec<Param<Tensor<1>>>,
}

/// A model on a device: its plan, trainable tensors, and fixed tensors (frozen parameters and
/// batch-norm statistics).
#[derive(Debug, Clone)]
pub struct Net {
    plan: Arc<Plan>,
    /// Trainable tensors (what the optimizer updates).
    pub params: Params,
    /// Per slot: the tensor when it is not trainable.
    fixed: Vec<Option<Tensor<1>>>,
    /// Per slot: its index in `params` when trainable.
    param_of: Vec<Option<usize>>,
}

/// What a training-mode forward pass needs and reports.
pub(crate) struct TrainCtx<'a> {
    /// Dropout masks.
    pub rng: &'a mut SeededRng,
    /// New values of batch-norm statistics, applied after the step.
    pub updates: Vec<(usize, Vec<f32>)>,
}

/// An activation: `[batch, shape...]` with rank 2 to 4.
enum Act {
    D2(Tensor<2>),
    D3(Tensor<3>),
    D4(Tensor<4>),
}

macro_rules! each {
    ($x:expr, $t:ident => $e:expr) => {
        match $x {
            Act::D2($t) => Act::D2($e),
            Act::D3($t) => Act::D3($e),
            Act::D4($t) => Act::D4($e),
        }
    };
}

impl Act {
    fn reshape(self, b: usize, s: &[usize]) -> Act {
        macro_rules! to {
            ($t:expr) => {
                match s.len() {
                    1 => Act::D2($t.reshape([b, s[0]])),
                    2 => Act::D3($t.reshape([b, s[0], s[1]])),
                    _ => Act::D4($t.reshape([b, s[0], s[1], s[2]])),
                }
            };
        }
        match self {
            Act::D2(t) => to!(t),
            Act::D3(t) => to!(t),
            Act::D4(t) => to!(t),
        }
    }
    // The plan fixes every layer's input rank, so the variants below always match.
    fn d2(self) -> Tensor<2> {
        match self {
            Act::D2(t) => t,
            _ => unreachable!("plan guarantees rank 2"),
        }
    }
    fn d3(self) -> Tensor<3> {
        match self {
            Act::D3(t) => t,
            _ => unreachable!("plan guarantees rank 3"),
        }
    }
    fn d4(self) -> Tensor<4> {
        match self {
            Act::D4(t) => t,
            _ => unreachable!("plan guarantees rank 4"),
        }
    }
}

fn softmax_last<const D: usize>(t: Tensor<D>) -> Tensor<D> {
    softmax(t, D - 1)
}

fn layer_norm<const D: usize>(x: Tensor<D>, w: Tensor<1>, b: Tensor<1>, eps: f64) -> Tensor<D> {
    let n = x.dims()[D - 1];
    let (var, mean) = x.clone().var_mean_bias(D - 1);
    let xn = (x - mean) / var.add_scalar(eps).sqrt();
    let mut shape = [1usize; D];
    shape[D - 1] = n;
    xn * w.reshape(shape) + b.reshape(shape)
}

/// Batch norm over channel dim 1; in training returns the batch mean and biased variance.
fn bn<const D: usize>(
    x: Tensor<D>,
    w: Tensor<1>,
    b: Tensor<1>,
    stats: Option<(Tensor<1>, Tensor<1>)>,
    eps: f64,
) -> (Tensor<D>, Option<(Tensor<1>, Tensor<1>)>) {
    match stats {
        Some((mean, var)) => (batch_norm(x, w, b, mean, var, eps), None),
        None => {
            let out = batch_norm_train(x, w, b, eps);
            (out.output, Some((out.mean, out.variance)))
        }
    }
}

/// Reads a tensor's values (any rank) as f32, row-major.
pub(crate) fn read<const D: usize>(t: Tensor<D>) -> Result<Vec<f32>, LearningError> {
    t.into_data().try_into_vec::<f32>().map_err(|e| LearningError::Tensor(format!("{e:?}")))
}

/// Transposes a row-major `[rows, cols]` matrix.
pub(crate) fn transpose(v: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; v.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = v[r * cols + c];
        }
    }
    out
}

impl Net {
    /// Builds the engine from bundle tensors on `device`. The bundle must have exactly the
    /// spec's tensors (see [`check_layout`]).
    pub fn from_bundle(spec: &ModelSpec, bundle: &TensorBundle, device: &Device) -> Result<Net, LearningError> {
        let plan = Arc::new(spec.plan()?);
        check_layout(spec, bundle)?;
        Net::from_plan(plan, bundle, device)
    }

    pub(crate) fn from_plan(plan: Arc<Plan>, bundle: &TensorBundle, device: &Device) -> Result<Net, LearningError> {
        let mut tensors = Vec::new();
        let mut fixed = Vec::with_capacity(plan.slots.len());
        let mut param_of = Vec::with_capacity(plan.slots.len());
        for slot in &plan.slots {
            let mut v = bundle.to_f32(&slot.name).ok_or_else(|| LearningError::Layout(format!("tensor {} missing", slot.name)))?;
            if slot.transposed {
                v = transpose(&v, slot.shape[0], slot.shape[1]);
            }
            let n = v.len();
            let t = Tensor::from_data(TensorData::new(v, [n]), device);
            if slot.trainable {
                param_of.push(Some(tensors.len()));
                fixed.push(None);
                tensors.push(Param::from_tensor(t));
            } else {
                param_of.push(None);
                fixed.push(Some(t));
            }
        }
        Ok(Net { plan, params: Params { tensors }, fixed, param_of })
    }

    /// The compiled model.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    fn t(&self, slot: usize) -> Tensor<1> {
        match self.param_of[slot] {
            Some(i) => self.params.tensors[i].val(),
            None => self.fixed[slot].clone().expect("every non-trainable slot has a fixed tensor"),
        }
    }

    /// Trainable tensors, flat in the engine's layout, in slot order (for whole-model loss terms:
    /// FedProx, SCAFFOLD).
    pub fn flat_params(&self) -> Vec<Tensor<1>> {
        self.params.tensors.iter().map(|p| p.val()).collect()
    }

    /// Applies batch-norm statistics computed by a training forward pass.
    pub(crate) fn apply_updates(&mut self, updates: Vec<(usize, Vec<f32>)>) {
        for (slot, v) in updates {
            let n = v.len();
            let device = self.fixed[slot].as_ref().map(|t| t.device()).expect("statistics are fixed tensors");
            self.fixed[slot] = Some(Tensor::from_data(TensorData::new(v, [n]), &device));
        }
    }

    /// Outputs `[batch, output_len]` from flattened examples `[batch, input_len]` (evaluation
    /// mode: batch norm uses its running statistics, dropout is off).
    pub fn forward_flat(&self, _spec: &ModelSpec, x: Tensor<2>) -> Result<Tensor<2>, LearningError> {
        self.forward(x, None)
    }

    pub(crate) fn forward(&self, x: Tensor<2>, mut ctx: Option<&mut TrainCtx<'_>>) -> Result<Tensor<2>, LearningError> {
        let [b, _] = x.dims();
        let x = Act::D2(x).reshape(b, &self.plan.input);
        let out = self.run(&self.plan.nodes, x, b, &mut ctx)?;
        let n: usize = self.plan.output.iter().product();
        Ok(out.reshape(b, &[n]).d2())
    }

    fn run(&self, nodes: &[Node], mut x: Act, b: usize, ctx: &mut Option<&mut TrainCtx<'_>>) -> Result<Act, LearningError> {
        for node in nodes {
            x = self.node(node, x, b, ctx)?;
        }
        Ok(x)
    }

    /// `W` (+ LoRA `scale · B·A`) reshaped to `shape`; linear weights come out `[in, out]`.
    fn weight<const D: usize>(&self, w: usize, lora: &Option<LoraSlots>, shape: [usize; D], linear_layout: bool) -> Tensor<D> {
        let base: Tensor<D> = self.t(w).reshape(shape);
        let Some(l) = lora else { return base };
        let (out, r) = (self.plan.slots[l.b].shape[0], self.plan.slots[l.b].shape[1]);
        let fan = self.plan.slots[l.a].len() / r;
        let a: Tensor<2> = self.t(l.a).reshape([r, fan]);
        let bm: Tensor<2> = self.t(l.b).reshape([out, r]);
        let mut delta = bm.matmul(a).mul_scalar(l.scale); // [out, fan]
        if linear_layout {
            delta = delta.transpose();
        }
        base + delta.reshape(shape)
    }

    fn node(&self, node: &Node, x: Act, b: usize, ctx: &mut Option<&mut TrainCtx<'_>>) -> Result<Act, LearningError> {
        let train = ctx.is_some();
        Ok(match &node.op {
            Op::Linear { weight, bias, lora } => {
                let slot = &self.plan.slots[*weight];
                let w: Tensor<2> = self.weight(*weight, lora, [slot.shape[1], slot.shape[0]], true);
                let bias = bias.map(|s| self.t(s));
                each!(x, t => linear(t, w.clone(), bias.clone()))
            }
            Op::Conv { dims, weight, bias, stride, padding, dilation, groups, lora } => {
                let ws = &self.plan.slots[*weight].shape;
                let bias = bias.map(|s| self.t(s));
                if *dims == 1 {
                    let w: Tensor<3> = self.weight(*weight, lora, [ws[0], ws[1], ws[2]], false);
                    let opts = ConvOptions::new([*stride], [*padding], [*dilation], *groups);
                    Act::D3(conv1d(x.d3(), w, bias, opts))
                } else {
                    let w: Tensor<4> = self.weight(*weight, lora, [ws[0], ws[1], ws[2], ws[3]], false);
                    let opts = ConvOptions::new_with_padding(
                        [*stride, *stride],
                        [(*padding, *padding), (*padding, *padding)],
                        [*dilation, *dilation],
                        *groups,
                    );
                    Act::D4(conv2d(x.d4(), w, bias, opts))
                }
            }
            Op::BatchNorm { weight, bias, mean, var, count, eps, momentum } => {
                // Frozen batch norm (its weight not trainable) behaves as in evaluation.
                let batch_stats = train && self.param_of[*weight].is_some();
                let stats = (!batch_stats).then(|| (self.t(*mean), self.t(*var)));
                let (w, bb) = (self.t(*weight), self.t(*bias));
                let (out, batch) = match x {
                    Act::D2(t) => {
                        let (o, s) = bn(t, w, bb, stats, *eps);
                        (Act::D2(o), s)
                    }
                    Act::D3(t) => {
                        let (o, s) = bn(t, w, bb, stats, *eps);
                        (Act::D3(o), s)
                    }
                    Act::D4(t) => {
                        let (o, s) = bn(t, w, bb, stats, *eps);
                        (Act::D4(o), s)
                    }
                };
                if let (Some((bm, bv)), Some(ctx)) = (batch, ctx.as_mut()) {
                    // PyTorch: running = (1 - m)·running + m·batch, with the unbiased variance.
                    let per_channel = b * node.input[1..].iter().product::<usize>();
                    let unbias = per_channel as f32 / (per_channel.max(2) - 1) as f32;
                    let m = *momentum as f32;
                    let (bm, bv) = (read(bm)?, read(bv)?);
                    let (rm, rv, rc) = (read(self.t(*mean))?, read(self.t(*var))?, read(self.t(*count))?);
                    let nm = rm.iter().zip(&bm).map(|(r, x)| (1.0 - m) * r + m * x).collect();
                    let nv = rv.iter().zip(&bv).map(|(r, x)| (1.0 - m) * r + m * x * unbias).collect();
                    ctx.updates.push((*mean, nm));
                    ctx.updates.push((*var, nv));
                    ctx.updates.push((*count, vec![rc[0] + 1.0]));
                }
                out
            }
            Op::LayerNorm { weight, bias, eps } => {
                let (w, bb) = (self.t(*weight), self.t(*bias));
                each!(x, t => layer_norm(t, w.clone(), bb.clone(), *eps))
            }
            Op::MaxPool { dims: 1, kernel, stride, padding } => {
                let o = MaxPoolOptions::new([*kernel]).with_stride([*stride]).with_padding([*padding]);
                Act::D3(max_pool1d(x.d3(), o))
            }
            Op::MaxPool { kernel, stride, padding, .. } => {
                let o = MaxPoolOptions::new([*kernel, *kernel]).with_stride([*stride, *stride]).with_padding([*padding, *padding]);
                Act::D4(max_pool2d(x.d4(), o))
            }
            Op::AvgPool { dims: 1, kernel, stride, padding } => {
                let o = AvgPoolOptions::new([*kernel]).with_stride([*stride]).with_padding([*padding]).with_count_include_pad(true);
                Act::D3(avg_pool1d(x.d3(), o))
            }
            Op::AvgPool { kernel, stride, padding, .. } => {
                let o = AvgPoolOptions::new([*kernel, *kernel])
                    .with_stride([*stride, *stride])
                    .with_padding([*padding, *padding])
                    .with_count_include_pad(true);
                Act::D4(avg_pool2d(x.d4(), o))
            }
            Op::GlobalAvgPool => {
                let c = node.input[0];
                let rest: usize = node.input[1..].iter().product();
                let t: Tensor<3> = match x {
                    Act::D3(t) => t,
                    Act::D4(t) => t.reshape([b, c, rest]),
                    Act::D2(_) => unreachable!("plan guarantees a spatial dimension"),
                };
                Act::D2(t.mean_dim(2).reshape([b, c]))
            }
            Op::Dropout { p } => match ctx.as_mut() {
                Some(ctx) if *p > 0.0 => {
                    let n = b * node.input.iter().product::<usize>();
                    let keep = (1.0 / (1.0 - p)) as f32;
                    let mask: Vec<f32> = (0..n).map(|_| if rng::uniform(ctx.rng, 0.0, 1.0) < *p { 0.0 } else { keep }).collect();
                    let device = match &x {
                        Act::D2(t) => t.device(),
                        Act::D3(t) => t.device(),
                        Act::D4(t) => t.device(),
                    };
                    let m = Act::D2(Tensor::from_data(TensorData::new(mask, [b, n / b]), &device)).reshape(b, &node.input);
                    match (x, m) {
                        (Act::D2(a), Act::D2(m)) => Act::D2(a * m),
                        (Act::D3(a), Act::D3(m)) => Act::D3(a * m),
                        (Act::D4(a), Act::D4(m)) => Act::D4(a * m),
                        _ => unreachable!("same shape, same rank"),
                    }
                }
                _ => x,
            },
            Op::Embedding { weight, num } => {
                let t = x.d2();
                let device = t.device();
                let len = node.input[0];
                let ids = read(t)?;
                let mut idx = Vec::with_capacity(ids.len());
                for (i, &v) in ids.iter().enumerate() {
                    if !(v >= 0.0 && v.fract() == 0.0 && (v as usize) < *num) {
                        return Err(LearningError::InputMismatch(format!(
                            "example {} position {}: token id {v} is not an integer in 0..{num}",
                            i / len,
                            i % len
                        )));
                    }
                    idx.push(v as i64);
                }
                let dim = node.output[1];
                let ids: Tensor<1, Int> = Tensor::from_data(TensorData::new(idx, [b * len]), &device);
                let w: Tensor<2> = self.t(*weight).reshape([*num, dim]);
                Act::D3(w.select(0, ids).reshape([b, len, dim]))
            }
            Op::Gru { w_ih, w_hh, b_ih, b_hh, hidden, last } | Op::Lstm { w_ih, w_hh, b_ih, b_hh, hidden, last } => {
                let lstm = matches!(node.op, Op::Lstm { .. });
                let gates = if lstm { 4 } else { 3 };
                let (h, steps, fin) = (*hidden, node.input[0], node.input[1]);
                let x = x.d3();
                let device = x.device();
                let wih: Tensor<2> = self.t(*w_ih).reshape([gates * h, fin]).transpose();
                let whh: Tensor<2> = self.t(*w_hh).reshape([gates * h, h]).transpose();
                let xi = linear(x, wih, Some(self.t(*b_ih))); // [b, steps, gates·h]
                let bhh = self.t(*b_hh);
                let mut hs: Tensor<2> = Tensor::zeros([b, h], &device);
                let mut cs: Tensor<2> = Tensor::zeros([b, h], &device);
                let mut outs = Vec::with_capacity(steps);
                for s in 0..steps {
                    let xt: Tensor<2> = xi.clone().narrow(1, s, 1).reshape([b, gates * h]);
                    let hh = linear(hs.clone(), whh.clone(), Some(bhh.clone()));
                    let g = |t: &Tensor<2>, k: usize| t.clone().narrow(1, k * h, h);
                    if lstm {
                        let z = xt + hh;
                        let (i, f, gg, o) = (sigmoid(g(&z, 0)), sigmoid(g(&z, 1)), tanh(g(&z, 2)), sigmoid(g(&z, 3)));
                        cs = f * cs + i * gg;
                        hs = o * tanh(cs.clone());
                    } else {
                        let r = sigmoid(g(&xt, 0) + g(&hh, 0));
                        let z = sigmoid(g(&xt, 1) + g(&hh, 1));
                        let n = tanh(g(&xt, 2) + r * g(&hh, 2));
                        hs = n.clone() + z * (hs - n); // (1 - z)·n + z·h
                    }
                    if !*last {
                        outs.push(hs.clone());
                    }
                }
                if *last { Act::D2(hs) } else { Act::D3(Tensor::stack::<3>(outs, 1)) }
            }
            Op::Attention { in_w, in_b, out_w, out_b, heads } => {
                let (len, e) = (node.input[0], node.input[1]);
                let d = e / heads;
                let x = x.d3();
                let wi: Tensor<2> = self.t(*in_w).reshape([3 * e, e]).transpose();
                let qkv = linear(x, wi, Some(self.t(*in_b))); // [b, L, 3E]
                let split = |k: usize| -> Tensor<4> { qkv.clone().narrow(2, k * e, e).reshape([b, len, *heads, d]).swap_dims(1, 2) };
                let (q, k, v) = (split(0), split(1), split(2));
                let scores = q.matmul(k.swap_dims(2, 3)).mul_scalar(1.0 / (d as f64).sqrt());
                let o: Tensor<3> = softmax(scores, 3).matmul(v).swap_dims(1, 2).reshape([b, len, e]);
                let wo: Tensor<2> = self.t(*out_w).reshape([e, e]).transpose();
                Act::D3(linear(o, wo, Some(self.t(*out_b))))
            }
            Op::Reshape => x.reshape(b, &node.output),
            Op::Relu => each!(x, t => relu(t)),
            Op::Gelu => each!(x, t => gelu(t)),
            Op::Tanh => each!(x, t => tanh(t)),
            Op::Sigmoid => each!(x, t => sigmoid(t)),
            Op::Silu => each!(x, t => silu(t)),
            Op::LeakyRelu(s) => each!(x, t => leaky_relu(t, *s)),
            Op::Softmax => each!(x, t => softmax_last(t)),
            Op::Residual { body, shortcut } => {
                let xs = match &x {
                    Act::D2(t) => Act::D2(t.clone()),
                    Act::D3(t) => Act::D3(t.clone()),
                    Act::D4(t) => Act::D4(t.clone()),
                };
                let main = self.run(body, x, b, ctx)?;
                let side = self.run(shortcut, xs, b, ctx)?;
                match (main, side) {
                    (Act::D2(a), Act::D2(s)) => Act::D2(a + s),
                    (Act::D3(a), Act::D3(s)) => Act::D3(a + s),
                    (Act::D4(a), Act::D4(s)) => Act::D4(a + s),
                    _ => unreachable!("plan checks both paths end with the same shape"),
                }
            }
            Op::Sequence(nodes) => self.run(nodes, x, b, ctx)?,
        })
    }

    /// Copies every tensor out into a bundle (PyTorch names and layouts). Exact.
    pub fn to_bundle(&self) -> Result<TensorBundle, LearningError> {
        self.bundle_of(|_| true)
    }

    /// The tensors whose slot passes `keep`, as a bundle.
    pub(crate) fn bundle_of(&self, keep: impl Fn(&crate::graph::Slot) -> bool) -> Result<TensorBundle, LearningError> {
        let mut bundle = TensorBundle::new();
        for (i, slot) in self.plan.slots.iter().enumerate() {
            if !keep(slot) {
                continue;
            }
            let mut v = read(self.t(i))?;
            if slot.transposed {
                v = transpose(&v, slot.shape[1], slot.shape[0]);
            }
            bundle.insert_f32(slot.name.clone(), slot.shape.clone(), v)?;
        }
        Ok(bundle)
    }
}

pub use fedfleet_modelspec::check_layout;

/// A model: its spec and its engine, on a device.
#[derive(Debug, Clone)]
pub struct Model {
    spec: ModelSpec,
    net: Net,
    device: Device,
}

impl Model {
    /// Fresh weights from `seed` (PyTorch's default init per layer), on the CPU device.
    pub fn init(spec: &ModelSpec, seed: u64) -> Result<Model, LearningError> {
        Model::from_bundle(spec, &init_bundle(spec, seed)?)
    }

    /// Rebuilds a model from a bundle on the plain CPU device (inference/evaluation).
    pub fn from_bundle(spec: &ModelSpec, bundle: &TensorBundle) -> Result<Model, LearningError> {
        Model::from_bundle_on(spec, bundle, &crate::cpu_device())
    }

    /// Rebuilds a model from a bundle on a given device.
    pub fn from_bundle_on(spec: &ModelSpec, bundle: &TensorBundle, device: &Device) -> Result<Model, LearningError> {
        let net = Net::from_bundle(spec, bundle, device)?;
        Ok(Model { spec: spec.clone(), net, device: device.clone() })
    }

    /// Copies the weights out (PyTorch names/layouts, f32). Exact.
    pub fn to_bundle(&self) -> Result<TensorBundle, LearningError> {
        self.net.to_bundle()
    }

    /// The spec.
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// The engine.
    pub fn net(&self) -> &Net {
        &self.net
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Outputs `[batch, output_len]` (logits for classification) for flattened examples
    /// `[batch, input_len]`, in evaluation mode. Fails only on token ids out of an embedding's
    /// range.
    pub fn forward(&self, x: Tensor<2>) -> Result<Tensor<2>, LearningError> {
        self.net.forward(x, None)
    }

    /// Writes the weights as a safetensors file (readable by `safetensors.torch.load_file`).
    pub fn save_safetensors(&self, path: impl AsRef<Path>) -> Result<(), LearningError> {
        save_bundle(&self.to_bundle()?, path)
    }

    /// Loads weights from a safetensors file, checking them against `spec`.
    pub fn load_safetensors(spec: &ModelSpec, path: impl AsRef<Path>) -> Result<Model, LearningError> {
        Model::from_bundle(spec, &load_bundle(path)?)
    }
}

/// Writes a bundle to a safetensors file (write to a temp name, then rename).
pub fn save_bundle(bundle: &TensorBundle, path: impl AsRef<Path>) -> Result<(), LearningError> {
    let path = path.as_ref();
    let tmp = path.with_extension("safetensors.tmp");
    let io = |cause| LearningError::Io { path: path.to_path_buf(), cause };
    std::fs::write(&tmp, bundle.encode()).map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}

/// Reads a safetensors file into a bundle (default protocol limits).
pub fn load_bundle(path: impl AsRef<Path>) -> Result<TensorBundle, LearningError> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|cause| LearningError::Io { path: path.to_path_buf(), cause })?;
    Ok(TensorBundle::decode(&bytes, &fedfleet_protocol::bundle::BundleLimits::default())?)
}

/// Initial weights for `spec` from `seed`, as a bundle: each tensor gets its layer's PyTorch
/// default (linear/conv weights and biases U(±1/√fan_in), batch/layer norm ones and zeros,
/// embeddings N(0, 1), GRU/LSTM U(±1/√hidden), attention xavier / zeros, LoRA A like the
/// layer's weight and B zeros), drawn in [`ModelSpec::params`] order from one ChaCha8 stream,
/// so the same seed gives the same bits on every machine.
pub fn init_bundle(spec: &ModelSpec, seed: u64) -> Result<TensorBundle, LearningError> {
    let plan = spec.plan()?;
    let mut r = rng::rng(seed, streams::INIT);
    let mut bundle = TensorBundle::new();
    for s in &plan.slots {
        let n = s.len();
        let values: Vec<f32> = match s.init {
            crate::graph::Init::Uniform(bound) => (0..n).map(|_| rng::uniform(&mut r, -bound, bound) as f32).collect(),
            crate::graph::Init::Normal => (0..n).map(|_| rng::normal(&mut r) as f32).collect(),
            crate::graph::Init::Const(c) => vec![c; n],
        };
        bundle.insert_f32(&s.name, s.shape.clone(), values)?;
    }
    Ok(bundle)
}
