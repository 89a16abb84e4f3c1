//! The fuzz harness of the registry config file (TOML). Shared by the cargo-fuzz target
//! (`fuzz_targets/registry_config.rs`, `#[path]`-included) and the corpus replay in every `cargo test`
//! (`../tests/fuzz_config.rs`, in the `fedfleet-tests` crate), so the two cannot drift apart. A config
//! parser returns an error, never panics, on any text; what parses is used the way the service
//! uses it.

#![allow(dead_code)]

use std::path::Path;

/// Where the harness pretends the file was read from (relative paths resolve against it).
const AT: &str = "/etc/fedfleet/service.toml";

/// `fedfleet_registry::config::Config::parse` (what `Config::load` runs on the file's text), then
/// the paths and lifetimes the registry derives from it.
pub fn registry_config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(c) = fedfleet_registry::config::Config::parse(Path::new(AT), text) {
        assert!(c.data_dir.is_absolute() && c.pki_dir.is_absolute(), "directories are resolved");
        let _ = (c.store_dir(), c.spool_dir(), c.lifetimes());
    }
}
