//! fedfleet's operator tools that link no test kit (the umbrella `fedfleet` binary links it for
//! its demo). [`local`]: a ready local deployment on loopback, run by `fedfleet-init-local DIR`
//! and by `fedfleet init-local DIR` with the same arguments ([`InitLocalArgs`]).

pub mod local;

use std::path::PathBuf;
use std::process::ExitCode;

use local::{LocalOptions, init_local};

/// Write a ready local deployment into DIR: a fleet PKI, the registry's signing keys, the
/// aggregator's receipt key and initial model, N enrolled agents, and configs that agree
/// (relative paths, distinct loopback ports, publishing wired). Then, from DIR:
/// `fedfleet-registry -c registry.toml serve`, `fedfleet-aggregator serve -c aggregator.toml`,
/// `fedfleet-agent run -c agents/agent-1.toml` (README: Quick tour).
#[derive(clap::Args, Debug)]
pub struct InitLocalArgs {
    /// The directory to create (must be absent or empty).
    pub dir: PathBuf,
    /// Number of agents (agent-1 ... agent-N).
    #[arg(long, default_value_t = LocalOptions::default().agents)]
    pub agents: usize,
    /// Fleet name (in the CA and every agent's config).
    #[arg(long, default_value_t = LocalOptions::default().fleet)]
    pub fleet: String,
    /// Rounds of the configured campaign (the last global model is version rounds + 1).
    #[arg(long, default_value_t = LocalOptions::default().rounds)]
    pub rounds: u32,
    /// The aggregator's QUIC port; the registry takes the next one, the two metrics endpoints
    /// the two after, the registry's and the aggregator's operator consoles the two after those.
    #[arg(long, default_value_t = LocalOptions::default().base_port)]
    pub base_port: u16,
}

/// Runs `init-local` as the CLIs do: a summary on stdout, `{program}: error` and exit code 2.
pub fn init_local_main(program: &str, a: InitLocalArgs) -> ExitCode {
    let o = LocalOptions { agents: a.agents, fleet: a.fleet, rounds: a.rounds, base_port: a.base_port, ..Default::default() };
    match init_local(&a.dir, &o) {
        Ok(layout) => {
            let d = a.dir.display();
            println!("wrote a local fleet {:?} with {} agents into {d}:", o.fleet, o.agents);
            println!("  pki/                 CA, registry/aggregator/operator identities, device identities");
            println!(
                "  registry.toml        registry on 127.0.0.1:{} (metrics :{}, console http://127.0.0.1:{}/)",
                o.base_port + 1,
                o.base_port + 3,
                o.base_port + 4
            );
            println!(
                "  aggregator.toml      aggregator on 127.0.0.1:{} (metrics :{}, console http://127.0.0.1:{}/), publishing into the registry",
                o.base_port,
                o.base_port + 2,
                o.base_port + 5
            );
            println!(
                "  agents/*.toml        {} (enrolled, pinned to the registry's root)",
                layout.agent_configs.join(", ").replace("agents/", "").replace(".toml", "")
            );
            println!(
                "  rows.csv             {} held-out digits for `fedfleet-agent infer` (labels {:?})",
                layout.labels.len(),
                layout.labels
            );
            println!("next, from {d}: start fedfleet-registry, fedfleet-aggregator and the agents (README: Quick tour)");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{program}: {e:#}");
            ExitCode::from(2)
        }
    }
}
