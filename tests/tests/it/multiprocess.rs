//! Issue 8 item 3: the real binaries as child processes on 127.0.0.1 — `fedfleet-certs` for the
//! PKI, `fedfleet-registry serve`, `fedfleet-aggregator serve` publishing into it, and agent
//! daemons (`fedfleet-agent run`, each on its own digits partition) — driven through the
//! operator CLIs:
//!
//! * [`campaign_and_rollout_reach_every_agent`]: a 3-round campaign publishes chained versions
//!   into the registry, a rollout installs the last one on every agent, and the model the agents
//!   run classifies the digits test split.
//! * [`services_killed_with_sigkill_recover`]: SIGKILL of the aggregator mid-round, of an agent
//!   while it trains or uploads, and of the registry during the rollout; every service restarts
//!   from its config and data, every update is counted exactly once and the agents converge.
//! * [`revoked_device_is_locked_out_mid_campaign`]: `fedfleet-certs revoke` during a round; the
//!   device's later uploads are refused (`revoked` in the aggregator's metrics) and the campaign
//!   completes with the others.
//!
//! Most of the SIGKILL test's ~70 s is two 30 s waits: a client whose QUIC connection was to a
//! SIGKILLed service only redials after `fedfleet-net`'s idle timeout, because the restarted
//! service's stateless resets carry tokens from a new random reset key, which clients ignore.
//!
//! The binaries are taken from `target/<profile>/` (`cargo build --workspace --bins`). Each
//! child's output goes to `<tempdir>/logs/<name>.log`; a failing test prints their tails.
//! Devices are gated through their conditions file (`[participation] status_file`, `idle`), so a
//! test decides who trains when.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use fedfleet_learning::{Dataset, ModelSpec};
use fedfleet_protocol::{BundleLimits, DeviceState, DeviceStatus, Digest, RoundId, TensorBundle};

use crate::procs::{
    Proc, Relay, SeededRng, cli, count_lines, free_tcp_port, free_udp_port, parse_metrics, poll_every, sample, scrape, wait_for,
};

pub(crate) const MODEL: &str = "digits";
const FLEET: &str = "fleet-mp";
pub(crate) const AGENTS: usize = 4;
/// Generous bounds: the tests fail instead of hanging, also on a loaded 2-core machine.
const CAMPAIGN_TIMEOUT: Duration = Duration::from_secs(150);
pub(crate) const STEP_TIMEOUT: Duration = Duration::from_secs(60);

/// One of these tests at a time: each runs two services and four agent processes.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

pub(crate) fn one_at_a_time() -> MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner())
}

/// `[campaign]` of the aggregator's config (the defaults of `campaign start`).
pub(crate) struct Plan {
    rounds: u32,
    target: u32,
    quorum: u32,
    deadline_secs: u64,
    extension_secs: u64,
    /// `rounds` or `async` (FedBuff buffers of `target`).
    mode: &'static str,
}

impl Plan {
    /// `rounds` rounds that each wait for every agent, with time to spare.
    pub(crate) fn every_agent(rounds: u32) -> Plan {
        let n = AGENTS as u32;
        Plan { rounds, target: n, quorum: n, deadline_secs: 300, extension_secs: 60, mode: "rounds" }
    }
}

/// A fleet in a temporary directory: PKI, configs, and the running children.
pub(crate) struct Fleet {
    root: PathBuf,
    pub devices: Vec<String>,
    rounds: u32,
    pub agg_addr: SocketAddr,
    pub reg_addr: SocketAddr,
    reg_metrics: SocketAddr,
    agg_metrics: SocketAddr,
    /// Command the agents are started under (e.g. `ip netns exec NS`); empty: none.
    agent_wrapper: Vec<String>,
    agents: Vec<Option<Proc>>,
    aggregator: Option<Proc>,
    registry: Option<Proc>,
    /// Dropped last: the children are gone before their directory is.
    _dir: tempfile::TempDir,
}

impl Fleet {
    /// Writes the PKI (through `fedfleet-certs`), the registry keys, the aggregator's initial
    /// model and every config. Starts nothing; every device starts idle.
    pub(crate) fn new(test: &str, plan: Plan) -> Fleet {
        let dir = tempfile::Builder::new().prefix(&format!("{test}-")).tempdir().expect("temp dir");
        let root = dir.path().to_owned();
        eprintln!("{test}: working directory {}", root.display());
        for d in ["logs", "conditions", "agents"] {
            std::fs::create_dir_all(root.join(d)).unwrap();
        }
        let devices: Vec<String> = (0..AGENTS).map(|i| format!("edge-{i:02}")).collect();

        cli("fedfleet-certs", &["--dir", "pki", "init", "--fleet", FLEET], &root);
        for name in ["registry", "aggregator", "operator"] {
            cli("fedfleet-certs", &["--dir", "pki", "issue-server", "--name", name], &root);
        }
        for d in &devices {
            cli("fedfleet-certs", &["--dir", "pki", "enroll-device", "--id", d], &root);
        }

        let (reg_port, agg_port) = (free_udp_port(), free_udp_port());
        let reg_metrics: SocketAddr = ([127, 0, 0, 1], free_tcp_port()).into();
        let agg_metrics: SocketAddr = ([127, 0, 0, 1], free_tcp_port()).into();
        // The operator commands are requests to the services' console APIs.
        let (reg_console, agg_console) = (free_tcp_port(), free_tcp_port());
        let r = root.display();
        std::fs::write(
            root.join("registry.toml"),
            format!(
                "listen = \"127.0.0.1:{reg_port}\"\ndata_dir = \"{r}/registry\"\npki_dir = \"{r}/pki\"\n\
                 metrics = \"{reg_metrics}\"\noperators = [\"operator\", \"aggregator\"]\n\
                 [console]\nlisten = \"127.0.0.1:{reg_console}\"\n"
            ),
        )
        .unwrap();
        cli("fedfleet-registry", &["--config", "registry.toml", "init-keys"], &root);

        let Plan { rounds, target, quorum, deadline_secs, extension_secs, mode } = plan;
        std::fs::write(
            root.join("aggregator.toml"),
            format!(
                "listen = \"127.0.0.1:{agg_port}\"\npki_dir = \"{r}/pki\"\nserver_name = \"aggregator\"\n\
                 data_dir = \"{r}/aggregator\"\nmetrics_addr = \"{agg_metrics}\"\noperators = [\"operator\"]\n\
                 [publish]\nregistry = \"127.0.0.1:{reg_port}\"\nserver_name = \"localhost\"\n\
                 [model]\nname = \"{MODEL}\"\nspec = {{ arch = \"mlp\", input = [64], hidden = [64], classes = 10 }}\n\
                 initial = \"{r}/initial.safetensors\"\nvalidation = \"digits\"\n\
                 [campaign]\nrounds = {rounds}\ntarget = {target}\nquorum = {quorum}\ndeadline_secs = {deadline_secs}\n\
                 extension_secs = {extension_secs}\nmode = \"{mode}\"\nlocal_epochs = 5\nbatch_size = 32\nlr = 0.3\n\
                 [console]\nlisten = \"127.0.0.1:{agg_console}\"\n"
            ),
        )
        .unwrap();
        cli("fedfleet-aggregator", &["init-model", "--config", "aggregator.toml", "--seed", "7"], &root);

        for (i, d) in devices.iter().enumerate() {
            let state = root.join("agents").join(d);
            let pki = root.join("pki");
            cli(
                "fedfleet-agent",
                &[
                    "enroll",
                    "--cert",
                    &pki.join(format!("devices/{d}.crt")).display().to_string(),
                    "--key",
                    &pki.join(format!("devices/{d}.key")).display().to_string(),
                    "--ca",
                    &pki.join("ca.crt").display().to_string(),
                    "--root",
                    &root.join("registry/root.json").display().to_string(),
                    "--state-dir",
                    &state.display().to_string(),
                ],
                &root,
            );
            // Latency bound far above anything a loaded CI machine shows: the health check
            // must judge the model, not the machine.
            std::fs::write(
                root.join("agents").join(format!("{d}.toml")),
                format!(
                    "fleet = \"{FLEET}\"\nstate_dir = \"{}\"\npoll_interval_ms = 200\n\
                     [data]\ndigits_partition = {{ clients = {AGENTS}, index = {i}, seed = 1 }}\n\
                     [participation]\nrequire_idle = true\nstatus_file = \"{r}/conditions/{d}.json\"\n\
                     [health]\nmax_latency_ms = 10000.0\n[backoff]\nbase_ms = 200\nmax_ms = 1000\n\
                     [aggregator]\naddr = \"127.0.0.1:{agg_port}\"\nserver_name = \"localhost\"\n\
                     receipt_key = \"{r}/aggregator/receipt.pub\"\n\
                     [registry]\naddr = \"127.0.0.1:{reg_port}\"\nserver_name = \"localhost\"\nmodel = \"{MODEL}\"\n",
                    state.display()
                ),
            )
            .unwrap();
        }
        let fleet = Fleet {
            root,
            devices,
            rounds,
            agg_addr: ([127, 0, 0, 1], agg_port).into(),
            reg_addr: ([127, 0, 0, 1], reg_port).into(),
            agent_wrapper: Vec::new(),
            reg_metrics,
            agg_metrics,
            agents: (0..AGENTS).map(|_| None).collect(),
            aggregator: None,
            registry: None,
            _dir: dir,
        };
        for i in 0..AGENTS {
            fleet.set_idle(i, true);
        }
        fleet
    }

    pub(crate) fn log(&self, name: &str) -> PathBuf {
        self.root.join("logs").join(format!("{name}.log"))
    }

    /// Starts `fedfleet-<service> args` and waits until it serves (its metrics endpoint, at
    /// `metrics`, is bound after the QUIC endpoint).
    fn start_service(&self, service: &str, args: &[&str], metrics: SocketAddr) -> Proc {
        let mut p = Proc::spawn(&[], service, &format!("fedfleet-{service}"), args, &self.root, &self.log(service), "info");
        wait_for(&format!("the {service} to serve"), STEP_TIMEOUT, || {
            p.assert_running();
            scrape(metrics)
        });
        p
    }

    /// Starts `fedfleet-registry serve`.
    fn start_registry(&mut self) {
        let p = self.start_service("registry", &["--config", "registry.toml", "serve"], self.reg_metrics);
        self.registry = Some(p);
    }

    /// Starts `fedfleet-aggregator serve` (it also creates `receipt.pub` the agents pin).
    fn start_aggregator(&mut self) {
        let p = self.start_service("aggregator", &["serve", "--config", "aggregator.toml"], self.agg_metrics);
        self.aggregator = Some(p);
    }

    /// Starts the registry, the aggregator and the agents `agents`, then a campaign (seed 1).
    pub(crate) fn start_campaign_with(&mut self, agents: impl IntoIterator<Item = usize>) {
        self.start_registry();
        self.start_aggregator();
        for i in agents {
            self.start_agent(i);
        }
        self.aggregator_cli(&["start", "--seed", "1"]);
    }

    fn agent_config(&self, i: usize) -> String {
        self.root.join("agents").join(format!("{}.toml", self.devices[i])).display().to_string()
    }

    /// Points agent `i` at `addr` (e.g. a [`Relay`]) instead of the aggregator; before it starts.
    pub(crate) fn route_agent_to_aggregator_via(&self, i: usize, addr: SocketAddr) {
        self.route_agent_via(i, "aggregator", self.agg_addr, addr);
    }

    /// Points agent `i` at `addr` instead of the registry; before it starts.
    pub(crate) fn route_agent_to_registry_via(&self, i: usize, addr: SocketAddr) {
        self.route_agent_via(i, "registry", self.reg_addr, addr);
    }

    fn route_agent_via(&self, i: usize, section: &str, service: SocketAddr, addr: SocketAddr) {
        let path = self.agent_config(i);
        let text = std::fs::read_to_string(&path).unwrap();
        let from = format!("[{section}]\naddr = \"{service}\"");
        assert!(text.contains(&from), "{text}");
        std::fs::write(&path, text.replace(&from, &format!("[{section}]\naddr = \"{addr}\""))).unwrap();
    }

    /// Starts the agents (from now on) under `wrapper`, e.g. `ip netns exec NS`, which must
    /// exec the agent (so signals and exit statuses are the agent's).
    pub(crate) fn run_agents_under(&mut self, wrapper: &[String]) {
        self.agent_wrapper = wrapper.to_vec();
    }

    fn start_agent(&mut self, i: usize) {
        let name = self.devices[i].clone();
        let config = self.agent_config(i);
        // The lifecycle says why a device does not join a round (INFO for a round it skips,
        // debug for routine repeats): proof that it heard the announcement.
        let log = self.log(&name);
        self.agents[i] = Some(Proc::spawn(
            &self.agent_wrapper,
            &name,
            "fedfleet-agent",
            &["run", "--config", &config],
            &self.root,
            &log,
            "info,fedfleet_agent_core::lifecycle=debug",
        ));
    }

    /// Writes device `i`'s conditions file (read at each of its polls): only an idle device
    /// joins a round.
    fn set_idle(&self, i: usize, idle: bool) {
        let path = self.root.join("conditions").join(format!("{}.json", self.devices[i]));
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, format!("{{\"idle\":{idle},\"charging\":true,\"fresh_samples\":1000}}")).unwrap();
        std::fs::rename(&tmp, &path).unwrap();
    }

    /// The agent's last status report (`status.json`), if it wrote one.
    pub(crate) fn status_file(&self, i: usize) -> Option<DeviceStatus> {
        let text = std::fs::read_to_string(self.root.join("agents").join(&self.devices[i]).join("status.json")).ok()?;
        serde_json::from_str(&text).ok()
    }

    /// `fedfleet-agent status`.
    fn status_cli(&self, i: usize) -> DeviceStatus {
        let out = cli("fedfleet-agent", &["status", "--config", &self.agent_config(i)], &self.root);
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("`fedfleet-agent status` of {}: {e}: {out}", self.devices[i]))
    }

    pub(crate) fn aggregator_metrics(&self) -> String {
        wait_for("the aggregator's metrics", STEP_TIMEOUT, || scrape(self.agg_metrics))
    }

    fn aggregator_cli(&self, args: &[&str]) -> String {
        let mut all = vec!["campaign"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["--config", "aggregator.toml"]);
        cli("fedfleet-aggregator", &all, &self.root)
    }

    /// Polls `campaign status` until the campaign has ended; panics unless it completed with
    /// one version per round on top of the initial model. Returns the global model version.
    pub(crate) fn wait_campaign_completed(&mut self) -> u64 {
        let text = wait_for("the campaign to end", CAMPAIGN_TIMEOUT, || {
            if let Some(a) = self.aggregator.as_mut() {
                a.assert_running();
            }
            let s = self.aggregator_cli(&["status"]);
            s.contains("no campaign running").then_some(s)
        });
        assert!(text.contains("(last: completed)"), "campaign ended but did not complete:\n{text}");
        let global: u64 = text
            .lines()
            .find_map(|l| l.strip_prefix("global model: version ")?.split(',').next()?.parse().ok())
            .unwrap_or_else(|| panic!("no global model in the status:\n{text}"));
        assert_eq!(global, 1 + self.rounds as u64, "the initial model and one version per round:\n{text}");
        global
    }

    fn registry_json(&self, args: &[&str]) -> serde_json::Value {
        let mut all = vec!["--config", "registry.toml", "--json"];
        all.extend_from_slice(args);
        let out = cli("fedfleet-registry", &all, &self.root);
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("fedfleet-registry {}: {e}: {out}", args.join(" ")))
    }

    /// The registry's versions of the model: version → (parent, digest in hex).
    pub(crate) fn registry_versions(&self) -> BTreeMap<u64, (Option<u64>, String)> {
        let list = self.registry_json(&["list"]);
        let model = list["models"]
            .as_array()
            .and_then(|m| m.iter().find(|m| m["name"] == MODEL))
            .unwrap_or_else(|| panic!("model {MODEL} not in the registry: {list}"));
        model["versions"]
            .as_array()
            .expect("versions")
            .iter()
            .map(|v| {
                let digest = v["digest"].as_str().expect("digest").to_owned();
                (v["version"].as_u64().expect("version"), (v["parent"].as_u64(), digest))
            })
            .collect()
    }

    /// Starts a one-phase (100 %) rollout of `version` to `stable` that completes only once
    /// every agent reported it healthy.
    pub(crate) fn rollout_start(&self, version: u64, id: &str) {
        self.rollout_start_soaking(version, id, "0s");
    }

    /// [`Fleet::rollout_start`], the phase soaking at least `soak` (e.g. `8s`).
    fn rollout_start_soaking(&self, version: u64, id: &str, soak: &str) {
        cli(
            "fedfleet-registry",
            &[
                "--config",
                "registry.toml",
                "rollout",
                "start",
                "--model",
                MODEL,
                "--version",
                &version.to_string(),
                "--phases",
                "100",
                "--soak",
                soak,
                "--min-healthy",
                &AGENTS.to_string(),
                "--id",
                id,
            ],
            &self.root,
        );
    }

    pub(crate) fn wait_rollout_completed(&mut self, id: &str) -> serde_json::Value {
        let s = wait_for(&format!("rollout {id} to end"), CAMPAIGN_TIMEOUT, || {
            if let Some(r) = self.registry.as_mut() {
                r.assert_running();
            }
            let s = self.registry_json(&["rollout", "status", id]);
            (s["status"] != "running").then_some(s)
        });
        assert_eq!(s["status"], "completed", "rollout {id}: {s:#}");
        s
    }

    /// Waits until every agent's `status.json` shows `version` active, then checks the same
    /// through `fedfleet-agent status`. Returns the active model's digest.
    pub(crate) fn wait_all_active(&self, version: u64) -> Digest {
        for i in 0..AGENTS {
            wait_for(&format!("{} to run version {version}", self.devices[i]), STEP_TIMEOUT, || {
                self.status_file(i).filter(|s| s.active.as_ref().is_some_and(|m| m.version.0 == version))
            });
        }
        let statuses: Vec<DeviceStatus> = (0..AGENTS).map(|i| self.status_cli(i)).collect();
        let digest = statuses[0].active.as_ref().expect("active model").digest;
        for s in &statuses {
            let m = s.active.as_ref().expect("active model");
            assert_eq!((m.name.as_str(), m.version.0, m.digest), (MODEL, version, digest), "{s:?}");
            assert_eq!(s.state, DeviceState::Active, "{s:?}");
        }
        digest
    }

    /// Stops every child with SIGTERM (clean exits required).
    pub(crate) fn stop_all(&mut self) {
        for a in self.agents.iter_mut().flatten() {
            a.stop();
        }
        if let Some(a) = self.aggregator.as_mut() {
            a.stop();
        }
        if let Some(r) = self.registry.as_mut() {
            r.stop();
        }
    }

    /// After [`Fleet::stop_all`]: checks that the aggregator's committed records hold exactly
    /// one update per (device, round) for `expected[device]` rounds, that every agent's outbox
    /// is empty, and that agents acknowledged no more updates than they trained.
    pub(crate) fn assert_exactly_once(&self, expected: &[u32]) {
        let store = fedfleet_aggregator::persist::Store::open(&self.root.join("aggregator")).expect("aggregator store");
        let mut per_device: BTreeMap<String, Vec<RoundId>> = BTreeMap::new();
        for r in 1..=self.rounds as u64 {
            for rec in store.accepted_in(RoundId(r)).expect("accepted records") {
                assert_eq!(rec.round, RoundId(r));
                per_device.entry(rec.device.as_str().to_owned()).or_default().push(rec.round);
            }
        }
        for (i, d) in self.devices.iter().enumerate() {
            let rounds = per_device.remove(d).unwrap_or_default();
            let mut unique = rounds.clone();
            unique.dedup();
            assert_eq!(unique.len(), rounds.len(), "{d}: an update counted twice: {rounds:?}");
            assert_eq!(rounds.len(), expected[i] as usize, "{d}: accepted in rounds {rounds:?}");
            let outbox = fedfleet_agent::store::AgentStore::open(self.root.join("agents").join(d).join("store"))
                .expect("agent store")
                .outbox()
                .expect("outbox");
            assert!(outbox.is_empty(), "{d}: {} updates still in the outbox", outbox.len());
            // An agent killed after logging an acknowledgement but before its outbox write
            // landed sends that update again and logs it again: count outbox entries, not lines.
            let log = self.log(d);
            let mut acked = outbox_ids(&log, "update acknowledged");
            acked.extend(outbox_ids(&log, "update already held by the aggregator"));
            assert!(
                acked.len() <= expected[i] as usize,
                "{d}: {} updates acknowledged for {} accepted ({acked:?})",
                acked.len(),
                expected[i]
            );
        }
        assert!(per_device.is_empty(), "records of unknown devices: {per_device:?}");
    }
}

/// The `outbox_id=` of every line of `log` that contains `needle`.
fn outbox_ids(log: &Path, needle: &str) -> std::collections::BTreeSet<u64> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    text.lines()
        .filter(|l| l.contains(needle))
        .filter_map(|l| l.split_whitespace().find_map(|w| w.strip_prefix("outbox_id=")?.parse().ok()))
        .collect()
}

/// Accuracy of a model (safetensors bytes) on the digits test split.
fn test_accuracy(bytes: &[u8]) -> f64 {
    let bundle = TensorBundle::decode(bytes, &BundleLimits::default()).expect("model decodes");
    let (_, test) = Dataset::digits_split().expect("digits");
    fedfleet_learning::evaluate(&ModelSpec::digits_mlp(), &bundle, &test).expect("evaluates").accuracy
}

/// The aggregator's open round and its accepted updates (from its metrics).
pub(crate) fn open_round(metrics: &str) -> (u64, u64) {
    let get = |n| sample(metrics, n).unwrap_or_else(|| panic!("{n} missing from the metrics"));
    (get("fedfleet_aggregator_open_round") as u64, get("fedfleet_aggregator_round_accepted") as u64)
}

#[test]
fn campaign_and_rollout_reach_every_agent() {
    let _serial = one_at_a_time();
    let rounds = 3;
    let mut f = Fleet::new("mp-campaign", Plan::every_agent(rounds));
    f.start_campaign_with(0..AGENTS);
    let global = f.wait_campaign_completed();

    // The registry holds every version, each trained from the one before.
    let versions = f.registry_versions();
    assert_eq!(versions.keys().copied().collect::<Vec<_>>(), (1..=global).collect::<Vec<_>>());
    for (v, (parent, _)) in &versions {
        assert_eq!(*parent, (*v > 1).then(|| v - 1), "parent of v{v}");
    }

    // A rollout through the registry's operator CLI reaches every agent.
    let id = format!("{MODEL}-stable-v{global}");
    f.rollout_start(global, &id);
    let rollout = f.wait_rollout_completed(&id);
    assert_eq!(rollout["healthy"].as_u64(), Some(AGENTS as u64), "{rollout:#}");
    let digest = f.wait_all_active(global);
    assert_eq!(digest.to_hex(), versions[&global].1, "agents run the registry's bytes");

    // The model the agents run classifies held-out digits.
    let bytes = std::fs::read(f.root.join("agents").join(&f.devices[0]).join("store/blobs").join(digest.to_hex())).expect("active blob");
    let accuracy = test_accuracy(&bytes);
    eprintln!("v{global} after {rounds} rounds of {AGENTS} agents: test accuracy {accuracy:.3}");
    assert!(accuracy > 0.8, "test accuracy {accuracy}");

    // Both services' /metrics parse as Prometheus text and count what happened; other paths 404.
    let reg_text = scrape(f.reg_metrics).expect("registry metrics");
    let reg = parse_metrics(&reg_text);
    let agg = f.aggregator_metrics();
    assert_eq!(sample(&agg, "fedfleet_aggregator_updates_accepted_total"), Some((AGENTS * rounds as usize) as f64), "{agg}");
    assert!(reg.samples.iter().any(|s| s.metric == "fedfleet_registry_chunks_served_total"), "registry metrics lack chunks_served");
    // Every round's base is a registry version: the agents fetched each from the registry.
    assert_eq!(sample(&agg, "fedfleet_aggregator_base_models_served_total"), Some(0.0), "{agg}");
    let manifests = sample(&reg_text, r#"fedfleet_registry_requests_total{kind="manifest"}"#);
    assert!(manifests >= Some((AGENTS * rounds as usize) as f64), "a base per agent and round described by the registry: {manifests:?}");
    for addr in [f.reg_metrics, f.agg_metrics] {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let (status, _) = rt.block_on(fedfleet_http::scrape(addr, "/anything-else")).unwrap();
        assert_eq!(status, 404, "{addr}: only /metrics is served");
    }

    f.stop_all();
    f.assert_exactly_once(&[rounds; AGENTS]);
    for d in &f.devices {
        let acks = count_lines(&f.log(d), "update acknowledged");
        assert_eq!(acks, rounds as usize, "{d}: one receipt per round");
    }
}

/// Polls `f` every 5 ms (for moments that last only tens of milliseconds).
fn catch<T>(what: &str, f: impl FnMut() -> Option<T>) -> T {
    poll_every(Duration::from_millis(5), what, STEP_TIMEOUT, f)
}

#[test]
fn services_killed_with_sigkill_recover() {
    let _serial = one_at_a_time();
    let t0 = Instant::now();
    let mut rng = SeededRng::from_env("services_killed_with_sigkill_recover");
    let rounds = 2;
    let mut f = Fleet::new("mp-sigkill", Plan::every_agent(rounds));
    // Round 1 gets k updates from the first k devices of a random order; the others start
    // after the aggregator's restart.
    let mut order: Vec<usize> = (0..AGENTS).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.range(0, i as u64) as usize);
    }
    let k = rng.range(1, AGENTS as u64 - 1) as usize;
    f.start_campaign_with(order[..k].iter().copied());

    // 1. The aggregator, SIGKILLed after k of the round's updates, restarts with them.
    wait_for(&format!("{k} updates in round 1"), STEP_TIMEOUT, || (open_round(&f.aggregator_metrics()) == (1, k as u64)).then_some(()));
    eprintln!("[{:.1?}] SIGKILL aggregator after {k} of {AGENTS} updates of round 1 (devices {:?} uploaded)", t0.elapsed(), &order[..k]);
    f.aggregator.as_mut().unwrap().sigkill();
    f.start_aggregator();
    assert_eq!(open_round(&f.aggregator_metrics()), (1, k as u64), "round 1 after the restart");

    // 2. An agent SIGKILLed while uploading restarts and delivers its update exactly once, from
    //    its outbox. It reaches the aggregator through a relay that cuts the link part-way
    //    through the upload: its client sends the handshake, a few polls and a model request
    //    (well under 12 KiB) before the ~19 KiB update.
    let victim = order[k];
    let name = f.devices[victim].clone();
    let relay = Relay::start(f.agg_addr);
    f.route_agent_to_aggregator_via(victim, relay.addr);
    relay.cut_after(12 * 1024);
    f.start_agent(victim);
    wait_for(&format!("{name}'s upload to be cut"), STEP_TIMEOUT, || relay.is_cut().then_some(()));
    let delay = rng.range(0, 300);
    std::thread::sleep(Duration::from_millis(delay));
    let state = f.status_file(victim).map(|s| s.state);
    eprintln!("[{:.1?}] SIGKILL {name} {delay} ms after its link was cut mid-upload (status then: {state:?})", t0.elapsed());
    f.agents[victim].as_mut().unwrap().sigkill();
    assert_eq!(open_round(&f.aggregator_metrics()), (1, k as u64), "a partial upload is not an update");
    relay.set_cut(false);
    f.start_agent(victim);
    for &i in &order[k + 1..] {
        f.start_agent(i);
    }

    let global = f.wait_campaign_completed();
    assert_eq!(count_lines(&f.log(&name), "update acknowledged"), rounds as usize, "{name}: one receipt per round");

    // 3. The registry, SIGKILLed while the agents install the rolled-out version, restarts and
    //    the agents still converge on it.
    let id = format!("{MODEL}-stable-v{global}");
    f.rollout_start(global, &id);
    let installing = |f: &Fleet, i: usize| {
        f.status_file(i).is_some_and(|s| {
            matches!(s.state, DeviceState::Downloading | DeviceState::Downloaded | DeviceState::Verified | DeviceState::Healthy)
                || s.active.is_some_and(|m| m.version.0 == global)
        })
    };
    catch("an agent to start installing", || (0..AGENTS).any(|i| installing(&f, i)).then_some(()));
    let delay = rng.range(0, 100);
    std::thread::sleep(Duration::from_millis(delay));
    let active = (0..AGENTS).filter(|&i| f.status_file(i).is_some_and(|s| s.active.is_some_and(|m| m.version.0 == global))).count();
    eprintln!(
        "[{:.1?}] SIGKILL registry {delay} ms after the first agent began installing ({active} of {AGENTS} agents active on v{global})",
        t0.elapsed()
    );
    f.registry.as_mut().unwrap().sigkill();
    f.start_registry();
    f.wait_rollout_completed(&id);
    let digest = f.wait_all_active(global);
    assert_eq!(digest.to_hex(), f.registry_versions()[&global].1);
    eprintln!("[{:.1?}] every agent runs v{global}", t0.elapsed());

    f.stop_all();
    f.assert_exactly_once(&[rounds; AGENTS]);
}

#[test]
fn revoked_device_is_locked_out_mid_campaign() {
    let _serial = one_at_a_time();
    let rounds = 2;
    let n = AGENTS as u32;
    // The revoked device never completes a round again: rounds close at the deadline on quorum.
    let mut f = Fleet::new("mp-revoke", Plan { rounds, target: n, quorum: n - 1, deadline_secs: 10, extension_secs: 30, mode: "rounds" });
    let revoked = AGENTS - 1;
    f.set_idle(revoked, false);
    f.start_campaign_with(0..AGENTS);
    wait_for("the others' round-1 updates", STEP_TIMEOUT, || (open_round(&f.aggregator_metrics()) == (1, n as u64 - 1)).then_some(()));

    // Revoked while round 1 is open, once the device has heard of the round (so its QUIC
    // connection to the aggregator predates the revocation: it is refused at ingest, and
    // counted, not at a later handshake); then the device tries to take part.
    let name = f.devices[revoked].clone();
    wait_for(&format!("{name} to hear of round 1"), STEP_TIMEOUT, || (count_lines(&f.log(&name), "not joining round") > 0).then_some(()));
    cli("fedfleet-certs", &["--dir", "pki", "revoke", "--id", &name, "--reason", "lost in test"], &f.root);
    f.set_idle(revoked, true);
    wait_for("an update refused as revoked", STEP_TIMEOUT, || {
        (sample(&f.aggregator_metrics(), "fedfleet_aggregator_updates_rejected_total{reason=\"revoked\"}")? >= 1.0).then_some(())
    });

    // Every round completes without the revoked device.
    f.wait_campaign_completed();
    let m = f.aggregator_metrics();
    assert_eq!(sample(&m, "fedfleet_aggregator_updates_accepted_total"), Some(((AGENTS - 1) * rounds as usize) as f64), "{m}");
    assert_eq!(sample(&m, "fedfleet_aggregator_rounds_total{event=\"failed\"}"), Some(0.0), "{m}");
    let status = f.status_cli(revoked);
    assert!(
        matches!(&status.state, DeviceState::Failed { reason } if reason.contains("revoked")),
        "{name} should report its refused update: {status:?}"
    );
    // Refused at its next contact, whichever came first: its update at ingest, or a poll on
    // the connection it made before the revocation (both count as `revoked`).
    assert!(count_lines(&f.log(&name), "certificate is revoked") >= 1, "{name}'s log names the refusal");

    f.stop_all();
    let mut expected = [rounds; AGENTS];
    expected[revoked] = 0;
    f.assert_exactly_once(&expected);
}

/// Which process a [`chaos_run`] kills.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Victim {
    Aggregator,
    Registry,
    /// A different agent (seeded) at each point.
    Agent,
}

/// SIGKILLs per process, at least, while the campaign or the rollout runs.
const KILL_POINTS: usize = 10;
/// Of which at least this many during the rollout.
const ROLLOUT_KILL_POINTS: usize = 3;
const CHAOS_ROUNDS: u32 = 6;
/// The rollout's soak (its least running time): room for the kills that did not fit into the
/// campaign, each 0–300 ms apart plus a restart.
const CHAOS_SOAK: Duration = Duration::from_secs(12);

/// A campaign of [`CHAOS_ROUNDS`] rounds on every agent, then a soaking rollout of its last
/// version; with a victim, SIGKILLed at seeded random moments (0–300 ms apart) and restarted
/// each time: while the campaign runs, at most [`KILL_POINTS`] - [`ROLLOUT_KILL_POINTS`] times,
/// then while the rollout runs until [`KILL_POINTS`] kills landed. Returns the digest of every
/// version the registry holds, oldest first.
fn chaos_run(victim: Option<Victim>, rng: &mut SeededRng) -> Vec<String> {
    let name = victim.map_or("reference".to_owned(), |v| format!("{v:?}").to_lowercase());
    let t0 = Instant::now();
    let mut f = Fleet::new(&format!("mp-kill9-{name}"), Plan::every_agent(CHAOS_ROUNDS));
    f.start_campaign_with(0..AGENTS);
    let kill = |f: &mut Fleet, rng: &mut SeededRng, victim: Victim, when: &str| {
        let wait = rng.range(0, 300);
        std::thread::sleep(Duration::from_millis(wait));
        match victim {
            Victim::Aggregator => {
                f.aggregator.as_mut().unwrap().sigkill();
                f.start_aggregator();
            }
            Victim::Registry => {
                f.registry.as_mut().unwrap().sigkill();
                f.start_registry();
            }
            Victim::Agent => {
                let i = rng.range(0, AGENTS as u64 - 1) as usize;
                f.agents[i].as_mut().unwrap().sigkill();
                f.start_agent(i);
            }
        }
        eprintln!("[{:.1?}] {name}: SIGKILL {wait} ms after {when}, restarted", t0.elapsed());
    };
    let mut kills = 0;
    if let Some(v) = victim {
        while kills < KILL_POINTS - ROLLOUT_KILL_POINTS {
            let (round, accepted) = open_round(&f.aggregator_metrics());
            if round == 0 {
                break; // the campaign ended; the rest land in the rollout
            }
            kill(&mut f, rng, v, &format!("round {round} had {accepted} updates"));
            kills += 1;
        }
    }
    let global = f.wait_campaign_completed();
    let id = format!("{MODEL}-stable-v{global}");
    let rollout_started = Instant::now();
    f.rollout_start_soaking(global, &id, &format!("{}s", CHAOS_SOAK.as_secs()));
    if let Some(v) = victim {
        while kills < KILL_POINTS {
            // Within the soak the rollout is running whatever the devices report.
            let into = rollout_started.elapsed();
            assert!(
                into + Duration::from_secs(1) < CHAOS_SOAK,
                "{name}: kill point {} would come after the rollout's soak; lengthen CHAOS_SOAK",
                kills + 1
            );
            kill(&mut f, rng, v, &format!("{into:.1?} into the rollout"));
            kills += 1;
        }
    }
    f.wait_rollout_completed(&id);
    let digest = f.wait_all_active(global);
    let versions = f.registry_versions();
    assert_eq!(digest.to_hex(), versions[&global].1, "{name}: agents run the registry's bytes");
    f.stop_all();
    f.assert_exactly_once(&[CHAOS_ROUNDS; AGENTS]);
    eprintln!("[{:.1?}] {name}: {kills} kills; v{global} active on every agent, every update counted once", t0.elapsed());
    versions.values().map(|(_, digest)| digest.clone()).collect()
}

/// Issue 14: the aggregator, the registry and an agent each SIGKILLed at 10 seeded random
/// points during a campaign and the rollout of its result (at least 3 in the rollout); after the restarts every version
/// the campaign published is bit-identical to the uninterrupted run's, every agent runs the last
/// one, and the accounting holds (one accepted record per device and round, outboxes empty, no
/// more acknowledgements than accepted updates).
#[test]
fn kill9_at_seeded_points_leaves_every_version_bit_identical() {
    let _serial = one_at_a_time();
    let mut rng = SeededRng::from_env("kill9_at_seeded_points_leaves_every_version_bit_identical");
    let reference = chaos_run(None, &mut rng);
    assert_eq!(reference.len(), 1 + CHAOS_ROUNDS as usize);
    for victim in [Victim::Aggregator, Victim::Registry, Victim::Agent] {
        let versions = chaos_run(Some(victim), &mut rng);
        assert_eq!(versions, reference, "{victim:?} killed: the versions differ from the uninterrupted run's");
    }
}

/// Issue 27: an asynchronous (FedBuff) campaign over real agent processes. Four agents, buffers
/// of two: the two updates that close a buffer leave two agents whose updates were trained on the
/// version before; they are folded into the next buffer, discounted, instead of refused. Every
/// buffer publishes a version, every agent contributes, and no update is counted twice.
#[test]
fn an_async_campaign_over_real_agents_folds_stale_updates_and_publishes_every_buffer() {
    let _serial = one_at_a_time();
    let buffers = 4;
    let mut f =
        Fleet::new("mp-async", Plan { rounds: buffers, target: 2, quorum: 1, deadline_secs: 300, extension_secs: 0, mode: "async" });
    f.start_campaign_with(0..AGENTS);
    let global = f.wait_campaign_completed();
    assert_eq!(global, 1 + u64::from(buffers));
    let m = f.aggregator_metrics();
    let accepted = sample(&m, "fedfleet_aggregator_updates_accepted_total").unwrap_or(0.0);
    assert_eq!(accepted, f64::from(2 * buffers), "each buffer takes exactly its two updates:\n{m}");
    let count = sample(&m, "fedfleet_aggregator_update_staleness_count").unwrap_or(0.0);
    let fresh = sample(&m, "fedfleet_aggregator_update_staleness_bucket{le=\"0.0\"}").unwrap_or(0.0);
    assert_eq!(count, accepted, "{m}");
    assert!(count - fresh >= 1.0, "no update trained on an earlier version was folded:\n{m}");
    f.stop_all();
    let store = fedfleet_aggregator::persist::Store::open(&f.root.join("aggregator")).expect("aggregator store");
    let mut contributors = std::collections::BTreeSet::new();
    for r in 1..=u64::from(buffers) {
        let records = store.accepted_in(RoundId(r)).expect("accepted records");
        assert_eq!(records.len(), 2, "buffer {r}: {records:?}");
        assert_ne!(records[0].device, records[1].device, "buffer {r} took one device twice");
        contributors.extend(records.into_iter().map(|rec| rec.device.as_str().to_owned()));
    }
    assert!(contributors.len() >= 3, "the slower agents' updates were lost: only {contributors:?} contributed");
}
