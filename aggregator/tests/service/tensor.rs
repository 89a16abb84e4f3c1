//! The tensor backend (`[compute] fold = "tensor"`) against the exact fold, on every device this
//! build can fold on: burn's CPU backend, and with `--features wgpu` the wgpu adapter (CI runs
//! them on Mesa's software Vulkan driver; each test prints the adapter it ran on).

use fedfleet_aggregator::accel::{AccelError, TensorBackend, compiled_devices, select_device};
use fedfleet_aggregator::strategy::{Backend, ClientConfig, FedOptParams, ServerStrategy, Strategy, StrategyConfig};

fn updates() -> Vec<(Vec<f32>, u64)> {
    (0..6u64).map(|i| ((0..257).map(|j| ((i * 31 + j) % 17) as f32 * 0.01 - 0.08).collect(), 10 + i * 7)).collect()
}

fn close(a: &[f32], b: &[f32], tol: f32) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() <= tol * (1.0 + y.abs()), "{x} vs {y}");
    }
}

/// The same strategy, three rounds, exact streaming fold vs the tensor backend.
#[test]
fn tensor_backend_matches_the_exact_backend_for_every_mean_based_strategy() {
    for name in compiled_devices() {
        matches_the_exact_backend_on(name);
    }
}

fn matches_the_exact_backend_on(name: &str) {
    let device = select_device(name).unwrap();
    eprintln!("tensor backend test device: {}", device.adapter);
    let backend = TensorBackend::new(&device.device);
    let ups = updates();
    let global: Vec<f32> = (0..257).map(|j| j as f32 * 0.001).collect();
    let client = ClientConfig::default();
    for config in [
        StrategyConfig::FedAvg { client: client.clone() },
        StrategyConfig::ClippedFedAvg { client: client.clone(), clip_norm: 0.3 },
        StrategyConfig::FedAdam { client: client.clone(), params: FedOptParams::adam() },
        StrategyConfig::FedYogi { client: client.clone(), params: FedOptParams::yogi() },
        StrategyConfig::FedAdagrad { client: client.clone(), params: FedOptParams::adagrad() },
    ] {
        let mut exact = ServerStrategy::new(&config, 257).unwrap();
        let mut tensor = exact.clone();
        let (mut ge, mut gt) = (global.clone(), global.clone());
        for round in 0..3 {
            let batch = &ups[round..round + 3];
            for (d, w) in batch {
                exact.fold(d, *w).unwrap();
            }
            ge = exact.finalize(&ge).unwrap();
            gt = tensor.finalize_on(&backend, &gt, batch.iter().cloned().map(Ok)).unwrap();
            close(&gt, &ge, 1e-4);
        }
    }
}

#[test]
fn tensor_canonical_order_is_reproducible() {
    for name in compiled_devices() {
        let backend = TensorBackend::new(&select_device(name).unwrap().device);
        let config = StrategyConfig::FedAvg { client: ClientConfig::default() };
        let global = vec![0.0f32; 257];
        let run = || {
            let mut s = ServerStrategy::new(&config, 257).unwrap();
            s.finalize_on(&backend, &global, updates().into_iter().map(Ok)).unwrap()
        };
        assert_eq!(run(), run(), "{name}");
    }
}

#[test]
fn tensor_bad_inputs_are_refused() {
    let backend = TensorBackend::new(&select_device("cpu").unwrap().device);
    let mut sum = backend.new_sum(3);
    assert!(backend.mean(&sum).is_err());
    assert!(backend.fold(&mut sum, &[1.0], 1, 1.0).is_err());
    assert!(backend.fold(&mut sum, &[1.0; 3], 0, 1.0).is_err());
    assert!(matches!(select_device("tpu"), Err(AccelError::UnknownDevice(_))));
    if !cfg!(feature = "wgpu") {
        assert_eq!(select_device("gpu").err(), Some(AccelError::GpuNotBuilt));
        assert_eq!(select_device("auto").unwrap().adapter.kind, "cpu");
    }
    let median = StrategyConfig::Median { client: ClientConfig::default(), max_updates: 4 };
    let mut s = ServerStrategy::new(&median, 3).unwrap();
    assert!(s.finalize_on(&backend, &[0.0; 3], std::iter::empty()).is_err());
}
