//! The same flow against a real external broker: Debian's mosquitto, TLS with the fleet CA,
//! client certificates required, run by `fedfleet_control::mosquitto`. `.ci/run` installs it; the
//! test fails (not skips) under `CI` when it is missing.

use std::time::Duration;

use fedfleet_testkit::mosquitto::{self, Mosquitto, MosquittoConfig};

use fedfleet_control::topics;

use crate::common::{self, Fleet};

fn binary() -> Option<std::path::PathBuf> {
    let bin = mosquitto::find_binary();
    if bin.is_none() {
        if std::env::var_os("CI").is_some() {
            panic!("mosquitto is not installed; CI must install it (.ci/run does: apt-get install mosquitto)");
        }
        eprintln!("NOTE: mosquitto not found on PATH or in /usr/sbin; skipping the external-broker test outside CI");
    }
    bin
}

/// mosquitto under `topics::mosquitto_acl`: a device's retained forgery on the announcement
/// topic and its publish on another device's status topic are dropped by the broker, so a device
/// connecting later hears the real announcement and the aggregator never sees the forgery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mosquitto_holds_devices_to_their_topics_with_the_fleet_acl() {
    let Some(bin) = binary() else { return };
    let f = Fleet::new(2);
    let (crt, key) = f.server_files();
    let mut cfg = MosquittoConfig::new(bin, ([127, 0, 0, 1], 0).into(), f.pki.ca_cert_path(), crt, key, f.dir.path().join("mosquitto"));
    cfg.acl = Some(topics::mosquitto_acl(&f.fleet, &["aggregator"]));
    let broker = Mosquitto::start(cfg).await.unwrap();
    let port = broker.port();
    common::forgeries_are_dropped_by_the_broker(&f, port, port, port).await;
    drop(broker);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_flow_and_restart_over_mosquitto() {
    let Some(bin) = binary() else { return };
    let f = Fleet::new(3);
    let (crt, key) = f.server_files();
    let cfg = MosquittoConfig::new(bin, ([127, 0, 0, 1], 0).into(), f.pki.ca_cert_path(), crt, key, f.dir.path().join("mosquitto"));
    let cfg = MosquittoConfig { acl: Some(topics::mosquitto_acl(&f.fleet, &["aggregator"])), ..cfg };
    let mut broker = Mosquitto::start(cfg).await.unwrap();
    let port = broker.port();
    let broker_ref = &mut broker;
    common::round_flow(&f, port, async || {
        broker_ref.kill();
        tokio::time::sleep(Duration::from_millis(300)).await;
        broker_ref.restart().await.unwrap();
        true
    })
    .await;
    broker.kill();
}
