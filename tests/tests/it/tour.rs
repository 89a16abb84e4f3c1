//! The README's Quick tour, run as written: the `sh` block under "## Quick tour" is taken from
//! README.md itself (so the docs cannot rot), its build and `export PATH` lines replaced by the
//! binaries this test run built, and executed by bash in a fresh directory. It goes through
//! `init-local`, the three kinds of process, a campaign, a rollout, `infer` and a revocation;
//! every `--wait` fails the script on a bad outcome. Then the results are checked from outside:
//! the agents run the campaign's last model, `infer` predicts the held-out rows with it, and no
//! process logged an ERROR line for what was a normal run.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::procs::bin;

const TOUR_TIMEOUT: Duration = Duration::from_secs(600);

/// The commands of the README's Quick tour block, minus the lines that build or locate binaries.
fn tour_commands(readme: &str) -> Vec<String> {
    let section = readme.split("\n## Quick tour").nth(1).expect("README.md has a \"## Quick tour\" section");
    let block = section.split("```sh\n").nth(1).expect("the Quick tour has a ```sh block");
    let block = block.split("\n```").next().unwrap();
    block.lines().filter(|l| !l.starts_with("cargo ") && !l.starts_with("export PATH=")).map(str::to_owned).collect()
}

#[test]
fn readme_quick_tour_runs_as_written() {
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md")).unwrap();
    let commands = tour_commands(&readme);
    assert!(commands.iter().any(|c| c.starts_with("fedfleet init-local")), "{commands:#?}");
    let bin_dir = bin("fedfleet").parent().unwrap().to_owned();
    for name in ["fedfleet-registry", "fedfleet-aggregator", "fedfleet-agent", "fedfleet-certs"] {
        bin(name); // fails with how to build it
    }
    let work = tempfile::Builder::new().prefix("tour-").tempdir().unwrap();
    // The EXIT trap waits for the daemons it stops: the checks below open the agent's store,
    // which a daemon still shutting down holds locked.
    let script = format!(
        "set -euo pipefail\nset -x\nexport PATH=\"{}:$PATH\"\nexport NO_COLOR=1\n\
         trap 'kill $(jobs -p) 2>/dev/null || true; wait' EXIT\n{}\n",
        bin_dir.display(),
        commands.join("\n")
    );
    std::fs::write(work.path().join("tour.sh"), &script).unwrap();
    let stdout = std::fs::File::create(work.path().join("tour.out")).unwrap();
    let stderr = std::fs::File::create(work.path().join("tour.err")).unwrap();
    let mut child =
        Command::new("bash").arg("tour.sh").current_dir(work.path()).stdin(Stdio::null()).stdout(stdout).stderr(stderr).spawn().unwrap();
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if t0.elapsed() > TOUR_TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let out = std::fs::read_to_string(work.path().join("tour.out")).unwrap_or_default();
    let err = std::fs::read_to_string(work.path().join("tour.err")).unwrap_or_default();
    let fleet = work.path().join("my-fleet");
    let logs = read_logs(&fleet.join("logs"));
    let report = format!("stdout:\n{out}\nstderr (commands and CLI logs):\n{err}\nservice and agent logs:\n{logs}");
    match status {
        Some(s) => assert!(s.success(), "the README tour failed ({s}):\n{report}"),
        None => panic!("the README tour did not finish in {TOUR_TIMEOUT:?}:\n{report}"),
    }
    eprintln!("README tour took {:.1} s", t0.elapsed().as_secs_f64());

    // The tour's results, checked from outside: the canary agent runs the last global model
    // and predicts the held-out rows with it (from its store, the daemons are stopped).
    let infer = Command::new(bin("fedfleet-agent"))
        .args(["infer", "--config", "agents/agent-1.toml", "--input", "rows.csv"])
        .current_dir(&fleet)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let predictions = String::from_utf8_lossy(&infer.stdout);
    assert!(infer.status.success(), "{predictions}\n{}", String::from_utf8_lossy(&infer.stderr));
    let (_, test) = fedfleet_learning::Dataset::digits_split().unwrap();
    let labels: Vec<u32> = predictions.lines().filter_map(|l| l.split(',').next()?.parse().ok()).collect();
    assert_eq!(labels.len(), 5, "one prediction per row of rows.csv:\n{predictions}");
    let right = labels.iter().zip(&test.labels).filter(|(a, b)| a == b).count();
    assert!(right >= 3, "the trained model gets {right} of 5 held-out digits right:\n{predictions}");
    assert!(out.contains("model digits v4") || out.contains("version 4"), "the agents did not report v4:\n{report}");
    assert!(out.contains("\"revoked\": true"), "the registry's device status does not mark agent-3 revoked:\n{report}");

    // A normal run (start, training, rollout, a revocation, SIGTERM) logs no ERROR line.
    let errors: Vec<&str> = logs.lines().filter(|l| l.contains(" ERROR ")).collect();
    assert!(errors.is_empty(), "ERROR lines in a normal run:\n{}\n\n{report}", errors.join("\n"));
}

fn read_logs(dir: &Path) -> String {
    let mut names: Vec<_> = std::fs::read_dir(dir).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default();
    names.sort();
    let mut all = String::new();
    for p in names {
        let text = std::fs::read_to_string(&p).unwrap_or_default();
        for line in text.lines() {
            all.push_str(&format!("{}: {line}\n", p.file_name().unwrap().to_string_lossy()));
        }
    }
    all
}
