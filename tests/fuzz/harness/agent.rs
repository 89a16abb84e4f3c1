//! The fuzz harness of the agent config file (TOML). Shared by the cargo-fuzz target
//! (`fuzz_targets/agent_config.rs`, `#[path]`-included) and the corpus replay in every `cargo test`
//! (`../tests/fuzz_config.rs`, in the `fedfleet-tests` crate), so the two cannot drift apart. A config
//! parser returns an error, never panics, on any text; what parses is used the way the service
//! uses it.

#![allow(dead_code)]

/// `fedfleet_agent::config::AgentConfig::parse` (what `AgentConfig::load` runs on the file's
/// text), then what the agent derives from it.
pub fn agent_config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(c) = fedfleet_agent::config::AgentConfig::parse(text) {
        let _ = (c.identity_paths(), c.socket_path(), c.status_path(), c.store_dir());
        let _ = (c.data.normalization(), c.data.is_configured());
    }
}
