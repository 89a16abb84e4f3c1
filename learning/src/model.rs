//! burn modules for the MLP and the CNN, and exact conversion to/from tensor bundles.
//!
//! Bundle tensor names and layouts follow PyTorch (`nn.Linear`, `nn.Conv2d`):
//! `fcN.weight` is `[out, in]`, `fcN.bias` `[out]`, `convN.weight` `[out, in, 3, 3]`,
//! `convN.bias` `[out]`. burn's `Linear` keeps its weight as `[in, out]`, so linear weights are
//! transposed on conversion (a pure copy: exact for f32).

use crate::error::LearningError;
use crate::rng::{self, streams};
use crate::spec::ModelSpec;
use burn::module::{Module, Param};
use burn::nn::conv::Conv2d;
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::nn::{Linear, PaddingConfig2d};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor, TensorData};
use fedfleet_protocol::bundle::TensorBundle;
use std::path::Path;

/// MLP: `layers[i]` is PyTorch's `fc{i+1}`; ReLU between layers.
#[derive(Module, Debug)]
pub struct Mlp {
    /// Linear layers, input first.
    pub layers: Vec<Linear>,
}

/// CNN: 3x3 convolutions (padding 1) + ReLU + 2x2 max-pool, then linear layers.
#[derive(Module, Debug)]
pub struct Cnn {
    /// Convolutions (`conv1..`).
    pub convs: Vec<Conv2d>,
    /// Linear layers after flattening (`fc1..`).
    pub fcs: Vec<Linear>,
    /// 2x2 max-pool.
    pub pool: MaxPool2d,
}

/// The burn module of either architecture.
#[derive(Module, Debug)]
pub enum Net {
    /// MLP.
    Mlp(Mlp),
    /// CNN.
    Cnn(Cnn),
}

impl Mlp {
    /// Logits for a `[batch, features]` input.
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let n = self.layers.len();
        let mut x = x;
        for (i, layer) in self.layers.iter().enumerate() {
            x = layer.forward(x);
            if i + 1 < n {
                x = relu(x);
            }
        }
        x
    }
}

impl Cnn {
    /// Logits for a `[batch, C, H, W]` input.
    pub fn forward(&self, x: Tensor<4>) -> Tensor<2> {
        let mut x = x;
        for conv in &self.convs {
            x = relu(conv.forward(x));
            let [_, _, h, w] = x.dims();
            if h >= 2 && w >= 2 {
                x = self.pool.forward(x);
            }
        }
        let [b, c, h, w] = x.dims();
        let mut y: Tensor<2> = x.reshape([b, c * h * w]);
        let n = self.fcs.len();
        for (i, layer) in self.fcs.iter().enumerate() {
            y = layer.forward(y);
            if i + 1 < n {
                y = relu(y);
            }
        }
        y
    }
}

impl Net {
    /// Logits `[batch, classes]` from flattened examples `[batch, input_len]`.
    pub fn forward_flat(&self, spec: &ModelSpec, x: Tensor<2>) -> Tensor<2> {
        match self {
            Net::Mlp(m) => m.forward(x),
            Net::Cnn(c) => {
                let [b, _] = x.dims();
                let s = spec.input_shape();
                c.forward(x.reshape([b, s[0], s[1], s[2]]))
            }
        }
    }

    fn linears(&self) -> &[Linear] {
        match self {
            Net::Mlp(m) => &m.layers,
            Net::Cnn(c) => &c.fcs,
        }
    }

    /// Every parameter as a flat tensor in burn's own layout, in [`ModelSpec::params`] order.
    /// Used for whole-model terms in the loss (FedProx, SCAFFOLD).
    pub fn flat_params(&self) -> Vec<Tensor<1>> {
        let mut out = Vec::new();
        if let Net::Cnn(c) = self {
            for conv in &c.convs {
                out.push(conv.weight.val().reshape([conv.weight.shape().num_elements()]));
                out.push(conv.bias.as_ref().expect("bias").val());
            }
        }
        for l in self.linears() {
            out.push(l.weight.val().reshape([l.weight.shape().num_elements()]));
            out.push(l.bias.as_ref().expect("bias").val());
        }
        out
    }

    /// Builds the module from bundle tensors, on `device`.
    pub fn from_bundle(spec: &ModelSpec, bundle: &TensorBundle, device: &Device) -> Result<Net, LearningError> {
        spec.validate()?;
        check_layout(spec, bundle)?;
        let get = |name: &str| -> Result<Vec<f32>, LearningError> {
            bundle
                .to_f32(name)
                .ok_or_else(|| LearningError::Layout(format!("tensor {name} missing or not convertible to f32")))
        };
        let widths = spec.linear_widths();
        let mut linears = Vec::with_capacity(widths.len() - 1);
        for (i, pair) in widths.windows(2).enumerate() {
            let (din, dout) = (pair[0], pair[1]);
            let w = get(&format!("fc{}.weight", i + 1))?;
            let b = get(&format!("fc{}.bias", i + 1))?;
            linears.push(Linear {
                weight: Param::from_tensor(Tensor::from_data(TensorData::new(transpose(&w, dout, din), [din, dout]), device)),
                bias: Some(Param::from_tensor(Tensor::from_data(TensorData::new(b, [dout]), device))),
            });
        }
        Ok(match spec {
            ModelSpec::Mlp { .. } => Net::Mlp(Mlp { layers: linears }),
            ModelSpec::Cnn { input, channels, .. } => {
                let mut convs = Vec::with_capacity(channels.len());
                let mut cin = input[0];
                for (i, &cout) in channels.iter().enumerate() {
                    let w = get(&format!("conv{}.weight", i + 1))?;
                    let b = get(&format!("conv{}.bias", i + 1))?;
                    convs.push(Conv2d {
                        weight: Param::from_tensor(Tensor::from_data(TensorData::new(w, [cout, cin, 3, 3]), device)),
                        bias: Some(Param::from_tensor(Tensor::from_data(TensorData::new(b, [cout]), device))),
                        stride: [1, 1],
                        kernel_size: [3, 3],
                        dilation: [1, 1],
                        groups: 1,
                        padding: PaddingConfig2d::Explicit(1, 1, 1, 1),
                    });
                    cin = cout;
                }
                Net::Cnn(Cnn { convs, fcs: linears, pool: MaxPool2dConfig::new([2, 2]).init() })
            }
        })
    }

    /// Copies every parameter out into a bundle (PyTorch names and layouts). Exact.
    pub fn to_bundle(&self) -> Result<TensorBundle, LearningError> {
        let mut bundle = TensorBundle::new();
        if let Net::Cnn(c) = self {
            for (i, conv) in c.convs.iter().enumerate() {
                let shape = conv.weight.dims().to_vec();
                bundle.insert_f32(format!("conv{}.weight", i + 1), shape, read(conv.weight.val())?)?;
                let b = conv.bias.as_ref().expect("bias").val();
                bundle.insert_f32(format!("conv{}.bias", i + 1), b.dims().to_vec(), read(b)?)?;
            }
        }
        for (i, l) in self.linears().iter().enumerate() {
            let [din, dout] = l.weight.dims();
            let w = read(l.weight.val())?;
            bundle.insert_f32(format!("fc{}.weight", i + 1), vec![dout, din], transpose(&w, din, dout))?;
            let b = l.bias.as_ref().expect("bias").val();
            bundle.insert_f32(format!("fc{}.bias", i + 1), vec![dout], read(b)?)?;
        }
        Ok(bundle)
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

/// Checks that the bundle has exactly the spec's tensors and shapes.
pub fn check_layout(spec: &ModelSpec, bundle: &TensorBundle) -> Result<(), LearningError> {
    let want = spec.layout();
    let got = bundle.layout();
    if want == got {
        return Ok(());
    }
    let mut problems = Vec::new();
    for (name, shape) in want.iter() {
        match got.get(name) {
            None => problems.push(format!("missing {name}")),
            Some(s) if s != shape => problems.push(format!("{name} has shape {s:?}, expected {shape:?}")),
            _ => {}
        }
    }
    for name in got.keys() {
        if !want.contains_key(name) {
            problems.push(format!("unexpected {name}"));
        }
    }
    Err(LearningError::Layout(format!("{} ({}): {}", spec.arch(), spec.to_json(), problems.join("; "))))
}

/// A model: its spec and its burn module, on a device.
#[derive(Debug, Clone)]
pub struct Model {
    spec: ModelSpec,
    net: Net,
    device: Device,
}

impl Model {
    /// Fresh weights from `seed` (PyTorch's default init, U(±1/√fan_in)), on the CPU device.
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

    /// The burn module.
    pub fn net(&self) -> &Net {
        &self.net
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Logits for flattened examples `[batch, input_len]`.
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.net.forward_flat(&self.spec, x)
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
    let io = |source| LearningError::Io { path: path.to_path_buf(), source };
    std::fs::write(&tmp, bundle.encode()).map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}

/// Reads a safetensors file into a bundle (default protocol limits).
pub fn load_bundle(path: impl AsRef<Path>) -> Result<TensorBundle, LearningError> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|source| LearningError::Io { path: path.to_path_buf(), source })?;
    Ok(TensorBundle::decode(&bytes, &fedfleet_protocol::bundle::BundleLimits::default())?)
}

/// Initial weights for `spec` from `seed`, as a bundle: every tensor U(-1/√fan_in, 1/√fan_in)
/// (PyTorch's default for `nn.Linear`/`nn.Conv2d`), drawn in [`ModelSpec::params`] order from
/// a ChaCha8 stream, so the same seed gives the same bits on every machine.
pub fn init_bundle(spec: &ModelSpec, seed: u64) -> Result<TensorBundle, LearningError> {
    spec.validate()?;
    let mut r = rng::rng(seed, streams::INIT);
    let mut bundle = TensorBundle::new();
    for p in spec.params() {
        let n: usize = p.shape.iter().product();
        let bound = 1.0 / (p.fan_in as f64).sqrt();
        let values: Vec<f32> = (0..n).map(|_| rng::uniform(&mut r, -bound, bound) as f32).collect();
        bundle.insert_f32(&p.name, p.shape.clone(), values)?;
    }
    Ok(bundle)
}
