//! The binary's errors are one line with a non-zero exit.

use std::process::Command;

#[test]
fn missing_config_is_a_one_line_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_fedfleet-aggregator"))
        .args(["serve", "--config", "/nonexistent/aggregator.toml"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("fedfleet-aggregator: cannot read /nonexistent/aggregator.toml"), "{err}");
}

/// A team's pre-trained PyTorch state_dict becomes the campaign's initial model in one command;
/// one that does not fit the spec is refused with the mismatch named.
#[test]
fn init_model_imports_a_pretrained_state_dict_and_names_a_mismatch() {
    use fedfleet_learning::{ModelSpec, interop, model::init_bundle};
    let dir = tempfile::tempdir().unwrap();
    let spec = ModelSpec::Mlp { input: vec![8], hidden: vec![4], classes: 3 };
    let pretrained = init_bundle(&spec, 99).unwrap();
    let state_dict = dir.path().join("pretrained.safetensors");
    std::fs::write(&state_dict, interop::export_state_dict(&spec, &pretrained).unwrap()).unwrap();
    let config = dir.path().join("aggregator.toml");
    let initial = dir.path().join("models/initial.safetensors");
    std::fs::write(
        &config,
        format!(
            "listen = \"127.0.0.1:0\"\npki_dir = \"pki\"\ndata_dir = \"data\"\n[model]\nname = \"m\"\n\
             spec = {{ arch = \"mlp\", input = [8], hidden = [4], classes = 3 }}\ninitial = {initial:?}\n"
        ),
    )
    .unwrap();
    let run = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_fedfleet-aggregator"))
            .args(["init-model", "--config", config.to_str().unwrap()])
            .args(extra)
            .output()
            .unwrap()
    };
    let out = run(&["--pretrained", state_dict.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let written = fedfleet_protocol::TensorBundle::decode(&std::fs::read(&initial).unwrap(), &Default::default()).unwrap();
    assert_eq!(written, pretrained, "the initial model is the pre-trained weights, in a directory init-model created");

    let other = ModelSpec::Mlp { input: vec![8], hidden: vec![5], classes: 3 };
    std::fs::write(&state_dict, interop::export_state_dict(&other, &init_bundle(&other, 1).unwrap()).unwrap()).unwrap();
    let out = run(&["--pretrained", state_dict.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("does not fit model.spec") && err.contains("fc1.weight"), "{err}");

    // `export-model` reads a data_dir's global model (the hosts test exports a trained one); a
    // data_dir that was never written is named, and not created.
    let out = Command::new(env!("CARGO_BIN_EXE_fedfleet-aggregator"))
        .args(["export-model", "--config", config.to_str().unwrap(), "--out", "base.safetensors"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("holds no aggregator state"), "{err}");
    assert!(!dir.path().join("data").exists() && !dir.path().join("base.safetensors").exists());
}

/// Issue 31, defect 11: `init-model` on a spec of 16 layers of 16384×16384 (4.3e9 parameters,
/// 17 GB of f32) is refused by name before anything is allocated, here under a 2 GB address-space
/// cap (`ulimit -v`): without the bound it dies on the allocation instead.
#[test]
fn a_spec_too_costly_to_hold_is_refused_by_name_under_a_memory_cap() {
    let dir = tempfile::tempdir().unwrap();
    let layers = vec![r#"{ type = "linear", out_features = 16384 }"#; 16].join(", ");
    std::fs::write(
        dir.path().join("aggregator.toml"),
        format!(
            "listen = \"127.0.0.1:0\"\npki_dir = \"pki\"\ndata_dir = \"data\"\n[model]\nname = \"m\"\n\
             spec = {{ arch = \"graph\", input = [16384], task = \"regression\", layers = [{layers}] }}\ninitial = \"initial.safetensors\"\n"
        ),
    )
    .unwrap();
    let out = Command::new("bash")
        .arg("-c")
        .arg(format!("ulimit -v 2000000 && exec {} init-model --config aggregator.toml", env!("CARGO_BIN_EXE_fedfleet-aggregator")))
        .current_dir(dir.path())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("parameter values; the limit is 268435456"), "{err}");
    assert!(!dir.path().join("initial.safetensors").exists());
}

/// Starts `serve` on a minimal config whose `[compute]` asks for `device`, with the Vulkan loader
/// and the EGL (OpenGL) loader pointed at no driver (so a wgpu build finds no adapter either);
/// returns (exit code, stderr).
fn serve_with_compute_device(device: &str) -> (Option<i32>, String) {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("aggregator.toml");
    let d = dir.path().display();
    std::fs::write(
        &config,
        format!(
            "listen = \"127.0.0.1:0\"\npki_dir = \"{d}/pki\"\ndata_dir = \"{d}/data\"\nmetrics_addr = \"127.0.0.1:0\"\n\
             [model]\nname = \"m\"\nspec = {{ arch = \"mlp\", input = [8], hidden = [4], classes = 3 }}\n\
             initial = \"{d}/initial.safetensors\"\n[compute]\nfold = \"tensor\"\ndevice = \"{device}\"\n"
        ),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_fedfleet-aggregator"))
        .args(["serve", "--config", config.to_str().unwrap()])
        .env("VK_ICD_FILENAMES", "/nonexistent/icd.json")
        .env("VK_DRIVER_FILES", "/nonexistent/icd.json")
        .env("__EGL_VENDOR_LIBRARY_FILENAMES", "/nonexistent/egl.json")
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// `[compute] device = "gpu"` with no adapter refuses to start, in one line naming what it
/// looked for (a default build says which feature it lacks).
#[test]
fn gpu_device_without_an_adapter_is_a_one_line_error() {
    let (code, err) = serve_with_compute_device("gpu");
    assert_eq!(code, Some(2), "{err}");
    let last = err.lines().last().unwrap_or_default();
    assert!(last.starts_with("fedfleet-aggregator: compute device gpu"), "{err}");
    if cfg!(feature = "wgpu") {
        assert!(last.contains("no wgpu adapter found") && last.contains("Vulkan"), "{err}");
    } else {
        assert!(last.contains("`wgpu` feature"), "{err}");
    }
    assert!(!err.contains("panicked"), "{err}");
}

/// `auto` without an adapter folds on the CPU: the start goes past the device (it stops later, at
/// the missing PKI), with a warning in a wgpu build.
#[test]
fn auto_device_without_an_adapter_falls_back_to_the_cpu() {
    let (code, err) = serve_with_compute_device("auto");
    assert_eq!(code, Some(2), "{err}");
    assert!(!err.contains("compute device gpu:") || err.contains("WARN"), "{err}");
    assert!(err.lines().last().unwrap_or_default().contains("pki"), "stopped at the PKI, after the device:\n{err}");
    if cfg!(feature = "wgpu") {
        assert!(err.contains("no GPU adapter, folding on the CPU"), "{err}");
    }
}

/// Issue 31 defect 7: `campaign start --wait` prints every round the campaign completed, the
/// last one included, numbered within the campaign, then exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn campaign_wait_reports_every_round_including_the_last() {
    use crate::support::*;
    use fedfleet_aggregator::client::UploadOutcome;
    use fedfleet_protocol::{DType, RoundAnnouncement};
    let fleet = Fleet::new(1);
    let console = fedfleet_http::console::ConsoleConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        tls: false,
        tokens: None,
        loopback: Default::default(),
        peer: None,
    };
    let cfg = fedfleet_aggregator::config::Config { console: Some(console), ..fleet.config("wait", 1, 3) };
    let svc = start(cfg.clone()).await;
    let toml = fleet.write_toml(&cfg);
    let console = svc.console_addr.expect("the console is bound").to_string();
    let child = Command::new(env!("CARGO_BIN_EXE_fedfleet-aggregator"))
        .args(["campaign", "start", "--config", toml.to_str().unwrap(), "--addr", &console, "--wait", "--rounds", "3"])
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let d = fleet.device_client(0, svc.addr).await;
    let mut done = 0;
    let t0 = std::time::Instant::now();
    while done < 3 {
        assert!(t0.elapsed() < std::time::Duration::from_secs(60), "rounds did not complete");
        let info = d.current_round().await.unwrap();
        let Some(ann) = info.announcement else {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            continue;
        };
        let ann: RoundAnnouncement = ann.verify(&info.receipt_key).unwrap().clone();
        if ann.round.0 as usize <= done {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            continue;
        }
        let payload = delta(ann.round.0).encode();
        let h = header(
            &fleet.fleet,
            &dev(0),
            ann.round,
            ann.base_model.digest,
            nonce(0, ann.round.0),
            10,
            &payload,
            DType::F32,
            &fleet.device_key(0),
        );
        assert!(matches!(d.upload(&h, &payload).await.unwrap(), UploadOutcome::Accepted(_)));
        done += 1;
    }
    let out = tokio::time::timeout(std::time::Duration::from_secs(30), tokio::task::spawn_blocking(move || child.wait_with_output()))
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    for k in 1..=3 {
        assert!(text.contains(&format!("campaign round {k} completed: global model version {}", k + 1)), "{text}");
    }
    assert!(text.contains("no campaign running (last: completed)"), "{text}");
    svc.stop().await;
}

/// `broker-access` writes the fleet's broker rules from the PKI: under NATS one user per enrolled
/// device, a revoked device left out; under mosquitto the ACL names the CRL that refuses it, and
/// a missing CRL is an error; a service name that is not a name is refused.
#[test]
fn broker_access_writes_the_rules_and_leaves_revoked_devices_out() {
    use fedfleet_certs::{LEAF_DAYS, Pki};
    use fedfleet_protocol::{DeviceId, FleetId};
    let dir = tempfile::tempdir().unwrap();
    let pki_dir = dir.path().join("pki");
    let pki = Pki::init(&pki_dir, &FleetId::new("acme").unwrap(), LEAF_DAYS, false).unwrap();
    for id in ["cam-1", "cam-2"] {
        pki.enroll_device(&DeviceId::new(id).unwrap(), LEAF_DAYS, false).unwrap();
    }
    pki.revoke(&DeviceId::new("cam-2").unwrap(), "lost").unwrap();
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_fedfleet-aggregator"))
            .args(["broker-access", "--pki", pki_dir.to_str().unwrap()])
            .args(args)
            .output()
            .unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (code, nats, err) = run(&["--broker", "nats"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(nats.contains("user: \"CN=cam-1,OU=device,O=acme\""), "{nats}");
    assert!(nats.contains("\"fedfleet.v1.acme.devices.cam-1.updates\""), "{nats}");
    assert!(!nats.contains("cam-2"), "a revoked device keeps no broker user:\n{nats}");
    for service in ["aggregator", "registry"] {
        assert!(nats.contains(&format!("user: \"CN={service},OU=service,O=acme\"")), "{nats}");
    }
    let (code, acl, _) = run(&["--broker", "mosquitto", "--service", "aggregator"]);
    assert_eq!(code, Some(0));
    assert!(acl.contains("pattern write fedfleet/v1/acme/devices/%u/status") && acl.contains("user aggregator\n"), "{acl}");
    assert!(!acl.contains("user registry"), "{acl}");
    assert!(acl.contains("# Revoked devices: 1 (revoked.json version 2), refused at the handshake by crlfile ca.crl"), "{acl}");
    std::fs::remove_file(pki.crl_path()).unwrap();
    let (code, _, err) = run(&["--broker", "mosquitto"]);
    assert_ne!(code, Some(0));
    assert!(err.contains("ca.crl: missing, so a broker reading it would let revoked devices in; run `fedfleet-certs crl`"), "{err}");
    let (code, _, err) = run(&["--broker", "nats", "--service", "bad name"]);
    assert_ne!(code, Some(0));
    assert!(err.contains("service name \"bad name\""), "{err}");
}
