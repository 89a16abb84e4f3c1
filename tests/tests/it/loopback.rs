//! Issue 6: a real registry and a real aggregator (publishing into the registry through
//! `RegistryPublisher`), 5 agents over QUIC completing 3 rounds, the aggregator stopped during
//! round 2's uploads and restarted on the same address and data directory. Every update is
//! accounted for exactly once and the published versions chain in the registry.

use std::time::Duration;

use fedfleet_aggregator::config::{CampaignDefaults, Config, ModelConfig, PublishConfig};
use fedfleet_aggregator::wire::CampaignOverrides;
use fedfleet_learning::ModelSpec;
use fedfleet_protocol::{ModelVersion, RoundId};
use fedfleet_testkit::services::RunningAggregator;
use fedfleet_testkit::sim::{FleetOptions, RemoteFleet};

use crate::inproc::{FleetDir, assert_acks_match_records, edge_devices, wait_until, write_initial_model};

const MODEL: &str = "digits";
const N: usize = 5;

fn round_acks(fleet: &RemoteFleet, r: u64) -> usize {
    fleet.acks().iter().filter(|a| a.round == RoundId(r)).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_agents_three_rounds_aggregator_restart() {
    tokio::time::timeout(Duration::from_secs(90), body()).await.expect("loopback test timed out");
}

async fn body() {
    let devices = edge_devices(N);
    let fleet_dir = FleetDir::new("fleet-e2e", &["registry", "aggregator"], &devices);
    let (root_dir, pki_dir, fleet_id) = (fleet_dir.root(), fleet_dir.pki_dir.clone(), fleet_dir.fleet_id.clone());

    // Registry, in process; the aggregator's service certificate is an operator.
    let registry = fleet_dir.start_registry(&["aggregator"]);
    let (reg, reg_addr) = (registry.reg.clone(), registry.addr);

    // Aggregator, in process, publishing into the registry.
    let spec = ModelSpec::digits_mlp();
    let initial = write_initial_model(root_dir, &spec);
    let model = ModelConfig { name: MODEL.into(), spec: spec.clone(), initial, validation: None };
    let cfg = Config {
        publish: Some(PublishConfig { registry: reg_addr, server_name: "localhost".into() }),
        campaign: CampaignDefaults {
            rounds: 3,
            target: N as u32,
            quorum: N as u32,
            deadline_secs: 600,
            learning_rate: 0.1,
            ..Default::default()
        },
        ..Config::new("127.0.0.1:0".parse().unwrap(), pki_dir.clone(), root_dir.join("aggregator"), model)
    };
    let running = RunningAggregator::publishing_to(cfg.clone(), reg_addr).await.unwrap();
    let agg_addr = running.addr;
    let receipt_key = running.agg.receipt_key();
    running.agg.start_campaign(CampaignOverrides { seed: Some(1), ..Default::default() }).await.unwrap();

    let mut fleet = RemoteFleet::start(FleetOptions::new(
        &pki_dir,
        fleet_id.clone(),
        devices.clone(),
        agg_addr,
        reg_addr,
        receipt_key,
        registry.pinned_root.clone(),
        MODEL,
        root_dir.join("agents"),
    ))
    .unwrap();

    // Round 1: everyone trains and uploads.
    assert!(fleet.run_until(|f| round_acks(f, 1) == N, Duration::from_secs(30)).await.unwrap(), "round 1 uploads: {:?}", fleet.status());
    let agg = running.agg.clone();
    wait_until("round 2 to open", 20, || agg.status().open_round == Some(RoundId(2))).await;

    // Round 2: all agents see the round; two upload while the aggregator is up.
    for a in &mut fleet.agents {
        a.poll_control().await.unwrap();
    }
    for a in &mut fleet.agents[..2] {
        a.drive().await.unwrap();
    }
    assert_eq!(round_acks(&fleet, 2), 2);
    // The others get the round's base model cached (as if fetched before the outage) ...
    let (g, bytes) = agg.global_model().unwrap();
    for a in &fleet.agents[2..] {
        let st = a.core().store();
        assert_eq!(st.put_blob(&bytes).unwrap(), g.digest);
        st.put_spec(&g.digest, &spec.to_json()).unwrap();
    }
    // ... and the aggregator goes down: their uploads fail and stay in the outbox.
    drop(agg);
    running.stop().await;
    for a in &mut fleet.agents[2..] {
        a.drive().await.unwrap();
    }
    assert_eq!(round_acks(&fleet, 2), 2, "no upload can succeed while the aggregator is down");
    assert_eq!(fleet.pending(), N - 2, "{:?}", fleet.status());

    // Back on the same address and data directory: the outboxes drain, rounds 2 and 3 finish.
    let running = RunningAggregator::publishing_to(Config { listen: agg_addr, ..cfg.clone() }, reg_addr).await.unwrap();
    assert_eq!(running.addr, agg_addr);
    assert_eq!(running.agg.receipt_key(), receipt_key, "same receipt key after restart");
    let agg = running.agg.clone();
    let done = fleet
        .run_until(|f| f.pending() == 0 && agg.status().last_outcome.is_some() && round_acks(f, 3) == N, Duration::from_secs(45))
        .await
        .unwrap();
    assert!(done, "campaign did not finish: {:?} {:?}", agg.status(), fleet.status());
    let status = agg.status();
    assert_eq!(status.last_outcome.as_deref(), Some("completed"), "{status:?}");

    // Stop the aggregator and read its committed records.
    drop(agg);
    running.stop().await;
    let astore = fedfleet_aggregator::persist::Store::open(&cfg.data_dir).unwrap();
    assert_acks_match_records(&astore, 3, 3 * N, &fleet.acks());
    assert_eq!(fleet.pending(), 0);

    // The registry holds the initial model and one version per round, parents chained.
    let versions = reg.store().versions(MODEL).unwrap();
    assert_eq!(versions, (1..=4).map(ModelVersion).collect::<Vec<_>>());
    assert_eq!(reg.store().version(MODEL, ModelVersion(1)).unwrap().parent, None);
    for v in 2..=4 {
        assert_eq!(reg.store().version(MODEL, ModelVersion(v)).unwrap().parent, Some(ModelVersion(v - 1)));
    }
    assert_eq!(status.global.map(|g| g.0), Some(ModelVersion(4)));

    registry.stop().await;
}
