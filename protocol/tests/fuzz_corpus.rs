//! CI smoke run of the fuzz corpus: every committed input of every fuzz target in `fuzz/corpus/`
//! goes through the same decoder calls as its target (`fuzz/fuzz_targets/`), on stable Rust and
//! without libFuzzer. It asserts only what the targets assert: nothing panics, and what decodes
//! re-encodes as the target expects.
//!
//! The corpus itself comes from coverage-guided fuzzing (see `fuzz/README.md`). The hand-made
//! starting inputs are written by the ignored test [`write_seed_inputs`]:
//! `cargo test -p fedfleet-protocol --test fuzz_corpus -- --ignored write_seed_inputs`.

use std::collections::BTreeMap;
use std::path::Path;

use ed25519_dalek::SigningKey;
use fedfleet_protocol::artifact::{ChunkRef, Manifest};
use fedfleet_protocol::envelope::Signable;
use fedfleet_protocol::tuf::{Root, SignedMetadata, Targets, Timestamp, Verifier};
use fedfleet_protocol::*;
use fedfleet_protocol::{ModelInfo, SpecJson};

#[path = "../fuzz/harness.rs"]
mod harness;
use harness::*;

#[path = "../fuzz/replay.rs"]
mod replay;

const CORPUS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz/corpus");

/// Every fuzz target and the harness that mirrors it.
const TARGETS: &[(&str, fn(&[u8]))] = &[
    ("bundle_decode", bundle_decode),
    ("envelope_decode", envelope_decode),
    ("frame_decode", frame_decode),
    ("manifest_decode", manifest_decode),
    ("message_decode", message_decode),
    ("signed_update_decode", signed_update_decode),
    ("tuf_decode", tuf_decode),
    ("tuf_verifier", tuf_verifier),
];

#[test]
fn every_corpus_input_decodes_without_panicking() {
    replay::replay(CORPUS, TARGETS, |b| hex::encode(b));
}

// ---- Seed inputs: valid encodings of everything, the fuzzers' starting points. ----

fn model() -> ModelRef {
    ModelRef { name: "mnist-mlp".into(), version: ModelVersion(3), digest: Digest::of(b"model") }
}

fn seed_messages() -> Vec<Message> {
    let fleet = FleetId::new("eu").unwrap();
    let device = DeviceId::new("cam-1").unwrap();
    let announcement = |selection| RoundAnnouncement {
        fleet: fleet.clone(),
        round: RoundId(4),
        base_model: model(),
        config: RoundConfig { quantization: DType::I8, proximal_mu: 0.01, max_samples: Some(1000), ..RoundConfig::default() },
        deadline_unix_ms: 1_700_000_000_000,
        selection,
    };
    let status = |state| DeviceStatus {
        fleet: fleet.clone(),
        device: device.clone(),
        reported_at_unix_ms: 7,
        state,
        active: Some(model()),
        staged: None,
        rollout_id: Some(2),
    };
    let rollout = |action, cohort| RolloutNotice {
        fleet: fleet.clone(),
        rollout_id: 2,
        alias: "stable".into(),
        model: model(),
        length: 1234,
        phase: 1,
        percent_bp: 1000,
        cohort,
        action,
        issued_at_unix_ms: 9,
    };
    vec![
        Message::RoundAnnouncement(announcement(Selection::Sample { rate_ppm: 250_000, seed: 9 })),
        Message::RoundAnnouncement(announcement(Selection::All)),
        Message::RoundAnnouncement(announcement(Selection::Devices(vec![device.clone()]))),
        Message::Receipt(Receipt {
            fleet: fleet.clone(),
            device: device.clone(),
            round: RoundId(4),
            nonce: [3; 16],
            payload_digest: Digest::of(b"p"),
            accepted_at_unix_ms: 5,
        }),
        Message::Rejection(Rejection::new(RejectReason::StaleRound, "round 3 is closed")),
        Message::Manifest(ModelInfo {
            name: "mnist-mlp".into(),
            version: ModelVersion(3),
            length: 1234,
            digest: Digest::of(b"model"),
            spec: SpecJson(serde_json::json!({"arch": "mlp", "input": [784]})),
            parent: Some(ModelVersion(2)),
            metrics: BTreeMap::from([("accuracy".to_owned(), 0.97)]),
            created_at_unix_ms: 1,
            publisher: "ci".into(),
            adapter: None,
        }),
        Message::Rollout(rollout(RolloutAction::Install, Some("lab".into()))),
        Message::Rollout(rollout(RolloutAction::RollBack { to: model() }, None)),
        Message::Status(status(DeviceState::Idle)),
        Message::Status(status(DeviceState::Training { round: RoundId(4) })),
        Message::Status(status(DeviceState::Failed { reason: "health check".into() })),
    ]
}

fn update_header(payload: &[u8]) -> UpdateHeader {
    UpdateHeader {
        device: DeviceId::new("cam-1").unwrap(),
        fleet: FleetId::new("eu").unwrap(),
        round: RoundId(7),
        base_model: Digest([0xAB; 32]),
        nonce: [0x11; 16],
        sample_count: 600,
        payload_len: payload.len() as u64,
        payload_digest: Digest::of(payload),
        payload_dtype: DType::I8,
    }
}

fn relay_header(payload: &[u8]) -> RelayHeader {
    RelayHeader {
        relay: DeviceId::new("relay-1").unwrap(),
        fleet: FleetId::new("eu").unwrap(),
        round: RoundId(7),
        base_model: Digest([0xAB; 32]),
        nonce: [0x22; 16],
        update_count: 3,
        total_samples: 1800,
        payload_len: payload.len() as u64,
        payload_digest: Digest::of(payload),
        payload_dtype: DType::F16,
    }
}

/// (target, name, bytes) of every seed input.
fn seeds() -> Vec<(&'static str, String, Vec<u8>)> {
    let key = SigningKey::from_bytes(&[7; 32]);
    let mut out: Vec<(&'static str, String, Vec<u8>)> = Vec::new();
    let mut add = |target: &'static str, name: String, bytes: Vec<u8>| {
        out.push((target, name, bytes));
    };

    // Messages and the envelopes that carry them.
    let mut envelopes = Vec::new();
    for (i, m) in seed_messages().into_iter().enumerate() {
        add("message_decode", format!("message-{i}"), m.encode().unwrap());
        let (body, env) = match m {
            Message::RoundAnnouncement(a) => (a.canonical_bytes(), Signed::sign(a, &key).encode()),
            Message::Receipt(r) => (r.canonical_bytes(), Signed::sign(r, &key).encode()),
            Message::Rollout(n) => (n.canonical_bytes(), Signed::sign(n, &key).encode()),
            Message::Status(s) => (s.canonical_bytes(), Signed::sign(s, &key).encode()),
            Message::Manifest(m) => (m.canonical_bytes(), Signed::sign(m, &key).encode()),
            Message::Rejection(_) => continue,
        };
        add("envelope_decode", format!("body-{i}"), body);
        add("envelope_decode", format!("envelope-{i}"), env.clone());
        envelopes.push(env);
    }
    let update = Signed::sign(update_header(b"payload"), &key);
    let relay = Signed::sign(relay_header(b"partial sum"), &key);
    for (name, bytes) in [
        ("update", update.encode()),
        ("update-header", update.body().canonical_bytes()),
        ("relay", relay.encode()),
        ("relay-header", relay.body().canonical_bytes()),
    ] {
        add("envelope_decode", name.to_owned(), bytes.clone());
        add("signed_update_decode", name.to_owned(), bytes);
    }
    for (i, env) in envelopes.iter().enumerate() {
        add("signed_update_decode", format!("envelope-{i}"), env.clone());
    }

    // Frames: one of each kind, cut at a few read sizes.
    let mut stream = Vec::new();
    stream.extend(encode_frame(FrameKind::Message, &seed_messages()[3].encode().unwrap()).unwrap());
    stream.extend(encode_frame(FrameKind::Signed, &update.encode()).unwrap());
    stream.extend(encode_frame(FrameKind::Chunk, b"payload").unwrap());
    stream.extend(encode_frame(FrameKind::End, b"").unwrap());
    for split in [1u8, 5, 64] {
        let mut input = vec![split];
        input.extend_from_slice(&stream);
        add("frame_decode", format!("stream-{split}"), input);
    }

    // Bundles: every dtype, a scalar and a matrix.
    let mut bundle = TensorBundle::new();
    bundle.insert_f32("fc1.weight", vec![2, 3], vec![0.5, -1.0, 2.0, 0.0, 3.25, -0.125]).unwrap();
    bundle.insert_f32("fc1.bias", vec![3], vec![0.1, 0.2, 0.3]).unwrap();
    bundle.insert_f32("scale", vec![], vec![4.0]).unwrap();
    for dtype in DType::ALL {
        add("bundle_decode", format!("bundle-{dtype}"), bundle.quantize(dtype).encode());
    }
    add("bundle_decode", "empty".into(), TensorBundle::new().encode());

    // TUF metadata, signed with the tuf_verifier harness keys.
    let k = &*TUF_KEYS;
    let vk: Vec<_> = k.iter().map(|k| k.verifying_key()).collect();
    let root1 = Root::new(1, TUF_EXPIRES, (&[&vk[0]], 1), (&[&vk[1]], 1), (&[&vk[2]], 1));
    let root2 = Root::new(2, TUF_EXPIRES, (&[&vk[0], &vk[3]], 2), (&[&vk[4]], 1), (&[&vk[2]], 1));
    let artifact = b"model bytes".to_vec();
    let target = ModelInfo {
        name: "m".into(),
        version: ModelVersion(1),
        length: artifact.len() as u64,
        digest: Digest::of(&artifact),
        spec: SpecJson(serde_json::json!({"arch": "mlp", "input": [784]})),
        parent: None,
        metrics: BTreeMap::from([("accuracy".to_owned(), 0.9)]),
        created_at_unix_ms: 0,
        publisher: String::new(),
        adapter: None,
    };
    let targets = Targets { version: 1, expires: TUF_EXPIRES, targets: vec![target] };
    let signed_root1 = SignedMetadata::sign(&root1, &[&k[0]]);
    let signed_root2 = SignedMetadata::sign(&root2, &[&k[0], &k[3]]);
    let signed_targets = SignedMetadata::sign(&targets, &[&k[1]]);
    let timestamp = Timestamp::for_targets(1, TUF_EXPIRES, &signed_targets).unwrap();
    let signed_timestamp = SignedMetadata::sign(&timestamp, &[&k[2]]);
    let mut verifier = Verifier::new(signed_root1.clone()).unwrap();
    verifier.update_timestamp(&signed_timestamp, 1000).unwrap();
    verifier.update_targets(&signed_targets, 1000).unwrap();
    let json = |v: &dyn erased::Json| v.json();
    for (name, text) in [
        ("root", json(&signed_root1)),
        ("root-v2", json(&signed_root2)),
        ("targets", json(&signed_targets)),
        ("timestamp", json(&signed_timestamp)),
        ("root-body", signed_root1.signed.clone()),
        ("targets-body", signed_targets.signed.clone()),
        ("timestamp-body", signed_timestamp.signed.clone()),
        ("verifier", serde_json::to_string(&verifier).unwrap()),
    ] {
        add("tuf_decode", name.to_owned(), text.into_bytes());
    }
    // tuf_verifier operations: `op | signers | version | len u16 | body`; the clock is op >> 3.
    let op = |op: u8, signers: u8, version: u8, body: &[u8]| {
        let mut v = vec![op, signers, version];
        v.extend_from_slice(&(body.len() as u16).to_be_bytes());
        v.extend_from_slice(body);
        v
    };
    let t1 = 1 << 3; // now = 1000
    let rotate = op(t1, 0b1001, 0, signed_root2.signed.as_bytes());
    let publish = op(t1 | 3, 0b0010, 1, signed_targets.signed.as_bytes());
    let timestamp_only = op(t1 | 1, 0b0100, 0, signed_timestamp.signed.as_bytes());
    let targets_only = op(t1 | 2, 0b0010, 0, signed_targets.signed.as_bytes());
    let publish_rotated = op(t1 | 3, 0b1_0000, 1, signed_targets.signed.as_bytes());
    let install = op(t1 | 4, 0, 1, &artifact);
    let persist = op(0x80 | t1 | 4, 0, 1, &artifact);
    for (name, parts) in [
        ("publish-install", vec![&publish, &install]),
        ("timestamp-targets-install", vec![&timestamp_only, &targets_only, &persist]),
        ("rotate-publish", vec![&rotate, &publish_rotated, &install]),
        ("rotate-twice", vec![&rotate, &rotate, &timestamp_only]),
    ] {
        add("tuf_verifier", name.to_owned(), parts.into_iter().flatten().copied().collect());
    }

    // Artifact manifests and the string forms of ids and digests.
    let manifest = Manifest {
        model: ModelInfo {
            name: "m".into(),
            version: ModelVersion(1),
            length: 100,
            digest: Digest::of(b"artifact"),
            spec: SpecJson(serde_json::json!({"arch": "mlp"})),
            parent: Some(ModelVersion(0)),
            metrics: BTreeMap::from([("loss".to_owned(), 0.25)]),
            created_at_unix_ms: 5,
            publisher: "ci".into(),
            adapter: Some(fedfleet_protocol::AdapterLineage {
                method: "lora".into(),
                rank: 4,
                alpha: 8.0,
                tensors: vec!["fc2.weight".into()],
            }),
        },
        chunk_size: 64,
        chunks: vec![ChunkRef { digest: Digest::of(b"a"), len: 64 }, ChunkRef { digest: Digest::of(b"b"), len: 36 }],
    };
    let mut plain = manifest.clone();
    plain.model.adapter = None;
    for (name, text) in [
        ("manifest", serde_json::to_string(&manifest).unwrap()),
        ("manifest-plain", serde_json::to_string(&plain).unwrap()),
        ("digest-json", serde_json::to_string(&Digest::of(b"x")).unwrap()),
        ("digest-array", serde_json::to_string(&Digest::of(b"x").0).unwrap()),
        ("digest-hex", Digest::of(b"x").to_hex()),
        ("device-json", "\"cam-1\"".into()),
        ("dtype", "bf16".into()),
    ] {
        add("manifest_decode", name.to_owned(), text.into_bytes());
    }
    out
}

/// JSON of any signed metadata role, behind one type for the seed table.
mod erased {
    use fedfleet_protocol::tuf::{Metadata, SignedMetadata};

    pub trait Json {
        fn json(&self) -> String;
    }
    impl<T: Metadata> Json for SignedMetadata<T> {
        fn json(&self) -> String {
            serde_json::to_string(self).expect("metadata serializes")
        }
    }
}

#[test]
fn seeds_pass_their_harnesses() {
    for (target, _name, bytes) in seeds() {
        let harness = TARGETS.iter().find(|(t, _)| *t == target).unwrap().1;
        harness(&bytes);
    }
}

/// Writes the seed inputs into `fuzz/corpus/<target>/seed-<name>` (run before the first fuzzing
/// of a new target; `cargo fuzz cmin` then keeps what adds coverage).
#[test]
#[ignore = "writes into the source tree; run by hand"]
fn write_seed_inputs() {
    for (target, name, bytes) in seeds() {
        let dir = Path::new(CORPUS).join(target);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(format!("seed-{name}")), bytes).unwrap();
    }
}
