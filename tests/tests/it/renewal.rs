//! Issue 14 defect 8: device certificates renew before they expire. A real registry on loopback
//! QUIC (mTLS judged by a fake clock on both sides) and the agent's own renewal code and registry
//! client: a device is carried past its certificate's original lifetime and keeps working
//! because it renewed; a device that did not is refused with `certificate_expired`, and its
//! agent names the lapse at start; a revoked device's renewal is refused; a certificate that
//! lapses after the device connected is refused even when its next connection resumes the TLS
//! session (no certificate exchanged).

use std::path::Path;
use std::sync::Arc;

use fedfleet_agent::config::IdentityPaths;
use fedfleet_agent::remote::RemoteRegistry;
use fedfleet_agent::renewal::{RenewalConfig, RenewalError, RenewalOutcome, Renewer};
use fedfleet_agent::{Clock, daemon};
use fedfleet_certs::{ALPN_V1, DeviceIdentity, Pki, tls};
use fedfleet_protocol::{DeviceId, FleetId, RejectReason};
use fedfleet_registry::client::{ClientError, RegistryClient};
use fedfleet_testkit::clock::FakeClock;
use fedfleet_testkit::services::{RegistrySetup, RunningRegistry};

const DAY_MS: u64 = 86_400_000;

struct Fleet {
    dir: tempfile::TempDir,
    pki: Pki,
    clock: Arc<FakeClock>,
    registry: RunningRegistry,
}

/// A fleet whose CA and registry certificate last ten years and whose devices' certificates
/// last 365 days; the registry renews with the CA key and judges time by the fake clock.
fn start(devices: &[&str]) -> Fleet {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::init(dir.path().join("pki"), &FleetId::new("fleet-renew").unwrap(), 3650, false).unwrap();
    pki.issue_server("registry", &[], 3650, false).unwrap();
    for d in devices {
        pki.enroll_device(&DeviceId::new(*d).unwrap(), 365, false).unwrap();
    }
    let clock = Arc::new(FakeClock::new(fedfleet_protocol::SystemClock.now_ms()));
    let setup = RegistrySetup { key_days: 3650, renewal_days: Some(365), clock: clock.clone(), ..Default::default() };
    let registry = RunningRegistry::start(&pki, &dir.path().join("registry"), setup).unwrap();
    Fleet { dir, pki, clock, registry }
}

/// A device as its agent holds it: its own copy of the identity files, the agent's registry
/// client (TLS judged by the fake clock) and its renewer.
struct Device {
    ids: IdentityPaths,
    registry: Arc<RemoteRegistry>,
    renewer: Renewer,
}

impl Fleet {
    fn device(&self, id: &str) -> Device {
        let home = self.dir.path().join("agents").join(id);
        std::fs::create_dir_all(&home).unwrap();
        let pki_dir = self.pki.dir();
        let ids = IdentityPaths {
            cert: home.join("device.crt"),
            key: home.join("device.key"),
            ca: home.join("ca.crt"),
            registry_root: home.join("root.json"),
        };
        copy(&pki_dir.join(format!("devices/{id}.crt")), &ids.cert);
        copy(&pki_dir.join(format!("devices/{id}.key")), &ids.key);
        copy(&pki_dir.join("ca.crt"), &ids.ca);
        let clock: Arc<dyn Clock> = self.clock.clone();
        let identity = daemon::load_identity_at(&ids, clock.now_ms()).unwrap();
        let c = clock.clone();
        let tls = tls::client_config_at(identity.ca(), &identity, &[ALPN_V1], tls::clock_time(move || c.now_ms())).unwrap();
        let client = RegistryClient::new(self.registry.addr, "localhost", tls).unwrap();
        let registry = Arc::new(RemoteRegistry::with_clock(client, "digits", self.registry.pinned_root.clone(), clock.clone()));
        let renewer = Renewer::new(ids.clone(), RenewalConfig::default(), registry.clone(), None, clock);
        Device { ids, registry, renewer }
    }

    fn now_secs(&self) -> i64 {
        (self.clock.now_ms() / 1000) as i64
    }

    async fn stop(self) {
        self.registry.stop().await;
    }
}

fn copy(from: &Path, to: &Path) {
    std::fs::copy(from, to).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_that_renewed_keeps_working_past_its_original_lifetime() {
    let fleet = start(&["edge-00"]);
    let dev = fleet.device("edge-00");
    let original = DeviceIdentity::from_files_at(&dev.ids.cert, &dev.ids.key, &dev.ids.ca, fleet.now_secs()).unwrap().validity();

    // Fresh certificate: nothing to do, and the registry answers.
    assert!(matches!(dev.renewer.check().await.unwrap(), RenewalOutcome::NotDue { .. }));
    dev.registry.client().metadata(0).await.expect("registry answers a fresh certificate");

    // 340 days on: in the renewal window (30 days left); the agent renews over its mTLS identity.
    fleet.clock.advance(340 * DAY_MS);
    let RenewalOutcome::Renewed { not_after } = dev.renewer.check().await.unwrap() else { panic!("not renewed") };
    assert!(not_after >= original.not_after + 300 * 86_400, "renewed until {not_after}, was {}", original.not_after);
    assert_eq!(fleet.registry.reg.metrics().certificates_renewed.get(), 1);
    // Same key (it signs the device's updates), now on disk.
    let on_disk = DeviceIdentity::from_files_at(&dev.ids.cert, &dev.ids.key, &dev.ids.ca, fleet.now_secs()).unwrap();
    assert_eq!(on_disk.validity().not_after, not_after);
    assert_eq!(on_disk.verifying_key(), DeviceIdentity::load(fleet.pki.dir(), &DeviceId::new("edge-00").unwrap()).unwrap().verifying_key());

    // 400 days after enrollment: past the original certificate's end, the device still works.
    fleet.clock.advance(60 * DAY_MS);
    assert!(fleet.now_secs() > original.not_after);
    dev.registry.client().metadata(0).await.expect("registry answers the renewed certificate");
    assert!(matches!(dev.renewer.check().await.unwrap(), RenewalOutcome::NotDue { .. }));
    // The certificate it started with would no longer load.
    let err = DeviceIdentity::from_files_at(&fleet.pki.dir().join("devices/edge-00.crt"), &dev.ids.key, &dev.ids.ca, fleet.now_secs())
        .unwrap_err();
    assert!(matches!(err, fedfleet_certs::CertError::Expired { .. }), "{err}");
    fleet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lapsed_device_is_refused_as_certificate_expired() {
    let fleet = start(&["edge-02"]);
    // Loaded (and its TLS config built) while the certificate was valid; no connection yet.
    let dev = fleet.device("edge-02");

    // The device never renewed (it was offline): 400 days on, its certificate has lapsed and
    // its next handshake is refused (mTLS judges a certificate at the handshake).
    fleet.clock.advance(400 * DAY_MS);
    match dev.registry.client().metadata(0).await {
        Err(ClientError::Rejected(r)) => assert_eq!(r.reason, RejectReason::CertificateExpired, "{}", r.detail),
        other => panic!("expected a certificate_expired refusal, got {other:?}"),
    }
    // The server counts the refused handshake on its side of it, which may finish just after
    // the client hears the alert.
    let counted = async {
        while fleet.registry.reg.metrics().get("fedfleet_registry_rejections_total", "certificate_expired") < 1 {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(10), counted).await.expect("the registry counts the certificate_expired refusal");
    // It cannot renew any more, and says why.
    let err = dev.renewer.check().await.unwrap_err();
    assert!(matches!(err, RenewalError::Identity(fedfleet_certs::CertError::Expired { .. })), "{err}");
    // The agent at start: a named error, not a TLS failure.
    let start = format!("{:#}", daemon::load_identity_at(&dev.ids, fleet.clock.now_ms()).unwrap_err());
    assert!(start.contains("certificate expired at") && start.contains("re-enroll"), "{start}");
    fleet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_device_cannot_renew() {
    let fleet = start(&["edge-01"]);
    let dev = fleet.device("edge-01");
    fleet.pki.revoke(&DeviceId::new("edge-01").unwrap(), "stolen").unwrap();
    fleet.clock.advance(340 * DAY_MS);
    match dev.renewer.check().await {
        Err(RenewalError::Refused { reason, .. }) => assert_eq!(reason, RejectReason::Revoked),
        other => panic!("expected a revoked refusal, got {other:?}"),
    }
    assert_eq!(fleet.registry.reg.metrics().certificates_renewed.get(), 0);
    // The certificate on disk is untouched.
    let kept = DeviceIdentity::from_files_at(&dev.ids.cert, &dev.ids.key, &dev.ids.ca, fleet.now_secs()).unwrap();
    assert_eq!(
        kept.cert(),
        DeviceIdentity::from_files_at(&fleet.pki.dir().join("devices/edge-01.crt"), &dev.ids.key, &dev.ids.ca, fleet.now_secs())
            .unwrap()
            .cert()
    );
    fleet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_session_whose_certificate_expired_since_is_refused_as_certificate_expired() {
    let fleet = start(&[]);
    let id = DeviceId::new("edge-03").unwrap();
    fleet.pki.enroll_device(&id, 1, false).unwrap();
    let identity = DeviceIdentity::load(fleet.pki.dir(), &id).unwrap();
    // The device judges time by the system clock, so the session ticket it gets stays fresh
    // while the registry's clock moves past the certificate's end.
    let tls = tls::client_config(identity.ca(), &identity, &[ALPN_V1]).unwrap();
    let client = RegistryClient::new(fleet.registry.addr, "localhost", tls).unwrap();
    client.metadata(0).await.expect("answered while the certificate is valid");
    client.close().await;

    fleet.clock.advance(2 * DAY_MS);
    // The next connection resumes (no certificate exchanged, so no handshake check of it); the
    // registry's own check of the ticket's chain refuses it, with the reason a full handshake
    // would have given. Its detail is the service's, not the TLS alert's.
    match client.metadata(0).await {
        Err(ClientError::Rejected(r)) => {
            assert_eq!(r.reason, RejectReason::CertificateExpired, "{}", r.detail);
            assert!(
                r.detail.contains("the client certificate expired at"),
                "refused by the handshake, not after a resumption: {}",
                r.detail
            );
        }
        other => panic!("expected a certificate_expired refusal, got {other:?}"),
    }
    assert_eq!(fleet.registry.reg.metrics().get("fedfleet_registry_rejections_total", "certificate_expired"), 1);
    fleet.stop().await;
}
