//! The same flow against a real external broker: Debian's mosquitto, TLS with the fleet CA,
//! client certificates required, run by `fedfleet_control::mosquitto`. `.ci/run` installs it; the
//! test fails (not skips) under `CI` when it is missing.

use std::time::Duration;

use fedfleet_testkit::mosquitto::{self, Mosquitto, MosquittoConfig};

use crate::common::{self, Fleet};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_flow_and_restart_over_mosquitto() {
    let Some(bin) = mosquitto::find_binary() else {
        if std::env::var_os("CI").is_some() {
            panic!(
                "mosquitto is not installed; CI must install it (.ci/run does: apt-get install mosquitto)"
            );
        }
        eprintln!(
            "NOTE: mosquitto not found on PATH or in /usr/sbin; skipping the external-broker test outside CI"
        );
        return;
    };
    let f = Fleet::new(3);
    let (crt, key) = f.server_files();
    let cfg = MosquittoConfig::new(
        bin,
        ([127, 0, 0, 1], 0).into(),
        f.pki.ca_cert_path(),
        crt,
        key,
        f.dir.path().join("mosquitto"),
    );
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
