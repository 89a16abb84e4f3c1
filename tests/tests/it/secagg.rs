//! Secure aggregation through the real processes: the registry, the aggregator with
//! `[secure_aggregation]` and five `fedfleet-agent` daemons. The same five agents first run a
//! plain round from the same initial model, which gives each agent's clear update (from the
//! aggregator's payload segment while the round is open) and shows that the scan below finds
//! every one of them there. The secure round then publishes the same model (to the grid's
//! resolution), and after it no 32-byte window of any agent's clear update is anywhere in the
//! aggregator's data directory (its sled database, payload segments, published models) or log.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use fedfleet_protocol::{BundleLimits, TensorBundle};

use crate::deployment::Deployment;
use crate::procs::{count_lines, tail, wait_for};

const AGENTS: usize = 5;
/// Windows of each agent's update the scan looks for.
const WINDOWS: usize = 8;
/// SecAgg+ over the five agents: four neighbours each.
const SECURE_AGGREGATION: &str = "[secure_aggregation]\ndegree = 4\n";

/// One round over the five agents. The target is above the fleet, so the round stays open (its
/// updates on disk) until its deadline, then publishes with its quorum of all five.
fn deployment(initial: Option<&Path>) -> Deployment {
    let d = Deployment::init(AGENTS);
    d.set("aggregator.toml", "rounds", "1");
    d.set("aggregator.toml", "target", &(AGENTS + 1).to_string());
    d.set("aggregator.toml", "quorum", &AGENTS.to_string());
    d.set("aggregator.toml", "deadline_secs", "30");
    if let Some(initial) = initial {
        std::fs::copy(initial, d.path("aggregator/initial.safetensors")).unwrap();
    }
    d
}

fn campaign(d: &Deployment) -> std::thread::JoinHandle<String> {
    let dir = d.dir.clone();
    std::thread::spawn(move || {
        crate::procs::cli("fedfleet-aggregator", &["campaign", "start", "--config", "aggregator.toml", "--seed", "11", "--wait"], &dir)
    })
}

/// Every file under `dir`.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() { out.extend(files(&p)) } else { out.push(p) }
    }
    out
}

/// The clear updates in the aggregator's payload segments (`digest | len u64 LE | payload`).
fn segment_updates(data_dir: &Path) -> Vec<Vec<f32>> {
    let mut updates = Vec::new();
    for seg in files(&data_dir.join("updates")).into_iter().filter(|p| p.extension().is_some_and(|e| e == "seg")) {
        let bytes = std::fs::read(&seg).unwrap();
        let mut at = 0;
        while at + 40 <= bytes.len() {
            let len = u64::from_le_bytes(bytes[at + 32..at + 40].try_into().unwrap()) as usize;
            let payload = &bytes[at + 40..at + 40 + len];
            updates.push(TensorBundle::decode(payload, &BundleLimits::default()).expect("a stored update decodes").flat_f32());
            at += 40 + len;
        }
    }
    updates
}

/// Up to [`WINDOWS`] windows of 8 consecutive coordinates (32 bytes as stored, f32 LE), each with
/// no zero in it (a zero run would match any file's padding).
fn needles(update: &[f32]) -> Vec<[u8; 32]> {
    let candidates: Vec<&[f32]> = update.chunks_exact(8).filter(|w| w.iter().all(|x| *x != 0.0)).collect();
    let stride = (candidates.len() / WINDOWS).max(1);
    candidates
        .into_iter()
        .step_by(stride)
        .map(|w| {
            let mut out = [0u8; 32];
            for (o, x) in out.chunks_exact_mut(4).zip(w) {
                o.copy_from_slice(&x.to_le_bytes());
            }
            out
        })
        .take(WINDOWS)
        .collect()
}

/// Which of `needles` occur in any of `paths`.
fn found(paths: &[PathBuf], needles: &[[u8; 32]]) -> Vec<bool> {
    let mut by_prefix: HashMap<[u8; 8], Vec<usize>> = HashMap::new();
    for (i, n) in needles.iter().enumerate() {
        by_prefix.entry(n[..8].try_into().unwrap()).or_default().push(i);
    }
    let mut hit = vec![false; needles.len()];
    for p in paths {
        let bytes = std::fs::read(p).unwrap_or_default();
        for w in bytes.windows(32) {
            if let Some(ids) = by_prefix.get(&w[..8]) {
                for &i in ids {
                    hit[i] |= needles[i] == *w;
                }
            }
        }
    }
    hit
}

#[test]
fn a_secure_round_publishes_the_plain_rounds_model_and_stores_no_agents_update() {
    // The plain round: each agent's clear update, read while the round is open.
    let mut plain = deployment(None);
    plain.start("fedfleet-agent");
    let run = campaign(&plain);
    let log = plain.log("aggregator");
    wait_for("the five updates", Duration::from_secs(120), || (count_lines(&log, "update accepted") >= AGENTS).then_some(()));
    let updates = segment_updates(&plain.path("aggregator"));
    assert_eq!(updates.len(), AGENTS, "one stored update per agent");
    let per_agent: Vec<Vec<[u8; 32]>> = updates.iter().map(|u| needles(u)).collect();
    let all: Vec<[u8; 32]> = per_agent.iter().flatten().copied().collect();
    assert!(per_agent.iter().all(|n| n.len() >= WINDOWS / 2), "every update gives windows to look for");
    let mut plain_files = files(&plain.path("aggregator"));
    plain_files.push(log.clone());
    assert!(found(&plain_files, &all).iter().all(|h| *h), "the scan finds every agent's update in a plain round's store");
    let status = run.join().expect("the plain campaign");
    plain.stop_agents();
    let plain_accuracy = plain.version_metrics("digits", "accuracy");

    // The secure round, from the same initial model.
    let mut secure = deployment(Some(&plain.path("aggregator/initial.safetensors")));
    secure.append("aggregator.toml", SECURE_AGGREGATION);
    secure.start("fedfleet-agent");
    let secure_status = campaign(&secure).join().expect("the secure campaign");
    let securely = secure.agent_lines("update securely aggregated", AGENTS);
    secure.stop_agents();
    let log = secure.log("aggregator");
    let context = format!(
        "plain: {status}\nsecure: {secure_status}\naggregator:\n{}\nagent-1:\n{}",
        tail(&log, 30),
        tail(&secure.log("agent-1"), 20)
    );
    assert!(
        secure_status.contains("secure aggregation: SecAgg+, 4 neighbours") && !status.contains("secure aggregation"),
        "`campaign start` names the mode as it is\n{context}"
    );
    assert_eq!(count_lines(&log, "the round's sum is unmasked and merged"), 1, "{context}");
    assert_eq!(count_lines(&log, "update accepted"), 0, "no update reached the aggregator in the clear\n{context}");
    assert_eq!(securely, AGENTS, "every agent's update is in the sum\n{context}");
    let secure_accuracy = secure.version_metrics("digits", "accuracy");
    assert_eq!(secure_accuracy.len(), 2, "the initial model and the round's\n{context}");
    assert!(
        (secure_accuracy[1] - plain_accuracy[1]).abs() < 0.005,
        "the secure round's model is the plain round's to the grid: accuracy {secure_accuracy:?} against {plain_accuracy:?}\n{context}"
    );
    let mut secure_files = files(&secure.path("aggregator"));
    secure_files.push(log);
    let leaked: Vec<usize> = found(&secure_files, &all).iter().enumerate().filter(|(_, h)| **h).map(|(i, _)| i / WINDOWS).collect();
    assert!(leaked.is_empty(), "windows of agents' clear updates in the secure aggregator's files: {leaked:?}\n{context}");
}

/// DP-FedAvg under secure aggregation through the real processes: the announcement tells each
/// agent to clip its update to C and add its `1/√quorum` share of the noise σ = z·C before
/// masking; the aggregator unmasks only the noised sum and adds nothing. The published model
/// moved from the initial one by the noise's spread (z·C·√(agents/quorum)/target per
/// coordinate, far above the clipped mean step), every agent says it noised, nothing reached the
/// aggregator in the clear, and the campaign's status and the version's metrics carry the ε spent.
#[test]
fn dp_fedavg_under_secure_aggregation_noises_on_the_agents_and_publishes_the_spend() {
    const CLIP: f64 = 6.0;
    const Z: f64 = 1.0;
    let mut d = deployment(None);
    d.set("aggregator.toml", "strategy", &format!("\"dp_fedavg\"\nclip_norm = {CLIP}\nnoise_multiplier = {Z}\ndelta = 1e-5"));
    d.append("aggregator.toml", SECURE_AGGREGATION);
    d.start("fedfleet-agent");
    let status = campaign(&d).join().expect("the campaign");
    let securely = d.agent_lines("update securely aggregated", AGENTS);
    d.stop_agents();
    let log = d.log("aggregator");
    let agents = d.agent_logs();
    let context = format!("status: {status}\naggregator:\n{}\nagent-1:\n{}", tail(&log, 30), tail(&d.log("agent-1"), 20));
    assert!(
        status.contains("secure aggregation: SecAgg+, 4 neighbours")
            && status.contains("privacy: DP-FedAvg, noise split across the devices, noise multiplier 1"),
        "`campaign start` names both modes\n{context}"
    );
    assert_eq!(agents.matches("update clipped and noised on the device").count(), AGENTS, "{context}");
    assert_eq!(securely, AGENTS, "{context}");
    assert_eq!(count_lines(&log, "update accepted"), 0, "no update reached the aggregator in the clear\n{context}");

    // The round's model: the one global model in the aggregator's store that is not the initial.
    let limits = BundleLimits::default();
    let initial_bytes = std::fs::read(d.path("aggregator/initial.safetensors")).unwrap();
    let initial = TensorBundle::decode(&initial_bytes, &limits).unwrap().flat_f32();
    let models: Vec<Vec<u8>> =
        files(&d.path("aggregator/models")).iter().map(|p| std::fs::read(p).unwrap()).filter(|b| *b != initial_bytes).collect();
    assert_eq!(models.len(), 1, "one round, one new global model\n{context}");
    let published = TensorBundle::decode(&models[0], &limits).unwrap().flat_f32();
    let step: Vec<f64> = published.iter().zip(&initial).map(|(m, b)| f64::from(*m) - f64::from(*b)).collect();
    let sd = (step.iter().map(|x| x * x).sum::<f64>() / step.len() as f64).sqrt();
    let (quorum, target) = (AGENTS as f64, (AGENTS + 1) as f64);
    let want = Z * CLIP * (AGENTS as f64 / quorum).sqrt() / target;
    // 4,810 coordinates: the estimate's own spread is 1 %; the clipped mean step adds at most
    // C·agents/target over them all (rms 0.07 against the noise's 1.0).
    assert!((sd - want).abs() < 0.05 * want, "the model moved by {sd} per coordinate, want the noise's {want}\n{context}");

    let versions = d.versions("digits");
    let epsilon = versions[1]["metrics"]["dp_epsilon"].as_f64().unwrap_or_else(|| panic!("v2 has no dp_epsilon: {}", versions[1]));
    assert!(epsilon > 0.0 && status.contains(&format!("ε = {epsilon:.3} spent")), "ε {epsilon} in the version and the status\n{context}");
}
