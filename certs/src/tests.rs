//! Unit tests: PKI round trips, the revocation list signature, the watcher and the allow-list.

use std::time::Duration;

use fedfleet_protocol::{DeviceId, FleetId};

use super::*;

fn fleet() -> FleetId {
    FleetId::new("test-fleet").unwrap()
}

fn id(s: &str) -> DeviceId {
    DeviceId::new(s).unwrap()
}

#[test]
fn issued_certificates_chain_to_the_ca_name_and_key() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::init(dir.path(), &fleet(), CA_DAYS, false).unwrap();
    let dev = pki.enroll_device(&id("cam-1"), LEAF_DAYS, false).unwrap();
    let ca = x509::parse(pki.ca().der()).unwrap();
    let der = x509::load_pem_certs(&dev.cert_path).unwrap().remove(0);
    let leaf = x509::parse(&der).unwrap();
    assert_eq!(leaf.issuer().as_raw(), ca.subject().as_raw());
    // x509-parser's verify feature is off; check the CA signature with dalek.
    let sig = ed25519_dalek::Signature::from_slice(&leaf.signature_value.data).unwrap();
    pki.ca().public_key().verify_strict(leaf.tbs_certificate.as_ref(), &sig).unwrap();
    assert_eq!(x509::serial_hex(&leaf), dev.entry.serial);
    assert_eq!(device_id_from_peer(std::slice::from_ref(&der)).unwrap(), id("cam-1"));

    let identity = DeviceIdentity::load(dir.path(), &id("cam-1")).unwrap();
    assert_eq!(identity.device_id(), &id("cam-1"));
    assert_eq!(hex::encode(identity.verifying_key().to_bytes()), dev.entry.public_key);
    // The same key signs updates and verifies against the allow-list.
    use ed25519_dalek::Signer;
    let sig = identity.signing_key().sign(b"update");
    let allow = AllowList::load(pki.allow_list_path()).unwrap();
    allow.public_key(&id("cam-1")).unwrap().verify_strict(b"update", &sig).unwrap();
}

#[test]
fn server_cert_is_not_a_device() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::init(dir.path(), &fleet(), CA_DAYS, false).unwrap();
    pki.issue_server("aggregator", &[], LEAF_DAYS, false).unwrap();
    let s = ServerIdentity::load(dir.path(), "aggregator").unwrap();
    assert_eq!(s.name(), "aggregator");
    assert!(matches!(device_id_from_peer(s.cert_chain()), Err(CertError::NotADevice(_))));
    assert_eq!(peer_identity(s.cert_chain()).unwrap(), PeerIdentity::Service("aggregator".into()));
    assert!(matches!(device_id_from_peer(&[]), Err(CertError::NoPeerCertificate)));
    assert!(matches!(pki.issue_server("bad/name", &[], 1, false), Err(CertError::InvalidId { .. })));
    assert!(matches!(pki.issue_server("x", &["not a name".into()], 1, false), Err(CertError::InvalidSan(_))));
}

#[test]
fn keys_are_0600_and_never_overwritten_without_force() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::init(dir.path(), &fleet(), CA_DAYS, false).unwrap();
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&layout::ca_key(dir.path())), 0o600);
    let dev = pki.enroll_device(&id("d1"), 30, false).unwrap();
    assert_eq!(mode(&dev.key_path), 0o600);
    let before = std::fs::read(&dev.key_path).unwrap();
    match pki.enroll_device(&id("d1"), 30, false) {
        Err(CertError::Exists { path }) => assert_eq!(path, dev.key_path),
        other => panic!("expected Exists, got {other:?}"),
    }
    assert_eq!(std::fs::read(&dev.key_path).unwrap(), before);
    let again = pki.enroll_device(&id("d1"), 30, true).unwrap();
    assert_ne!(std::fs::read(&again.key_path).unwrap(), before);
    assert_eq!(mode(&again.key_path), 0o600);
    assert!(matches!(Pki::init(dir.path(), &fleet(), CA_DAYS, false), Err(CertError::Exists { .. })));
}

#[test]
fn revocation_list_signature_covers_every_field() {
    let ca_key = keys::generate();
    let entry = RevocationEntry { device_id: id("a"), serial: "01".into(), revoked_at: 5, reason: "lost".into() };
    let list = RevocationList::signed(3, 10, vec![entry], &ca_key);
    assert!(list.verify(&ca_key.verifying_key()));
    assert!(list.signed_bytes().starts_with(b"fedfleet/revocation/v1\0"));
    let mut t = list.clone();
    t.entries[0].reason = "found".into();
    assert!(!t.verify(&ca_key.verifying_key()));
    let mut t = list.clone();
    t.entries.clear();
    assert!(!t.verify(&ca_key.verifying_key()));
    let mut t = list.clone();
    t.version = 4;
    assert!(!t.verify(&ca_key.verifying_key()));
    assert!(!list.verify(&keys::generate().verifying_key()));
}

#[test]
fn watcher_picks_up_revocations_and_keeps_the_last_good_list() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::init(dir.path(), &fleet(), CA_DAYS, false).unwrap();
    pki.enroll_device(&id("d1"), 30, false).unwrap();
    pki.enroll_device(&id("d2"), 30, false).unwrap();
    let w = RevocationWatcher::open(dir.path()).unwrap();
    assert!(!w.is_revoked(&id("d1")));
    pki.revoke(&id("d1"), "stolen").unwrap();
    assert!(w.is_revoked(&id("d1")));
    assert!(!w.is_revoked(&id("d2")));
    assert!(matches!(pki.revoke(&id("d1"), "again"), Err(CertError::Revoked(_))));
    assert!(matches!(pki.enroll_device(&id("d1"), 30, true), Err(CertError::Revoked(_))));
    assert!(matches!(pki.revoke(&id("nobody"), ""), Err(CertError::NotEnrolled(_))));

    // A tampered list (d1 removed) is ignored.
    let path = pki.revocation_list_path();
    let good = std::fs::read(&path).unwrap();
    let mut tampered = RevocationList::read_unverified(&path).unwrap();
    tampered.entries.clear();
    std::fs::write(&path, serde_json::to_vec(&tampered).unwrap()).unwrap();
    assert!(w.refresh().is_err());
    assert!(w.is_revoked(&id("d1")));
    // Garbage too.
    std::fs::write(&path, b"{not json").unwrap();
    assert!(w.is_revoked(&id("d1")));
    // An older, validly signed list is a rollback.
    std::fs::write(&path, &good).unwrap();
    assert!(w.refresh().is_ok());
    let ca_key = load_signing_key(&layout::ca_key(dir.path())).unwrap();
    let old = RevocationList::signed(1, 0, vec![], &ca_key);
    std::fs::write(&path, old.to_json()).unwrap();
    assert!(matches!(w.refresh(), Err(CertError::Rollback { .. })));
    assert!(w.is_revoked(&id("d1")));
    assert_eq!(w.current().version, 2);
}

#[test]
fn watcher_interval_limits_stats() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::init(dir.path(), &fleet(), CA_DAYS, false).unwrap();
    pki.enroll_device(&id("d1"), 30, false).unwrap();
    let w = RevocationWatcher::open(dir.path()).unwrap().with_min_interval(Duration::from_secs(3600));
    pki.revoke(&id("d1"), "").unwrap();
    assert!(!w.is_revoked(&id("d1")), "not re-read within the interval");
    w.refresh().unwrap();
    assert!(w.is_revoked(&id("d1")));
}

#[test]
fn allow_list_reloads_and_refuses_weak_keys() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::init(dir.path(), &fleet(), CA_DAYS, false).unwrap();
    let allow = AllowList::load(pki.allow_list_path()).unwrap();
    assert!(allow.is_empty());
    assert_eq!(allow.status(&id("d1")), DeviceStatus::Unknown);
    pki.enroll_device(&id("d1"), 30, false).unwrap();
    assert!(allow.public_key(&id("d1")).is_some());
    pki.revoke(&id("d1"), "").unwrap();
    assert_eq!(allow.public_key(&id("d1")), None);
    assert_eq!(allow.status(&id("d1")), DeviceStatus::Revoked);

    // The identity point (all zeros but the first byte = 1) is a weak key.
    let mut file = AllowListFile::read(&pki.allow_list_path()).unwrap();
    let mut weak = [0u8; 32];
    weak[0] = 1;
    file.devices.insert(id("weak"), AllowEntry { public_key: hex::encode(weak), serial: "01".into(), enrolled_at: 0, revoked_at: None });
    let weak_path = dir.path().join("weak.json");
    std::fs::write(&weak_path, file.to_json()).unwrap();
    let err = AllowList::load(&weak_path).unwrap_err().to_string();
    assert!(err.contains("weak"), "{err}");
    // A reload to a bad file keeps the last good list.
    std::fs::write(pki.allow_list_path(), file.to_json()).unwrap();
    assert!(allow.reload_if_changed().is_err());
    assert_eq!(allow.status(&id("d1")), DeviceStatus::Revoked);
}

#[test]
fn tls_configs_build_with_ring() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::init(dir.path(), &fleet(), CA_DAYS, false).unwrap();
    pki.issue_server("registry", &["registry.local".into(), "::1".into()], 30, false).unwrap();
    pki.enroll_device(&id("d1"), 30, false).unwrap();
    let server = ServerIdentity::load(dir.path(), "registry").unwrap();
    let device = DeviceIdentity::load(dir.path(), &id("d1")).unwrap();
    let w = std::sync::Arc::new(RevocationWatcher::open(dir.path()).unwrap());
    let sc = tls::server_config(pki.ca(), &server, w, &[ALPN_V1]).unwrap();
    assert_eq!(sc.alpn_protocols, vec![ALPN_V1.to_vec()]);
    tls::client_config(device.ca(), &device, &[ALPN_V1]).unwrap();
    tls::service_client_config(pki.ca(), &server, &[ALPN_V1]).unwrap();
    tls::anonymous_client_config(pki.ca(), &[ALPN_V1]).unwrap();
}

#[test]
fn inspect_describes_each_kind_of_file() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::init(dir.path(), &fleet(), CA_DAYS, false).unwrap();
    pki.issue_server("aggregator", &[], 30, false).unwrap();
    let d = pki.enroll_device(&id("d1"), 30, false).unwrap();
    pki.revoke(&id("d1"), "lost").unwrap();
    let s = inspect::describe(&dir.path().join("servers/aggregator.crt"), None).unwrap();
    assert!(s.contains("DNS:localhost") && s.contains("IP:127.0.0.1") && s.contains("serverAuth"), "{s}");
    let s = inspect::describe(&d.cert_path, None).unwrap();
    assert!(s.contains("CN=d1") && s.contains("clientAuth") && s.contains("ed25519"), "{s}");
    let s = inspect::describe(&d.key_path, None).unwrap();
    assert!(s.contains(&d.entry.public_key) && !s.contains("PRIVATE"), "{s}");
    let s = inspect::describe(&pki.revocation_list_path(), None).unwrap();
    assert!(s.contains("signature:   valid") && s.contains("lost"), "{s}");
    let s = inspect::describe(&pki.allow_list_path(), None).unwrap();
    assert!(s.contains("d1") && s.contains("REVOKED"), "{s}");
}

#[test]
fn a_device_identity_from_another_fleets_ca_is_refused_at_load() {
    let (ours, theirs) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let our_pki = Pki::init(ours.path(), &fleet(), CA_DAYS, false).unwrap();
    let their_pki = Pki::init(theirs.path(), &FleetId::new("other").unwrap(), CA_DAYS, false).unwrap();
    let mine = our_pki.enroll_device(&id("cam-1"), LEAF_DAYS, false).unwrap();
    let foreign = their_pki.enroll_device(&id("cam-1"), LEAF_DAYS, false).unwrap();
    DeviceIdentity::from_files(&mine.cert_path, &mine.key_path, &our_pki.ca_cert_path()).unwrap();
    match DeviceIdentity::from_files(&foreign.cert_path, &foreign.key_path, &our_pki.ca_cert_path()) {
        Err(CertError::NotIssuedByCa { path, reason, .. }) => {
            assert_eq!(path, foreign.cert_path);
            assert!(!reason.is_empty());
        }
        other => panic!("a certificate of another fleet's CA was accepted: {other:?}"),
    }
}

/// `ca.crl` follows `revoked.json`: numbered by its version, listing its serials, issued by the
/// CA and signed by the CA key, each one strictly later than the last even within a second.
#[test]
fn the_crl_lists_every_revoked_serial_signed_by_the_ca() {
    use ed25519_dalek::Verifier;
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::init(dir.path(), &fleet(), CA_DAYS, false).unwrap();
    assert_eq!(crl::summary(&pki.crl_path()).unwrap(), crl::CrlSummary { number: 1, revoked: 0 });
    let d1 = pki.enroll_device(&id("d1"), 30, false).unwrap();
    let d2 = pki.enroll_device(&id("d2"), 30, false).unwrap();
    pki.enroll_device(&id("d3"), 30, false).unwrap();
    let issued = || RevocationList::load(&pki.revocation_list_path(), pki.ca().public_key()).unwrap().issued_at;
    pki.revoke(&id("d1"), "stolen").unwrap();
    let first = issued();
    pki.revoke(&id("d2"), "lost").unwrap();
    assert!(issued() > first, "two revocations within a second still order their CRLs");
    assert_eq!(crl::summary(&pki.crl_path()).unwrap(), crl::CrlSummary { number: 3, revoked: 2 });

    let pem_bytes = std::fs::read(pki.crl_path()).unwrap();
    let (_, pem) = x509_parser::pem::parse_x509_pem(&pem_bytes).unwrap();
    let (_, crl) = x509_parser::parse_x509_crl(&pem.contents).unwrap();
    let ca = x509::parse(pki.ca().der()).unwrap();
    assert_eq!(crl.issuer(), ca.subject());
    let mut serials: Vec<String> = crl.iter_revoked_certificates().map(|r| hex::encode(r.raw_serial())).collect();
    serials.sort();
    let mut want = vec![d1.entry.serial.clone(), d2.entry.serial.clone()];
    want.sort();
    assert_eq!(serials, want);
    let sig = ed25519_dalek::Signature::from_slice(&crl.signature_value.data).unwrap();
    pki.ca().public_key().verify(crl.tbs_cert_list.as_ref(), &sig).expect("signed by the CA key");
    // thisUpdate is the list's issue time, strictly increasing; nextUpdate the CA's expiry.
    let list = RevocationList::load(&pki.revocation_list_path(), pki.ca().public_key()).unwrap();
    assert_eq!(crl.last_update().timestamp() as u64, list.issued_at);
    assert_eq!(crl.next_update().unwrap(), ca.validity().not_after);

    // A lost CRL is written again, byte for byte (ed25519 signs deterministically).
    std::fs::remove_file(pki.crl_path()).unwrap();
    pki.write_crl().unwrap();
    assert_eq!(std::fs::read(pki.crl_path()).unwrap(), pem_bytes);
}

#[test]
fn a_service_certificate_warns_in_its_last_30_days_or_last_third_whichever_is_shorter() {
    use crate::renewal::Validity;
    const DAY: i64 = 86_400;
    let year = Validity { not_before: 0, not_after: 365 * DAY };
    assert!(!year.expiry_warning_due(335 * DAY - 1), "31 days left of a year: quiet");
    assert!(year.expiry_warning_due(335 * DAY + 1), "under 30 days left: warns");
    // A 30-day certificate has under 30 days left from its first second; it warns in its last 10.
    let month = Validity { not_before: 0, not_after: 30 * DAY };
    assert!(!month.expiry_warning_due(3_600), "an hour-old short-lived certificate does not warn");
    assert!(!month.expiry_warning_due(20 * DAY - 1));
    assert!(month.expiry_warning_due(20 * DAY + 1));
    assert!(month.expiry_warning_due(31 * DAY), "expired: still due (the caller logs an error)");
}
