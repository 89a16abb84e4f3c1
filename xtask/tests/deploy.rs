//! The deployment files stay valid (issue 28.4): the Kubernetes manifests under `deploy/k8s`
//! against the Kubernetes API schemas (`kubernetes-validate --strict`, offline: the PyPI package
//! bundles the schemas; `.ci/run` installs it), and the NATS node config under `deploy/nats` as
//! `nats-server -t` parses it. Each fails under `CI` when its tool is missing and skips with a
//! note elsewhere.

use std::path::{Path, PathBuf};
use std::process::Command;

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask/ has a parent").join("deploy")
}

/// `tool` on PATH or in the sbin directories, or `None` (a panic under `CI`).
fn tool(name: &str, install: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let found =
        std::env::split_paths(&path).chain(["/usr/sbin", "/usr/local/sbin"].map(PathBuf::from)).map(|d| d.join(name)).find(|p| p.is_file());
    if found.is_none() {
        assert!(std::env::var_os("CI").is_none(), "{name} is not installed; CI must install it ({install})");
        eprintln!("NOTE: {name} not found; skipping (install: {install})");
    }
    found
}

#[test]
fn kubernetes_manifests_validate_against_the_api_schemas() {
    let Some(validate) = tool("kubernetes-validate", "pip install kubernetes-validate") else { return };
    let mut manifests: Vec<PathBuf> = std::fs::read_dir(deploy_dir().join("k8s")).unwrap().map(|e| e.unwrap().path()).collect();
    manifests.sort();
    assert!(manifests.len() >= 3, "{manifests:?}");
    let out = Command::new(validate).arg("--strict").args(&manifests).output().unwrap();
    let report = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{report}");
    for kind in ["statefulset/fedfleet-aggregator", "statefulset/fedfleet-registry", "namespace/fedfleet"] {
        assert!(report.contains(&format!("passed for resource {kind}")), "{kind} was not validated:\n{report}");
    }
}

#[test]
fn the_nats_node_config_parses() {
    let Some(nats) = tool("nats-server", "apt-get install nats-server") else { return };
    let dir = tempfile::tempdir().unwrap();
    // The config as shipped, with its /etc/nats/pki pointed at a fresh fleet PKI.
    let pki_dir = dir.path().join("pki");
    let fleet = fedfleet_protocol::FleetId::new("acme").unwrap();
    let pki = fedfleet_certs::Pki::init(&pki_dir, &fleet, fedfleet_certs::LEAF_DAYS, false).unwrap();
    pki.issue_server("broker", &[], fedfleet_certs::LEAF_DAYS, false).unwrap();
    let conf = std::fs::read_to_string(deploy_dir().join("nats/nats-node.conf")).unwrap();
    assert!(conf.contains("/etc/nats/pki/"), "{conf}");
    std::fs::write(dir.path().join("nats.conf"), conf.replace("/etc/nats/pki", pki_dir.to_str().unwrap())).unwrap();
    std::fs::write(
        dir.path().join("fleet-authorization.conf"),
        "authorization { users = [ { user: \"CN=aggregator,OU=service,O=acme\" } ] }\n",
    )
    .unwrap();
    let out = Command::new(nats).current_dir(dir.path()).args(["-c", "nats.conf", "-t"]).output().unwrap();
    assert!(out.status.success(), "{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
}

/// The Grafana dashboard (`deploy/grafana/fedfleet.json`, issue 30.4) is a dashboard document
/// whose every query names metrics the services export (their metric tables in
/// `aggregator/src/metrics.rs` and `registry/src/metrics.rs`), so a renamed metric cannot leave
/// a panel silently empty.
#[test]
fn the_grafana_dashboard_queries_only_exported_metrics() {
    let root = deploy_dir().parent().expect("the repository").to_owned();
    let text = std::fs::read_to_string(deploy_dir().join("grafana/fedfleet.json")).unwrap();
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let exported: String =
        ["aggregator/src/metrics.rs", "registry/src/metrics.rs"].iter().map(|p| std::fs::read_to_string(root.join(p)).unwrap()).collect();
    let panels = dashboard["panels"].as_array().expect("panels");
    let mut queries = 0;
    for panel in panels {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().expect("every target has a PromQL expr");
            queries += 1;
            let mut rest = expr;
            while let Some(at) = rest.find("fedfleet_") {
                let name: String = rest[at..].chars().take_while(|c| c.is_ascii_lowercase() || *c == '_').collect();
                assert!(exported.contains(&format!("`{name}`")), "panel {:?} queries {name}, which no service exports", panel["title"]);
                rest = &rest[at + name.len()..];
            }
        }
    }
    assert!(queries >= 15, "{queries} queries");
}
