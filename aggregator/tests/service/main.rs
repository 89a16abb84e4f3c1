//! The aggregator's one integration-test binary (one link): ingest over loopback QUIC
//! (`ingest`), and crash/restart of a child process (`crash`). The sans-IO core's tests live in
//! `fedfleet-rounds`.

mod admission;
mod cli;
mod compute;
mod crash;
mod ingest;
mod mqtt;
mod privacy;
mod secagg;
mod support;
mod tensor;
