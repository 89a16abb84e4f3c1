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
    fedfleet_testkit::daemon::free_port([127, 0, 0, 1].into()).unwrap()
}

/// Zero weights of exactly `spec`'s layout, as a safetensors file's bytes.
fn weights_of(spec: &fedfleet_modelspec::ModelSpec) -> fedfleet_protocol::TensorBundle {
    let mut b = fedfleet_protocol::TensorBundle::new();
    for (name, shape) in spec.layout() {
        let n = shape.iter().product();
        b.insert_f32(name, shape, vec![0.0; n]).unwrap();
    }
    b
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
    let (port, mport, cport) = (free_port(), free_port(), free_port());
    let cfg = dir.path().join("registry.toml");
    std::fs::write(
        &cfg,
        format!(
            "listen = \"127.0.0.1:{port}\"\ndata_dir = \"data\"\npki_dir = \"pki\"\n\
             metrics = \"127.0.0.1:{mport}\"\nchunk_size = 65536\n[console]\nlisten = \"127.0.0.1:{cport}\"\n"
        ),
    )
    .unwrap();
    let spec_text = r#"{"arch":"mlp","input":[64],"hidden":[512],"classes":10}"#;
    let model_spec = fedfleet_modelspec::ModelSpec::from_json(spec_text).unwrap();
    let model = dir.path().join("model.safetensors");
    let weights = weights_of(&model_spec).encode();
    std::fs::write(&model, &weights).unwrap();
    let spec = dir.path().join("spec.json");
    std::fs::write(&spec, spec_text).unwrap();
    let (m, spec) = (model.to_str().unwrap(), spec.to_str().unwrap());

    let out = ok(&cfg, &["init-keys"]);
    assert!(out.contains("root v1"), "{out}");
    assert!(dir.path().join("data/root.json").exists());
    // Nothing serves: an operator command (a request to the console's API) says so, after
    // trying for a while, and creates no store.
    let o = run(&cfg, &["list"]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains(&format!("cannot reach the console at 127.0.0.1:{cport}")), "{err}");
    assert!(!dir.path().join("data/store").exists(), "an operator command created a store");
    let o = run(&cfg, &["check"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("no store at"), "{o:?}");

    let child = serve(&cfg, mport);
    let out = ok(&cfg, &["publish", m, "--model", "digits", "--spec", spec, "--metrics", "accuracy=0.91"]);
    assert!(out.starts_with("published digits v1"), "{out}");
    ok(&cfg, &["publish", m, "--model", "digits", "--spec", spec, "--parent", "1"]);

    // Weights that are not a model of their spec are refused, every problem named, and leave
    // nothing behind (issue 31 item 6): a NaN, a missing tensor, a wrong shape, an extra one.
    let layout: Vec<(String, Vec<usize>)> = model_spec.layout().into_iter().collect();
    let (nan, missing, misshapen) = (&layout[0].0, &layout[1].0, &layout[layout.len() - 1].0);
    let mut bad = fedfleet_protocol::TensorBundle::new();
    for (name, shape) in &layout {
        let n: usize = shape.iter().product();
        if name == missing {
            continue;
        }
        let shape = if name == misshapen { vec![n + 1] } else { shape.clone() };
        let mut v = vec![0.0; shape.iter().product()];
        if name == nan {
            v[3] = f32::NAN;
        }
        bad.insert_f32(name.clone(), shape, v).unwrap();
    }
    bad.insert_f32("extra.weight", vec![2], vec![1.0, 2.0]).unwrap();
    let bad_path = dir.path().join("bad.safetensors");
    std::fs::write(&bad_path, bad.encode()).unwrap();
    let o = run(&cfg, &["publish", bad_path.to_str().unwrap(), "--model", "digits", "--spec", spec]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    let n = layout[layout.len() - 1].1.iter().product::<usize>();
    let problems = [
        format!("missing {missing}"),
        format!("{misshapen} has shape [{}], expected {:?}", n + 1, layout[layout.len() - 1].1),
        "unexpected extra.weight".into(),
        format!("{nan} holds NaN"),
    ];
    for problem in problems {
        assert!(err.contains(&problem), "the refusal names {problem:?}: {err}");
    }
    // A spec that is not a model spec, and bytes that are not weights.
    let junk_spec = dir.path().join("junk-spec.json");
    std::fs::write(&junk_spec, r#"{"arch":"cnn"}"#).unwrap();
    let o = run(&cfg, &["publish", m, "--model", "digits", "--spec", junk_spec.to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("its spec is not a model spec"), "{o:?}");
    // A spec too costly to hold (4.3e9 parameters) is refused by name, before any weight is read.
    let costly_spec = dir.path().join("costly-spec.json");
    let layers = vec![r#"{"type":"linear","out_features":16384}"#; 16].join(",");
    std::fs::write(&costly_spec, format!(r#"{{"arch":"graph","input":[16384],"task":"regression","layers":[{layers}]}}"#)).unwrap();
    let o = run(&cfg, &["publish", m, "--model", "digits", "--spec", costly_spec.to_str().unwrap()]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("parameter values; the limit is 268435456"), "{o:?}");
    std::fs::write(&bad_path, vec![7u8; 1000]).unwrap();
    let o = run(&cfg, &["publish", bad_path.to_str().unwrap(), "--model", "digits", "--spec", spec]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("the artifact is not a tensor bundle"), "{o:?}");

    let out = ok(&cfg, &["alias", "set", "digits", "stable", "1"]);
    assert_eq!(out.trim(), "digits stable -> v1 (was unset)");
    let out = ok(&cfg, &["list"]);
    assert!(out.contains("v1") && out.contains("v2") && out.contains("[stable]") && !out.contains("v3"), "{out}");
    let out = ok(&cfg, &["show", "digits"]);
    assert!(out.starts_with("digits v2\n") && out.contains("parent:    v1"), "{out}");
    let v: serde_json::Value = serde_json::from_str(&ok(&cfg, &["--json", "show", "digits"])).unwrap();
    let chunks = weights.len().div_ceil(65536) as u64;
    assert_eq!((v["answer"].as_str(), v["version"].as_u64(), v["chunks"].as_u64()), (Some("version"), Some(2), Some(chunks)));
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

    // From another directory with no config at all: `--addr` (the console) and the operator's files.
    let elsewhere = tempfile::tempdir().unwrap();
    let op_cfg = elsewhere.path().join("operator.toml");
    std::fs::write(&op_cfg, format!("pki_dir = \"{}\"\n", dir.path().join("pki").display())).unwrap();
    let out = ok(&op_cfg, &["--addr", &format!("127.0.0.1:{cport}"), "rollout", "status", "r1"]);
    assert!(out.contains("paused"), "{out}");

    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let (status, text) = rt.block_on(fedfleet_http::scrape(([127, 0, 0, 1], mport).into(), "/metrics")).unwrap();
    assert_eq!(status, 200);
    // The publishes came through the console, not as QUIC requests; their refusals are counted alike.
    assert!(!text.contains("fedfleet_registry_requests_total{kind=\"admin_publish\"}"), "{text}");
    assert!(text.contains("fedfleet_registry_rejections_total{reason=\"not_a_model\"} 4"), "{text}");
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
