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

/// The cluster's routes take TLS only: a peer that speaks the route protocol in the clear is
/// answered nothing and dropped (a node without route TLS greets with its `INFO` at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_routes_require_tls() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Some(bin) = binary() else { return };
    let f = Fleet::new(1);
    let nats = cluster(&f, bin).await;
    for addr in nats.route_addrs() {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let _ = stream.write_all(b"CONNECT {\"verbose\":false}\r\nPING\r\n").await;
        let mut answer = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer)).await.expect("dropped in time").ok();
        let answer = String::from_utf8_lossy(&answer);
        assert!(!answer.contains("INFO") && !answer.contains("PONG"), "route {addr} answered in the clear: {answer}");
    }
    // The nodes' own routes came up (under TLS: nothing else is taken), and each node names
    // why it dropped the clear peer.
    let logs = nats.logs();
    assert!(logs.matches("Route connection created").count() >= 3, "{logs}");
    assert_eq!(logs.matches("TLS route handshake error").count(), nats.route_addrs().len(), "{logs}");
}

/// `broker-access --watch` (`access::RulesWatch`) keeps the cluster's users in step with the
/// PKI: a device enrolled after the cluster started is refused until the rules are written again
/// and the nodes reloaded (SIGHUP), then it connects; a device revoked since is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_users_follow_enrolment_and_revocation_through_the_rules_watch() {
    use fedfleet_control::access::{BrokerKind, RulesWatch, Tick};
    let Some(bin) = binary() else { return };
    let f = Fleet::new(2);
    let (crt, key) = f.server_files();
    let work = f.dir.path().join("nats");
    std::fs::create_dir_all(&work).unwrap();
    let rules = work.join("fleet-authorization.conf");
    let services = vec!["aggregator".to_owned()];
    let mut watch = RulesWatch::new(f.pki.dir().to_path_buf(), BrokerKind::Nats, services.clone(), rules.clone(), Vec::new());
    assert_eq!(watch.tick().unwrap(), Tick::Written);
    // Each node's config sits in its own directory under `work`; NATS includes relative paths.
    let include = "include \"../fleet-authorization.conf\"".to_owned();
    let nats = NatsCluster::start(NatsConfig::new(bin, f.pki.ca_cert_path(), crt, key, work, include)).await.unwrap();
    let port = nats.mqtt_addrs()[0].port();
    let hup: Vec<String> = ["kill", "-HUP"].into_iter().map(String::from).chain(nats.pids().iter().map(u32::to_string)).collect();
    let mut watch = RulesWatch::new(f.pki.dir().to_path_buf(), BrokerKind::Nats, services, rules, hup);
    assert_eq!(watch.tick().unwrap(), Tick::Unchanged);

    let connects = async |id: &fedfleet_protocol::DeviceId, within: Duration| f.connects(port, id, within).await;
    assert!(connects(&f.devices[0], Duration::from_secs(30)).await, "an enrolled device connects");

    let late = fedfleet_protocol::DeviceId::new("dev-late").unwrap();
    f.pki.enroll_device(&late, fedfleet_certs::LEAF_DAYS, false).unwrap();
    assert!(!connects(&late, Duration::from_secs(3)).await, "a device the broker has no user for got in");
    assert_eq!(watch.tick().unwrap(), Tick::Written);
    assert!(connects(&late, Duration::from_secs(30)).await, "the enrolled device was not let in after the reload:\n{}", nats.logs());

    f.pki.revoke(&f.devices[1], "lost").unwrap();
    assert_eq!(watch.tick().unwrap(), Tick::Written);
    assert!(!connects(&f.devices[1], Duration::from_secs(5)).await, "a revoked device still has a broker user");
    assert_eq!(watch.tick().unwrap(), Tick::Unchanged);
}
