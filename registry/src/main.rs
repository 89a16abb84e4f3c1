//! `fedfleet-registry`: the registry service and its operator CLI.
//!
//! Operator commands are requests to a running registry's console API (`/api/v1`, the config's
//! `[console] listen`, or `--addr`), the same operations the dashboard uses: over HTTPS they
//! present the operator service certificate (`operator_identity` in the config, issued with
//! `fedfleet-certs issue-server --name operator`) or a bearer token from `FEDFLEET_API_TOKEN`;
//! they never open a store themselves, so they work the same from the registry's host and from
//! an operator's. `serve`, `init-keys` and
//! `check` are the registry host's own.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, bail};
use clap::{Args, Parser, Subcommand};
use fedfleet_http::operator::{OperatorClient, Target, decode, query, segment};
use fedfleet_protocol::{Clock, SystemClock};
use fedfleet_protocol::{DeviceId, ModelVersion, SpecJson};
use fedfleet_registry::config::Config;
use fedfleet_registry::metadata;
use fedfleet_registry::rollout::{Phase, Status};
use fedfleet_registry::service::RegistryService;
use fedfleet_registry::store::{Store, StoreConfig};
use fedfleet_registry::wire::RolloutStart;
use fedfleet_registry_client::admin::{AdminAnswer, DeviceReport, RolloutReport};
use serde_json::Value;

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
    /// The registry console (its HTTP API) operator commands talk to (default: the config's
    /// `[console] listen`, with 0.0.0.0 read as 127.0.0.1).
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
        #[arg(long = "metrics", value_parser = fedfleet_registry::console::parse_metric)]
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
    /// The latest report of one device, or a line per device of the fleet.
    Status { id: Option<String> },
    /// Revoke a device: every service refuses it from its next request. The registry needs the
    /// fleet CA key for this (`[renewal] ca_key`); otherwise run `fedfleet-certs revoke` on the
    /// CA's host.
    Revoke {
        id: String,
        /// Why, kept in the revocation list.
        #[arg(long, default_value = "operator revoke")]
        reason: String,
    },
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
            let op = Operator { cfg, config_path: cli.config.clone(), addr: cli.addr, json: cli.json };
            rt.block_on(op.command(cmd))
        }
    }
}

/// An operator's connection settings: the registry's console (its HTTP API), the operator
/// certificate.
struct Operator {
    cfg: Config,
    config_path: PathBuf,
    addr: Option<SocketAddr>,
    json: bool,
}

impl Operator {
    /// A client of the registry's console: `--addr`, else the config's `[console] listen`.
    fn client(&self) -> anyhow::Result<OperatorClient> {
        let cfg = &self.cfg;
        OperatorClient::new(&Target {
            service: "registry",
            config: &self.config_path,
            console: cfg.console.as_ref(),
            addr: self.addr,
            pki_dir: &cfg.pki_dir,
            operator: &cfg.operator_identity,
            server_name: &cfg.server_name,
        })
        .map_err(anyhow::Error::msg)
    }

    async fn command(&self, cmd: Cmd) -> anyhow::Result<()> {
        let api = self.client()?;
        let (answer, wait) = match cmd {
            Cmd::Publish { file, model, spec, parent, metrics, publisher } => {
                let spec_text = std::fs::read_to_string(&spec).with_context(|| format!("reading {}", spec.display()))?;
                SpecJson::parse(&spec_text).with_context(|| format!("{} is not JSON", spec.display()))?;
                let bytes = tokio::fs::read(&file).await.with_context(|| format!("reading {}", file.display()))?;
                let publisher = publisher.or_else(|| std::env::var("USER").ok()).unwrap_or_else(|| "operator".into());
                let metrics: Vec<String> = metrics.iter().map(|(k, v)| format!("{k}={v}")).collect();
                let mut q = vec![("spec", spec_text), ("publisher", publisher), ("metrics", metrics.join(","))];
                q.extend(parent.map(|p| ("parent", p.to_string())));
                let path = format!("/api/v1/models/{}/versions{}", segment(&model), query(&q));
                (decode(&path, api.upload(&path, bytes.into()).await?)?, false)
            }
            Cmd::List => {
                let path = "/api/v1/models";
                (AdminAnswer::Models { models: decode(path, api.get(path).await?["models"].take())? }, false)
            }
            Cmd::Show { name, version } => {
                let v = version.map_or("latest".into(), |v| v.to_string());
                let path = format!("/api/v1/models/{}/versions/{v}", segment(&name));
                (AdminAnswer::Version(decode(&path, api.get(&path).await?)?), false)
            }
            Cmd::Alias { cmd: AliasCmd::Set { name, alias, version } } => {
                let path = format!("/api/v1/models/{}/aliases/{}", segment(&name), segment(&alias));
                (decode(&path, api.post(&path, &serde_json::json!({ "version": version })).await?)?, false)
            }
            Cmd::Rollout { cmd } => {
                let (wait, path, body) = match cmd {
                    RolloutCmd::Start(a) => {
                        let wait = a.wait;
                        (wait, "/api/v1/rollouts".to_owned(), Some(serde_json::to_value(start_request(a)?)?))
                    }
                    RolloutCmd::Pause { id } => (false, format!("/api/v1/rollouts/{}/pause", segment(&id)), Some(Value::Null)),
                    RolloutCmd::Resume { id } => (false, format!("/api/v1/rollouts/{}/resume", segment(&id)), Some(Value::Null)),
                    RolloutCmd::Abort { id, reason } => {
                        (false, format!("/api/v1/rollouts/{}/abort", segment(&id)), Some(serde_json::json!({ "reason": reason })))
                    }
                    RolloutCmd::Rollback { id } => (false, format!("/api/v1/rollouts/{}/rollback", segment(&id)), Some(Value::Null)),
                    RolloutCmd::Status { id: Some(id) } => (false, format!("/api/v1/rollouts/{}", segment(&id)), None),
                    RolloutCmd::Status { id: None } => {
                        let path = "/api/v1/rollouts";
                        let rollouts = decode(path, api.get(path).await?["rollouts"].take())?;
                        print_answer(&AdminAnswer::Rollouts { rollouts }, self.json);
                        return Ok(());
                    }
                };
                (AdminAnswer::Rollout(decode(&path, api.get_or_post(&path, body.as_ref()).await?)?), wait)
            }
            Cmd::Device { cmd: DeviceCmd::Status { id: Some(id) } } => {
                let path = format!("/api/v1/devices/{}", segment(&id));
                (AdminAnswer::Device(decode(&path, api.get(&path).await?)?), false)
            }
            Cmd::Device { cmd: DeviceCmd::Status { id: None } } => {
                let fleet = api.get("/api/v1/devices").await?;
                match self.json {
                    true => println!("{}", serde_json::to_string_pretty(&fleet)?),
                    false => print!("{}", render_fleet(&fleet)),
                }
                return Ok(());
            }
            Cmd::Device { cmd: DeviceCmd::Revoke { id, reason } } => {
                let path = format!("/api/v1/devices/{}/revoke", segment(&id));
                let revoked = api.post(&path, &serde_json::json!({ "reason": reason })).await?;
                match self.json {
                    true => println!("{}", serde_json::to_string_pretty(&revoked)?),
                    false => println!(
                        "revoked device {id} (serial {}, reason {:?}); revoked.json is now version {}",
                        revoked["serial"].as_str().unwrap_or("?"),
                        revoked["reason"].as_str().unwrap_or_default(),
                        revoked["revocation_list_version"]
                    ),
                }
                return Ok(());
            }
            Cmd::Serve | Cmd::InitKeys { .. } | Cmd::Check { .. } => unreachable!("the registry host's own commands run locally"),
        };
        print_answer(&answer, self.json);
        match (&answer, wait) {
            (AdminAnswer::Rollout(r), true) => self.wait_for_rollout_end(&api, r).await,
            _ => Ok(()),
        }
    }

    /// Polls a started rollout until it leaves `running`/`paused`, printing each phase change.
    async fn wait_for_rollout_end(&self, api: &OperatorClient, started: &RolloutReport) -> anyhow::Result<()> {
        let id = started.id.clone();
        let path = format!("/api/v1/rollouts/{}", segment(&id));
        let mut last = (started.summary.status, started.summary.phase);
        loop {
            let r: RolloutReport = decode(&path, api.get(&path).await?)?;
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

/// The fleet as `GET /api/v1/devices` answers it: a line per device.
fn render_fleet(fleet: &Value) -> String {
    use std::fmt::Write;
    let devices = fleet["devices"].as_array().map(Vec::as_slice).unwrap_or_default();
    if devices.is_empty() {
        return "no device has reported\n".into();
    }
    let text = |v: &Value| v.as_str().map_or_else(|| "-".to_owned(), str::to_owned);
    let mut out = String::new();
    for d in devices {
        let seen = d["last_seen_unix_ms"].as_u64().map_or("never".into(), rfc3339_ms);
        let _ = writeln!(
            out,
            "{:<20} {:<8} {:<12} {:<10} {:<8} last seen {seen}{}{}",
            text(&d["device"]),
            text(&d["version"]),
            text(&d["state"]),
            text(&d["health"]),
            if d["online"] == Value::Bool(true) { "online" } else { "offline" },
            if d["revoked"] == Value::Bool(true) { "  REVOKED" } else { "" },
            d["cohorts"].as_array().filter(|c| !c.is_empty()).map_or(String::new(), |c| format!("  cohorts {}", Value::from(c.clone())))
        );
    }
    let _ = writeln!(out, "{} devices, {} online", fleet["total"], fleet["online"]);
    out
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
