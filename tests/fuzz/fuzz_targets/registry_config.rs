#![no_main]

#[path = "../harness/registry.rs"]
mod harness;

libfuzzer_sys::fuzz_target!(|data: &[u8]| harness::registry_config(data));
