#![no_main]

use fedfleet_protocol::{BundleLimits, TensorBundle};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let limits = BundleLimits {
        max_bytes: 1 << 20,
        max_tensors: 256,
        max_params: 1 << 20,
    };
    if let Ok(bundle) = TensorBundle::decode(data, &limits) {
        let again =
            TensorBundle::decode(&bundle.encode(), &limits).expect("re-encoded bundle decodes");
        assert_eq!(again.layout(), bundle.layout());
        let _ = bundle.check_finite();
        let _ = bundle.dequantize();
    }
});
