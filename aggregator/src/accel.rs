//! The strategies' arithmetic on burn tensors: [`TensorBackend`] implements the round core's
//! [`Backend`] trait, so the weighted mean and every server optimizer are the core's own code
//! (`ServerStrategy::finalize_on`), run on any burn device.
//!
//! The default build has burn's CPU backend (`flex`) only; the `wgpu` cargo feature compiles
//! burn's GPU backend in, and [`select_device`] picks it (or honours `BURN_DEVICE`). The exact
//! integer fold stays the service's default: f32 tensor sums depend on summation order, so a
//! tensor fold is deterministic only when updates are folded in one canonical order, which the
//! shell can do because it keeps every accepted payload on disk (see `persist`).

use burn::tensor::{Device, Tensor, TensorData};

use crate::strategy::{Backend, StrategyError};

/// Why the tensor path refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AccelError {
    #[error("unknown compute device {0:?}; expected cpu, gpu or auto")]
    UnknownDevice(String),
    #[error("compute device gpu needs a build with the `wgpu` feature (cargo build --features wgpu)")]
    GpuNotBuilt,
    #[error(
        "compute device gpu: no wgpu adapter found (looked for Vulkan, Metal, DX12 and OpenGL adapters: {0}); \
         install a GPU driver (or Mesa's software Vulkan driver, Debian package mesa-vulkan-drivers) or set [compute] device = \"cpu\""
    )]
    NoAdapter(String),
}

/// What the tensor path runs on, as the log and `/metrics` name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterInfo {
    /// `cpu` or `gpu`: the configured kind the device was picked for.
    pub kind: &'static str,
    /// The adapter's name (`llvmpipe (LLVM 15.0.6, 256 bits)`, `NVIDIA H200`, or `burn flex` on the CPU).
    pub name: String,
    /// The graphics API (`Vulkan`, `Metal`, ...) or `flex` on the CPU.
    pub backend: String,
    /// Driver name and version as the adapter reports them (empty on the CPU).
    pub driver: String,
    /// The adapter type wgpu reports (`DiscreteGpu`, `Cpu` for a software driver, ...).
    pub device_type: String,
}

impl std::fmt::Display for AdapterInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} on {} ({}", self.kind, self.name, self.backend)?;
        if !self.driver.is_empty() {
            write!(f, ", driver {}", self.driver)?;
        }
        write!(f, ", type {})", self.device_type)
    }
}

/// A burn device picked for the tensor path, with what it is.
#[derive(Debug, Clone)]
pub struct ComputeDevice {
    pub device: Device,
    pub adapter: AdapterInfo,
}

/// The device named in config: `cpu` (burn flex), `gpu` (burn wgpu, with the `wgpu` feature; an
/// error when no adapter exists) or `auto` (`BURN_DEVICE=cpu` forces the CPU; else the GPU when
/// compiled in and an adapter exists, falling back to the CPU with a warning). Named explicitly
/// because burn's default device prefers a GPU backend without probing for a driver.
pub fn select_device(name: &str) -> Result<ComputeDevice, AccelError> {
    match name {
        "cpu" => Ok(cpu_device()),
        "gpu" => gpu_device(),
        "auto" => match std::env::var("BURN_DEVICE").ok().as_deref() {
            Some("flex" | "cpu") => Ok(cpu_device()),
            _ if cfg!(feature = "wgpu") => gpu_device().or_else(|e| {
                tracing::warn!(error = %e, "[compute] device = \"auto\": no GPU adapter, folding on the CPU");
                Ok(cpu_device())
            }),
            _ => Ok(cpu_device()),
        },
        other => Err(AccelError::UnknownDevice(other.to_string())),
    }
}

fn cpu_device() -> ComputeDevice {
    let adapter =
        AdapterInfo { kind: "cpu", name: "burn flex".into(), backend: "flex".into(), driver: String::new(), device_type: "Cpu".into() };
    ComputeDevice { device: Device::flex(), adapter }
}

/// burn's wgpu runtime is process-wide and initializes once, so the first pick is kept and
/// every later service in the process (tests start many) shares it.
#[cfg(feature = "wgpu")]
fn gpu_device() -> Result<ComputeDevice, AccelError> {
    static GPU: std::sync::OnceLock<Result<ComputeDevice, AccelError>> = std::sync::OnceLock::new();
    GPU.get_or_init(|| {
        let (device, setup) =
            Device::wgpu_options().init_with_setup().map_err(|e| AccelError::NoAdapter(e.to_string().replace('\n', " ")))?;
        let info = setup.adapter.get_info();
        let adapter = AdapterInfo {
            kind: "gpu",
            name: info.name,
            backend: format!("{:?}", info.backend),
            driver: format!("{} {}", info.driver, info.driver_info).trim().to_string(),
            device_type: format!("{:?}", info.device_type),
        };
        Ok(ComputeDevice { device, adapter })
    })
    .clone()
}

#[cfg(not(feature = "wgpu"))]
fn gpu_device() -> Result<ComputeDevice, AccelError> {
    Err(AccelError::GpuNotBuilt)
}

/// The device kinds this build can fold on: `cpu` always, `gpu` with the `wgpu` feature. The
/// tensor-path tests run on each (CI runs the wgpu build on Mesa's software Vulkan driver).
pub fn compiled_devices() -> Vec<&'static str> {
    if cfg!(feature = "wgpu") { vec!["cpu", "gpu"] } else { vec!["cpu"] }
}

/// The core's arithmetic on one burn device, in `f32`.
#[derive(Debug, Clone)]
pub struct TensorBackend {
    device: Device,
}

/// A running weighted sum `Σ wᵢΔᵢ` held on the device: memory O(model) on the device.
pub struct TensorSum {
    sum: Tensor<1>,
    total_weight: f64,
    count: u64,
}

fn compute(detail: impl std::fmt::Display) -> StrategyError {
    StrategyError::Compute(detail.to_string())
}

impl TensorBackend {
    pub fn new(device: &Device) -> Self {
        TensorBackend { device: device.clone() }
    }
}

impl Backend for TensorBackend {
    type Vector = Tensor<1>;
    type Sum = TensorSum;

    fn new_sum(&self, dim: usize) -> TensorSum {
        TensorSum { sum: Tensor::zeros([dim], &self.device), total_weight: 0.0, count: 0 }
    }
    fn fold(&self, sum: &mut TensorSum, delta: &[f32], weight: u64, scale: f64) -> Result<(), StrategyError> {
        let dim = sum.sum.dims()[0];
        if delta.len() != dim {
            return Err(compute(format!("update has {} values; the model has {dim}", delta.len())));
        }
        crate::strategy::fixed::check_weight(weight)?;
        let term = self.upload(delta).mul_scalar((weight as f64 * scale) as f32);
        sum.sum = sum.sum.clone().add(term);
        sum.total_weight += weight as f64;
        sum.count += 1;
        Ok(())
    }
    fn mean(&self, sum: &TensorSum) -> Result<Tensor<1>, StrategyError> {
        if sum.count == 0 {
            return Err(compute("nothing was folded"));
        }
        Ok(sum.sum.clone().div_scalar(sum.total_weight as f32))
    }
    fn upload(&self, v: &[f32]) -> Tensor<1> {
        Tensor::from_data(TensorData::new(v.to_vec(), [v.len()]), &self.device)
    }
    fn download(&self, v: Tensor<1>) -> Result<Vec<f32>, StrategyError> {
        v.into_data().try_into_vec::<f32>().map_err(|e| compute(format!("tensor readback failed: {e:?}")))
    }
    fn add(&self, a: &Tensor<1>, b: &Tensor<1>) -> Tensor<1> {
        a.clone().add(b.clone())
    }
    fn sub(&self, a: &Tensor<1>, b: &Tensor<1>) -> Tensor<1> {
        a.clone().sub(b.clone())
    }
    fn mul(&self, a: &Tensor<1>, b: &Tensor<1>) -> Tensor<1> {
        a.clone().mul(b.clone())
    }
    fn div(&self, a: &Tensor<1>, b: &Tensor<1>) -> Tensor<1> {
        a.clone().div(b.clone())
    }
    fn scale(&self, a: &Tensor<1>, s: f64) -> Tensor<1> {
        a.clone().mul_scalar(s as f32)
    }
    fn add_scalar(&self, a: &Tensor<1>, s: f64) -> Tensor<1> {
        a.clone().add_scalar(s as f32)
    }
    fn sqrt(&self, a: &Tensor<1>) -> Tensor<1> {
        a.clone().sqrt()
    }
    fn sign(&self, a: &Tensor<1>) -> Tensor<1> {
        a.clone().sign()
    }
}
