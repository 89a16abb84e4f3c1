//! Server math on burn tensors: the weighted fold and the FedOpt server step on any burn device.
//!
//! The default build has burn's CPU backend (`flex`) only; the `wgpu` cargo feature compiles
//! burn's GPU backend in, and [`select_device`] picks it (or honours `BURN_DEVICE`). The exact
//! integer fold in [`crate::strategy::fixed`] stays the service's default: f32 tensor sums depend
//! on summation order, so a tensor fold is deterministic only when updates are folded in one
//! canonical order ([`fold_canonical`]), which the shell can do because it keeps every accepted
//! payload on disk (see `persist`).

use burn::tensor::{Device, Tensor, TensorData};

use crate::strategy::{FedOptKind, FedOptParams, FedOptState, ServerStrategy, Strategy, StrategyError};

/// Why the tensor path refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AccelError {
    #[error("unknown compute device {0:?}; expected cpu, gpu or auto")]
    UnknownDevice(String),
    #[error("compute device gpu needs a build with the `wgpu` feature")]
    GpuNotBuilt,
    #[error("update has {got} values; the model has {expected}")]
    Shape { expected: usize, got: usize },
    #[error("weight must be positive")]
    BadWeight,
    #[error("nothing was folded")]
    Empty,
    #[error("tensor readback failed: {0}")]
    Readback(String),
}

/// The device named in config: `cpu` (burn flex), `gpu` (burn wgpu, with the `wgpu` feature) or
/// `auto` (`BURN_DEVICE` when set, else gpu when compiled in, else cpu). Named explicitly because
/// burn's default device prefers a GPU backend without probing for a driver.
pub fn select_device(name: &str) -> Result<Device, AccelError> {
    match name {
        "cpu" => Ok(Device::flex()),
        "gpu" => gpu_device(),
        "auto" => match std::env::var("BURN_DEVICE").ok().as_deref() {
            Some("flex" | "cpu") => Ok(Device::flex()),
            _ if cfg!(feature = "wgpu") => gpu_device(),
            _ => Ok(Device::flex()),
        },
        other => Err(AccelError::UnknownDevice(other.to_string())),
    }
}

#[cfg(feature = "wgpu")]
fn gpu_device() -> Result<Device, AccelError> {
    Ok(Device::wgpu(burn::tensor::DeviceKind::DefaultDevice))
}

#[cfg(not(feature = "wgpu"))]
fn gpu_device() -> Result<Device, AccelError> {
    Err(AccelError::GpuNotBuilt)
}

fn upload(device: &Device, values: &[f32]) -> Tensor<1> {
    Tensor::from_data(TensorData::new(values.to_vec(), [values.len()]), device)
}

fn download(t: Tensor<1>) -> Result<Vec<f32>, AccelError> {
    t.into_data().try_into_vec::<f32>().map_err(|e| AccelError::Readback(format!("{e:?}")))
}

/// A running weighted sum `Σ wᵢΔᵢ` held on a burn device: memory O(model) on the device.
pub struct TensorFold {
    device: Device,
    dim: usize,
    sum: Tensor<1>,
    total_weight: f64,
    count: u64,
}

impl TensorFold {
    pub fn new(device: &Device, dim: usize) -> Self {
        TensorFold { device: device.clone(), dim, sum: Tensor::zeros([dim], device), total_weight: 0.0, count: 0 }
    }

    pub fn fold(&mut self, delta: &[f32], weight: u64) -> Result<(), AccelError> {
        self.fold_scaled(delta, weight, 1.0)
    }

    /// Folds `scale·delta` with `weight` (clipping scales a delta, not its weight).
    pub fn fold_scaled(&mut self, delta: &[f32], weight: u64, scale: f64) -> Result<(), AccelError> {
        if delta.len() != self.dim {
            return Err(AccelError::Shape { expected: self.dim, got: delta.len() });
        }
        if weight == 0 {
            return Err(AccelError::BadWeight);
        }
        let term = upload(&self.device, delta).mul_scalar((weight as f64 * scale) as f32);
        self.sum = self.sum.clone().add(term);
        self.total_weight += weight as f64;
        self.count += 1;
        Ok(())
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    /// `Σ wᵢΔᵢ / Σ wᵢ`, read back to the host.
    pub fn mean(&self) -> Result<Vec<f32>, AccelError> {
        download(self.mean_tensor()?)
    }

    /// `Σ wᵢΔᵢ / Σ wᵢ`, left on the device.
    pub fn mean_tensor(&self) -> Result<Tensor<1>, AccelError> {
        if self.count == 0 {
            return Err(AccelError::Empty);
        }
        Ok(self.sum.clone().div_scalar(self.total_weight as f32))
    }
}

/// FedAvg mean of `updates` folded in the order given: pass them in a canonical order (e.g. by
/// payload digest) and the result is the same on one device whatever order they arrived in.
pub fn fold_canonical<'a>(
    device: &Device,
    dim: usize,
    updates: impl IntoIterator<Item = (&'a [f32], u64)>,
) -> Result<Vec<f32>, AccelError> {
    let mut fold = TensorFold::new(device, dim);
    for (delta, weight) in updates {
        fold.fold(delta, weight)?;
    }
    fold.mean()
}

/// Server optimizer state for [`fedopt_step`], kept on the device between rounds.
pub struct TensorFedOpt {
    device: Device,
    kind: FedOptKind,
    params: FedOptParams,
    m: Tensor<1>,
    v: Tensor<1>,
    t: u64,
}

impl TensorFedOpt {
    /// Zero moments, like [`crate::FedOpt`].
    pub fn new(device: &Device, kind: FedOptKind, params: FedOptParams, dim: usize) -> Self {
        TensorFedOpt {
            device: device.clone(),
            kind,
            params,
            m: Tensor::zeros([dim], device),
            v: Tensor::zeros([dim], device),
            t: 0,
        }
    }

    /// Continues from a [`crate::FedOpt`]'s persisted state.
    pub fn from_state(device: &Device, s: &FedOptState) -> Result<Self, AccelError> {
        if s.v.len() != s.m.len() {
            return Err(AccelError::Shape { expected: s.m.len(), got: s.v.len() });
        }
        Ok(TensorFedOpt {
            device: device.clone(),
            kind: s.kind,
            params: s.params,
            m: upload(device, &s.m),
            v: upload(device, &s.v),
            t: s.t,
        })
    }

    /// The state to persist (read back from the device).
    pub fn state(&self) -> Result<FedOptState, AccelError> {
        Ok(FedOptState {
            kind: self.kind,
            params: self.params,
            m: download(self.m.clone())?,
            v: download(self.v.clone())?,
            t: self.t,
        })
    }

    /// One server step of Reddi et al.'s Algorithm 2 (same update rules as [`crate::FedOpt`],
    /// in f32 on the device): returns the new global model.
    pub fn step(&mut self, global: &[f32], mean_delta: &[f32]) -> Result<Vec<f32>, AccelError> {
        self.step_tensor(global, upload(&self.device, mean_delta))
    }

    fn step_tensor(&mut self, global: &[f32], d: Tensor<1>) -> Result<Vec<f32>, AccelError> {
        let dim = self.m.dims()[0];
        for got in [global.len(), d.dims()[0]] {
            if got != dim {
                return Err(AccelError::Shape { expected: dim, got });
            }
        }
        let p = self.params;
        self.t += 1;
        let eta = match (self.kind, p.bias_correction) {
            (FedOptKind::Adam, true) => {
                let t = self.t.min(i32::MAX as u64) as i32;
                p.eta * (1.0 - p.beta_2.powi(t)).sqrt() / (1.0 - p.beta_1.powi(t))
            }
            _ => p.eta,
        };
        let d2 = d.clone().mul(d.clone());
        self.m = self.m.clone().mul_scalar(p.beta_1 as f32).add(d.mul_scalar((1.0 - p.beta_1) as f32));
        self.v = match self.kind {
            FedOptKind::Adam => self.v.clone().mul_scalar(p.beta_2 as f32).add(d2.mul_scalar((1.0 - p.beta_2) as f32)),
            FedOptKind::Yogi => {
                let sign = self.v.clone().sub(d2.clone()).sign();
                self.v.clone().sub(d2.mul(sign).mul_scalar((1.0 - p.beta_2) as f32))
            }
            FedOptKind::Adagrad => self.v.clone().add(d2),
        };
        let step = self.m.clone().div(self.v.clone().sqrt().add_scalar(p.tau as f32)).mul_scalar(eta as f32);
        download(upload(&self.device, global).add(step))
    }
}

/// The next global model of a FedAvg-family `strategy` from the round's updates, folded on
/// `device` in the order given (pass the canonical order): clipping as [`crate::ClippedFedAvg`]
/// decides it, then `global + mean` or the FedOpt step, whose state is written back into the
/// strategy (so it is persisted with it at the round boundary).
pub fn finalize_round(
    device: &Device,
    strategy: &mut ServerStrategy,
    global: &[f32],
    updates: impl IntoIterator<Item = Result<(Vec<f32>, u64), String>>,
) -> Result<Vec<f32>, StrategyError> {
    let compute = |e: AccelError| StrategyError::Compute(e.to_string());
    if !strategy.is_mean_based() {
        return Err(StrategyError::BadParameter(format!("{} has no tensor fold", strategy.name())));
    }
    let mut fold = TensorFold::new(device, global.len());
    for update in updates {
        let (delta, weight) = update.map_err(StrategyError::Compute)?;
        let scale = match &*strategy {
            ServerStrategy::ClippedFedAvg(s) => s.clip_scale(&delta)?,
            _ => 1.0,
        };
        fold.fold_scaled(&delta, weight, scale).map_err(compute)?;
    }
    let mean = fold.mean_tensor().map_err(compute)?;
    match strategy {
        ServerStrategy::FedOpt(s) => {
            let mut opt = TensorFedOpt::from_state(device, &s.state()).map_err(compute)?;
            let out = opt.step_tensor(global, mean).map_err(compute)?;
            s.set_state(opt.state().map_err(compute)?)?;
            Ok(out)
        }
        other => {
            other.abort_round(); // nothing folded in it; resets per-round counters
            download(upload(device, global).add(mean)).map_err(compute)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategy::{ClientConfig, FedOpt, PartialSum, Strategy};

    fn updates() -> Vec<(Vec<f32>, u64)> {
        (0..6u64)
            .map(|i| ((0..257).map(|j| ((i * 31 + j) % 17) as f32 * 0.01 - 0.08).collect(), 10 + i * 7))
            .collect()
    }

    fn close(a: &[f32], b: &[f32], tol: f32) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() <= tol * (1.0 + y.abs()), "{x} vs {y}");
        }
    }

    #[test]
    fn tensor_fold_matches_exact_fold() {
        let device = select_device("cpu").unwrap();
        let ups = updates();
        let mut exact = PartialSum::new(257);
        for (d, w) in &ups {
            exact.fold(d, *w).unwrap();
        }
        let exact: Vec<f32> = exact.mean().unwrap().into_iter().map(|x| x as f32).collect();
        let tensor = fold_canonical(&device, 257, ups.iter().map(|(d, w)| (d.as_slice(), *w))).unwrap();
        close(&tensor, &exact, 1e-6);
    }

    #[test]
    fn canonical_order_is_reproducible() {
        let device = select_device("cpu").unwrap();
        let ups = updates();
        let a = fold_canonical(&device, 257, ups.iter().map(|(d, w)| (d.as_slice(), *w))).unwrap();
        let b = fold_canonical(&device, 257, ups.iter().map(|(d, w)| (d.as_slice(), *w))).unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn tensor_fedopt_matches_scalar_fedopt() {
        let device = select_device("cpu").unwrap();
        let ups = updates();
        let global: Vec<f32> = (0..257).map(|j| j as f32 * 0.001).collect();
        for (kind, params) in [
            (FedOptKind::Adam, FedOptParams::adam()),
            (FedOptKind::Yogi, FedOptParams::yogi()),
            (FedOptKind::Adagrad, FedOptParams::adagrad()),
        ] {
            let mut scalar = FedOpt::new(kind, 257, ClientConfig::default(), params).unwrap();
            let mut tensor = TensorFedOpt::new(&device, kind, params, 257);
            let (mut gs, mut gt) = (global.clone(), global.clone());
            for round in 0..3 {
                for (d, w) in &ups[round..round + 3] {
                    scalar.fold(d, *w).unwrap();
                }
                let mut sum = PartialSum::new(257);
                for (d, w) in &ups[round..round + 3] {
                    sum.fold(d, *w).unwrap();
                }
                let mean: Vec<f32> = sum.mean().unwrap().into_iter().map(|x| x as f32).collect();
                gs = scalar.finalize(&gs).unwrap();
                gt = tensor.step(&gt, &mean).unwrap();
                close(&gt, &gs, 1e-4);
            }
        }
    }

    #[test]
    fn bad_inputs_are_refused() {
        let device = select_device("cpu").unwrap();
        let mut fold = TensorFold::new(&device, 3);
        assert_eq!(fold.mean(), Err(AccelError::Empty));
        assert_eq!(fold.fold(&[1.0], 1), Err(AccelError::Shape { expected: 3, got: 1 }));
        assert_eq!(fold.fold(&[1.0; 3], 0), Err(AccelError::BadWeight));
        assert!(matches!(select_device("tpu"), Err(AccelError::UnknownDevice(_))));
        if !cfg!(feature = "wgpu") {
            assert_eq!(select_device("gpu").err(), Some(AccelError::GpuNotBuilt));
        }
    }
}
