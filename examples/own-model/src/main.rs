//! `own-model-agent`: the stock fedfleet agent around a team's own burn model.
//!
//! ```text
//! own-model-agent spec                         # the [model] spec for aggregator.toml (JSON)
//! own-model-agent init-weights --out w.safetensors   # then: fedfleet-aggregator init-model --pretrained w.safetensors
//! own-model-agent run --config agent.toml      # the agent daemon, training with GatedTrainer
//! ```

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use fedfleet_agent::config::ConfigArg;
use fedfleet_example_own_model::{GatedTrainer, init_weights, spec};

/// The fedfleet edge agent running a team's own burn model (a gated MLP over 8x8 digits).
#[derive(Parser, Debug)]
#[command(name = "own-model-agent", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the agent daemon with the team's trainer.
    Run(ConfigArg),
    /// Print the model's spec (JSON) for the aggregator's `[model] spec`.
    Spec,
    /// Write fresh weights as a PyTorch-named safetensors `state_dict`.
    InitWeights {
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 7)]
        seed: u64,
    },
}

fn main() -> ExitCode {
    fedfleet_net::logging::init("info");
    let result = match Cli::parse().command {
        Command::Spec => {
            println!("{}", spec().to_json());
            Ok(())
        }
        Command::InitWeights { out, seed } => fedfleet_learning::interop::save_state_dict(&spec(), &init_weights(seed), &out)
            .map_err(|e| anyhow::anyhow!("{}: {e}", out.display())),
        Command::Run(ConfigArg { config }) => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(anyhow::Error::from)
            .and_then(|rt| rt.block_on(fedfleet_agent::daemon::AgentBuilder::new(config).trainer(Arc::new(GatedTrainer)).run())),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("own-model-agent: {e:#}");
            ExitCode::from(2)
        }
    }
}
