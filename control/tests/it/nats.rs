//! The control plane on a 3-node NATS cluster (Debian's `nats-server`: MQTT listener, JetStream
//! clustered, TLS with the fleet CA and `verify_and_map`), under `topics::nats_authorization`.
//! `.ci/run` installs it; the tests fail (not skip) under `CI` when it is missing.

use std::time::Duration;

use fedfleet_control::{ControlEvent, QoS, topics};
use fedfleet_protocol::Signed;
use fedfleet_testkit::nats::{self, NatsCluster, NatsConfig};

use crate::common::{self, Fleet, wait_for};

fn binary() -> Option<std::path::PathBuf> {
    let bin = nats::find_binary();
    if bin.is_none() {
        if std::env::var_os("CI").is_some() {
            panic!("nats-server is not installed; CI must install it (.ci/run does: apt-get install nats-server)");
        }
        eprintln!("NOTE: nats-server not found on PATH or in /usr/sbin; skipping the NATS cluster test outside CI");
    }
    bin
}

async fn cluster(f: &Fleet, bin: std::path::PathBuf) -> NatsCluster {
    let (crt, key) = f.server_files();
    let auth = topics::nats_authorization(&f.fleet, &["aggregator"], &f.devices);
    let cfg = NatsConfig::new(bin, f.pki.ca_cert_path(), crt, key, f.dir.path().join("nats"), auth);
    NatsCluster::start(cfg).await.unwrap()
}

/// A device publishing a retained forged announcement, and on another device's status topic, is
/// refused by the broker: a device connecting later hears the real announcement, and the
/// aggregator never receives the forged status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_holds_devices_to_their_topics_and_a_late_joiner_hears_the_real_announcement() {
    let Some(bin) = binary() else { return };
    let f = Fleet::new(2);
    let nats = cluster(&f, bin).await;
    let ports: Vec<u16> = nats.mqtt_addrs().iter().map(|a| a.port()).collect();
    let (agg, mut agg_events) = f.aggregator(ports[0]);
    // The forger is on another node than the aggregator: the rules hold cluster-wide.
    let (dev_b, mut b_events, key_b) = f.device(ports[1], &f.devices[1]);
    for (what, events) in [("aggregator", &mut agg_events), ("b", &mut b_events)] {
        wait_for(events, what, |e| matches!(e, ControlEvent::Connected { .. }).then_some(())).await;
    }
    agg.publish_announcement(&f.announcement(6)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let forged = Signed::sign(f.announcement(7).into_body(), &key_b);
    dev_b.publish_raw(&topics::rounds(&f.fleet), forged.encode(), QoS::AtLeastOnce, true).await.unwrap();
    let forged_status = Signed::sign(common::training_status(&f.fleet, &f.devices[0], 6), &key_b);
    dev_b.publish_raw(&topics::status(&f.fleet, &f.devices[0]), forged_status.encode(), QoS::AtLeastOnce, true).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (dev_a, mut a_events, _) = f.device(ports[2], &f.devices[0]);
    let round = wait_for(&mut a_events, "retained announcement", |e| match e {
        ControlEvent::Announcement(s) => Some(s.body().round.0),
        ControlEvent::Rejected(r) => panic!("the forgery reached a device: {r}"),
        _ => None,
    })
    .await;
    assert_eq!(round, 6);
    // Whatever reached the aggregator meanwhile, none of it was the forged status.
    while let Ok(Some(e)) = tokio::time::timeout(Duration::from_millis(300), agg_events.recv()).await {
        assert!(!matches!(e, ControlEvent::Rejected(_)), "a forgery reached the aggregator: {e:?}");
    }
    assert!(agg.stats().rejected.is_empty(), "{:?}", agg.stats());
    for c in [&agg, &dev_a, &dev_b] {
        c.shutdown().await;
    }
    drop(nats);
}

/// The round flow with every client given the three nodes: the node they all use is killed
/// mid-round; each fails over to the next node, and the round and the next complete with every
/// update acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_flow_survives_a_nats_node_killed_mid_round() {
    let Some(bin) = binary() else { return };
    let mut f = Fleet::new(3);
    let mut nats = cluster(&f, bin).await;
    let ports: Vec<u16> = nats.mqtt_addrs().iter().map(|a| a.port()).collect();
    f.failover = ports[1..].to_vec();
    // A node that lost a peer refuses subscriptions while it elects JetStream leaders; clients
    // wait the ceiling between tries (2 s, where a fleet would wait 30 s).
    f.backoff_max = Duration::from_secs(2);
    let nats_ref = &mut nats;
    common::round_flow(&f, ports[0], async || {
        nats_ref.kill(0);
        true
    })
    .await;
    assert!(nats.is_running(1) && nats.is_running(2), "{}", nats.logs());
}
