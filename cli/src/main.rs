//! `fedfleet-init-local DIR`: a ready local deployment, without the demo's test kit linked in.
use std::process::ExitCode;

use clap::Parser;
use fedfleet_cli::{InitLocalArgs, init_local_main};

#[derive(Parser)]
#[command(name = "fedfleet-init-local", version, about = "Write a ready local fedfleet deployment (PKI, keys, configs) into DIR")]
struct Cli {
    #[command(flatten)]
    args: InitLocalArgs,
}

fn main() -> ExitCode {
    init_local_main("fedfleet-init-local", Cli::parse().args)
}
