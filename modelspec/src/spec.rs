//! `ModelSpec`: architecture name + configuration, serialised into model manifests so any
//! component can rebuild the module and check a bundle's layout.

use crate::SpecError;
use crate::graph::{FineTune, GraphSpec, Layer, Plan, SlotKind, Task};
use serde::{Deserialize, Serialize};

/// Architecture and sizes of a model. JSON form (the `arch` tag selects the variant):
///
/// ```json
/// {"arch":"mlp","input":[64],"hidden":[64],"classes":10}
/// {"arch":"cnn","input":[1,8,8],"channels":[16,32],"hidden":[64],"classes":10}
/// {"arch":"graph","input":[64],"task":"classification","layers":[{"type":"linear","out_features":10}]}
/// {"arch":"custom","kind":"acme/kws","input":[40,16],"output":12,"tensors":[{"name":"head.weight","shape":[12,64]}]}
/// ```
///
/// `mlp` and `cnn` are presets: they compile to the same layer graph as [`ModelSpec::to_graph`]
/// returns, with their historical tensor names (`fc1`, `conv1`, ...).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "arch", rename_all = "lowercase", deny_unknown_fields)]
pub enum ModelSpec {
    /// Multi-layer perceptron: the input (any shape, flattened) goes through `hidden` ReLU
    /// layers, then a linear layer to `classes` logits. Parameters `fc1..fc{n+1}`.
    Mlp {
        /// Shape of one example (flattened in the model), e.g. `[64]` or `[1, 28, 28]`.
        input: Vec<usize>,
        /// Hidden layer widths.
        hidden: Vec<usize>,
        /// Number of classes (output logits).
        classes: usize,
    },
    /// Small CNN over `[C, H, W]` images: per entry of `channels` a 3x3 convolution
    /// (padding 1), ReLU and 2x2 max-pool (skipped once a side is below 2), then flatten,
    /// `hidden` ReLU linear layers and a linear output layer. Parameters `conv1..convN`, `fc1..fcM`.
    Cnn {
        /// `[channels, height, width]` of one example.
        input: Vec<usize>,
        /// Output channels of each convolution.
        channels: Vec<usize>,
        /// Hidden linear layer widths after flattening.
        hidden: Vec<usize>,
        /// Number of classes.
        classes: usize,
    },
    /// A user model: a layer graph with a task and a fine-tuning mode (see [`GraphSpec`]).
    Graph(GraphSpec),
    /// A model the device team runs with its own code (a `Trainer` in the agent): the spec
    /// declares only its tensors and which of them an update carries, which is all the
    /// aggregator and the registry need. No built-in engine runs it.
    Custom(CustomSpec),
}

/// A team's own model, declared by its tensors (see [`ModelSpec::Custom`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CustomSpec {
    /// The team's name for the architecture, e.g. `"acme/keyword-spotter"` (shown, not interpreted).
    pub kind: String,
    /// Shape of one input example.
    pub input: Vec<usize>,
    /// The task (default classification): picks the health check's metric.
    #[serde(default)]
    pub task: Task,
    /// Output values per example (the classes of a classifier).
    pub output: usize,
    /// Every tensor of the model's `state_dict`, in order.
    pub tensors: Vec<TensorDecl>,
    /// Glob patterns of the tensors local training changes and an update carries
    /// (default: every tensor).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trainable: Option<Vec<String>>,
}

/// One declared tensor of a [`CustomSpec`].
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorDecl {
    /// `state_dict` name, e.g. `conv1.weight`.
    pub name: String,
    /// PyTorch shape.
    pub shape: Vec<usize>,
}

impl CustomSpec {
    fn is_trainable(&self, name: &str) -> bool {
        self.trainable.as_ref().is_none_or(|globs| globs.iter().any(|g| crate::graph::glob_match(g, name)))
    }

    fn validate(&self) -> Result<(), SpecError> {
        let bad = |m: String| Err(SpecError::InvalidSpec(format!("custom model \"{}\": {m}", self.kind)));
        if self.input.is_empty() || self.input.contains(&0) {
            return bad(format!("input shape {:?} is empty", self.input));
        }
        if self.output == 0 {
            return bad("output must be at least 1".into());
        }
        if self.tensors.is_empty() {
            return bad("declares no tensors".into());
        }
        let mut seen = std::collections::HashSet::new();
        for t in &self.tensors {
            if t.name.is_empty() || !seen.insert(t.name.as_str()) {
                return bad(format!("tensor name {:?} is empty or declared twice", t.name));
            }
            if t.shape.contains(&0) || t.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).is_none_or(|n| n > 1 << 28) {
                return bad(format!("tensor {} has shape {:?} (empty or too large)", t.name, t.shape));
            }
        }
        let values = self.tensors.iter().try_fold(0usize, |a, t| a.checked_add(t.shape.iter().product()));
        if values.is_none_or(|n| n > crate::graph::MAX_MODEL_VALUES) {
            return bad(format!(
                "its tensors hold {} values; the limit is {}",
                values.map_or("more than 2^64".into(), |n| n.to_string()),
                crate::graph::MAX_MODEL_VALUES
            ));
        }
        for g in self.trainable.iter().flatten() {
            if !self.tensors.iter().any(|t| crate::graph::glob_match(g, &t.name)) {
                return bad(format!("trainable pattern {g:?} matches no tensor"));
            }
        }
        if !self.tensors.iter().any(|t| self.is_trainable(&t.name)) {
            return bad("no tensor is trainable".into());
        }
        Ok(())
    }
}

/// One parameter tensor of a spec: its name and shape as stored in bundles (PyTorch layout).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamInfo {
    /// e.g. `fc1.weight`.
    pub name: String,
    /// PyTorch shape, e.g. `[out, in]` for linear weights.
    pub shape: Vec<usize>,
    /// Fan-in used by the default initialisation.
    pub fan_in: usize,
}

/// Where a tensor goes after local training.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorRole {
    /// Trained (or, for statistics, updated) and sent in the update.
    Sent,
    /// Trained or updated but kept on the device (FedBN `local` batch norms).
    Local,
    /// Never changed by local training (frozen by the fine-tuning mode).
    Fixed,
}

impl ModelSpec {
    /// The default MLP for the digits task: 64 → 64 → 10 (4,810 parameters).
    pub fn digits_mlp() -> Self {
        ModelSpec::Mlp { input: vec![64], hidden: vec![64], classes: 10 }
    }

    /// The default CNN for digits (8x8): conv 1→16, conv 16→32, fc 128→64→10.
    pub fn digits_cnn() -> Self {
        ModelSpec::Cnn { input: vec![1, 8, 8], channels: vec![16, 32], hidden: vec![64], classes: 10 }
    }

    /// A small CNN for MNIST (28x28): conv 1→16, conv 16→32, fc 1568→128→10.
    pub fn mnist_cnn() -> Self {
        ModelSpec::Cnn { input: vec![1, 28, 28], channels: vec![16, 32], hidden: vec![128], classes: 10 }
    }

    /// Architecture name (`"mlp"`, `"cnn"` or `"graph"`).
    pub fn arch(&self) -> &'static str {
        match self {
            ModelSpec::Mlp { .. } => "mlp",
            ModelSpec::Cnn { .. } => "cnn",
            ModelSpec::Graph(_) => "graph",
            ModelSpec::Custom(_) => "custom",
        }
    }

    /// Shape of one input example.
    pub fn input_shape(&self) -> &[usize] {
        match self {
            ModelSpec::Mlp { input, .. } | ModelSpec::Cnn { input, .. } => input,
            ModelSpec::Graph(g) => &g.input,
            ModelSpec::Custom(c) => &c.input,
        }
    }

    /// Number of input values per example.
    pub fn input_len(&self) -> usize {
        self.input_shape().iter().product()
    }

    /// The task (the presets are classifiers).
    pub fn task(&self) -> Task {
        match self {
            ModelSpec::Graph(g) => g.task,
            ModelSpec::Custom(c) => c.task,
            _ => Task::Classification,
        }
    }

    /// The fine-tuning mode (the presets train fully).
    pub fn finetune(&self) -> FineTune {
        match self {
            ModelSpec::Graph(g) => g.finetune.clone(),
            _ => FineTune::Full,
        }
    }

    /// Number of output values per example: the classes of a classifier, the targets of a
    /// regression, the input size of an autoencoder. 0 for an invalid graph.
    pub fn classes(&self) -> usize {
        match self {
            ModelSpec::Mlp { classes, .. } | ModelSpec::Cnn { classes, .. } => *classes,
            ModelSpec::Graph(_) | ModelSpec::Custom(_) => self.output_len(),
        }
    }

    /// Number of output values per example (0 for an invalid spec).
    pub fn output_len(&self) -> usize {
        match self {
            ModelSpec::Custom(c) => c.output,
            _ => self.plan().map_or(0, |p| p.output.iter().product()),
        }
    }

    /// Whether a built-in engine runs this model (every spec but [`ModelSpec::Custom`]).
    pub fn is_builtin(&self) -> bool {
        !matches!(self, ModelSpec::Custom(_))
    }

    /// The equivalent layer graph. Presets keep their historical tensor names: MLP
    /// `[flatten, fc1, relu, ..., fcN]`; CNN per channel entry `conv{i}` (3x3, padding 1), relu,
    /// 2x2 max-pool while both sides are >= 2, then flatten and the `fc` stack. A custom model
    /// has no layers here.
    pub fn to_graph(&self) -> GraphSpec {
        let linear =
            |i: usize, out: usize| Layer::Linear { name: Some(format!("fc{i}")), in_features: None, out_features: out, bias: true };
        let head = |hidden: &[usize], classes: usize, layers: &mut Vec<Layer>| {
            for (i, &h) in hidden.iter().enumerate() {
                layers.push(linear(i + 1, h));
                layers.push(Layer::Relu);
            }
            layers.push(linear(hidden.len() + 1, classes));
        };
        match self {
            ModelSpec::Graph(g) => g.clone(),
            ModelSpec::Custom(c) => GraphSpec { input: c.input.clone(), task: c.task, layers: Vec::new(), finetune: FineTune::Full },
            ModelSpec::Mlp { input, hidden, classes } => {
                let mut layers = vec![Layer::Flatten];
                head(hidden, *classes, &mut layers);
                GraphSpec { input: input.clone(), task: Task::Classification, layers, finetune: FineTune::Full }
            }
            ModelSpec::Cnn { input, channels, hidden, classes } => {
                let mut layers = Vec::new();
                let (mut h, mut w) = (input.get(1).copied().unwrap_or(0), input.get(2).copied().unwrap_or(0));
                for (i, &c) in channels.iter().enumerate() {
                    layers.push(Layer::Conv2d {
                        name: Some(format!("conv{}", i + 1)),
                        in_channels: None,
                        out_channels: c,
                        kernel_size: 3,
                        stride: 1,
                        padding: 1,
                        dilation: 1,
                        groups: 1,
                        bias: true,
                    });
                    layers.push(Layer::Relu);
                    if h >= 2 && w >= 2 {
                        layers.push(Layer::MaxPool2d { kernel_size: 2, stride: None, padding: 0 });
                        h /= 2;
                        w /= 2;
                    }
                }
                layers.push(Layer::Flatten);
                head(hidden, *classes, &mut layers);
                GraphSpec { input: input.clone(), task: Task::Classification, layers, finetune: FineTune::Full }
            }
        }
    }

    /// Validates and compiles the model: shapes of every layer and the tensor list.
    pub fn plan(&self) -> Result<Plan, SpecError> {
        if let ModelSpec::Custom(c) = self {
            return Err(SpecError::InvalidSpec(format!(
                "custom model \"{}\" has no built-in engine: the device team's Trainer runs it",
                c.kind
            )));
        }
        self.validate_preset()?;
        self.to_graph().compile()
    }

    fn validate_preset(&self) -> Result<(), SpecError> {
        let bad = |m: String| Err(SpecError::InvalidSpec(m));
        if let ModelSpec::Graph(_) | ModelSpec::Custom(_) = self {
            return Ok(());
        }
        if self.classes() < 2 {
            return bad(format!("classes must be >= 2, got {}", self.classes()));
        }
        if self.input_shape().is_empty() || self.input_len() == 0 {
            return bad(format!("input shape {:?} is empty", self.input_shape()));
        }
        if self.input_len() > 1 << 26 {
            return bad(format!("input shape {:?} is too large", self.input_shape()));
        }
        match self {
            ModelSpec::Mlp { hidden, .. } => {
                if hidden.iter().any(|&h| h == 0 || h > 1 << 16) {
                    return bad(format!("hidden widths {hidden:?} must be in 1..=65536"));
                }
            }
            ModelSpec::Cnn { input, channels, hidden, .. } => {
                if input.len() != 3 {
                    return bad(format!("cnn input must be [C, H, W], got {input:?}"));
                }
                if channels.is_empty() {
                    return bad("cnn needs at least one convolution".into());
                }
                if channels.iter().chain(hidden).any(|&h| h == 0 || h > 1 << 16) {
                    return bad(format!("channels {channels:?} / hidden {hidden:?} must be in 1..=65536"));
                }
            }
            ModelSpec::Graph(_) | ModelSpec::Custom(_) => {}
        }
        Ok(())
    }

    /// Checks the spec is usable (every layer's shapes, sizes, fine-tuning patterns).
    pub fn validate(&self) -> Result<(), SpecError> {
        match self {
            ModelSpec::Custom(c) => c.validate(),
            _ => self.plan().map(|_| ()),
        }
    }

    /// Every tensor (parameters and batch-norm statistics), in initialisation order, with its
    /// bundle (PyTorch `state_dict`) name and shape. Empty for an invalid spec.
    pub fn params(&self) -> Vec<ParamInfo> {
        if let ModelSpec::Custom(c) = self {
            let fan_in = |s: &[usize]| s.iter().skip(1).product::<usize>().max(1);
            return c
                .tensors
                .iter()
                .map(|t| ParamInfo { name: t.name.clone(), shape: t.shape.clone(), fan_in: fan_in(&t.shape) })
                .collect();
        }
        self.plan()
            .map(|p| p.slots.into_iter().map(|s| ParamInfo { name: s.name, shape: s.shape, fan_in: s.fan_in }).collect())
            .unwrap_or_default()
    }

    /// Parameter layout (name → PyTorch shape), as the protocol's bundles check it.
    pub fn layout(&self) -> fedfleet_protocol::bundle::Layout {
        self.params().into_iter().map(|p| (p.name, p.shape)).collect()
    }

    /// What local training does with each tensor (by name). Empty for an invalid spec.
    pub fn roles(&self) -> Vec<(String, TensorRole)> {
        if let ModelSpec::Custom(c) = self {
            let role = |n: &str| if c.is_trainable(n) { TensorRole::Sent } else { TensorRole::Fixed };
            return c.tensors.iter().map(|t| (t.name.clone(), role(&t.name))).collect();
        }
        let Ok(plan) = self.plan() else { return Vec::new() };
        let updated = crate::graph::updated_slots(&plan);
        plan.slots
            .iter()
            .zip(updated)
            .map(|(s, changed)| {
                let role = match (changed, s.exchanged) {
                    (false, _) => TensorRole::Fixed,
                    (true, true) => TensorRole::Sent,
                    (true, false) => TensorRole::Local,
                };
                (s.name.clone(), role)
            })
            .collect()
    }

    /// Layout of a training update (the tensors local training's delta carries).
    pub fn update_layout(&self) -> fedfleet_protocol::bundle::Layout {
        let roles: std::collections::HashMap<String, TensorRole> = self.roles().into_iter().collect();
        self.layout().into_iter().filter(|(n, _)| roles.get(n) == Some(&TensorRole::Sent)).collect()
    }

    /// Total number of scalar values over every tensor (parameters and statistics).
    pub fn num_params(&self) -> usize {
        self.params().iter().map(|p| p.shape.iter().product::<usize>()).sum()
    }

    /// Number of trainable scalars under the fine-tuning mode.
    pub fn num_trainable(&self) -> usize {
        if let ModelSpec::Custom(_) = self {
            return self.update_layout().values().map(|s| s.iter().product::<usize>()).sum();
        }
        self.plan().map_or(0, |p| p.slots.iter().filter(|s| s.trainable && s.kind == SlotKind::Param).map(|s| s.len()).sum())
    }

    /// One line per layer: position, kind, tensor prefix, input → output shape and the number
    /// of values in its tensors (like `torchinfo.summary`), then the totals.
    pub fn summary(&self) -> Result<String, SpecError> {
        use crate::graph::{Node, Op};
        fn slots_of(op: &Op, out: &mut Vec<usize>) {
            match op {
                Op::Linear { weight, bias, lora } | Op::Conv { weight, bias, lora, .. } => {
                    out.push(*weight);
                    out.extend(bias);
                    if let Some(l) = lora {
                        out.extend([l.a, l.b]);
                    }
                }
                Op::BatchNorm { weight, bias, mean, var, count, .. } => out.extend([*weight, *bias, *mean, *var, *count]),
                Op::LayerNorm { weight, bias, .. } => out.extend([*weight, *bias]),
                Op::Embedding { weight, .. } => out.push(*weight),
                Op::Gru { w_ih, w_hh, b_ih, b_hh, .. } | Op::Lstm { w_ih, w_hh, b_ih, b_hh, .. } => {
                    out.extend([*w_ih, *w_hh, *b_ih, *b_hh])
                }
                Op::Attention { in_w, in_b, out_w, out_b, .. } => out.extend([*in_w, *in_b, *out_w, *out_b]),
                Op::Residual { body, shortcut } => body.iter().chain(shortcut).for_each(|n| slots_of(&n.op, out)),
                Op::Sequence(nodes) => nodes.iter().for_each(|n| slots_of(&n.op, out)),
                _ => {}
            }
        }
        if let ModelSpec::Custom(c) = self {
            self.validate()?;
            let roles: std::collections::HashMap<_, _> = self.roles().into_iter().collect();
            let mut lines: Vec<String> = c.tensors.iter().map(|t| format!("{:<32} {:?}  {:?}", t.name, t.shape, roles[&t.name])).collect();
            lines.push(format!(
                "custom model \"{}\": {} tensors, {} values, {} trainable; task {:?}; output {}",
                c.kind,
                c.tensors.len(),
                self.num_params(),
                self.num_trainable(),
                c.task,
                c.output
            ));
            return Ok(lines.join("\n"));
        }
        let plan = self.plan()?;
        let graph = self.to_graph();
        let mut lines = Vec::new();
        fn walk(layers: &[Layer], nodes: &[Node], plan: &Plan, path: &str, names: &str, lines: &mut Vec<String>) {
            for (i, (layer, node)) in layers.iter().zip(nodes).enumerate() {
                let mut slots = Vec::new();
                slots_of(&node.op, &mut slots);
                let values: usize = slots.iter().map(|&s| plan.slots[s].len()).sum();
                let prefix = layer.explicit_name().map_or_else(|| format!("{names}.{i}"), str::to_string);
                let shown = if slots.is_empty() && !matches!(layer, Layer::Residual { .. }) { "" } else { prefix.as_str() };
                let at = format!("{path}{i}");
                lines.push(format!("{at:<6} {:<20} {shown:<24} {:?} -> {:?}  {values}", layer.kind(), node.input, node.output));
                if let (Layer::Residual { layers: body, shortcut, .. }, Op::Residual { body: bn, shortcut: sn }) = (layer, &node.op) {
                    walk(body, bn, plan, &format!("{at}."), &format!("{prefix}.layers"), lines);
                    walk(shortcut, sn, plan, &format!("{at}.shortcut."), &format!("{prefix}.shortcut"), lines);
                }
            }
        }
        walk(&graph.layers, &plan.nodes, &plan, "", "layers", &mut lines);
        lines.push(format!(
            "{} tensors, {} values, {} trainable; task {:?}; output {:?}",
            plan.slots.len(),
            self.num_params(),
            self.num_trainable(),
            plan.task,
            plan.output
        ));
        Ok(lines.join("\n"))
    }

    /// JSON for manifests.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("spec serialises")
    }

    /// The spec as the JSON value model metadata carries (`ModelInfo::spec`, `NewVersion::spec`).
    pub fn spec_json(&self) -> fedfleet_protocol::SpecJson {
        fedfleet_protocol::SpecJson(serde_json::to_value(self).expect("spec serialises"))
    }

    /// Parses and validates the JSON form.
    pub fn from_json(s: &str) -> Result<Self, SpecError> {
        let spec: ModelSpec = serde_json::from_str(s).map_err(|e| SpecError::InvalidSpec(e.to_string()))?;
        spec.validate()?;
        Ok(spec)
    }
}
