//! CI smoke run of the config file fuzz corpus: every committed input of every target in
//! `fuzz/corpus/` goes through the same parser calls as its cargo-fuzz target
//! (`fuzz/fuzz_targets/`, harnesses in `fuzz/harness/`), on stable Rust and without
//! libFuzzer. See `tests/fuzz/README.md`.

#[path = "../fuzz/harness/agent.rs"]
mod agent;
#[path = "../fuzz/harness/aggregator.rs"]
mod aggregator;
#[path = "../fuzz/harness/registry.rs"]
mod registry;

#[path = "../../protocol/fuzz/replay.rs"]
mod replay;

const CORPUS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz/corpus");

/// Every fuzz target and the harness that mirrors it.
const TARGETS: &[(&str, fn(&[u8]))] = &[
    ("agent_config", agent::agent_config),
    ("aggregator_config", aggregator::aggregator_config),
    ("registry_config", registry::registry_config),
];

#[test]
fn every_corpus_input_parses_or_fails_without_panicking() {
    replay::replay(CORPUS, TARGETS, |b| format!("{:?}", String::from_utf8_lossy(b)));
}

/// The seeds are real configs (the examples, the files `fedfleet init-local` writes, the doc
/// comments' examples): each must parse, or the fuzzers started from broken inputs.
#[test]
fn the_seed_configs_parse() {
    use std::path::Path as P;
    for (target, ok) in [
        (
            "registry_config",
            &(|t: &str| fedfleet_registry::config::Config::parse(P::new("/etc/r.toml"), t).map(drop).map_err(|e| e.to_string()))
                as &dyn Fn(&str) -> Result<(), String>,
        ),
        ("agent_config", &|t: &str| fedfleet_agent::config::AgentConfig::parse(t).map(drop)),
        ("aggregator_config", &|t: &str| {
            fedfleet_aggregator::config::Config::parse_all(P::new("/etc/a.toml"), t).map(drop).map_err(|e| e.to_string())
        }),
    ] {
        for (path, bytes) in replay::inputs(CORPUS, target) {
            if path.file_name().unwrap().to_string_lossy().starts_with("seed-") {
                let text = String::from_utf8(bytes).unwrap();
                ok(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            }
        }
    }
}
