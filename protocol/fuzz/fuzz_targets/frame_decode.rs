#![no_main]

use fedfleet_protocol::FrameDecoder;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The first byte picks the read size, so frames are split at varied places.
    let Some((&split, rest)) = data.split_first() else {
        return;
    };
    let mut decoder = FrameDecoder::new();
    for chunk in rest.chunks(usize::from(split).max(1)) {
        decoder.push(chunk);
        while let Ok(Some(_)) = decoder.poll() {}
    }
    let _ = decoder.finish();
});
