//! The inbox of a real agent process: examples the application pushes through the socket are
//! capped at `[inbox]`'s bounds, survive a kill -9 of the agent, and are what the next round
//! trains on.

use std::path::Path;
use std::time::Duration;

use fedfleet_agent::inbox::{Example, InboxStats};
use fedfleet_agent::inference::{Push, query};

use crate::deployment::Deployment;
use crate::procs::{Proc, wait_for};

/// Pushes `examples` once the agent's socket answers; returns the inbox after the push.
fn push(rt: &tokio::runtime::Runtime, socket: &Path, examples: Vec<Example>) -> InboxStats {
    let push = Push { examples };
    wait_for("the agent's socket", Duration::from_secs(30), || rt.block_on(query(socket, &push)).ok())
        .inbox
        .expect("the push is acknowledged with the inbox")
}

#[test]
fn pushed_examples_are_capped_survive_kill_9_and_are_trained_on_next() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let mut d = Deployment::init(1);
    let config = d.path("agents/agent-1.toml");
    let mut text = std::fs::read_to_string(&config).unwrap();
    text.push_str("\n[inbox]\nmax_examples = 30\n");
    std::fs::write(&config, text).unwrap();
    d.set("aggregator.toml", "rounds", "1");
    d.start("fedfleet-agent");
    let socket = d.path("agents/agent-1/agent.sock");

    let (_, test) = fedfleet_learning::Dataset::digits_split().unwrap();
    let examples: Vec<Example> =
        (0..40).map(|i| Example { input: test.example(i).to_vec(), label: test.labels[i], target: vec![] }).collect();
    let stats = push(&rt, &socket, examples);
    assert_eq!((stats.stored, stats.examples, stats.dropped, stats.fresh), (30, 30, 10, 30), "{stats:?}");

    // kill -9 right after the acknowledgement, then start the agent again on the same store.
    d.agent_procs[0].sigkill();
    let _ = std::fs::remove_file(&socket);
    d.agent_procs[0] =
        Proc::spawn(&[], "agent-1", "fedfleet-agent", &["run", "--config", "agents/agent-1.toml"], &d.dir, &d.log("agent-1"), "info");
    let stats = push(&rt, &socket, Vec::new());
    assert_eq!((stats.examples, stats.dropped, stats.fresh), (30, 10, 30), "the inbox after kill -9: {stats:?}");

    // The next round trains on the configured data plus the 30 kept, less every 5th held out.
    d.cli("fedfleet-aggregator", &["campaign", "start", "--config", "aggregator.toml", "--wait"]);
    let cfg = fedfleet_agent::config::AgentConfig::load(&config).unwrap();
    let configured = fedfleet_agent::daemon::load_data(&cfg).unwrap().train.len();
    let log = std::fs::read_to_string(d.log("agent-1")).unwrap();
    let trained = log.lines().find(|l| l.contains(" trained ")).unwrap_or_else(|| panic!("agent-1 did not train:\n{log}"));
    assert!(trained.contains(&format!("examples={}", configured + 24)), "expected {} + 24 examples: {trained}", configured);
    assert_eq!(push(&rt, &socket, Vec::new()).fresh, 0, "everything pushed was trained on");
    d.stop_agents();
}
