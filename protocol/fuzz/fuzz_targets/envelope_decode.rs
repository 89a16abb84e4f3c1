#![no_main]

//! Every signed envelope kind, the hand-written canonical headers, and streaming payload checks.

#[path = "../harness.rs"]
mod harness;

libfuzzer_sys::fuzz_target!(|data: &[u8]| harness::envelope_decode(data));
