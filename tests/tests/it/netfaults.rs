//! Issue 14: the multi-process fleet of [`crate::multiprocess`] across a faulty network.
//!
//! The registry and the aggregator run on loopback in the test's network namespace; the agents
//! run in a namespace of their own (`ffnet-<pid>`, started through `ip netns exec`), joined to
//! the test's by a veth pair (`ffh<pid>` here, `ffd<pid>` there, a /30 in 10.77.0.0/16). The
//! agents' only way to the services is a fault-injecting UDP relay per service ([`Relay`], QUIC
//! is UDP), listening on this side's veth address: it loses, delays (with jitter, so datagrams
//! overtake each other) and reorders datagrams in both directions, with parameters drawn from
//! the seed and printed, and twice cuts the link (a partition) and heals it — once in the middle
//! of a round, once while the agents download the rolled-out model. Then:
//!
//! * the campaign completes, one version per round;
//! * nothing crosses a partition while it lasts (the open round's accepted count stands still);
//! * every agent runs the rolled-out version with the registry's digest;
//! * every update is counted exactly once and every outbox is empty
//!   ([`Fleet::assert_exactly_once`]);
//! * the final model is bit-identical to that of the same campaign run again without relays,
//!   namespace or faults (every agent is in every round, so the campaign is deterministic).
//!
//! The whole test takes about 45 s.
//!
//! Why a relay and not `tc netem` on the veth pair: the kernel of the machine this was written
//! on (a Firecracker guest without loadable modules; CI runs on the same kind) has network
//! namespaces, veth and `htb`/`tbf`, but no `sch_netem`, no `gact` action and no `matchall`
//! classifier, so it can neither delay nor drop packets on demand. The namespace still matters: the agents cannot reach the
//! services except through the faults.
//!
//! Needs root (`CAP_NET_ADMIN`, `CAP_SYS_ADMIN`) and iproute2 (`.ci/run` installs it). Where a
//! namespace cannot be made (or with `FEDFLEET_NETFAULTS_LOOPBACK=1`), the agents run on
//! loopback behind the same relays, and the test says so. The namespace and the link are
//! deleted when the test ends, also on a panic (and those of killed test processes at the next
//! run).
//!
//! Partitions last a few seconds, below QUIC's 30 s idle timeout in `fedfleet-net`: connections
//! survive them, and requests in flight (an upload, a model download) stall and continue when
//! the link heals, by QUIC retransmission. With `FEDFLEET_NETFAULTS_LONG=1` they last 32–40 s
//! instead, past the idle timeout: connections die and what was in flight is retried on a new
//! one (the per-agent summary counts upload and install retries); about a minute more.
//!
//! Run alone: `cargo build --workspace --bins && cargo test -p fedfleet-tests --test it netfaults
//! -- --nocapture` (`FEDFLEET_TEST_SEED=<seed>` repeats a run's faults and moments).

use std::net::{IpAddr, Ipv4Addr};
use std::process::Command;
use std::time::{Duration, Instant};

use fedfleet_protocol::DeviceState;

use crate::multiprocess::{AGENTS, Fleet, MODEL, Plan, STEP_TIMEOUT, one_at_a_time, open_round};
use crate::procs::{LinkFaults, Relay, SeededRng, count_lines, poll_every, sample, wait_for};

const ROUNDS: u32 = 3;

/// Runs `program args`; `Err` with its output unless it succeeds.
fn run(program: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new(program).args(args).output().map_err(|e| format!("cannot run `{program}`: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("`{program} {}` failed ({}): {}", args.join(" "), out.status, String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// A network namespace joined to the test's by a veth pair; deleted on drop (also on a panic).
struct NetLab {
    ns: String,
    host_if: String,
    host_ip: Ipv4Addr,
    dev_ip: Ipv4Addr,
}

const NS_PREFIX: &str = "ffnet-";

impl NetLab {
    /// `ffnet-<pid>` with `ffd<pid>` inside, joined to `ffh<pid>` here; a /30 in 10.77.0.0/16
    /// chosen by the pid. `Err` says why it could not be made (no permission, no iproute2).
    fn create() -> Result<NetLab, String> {
        sweep_stale();
        let pid = std::process::id();
        let slot = pid % (256 * 64);
        let (x, y) = ((slot / 64) as u8, (slot % 64 * 4) as u8);
        let dev_if = format!("ffd{pid}");
        let lab = NetLab {
            ns: format!("{NS_PREFIX}{pid}"),
            host_if: format!("ffh{pid}"),
            host_ip: Ipv4Addr::new(10, 77, x, y + 1),
            dev_ip: Ipv4Addr::new(10, 77, x, y + 2),
        };
        // From here on, dropping `lab` removes whatever was made.
        run("ip", &["netns", "add", &lab.ns])?;
        run("ip", &["link", "add", &lab.host_if, "type", "veth", "peer", "name", &dev_if, "netns", &lab.ns])?;
        run("ip", &["addr", "add", &format!("{}/30", lab.host_ip), "dev", &lab.host_if])?;
        run("ip", &["link", "set", &lab.host_if, "up"])?;
        run("ip", &["-n", &lab.ns, "addr", "add", &format!("{}/30", lab.dev_ip), "dev", &dev_if])?;
        run("ip", &["-n", &lab.ns, "link", "set", &dev_if, "up"])?;
        run("ip", &["-n", &lab.ns, "link", "set", "lo", "up"])?;
        Ok(lab)
    }

    /// What the agents are started under.
    fn wrapper(&self) -> Vec<String> {
        ["ip", "netns", "exec", &self.ns].iter().map(|s| s.to_string()).collect()
    }
}

impl Drop for NetLab {
    fn drop(&mut self) {
        // Deleting the namespace deletes its end of the pair, and with it the other end.
        let _ = run("ip", &["netns", "del", &self.ns]);
        let _ = run("ip", &["link", "del", &self.host_if]);
    }
}

/// Deletes the namespaces and links of test processes that no longer run (killed before their
/// guards ran). Only names this module makes, with a pid that is gone.
fn sweep_stale() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let Some(pid) = name.strip_prefix(NS_PREFIX).and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            eprintln!("netfaults: deleting the leftover namespace {name}");
            let _ = run("ip", &["netns", "del", name]);
            let _ = run("ip", &["link", "del", &format!("ffh{pid}")]);
        }
    }
}

/// Loss 5–12 %, delay 20–60 ms ± 5–20 ms, 10–30 % of datagrams sent at once (overtaking).
fn draw_faults(rng: &mut SeededRng) -> LinkFaults {
    LinkFaults { loss_pct: rng.range(5, 12), delay_ms: rng.range(20, 60), jitter_ms: rng.range(5, 20), reorder_pct: rng.range(10, 30) }
}

/// The agents' link to the services: a relay per service (and the namespace they are in).
struct Link {
    relays: [Relay; 2],
}

impl Link {
    fn cut(&self, cut: bool) {
        for r in &self.relays {
            r.set_cut(cut);
        }
    }

    /// Cuts the link (both directions, both services) for `secs`, checks that the open round's
    /// accepted updates stood still while it was cut (`check_round`), then heals it.
    fn partition(&self, f: &Fleet, secs: u64, t0: Instant, check_round: bool) {
        eprintln!("[{:.1?}] partition: every datagram dropped, both ways, for {secs} s", t0.elapsed());
        self.cut(true);
        // Datagrams already in the delay line still arrive: judge from half a second in.
        std::thread::sleep(Duration::from_millis(500));
        let before = check_round.then(|| open_round(&f.aggregator_metrics()));
        std::thread::sleep(Duration::from_millis(secs * 1000 - 500));
        if let Some(before) = before {
            let after = open_round(&f.aggregator_metrics());
            assert_eq!(before, after, "an update crossed the partition (open round, accepted)");
        }
        self.cut(false);
        eprintln!("[{:.1?}] healed", t0.elapsed());
    }
}

/// A 3-round campaign and a rollout of its result to every agent. With `lab`'s link the agents
/// reach the services through faulty relays (from the namespace `ns`, if there is one) and the
/// link is cut twice; without, directly on loopback. Returns the final model's digest (hex).
fn campaign_and_rollout(faulty: Option<Option<&NetLab>>, rng: &mut SeededRng, t0: Instant) -> String {
    let mut f = Fleet::new(if faulty.is_some() { "mp-netfaults" } else { "mp-netfaults-baseline" }, Plan::every_agent(ROUNDS));
    let link = faulty.map(|ns| {
        let front = ns.map_or(IpAddr::V4(Ipv4Addr::LOCALHOST), |l| IpAddr::V4(l.host_ip));
        let link =
            Link { relays: [Relay::start_on(front, f.agg_addr, rng.next_u64()), Relay::start_on(front, f.reg_addr, rng.next_u64())] };
        for i in 0..AGENTS {
            f.route_agent_to_aggregator_via(i, link.relays[0].addr);
            f.route_agent_to_registry_via(i, link.relays[1].addr);
        }
        let faults = draw_faults(rng);
        for r in &link.relays {
            r.set_faults(faults);
        }
        match ns {
            Some(lab) => {
                f.run_agents_under(&lab.wrapper());
                eprintln!(
                    "[{:.1?}] agents in namespace {} ({}), relays on {} ({}): {faults}, both ways",
                    t0.elapsed(),
                    lab.ns,
                    lab.dev_ip,
                    lab.host_ip,
                    lab.host_if,
                );
            }
            None => eprintln!("[{:.1?}] agents on loopback, relays on 127.0.0.1: {faults}, both ways", t0.elapsed()),
        }
        link
    });
    f.start_campaign_with(0..AGENTS);

    // A partition in the middle of a round: once round `p` has `k` of its updates.
    if let Some(link) = &link {
        let p = rng.range(1, ROUNDS as u64);
        let k = rng.range(0, AGENTS as u64 - 1);
        let secs = if long_partitions() { rng.range(32, 40) } else { rng.range(3, 8) };
        let at = wait_for(&format!("round {p} with {k} updates"), STEP_TIMEOUT * 2, || {
            let metrics = f.aggregator_metrics();
            let (round, accepted) = open_round(&metrics);
            // Round `p` may be over between two polls (the last round's, then no round is open:
            // seen with its last two uploads 31 ms apart); the partition then comes after it.
            let published = sample(&metrics, r#"fedfleet_aggregator_rounds_total{event="published"}"#).unwrap_or(0.0);
            (round > p || (round == p && accepted >= k) || published >= p as f64).then_some((round, accepted))
        });
        eprintln!("[{:.1?}] open round {} with {} of {AGENTS} updates (aimed at round {p} with {k})", t0.elapsed(), at.0, at.1);
        link.partition(&f, secs, t0, true);
    }
    let global = f.wait_campaign_completed();
    eprintln!("[{:.1?}] campaign completed: v{global}", t0.elapsed());

    // A rollout of the final version, cut while the first agent downloads it.
    let id = format!("{MODEL}-stable-v{global}");
    f.rollout_start(global, &id);
    if let Some(link) = &link {
        let installing = |i: usize| {
            f.status_file(i).is_some_and(|s| matches!(s.state, DeviceState::Downloading) || s.active.is_some_and(|m| m.version.0 == global))
        };
        let first =
            poll_every(Duration::from_millis(5), "an agent to start downloading", STEP_TIMEOUT, || (0..AGENTS).find(|&i| installing(i)));
        let state = f.status_file(first).map(|s| s.state);
        eprintln!("[{:.1?}] {} downloading (status {state:?})", t0.elapsed(), f.devices[first]);
        let secs = if long_partitions() { rng.range(32, 40) } else { rng.range(2, 5) };
        link.partition(&f, secs, t0, false);
    }
    let rollout = f.wait_rollout_completed(&id);
    assert_eq!(rollout["healthy"].as_u64(), Some(AGENTS as u64), "{rollout:#}");
    let digest = f.wait_all_active(global);
    let versions = f.registry_versions();
    assert_eq!(digest.to_hex(), versions[&global].1, "agents run the registry's bytes");
    eprintln!("[{:.1?}] every agent runs v{global} ({})", t0.elapsed(), digest.to_hex());
    for d in &f.devices {
        let log = f.log(d);
        eprintln!(
            "  {d}: {} updates acknowledged, {} already held, {} upload retries, {} install retries",
            count_lines(&log, "update acknowledged"),
            count_lines(&log, "update already held by the aggregator"),
            count_lines(&log, "upload will be retried"),
            count_lines(&log, "install step will be retried"),
        );
    }

    f.stop_all();
    f.assert_exactly_once(&[ROUNDS; AGENTS]);
    digest.to_hex()
}

#[test]
fn fleet_survives_loss_delay_reordering_and_partitions() {
    let _serial = one_at_a_time();
    let t0 = Instant::now();
    let mut rng = SeededRng::from_env("netfaults");
    let lab = if std::env::var_os("FEDFLEET_NETFAULTS_LOOPBACK").is_some() {
        eprintln!("netfaults: FEDFLEET_NETFAULTS_LOOPBACK set: agents on loopback behind the relays");
        None
    } else {
        NetLab::create()
            .inspect_err(|e| {
                eprintln!(
                    "NOTE netfaults: no network namespace ({e}; needs root and iproute2): \
                     the agents run on loopback behind the same faulty relays"
                )
            })
            .ok()
    };
    let digest = campaign_and_rollout(Some(lab.as_ref()), &mut rng, t0);
    drop(lab);
    let baseline = campaign_and_rollout(None, &mut rng, t0);
    assert_eq!(digest, baseline, "the faults changed the final model");
    eprintln!("[{:.1?}] the same final model as the campaign without faults", t0.elapsed());
}

/// `FEDFLEET_NETFAULTS_LONG=1`: partitions outlast QUIC's idle timeout.
fn long_partitions() -> bool {
    std::env::var_os("FEDFLEET_NETFAULTS_LONG").is_some()
}
