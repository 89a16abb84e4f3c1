//! CI smoke run of the config file fuzz corpus: every committed input of every target in
//! `fuzz/corpus/` goes through the same parser calls as its cargo-fuzz target
//! (`fuzz/fuzz_targets/`, harnesses in `fuzz/harness/`), on stable Rust and without
//! libFuzzer. See `tests/fuzz/README.md`.

use std::path::{Path, PathBuf};

#[path = "../fuzz/harness/agent.rs"]
mod agent;
#[path = "../fuzz/harness/aggregator.rs"]
mod aggregator;
#[path = "../fuzz/harness/registry.rs"]
mod registry;

const CORPUS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz/corpus");

/// Every fuzz target and the harness that mirrors it.
const TARGETS: &[(&str, fn(&[u8]))] = &[
    ("agent_config", agent::agent_config),
    ("aggregator_config", aggregator::aggregator_config),
    ("registry_config", registry::registry_config),
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

#[test]
fn every_corpus_input_parses_or_fails_without_panicking() {
    let mut failed = Vec::new();
    let mut total = 0;
    for (target, harness) in TARGETS {
        let files = inputs(target);
        assert!(!files.is_empty(), "fuzz/corpus/{target} is empty");
        for (path, bytes) in files {
            total += 1;
            if std::panic::catch_unwind(|| harness(&bytes)).is_err() {
                failed.push(format!("{target}: {} ({:?})", path.display(), String::from_utf8_lossy(&bytes)));
            }
        }
    }
    assert!(failed.is_empty(), "{} of {total} corpus inputs panicked:\n{}", failed.len(), failed.join("\n"));
}

/// The seeds are real configs (the examples, the files `fedfleet init-local` writes, the doc
/// comments' examples): each must parse, or the fuzzers started from broken inputs.
#[test]
fn the_seed_configs_parse() {
    use std::path::Path as P;
    for (target, ok) in [
        ("registry_config", &(|t: &str| fedfleet_registry::config::Config::parse(P::new("/etc/r.toml"), t).map(drop).map_err(|e| e.to_string())) as &dyn Fn(&str) -> Result<(), String>),
        ("agent_config", &|t: &str| fedfleet_agent::config::AgentConfig::parse(t).map(drop)),
        ("aggregator_config", &|t: &str| fedfleet_aggregator::config::Config::parse_all(P::new("/etc/a.toml"), t).map(drop).map_err(|e| e.to_string())),
    ] {
        for (path, bytes) in inputs(target) {
            if path.file_name().unwrap().to_string_lossy().starts_with("seed-") {
                let text = String::from_utf8(bytes).unwrap();
                ok(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            }
        }
    }
}
