#![no_main]

//! The JSON a downloader reads from the registry (artifact manifest, chunk list) and the string
//! forms of ids, digests and dtypes.

use fedfleet_protocol::artifact::Manifest;
use fedfleet_protocol::tuf::TargetInfo;
use fedfleet_protocol::{DType, DeviceId, Digest, FleetId};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(manifest) = serde_json::from_slice::<Manifest>(data) {
        for i in 0..=manifest.chunks.len() {
            let _ = manifest.chunk_offset(i);
        }
        let _ = TargetInfo::from_manifest(&manifest);
        let _ = serde_json::to_vec(&manifest);
    }
    let _ = serde_json::from_slice::<Digest>(data);
    let _ = serde_json::from_slice::<DeviceId>(data);
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = text.parse::<Digest>();
        let _ = text.parse::<DeviceId>();
        let _ = text.parse::<FleetId>();
        let _ = text.parse::<DType>();
    }
});
