//! Registry service integration tests (one binary): QUIC downloads with resume, corruption and
//! deltas, signed assignments driven by rollouts, mTLS refusals, concurrency, and the CLI.

mod support;

mod auth;
mod cli;
mod download;
mod rollout;
