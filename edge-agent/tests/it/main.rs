//! Integration tests of fedfleet-agent: one binary.
mod lifecycle;
mod mqtt;
mod shell;
mod support;
