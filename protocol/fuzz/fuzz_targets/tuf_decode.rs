#![no_main]

//! TUF metadata as it arrives from a mirror: the signed JSON of each role, its body, a pinned
//! root, and the verifier state an agent persists.

use fedfleet_protocol::tuf::{Root, SignedMetadata, Targets, Timestamp, Verifier};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(root) = serde_json::from_slice::<SignedMetadata<Root>>(data) {
        let _ = root.message();
        if let Ok(body) = root.body_unverified() {
            let _ = body.validate();
        }
        // A pinned root: valid, and signed by its own threshold.
        let _ = Verifier::new(root);
    }
    if let Ok(targets) = serde_json::from_slice::<SignedMetadata<Targets>>(data)
        && targets.body_unverified().is_ok()
    {
        let _ = Timestamp::for_targets(1, 2, &targets);
    }
    if let Ok(timestamp) = serde_json::from_slice::<SignedMetadata<Timestamp>>(data) {
        let _ = timestamp.body_unverified();
    }
    // Bodies on their own (what `signed` holds).
    if let Ok(root) = serde_json::from_slice::<Root>(data) {
        let _ = root.validate();
    }
    let _ = serde_json::from_slice::<Targets>(data);
    let _ = serde_json::from_slice::<Timestamp>(data);
    // Persisted verifier state (the agent's state file).
    if let Ok(verifier) = serde_json::from_slice::<Verifier>(data) {
        let _ = verifier.target("m", fedfleet_protocol::ModelVersion(1), 0);
        let _ = serde_json::to_vec(&verifier);
    }
});
