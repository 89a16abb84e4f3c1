//! `fedfleet-init-local DIR` (also `fedfleet init-local DIR`): a ready local deployment on loopback. One command writes the fleet
//! PKI, the registry's signing keys, the aggregator's receipt key and initial model, N enrolled
//! agents, and configs that agree with each other (relative paths, distinct ports, publishing
//! wired, one fleet name), so the hand-run deployment is "start these three kinds of process".
//! README's Quick tour runs it; `tests/tests/it/tour.rs` runs the README.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use fedfleet_learning::{Dataset, ModelSpec};
use fedfleet_protocol::{Clock, DeviceId, FleetId, SystemClock};

/// What `init-local` writes: fleet size and names, ports, campaign length.
#[derive(Debug, Clone)]
pub struct LocalOptions {
    pub agents: usize,
    pub fleet: String,
    pub rounds: u32,
    /// The aggregator listens on `base_port`, the registry on `base_port + 1`, their metrics on
    /// `base_port + 2` and `+ 3`, their operator consoles on `+ 5` and `+ 4` (QUIC is UDP,
    /// metrics and consoles TCP).
    pub base_port: u16,
    /// Certificate lifetime.
    pub days: u32,
}

impl Default for LocalOptions {
    fn default() -> Self {
        LocalOptions { agents: 3, fleet: "local".into(), rounds: 3, base_port: 7400, days: 365 }
    }
}

pub const MODEL: &str = "digits";
/// The TLS name every client expects (both service certificates carry it and 127.0.0.1).
const SERVER_NAME: &str = "localhost";

/// The files `init-local` wrote, relative to its directory.
#[derive(Debug)]
pub struct LocalLayout {
    pub dir: PathBuf,
    pub agent_configs: Vec<String>,
    /// The held-out rows written for `fedfleet-agent infer`, and their true labels.
    pub rows: String,
    pub labels: Vec<u32>,
}

/// The agent names: `agent-1` … `agent-N`.
pub fn agent_names(n: usize) -> Vec<String> {
    (1..=n).map(|i| format!("agent-{i}")).collect()
}

/// Writes the deployment into `dir` (created; must be empty if it exists).
pub fn init_local(dir: &Path, o: &LocalOptions) -> anyhow::Result<LocalLayout> {
    if o.agents == 0 {
        bail!("--agents must be at least 1");
    }
    if o.base_port.checked_add(5).is_none() || o.base_port == 0 {
        bail!("--base-port {} leaves no room for the six ports it takes", o.base_port);
    }
    if dir.exists() && std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))?.next().is_some() {
        bail!("{} is not empty; init-local writes a fresh deployment (pick a new directory)", dir.display());
    }
    let fleet = FleetId::new(&o.fleet).map_err(|e| anyhow::anyhow!("--fleet {:?}: {e}", o.fleet))?;
    let names = agent_names(o.agents);
    let devices: Vec<DeviceId> = names.iter().map(DeviceId::new).collect::<Result<_, _>>()?;
    for sub in ["logs", "agents"] {
        std::fs::create_dir_all(dir.join(sub)).with_context(|| format!("creating {}", dir.join(sub).display()))?;
    }

    // PKI: CA, the three service identities, one identity per device.
    fedfleet_certs::Pki::init_loopback(dir.join("pki"), &fleet, &["registry", "aggregator", "operator"], &devices, o.days)
        .context("creating the fleet PKI")?;

    // Registry: signing keys and root.json (pinned by every agent at enrollment).
    let registry_dir = dir.join("registry");
    fedfleet_registry::metadata::init_keys(&registry_dir, o.days, false, SystemClock.now_ms()).context("registry signing keys")?;

    // Aggregator: receipt key (pinned by agents) and the initial model, version 1.
    let aggregator_dir = dir.join("aggregator");
    fedfleet_aggregator::keys::load_or_create(&aggregator_dir).context("aggregator receipt key")?;
    let spec = ModelSpec::Mlp { input: vec![64], hidden: vec![64], classes: 10 };
    let initial = fedfleet_learning::model::init_bundle(&spec, 7).map_err(|e| anyhow::anyhow!("initial model: {e}"))?;
    fedfleet_aggregator::persist::write_atomic(&aggregator_dir.join("initial.safetensors"), &initial.encode())?;

    let p = o.base_port;
    let (agg_port, reg_port, agg_metrics, reg_metrics) = (p, p + 1, p + 2, p + 3);
    let (reg_console, agg_console) = (p + 4, p + 5);
    write(
        dir,
        "registry.toml",
        &format!(
            "# fedfleet-registry, written by `fedfleet init-local` (paths relative to this directory;\n\
             # run the services from here). Every key: registry/registry.example.toml.\n\
             listen = \"127.0.0.1:{reg_port}\"\n\
             data_dir = \"registry\"\n\
             pki_dir = \"pki\"\n\
             server_identity = \"registry\"\n\
             server_name = \"{SERVER_NAME}\"\n\
             metrics = \"127.0.0.1:{reg_metrics}\"\n\
             operators = [\"operator\", \"aggregator\"]\n\
             operator_identity = \"operator\"\n\
             \n\
             # Devices renew their certificates here before they expire (the CA key is on this host).\n\
             [renewal]\n\
             ca_key = \"pki/ca.key\"\n\n\
             # The operator console: API and dashboard on loopback (open http://127.0.0.1:{reg_console}/).\n\
             [console]\n\
             listen = \"127.0.0.1:{reg_console}\"\n\
             peer = \"http://127.0.0.1:{agg_console}/\"\n"
        ),
    )?;
    let n = o.agents;
    write(
        dir,
        "aggregator.toml",
        &format!(
            "# fedfleet-aggregator, written by `fedfleet init-local` (paths relative to this directory).\n\
             # Every key: aggregator/src/config.rs.\n\
             listen = \"127.0.0.1:{agg_port}\"\n\
             pki_dir = \"pki\"\n\
             server_identity = \"aggregator\"        # its certificate in pki/servers/\n\
             data_dir = \"aggregator\"\n\
             metrics_addr = \"127.0.0.1:{agg_metrics}\"\n\
             operators = [\"operator\"]\n\n\
             # Every global model goes into the registry as the next version of the model.\n\
             [publish]\n\
             registry = \"127.0.0.1:{reg_port}\"\n\
             server_name = \"{SERVER_NAME}\"\n\n\
             [model]\n\
             name = \"{MODEL}\"\n\
             spec = {{ arch = \"mlp\", input = [64], hidden = [64], classes = 10 }}\n\
             initial = \"aggregator/initial.safetensors\"\n\
             validation = \"digits\"\n\n\
             [campaign]\n\
             rounds = {rounds}\n\
             strategy = \"fedavg\"\n\
             target = {n}                 # a round closes when every agent has sent its update\n\
             quorum = 1\n\
             deadline_secs = 120\n\
             extension_secs = 60\n\
             local_epochs = 5\n\
             batch_size = 32\n\
             learning_rate = 0.3\n\n\
             # The operator console: API and dashboard on loopback (open http://127.0.0.1:{agg_console}/).\n\
             [console]\n\
             listen = \"127.0.0.1:{agg_console}\"\n\
             peer = \"http://127.0.0.1:{reg_console}/\"\n",
            rounds = o.rounds,
        ),
    )?;

    let root = registry_dir.join(fedfleet_registry::metadata::ROOT_JSON);
    let mut agent_configs = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let state = dir.join("agents").join(name);
        let pki = dir.join("pki");
        fedfleet_agent::daemon::enroll(
            &pki.join(format!("devices/{name}.crt")),
            &pki.join(format!("devices/{name}.key")),
            &pki.join("ca.crt"),
            &root,
            &state,
            false,
        )
        .with_context(|| format!("enrolling {name}"))?;
        let config = format!("agents/{name}.toml");
        write(
            dir,
            &config,
            &format!(
                "# fedfleet-agent {name}, written by `fedfleet init-local` (paths relative to this\n\
                 # file, as in every fedfleet config). Every key: edge-agent/src/config.rs.\n\
                 fleet = \"{fleet}\"\n\
                 state_dir = \"{name}\"          # identity/ (enrolled), store, agent.sock\n\
                 poll_interval_ms = 500\n\n\
                 # This device's own data: share {index} of {n} of the built-in digits set.\n\
                 [data]\n\
                 digits_partition = {{ clients = {n}, index = {i}, seed = 1 }}\n\n\
                 [participation]\n\
                 require_idle = false\n\n\
                 [health]\n\
                 max_latency_ms = 1000.0\n\n\
                 [backoff]\n\
                 base_ms = 500\n\
                 max_ms = 5000\n\n\
                 [aggregator]\n\
                 addr = \"127.0.0.1:{agg_port}\"\n\
                 server_name = \"{SERVER_NAME}\"\n\
                 receipt_key = \"../aggregator/receipt.pub\"\n\n\
                 [registry]\n\
                 addr = \"127.0.0.1:{reg_port}\"\n\
                 server_name = \"{SERVER_NAME}\"\n\
                 model = \"{MODEL}\"\n",
                index = i + 1,
            ),
        )?;
        agent_configs.push(config);
    }

    // A few held-out digits for `fedfleet-agent infer` (features as the agents train on them).
    let (_, test) = Dataset::digits_split().map_err(|e| anyhow::anyhow!("digits: {e}"))?;
    let width = test.features.len() / test.len();
    let mut rows = String::new();
    let take = 5.min(test.len());
    for r in 0..take {
        let row = &test.features[r * width..(r + 1) * width];
        let _ = writeln!(rows, "{}", row.iter().map(|v| format!("{v:.4}")).collect::<Vec<_>>().join(","));
    }
    write(dir, "rows.csv", &rows)?;
    Ok(LocalLayout { dir: dir.to_owned(), agent_configs, rows: "rows.csv".into(), labels: test.labels[..take].to_vec() })
}

fn write(dir: &Path, name: &str, text: &str) -> anyhow::Result<()> {
    let path = dir.join(name);
    fedfleet_aggregator::persist::write_atomic(&path, text.as_bytes()).with_context(|| format!("writing {}", path.display()))
}
