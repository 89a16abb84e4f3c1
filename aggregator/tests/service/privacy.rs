//! DP-FedAvg through the service: every update clipped and counted once, Gaussian noise on the
//! published model, ε accounted after every round, shown in `campaign status`, and the campaign
//! stopped (named outcome) before a round would spend past its budget. Local DP: the
//! announcement tells devices to clip and noise, the aggregator adds nothing, and the status
//! reports each device's spend.

use fedfleet_aggregator::client::UploadOutcome;
use fedfleet_aggregator::wire::{CampaignOverrides, Request};
use fedfleet_protocol::{BundleLimits, DType, RoundId, TensorBundle};
use fedfleet_rounds::privacy::DpSpend;

use crate::support::*;

fn values(bytes: &[u8]) -> Vec<f32> {
    let b = TensorBundle::decode(bytes, &BundleLimits::default()).unwrap();
    b.iter().flat_map(|(_, t)| t.to_f32_vec()).collect()
}

#[tokio::test]
async fn a_dp_campaign_publishes_noised_models_and_stops_at_its_privacy_budget() {
    let fleet = Fleet::new(2);
    let mut cfg = fleet.config("dp", 2, 10);
    // Every device in every round (q = 1); the budget holds two rounds, not three.
    let spend = DpSpend { sampling_rate: 1.0, noise_multiplier: 1.0, delta: 1e-5 };
    let budget = spend.epsilon_after(2) + 1e-9;
    cfg.campaign.strategy = CampaignStrategy::DpFedAvg {
        clip_norm: 1.0,
        noise_multiplier: 1.0,
        delta: 1e-5,
        epsilon_budget: Some(budget),
        clip_quantile: None,
        clip_learning_rate: None,
        clip_count_stddev: None,
    };
    let (dir, initial) = (cfg.publish_dir(), std::fs::read(&cfg.model.initial).unwrap());
    let agg = start(cfg).await;
    let op = fleet.operator(agg.addr).await;
    op.campaign(Request::CampaignStart(CampaignOverrides { seed: Some(1), ..Default::default() })).await.unwrap();
    // Both devices send all-zero deltas: whatever the published model moved by is the noise.
    let mut zero = TensorBundle::new();
    for p in spec().params() {
        zero.insert_f32(&p.name, p.shape.clone(), vec![0.0; p.shape.iter().product()]).unwrap();
    }
    let payload = zero.encode();
    for round in [RoundId(1), RoundId(2)] {
        for i in 0..2 {
            let d = fleet.device_client(i, agg.addr).await;
            let base = wait_round(&d, round).await;
            let h = header(&fleet.fleet, &dev(i), round, base, nonce(i, round.0), 10, &payload, DType::F32, &fleet.device_key(i));
            assert!(matches!(d.upload(&h, &payload).await.unwrap(), UploadOutcome::Accepted(_)));
        }
    }
    let t0 = std::time::Instant::now();
    let status = loop {
        let s = op.campaign(Request::CampaignStatus).await.unwrap();
        if s.campaign.is_none() || t0.elapsed() > std::time::Duration::from_secs(30) {
            break s;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert_eq!(status.last_outcome.as_deref(), Some("privacy_budget_spent"), "{status:?}");
    let p = status.privacy.expect("a DP campaign reports its spend");
    assert_eq!((p.noise_multiplier, p.sampling_rate, p.epsilon_budget), (1.0, 1.0, Some(budget)));
    assert_eq!(p.epsilon_spent, spend.epsilon_after(2));

    // Two rounds published (v2, v3), each moved by noise of σ = z·C / target = 0.5 per
    // coordinate, summed over two rounds: σ ≈ 0.71. Zero deltas alone would not move it at all.
    // Each version carries the ε spent up to and including its round.
    let info = fedfleet_aggregator::publish::DirPublisher::latest(&dir, "tiny").unwrap().unwrap();
    assert_eq!(info.metrics.get("dp_epsilon"), Some(&spend.epsilon_after(2)), "{:?}", info.metrics);
    assert_eq!(info.metrics.get("dp_delta"), Some(&1e-5));
    let published = values(&read_published(&dir, "tiny"));
    let base = values(&initial);
    let moved: Vec<f64> = published.iter().zip(&base).map(|(a, b)| (a - b) as f64).collect();
    let sd = (moved.iter().map(|x| x * x).sum::<f64>() / moved.len() as f64).sqrt();
    assert!((0.45..1.0).contains(&sd), "{} coordinates moved by σ = {sd}", moved.len());
    op.close().await;
    agg.stop().await;
}

#[tokio::test]
async fn local_dp_is_announced_to_the_devices_and_its_spend_reported() {
    let fleet = Fleet::new(2);
    let mut cfg = fleet.config("ldp", 2, 2);
    let local = fedfleet_aggregator::config::LocalDpConfig { clip_norm: 0.5, noise_multiplier: 3.0, delta: 1e-6 };
    cfg.campaign.local_dp = Some(local);
    let (dir, initial) = (cfg.publish_dir(), std::fs::read(&cfg.model.initial).unwrap());
    let agg = start(cfg).await;
    let op = fleet.operator(agg.addr).await;
    op.campaign(Request::CampaignStart(CampaignOverrides { seed: Some(1), ..Default::default() })).await.unwrap();
    let info = fleet.device_client(0, agg.addr).await.current_round().await.unwrap();
    let ann = info.announcement.expect("round 1 is open").verify(&info.receipt_key).unwrap().clone();
    let p = ann.config.device_privacy.expect("the devices clip and noise");
    assert_eq!((p.clip_norm, p.noise_stddev, p.count_once), (0.5, 1.5, false));
    // Deltas as devices noised them (here all zero): the aggregator adds nothing of its own.
    let mut zero = TensorBundle::new();
    for p in spec().params() {
        zero.insert_f32(&p.name, p.shape.clone(), vec![0.0; p.shape.iter().product()]).unwrap();
    }
    let payload = zero.encode();
    for i in 0..2 {
        let d = fleet.device_client(i, agg.addr).await;
        let base = wait_round(&d, RoundId(1)).await;
        let h = header(&fleet.fleet, &dev(i), RoundId(1), base, nonce(i, 1), 10, &payload, DType::F32, &fleet.device_key(i));
        assert!(matches!(d.upload(&h, &payload).await.unwrap(), UploadOutcome::Accepted(_)));
    }
    let t0 = std::time::Instant::now();
    let status = loop {
        let s = op.campaign(Request::CampaignStatus).await.unwrap();
        if s.rounds_completed == Some(1) {
            break s;
        }
        assert!(t0.elapsed() < std::time::Duration::from_secs(30), "round 1 did not publish: {s:?}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert_eq!(values(&read_published(&dir, "tiny")), values(&initial), "no noise from the aggregator");
    assert!(status.privacy.is_none(), "no DP-FedAvg accounting");
    let l = status.local_dp.expect("the status reports local DP");
    assert_eq!((l.clip_norm, l.noise_multiplier, l.delta, l.rounds), (0.5, 3.0, 1e-6, 1));
    assert_eq!(l.epsilon_per_device, local.epsilon_per_device(1));
    // The published version carries it too (the status shows it only while the campaign runs).
    let info = fedfleet_aggregator::publish::DirPublisher::latest(&dir, "tiny").unwrap().unwrap();
    assert_eq!(info.metrics.get("local_dp_epsilon_per_device"), Some(&local.epsilon_per_device(1)), "{:?}", info.metrics);
    op.close().await;
    agg.stop().await;
}
