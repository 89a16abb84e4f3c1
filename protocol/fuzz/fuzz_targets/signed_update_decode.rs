#![no_main]

use fedfleet_protocol::envelope::Signable;
use fedfleet_protocol::{
    DeviceStatus, Receipt, RoundAnnouncement, Signed, SignedRelay, SignedUpdate, UpdateHeader,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(signed) = SignedUpdate::decode(data) {
        // Whatever parses must re-encode to the same bytes: the encoding is canonical.
        assert_eq!(signed.encode(), data);
    }
    if let Ok(header) = UpdateHeader::from_canonical_bytes(data) {
        assert_eq!(header.canonical_bytes(), data);
    }
    let _ = SignedRelay::decode(data);
    let _ = Signed::<Receipt>::decode(data);
    let _ = Signed::<RoundAnnouncement>::decode(data);
    let _ = Signed::<DeviceStatus>::decode(data);
});
