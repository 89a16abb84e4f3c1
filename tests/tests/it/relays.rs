//! Regional relays as real processes: the root aggregator, three `fedfleet-aggregator relay`
//! processes and nine agents, three per relay (the registry beside them). FedAvg over the tree
//! publishes the flat run's versions bit for bit, and a relay killed with SIGKILL mid-round and
//! started again loses and doubles nothing. A chain of three relays under the root (four
//! levels) publishes the same versions too.

use std::path::Path;
use std::time::Duration;

use crate::deployment::Deployment;
use crate::procs::{Proc, count_lines, free_udp_port, tail, wait_for};

const AGENTS: usize = 9;
const RELAYS: usize = 3;

/// Two rounds of FedAvg over every agent, from `initial` (the same initial model in both runs).
fn deployment(initial: Option<&Path>) -> Deployment {
    let d = Deployment::init(AGENTS);
    d.set("aggregator.toml", "rounds", "2");
    d.set("aggregator.toml", "target", &AGENTS.to_string());
    if let Some(initial) = initial {
        std::fs::copy(initial, d.path("aggregator/initial.safetensors")).unwrap();
    }
    d
}

/// Runs the campaign; the digest of every version the registry holds, oldest first.
fn campaign(d: &Deployment) -> Vec<String> {
    d.cli("fedfleet-aggregator", &["campaign", "start", "--config", "aggregator.toml", "--seed", "11", "--wait"]);
    d.versions("digits").iter().map(|v| v["digest"].as_str().expect("a version has a digest").to_owned()).collect()
}

/// The agents of relay `r` (1-based): 3r-2 ..= 3r.
fn region(r: usize) -> std::ops::RangeInclusive<usize> {
    3 * r - 2..=3 * r
}

/// Relay `r` (1-based, `shape[r - 1]`): its parent (`None`: the root) and the agents that
/// connect to it.
struct RelaySpec {
    parent: Option<usize>,
    agents: std::ops::RangeInclusive<usize>,
}

/// The root and three relays under it, three agents each.
fn two_levels() -> Vec<RelaySpec> {
    (1..=RELAYS).map(|r| RelaySpec { parent: None, agents: region(r) }).collect()
}

/// A chain: root ← relay-1 ← relay-2 ← relay-3, three agents on each relay.
fn four_levels() -> Vec<RelaySpec> {
    (1..=RELAYS).map(|r| RelaySpec { parent: (r > 1).then(|| r - 1), agents: region(r) }).collect()
}

/// The agents relay `r` answers for: its own and those of every relay below it.
fn subtree(shape: &[RelaySpec], r: usize) -> Vec<usize> {
    let mut all: Vec<usize> = shape[r - 1].agents.clone().collect();
    for (i, s) in shape.iter().enumerate() {
        if s.parent == Some(r) {
            all.extend(subtree(shape, i + 1));
        }
    }
    all
}

/// Each relay's certificate and config (its region: every agent of its subtree; its parent;
/// the relays below it), and its agents' configs pointing at it; the root names the relays
/// directly under it.
fn make_tree(d: &Deployment, shape: &[RelaySpec]) {
    let root = std::fs::read_to_string(d.path("aggregator.toml")).unwrap();
    let root_addr = root.lines().find_map(|l| l.strip_prefix("listen = ")).unwrap().trim_matches('"').to_owned();
    let ports: Vec<u16> = shape.iter().map(|_| free_udp_port()).collect();
    let children = |parent: Option<usize>| -> Vec<String> {
        shape.iter().enumerate().filter(|(_, s)| s.parent == parent).map(|(i, _)| format!("\"relay-{}\"", i + 1)).collect()
    };
    std::fs::write(
        d.path("aggregator.toml"),
        root.replacen("\n[publish]", &format!("\nrelays = [{}]\n\n[publish]", children(None).join(", ")), 1),
    )
    .unwrap();
    for (i, spec) in shape.iter().enumerate() {
        let r = i + 1;
        let name = format!("relay-{r}");
        d.cli("fedfleet-certs", &["--dir", "pki", "issue-server", "--name", &name]);
        let port = ports[i];
        let (parent, parent_key) = match spec.parent {
            None => (root_addr.clone(), "aggregator/receipt.pub".to_owned()),
            Some(p) => (format!("127.0.0.1:{}", ports[p - 1]), format!("relay-{p}/receipt.pub")),
        };
        let devices: Vec<String> = subtree(shape, r).iter().map(|i| format!("\"agent-{i}\"")).collect();
        // The root's config as a relay's (`relay_config`), plus the relays below this one and
        // the parent.
        let below = children(Some(r));
        let mut config = if below.is_empty() { String::new() } else { format!("relays = [{}]\n", below.join(", ")) };
        config += &fedfleet_testkit::services::relay_config(&root, &format!("127.0.0.1:{port}"), &name, &name, None);
        config += &format!(
            "\n[relay]\nparent = \"{parent}\"\nparent_receipt_key = \"{parent_key}\"\nregion = [{}]\nforward_margin_secs = 5\npoll_interval_ms = 200\n",
            devices.join(", ")
        );
        std::fs::write(d.path(&format!("{name}.toml")), config).unwrap();
        for a in spec.agents.clone() {
            let file = format!("agents/agent-{a}.toml");
            let text = std::fs::read_to_string(d.path(&file)).unwrap();
            let text = text
                .replace(&format!("addr = \"{root_addr}\""), &format!("addr = \"127.0.0.1:{port}\""))
                .replace("receipt_key = \"../aggregator/receipt.pub\"", &format!("receipt_key = \"../{name}/receipt.pub\""));
            assert!(text.contains(&format!("127.0.0.1:{port}")), "agent {a}'s config names the aggregator differently: {text}");
            std::fs::write(d.path(&file), text).unwrap();
        }
    }
}

/// Relay `r` runs an embedded MQTT broker (TLS with its service certificate) and its agents
/// upload over MQTT only (`upload = "mqtt"`), hearing the relay's announcements there.
fn region_over_mqtt(d: &Deployment, r: usize) {
    let port = free_udp_port();
    let relay = format!("relay-{r}.toml");
    let config = std::fs::read_to_string(d.path(&relay)).unwrap();
    assert!(!config.contains("[mqtt]"), "{config}");
    d.append(&relay, &format!("[mqtt]\nmode = \"embedded\"\nlisten = \"127.0.0.1:{port}\"\n"));
    for a in region(r) {
        d.append(&format!("agents/agent-{a}.toml"), &format!("[mqtt]\nhost = \"127.0.0.1\"\nport = {port}\nupload = \"mqtt\"\n"));
    }
}

fn spawn_relay(d: &Deployment, r: usize) -> Proc {
    let name = format!("relay-{r}");
    let config = format!("{name}.toml");
    let p = Proc::spawn(&[], &name, "fedfleet-aggregator", &["relay", "--config", &config], &d.dir, &d.log(&name), "info");
    wait_for(&format!("{name} to listen"), Duration::from_secs(30), || d.path(&format!("{name}/receipt.pub")).exists().then_some(()));
    p
}

/// A campaign run on a tree whose configs are written ([`make_tree`]): what the tests check.
struct TreeRun {
    /// Kept running until the test drops them.
    relays: Vec<Proc>,
    /// What `campaign start --wait` printed.
    status: String,
    /// The digest of every version the registry holds, oldest first.
    versions: Vec<String>,
    root_log: std::path::PathBuf,
    /// The campaign's answer and the services' logs, for failure messages.
    context: String,
}

/// Starts the registry and root, the relays (parents first: a relay reads its parent's receipt
/// key when it starts) and every agent, then runs the campaign to its end.
fn run_tree(d: &mut Deployment) -> TreeRun {
    d.start_services();
    let relays: Vec<Proc> = (1..=RELAYS).map(|r| spawn_relay(d, r)).collect();
    d.start_agents(1..=AGENTS, "fedfleet-agent");
    let status = d.cli("fedfleet-aggregator", &["campaign", "start", "--config", "aggregator.toml", "--seed", "11", "--wait"]);
    let versions = d.versions("digits").iter().map(|v| v["digest"].as_str().unwrap().to_owned()).collect();
    let root_log = d.log("aggregator");
    let logs: String = (1..=RELAYS).map(|r| format!("relay-{r}:\n{}\n", tail(&d.log(&format!("relay-{r}")), 20))).collect();
    let context = format!("campaign: {status}\nroot:\n{}\n{logs}agent-1:\n{}", tail(&root_log, 40), tail(&d.log("agent-1"), 20));
    TreeRun { relays, status, versions, root_log, context }
}

#[test]
fn a_tree_of_relays_publishes_the_flat_runs_models_and_survives_a_relay_killed_mid_round() {
    // The flat run: nine agents on the root.
    let mut flat = deployment(None);
    flat.start("fedfleet-agent");
    let flat_versions = campaign(&flat);
    flat.stop_agents();
    assert_eq!(flat_versions.len(), 3, "the initial model and two rounds: {flat_versions:?}");

    // The tree: the root, three relays, three agents each. Relay 2 gets two of its agents, is
    // killed with SIGKILL once it holds both updates (its round needs the third), is started
    // again, and only then does its third agent come up. Relay 1's region uploads over MQTT.
    let mut tree = deployment(Some(&flat.path("aggregator/initial.safetensors")));
    make_tree(&tree, &two_levels());
    region_over_mqtt(&tree, 1);
    tree.start_services();
    let mut relays: Vec<Proc> = (1..=RELAYS).map(|r| spawn_relay(&tree, r)).collect();
    for r in 1..=RELAYS {
        let last = if r == 2 { *region(r).end() - 1 } else { *region(r).end() };
        tree.start_agents(*region(r).start()..=last, "fedfleet-agent");
    }
    let dir = tree.dir.clone();
    let run = std::thread::spawn(move || {
        crate::procs::cli("fedfleet-aggregator", &["campaign", "start", "--config", "aggregator.toml", "--seed", "11", "--wait"], &dir)
    });
    let relay2 = tree.log("relay-2");
    wait_for("relay-2 to accept two updates", Duration::from_secs(120), || (count_lines(&relay2, "update accepted") >= 2).then_some(()));
    assert_eq!(count_lines(&relay2, "partial sum forwarded"), 0, "relay-2 waits for its third agent");
    relays[1].sigkill();
    relays[1] = spawn_relay(&tree, 2);
    tree.start_agents(*region(2).end()..=*region(2).end(), "fedfleet-agent");
    let status = run.join().unwrap_or_else(|_| "`campaign start --wait` failed (see above)".into());
    let tree_versions = tree.versions("digits").iter().map(|v| v["digest"].as_str().unwrap().to_owned()).collect::<Vec<_>>();
    let root_log = tree.log("aggregator");
    let context = format!("campaign: {status}\nroot:\n{}\nrelay-2:\n{}", tail(&root_log, 30), tail(&relay2, 30));
    assert_eq!(tree_versions, flat_versions, "FedAvg over relays is FedAvg over all devices, bit for bit\n{context}");
    assert_eq!(count_lines(&root_log, "relay's partial sum accepted"), 2 * RELAYS, "one sum per relay per round\n{context}");
    assert_eq!(count_lines(&root_log, "update accepted"), 0, "no device reached the root\n{context}");
    assert!(count_lines(&relay2, "refolded the current round after restart") >= 1, "relay-2 refolded its two updates\n{context}");
    // Relay 1's region over MQTT: its broker ran, and each of its agents was answered there.
    let relay1 = tree.log("relay-1");
    assert_eq!(count_lines(&relay1, "MQTT control plane started"), 1, "{}", tail(&relay1, 30));
    assert_eq!(count_lines(&relay1, "update accepted"), 2 * 3, "{}", tail(&relay1, 30));
    for a in region(1) {
        let log = tree.log(&format!("agent-{a}"));
        assert!(count_lines(&log, "receipt over MQTT") >= 2, "agent-{a}:\n{}", tail(&log, 30));
        assert_eq!(count_lines(&log, "MQTT upload refused by the aggregator"), 0, "agent-{a}:\n{}", tail(&log, 30));
    }
    tree.stop_agents();
    drop(relays);

    // Deeper trees: a chain of three relays under the root, each relay's region the agents of
    // its whole subtree, so that each waits for the sum from below. The same versions again.
    let mut chain = deployment(Some(&flat.path("aggregator/initial.safetensors")));
    make_tree(&chain, &four_levels());
    let TreeRun { relays, versions: chain_versions, root_log, context, .. } = run_tree(&mut chain);
    assert_eq!(chain_versions, flat_versions, "FedAvg down a chain of relays is FedAvg over all devices, bit for bit\n{context}");
    assert_eq!(count_lines(&root_log, "relay's partial sum accepted"), 2, "one sum (relay-1's) per round\n{context}");
    for r in 1..RELAYS {
        let log = chain.log(&format!("relay-{r}"));
        assert_eq!(count_lines(&log, "relay's partial sum accepted"), 2, "relay-{r} took relay-{}'s sum each round\n{context}", r + 1);
    }
    chain.stop_agents();
    drop(relays);
}

/// Secure aggregation in every region (issues 28 and 29): the tree of three relays, each with
/// `[secure_aggregation]`, so each relay learns only its region's sum (its three agents run the
/// SecAgg+ stages with it) and the root only the three sums. One round of it publishes the model
/// that one secure round over all nine agents on the root publishes, bit for bit: both sum the
/// same updates on the same grid exactly. No relay took an update in the clear.
#[test]
fn secure_regions_publish_the_flat_secure_runs_model() {
    const SECURE_AGGREGATION: &str = "[secure_aggregation]\ndegree = 2\n";
    let one_round = |initial: Option<&Path>| {
        let d = deployment(initial);
        d.set("aggregator.toml", "rounds", "1");
        d
    };
    let mut flat = one_round(None);
    flat.append("aggregator.toml", SECURE_AGGREGATION);
    flat.start("fedfleet-agent");
    let flat_versions = campaign(&flat);
    flat.stop_agents();
    let flat_log = flat.log("aggregator");
    assert_eq!(count_lines(&flat_log, "the round's sum is unmasked and merged"), 1, "{}", tail(&flat_log, 30));

    let mut tree = one_round(Some(&flat.path("aggregator/initial.safetensors")));
    make_tree(&tree, &two_levels());
    for r in 1..=RELAYS {
        tree.append(&format!("relay-{r}.toml"), SECURE_AGGREGATION);
    }
    let TreeRun { relays, versions: tree_versions, root_log, context, .. } = run_tree(&mut tree);
    assert_eq!(flat_versions.len(), 2, "the initial model and the round's\n{context}");
    assert_eq!(tree_versions, flat_versions, "secure regions publish the flat secure round's model, bit for bit\n{context}");
    assert_eq!(count_lines(&root_log, "relay's partial sum accepted"), RELAYS, "one sum per relay\n{context}");
    for r in 1..=RELAYS {
        let log = tree.log(&format!("relay-{r}"));
        assert_eq!(count_lines(&log, "the round's sum is unmasked and merged"), 1, "relay-{r}'s region aggregated securely\n{context}");
        assert_eq!(count_lines(&log, "update accepted"), 0, "relay-{r} took no update in the clear\n{context}");
    }
    assert_eq!(tree.agent_lines("update securely aggregated", AGENTS), AGENTS, "{context}");
    tree.stop_agents();
    drop(relays);
}

/// Asynchronous mode (FedBuff) over relays (issue 28): the root runs `mode = "async"` with
/// buffers of 3 updates, and each of the three relays forwards one sum of its three agents per
/// buffer it follows. A relay's sum that arrives after its buffer closed joins the open one,
/// discounted by its staleness as a whole (the core's tests pin the arithmetic). The campaign
/// publishes its three versions, no device reaches the root, and every sum a relay forwarded
/// was accepted once at the root: nothing is lost or counted twice.
#[test]
fn relays_forward_one_sum_per_buffer_in_async_mode() {
    async_tree(false);
}

/// Secure aggregation per FedBuff buffer (issue 29): the same async tree with
/// `[secure_aggregation]` on every relay. Each region is one SecAgg+ cohort per buffer it
/// follows: the relay learns only its region's sum for that buffer and takes no update in the
/// clear, the root only the regions' sums (discounted as a whole when their buffer has closed).
#[test]
fn secure_regions_aggregate_per_buffer_in_async_mode() {
    async_tree(true);
}

fn async_tree(secure: bool) {
    let mut tree = deployment(None);
    tree.set("aggregator.toml", "rounds", "3");
    tree.set("aggregator.toml", "target", "3");
    let root = std::fs::read_to_string(tree.path("aggregator.toml")).unwrap();
    std::fs::write(tree.path("aggregator.toml"), root.replacen("\n[campaign]\n", "\n[campaign]\nmode = \"async\"\n", 1)).unwrap();
    make_tree(&tree, &two_levels());
    if secure {
        for r in 1..=RELAYS {
            tree.append(&format!("relay-{r}.toml"), "[secure_aggregation]\ndegree = 2\n");
        }
    }
    let TreeRun { relays, status, versions, root_log, context } = run_tree(&mut tree);
    assert!(status.contains("async"), "the campaign runs buffers\n{context}");
    assert_eq!(versions.len(), 4, "the initial model and three buffers' versions\n{context}");
    assert_eq!(count_lines(&root_log, "update accepted"), 0, "no device reached the root\n{context}");
    let forwarded: usize = (1..=RELAYS).map(|r| count_lines(&tree.log(&format!("relay-{r}")), "partial sum forwarded")).sum();
    let accepted = count_lines(&root_log, "relay's partial sum accepted");
    assert!(forwarded >= 3, "one sum per buffer at least\n{context}");
    assert_eq!(accepted, forwarded, "every forwarded sum accepted once\n{context}");
    if secure {
        for r in 1..=RELAYS {
            let log = tree.log(&format!("relay-{r}"));
            // A sum refused while its buffer published is forwarded later, or not at all once the
            // campaign has its versions; none is forwarded without being unmasked first.
            let unmasked = count_lines(&log, "the round's sum is unmasked and merged");
            assert!(unmasked >= 1, "relay-{r}'s region aggregated securely\n{context}");
            assert!(count_lines(&log, "partial sum forwarded") <= unmasked, "relay-{r} forwarded only unmasked sums\n{context}");
            assert_eq!(count_lines(&log, "update accepted"), 0, "relay-{r} took no update in the clear\n{context}");
        }
        assert!(tree.agent_logs().matches("update securely aggregated").count() >= 3, "{context}");
    }
    let stale = std::fs::read_to_string(&root_log)
        .unwrap()
        .lines()
        .filter(|l| l.contains("relay's partial sum accepted") && !l.contains("staleness=0"))
        .count();
    eprintln!("relay sums accepted: {accepted}, of which discounted for staleness: {stale}");
    tree.stop_agents();
    drop(relays);
}
