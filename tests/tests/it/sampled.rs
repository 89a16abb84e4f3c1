//! Issue 27: a campaign that samples a big enrolled fleet. Devices hold only their identity until
//! a round selects them; the round announcement reaches them as a broadcast, each checks its own
//! selection, and a device that is not selected never connects: the aggregator authenticates
//! about as many device connections as the rounds selected devices, not one per enrolled device.

use std::time::Duration;

use fedfleet_aggregator::config::{CampaignDefaults, Config, ModelConfig};
use fedfleet_aggregator::wire::CampaignOverrides;
use fedfleet_learning::ModelSpec;
use fedfleet_protocol::DeviceId;
use fedfleet_testkit::sampled::{DeviceBehaviour, SampledFleet, SampledStats};
use fedfleet_testkit::services::RunningAggregator;
use fedfleet_testkit::sim::FleetOptions;

use crate::inproc::{FleetDir, write_initial_model};

const ENROLLED: usize = 600;
const ROUNDS: u32 = 3;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_a_round_does_not_select_never_connect() {
    tokio::time::timeout(Duration::from_secs(120), body()).await.expect("sampled fleet test timed out");
}

async fn body() {
    let listener = DeviceId::new("listener").unwrap();
    let fleet_dir = FleetDir::new("fleet-sampled", &["registry", "aggregator"], std::slice::from_ref(&listener));
    let ids: Vec<DeviceId> = (0..ENROLLED).map(|i| DeviceId::new(format!("s-{i:04}")).unwrap()).collect();
    let identities = fleet_dir.pki.enroll_devices(&ids, 30, false).unwrap();
    let root = fleet_dir.root();
    let registry = fleet_dir.start_registry(&["aggregator"]);
    let spec = ModelSpec::digits_mlp();
    let model = ModelConfig { name: "digits".into(), spec: spec.clone(), initial: write_initial_model(root, &spec), validation: None };
    // 5 % of the fleet a round (30), over-selection 1.3: about 39 invited of 600.
    let cfg = Config {
        campaign: CampaignDefaults {
            rounds: ROUNDS,
            target: 30,
            quorum: 24,
            deadline_secs: 30,
            sampling_rate: 0.05,
            over_selection: 1.3,
            learning_rate: 0.1,
            ..Default::default()
        },
        ..Config::new("127.0.0.1:0".parse().unwrap(), fleet_dir.pki_dir.clone(), root.join("aggregator"), model)
    };
    let running = RunningAggregator::publishing_to(cfg, registry.addr).await.unwrap();
    let agg = running.agg.clone();
    let options = FleetOptions::new(
        &fleet_dir.pki_dir,
        fleet_dir.fleet_id.clone(),
        Vec::new(),
        running.addr,
        registry.addr,
        agg.receipt_key(),
        registry.pinned_root.clone(),
        "digits",
        root.join("agents"),
    );
    let listen_as = fedfleet_certs::DeviceIdentity::load(&fleet_dir.pki_dir, &listener).unwrap();
    let behaviour = DeviceBehaviour { train_median_ms: 20.0, train_sigma: 0.5, ..DeviceBehaviour::default() };
    let mut fleet = SampledFleet::start(options, identities, &listen_as, behaviour).unwrap();
    agg.start_campaign(CampaignOverrides { seed: Some(3), ..Default::default() }).await.unwrap();
    while agg.status().last_outcome.is_none() {
        fleet.step().await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    fleet.settle().await;
    let status = agg.status();
    assert_eq!(status.last_outcome.as_deref(), Some("completed"), "{status:?}");

    let st = &fleet.stats;
    let (selected, acknowledged) = (SampledStats::get(&st.selected), SampledStats::get(&st.acknowledged));
    assert_eq!(SampledStats::get(&st.rounds), u64::from(ROUNDS), "every round was heard");
    assert!(acknowledged >= u64::from(ROUNDS) * 24, "{acknowledged} acknowledged");
    assert!(selected < ENROLLED as u64 / 3, "{selected} selections of {ENROLLED} over {ROUNDS} rounds (about 117 expected)");
    // The listener's connection, and one per selected device that took part (an upload may
    // reconnect once after a refusal): nowhere near one per enrolled device.
    let connections = agg.metrics().device_connections.get();
    eprintln!("{ENROLLED} enrolled, {ROUNDS} rounds: {selected} selections, {acknowledged} acknowledged, {connections} device connections");
    assert!(connections >= acknowledged / 2, "{connections} connections for {acknowledged} acknowledged updates");
    assert!(connections <= 2 * selected + 1, "{connections} device connections for {selected} selections of {ENROLLED} enrolled devices");
    drop(fleet);
    running.stop().await;
    registry.stop().await;
}
