//! `fedfleet-registry`: the registry service and its operator CLI.
//!
//! Operator commands go to a running registry over QUIC (the config's `listen`, or `--addr`),
//! presenting the operator service certificate (`operator_identity` in the config, issued with
//! `fedfleet-certs issue-server --name operator`); they never open a store themselves, so they
//! work the same from the registry's host and from an operator's. `serve`, `init-keys` and
//! `check` are the registry host's own.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, bail};
use clap::{Args, Parser, Subcommand};
use fedfleet_protocol::{Clock, SystemClock};
use fedfleet_protocol::{DeviceId, ModelVersion, SpecJson};
use fedfleet_registry::client::RegistryClient;
use fedfleet_registry::config::Config;
use fedfleet_registry::metadata;
use fedfleet_registry::rollout::{Phase, Status};
use fedfleet_registry::service::RegistryService;
use fedfleet_registry::store::{NewVersion, Store, StoreConfig};
use fedfleet_registry::wire::{AdminRequest, RolloutCommand, RolloutStart};
use fedfleet_registry_client::admin::{AdminAnswer, DeviceReport, RolloutReport};

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
    /// The registry operator commands talk to (default: the config's `listen`, with 0.0.0.0
    /// read as 127.0.0.1).
    #[arg(long, global = true)]
    addr: Option<SocketAddr>,
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
    /// Publish FILE (safetensors weights) as the next version of a model. The registry refuses
    /// weights that are not a model of the spec, naming every wrong tensor.
    Publish {
        file: PathBuf,
        #[arg(long)]
        model: String,
        /// The model's spec as a JSON file (what `init-model` and the agents read).
        #[arg(long)]
        spec: PathBuf,
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
    /// Check the store's integrity (on the registry's host, while `serve` is stopped).
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
    /// Devices that must report healthy before a phase advances (at least 1 whatever is given:
    /// a rollout advances on evidence, never on time alone).
    #[arg(long, default_value_t = 1)]
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
    fedfleet_net::logging::init("info");
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
                rfc3339_ms(body.expires),
                cfg.data_dir.join(metadata::ROOT_JSON).display(),
                cfg.data_dir.join(metadata::ROOT_KEY).display()
            );
            Ok(())
        }
        Cmd::Check { deep } => {
            let dir = cfg.store_dir();
            if !dir.exists() {
                bail!("no store at {}: check `data_dir` in {}", dir.display(), cli.config.display());
            }
            let store = Store::open(dir, StoreConfig { chunk_size: cfg.chunk_size, ..StoreConfig::default() })?;
            let r = store.check(deep)?;
            println!("ok: {} versions, {} artifacts, {} chunks ({} unreferenced)", r.versions, r.artifacts, r.chunks, r.orphan_chunks);
            Ok(())
        }
        cmd => {
            let op = Operator { cfg, addr: cli.addr, json: cli.json };
            rt.block_on(op.command(cmd))
        }
    }
}

/// An operator's connection settings: the registry's address, the operator certificate.
struct Operator {
    cfg: Config,
    addr: Option<SocketAddr>,
    json: bool,
}

impl Operator {
    async fn command(&self, cmd: Cmd) -> anyhow::Result<()> {
        let (req, artifact, wait) = match cmd {
            Cmd::Publish { file, model, spec, parent, metrics, publisher } => {
                let text = std::fs::read_to_string(&spec).with_context(|| format!("reading {}", spec.display()))?;
                let spec = SpecJson::parse(&text).with_context(|| format!("{} is not JSON", spec.display()))?;
                let f = std::fs::File::open(&file).with_context(|| format!("reading {}", file.display()))?;
                let publisher = publisher.or_else(|| std::env::var("USER").ok()).unwrap_or_else(|| "operator".into());
                let new = NewVersion {
                    name: model,
                    spec,
                    parent: parent.map(ModelVersion),
                    metrics: metrics.into_iter().collect(),
                    // The registry stamps the time with its own clock.
                    created_at_unix_ms: 0,
                    publisher,
                    adapter: None,
                };
                (AdminRequest::Publish(new), Some(f), false)
            }
            Cmd::List => (AdminRequest::List, None, false),
            Cmd::Show { name, version } => (AdminRequest::Show { name, version: version.map(ModelVersion) }, None, false),
            Cmd::Alias { cmd: AliasCmd::Set { name, alias, version } } => {
                (AdminRequest::AliasSet { name, alias, version: ModelVersion(version) }, None, false)
            }
            Cmd::Rollout { cmd } => match cmd {
                RolloutCmd::Start(a) => {
                    let wait = a.wait;
                    (AdminRequest::RolloutStart(start_request(a)?), None, wait)
                }
                RolloutCmd::Pause { id } => (AdminRequest::Rollout { id, command: RolloutCommand::Pause }, None, false),
                RolloutCmd::Resume { id } => (AdminRequest::Rollout { id, command: RolloutCommand::Resume }, None, false),
                RolloutCmd::Abort { id, reason } => (AdminRequest::Rollout { id, command: RolloutCommand::Abort { reason } }, None, false),
                RolloutCmd::Rollback { id } => (AdminRequest::Rollout { id, command: RolloutCommand::Rollback }, None, false),
                RolloutCmd::Status { id } => (AdminRequest::RolloutStatus { id }, None, false),
            },
            Cmd::Device { cmd: DeviceCmd::Status { id } } => (AdminRequest::DeviceStatus { device: id }, None, false),
            Cmd::Serve | Cmd::InitKeys { .. } | Cmd::Check { .. } => unreachable!("the registry host's own commands run locally"),
        };
        let answer = self.call(req, artifact).await?;
        print_answer(&answer, self.json);
        match (&answer, wait) {
            (AdminAnswer::Rollout(r), true) => self.wait_for_rollout_end(r).await,
            _ => Ok(()),
        }
    }

    /// Sends one command to the running registry.
    async fn call(&self, req: AdminRequest, artifact: Option<std::fs::File>) -> anyhow::Result<AdminAnswer> {
        let cfg = &self.cfg;
        let pki = fedfleet_certs::Pki::open(&cfg.pki_dir)
            .with_context(|| format!("opening the PKI directory {} for the operator certificate", cfg.pki_dir.display()))?;
        let id = fedfleet_certs::ServerIdentity::load(&cfg.pki_dir, &cfg.operator_identity).with_context(|| {
            format!(
                "operator commands present the operator certificate {:?} (fedfleet-certs issue-server --name {})",
                cfg.operator_identity, cfg.operator_identity
            )
        })?;
        let tls = fedfleet_certs::tls::service_client_config(pki.ca(), &id, &[fedfleet_certs::ALPN_V1])?;
        let mut addr = self.addr.unwrap_or(cfg.listen);
        if addr.ip().is_unspecified() {
            addr = SocketAddr::new([127, 0, 0, 1].into(), addr.port());
        }
        let client = RegistryClient::connect(addr, &cfg.server_name, tls)
            .await
            .with_context(|| format!("connecting to the registry at {addr} (is `fedfleet-registry serve` running there?)"))?;
        let out = match artifact {
            Some(f) => client.publish(req, std::io::BufReader::with_capacity(1 << 20, f)).await,
            None => client.admin(req).await,
        };
        client.close().await;
        Ok(out?)
    }

    /// Polls a started rollout until it leaves `running`/`paused`, printing each phase change.
    async fn wait_for_rollout_end(&self, started: &RolloutReport) -> anyhow::Result<()> {
        let id = started.id.clone();
        let mut last = (started.summary.status, started.summary.phase);
        loop {
            let AdminAnswer::Rollout(r) = self.call(AdminRequest::RolloutStatus { id: Some(id.clone()) }, None).await? else {
                bail!("the registry answered rollout status {id} with something else");
            };
            if (r.summary.status, r.summary.phase) != last {
                println!("rollout {id}: {}", rollout_stage(&r));
                last = (r.summary.status, r.summary.phase);
            }
            match r.summary.status {
                Status::Running | Status::Paused => tokio::time::sleep(std::time::Duration::from_millis(500)).await,
                Status::Completed => return Ok(()),
                _ => bail!("rollout {id} {}: {} devices healthy, {} failed", rollout_stage(&r), r.summary.healthy, r.summary.failed),
            }
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

/// Prints an answer as text, or (with `--json`) as the JSON the registry sent.
fn print_answer(a: &AdminAnswer, json: bool) {
    if json {
        println!("{}", serde_json::to_string_pretty(a).unwrap_or_default());
    } else {
        print!("{}", render(a));
    }
}

fn render(a: &AdminAnswer) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    match a {
        AdminAnswer::Published(p) => {
            let _ = writeln!(out, "published {} v{} ({} bytes, {} chunks, digest {})", p.name, p.version, p.length, p.chunks, p.digest);
        }
        AdminAnswer::Models { models } if models.is_empty() => out.push_str("no models published\n"),
        AdminAnswer::Models { models } => {
            for m in models {
                let _ = writeln!(out, "{}", m.name);
                for v in &m.versions {
                    let tags: Vec<&str> = m.aliases.iter().filter(|(_, t)| **t == v.version).map(|(a, _)| a.as_str()).collect();
                    let _ = writeln!(
                        out,
                        "  v{:<4} {:>12} bytes  {}  {}  {}{}{}",
                        v.version.0,
                        v.length,
                        &v.digest.to_hex()[..16],
                        rfc3339_ms(v.created_at_unix_ms),
                        v.publisher,
                        if v.adapter { "  (LoRA, merged)" } else { "" },
                        if tags.is_empty() { String::new() } else { format!("  [{}]", tags.join(", ")) }
                    );
                }
            }
        }
        AdminAnswer::Version(v) => {
            let m = &v.model;
            let _ = writeln!(
                out,
                "{} v{}{}",
                m.name,
                m.version,
                if v.aliases.is_empty() { String::new() } else { format!("  [{}]", v.aliases.join(", ")) }
            );
            let _ = writeln!(
                out,
                "digest:    {}{}",
                m.digest,
                if m.adapter.is_some() { " (a LoRA fine-tune merged into its base weights)" } else { "" }
            );
            let _ = writeln!(out, "length:    {} bytes in {} chunks of {}", m.length, v.chunks, v.chunk_size);
            let _ = writeln!(out, "parent:    {}", m.parent.map_or("none".into(), |p| format!("v{p}")));
            let _ = writeln!(out, "published: {} by {}", rfc3339_ms(m.created_at_unix_ms), m.publisher);
            for (k, x) in &m.metrics {
                let _ = writeln!(out, "metric:    {k} = {x}");
            }
            let _ = writeln!(out, "spec:      {}", m.spec.0);
        }
        AdminAnswer::Alias(a) => {
            let _ =
                writeln!(out, "{} {} -> v{} (was {})", a.name, a.alias, a.version, a.previous.map_or("unset".into(), |p| format!("v{p}")));
        }
        AdminAnswer::Rollout(r) => out.push_str(&render_rollout(r)),
        AdminAnswer::Rollouts { rollouts } if rollouts.is_empty() => out.push_str("no rollouts\n"),
        AdminAnswer::Rollouts { rollouts } => rollouts.iter().for_each(|r| out.push_str(&render_rollout(r))),
        AdminAnswer::Device(d) => out.push_str(&render_device(d)),
        AdminAnswer::Devices { devices } if devices.is_empty() => out.push_str("no device has reported\n"),
        AdminAnswer::Devices { devices } => devices.iter().for_each(|d| out.push_str(&render_device(d))),
    }
    out
}

/// "running (phase 1 of 2)", "completed (2 phases)", "aborted in phase 1 of 2".
fn rollout_stage(r: &RolloutReport) -> String {
    let s = &r.summary;
    match s.status {
        Status::Running | Status::Paused => format!("{} (phase {} of {})", s.status, s.phase + 1, s.phases),
        Status::Completed => format!("{} ({} of {} phases)", s.status, s.phases, s.phases),
        _ => format!("{} in phase {} of {}", s.status, s.phase + 1, s.phases),
    }
}

fn render_rollout(r: &RolloutReport) -> String {
    let rate = r.summary.failure_rate.map_or("not judged yet".into(), |f| format!("{:.0} %", f * 100.0));
    format!(
        "rollout {}: {} {} -> v{} (from {}), {}\n  healthy {}, failed {}, in progress {}; failure rate {rate} (abort above {:.0} %)\n",
        r.id,
        r.model,
        r.alias,
        r.target,
        r.previous.map_or("nothing".into(), |p| format!("v{p}")),
        rollout_stage(r),
        r.summary.healthy,
        r.summary.failed,
        r.summary.in_progress,
        r.failure_threshold * 100.0
    )
}

fn render_device(d: &DeviceReport) -> String {
    let revoked = if d.revoked { "  REVOKED" } else { "" };
    format!("{}{revoked}\n  {}\n", d.device, d.report)
}

fn rfc3339_ms(ms: u64) -> String {
    fedfleet_certs::inspect::rfc3339((ms / 1000) as i64)
}

async fn serve(cfg: Config) -> anyhow::Result<()> {
    let service = RegistryService::open(cfg, SystemClock::shared())?;
    service.bind()?.run(fedfleet_net::Shutdown::on_signal()).await?;
    Ok(())
}
