//! Asynchronous mode (FedBuff) of the round engine: stale updates folded into the open buffer
//! with their discount, the staleness bound, the window while a buffer publishes, and a restart
//! from the buffer boundary plus records that is the engine that ran on.

use fedfleet_protocol::{Digest, ModelVersion, RoundId};
use fedfleet_rounds::*;

use crate::engine::{MIN, T0, dev, fleet};
fn version(v: u64) -> Digest {
    Digest::of(format!("model v{v}").as_bytes())
}

/// An async campaign over `devices` explicit devices: buffers of `k`, staleness bound `s`.
fn buffered(devices: usize, k: u32, s: u32) -> (RoundEngine, OpenedRound) {
    let spec = CampaignSpec {
        id: CampaignId(1),
        rounds: 10,
        base_version: ModelVersion(1),
        base_digest: version(1),
        client: ClientConfig::default(),
        selection: Invitation::Explicit { devices: (0..devices).map(dev).collect() },
        policy: RoundPolicy {
            target_count: k,
            min_quorum: 1,
            over_selection: 1.0,
            duration_ms: 10 * MIN,
            extension_ms: 0,
            max_sample_count: 1_000,
        },
        seed: [3; 32],
        max_consecutive_failures: 3,
        buffer: Some(BufferPolicy { max_staleness: s }),
        privacy: None,
    };
    let mut e = RoundEngine::new(fleet(), EngineConfig::default(), RoundId(1));
    e.start_campaign(T0, spec).unwrap();
    let Some(EngineEvent::RoundOpened(a)) = e.poll_event() else { panic!("buffer must open") };
    (e, a)
}

/// Device `d`'s update trained for buffer `round` on model version `v`, with 100 samples.
fn update(d: usize, round: RoundId, v: u64) -> UpdateMeta {
    let mut nonce = [0u8; 16];
    nonce[..8].copy_from_slice(&(d as u64).to_le_bytes());
    nonce[8..].copy_from_slice(&round.0.to_le_bytes());
    UpdateMeta {
        fleet: fleet(),
        device: dev(d),
        round,
        base_digest: version(v),
        nonce: Nonce(nonce),
        num_examples: 100,
        payload_digest: Digest::of(&[d as u8, round.0 as u8]),
    }
}

fn reason(r: Result<Accepted, Reject>) -> RejectReason {
    r.expect_err("must be refused").reason
}

/// Publishes the closed buffer as version `v` and returns the next buffer's announcement.
fn publish(e: &mut RoundEngine, now: Millis, v: u64) -> OpenedRound {
    let round = e.awaiting_model().expect("a closed buffer");
    e.model_ready(now, round, ModelVersion(v), version(v)).unwrap();
    loop {
        match e.poll_event().expect("the next buffer opens") {
            EngineEvent::RoundOpened(a) => return a,
            _ => continue,
        }
    }
}

#[test]
fn the_staleness_discount_is_one_over_the_root_of_one_plus_staleness_on_the_integer_grid() {
    assert_eq!(staleness_weight(100, 0), 100);
    assert_eq!(staleness_weight(100, 3), 50, "1/√4 = 0.5 exactly");
    assert_eq!(staleness_weight(1_000, 8), 333, "1/√9 = 0.333333 in ppm, rounded down");
    assert_eq!(staleness_weight(1_000, 1), 707, "1/√2 = 0.707107 in ppm");
    assert_eq!(staleness_weight(1, 1_000), 1, "never below 1");
    // The largest weight times the factor stays exact in u64.
    assert_eq!(staleness_weight(1 << 24, 1), ((1u128 << 24) * 707_107 / 1_000_000) as u64);
}

#[test]
fn a_stale_update_joins_the_open_buffer_discounted_and_one_past_the_bound_is_too_stale() {
    let (mut e, b1) = buffered(8, 2, 1);
    e.handle_update(T0 + 1, update(0, b1.round, 1)).unwrap();
    let closing = e.handle_update(T0 + 2, update(1, b1.round, 1)).unwrap();
    assert!(closing.closed_round);
    // While the closed buffer publishes, updates are asked to come back, not dropped as stale.
    assert_eq!(reason(e.check_update(T0 + 3, &update(2, b1.round, 1))), RejectReason::Overloaded);
    let b2 = publish(&mut e, T0 + 4, 2);
    assert_eq!(b2.base_digest, version(2));

    // Device 2 trained on version 1 for buffer 1: one version behind, folded into buffer 2.
    let stale = e.handle_update(T0 + 5, update(2, b1.round, 1)).unwrap();
    assert_eq!((stale.round, stale.weight), (b2.round, staleness_weight(100, 1)));
    // It must name buffer 1's base model.
    assert_eq!(reason(e.check_update(T0 + 6, &update(3, b1.round, 2))), RejectReason::WrongBaseModel);
    assert_eq!(reason(e.check_update(T0 + 6, &update(3, b2.round, 1))), RejectReason::WrongBaseModel);
    // One update per device per buffer.
    assert_eq!(reason(e.check_update(T0 + 6, &update(2, b2.round, 2))), RejectReason::Duplicate);
    let fresh = e.handle_update(T0 + 7, update(3, b2.round, 2)).unwrap();
    assert_eq!(fresh.weight, 100);
    assert!(fresh.closed_round);
    let Some(EngineEvent::RoundClosed { round, contributions, .. }) = e.poll_event() else { panic!("buffer 2 closes") };
    assert_eq!(round, b2.round);
    let weights: Vec<_> = contributions.iter().map(|c| (c.device.clone(), c.weight)).collect();
    assert_eq!(weights, vec![(dev(2), 70), (dev(3), 100)]);

    let b3 = publish(&mut e, T0 + 8, 3);
    // Buffer 1's base is now two versions behind: past the bound of 1.
    assert_eq!(reason(e.check_update(T0 + 9, &update(4, b1.round, 1))), RejectReason::TooStale);
    // Buffer 2's base is one behind: still in.
    assert_eq!(e.check_update(T0 + 9, &update(4, b2.round, 2)).unwrap().weight, 70);
    // A buffer not yet announced, and a round before the campaign.
    assert_eq!(reason(e.check_update(T0 + 9, &update(4, RoundId(b3.round.0 + 1), 3))), RejectReason::UnknownRound);
    assert_eq!(reason(e.check_update(T0 + 9, &update(4, RoundId(0), 1))), RejectReason::StaleRound);
    // Replays are refused whichever buffer took the original.
    assert_eq!(reason(e.check_update(T0 + 9, &update(2, b1.round, 1))), RejectReason::Replay);
}

#[test]
fn a_replayed_stale_update_is_refused_past_the_engines_nonce_window() {
    // The engine keeps nonces for one round only, but an async campaign keeps those of every
    // buffer whose base it still admits updates for.
    let spec = CampaignSpec {
        id: CampaignId(2),
        rounds: 10,
        base_version: ModelVersion(1),
        base_digest: version(1),
        client: ClientConfig::default(),
        selection: Invitation::Rate { rate: 1.0 },
        policy: RoundPolicy { target_count: 1, min_quorum: 1, ..RoundPolicy::default() },
        seed: [0; 32],
        max_consecutive_failures: 1,
        buffer: Some(BufferPolicy { max_staleness: 3 }),
        privacy: None,
    };
    let mut e = RoundEngine::new(fleet(), EngineConfig { nonce_retention_rounds: 1 }, RoundId(1));
    e.start_campaign(T0, spec).unwrap();
    e.handle_update(T0 + 1, update(0, RoundId(1), 1)).unwrap(); // closes buffer 1
    publish(&mut e, T0 + 2, 2);
    // Device 1's update for buffer 1 lands in buffer 2; buffers 3 and 4 follow.
    assert_eq!(e.handle_update(T0 + 3, update(1, RoundId(1), 1)).unwrap().round, RoundId(2));
    publish(&mut e, T0 + 4, 3);
    e.handle_update(T0 + 5, update(2, RoundId(3), 3)).unwrap();
    publish(&mut e, T0 + 6, 4);
    // Buffer 1's base is 3 versions behind: still admitted, so both replays must be caught.
    assert_eq!(reason(e.check_update(T0 + 7, &update(1, RoundId(1), 1))), RejectReason::Replay);
    assert_eq!(reason(e.check_update(T0 + 7, &update(0, RoundId(1), 1))), RejectReason::Replay);
    assert_eq!(e.handle_update(T0 + 7, update(3, RoundId(1), 1)).unwrap().staleness, 3);
    publish(&mut e, T0 + 8, 5);
    // Now 4 behind: refused for its staleness, whatever became of its nonce.
    assert_eq!(reason(e.check_update(T0 + 9, &update(4, RoundId(1), 1))), RejectReason::TooStale);
}

#[test]
fn a_buffer_boundary_snapshot_plus_readmitted_records_is_the_engine_that_ran_on() {
    // As in rounds mode: the shell snapshots at buffer boundaries and re-admits the open
    // buffer's records, which carry the discounted weight they were folded with.
    let (mut e, b1) = buffered(6, 3, 2);
    for d in 0..3 {
        e.handle_update(T0 + d as u64, update(d, b1.round, 1)).unwrap();
    }
    let b2 = publish(&mut e, T0 + 10, 2);
    let at_open = e.to_bytes();
    let mut records = Vec::new();
    for (d, round, v) in [(3, b1.round, 1), (4, b2.round, 2)] {
        let m = update(d, round, v);
        let acc = e.handle_update(T0 + 20 + d as u64, m.clone()).unwrap();
        records.push(Contribution {
            device: m.device,
            nonce: m.nonce,
            num_examples: acc.weight,
            weight: acc.weight,
            payload_digest: m.payload_digest,
            accepted_at: T0 + 20 + d as u64,
            updates: 1,
        });
    }
    assert_eq!(records[0].weight, 70);
    let mut restored = RoundEngine::from_bytes(&at_open).unwrap();
    while restored.poll_event().is_some() {}
    while e.poll_event().is_some() {}
    for r in &records {
        assert!(restored.readmit(b2.round, r.clone()).unwrap());
    }
    assert_eq!(restored.round_status(), e.round_status());
    // Both go on alike: the third update closes buffer 2 with the same weights (the shell's
    // record keeps the weight, not the claimed sample count, and folds with the weight).
    let last = update(5, b1.round, 1);
    assert_eq!(restored.handle_update(T0 + 30, last.clone()), e.handle_update(T0 + 30, last));
    let weights = |ev: Option<EngineEvent>| match ev {
        Some(EngineEvent::RoundClosed { round, contributions, .. }) => {
            (round, contributions.into_iter().map(|c| (c.device, c.nonce, c.weight, c.payload_digest)).collect::<Vec<_>>())
        }
        other => panic!("buffer 2 must close, got {other:?}"),
    };
    let (closed, restored_weights) = weights(restored.poll_event());
    assert_eq!((closed, restored_weights.len()), (b2.round, 3));
    assert_eq!(restored_weights, weights(e.poll_event()).1);
}
