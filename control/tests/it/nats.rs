//! The control plane on a 3-node NATS cluster (Debian's `nats-server`: MQTT listener, JetStream
//! clustered, TLS with the fleet CA and `verify_and_map`), under `topics::nats_authorization`.
//! `.ci/run` installs it; the tests fail (not skip) under `CI` when it is missing.

use std::time::Duration;

use fedfleet_control::topics;
use fedfleet_testkit::nats::{self, NatsCluster, NatsConfig};

use crate::common::{self, Fleet};

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
    // The forger and the joiner on other nodes than the aggregator: the rules hold cluster-wide.
    common::forgeries_are_dropped_by_the_broker(&f, ports[0], ports[1], ports[2]).await;
    drop(nats);
}

/// The round flow with every client given the three nodes: the node they all use is killed
/// mid-round; each fails over to the next node, and the round and the next complete with every
/// update acknowledged. The node killed is one that does not lead the JetStream metadata group:
/// that election adds 10-30 s on 2 busy cores, past this flow's waits; the services' fleet test
/// (`tests/tests/it/mqtt_fleet.rs`) kills its first node whatever it leads, with longer waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_flow_survives_a_nats_node_killed_mid_round() {
    let Some(bin) = binary() else { return };
    let mut f = Fleet::new(3);
    let mut nats = cluster(&f, bin).await;
    let victim = (0..3).find(|&i| Some(i) != nats.meta_leader()).unwrap();
    let mut ports: Vec<u16> = nats.mqtt_addrs().iter().map(|a| a.port()).collect();
    ports.swap(0, victim);
    f.failover = ports[1..].to_vec();
    // A node that lost a peer refuses subscriptions while it elects JetStream leaders; clients
    // wait the ceiling between tries (2 s, where a fleet would wait 30 s).
    f.backoff_max = Duration::from_secs(2);
    let nats_ref = &mut nats;
    common::round_flow(&f, ports[0], async || {
        nats_ref.kill(victim);
        true
    })
    .await;
    assert!((0..3).filter(|&i| i != victim).all(|i| nats.is_running(i)), "{}", nats.logs());
}
