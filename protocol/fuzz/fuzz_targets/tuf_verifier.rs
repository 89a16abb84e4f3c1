#![no_main]

//! The TUF client state machine. The harness holds the fleet's keys and signs whatever body text
//! the fuzzer writes, so inputs get past the signature checks into the version, expiry, rotation,
//! timestamp/targets binding and artifact rules.
//!
//! Input: a sequence of operations, each
//! `op u8 | signers u8 | version u8 | len u16 BE | len bytes of body text (lossy UTF-8)`.
//! `op & 7` picks the update (root, timestamp, targets, targets with a matching timestamp,
//! artifact); `op >> 3` is the clock, in steps of 1000 ms. Each set bit of `signers` signs with
//! one of the harness keys (0: root, 1: targets, 2: timestamp, 3..: spare keys for rotation).

use std::sync::LazyLock;

use ed25519_dalek::SigningKey;
use fedfleet_protocol::tuf::{Root, SignedMetadata, Targets, Timestamp, Verifier};
use fedfleet_protocol::{Digest, ModelVersion};
use libfuzzer_sys::fuzz_target;

const EXPIRES: u64 = 20_000;
const MAX_OPS: usize = 6;

static KEYS: LazyLock<Vec<SigningKey>> = LazyLock::new(|| {
    (1..=5u8)
        .map(|i| SigningKey::from_bytes(&[i; 32]))
        .collect()
});

struct Fixture {
    verifier: Verifier,
    root: SignedMetadata<Root>,
    targets: SignedMetadata<Targets>,
    timestamp: SignedMetadata<Timestamp>,
}

static FIXTURE: LazyLock<Fixture> = LazyLock::new(|| {
    let k = &*KEYS;
    let vk = |i: usize| k[i].verifying_key();
    let root = Root::new(1, EXPIRES, (&[&vk(0)], 1), (&[&vk(1)], 1), (&[&vk(2)], 1));
    let root = SignedMetadata::sign(&root, &[&k[0]]);
    let verifier = Verifier::new(root.clone()).expect("the fixture root is valid");
    let targets = SignedMetadata::new(&Targets {
        version: 1,
        expires: EXPIRES,
        targets: Vec::new(),
    });
    let timestamp = SignedMetadata::new(
        &Timestamp::for_targets(1, EXPIRES, &targets).expect("fixture targets parse"),
    );
    Fixture {
        verifier,
        root,
        targets,
        timestamp,
    }
});

/// `template` with its text replaced by `text` and signed by the keys `signers` selects.
fn signed<T: fedfleet_protocol::tuf::Metadata + Clone>(
    template: &SignedMetadata<T>,
    text: String,
    signers: u8,
) -> SignedMetadata<T> {
    let mut s = template.clone();
    s.signed = text;
    s.signatures.clear();
    for (i, key) in KEYS.iter().enumerate() {
        if signers & (1 << i) != 0 {
            s.add_signature(key);
        }
    }
    s
}

fuzz_target!(|data: &[u8]| {
    let fx = &*FIXTURE;
    let mut verifier = fx.verifier.clone();
    let mut rest = data;
    for _ in 0..MAX_OPS {
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
                let _ = verifier.update_root(&signed(&fx.root, text, signers));
            }
            1 => {
                let _ = verifier.update_timestamp(&signed(&fx.timestamp, text, signers), now);
            }
            2 => {
                let _ = verifier.update_targets(&signed(&fx.targets, text, signers), now);
            }
            3 => {
                // Targets with a timestamp that names them, so the targets rules are reachable.
                let targets = signed(&fx.targets, text, signers);
                if let Ok(ts) = Timestamp::for_targets(u64::from(version), EXPIRES, &targets) {
                    let ts_text = serde_json::to_string(&ts).expect("timestamp serializes");
                    let ts = signed(&fx.timestamp, ts_text, 1 << 2);
                    if verifier.update_timestamp(&ts, now).is_ok() {
                        let _ = verifier.update_targets(&targets, now);
                    }
                }
            }
            _ => {
                let version = ModelVersion(u64::from(version));
                let _ = verifier.verify_artifact("m", version, body, now);
                let _ = verifier.verify_artifact_digest(
                    "m",
                    version,
                    body.len() as u64,
                    Digest::of(body),
                    now,
                );
            }
        }
        // The state an agent persists must round-trip through JSON.
        if op & 0x80 != 0 {
            let json = serde_json::to_vec(&verifier).expect("verifier serializes");
            verifier = serde_json::from_slice(&json).expect("persisted verifier reads back");
        }
        let _ = (verifier.root(), verifier.timestamp(), verifier.targets());
    }
});
