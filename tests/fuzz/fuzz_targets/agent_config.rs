#![no_main]

#[path = "../harness/agent.rs"]
mod harness;

libfuzzer_sys::fuzz_target!(|data: &[u8]| harness::agent_config(data));
