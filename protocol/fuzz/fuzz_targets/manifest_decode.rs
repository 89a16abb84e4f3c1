#![no_main]

//! The JSON a downloader reads from the registry (artifact manifest, chunk list) and the string
//! forms of ids, digests and dtypes.

#[path = "../harness.rs"]
mod harness;

libfuzzer_sys::fuzz_target!(|data: &[u8]| harness::manifest_decode(data));
