//! Integration tests of fedfleet-agent: one binary.
mod lifecycle;
mod shell;
mod support;
