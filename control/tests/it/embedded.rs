use std::time::Duration;

use fedfleet_control::{ClientOptions, ControlClient, ControlEvent, EmbeddedBroker, QoS, Role, encode_frames, topics};
use fedfleet_protocol::{DeviceId, FleetId, RejectReason, RoundAnnouncement, Signed};

use crate::common::{self, Fleet, wait_for};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_flow_over_the_embedded_broker() {
    let f = Fleet::new(3);
    let broker = EmbeddedBroker::start(f.broker_config(0)).await.unwrap();
    let port = broker.local_addr().port();
    common::round_flow(&f, port, async || false).await;
    broker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_agent_survives_a_broker_restart_mid_round() {
    let f = Fleet::new(3);
    let broker = EmbeddedBroker::start(f.broker_config(0)).await.unwrap();
    let port = broker.local_addr().port();
    let config = f.broker_config(port);
    let mut slot = Some(broker);
    let mut restarted = None;
    common::round_flow(&f, port, async || {
        slot.take().unwrap().shutdown().await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        restarted = Some(EmbeddedBroker::start(config).await.unwrap());
        true
    })
    .await;
    restarted.unwrap().shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_announcements_and_updates_are_rejected_with_reasons() {
    let f = Fleet::new(2);
    let broker = EmbeddedBroker::start(f.broker_config(0)).await.unwrap();
    let port = broker.local_addr().port();
    let (a, b) = (&f.devices[0], &f.devices[1]);
    let (agg, mut agg_events) = f.aggregator(port);
    let (dev_a, mut a_events, key_a) = f.device(port, a);
    let (dev_b, mut b_events, key_b) = f.device(port, b);
    let (rogue, mut rogue_events) = f.rogue_service(port);
    for (what, events) in [("aggregator", &mut agg_events), ("a", &mut a_events), ("b", &mut b_events), ("rogue", &mut rogue_events)] {
        wait_for(events, what, |e| matches!(e, ControlEvent::Connected { .. }).then_some(())).await;
    }

    // An announcement signed by the wrong key, published straight to the broker by a client
    // with a service certificate (the broker lets services publish on every fleet topic; a
    // device could not: see the_broker_closes_a_device_publishing_outside_its_own_topics).
    let mut ann = f.announcement(5).into_body();
    let forged = Signed::sign(ann.clone(), &key_b);
    rogue.publish_raw(&topics::rounds(&f.fleet), forged.encode(), QoS::AtLeastOnce, true).await.unwrap();
    let r = wait_for(&mut a_events, "forged announcement rejection", |e| match e {
        ControlEvent::Rejected(r) => Some(r.clone()),
        ControlEvent::Announcement(_) => panic!("forged announcement accepted"),
        _ => None,
    })
    .await;
    assert_eq!(r.reason, RejectReason::BadSignature, "{r}");

    // Right key, another fleet's announcement replayed into ours.
    ann.fleet = FleetId::new("other").unwrap();
    let other_fleet: Signed<RoundAnnouncement> = Signed::sign(ann, &f.aggregator_key);
    rogue.publish_raw(&topics::rounds(&f.fleet), other_fleet.encode(), QoS::AtLeastOnce, true).await.unwrap();
    let r = wait_for(&mut a_events, "wrong-fleet rejection", |e| match e {
        ControlEvent::Rejected(r) => Some(r.clone()),
        ControlEvent::Announcement(_) => panic!("other fleet's announcement accepted"),
        _ => None,
    })
    .await;
    assert_eq!(r.reason, RejectReason::WrongFleet, "{r}");

    // Forged updates on device a's topic.
    let topic_a = topics::updates(&f.fleet, a);
    let p = common::payload(a, 5);
    let cases: Vec<(&str, Vec<Vec<u8>>, RejectReason)> = vec![
        // Header naming a, signed with b's key.
        ("signed by b", encode_frames(&common::signed_update(&f.fleet, a, &key_b, 5, &p), &p, 16 * 1024), RejectReason::BadSignature),
        // b's genuine header, published on a's topic.
        (
            "b's header on a's topic",
            encode_frames(&common::signed_update(&f.fleet, b, &key_b, 5, &p), &p, 16 * 1024),
            RejectReason::BadSignature,
        ),
        // a's genuine header, payload altered in flight.
        (
            "bad digest",
            {
                let mut frames = encode_frames(&common::signed_update(&f.fleet, a, &key_a, 5, &p), &p, 16 * 1024);
                let last = frames.last_mut().unwrap();
                let n = last.len() - 1;
                last[n] ^= 0x40;
                frames
            },
            RejectReason::DigestMismatch,
        ),
    ];
    for (what, frames, reason) in cases {
        for frame in frames {
            rogue.publish_raw(&topic_a, frame, QoS::AtLeastOnce, false).await.unwrap();
        }
        let r = wait_for(&mut agg_events, what, |e| match e {
            ControlEvent::Rejected(r) => Some(r.clone()),
            ControlEvent::Update(_) => panic!("{what}: forged update accepted"),
            _ => None,
        })
        .await;
        assert_eq!((r.reason, r.device.as_ref()), (reason, Some(a)), "{what}: {r}");
    }
    // A device that is not enrolled.
    let ghost = DeviceId::new("ghost").unwrap();
    for frame in encode_frames(&common::signed_update(&f.fleet, &ghost, &key_b, 5, &p), &p, 16 * 1024) {
        rogue.publish_raw(&topics::updates(&f.fleet, &ghost), frame, QoS::AtLeastOnce, false).await.unwrap();
    }
    let r = wait_for(&mut agg_events, "ghost", |e| match e {
        ControlEvent::Rejected(r) => Some(r.clone()),
        _ => None,
    })
    .await;
    assert_eq!(r.reason, RejectReason::UnknownDevice, "{r}");

    // Nothing crashed: a genuine announcement and a genuine update still go through.
    agg.publish_announcement(&f.announcement(6)).await.unwrap();
    let round = wait_for(&mut a_events, "genuine announcement", |e| match e {
        ControlEvent::Announcement(s) => Some(s.body().round.0),
        _ => None,
    })
    .await;
    assert_eq!(round, 6);
    let genuine = common::signed_update(&f.fleet, a, &key_a, 6, &common::payload(a, 6));
    dev_a.upload_update(&genuine, &common::payload(a, 6)).await.unwrap();
    let v = wait_for(&mut agg_events, "genuine update", |e| match e {
        ControlEvent::Update(v) => Some(v.clone()),
        ControlEvent::Rejected(r) => panic!("genuine update rejected: {r}"),
        _ => None,
    })
    .await;
    assert_eq!(v.signed(), &genuine);
    assert_eq!(v.payload(), common::payload(a, 6));

    let s = agg.stats();
    assert_eq!(s.rejected(RejectReason::BadSignature), 2, "{s:?}");
    assert_eq!(s.rejected(RejectReason::DigestMismatch), 1, "{s:?}");
    assert_eq!(s.rejected(RejectReason::UnknownDevice), 1, "{s:?}");
    let s = dev_a.stats();
    assert_eq!(s.rejected(RejectReason::BadSignature), 1, "{s:?}");
    assert_eq!(s.rejected(RejectReason::WrongFleet), 1, "{s:?}");
    for c in [&agg, &dev_a, &dev_b, &rogue] {
        c.shutdown().await;
    }
    broker.shutdown().await;
}

/// Issue 14.5: a device could publish a retained forgery on the fleet's announcement topic, and
/// devices connecting later saw only it. The broker now holds each device to its own topics:
/// the publish closes the device's connection, is counted, and never reaches anyone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_broker_closes_a_device_publishing_outside_its_own_topics() {
    let f = Fleet::new(3);
    let config = f.broker_config(0);
    let metrics = config.metrics.clone();
    let broker = EmbeddedBroker::start(config).await.unwrap();
    let port = broker.local_addr().port();
    let (a, b, late) = (&f.devices[0], &f.devices[1], &f.devices[2]);
    let (agg, mut agg_events) = f.aggregator(port);
    let (dev_b, mut b_events, key_b) = f.device(port, b);
    for (what, events) in [("aggregator", &mut agg_events), ("b", &mut b_events)] {
        wait_for(events, what, |e| matches!(e, ControlEvent::Connected { .. }).then_some(())).await;
    }
    agg.publish_announcement(&f.announcement(6)).await.unwrap();

    // b plants a retained announcement signed with its own key.
    let forged = Signed::sign(f.announcement(7).into_body(), &key_b);
    dev_b.publish_raw(&topics::rounds(&f.fleet), forged.encode(), QoS::AtLeastOnce, true).await.unwrap();
    wait_for(&mut b_events, "b disconnected", |e| matches!(e, ControlEvent::Disconnected { .. }).then_some(())).await;
    dev_b.shutdown().await;
    assert_eq!(metrics.refused(fedfleet_control::Refusal::Acl), 1);

    // b publishing a's status and subscribing to every device's status are refused as well.
    let identity = fedfleet_certs::DeviceIdentity::load(f.pki.dir(), b).unwrap();
    let tls = fedfleet_control::device_tls(&identity).unwrap();
    for attempt in ["status", "subscribe"] {
        let mut o = rumqttc::MqttOptions::new(b.as_str(), "127.0.0.1", port);
        o.set_transport(rumqttc::Transport::tls_with_config(rumqttc::TlsConfiguration::Rustls(tls.clone())));
        let (client, mut events) = rumqttc::AsyncClient::new(o, 10);
        match attempt {
            "status" => client.publish(topics::status(&f.fleet, a), QoS::AtLeastOnce, true, b"forged".to_vec()).await.unwrap(),
            _ => client.subscribe(topics::all_status(&f.fleet), QoS::AtLeastOnce).await.unwrap(),
        }
        let closed = tokio::time::timeout(common::WAIT, async {
            loop {
                if events.poll().await.is_err() {
                    return;
                }
            }
        });
        closed.await.unwrap_or_else(|_| panic!("{attempt}: the broker kept the connection"));
    }
    assert_eq!(metrics.refused(fedfleet_control::Refusal::Acl), 3);

    // A device under another device's client id could cut that device off: refused.
    let mut o = rumqttc::MqttOptions::new(a.as_str(), "127.0.0.1", port);
    o.set_transport(rumqttc::Transport::tls_with_config(rumqttc::TlsConfiguration::Rustls(tls.clone())));
    let (_client, mut events) = rumqttc::AsyncClient::new(o, 10);
    assert!(events.poll().await.is_err() || events.poll().await.is_err(), "b connected as a");
    assert_eq!(metrics.refused(fedfleet_control::Refusal::ClientId), 1);

    // A device connecting now hears the real announcement, never the forgery.
    let dev_late = common::late_joiner_hears(&f, port, late, 6).await;
    assert!(dev_late.stats().rejected(RejectReason::BadSignature) == 0);
    for c in [&agg, &dev_late] {
        c.shutdown().await;
    }
    broker.shutdown().await;
}

/// Issue 31.15: an operator's service certificate could replace the retained round
/// announcement, and a late joiner then saw none. Only the broker's own service and the registry
/// publish; any other service certificate may listen only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_certificate_cannot_replace_the_retained_announcement() {
    let f = Fleet::new(1);
    f.pki.issue_server("operator", &[], 30, false).unwrap();
    let config = f.broker_config(0);
    let metrics = config.metrics.clone();
    let broker = EmbeddedBroker::start(config).await.unwrap();
    let port = broker.local_addr().port();
    let (agg, mut agg_events) = f.aggregator(port);
    wait_for(&mut agg_events, "aggregator", |e| matches!(e, ControlEvent::Connected { .. }).then_some(())).await;
    agg.publish_announcement(&f.announcement(6)).await.unwrap();

    // The operator clears the retained announcement (an empty retained publish).
    let id = fedfleet_certs::ServerIdentity::load(f.pki.dir(), "operator").unwrap();
    let tls = fedfleet_control::service_tls(f.pki.ca(), &id).unwrap();
    let mut o = rumqttc::MqttOptions::new("operator", "127.0.0.1", port);
    o.set_transport(rumqttc::Transport::tls_with_config(rumqttc::TlsConfiguration::Rustls(tls)));
    let (client, mut events) = rumqttc::AsyncClient::new(o, 10);
    client.publish(topics::rounds(&f.fleet), QoS::AtLeastOnce, true, Vec::new()).await.unwrap();
    let closed = tokio::time::timeout(common::WAIT, async {
        loop {
            if events.poll().await.is_err() {
                return;
            }
        }
    });
    closed.await.expect("the broker kept the operator's publishing connection");
    assert_eq!(metrics.refused(fedfleet_control::Refusal::Acl), 1);

    // A device connecting now still hears the aggregator's announcement.
    let (late, mut late_events, _) = f.device(port, &f.devices[0]);
    let round = wait_for(&mut late_events, "retained announcement", |e| match e {
        ControlEvent::Announcement(s) => Some(s.body().round.0),
        _ => None,
    })
    .await;
    assert_eq!(round, 6);
    for c in [&agg, &late] {
        c.shutdown().await;
    }
    broker.shutdown().await;
}

/// Issue 14.7: a publish over the size limit closes the connection and is counted, instead of
/// vanishing without a trace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_publish_is_counted() {
    let f = Fleet::new(1);
    let mut config = f.broker_config(0);
    config.max_payload_bytes = 64 * 1024;
    let metrics = config.metrics.clone();
    let broker = EmbeddedBroker::start(config).await.unwrap();
    let port = broker.local_addr().port();
    let a = &f.devices[0];
    let (dev, mut events, _) = f.device(port, a);
    wait_for(&mut events, "connected", |e| matches!(e, ControlEvent::Connected { .. }).then_some(())).await;
    dev.publish_raw(&topics::updates(&f.fleet, a), vec![0u8; 100 * 1024], QoS::AtLeastOnce, false).await.unwrap();
    wait_for(&mut events, "disconnected", |e| matches!(e, ControlEvent::Disconnected { .. }).then_some(())).await;
    dev.shutdown().await;
    assert_eq!(metrics.refused(fedfleet_control::Refusal::Oversized), 1);
    let mut registry = prometheus_client::registry::Registry::default();
    metrics.register(&mut registry);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    assert!(text.contains("broker_refused_total{reason=\"oversized\"} 1"), "{text}");
    broker.shutdown().await;
}

/// The gate checks the fleet's revocation list at every handshake (rumqttd alone did not).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_device_cannot_connect_to_the_embedded_broker() {
    let f = Fleet::new(2);
    let broker = EmbeddedBroker::start(f.broker_config(0)).await.unwrap();
    let port = broker.local_addr().port();
    f.pki.revoke(&f.devices[1], "stolen").unwrap();
    let (ok, mut ok_events, _) = f.device(port, &f.devices[0]);
    wait_for(&mut ok_events, "enrolled device connected", |e| matches!(e, ControlEvent::Connected { .. }).then_some(())).await;
    let (revoked, mut events, _) = f.device(port, &f.devices[1]);
    let connected = tokio::time::timeout(Duration::from_secs(2), async {
        loop {
            if let Some(ControlEvent::Connected { .. }) = events.recv().await {
                return;
            }
        }
    })
    .await;
    assert!(connected.is_err(), "a revoked device connected");
    ok.shutdown().await;
    revoked.shutdown().await;
    broker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedded_broker_requires_a_fleet_client_certificate() {
    let f = Fleet::new(1);
    let broker = EmbeddedBroker::start(f.broker_config(0)).await.unwrap();
    let port = broker.local_addr().port();
    let anonymous = fedfleet_certs::tls::anonymous_client_config(f.pki.ca(), &[]).unwrap();
    let role = Role::Device { id: f.devices[0].clone(), aggregator_key: f.aggregator_key.verifying_key(), registry_key: None };
    let (c, mut events) =
        ControlClient::start(ClientOptions::new("127.0.0.1", port, "anon", f.fleet.clone()), std::sync::Arc::new(anonymous), role);
    let connected = tokio::time::timeout(Duration::from_secs(2), async {
        loop {
            if let Some(ControlEvent::Connected { .. }) = events.recv().await {
                return;
            }
        }
    })
    .await;
    assert!(connected.is_err(), "a client without a certificate connected");
    c.shutdown().await;
    broker.shutdown().await;
}

/// rumqttd took the certificate's O= as a tenant and refused fleet ids that are not
/// alphanumeric; the gate terminates TLS itself, so any fleet id works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedded_broker_takes_any_fleet_id() {
    let f = Fleet::with_fleet(2, "eu-west");
    let broker = EmbeddedBroker::start(f.broker_config(0)).await.unwrap();
    let port = broker.local_addr().port();
    common::round_flow(&f, port, async || false).await;
    broker.shutdown().await;
}

/// Refusals of MQTT uploads reach only the device they name, and only when the aggregator
/// signed them: one signed by another key, or signed but naming another device, is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upload_refusals_are_verified_at_the_device() {
    use fedfleet_control::{SignedRejection, UploadRejection};
    let f = Fleet::new(2);
    let broker = EmbeddedBroker::start(f.broker_config(0)).await.unwrap();
    let port = broker.local_addr().port();
    let (a, b) = (&f.devices[0], &f.devices[1]);
    let (dev_a, mut a_events, key_a) = f.device(port, a);
    let (dev_b, mut b_events, key_b) = f.device(port, b);
    // Publishes what only a compromised service could (the broker holds devices to their own
    // topics): the device must still verify what it hears.
    let (rogue, mut rogue_events) = f.rogue_service(port);
    for (what, events) in [("a", &mut a_events), ("b", &mut b_events), ("rogue", &mut rogue_events)] {
        wait_for(events, what, |e| matches!(e, ControlEvent::Connected { .. }).then_some(())).await;
    }
    let p = common::payload(a, 5);
    let header = common::signed_update(&f.fleet, a, &key_a, 5, &p);
    let refusal = UploadRejection::of(header.body(), RejectReason::NonFinite, "NaN in fc1.weight", 1);
    let topic_a = topics::rejections(&f.fleet, a);

    // Signed by device b instead of the aggregator.
    let forged = SignedRejection::sign(refusal.clone(), &key_b);
    rogue.publish_raw(&topic_a, forged.encode(), QoS::AtLeastOnce, false).await.unwrap();
    let r = wait_for(&mut a_events, "forged refusal rejection", |e| match e {
        ControlEvent::Rejected(r) => Some(r.clone()),
        ControlEvent::UploadRefused(_) => panic!("forged refusal accepted"),
        _ => None,
    })
    .await;
    assert_eq!(r.reason, RejectReason::BadSignature, "{r}");

    // Signed by the aggregator, but for device b, replayed on a's topic.
    let mut for_b = refusal.clone();
    for_b.device = b.clone();
    let misdirected = SignedRejection::sign(for_b, &f.aggregator_key);
    rogue.publish_raw(&topic_a, misdirected.encode(), QoS::AtLeastOnce, false).await.unwrap();
    let r = wait_for(&mut a_events, "misdirected refusal rejection", |e| match e {
        ControlEvent::Rejected(r) => Some(r.clone()),
        ControlEvent::UploadRefused(_) => panic!("another device's refusal accepted"),
        _ => None,
    })
    .await;
    assert_eq!(r.reason, RejectReason::BadSignature, "{r}");

    // The genuine one, published by the aggregator's key holder.
    let genuine = SignedRejection::sign(refusal.clone(), &f.aggregator_key);
    rogue.publish_raw(&topic_a, genuine.encode(), QoS::AtLeastOnce, false).await.unwrap();
    let got = wait_for(&mut a_events, "genuine refusal", |e| match e {
        ControlEvent::UploadRefused(s) => Some(s.clone()),
        _ => None,
    })
    .await;
    assert_eq!(got.body(), &refusal);
    assert!(got.body().refuses(header.body()));

    dev_a.shutdown().await;
    dev_b.shutdown().await;
    rogue.shutdown().await;
    broker.shutdown().await;
}
