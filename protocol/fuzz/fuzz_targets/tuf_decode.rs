#![no_main]

//! TUF metadata as it arrives from a mirror: the signed JSON of each role, its body, a pinned
//! root, and the verifier state an agent persists.

#[path = "../harness.rs"]
mod harness;

libfuzzer_sys::fuzz_target!(|data: &[u8]| harness::tuf_decode(data));
