use std::collections::BTreeMap;

use ed25519_dalek::SigningKey;
use fedfleet_protocol::{Digest, ModelInfo, ModelVersion, SpecJson};

use crate::tuf::*;

const DAY: u64 = 86_400_000;
const NOW: u64 = 1_700_000_000_000;

fn key(i: u8) -> SigningKey {
    SigningKey::from_bytes(&[i; 32])
}

struct Keys {
    root: SigningKey,
    root2: SigningKey,
    targets: SigningKey,
    targets2: SigningKey,
    ts: SigningKey,
}

fn keys() -> Keys {
    Keys { root: key(1), root2: key(2), targets: key(3), targets2: key(4), ts: key(5) }
}

fn root_v1(k: &Keys) -> Root {
    Root::new(1, NOW + 365 * DAY, (&[&k.root.verifying_key()], 1), (&[&k.targets.verifying_key()], 1), (&[&k.ts.verifying_key()], 1))
}

const MODEL: &[u8] = b"model weights v1";
const MODEL2: &[u8] = b"model weights v2, a bit longer";

fn target(name: &str, v: u64, bytes: &[u8]) -> ModelInfo {
    ModelInfo {
        name: name.into(),
        version: ModelVersion(v),
        length: bytes.len() as u64,
        digest: Digest::of(bytes),
        spec: SpecJson(serde_json::json!({"arch": "cnn", "input": [1, 28, 28]})),
        parent: v.checked_sub(1).filter(|&p| p > 0).map(ModelVersion),
        metrics: BTreeMap::from([("accuracy".into(), 0.981)]),
        created_at_unix_ms: 0,
        publisher: String::new(),
        adapter: None,
    }
}

fn targets(version: u64, expires: u64) -> Targets {
    let mut list = vec![target("mnist", 1, MODEL)];
    if version >= 2 {
        list.push(target("mnist", 2, MODEL2));
    }
    Targets { version, expires, targets: list }
}

fn ts(version: u64, expires: u64, t: &SignedMetadata<Targets>, key: &SigningKey) -> SignedMetadata<Timestamp> {
    SignedMetadata::sign(&Timestamp::for_targets(version, expires, t).unwrap(), &[key])
}

/// A verifier that trusts root v1, timestamp v1 and targets v1.
fn setup() -> (Keys, Verifier) {
    let k = keys();
    let root = SignedMetadata::sign(&root_v1(&k), &[&k.root]);
    let mut v = Verifier::new(root).unwrap();
    let t = SignedMetadata::sign(&targets(1, NOW + 30 * DAY), &[&k.targets]);
    assert!(v.update_timestamp(&ts(1, NOW + DAY, &t, &k.ts), NOW).unwrap());
    assert!(v.update_targets(&t, NOW).unwrap());
    (k, v)
}

#[test]
fn happy_path_and_persistence() {
    let (k, mut v) = setup();
    let info = v.verify_artifact("mnist", ModelVersion(1), MODEL, NOW).unwrap();
    assert_eq!(info.metrics["accuracy"], 0.981);
    // Idempotent re-delivery.
    let t = SignedMetadata::sign(&targets(1, NOW + 30 * DAY), &[&k.targets]);
    assert!(!v.update_timestamp(&ts(1, NOW + DAY, &t, &k.ts), NOW).unwrap());
    assert!(!v.update_targets(&t, NOW).unwrap());
    // New targets through a new timestamp.
    let t2 = SignedMetadata::sign(&targets(2, NOW + 30 * DAY), &[&k.targets]);
    v.update_timestamp(&ts(2, NOW + DAY, &t2, &k.ts), NOW + 1).unwrap();
    v.update_targets(&t2, NOW + 1).unwrap();
    v.verify_artifact("mnist", ModelVersion(2), MODEL2, NOW + 2).unwrap();
    // The metadata and the verifier state survive JSON.
    let json = serde_json::to_string(&t2).unwrap();
    assert_eq!(serde_json::from_str::<SignedMetadata<Targets>>(&json).unwrap(), t2);
    let state = serde_json::to_string(&v).unwrap();
    let mut v2: Verifier = serde_json::from_str(&state).unwrap();
    v2.verify_artifact("mnist", ModelVersion(2), MODEL2, NOW + 2).unwrap();
    assert!(matches!(
        v2.update_timestamp(&ts(1, NOW + DAY, &t, &k.ts), NOW).unwrap_err(),
        TufError::Rollback { role: Role::Timestamp, trusted: 2, got: 1 }
    ));
}

#[test]
fn canonical_bytes_are_domain_separated_and_stable() {
    let k = keys();
    let t = targets(1, 5);
    let a = SignedMetadata::sign(&t, &[&k.targets]);
    let b = SignedMetadata::sign(&t, &[&k.targets]);
    assert_eq!(a, b, "same body, same bytes, same signature");
    assert!(a.message().starts_with(b"fedfleet/tuf/targets/v1\0"));
    assert!(a.signed.starts_with(r#"{"version":1,"expires":5,"targets":[{"name":"mnist""#), "{}", a.signed);
    // A targets signature does not verify as a timestamp signature over the same text.
    let k2 = keys();
    let root = Root::new(1, NOW + DAY, (&[&k2.root.verifying_key()], 1), (&[&k2.ts.verifying_key()], 1), (&[&k2.ts.verifying_key()], 1));
    let mut v = Verifier::new(SignedMetadata::sign(&root, &[&k2.root])).unwrap();
    let tt = SignedMetadata::<Targets>::sign(&targets(1, NOW + DAY), &[&k2.ts]);
    let forged: SignedMetadata<Timestamp> = serde_json::from_str(&serde_json::to_string(&tt).unwrap()).unwrap();
    assert_eq!(forged.signed, tt.signed);
    assert!(matches!(v.update_timestamp(&forged, NOW), Err(TufError::BadSignature { role: Role::Timestamp, .. })));
}

#[test]
fn attack_bad_signature() {
    let (k, mut v) = setup();
    let t2 = SignedMetadata::sign(&targets(2, NOW + 30 * DAY), &[&k.targets]);
    let mut stamp = ts(2, NOW + DAY, &t2, &k.ts);
    stamp.signatures[0].sig[10] ^= 1;
    assert_eq!(
        v.update_timestamp(&stamp, NOW),
        Err(TufError::BadSignature { role: Role::Timestamp, keyid: KeyId::of(&k.ts.verifying_key()) })
    );
    // A tampered body (signatures kept) fails the same way.
    let mut stamp = ts(2, NOW + DAY, &t2, &k.ts);
    stamp.signed = stamp.signed.replace(r#""version":2"#, r#""version":3"#);
    assert!(matches!(v.update_timestamp(&stamp, NOW), Err(TufError::BadSignature { role: Role::Timestamp, .. })));
    // Targets tampered after signing: the timestamp (signed over the honest text) catches it
    // first; with a timestamp over the tampered text, the signature does.
    let mut evil = t2.clone();
    evil.signed = evil.signed.replace("0.981", "0.999");
    v.update_timestamp(&ts(2, NOW + DAY, &evil, &k.ts), NOW).unwrap();
    assert!(matches!(v.update_targets(&evil, NOW), Err(TufError::BadSignature { role: Role::Targets, .. })));
    // Nothing forged is trusted; the honest targets still go through with a fresh timestamp.
    assert!(v.targets().is_none());
    v.update_timestamp(&ts(3, NOW + DAY, &t2, &k.ts), NOW).unwrap();
    v.update_targets(&t2, NOW).unwrap();
    assert_eq!(v.targets().unwrap().get("mnist", ModelVersion(2)).unwrap().metrics["accuracy"], 0.981);
}

#[test]
fn attack_unsigned_and_under_threshold() {
    let k = keys();
    let mut root = root_v1(&k);
    root.targets = RoleKeys::new(&[&k.targets.verifying_key(), &k.targets2.verifying_key()], 2);
    root.keys.insert(KeyId::of(&k.targets2.verifying_key()), PublicKey::ed25519(&k.targets2.verifying_key()));
    let mut v = Verifier::new(SignedMetadata::sign(&root, &[&k.root])).unwrap();

    let one = SignedMetadata::sign(&targets(1, NOW + DAY), &[&k.targets]);
    v.update_timestamp(&ts(1, NOW + DAY, &one, &k.ts), NOW).unwrap();
    assert_eq!(v.update_targets(&one, NOW), Err(TufError::UnderThreshold { role: Role::Targets, valid: 1, threshold: 2 }));
    // The same key twice counts once.
    let mut twice = one.clone();
    twice.signatures.push(twice.signatures[0].clone());
    assert_eq!(v.update_targets(&twice, NOW), Err(TufError::UnderThreshold { role: Role::Targets, valid: 1, threshold: 2 }));
    // Signatures by keys outside the role do not count.
    let outsider = SignedMetadata::sign(&targets(1, NOW + DAY), &[&k.targets, &k.root, &k.ts]);
    assert_eq!(v.update_targets(&outsider, NOW), Err(TufError::UnderThreshold { role: Role::Targets, valid: 1, threshold: 2 }));
    // Unsigned.
    let unsigned = SignedMetadata::new(&targets(1, NOW + DAY));
    assert_eq!(v.update_targets(&unsigned, NOW), Err(TufError::UnderThreshold { role: Role::Targets, valid: 0, threshold: 2 }));
    let both = SignedMetadata::sign(&targets(1, NOW + DAY), &[&k.targets, &k.targets2]);
    v.update_targets(&both, NOW).unwrap();
    // An unsigned pinned root is refused too.
    assert!(matches!(
        Verifier::new(SignedMetadata::new(&root_v1(&k))),
        Err(TufError::UnderThreshold { role: Role::Root, valid: 0, threshold: 1 })
    ));
}

#[test]
fn attack_freeze_expired_metadata() {
    let (k, mut v) = setup();
    // Expired timestamp.
    let t = SignedMetadata::sign(&targets(2, NOW + 30 * DAY), &[&k.targets]);
    let old = ts(2, NOW + 10, &t, &k.ts);
    assert_eq!(v.update_timestamp(&old, NOW + 10), Err(TufError::Expired { role: Role::Timestamp, expires: NOW + 10, now: NOW + 10 }));
    // The trusted timestamp itself expires: no artifact verifies any more.
    assert_eq!(
        v.verify_artifact("mnist", ModelVersion(1), MODEL, NOW + DAY),
        Err(TufError::Expired { role: Role::Timestamp, expires: NOW + DAY, now: NOW + DAY })
    );
    // Expired targets behind a fresh timestamp.
    let stale = SignedMetadata::sign(&targets(3, NOW + 5), &[&k.targets]);
    v.update_timestamp(&ts(3, NOW + DAY, &stale, &k.ts), NOW).unwrap();
    assert!(matches!(v.update_targets(&stale, NOW + 5), Err(TufError::Expired { role: Role::Targets, .. })));
    // Expired root.
    let r = Root { expires: NOW + 1, ..root_v1(&k) };
    let mut v = Verifier::new(SignedMetadata::sign(&r, &[&k.root])).unwrap();
    assert!(matches!(v.update_timestamp(&ts(1, NOW + DAY, &t, &k.ts), NOW + 1), Err(TufError::Expired { role: Role::Root, .. })));
}

#[test]
fn attack_rollback() {
    let (k, mut v) = setup();
    let t2 = SignedMetadata::sign(&targets(2, NOW + 30 * DAY), &[&k.targets]);
    v.update_timestamp(&ts(5, NOW + DAY, &t2, &k.ts), NOW).unwrap();
    v.update_targets(&t2, NOW).unwrap();
    // Older timestamp.
    let t1 = SignedMetadata::sign(&targets(1, NOW + 30 * DAY), &[&k.targets]);
    assert_eq!(
        v.update_timestamp(&ts(4, NOW + DAY, &t1, &k.ts), NOW),
        Err(TufError::Rollback { role: Role::Timestamp, trusted: 5, got: 4 })
    );
    // Newer timestamp that points at older targets.
    assert_eq!(v.update_timestamp(&ts(6, NOW + DAY, &t1, &k.ts), NOW), Err(TufError::Rollback { role: Role::Targets, trusted: 2, got: 1 }));
    // Same timestamp version, different content.
    assert_eq!(
        v.update_timestamp(&ts(5, NOW + 2 * DAY, &t2, &k.ts), NOW),
        Err(TufError::VersionReused { role: Role::Timestamp, version: 5 })
    );
    // Older root.
    let r2 = SignedMetadata::sign(&Root { version: 2, ..root_v1(&k) }, &[&k.root]);
    v.update_root(&r2).unwrap();
    let r1 = SignedMetadata::sign(&root_v1(&k), &[&k.root]);
    assert_eq!(v.update_root(&r1), Err(TufError::Rollback { role: Role::Root, trusted: 2, got: 1 }));
    let r4 = SignedMetadata::sign(&Root { version: 4, ..root_v1(&k) }, &[&k.root]);
    assert_eq!(v.update_root(&r4), Err(TufError::RootVersionSkipped { trusted: 2, got: 4 }));
}

#[test]
fn attack_root_rotation_not_signed_by_old_root() {
    let (k, mut v) = setup();
    // An attacker's root listing their own key, signed only by their own key.
    let evil = key(66);
    let r2 = Root::new(2, NOW + DAY, (&[&evil.verifying_key()], 1), (&[&evil.verifying_key()], 1), (&[&evil.verifying_key()], 1));
    assert_eq!(v.update_root(&SignedMetadata::sign(&r2, &[&evil])), Err(TufError::RootNotSignedByOldRoot { valid: 0, threshold: 1 }));
    assert_eq!(v.root().version, 1);
    let _ = k;
}

#[test]
fn attack_root_rotation_not_signed_by_new_root_threshold() {
    let (k, mut v) = setup();
    let r2 = Root::new(2, NOW + DAY, (&[&k.root2.verifying_key()], 1), (&[&k.targets.verifying_key()], 1), (&[&k.ts.verifying_key()], 1));
    assert_eq!(v.update_root(&SignedMetadata::sign(&r2, &[&k.root])), Err(TufError::RootNotSignedByNewRoot { valid: 0, threshold: 1 }));
    assert!(v.update_root(&SignedMetadata::sign(&r2, &[&k.root, &k.root2])).unwrap());
    assert_eq!(v.root().version, 2);
}

#[test]
fn targets_key_rotation() {
    let (k, mut v) = setup();
    // Root v2: same root key plus a second one (threshold 2), targets key rotated.
    let r2 = Root::new(
        2,
        NOW + 365 * DAY,
        (&[&k.root.verifying_key(), &k.root2.verifying_key()], 2),
        (&[&k.targets2.verifying_key()], 1),
        (&[&k.ts.verifying_key()], 1),
    );
    let r2 = SignedMetadata::sign(&r2, &[&k.root, &k.root2]);
    assert!(v.update_root(&r2).unwrap());
    assert!(v.targets().is_none(), "targets signed by the old key are no longer trusted");
    // Targets signed by the retired key are refused.
    let old = SignedMetadata::sign(&targets(2, NOW + 30 * DAY), &[&k.targets]);
    v.update_timestamp(&ts(2, NOW + DAY, &old, &k.ts), NOW).unwrap();
    assert_eq!(v.update_targets(&old, NOW), Err(TufError::UnderThreshold { role: Role::Targets, valid: 0, threshold: 1 }));
    // Targets signed by the new key are accepted.
    let new = SignedMetadata::sign(&targets(2, NOW + 30 * DAY), &[&k.targets2]);
    v.update_timestamp(&ts(3, NOW + DAY, &new, &k.ts), NOW).unwrap();
    v.update_targets(&new, NOW).unwrap();
    v.verify_artifact("mnist", ModelVersion(2), MODEL2, NOW).unwrap();
    // Root v3 now needs both root keys of v2.
    let r3 = SignedMetadata::sign(&Root { version: 3, ..r2.body_unverified().unwrap() }, &[&k.root2]);
    assert_eq!(v.update_root(&r3), Err(TufError::RootNotSignedByOldRoot { valid: 1, threshold: 2 }));
    // Persisted verifier keeps the rotated root.
    let v2: Verifier = serde_json::from_str(&serde_json::to_string(&v).unwrap()).unwrap();
    assert_eq!(v2.root().version, 2);
}

#[test]
fn attack_targets_not_matching_timestamp() {
    let (k, mut v) = setup();
    let t2 = SignedMetadata::sign(&targets(2, NOW + 30 * DAY), &[&k.targets]);
    let t3 = SignedMetadata::sign(&targets(3, NOW + 30 * DAY), &[&k.targets]);
    v.update_timestamp(&ts(2, NOW + DAY, &t2, &k.ts), NOW).unwrap();
    assert!(matches!(v.update_targets(&t3, NOW), Err(TufError::TargetsMismatchTimestamp { .. })));
    // Same length, different bytes.
    let mut same_len = t2.clone();
    same_len.signed = same_len.signed.replace("0.981", "0.982");
    assert!(matches!(v.update_targets(&same_len, NOW), Err(TufError::TargetsMismatchTimestamp { .. })));
    v.update_targets(&t2, NOW).unwrap();
    // Targets before any timestamp.
    let (k, _) = setup();
    let mut fresh = Verifier::new(SignedMetadata::sign(&root_v1(&k), &[&k.root])).unwrap();
    assert_eq!(fresh.update_targets(&t2, NOW), Err(TufError::Missing { role: Role::Timestamp }));
}

#[test]
fn attack_artifact_length_mismatch() {
    let (_, v) = setup();
    let mut endless = MODEL.to_vec();
    endless.extend_from_slice(&[0; 1000]);
    assert_eq!(
        v.verify_artifact("mnist", ModelVersion(1), &endless, NOW),
        Err(TufError::LengthMismatch { expected: MODEL.len() as u64, got: endless.len() as u64 })
    );
    assert_eq!(v.target("mnist", ModelVersion(1), NOW).unwrap().length, MODEL.len() as u64);
}

#[test]
fn attack_artifact_digest_mismatch() {
    let (_, v) = setup();
    let mut evil = MODEL.to_vec();
    evil[0] ^= 0x20;
    assert_eq!(
        v.verify_artifact("mnist", ModelVersion(1), &evil, NOW),
        Err(TufError::DigestMismatch { expected: Digest::of(MODEL), got: Digest::of(&evil) })
    );
    assert_eq!(
        v.verify_artifact("mnist", ModelVersion(9), MODEL, NOW),
        Err(TufError::UnknownTarget { name: "mnist".into(), version: ModelVersion(9) })
    );
}

#[test]
fn invalid_roots_are_refused() {
    let k = keys();
    let mut r = root_v1(&k);
    r.targets.threshold = 0;
    assert!(matches!(Verifier::new(SignedMetadata::sign(&r, &[&k.root])), Err(TufError::InvalidRoot(_))));
    let mut r = root_v1(&k);
    r.timestamp.threshold = 2;
    assert!(matches!(Verifier::new(SignedMetadata::sign(&r, &[&k.root])), Err(TufError::InvalidRoot(_))));
    let mut r = root_v1(&k);
    let id = KeyId::of(&k.ts.verifying_key());
    r.keys.get_mut(&id).unwrap().public = k.targets.verifying_key().to_bytes();
    assert!(matches!(Verifier::new(SignedMetadata::sign(&r, &[&k.root])), Err(TufError::InvalidRoot(_))));
}

#[test]
fn timestamp_key_rotation_resets_the_timestamp_floor() {
    let (k, mut v) = setup();
    let t1 = SignedMetadata::sign(&targets(1, NOW + 30 * DAY), &[&k.targets]);
    v.update_timestamp(&ts(50, NOW + DAY, &t1, &k.ts), NOW).unwrap();
    let new_ts = key(9);
    let r2 =
        Root::new(2, NOW + 365 * DAY, (&[&k.root.verifying_key()], 1), (&[&k.targets.verifying_key()], 1), (&[&new_ts.verifying_key()], 1));
    v.update_root(&SignedMetadata::sign(&r2, &[&k.root])).unwrap();
    assert!(v.timestamp().is_none());
    // The old online key is dead; the new one may restart at a low version (TUF's recovery from
    // a fast-forward attack), but targets may still not roll back.
    assert!(matches!(
        v.update_timestamp(&ts(51, NOW + DAY, &t1, &k.ts), NOW),
        Err(TufError::UnderThreshold { role: Role::Timestamp, valid: 0, threshold: 1 })
    ));
    v.update_timestamp(&ts(1, NOW + DAY, &t1, &new_ts), NOW).unwrap();
    v.update_targets(&t1, NOW).unwrap();
    v.verify_artifact("mnist", ModelVersion(1), MODEL, NOW).unwrap();
}
