//! Secure aggregation through the service (in process, on a fake clock): six devices run the
//! SecAgg+ stages over QUIC with `fedfleet_secagg::Client`, two drop out after sharing, and the
//! round publishes the model a plain round of the four survivors' updates publishes, bit for
//! bit (updates on the grid, so quantizing loses nothing). Tampered messages and plain uploads
//! are refused by name; a round below the threshold fails with the protocol's reason.

use fedfleet_aggregator::client::AggregatorClient;
use fedfleet_aggregator::config::SecureAggregationConfig;
use fedfleet_aggregator::wire::{CampaignOverrides, Request, Stage};
use fedfleet_protocol::{DType, RejectReason, RoundAnnouncement, Signed, TensorBundle};
use fedfleet_secagg::{Body, Client, Message};

use crate::support::*;

const DEVICES: usize = 6;
const SURVIVORS: usize = 4;

/// Device `i`'s update, on a 2⁻¹⁰ grid, and its weight (a power of two): `w·Δ` lies on the
/// secure aggregation's 2⁻²⁴ grid exactly.
fn update(i: usize) -> (TensorBundle, u64) {
    let mut b = TensorBundle::new();
    for (name, t) in delta(100 + i as u64).iter() {
        let v: Vec<f32> = t.to_f32_vec().iter().map(|x| (x * 1024.0).round() / 1024.0).collect();
        b.insert_f32(name, t.shape.clone(), v).unwrap();
    }
    (b, 1 << i)
}

fn refusal(r: Result<(), fedfleet_aggregator::client::ClientError>) -> (RejectReason, String) {
    match r {
        Err(fedfleet_aggregator::client::ClientError::Refused(r)) => (r.reason, r.detail),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// The open round's announcement, asked again for up to 20 s (a loaded machine may answer the
/// operator before a device sees the round).
async fn announcement(c: &AggregatorClient) -> (RoundAnnouncement, ed25519_dalek::VerifyingKey) {
    let t0 = std::time::Instant::now();
    loop {
        let info = c.current_round().await.unwrap();
        if let Some(a) = info.announcement {
            return (a.verify(&info.receipt_key).unwrap().clone(), info.receipt_key);
        }
        assert!(t0.elapsed() < std::time::Duration::from_secs(20), "no round opened");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// Polls device `c` until the round's stage is `stage`.
async fn until(c: &AggregatorClient, ann: &RoundAnnouncement, stage: Stage) -> fedfleet_aggregator::wire::SecAggView {
    let t0 = std::time::Instant::now();
    loop {
        let v = c.secagg_poll(ann.round).await.unwrap();
        if v.stage == stage {
            return v;
        }
        assert!(t0.elapsed() < std::time::Duration::from_secs(20), "stage {stage:?} never came (at {:?}: {:?})", v.stage, v.failure);
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secure_round_with_dropouts_publishes_the_plain_fold_of_the_survivors_bit_for_bit() {
    let f = Fleet::new(DEVICES);
    // The plain round: the four survivors' updates, uploaded in the clear.
    let plain = start(f.config("plain", SURVIVORS as u32, 1)).await;
    f.operator(plain.addr).await.campaign(Request::CampaignStart(CampaignOverrides { seed: Some(1), ..Default::default() })).await.unwrap();
    for i in 0..SURVIVORS {
        let c = f.device_client(i, plain.addr).await;
        let (ann, _) = announcement(&c).await;
        let (b, w) = update(i);
        let payload = b.encode();
        let h = header(&f.fleet, &dev(i), ann.round, ann.base_model.digest, nonce(i, 1), w, &payload, DType::F32, &f.device_key(i));
        assert!(matches!(c.upload(&h, &payload).await.unwrap(), fedfleet_aggregator::client::UploadOutcome::Accepted(_)));
    }
    let plain_dir = f.config("plain", 0, 0).publish_dir();
    let t0 = std::time::Instant::now();
    while fedfleet_aggregator::publish::DirPublisher::latest(&plain_dir, "tiny").unwrap().is_none_or(|m| m.version.0 < 2) {
        assert!(t0.elapsed() < std::time::Duration::from_secs(20), "the plain round did not publish");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let plain_model = read_published(&plain_dir, "tiny");

    // The secure round on a fake clock, two rounds: the second ends below the threshold.
    let mut cfg = f.config("secure", DEVICES as u32, 2);
    cfg.campaign.quorum = 1;
    cfg.secure_aggregation = Some(SecureAggregationConfig { degree: 4, threshold_fraction: 0.5, ..Default::default() });
    let start_ms = fedfleet_protocol::Clock::now_ms(&fedfleet_protocol::SystemClock);
    let clock = std::sync::Arc::new(fedfleet_testkit::clock::FakeClock::new(start_ms));
    let svc = start_at(cfg, clock.clone()).await;
    f.operator(svc.addr).await.campaign(Request::CampaignStart(CampaignOverrides { seed: Some(1), ..Default::default() })).await.unwrap();
    let mut clients = Vec::new();
    for i in 0..DEVICES {
        clients.push(f.device_client(i, svc.addr).await);
    }
    let (ann, receipt_key) = announcement(&clients[0]).await;
    assert!(ann.config.secure_aggregation, "the announcement tells devices to aggregate securely");

    // A plain upload is refused before its payload is read.
    let (b, w) = update(0);
    let payload = b.encode();
    let h = header(&f.fleet, &dev(0), ann.round, ann.base_model.digest, nonce(0, 1), w, &payload, DType::F32, &f.device_key(0));
    match clients[0].upload(&h, &payload).await.unwrap() {
        fedfleet_aggregator::client::UploadOutcome::Rejected(r) => assert_eq!(r.reason, RejectReason::NotPermitted, "{}", r.detail),
        other => panic!("a plain upload under secure aggregation: {other:?}"),
    }

    // Keys.
    let mut devices = Vec::new();
    for (i, c) in clients.iter().enumerate() {
        let roster = c.secagg_roster(ann.round, &receipt_key).await.unwrap();
        assert_eq!((roster.len(), roster.params.threshold), (DEVICES, 2));
        let (client, keys) = Client::new(roster, &dev(i), f.device_key(i), [i as u8; 32]).unwrap();
        if i == 0 {
            // Another device's connection sending it, and another key signing it, are refused.
            assert_eq!(refusal(clients[1].secagg_send(&keys.encode(), &[]).await).0, RejectReason::IdentityMismatch);
            let forged = Signed::sign(keys.body().clone(), &f.device_key(1));
            let (reason, detail) = refusal(c.secagg_send(&forged.encode(), &[]).await);
            assert_eq!((reason, detail.split(':').next().unwrap()), (RejectReason::SecAggRefused, "bad_signature"));
        }
        c.secagg_send(&keys.encode(), &[]).await.unwrap();
        if i == 0 {
            let (reason, detail) = refusal(c.secagg_send(&keys.encode(), &[]).await);
            assert_eq!((reason, detail.split(':').next().unwrap()), (RejectReason::Duplicate, "duplicate"));
        }
        devices.push(client);
    }
    // Shares.
    for (i, c) in clients.iter().enumerate() {
        let view = until(c, &ann, Stage::Shares).await;
        let adverts: Vec<Signed<Message>> = view.keys.iter().map(|k| Signed::decode(k).unwrap()).collect();
        let shares = devices[i].on_keys(&adverts).unwrap();
        c.secagg_send(&shares.encode(), &[]).await.unwrap();
    }
    // Masked inputs from the survivors; the two others drop out.
    for (i, c) in clients.iter().enumerate().take(SURVIVORS) {
        let view = until(c, &ann, Stage::Masked).await;
        let (b, w) = update(i);
        let (msg, y) = devices[i].on_shares(&view.shares, &b.flat_f32(), w).unwrap();
        let bytes = fedfleet_secagg::vector_bytes(&y);
        if i == 0 {
            // A vector that is not the one its message signs.
            let mut other = bytes.clone();
            other[0] ^= 1;
            let (reason, detail) = refusal(c.secagg_send(&msg.encode(), &other).await);
            assert_eq!((reason, detail.split(':').next().unwrap()), (RejectReason::SecAggRefused, "bad_vector"));
            let (reason, _) = refusal(c.secagg_send(&msg.encode(), &bytes[8..]).await);
            assert_eq!(reason, RejectReason::LengthMismatch);
        }
        assert!(matches!(msg.body().body, Body::Masked { .. }));
        c.secagg_send(&msg.encode(), &bytes).await.unwrap();
    }
    // The masked stage ends at its deadline (85 % of the round's time), without the two; the
    // unmask stage (to 95 %) goes on.
    clock.set(ann.deadline_unix_ms - 60_000);
    svc.agg.clock_moved();
    // The operator's view (`campaign status`) says how the round is aggregated and where it stands.
    let _ = until(&clients[0], &ann, Stage::Unmask).await;
    let secure = svc.agg.status().secure_aggregation.expect("the status names secure aggregation");
    assert_eq!((secure.degree, secure.threshold_fraction), (4, 0.5));
    let open = secure.open_round.expect("the open round's stages");
    assert_eq!((open.round, open.stage, open.roster, open.threshold, open.failure), (ann.round, Stage::Unmask, DEVICES as u32, 2, None));
    for (i, c) in clients.iter().enumerate().take(SURVIVORS) {
        let view = until(c, &ann, Stage::Unmask).await;
        let unmask = devices[i].on_unmask(&view.unmask.expect("an unmask request")).unwrap();
        c.secagg_send(&unmask.encode(), &[]).await.unwrap();
    }
    for (i, c) in clients.iter().enumerate() {
        let view = until(c, &ann, Stage::Done).await;
        match view.receipt {
            Some(r) => {
                let r = Signed::<fedfleet_protocol::Receipt>::decode(&r).unwrap();
                assert_eq!(r.verify(&receipt_key).unwrap().device, dev(i));
                assert!(i < SURVIVORS, "a receipt for a device that dropped out");
            }
            None => assert!(i >= SURVIVORS, "no receipt for survivor {i}"),
        }
    }
    let secure_dir = f.config("secure", 0, 0).publish_dir();
    let t0 = std::time::Instant::now();
    while fedfleet_aggregator::publish::DirPublisher::latest(&secure_dir, "tiny").unwrap().is_none_or(|m| m.version.0 < 2) {
        assert!(t0.elapsed() < std::time::Duration::from_secs(20), "the secure round did not publish");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(read_published(&secure_dir, "tiny"), plain_model, "the secure round's model is the plain fold's, bit for bit");

    // Round 2: one device sends keys, under the threshold of two; at the keys deadline the
    // round fails with the protocol's reason and publishes nothing.
    let t0 = std::time::Instant::now();
    let ann2 = loop {
        let (a, _) = announcement(&clients[0]).await;
        if a.round != ann.round {
            break a;
        }
        assert!(t0.elapsed() < std::time::Duration::from_secs(20), "round 2 did not open");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    for (i, c) in clients.iter().enumerate().take(1) {
        let roster = c.secagg_roster(ann2.round, &receipt_key).await.unwrap();
        let (_, keys) = Client::new(roster, &dev(i), f.device_key(i), [9; 32]).unwrap();
        c.secagg_send(&keys.encode(), &[]).await.unwrap();
    }
    clock.set(ann2.deadline_unix_ms - 1);
    svc.agg.clock_moved();
    let view = until(&clients[0], &ann2, Stage::Failed).await;
    assert!(view.failure.as_deref().unwrap_or_default().starts_with("below_threshold"), "{:?}", view.failure);
    assert_eq!(svc.agg.metrics().round_count("secagg_failed"), 1);
    assert_eq!(fedfleet_aggregator::publish::DirPublisher::latest(&secure_dir, "tiny").unwrap().unwrap().version.0, 2, "nothing published");
    svc.stop().await;
    plain.stop().await;
}

/// DP-FedAvg under secure aggregation: the announcement tells each device to clip to C and add
/// a `1/√quorum` share of the noise σ = z·C; the aggregator merges the unmasked sum as it is
/// (no noise of its own: it never sees the noise-free sum) and divides it by the expected
/// count; the status says the noise is on the devices and what the round spent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dp_fedavg_under_secure_aggregation_puts_the_noise_on_the_devices() {
    use rand::SeedableRng;
    const N: usize = 4;
    let f = Fleet::new(N);
    let mut cfg = f.config("dp", N as u32, 1);
    cfg.campaign.quorum = 3;
    cfg.campaign.strategy = fedfleet_aggregator::config::CampaignStrategy::DpFedAvg {
        clip_norm: 0.02,
        noise_multiplier: 0.6,
        delta: 1e-5,
        epsilon_budget: None,
        clip_quantile: None,
        clip_learning_rate: None,
        clip_count_stddev: None,
    };
    cfg.secure_aggregation = Some(SecureAggregationConfig { degree: 2, threshold_fraction: 1.0, ..Default::default() });
    let svc = start(cfg).await;
    f.operator(svc.addr).await.campaign(Request::CampaignStart(CampaignOverrides { seed: Some(1), ..Default::default() })).await.unwrap();
    let mut clients = Vec::new();
    for i in 0..N {
        clients.push(f.device_client(i, svc.addr).await);
    }
    let (ann, receipt_key) = announcement(&clients[0]).await;
    let p = ann.config.device_privacy.expect("the devices clip and noise");
    assert_eq!((p.clip_norm, p.count_once), (0.02, true));
    assert!((p.noise_stddev - 0.6 * 0.02 / 3f64.sqrt()).abs() < 1e-12, "a 1/√quorum share: {}", p.noise_stddev);

    // Each device clips and noises its update (its own randomness), then masks it with weight 1.
    let mut rng = rand_chacha::ChaCha20Rng::seed_from_u64(5);
    let mut noised = Vec::new();
    let mut clipped_sum = vec![0f64; delta(0).num_params()];
    for i in 0..N {
        let (b, _) = update(i);
        let clip_only = fedfleet_protocol::DevicePrivacy { noise_stddev: 0.0, ..p };
        let (c, _) = fedfleet_agent_core::privacy::privatize(&b, &clip_only, &mut rng).unwrap();
        for (s, x) in clipped_sum.iter_mut().zip(c.flat_f32()) {
            *s += f64::from(x);
        }
        let (private, did) = fedfleet_agent_core::privacy::privatize(&b, &p, &mut rng).unwrap();
        assert!(did.scale < 1.0, "these updates are above the bound");
        noised.push(private.flat_f32());
    }
    let mut devices = Vec::new();
    for (i, c) in clients.iter().enumerate() {
        let roster = c.secagg_roster(ann.round, &receipt_key).await.unwrap();
        let (client, keys) = Client::new(roster, &dev(i), f.device_key(i), [i as u8 + 1; 32]).unwrap();
        c.secagg_send(&keys.encode(), &[]).await.unwrap();
        devices.push(client);
    }
    for (i, c) in clients.iter().enumerate() {
        let view = until(c, &ann, Stage::Shares).await;
        let adverts: Vec<Signed<Message>> = view.keys.iter().map(|k| Signed::decode(k).unwrap()).collect();
        c.secagg_send(&devices[i].on_keys(&adverts).unwrap().encode(), &[]).await.unwrap();
    }
    for (i, c) in clients.iter().enumerate() {
        let view = until(c, &ann, Stage::Masked).await;
        let (msg, y) = devices[i].on_shares(&view.shares, &noised[i], 1).unwrap();
        c.secagg_send(&msg.encode(), &fedfleet_secagg::vector_bytes(&y)).await.unwrap();
    }
    for (i, c) in clients.iter().enumerate() {
        let view = until(c, &ann, Stage::Unmask).await;
        c.secagg_send(&devices[i].on_unmask(&view.unmask.expect("an unmask request")).unwrap().encode(), &[]).await.unwrap();
    }
    let dir = f.config("dp", 0, 0).publish_dir();
    let t0 = std::time::Instant::now();
    while fedfleet_aggregator::publish::DirPublisher::latest(&dir, "tiny").unwrap().is_none_or(|m| m.version.0 < 2) {
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(20),
            "the round did not publish: {:?} {:?}",
            svc.agg.round_history(3),
            clients[0].secagg_poll(ann.round).await.map(|v| (v.stage, v.failure))
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let limits = fedfleet_protocol::BundleLimits::default();
    let published = TensorBundle::decode(&read_published(&dir, "tiny"), &limits).unwrap().flat_f32();
    let base = TensorBundle::decode(&std::fs::read(f.dir.path().join("initial.safetensors")).unwrap(), &limits).unwrap().flat_f32();
    // The model moved by the devices' noised sum over the expected count (4), nothing more: the
    // grid (2⁻²⁴) and f32 rounding are all that separate them.
    let mut worst = 0f64;
    let mut noise = Vec::new();
    for (k, (m, b)) in published.iter().zip(&base).enumerate() {
        let sum: f64 = noised.iter().map(|u| f64::from(u[k])).sum();
        let want = f64::from(*b) + sum / N as f64;
        worst = worst.max((f64::from(*m) - want).abs() / want.abs().max(1.0));
        noise.push((sum - clipped_sum[k]) / N as f64);
    }
    assert!(worst < 1e-6, "the published step is the devices' sum over 4: off by {worst}");
    // And that sum holds the devices' noise: σ·√(4/3)/4 per coordinate over the clipped mean.
    let sd = (noise.iter().map(|x| x * x).sum::<f64>() / noise.len() as f64).sqrt();
    let want = 0.6 * 0.02 * (4.0f64 / 3.0).sqrt() / 4.0;
    // (51 coordinates: the estimate's own spread is about 10 %.)
    assert!((sd - want).abs() < 0.35 * want, "noise sd {sd}, want {want}");
    let privacy = svc.agg.status().privacy.expect("the status accounts the spend");
    assert_eq!(privacy.noise_added_by, fedfleet_aggregator::wire::NoiseSource::Devices);
    assert!(privacy.epsilon_spent > 0.0, "{privacy:?}");
    svc.stop().await;
}
