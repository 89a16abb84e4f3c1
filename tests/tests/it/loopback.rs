//! Issue 6: a real registry and a real aggregator (publishing into the registry through
//! `RegistryPublisher`), 5 agents over QUIC completing 3 rounds, the aggregator stopped during
//! round 2's uploads and restarted on the same address and data directory. Every update is
//! accounted for exactly once and the published versions chain in the registry.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use fedfleet_agent::sim::{FleetOptions, RemoteFleet};
use fedfleet_aggregator::config::{CampaignDefaults, Config, ModelConfig, PublishConfig};
use fedfleet_aggregator::publish::RegistryPublisher;
use fedfleet_aggregator::service::Aggregator;
use fedfleet_aggregator::wire::CampaignOverrides;
use fedfleet_certs::{ALPN_V1, Pki, RevocationWatcher, ServerIdentity, tls};
use fedfleet_learning::ModelSpec;
use fedfleet_protocol::{DeviceId, FleetId, ModelVersion, RoundId};
use fedfleet_registry::metadata::{self, Lifetimes, MetadataSigner};
use fedfleet_registry::metrics::Metrics;
use fedfleet_registry::ops::Registry;
use fedfleet_registry::server::{self, ServerOptions};
use fedfleet_registry::store::{Store, StoreConfig};

const MODEL: &str = "digits";
const N: usize = 5;

struct RunningAgg {
    agg: Aggregator,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

async fn start_agg(cfg: &Config, reg_addr: SocketAddr, addr: SocketAddr) -> (RunningAgg, SocketAddr) {
    let publisher = RegistryPublisher::connect_lazy(&cfg.pki_dir, "aggregator", reg_addr, "localhost").unwrap();
    let agg = Aggregator::open(cfg.clone(), Box::new(publisher)).unwrap();
    // The old endpoint may still hold the port for a moment after a stop.
    let mut tries = 0;
    let endpoint = loop {
        match agg.bind(addr) {
            Ok(e) => break e,
            Err(e) if tries < 50 => {
                tries += 1;
                let _ = e;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("rebinding {addr}: {e}"),
        }
    };
    let bound = endpoint.local_addr().unwrap();
    let (stop, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(agg.clone().run(endpoint, async move {
        let _ = rx.await;
    }));
    (RunningAgg { agg, stop, task }, bound)
}

async fn wait_for(what: &str, secs: u64, mut f: impl FnMut() -> bool) {
    let end = tokio::time::Instant::now() + Duration::from_secs(secs);
    while !f() {
        assert!(tokio::time::Instant::now() < end, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn round_acks(fleet: &RemoteFleet, r: u64) -> usize {
    fleet.acks().iter().filter(|a| a.round == RoundId(r)).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_agents_three_rounds_aggregator_restart() {
    tokio::time::timeout(Duration::from_secs(90), body()).await.expect("loopback test timed out");
}

async fn body() {
    let dir = tempfile::tempdir().unwrap();
    let root_dir = dir.path();
    let pki_dir = root_dir.join("pki");
    let fleet_id = FleetId::new("fleet-e2e").unwrap();
    let pki = Pki::init(&pki_dir, &fleet_id, 30, false).unwrap();
    pki.issue_server("registry", &[], 30, false).unwrap();
    pki.issue_server("aggregator", &[], 30, false).unwrap();
    let devices: Vec<DeviceId> = (0..N).map(|i| DeviceId::new(format!("edge-{i:02}")).unwrap()).collect();
    for d in &devices {
        pki.enroll_device(d, 30, false).unwrap();
    }

    // Registry, in process; the aggregator's service certificate is an operator.
    let rdata = root_dir.join("registry");
    metadata::init_keys(&rdata, 30, false).unwrap();
    let store = Store::open(rdata.join("store"), StoreConfig::default()).unwrap();
    let signer = MetadataSigner::load(&rdata, Lifetimes::default()).unwrap();
    let reg = Arc::new(Registry::new(store, fleet_id.clone(), Some(signer), Arc::new(Metrics::default())).unwrap());
    let pinned_root = reg.signer().unwrap().root().clone();
    let identity = ServerIdentity::load(&pki_dir, "registry").unwrap();
    let revocation = Arc::new(RevocationWatcher::open(&pki_dir).unwrap());
    let rtls = tls::server_config(pki.ca(), &identity, revocation, &[ALPN_V1]).unwrap();
    let rendpoint = fedfleet_net::server_endpoint(([127, 0, 0, 1], 0).into(), rtls).unwrap();
    let reg_addr = rendpoint.local_addr().unwrap();
    let mut opts = ServerOptions::new(rdata.join("incoming"));
    opts.operators = vec!["aggregator".into()];
    let (rstop, rrx) = tokio::sync::oneshot::channel::<()>();
    let rtask = tokio::spawn(server::run(rendpoint, reg.clone(), opts, async move {
        let _ = rrx.await;
    }));

    // Aggregator, in process, publishing into the registry.
    let spec = ModelSpec::digits_mlp();
    let initial = root_dir.join("initial.safetensors");
    std::fs::write(&initial, fedfleet_learning::model::init_bundle(&spec, 7).unwrap().encode()).unwrap();
    let cfg = Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        pki_dir: pki_dir.clone(),
        server_name: "aggregator".into(),
        data_dir: root_dir.join("aggregator"),
        metrics_addr: None,
        operators: vec!["operator".into()],
        publish_dir: None,
        publish: Some(PublishConfig { registry: reg_addr, server_name: "localhost".into() }),
        model: ModelConfig { name: MODEL.into(), spec: spec.clone(), initial, validation: None },
        campaign: CampaignDefaults { rounds: 3, target: N as u32, quorum: N as u32, deadline_secs: 600, lr: 0.1, ..Default::default() },
        compute: Default::default(),
    };
    let (running, agg_addr) = start_agg(&cfg, reg_addr, "127.0.0.1:0".parse().unwrap()).await;
    let receipt_key = running.agg.receipt_key();
    running.agg.start_campaign(CampaignOverrides { seed: Some(1), ..Default::default() }).await.unwrap();

    let mut fleet = RemoteFleet::start(FleetOptions::new(
        &pki_dir,
        fleet_id.clone(),
        devices.clone(),
        agg_addr,
        reg_addr,
        receipt_key,
        pinned_root,
        MODEL,
        root_dir.join("agents"),
    ))
    .unwrap();

    // Round 1: everyone trains and uploads.
    assert!(fleet.run_until(|f| round_acks(f, 1) == N, Duration::from_secs(30)).await.unwrap(), "round 1 uploads: {:?}", fleet.status());
    let agg = running.agg.clone();
    wait_for("round 2 to open", 20, || agg.status().open_round == Some(RoundId(2))).await;

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
        std::fs::write(st.blob_path(&g.digest).with_extension("spec.json"), spec.to_json()).unwrap();
    }
    // ... and the aggregator goes down: their uploads fail and stay in the outbox.
    drop(agg);
    let RunningAgg { agg: a0, stop, task } = running;
    drop(a0);
    drop(stop);
    task.await.unwrap();
    for a in &mut fleet.agents[2..] {
        a.drive().await.unwrap();
    }
    assert_eq!(round_acks(&fleet, 2), 2, "no upload can succeed while the aggregator is down");
    assert_eq!(fleet.pending(), N - 2, "{:?}", fleet.status());

    // Back on the same address and data directory: the outboxes drain, rounds 2 and 3 finish.
    let (running, again) = start_agg(&cfg, reg_addr, agg_addr).await;
    assert_eq!(again, agg_addr);
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
    let RunningAgg { agg: a0, stop, task } = running;
    drop(a0);
    drop(stop);
    task.await.unwrap();
    let astore = fedfleet_aggregator::persist::Store::open(&cfg.data_dir).unwrap();
    let mut accepted = Vec::new();
    for r in 1..=3 {
        for rec in astore.accepted_in(RoundId(r)).unwrap() {
            accepted.push((rec.device.clone(), rec.round, rec.payload_digest));
        }
    }
    let acks = fleet.acks();
    let ack_keys: Vec<_> = acks.iter().map(|a| (a.device.clone(), a.round, a.payload_digest)).collect();
    let ack_set: BTreeSet<_> = ack_keys.iter().cloned().collect();
    let acc_set: BTreeSet<_> = accepted.iter().cloned().collect();
    assert_eq!(accepted.len(), 3 * N, "aggregator records: {accepted:?}");
    assert_eq!(acc_set.len(), accepted.len(), "an update recorded twice");
    assert_eq!(ack_keys.len(), ack_set.len(), "an update acknowledged twice: {acks:?}");
    assert_eq!(ack_set, acc_set, "agents' acknowledged updates differ from the aggregator's records");
    assert_eq!(fleet.pending(), 0);

    // The registry holds the initial model and one version per round, parents chained.
    let versions = reg.store().versions(MODEL).unwrap();
    assert_eq!(versions, (1..=4).map(ModelVersion).collect::<Vec<_>>());
    assert_eq!(reg.store().version(MODEL, ModelVersion(1)).unwrap().parent, None);
    for v in 2..=4 {
        assert_eq!(reg.store().version(MODEL, ModelVersion(v)).unwrap().parent, Some(ModelVersion(v - 1)));
    }
    assert_eq!(status.global.map(|g| g.0), Some(ModelVersion(4)));

    drop(rstop);
    tokio::time::timeout(Duration::from_secs(15), rtask).await.unwrap().unwrap();
}
