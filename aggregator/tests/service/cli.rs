//! The binary's errors are one line with a non-zero exit.

use std::process::Command;

#[test]
fn missing_config_is_a_one_line_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_fedfleet-aggregator"))
        .args(["serve", "--config", "/nonexistent/aggregator.toml"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("fedfleet-aggregator: cannot read /nonexistent/aggregator.toml"), "{err}");
}
