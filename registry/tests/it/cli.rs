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

#[test]
fn operator_cli_offline_then_through_the_running_service() {
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

    // Offline: nothing runs, the CLI opens the store itself.
    let out = ok(&cfg, &["init-keys"]);
    assert!(out.contains("root v1"), "{out}");
    assert!(dir.path().join("data/root.json").exists());
    let out = ok(&cfg, &["publish", m, "--model", "digits", "--spec", spec.to_str().unwrap(), "--metrics", "accuracy=0.91"]);
    assert!(out.starts_with("published digits v1"), "{out}");
    ok(&cfg, &["publish", m, "--model", "digits", "--parent", "1"]);
    ok(&cfg, &["alias", "set", "digits", "stable", "1"]);
    let out = ok(&cfg, &["list"]);
    assert!(out.contains("v1") && out.contains("v2") && out.contains("[stable]"), "{out}");
    let out = ok(&cfg, &["show", "digits"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!((v["version"].as_u64(), v["chunks"].as_u64()), (Some(2), Some(4)));
    let out = ok(&cfg, &["rollout", "start", "--model", "digits", "--version", "2", "--phases", "10,100", "--soak", "1h", "--id", "r1"]);
    assert!(out.contains("\"running\""), "{out}");
    let out = ok(&cfg, &["rollout", "pause", "r1"]);
    assert!(out.contains("\"paused\""), "{out}");
    let o = run(&cfg, &["show", "nosuch"]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.starts_with("fedfleet-registry: ") && err.trim_end().lines().count() == 1, "{err}");

    // Online: `serve` holds the store; the same commands go over QUIC with the operator cert.
    let mut child = Command::new(env!("CARGO_BIN_EXE_fedfleet-registry"))
        .arg("--config")
        .arg(&cfg)
        .arg("serve")
        .env("RUST_LOG", "warn")
        .spawn()
        .unwrap();
    let start = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", mport)).is_err() {
        assert!(start.elapsed() < Duration::from_secs(20), "serve did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = ok(&cfg, &["publish", m, "--model", "digits"]);
    assert!(out.starts_with("published digits v3"), "{out}");
    let out = ok(&cfg, &["rollout", "status", "r1"]);
    assert!(out.contains("\"paused\""), "{out}");
    ok(&cfg, &["rollout", "resume", "r1"]);
    let out = ok(&cfg, &["device", "status"]);
    assert!(out.contains("devices"), "{out}");

    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let (status, text) = rt.block_on(fedfleet_http::scrape(([127, 0, 0, 1], mport).into(), "/metrics")).unwrap();
    assert_eq!(status, 200);
    assert!(text.contains("fedfleet_registry_requests_total{kind=\"admin_publish\"} 1"), "{text}");

    // SIGTERM: graceful shutdown, exit 0.
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
    // And offline again afterwards.
    let out = ok(&cfg, &["list"]);
    assert!(out.contains("v3"), "{out}");
}

#[test]
fn example_config_parses() {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("registry.example.toml");
    let c = fedfleet_registry::config::Config::load(&p).unwrap();
    assert_eq!(c.operators, ["operator", "aggregator"]);
    assert_eq!(c.chunk_size, 1 << 20);
}
