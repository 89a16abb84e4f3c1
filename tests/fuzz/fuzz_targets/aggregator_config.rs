#![no_main]

#[path = "../harness/aggregator.rs"]
mod harness;

libfuzzer_sys::fuzz_target!(|data: &[u8]| harness::aggregator_config(data));
