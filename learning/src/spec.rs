//! `ModelSpec`: architecture name + configuration, serialised into model manifests so any
//! component can rebuild the module and check a bundle's layout.

use crate::error::LearningError;
use crate::model::Model;
use serde::{Deserialize, Serialize};

/// Architecture and sizes of a model. JSON form (the `arch` tag selects the variant):
///
/// ```json
/// {"arch":"mlp","input":[64],"hidden":[64],"classes":10}
/// {"arch":"cnn","input":[1,8,8],"channels":[16,32],"hidden":[64],"classes":10}
/// ```
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

    /// Architecture name (`"mlp"` or `"cnn"`).
    pub fn arch(&self) -> &'static str {
        match self {
            ModelSpec::Mlp { .. } => "mlp",
            ModelSpec::Cnn { .. } => "cnn",
        }
    }

    /// Shape of one input example.
    pub fn input_shape(&self) -> &[usize] {
        match self {
            ModelSpec::Mlp { input, .. } | ModelSpec::Cnn { input, .. } => input,
        }
    }

    /// Number of input values per example.
    pub fn input_len(&self) -> usize {
        self.input_shape().iter().product()
    }

    /// Number of classes.
    pub fn classes(&self) -> usize {
        match self {
            ModelSpec::Mlp { classes, .. } | ModelSpec::Cnn { classes, .. } => *classes,
        }
    }

    /// Checks sizes are usable.
    pub fn validate(&self) -> Result<(), LearningError> {
        let bad = |m: String| Err(LearningError::InvalidSpec(m));
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
        }
        Ok(())
    }

    /// Spatial size after the convolution stack of a CNN, as `(C, H, W)`.
    pub(crate) fn cnn_out(&self) -> Option<(usize, usize, usize)> {
        match self {
            ModelSpec::Cnn { input, channels, .. } => {
                let (mut h, mut w) = (input[1], input[2]);
                for _ in channels {
                    if h >= 2 && w >= 2 {
                        h /= 2;
                        w /= 2;
                    }
                }
                Some((*channels.last()?, h, w))
            }
            ModelSpec::Mlp { .. } => None,
        }
    }

    /// Widths of the linear stack `[in, h1, ..., classes]`.
    pub(crate) fn linear_widths(&self) -> Vec<usize> {
        let (first, hidden) = match self {
            ModelSpec::Mlp { hidden, .. } => (self.input_len(), hidden),
            ModelSpec::Cnn { hidden, .. } => {
                let (c, h, w) = self.cnn_out().expect("cnn");
                (c * h * w, hidden)
            }
        };
        let mut v = vec![first];
        v.extend(hidden.iter().copied());
        v.push(self.classes());
        v
    }

    /// Every parameter, in a fixed order, with its bundle (PyTorch) name and shape.
    pub fn params(&self) -> Vec<ParamInfo> {
        let mut out = Vec::new();
        if let ModelSpec::Cnn { input, channels, .. } = self {
            let mut cin = input[0];
            for (i, &cout) in channels.iter().enumerate() {
                let fan_in = cin * 9;
                out.push(ParamInfo { name: format!("conv{}.weight", i + 1), shape: vec![cout, cin, 3, 3], fan_in });
                out.push(ParamInfo { name: format!("conv{}.bias", i + 1), shape: vec![cout], fan_in });
                cin = cout;
            }
        }
        let widths = self.linear_widths();
        for (i, pair) in widths.windows(2).enumerate() {
            let (din, dout) = (pair[0], pair[1]);
            out.push(ParamInfo { name: format!("fc{}.weight", i + 1), shape: vec![dout, din], fan_in: din });
            out.push(ParamInfo { name: format!("fc{}.bias", i + 1), shape: vec![dout], fan_in: din });
        }
        out
    }

    /// Parameter layout (name → PyTorch shape), as the protocol's bundles check it.
    pub fn layout(&self) -> fedfleet_protocol::bundle::Layout {
        self.params().into_iter().map(|p| (p.name, p.shape)).collect()
    }

    /// Total number of scalar parameters.
    pub fn num_params(&self) -> usize {
        self.params().iter().map(|p| p.shape.iter().product::<usize>()).sum()
    }

    /// JSON for manifests.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("spec serialises")
    }

    /// Parses and validates the JSON form.
    pub fn from_json(s: &str) -> Result<Self, LearningError> {
        let spec: ModelSpec =
            serde_json::from_str(s).map_err(|e| LearningError::InvalidSpec(e.to_string()))?;
        spec.validate()?;
        Ok(spec)
    }

    /// A freshly initialised model (PyTorch's default init: U(±1/√fan_in) for weights and
    /// biases), reproducible from `seed`. Panics if the spec is invalid; see [`Model::init`].
    pub fn init(&self, seed: u64) -> Model {
        Model::init(self, seed).expect("valid model spec")
    }
}
