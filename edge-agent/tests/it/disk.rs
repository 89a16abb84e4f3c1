//! Issue 14 defect 2: a download that fills the device's disk. The agent's store (sled, blobs,
//! partial downloads, space reserve) is on a 4 MiB tmpfs; the registry fills it to the last
//! byte after the first chunk of the new version. The agent must keep running and serving its
//! active model, discard the partial file, report the install deferred, install the version once
//! the space is back, and its store must reopen on a disk that is full again.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use ed25519_dalek::SigningKey;
use fedfleet_agent::clients::{MetadataSet, Registry, TransportError};
use fedfleet_agent::inference::{self, Request};
use fedfleet_agent::lifecycle::{Backoff, CoreConfig, DurableLifecycle, HealthPolicy, SlotModel};
use fedfleet_agent::{Agent, AgentStore, LocalData, ShellConfig, SystemClock, run_agent};
use fedfleet_learning::{Dataset, ModelSpec, Normalization};
use fedfleet_protocol::{DeviceId, DeviceStatus, FleetId, ModelRef, ModelVersion, RolloutNotice};
use fedfleet_testkit::fakes::{FakeAggregator, FakeRegistry};

/// A tmpfs of `size_kib` mounted on a fresh directory, unmounted on drop.
struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    /// `None` (the caller skips) only where mounting is not permitted.
    fn mount(size_kib: u64) -> Option<Tmpfs> {
        let dir = tempfile::tempdir().unwrap();
        let out = Command::new("mount").args(["-t", "tmpfs", "-o", &format!("size={size_kib}k"), "tmpfs"]).arg(dir.path()).output().ok()?;
        if !out.status.success() {
            eprintln!("SKIPPED: mounting a tmpfs is not permitted here ({})", String::from_utf8_lossy(&out.stderr).trim());
            return None;
        }
        Some(Tmpfs { dir })
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn filler(&self) -> PathBuf {
        self.path().join("filler")
    }

    fn fill(&self) {
        fill(self.path());
    }
}

/// Another process's file in `disk`, grown until the filesystem refuses a byte more.
fn fill(disk: &Path) {
    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(disk.join("filler")).unwrap();
    let page = vec![7u8; 4096];
    while f.write_all(&page).is_ok() {}
    while f.write_all(&[7]).is_ok() {}
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(self.dir.path()).status();
    }
}

/// The fake registry, filling the disk once the first chunk of an armed download is served.
struct FillingRegistry {
    inner: FakeRegistry,
    armed: AtomicBool,
    disk: PathBuf,
}

impl Registry for FillingRegistry {
    async fn metadata(&self, have_root_version: u64) -> Result<MetadataSet, TransportError> {
        self.inner.metadata(have_root_version).await
    }
    async fn assignment(&self, device: &DeviceId) -> Result<Option<RolloutNotice>, TransportError> {
        self.inner.assignment(device).await
    }
    async fn download(&self, name: &str, version: ModelVersion, offset: u64, max_len: u32) -> Result<Vec<u8>, TransportError> {
        if offset > 0 && self.armed.swap(false, Ordering::SeqCst) {
            fill(&self.disk);
        }
        self.inner.download(name, version, offset, max_len).await
    }
    async fn report(&self, status: &DeviceStatus) -> Result<(), TransportError> {
        self.inner.report(status).await
    }
}

fn core_cfg(device: &DeviceId, fleet: &FleetId) -> CoreConfig {
    let mut c = CoreConfig::new(device.clone(), fleet.clone());
    c.local_samples = 100;
    c.backoff = Backoff { base_ms: 50, max_ms: 200 };
    // Two random initialisations: this test is about the disk, not the model's quality.
    c.health = HealthPolicy { max_latency_ms: 1_000.0, accuracy_margin: 1.0 };
    c
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64
}

async fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..400 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("timed out waiting for {what}");
}

/// The model the local endpoint answers with.
async fn answering_model(sock: &Path, row: &[f32]) -> ModelRef {
    let resp = inference::query(sock, &Request { inputs: vec![row.to_vec()], feedback: false }).await.expect("the endpoint answers");
    assert_eq!(resp.error, None);
    resp.model.expect("a model answers")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_download_that_fills_the_disk_defers_the_install_and_the_agent_serves_on() {
    let Some(disk) = Tmpfs::mount(4096) else { return };
    let outside = tempfile::tempdir().unwrap();
    let (device, fleet) = (DeviceId::new("dev-disk").unwrap(), FleetId::new("f1").unwrap());
    let spec = ModelSpec::digits_mlp();
    let spec_json = spec.to_json();
    let v1_bytes = fedfleet_learning::model::init_bundle(&spec, 1).unwrap().encode();
    let v2_bytes = fedfleet_learning::model::init_bundle(&spec, 2).unwrap().encode();
    let reg = Arc::new(FillingRegistry {
        inner: FakeRegistry::new(3, u64::MAX / 2),
        armed: AtomicBool::new(false),
        disk: disk.path().to_owned(),
    });
    let v1 = reg.inner.publish("digits", &spec_json, v1_bytes.clone());

    let store = AgentStore::open(disk.path()).unwrap();
    assert!(disk.path().join("reserve").is_file(), "the store holds its space reserve");
    store.put_blob(&v1_bytes).unwrap();
    let initial = SlotModel { model: v1.clone(), spec: spec_json.clone() };
    let core = DurableLifecycle::open(core_cfg(&device, &fleet), store, Some(reg.inner.pinned_root()), Some(initial), now_ms()).unwrap();
    let (train, holdout) = Dataset::digits_split().unwrap();
    let row = holdout.example(0).to_vec();
    let data = LocalData { train: train.subset(&(0..100).collect::<Vec<_>>()), holdout: holdout.subset(&(0..50).collect::<Vec<_>>()) };
    let shell = ShellConfig { download_chunk: 4096, latency_samples: 8, ..Default::default() };
    let mut agent = Agent::new(
        core,
        Arc::new(FakeAggregator::new()),
        reg.clone(),
        SigningKey::from_bytes(&[5; 32]),
        data,
        Arc::new(SystemClock),
        shell,
    );

    // The local inference endpoint, as the daemon runs it, and the agent's loop.
    let sock = outside.path().join("agent.sock");
    let (stop_serving, serving_stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn({
        let (sock, serving) = (sock.clone(), agent.serving());
        async move {
            inference::serve_unix(&sock, serving, Normalization::None, async {
                let _ = serving_stopped.await;
            })
            .await
        }
    });
    let (stop_agent, agent_stopped) = tokio::sync::oneshot::channel::<()>();
    let daemon = tokio::spawn(async move {
        let r = run_agent(&mut agent, Duration::from_millis(20), async {
            let _ = agent_stopped.await;
        })
        .await;
        (agent, r)
    });
    wait_for("v1 to serve", || !daemon.is_finished() && std::fs::exists(&sock).unwrap()).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(answering_model(&sock, &row).await, v1);

    // v2 rolls out; after its first chunk another process fills the disk.
    let v2 = reg.inner.publish("digits", &spec_json, v2_bytes);
    reg.armed.store(true, Ordering::SeqCst);
    reg.inner.assign_all(Some(FakeRegistry::notice(&fleet, 1, &v2)));
    let deferred =
        |r: &FakeRegistry| r.reports().into_iter().find(|s| s.state.as_str() == "install_deferred" && s.staged.as_ref() == Some(&v2));
    wait_for("the install to be reported deferred", || deferred(&reg.inner).is_some() || daemon.is_finished()).await;
    assert!(!daemon.is_finished(), "the agent stopped: {:?}", daemon.await.unwrap().1.err());
    let report = deferred(&reg.inner).unwrap();
    assert_eq!(report.active.as_ref(), Some(&v1), "{report:?}");
    assert_eq!(report.rollout_id, Some(1), "{report:?}");
    let detail = serde_json::to_string(&report.state).unwrap();
    assert!(detail.contains("DiskFull") && detail.contains("No space left"), "{detail}");
    wait_for("the partial download to be discarded", || std::fs::read_dir(disk.path().join("partial")).unwrap().count() == 0).await;
    assert!(!disk.path().join("reserve").exists(), "the reserve was given to the store's commit");
    assert_eq!(answering_model(&sock, &row).await, v1, "inference serves the active model through the full disk");

    // Still full: the retries are deferred too (refused before the download), the agent runs on.
    let reports = reg.inner.reports().len();
    wait_for("a retry", || reg.inner.reports().len() > reports + 1).await;
    assert!(!daemon.is_finished());

    // Space is back: the next retry takes the reserve back and installs v2.
    std::fs::remove_file(disk.filler()).unwrap();
    wait_for("v2 to be installed", || reg.inner.reports().iter().any(|s| s.state.as_str() == "active" && s.active.as_ref() == Some(&v2)))
        .await;
    assert_eq!(answering_model(&sock, &row).await, v2);
    assert!(disk.path().join("reserve").is_file(), "the reserve is taken again");

    // A restart on a disk full again (the reserve held): the store reopens and serves v2.
    stop_agent.send(()).unwrap();
    let (agent, r) = daemon.await.unwrap();
    r.unwrap();
    drop(agent);
    disk.fill();
    let store = AgentStore::open(disk.path()).expect("the store reopens on a full disk");
    let core = DurableLifecycle::open(core_cfg(&device, &fleet), store, None, None, now_ms()).unwrap();
    assert_eq!(core.active().map(|m| &m.model), Some(&v2));
    let _ = stop_serving.send(());
    server.await.unwrap().unwrap();
}
