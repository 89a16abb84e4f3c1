//! Ingest over loopback QUIC: a valid update gets a verified receipt; each bad input of the trust
//! model is refused with its named reason, counted, and the service keeps serving.

use fedfleet_aggregator::client::{ClientError, UploadOutcome};
use fedfleet_aggregator::wire::{CampaignOverrides, Request};
use fedfleet_protocol::{DType, RejectReason, RoundAnnouncement, RoundId, Signed};

use crate::support::*;

fn rejected(o: UploadOutcome) -> RejectReason {
    match o {
        UploadOutcome::Rejected(r) => r.reason,
        UploadOutcome::Accepted(_) => panic!("accepted, expected a rejection"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_bad_input_is_refused_with_its_reason_and_the_service_keeps_serving() {
    let fleet = Fleet::new(12);
    let cfg = fleet.config("agg", 100, 1);
    let svc = start(cfg).await;
    let addr = svc.addr;

    // A device cannot start campaigns; the operator can.
    let d0 = fleet.device_client(0, addr).await;
    match d0.campaign(Request::CampaignStart(CampaignOverrides::default())).await {
        Err(ClientError::Refused(r)) => assert_eq!(r.reason, RejectReason::NotPermitted),
        other => panic!("{other:?}"),
    }
    let op = fleet.operator(addr).await;
    let st = op.campaign(Request::CampaignStart(CampaignOverrides { seed: Some(1), ..Default::default() })).await.unwrap();
    assert_eq!(st.open_round, Some(RoundId(1)));

    let info = d0.current_round().await.unwrap();
    let ann: RoundAnnouncement = info.announcement.expect("open round").verify(&info.receipt_key).unwrap().clone();
    let (round, base) = (ann.round, ann.base_model.digest);
    // The base model is served by digest.
    let (spec_json, bytes) = d0.fetch_model(&base).await.unwrap();
    assert!(spec_json.contains("mlp"));
    assert_eq!(fedfleet_protocol::Digest::of(&bytes), base);

    let f32 = DType::F32;
    let good = |i: usize, k: u64| {
        let payload = delta(i as u64 * 100 + k).encode();
        let h = header(&fleet.fleet, &dev(i), round, base, nonce(i, k), 10, &payload, f32, &fleet.device_key(i));
        (h, payload)
    };

    // Valid → receipt, verified with the announced receipt key.
    let (h0, p0) = good(0, 1);
    let receipt = match d0.upload(&h0, &p0).await.unwrap() {
        UploadOutcome::Accepted(r) => r,
        UploadOutcome::Rejected(r) => panic!("{r:?}"),
    };
    let r = receipt.verify(&info.receipt_key).unwrap();
    assert_eq!((r.device.clone(), r.round, r.nonce, r.payload_digest), (dev(0), round, nonce(0, 1), h0.body().payload_digest));
    // A resend (lost receipt) gets the same receipt; it is not counted twice.
    assert_eq!(d0.upload(&h0, &p0).await.unwrap(), UploadOutcome::Accepted(receipt));
    assert_eq!(svc.agg.status().accepted, 1);

    let mut expect: Vec<RejectReason> = Vec::new();
    let mut check = |got: RejectReason, want: RejectReason| {
        assert_eq!(got, want);
        expect.push(want);
    };

    // Duplicate: a second update of the same device in the round.
    let (h, p) = good(0, 2);
    check(rejected(d0.upload(&h, &p).await.unwrap()), RejectReason::Duplicate);
    // Replay: an accepted nonce with other bytes.
    let p = delta(999).encode();
    let h = header(&fleet.fleet, &dev(0), round, base, nonce(0, 1), 10, &p, f32, &fleet.device_key(0));
    check(rejected(d0.upload(&h, &p).await.unwrap()), RejectReason::Replay);

    let d1 = fleet.device_client(1, addr).await;
    // Header of another device on dev-1's connection (signed by that device's own key).
    let (h, p) = good(2, 1);
    check(rejected(d1.upload(&h, &p).await.unwrap()), RejectReason::IdentityMismatch);
    // Bad signature: dev-1's header signed with dev-2's key.
    let p = delta(11).encode();
    let h = header(&fleet.fleet, &dev(1), round, base, nonce(1, 1), 10, &p, f32, &fleet.device_key(2));
    check(rejected(d1.upload(&h, &p).await.unwrap()), RejectReason::BadSignature);
    // Digest mismatch: one byte flipped at the end (tensor data), same length.
    let (h, mut p) = good(1, 2);
    *p.last_mut().unwrap() ^= 1;
    check(rejected(d1.upload(&h, &p).await.unwrap()), RejectReason::DigestMismatch);
    // Length mismatch: more bytes than signed.
    let (h, mut p) = good(1, 3);
    p.extend_from_slice(&[0; 16]);
    check(rejected(d1.upload(&h, &p).await.unwrap()), RejectReason::LengthMismatch);
    // Stale and unknown rounds.
    let p = delta(12).encode();
    let h = header(&fleet.fleet, &dev(1), RoundId(0), base, nonce(1, 4), 10, &p, f32, &fleet.device_key(1));
    check(rejected(d1.upload(&h, &p).await.unwrap()), RejectReason::StaleRound);
    let h = header(&fleet.fleet, &dev(1), RoundId(round.0 + 5), base, nonce(1, 5), 10, &p, f32, &fleet.device_key(1));
    check(rejected(d1.upload(&h, &p).await.unwrap()), RejectReason::UnknownRound);
    // Wrong base model.
    let h = header(&fleet.fleet, &dev(1), round, fedfleet_protocol::Digest::of(b"other"), nonce(1, 6), 10, &p, f32, &fleet.device_key(1));
    check(rejected(d1.upload(&h, &p).await.unwrap()), RejectReason::WrongBaseModel);
    // Wrong shapes: one tensor transposed.
    let mut bad = fedfleet_protocol::TensorBundle::new();
    for (name, t) in delta(13).iter() {
        let mut shape = t.shape.clone();
        shape.reverse();
        bad.insert_f32(name, shape, t.to_f32_vec()).unwrap();
    }
    let p = bad.encode();
    let h = header(&fleet.fleet, &dev(1), round, base, nonce(1, 7), 10, &p, f32, &fleet.device_key(1));
    check(rejected(d1.upload(&h, &p).await.unwrap()), RejectReason::ShapeMismatch);
    // NaN.
    let mut nan = fedfleet_protocol::TensorBundle::new();
    for (i, (name, t)) in delta(14).iter().enumerate() {
        let mut v = t.to_f32_vec();
        if i == 1 {
            v[0] = f32::NAN;
        }
        nan.insert_f32(name, t.shape.clone(), v).unwrap();
    }
    let p = nan.encode();
    let h = header(&fleet.fleet, &dev(1), round, base, nonce(1, 8), 10, &p, f32, &fleet.device_key(1));
    check(rejected(d1.upload(&h, &p).await.unwrap()), RejectReason::NonFinite);
    // Wrong dtype: f16 payload in an f32 round.
    let p = delta(15).quantize(DType::F16).encode();
    let h = header(&fleet.fleet, &dev(1), round, base, nonce(1, 9), 10, &p, DType::F16, &fleet.device_key(1));
    check(rejected(d1.upload(&h, &p).await.unwrap()), RejectReason::WrongDtype);
    // Oversize: a header claiming far more than the model can take (refused before any payload).
    let p = vec![0u8; 300_000];
    let h = header(&fleet.fleet, &dev(1), round, base, nonce(1, 10), 10, &p, f32, &fleet.device_key(1));
    check(rejected(d1.upload(&h, &p).await.unwrap()), RejectReason::TooLarge);
    // Zero samples.
    let p = delta(16).encode();
    let h = header(&fleet.fleet, &dev(1), round, base, nonce(1, 11), 0, &p, f32, &fleet.device_key(1));
    check(rejected(d1.upload(&h, &p).await.unwrap()), RejectReason::BadSampleCount);

    // Unknown device: a CA-signed certificate whose device is not in the allow-list.
    let allow = fleet.pki.allow_list_path();
    let mut json: serde_json::Value = serde_json::from_slice(&std::fs::read(&allow).unwrap()).unwrap();
    json["devices"].as_object_mut().unwrap().remove(dev(11).as_str()).unwrap();
    std::fs::write(&allow, serde_json::to_vec_pretty(&json).unwrap()).unwrap();
    let d11 = fleet.device_client(11, addr).await;
    let (h, p) = good(11, 1);
    check(rejected(d11.upload(&h, &p).await.unwrap()), RejectReason::UnknownDevice);

    // Revoked: effective at the next ingest on an open connection, and at the next handshake.
    let d5 = fleet.device_client(5, addr).await;
    d5.current_round().await.unwrap(); // connection established before the revocation
    fleet.pki.revoke(&dev(5), "lost").unwrap();
    let (h, p) = good(5, 1);
    check(rejected(d5.upload(&h, &p).await.unwrap()), RejectReason::Revoked);
    let ca = fedfleet_certs::CaCert::load(fleet.pki.ca_cert_path()).unwrap();
    let id = fedfleet_certs::DeviceIdentity::load(fleet.pki.dir(), &dev(5)).unwrap();
    let tls = fedfleet_certs::tls::client_config(&ca, &id, &[fedfleet_certs::ALPN_V1]).unwrap();
    match fedfleet_aggregator::client::AggregatorClient::connect(addr, "localhost", tls).await {
        Err(_) => {}
        Ok(c) => assert!(c.current_round().await.is_err(), "revoked certificate must be refused"),
    }

    // Revoked on another host (issue 31): only the CA-signed `revoked.json` was copied here and
    // the allow-list still names the device enrolled. The signed list is the one source.
    let d6 = fleet.device_client(6, addr).await;
    d6.current_round().await.unwrap();
    let allow_before = std::fs::read(fleet.pki.allow_list_path()).unwrap();
    fleet.pki.revoke(&dev(6), "stolen").unwrap();
    std::fs::write(fleet.pki.allow_list_path(), &allow_before).unwrap();
    let (h, p) = good(6, 1);
    check(rejected(d6.upload(&h, &p).await.unwrap()), RejectReason::Revoked);

    // Still serving: more valid updates are accepted, each with a receipt.
    for i in [1usize, 2, 3] {
        let c = fleet.device_client(i, addr).await;
        let (h, p) = good(i, 20);
        assert!(matches!(c.upload(&h, &p).await.unwrap(), UploadOutcome::Accepted(_)), "device {i}");
    }
    let st = op.campaign(Request::CampaignStatus).await.unwrap();
    assert_eq!(st.accepted, 4);

    // Every refusal was counted under its reason.
    let m = svc.agg.metrics();
    for r in RejectReason::ALL {
        let want = expect.iter().filter(|x| *x == r).count() as u64;
        // Service certificates asking for campaigns: the device's refused start above.
        let extra = u64::from(*r == RejectReason::NotPermitted);
        assert_eq!(m.rejected_count(*r), want + extra, "{r}");
    }
    let text = m.render();
    assert!(text.contains("fedfleet_aggregator_updates_rejected_total{reason=\"non_finite\"} 1"), "{text}");
    assert!(text.contains("fedfleet_aggregator_updates_accepted_total 4"), "{text}");
    // Bytes of the 4 accepted payloads only (the refused ones are counted by reason above).
    let accepted_bytes = 4 * good(0, 1).1.len();
    assert!(text.contains(&format!("fedfleet_aggregator_update_bytes_total {accepted_bytes}\n")), "{text}");

    // The announcement is a protocol `Signed<RoundAnnouncement>`.
    let _: Option<Signed<RoundAnnouncement>> = None;
    op.campaign(Request::CampaignStop).await.unwrap();
    svc.stop().await;
}

/// A round whose quorum is not met at its deadline is extended once; the signed announcement
/// devices read must carry the new deadline (it kept the old one, so late devices skipped it).
/// On a fake clock: the deadline passes when the test moves the clock, not after a real wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_extended_round_is_announced_with_its_new_deadline() {
    let f = Fleet::new(3);
    let mut cfg = f.config("ext", 3, 1);
    cfg.campaign.quorum = 2;
    cfg.campaign.deadline_secs = 600;
    cfg.campaign.extension_secs = 60;
    // Starts at the wall clock's now: TLS judges the test certificates by this clock too.
    let start = fedfleet_protocol::Clock::now_ms(&fedfleet_protocol::SystemClock);
    let clock = std::sync::Arc::new(fedfleet_testkit::clock::FakeClock::new(start));
    let svc = start_at(cfg, clock.clone()).await;
    let op = f.operator(svc.addr).await;
    op.campaign(Request::CampaignStart(CampaignOverrides { seed: Some(1), ..Default::default() })).await.unwrap();
    let d0 = f.device_client(0, svc.addr).await;
    let deadline = |info: fedfleet_aggregator::client::RoundInfo| {
        let ann = info.announcement.expect("a round is open");
        ann.verify(&info.receipt_key).expect("signed by the aggregator").deadline_unix_ms
    };
    let first = deadline(d0.current_round().await.unwrap());
    assert_eq!(first, start + 600_000, "the deadline is read from the service's clock");
    // One millisecond short of the deadline, nothing happens.
    clock.set(first - 1);
    svc.agg.clock_moved();
    assert_eq!(deadline(d0.current_round().await.unwrap()), first);
    clock.set(first);
    svc.agg.clock_moved();
    let t0 = std::time::Instant::now();
    let extended = loop {
        let now = deadline(d0.current_round().await.unwrap());
        if now != first {
            break now;
        }
        assert!(t0.elapsed() < std::time::Duration::from_secs(20), "the announcement still carries the first deadline");
        tokio::task::yield_now().await;
    };
    assert_eq!(extended, first + 60_000, "extended by the configured 60 s");
    svc.stop().await;
}

/// A publisher whose `lose`-th publish (1-based) fails after reaching the inner publisher (the
/// registry stored the version, the answer was lost), like a registry killed mid-request.
struct LosesAnswers {
    inner: fedfleet_aggregator::publish::DirPublisher,
    calls: std::sync::atomic::AtomicU32,
    lose: u32,
}

impl fedfleet_aggregator::publish::Publisher for LosesAnswers {
    fn publish<'a>(&'a self, req: &'a fedfleet_aggregator::publish::PublishRequest) -> fedfleet_aggregator::publish::PublishFuture<'a> {
        Box::pin(async move {
            use std::sync::atomic::Ordering::SeqCst;
            let out = self.inner.publish(req).await;
            if self.calls.fetch_add(1, SeqCst) + 1 == self.lose {
                return Err(fedfleet_aggregator::publish::PublishError("connection lost".into()));
            }
            out
        })
    }
}

/// Found by the kill -9 campaign suite: a publish that failed (registry SIGKILLed) was retried
/// by folding the round again, which its consumed fold refused, and the campaign stalled for
/// good. The retry publishes the model it already finalized, and the campaign goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_publish_is_retried_with_the_finalized_model() {
    let fleet = Fleet::new(2);
    let cfg = fleet.config("retry", 2, 2);
    let key = fedfleet_aggregator::keys::load_or_create(&cfg.data_dir).unwrap();
    let dir = cfg.publish_dir();
    let publisher = LosesAnswers {
        inner: fedfleet_aggregator::publish::DirPublisher::new(dir.clone(), key, "test"),
        calls: std::sync::atomic::AtomicU32::new(0),
        lose: 2, // the initial model is the first publish; round 1's model the second
    };
    let agg = fedfleet_aggregator::service::Aggregator::open(cfg, Box::new(publisher), fedfleet_protocol::SystemClock::shared()).unwrap();
    let endpoint = agg.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = endpoint.local_addr().unwrap();
    let stop = fedfleet_net::Shutdown::new();
    let task = tokio::spawn(agg.clone().run(endpoint, None, stop.clone()));
    let op = fleet.operator(addr).await;
    op.campaign(Request::CampaignStart(CampaignOverrides { seed: Some(1), ..Default::default() })).await.unwrap();
    for round in [RoundId(1), RoundId(2)] {
        for i in 0..2 {
            let d = fleet.device_client(i, addr).await;
            let base = wait_round(&d, round).await;
            let payload = delta(i as u64 + 10 * round.0).encode();
            let h = header(&fleet.fleet, &dev(i), round, base, nonce(i, round.0), 10, &payload, DType::F32, &fleet.device_key(i));
            assert!(matches!(d.upload(&h, &payload).await.unwrap(), UploadOutcome::Accepted(_)));
        }
    }
    // Round 1's publish lost its answer; its retry (same bytes: the same version) and round 2
    // give versions 2 and 3.
    let t0 = std::time::Instant::now();
    let latest = loop {
        let v = fedfleet_aggregator::publish::DirPublisher::latest(&dir, "tiny").unwrap().map(|m| m.version.0);
        if v == Some(3) || t0.elapsed() > std::time::Duration::from_secs(30) {
            break v;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    assert_eq!(latest, Some(3), "round 2 was never published");
    stop.trigger();
    task.await.unwrap();
}

/// A relay's partial sum: only a service named in `relays`, signed with its certificate's key;
/// merged and counted with its updates; a resend gets the first receipt, a second sum is a
/// duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partial_sum_is_taken_only_from_a_named_relay_under_its_own_key() {
    use fedfleet_aggregator::strategy::fixed::PartialSum;
    use fedfleet_protocol::{DeviceId, Digest, RelayHeader};
    let fleet = Fleet::new(2);
    // The operator's certificate stands in for a relay's.
    let cfg = fedfleet_aggregator::config::Config { relays: vec!["operator".into()], ..fleet.config("agg", 100, 1) };
    let svc = start(cfg).await;
    let op = fleet.operator(svc.addr).await;
    op.campaign(Request::CampaignStart(CampaignOverrides { seed: Some(1), ..Default::default() })).await.unwrap();
    let d0 = fleet.device_client(0, svc.addr).await;
    let info = d0.current_round().await.unwrap();
    let ann: RoundAnnouncement = info.announcement.expect("open round").verify(&info.receipt_key).unwrap().clone();
    let update = delta(3);
    let mut sum = PartialSum::new(update.num_params());
    sum.fold(&fedfleet_aggregator::service::flatten(&update, update.num_params()), 10).unwrap();
    sum.fold(&fedfleet_aggregator::service::flatten(&delta(4), update.num_params()), 20).unwrap();
    let payload = sum.to_le_bytes();
    let header = |relay: &str, nonce: u8| RelayHeader {
        relay: DeviceId::new(relay).unwrap(),
        fleet: fleet.fleet.clone(),
        round: ann.round,
        base_model: ann.base_model.digest,
        nonce: [nonce; 16],
        update_count: 2,
        total_samples: 30,
        payload_len: payload.len() as u64,
        payload_digest: Digest::of(&payload),
        payload_dtype: DType::F32,
    };
    let relay_key = fedfleet_certs::ServerIdentity::load(fleet.pki.dir(), "operator").unwrap().signing_key();
    // A device is no relay, whatever it signs.
    let from_device = Signed::sign(header(dev(0).as_str(), 1), &fleet.device_key(0));
    assert_eq!(rejected(d0.upload_encoded(&from_device.encode(), &payload).await.unwrap()), RejectReason::NotPermitted);
    // The named relay, but signed with another key.
    let forged = Signed::sign(header("operator", 1), &fleet.device_key(1));
    assert_eq!(rejected(op.upload_encoded(&forged.encode(), &payload).await.unwrap()), RejectReason::BadSignature);
    // Signed by the relay: merged, counted as two updates.
    let signed = Signed::sign(header("operator", 1), &relay_key);
    let receipt = match op.upload_encoded(&signed.encode(), &payload).await.unwrap() {
        UploadOutcome::Accepted(r) => r,
        UploadOutcome::Rejected(r) => panic!("{r:?}"),
    };
    assert_eq!(receipt.verify(&info.receipt_key).unwrap().device.as_str(), "operator");
    let status = op.campaign(Request::CampaignStatus).await.unwrap();
    assert_eq!(status.accepted, 2);
    assert_eq!(op.upload_encoded(&signed.encode(), &payload).await.unwrap(), UploadOutcome::Accepted(receipt));
    let again = Signed::sign(header("operator", 2), &relay_key);
    assert_eq!(rejected(op.upload_encoded(&again.encode(), &payload).await.unwrap()), RejectReason::Duplicate);
    assert_eq!(op.campaign(Request::CampaignStatus).await.unwrap().accepted, 2);
}
