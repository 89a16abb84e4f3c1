use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use fedfleet_protocol::{DeviceId, Digest, ModelVersion};

use crate::store::{NewVersion, Store, StoreConfig, StoreError};

const CHUNK: u32 = 4096;

fn cfg() -> StoreConfig {
    StoreConfig { chunk_size: CHUNK, deep_check_on_open: true }
}

fn meta(name: &str, parent: Option<u64>) -> NewVersion {
    NewVersion {
        name: name.into(),
        spec: serde_json::json!({"arch": "mlp", "input": [1, 28, 28], "hidden": [128]}).into(),
        parent: parent.map(ModelVersion),
        metrics: BTreeMap::from([("accuracy".to_string(), 0.9 + parent.unwrap_or(0) as f64 / 100.0)]),
        created_at_unix_ms: 1_700_000_000_000 + parent.unwrap_or(0),
        publisher: "test".into(),
        adapter: None,
    }
}

/// Deterministic pseudo-random bytes.
fn blob(seed: u8, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    let mut h = blake3::Hasher::new();
    h.update(&[seed]);
    let mut r = h.finalize_xof();
    out.resize(len, 0);
    r.fill(&mut out);
    out
}

#[test]
fn publish_and_read_back() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), cfg()).unwrap();
    let bytes = blob(1, 10_000);
    let m = store.publish(meta("mnist", None), &bytes).unwrap();
    assert_eq!(m.model.version, ModelVersion(1));
    assert_eq!(m.model.length, 10_000);
    assert_eq!(m.model.digest, Digest::of(&bytes));
    assert_eq!(m.chunks.len(), 3);
    assert_eq!(m.chunks.iter().map(|c| c.len).collect::<Vec<_>>(), vec![4096, 4096, 1808]);
    assert_eq!(m.chunk_offset(2), 8192);
    assert_eq!(m.model.spec["arch"], "mlp");
    for (i, c) in m.chunks.iter().enumerate() {
        let off = m.chunk_offset(i) as usize;
        assert_eq!(store.chunk(&c.digest).unwrap(), &bytes[off..off + c.len as usize]);
    }
    assert_eq!(store.read_artifact(&m.model.digest).unwrap(), bytes);
    assert_eq!(store.manifest("mnist", ModelVersion(1)).unwrap(), m);

    // Versions are monotonic per name; names are independent.
    let m2 = store.publish(meta("mnist", Some(1)), &blob(2, 5000)).unwrap();
    assert_eq!(m2.model.version, ModelVersion(2));
    assert_eq!(m2.model.parent, Some(ModelVersion(1)));
    let other = store.publish(meta("kws", None), &blob(3, 100)).unwrap();
    assert_eq!(other.model.version, ModelVersion(1));
    assert_eq!(store.versions("mnist").unwrap(), vec![ModelVersion(1), ModelVersion(2)]);
    assert_eq!(store.latest("mnist").unwrap(), Some(ModelVersion(2)));
    assert_eq!(store.latest("nope").unwrap(), None);
    assert_eq!(store.models().unwrap(), vec!["kws".to_string(), "mnist".to_string()]);
    // "mnist" must not see "mnist2"'s versions (prefix separation).
    store.publish(meta("mnist2", None), &blob(4, 10)).unwrap();
    assert_eq!(store.versions("mnist").unwrap().len(), 2);
    assert!(matches!(store.manifest("mnist", ModelVersion(9)), Err(StoreError::UnknownVersion { .. })));

    // Reopen: everything is still there.
    drop(store);
    let store = Store::open(dir.path(), cfg()).unwrap();
    assert_eq!(store.manifest("mnist", ModelVersion(1)).unwrap(), m);
    let rep = store.check(true).unwrap();
    assert_eq!((rep.versions, rep.artifacts, rep.orphan_chunks), (4, 4, 0));
}

#[test]
fn only_changed_chunks_are_missing() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), cfg()).unwrap();
    let v1 = blob(1, 5 * CHUNK as usize);
    let mut v2 = v1.clone();
    v2[CHUNK as usize * 3 + 7] ^= 1; // only chunk 3 differs
    v2.extend_from_slice(&blob(9, 100)); // plus a new tail chunk
    let m1 = store.publish(meta("m", None), &v1).unwrap();
    let m2 = store.publish(meta("m", Some(1)), &v2).unwrap();
    let have: Vec<Digest> = m1.chunks.iter().map(|c| c.digest).collect();
    let missing = store.missing_chunks("m", m2.model.version, &have).unwrap();
    assert_eq!(missing, vec![m2.chunks[3], m2.chunks[5]]);
    // Repeated chunks are listed once.
    let zeros = vec![0u8; 3 * CHUNK as usize];
    let m3 = store.publish(meta("m", None), &zeros).unwrap();
    assert_eq!(store.missing_chunks("m", m3.model.version, &[]).unwrap().len(), 1);
    // Same bytes again: a new version, the same artifact, no new chunks.
    let before = store.check(false).unwrap();
    let m4 = store.publish(meta("m", None), &v1).unwrap();
    assert_eq!((m4.model.version, m4.model.digest), (ModelVersion(4), m1.model.digest));
    let after = store.check(false).unwrap();
    assert_eq!((after.artifacts, after.chunks), (before.artifacts, before.chunks));
}

#[test]
fn names_made_of_dots_or_starting_with_a_symbol_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), cfg()).unwrap();
    for name in [".", "..", "...", ".hidden", "-rf", "_x"] {
        match store.publish(meta(name, None), b"x") {
            Err(StoreError::InvalidName { reason, .. }) => assert!(reason.contains("start with"), "{name}: {reason}"),
            other => panic!("{name:?} accepted as a model name: {other:?}"),
        }
    }
    assert!(matches!(store.set_alias("m", "..", ModelVersion(1)), Err(StoreError::InvalidName { .. })));
    store.publish(meta("cam-v2.1_int8", None), b"x").unwrap();
}

#[test]
fn publish_rejects_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), cfg()).unwrap();
    assert!(matches!(store.publish(meta("a/b", None), b"x"), Err(StoreError::InvalidName { .. })));
    assert!(matches!(store.publish(meta("m", None), b""), Err(StoreError::EmptyArtifact)));
    assert!(matches!(store.publish(meta("m", Some(7)), b"x"), Err(StoreError::UnknownParent { .. })));
    let mut nan = meta("m", None);
    nan.metrics.insert("loss".into(), f64::NAN);
    assert!(matches!(store.publish(nan, b"x"), Err(StoreError::InvalidMetric(_))));
    // Records that would not read back as written (and, once stored, would stop the registry
    // signing its metadata) are refused by name.
    let mut lora = meta("m", None);
    lora.adapter =
        Some(fedfleet_protocol::AdapterLineage { method: "lora".into(), rank: 4, alpha: f64::NAN, tensors: vec!["fc.weight".into()] });
    let e = store.publish(lora, b"x").unwrap_err();
    assert!(matches!(&e, StoreError::InvalidRecord(d) if d.contains("alpha NaN")), "{e}");
    let mut deep = meta("m", None);
    let mut spec = serde_json::json!(1);
    for _ in 0..126 {
        spec = serde_json::json!([spec]);
    }
    deep.spec = spec.into();
    let e = store.publish(deep, b"x").unwrap_err();
    assert!(matches!(&e, StoreError::InvalidRecord(d) if d.contains("nests 126 levels deep; the limit is 32")), "{e}");
    assert_eq!(store.latest("m").unwrap(), None, "failed publishes leave no version");
    // ...and nothing else: no chunk of a refused publish is written.
    let c = store.check(false).unwrap();
    assert_eq!((c.versions, c.chunks), (0, 0));
    // A good publish after them goes through.
    assert_eq!(store.publish(meta("m", None), b"x").unwrap().model.version, ModelVersion(1));
    assert!(matches!(Store::open(dir.path().join("x"), StoreConfig { chunk_size: 0, ..cfg() }), Err(StoreError::InvalidChunkSize(0))));
}

#[test]
fn aliases_move() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), cfg()).unwrap();
    store.publish(meta("m", None), &blob(1, 10)).unwrap();
    store.publish(meta("m", Some(1)), &blob(2, 10)).unwrap();
    assert_eq!(store.set_alias("m", "stable", ModelVersion(1)).unwrap(), None);
    assert_eq!(store.set_alias("m", "canary", ModelVersion(2)).unwrap(), None);
    assert_eq!(store.set_alias("m", "stable", ModelVersion(2)).unwrap(), Some(ModelVersion(1)));
    assert_eq!(store.alias("m", "stable").unwrap(), Some(ModelVersion(2)));
    assert!(matches!(store.set_alias("m", "stable", ModelVersion(3)), Err(StoreError::UnknownVersion { .. })));
    assert_eq!(store.alias("m", "stable").unwrap(), Some(ModelVersion(2)));
    assert_eq!(store.aliases("m").unwrap(), BTreeMap::from([("canary".into(), ModelVersion(2)), ("stable".into(), ModelVersion(2))]));
    assert_eq!(store.remove_alias("m", "canary").unwrap(), Some(ModelVersion(2)));
    assert_eq!(store.alias("m", "canary").unwrap(), None);
    drop(store);
    let store = Store::open(dir.path(), cfg()).unwrap();
    assert_eq!(store.alias("m", "stable").unwrap(), Some(ModelVersion(2)));
}

#[test]
fn chunk_reads_verify_digest() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), cfg()).unwrap();
    let m = store.publish(meta("m", None), &blob(1, 9000)).unwrap();
    let c = m.chunks[1].digest;
    store.chunks.insert(c.0, vec![7u8; 4096]).unwrap();
    assert!(matches!(store.chunk(&c), Err(StoreError::CorruptChunk { expected, .. }) if expected == c));
    assert!(matches!(store.read_artifact(&m.model.digest), Err(StoreError::CorruptChunk { .. })));
    assert!(matches!(store.check(true), Err(StoreError::Corrupt { .. })));
    assert!(matches!(store.chunk(&Digest::of(b"nope")), Err(StoreError::MissingChunk(_))));
    drop(store);
    // A deep check on open refuses the store.
    let err = Store::open(dir.path(), cfg()).unwrap_err();
    assert!(matches!(err, StoreError::Corrupt { .. }), "{err}");
}

#[test]
fn inconsistent_store_is_refused_on_open() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), cfg()).unwrap();
    let m = store.publish(meta("m", None), &blob(1, 9000)).unwrap();
    store.chunks.remove(m.chunks[0].digest.0).unwrap();
    store.flush().unwrap();
    drop(store);
    let err = Store::open(dir.path(), cfg()).unwrap_err();
    assert!(matches!(err, StoreError::Inconsistent { .. }), "{err}");
    assert!(err.to_string().contains("Restore it from a backup"), "{err}");
}

#[test]
fn damaged_files_are_refused_not_replaced_by_an_empty_store() {
    let dir = tempfile::tempdir().unwrap();
    {
        let store = Store::open(dir.path(), StoreConfig { chunk_size: 512, ..cfg() }).unwrap();
        for i in 0..4 {
            store.publish(meta("m", None), &blob(i, 20_000)).unwrap();
        }
    }
    let db = dir.path().join("db");
    let mut bytes = std::fs::read(&db).unwrap();
    let n = bytes.len();
    // Scribble over the middle of the log.
    for b in &mut bytes[n / 4..n / 2] {
        *b ^= 0x5a;
    }
    std::fs::write(&db, &bytes).unwrap();
    // sled 0.34.7 recovers by truncating its log at the damage (it reopened this store with
    // one of four versions); the COMMIT marker turns that into a refusal.
    let err = Store::open(dir.path(), cfg()).unwrap_err();
    assert!(matches!(err, StoreError::Corrupt { .. }), "{err}");
    assert!(err.to_string().contains("refusing to start"), "{err}");
    // Losing the whole database next to its marker is refused as well.
    let db_dir = dir.path();
    for f in std::fs::read_dir(db_dir).unwrap() {
        let f = f.unwrap();
        if f.file_name() != "COMMIT" {
            let p = f.path();
            if p.is_dir() { std::fs::remove_dir_all(p).unwrap() } else { std::fs::remove_file(p).unwrap() }
        }
    }
    let err = Store::open(dir.path(), cfg()).unwrap_err();
    assert!(matches!(err, StoreError::Corrupt { .. }), "{err}");
    // A garbled marker is refused, not ignored.
    std::fs::write(dir.path().join("COMMIT"), "garbage").unwrap();
    assert!(matches!(Store::open(dir.path(), cfg()), Err(StoreError::Corrupt { .. })));
}

#[test]
fn commit_sequence_tracks_every_commit() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), cfg()).unwrap();
    assert_eq!(store.seq().unwrap(), 0);
    store.publish(meta("m", None), b"abc").unwrap();
    store.set_alias("m", "stable", ModelVersion(1)).unwrap();
    store.remove_alias("m", "stable").unwrap();
    assert!(store.publish(meta("m", Some(9)), b"abc").is_err());
    assert_eq!(store.seq().unwrap(), 3);
    let marker = fedfleet_durable::CommitMarker::new(dir.path(), "fedfleet-registry-commit");
    assert_eq!(marker.read().unwrap(), 3);
    drop(store);
    // A marker behind sled (crash between flush and marker write) is fine.
    std::fs::write(dir.path().join("COMMIT"), "fedfleet-registry-commit 2\n").unwrap();
    let store = Store::open(dir.path(), cfg()).unwrap();
    store.publish(meta("m", None), b"def").unwrap();
    drop(store);
    // A marker ahead of sled means sled lost acknowledged commits.
    std::fs::write(dir.path().join("COMMIT"), "fedfleet-registry-commit 99\n").unwrap();
    let err = Store::open(dir.path(), cfg()).unwrap_err();
    assert!(matches!(err, StoreError::Corrupt { .. }), "{err}");
    assert!(err.to_string().contains("acknowledged data was lost"), "{err}");
}

#[test]
fn rollouts_persist() {
    use crate::rollout::{Phase, Rollout, RolloutPlan};
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path(), cfg()).unwrap();
    let plan = RolloutPlan {
        id: "r1".into(),
        model: "m".into(),
        alias: "stable".into(),
        target: ModelVersion(2),
        previous: Some(ModelVersion(1)),
        phases: vec![Phase::percent(10.0, 1000)],
        failure_threshold: 0.1,
        min_sample: 3,
    };
    let mut r = Rollout::start(plan, 5).unwrap();
    store.put_rollout(&r).unwrap();
    // Reports: one record each, kept under keys of their own; the second replaces the first.
    let devices: Vec<DeviceId> = (0..200).map(|i| DeviceId::new(format!("d{i}")).unwrap()).collect();
    let report = |r: &mut Rollout, d: &DeviceId, state| {
        r.handle_report(10, d.clone(), ModelVersion(2), state);
        let written = store.write_rollout_report(r, d).unwrap();
        store.sync(written).unwrap();
    };
    for d in &devices {
        report(&mut r, d, crate::rollout::VersionReport::Verified);
    }
    report(&mut r, &devices[3], crate::rollout::VersionReport::Healthy);
    let rollout_bytes = serde_json::to_vec(&r).unwrap().len();
    assert!(rollout_bytes < 2_000, "the rollout's own record holds no device records ({rollout_bytes} B)");
    drop(store);
    let store = Store::open(dir.path(), cfg()).unwrap();
    let back = store.rollout("r1").unwrap().unwrap();
    assert_eq!(back, r);
    assert_eq!(back.devices().len(), 200);
    assert_eq!(back.summary(), r.summary());
    assert_eq!(store.rollouts().unwrap(), vec![r]);
}

/// Reports flush with the rollouts unlocked (`Registry::report`): from many devices at once,
/// every answered report is in the store when it is opened again, under a commit marker that
/// matches what sled holds.
#[test]
fn reports_answered_at_once_from_many_devices_are_all_durable() {
    use crate::ops::Registry;
    use crate::rollout::Phase;
    use crate::wire::{AdminRequest, RolloutStart};
    use fedfleet_protocol::{DeviceState, DeviceStatus, FleetId, ModelRef};

    let dir = tempfile::tempdir().unwrap();
    let fleet = FleetId::new("f").unwrap();
    let store = Store::open(dir.path(), cfg()).unwrap();
    let reg = Registry::new(store, fleet.clone(), None, Default::default(), fedfleet_protocol::SystemClock::shared()).unwrap();
    reg.publish(meta("m", None), &blob(1, 100)[..]).unwrap();
    let v2 = reg.publish(meta("m", Some(1)), &blob(2, 100)[..]).unwrap();
    reg.store().set_alias("m", "stable", ModelVersion(1)).unwrap();
    let start = RolloutStart {
        id: Some("r1".into()),
        model: "m".into(),
        alias: "stable".into(),
        target: v2.model.version,
        phases: vec![Phase::percent(100.0, 3_600_000)],
        failure_threshold: 0.5,
        min_sample: 5,
    };
    reg.admin(AdminRequest::RolloutStart(start), 1_000).unwrap();
    let target = ModelRef { name: "m".into(), version: v2.model.version, digest: v2.model.digest };
    let (threads, each) = (8, 40);
    std::thread::scope(|s| {
        for t in 0..threads {
            let (reg, fleet, target) = (&reg, &fleet, &target);
            s.spawn(move || {
                for i in 0..each {
                    let status = DeviceStatus {
                        fleet: fleet.clone(),
                        device: DeviceId::new(format!("d{t}-{i}")).unwrap(),
                        reported_at_unix_ms: 2_000,
                        state: DeviceState::Verified,
                        active: None,
                        staged: Some(target.clone()),
                        rollout_id: None,
                    };
                    reg.report(&status, 2_000).unwrap();
                }
            });
        }
    });
    let summary = reg.store().rollout("r1").unwrap().unwrap().summary();
    drop(reg);
    let store = Store::open(dir.path(), cfg()).unwrap();
    let back = store.rollout("r1").unwrap().unwrap();
    assert_eq!(back.devices().len(), threads * each);
    assert_eq!(back.summary(), summary);
    assert!(store.seq().unwrap() >= (threads * each) as u64, "every report was a commit");
}

// ---- crash tests -------------------------------------------------------------------------

const CHILD_ENV: &str = "FEDFLEET_REGISTRY_CRASH_CHILD";
const DIR_ENV: &str = "FEDFLEET_REGISTRY_CRASH_DIR";

fn fault(stage: usize) {
    let at: usize = std::env::var("FEDFLEET_REGISTRY_CRASH_AT").unwrap().parse().unwrap();
    if stage == at {
        std::process::abort();
    }
}

/// Not a test on its own: the body of the child process the crash tests start.
#[test]
fn crash_child() {
    let Ok(mode) = std::env::var(CHILD_ENV) else {
        return;
    };
    let dir = std::env::var(DIR_ENV).unwrap();
    let mut store = Store::open(&dir, cfg()).unwrap();
    match mode.as_str() {
        "abort" => {
            store.fault = Some(fault);
            store.publish(meta("m", Some(1)), &blob(2, 5 * CHUNK as usize)).unwrap();
            unreachable!("the fault hook aborts");
        }
        "loop" => {
            use std::io::Write;
            for i in 0u64.. {
                let m = store.publish(meta("m", None), &blob((i % 251) as u8, 3 * CHUNK as usize + 17)).unwrap();
                if i % 3 == 0 {
                    store.set_alias("m", "stable", m.model.version).unwrap();
                }
                println!("committed {}", m.model.version);
                std::io::stdout().flush().unwrap();
            }
        }
        other => panic!("unknown mode {other}"),
    }
}

fn child(mode: &str, dir: &std::path::Path, crash_at: &str) -> Command {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", "tests::store::crash_child", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, mode)
        .env(DIR_ENV, dir)
        .env("FEDFLEET_REGISTRY_CRASH_AT", crash_at)
        .stdin(Stdio::null());
    c
}

fn assert_consistent(store: &Store) {
    let rep = store.check(true).unwrap();
    for name in store.models().unwrap() {
        for v in store.versions(&name).unwrap() {
            let m = store.manifest(&name, v).unwrap();
            assert_eq!(Digest::of(&store.read_artifact(&m.model.digest).unwrap()), m.model.digest);
        }
    }
    assert!(rep.versions > 0);
}

#[test]
fn crash_between_chunks_and_commit_leaves_no_version() {
    // Stage 2: after the second chunk; stage MAX: after all chunks are flushed, just before the
    // transaction.
    for crash_at in ["2", &usize::MAX.to_string()] {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = Store::open(dir.path(), cfg()).unwrap();
            store.publish(meta("m", None), &blob(1, 10_000)).unwrap();
        }
        let status = child("abort", dir.path(), crash_at).stderr(Stdio::null()).stdout(Stdio::null()).status().unwrap();
        assert!(!status.success(), "child must have died");
        #[cfg(unix)]
        {
            use std::os::unix::process::ExitStatusExt;
            assert_eq!(status.signal(), Some(6), "child aborted (SIGABRT), status {status:?}");
        }
        let store = Store::open(dir.path(), cfg()).unwrap();
        assert_eq!(store.versions("m").unwrap(), vec![ModelVersion(1)], "crash at {crash_at}");
        assert_eq!(store.latest("m").unwrap(), Some(ModelVersion(1)));
        assert!(matches!(store.manifest("m", ModelVersion(2)), Err(StoreError::UnknownVersion { .. })));
        assert_consistent(&store);
        // The same publish now succeeds and reuses whatever chunks the crash left.
        let m = store.publish(meta("m", Some(1)), &blob(2, 5 * CHUNK as usize)).unwrap();
        assert_eq!(m.model.version, ModelVersion(2));
        assert_eq!(store.check(true).unwrap().orphan_chunks, 0);
        assert_consistent(&store);
    }
}

#[test]
fn sigkill_during_publish_loop_keeps_every_acknowledged_version() {
    let dir = tempfile::tempdir().unwrap();
    let mut proc = child("loop", dir.path(), "none").stdout(Stdio::piped()).stderr(Stdio::null()).spawn().unwrap();
    let out = BufReader::new(proc.stdout.take().unwrap());
    let mut last = 0u64;
    for line in out.lines() {
        let line = line.unwrap();
        if let Some(v) = line.strip_prefix("committed ") {
            last = v.parse().unwrap();
            if last >= 8 {
                break;
            }
        }
    }
    proc.kill().unwrap(); // SIGKILL, most likely mid-publish
    proc.wait().unwrap();
    assert!(last >= 8, "child stopped early");
    let store = Store::open(dir.path(), cfg()).unwrap();
    let latest = store.latest("m").unwrap().unwrap();
    assert!(latest.0 >= last, "acknowledged v{last} lost; latest is v{latest}");
    assert_eq!(store.versions("m").unwrap(), (1..=latest.0).map(ModelVersion).collect::<Vec<_>>());
    assert!(store.alias("m", "stable").unwrap().is_some());
    assert_consistent(&store);
    let m = store.publish(meta("m", None), b"after the crash").unwrap();
    assert_eq!(m.model.version.0, latest.0 + 1);
}

#[test]
fn second_open_is_refused_while_in_use() {
    let dir = tempfile::tempdir().unwrap();
    let _store = Store::open(dir.path(), cfg()).unwrap();
    let err = Store::open(dir.path(), cfg()).unwrap_err();
    assert!(matches!(err, StoreError::Locked { .. }), "{err}");
}
