//! Integration tests of fedfleet-agent: one binary.
mod disk;
mod lifecycle;
mod mqtt;
mod shell;
mod support;
