//! The agent over the MQTT control plane: an embedded broker, a stand-in aggregator service on
//! MQTT (publishes a signed announcement, answers MQTT uploads with signed receipts), and an
//! agent whose QUIC aggregator fails every round poll and upload (it still serves the base
//! model, which is always fetched over QUIC). The agent learns the round over MQTT, trains,
//! switches to the MQTT upload path after its QUIC failures, gets its receipt, and its outbox
//! empties; its signed status reaches the service.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ed25519_dalek::SigningKey;
use fedfleet_agent::AgentStore;
use fedfleet_agent::agent::{Agent, Clock, LocalData, ShellConfig, SystemClock};
use fedfleet_agent::clients::{Aggregator, BaseModel, TransportError, UploadReply};
use fedfleet_agent::lifecycle::{Backoff, CoreConfig, DurableLifecycle, HealthPolicy};
use fedfleet_agent::mqtt::{MqttAggregator, MqttRegistry, MqttUploadOptions, StatusPublisher, UploadPath};
use fedfleet_certs::{AllowList, DeviceIdentity, LEAF_DAYS, ServerIdentity};
use fedfleet_control::{
    AssemblerLimits, BrokerConfig, ClientOptions, ControlClient, ControlEvent, EmbeddedBroker, Role, device_tls, service_tls,
};
use fedfleet_learning::{Dataset, ModelSpec, Partition, model::init_bundle};
use fedfleet_protocol::{DeviceId, FleetId, ModelRef, Receipt, RoundAnnouncement, RoundConfig, RoundId, Selection, Signed};
use fedfleet_testkit::fakes::FakeRegistry;

/// QUIC that is blocked for everything but the base model download.
struct Blocked {
    base: BaseModel,
}

impl Aggregator for Blocked {
    async fn current_round(&self, _: &FleetId) -> Result<Option<RoundAnnouncement>, TransportError> {
        Err(TransportError("quic blocked".into()))
    }
    async fn fetch_base_model(&self, _: &ModelRef) -> Result<BaseModel, TransportError> {
        Ok(self.base.clone())
    }
    async fn upload(&self, _: &[u8], _: &[u8]) -> Result<UploadReply, TransportError> {
        Err(TransportError("quic blocked".into()))
    }
}

fn options(port: u16, id: &str, fleet: &FleetId) -> ClientOptions {
    let mut o = ClientOptions::new("127.0.0.1", port, id, fleet.clone());
    o.backoff_initial = Duration::from_millis(50);
    o.backoff_max = Duration::from_millis(500);
    o.chunk_bytes = 16 * 1024;
    o
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn learns_round_over_mqtt_and_falls_back_to_mqtt_upload() {
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let fleet = FleetId::new("fleetm").unwrap();
    let device = DeviceId::new("dev-1").unwrap();
    let pki =
        fedfleet_testkit::services::fleet_pki(&dir.path().join("pki"), &fleet, &["aggregator"], std::slice::from_ref(&device), LEAF_DAYS)
            .unwrap();
    let servers = pki.dir().join("servers");
    let broker = EmbeddedBroker::start(BrokerConfig::new(
        ([127, 0, 0, 1], 0).into(),
        pki.ca_cert_path(),
        servers.join("aggregator.crt"),
        servers.join("aggregator.key"),
    ))
    .await
    .unwrap();
    let port = broker.local_addr().port();
    let agg_key = SigningKey::from_bytes(&[21; 32]);

    // The model and the round.
    let spec = ModelSpec::digits_mlp();
    let spec_json = spec.to_json();
    let bytes = init_bundle(&spec, 1).unwrap().encode();
    let base =
        ModelRef { name: "digits".into(), version: fedfleet_protocol::ModelVersion(0), digest: fedfleet_protocol::Digest::of(&bytes) };
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let round = RoundAnnouncement {
        fleet: fleet.clone(),
        round: RoundId(1),
        base_model: base.clone(),
        config: RoundConfig { local_epochs: 1, batch_size: 16, learning_rate: 0.1, ..Default::default() },
        deadline_unix_ms: clock.now_ms() + 3_600_000,
        selection: Selection::All,
    };

    // The aggregator side: announces, receipts every verified MQTT upload, records statuses.
    let id = ServerIdentity::load(pki.dir(), "aggregator").unwrap();
    let keys = Arc::new(AllowList::load(pki.allow_list_path()).unwrap());
    let role = Role::Service { keys, status: true, updates: true, limits: AssemblerLimits::default() };
    let (svc, mut svc_events) = ControlClient::start(options(port, "aggregator", &fleet), service_tls(pki.ca(), &id).unwrap(), role);
    svc.publish_announcement(&Signed::sign(round.clone(), &agg_key)).await.unwrap();
    let (seen_tx, mut seen_rx) = tokio::sync::mpsc::unbounded_channel::<(&'static str, DeviceId)>();
    {
        let svc = svc.clone();
        let agg_key = agg_key.clone();
        tokio::spawn(async move {
            while let Some(ev) = svc_events.recv().await {
                match ev {
                    ControlEvent::Update(u) => {
                        let h = u.signed().body().clone();
                        let r = Receipt {
                            fleet: h.fleet,
                            device: h.device.clone(),
                            round: h.round,
                            nonce: h.nonce,
                            payload_digest: h.payload_digest,
                            accepted_at_unix_ms: 1,
                        };
                        svc.publish_receipt(&Signed::sign(r, &agg_key)).await.unwrap();
                        let _ = seen_tx.send(("update", h.device));
                    }
                    ControlEvent::Status(s) => {
                        let _ = seen_tx.send(("status", s.body().device.clone()));
                    }
                    _ => {}
                }
            }
        });
    }

    // The agent: QUIC blocked, MQTT on `auto` after 2 failures.
    let identity = DeviceIdentity::load(pki.dir(), &device).unwrap();
    let (control, events) = ControlClient::start(
        options(port, device.as_str(), &fleet),
        device_tls(&identity).unwrap(),
        Role::Device { id: device.clone(), aggregator_key: agg_key.verifying_key(), registry_key: None },
    );
    let opts = MqttUploadOptions { path: UploadPath::Auto, switch_after: 2, receipt_timeout: Duration::from_secs(5), ..Default::default() };
    let agg = Arc::new(MqttAggregator::new(
        Arc::new(Blocked { base: BaseModel { spec: spec_json.clone(), bytes } }),
        control.clone(),
        events,
        opts,
    ));
    let reg = Arc::new(MqttRegistry::new(
        Arc::new(FakeRegistry::new(3, u64::MAX / 2)),
        StatusPublisher::new(control.clone(), identity.signing_key()),
    ));
    let (train, _) = Dataset::digits_split().unwrap();
    let part = Partition::Iid.split_dataset(&train, 10, 1).swap_remove(0);
    let (tr, holdout) = part.split(0.2, 1);
    let mut cfg = CoreConfig::new(device.clone(), fleet.clone());
    cfg.local_samples = tr.len() as u64;
    cfg.rng_seed = 5;
    cfg.backoff = Backoff { base_ms: 50, max_ms: 200 };
    cfg.health = HealthPolicy { max_latency_ms: 1_000.0, accuracy_margin: 0.05 };
    let store = AgentStore::open(dir.path().join("agent")).unwrap();
    let core = DurableLifecycle::open(cfg, store, Some(FakeRegistry::new(3, u64::MAX / 2).pinned_root()), None, clock.now_ms()).unwrap();
    let shell = ShellConfig { latency_samples: 8, ..Default::default() };
    let mut agent = Agent::new(core, agg.clone(), reg, identity.signing_key(), LocalData { train: tr, holdout }, clock.clone(), shell);

    let deadline = Instant::now() + Duration::from_secs(15);
    let mut uploaded = false;
    loop {
        assert!(
            Instant::now() < deadline,
            "no MQTT receipt in time: outbox {:?}, mqtt uploads {}",
            agent.core().pending_uploads().len(),
            agg.mqtt_uploads()
        );
        agent.poll_control().await.unwrap();
        agent.drive().await.unwrap();
        uploaded |= agg.mqtt_uploads() > 0;
        if uploaded && agent.core().store().outbox().unwrap().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    assert_eq!(agg.announced().map(|a| a.round), Some(RoundId(1)), "round learnt over MQTT");
    assert!(agg.mqtt_uploads() >= 1);

    // The service saw the update and a signed status from the device.
    let mut saw = (false, false);
    let until = Instant::now() + Duration::from_secs(3);
    while !(saw.0 && saw.1) && Instant::now() < until {
        if let Ok(Some((what, d))) = tokio::time::timeout(Duration::from_millis(200), seen_rx.recv()).await {
            assert_eq!(d, device);
            match what {
                "update" => saw.0 = true,
                _ => saw.1 = true,
            }
        }
    }
    assert!(saw.0, "service received the MQTT upload");
    assert!(saw.1, "service received a signed status");
    control.shutdown().await;
    svc.shutdown().await;
    broker.shutdown().await;
    assert!(started.elapsed() < Duration::from_secs(20), "took {:?}", started.elapsed());
}

#[test]
fn mqtt_section_parses_with_defaults() {
    let base = "fleet = \"fleetm\"\nstate_dir = \"/tmp/x\"\n[data]\ndigits_partition = { clients = 2, index = 0 }\n";
    let c = fedfleet_agent::config::AgentConfig::parse(&format!(
        "{base}[aggregator]\naddr = \"127.0.0.1:7400\"\nreceipt_key = \"r.pub\"\n[mqtt]\nhost = \"broker\"\nupload = \"mqtt\"\n"
    ))
    .unwrap();
    let m = c.mqtt.unwrap();
    assert_eq!((m.client.address().unwrap(), m.upload, m.switch_after), (("broker".into(), 8883), UploadPath::Mqtt, 3));
    let e = fedfleet_agent::config::AgentConfig::parse(&format!("{base}[mqtt]\nhost = \"b\"\n")).unwrap_err();
    assert!(e.contains("receipt_key"), "{e}");
    assert!(
        fedfleet_agent::config::AgentConfig::parse(&format!("{base}[mqtt]\nhost = \"b\"\nreceipt_key = \"k\"\nupload = \"udp\"\n"))
            .is_err()
    );
    // The keys every program shares are named alike, a misspelt one is refused by name, and
    // the broker must be named.
    let e =
        fedfleet_agent::config::AgentConfig::parse(&format!("{base}[mqtt]\nhost = \"b\"\nreceipt_key = \"k\"\nprot = 1883\n")).unwrap_err();
    assert!(e.contains("unknown key(s) prot"), "{e}");
    let e = fedfleet_agent::config::AgentConfig::parse(&format!("{base}[mqtt]\nreceipt_key = \"k\"\n")).unwrap_err();
    assert!(e.contains("host is missing"), "{e}");
    // The shipped example still parses.
    fedfleet_agent::config::AgentConfig::parse(include_str!("../../dist/agent.toml")).unwrap();
}
