#![no_main]

#[path = "../harness.rs"]
mod harness;

libfuzzer_sys::fuzz_target!(init: harness::write_seeds_if_asked(), |data: &[u8]| harness::inbound_publish(data));
