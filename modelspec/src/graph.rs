//! Bring-your-own-model: a JSON layer graph (sequential, with residual blocks), its validation
//! and shape inference, and the tensor list it implies (PyTorch `state_dict` names and layouts).
//!
//! The graph is compiled into a [`Plan`]: one [`Node`] per layer with its input/output shapes
//! (per example, without the batch dimension) and the indices of its tensors in
//! [`Plan::slots`]. The MLP and CNN presets of [`crate::ModelSpec`] compile to the same kind of
//! plan, so one engine (fedfleet-learning's `Net`) runs every model.

use crate::SpecError;
use serde::{Deserialize, Serialize};
use std::hash::{Hash, Hasher};

/// A real number in a spec (epsilons, momentum, dropout rate, LoRA alpha). Compared and hashed
/// by its bits so that specs stay `Eq + Hash` (they are used as keys).
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Real(pub f64);

impl PartialEq for Real {
    fn eq(&self, other: &Self) -> bool {
        self.0.to_bits() == other.0.to_bits()
    }
}
impl Eq for Real {}
impl Hash for Real {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.0.to_bits().hash(state)
    }
}

/// What the model is trained for; decides the loss, the targets and the evaluation metric.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Task {
    /// Cross-entropy on integer labels; the output is `[classes]` logits; metric: accuracy.
    #[default]
    Classification,
    /// Mean squared error on float targets (one per output value); metrics: RMSE, MAE.
    Regression,
    /// Autoencoder: the output must have the input's shape and is compared (MSE) with the input;
    /// the per-example reconstruction error is the anomaly score.
    Reconstruction,
}

/// How a local training run may change the model.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "lowercase", deny_unknown_fields)]
pub enum FineTune {
    /// Every parameter is trained and sent.
    #[default]
    Full,
    /// Parameters are frozen by name (glob patterns, `*` any run of characters, `?` one).
    /// With `trainable`, only matching parameters train; `frozen` then removes more.
    Freeze {
        /// Patterns of the parameters that train (absent: all of them).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        trainable: Option<Vec<String>>,
        /// Patterns of the parameters that stay fixed.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        frozen: Vec<String>,
    },
    /// Low-rank adapters on linear and convolution layers: the base weights are frozen and
    /// `W + (alpha / rank) · B·A` is used, with `<layer>.lora_A` `[rank, fan_in...]` and
    /// `<layer>.lora_B` `[out, rank, 1...]` (peft's layout). Only the adapters train.
    Lora {
        /// Rank r of the adapters.
        rank: usize,
        /// Scaling numerator (the update is scaled by alpha / r).
        alpha: Real,
        /// Layer-name patterns to adapt (absent: every linear and convolution layer).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        targets: Option<Vec<String>>,
        /// Parameter-name patterns that also train in full beside the adapters, e.g. `*.bias`
        /// or the classification head (peft's `bias = "all"` and `modules_to_save`).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        also_train: Vec<String>,
        /// Keep every `lora_A` at its (shared, seeded) initial value and train only `lora_B`
        /// (FFA-LoRA): updates carry half the adapter, and the federated mean of `B·A` is
        /// exactly `mean(B)·A`.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        freeze_a: bool,
        /// How fedfleet-learning's `attach_adapters` starts each `lora_A` from the pre-trained
        /// weights: seeded random (peft's default) or the weight's principal input directions.
        #[serde(default, skip_serializing_if = "AdapterInit::is_random")]
        init_a: AdapterInit,
    },
}

/// The starting value of a LoRA adapter's `A` `[r, fan_in]`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdapterInit {
    /// Kaiming-uniform from the model seed, like the layer's own weight (peft).
    #[default]
    Random,
    /// The top-r right singular vectors of the pre-trained weight `W` `[out, fan_in]` (as
    /// PiSSA): the adapter writes where the layer already reads. With `freeze_a`, B then
    /// trains in that subspace. Deterministic from the weights, so every device agrees.
    Principal,
}

impl AdapterInit {
    fn is_random(&self) -> bool {
        *self == AdapterInit::Random
    }
}

impl FineTune {
    fn is_full(&self) -> bool {
        matches!(self, FineTune::Full)
    }
}

/// A user model: input shape, task, layers and fine-tuning mode. JSON form (inside a
/// [`crate::ModelSpec`]: `{"arch":"graph", ...}`); see the crate README for a full example.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GraphSpec {
    /// Shape of one example without the batch dimension, e.g. `[3, 32, 32]`, `[16, 8]`
    /// (sequence of 16 steps of 8 features) or `[20]` (20 token ids for an embedding).
    pub input: Vec<usize>,
    /// The task (default classification).
    #[serde(default)]
    pub task: Task,
    /// Layers applied in order.
    pub layers: Vec<Layer>,
    /// Fine-tuning mode (default full).
    #[serde(default, skip_serializing_if = "FineTune::is_full")]
    pub finetune: FineTune,
}

fn yes() -> bool {
    true
}
fn one() -> usize {
    1
}
fn eps_default() -> Real {
    Real(1e-5)
}
fn bn_momentum() -> Real {
    Real(0.1)
}
fn leaky_default() -> Real {
    Real(0.01)
}

/// How a recurrent layer's output is used.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RnnOutput {
    /// Every step's hidden state, `[steps, hidden]` (PyTorch's `output`).
    #[default]
    Sequence,
    /// The last step's hidden state, `[hidden]` (PyTorch's `h_n[-1]`).
    Last,
}

/// One layer. JSON: `{"type": "<kind>", ...}`. Layers with parameters take an optional
/// `name`, the prefix of their tensors (default `layers.<i>`, or `<block>.layers.<j>` /
/// `<block>.shortcut.<j>` inside a residual block), as PyTorch's `state_dict` would name them.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum Layer {
    /// `nn.Linear` on the last dimension: `weight [out, in]`, `bias [out]`.
    Linear {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        name: Option<String>,
        /// Optional declared input size, checked against the inferred one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        in_features: Option<usize>,
        out_features: usize,
        #[serde(default = "yes")]
        bias: bool,
    },
    /// `nn.Conv1d` on `[C, L]`: `weight [out, in/groups, k]`.
    Conv1d {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        name: Option<String>,
        /// Optional declared input size, checked against the inferred one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        in_channels: Option<usize>,
        out_channels: usize,
        kernel_size: usize,
        #[serde(default = "one")]
        stride: usize,
        #[serde(default)]
        padding: usize,
        #[serde(default = "one")]
        dilation: usize,
        #[serde(default = "one")]
        groups: usize,
        #[serde(default = "yes")]
        bias: bool,
    },
    /// `nn.Conv2d` on `[C, H, W]` (square kernel): `weight [out, in/groups, k, k]`.
    Conv2d {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        name: Option<String>,
        /// Optional declared input size, checked against the inferred one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        in_channels: Option<usize>,
        out_channels: usize,
        kernel_size: usize,
        #[serde(default = "one")]
        stride: usize,
        #[serde(default)]
        padding: usize,
        #[serde(default = "one")]
        dilation: usize,
        #[serde(default = "one")]
        groups: usize,
        #[serde(default = "yes")]
        bias: bool,
    },
    /// Depthwise-separable convolution on `[C, H, W]`: `<name>.depthwise` (`Conv2d(C, C, k,
    /// groups=C)`) then `<name>.pointwise` (`Conv2d(C, out, 1)`).
    SeparableConv2d {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        name: Option<String>,
        /// Optional declared input size, checked against the inferred one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        in_channels: Option<usize>,
        out_channels: usize,
        kernel_size: usize,
        #[serde(default = "one")]
        stride: usize,
        #[serde(default)]
        padding: usize,
        #[serde(default = "yes")]
        bias: bool,
    },
    /// `nn.BatchNorm1d/2d` over channel dimension 0 of `[C]`, `[C, L]` or `[C, H, W]`:
    /// `weight, bias, running_mean, running_var [C]`, `num_batches_tracked []`. With
    /// `local: true` (FedBN) its tensors train and update but are never sent.
    BatchNorm {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        name: Option<String>,
        /// Optional declared input size, checked against the inferred one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        num_features: Option<usize>,
        #[serde(default = "eps_default")]
        eps: Real,
        #[serde(default = "bn_momentum")]
        momentum: Real,
        #[serde(default)]
        local: bool,
    },
    /// `nn.LayerNorm` over the last dimension: `weight, bias [last]`.
    LayerNorm {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        name: Option<String>,
        #[serde(default = "eps_default")]
        eps: Real,
    },
    /// `nn.MaxPool1d` on `[C, L]` (stride defaults to the kernel size).
    MaxPool1d {
        kernel_size: usize,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        stride: Option<usize>,
        #[serde(default)]
        padding: usize,
    },
    /// `nn.MaxPool2d` on `[C, H, W]`.
    MaxPool2d {
        kernel_size: usize,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        stride: Option<usize>,
        #[serde(default)]
        padding: usize,
    },
    /// `nn.AvgPool1d` on `[C, L]` (padding counted, as PyTorch's default).
    AvgPool1d {
        kernel_size: usize,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        stride: Option<usize>,
        #[serde(default)]
        padding: usize,
    },
    /// `nn.AvgPool2d` on `[C, H, W]`.
    AvgPool2d {
        kernel_size: usize,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        stride: Option<usize>,
        #[serde(default)]
        padding: usize,
    },
    /// Mean over every dimension after the channels: `[C, ...] -> [C]`.
    GlobalAvgPool,
    /// `nn.Dropout(p)`: active in training only (seeded), identity in evaluation.
    Dropout {
        p: Real,
    },
    /// `nn.Embedding` as the first layer: the example's values are token ids `[L] -> [L, dim]`;
    /// `weight [num_embeddings, embedding_dim]`.
    Embedding {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        name: Option<String>,
        num_embeddings: usize,
        embedding_dim: usize,
    },
    /// `nn.GRU(batch_first=True)`, one layer, on `[steps, features]`: `weight_ih_l0
    /// [3H, in]`, `weight_hh_l0 [3H, H]`, `bias_ih_l0`, `bias_hh_l0 [3H]` (gates r, z, n).
    Gru {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        name: Option<String>,
        /// Optional declared input size, checked against the inferred one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        input_size: Option<usize>,
        hidden_size: usize,
        #[serde(default)]
        output: RnnOutput,
    },
    /// `nn.LSTM(batch_first=True)`, one layer: as GRU with `4H` rows (gates i, f, g, o).
    Lstm {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        name: Option<String>,
        /// Optional declared input size, checked against the inferred one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        input_size: Option<usize>,
        hidden_size: usize,
        #[serde(default)]
        output: RnnOutput,
    },
    /// `nn.MultiheadAttention(E, heads, batch_first=True)` as self-attention on `[L, E]`:
    /// `in_proj_weight [3E, E]`, `in_proj_bias [3E]`, `out_proj.weight [E, E]`, `out_proj.bias`.
    MultiheadAttention {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        name: Option<String>,
        num_heads: usize,
    },
    /// Reshapes one example (row-major, like `torch.reshape` after the batch dimension).
    Reshape {
        shape: Vec<usize>,
    },
    /// Flattens one example to one dimension (`nn.Flatten()`).
    Flatten,
    Relu,
    /// Exact (erf) GELU, PyTorch's default.
    Gelu,
    Tanh,
    Sigmoid,
    Silu,
    LeakyRelu {
        #[serde(default = "leaky_default")]
        negative_slope: Real,
    },
    /// Softmax over the last dimension.
    Softmax,
    /// `layers(x) + shortcut(x)` (shortcut: identity when empty). Both paths must end with the
    /// same shape.
    Residual {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        name: Option<String>,
        layers: Vec<Layer>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        shortcut: Vec<Layer>,
    },
}

impl Layer {
    /// The `type` tag, as written in JSON.
    pub fn kind(&self) -> &'static str {
        match self {
            Layer::Linear { .. } => "linear",
            Layer::Conv1d { .. } => "conv1d",
            Layer::Conv2d { .. } => "conv2d",
            Layer::SeparableConv2d { .. } => "separable_conv2d",
            Layer::BatchNorm { .. } => "batch_norm",
            Layer::LayerNorm { .. } => "layer_norm",
            Layer::MaxPool1d { .. } => "max_pool1d",
            Layer::MaxPool2d { .. } => "max_pool2d",
            Layer::AvgPool1d { .. } => "avg_pool1d",
            Layer::AvgPool2d { .. } => "avg_pool2d",
            Layer::GlobalAvgPool => "global_avg_pool",
            Layer::Dropout { .. } => "dropout",
            Layer::Embedding { .. } => "embedding",
            Layer::Gru { .. } => "gru",
            Layer::Lstm { .. } => "lstm",
            Layer::MultiheadAttention { .. } => "multihead_attention",
            Layer::Reshape { .. } => "reshape",
            Layer::Flatten => "flatten",
            Layer::Relu => "relu",
            Layer::Gelu => "gelu",
            Layer::Tanh => "tanh",
            Layer::Sigmoid => "sigmoid",
            Layer::Silu => "silu",
            Layer::LeakyRelu { .. } => "leaky_relu",
            Layer::Softmax => "softmax",
            Layer::Residual { .. } => "residual",
        }
    }

    pub(crate) fn explicit_name(&self) -> Option<&str> {
        match self {
            Layer::Linear { name, .. }
            | Layer::Conv1d { name, .. }
            | Layer::Conv2d { name, .. }
            | Layer::SeparableConv2d { name, .. }
            | Layer::BatchNorm { name, .. }
            | Layer::LayerNorm { name, .. }
            | Layer::Embedding { name, .. }
            | Layer::Gru { name, .. }
            | Layer::Lstm { name, .. }
            | Layer::MultiheadAttention { name, .. }
            | Layer::Residual { name, .. } => name.as_deref(),
            _ => None,
        }
    }
}

/// Whether a tensor is learned or a statistic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotKind {
    /// A learned parameter (may be trained).
    Param,
    /// A running statistic (batch norm), updated in training mode, never by the optimizer.
    Buffer,
}

/// How a tensor is initialised (PyTorch's defaults for its layer).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// U(-bound, bound).
    Uniform(f64),
    /// N(0, 1) (embeddings).
    Normal,
    /// Every value the same.
    Const(f32),
}

/// One tensor of a model (a `state_dict` entry).
#[derive(Clone, Debug, PartialEq)]
pub struct Slot {
    /// `state_dict` name, e.g. `layers.0.weight`.
    pub name: String,
    /// PyTorch shape (`[]` for `num_batches_tracked`).
    pub shape: Vec<usize>,
    /// Parameter or statistic.
    pub kind: SlotKind,
    /// Initial values.
    pub init: Init,
    /// Fan-in of the layer (for reporting; the bound is in `init`).
    pub fan_in: usize,
    /// False for tensors kept on the device (FedBN): never part of an update.
    pub exchanged: bool,
    /// Stored by PyTorch as `[out, in]` but kept by the engine as `[in, out]` (linear weights:
    /// burn's layout, so that the presets run exactly the operations they always did).
    pub transposed: bool,
    /// Whether the optimizer updates it (fine-tuning mode applied).
    pub trainable: bool,
    /// PyTorch stores it as int64 (`num_batches_tracked`).
    pub integer: bool,
}

impl Slot {
    /// Number of values.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// True for an empty tensor (never produced by a valid spec).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A LoRA adapter attached to a linear/conv weight.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraSlots {
    /// Slot of `lora_A` `[r, fan_in...]`.
    pub a: usize,
    /// Slot of `lora_B` `[out, r, 1...]`.
    pub b: usize,
    /// alpha / r.
    pub scale: f64,
}

/// A compiled layer.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    Linear {
        weight: usize,
        bias: Option<usize>,
        lora: Option<LoraSlots>,
    },
    Conv {
        dims: usize,
        weight: usize,
        bias: Option<usize>,
        stride: usize,
        padding: usize,
        dilation: usize,
        groups: usize,
        lora: Option<LoraSlots>,
    },
    BatchNorm {
        weight: usize,
        bias: usize,
        mean: usize,
        var: usize,
        count: usize,
        eps: f64,
        momentum: f64,
    },
    LayerNorm {
        weight: usize,
        bias: usize,
        eps: f64,
    },
    MaxPool {
        dims: usize,
        kernel: usize,
        stride: usize,
        padding: usize,
    },
    AvgPool {
        dims: usize,
        kernel: usize,
        stride: usize,
        padding: usize,
    },
    GlobalAvgPool,
    Dropout {
        p: f64,
    },
    Embedding {
        weight: usize,
        num: usize,
    },
    Gru {
        w_ih: usize,
        w_hh: usize,
        b_ih: usize,
        b_hh: usize,
        hidden: usize,
        last: bool,
    },
    Lstm {
        w_ih: usize,
        w_hh: usize,
        b_ih: usize,
        b_hh: usize,
        hidden: usize,
        last: bool,
    },
    Attention {
        in_w: usize,
        in_b: usize,
        out_w: usize,
        out_b: usize,
        heads: usize,
    },
    Reshape,
    Relu,
    Gelu,
    Tanh,
    Sigmoid,
    Silu,
    LeakyRelu(f64),
    Softmax,
    Residual {
        body: Vec<Node>,
        shortcut: Vec<Node>,
    },
    /// Layers applied in order (the two halves of a separable convolution).
    Sequence(Vec<Node>),
}

/// A compiled layer with its per-example shapes.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    /// What it computes.
    pub op: Op,
    /// Input shape (without batch).
    pub input: Vec<usize>,
    /// Output shape (without batch).
    pub output: Vec<usize>,
}

/// A validated, shape-checked model: its layers and its tensors.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// Input shape.
    pub input: Vec<usize>,
    /// Output shape.
    pub output: Vec<usize>,
    /// Task.
    pub task: Task,
    /// Layers.
    pub nodes: Vec<Node>,
    /// Every tensor, in initialisation order.
    pub slots: Vec<Slot>,
}

impl Plan {
    /// Index of the slot called `name`.
    pub fn slot(&self, name: &str) -> Option<usize> {
        self.slots.iter().position(|s| s.name == name)
    }
}

/// Largest size of any one dimension or tensor we accept (guards allocation from bad JSON).
const MAX_ELEMENTS: usize = 1 << 28;
/// Most values a model may hold in all its tensors (1 GiB of f32): specs are checked for cost
/// before anything is allocated.
pub const MAX_MODEL_VALUES: usize = 1 << 28;
/// Most values one example's forward pass may produce (every layer's output, attention
/// scores included): 256 MiB of f32 per example.
pub const MAX_ACTIVATIONS_PER_EXAMPLE: usize = 1 << 26;
const MAX_DEPTH: usize = 16;

/// `*` matches any run of characters (dots included), `?` any one character.
pub fn glob_match(pattern: &str, name: &str) -> bool {
    fn go(p: &[u8], n: &[u8]) -> bool {
        match p.first() {
            None => n.is_empty(),
            Some(b'*') => (0..=n.len()).any(|i| go(&p[1..], &n[i..])),
            Some(b'?') => !n.is_empty() && go(&p[1..], &n[1..]),
            Some(c) => n.first() == Some(c) && go(&p[1..], &n[1..]),
        }
    }
    go(pattern.as_bytes(), name.as_bytes())
}

struct Builder<'a> {
    slots: Vec<Slot>,
    finetune: &'a FineTune,
    lora_targets_hit: Vec<bool>,
}

/// Path, kind and name of a layer, for error messages: `layer 3 (conv2d "backbone.1")`.
fn where_(path: &str, layer: &Layer, prefix: &str) -> String {
    format!("layer {path} ({} \"{prefix}\")", layer.kind())
}

impl GraphSpec {
    /// Validates the graph, infers every shape and lists the tensors. Errors name the layer.
    pub fn compile(&self) -> Result<Plan, SpecError> {
        let bad = |m: String| Err(SpecError::InvalidSpec(m));
        if self.input.is_empty() || self.input.len() > 3 {
            return bad(format!("input shape {:?} must have 1 to 3 dimensions", self.input));
        }
        if self.input.contains(&0) || checked_product(&self.input).is_none_or(|n| n > MAX_ELEMENTS) {
            return bad(format!("input shape {:?} is empty or too large", self.input));
        }
        if self.layers.is_empty() {
            return bad("the graph has no layers".into());
        }
        let targets = match &self.finetune {
            FineTune::Lora { rank, alpha, targets, .. } => {
                if *rank == 0 || *rank > 4096 {
                    return bad(format!("lora rank {rank} must be in 1..=4096"));
                }
                if !(alpha.0.is_finite() && alpha.0 > 0.0) {
                    return bad(format!("lora alpha {} must be finite and > 0", alpha.0));
                }
                targets.as_ref().map_or(0, Vec::len)
            }
            _ => 0,
        };
        let mut b = Builder { slots: Vec::new(), finetune: &self.finetune, lora_targets_hit: vec![false; targets] };
        let (nodes, output) = b.sequence(&self.layers, self.input.clone(), "", "layers", 0)?;
        match self.task {
            Task::Classification => {
                if output.len() != 1 || output[0] < 2 {
                    return bad(format!("classification needs an output of [classes >= 2] logits, the last layer gives {output:?}"));
                }
            }
            Task::Regression => {}
            Task::Reconstruction => {
                if output != self.input {
                    return bad(format!(
                        "reconstruction needs an output shaped like the input {:?}, the last layer gives {output:?}",
                        self.input
                    ));
                }
            }
        }
        if let FineTune::Lora { targets: Some(t), .. } = &self.finetune
            && let Some(i) = b.lora_targets_hit.iter().position(|hit| !hit)
        {
            return bad(format!("lora target {:?} matches no linear or convolution layer", t[i]));
        }
        let mut plan = Plan { input: self.input.clone(), output, task: self.task, nodes, slots: b.slots };
        apply_freeze(&mut plan, &self.finetune)?;
        let mut seen = std::collections::HashSet::new();
        if let Some(dup) = plan.slots.iter().find(|s| !seen.insert(s.name.as_str())) {
            return bad(format!("two tensors are called {:?}; give the layers distinct names", dup.name));
        }
        check_cost(&plan)?;
        Ok(plan)
    }
}

/// Refuses a plan too costly to hold or run, by name, before anything is allocated: its
/// parameters, one example's activations, and LoRA ranks above the layer they adapt.
fn check_cost(plan: &Plan) -> Result<(), SpecError> {
    let bad = |m: String| Err(SpecError::InvalidSpec(m));
    let values = plan.slots.iter().try_fold(0usize, |a, s| checked_product(&s.shape).and_then(|n| a.checked_add(n)));
    match values {
        Some(n) if n <= MAX_MODEL_VALUES => {}
        n => {
            let n = n.map_or("more than 2^64".to_string(), |n| n.to_string());
            return bad(format!("the model has {n} parameter values; the limit is {MAX_MODEL_VALUES}"));
        }
    }
    fn activations(nodes: &[Node]) -> Option<usize> {
        nodes.iter().try_fold(0usize, |a, n| {
            let own = checked_product(&n.output)?;
            let inner = match &n.op {
                // Scores: heads × sequence × sequence.
                Op::Attention { heads, .. } => heads.checked_mul(n.input.first()?.checked_pow(2)?)?,
                Op::Residual { body, shortcut } => activations(body)?.checked_add(activations(shortcut)?)?,
                Op::Sequence(inner) => activations(inner)?,
                _ => 0,
            };
            a.checked_add(own)?.checked_add(inner)
        })
    }
    match activations(&plan.nodes) {
        Some(n) if n <= MAX_ACTIVATIONS_PER_EXAMPLE => {}
        n => {
            let n = n.map_or("more than 2^64".to_string(), |n| n.to_string());
            return bad(format!("one example's forward pass produces {n} values; the limit is {MAX_ACTIVATIONS_PER_EXAMPLE}"));
        }
    }
    for a in plan.slots.iter().filter(|s| s.name.ends_with(".lora_A")) {
        let layer = a.name.trim_end_matches(".lora_A");
        let rank = a.shape[0];
        let fan_in: usize = a.shape[1..].iter().product();
        let out = plan.slots.iter().find(|s| s.name == format!("{layer}.weight")).map_or(0, |w| w.shape[0]);
        if rank > fan_in.min(out) {
            return bad(format!(
                "lora rank {rank} exceeds layer {layer:?} ({out} outputs, {fan_in} inputs): use a rank of at most {}",
                fan_in.min(out)
            ));
        }
    }
    Ok(())
}

fn apply_freeze(plan: &mut Plan, finetune: &FineTune) -> Result<(), SpecError> {
    if let FineTune::Lora { also_train, .. } = finetune {
        for p in also_train {
            let mut hit = false;
            for s in plan.slots.iter_mut().filter(|s| s.kind == SlotKind::Param && glob_match(p, &s.name)) {
                s.trainable = true;
                hit = true;
            }
            if !hit {
                return Err(SpecError::InvalidSpec(format!("lora also_train pattern {p:?} matches no parameter")));
            }
        }
        return Ok(());
    }
    let FineTune::Freeze { trainable, frozen } = finetune else { return Ok(()) };
    let params: Vec<&str> = plan.slots.iter().filter(|s| s.kind == SlotKind::Param).map(|s| s.name.as_str()).collect();
    for p in trainable.iter().flatten().chain(frozen) {
        if !params.iter().any(|n| glob_match(p, n)) {
            return Err(SpecError::InvalidSpec(format!("freeze pattern {p:?} matches no parameter")));
        }
    }
    for s in plan.slots.iter_mut().filter(|s| s.kind == SlotKind::Param) {
        let listed = trainable.as_ref().is_none_or(|t| t.iter().any(|p| glob_match(p, &s.name)));
        s.trainable = listed && !frozen.iter().any(|p| glob_match(p, &s.name));
    }
    if !plan.slots.iter().any(|s| s.trainable) {
        return Err(SpecError::InvalidSpec("the freeze patterns leave nothing to train".into()));
    }
    Ok(())
}

fn checked_product(v: &[usize]) -> Option<usize> {
    v.iter().try_fold(1usize, |a, &d| a.checked_mul(d))
}

fn conv_out(len: usize, k: usize, s: usize, p: usize, d: usize) -> Option<usize> {
    let span = d.checked_mul(k - 1)? + 1;
    let padded = len + 2 * p;
    (padded >= span).then(|| (padded - span) / s + 1)
}

impl Builder<'_> {
    fn sequence(
        &mut self,
        layers: &[Layer],
        mut shape: Vec<usize>,
        path_prefix: &str,
        name_prefix: &str,
        depth: usize,
    ) -> Result<(Vec<Node>, Vec<usize>), SpecError> {
        if depth > MAX_DEPTH {
            return Err(SpecError::InvalidSpec(format!("residual blocks nest deeper than {MAX_DEPTH}")));
        }
        let mut nodes = Vec::with_capacity(layers.len());
        for (i, layer) in layers.iter().enumerate() {
            let path = format!("{path_prefix}{i}");
            let prefix = layer.explicit_name().map_or_else(|| format!("{name_prefix}.{i}"), str::to_string);
            let first = depth == 0 && i == 0;
            let node = self.layer(layer, shape, &path, &prefix, first, depth)?;
            shape = node.output.clone();
            nodes.push(node);
        }
        Ok((nodes, shape))
    }

    fn slot(&mut self, name: String, shape: Vec<usize>, kind: SlotKind, init: Init, fan_in: usize) -> usize {
        self.slots.push(Slot {
            name,
            shape,
            kind,
            init,
            fan_in,
            exchanged: true,
            transposed: false,
            trainable: kind == SlotKind::Param && !matches!(self.finetune, FineTune::Lora { .. }),
            integer: false,
        });
        self.slots.len() - 1
    }

    /// Weight + optional bias with PyTorch's default init U(±1/√fan_in), then a LoRA adapter
    /// when the fine-tuning mode targets this layer.
    fn weight_bias(
        &mut self,
        prefix: &str,
        wshape: Vec<usize>,
        fan_in: usize,
        bias: bool,
        transposed: bool,
    ) -> (usize, Option<usize>, Option<LoraSlots>) {
        let bound = 1.0 / (fan_in as f64).sqrt();
        let out = wshape[0];
        let w = self.slot(format!("{prefix}.weight"), wshape.clone(), SlotKind::Param, Init::Uniform(bound), fan_in);
        self.slots[w].transposed = transposed;
        let b = bias.then(|| self.slot(format!("{prefix}.bias"), vec![out], SlotKind::Param, Init::Uniform(bound), fan_in));
        let lora = match self.finetune {
            FineTune::Lora { rank, alpha, targets, freeze_a, .. } => {
                let hit = match targets {
                    None => true,
                    Some(t) => {
                        let mut any = false;
                        for (k, p) in t.iter().enumerate() {
                            if glob_match(p, prefix) {
                                self.lora_targets_hit[k] = true;
                                any = true;
                            }
                        }
                        any
                    }
                };
                hit.then(|| {
                    let mut a_shape = vec![*rank];
                    a_shape.extend_from_slice(&wshape[1..]);
                    let mut b_shape = vec![out, *rank];
                    b_shape.extend(std::iter::repeat_n(1, wshape.len() - 2));
                    // peft: A like the layer's own weight (kaiming-uniform a=√5), B zero, so
                    // the adapted model starts equal to the base model.
                    let a = self.slot(format!("{prefix}.lora_A"), a_shape, SlotKind::Param, Init::Uniform(bound), fan_in);
                    let b = self.slot(format!("{prefix}.lora_B"), b_shape, SlotKind::Param, Init::Const(0.0), *rank);
                    self.slots[a].trainable = !freeze_a;
                    self.slots[b].trainable = true;
                    LoraSlots { a, b, scale: alpha.0 / *rank as f64 }
                })
            }
            _ => None,
        };
        (w, b, lora)
    }

    fn layer(&mut self, layer: &Layer, input: Vec<usize>, path: &str, prefix: &str, first: bool, depth: usize) -> Result<Node, SpecError> {
        let at = where_(path, layer, prefix);
        let bad = |m: String| SpecError::InvalidSpec(format!("{at}: {m}"));
        let positive = |what: &str, v: usize| -> Result<(), SpecError> {
            if v == 0 || v > 1 << 20 { Err(bad(format!("{what} {v} must be in 1..=1048576"))) } else { Ok(()) }
        };
        let rank = |want: usize, form: &str| -> Result<(), SpecError> {
            if input.len() != want { Err(bad(format!("expects input {form} but gets {input:?}"))) } else { Ok(()) }
        };
        let declared = match layer {
            Layer::Linear { in_features: Some(n), .. } => Some(("in_features", *n, *input.last().expect("non-empty"), "features")),
            Layer::Conv1d { in_channels: Some(n), .. }
            | Layer::Conv2d { in_channels: Some(n), .. }
            | Layer::SeparableConv2d { in_channels: Some(n), .. } => Some(("in_channels", *n, input[0], "channels")),
            Layer::BatchNorm { num_features: Some(n), .. } => Some(("num_features", *n, input[0], "channels")),
            Layer::Gru { input_size: Some(n), .. } | Layer::Lstm { input_size: Some(n), .. } => {
                Some(("input_size", *n, input.get(1).copied().unwrap_or(0), "features per step"))
            }
            _ => None,
        };
        if let Some((field, want, got, what)) = declared
            && want != got
        {
            return Err(bad(format!("{field} {want} but input {input:?} has {got} {what}")));
        }
        let (op, output) = match layer {
            Layer::Linear { out_features, bias, .. } => {
                positive("out_features", *out_features)?;
                let fan_in = *input.last().expect("shapes are never empty");
                let (weight, bias, lora) = self.weight_bias(prefix, vec![*out_features, fan_in], fan_in, *bias, true);
                let mut out = input.clone();
                *out.last_mut().expect("non-empty") = *out_features;
                (Op::Linear { weight, bias, lora }, out)
            }
            Layer::Conv1d { out_channels, kernel_size, stride, padding, dilation, groups, bias, .. }
            | Layer::Conv2d { out_channels, kernel_size, stride, padding, dilation, groups, bias, .. } => {
                let dims = if matches!(layer, Layer::Conv1d { .. }) { 1 } else { 2 };
                rank(dims + 1, if dims == 1 { "[channels, length]" } else { "[channels, height, width]" })?;
                for (what, v) in [
                    ("out_channels", *out_channels),
                    ("kernel_size", *kernel_size),
                    ("stride", *stride),
                    ("dilation", *dilation),
                    ("groups", *groups),
                ] {
                    positive(what, v)?;
                }
                if *padding > 1 << 20 {
                    return Err(bad(format!("padding {padding} must be at most 1048576")));
                }
                let cin = input[0];
                if !cin.is_multiple_of(*groups) || !out_channels.is_multiple_of(*groups) {
                    return Err(bad(format!("groups {groups} must divide in_channels {cin} and out_channels {out_channels}")));
                }
                let mut out = vec![*out_channels];
                for &len in &input[1..] {
                    out.push(conv_out(len, *kernel_size, *stride, *padding, *dilation).ok_or_else(|| {
                        bad(format!("kernel {kernel_size} (dilation {dilation}, padding {padding}) is larger than the input {input:?}"))
                    })?);
                }
                let mut wshape = vec![*out_channels, cin / groups];
                wshape.extend(std::iter::repeat_n(*kernel_size, dims));
                let fan_in = (cin / groups)
                    .checked_mul(kernel_size.pow(dims as u32))
                    .filter(|&n| n <= MAX_ELEMENTS)
                    .ok_or_else(|| bad(format!("kernel {kernel_size} over {cin} channels is too large")))?;
                let (weight, bias, lora) = self.weight_bias(prefix, wshape, fan_in, *bias, false);
                let op =
                    Op::Conv { dims, weight, bias, stride: *stride, padding: *padding, dilation: 1.max(*dilation), groups: *groups, lora };
                (op, out)
            }
            Layer::SeparableConv2d { out_channels, kernel_size, stride, padding, bias, .. } => {
                rank(3, "[channels, height, width]")?;
                for (what, v) in [("out_channels", *out_channels), ("kernel_size", *kernel_size), ("stride", *stride)] {
                    positive(what, v)?;
                }
                if *padding > 1 << 20 {
                    return Err(bad(format!("padding {padding} must be at most 1048576")));
                }
                let c = input[0];
                let mut mid = vec![c];
                for &len in &input[1..] {
                    mid.push(
                        conv_out(len, *kernel_size, *stride, *padding, 1)
                            .ok_or_else(|| bad(format!("kernel {kernel_size} (padding {padding}) is larger than the input {input:?}")))?,
                    );
                }
                let dw_prefix = format!("{prefix}.depthwise");
                let (w1, b1, l1) =
                    self.weight_bias(&dw_prefix, vec![c, 1, *kernel_size, *kernel_size], kernel_size * kernel_size, *bias, false);
                let pw_prefix = format!("{prefix}.pointwise");
                let (w2, b2, l2) = self.weight_bias(&pw_prefix, vec![*out_channels, c, 1, 1], c, *bias, false);
                let out = vec![*out_channels, mid[1], mid[2]];
                let depthwise = Node {
                    op: Op::Conv { dims: 2, weight: w1, bias: b1, stride: *stride, padding: *padding, dilation: 1, groups: c, lora: l1 },
                    input: input.clone(),
                    output: mid.clone(),
                };
                let pointwise = Node {
                    op: Op::Conv { dims: 2, weight: w2, bias: b2, stride: 1, padding: 0, dilation: 1, groups: 1, lora: l2 },
                    input: mid,
                    output: out.clone(),
                };
                return Ok(Node { op: Op::Sequence(vec![depthwise, pointwise]), input, output: out });
            }
            Layer::BatchNorm { eps, momentum, local, .. } => {
                if !(eps.0.is_finite() && eps.0 > 0.0 && (0.0..=1.0).contains(&momentum.0)) {
                    return Err(bad(format!("eps {} must be > 0 and momentum {} in [0, 1]", eps.0, momentum.0)));
                }
                let c = input[0];
                let weight = self.slot(format!("{prefix}.weight"), vec![c], SlotKind::Param, Init::Const(1.0), c);
                let bias = self.slot(format!("{prefix}.bias"), vec![c], SlotKind::Param, Init::Const(0.0), c);
                let mean = self.slot(format!("{prefix}.running_mean"), vec![c], SlotKind::Buffer, Init::Const(0.0), c);
                let var = self.slot(format!("{prefix}.running_var"), vec![c], SlotKind::Buffer, Init::Const(1.0), c);
                let count = self.slot(format!("{prefix}.num_batches_tracked"), vec![], SlotKind::Buffer, Init::Const(0.0), c);
                self.slots[count].integer = true;
                if *local {
                    for s in [weight, bias, mean, var, count] {
                        self.slots[s].exchanged = false;
                    }
                }
                (Op::BatchNorm { weight, bias, mean, var, count, eps: eps.0, momentum: momentum.0 }, input.clone())
            }
            Layer::LayerNorm { eps, .. } => {
                if !(eps.0.is_finite() && eps.0 > 0.0) {
                    return Err(bad(format!("eps {} must be > 0", eps.0)));
                }
                let n = *input.last().expect("non-empty");
                let weight = self.slot(format!("{prefix}.weight"), vec![n], SlotKind::Param, Init::Const(1.0), n);
                let bias = self.slot(format!("{prefix}.bias"), vec![n], SlotKind::Param, Init::Const(0.0), n);
                (Op::LayerNorm { weight, bias, eps: eps.0 }, input.clone())
            }
            Layer::MaxPool1d { kernel_size, stride, padding }
            | Layer::MaxPool2d { kernel_size, stride, padding }
            | Layer::AvgPool1d { kernel_size, stride, padding }
            | Layer::AvgPool2d { kernel_size, stride, padding } => {
                let dims = if matches!(layer, Layer::MaxPool1d { .. } | Layer::AvgPool1d { .. }) { 1 } else { 2 };
                rank(dims + 1, if dims == 1 { "[channels, length]" } else { "[channels, height, width]" })?;
                positive("kernel_size", *kernel_size)?;
                let stride = stride.unwrap_or(*kernel_size);
                positive("stride", stride)?;
                if 2 * padding > *kernel_size {
                    return Err(bad(format!("padding {padding} must be at most half the kernel {kernel_size}")));
                }
                let mut out = vec![input[0]];
                for &len in &input[1..] {
                    out.push(
                        conv_out(len, *kernel_size, stride, *padding, 1)
                            .ok_or_else(|| bad(format!("kernel {kernel_size} is larger than the input {input:?}")))?,
                    );
                }
                let (kernel, padding) = (*kernel_size, *padding);
                let op = if matches!(layer, Layer::MaxPool1d { .. } | Layer::MaxPool2d { .. }) {
                    Op::MaxPool { dims, kernel, stride, padding }
                } else {
                    Op::AvgPool { dims, kernel, stride, padding }
                };
                (op, out)
            }
            Layer::GlobalAvgPool => {
                if input.len() < 2 {
                    return Err(bad(format!("expects input [channels, ...] with at least one spatial dimension, gets {input:?}")));
                }
                (Op::GlobalAvgPool, vec![input[0]])
            }
            Layer::Dropout { p } => {
                if !(0.0..1.0).contains(&p.0) {
                    return Err(bad(format!("p {} must be in [0, 1)", p.0)));
                }
                (Op::Dropout { p: p.0 }, input.clone())
            }
            Layer::Embedding { num_embeddings, embedding_dim, .. } => {
                if !first {
                    return Err(bad("an embedding must be the first layer (its input is the example's token ids)".into()));
                }
                rank(1, "[tokens]")?;
                positive("num_embeddings", *num_embeddings)?;
                positive("embedding_dim", *embedding_dim)?;
                let weight = self.slot(
                    format!("{prefix}.weight"),
                    vec![*num_embeddings, *embedding_dim],
                    SlotKind::Param,
                    Init::Normal,
                    *num_embeddings,
                );
                (Op::Embedding { weight, num: *num_embeddings }, vec![input[0], *embedding_dim])
            }
            Layer::Gru { hidden_size, output, .. } | Layer::Lstm { hidden_size, output, .. } => {
                rank(2, "[steps, features]")?;
                positive("hidden_size", *hidden_size)?;
                let gates = if matches!(layer, Layer::Gru { .. }) { 3 } else { 4 };
                let (h, fin) = (*hidden_size, input[1]);
                let bound = 1.0 / (h as f64).sqrt();
                let mut s =
                    |n: &str, shape: Vec<usize>| self.slot(format!("{prefix}.{n}"), shape, SlotKind::Param, Init::Uniform(bound), h);
                let w_ih = s("weight_ih_l0", vec![gates * h, fin]);
                let w_hh = s("weight_hh_l0", vec![gates * h, h]);
                let b_ih = s("bias_ih_l0", vec![gates * h]);
                let b_hh = s("bias_hh_l0", vec![gates * h]);
                let last = *output == RnnOutput::Last;
                let out = if last { vec![h] } else { vec![input[0], h] };
                let op = if gates == 3 {
                    Op::Gru { w_ih, w_hh, b_ih, b_hh, hidden: h, last }
                } else {
                    Op::Lstm { w_ih, w_hh, b_ih, b_hh, hidden: h, last }
                };
                (op, out)
            }
            Layer::MultiheadAttention { num_heads, .. } => {
                rank(2, "[sequence, embed_dim]")?;
                positive("num_heads", *num_heads)?;
                let e = input[1];
                if !e.is_multiple_of(*num_heads) {
                    return Err(bad(format!("embed_dim {e} is not divisible by num_heads {num_heads}")));
                }
                // PyTorch: xavier_uniform on in_proj_weight, zero biases, out_proj like Linear.
                let xavier = (6.0 / (e + 3 * e) as f64).sqrt();
                let in_w = self.slot(format!("{prefix}.in_proj_weight"), vec![3 * e, e], SlotKind::Param, Init::Uniform(xavier), e);
                let in_b = self.slot(format!("{prefix}.in_proj_bias"), vec![3 * e], SlotKind::Param, Init::Const(0.0), e);
                let out_w =
                    self.slot(format!("{prefix}.out_proj.weight"), vec![e, e], SlotKind::Param, Init::Uniform(1.0 / (e as f64).sqrt()), e);
                let out_b = self.slot(format!("{prefix}.out_proj.bias"), vec![e], SlotKind::Param, Init::Const(0.0), e);
                (Op::Attention { in_w, in_b, out_w, out_b, heads: *num_heads }, input.clone())
            }
            Layer::Reshape { shape } => {
                if shape.is_empty() || shape.len() > 3 || shape.contains(&0) {
                    return Err(bad(format!("shape {shape:?} must have 1 to 3 non-zero dimensions")));
                }
                if checked_product(shape) != checked_product(&input) {
                    return Err(bad(format!("cannot reshape {input:?} to {shape:?}: sizes differ")));
                }
                (Op::Reshape, shape.clone())
            }
            Layer::Flatten => (Op::Reshape, vec![input.iter().product()]),
            Layer::Relu => (Op::Relu, input.clone()),
            Layer::Gelu => (Op::Gelu, input.clone()),
            Layer::Tanh => (Op::Tanh, input.clone()),
            Layer::Sigmoid => (Op::Sigmoid, input.clone()),
            Layer::Silu => (Op::Silu, input.clone()),
            Layer::Softmax => (Op::Softmax, input.clone()),
            Layer::LeakyRelu { negative_slope } => {
                if !negative_slope.0.is_finite() {
                    return Err(bad("negative_slope must be finite".into()));
                }
                (Op::LeakyRelu(negative_slope.0), input.clone())
            }
            Layer::Residual { layers, shortcut, .. } => {
                if layers.is_empty() {
                    return Err(bad("a residual block needs at least one layer".into()));
                }
                let (body, out) = self.sequence(layers, input.clone(), &format!("{path}."), &format!("{prefix}.layers"), depth + 1)?;
                let (short, short_out) =
                    self.sequence(shortcut, input.clone(), &format!("{path}.shortcut."), &format!("{prefix}.shortcut"), depth + 1)?;
                if out != short_out {
                    return Err(bad(format!("the block gives {out:?} but the shortcut gives {short_out:?}; they must match to be added")));
                }
                (Op::Residual { body, shortcut: short }, out)
            }
        };
        if output.len() > 3 || checked_product(&output).is_none_or(|n| n > MAX_ELEMENTS) {
            return Err(bad(format!("output {output:?} has too many dimensions or values")));
        }
        if self.slots.iter().any(|s| checked_product(&s.shape).is_none_or(|n| n > MAX_ELEMENTS)) {
            return Err(bad("a tensor is too large".into()));
        }
        Ok(Node { op, input, output })
    }
}

/// Per slot: whether local training changes it (trainable parameters, and the statistics of
/// batch norms whose weight trains).
pub fn updated_slots(plan: &Plan) -> Vec<bool> {
    fn walk(nodes: &[Node], plan: &Plan, out: &mut [bool]) {
        for n in nodes {
            match &n.op {
                Op::BatchNorm { weight, mean, var, count, .. } if plan.slots[*weight].trainable => {
                    for s in [mean, var, count] {
                        out[*s] = true;
                    }
                }
                Op::Residual { body, shortcut } => {
                    walk(body, plan, out);
                    walk(shortcut, plan, out);
                }
                Op::Sequence(nodes) => walk(nodes, plan, out),
                _ => {}
            }
        }
    }
    let mut out: Vec<bool> = plan.slots.iter().map(|s| s.trainable).collect();
    walk(&plan.nodes, plan, &mut out);
    out
}
