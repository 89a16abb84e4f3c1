//! Crash/restart: a child `fedfleet-aggregator serve` is killed with SIGKILL after k of n
//! updates (and right after a round's last update, while it finalizes), restarted, and the
//! campaign completes; the published global model equals, bit for bit, the one of a run without
//! a crash.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fedfleet_aggregator::client::UploadOutcome;
use fedfleet_aggregator::wire::{CampaignOverrides, Request};
use fedfleet_protocol::{DType, RoundId};

use crate::support::*;

const N: usize = 6;
const ROUNDS: u32 = 2;

struct Child_ {
    child: Child,
    addr: SocketAddr,
}

fn spawn(toml: &std::path::Path, log: &std::path::Path) -> Child_ {
    let stderr = std::fs::OpenOptions::new().create(true).append(true).open(log).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_fedfleet-aggregator"))
        .args(["serve", "--config"])
        .arg(toml)
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let addr = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("child did not start: {line:?}\n{}", std::fs::read_to_string(log).unwrap_or_default()))
        .parse()
        .unwrap();
    Child_ { child, addr }
}

impl Child_ {
    /// SIGKILL: the process gets no chance to flush, close connections or finish a round.
    fn sigkill(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// SIGKILL, then a new child on the same config.
    fn sigkill_and_restart(&mut self, toml: &std::path::Path, log: &std::path::Path) {
        self.sigkill();
        *self = spawn(toml, log);
    }
}

/// Waits (30 s at most) for the campaign to complete with global model `version`.
async fn wait_completed(fleet: &Fleet, addr: SocketAddr, version: u64) {
    let op = fleet.operator(addr).await;
    let t0 = Instant::now();
    loop {
        let st = op.campaign(Request::CampaignStatus).await.unwrap();
        if st.last_outcome.as_deref() == Some("completed") {
            assert_eq!(st.global.unwrap().0, fedfleet_protocol::ModelVersion(version));
            return;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "campaign did not complete: {st:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Runs a 2-round campaign of N updates per round; `crashes` lists (round index, update index)
/// before which the child is SIGKILLed and restarted. Returns the final published model bytes.
async fn campaign(fleet: &Fleet, data: &str, crashes: &[(u32, usize)]) -> Vec<u8> {
    campaign_with(fleet, fleet.config(data, N as u32, ROUNDS), crashes).await
}

async fn campaign_with(fleet: &Fleet, cfg: fedfleet_aggregator::config::Config, crashes: &[(u32, usize)]) -> Vec<u8> {
    let toml = fleet.write_toml(&cfg);
    let log = cfg.data_dir.with_extension("log");
    let mut child = spawn(&toml, &log);
    let op = fleet.operator(child.addr).await;
    op.campaign(Request::CampaignStart(CampaignOverrides { seed: Some(42), ..Default::default() })).await.unwrap();
    let mut last: Option<(usize, fedfleet_protocol::SignedUpdate, Vec<u8>)> = None;
    for r in 0..ROUNDS {
        let round = RoundId(1 + r as u64);
        let mut dev0 = fleet.device_client(0, child.addr).await;
        let base = wait_round(&dev0, round).await;
        for i in 0..N {
            if crashes.contains(&(r, i)) {
                child.sigkill_and_restart(&toml, &log);
                dev0 = fleet.device_client(0, child.addr).await;
                // The round survived the crash, with the same base model.
                assert_eq!(wait_round(&dev0, round).await, base);
                // A resend of the last acknowledged update is answered with its receipt and
                // not counted again.
                if let Some((j, h, p)) = last.take() {
                    let c = fleet.device_client(j, child.addr).await;
                    assert!(matches!(c.upload(&h, &p).await.unwrap(), UploadOutcome::Accepted(_)));
                }
            }
            let payload = delta(1000 * r as u64 + i as u64).encode();
            let h =
                header(&fleet.fleet, &dev(i), round, base, nonce(i, r as u64), 10 + i as u64, &payload, DType::F32, &fleet.device_key(i));
            let c = fleet.device_client(i, child.addr).await;
            match c.upload(&h, &payload).await.unwrap() {
                UploadOutcome::Accepted(_) => {}
                UploadOutcome::Rejected(rej) => panic!("round {round} update {i}: {rej:?}"),
            }
            last = Some((i, h, payload));
        }
        last = None;
        if crashes.contains(&(r, N)) {
            // Killed right after the round's last update: while finalizing/publishing.
            child.sigkill_and_restart(&toml, &log);
        }
    }
    wait_completed(fleet, child.addr, 1 + ROUNDS as u64).await;
    // Graceful shutdown on SIGTERM.
    let status = Command::new("kill").args(["-TERM", &child.child.id().to_string()]).status().unwrap();
    assert!(status.success());
    let exit = child.child.wait().unwrap();
    assert!(exit.success(), "exit {exit:?}\n{}", std::fs::read_to_string(&log).unwrap_or_default());
    read_published(&cfg.publish_dir(), "tiny")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_and_restart_give_the_bit_identical_model() {
    let fleet = Fleet::new(N);
    let clean = campaign(&fleet, "clean", &[]).await;
    let crashed = campaign(&fleet, "crashed", &[(0, 3), (0, N), (1, 2)]).await;
    assert!(!clean.is_empty());
    assert!(clean == crashed, "the crashed run published a different model");
}

/// The same on the tensor path (`[compute] fold = "tensor"`, FedAdam), on every device this
/// build can fold on: the restarted service folds the stored updates in digest order, so the
/// crash changes no bit either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_and_restart_give_the_bit_identical_model_on_the_tensor_path() {
    use fedfleet_aggregator::config::{ComputeConfig, FoldBackend};
    let fleet = Fleet::new(N);
    for device in fedfleet_aggregator::accel::compiled_devices() {
        let cfg = |data: &str| {
            let mut c = fleet.config(&format!("{data}-{device}"), N as u32, ROUNDS);
            c.campaign.strategy = CampaignStrategy::named("fedadam").unwrap();
            c.compute = ComputeConfig { fold: FoldBackend::Tensor, device: device.into() };
            c
        };
        let clean = campaign_with(&fleet, cfg("tensor-clean"), &[]).await;
        let crashed_cfg = cfg("tensor-crashed");
        let log = crashed_cfg.data_dir.with_extension("log");
        let crashed = campaign_with(&fleet, crashed_cfg, &[(0, 2), (0, N), (1, 4)]).await;
        assert!(clean == crashed, "{device}: the crashed run published a different model");
        let log = std::fs::read_to_string(log).unwrap();
        assert!(log.contains("tensor fold"), "{device}: the child did not fold on tensors:\n{log}");
        assert!(log.contains(&format!("folded on burn tensors: {device} on")), "{device}: the log does not name the adapter:\n{log}");
    }
}

/// Robust strategies hold every update of the round, and DP-FedAvg draws its noise from a key
/// kept with its state: a restart rebuilds them from the stored payloads and the persisted
/// strategy, and the result is again the same bits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_and_restart_give_the_bit_identical_model_for_robust_strategies() {
    let fleet = Fleet::new(N);
    for strategy in ["median", "trimmed_mean", "krum", "dp_fedavg"] {
        let cfg = |data: &str| {
            let mut c = fleet.config(&format!("{strategy}-{data}"), N as u32, ROUNDS);
            c.campaign.strategy = CampaignStrategy::named(strategy).unwrap();
            c
        };
        let clean = campaign_with(&fleet, cfg("clean"), &[]).await;
        let crashed = campaign_with(&fleet, cfg("crashed"), &[(0, 3), (1, N)]).await;
        assert!(clean == crashed, "{strategy}: the crashed run published a different model");
    }
}

/// A client still holding a connection to a SIGKILLed aggregator learns at its next packet that
/// the connection is gone: the restarted process derives the same QUIC stateless-reset key from
/// its server identity, so its reset is accepted (with a random key the client would wait out the
/// 30 s idle timeout before reconnecting).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_of_a_killed_aggregator_are_reset_by_its_successor() {
    let fleet = Fleet::new(1);
    let mut cfg = fleet.config("reset", 1, 1);
    cfg.listen = std::net::UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let toml = fleet.write_toml(&cfg);
    let log = cfg.data_dir.with_extension("log");
    let mut child = spawn(&toml, &log);
    assert_eq!(child.addr, cfg.listen);
    let ca = fedfleet_certs::CaCert::load(fleet.pki.ca_cert_path()).unwrap();
    let id = fedfleet_certs::DeviceIdentity::load(fleet.pki.dir(), &dev(0)).unwrap();
    let tls = fedfleet_certs::tls::client_config(&ca, &id, &[fedfleet_certs::ALPN_V1]).unwrap();
    let endpoint = fedfleet_net::client_endpoint(tls).unwrap();
    let conn = fedfleet_net::connect(&endpoint, child.addr, "localhost").await.unwrap();

    child.sigkill_and_restart(&toml, &log); // no CONNECTION_CLOSE reaches the client
    // Application data on the old connection reaches the new process, which resets it.
    // (A keep-alive may have drawn the reset already, before any stream opens.)
    if let Ok((mut send, _recv)) = conn.open_bi().await {
        let _ = send.write_all(&[0u8; 1200]).await;
    }
    let why = tokio::time::timeout(Duration::from_secs(60), conn.closed()).await.expect("connection closed");
    assert!(matches!(why, quinn::ConnectionError::Reset), "{why:?}");
    child.sigkill();
}

/// Issue 31 defect 3: restarting on a data_dir whose global model the spec no longer describes
/// is refused with what changed, instead of resuming and refusing every update as too large.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_spec_on_an_existing_data_dir_is_refused_naming_the_change() {
    let fleet = Fleet::new(1);
    let cfg = fleet.config("spec-change", 1, 1);
    let svc = start(cfg.clone()).await;
    let op = fleet.operator(svc.addr).await;
    op.campaign(Request::CampaignStart(CampaignOverrides::default())).await.unwrap();
    svc.stop().await;
    let mut changed = cfg.clone();
    changed.model.spec = fedfleet_learning::ModelSpec::Mlp { input: vec![8], hidden: vec![5], classes: 3 };
    let key = fedfleet_aggregator::keys::load_or_create(&changed.data_dir).unwrap();
    let publisher = fedfleet_aggregator::publish::DirPublisher::new(changed.publish_dir(), key, "test");
    let err = fedfleet_aggregator::service::Aggregator::open(changed, Box::new(publisher), fedfleet_protocol::SystemClock::shared())
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(err.contains("model.spec changed since global model v1 was made (the spec reshapes"), "{err}");
    assert!(err.contains("[4, 8] -> [5, 8]"), "{err}");
    // The old spec still resumes.
    start(cfg).await.stop().await;
}

/// One upload of an asynchronous campaign's schedule: sent while buffer `open` is announced, by
/// `device`, trained on the model buffer `trained_for` announced.
struct Upload {
    open: u64,
    device: usize,
    trained_for: u64,
}

/// An asynchronous (FedBuff) campaign: buffers of 3, staleness bound 1, 3 versions, with stale
/// updates in every buffer after the first; the child is SIGKILLed and restarted before each
/// schedule index in `crashes` (`ASYNC_SCHEDULE.len()` = after the last one). Returns every
/// published version's bytes, oldest first.
async fn async_campaign(fleet: &Fleet, data: &str, crashes: &[usize]) -> Vec<Vec<u8>> {
    use fedfleet_aggregator::config::CampaignMode;
    #[rustfmt::skip]
    let schedule = [
        Upload { open: 1, device: 0, trained_for: 1 }, Upload { open: 1, device: 1, trained_for: 1 }, Upload { open: 1, device: 2, trained_for: 1 },
        Upload { open: 2, device: 3, trained_for: 1 }, Upload { open: 2, device: 4, trained_for: 1 }, Upload { open: 2, device: 0, trained_for: 2 },
        Upload { open: 3, device: 5, trained_for: 2 }, Upload { open: 3, device: 1, trained_for: 2 }, Upload { open: 3, device: 2, trained_for: 3 },
    ];
    let mut cfg = fleet.config(data, 3, 3);
    cfg.campaign.mode = CampaignMode::Async;
    cfg.campaign.max_staleness = Some(1);
    let toml = fleet.write_toml(&cfg);
    let log = cfg.data_dir.with_extension("log");
    let mut child = spawn(&toml, &log);
    let op = fleet.operator(child.addr).await;
    let started = op.campaign(Request::CampaignStart(CampaignOverrides { seed: Some(42), ..Default::default() })).await.unwrap();
    assert!(started.strategy.as_deref().is_some_and(|s| s.contains("async")), "{started:?}");
    let mut bases = std::collections::BTreeMap::new();
    let mut last: Option<(usize, fedfleet_protocol::SignedUpdate, Vec<u8>)> = None;
    for (j, u) in schedule.iter().enumerate() {
        if crashes.contains(&j) {
            child.sigkill_and_restart(&toml, &log);
            // A resend of the last acknowledged update (perhaps folded into a later buffer than
            // the one it names) is answered with its receipt and not counted again.
            if let Some((i, h, p)) = last.take() {
                let c = fleet.device_client(i, child.addr).await;
                assert!(matches!(c.upload(&h, &p).await.unwrap(), UploadOutcome::Accepted(_)));
            }
        }
        let open = RoundId(u.open);
        let dev0 = fleet.device_client(0, child.addr).await;
        let base = wait_round(&dev0, open).await;
        bases.entry(u.open).or_insert(base);
        if u.open == 3 && !bases.contains_key(&0) {
            // Buffer 1's base is two versions behind now, past the bound: refused by name.
            let payload = delta(999).encode();
            let h = header(&fleet.fleet, &dev(5), RoundId(1), bases[&1], nonce(5, 1), 15, &payload, DType::F32, &fleet.device_key(5));
            let c = fleet.device_client(5, child.addr).await;
            match c.upload(&h, &payload).await.unwrap() {
                UploadOutcome::Rejected(rej) => assert_eq!(rej.reason, fedfleet_protocol::RejectReason::TooStale, "{rej:?}"),
                other => panic!("a too stale update was taken: {other:?}"),
            }
            bases.insert(0, base); // said once
        }
        let payload = delta(100 * u.trained_for + u.device as u64).encode();
        let base = bases[&u.trained_for];
        let h = header(
            &fleet.fleet,
            &dev(u.device),
            RoundId(u.trained_for),
            base,
            nonce(u.device, u.trained_for),
            10 + u.device as u64,
            &payload,
            DType::F32,
            &fleet.device_key(u.device),
        );
        let c = fleet.device_client(u.device, child.addr).await;
        match c.upload(&h, &payload).await.unwrap() {
            UploadOutcome::Accepted(_) => {}
            UploadOutcome::Rejected(rej) => panic!("upload {j} (device {} for buffer {}): {rej:?}", u.device, u.trained_for),
        }
        last = Some((u.device, h, payload));
    }
    if crashes.contains(&schedule.len()) {
        // Killed right after the last buffer's last update: while it finalizes and publishes.
        child.sigkill_and_restart(&toml, &log);
    }
    wait_completed(fleet, child.addr, 4).await;
    child.sigkill();
    (2..=4)
        .map(|v| {
            let path =
                fedfleet_aggregator::publish::DirPublisher::model_path(&cfg.publish_dir(), "tiny", fedfleet_protocol::ModelVersion(v));
            std::fs::read(path).unwrap()
        })
        .collect()
}

/// Issue 27: a SIGKILL mid-buffer (after a stale update was folded), right after a buffer's
/// last update and mid-way through the last buffer gives the bit-identical sequence of versions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_mid_buffer_gives_the_bit_identical_sequence_of_versions_in_async_mode() {
    let fleet = Fleet::new(N);
    let clean = async_campaign(&fleet, "async-clean", &[]).await;
    let crashed = async_campaign(&fleet, "async-crashed", &[4, 6, 8]).await;
    assert_eq!(clean.len(), 3);
    assert!(clean.windows(2).all(|w| w[0] != w[1]), "every buffer publishes a new model");
    assert!(clean == crashed, "the crashed run published a different sequence of versions");
}

/// sled may flush an accepted record on its own before the group commit syncs its payload; a
/// crash then leaves a record without a payload, which was never acknowledged. The restart drops
/// it (the round counts it no more) and the device's resend is taken: nothing lost, nothing
/// counted twice. (Simulated by deleting the round's payload segment of a stopped service.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_whose_payload_was_lost_is_dropped_on_restart_and_the_resend_is_taken() {
    let fleet = Fleet::new(3);
    let cfg = fleet.config("lost-payload", 3, 1);
    let agg = start(cfg.clone()).await;
    let op = fleet.operator(agg.addr).await;
    op.campaign(Request::CampaignStart(CampaignOverrides { seed: Some(5), ..Default::default() })).await.unwrap();
    let d = fleet.device_client(0, agg.addr).await;
    let base = wait_round(&d, RoundId(1)).await;
    let payload = delta(7).encode();
    let h = header(&fleet.fleet, &dev(0), RoundId(1), base, nonce(0, 1), 10, &payload, DType::F32, &fleet.device_key(0));
    assert!(matches!(d.upload(&h, &payload).await.unwrap(), UploadOutcome::Accepted(_)));
    assert_eq!(op.campaign(Request::CampaignStatus).await.unwrap().accepted, 1);
    op.close().await;
    agg.stop().await;

    let segment = cfg.data_dir.join("updates").join("1.seg");
    assert!(segment.is_file(), "the round's payloads are in one segment");
    std::fs::remove_file(&segment).unwrap();
    let agg = start(cfg).await;
    let op = fleet.operator(agg.addr).await;
    assert_eq!(op.campaign(Request::CampaignStatus).await.unwrap().accepted, 0, "the record without its payload was dropped");
    let d = fleet.device_client(0, agg.addr).await;
    assert!(matches!(d.upload(&h, &payload).await.unwrap(), UploadOutcome::Accepted(_)), "the resend is taken, not a replay");
    assert_eq!(op.campaign(Request::CampaignStatus).await.unwrap().accepted, 1);
    op.close().await;
    agg.stop().await;
}
