//! Tidy checks on the dependency boundaries ARCHITECTURE.md promises (issue 26, "Nothing checks
//! the boundaries"), in the style of rust-analyzer's tidy tests: each check reads the real
//! dependency graph through cargo and fails with what to do.
//!
//! * [`core_dependencies_are_allow_listed`]: each sans-IO core's direct normal dependencies are
//!   exactly the ones on its allow-list ([`CORES`]); read from `cargo metadata`.
//! * [`cores_reach_no_runtime_or_io`]: no core reaches tokio, quinn, sled, burn, rustls, rumqttc,
//!   axum or hyper, however indirectly ([`CORE_DENY`]); read from `cargo tree`.
//! * [`agent_stays_lean`]: the device binary reaches none of the server-side crates, the broker,
//!   the HTTP server stack, the S3 SDK, the GPU backend or the metrics exporter ([`AGENT_DENY`]); read from
//!   `cargo tree`, with the chain of packages that reaches each one.
//!
//! Why `cargo tree` for reachability and not the `resolve` section of `cargo metadata`: the
//! metadata resolve is one graph for the whole workspace with features unified across every
//! member. The aggregator enables `fedfleet-control/broker`, so in that graph the agent's edge to
//! control carries rumqttd, axum, hyper and prometheus-client — a false failure. `cargo tree -p X`
//! resolves features for the selected package alone (resolver 2 and later unify features only
//! across the packages being built, and with `-e normal` dev-dependencies take no part in feature
//! resolution either, so control's own dev-dependency on `control[broker]` does not leak in): it
//! is the graph `cargo build -p X` compiles. Checked when this was written: the metadata resolve
//! has `fedfleet-agent -> fedfleet-control -> rumqttd`, `cargo tree -p fedfleet-agent -e normal`
//! has no rumqttd.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// The sans-IO cores and, for each, every normal (non-dev, non-build) dependency its
/// `Cargo.toml` may declare, optional or not, for any target. Keep these in step with the crate
/// table in ARCHITECTURE.md.
const CORES: &[(&str, &[&str])] = &[
    (
        "fedfleet-protocol",
        &["blake3", "ed25519-dalek", "half", "hex", "postcard", "rand_core", "safetensors", "serde", "serde_json", "thiserror"],
    ),
    // Not a state machine, but held to the cores' rule: the registry links it to check every
    // publish, and must not pull in the engine through it.
    ("fedfleet-modelspec", &["fedfleet-protocol", "serde", "serde_json", "thiserror"]),
    ("fedfleet-rounds", &["blake3", "fedfleet-protocol", "postcard", "rand_chacha", "serde", "serde_json", "thiserror"]),
    ("fedfleet-rollout", &["blake3", "fedfleet-protocol", "serde", "thiserror", "tracing"]),
    (
        "fedfleet-secagg",
        &[
            "blahaj",
            "blake3",
            "chacha20",
            "chacha20poly1305",
            "ed25519-dalek",
            "fedfleet-protocol",
            "postcard",
            "serde",
            "thiserror",
            "x25519-dalek",
            "zeroize",
        ],
    ),
    ("fedfleet-agent-core", &["fedfleet-protocol", "rand", "rand_chacha", "serde", "serde_json", "thiserror", "tracing"]),
];

/// What no core may reach anywhere in its normal dependency graph: async runtimes, network
/// stacks, storage, the ML framework. `burn` stands for every crate whose name starts with it.
const CORE_DENY: &[&str] = &["tokio", "quinn", "sled", "burn", "rustls", "rumqttc", "axum", "hyper"];

/// What the device binary must not reach: the services, the test harness, the embedded broker,
/// the HTTP server stack, the S3 SDK and its HTTP client, the GPU backend and the metrics
/// exporter. (hyper itself is allowed: the agent's artifact mirrors are an HTTP/1.1 client on it,
/// `edge-agent/src/mirror.rs`, with the `client` and `http1` features only.)
const AGENT_DENY: &[&str] = &[
    "fedfleet-aggregator",
    "fedfleet-registry",
    "fedfleet-testkit",
    "fedfleet-http",
    "rumqttd",
    "axum",
    "object_store",
    "reqwest",
    "burn-wgpu",
    "wgpu",
    "prometheus-client",
];

fn core_denied(name: &str) -> Option<&'static str> {
    CORE_DENY.iter().copied().find(|&deny| if deny == "burn" { name.starts_with("burn") } else { name == deny })
}

#[test]
fn core_dependencies_are_allow_listed() {
    let metadata = cargo_json(&["metadata", "--format-version", "1", "--no-deps"]);
    let root = workspace_root();
    let packages = metadata["packages"].as_array().expect("cargo metadata: no packages array");

    let mut failures = Vec::new();
    for &(core, allowed) in CORES {
        let Some(package) = packages.iter().find(|p| p["name"] == core) else {
            failures.push(format!(
                "{core} is not a workspace member any more: if it was renamed or removed, update \
                 CORES in xtask/tests/tidy.rs and ARCHITECTURE.md"
            ));
            continue;
        };
        let manifest = package["manifest_path"].as_str().map_or_else(
            || format!("{core}'s Cargo.toml"),
            |path| Path::new(path).strip_prefix(&root).unwrap_or(Path::new(path)).display().to_string(),
        );
        // `kind` is null for normal dependencies, "dev" or "build" otherwise; a target-specific
        // (`[target.'cfg(..)'.dependencies]`) or optional dependency is still a normal one.
        let declared: BTreeSet<&str> = package["dependencies"]
            .as_array()
            .expect("cargo metadata: no dependencies array")
            .iter()
            .filter(|dep| dep["kind"].is_null())
            .map(|dep| dep["name"].as_str().expect("cargo metadata: dependency without a name"))
            .collect();
        let allowed: BTreeSet<&str> = allowed.iter().copied().collect();

        let extra: Vec<&str> = declared.difference(&allowed).copied().collect();
        if !extra.is_empty() {
            failures.push(format!(
                "{core} ({manifest}) has normal dependencies that are not on its allow-list: {}.\n  \
                 A sans-IO core takes events and `now` and returns actions; sockets, disks, \
                 clocks and runtimes belong in its shell. If the dependency is intended, add it \
                 to {core}'s allow-list (CORES) in xtask/tests/tidy.rs and update {core}'s row \
                 in ARCHITECTURE.md; otherwise move it to the shell or to [dev-dependencies].",
                extra.join(", ")
            ));
        }
        let stale: Vec<&str> = allowed.difference(&declared).copied().collect();
        if !stale.is_empty() {
            failures.push(format!(
                "{core}'s allow-list in xtask/tests/tidy.rs names {}, which {manifest} no longer \
                 depends on: remove it from the list (and from {core}'s row in ARCHITECTURE.md) \
                 so the list stays the crate's real boundary.",
                stale.join(", ")
            ));
        }
    }
    report(failures);
}

#[test]
fn cores_reach_no_runtime_or_io() {
    let mut failures = Vec::new();
    // The core-only fleet harness is held to the cores' rule too (its allow-list is not pinned:
    // it may use any light crate the cores use).
    for core in CORES.iter().map(|&(core, _)| core).chain(["fedfleet-sim"]) {
        let tree = normal_tree(core);
        for (denied, path) in tree.first_paths(core_denied) {
            failures.push(format!(
                "{core} reaches {denied}, which no sans-IO core may depend on, even \
                 transitively:\n    {}\n  Drop the dependency that pulls it in (or turn off the \
                 feature that does); the I/O belongs in the core's shell. This deny-list \
                 (CORE_DENY in xtask/tests/tidy.rs) is not meant to grow exceptions: a crate that \
                 needs {denied} is not a core, so change ARCHITECTURE.md first.",
                path.join(" -> ")
            ));
        }
    }
    report(failures);
}

#[test]
fn agent_stays_lean() {
    let tree = normal_tree("fedfleet-agent");
    let failures = tree
        .first_paths(|name| AGENT_DENY.iter().copied().find(|&deny| deny == name))
        .into_iter()
        .map(|(denied, path)| {
            format!(
                "fedfleet-agent reaches {denied}, which the device binary must not link:\n    \
                 {}\n  Keep it out of the agent's normal graph: put it behind a feature the agent \
                 does not enable (as control's `broker` feature keeps rumqttd out), or make it a \
                 [dev-dependencies] entry. If devices really need it, remove it from AGENT_DENY in \
                 xtask/tests/tidy.rs and update ARCHITECTURE.md.",
                path.join(" -> ")
            )
        })
        .collect();
    report(failures);
}

/// `cargo tree`'s normal-dependency graph of one package, as (depth, package name) in the
/// printed (depth-first) order.
struct Tree {
    lines: Vec<(usize, String)>,
}

/// The normal dependency graph `cargo build -p package` compiles, for every target: devices are
/// cross-compiled, so a forbidden crate behind a `cfg(target_..)` counts as well (cargo tree
/// shows the host's platform alone unless told `--target all`).
fn normal_tree(package: &str) -> Tree {
    let args = ["tree", "-p", package, "-e", "normal", "--target", "all", "--prefix", "depth", "-f", "{p}"];
    let stdout = cargo(&args);
    let lines: Vec<(usize, String)> = stdout
        .lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| {
            // "3serde v1.0.228", "1fedfleet-protocol v0.1.0 (/path)", "4libc v0.2.180 (*)".
            let digits = line.len() - line.trim_start_matches(|c: char| c.is_ascii_digit()).len();
            let depth = line[..digits].parse().unwrap_or_else(|_| panic!("cargo tree: no depth in {line:?}"));
            let name = line[digits..].split_whitespace().next().unwrap_or_default().to_owned();
            (depth, name)
        })
        .collect();
    assert!(
        lines.first().is_some_and(|(depth, name)| *depth == 0 && name == package),
        "`cargo {}` did not print {package}'s tree:\n{stdout}",
        args.join(" ")
    );
    Tree { lines }
}

impl Tree {
    /// For each deny-list entry `matches` returns for some package in the tree, the first chain
    /// of packages from the root to such a package.
    fn first_paths(&self, matches: impl Fn(&str) -> Option<&'static str>) -> BTreeMap<&'static str, Vec<String>> {
        let mut found = BTreeMap::new();
        let mut stack: Vec<&str> = Vec::new();
        for (depth, name) in &self.lines {
            stack.truncate(*depth);
            stack.push(name);
            if let Some(denied) = matches(name) {
                found.entry(denied).or_insert_with(|| stack.iter().map(|s| s.to_string()).collect());
            }
        }
        found
    }
}

fn report(failures: Vec<String>) {
    assert!(failures.is_empty(), "\n\n{}\n", failures.join("\n\n"));
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask/ has a parent").to_path_buf()
}

fn cargo(args: &[&str]) -> String {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let output = Command::new(&cargo)
        .args(args)
        .current_dir(workspace_root())
        .output()
        .unwrap_or_else(|err| panic!("running {} {}: {err}", cargo.to_string_lossy(), args.join(" ")));
    assert!(output.status.success(), "`cargo {}` failed ({}):\n{}", args.join(" "), output.status, String::from_utf8_lossy(&output.stderr));
    String::from_utf8(output.stdout).expect("cargo printed UTF-8")
}

fn cargo_json(args: &[&str]) -> Value {
    serde_json::from_str(&cargo(args)).expect("cargo metadata printed JSON")
}

/// The operator tools (`fedfleet-init-local`) are shipped to operators: no test kit in them.
#[test]
fn operator_tools_link_no_test_kit() {
    let tree = normal_tree("fedfleet-cli");
    let failures = tree
        .first_paths(|name| (name == "fedfleet-testkit").then_some("fedfleet-testkit"))
        .into_iter()
        .map(|(denied, path)| {
            format!(
                "fedfleet-cli reaches {denied}:\n    {}\n  The test kit is for tests, examples and the \
                 demo; an operator tool builds what it needs from the service crates' libraries.",
                path.join(" -> ")
            )
        })
        .collect();
    report(failures);
}
