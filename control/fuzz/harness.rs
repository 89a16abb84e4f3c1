//! The fuzz harnesses of the MQTT payload decoders: what each target feeds its input to. Shared
//! by the cargo-fuzz targets (`fuzz_targets/<name>.rs`, `#[path]`-included) and the corpus replay
//! in every `cargo test` (`../tests/fuzz_corpus.rs`), so the two cannot drift apart. They assert
//! that nothing panics, and the invariants named at each assertion.
//!
//! Keys are fixed: the harness holds the device, aggregator and registry keys, and some targets
//! re-sign what the fuzzer wrote (a flag in the input), so inputs get past signature checks into
//! the logic behind them.

#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ed25519_dalek::{SigningKey, VerifyingKey};
use fedfleet_certs::PeerIdentity;
use fedfleet_control::rejection::{SignedRejection, UploadRejection};
use fedfleet_control::topics::{self, Topic};
use fedfleet_control::upload::FRAME_PREFIX_LEN;
use fedfleet_control::{
    Assembled, AssemblerLimits, ControlEvent, Inbound, Received, Role, SignedAnswer, UpdateAssembler, encode_frames, verify,
};
use fedfleet_protocol::{
    DType, DeviceId, DeviceState, DeviceStatus, Digest, FleetId, ModelRef, ModelVersion, Receipt, RejectReason, RolloutAction,
    RolloutNotice, RoundAnnouncement, RoundConfig, RoundId, Selection, Signable, Signed, UpdateHeader,
};

// ---- Fixed identities ----

pub fn fleet() -> FleetId {
    FleetId::new("eu").expect("valid id")
}
pub fn cam1() -> DeviceId {
    DeviceId::new("cam-1").expect("valid id")
}
pub fn cam2() -> DeviceId {
    DeviceId::new("cam-2").expect("valid id")
}
pub fn device_key(device: &DeviceId) -> Option<SigningKey> {
    match device.as_str() {
        "cam-1" => Some(SigningKey::from_bytes(&[7; 32])),
        "cam-2" => Some(SigningKey::from_bytes(&[6; 32])),
        _ => None,
    }
}
pub fn aggregator_key() -> SigningKey {
    SigningKey::from_bytes(&[8; 32])
}
pub fn registry_key() -> SigningKey {
    SigningKey::from_bytes(&[9; 32])
}
fn enrolled() -> HashMap<DeviceId, VerifyingKey> {
    [cam1(), cam2()]
        .into_iter()
        .map(|d| {
            let k = device_key(&d).expect("enrolled").verifying_key();
            (d, k)
        })
        .collect()
}
/// Small limits, so the fuzzer reaches them.
pub fn limits() -> AssemblerLimits {
    AssemblerLimits { max_update_bytes: 4096, max_total_bytes: 6144, idle_timeout: Duration::from_secs(60) }
}

/// Splits `data` into records of `[flags u8][len u16 BE][len bytes]` (the last one may be short).
fn records(mut data: &[u8]) -> Vec<(u8, &[u8])> {
    let mut out = Vec::new();
    while let [flags, a, b, rest @ ..] = data {
        let len = usize::from(u16::from_be_bytes([*a, *b])).min(rest.len());
        let (frame, tail) = rest.split_at(len);
        out.push((*flags, frame));
        data = tail;
    }
    out
}

fn record(flags: u8, bytes: &[u8]) -> Vec<u8> {
    let mut r = vec![flags];
    r.extend_from_slice(&(bytes.len() as u16).to_be_bytes());
    r.extend_from_slice(bytes);
    r
}

/// A header upload frame with its envelope signed again by `device`'s key (if it decodes).
fn resign_header_frame(frame: &[u8], device: &DeviceId) -> Option<Vec<u8>> {
    if frame.len() < FRAME_PREFIX_LEN || frame[0] != b'H' {
        return None;
    }
    let (prefix, envelope) = frame.split_at(FRAME_PREFIX_LEN);
    let signed = Signed::<UpdateHeader>::decode(envelope).ok()?;
    let again = Signed::sign(signed.body().clone(), &device_key(device)?);
    let mut out = prefix.to_vec();
    out.extend_from_slice(&again.encode());
    Some(out)
}

fn resign<T: Signable + Clone>(bytes: &[u8], key: &SigningKey) -> Option<Vec<u8>> {
    let signed = Signed::<T>::decode(bytes).ok()?;
    Some(Signed::sign(signed.body().clone(), key).encode())
}

// ---- topic_parse ----

/// `topics::parse` on any UTF-8 string; a parsed topic prints back as the same string; the
/// broker's access rules (`may_publish`, `may_subscribe`) for a device and a service never let a
/// device touch a wildcard, another device's topics or another fleet, nor a service leave its
/// fleet's prefix.
pub fn topic_parse(data: &[u8]) {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    let parsed = topics::parse(s);
    if let Ok(t) = &parsed {
        assert_eq!(t.path(), s, "a parsed topic prints back as itself");
        assert_eq!(topics::parse(&t.path()).as_ref(), Ok(t));
        let _ = (t.qos(), t.retained(), t.device());
    }
    let me = cam1();
    let device = PeerIdentity::Device(me.clone());
    let service = PeerIdentity::Service("aggregator".into());
    let publishers = ["aggregator".to_owned()];
    let mut fleets = vec![fleet()];
    if let Ok(t) = &parsed {
        fleets.push(t.fleet().clone());
    }
    for f in &fleets {
        let ours = format!("{}/{f}/", topics::PREFIX);
        if topics::may_publish(&device, f, &publishers, s) {
            assert!(!s.contains(['+', '#']), "device publishes on a wildcard");
            assert!(
                matches!(&parsed, Ok(Topic::Status { fleet, device } | Topic::Updates { fleet, device } | Topic::Requests { fleet, device })
                    if fleet == f && device == &me),
                "device may publish on {s:?}"
            );
        }
        if topics::may_subscribe(&device, f, s) {
            assert!(!s.contains(['+', '#']), "device subscribes to a wildcard");
            match &parsed {
                Ok(Topic::Rounds { fleet } | Topic::Rollouts { fleet }) => assert_eq!(fleet, f),
                Ok(Topic::Receipts { fleet, device } | Topic::Rejections { fleet, device } | Topic::Answers { fleet, device }) => {
                    assert_eq!(fleet, f);
                    assert_eq!(device, &me);
                }
                other => panic!("device may subscribe to {s:?} ({other:?})"),
            }
        }
        if topics::may_publish(&service, f, &publishers, s) || topics::may_subscribe(&service, f, s) {
            assert!(s.starts_with(&ours), "service leaves its fleet: {s:?}");
        }
    }
}

// ---- rejection_decode ----

/// `SignedRejection::decode` (must re-encode byte for byte), `verify` with the pinned aggregator
/// key, and `verify::rejection` (what the client calls). What decodes is signed again with the
/// aggregator key: the body must re-encode to the same bytes, verify, and pass
/// `verify::rejection` exactly when it names our fleet and device.
pub fn rejection_decode(data: &[u8]) {
    let agg = aggregator_key();
    let vk = agg.verifying_key();
    let (fleet, me) = (fleet(), cam1());
    let topic = topics::rejections(&fleet, &me);
    let _ = verify::rejection(&topic, data, &fleet, &me, &vk);
    let Ok(signed) = SignedRejection::decode(data) else {
        return;
    };
    assert_eq!(signed.encode(), data, "rejection re-encodes");
    let _ = signed.verify(&vk);
    let body = signed.body().clone();
    let wire = SignedRejection::sign(body.clone(), &agg).encode();
    assert_eq!(wire[..wire.len() - 64], data[..data.len() - 64], "the body re-encodes to the bytes it was decoded from");
    let back = SignedRejection::decode(&wire).expect("signed again decodes");
    assert_eq!(back.verify(&vk), Ok(&body));
    let ok = verify::rejection(&topic, &wire, &fleet, &me, &vk);
    assert_eq!(ok.is_ok(), body.fleet == fleet && body.device == me);
    let _ = body.reason.as_str();
}

// ---- upload_frames ----

const RESIGN: u8 = 1;
const LATER: u8 = 2;
const OTHER_DEVICE: u8 = 4;
const EXPIRE: u8 = 8;

/// A sequence of upload frames fed to one `UpdateAssembler` (small limits), as records
/// `[flags u8][len u16 BE][frame]`. Flags: 1 = sign the header frame's envelope again with the
/// device's key, 2 = the frame arrives 61 s after the previous one (past the idle timeout),
/// 4 = the frame comes from cam-2 instead of cam-1 (both enrolled), 8 = call `expire` after it.
/// Invariants: reservations stay within the global limit and return to 0 when everything
/// expires; a completed upload has its signed length and digest and names the device it came
/// from.
pub fn upload_frames(data: &[u8]) {
    let keys = enrolled();
    let limits = limits();
    let mut asm = UpdateAssembler::new(fleet(), limits.clone());
    let mut now = Instant::now();
    for (flags, frame) in records(data) {
        let device = if flags & OTHER_DEVICE != 0 { cam2() } else { cam1() };
        let topic = topics::updates(&fleet(), &device);
        let resigned = (flags & RESIGN != 0).then(|| resign_header_frame(frame, &device)).flatten();
        let frame = resigned.as_deref().unwrap_or(frame);
        if flags & LATER != 0 {
            now += limits.idle_timeout + Duration::from_secs(1);
        }
        match asm.push(&topic, &device, &keys, frame, now) {
            Ok(Assembled::Complete(v)) => {
                let h = v.signed().body();
                assert_eq!(v.device(), &device);
                assert_eq!(h.device, device);
                assert_eq!(h.fleet, fleet());
                assert_eq!(v.payload().len() as u64, h.payload_len);
                assert_eq!(v.key(), &keys[&device]);
                assert!(h.payload_len <= limits.max_update_bytes);
                assert_eq!(Digest::of(v.payload()), h.payload_digest);
                assert!(v.signed().verify(&keys[&device]).is_ok());
            }
            Ok(Assembled::Pending | Assembled::Ignored) => {}
            Err(r) => {
                assert_eq!(r.device.as_ref(), Some(&device));
                assert_eq!(r.topic, topic);
            }
        }
        assert!(asm.reserved_bytes() <= limits.max_total_bytes);
        assert!(asm.in_progress() <= 2);
        if flags & EXPIRE != 0 {
            asm.expire(now);
        }
    }
    asm.expire(now + Duration::from_secs(86_400));
    assert_eq!(asm.in_progress(), 0);
    assert_eq!(asm.reserved_bytes(), 0, "every reservation is released");
}

// ---- inbound_publish ----

const SERVICE: u8 = 1;
const SIGN: u8 = 2;
// LATER (2) is not used here: the third bit is.
const LATE: u8 = 4;

/// Incoming publishes fed to the client's receiving half, `Inbound::receive` (topic parsing, the
/// payload decoders and signature checks, repeats, stale announcements, upload reassembly), as
/// records `[flags u8][topic len u8][payload len u16 BE][topic][payload]`. Two receivers: a
/// device (cam-1, pinned aggregator and registry keys) and a service (status and updates, cam-1
/// and cam-2 enrolled). Flags: 1 = to the service (else the device), 2 = sign the payload again
/// with the key its topic expects (aggregator: rounds, receipts, rejections; registry: rollouts;
/// the topic's device: status, update header frames; aggregator: answers), 4 = 61 s later. Invariants: what is
/// delivered verifies against the key it must, names our fleet (and the device its topic names),
/// and a verified announcement or rollout notice received again is a duplicate.
pub fn inbound_publish(mut data: &[u8]) {
    let fleet = fleet();
    let agg = aggregator_key();
    let reg = registry_key();
    let keys = enrolled();
    let mut device = Inbound::new(
        fleet.clone(),
        Role::Device { id: cam1(), aggregator_key: agg.verifying_key(), registry_key: Some(reg.verifying_key()) },
    );
    let mut service =
        Inbound::new(fleet.clone(), Role::Service { keys: Arc::new(keys.clone()), status: true, updates: true, limits: limits() });
    let mut now = Instant::now();
    while let [flags, topic_len, a, b, rest @ ..] = data {
        let topic_len = usize::from(*topic_len).min(rest.len());
        let (topic, rest) = rest.split_at(topic_len);
        let len = usize::from(u16::from_be_bytes([*a, *b])).min(rest.len());
        let (payload, tail) = rest.split_at(len);
        data = tail;
        let topic = String::from_utf8_lossy(topic);
        let parsed = topics::parse(&topic).ok();
        let resigned = if flags & SIGN != 0 {
            match &parsed {
                Some(Topic::Rounds { .. }) => resign::<RoundAnnouncement>(payload, &agg),
                Some(Topic::Rollouts { .. }) => resign::<RolloutNotice>(payload, &reg),
                Some(Topic::Receipts { .. }) => resign::<Receipt>(payload, &agg),
                Some(Topic::Rejections { .. }) => {
                    SignedRejection::decode(payload).ok().map(|s| SignedRejection::sign(s.body().clone(), &agg).encode())
                }
                Some(Topic::Status { device, .. }) => device_key(device).and_then(|k| resign::<DeviceStatus>(payload, &k)),
                Some(Topic::Updates { device, .. }) => resign_header_frame(payload, device),
                Some(Topic::Answers { .. }) => {
                    SignedAnswer::decode(payload).ok().map(|s| SignedAnswer::sign(s.body().clone(), &agg).encode())
                }
                Some(Topic::Requests { .. }) | None => None,
            }
        } else {
            None
        };
        let payload = resigned.as_deref().unwrap_or(payload);
        if flags & LATE != 0 {
            now += Duration::from_secs(61);
        }
        let to_service = flags & SERVICE != 0;
        let inbound = if to_service { &mut service } else { &mut device };
        let received = inbound.receive(&topic, payload, now);
        let event = match received {
            Received::Event(e) => e,
            Received::Duplicate | Received::Nothing => continue,
        };
        let topic_device = parsed.as_ref().and_then(|t| t.device().cloned());
        match &event {
            ControlEvent::Announcement(s) => {
                assert!(!to_service);
                assert!(s.verify(&agg.verifying_key()).is_ok());
                assert_eq!(s.body().fleet, fleet);
            }
            ControlEvent::Rollout(s) => {
                assert!(!to_service);
                assert!(s.verify(&reg.verifying_key()).is_ok());
                assert_eq!(s.body().fleet, fleet);
            }
            ControlEvent::Receipt(s) => {
                assert!(!to_service);
                assert!(s.verify(&agg.verifying_key()).is_ok());
                assert_eq!((&s.body().fleet, &s.body().device), (&fleet, &cam1()));
            }
            ControlEvent::UploadRefused(s) => {
                assert!(!to_service);
                assert!(s.verify(&agg.verifying_key()).is_ok());
                assert_eq!((&s.body().fleet, &s.body().device), (&fleet, &cam1()));
            }
            ControlEvent::Status(s) => {
                assert!(to_service);
                let d = &s.body().device;
                assert_eq!(Some(d), topic_device.as_ref());
                assert!(s.verify(&keys[d]).is_ok());
                assert_eq!(s.body().fleet, fleet);
            }
            ControlEvent::Update(v) => {
                assert!(to_service);
                assert_eq!(Some(v.device()), topic_device.as_ref());
                assert_eq!(Digest::of(v.payload()), v.signed().body().payload_digest);
                assert!(v.signed().verify(&keys[v.device()]).is_ok());
                assert_eq!(v.key(), &keys[v.device()]);
            }
            ControlEvent::Answer(s) => {
                assert!(!to_service);
                assert!(s.verify(&agg.verifying_key()).is_ok());
                assert_eq!((&s.body().fleet, &s.body().device), (&fleet, &cam1()));
            }
            ControlEvent::Request(r) => {
                assert!(to_service);
                assert_eq!(Some(&r.device), topic_device.as_ref());
            }
            ControlEvent::Rejected(r) => {
                assert_eq!(r.topic, topic);
                let _ = r.to_string();
            }
            ControlEvent::Connected { .. } | ControlEvent::Disconnected { .. } => {
                panic!("a publish became a connection event")
            }
        }
        if matches!(event, ControlEvent::Announcement(_) | ControlEvent::Rollout(_)) {
            assert_eq!(inbound.receive(&topic, payload, now), Received::Duplicate, "the same verified announcement again is a duplicate");
        }
    }
}

// ---- Seed inputs: valid encodings, the fuzzers' starting points ----

fn model() -> ModelRef {
    ModelRef { name: "mnist-mlp".into(), version: ModelVersion(3), digest: Digest::of(b"model") }
}

fn announcement(round: u64) -> RoundAnnouncement {
    RoundAnnouncement {
        fleet: fleet(),
        round: RoundId(round),
        base_model: model(),
        config: RoundConfig { quantization: DType::I8, ..RoundConfig::default() },
        deadline_unix_ms: 1_700_000_000_000,
        selection: Selection::Devices(vec![cam1()]),
    }
}

fn rollout(issued: u64) -> RolloutNotice {
    RolloutNotice {
        fleet: fleet(),
        rollout_id: 2,
        alias: "stable".into(),
        model: model(),
        length: 1234,
        phase: 1,
        percent_bp: 1000,
        cohort: Some("lab".into()),
        action: RolloutAction::Install,
        issued_at_unix_ms: issued,
    }
}

fn status(device: DeviceId) -> DeviceStatus {
    DeviceStatus {
        fleet: fleet(),
        device,
        reported_at_unix_ms: 7,
        state: DeviceState::Training { round: RoundId(4) },
        active: Some(model()),
        staged: None,
        rollout_id: Some(2),
    }
}

fn header(device: DeviceId, payload: &[u8], nonce: u8) -> UpdateHeader {
    UpdateHeader {
        device,
        fleet: fleet(),
        round: RoundId(4),
        base_model: model().digest,
        nonce: [nonce; 16],
        sample_count: 600,
        payload_len: payload.len() as u64,
        payload_digest: Digest::of(payload),
        payload_dtype: DType::I8,
    }
}

fn signed_update(device: DeviceId, payload: &[u8], nonce: u8) -> Signed<UpdateHeader> {
    let key = device_key(&device).expect("enrolled");
    Signed::sign(header(device, payload, nonce), &key)
}

fn rejection(device: DeviceId, reason: RejectReason, detail: &str) -> Vec<u8> {
    let h = header(device, b"payload", 1);
    SignedRejection::sign(UploadRejection::of(&h, reason, detail, 1_700_000_000_000), &aggregator_key()).encode()
}

fn receipt(device: DeviceId) -> Vec<u8> {
    let r = Receipt {
        fleet: fleet(),
        device,
        round: RoundId(4),
        nonce: [1; 16],
        payload_digest: Digest::of(b"payload"),
        accepted_at_unix_ms: 5,
    };
    Signed::sign(r, &aggregator_key()).encode()
}

fn publish(flags: u8, topic: &str, payload: &[u8]) -> Vec<u8> {
    let mut r = vec![flags, topic.len() as u8];
    r.extend_from_slice(&(payload.len() as u16).to_be_bytes());
    r.extend_from_slice(topic.as_bytes());
    r.extend_from_slice(payload);
    r
}

/// An answer to request `id` addressed to `device`, signed by the aggregator.
fn answer(device: DeviceId, id: u64) -> Vec<u8> {
    let a = fedfleet_control::Answer { fleet: fleet(), device, id, bytes: b"a response".to_vec() };
    SignedAnswer::sign(a, &aggregator_key()).encode()
}

/// (target, name, bytes) of every seed input.
pub fn seeds() -> Vec<(&'static str, String, Vec<u8>)> {
    let mut out = Vec::new();
    let (f, c1, c2) = (fleet(), cam1(), cam2());

    let topic_strings = [
        topics::rounds(&f),
        topics::rollouts(&f),
        topics::status(&f, &c1),
        topics::updates(&f, &c1),
        topics::receipts(&f, &c1),
        topics::rejections(&f, &c2),
        topics::requests(&f, &c1),
        topics::answers(&f, &c2),
        topics::all_status(&f),
        topics::all_updates(&f),
        "fedfleet/v1/eu/#".into(),
        "fedfleet/v2/eu/rounds".into(),
        "fedfleet/v1//rounds".into(),
    ];
    for (i, t) in topic_strings.iter().enumerate() {
        out.push(("topic_parse", format!("topic-{i}"), t.clone().into_bytes()));
    }

    let long = "x".repeat(1024);
    for (i, bytes) in [
        rejection(c1.clone(), RejectReason::ShapeMismatch, "tensor fc1.weight: [64, 64]"),
        rejection(c2.clone(), RejectReason::StaleRound, ""),
        rejection(c1.clone(), RejectReason::NonFinite, &long),
    ]
    .into_iter()
    .enumerate()
    {
        out.push(("rejection_decode", format!("rejection-{i}"), bytes));
    }

    // Upload frames: whole uploads, chunk sizes 4 and 1000, a redelivery, two devices at once,
    // an empty payload.
    let payload: Vec<u8> = (0..10u8).collect();
    let big = vec![5u8; 3000];
    let up1 = encode_frames(&signed_update(c1.clone(), &payload, 1), &payload, 4);
    let up2 = encode_frames(&signed_update(c2.clone(), &big, 2), &big, 1000);
    let empty = encode_frames(&signed_update(c1.clone(), b"", 3), b"", 4);
    let cat = |frames: &[(u8, &Vec<u8>)]| -> Vec<u8> { frames.iter().flat_map(|(fl, fr)| record(*fl, fr)).collect() };
    let seq: Vec<_> = up1.iter().map(|f| (0, f)).collect();
    out.push(("upload_frames", "whole".into(), cat(&seq)));
    let redelivered = [(0, &up1[0]), (0, &up1[1]), (0, &up1[1]), (1, &up1[0]), (0, &up1[2]), (0, &up1[3])];
    out.push(("upload_frames", "redelivered".into(), cat(&redelivered)));
    let two: Vec<_> = up2.iter().map(|fr| (OTHER_DEVICE, fr)).zip(up1.iter().map(|fr| (0, fr))).flat_map(|(a, b)| [a, b]).collect();
    out.push(("upload_frames", "two-devices".into(), cat(&two)));
    out.push(("upload_frames", "empty".into(), cat(&[(0, &empty[0])])));
    let expired = [(0, &up1[0]), (0, &up1[1]), (LATER | EXPIRE, &up1[2])];
    out.push(("upload_frames", "expired".into(), cat(&expired)));

    // Inbound publishes: every topic, to the role that listens to it.
    let ann = Signed::sign(announcement(4), &aggregator_key()).encode();
    let ann5 = Signed::sign(announcement(5), &aggregator_key()).encode();
    let roll = Signed::sign(rollout(9), &registry_key()).encode();
    let st1 = Signed::sign(status(c1.clone()), &device_key(&c1).unwrap()).encode();
    let st2 = Signed::sign(status(c2.clone()), &device_key(&c2).unwrap()).encode();
    let device_side = [
        publish(0, &topics::rounds(&f), &ann),
        publish(0, &topics::rounds(&f), &ann5),
        publish(0, &topics::rounds(&f), &ann),
        publish(0, &topics::rollouts(&f), &roll),
        publish(0, &topics::receipts(&f, &c1), &receipt(c1.clone())),
        publish(0, &topics::rejections(&f, &c1), &rejection(c1.clone(), RejectReason::Replay, "seen")),
        publish(0, &topics::rounds(&f), b""),
        publish(0, &topics::answers(&f, &c1), &answer(c1.clone(), 7)),
        publish(0, &topics::answers(&f, &c1), &answer(c2.clone(), 8)),
    ]
    .concat();
    out.push(("inbound_publish", "device".into(), device_side));
    let mut service_side = vec![
        publish(SERVICE, &topics::status(&f, &c1), &st1),
        publish(SERVICE, &topics::status(&f, &c2), &st2),
        publish(SERVICE, &topics::status(&f, &c1), &st2),
    ];
    for fr in &up1 {
        service_side.push(publish(SERVICE, &topics::updates(&f, &c1), fr));
    }
    service_side.push(publish(SERVICE, &topics::requests(&f, &c1), &fedfleet_control::exchange::encode_request(7, b"poll", b"")));
    service_side.push(publish(SERVICE, &topics::requests(&f, &c2), &fedfleet_control::exchange::encode_request(8, b"send", &[1; 16])));
    out.push(("inbound_publish", "service".into(), service_side.concat()));
    let strangers = [
        publish(SIGN, &topics::rounds(&f), &Signed::sign(announcement(6), &registry_key()).encode()),
        publish(SERVICE | SIGN, &topics::status(&f, &c2), &st1),
        publish(0, "fedfleet/v1/us/rounds", &ann),
        publish(0, "elsewhere", b"x"),
    ]
    .concat();
    out.push(("inbound_publish", "strangers".into(), strangers));
    out
}

/// With `FEDFLEET_FUZZ_WRITE_SEEDS=<corpus dir>` set, writes every target's seed inputs into
/// `<dir>/<target>/seed-<name>` (called by each target's libFuzzer init, before the corpus is
/// read, and by the replay test's ignored `write_seed_inputs`).
pub fn write_seeds_if_asked() {
    let Some(dir) = std::env::var_os("FEDFLEET_FUZZ_WRITE_SEEDS") else {
        return;
    };
    write_seeds(std::path::Path::new(&dir));
}

pub fn write_seeds(dir: &std::path::Path) {
    for (target, name, bytes) in seeds() {
        let d = dir.join(target);
        std::fs::create_dir_all(&d).expect("corpus dir");
        std::fs::write(d.join(format!("seed-{name}")), bytes).expect("seed written");
    }
}
