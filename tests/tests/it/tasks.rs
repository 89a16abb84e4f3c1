//! Regression and anomaly detection through the real services: `init-local`'s deployment with
//! the model, the data and the server-side validation set swapped for the task's, agents reading
//! `.npy` files from their `[data]`, a campaign whose global models the aggregator scores with the
//! task's metric (RMSE, published with each version), a rollout whose health checks compare that
//! metric, and inference answering with values or anomaly scores.

use fedfleet_learning::files::write_npy;
use fedfleet_learning::{Dataset, ModelSpec, Partition};

use crate::deployment::{Deployment, write_rows};

fn spec(json: &str) -> ModelSpec {
    ModelSpec::from_json(json).unwrap()
}

/// Writes `data` as `<name>-x.npy` (and `<name>-y.npy` with its targets) in the deployment.
fn write_arrays(d: &Deployment, name: &str, data: &Dataset) -> String {
    let x = d.path(&format!("{name}-x.npy"));
    write_npy(&x, &[data.len(), data.example_len()], &data.features).unwrap();
    if data.targets.is_empty() {
        return format!("features = {:?}", x.display().to_string());
    }
    let y = d.path(&format!("{name}-y.npy"));
    write_npy(&y, &[data.len(), data.targets_per_example()], &data.targets).unwrap();
    format!("features = {:?}, labels = {:?}", x.display().to_string(), y.display().to_string())
}

/// A deployment of 3 agents whose model, data and validation set are the task's.
fn deployment(model: &ModelSpec, train: &Dataset, validation: &Dataset, campaign: &[(&str, &str)]) -> Deployment {
    let mut d = Deployment::init(3);
    d.set_spec(model);
    d.set("aggregator.toml", "validation", &format!("{{ {} }}", write_arrays(&d, "validation", validation)));
    for (key, value) in campaign {
        d.set("aggregator.toml", key, value);
    }
    d.cli("fedfleet-aggregator", &["init-model", "--config", "aggregator.toml"]);
    for (i, part) in Partition::Iid.split_dataset(train, 3, 1).iter().enumerate() {
        let source = format!("npy = {{ {} }}", write_arrays(&d, &format!("agent-{}", i + 1), part));
        d.set_agent_data(i + 1, &source);
    }
    d.start("fedfleet-agent");
    d
}

fn rollout(d: &Deployment, version: usize) -> String {
    d.start_rollout(version as u64, 3, &["--wait"])
}

#[test]
fn regression_trains_over_rounds_and_the_health_check_compares_rmse() {
    let (train, test) = fedfleet::datasets::diabetes().unwrap().split(0.2, 3);
    let model = spec(
        r#"{"arch":"graph","input":[10],"task":"regression",
            "layers":[{"type":"linear","out_features":32},{"type":"relu"},{"type":"linear","out_features":1}]}"#,
    );
    let rounds = 5;
    let mut d =
        deployment(&model, &train, &test, &[("rounds", "5"), ("local_epochs", "5"), ("batch_size", "16"), ("learning_rate", "0.05")]);
    d.cli("fedfleet-aggregator", &["campaign", "start", "--config", "aggregator.toml", "--wait"]);

    // The aggregator scored every global model on the held-out patients.
    let rmse = d.version_metrics("digits", "rmse");
    eprintln!("held-out RMSE by version: {rmse:.3?}");
    assert_eq!(rmse.len(), rounds + 1);
    assert!(rmse[rounds] < 0.5 * rmse[0] && rmse[rounds] < rmse[1], "RMSE does not improve over rounds: {rmse:?}");

    // Installed everywhere after a health check on -RMSE; inference answers with values.
    rollout(&d, rounds + 1);
    write_rows(&d.path("test.csv"), &test);
    let out = d.cli("fedfleet-agent", &["infer", "--config", "agents/agent-1.toml", "--input", "test.csv"]);
    let predicted: Vec<f64> = out.lines().map(|l| l.parse().unwrap()).collect();
    assert_eq!(predicted.len(), test.len());
    let served = (predicted.iter().zip(&test.targets).map(|(p, t)| (p - *t as f64).powi(2)).sum::<f64>() / test.len() as f64).sqrt();
    assert!((served - rmse[rounds]).abs() < 1e-3, "served RMSE {served} vs published {}", rmse[rounds]);

    // A worse model (the untrained one, published as the next version) fails the health check
    // on RMSE and is rolled back; the active model keeps serving.
    d.cli(
        "fedfleet-registry",
        &["--config", "registry.toml", "publish", "aggregator/initial.safetensors", "--model", "digits", "--spec", &spec_file(&d, &model)],
    );
    let v = (rounds + 2).to_string();
    let args = [
        "--config",
        "registry.toml",
        "rollout",
        "start",
        "--model",
        "digits",
        "--version",
        &v,
        "--phases",
        "100",
        "--soak",
        "1s",
        "--min-healthy",
        "3",
        "--min-sample",
        "3",
        "--wait",
    ];
    let refused = std::process::Command::new("timeout")
        .arg("300")
        .arg(crate::procs::bin("fedfleet-registry"))
        .args(args)
        .current_dir(&d.dir)
        .output()
        .unwrap();
    assert!(!refused.status.success(), "the rollout of a worse model succeeded");
    let logs = d.agent_logs();
    assert!(
        logs.contains("health check failed: holdout -rmse"),
        "no agent refused the worse model on its RMSE:\n{}",
        logs.lines().filter(|l| l.contains("health") || l.contains("rolled")).collect::<Vec<_>>().join("\n")
    );
    let status = d.cli("fedfleet-agent", &["status", "--config", "agents/agent-1.toml"]);
    assert!(status.contains(&format!("\"version\": {}", rounds + 1)), "agent-1 no longer runs the trained model:\n{status}");
    d.stop_agents();
}

fn spec_file(d: &Deployment, model: &ModelSpec) -> String {
    let path = d.path("model.spec.json");
    std::fs::write(&path, model.to_json()).unwrap();
    path.display().to_string()
}

#[test]
fn an_autoencoder_learns_normal_sensor_windows_and_scores_anomalies() {
    let (train, _) = fedfleet::datasets::sensor_windows(900, 16, 1, None);
    let (validation, _) = fedfleet::datasets::sensor_windows(200, 16, 2, None);
    let model = spec(
        r#"{"arch":"graph","input":[16],"task":"reconstruction",
            "layers":[{"type":"linear","out_features":32},{"type":"tanh"},{"type":"linear","out_features":6},
                      {"type":"linear","out_features":32},{"type":"tanh"},{"type":"linear","out_features":16}]}"#,
    );
    let rounds = 6;
    let mut d =
        deployment(&model, &train, &validation, &[("rounds", "6"), ("local_epochs", "5"), ("batch_size", "16"), ("learning_rate", "0.1")]);
    d.cli("fedfleet-aggregator", &["campaign", "start", "--config", "aggregator.toml", "--wait"]);
    let rmse = d.version_metrics("digits", "rmse");
    eprintln!("validation reconstruction RMSE by version: {rmse:.3?}");
    assert!(rmse[rounds] < 0.6 * rmse[0], "reconstruction does not improve over rounds: {rmse:?}");

    rollout(&d, rounds + 1);
    let (probe, anomalous) = fedfleet::datasets::sensor_windows(120, 16, 3, Some(3));
    write_rows(&d.path("probe.csv"), &probe);
    let out = d.cli("fedfleet-agent", &["infer", "--config", "agents/agent-1.toml", "--input", "probe.csv"]);
    let scores: Vec<f64> = out.lines().map(|l| l.parse().unwrap()).collect();
    assert_eq!(scores.len(), probe.len());
    // AUROC of the anomaly score: the chance that an anomalous window outscores a normal one.
    let (pos, neg): (Vec<_>, Vec<_>) = scores.iter().zip(&anomalous).partition(|(_, a)| **a);
    let wins: f64 = pos
        .iter()
        .map(|(p, _)| {
            neg.iter()
                .map(|(n, _)| {
                    if p > n {
                        1.0
                    } else if p == n {
                        0.5
                    } else {
                        0.0
                    }
                })
                .sum::<f64>()
        })
        .sum();
    let auroc = wins / (pos.len() * neg.len()) as f64;
    eprintln!("anomaly score AUROC over {} windows ({} anomalous): {auroc:.3}", scores.len(), pos.len());
    assert!(auroc > 0.9, "anomaly scores do not separate the injected anomalies: AUROC {auroc:.3}");
    d.stop_agents();
}
