use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use fedfleet_certs::Pki;
use fedfleet_protocol::FleetId;

fn run(cfg: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fedfleet-registry")).arg("--config").arg(cfg).args(args).env("RUST_LOG", "warn").output().unwrap()
}

fn ok(cfg: &Path, args: &[&str]) -> String {
    let o = run(cfg, args);
    assert!(o.status.success(), "{args:?}: {}\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap()
}

fn free_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn free_tcp_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Starts `fedfleet-registry serve` and waits for its metrics port.
fn serve(cfg: &Path, mport: u16) -> std::process::Child {
    let child = Command::new(env!("CARGO_BIN_EXE_fedfleet-registry"))
        .arg("--config")
        .arg(cfg)
        .arg("serve")
        .env("RUST_LOG", "warn")
        .spawn()
        .unwrap();
    let start = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", mport)).is_err() {
        assert!(start.elapsed() < Duration::from_secs(20), "serve did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    child
}

/// SIGTERM: graceful shutdown, exit 0.
fn stop(mut child: std::process::Child) {
    Command::new("kill").arg("-TERM").arg(child.id().to_string()).status().unwrap();
    let start = Instant::now();
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            assert!(st.success(), "{st:?}");
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(15), "serve did not stop on SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn operator_cli_talks_to_the_running_registry_only() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::init(dir.path().join("pki"), &FleetId::new("cli-fleet").unwrap(), 30, false).unwrap();
    pki.issue_server("registry", &[], 30, false).unwrap();
    pki.issue_server("operator", &[], 30, false).unwrap();
    let (port, mport) = (free_port(), free_tcp_port());
    let cfg = dir.path().join("registry.toml");
    std::fs::write(
        &cfg,
        format!(
            "listen = \"127.0.0.1:{port}\"\ndata_dir = \"data\"\npki_dir = \"pki\"\n\
             metrics = \"127.0.0.1:{mport}\"\nchunk_size = 65536\n"
        ),
    )
    .unwrap();
    let model = dir.path().join("model.safetensors");
    std::fs::write(&model, vec![7u8; 200_000]).unwrap();
    let spec = dir.path().join("spec.json");
    std::fs::write(&spec, r#"{"arch":"cnn","input":[1,28,28]}"#).unwrap();
    let m = model.to_str().unwrap();

    let out = ok(&cfg, &["init-keys"]);
    assert!(out.contains("root v1"), "{out}");
    assert!(dir.path().join("data/root.json").exists());
    // Nothing serves: an operator command says so and creates no store.
    let o = run(&cfg, &["list"]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains(&format!("connecting to the registry at 127.0.0.1:{port}")), "{err}");
    assert!(!dir.path().join("data/store").exists(), "an operator command created a store");
    let o = run(&cfg, &["check"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("no store at"), "{o:?}");

    let child = serve(&cfg, mport);
    let out = ok(&cfg, &["publish", m, "--model", "digits", "--spec", spec.to_str().unwrap(), "--metrics", "accuracy=0.91"]);
    assert!(out.starts_with("published digits v1"), "{out}");
    ok(&cfg, &["publish", m, "--model", "digits", "--parent", "1"]);
    let out = ok(&cfg, &["alias", "set", "digits", "stable", "1"]);
    assert_eq!(out.trim(), "digits stable -> v1 (was unset)");
    let out = ok(&cfg, &["list"]);
    assert!(out.contains("v1") && out.contains("v2") && out.contains("[stable]"), "{out}");
    let out = ok(&cfg, &["show", "digits"]);
    assert!(out.starts_with("digits v2\n") && out.contains("parent:    v1"), "{out}");
    let v: serde_json::Value = serde_json::from_str(&ok(&cfg, &["--json", "show", "digits"])).unwrap();
    assert_eq!((v["answer"].as_str(), v["version"].as_u64(), v["chunks"].as_u64()), (Some("version"), Some(2), Some(4)));
    let out = ok(&cfg, &["rollout", "start", "--model", "digits", "--version", "2", "--phases", "10,100", "--soak", "1h", "--id", "r1"]);
    assert!(out.starts_with("rollout r1: digits stable -> v2 (from v1), running (phase 1 of 2)"), "{out}");
    let out = ok(&cfg, &["rollout", "pause", "r1"]);
    assert!(out.contains("paused (phase 1 of 2)"), "{out}");
    let o = run(&cfg, &["show", "nosuch"]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.starts_with("fedfleet-registry: ") && err.trim_end().lines().count() == 1, "{err}");
    let out = ok(&cfg, &["device", "status"]);
    assert_eq!(out.trim(), "no device has reported");

    // From another directory with no config at all: `--addr` and the operator's files.
    let elsewhere = tempfile::tempdir().unwrap();
    let op_cfg = elsewhere.path().join("operator.toml");
    std::fs::write(&op_cfg, format!("pki_dir = \"{}\"\n", dir.path().join("pki").display())).unwrap();
    let out = ok(&op_cfg, &["--addr", &format!("127.0.0.1:{port}"), "rollout", "status", "r1"]);
    assert!(out.contains("paused"), "{out}");

    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let (status, text) = rt.block_on(fedfleet_http::scrape(([127, 0, 0, 1], mport).into(), "/metrics")).unwrap();
    assert_eq!(status, 200);
    assert!(text.contains("fedfleet_registry_requests_total{kind=\"admin_publish\"} 2"), "{text}");
    stop(child);

    // The store outlives the process: a restart serves the same versions.
    let child = serve(&cfg, mport);
    let out = ok(&cfg, &["list"]);
    assert!(out.contains("v2"), "{out}");
    stop(child);
    let out = ok(&cfg, &["check", "--deep"]);
    assert!(out.starts_with("ok: 2 versions"), "{out}");
}

#[test]
fn example_config_parses() {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("registry.example.toml");
    let c = fedfleet_registry::config::Config::load(&p).unwrap();
    assert_eq!(c.operators, ["operator", "aggregator"]);
    assert_eq!(c.chunk_size, 1 << 20);
}
