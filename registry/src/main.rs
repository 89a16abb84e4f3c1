//! `fedfleet-registry`: the registry service and its operator CLI.
//!
//! Operator commands open the store directly when no `serve` process holds it (sled allows one
//! process per database); while `serve` runs they go to it over QUIC, presenting the operator
//! service certificate (`operator_identity` in the config, issued with
//! `fedfleet-certs issue-server --name operator`). Either way the same code runs them
//! (`ops::Registry::admin`).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context, bail};
use clap::{Args, Parser, Subcommand};
use fedfleet_protocol::{Clock, SystemClock};
use fedfleet_protocol::{DeviceId, FleetId, ModelVersion, SpecJson};
use fedfleet_registry::RegistryError;
use fedfleet_registry::client::RegistryClient;
use fedfleet_registry::config::Config;
use fedfleet_registry::metadata::{self, MetadataSigner};
use fedfleet_registry::metrics::Metrics;
use fedfleet_registry::ops::Registry;
use fedfleet_registry::rollout::Phase;
use fedfleet_registry::service::RegistryService;
use fedfleet_registry::store::{NewVersion, Store, StoreConfig, StoreError};
use fedfleet_registry::wire::{AdminRequest, RolloutCommand, RolloutStart};

#[derive(Parser, Debug)]
#[command(
    name = "fedfleet-registry",
    version,
    about = "fedfleet model registry: versioned store, signed metadata, rollouts, QUIC download service"
)]
struct Cli {
    /// Configuration file (TOML). Missing file: built-in defaults.
    #[arg(long, short, global = true, env = "FEDFLEET_REGISTRY_CONFIG", default_value = "registry.toml")]
    config: PathBuf,
    /// Print machine-readable JSON.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run the QUIC download service (creates the signing keys on first start).
    Serve,
    /// Create the root, targets and timestamp keys and root.json (pin it on devices).
    InitKeys {
        /// Replace existing keys (devices pinned to the old root will refuse everything).
        #[arg(long)]
        force: bool,
    },
    /// Publish FILE as the next version of a model.
    Publish {
        file: PathBuf,
        #[arg(long)]
        model: String,
        /// Model spec (architecture, input shape) as a JSON file.
        #[arg(long)]
        spec: Option<PathBuf>,
        /// The version this one was trained from.
        #[arg(long)]
        parent: Option<u64>,
        /// Evaluation metric, repeatable: --metrics accuracy=0.97
        #[arg(long = "metrics", value_parser = parse_kv)]
        metrics: Vec<(String, f64)>,
        /// Publisher name recorded with the version (default: operator / $USER).
        #[arg(long)]
        publisher: Option<String>,
    },
    /// List models, versions and aliases.
    List,
    /// Show one version (default: the latest).
    Show {
        name: String,
        #[arg(long)]
        version: Option<u64>,
    },
    /// Manage aliases.
    Alias {
        #[command(subcommand)]
        cmd: AliasCmd,
    },
    /// Start and steer phased rollouts.
    Rollout {
        #[command(subcommand)]
        cmd: RolloutCmd,
    },
    /// Per-device status reports.
    Device {
        #[command(subcommand)]
        cmd: DeviceCmd,
    },
    /// Check the store's integrity (offline only).
    Check {
        /// Re-hash every chunk.
        #[arg(long)]
        deep: bool,
    },
}

#[derive(Subcommand, Debug)]
enum AliasCmd {
    /// Point ALIAS of model NAME at VERSION.
    Set { name: String, alias: String, version: u64 },
}

#[derive(Subcommand, Debug)]
enum RolloutCmd {
    /// Start moving an alias to a version in phases.
    Start(StartArgs),
    /// Freeze the current phase.
    Pause { id: String },
    /// Continue a paused rollout.
    Resume { id: String },
    /// Stop: no new device gets the target (healthy ones keep it).
    Abort {
        id: String,
        #[arg(long, default_value = "operator abort")]
        reason: String,
    },
    /// Send every device back to the previous version (and the alias, if it moved).
    Rollback { id: String },
    /// One rollout's status, or all.
    Status { id: Option<String> },
}

#[derive(Args, Debug)]
struct StartArgs {
    /// Model name.
    #[arg(long)]
    model: String,
    /// Target version.
    #[arg(long)]
    version: u64,
    #[arg(long, default_value = "stable")]
    alias: String,
    /// Fleet percentages of the phases, comma separated.
    #[arg(long, default_value = "1,10,100", value_delimiter = ',')]
    phases: Vec<f64>,
    /// A named cohort as the first phase: NAME=dev1,dev2,...
    #[arg(long)]
    cohort: Option<String>,
    /// Minimum soak time per phase: 30s, 10m, 2h, 500ms.
    #[arg(long, default_value = "10m", value_parser = parse_duration_ms)]
    soak: u64,
    /// Devices that must report healthy before a phase advances.
    #[arg(long, default_value_t = 0)]
    min_healthy: u32,
    /// Most running time a phase may wait for --min-healthy healthy devices before the rollout
    /// stops as stalled (default: the soak plus 1h; 0 waits forever).
    #[arg(long, value_parser = parse_duration_ms)]
    deadline: Option<u64>,
    /// Auto-abort when failed/reporting exceeds this share.
    #[arg(long, default_value_t = 0.2)]
    failure_threshold: f64,
    /// Outcomes needed before the failure rate is judged.
    #[arg(long, default_value_t = 5)]
    min_sample: u32,
    /// Rollout id (default: MODEL-ALIAS-vN-<ms>).
    #[arg(long)]
    id: Option<String>,
    /// Wait until the rollout ends, printing each phase; the exit status is 0 only if it
    /// completed (not aborted or rolled back).
    #[arg(long)]
    wait: bool,
}

#[derive(Subcommand, Debug)]
enum DeviceCmd {
    /// The latest report of one device, or of all.
    Status { id: Option<String> },
}

fn parse_kv(s: &str) -> Result<(String, f64), String> {
    let (k, v) = s.split_once('=').ok_or("expected KEY=VALUE")?;
    let v: f64 = v.parse().map_err(|e| format!("{v:?}: {e}"))?;
    Ok((k.to_owned(), v))
}

fn parse_duration_ms(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(split);
    let n: u64 = n.parse().map_err(|_| format!("{s:?}: expected e.g. 30s, 10m, 2h"))?;
    let mul = match unit {
        "ms" => 1,
        "" | "s" => 1000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return Err(format!("{s:?}: unknown unit {unit:?}")),
    };
    Ok(n * mul)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fedfleet-registry: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}

fn load_config(path: &Path) -> anyhow::Result<Config> {
    if path.exists() { Ok(Config::load(path)?) } else { Ok(Config::default()) }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let cfg = load_config(&cli.config)?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    match cli.cmd {
        Cmd::Serve => {
            init_tracing();
            rt.block_on(serve(cfg))
        }
        Cmd::InitKeys { force } => {
            let root = metadata::init_keys(&cfg.data_dir, cfg.root_days, force, SystemClock.now_ms())?;
            let body = root.body_unverified()?;
            println!(
                "created keys in {} and root v{} (expires {}); pin {} on devices. Move {} offline.",
                cfg.data_dir.join("keys").display(),
                body.version,
                body.expires,
                cfg.data_dir.join(metadata::ROOT_JSON).display(),
                cfg.data_dir.join(metadata::ROOT_KEY).display()
            );
            Ok(())
        }
        Cmd::Check { deep } => {
            let store = Store::open(cfg.store_dir(), store_config(&cfg))?;
            let r = store.check(deep)?;
            println!("ok: {} versions, {} artifacts, {} chunks ({} unreferenced)", r.versions, r.artifacts, r.chunks, r.orphan_chunks);
            Ok(())
        }
        Cmd::Publish { file, model, spec, parent, metrics, publisher } => {
            let spec = match spec {
                Some(p) => {
                    let text = std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
                    SpecJson::parse(&text).with_context(|| format!("{} is not JSON", p.display()))?
                }
                None => SpecJson(serde_json::json!({})),
            };
            let f = std::fs::File::open(&file).with_context(|| format!("reading {}", file.display()))?;
            let publisher = publisher.or_else(|| std::env::var("USER").ok()).unwrap_or_else(|| "operator".into());
            let req = AdminRequest::Publish(NewVersion {
                name: model,
                spec,
                parent: parent.map(ModelVersion),
                metrics: metrics.into_iter().collect(),
                created_at_unix_ms: SystemClock.now_ms(),
                publisher,
                adapter: None,
            });
            let out = rt.block_on(admin(&cfg, req, Some(f)))?;
            print_out(&out, cli.json, |v| {
                format!(
                    "published {} v{} ({} bytes, {} chunks, digest {})",
                    v["name"].as_str().unwrap_or("?"),
                    v["version"],
                    v["length"],
                    v["chunks"],
                    v["digest"].as_str().unwrap_or("?")
                )
            });
            Ok(())
        }
        Cmd::List => {
            let out = rt.block_on(admin(&cfg, AdminRequest::List, None))?;
            print_out(&out, cli.json, render_list);
            Ok(())
        }
        Cmd::Show { name, version } => {
            let out = rt.block_on(admin(&cfg, AdminRequest::Show { name, version: version.map(ModelVersion) }, None))?;
            print_out(&out, true, |_| String::new());
            Ok(())
        }
        Cmd::Alias { cmd: AliasCmd::Set { name, alias, version } } => {
            let out = rt.block_on(admin(&cfg, AdminRequest::AliasSet { name, alias, version: ModelVersion(version) }, None))?;
            print_out(&out, cli.json, |v| {
                format!(
                    "{} {} -> v{} (was {})",
                    v["name"].as_str().unwrap_or("?"),
                    v["alias"].as_str().unwrap_or("?"),
                    v["version"],
                    match &v["previous"] {
                        serde_json::Value::Null => "unset".to_string(),
                        p => format!("v{p}"),
                    }
                )
            });
            Ok(())
        }
        Cmd::Rollout { cmd } => {
            let mut wait = false;
            let req = match cmd {
                RolloutCmd::Start(a) => {
                    wait = a.wait;
                    AdminRequest::RolloutStart(start_request(a)?)
                }
                RolloutCmd::Pause { id } => AdminRequest::Rollout { id, command: RolloutCommand::Pause },
                RolloutCmd::Resume { id } => AdminRequest::Rollout { id, command: RolloutCommand::Resume },
                RolloutCmd::Abort { id, reason } => AdminRequest::Rollout { id, command: RolloutCommand::Abort { reason } },
                RolloutCmd::Rollback { id } => AdminRequest::Rollout { id, command: RolloutCommand::Rollback },
                RolloutCmd::Status { id } => AdminRequest::RolloutStatus { id },
            };
            let out = rt.block_on(admin(&cfg, req, None))?;
            print_out(&out, true, |_| String::new());
            if wait {
                rt.block_on(wait_for_rollout_end(&cfg, &out))?;
            }
            Ok(())
        }
        Cmd::Device { cmd: DeviceCmd::Status { id } } => {
            let out = rt.block_on(admin(&cfg, AdminRequest::DeviceStatus { device: id }, None))?;
            print_out(&out, true, |_| String::new());
            Ok(())
        }
    }
}

/// Polls a started rollout until it leaves `running`/`paused`, printing each phase change.
async fn wait_for_rollout_end(cfg: &Config, started: &serde_json::Value) -> anyhow::Result<()> {
    let id = started["id"].as_str().context("the registry's answer names no rollout id")?.to_string();
    let mut last = (started["status"].clone(), started["phase"].clone());
    loop {
        let s = admin(cfg, AdminRequest::RolloutStatus { id: Some(id.clone()) }, None).await?;
        let now = (s["status"].clone(), s["phase"].clone());
        if now != last {
            println!("rollout {id}: {} (phase {})", now.0.as_str().unwrap_or("?"), now.1);
            last = now;
        }
        match s["status"].as_str() {
            Some("running" | "paused") => tokio::time::sleep(std::time::Duration::from_millis(500)).await,
            Some("completed") => return Ok(()),
            other => bail!("rollout {id} ended {}: {} devices healthy, {} failed", other.unwrap_or("?"), s["healthy"], s["failed"]),
        }
    }
}

fn start_request(a: StartArgs) -> anyhow::Result<RolloutStart> {
    let deadline = a.deadline.unwrap_or(a.soak + 3_600_000);
    let mut phases = Vec::new();
    if let Some(c) = &a.cohort {
        let (name, devs) = c.split_once('=').context("--cohort expects NAME=dev1,dev2")?;
        let devices = devs
            .split(',')
            .filter(|s| !s.is_empty())
            .map(DeviceId::new)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| anyhow::anyhow!("--cohort: {e}"))?;
        let mut p = Phase::cohort(name, devices, a.soak);
        p.min_healthy = a.min_healthy;
        p.deadline_ms = deadline;
        phases.push(p);
    }
    for pct in &a.phases {
        let mut p = Phase::percent(*pct, a.soak);
        p.min_healthy = a.min_healthy;
        p.deadline_ms = deadline;
        phases.push(p);
    }
    if phases.is_empty() {
        bail!("a rollout needs at least one phase");
    }
    Ok(RolloutStart {
        id: a.id,
        model: a.model,
        alias: a.alias,
        target: ModelVersion(a.version),
        phases,
        failure_threshold: a.failure_threshold,
        min_sample: a.min_sample,
    })
}

fn print_out(v: &serde_json::Value, json: bool, human: impl Fn(&serde_json::Value) -> String) {
    if json {
        println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
    } else {
        println!("{}", human(v));
    }
}

fn render_list(v: &serde_json::Value) -> String {
    let mut out = String::new();
    let models = v["models"].as_array().cloned().unwrap_or_default();
    if models.is_empty() {
        return "no models published".into();
    }
    for m in models {
        let aliases: BTreeMap<String, u64> = serde_json::from_value(m["aliases"].clone()).unwrap_or_default();
        out.push_str(&format!("{}\n", m["name"].as_str().unwrap_or("?")));
        for ver in m["versions"].as_array().cloned().unwrap_or_default() {
            let n = ver["version"].as_u64().unwrap_or(0);
            let tags: Vec<&str> = aliases.iter().filter(|(_, t)| **t == n).map(|(a, _)| a.as_str()).collect();
            out.push_str(&format!(
                "  v{n:<4} {:>12} bytes  {}  {}{}\n",
                ver["length"],
                &ver["digest"].as_str().unwrap_or("")[..16.min(ver["digest"].as_str().unwrap_or("").len())],
                ver["publisher"].as_str().unwrap_or(""),
                if tags.is_empty() { String::new() } else { format!("  [{}]", tags.join(", ")) }
            ));
        }
    }
    out.trim_end().to_owned()
}

fn store_config(cfg: &Config) -> StoreConfig {
    StoreConfig { chunk_size: cfg.chunk_size, ..StoreConfig::default() }
}

fn fleet_of(cfg: &Config) -> FleetId {
    fedfleet_certs::Pki::open(&cfg.pki_dir).map(|p| p.fleet().clone()).unwrap_or_else(|_| FleetId::new("unknown").expect("valid id"))
}

/// Runs an operator command: directly on the store if no server holds it, else over QUIC.
async fn admin(cfg: &Config, req: AdminRequest, artifact: Option<std::fs::File>) -> anyhow::Result<serde_json::Value> {
    match Store::open(cfg.store_dir(), store_config(cfg)) {
        Ok(store) => {
            let signer =
                if metadata::keys_exist(&cfg.data_dir) { Some(MetadataSigner::load(&cfg.data_dir, cfg.lifetimes())?) } else { None };
            let reg = Registry::new(store, fleet_of(cfg), signer, Arc::new(Metrics::default()), SystemClock::shared())?;
            let now = SystemClock.now_ms();
            let out = match req {
                AdminRequest::Publish(mut new) => {
                    new.created_at_unix_ms = now;
                    let m = reg.publish(new, std::io::BufReader::with_capacity(1 << 20, artifact.context("no artifact")?))?;
                    fedfleet_registry::ops::published_summary(&m)
                }
                req => reg.admin(req, now)?,
            };
            reg.drive(now)?;
            reg.store().flush()?;
            Ok(out)
        }
        Err(StoreError::Locked { .. }) => {
            let pki = fedfleet_certs::Pki::open(&cfg.pki_dir).context("opening the PKI directory for the operator certificate")?;
            let id = fedfleet_certs::ServerIdentity::load(&cfg.pki_dir, &cfg.operator_identity).with_context(|| {
                format!(
                    "the registry is running; operator commands go through it and need the operator certificate \
                     (fedfleet-certs issue-server --name {})",
                    cfg.operator_identity
                )
            })?;
            let tls = fedfleet_certs::tls::service_client_config(pki.ca(), &id, &[fedfleet_certs::ALPN_V1])?;
            let mut addr = cfg.listen;
            if addr.ip().is_unspecified() {
                addr = SocketAddr::new([127, 0, 0, 1].into(), addr.port());
            }
            let client = RegistryClient::connect(addr, &cfg.server_name, tls).await.context("connecting to the running registry")?;
            let out = match artifact {
                Some(f) => client.publish(req, f).await,
                None => client.admin(req).await,
            };
            client.close().await;
            Ok(out?)
        }
        Err(e) => Err(RegistryError::from(e).into()),
    }
}

async fn serve(cfg: Config) -> anyhow::Result<()> {
    let service = RegistryService::open(cfg, SystemClock::shared())?;
    service.bind()?.run(fedfleet_net::Shutdown::on_signal()).await?;
    Ok(())
}
