//! The fuzz harnesses: what each target feeds its input to. Shared by the cargo-fuzz targets
//! (`fuzz_targets/<name>.rs`, `#[path]`-included) and the corpus replay in every `cargo test`
//! (`../tests/fuzz_corpus.rs`), so the two cannot drift apart. They assert only that nothing
//! panics and that what decodes re-encodes as expected.

#![allow(dead_code)]

use std::sync::LazyLock;

use ed25519_dalek::SigningKey;
use fedfleet_protocol::ModelInfo;
use fedfleet_protocol::artifact::Manifest;
use fedfleet_protocol::envelope::Signable;
use fedfleet_protocol::tuf::{Metadata, Root, SignedMetadata, Targets, Timestamp, Verifier};
use fedfleet_protocol::*;

pub fn bundle_decode(data: &[u8]) {
    let limits = BundleLimits { max_bytes: 1 << 20, max_tensors: 256, max_params: 1 << 20 };
    if let Ok(bundle) = TensorBundle::decode(data, &limits) {
        let again = TensorBundle::decode(&bundle.encode(), &limits).expect("re-encoded bundle decodes");
        assert_eq!(again.layout(), bundle.layout());
        let _ = bundle.check_finite();
        let _ = bundle.dequantize();
    }
}

pub fn frame_decode(data: &[u8]) {
    let Some((&split, rest)) = data.split_first() else {
        return;
    };
    let mut decoder = FrameDecoder::new();
    for chunk in rest.chunks(usize::from(split).max(1)) {
        decoder.push(chunk);
        while let Ok(Some(_)) = decoder.poll() {}
    }
    let _ = decoder.finish();
}

pub fn message_decode(data: &[u8]) {
    if let Ok(message) = Message::decode(data) {
        let _ = message.encode();
    }
}

pub fn signed_update_decode(data: &[u8]) {
    if let Ok(signed) = SignedUpdate::decode(data) {
        assert_eq!(signed.encode(), data);
    }
    if let Ok(header) = UpdateHeader::from_canonical_bytes(data) {
        assert_eq!(header.canonical_bytes(), data);
    }
    let _ = SignedRelay::decode(data);
    let _ = Signed::<Receipt>::decode(data);
    let _ = Signed::<RoundAnnouncement>::decode(data);
    let _ = Signed::<DeviceStatus>::decode(data);
}

pub fn envelope<T: Signable>(data: &[u8]) -> Option<Signed<T>> {
    let signed = Signed::<T>::decode(data).ok()?;
    assert_eq!(signed.encode(), data, "{:?} envelope re-encodes", T::KIND);
    let _ = signed.signing_message();
    Some(signed)
}

pub fn envelope_decode(data: &[u8]) {
    let device = DeviceId::new("dev-1").expect("valid id");

    if let Some(s) = envelope::<UpdateHeader>(data) {
        let _ = verify_payload(s.body(), data);
    }
    if let Some(s) = envelope::<RelayHeader>(data) {
        let mut check = PayloadCheck::new(s.body());
        for chunk in data.chunks(7) {
            if check.update(chunk).is_err() {
                break;
            }
        }
        let _ = check.received();
        let _ = check.finish();
    }
    let _ = envelope::<Receipt>(data);
    if let Some(s) = envelope::<RoundAnnouncement>(data) {
        let _ = s.body().selection.selects(&device);
    }
    if let Some(s) = envelope::<RolloutNotice>(data) {
        let _ = s.body().includes(&device, Some("lab"));
        let _ = s.body().includes(&device, None);
    }
    let _ = envelope::<DeviceStatus>(data);
    if let Some(s) = envelope::<ModelInfo>(data) {
        let _ = s.body().spec.to_string();
        let _ = s.body().model_ref();
    }

    if let Ok(h) = RelayHeader::from_canonical_bytes(data) {
        assert_eq!(h.canonical_bytes(), data);
    }
    if let Ok(r) = Receipt::from_canonical_bytes(data) {
        assert_eq!(r.canonical_bytes(), data);
    }
    if let Ok(a) = RoundAnnouncement::from_canonical_bytes(data) {
        RoundAnnouncement::from_canonical_bytes(&a.canonical_bytes()).expect("re-encoded round");
    }
    if let Ok(n) = RolloutNotice::from_canonical_bytes(data) {
        let again = RolloutNotice::from_canonical_bytes(&n.canonical_bytes()).expect("re-encoded");
        assert_eq!(again, n);
    }
    if let Ok(s) = DeviceStatus::from_canonical_bytes(data) {
        let again = DeviceStatus::from_canonical_bytes(&s.canonical_bytes()).expect("re-encoded");
        assert_eq!(again, s);
        let _ = s.state.as_str();
    }
    if let Ok(m) = ModelInfo::from_canonical_bytes(data) {
        ModelInfo::from_canonical_bytes(&m.canonical_bytes()).expect("re-encoded manifest");
    }
}

pub fn tuf_decode(data: &[u8]) {
    if let Ok(root) = serde_json::from_slice::<SignedMetadata<Root>>(data) {
        let _ = root.message();
        if let Ok(body) = root.body_unverified() {
            let _ = body.validate();
        }
        let _ = Verifier::new(root);
    }
    if let Ok(targets) = serde_json::from_slice::<SignedMetadata<Targets>>(data)
        && targets.body_unverified().is_ok()
    {
        let _ = Timestamp::for_targets(1, 2, &targets);
    }
    if let Ok(timestamp) = serde_json::from_slice::<SignedMetadata<Timestamp>>(data) {
        let _ = timestamp.body_unverified();
    }
    if let Ok(root) = serde_json::from_slice::<Root>(data) {
        let _ = root.validate();
    }
    let _ = serde_json::from_slice::<Targets>(data);
    let _ = serde_json::from_slice::<Timestamp>(data);
    if let Ok(verifier) = serde_json::from_slice::<Verifier>(data) {
        let _ = verifier.target("m", ModelVersion(1), 0);
        let _ = serde_json::to_vec(&verifier);
    }
}

pub fn manifest_decode(data: &[u8]) {
    if let Ok(manifest) = serde_json::from_slice::<Manifest>(data) {
        for i in 0..=manifest.chunks.len() {
            let _ = manifest.chunk_offset(i);
        }
        let _ = manifest.validate();
        let _ = serde_json::to_vec(&manifest);
        let _ = postcard::to_stdvec(&manifest);
    }
    let _ = serde_json::from_slice::<Digest>(data);
    let _ = serde_json::from_slice::<DeviceId>(data);
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = text.parse::<Digest>();
        let _ = text.parse::<DeviceId>();
        let _ = text.parse::<FleetId>();
        let _ = text.parse::<DType>();
    }
}

// tuf_verifier: the harness signs the fuzzer's body text with these keys.
pub const TUF_EXPIRES: u64 = 20_000;
pub const TUF_MAX_OPS: usize = 6;

pub static TUF_KEYS: LazyLock<Vec<SigningKey>> = LazyLock::new(|| (1..=5u8).map(|i| SigningKey::from_bytes(&[i; 32])).collect());

pub struct TufFixture {
    verifier: Verifier,
    root: SignedMetadata<Root>,
    targets: SignedMetadata<Targets>,
    timestamp: SignedMetadata<Timestamp>,
}

pub static TUF_FIXTURE: LazyLock<TufFixture> = LazyLock::new(|| {
    let k = &*TUF_KEYS;
    let vk = |i: usize| k[i].verifying_key();
    let root = Root::new(1, TUF_EXPIRES, (&[&vk(0)], 1), (&[&vk(1)], 1), (&[&vk(2)], 1));
    let root = SignedMetadata::sign(&root, &[&k[0]]);
    let verifier = Verifier::new(root.clone()).expect("the fixture root is valid");
    let targets = SignedMetadata::new(&Targets { version: 1, expires: TUF_EXPIRES, targets: Vec::new() });
    let timestamp = SignedMetadata::new(&Timestamp::for_targets(1, TUF_EXPIRES, &targets).expect("fixture targets parse"));
    TufFixture { verifier, root, targets, timestamp }
});

pub fn tuf_signed<T: Metadata + Clone>(template: &SignedMetadata<T>, text: String, signers: u8) -> SignedMetadata<T> {
    let mut s = template.clone();
    s.signed = text;
    s.signatures.clear();
    for (i, key) in TUF_KEYS.iter().enumerate() {
        if signers & (1 << i) != 0 {
            s.add_signature(key);
        }
    }
    s
}

pub fn tuf_verifier(data: &[u8]) {
    let fx = &*TUF_FIXTURE;
    let mut verifier = fx.verifier.clone();
    let mut rest = data;
    for _ in 0..TUF_MAX_OPS {
        let Some((&[op, signers, version, hi, lo], tail)) = rest.split_first_chunk::<5>() else {
            break;
        };
        let len = usize::from(u16::from_be_bytes([hi, lo])).min(tail.len());
        let (body, tail) = tail.split_at(len);
        rest = tail;
        let now = u64::from(op >> 3) * 1000;
        let text = String::from_utf8_lossy(body).into_owned();
        match op & 7 {
            0 => {
                let _ = verifier.update_root(&tuf_signed(&fx.root, text, signers));
            }
            1 => {
                let _ = verifier.update_timestamp(&tuf_signed(&fx.timestamp, text, signers), now);
            }
            2 => {
                let _ = verifier.update_targets(&tuf_signed(&fx.targets, text, signers), now);
            }
            3 => {
                let targets = tuf_signed(&fx.targets, text, signers);
                if let Ok(ts) = Timestamp::for_targets(u64::from(version), TUF_EXPIRES, &targets) {
                    let ts_text = serde_json::to_string(&ts).expect("timestamp serializes");
                    let ts = tuf_signed(&fx.timestamp, ts_text, 1 << 2);
                    if verifier.update_timestamp(&ts, now).is_ok() {
                        let _ = verifier.update_targets(&targets, now);
                    }
                }
            }
            _ => {
                let version = ModelVersion(u64::from(version));
                let _ = verifier.verify_artifact("m", version, body, now);
                let _ = verifier.verify_artifact_digest("m", version, body.len() as u64, Digest::of(body), now);
            }
        }
        if op & 0x80 != 0 {
            let json = serde_json::to_vec(&verifier).expect("verifier serializes");
            verifier = serde_json::from_slice(&json).expect("persisted verifier reads back");
        }
        let _ = (verifier.root(), verifier.timestamp(), verifier.targets());
    }
}
