//! fedfleet-xtask: checks on the repository itself, in the style of rust-analyzer's tidy tests.
//!
//! The checks are integration tests (`tests/tidy.rs`), so `cargo test -p fedfleet-xtask` runs
//! them and a plain `cargo test --workspace` does too. They read the dependency graph through
//! `cargo metadata` and `cargo tree`; this library is empty on purpose.
