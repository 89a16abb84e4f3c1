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

/// The CA's CRL closes what the ACL's patterns leave open: a revoked device's certificate is
/// refused at mosquitto's TLS handshake once the rules watch has seen the revocation (the rules
/// name the CRL's number) and reloaded the broker; the other devices keep connecting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mosquitto_refuses_a_revoked_device_at_the_handshake_after_the_rules_watch_reloads_it() {
    use fedfleet_control::access::{self, BrokerKind, RulesWatch, Tick};
    let Some(bin) = binary() else { return };
    let f = Fleet::new(2);
    let (crt, key) = f.server_files();
    let work = f.dir.path().join("mosquitto");
    let services = vec!["aggregator".to_owned()];
    let mut cfg = MosquittoConfig::new(bin, ([127, 0, 0, 1], 0).into(), f.pki.ca_cert_path(), crt, key, work.clone());
    cfg.acl = Some(access::broker_rules(f.pki.dir(), BrokerKind::Mosquitto, &services).unwrap());
    cfg.crl = Some(f.pki.crl_path());
    let broker = Mosquitto::start(cfg).await.unwrap();
    let port = broker.port();
    let hup = vec!["kill".to_owned(), "-HUP".to_owned(), broker.pid().unwrap().to_string()];
    let mut watch = RulesWatch::new(f.pki.dir().to_path_buf(), BrokerKind::Mosquitto, services, work.join("acl"), hup);
    assert_eq!(watch.tick().unwrap(), Tick::Unchanged);
    let (kept, revoked) = (&f.devices[0], &f.devices[1]);
    assert!(f.connects(port, revoked, Duration::from_secs(20)).await, "an enrolled device connects:\n{}", broker.log());

    // A CRL behind the list is not taken for rules: the watch waits for the current one.
    let crl_before = std::fs::read(f.pki.crl_path()).unwrap();
    f.pki.revoke(revoked, "lost").unwrap();
    let crl_after = std::fs::read(f.pki.crl_path()).unwrap();
    std::fs::write(f.pki.crl_path(), &crl_before).unwrap();
    assert!(matches!(watch.tick().unwrap(), Tick::PkiUnreadable(why) if why.contains("CRL number 1 but revoked.json is version 2")));
    std::fs::write(f.pki.crl_path(), &crl_after).unwrap();
    assert_eq!(watch.tick().unwrap(), Tick::Written);
    assert!(std::fs::read_to_string(work.join("acl")).unwrap().contains("Revoked devices: 1 (revoked.json version 2)"));

    // The new CRL's thisUpdate may sit a second ahead (crate docs of fedfleet_certs::crl).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while f.connects(port, revoked, Duration::from_secs(3)).await {
        assert!(tokio::time::Instant::now() < deadline, "a revoked device still gets in after the reload:\n{}", broker.log());
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(f.connects(port, kept, Duration::from_secs(20)).await, "the other device is let in:\n{}", broker.log());
    assert_eq!(watch.tick().unwrap(), Tick::Unchanged);
    drop(broker);
}
