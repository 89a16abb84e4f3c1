#![no_main]

//! The TUF client state machine. The harness holds the fleet's keys and signs whatever body text
//! the fuzzer writes, so inputs get past the signature checks into the version, expiry, rotation,
//! timestamp/targets binding and artifact rules.
//!
//! Input: a sequence of operations, each
//! `op u8 | signers u8 | version u8 | len u16 BE | len bytes of body text (lossy UTF-8)`.
//! `op & 7` picks the update (root, timestamp, targets, targets with a matching timestamp,
//! artifact); `op >> 3` is the clock, in steps of 1000 ms. Each set bit of `signers` signs with
//! one of the harness keys (0: root, 1: targets, 2: timestamp, 3..: spare keys for rotation).

#[path = "../harness.rs"]
mod harness;

libfuzzer_sys::fuzz_target!(|data: &[u8]| harness::tuf_verifier(data));
