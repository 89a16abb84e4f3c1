//! MQTT next to QUIC: the same round run twice on fresh data directories with identical updates,
//! once uploaded over QUIC and once over the MQTT fallback path (embedded broker), yields
//! byte-identical global models; receipts arrive over MQTT (also for a resend); the announcement
//! reaches a device over MQTT, verifies against the receipt key and is published again while the
//! round is open; presence is exported.

use std::time::Duration;

use fedfleet_aggregator::client::UploadOutcome;
use fedfleet_aggregator::config::MqttConfig;
use fedfleet_aggregator::wire::CampaignOverrides;
use fedfleet_certs::DeviceIdentity;
use fedfleet_control::{ClientOptions, ControlClient, ControlEvent, ControlEvents, Role, device_tls};
use fedfleet_protocol::{DType, DeviceState, DeviceStatus, Digest, Receipt, RoundAnnouncement, RoundId, Signed, SignedUpdate};
use tokio::time::timeout;

use crate::support::*;

const DEVICES: usize = 3;
const WAIT: Duration = Duration::from_secs(8);

fn update(fleet: &Fleet, i: usize, round: RoundId, base: Digest) -> (SignedUpdate, Vec<u8>) {
    let payload = delta(1000 + i as u64).encode();
    let h = header(&fleet.fleet, &dev(i), round, base, nonce(i, 1), 10 + i as u64, &payload, DType::F32, &fleet.device_key(i));
    (h, payload)
}

async fn next<T>(events: &mut ControlEvents, what: &str, mut f: impl FnMut(ControlEvent) -> Option<T>) -> T {
    timeout(WAIT, async {
        loop {
            let ev = events.recv().await.expect("client stopped");
            if let Some(t) = f(ev) {
                return t;
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
}

fn device(fleet: &Fleet, i: usize, port: u16, key: ed25519_dalek::VerifyingKey) -> (ControlClient, ControlEvents) {
    let id = DeviceIdentity::load(fleet.pki.dir(), &dev(i)).unwrap();
    let mut o = ClientOptions::new("127.0.0.1", port, dev(i).as_str(), fleet.fleet.clone());
    o.backoff_initial = Duration::from_millis(50);
    o.backoff_max = Duration::from_millis(500);
    o.chunk_bytes = 64; // several chunks per update
    ControlClient::start(o, device_tls(&id).unwrap(), Role::Device { id: dev(i), aggregator_key: key, registry_key: None })
}

async fn published(svc: &RunningAggregator, base: Digest) -> Vec<u8> {
    timeout(WAIT, async {
        loop {
            if let Some((g, bytes)) = svc.agg.global_model()
                && g.digest != base
            {
                return bytes;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the round's model was not published")
}

/// One round of `DEVICES` identical updates; returns the published global model.
async fn round(fleet: &Fleet, data: &str, over_mqtt: bool) -> Vec<u8> {
    let svc = start(fleet.config(data, DEVICES as u32, 1)).await;
    let mut mqtt_cfg = MqttConfig::embedded("127.0.0.1:0".parse().unwrap());
    mqtt_cfg.announce_every_secs = 1;
    let mqtt = fedfleet_aggregator::mqtt::start(&svc.agg, &mqtt_cfg).await.unwrap().expect("mqtt on");
    let port = mqtt.broker_addr().unwrap().port();
    let key = svc.agg.receipt_key();
    svc.agg.start_campaign(CampaignOverrides { seed: Some(1), ..Default::default() }).await.unwrap();

    // The retained announcement reaches a device over MQTT and verifies against the receipt key.
    let (d0, mut e0) = device(fleet, 0, port, key);
    let ann: Signed<RoundAnnouncement> = next(&mut e0, "announcement", |e| match e {
        ControlEvent::Announcement(a) => Some(a),
        _ => None,
    })
    .await;
    let body = ann.verify(&key).unwrap().clone();
    assert_eq!(body.round, RoundId(1));
    assert_eq!(Some(ann.encode()), svc.agg.announcements().borrow().clone(), "the same signed bytes as over QUIC");
    let (round, base) = (body.round, body.base_model.digest);
    // The open round is announced again every `announce_every_secs` (for devices that missed
    // it); a device that heard it drops the repeat unread.
    timeout(WAIT, async {
        while d0.stats().duplicates == 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the open round was not announced again");

    if over_mqtt {
        // Presence from a verified status.
        let st = Signed::sign(
            DeviceStatus {
                fleet: fleet.fleet.clone(),
                device: dev(0),
                reported_at_unix_ms: svc.agg.now_ms(),
                state: DeviceState::Idle,
                active: None,
                staged: None,
                rollout_id: None,
            },
            &fleet.device_key(0),
        );
        d0.publish_status(&st).await.unwrap();
        let mut clients = vec![(d0, e0)];
        for i in 1..DEVICES {
            clients.push(device(fleet, i, port, key));
        }
        for (i, (c, e)) in clients.iter_mut().enumerate() {
            let (h, p) = update(fleet, i, round, base);
            let want = |r: &Signed<Receipt>| {
                let b = r.verify(&key).unwrap();
                assert_eq!((&b.device, b.round, b.nonce, b.payload_digest), (&dev(i), round, nonce(i, 1), h.body().payload_digest));
            };
            // The device may still be connecting: re-send until a receipt, as a device does.
            let receipt = timeout(WAIT, async {
                loop {
                    c.upload_update(&h, &p).await.unwrap();
                    let got = timeout(Duration::from_secs(2), async {
                        loop {
                            if let Some(ControlEvent::Receipt(r)) = e.recv().await {
                                return r;
                            }
                        }
                    })
                    .await;
                    if let Ok(r) = got {
                        return r;
                    }
                }
            })
            .await
            .unwrap_or_else(|_| panic!("no receipt over MQTT for device {i}"));
            want(&receipt);
            if i == 0 {
                // A resend (lost receipt) gets the receipt again and is not counted twice.
                c.upload_update(&h, &p).await.unwrap();
                let again = next(e, "resend receipt", |ev| match ev {
                    ControlEvent::Receipt(r) => Some(r),
                    _ => None,
                })
                .await;
                assert_eq!(again, receipt);
                assert_eq!(svc.agg.status().accepted, 1);
            }
        }
        let m = svc.agg.metrics();
        assert_eq!(m.devices(svc.agg.now_ms()), (1, 1));
        let text = m.render();
        assert!(text.contains("fedfleet_aggregator_mqtt_connected 1"), "{text}");
        assert!(text.contains("fedfleet_aggregator_devices_online 1"), "{text}");
        assert!(text.contains("fedfleet_aggregator_device_last_seen_seconds{device=\"dev-000\"}"), "{text}");
        assert!(text.contains("fedfleet_aggregator_mqtt_rejected_total{reason=\"bad_signature\"} 0"), "{text}");
        for (c, _) in &clients {
            c.shutdown().await;
        }
    } else {
        for i in 0..DEVICES {
            let c = fleet.device_client(i, svc.addr).await;
            let (h, p) = update(fleet, i, round, base);
            assert!(matches!(c.upload(&h, &p).await.unwrap(), UploadOutcome::Accepted(_)), "device {i}");
        }
        d0.shutdown().await;
    }
    let model = published(&svc, base).await;
    mqtt.shutdown().await;
    svc.stop().await;
    model
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_update_over_mqtt_yields_the_same_global_model_as_over_quic() {
    let fleet = Fleet::named(DEVICES, "fleetm");
    let quic = round(&fleet, "quic", false).await;
    let mqtt = round(&fleet, "mqtt", true).await;
    assert_eq!(Digest::of(&quic), Digest::of(&mqtt));
    assert!(quic == mqtt, "global models differ");
    // And the round moved the model.
    assert_ne!(Digest::of(&quic), Digest::of(&std::fs::read(fleet.dir.path().join("initial.safetensors")).unwrap()));
}

/// The service on `cfg` with its embedded broker, its campaign started: the service, its MQTT
/// plane, the broker's port and the receipt key.
async fn campaign_with_broker(
    cfg: fedfleet_aggregator::config::Config,
) -> (RunningAggregator, fedfleet_aggregator::mqtt::Mqtt, u16, ed25519_dalek::VerifyingKey) {
    let svc = start(cfg).await;
    let mqtt_cfg = MqttConfig::embedded("127.0.0.1:0".parse().unwrap());
    let mqtt = fedfleet_aggregator::mqtt::start(&svc.agg, &mqtt_cfg).await.unwrap().expect("mqtt on");
    let port = mqtt.broker_addr().unwrap().port();
    let key = svc.agg.receipt_key();
    svc.agg.start_campaign(CampaignOverrides { seed: Some(1), ..Default::default() }).await.unwrap();
    (svc, mqtt, port, key)
}

/// The round announcement a device hears over MQTT, verified.
async fn announced(events: &mut ControlEvents, key: ed25519_dalek::VerifyingKey) -> RoundAnnouncement {
    let ann = next(events, "announcement", |ev| match ev {
        ControlEvent::Announcement(a) => Some(a),
        _ => None,
    })
    .await;
    ann.verify(&key).unwrap().clone()
}

/// Uploads over MQTT past `[admission] max_bytes_in_flight` wait for the budget instead of being
/// refused as `overloaded` (their bytes are in memory already; a refusal would only bring them
/// back through the broker): with a budget of one payload, every one of eight devices uploading
/// at once gets its receipt and none a refusal. And ingest does not verify their signatures
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mqtt_uploads_past_the_byte_budget_wait_for_it_instead_of_being_refused() {
    const N: usize = 8;
    let fleet = Fleet::named(N, "fleetmb");
    let mut cfg = fleet.config("budget", N as u32, 1);
    cfg.admission.max_bytes_in_flight = delta(0).encode().len() as u64;
    let (svc, mqtt, port, key) = campaign_with_broker(cfg).await;
    let mut clients: Vec<_> = (0..N).map(|i| device(&fleet, i, port, key)).collect();
    // Every device is connected and has heard the round before any uploads: they go at once.
    let mut heard = Vec::new();
    for (_, e) in &mut clients {
        heard.push(announced(e, key).await);
    }
    let (round, base) = (heard[0].round, heard[0].base_model.digest);
    for (i, (c, _)) in clients.iter().enumerate() {
        let (h, p) = update(&fleet, i, round, base);
        c.upload_update(&h, &p).await.unwrap();
    }
    for (i, (_, e)) in clients.iter_mut().enumerate() {
        let answer = next(e, "a receipt or a refusal", |ev| match ev {
            ControlEvent::Receipt(r) => Some(Ok(r)),
            ControlEvent::UploadRefused(r) => Some(Err(r)),
            _ => None,
        })
        .await;
        let receipt = answer.unwrap_or_else(|r| panic!("device {i}'s upload was refused: {:?}", r.body()));
        assert_eq!(receipt.verify(&key).unwrap().device, dev(i));
    }
    let text = svc.agg.metrics().render();
    assert!(text.contains(&format!("fedfleet_aggregator_updates_accepted_total {N}\n")), "{text}");
    assert!(text.contains("fedfleet_aggregator_updates_rejected_total{reason=\"overloaded\"} 0"), "{text}");
    // Each signature was verified once, by the control client: ingest checked none again.
    assert!(text.contains("fedfleet_aggregator_ingest_seconds_total{step=\"signature\"} 0.0\n"), "{text}");
    for (c, _) in &clients {
        c.shutdown().await;
    }
    mqtt.shutdown().await;
    svc.stop().await;
}

/// A secure-aggregation request over MQTT whose masked vector comes past
/// `[admission] max_bytes_in_flight` waits for the budget like an update, instead of being
/// refused as `overloaded`: while the test holds the whole budget the request gets no answer;
/// once it lets go, the vector is handed to the protocol (which refuses this one by name, as
/// sent before its stage; the session field is not checked before the budget).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_masked_vector_over_mqtt_past_the_byte_budget_waits_for_it() {
    use fedfleet_aggregator::config::SecureAggregationConfig;
    use fedfleet_aggregator::wire::{MAX_WIRE_MESSAGE, Request, Response};
    use fedfleet_protocol::{RejectReason, messages};

    const N: usize = 4;
    const BUDGET: u64 = 1 << 20;
    let fleet = Fleet::named(N, "fleetmv");
    let mut cfg = fleet.config("maskedbudget", N as u32, 1);
    cfg.secure_aggregation = Some(SecureAggregationConfig { degree: 2, ..Default::default() });
    cfg.admission.max_bytes_in_flight = BUDGET;
    let (svc, mqtt, port, key) = campaign_with_broker(cfg).await;
    let (c, mut e) = device(&fleet, 0, port, key);
    let round = announced(&mut e, key).await.round;
    // The service's answer to request `id`, if it comes within `wait`.
    let answer = async |e: &mut ControlEvents, id: u64, wait: Duration| {
        timeout(wait, async {
            loop {
                if let Some(ControlEvent::Answer(a)) = e.recv().await
                    && a.verify(&key).unwrap().id == id
                {
                    return messages::decode::<Response>(&a.verify(&key).unwrap().bytes, MAX_WIRE_MESSAGE).unwrap();
                }
            }
        })
        .await
    };
    let ask = async |id: u64, request: &Request, attachment: &[u8]| {
        c.send_request(id, &messages::encode(request, MAX_WIRE_MESSAGE).unwrap(), attachment).await.unwrap();
    };
    ask(1, &Request::SecAggRoster { round }, &[]).await;
    let roster = match answer(&mut e, 1, WAIT).await.expect("the roster over MQTT") {
        Response::SecAggRoster { roster, .. } => fedfleet_secagg::Roster::from_bytes(&roster).unwrap(),
        other => panic!("roster request answered {other:?}"),
    };
    let vector = vec![0u8; (roster.dim as usize + 1) * 8];
    let body = fedfleet_secagg::Body::Masked { digest: Digest::of(&vector), coordinates: roster.dim as u64 + 1, pairs: Vec::new() };
    let message = Signed::sign(fedfleet_secagg::Message { round, session: [0; 32], device: dev(0), body }, &fleet.device_key(0));
    let send = Request::SecAggSend { message: message.encode(), vector_len: vector.len() as u64 };

    let held = svc.agg.wait_for_bytes(BUDGET, WAIT).await.unwrap();
    ask(2, &send, &vector).await;
    let early = answer(&mut e, 2, Duration::from_secs(2)).await;
    assert!(early.is_err(), "answered while the budget was spent: {early:?}");
    drop(held);
    match answer(&mut e, 2, WAIT).await.expect("no answer once the budget was free") {
        Response::Error(r) => assert_eq!(r.reason, RejectReason::SecAggRefused, "{}", r.detail),
        other => panic!("a masked vector before its stage was answered {other:?}"),
    }
    assert_eq!(svc.agg.metrics().mqtt_requests_count("overloaded"), 0);
    c.shutdown().await;
    mqtt.shutdown().await;
    svc.stop().await;
}

/// An MQTT upload waits for the byte budget at most half the control client's keep-alive (15 s):
/// meanwhile the service's client reads nothing and sends no ping, and a broker drops a client
/// silent for 1.5 keep-alives, with the uploads it queued for it. Past that the upload is refused
/// as `overloaded` with a retry-after, as over QUIC; the service stays connected, and the same
/// upload sent again once the budget is free is accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_mqtt_upload_waits_for_the_budget_at_most_half_the_keep_alive() {
    const BUDGET: u64 = 1 << 20;
    let fleet = Fleet::named(1, "fleetmw");
    let mut cfg = fleet.config("budgetwait", 1, 1);
    cfg.admission.max_bytes_in_flight = BUDGET;
    let (svc, mqtt, port, key) = campaign_with_broker(cfg).await;
    let (c, mut e) = device(&fleet, 0, port, key);
    let ann = announced(&mut e, key).await;
    let (h, p) = update(&fleet, 0, ann.round, ann.base_model.digest);

    let held = svc.agg.wait_for_bytes(BUDGET, WAIT).await.unwrap();
    let t0 = std::time::Instant::now();
    c.upload_update(&h, &p).await.unwrap();
    let refused = timeout(Duration::from_secs(30), async {
        loop {
            match e.recv().await.expect("client stopped") {
                ControlEvent::UploadRefused(r) => return r,
                ControlEvent::Receipt(r) => panic!("accepted while the budget was held: {:?}", r.body()),
                _ => {}
            }
        }
    })
    .await
    .expect("no answer while the budget was held");
    let waited = t0.elapsed();
    let refusal = refused.verify(&key).unwrap();
    assert_eq!(refusal.reason, fedfleet_protocol::RejectReason::Overloaded, "{}", refusal.detail);
    assert!(fedfleet_protocol::reject::retry_after_ms(&refusal.detail).is_some(), "{}", refusal.detail);
    assert!(waited >= Duration::from_secs(5), "refused after {waited:?}, not after waiting half the keep-alive");
    drop(held);
    c.upload_update(&h, &p).await.unwrap();
    let receipt = next(&mut e, "a receipt once the budget was free", |ev| match ev {
        ControlEvent::Receipt(r) => Some(r),
        _ => None,
    })
    .await;
    assert_eq!(receipt.verify(&key).unwrap().nonce, h.body().nonce);
    let text = svc.agg.metrics().render();
    assert!(text.contains("fedfleet_aggregator_mqtt_connected 1"), "{text}");
    assert!(text.contains("fedfleet_aggregator_updates_rejected_total{reason=\"overloaded\"} 1"), "{text}");
    c.shutdown().await;
    mqtt.shutdown().await;
    svc.stop().await;
}

/// `[mqtt] max_connections` bounds the embedded broker, the service's own connection included:
/// with 2, the service and one device connect, a second device is turned away at the gate
/// (counted as `overloaded`) while they hold theirs, and it connects once a slot is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_embedded_broker_takes_at_most_its_max_connections() {
    let fleet = Fleet::named(2, "fleetmc");
    let svc = start(fleet.config("maxconn", 2, 1)).await;
    let mut mqtt_cfg = MqttConfig::embedded("127.0.0.1:0".parse().unwrap());
    mqtt_cfg.max_connections = 2;
    let mqtt = fedfleet_aggregator::mqtt::start(&svc.agg, &mqtt_cfg).await.unwrap().expect("mqtt on");
    let port = mqtt.broker_addr().unwrap().port();
    let key = svc.agg.receipt_key();
    // Whether the client connects within `wait`.
    let connects_within = async |events: &mut ControlEvents, wait: Duration| {
        timeout(wait, async { while !matches!(events.recv().await.expect("client stopped"), ControlEvent::Connected { .. }) {} })
            .await
            .is_ok()
    };
    timeout(WAIT, async {
        while !svc.agg.metrics().render().contains("fedfleet_aggregator_mqtt_connected 1") {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the service did not connect to its own broker");
    let (first, mut first_events) = device(&fleet, 0, port, key);
    assert!(connects_within(&mut first_events, WAIT).await, "the first device did not connect");
    let (second, mut second_events) = device(&fleet, 1, port, key);
    assert!(!connects_within(&mut second_events, Duration::from_secs(3)).await, "a third connection was taken past max_connections = 2");
    let text = svc.agg.metrics().render();
    let refused = text.lines().find_map(|l| l.strip_prefix("fedfleet_aggregator_broker_refused_total{reason=\"overloaded\"} "));
    assert!(refused.and_then(|n| n.parse::<u64>().ok()).is_some_and(|n| n >= 1), "{text}");
    first.shutdown().await;
    assert!(connects_within(&mut second_events, Duration::from_secs(30)).await, "the second device did not connect once a slot was free");
    second.shutdown().await;
    mqtt.shutdown().await;
    svc.stop().await;
}
