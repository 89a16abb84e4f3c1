//! Shared fixture: a fleet PKI in a tempdir, clients, a scripted device and the round flow run
//! against any broker.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use ed25519_dalek::SigningKey;
use fedfleet_certs::{AllowList, DeviceIdentity, LEAF_DAYS, Pki, ServerIdentity};
use fedfleet_control::{
    AssemblerLimits, BrokerConfig, ClientOptions, ControlClient, ControlEvent, ControlEvents, Presence, QoS, Rejected, Role, device_tls,
    service_tls,
};
use fedfleet_protocol::{
    DType, DeviceId, DeviceState, DeviceStatus, Digest, FleetId, ModelRef, ModelVersion, Receipt, RejectReason, RoundAnnouncement,
    RoundConfig, RoundId, Selection, Signed, UpdateHeader, random_nonce,
};
use fedfleet_testkit::services::fleet_pki;
use tokio::sync::mpsc;
use tokio::time::{Instant, timeout};

/// How long any one step may take. A NATS cluster that lost a node takes 10-30 s on 2 busy cores
/// to elect new JetStream leaders before it takes MQTT connections again.
pub const WAIT: Duration = Duration::from_secs(60);

pub struct Fleet {
    pub dir: tempfile::TempDir,
    pub pki: Pki,
    pub fleet: FleetId,
    pub aggregator_key: SigningKey,
    pub registry_key: SigningKey,
    pub devices: Vec<DeviceId>,
    /// More broker ports (the other nodes of a cluster) every client fails over to.
    pub failover: Vec<u16>,
    /// Every client's reconnect backoff ceiling.
    pub backoff_max: Duration,
}

impl Fleet {
    pub fn new(n: usize) -> Fleet {
        Self::with_fleet(n, "demo")
    }

    pub fn with_fleet(n: usize, fleet: &str) -> Fleet {
        let dir = tempfile::tempdir().unwrap();
        let fleet = FleetId::new(fleet).unwrap();
        let devices: Vec<DeviceId> = (1..=n).map(|i| DeviceId::new(format!("dev-{i}")).unwrap()).collect();
        let pki = fleet_pki(&dir.path().join("pki"), &fleet, &["aggregator"], &devices, LEAF_DAYS).unwrap();
        Fleet {
            dir,
            pki,
            fleet,
            aggregator_key: SigningKey::from_bytes(&[11; 32]),
            registry_key: SigningKey::from_bytes(&[12; 32]),
            devices,
            failover: Vec::new(),
            backoff_max: Duration::from_millis(500),
        }
    }

    pub fn server_files(&self) -> (PathBuf, PathBuf) {
        let d = self.pki.dir().join("servers");
        (d.join("aggregator.crt"), d.join("aggregator.key"))
    }

    pub fn broker_config(&self, port: u16) -> BrokerConfig {
        let (crt, key) = self.server_files();
        BrokerConfig::new(([127, 0, 0, 1], port).into(), self.pki.ca_cert_path(), crt, key)
    }

    pub fn options(&self, port: u16, client_id: &str) -> ClientOptions {
        let mut o = ClientOptions::new("127.0.0.1", port, client_id, self.fleet.clone());
        o.keep_alive = Duration::from_secs(5);
        o.backoff_initial = Duration::from_millis(50);
        o.backoff_max = self.backoff_max;
        o.chunk_bytes = 16 * 1024;
        o.failover = self.failover.iter().map(|p| ("127.0.0.1".to_owned(), *p)).collect();
        o
    }

    /// The aggregator's control client: hears status and uploads.
    pub fn aggregator(&self, port: u16) -> (ControlClient, ControlEvents) {
        let id = ServerIdentity::load(self.pki.dir(), "aggregator").unwrap();
        let tls = service_tls(self.pki.ca(), &id).unwrap();
        let keys = Arc::new(AllowList::load(self.pki.allow_list_path()).unwrap());
        let role = Role::Service { keys, status: true, updates: true, limits: AssemblerLimits::default() };
        ControlClient::start(self.options(port, "aggregator"), tls, role)
    }

    /// A client with a fleet service's certificate that hears nothing: it publishes what a
    /// compromised service (or any client of a broker without access rules) could.
    pub fn rogue_service(&self, port: u16) -> (ControlClient, ControlEvents) {
        let id = ServerIdentity::load(self.pki.dir(), "aggregator").unwrap();
        let tls = service_tls(self.pki.ca(), &id).unwrap();
        let keys = Arc::new(AllowList::load(self.pki.allow_list_path()).unwrap());
        let role = Role::Service { keys, status: false, updates: false, limits: AssemblerLimits::default() };
        ControlClient::start(self.options(port, "rogue"), tls, role)
    }

    pub fn device(&self, port: u16, id: &DeviceId) -> (ControlClient, ControlEvents, SigningKey) {
        let identity = DeviceIdentity::load(self.pki.dir(), id).unwrap();
        let tls = device_tls(&identity).unwrap();
        let role = Role::Device {
            id: id.clone(),
            aggregator_key: self.aggregator_key.verifying_key(),
            registry_key: Some(self.registry_key.verifying_key()),
        };
        let (c, e) = ControlClient::start(self.options(port, id.as_str()), tls, role);
        (c, e, identity.signing_key())
    }

    /// Whether device `id` gets connected to the broker at `port` within `within` (then lets go).
    pub async fn connects(&self, port: u16, id: &DeviceId, within: Duration) -> bool {
        let (client, mut events, _) = self.device(port, id);
        let connected = tokio::time::timeout(within, async {
            while let Some(ev) = events.recv().await {
                if matches!(ev, ControlEvent::Connected { .. }) {
                    return true;
                }
            }
            false
        })
        .await
        .unwrap_or(false);
        drop(client);
        connected
    }

    pub fn announcement(&self, round: u64) -> Signed<RoundAnnouncement> {
        Signed::sign(
            RoundAnnouncement {
                fleet: self.fleet.clone(),
                round: RoundId(round),
                base_model: base_model(round),
                config: RoundConfig::default(),
                deadline_unix_ms: 4_000_000_000_000,
                selection: Selection::All,
            },
            &self.aggregator_key,
        )
    }
}

/// `device`'s status while it trains in `round`.
pub fn training_status(fleet: &FleetId, device: &DeviceId, round: u64) -> DeviceStatus {
    DeviceStatus {
        fleet: fleet.clone(),
        device: device.clone(),
        reported_at_unix_ms: now_ms(),
        state: DeviceState::Training { round: RoundId(round) },
        active: None,
        staged: None,
        rollout_id: None,
    }
}

/// A broker holding devices to their topics: the aggregator (on `agg_port`) announces round 6;
/// device b (on `forger_port`) publishes a retained announcement of its own and a status on
/// device a's topic; device a, connecting later on `joiner_port`, hears the real announcement,
/// and the aggregator never receives the forged status.
pub async fn forgeries_are_dropped_by_the_broker(f: &Fleet, agg_port: u16, forger_port: u16, joiner_port: u16) {
    let (agg, mut agg_events) = f.aggregator(agg_port);
    let (dev_b, mut b_events, key_b) = f.device(forger_port, &f.devices[1]);
    for (what, events) in [("aggregator", &mut agg_events), ("b", &mut b_events)] {
        wait_for(events, what, |e| matches!(e, ControlEvent::Connected { .. }).then_some(())).await;
    }
    agg.publish_announcement(&f.announcement(6)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let forged = Signed::sign(f.announcement(7).into_body(), &key_b);
    dev_b.publish_raw(&fedfleet_control::topics::rounds(&f.fleet), forged.encode(), QoS::AtLeastOnce, true).await.unwrap();
    let forged_status = Signed::sign(training_status(&f.fleet, &f.devices[0], 6), &key_b);
    let a_status = fedfleet_control::topics::status(&f.fleet, &f.devices[0]);
    dev_b.publish_raw(&a_status, forged_status.encode(), QoS::AtLeastOnce, true).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let dev_a = late_joiner_hears(f, joiner_port, &f.devices[0], 6).await;
    // Whatever reached the aggregator meanwhile, none of it was the forged status.
    while let Ok(Some(e)) = timeout(Duration::from_millis(300), agg_events.recv()).await {
        assert!(!matches!(e, ControlEvent::Rejected(_)), "a forgery reached the aggregator: {e:?}");
    }
    assert!(agg.stats().rejected.is_empty(), "{:?}", agg.stats());
    for c in [&agg, &dev_a, &dev_b] {
        c.shutdown().await;
    }
}

/// Connects `device` on `port` and waits for the retained announcement, which must be `round`'s
/// and no forgery (a refused message panics). Returns the device's client.
pub async fn late_joiner_hears(f: &Fleet, port: u16, device: &DeviceId, round: u64) -> ControlClient {
    let (client, mut events, _) = f.device(port, device);
    let heard = wait_for(&mut events, "retained announcement", |e| match e {
        ControlEvent::Announcement(s) => Some(s.body().round.0),
        ControlEvent::Rejected(r) => panic!("the forgery reached a device: {r}"),
        _ => None,
    })
    .await;
    assert_eq!(heard, round);
    client
}

pub fn base_model(round: u64) -> ModelRef {
    ModelRef { name: "digits".into(), version: ModelVersion(round), digest: Digest::of(&round.to_be_bytes()) }
}

/// The update a device sends in a round: deterministic, ~50 KB (4 chunks of 16 KiB).
pub fn payload(device: &DeviceId, round: u64) -> Vec<u8> {
    let seed = Digest::of(format!("{device}/{round}").as_bytes()).0;
    (0..50_000usize).map(|i| seed[i % 32].wrapping_add((i / 32) as u8)).collect()
}

pub fn signed_update(fleet: &FleetId, device: &DeviceId, key: &SigningKey, round: u64, payload: &[u8]) -> fedfleet_protocol::SignedUpdate {
    Signed::sign(
        UpdateHeader {
            device: device.clone(),
            fleet: fleet.clone(),
            round: RoundId(round),
            base_model: base_model(round).digest,
            nonce: random_nonce(&mut rand_core::OsRng),
            sample_count: 100,
            payload_len: payload.len() as u64,
            payload_digest: Digest::of(payload),
            payload_dtype: DType::F32,
        },
        key,
    )
}

/// Waits for the first event `f` maps to `Some`, skipping others.
pub async fn wait_for<T>(events: &mut ControlEvents, what: &str, mut f: impl FnMut(&ControlEvent) -> Option<T>) -> T {
    let deadline = Instant::now() + WAIT;
    loop {
        let ev = timeout(deadline.saturating_duration_since(Instant::now()), events.recv())
            .await
            .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
            .unwrap_or_else(|| panic!("event stream ended waiting for {what}"));
        if let Some(t) = f(&ev) {
            return t;
        }
    }
}

#[derive(Debug)]
pub enum Report {
    Connected(DeviceId, u64),
    Joined(DeviceId, u64),
    Receipted(DeviceId, u64),
    Rejected(DeviceId, Rejected),
}

/// A scripted agent: joins every announced round, uploads over MQTT, re-sends until its
/// receipt arrives (as the agent's outbox does), reports a status on joining.
pub async fn run_device(
    client: ControlClient,
    mut events: ControlEvents,
    id: DeviceId,
    key: SigningKey,
    fleet: FleetId,
    reports: mpsc::UnboundedSender<Report>,
) {
    let mut pending: Option<(fedfleet_protocol::SignedUpdate, Vec<u8>)> = None;
    let resend = Duration::from_millis(1500);
    let mut next_resend = Instant::now() + resend;
    loop {
        tokio::select! {
            ev = events.recv() => {
                let Some(ev) = ev else { return };
                match ev {
                    ControlEvent::Connected { count } => {
                        let _ = reports.send(Report::Connected(id.clone(), count));
                        if let Some((s, p)) = &pending {
                            client.upload_update(s, p).await.unwrap();
                            next_resend = Instant::now() + resend;
                        }
                    }
                    ControlEvent::Announcement(a) => {
                        let round = a.body().round.0;
                        let _ = reports.send(Report::Joined(id.clone(), round));
                        client.publish_status(&Signed::sign(training_status(&fleet, &id, round), &key)).await.unwrap();
                        let p = payload(&id, round);
                        let s = signed_update(&fleet, &id, &key, round, &p);
                        client.upload_update(&s, &p).await.unwrap();
                        next_resend = Instant::now() + resend;
                        pending = Some((s, p));
                    }
                    ControlEvent::Receipt(r) => {
                        let r = r.body();
                        if pending.as_ref().is_some_and(|(s, _)| s.body().nonce == r.nonce) {
                            pending = None;
                            let _ = reports.send(Report::Receipted(id.clone(), r.round.0));
                        }
                    }
                    ControlEvent::Rejected(r) => { let _ = reports.send(Report::Rejected(id.clone(), r)); }
                    _ => {}
                }
            }
            _ = tokio::time::sleep_until(next_resend), if pending.is_some() => {
                let (s, p) = pending.as_ref().unwrap();
                client.upload_update(s, p).await.unwrap();
                next_resend = Instant::now() + resend;
            }
        }
    }
}

pub fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64
}

async fn wait_reports(rx: &mut mpsc::UnboundedReceiver<Report>, what: &str, done: impl FnMut(&Report) -> bool) {
    wait_reports_for(rx, what, WAIT, done).await
}

async fn wait_reports_for(rx: &mut mpsc::UnboundedReceiver<Report>, what: &str, wait: Duration, mut done: impl FnMut(&Report) -> bool) {
    let deadline = Instant::now() + wait;
    loop {
        let r = timeout(deadline.saturating_duration_since(Instant::now()), rx.recv())
            .await
            .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
            .unwrap();
        if let Report::Rejected(d, r) = &r {
            panic!("device {d} rejected a genuine message: {r}");
        }
        if done(&r) {
            return;
        }
    }
}

/// The aggregator's signed receipt for the update `h`.
async fn send_receipt(f: &Fleet, agg: &ControlClient, h: &UpdateHeader) {
    let receipt = Receipt {
        fleet: f.fleet.clone(),
        device: h.device.clone(),
        round: h.round,
        nonce: h.nonce,
        payload_digest: h.payload_digest,
        accepted_at_unix_ms: now_ms(),
    };
    agg.publish_receipt(&Signed::sign(receipt, &f.aggregator_key)).await.unwrap();
}

/// Waits until every device holds its receipt for `round`, answering re-sent updates of that
/// round meanwhile: sessions are clean, so a receipt published while a device was still
/// resubscribing after a reconnect is lost, and the device re-sends until one arrives.
async fn await_receipts(
    f: &Fleet,
    agg: &ControlClient,
    events: &mut ControlEvents,
    rx: &mut mpsc::UnboundedReceiver<Report>,
    round: u64,
    presence: &mut Presence,
) {
    let mut receipted = BTreeSet::new();
    let deadline = Instant::now() + WAIT;
    while receipted.len() < f.devices.len() {
        tokio::select! {
            r = rx.recv() => match r.unwrap() {
                Report::Receipted(d, n) if n == round => { receipted.insert(d); }
                Report::Rejected(d, r) => panic!("device {d} rejected a genuine message: {r}"),
                _ => {}
            },
            ev = events.recv() => match ev.unwrap() {
                ControlEvent::Update(v) if v.signed().body().round.0 == round => {
                    send_receipt(f, agg, v.signed().body()).await;
                }
                ControlEvent::Status(s) => presence.record(s.body(), now_ms()),
                ControlEvent::Rejected(r) if lost_header(&r) => {}
                ControlEvent::Rejected(r) => panic!("aggregator rejected a genuine message: {r}"),
                _ => {}
            },
            _ = tokio::time::sleep_until(deadline) => {
                panic!("timed out waiting for receipts of round {round}: {receipted:?} only")
            }
        }
    }
}

/// The aggregator side of one round: collects a verified update from every device (checking
/// the bytes are exactly those sent), answers each with a signed receipt.
async fn collect_round(f: &Fleet, agg: &ControlClient, events: &mut ControlEvents, round: u64, presence: &mut Presence) {
    let mut got: BTreeSet<DeviceId> = BTreeSet::new();
    let deadline = Instant::now() + WAIT;
    while got.len() < f.devices.len() {
        let ev = timeout(deadline.saturating_duration_since(Instant::now()), events.recv())
            .await
            .unwrap_or_else(|_| panic!("round {round}: updates from {got:?} only"))
            .unwrap();
        match ev {
            ControlEvent::Update(v) => {
                let h = v.signed().body().clone();
                if h.round.0 != round {
                    continue; // a late re-send of an earlier round
                }
                assert_eq!(v.payload(), payload(v.device(), round), "bytes differ from those sent");
                assert_eq!(&h.device, v.device());
                got.insert(v.device().clone());
                send_receipt(f, agg, &h).await;
            }
            ControlEvent::Status(s) => presence.record(s.body(), now_ms()),
            ControlEvent::Rejected(r) if lost_header(&r) => {}
            ControlEvent::Rejected(r) => panic!("aggregator rejected a genuine message: {r}"),
            _ => {}
        }
    }
}

/// A chunk whose upload header the broker lost while it restarted (clean sessions, QoS 1 in
/// flight): refused as malformed, harmless, and the device re-sends the whole upload.
fn lost_header(r: &Rejected) -> bool {
    r.reason == RejectReason::Malformed && r.detail.contains("header was not received")
}

/// announcement -> agents join -> updates arrive -> next round, against the broker on `port`.
/// `mid_round` runs after every device joined round 1 (e.g. restarts the broker); when it
/// returns true, the flow waits for every client to reconnect before going on.
pub async fn round_flow(f: &Fleet, port: u16, mid_round: impl AsyncFnOnce() -> bool) {
    let (agg, mut agg_events) = f.aggregator(port);
    wait_for(&mut agg_events, "aggregator connect", |e| matches!(e, ControlEvent::Connected { .. }).then_some(())).await;
    agg.publish_announcement(&f.announcement(1)).await.unwrap();

    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut clients = Vec::new();
    for d in &f.devices {
        let (c, e, k) = f.device(port, d);
        clients.push(c.clone());
        tokio::spawn(run_device(c, e, d.clone(), k, f.fleet.clone(), tx.clone()));
    }
    let mut joined = BTreeSet::new();
    wait_reports(&mut rx, "devices joining round 1", |r| {
        if let Report::Joined(d, 1) = r {
            joined.insert(d.clone());
        }
        joined.len() == f.devices.len()
    })
    .await;

    let mut presence = Presence::new();
    let restarted = mid_round().await;
    if restarted {
        let mut reconnected = BTreeSet::new();
        // A NATS cluster that lost a node took up to a minute on 2 cores busy with other tests to
        // take MQTT subscriptions again (JetStream stream leader elections, 4 s API time-outs).
        wait_reports_for(&mut rx, "devices reconnecting", 3 * WAIT, |r| {
            if let Report::Connected(d, n) = r
                && *n >= 2
            {
                reconnected.insert(d.clone());
            }
            reconnected.len() == f.devices.len()
        })
        .await;
    }

    collect_round(f, &agg, &mut agg_events, 1, &mut presence).await;
    if restarted {
        // The updates may all have arrived before the restart; the aggregator's own reconnect
        // (its backoff is its own) is awaited here, not assumed.
        let deadline = Instant::now() + WAIT;
        while agg.stats().connects < 2 {
            assert!(Instant::now() < deadline, "the aggregator did not reconnect: {:?}", agg.stats());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    await_receipts(f, &agg, &mut agg_events, &mut rx, 1, &mut presence).await;

    // Next round.
    agg.publish_announcement(&f.announcement(2)).await.unwrap();
    collect_round(f, &agg, &mut agg_events, 2, &mut presence).await;
    await_receipts(f, &agg, &mut agg_events, &mut rx, 2, &mut presence).await;

    // Status heartbeats reached the aggregator, verified (retained ones arrive on reconnect too).
    let deadline = Instant::now() + WAIT;
    while presence.known() < f.devices.len() {
        match timeout(deadline.saturating_duration_since(Instant::now()), agg_events.recv()).await {
            Ok(Some(ControlEvent::Status(s))) => presence.record(s.body(), now_ms()),
            Ok(Some(_)) => {}
            _ => panic!("status of {} devices only", presence.known()),
        }
    }
    assert_eq!(presence.online(now_ms(), 60_000), f.devices.len());

    let stats = agg.stats();
    // Only chunks orphaned by a broker restart may have been refused (see `lost_header`).
    assert!(stats.rejected.keys().all(|reason| restarted && *reason == RejectReason::Malformed), "{stats:?}");
    for c in &clients {
        assert!(c.stats().rejected.is_empty(), "{:?}", c.stats());
        c.shutdown().await;
    }
    agg.shutdown().await;
}
