//! The fuzz harness of the aggregator config file (TOML). Shared by the cargo-fuzz target
//! (`fuzz_targets/aggregator_config.rs`, `#[path]`-included) and the corpus replay in every `cargo test`
//! (`../tests/fuzz_config.rs`, in the `fedfleet-tests` crate), so the two cannot drift apart. A config
//! parser returns an error, never panics, on any text; what parses is used the way the service
//! uses it.

#![allow(dead_code)]

use std::path::Path;

/// Where the harness pretends the file was read from (relative paths resolve against it).
const AT: &str = "/etc/fedfleet/service.toml";

/// `fedfleet_aggregator::config::Config::parse_all` (what `Config::load_all` runs on the file's
/// text, `[mqtt]` included), then what the aggregator derives from it; a config that parsed
/// validates again.
pub fn aggregator_config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok((c, _mqtt)) = fedfleet_aggregator::config::Config::parse_all(Path::new(AT), text) {
        c.validate().expect("a loaded config validates again");
        let _ = (c.campaign.client(), c.campaign.strategy_config(), c.campaign.dtype());
        let _ = (c.spec_json(), c.publish_dir());
    }
}
