//! CI smoke run of the MQTT payload fuzz corpus: every committed input of every fuzz target in
//! `fuzz/corpus/` goes through the same calls as its target (`fuzz/fuzz_targets/`, harnesses in
//! `fuzz/harness.rs`), on stable Rust and without libFuzzer. See `fuzz/README.md`.
//!
//! The hand-made starting inputs are written by the ignored test [`write_seed_inputs`]:
//! `cargo test -p fedfleet-control --test fuzz_corpus -- --ignored write_seed_inputs`.

use std::path::{Path, PathBuf};

#[path = "../fuzz/harness.rs"]
mod harness;
use harness::*;

const CORPUS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz/corpus");

/// Every fuzz target and the harness that mirrors it.
const TARGETS: &[(&str, fn(&[u8]))] = &[
    ("inbound_publish", inbound_publish),
    ("rejection_decode", rejection_decode),
    ("topic_parse", topic_parse),
    ("upload_frames", upload_frames),
];

fn inputs(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = Path::new(CORPUS).join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("corpus {}: {e}", dir.display()))
        .map(|entry| entry.expect("corpus entry").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let bytes = std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (p, bytes)
        })
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn every_corpus_input_runs_without_panicking() {
    let mut failed = Vec::new();
    let mut total = 0;
    for (target, harness) in TARGETS {
        let files = inputs(target);
        assert!(!files.is_empty(), "fuzz/corpus/{target} is empty");
        for (path, bytes) in files {
            total += 1;
            if std::panic::catch_unwind(|| harness(&bytes)).is_err() {
                failed.push(format!("{target}: {} ({})", path.display(), hex(&bytes)));
            }
        }
    }
    assert!(
        failed.is_empty(),
        "{} of {total} corpus inputs panicked:\n{}",
        failed.len(),
        failed.join("\n")
    );
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
