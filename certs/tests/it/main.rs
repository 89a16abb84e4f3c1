//! Integration tests: fleet mTLS over quinn on loopback, and the CLI binary.

mod cli;
mod mtls;
