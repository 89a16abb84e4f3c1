//! `fedfleet`: the umbrella CLI. The fleet demo lands with the end-to-end issue.
use clap::Parser;

#[derive(Parser)]
#[command(name = "fedfleet", version, about = "fedfleet umbrella CLI")]
enum Cli {
    /// Run the one-command fleet demo (coming: see the end-to-end issue).
    Demo,
}

fn main() -> anyhow::Result<()> {
    match Cli::parse() {
        Cli::Demo => anyhow::bail!("the fleet demo is not built yet; see README.md"),
    }
}
