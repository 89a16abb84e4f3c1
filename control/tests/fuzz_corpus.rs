//! CI smoke run of the MQTT payload fuzz corpus: every committed input of every fuzz target in
//! `fuzz/corpus/` goes through the same calls as its target (`fuzz/fuzz_targets/`, harnesses in
//! `fuzz/harness.rs`), on stable Rust and without libFuzzer. See `fuzz/README.md`.
//!
//! The hand-made starting inputs are written by the ignored test [`write_seed_inputs`]:
//! `cargo test -p fedfleet-control --test fuzz_corpus -- --ignored write_seed_inputs`.

use std::path::Path;

#[path = "../fuzz/harness.rs"]
mod harness;
use harness::*;

#[path = "../../protocol/fuzz/replay.rs"]
mod replay;

const CORPUS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz/corpus");

/// Every fuzz target and the harness that mirrors it.
const TARGETS: &[(&str, fn(&[u8]))] = &[
    ("inbound_publish", inbound_publish),
    ("rejection_decode", rejection_decode),
    ("topic_parse", topic_parse),
    ("upload_frames", upload_frames),
];

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn every_corpus_input_runs_without_panicking() {
    replay::replay(CORPUS, TARGETS, hex);
}

#[test]
fn seeds_pass_their_harnesses() {
    for (target, _name, bytes) in seeds() {
        let harness = TARGETS.iter().find(|(t, _)| *t == target).expect("a target").1;
        harness(&bytes);
    }
}

/// Writes the seed inputs into `fuzz/corpus/<target>/seed-<name>` (before fuzzing a new target).
#[test]
#[ignore = "writes into the source tree; run by hand"]
fn write_seed_inputs() {
    write_seeds(Path::new(CORPUS));
}
