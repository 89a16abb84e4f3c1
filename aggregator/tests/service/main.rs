//! The aggregator's one integration-test binary (one link): the sans-IO core (`engine`,
//! `strategies`), ingest over loopback QUIC (`ingest`), and crash/restart of a child process
//! (`crash`).

mod cli;
mod compute;
mod crash;
mod engine;
mod ingest;
mod mqtt;
mod strategies;
mod support;
