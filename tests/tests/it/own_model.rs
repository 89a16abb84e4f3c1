//! A device team's own burn model (`examples/own-model`: a gated MLP no built-in layer graph
//! has) in a real deployment: `init-local`, the aggregator's model swapped for the team's
//! custom spec and weights (`init-model --pretrained`), the registry, the aggregator and three
//! `own-model-agent` processes (the stock agent built with `AgentBuilder::trainer`). A 3-round
//! campaign trains it, a rollout installs the last version (health-checked by the team's
//! trainer), and inference through the agent's socket answers with it.

use crate::deployment::{Deployment, write_rows};

#[test]
fn a_teams_own_burn_model_trains_in_a_campaign_installs_and_serves() {
    let mut d = Deployment::init(3);
    let spec = fedfleet_example_own_model::spec();
    d.set_spec(&spec);
    d.cli("own-model-agent", &["init-weights", "--out", "team.safetensors"]);
    d.cli("fedfleet-aggregator", &["init-model", "--config", "aggregator.toml", "--pretrained", "team.safetensors"]);
    d.start("own-model-agent");

    d.cli("fedfleet-aggregator", &["campaign", "start", "--config", "aggregator.toml", "--wait"]);
    d.start_rollout(4, 3, &["--wait"]);
    for a in &mut d.agent_procs {
        a.assert_running();
    }

    // Every held-out digit through agent-1's socket: answered by the team's model, v4.
    let (_, test) = fedfleet_learning::Dataset::digits_split().unwrap();
    write_rows(&d.path("test.csv"), &test);
    let status = d.cli("fedfleet-agent", &["status", "--config", "agents/agent-1.toml"]);
    assert!(status.contains("\"version\": 4"), "agent-1 does not run v4:\n{status}");
    let out = d.cli("fedfleet-agent", &["infer", "--config", "agents/agent-1.toml", "--input", "test.csv"]);
    let labels: Vec<u32> = out.lines().filter_map(|l| l.split(',').next()?.parse().ok()).collect();
    assert_eq!(labels.len(), test.len(), "one prediction per row:\n{out}");
    let accuracy = labels.iter().zip(&test.labels).filter(|(a, b)| a == b).count() as f64 / test.len() as f64;
    let initial = fedfleet_learning::interop::load_state_dict(&spec, d.path("team.safetensors")).unwrap();
    let before = fedfleet_example_own_model::accuracy(&initial, &test).unwrap();
    eprintln!("team model on the held-out digits: {before:.3} before the campaign, {accuracy:.3} after (v4, served by agent-1)");
    assert!(accuracy > 0.85 && before < 0.3, "accuracy {before:.3} -> {accuracy:.3}");
    let logs = d.agent_logs();
    assert!(!logs.contains(" ERROR "), "an agent logged an error:\n{logs}");
    d.stop_agents();
}
