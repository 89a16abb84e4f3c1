#![no_main]

//! Every signed envelope kind, the hand-written canonical headers, and streaming payload checks.

use fedfleet_protocol::envelope::Signable;
use fedfleet_protocol::messages::ModelManifest;
use fedfleet_protocol::{
    DeviceId, DeviceStatus, PayloadCheck, Receipt, RelayHeader, RolloutNotice, RoundAnnouncement,
    Signed, UpdateHeader,
};
use libfuzzer_sys::fuzz_target;

/// Decodes `data` as a `Signed<T>`; whatever parses must re-encode to the same bytes (the body
/// bytes are kept as received).
fn envelope<T: Signable>(data: &[u8]) -> Option<Signed<T>> {
    let signed = Signed::<T>::decode(data).ok()?;
    assert_eq!(signed.encode(), data, "{:?} envelope re-encodes", T::KIND);
    let _ = signed.signing_message();
    Some(signed)
}

fuzz_target!(|data: &[u8]| {
    let device = DeviceId::new("dev-1").expect("valid id");

    if let Some(s) = envelope::<UpdateHeader>(data) {
        let _ = fedfleet_protocol::verify_payload(s.body(), data);
    }
    if let Some(s) = envelope::<RelayHeader>(data) {
        // The payload arrives in chunks; the digest and length checks must never panic.
        let mut check = PayloadCheck::new(s.body());
        for chunk in data.chunks(7) {
            if check.update(chunk).is_err() {
                break;
            }
        }
        let _ = check.received();
        let _ = check.finish();
    }
    let _ = envelope::<Receipt>(data);
    if let Some(s) = envelope::<RoundAnnouncement>(data) {
        let _ = s.body().selection.selects(&device);
    }
    if let Some(s) = envelope::<RolloutNotice>(data) {
        let _ = s.body().includes(&device, Some("lab"));
        let _ = s.body().includes(&device, None);
    }
    let _ = envelope::<DeviceStatus>(data);
    if let Some(s) = envelope::<ModelManifest>(data) {
        let _ = s.body().spec_json();
        let _ = s.body().model_ref();
    }

    // Canonical (hand-written) bodies: whatever parses re-encodes to the same bytes.
    if let Ok(h) = RelayHeader::from_canonical_bytes(data) {
        assert_eq!(h.canonical_bytes(), data);
    }
    if let Ok(r) = Receipt::from_canonical_bytes(data) {
        assert_eq!(r.canonical_bytes(), data);
    }
    // postcard bodies: whatever parses re-encodes to something that parses again.
    if let Ok(a) = RoundAnnouncement::from_canonical_bytes(data) {
        RoundAnnouncement::from_canonical_bytes(&a.canonical_bytes()).expect("re-encoded round");
    }
    if let Ok(n) = RolloutNotice::from_canonical_bytes(data) {
        let again = RolloutNotice::from_canonical_bytes(&n.canonical_bytes()).expect("re-encoded");
        assert_eq!(again, n);
    }
    if let Ok(s) = DeviceStatus::from_canonical_bytes(data) {
        let again = DeviceStatus::from_canonical_bytes(&s.canonical_bytes()).expect("re-encoded");
        assert_eq!(again, s);
        let _ = s.state.as_str();
    }
    if let Ok(m) = ModelManifest::from_canonical_bytes(data) {
        ModelManifest::from_canonical_bytes(&m.canonical_bytes()).expect("re-encoded manifest");
    }
});
