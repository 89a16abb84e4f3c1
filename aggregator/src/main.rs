//! `fedfleet-aggregator`: the aggregator service and its operator commands.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result, anyhow, bail};
use clap::{Parser, Subcommand};
use fedfleet_aggregator::config::{Config, OperatorConfig};
use fedfleet_aggregator::lifecycle::AggregatorService;
use fedfleet_aggregator::wire::{CampaignOverrides, CampaignStatus};
use fedfleet_http::operator::{OperatorClient, Target, decode};

/// Federated-learning aggregator: ingests signed updates over QUIC (mTLS), aggregates them with
/// a configurable strategy, persists round state in sled and publishes each new global model.
#[derive(Parser)]
#[command(name = "fedfleet-aggregator", version)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the service (QUIC ingest, round driver, Prometheus metrics) until SIGTERM/Ctrl-C.
    Serve {
        /// The service configuration (see `aggregator.toml` in the crate for every key).
        #[arg(long, short, env = "FEDFLEET_AGGREGATOR_CONFIG")]
        config: PathBuf,
        /// Override `listen` (e.g. 127.0.0.1:0 in tests; the bound address is printed).
        #[arg(long)]
        listen: Option<std::net::SocketAddr>,
    },
    /// Run a regional relay (the config's `[relay]`): takes the updates of its region's devices
    /// with every check the root applies, folds them exactly and forwards one signed partial
    /// sum per round to its parent (whose `relays` must name this service's certificate).
    /// Devices point their `[aggregator]` at it and pin its `receipt.pub`.
    Relay {
        #[arg(long, short, env = "FEDFLEET_AGGREGATOR_CONFIG")]
        config: PathBuf,
        /// Override `listen`.
        #[arg(long)]
        listen: Option<std::net::SocketAddr>,
    },
    /// Start, inspect or stop a training campaign on a running service (over QUIC, with an
    /// operator service certificate: `fedfleet-certs issue-server --name operator`).
    Campaign {
        #[command(subcommand)]
        action: CampaignCmd,
    },
    /// Write the initial model (version 1 of the campaign) for `model.spec` of the config: a
    /// seeded initialisation, or a team's pre-trained weights (`--pretrained`).
    InitModel {
        #[arg(long, short)]
        config: PathBuf,
        /// Initialization seed (of the whole model, or of fresh LoRA adapters with --pretrained).
        #[arg(long, default_value_t = 7)]
        seed: u64,
        /// A PyTorch `state_dict` in safetensors (PyTorch names and layouts) with the weights of
        /// `model.spec`'s base model; every mismatch is listed. Under a LoRA spec, fresh adapters
        /// are added.
        #[arg(long)]
        pretrained: Option<PathBuf>,
        /// Output path (default: the config's `model.initial`).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Write `data_dir`'s current global model as a PyTorch `state_dict` in safetensors (what
    /// `init-model --pretrained` reads): the trained weights a new lineage starts from, such as
    /// a switch from full fine-tuning to LoRA. Run it with the config the data_dir was written
    /// under, with the service stopped (it holds the store's lock while it runs). A LoRA model
    /// is written with its adapters merged into the base weights.
    ExportModel {
        #[arg(long, short)]
        config: PathBuf,
        /// Where to write the state_dict.
        #[arg(long)]
        out: PathBuf,
    },
    /// Write the fleet's MQTT access rules for an external broker, from the PKI: devices publish
    /// only their own status and updates and hear the announcements and their own receipts;
    /// only the named services publish announcements. mosquitto: an `acl_file` (run it with
    /// `use_identity_as_username true` and `crlfile PKI/ca.crl`, which refuses revoked devices;
    /// the rules name the CRL's number, so a revocation reloads the broker under `--watch`, and a
    /// ca.crl behind revoked.json is an error); NATS: the `authorization` block of each node's config
    /// (MQTT listener with `verify_and_map: true`), one user per enrolled device, revoked devices
    /// left out. With `--watch`, keeps running: writes the file again whenever the PKI's rules
    /// change (a device enrolled or revoked) and then runs the broker's reload command, e.g.
    /// `broker-access --broker nats --out /etc/nats/fleet-authorization.conf --watch 10 --
    /// nats-server --signal reload=/run/nats/nats.pid`.
    BrokerAccess {
        /// The fleet's PKI directory (ca.crt, devices.json, revoked.json).
        #[arg(long, env = "FEDFLEET_PKI", default_value = "pki")]
        pki: PathBuf,
        #[arg(long, value_enum)]
        broker: BrokerKind,
        /// A service allowed every topic of the fleet (its certificate's name). Repeat.
        #[arg(long = "service", default_values = ["aggregator", "registry"])]
        services: Vec<String>,
        /// Where to write it (default: standard output).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Keep running, reading the PKI again every SECS seconds; needs `--out`.
        #[arg(long, value_name = "SECS", requires = "out", value_parser = clap::value_parser!(u64).range(1..))]
        watch: Option<u64>,
        /// The broker's reload command, after `--`: run after each write under `--watch` (and
        /// again at the next check while it fails).
        #[arg(last = true, requires = "watch", value_name = "RELOAD")]
        reload: Vec<String>,
    },
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum BrokerKind {
    Mosquitto,
    Nats,
}

impl From<BrokerKind> for fedfleet_control::access::BrokerKind {
    fn from(b: BrokerKind) -> Self {
        match b {
            BrokerKind::Mosquitto => Self::Mosquitto,
            BrokerKind::Nats => Self::Nats,
        }
    }
}

#[derive(clap::Args)]
struct Conn {
    /// The service configuration (for the address, the PKI directory and the server name).
    #[arg(long, short)]
    config: PathBuf,
    /// Operator certificate name in the PKI's servers/ directory.
    #[arg(long, default_value = "operator")]
    operator: String,
    /// The aggregator's console (its HTTP API) address (default: the config's `[console]
    /// listen`, with 0.0.0.0 read as 127.0.0.1). Over HTTPS the operator certificate is
    /// presented, or the bearer token in `FEDFLEET_API_TOKEN`.
    #[arg(long)]
    addr: Option<std::net::SocketAddr>,
    /// TLS server name to expect.
    #[arg(long, default_value = "localhost")]
    server_name: String,
    /// Print the status as JSON (one object per line) instead of text.
    #[arg(long)]
    json: bool,
}

/// `broker-access --watch`: the rules kept in step with the PKI until the process is stopped;
/// each change is said once on standard error.
fn watch_broker_access(mut watch: fedfleet_control::access::RulesWatch, secs: u64) -> anyhow::Result<()> {
    use fedfleet_control::access::Tick;
    let mut last = Tick::Unchanged;
    loop {
        let tick = watch.tick()?;
        if tick != last {
            match &tick {
                Tick::Unchanged => {}
                Tick::Written => eprintln!("broker access rules written again from the PKI (and the reload command run, if given)"),
                Tick::ReloadFailed(why) => eprintln!("broker access rules written, but the reload failed (tried again in {secs} s): {why}"),
                Tick::PkiUnreadable(why) => eprintln!("cannot read the PKI, rules left as they are (read again in {secs} s): {why}"),
            }
        }
        last = tick;
        std::thread::sleep(std::time::Duration::from_secs(secs));
    }
}

#[derive(Subcommand)]
enum CampaignCmd {
    /// Start a campaign; unset options take the config's `[campaign]` defaults.
    Start {
        #[command(flatten)]
        conn: Conn,
        #[arg(long)]
        rounds: Option<u32>,
        /// Updates that close a round.
        #[arg(long)]
        target: Option<u32>,
        /// Updates needed at the deadline.
        #[arg(long)]
        quorum: Option<u32>,
        #[arg(long)]
        deadline_secs: Option<u64>,
        /// Sampling seed (random if unset). Fixed, it also fixes a dp_fedavg campaign's noise: for reproducible runs and tests, not for privacy.
        #[arg(long)]
        seed: Option<u64>,
        /// Wait until the campaign ends, printing each completed round; the exit status is 0
        /// only if it completed.
        #[arg(long)]
        wait: bool,
    },
    /// Show the running campaign and the current global model.
    Status {
        #[command(flatten)]
        conn: Conn,
    },
    /// Stop the running campaign (its open round fails; published models stay).
    Stop {
        #[command(flatten)]
        conn: Conn,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // wgpu logs each graphics API it probes and does not find as ERROR; the device selection
    // reports what it found in one line instead.
    fedfleet_net::logging::init("info,wgpu_hal=off");
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("fedfleet-aggregator: {e}");
            return ExitCode::from(2);
        }
    };
    match rt.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fedfleet-aggregator: {e:#}");
            ExitCode::from(2)
        }
    }
}

async fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Serve { config, listen } => serve(config, listen, false).await,
        Cmd::Relay { config, listen } => serve(config, listen, true).await,
        Cmd::InitModel { config, seed, pretrained, out } => {
            let cfg = Config::load(&config)?;
            let out = out.unwrap_or(cfg.model.initial.clone());
            let (bundle, from) = match &pretrained {
                None if !cfg.model.spec.is_builtin() => {
                    bail!(
                        "model.spec declares a custom model (a team's own code): give its initial weights with --pretrained FILE.safetensors"
                    )
                }
                None => (
                    fedfleet_learning::model::init_bundle(&cfg.model.spec, seed).map_err(|e| anyhow!("model.spec: {e}"))?,
                    format!("seed {seed}"),
                ),
                Some(path) => {
                    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
                    let bundle = fedfleet_learning::interop::import_pretrained(&cfg.model.spec, &bytes, seed)
                        .map_err(|e| anyhow!("{} does not fit model.spec: {e}", path.display()))?;
                    (bundle, format!("pre-trained weights of {}", path.display()))
                }
            };
            if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            }
            fedfleet_aggregator::persist::write_atomic(&out, &bundle.encode()).with_context(|| format!("writing {}", out.display()))?;
            println!("wrote {} ({} parameters, {from})", out.display(), bundle.num_params());
            Ok(())
        }
        Cmd::ExportModel { config, out } => {
            let cfg = Config::load(&config)?;
            let (version, bytes) = export_global_model(&cfg)?;
            fedfleet_aggregator::persist::write_atomic(&out, &bytes).with_context(|| format!("writing {}", out.display()))?;
            println!("wrote {} (global model v{version} of {})", out.display(), cfg.data_dir.display());
            Ok(())
        }
        Cmd::BrokerAccess { pki, broker, services, out: Some(out), watch: Some(secs), reload } => {
            watch_broker_access(fedfleet_control::access::RulesWatch::new(pki, broker.into(), services, out, reload), secs)
        }
        Cmd::BrokerAccess { pki, broker, services, out, .. } => {
            let text = fedfleet_control::access::broker_rules(&pki, broker.into(), &services)?;
            match out {
                Some(path) => {
                    fedfleet_aggregator::persist::write_atomic(&path, text.as_bytes())
                        .with_context(|| format!("writing {}", path.display()))?;
                    eprintln!("wrote {}", path.display());
                }
                None => print!("{text}"),
            }
            Ok(())
        }
        Cmd::Campaign { action } => {
            let mut wait = false;
            let (conn, path, body) = match action {
                CampaignCmd::Start { conn, rounds, target, quorum, deadline_secs, seed, wait: w } => {
                    wait = w;
                    let overrides = CampaignOverrides { rounds, target_count: target, min_quorum: quorum, deadline_secs, seed };
                    (conn, "/api/v1/campaign/start", Some(serde_json::to_value(overrides)?))
                }
                CampaignCmd::Status { conn } => (conn, CAMPAIGN, None),
                CampaignCmd::Stop { conn } => (conn, "/api/v1/campaign/stop", Some(serde_json::Value::Null)),
            };
            let cfg = OperatorConfig::load(&conn.config)?;
            let api = operator_api(&conn, &cfg)?;
            let status: CampaignStatus = decode(path, api.get_or_post(path, body.as_ref()).await?)?;
            print_status(&status, &conn, &cfg);
            if wait {
                wait_for_campaign_end(&api, &conn, &cfg, status).await?;
            }
            Ok(())
        }
    }
}

/// The current global model of `cfg.data_dir` as a PyTorch state_dict of its base model (LoRA
/// adapters merged in), with its version.
fn export_global_model(cfg: &Config) -> Result<(u64, Vec<u8>)> {
    use fedfleet_learning::finetune::{base_spec, lora_adapters, merge_lora};
    let dir = &cfg.data_dir;
    // A missing store is an error, not an empty one: opening would create it.
    if !dir.join("db").exists() {
        bail!("{} holds no aggregator state (data_dir of {}?)", dir.display(), cfg.model.name);
    }
    let store = fedfleet_aggregator::persist::Store::open(dir)?;
    let global = store.global()?.ok_or_else(|| anyhow!("{} has no global model yet: nothing to export", dir.display()))?;
    let bytes = store.read_model(&global.digest)?;
    let bundle = fedfleet_protocol::TensorBundle::decode(&bytes, &fedfleet_protocol::BundleLimits::default())
        .map_err(|e| anyhow!("global model v{} ({}): {e}", global.version.0, global.digest))?;
    let spec = &cfg.model.spec;
    let (spec, bundle) = match lora_adapters(spec) {
        Some(_) => (base_spec(spec), merge_lora(spec, &bundle).map_err(|e| anyhow!("merging the LoRA adapters: {e}"))?),
        None => (spec.clone(), bundle),
    };
    let state_dict = fedfleet_learning::interop::export_state_dict(&spec, &bundle).map_err(|e| {
        anyhow!("global model v{} does not fit model.spec ({e}): export with the config the data_dir was written under", global.version.0)
    })?;
    Ok((global.version.0, state_dict))
}

async fn serve(config: PathBuf, listen: Option<std::net::SocketAddr>, relay: bool) -> Result<()> {
    let (cfg, mqtt) = Config::load_all(&config)?;
    match (&cfg.relay, relay) {
        (Some(_), false) => bail!("{} has a [relay] section: run it with `fedfleet-aggregator relay`", config.display()),
        (None, true) => bail!("{} has no [relay] section (parent, parent_receipt_key): a relay needs its parent", config.display()),
        (Some(r), true) => tracing::info!(parent = %r.parent, "relay: following the parent's rounds"),
        (None, false) => {}
    }
    let mut service = AggregatorService::open(cfg, mqtt, fedfleet_protocol::SystemClock::shared())?;
    if let Some(addr) = listen {
        service = service.listen_on(addr);
    }
    let bound = service.bind().await?;
    let addr = bound.local_addr()?;
    tracing::info!(%addr, "listening");
    // Tests and scripts read this line to find an ephemeral port.
    println!("listening on {addr}");
    if let Some(a) = bound.operator_addr() {
        tracing::info!(addr = %a, "operators' address");
        println!("operators on {a}");
    }
    if let Some(b) = bound.broker_addr() {
        println!("mqtt broker on {b}");
    }
    bound.run(fedfleet_net::Shutdown::on_signal()).await?;
    Ok(())
}

/// A client of the aggregator's console API: `--addr`, else the config's `[console] listen`.
fn operator_api(conn: &Conn, cfg: &OperatorConfig) -> Result<OperatorClient> {
    OperatorClient::new(&Target {
        service: "aggregator",
        config: &conn.config,
        console: cfg.console.as_ref(),
        addr: conn.addr,
        pki_dir: &cfg.pki_dir,
        operator: &conn.operator,
        server_name: &conn.server_name,
    })
    .map_err(anyhow::Error::msg)
}

/// Polls the campaign until it ends, printing every round it completed (each publishes the
/// next global model version, so none is missed between polls, the last included), then the
/// final status.
async fn wait_for_campaign_end(api: &OperatorClient, conn: &Conn, cfg: &OperatorConfig, started: CampaignStatus) -> Result<()> {
    let first = started.global.as_ref().map_or(0, |(v, _)| v.0);
    let mut reported = first;
    let mut status = started;
    loop {
        let done = status.campaign.is_none();
        if let Some((v, d)) = &status.global
            && v.0 > reported
            && !conn.json
        {
            for version in reported + 1..=v.0 {
                let digest = if version == v.0 { format!(", digest {d}") } else { String::new() };
                println!("campaign round {} completed: global model version {version}{digest}", version - first);
            }
            reported = v.0;
        }
        if done {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        status = decode(CAMPAIGN, api.get(CAMPAIGN).await?)?;
    }
    print_status(&status, conn, cfg);
    match status.last_outcome.as_deref() {
        Some("completed") => Ok(()),
        other => Err(anyhow!("the campaign ended {}", other.unwrap_or("without an outcome"))),
    }
}

/// The campaign's status in the console API.
const CAMPAIGN: &str = "/api/v1/campaign";

fn print_status(s: &CampaignStatus, conn: &Conn, cfg: &OperatorConfig) {
    if conn.json {
        println!("{}", serde_json::to_string(s).unwrap_or_default());
        return;
    }
    match s.campaign {
        Some(c) => {
            println!("campaign {c} running ({})", s.strategy.as_deref().unwrap_or("?"));
            println!("rounds completed: {}", s.rounds_completed.unwrap_or(0));
            match s.open_round {
                Some(r) => println!(
                    "open round {r}: {}/{} updates, deadline {}",
                    s.accepted,
                    s.target,
                    s.deadline_unix_ms.map_or("none".into(), |ms| fedfleet_certs::inspect::rfc3339((ms / 1000) as i64))
                ),
                None => println!("no open round (finalizing)"),
            }
        }
        None => println!("no campaign running{}", s.last_outcome.as_deref().map(|o| format!(" (last: {o})")).unwrap_or_default()),
    }
    if let Some(p) = &s.privacy {
        let left = p.epsilon_budget.map(|b| format!(", {:.3} left of a budget of {b}", (b - p.epsilon_spent).max(0.0))).unwrap_or_default();
        let by = if p.noise_added_by == fedfleet_aggregator::wire::NoiseSource::Devices { ", noise split across the devices" } else { "" };
        println!(
            "privacy: DP-FedAvg{by}, noise multiplier {}, sampling rate {:.4}: ε = {:.3} spent (δ = {:e}){left}",
            p.noise_multiplier, p.sampling_rate, p.epsilon_spent, p.delta
        );
    }
    if let Some(l) = &s.local_dp {
        println!(
            "privacy: local DP, each update clipped to {} and noised on its device (noise multiplier {}): ε ≤ {:.3} per device over {} rounds (δ = {:e})",
            l.clip_norm, l.noise_multiplier, l.epsilon_per_device, l.rounds, l.delta
        );
    }
    if let Some(a) = &s.secure_aggregation {
        println!(
            "secure aggregation: SecAgg+, {} neighbours, shares needed {:.0} % of them, updates clipped to ±{} on a 2^-{} grid",
            a.degree,
            a.threshold_fraction * 100.0,
            a.clip,
            a.frac_bits
        );
        if let Some(r) = &a.open_round {
            let failure = r.failure.as_deref().map(|f| format!(" (failed: {f})")).unwrap_or_default();
            println!(
                "  round {}: stage {:?}, {} devices on the roster, {} shares rebuild a device{failure}",
                r.round, r.stage, r.roster, r.threshold
            );
        }
    }
    if let Some((v, d)) = &s.global {
        // Under LoRA the aggregator's model holds the adapters; the registry also stores (and
        // names by digest) the model with them merged in: say which digest this is.
        let which = if cfg.lora() { " (base weights + LoRA adapters; the registry's merged model has its own digest)" } else { "" };
        println!("global model: version {v}, digest {d}{which}");
    }
}
