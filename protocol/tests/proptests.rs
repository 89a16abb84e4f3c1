//! Property tests: every encoding round-trips, and no decoder panics on any input.

use ed25519_dalek::SigningKey;
use fedfleet_protocol::envelope::Signable;
use fedfleet_protocol::*;
use proptest::prelude::*;
use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn id_string() -> impl Strategy<Value = String> {
    "[A-Za-z0-9._-]{1,64}"
}

fn dtype() -> impl Strategy<Value = DType> {
    prop::sample::select(DType::ALL.to_vec())
}

fn digest() -> impl Strategy<Value = Digest> {
    any::<[u8; 32]>().prop_map(Digest)
}

fn update_header() -> impl Strategy<Value = UpdateHeader> {
    (id_string(), id_string(), any::<u64>(), digest(), any::<[u8; 16]>(), any::<u64>(), any::<u64>(), digest(), dtype()).prop_map(
        |(device, fleet, round, base_model, nonce, sample_count, payload_len, payload_digest, payload_dtype)| UpdateHeader {
            device: DeviceId::new(device).unwrap(),
            fleet: FleetId::new(fleet).unwrap(),
            round: RoundId(round),
            base_model,
            nonce,
            sample_count,
            payload_len,
            payload_digest,
            payload_dtype,
        },
    )
}

fn model_ref() -> impl Strategy<Value = ModelRef> {
    (".{0,20}", any::<u64>(), digest()).prop_map(|(name, v, digest)| ModelRef { name, version: ModelVersion(v), digest })
}

fn message() -> impl Strategy<Value = Message> {
    let receipt = (id_string(), id_string(), any::<u64>(), any::<[u8; 16]>(), digest(), any::<u64>()).prop_map(
        |(fleet, device, round, nonce, payload_digest, at)| {
            Message::Receipt(Receipt {
                fleet: FleetId::new(fleet).unwrap(),
                device: DeviceId::new(device).unwrap(),
                round: RoundId(round),
                nonce,
                payload_digest,
                accepted_at_unix_ms: at,
            })
        },
    );
    let rejection = (prop::sample::select(RejectReason::ALL.to_vec()), ".{0,40}")
        .prop_map(|(reason, detail)| Message::Rejection(Rejection { reason, detail }));
    let selection = prop_oneof![
        Just(Selection::All),
        prop::collection::vec(id_string(), 0..5)
            .prop_map(|ids| Selection::Devices(ids.into_iter().map(|s| DeviceId::new(s).unwrap()).collect())),
        (any::<u32>(), any::<u64>()).prop_map(|(rate_ppm, seed)| Selection::Sample { rate_ppm, seed }),
    ];
    let round = (
        id_string(),
        any::<u64>(),
        model_ref(),
        (any::<u32>(), any::<u32>(), -1e3f32..1e3, "[a-z]{0,8}", 0f32..1.0, dtype(), any::<u64>(), any::<Option<u64>>()),
        any::<u64>(),
        selection,
    )
        .prop_map(|(fleet, round, base_model, c, deadline, selection)| {
            Message::RoundAnnouncement(RoundAnnouncement {
                fleet: FleetId::new(fleet).unwrap(),
                round: RoundId(round),
                base_model,
                config: RoundConfig {
                    local_epochs: c.0,
                    batch_size: c.1,
                    learning_rate: c.2,
                    optimizer: c.3,
                    proximal_mu: c.4,
                    quantization: c.5,
                    min_samples: c.6,
                    max_samples: c.7,
                    seed: c.6 ^ 0x5555,
                    secure_aggregation: c.6 % 2 == 1,
                    start_window_ms: deadline % 100_000,
                    device_privacy: None,
                },
                deadline_unix_ms: deadline,
                selection,
            })
        });
    let state = prop_oneof![
        Just(DeviceState::Idle),
        any::<u64>().prop_map(|r| DeviceState::Training { round: RoundId(r) }),
        Just(DeviceState::Active),
        ".{0,20}".prop_map(|reason| DeviceState::RolledBack { reason }),
        ".{0,20}".prop_map(|reason| DeviceState::Failed { reason }),
        ".{0,20}".prop_map(|detail| DeviceState::InstallDeferred { fault: StorageFault::DiskFull, detail }),
    ];
    let status = (id_string(), id_string(), any::<u64>(), state, prop::option::of(model_ref()), any::<Option<u64>>()).prop_map(
        |(fleet, device, at, state, active, rollout_id)| {
            Message::Status(DeviceStatus {
                fleet: FleetId::new(fleet).unwrap(),
                device: DeviceId::new(device).unwrap(),
                reported_at_unix_ms: at,
                state,
                staged: active.clone(),
                active,
                rollout_id,
            })
        },
    );
    prop_oneof![receipt, rejection, round, status]
}

fn tensor() -> impl Strategy<Value = Tensor> {
    (prop::collection::vec(0usize..5, 0..4), dtype()).prop_flat_map(|(shape, dtype)| {
        let len = shape.iter().product::<usize>();
        prop::collection::vec(-1e4f32..1e4, len).prop_map(move |values| {
            let f32_tensor = Tensor { shape: shape.clone(), data: TensorData::F32(values) };
            f32_tensor.quantize(dtype)
        })
    })
}

fn bundle() -> impl Strategy<Value = TensorBundle> {
    prop::collection::btree_map("[a-z][a-z0-9._]{0,12}", tensor(), 0..6).prop_map(|tensors| {
        let mut bundle = TensorBundle::new();
        for (name, tensor) in tensors {
            bundle.insert(name, tensor).unwrap();
        }
        bundle
    })
}

fn frame_kind() -> impl Strategy<Value = FrameKind> {
    prop::sample::select(FrameKind::ALL.to_vec())
}

proptest! {
    #[test]
    fn update_header_round_trips(header in update_header(), seed in any::<u8>()) {
        let canonical = header.canonical_bytes();
        prop_assert_eq!(UpdateHeader::from_canonical_bytes(&canonical).unwrap(), header.clone());
        let key = SigningKey::from_bytes(&[seed; 32]);
        let signed = SignedUpdate::sign(header, &key);
        let decoded = SignedUpdate::decode(&signed.encode()).unwrap();
        prop_assert!(decoded.verify(&key.verifying_key()).is_ok());
        prop_assert_eq!(decoded, signed);
    }

    #[test]
    fn messages_round_trip(message in message()) {
        let bytes = message.encode().unwrap();
        prop_assert_eq!(Message::decode(&bytes).unwrap(), message);
    }

    #[test]
    fn bundles_round_trip(bundle in bundle()) {
        let bytes = bundle.encode();
        let decoded = TensorBundle::decode(&bytes, &BundleLimits::default()).unwrap();
        prop_assert_eq!(&decoded, &bundle);
        prop_assert_eq!(decoded.layout(), bundle.layout());
        prop_assert_eq!(decoded.num_params(), bundle.num_params());
    }

    #[test]
    fn frames_round_trip(
        frames in prop::collection::vec((frame_kind(), prop::collection::vec(any::<u8>(), 0..300)), 0..8),
        split in 1usize..64,
    ) {
        let frames: Vec<Frame> = frames
            .into_iter()
            .map(|(kind, body)| Frame { kind, body: if kind == FrameKind::End { Vec::new() } else { body } })
            .collect();
        let wire: Vec<u8> = frames.iter().flat_map(|f| encode_frame(f.kind, &f.body).unwrap()).collect();
        let mut decoder = FrameDecoder::new();
        let mut out = Vec::new();
        for chunk in wire.chunks(split) {
            decoder.push(chunk);
            while let Some(frame) = decoder.poll().unwrap() {
                out.push(frame);
            }
        }
        prop_assert!(decoder.finish().is_ok());
        prop_assert_eq!(out, frames);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(10_000))]

    /// 10 000 arbitrary byte strings through every decoder: errors are fine, panics are not.
    #[test]
    fn no_decoder_panics_on_random_bytes(bytes in prop::collection::vec(any::<u8>(), 0..600)) {
        feed_every_decoder(&bytes);
    }
}

/// Mutations of valid encodings reach deeper than random bytes: 10 000 per seed corpus entry kind.
#[test]
fn no_decoder_panics_on_mutated_encodings() {
    let key = SigningKey::from_bytes(&[1; 32]);
    let mut corpus: Vec<Vec<u8>> = Vec::new();
    let header = UpdateHeader {
        device: DeviceId::new("cam-1").unwrap(),
        fleet: FleetId::new("eu").unwrap(),
        round: RoundId(3),
        base_model: Digest::of(b"base"),
        nonce: [7; 16],
        sample_count: 10,
        payload_len: 4,
        payload_digest: Digest::of(b"load"),
        payload_dtype: DType::BF16,
    };
    corpus.push(SignedUpdate::sign(header.clone(), &key).encode());
    corpus.push(header.canonical_bytes());
    let mut bundle = TensorBundle::new();
    bundle.insert_f32("w", vec![2, 3], vec![1.0, -2.0, 3.0, 0.5, 0.25, -0.125]).unwrap();
    bundle.insert_f32("b", vec![3], vec![0.1, 0.2, 0.3]).unwrap();
    for dtype in DType::ALL {
        corpus.push(bundle.quantize(dtype).encode());
    }
    let status = Message::Status(DeviceStatus {
        fleet: FleetId::new("eu").unwrap(),
        device: DeviceId::new("cam-1").unwrap(),
        reported_at_unix_ms: 1,
        state: DeviceState::Failed { reason: "x".into() },
        active: None,
        staged: None,
        rollout_id: Some(2),
    });
    corpus.push(status.encode().unwrap());
    let Message::Status(status) = status else { unreachable!() };
    corpus.push(Signed::sign(status, &key).encode());
    corpus.push(encode_frame(FrameKind::Signed, &corpus[0]).unwrap());

    let mut rng = ChaCha8Rng::seed_from_u64(0x5eed_f1ee_7000_0001);
    let mut decoded_bundles = 0;
    for original in &corpus {
        for _ in 0..10_000 {
            let mut bytes = original.clone();
            for _ in 0..=rng.gen_range(0..4) {
                mutate(&mut bytes, &mut rng);
            }
            // Keep safetensors' header length consistent half the time, to get past it.
            if bytes.len() >= 8 && rng.gen_range(0..2) == 0 && original.len() >= 8 && original[..8] != bytes[..8] {
                let json_len = (bytes.len() as u64 - 8).min(u64::from_le_bytes(original[..8].try_into().unwrap()));
                bytes[..8].copy_from_slice(&json_len.to_le_bytes());
            }
            decoded_bundles += usize::from(feed_every_decoder(&bytes));
        }
    }
    // Some mutants must still parse, or the mutations never got past the first check.
    eprintln!("mutated bundles that still decoded: {decoded_bundles}");
    assert!(decoded_bundles > 100, "{decoded_bundles}");
}

/// Returns whether the bytes decoded as a bundle.
fn feed_every_decoder(bytes: &[u8]) -> bool {
    if let Ok(signed) = SignedUpdate::decode(bytes) {
        assert_eq!(signed.encode(), bytes, "the envelope encoding is canonical");
    }
    let _ = SignedRelay::decode(bytes);
    let _ = Signed::<Receipt>::decode(bytes);
    let _ = Signed::<RoundAnnouncement>::decode(bytes);
    let _ = Signed::<DeviceStatus>::decode(bytes);
    let _ = UpdateHeader::from_canonical_bytes(bytes);
    let _ = Message::decode(bytes);
    let limits = BundleLimits { max_bytes: 1 << 20, max_tensors: 64, max_params: 1 << 20 };
    let bundle = TensorBundle::decode(bytes, &limits);
    if let Ok(bundle) = &bundle {
        // Whatever decodes must re-encode and decode to itself.
        let again = TensorBundle::decode(&bundle.encode(), &limits).unwrap();
        assert_eq!(again.layout(), bundle.layout());
        let _ = bundle.check_finite();
        let _ = bundle.dequantize();
    }
    let mut decoder = FrameDecoder::new();
    for chunk in bytes.chunks(7) {
        decoder.push(chunk);
        while let Ok(Some(_)) = decoder.poll() {}
    }
    let _ = decoder.finish();
    bundle.is_ok()
}

fn mutate(bytes: &mut Vec<u8>, rng: &mut ChaCha8Rng) {
    if bytes.is_empty() {
        bytes.push(rng.next_u64() as u8);
        return;
    }
    let at = rng.gen_range(0..bytes.len());
    match rng.gen_range(0..6) {
        0 => bytes[at] ^= 1 << rng.gen_range(0..8),
        1 => bytes[at] = rng.next_u64() as u8,
        2 => bytes.truncate(at),
        3 => bytes.insert(at, rng.next_u64() as u8),
        4 => {
            bytes.remove(at);
        }
        _ => {
            // Interesting values: digits and JSON punctuation for the safetensors header.
            const INTERESTING: &[u8] = b"0123456789{}[]\",:-eE.\xff\x00";
            bytes[at] = INTERESTING[rng.gen_range(0..INTERESTING.len())];
        }
    }
}
