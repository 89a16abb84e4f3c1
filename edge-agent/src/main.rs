//! `fedfleet-agent`: the edge agent daemon and its commands.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use fedfleet_agent::config::ConfigArg;

/// The fedfleet edge agent: joins training rounds, installs verified models, serves inference.
#[derive(Parser, Debug)]
#[command(name = "fedfleet-agent", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the daemon.
    Run(ConfigArg),
    /// Print the last status the daemon reported.
    Status(ConfigArg),
    /// Install identity files made by `fedfleet-certs enroll-device` and the pinned registry root.
    Enroll {
        #[arg(long)]
        cert: PathBuf,
        #[arg(long)]
        key: PathBuf,
        #[arg(long)]
        ca: PathBuf,
        /// The registry's signed root metadata (root.json).
        #[arg(long)]
        root: PathBuf,
        #[arg(long, default_value = "/var/lib/fedfleet-agent")]
        state_dir: PathBuf,
        #[arg(long)]
        force: bool,
    },
    /// Predict CSV rows with the active model: one line per row, `label,confidence` (classification),
    /// the predicted values (regression) or the anomaly score (autoencoder).
    Infer {
        #[arg(long)]
        input: PathBuf,
        #[command(flatten)]
        config: ConfigArg,
    },
}

fn main() -> ExitCode {
    fedfleet_net::logging::init("info");
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("fedfleet-agent: cannot start runtime: {e}");
            return ExitCode::from(2);
        }
    };
    let result = rt.block_on(async {
        match cli.command {
            Command::Run(c) => fedfleet_agent::daemon::run(&c.config).await.map(|_| String::new()),
            Command::Status(c) => fedfleet_agent::daemon::status(&c.config),
            Command::Enroll { cert, key, ca, root, state_dir, force } => {
                fedfleet_agent::daemon::enroll(&cert, &key, &ca, &root, &state_dir, force)
            }
            Command::Infer { input, config } => fedfleet_agent::daemon::infer(&config.config, &input).await,
        }
    });
    match result {
        Ok(out) => {
            print!("{out}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("fedfleet-agent: {e:#}");
            ExitCode::from(2)
        }
    }
}
