//! Tidy checks on the shape of the shells (issue 26): one way to stop, one accept loop, one
//! reading of the wall clock. Each reads the library sources (`*/src/**/*.rs`, not tests,
//! examples or benches, which may hold baselines of their own) and fails naming every place
//! that has a second copy, with what to use instead.

use std::path::{Path, PathBuf};

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask/ has a parent").to_path_buf()
}

/// Every `.rs` file under a workspace crate's `src/`, as (path relative to the root, text).
fn library_sources() -> Vec<(String, String)> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else { return };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let root = workspace_root();
    let mut files = Vec::new();
    for krate in std::fs::read_dir(&root).expect("workspace root").flatten() {
        let src = krate.path().join("src");
        if krate.path().join("Cargo.toml").exists() && src.is_dir() {
            walk(&src, &mut files);
        }
    }
    // examples/own-model is a crate of its own one level down.
    walk(&root.join("examples/own-model/src"), &mut files);
    files.sort();
    files.dedup();
    files
        .into_iter()
        .map(|p| {
            let text = std::fs::read_to_string(&p).expect("readable source");
            (p.strip_prefix(&root).unwrap().to_string_lossy().into_owned(), text)
        })
        .filter(|(p, _)| !p.contains("/tests/") && !p.starts_with("xtask/"))
        .collect()
}

/// Files (other than `allowed`) whose text contains any of `needles`.
fn offenders(needles: &[&str], allowed: &[&str]) -> Vec<String> {
    library_sources()
        .into_iter()
        .filter(|(path, _)| !allowed.contains(&path.as_str()))
        .filter(|(_, text)| needles.iter().any(|n| text.contains(n)))
        .map(|(path, _)| path)
        .collect()
}

#[test]
fn one_signal_handler() {
    let found = offenders(&["tokio::signal", "fn shutdown_signal"], &["net/src/shutdown.rs"]);
    assert!(
        found.is_empty(),
        "these files handle SIGTERM/Ctrl-C themselves: {found:?}.\n\
         Use fedfleet_net::Shutdown::on_signal() (the one handler) and pass the Shutdown on."
    );
}

#[test]
fn one_accept_loop() {
    let found = offenders(&["listener.accept()", "endpoint.accept()", "::accept(&listener"], &["net/src/serve.rs"]);
    assert!(
        found.is_empty(),
        "these files run an accept loop of their own: {found:?}.\n\
         Use fedfleet_net::serve::accept_until (connection limit, backoff on errors, shutdown);\n\
         a new kind of listener implements fedfleet_net::serve::Listener."
    );
}

#[test]
fn one_wall_clock() {
    let found = offenders(&["SystemTime::now", "fn now_ms()", "fn unix_ms()"], &["protocol/src/time.rs"]);
    assert!(
        found.is_empty(),
        "these files read the wall clock themselves: {found:?}.\n\
         A shell takes a fedfleet_protocol::SharedClock when it is opened (SystemClock in main, a\n\
         fake clock in tests) and a core takes `now` as an argument."
    );
}

/// An error that prints its cause in its message must not also return it as `source()`: a
/// report of the chain (`{:#}`, as every CLI prints) would say it twice. thiserror makes a
/// field a source when it is `#[from]`, `#[source]`, or named `source`.
#[test]
fn no_error_prints_its_cause_twice() {
    let mut found = Vec::new();
    for (path, text) in library_sources() {
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let Some(at) = line.find("#[error(\"") else { continue };
            let message = &line[at..];
            let next = lines.get(i + 1).copied().unwrap_or("");
            let prints_field_0 = message.contains("{0}") && (next.contains("#[from]") || next.contains("#[source]"));
            if message.contains("{source}") || prints_field_0 {
                found.push(format!("{path}:{}: {}", i + 1, line.trim()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "these errors print their cause and also return it as their source:\n  {}\n\
         Keep the cause in the message and name the field `cause` (or write the From impl by\n\
         hand instead of #[from]).",
        found.join("\n  ")
    );
}
