//! `[compute] fold = "tensor"`: the FedAvg family folded on burn tensors (CPU device here) gives
//! the same bits for any arrival order, stays within f32 rounding of the exact fold, and the
//! FedOpt server state carries across rounds on the device path.

use std::time::Duration;

use fedfleet_aggregator::client::UploadOutcome;
use fedfleet_aggregator::config::{ComputeConfig, Config, FoldBackend};
use fedfleet_aggregator::wire::CampaignOverrides;
use fedfleet_protocol::{DType, RoundId, TensorBundle};

use crate::support::*;

const N: usize = 5;
/// Below the norm of most test deltas, so clipping really scales them.
const CLIP: f64 = 0.02;

/// The strategy `name` with defaults, and `clip_norm` when it clips.
fn clipped_at(name: &str, clip: f64) -> CampaignStrategy {
    match CampaignStrategy::named(name).unwrap() {
        CampaignStrategy::ClippedFedAvg { .. } => CampaignStrategy::ClippedFedAvg { clip_norm: clip },
        other => other,
    }
}

fn tensor_config(fleet: &Fleet, data: &str, rounds: u32, strategy: &str, device: &str) -> Config {
    let mut cfg = fleet.config(data, N as u32, rounds);
    cfg.campaign.strategy = clipped_at(strategy, CLIP);
    cfg.compute = ComputeConfig { fold: FoldBackend::Tensor, device: device.into() };
    cfg
}

/// Runs `rounds` rounds of N updates uploaded in `order`; returns the last published model.
async fn campaign(fleet: &Fleet, cfg: Config, order: &[usize]) -> Vec<u8> {
    let rounds = cfg.campaign.rounds;
    let publish_dir = cfg.publish_dir();
    let svc = start(cfg).await;
    svc.agg.start_campaign(CampaignOverrides { seed: Some(3), ..Default::default() }).await.unwrap();
    for r in 1..=rounds as u64 {
        let base = wait_round(&fleet.device_client(0, svc.addr).await, RoundId(r)).await;
        for &i in order {
            let p = delta(100 * r + i as u64).encode();
            let h = header(&fleet.fleet, &dev(i), RoundId(r), base, nonce(i, r), 10 + 7 * i as u64, &p, DType::F32, &fleet.device_key(i));
            let c = fleet.device_client(i, svc.addr).await;
            assert!(matches!(c.upload(&h, &p).await.unwrap(), UploadOutcome::Accepted(_)), "device {i} round {r}");
        }
    }
    tokio::time::timeout(Duration::from_secs(60), async {
        while svc.agg.status().last_outcome.as_deref() != Some("completed") {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("campaign completed");
    let tensor = svc.agg.config().compute.fold == FoldBackend::Tensor;
    assert_eq!(svc.agg.metrics().round_count("tensor_folded"), if tensor { rounds as u64 } else { 0 });
    svc.stop().await;
    read_published(&publish_dir, "tiny")
}

fn values(bytes: &[u8]) -> Vec<f32> {
    let b = TensorBundle::decode(bytes, &Default::default()).unwrap();
    b.iter().flat_map(|(_, t)| t.to_f32_vec()).collect()
}

fn assert_close(a: &[f32], b: &[f32], tol: f32) {
    assert_eq!(a.len(), b.len());
    let worst = a.iter().zip(b).map(|(x, y)| (x - y).abs() / (1.0 + y.abs())).fold(0f32, f32::max);
    assert!(worst <= tol, "largest relative difference {worst}");
}

/// On every device this build can fold on (the CPU; the wgpu adapter with `--features wgpu`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tensor_fold_is_order_independent_and_matches_the_exact_fold() {
    let fleet = Fleet::new(N);
    let forward: Vec<usize> = (0..N).collect();
    let backward: Vec<usize> = (0..N).rev().collect();
    for device in fedfleet_aggregator::accel::compiled_devices() {
        for strategy in ["fedavg", "clipped_fedavg", "fedadam"] {
            let name = format!("{strategy}-{device}");
            let a = campaign(&fleet, tensor_config(&fleet, &format!("{name}-t1"), 2, strategy, device), &forward).await;
            let b = campaign(&fleet, tensor_config(&fleet, &format!("{name}-t2"), 2, strategy, device), &backward).await;
            assert!(a == b, "{name}: the tensor fold depends on arrival order");
            let mut exact = fleet.config(&format!("{name}-exact"), N as u32, 2);
            exact.campaign.strategy = clipped_at(strategy, CLIP);
            let initial = std::fs::read(&exact.model.initial).unwrap();
            let e = campaign(&fleet, exact, &forward).await;
            assert_close(&values(&a), &values(&e), 1e-5);
            assert_ne!(values(&a), values(&initial), "{name}: the model did not move");
        }
    }
}
