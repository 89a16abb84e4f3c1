//! A local deployment written by `fedfleet init-local` and run as real processes, for tests that
//! change its model, data or campaign first: the registry, the aggregator and N agents on
//! loopback, steered through the operator CLIs.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use crate::procs::{Proc, cli};

pub struct Deployment {
    _work: tempfile::TempDir,
    pub dir: PathBuf,
    pub agents: usize,
    /// `init-local --base-port`: the aggregator's QUIC port; the registry's console is `+ 4`,
    /// the aggregator's `+ 5`.
    pub base_port: u16,
    services: Vec<Proc>,
    pub agent_procs: Vec<Proc>,
}

/// A TOML inline value for a JSON value (the configs are TOML, specs JSON).
pub fn toml_inline(v: &serde_json::Value) -> String {
    use serde_json::Value::*;
    match v {
        Null => "\"\"".into(),
        Bool(b) => b.to_string(),
        Number(n) => n.to_string(),
        String(s) => format!("{s:?}"),
        Array(a) => format!("[{}]", a.iter().map(toml_inline).collect::<Vec<_>>().join(", ")),
        Object(o) => format!("{{ {} }}", o.iter().map(|(k, v)| format!("{k} = {}", toml_inline(v))).collect::<Vec<_>>().join(", ")),
    }
}

impl Deployment {
    /// `fedfleet init-local` with `agents` agents, on six ports of its own.
    pub fn init(agents: usize) -> Deployment {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        // Consecutive ports below the ephemeral range (32768), apart from the README tour's 7400:
        // 16 deployments of one test process at once, each with six ports (eight apart).
        let base = 20_000 + (std::process::id() % 90) * 128 + NEXT.fetch_add(1, Ordering::SeqCst) % 16 * 8;
        let work = tempfile::Builder::new().prefix("deployment-").tempdir().unwrap();
        let dir = work.path().join("fleet");
        let n = agents.to_string();
        cli("fedfleet", &["init-local", dir.to_str().unwrap(), "--agents", &n, "--base-port", &base.to_string()], work.path());
        Deployment { _work: work, dir, agents, base_port: base as u16, services: Vec::new(), agent_procs: Vec::new() }
    }

    /// Replaces the line starting with `key = ` in the config `file` by `key = value`.
    pub fn set(&self, file: &str, key: &str, value: &str) {
        let path = self.dir.join(file);
        let text = std::fs::read_to_string(&path).unwrap();
        let prefix = format!("{key} = ");
        let line = text.lines().find(|l| l.starts_with(&prefix)).unwrap_or_else(|| panic!("{file} has no `{key}` line")).to_owned();
        std::fs::write(&path, text.replace(&line, &format!("{key} = {value}"))).unwrap();
    }

    /// Appends `text` (a section, say) to the config `file`, after a blank line.
    pub fn append(&self, file: &str, text: &str) {
        let path = self.dir.join(file);
        let old = std::fs::read_to_string(&path).unwrap();
        std::fs::write(&path, format!("{old}\n{text}")).unwrap();
    }

    /// The aggregator's `[model] spec`.
    pub fn set_spec(&self, spec: &fedfleet_learning::ModelSpec) {
        let json: serde_json::Value = serde_json::from_str(&spec.to_json()).unwrap();
        self.set("aggregator.toml", "spec", &toml_inline(&json));
    }

    /// Agent `i`'s (1-based) `[data]` source, replacing its digits partition.
    pub fn set_agent_data(&self, i: usize, source: &str) {
        let file = format!("agents/agent-{i}.toml");
        let text = std::fs::read_to_string(self.dir.join(&file)).unwrap();
        let line = text.lines().find(|l| l.starts_with("digits_partition = ")).unwrap().to_owned();
        std::fs::write(self.dir.join(&file), text.replace(&line, source)).unwrap();
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.join(rel)
    }

    pub fn log(&self, name: &str) -> PathBuf {
        self.dir.join("logs").join(format!("{name}.log"))
    }

    /// Runs a CLI in the deployment directory; panics unless it succeeds. Returns stdout.
    pub fn cli(&self, bin: &str, args: &[&str]) -> String {
        cli(bin, args, &self.dir)
    }

    fn spawn_registry(&self) -> Proc {
        Proc::spawn(&[], "registry", "fedfleet-registry", &["--config", "registry.toml", "serve"], &self.dir, &self.log("registry"), "info")
    }

    /// Kills the registry (SIGKILL; the first service [`Deployment::start`] started).
    pub fn kill_registry(&mut self) {
        self.services[0].sigkill();
    }

    /// Starts the registry again after [`Deployment::kill_registry`].
    pub fn restart_registry(&mut self) {
        self.services[0] = self.spawn_registry();
    }

    fn spawn_agent(&self, i: usize, agent_bin: &str) -> Proc {
        let name = format!("agent-{i}");
        let config = format!("agents/{name}.toml");
        Proc::spawn(&[], &name, agent_bin, &["run", "--config", &config], &self.dir, &self.log(&name), "info")
    }

    /// Stops agent `i` (1-based; SIGTERM, a clean exit) and starts it again, reading its config anew.
    pub fn restart_agent(&mut self, i: usize, agent_bin: &str) {
        self.agent_procs[i - 1].stop();
        self.agent_procs[i - 1] = self.spawn_agent(i, agent_bin);
    }

    /// Starts the registry, the aggregator and the agents (`agent_bin run --config ...`).
    pub fn start(&mut self, agent_bin: &str) {
        self.start_services();
        self.start_agents(1..=self.agents, agent_bin);
    }

    /// Starts the agents `which` (1-based).
    pub fn start_agents(&mut self, which: std::ops::RangeInclusive<usize>, agent_bin: &str) {
        for i in which {
            let agent = self.spawn_agent(i, agent_bin);
            self.agent_procs.push(agent);
        }
    }

    /// Starts the registry and the aggregator.
    pub fn start_services(&mut self) {
        let dir = self.dir.clone();
        self.services.push(self.spawn_registry());
        self.services.push(Proc::spawn(
            &[],
            "aggregator",
            "fedfleet-aggregator",
            &["serve", "--config", "aggregator.toml"],
            &dir,
            &self.log("aggregator"),
            "info",
        ));
    }

    /// `fedfleet-registry rollout start` of `digits` v`version` to the whole fleet in one phase
    /// (1 s soak, at least `min_healthy` healthy devices), plus `extra` (`--wait`, `--id ID`).
    pub fn start_rollout(&self, version: u64, min_healthy: usize, extra: &[&str]) -> String {
        let (v, healthy) = (version.to_string(), min_healthy.to_string());
        let mut args = vec!["--config", "registry.toml", "rollout", "start", "--model", "digits", "--version", &v];
        args.extend(["--phases", "100", "--soak", "1s", "--min-healthy", &healthy]);
        args.extend(extra);
        self.cli("fedfleet-registry", &args)
    }

    /// The `metric` of every version of the model in the registry, oldest first.
    pub fn version_metrics(&self, model: &str, metric: &str) -> Vec<f64> {
        self.versions(model)
            .iter()
            .map(|record| record["metrics"][metric].as_f64().unwrap_or_else(|| panic!("a version has no {metric} metric: {record}")))
            .collect()
    }

    /// The record (`fedfleet-registry show --json`) of every version of the model, oldest first.
    pub fn versions(&self, model: &str) -> Vec<serde_json::Value> {
        let list: serde_json::Value =
            serde_json::from_str(&self.cli("fedfleet-registry", &["--config", "registry.toml", "--json", "show", model])).unwrap();
        let latest = list["version"].as_u64().expect("show names the version");
        (1..=latest)
            .map(|v| {
                let out =
                    self.cli("fedfleet-registry", &["--config", "registry.toml", "--json", "show", model, "--version", &v.to_string()]);
                serde_json::from_str(&out).unwrap()
            })
            .collect()
    }

    /// Every agent's log.
    pub fn agent_logs(&self) -> String {
        (1..=self.agents).map(|i| std::fs::read_to_string(self.log(&format!("agent-{i}"))).unwrap_or_default()).collect()
    }

    /// How many times the agents' logs say `line`, once they say it `n` times or 60 s passed:
    /// a campaign is over when the aggregator publishes, before every agent heard back.
    pub fn agent_lines(&self, line: &str, n: usize) -> usize {
        let end = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let seen = self.agent_logs().matches(line).count();
            if seen >= n || std::time::Instant::now() >= end {
                return seen;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }

    /// Stops the agents with SIGTERM (each must exit cleanly); the services are killed on drop.
    pub fn stop_agents(&mut self) {
        for mut a in self.agent_procs.drain(..) {
            a.stop();
        }
    }
}

/// Writes CSV rows for `fedfleet-agent infer`.
pub fn write_rows(path: &Path, data: &fedfleet_learning::Dataset) {
    use std::fmt::Write as _;
    let mut rows = String::new();
    for i in 0..data.len() {
        let _ = writeln!(rows, "{}", data.example(i).iter().map(|v| format!("{v}")).collect::<Vec<_>>().join(","));
    }
    std::fs::write(path, rows).unwrap();
}
