//! Issue 31's must-show: a deployment laid out as on separate hosts. A CA directory runs
//! `fedfleet-certs`; the registry, the aggregator, the operator and each device get a directory
//! of their own holding only what `fedfleet-certs bundle --role …` gives their role, the files
//! other hosts hand them (`root.json`, `receipt.pub`) and their own config with relative paths.
//! Every operator command runs in the operator's directory, over the network.
//!
//! [`a_deployment_on_separate_hosts_fails_safe`] walks defects 1–5 of the issue in one
//! deployment: a rollout of a bad model aborts and `stable` stays (and a device enrolled
//! afterwards installs `stable`), a revoked device's next update is refused at ingest once only
//! the signed `revoked.json` reached the aggregator, a changed spec is refused at start with what
//! changed, the agents join round 1 of a fresh aggregator instance, and `fedfleet-registry list
//! --addr` answers from the remote registry without creating a store.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use fedfleet_protocol::DeviceStatus;

use crate::multiprocess::{STEP_TIMEOUT, one_at_a_time};
use crate::procs::{Proc, bin, cli, count_lines, free_tcp_port, free_udp_port, sample, scrape, wait_for};

const FLEET: &str = "plant7";
const MODEL: &str = "digits";
const SPEC: &str = r#"{"arch":"mlp","input":[64],"hidden":[64],"classes":10}"#;
/// `SPEC` as the aggregator's config writes it, and with a narrower hidden layer (a changed spec).
const MLP: &str = r#"{ arch = "mlp", input = [64], hidden = [64], classes = 10 }"#;
const NARROWER: &str = r#"{ arch = "mlp", input = [64], hidden = [32], classes = 10 }"#;
/// `SPEC`'s layers as a graph (the same tensor names) fine-tuned with LoRA: DEPLOYMENT.md's switch.
const LORA: &str = r#"{ arch = "graph", input = [64], task = "classification", layers = [{ type = "flatten" }, { type = "linear", name = "fc1", out_features = 64 }, { type = "relu" }, { type = "linear", name = "fc2", out_features = 10 }], finetune = { mode = "lora", rank = 4, alpha = 8 } }"#;

struct Hosts {
    root: PathBuf,
    reg_addr: SocketAddr,
    agg_addr: SocketAddr,
    reg_metrics: SocketAddr,
    agg_metrics: SocketAddr,
    /// The services' consoles (HTTPS, credentials needed even from loopback): the operator's
    /// commands are requests to their APIs.
    reg_console: SocketAddr,
    agg_console: SocketAddr,
    registry: Option<Proc>,
    aggregator: Option<Proc>,
    agents: Vec<Option<Proc>>,
    _dir: tempfile::TempDir,
}

fn device(i: usize) -> String {
    format!("sensor-{i:03}")
}

/// Copies `from` (a file) into the directory `to`.
fn copy_into(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    std::fs::copy(from, to.join(from.file_name().unwrap())).unwrap_or_else(|e| panic!("copying {}: {e}", from.display()));
}

/// Every file under `dir`, relative to it, sorted.
fn files_under(dir: &Path) -> Vec<String> {
    fn walk(base: &Path, d: &Path, out: &mut Vec<String>) {
        for e in std::fs::read_dir(d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(base, &p, out);
            } else {
                out.push(p.strip_prefix(base).unwrap().display().to_string());
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

impl Hosts {
    fn host(&self, name: &str) -> PathBuf {
        self.root.join(name)
    }

    fn log(&self, name: &str) -> PathBuf {
        self.root.join("logs").join(format!("{name}.log"))
    }

    /// `fedfleet-certs --dir pki ARGS` on the CA host.
    fn ca(&self, args: &[&str]) -> String {
        let mut all = vec!["--dir", "pki"];
        all.extend_from_slice(args);
        cli("fedfleet-certs", &all, &self.host("ca"))
    }

    /// Enrols device `i` on the CA host and hands it its bundle, the registry's `root.json` and
    /// the aggregator's `receipt.pub`; `devices.json` goes to both service hosts.
    fn enroll(&self, i: usize) {
        let name = device(i);
        self.ca(&["enroll-device", "--id", &name]);
        self.ca(&["bundle", "--role", "device", "--id", &name, "--out", &format!("out/{name}")]);
        let host = self.host(&name);
        std::fs::rename(self.host("ca").join("out").join(&name), &host).unwrap();
        copy_into(&self.host("registry").join("data/root.json"), &host);
        copy_into(&self.host("aggregator").join("data/receipt.pub"), &host);
        for service in ["registry", "aggregator"] {
            copy_into(&self.host("ca").join("pki/devices.json"), &self.host(service).join(format!("{service}-pki")));
        }
        cli(
            "fedfleet-agent",
            &[
                "enroll",
                "--cert",
                &format!("devices/{name}.crt"),
                "--key",
                &format!("devices/{name}.key"),
                "--ca",
                "ca.crt",
                "--root",
                "root.json",
                "--state-dir",
                "state",
            ],
            &host,
        );
        std::fs::write(
            host.join("agent.toml"),
            format!(
                "fleet = \"{FLEET}\"\nstate_dir = \"state\"\npoll_interval_ms = 200\n\
                 [data]\ndigits_partition = {{ clients = 4, index = {}, seed = 1 }}\n\
                 [participation]\nrequire_idle = true\nstatus_file = \"conditions.json\"\n\
                 [health]\nmax_latency_ms = 10000.0\n[backoff]\nbase_ms = 200\nmax_ms = 1000\n\
                 [aggregator]\naddr = \"{}\"\nserver_name = \"localhost\"\nreceipt_key = \"receipt.pub\"\n\
                 [registry]\naddr = \"{}\"\nserver_name = \"localhost\"\nmodel = \"{MODEL}\"\n",
                i - 1,
                self.agg_addr,
                self.reg_addr
            ),
        )
        .unwrap();
        self.set_idle(i, true);
    }

    fn set_idle(&self, i: usize, idle: bool) {
        let path = self.host(&device(i)).join("conditions.json");
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, format!("{{\"idle\":{idle},\"charging\":true,\"fresh_samples\":1000}}")).unwrap();
        std::fs::rename(&tmp, &path).unwrap();
    }

    fn start_agent(&mut self, i: usize) {
        let name = device(i);
        let p = Proc::spawn(
            &[],
            &name,
            "fedfleet-agent",
            &["run", "--config", "agent.toml"],
            &self.host(&name),
            &self.log(&name),
            "info,fedfleet_agent_core::lifecycle=debug",
        );
        self.agents[i] = Some(p);
    }

    fn status(&self, i: usize) -> Option<DeviceStatus> {
        let text = std::fs::read_to_string(self.host(&device(i)).join("state/status.json")).ok()?;
        serde_json::from_str(&text).ok()
    }

    /// Starts a service in its host directory and waits for its metrics endpoint.
    fn start_service(&self, service: &str, args: &[&str], metrics: SocketAddr) -> Proc {
        let mut p = Proc::spawn(&[], service, &format!("fedfleet-{service}"), args, &self.host(service), &self.log(service), "info");
        wait_for(&format!("the {service} to serve"), STEP_TIMEOUT, || {
            p.assert_running();
            scrape(metrics)
        });
        p
    }

    fn start_aggregator(&mut self) {
        self.aggregator = Some(self.start_service("aggregator", &["serve", "--config", "aggregator.toml"], self.agg_metrics));
    }

    /// An operator command in the operator's directory: `fedfleet-<tool> <args>` with the
    /// operator's config for that service and its console's address.
    fn operator(&self, tool: &str, args: &[&str]) -> std::process::Output {
        let addr = if tool == "registry" { self.reg_console } else { self.agg_console }.to_string();
        let config = format!("operator-{tool}.toml");
        let mut cmd = Command::new("timeout");
        cmd.arg("300").arg(bin(&format!("fedfleet-{tool}"))).current_dir(self.host("operator")).env("RUST_LOG", "warn");
        if tool == "registry" {
            cmd.args(["--config", &config, "--addr", &addr]).args(args);
        } else {
            // `campaign <action> [options]`: the connection options follow the action.
            cmd.args(&args[..2]).args(["--config", &config, "--addr", &addr]).args(&args[2..]);
        }
        cmd.output().unwrap()
    }

    fn operator_ok(&self, tool: &str, args: &[&str]) -> String {
        let o = self.operator(tool, args);
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        assert!(o.status.success(), "`fedfleet-{tool} {}` failed: {out}\n{}", args.join(" "), String::from_utf8_lossy(&o.stderr));
        out
    }

    fn registry_json(&self, args: &[&str]) -> serde_json::Value {
        let mut all = vec!["--json"];
        all.extend_from_slice(args);
        let out = self.operator_ok("registry", &all);
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?}: {e}: {out}"))
    }

    fn latest_version(&self) -> u64 {
        self.registry_json(&["show", MODEL])["version"].as_u64().expect("show names the version")
    }

    fn stable(&self) -> Option<u64> {
        let list = self.registry_json(&["list"]);
        let model = list["models"].as_array().and_then(|m| m.iter().find(|m| m["name"] == MODEL)).cloned();
        model.and_then(|m| m["aliases"]["stable"].as_u64())
    }

    fn agg_metric(&self, selector: &str) -> f64 {
        sample(&wait_for("the aggregator's metrics", STEP_TIMEOUT, || scrape(self.agg_metrics)), selector).unwrap_or(0.0)
    }
}

/// The CA, the registry and the aggregator hosts, with three devices enrolled; the services
/// run, the agents do not yet.
fn stand_up() -> Hosts {
    let dir = tempfile::Builder::new().prefix("hosts-").tempdir().unwrap();
    let root = dir.path().to_owned();
    eprintln!("hosts: working directory {}", root.display());
    for d in ["ca", "logs", "operator"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    let localhost = |port: u16| -> SocketAddr { ([127, 0, 0, 1], port).into() };
    let mut h = Hosts {
        reg_addr: localhost(free_udp_port()),
        agg_addr: localhost(free_udp_port()),
        reg_metrics: localhost(free_tcp_port()),
        agg_metrics: localhost(free_tcp_port()),
        reg_console: localhost(free_tcp_port()),
        agg_console: localhost(free_tcp_port()),
        root,
        registry: None,
        aggregator: None,
        agents: (0..=4).map(|_| None).collect(),
        _dir: dir,
    };

    // The CA host: the PKI, then one directory per host.
    h.ca(&["init", "--fleet", FLEET]);
    for name in ["registry", "aggregator", "operator"] {
        h.ca(&["issue-server", "--name", name]);
    }
    for role in ["registry", "aggregator", "operator"] {
        h.ca(&["bundle", "--role", role, "--out", &format!("out/{role}-pki")]);
        let host = h.host(if role == "operator" { "operator" } else { role });
        std::fs::create_dir_all(&host).unwrap();
        std::fs::rename(h.host("ca").join(format!("out/{role}-pki")), host.join(format!("{role}-pki"))).unwrap();
    }
    assert!(!files_under(&h.host("aggregator")).iter().any(|f| f.ends_with("ca.key")), "the aggregator host holds no CA key");
    assert_eq!(
        files_under(&h.host("operator")),
        ["operator-pki/ca.crt", "operator-pki/servers/operator.crt", "operator-pki/servers/operator.key"]
    );

    // The registry host.
    std::fs::write(
        h.host("registry").join("registry.toml"),
        format!(
            "listen = \"{}\"\ndata_dir = \"data\"\npki_dir = \"registry-pki\"\nmetrics = \"{}\"\noperators = [\"operator\", \"aggregator\"]\n{}",
            h.reg_addr,
            h.reg_metrics,
            console(h.reg_console)
        ),
    )
    .unwrap();
    cli("fedfleet-registry", &["--config", "registry.toml", "init-keys"], &h.host("registry"));
    h.registry = Some(h.start_service("registry", &["--config", "registry.toml", "serve"], h.reg_metrics));

    // The aggregator host.
    std::fs::write(h.host("aggregator").join("aggregator.toml"), aggregator_config(&h, "data", MLP)).unwrap();
    cli("fedfleet-aggregator", &["init-model", "--config", "aggregator.toml", "--seed", "7"], &h.host("aggregator"));
    h.start_aggregator();

    // The operator host: a config per service naming its PKI directory and the service's console.
    for (tool, addr) in [("registry", h.reg_console), ("aggregator", h.agg_console)] {
        std::fs::write(h.host("operator").join(format!("operator-{tool}.toml")), format!("pki_dir = \"operator-pki\"\n{}", console(addr)))
            .unwrap();
    }
    std::fs::write(h.host("operator").join("spec.json"), SPEC).unwrap();

    for i in 1..=3 {
        h.enroll(i);
    }
    h
}

fn aggregator_config(h: &Hosts, data_dir: &str, spec: &str) -> String {
    format!(
        "listen = \"{}\"\npki_dir = \"aggregator-pki\"\nserver_name = \"aggregator\"\ndata_dir = \"{data_dir}\"\n\
         metrics_addr = \"{}\"\noperators = [\"operator\"]\n\
         [publish]\nregistry = \"{}\"\nserver_name = \"localhost\"\n\
         [model]\nname = \"{MODEL}\"\nspec = {spec}\n\
         initial = \"initial.safetensors\"\nvalidation = \"digits\"\n\
         [campaign]\nrounds = 1\ntarget = 3\nquorum = 3\ndeadline_secs = 300\nextension_secs = 60\n\
         local_epochs = 5\nbatch_size = 32\nlr = 0.3\n{}",
        h.agg_addr,
        h.agg_metrics,
        h.reg_addr,
        console(h.agg_console)
    )
}

/// A console over HTTPS that asks every caller, loopback included, for credentials: as on a
/// host of its own.
fn console(addr: SocketAddr) -> String {
    format!("[console]\nlisten = \"{addr}\"\ntls = true\nloopback = \"none\"\n")
}

#[test]
fn a_deployment_on_separate_hosts_fails_safe() {
    let _serial = one_at_a_time();
    let mut h = stand_up();
    for i in 1..=3 {
        h.start_agent(i);
    }

    // A campaign from the operator's host, then a rollout of its model to every device.
    let out = h.operator_ok("aggregator", &["campaign", "start", "--rounds", "1", "--seed", "1", "--wait"]);
    assert!(out.contains("campaign round 1 completed"), "{out}");
    let good = h.latest_version();

    // Defect 5: the registry's operator commands answer from the remote registry and open no
    // store on the operator's host.
    let list = String::from_utf8_lossy(&h.operator("registry", &["list"]).stdout).into_owned();
    assert!(list.contains(MODEL) && list.contains(&format!("v{good}")), "{list}");
    assert!(
        !files_under(&h.host("operator")).iter().any(|f| f.starts_with("data") || f.starts_with("registry-data")),
        "an operator command created a store: {:?}",
        files_under(&h.host("operator"))
    );

    let good_s = good.to_string();
    let out = h.operator_ok(
        "registry",
        &["rollout", "start", "--model", MODEL, "--version", &good_s, "--phases", "100", "--soak", "1s", "--id", "good", "--wait"],
    );
    assert!(out.contains("completed"), "{out}");
    assert_eq!(h.stable(), Some(good));

    // Defect 1: a bad model (the untrained initial weights) rolled out in two phases with the
    // default gate: every device that tries it rolls back, the rollout aborts (an empty first
    // phase widens on its soak; with no outcome at all it would stall at its deadline), the
    // command fails, and `stable` does not move.
    let bad = h.host("operator").join("untrained.safetensors");
    std::fs::copy(h.host("aggregator").join("initial.safetensors"), &bad).unwrap();
    h.operator_ok("registry", &["publish", "untrained.safetensors", "--model", MODEL, "--spec", "spec.json", "--parent", &good_s]);
    let bad_version = h.latest_version();
    let o = h.operator(
        "registry",
        &[
            "rollout",
            "start",
            "--model",
            MODEL,
            "--version",
            &bad_version.to_string(),
            "--phases",
            "34,100",
            "--soak",
            "2s",
            "--deadline",
            "30s",
            "--id",
            "bad",
            "--wait",
        ],
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(!o.status.success(), "the bad model's rollout succeeded: {out}");
    assert!(out.contains("aborted") || out.contains("stalled"), "{out}");
    assert_eq!(h.stable(), Some(good), "stable moved to the bad model");
    let status = h.registry_json(&["rollout", "status", "bad"]);
    assert_eq!(status["healthy"].as_u64(), Some(0), "{status}");
    for i in 1..=3 {
        wait_for(&format!("{} back on v{good}", device(i)), STEP_TIMEOUT, || {
            h.status(i).and_then(|s| s.active).is_some_and(|a| a.version.0 == good).then_some(())
        });
    }

    // A device enrolled now, with no model yet, installs `stable` and never the bad version.
    h.enroll(4);
    h.start_agent(4);
    wait_for("the new device to run stable", STEP_TIMEOUT, || {
        h.status(4).and_then(|s| s.active).is_some_and(|a| a.version.0 == good).then_some(())
    });
    assert_eq!(count_lines(&h.log(&device(4)), &format!("v{bad_version}")), 0, "the new device heard of the bad version");

    // Defect 2: sensor-003 is revoked while it waits in an open round; only the signed
    // `revoked.json` reaches the aggregator's host. Its next contact (its update at ingest, or a
    // poll on the connection it made before the revocation) is refused as revoked, and counted.
    // sensor-004 sits this out until the refusal is counted: the round cannot fill without it.
    h.set_idle(3, false);
    h.set_idle(4, false);
    h.operator_ok("aggregator", &["campaign", "start", "--rounds", "1", "--target", "3", "--quorum", "3", "--seed", "2"]);
    wait_for("sensor-003 to hear of the round", STEP_TIMEOUT, || (count_lines(&h.log(&device(3)), "not joining round") > 0).then_some(()));
    h.ca(&["revoke", "--id", &device(3), "--reason", "lost on site"]);
    copy_into(&h.host("ca").join("pki/revoked.json"), &h.host("aggregator").join("aggregator-pki"));
    copy_into(&h.host("ca").join("pki/revoked.json"), &h.host("registry").join("registry-pki"));
    h.set_idle(3, true);
    wait_for("sensor-003 refused as revoked", STEP_TIMEOUT, || {
        (h.agg_metric("fedfleet_aggregator_updates_rejected_total{reason=\"revoked\"}") >= 1.0).then_some(())
    });
    wait_for("sensor-003 to report itself revoked", STEP_TIMEOUT, || {
        h.status(3)
            .is_some_and(|s| matches!(&s.state, fedfleet_protocol::DeviceState::Failed { reason } if reason.contains("revoked")))
            .then_some(())
    });
    h.set_idle(4, true);
    wait_for("the round to complete without sensor-003", Duration::from_secs(120), || {
        (h.agg_metric("fedfleet_aggregator_rounds_total{event=\"published\"}") >= 2.0).then_some(())
    });

    // Defect 3: the spec changed under the same data_dir: the aggregator refuses to start and
    // says what changed.
    h.aggregator.take().unwrap().stop();
    let config = h.host("aggregator").join("aggregator.toml");
    std::fs::write(&config, aggregator_config(&h, "data", NARROWER)).unwrap();
    let o = Command::new(bin("fedfleet-aggregator"))
        .args(["serve", "--config", "aggregator.toml"])
        .current_dir(h.host("aggregator"))
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("model.spec changed since global model"), "{err}");

    // Defect 4, as DEPLOYMENT.md's switch from full fine-tuning to LoRA: the trained weights
    // are exported from the stopped aggregator's data_dir (under the config it was written
    // with), and a LoRA spec over them starts a fresh instance (a new data_dir, the same receipt
    // key). Round ids start over; the agents join its first round and train the adapters.
    let on_aggregator_host = |args: &[&str]| cli("fedfleet-aggregator", args, &h.host("aggregator"));
    std::fs::write(&config, aggregator_config(&h, "data", MLP)).unwrap();
    on_aggregator_host(&["export-model", "--config", "aggregator.toml", "--out", "base.safetensors"]);
    std::fs::write(&config, aggregator_config(&h, "data2", LORA)).unwrap();
    on_aggregator_host(&["init-model", "--config", "aggregator.toml", "--pretrained", "base.safetensors"]);
    for f in ["receipt.key", "receipt.pub"] {
        copy_into(&h.host("aggregator").join("data").join(f), &h.host("aggregator").join("data2"));
    }
    h.start_aggregator();
    let before = h.latest_version();
    let out =
        h.operator_ok("aggregator", &["campaign", "start", "--rounds", "1", "--target", "3", "--quorum", "3", "--seed", "3", "--wait"]);
    assert!(out.contains("campaign round 1 completed"), "{out}");
    let fresh = [1, 2, 4].iter().filter(|&&i| count_lines(&h.log(&device(i)), "a fresh aggregator instance") > 0).count();
    assert!(fresh >= 3, "every agent that took part says it followed the fresh instance ({fresh} of 3)");
    // The registry holds the LoRA round's model with its adapters merged, and says so.
    let lora = h.latest_version();
    assert!(lora > before, "the LoRA campaign published (v{before} before, v{lora} now)");
    let list = h.operator_ok("registry", &["list"]);
    assert!(list.lines().any(|l| l.contains(&format!("v{lora} ")) && l.contains("(LoRA, merged)")), "{list}");

    // The revoked device is told once and slowed down, not let in: it warns once, and knocks
    // ever less often (its poll interval doubles up to an hour), not every 200 ms.
    let log3 = h.log(&device(3));
    assert_eq!(count_lines(&log3, "refuse this certificate as revoked"), 1, "{}", crate::procs::tail(&log3, 20));
    let knocks = count_lines(&h.log("registry"), "refused revoked device certificate")
        + count_lines(&h.log("aggregator"), "refused revoked device certificate");
    assert!(knocks < 40, "the revoked device knocked {knocks} times");

    for a in h.agents.iter_mut().flatten() {
        a.stop();
    }
}
