//! Relays in the core: a relay's engine follows its parent's round, and the parent merges the
//! relays' partial sums into exactly the round a flat fleet would have folded.

use fedfleet_protocol::{DeviceId, Digest, FleetId, ModelVersion, RoundId, Selection};
use fedfleet_rounds::strategy::fixed::PartialSum;
use fedfleet_rounds::*;

const T0: Millis = 1_700_000_000_000;
const DIM: usize = 257;

fn fleet() -> FleetId {
    FleetId::new("fleet-a").unwrap()
}
fn dev(i: usize) -> DeviceId {
    DeviceId::new(format!("dev-{i:02}")).unwrap()
}
fn relay_id(r: usize) -> DeviceId {
    DeviceId::new(format!("relay-{r}")).unwrap()
}
fn base() -> Digest {
    Digest::of(b"model v1")
}
fn fedavg() -> ServerStrategy {
    ServerStrategy::new(&StrategyConfig::FedAvg { client: ClientConfig::default() }, DIM).unwrap()
}
/// Device `i`'s delta: values of every magnitude, so rounding would show.
fn delta(i: usize) -> Vec<f32> {
    (0..DIM).map(|j| ((i * 131 + j * 17) % 97) as f32 * 1e-3 - 0.047 + (j as f32).sin() * 1e-7 * i as f32).collect()
}
fn update(i: usize, round: RoundId) -> UpdateMeta {
    UpdateMeta {
        fleet: fleet(),
        device: dev(i),
        round,
        base_digest: base(),
        nonce: Nonce([i as u8; 16]),
        num_examples: 10 + 7 * i as u64,
        payload_digest: Digest::of(&i.to_le_bytes()),
    }
}

fn root(target: u32) -> (Coordinator<ServerStrategy>, OpenedRound) {
    let spec = campaign(target, None);
    let mut engine = RoundEngine::new(fleet(), EngineConfig::default(), RoundId(1));
    engine.start_campaign(T0, spec).unwrap();
    let Some(EngineEvent::RoundOpened(opened)) = engine.poll_event() else { panic!("round must open") };
    (Coordinator::new(engine, fedavg()), opened)
}

/// A FedAvg campaign whose rounds (or buffers) close at `target` updates.
fn campaign(target: u32, buffer: Option<BufferPolicy>) -> CampaignSpec {
    CampaignSpec {
        id: CampaignId(1),
        rounds: 2,
        base_version: ModelVersion(1),
        base_digest: base(),
        client: ClientConfig::default(),
        selection: Invitation::Rate { rate: 1.0 },
        policy: RoundPolicy {
            target_count: target,
            min_quorum: 1,
            over_selection: 1.0,
            duration_ms: 600_000,
            extension_ms: 0,
            max_sample_count: 1000,
        },
        seed: [3; 32],
        max_consecutive_failures: 3,
        buffer,
        privacy: None,
    }
}

fn follower(opened: &OpenedRound, expected: u32) -> Coordinator<ServerStrategy> {
    let mut engine = RoundEngine::new(fleet(), EngineConfig::default(), RoundId(1));
    engine
        .follow_round(
            T0 + 5,
            FollowedRound {
                round: opened.round,
                base_version: opened.base_version,
                base_digest: opened.base_digest,
                client: ClientConfig::default(),
                selection: opened.selection.clone(),
                deadline: opened.deadline - 10_000,
                expected,
                max_sample_count: opened.max_sample_count,
            },
        )
        .unwrap();
    let Some(EngineEvent::RoundOpened(mine)) = engine.poll_event() else { panic!("followed round must open") };
    assert_eq!((mine.round, mine.deadline, &mine.selection), (opened.round, opened.deadline - 10_000, &opened.selection));
    Coordinator::new(engine, fedavg())
}

fn relay_meta(r: usize, round: RoundId, sum: &PartialSum) -> RelayMeta {
    RelayMeta {
        fleet: fleet(),
        relay: relay_id(r),
        round,
        base_digest: base(),
        nonce: Nonce([100 + r as u8; 16]),
        update_count: sum.count(),
        total_weight: sum.total_weight(),
        payload_digest: Digest::of(&sum.to_le_bytes()),
    }
}

fn global() -> Vec<f32> {
    (0..DIM).map(|j| j as f32 * 0.01).collect()
}

#[test]
fn a_tree_of_relays_folds_the_flat_round_bit_for_bit() {
    let (mut flat, opened) = root(9);
    for i in 0..9 {
        flat.handle_update(T0 + 10 + i as u64, update(i, opened.round), &delta(i)).unwrap();
    }
    let flat_model = flat.finalize(T0 + 100, opened.round, &global()).unwrap();

    let (mut tree, opened) = root(9);
    for r in 0..3 {
        let mut relay = follower(&opened, 3);
        // Each region's devices in a different order: integer sums do not care.
        for i in [3 * r + 2, 3 * r, 3 * r + 1] {
            relay.handle_update(T0 + 20 + i as u64, update(i, opened.round), &delta(i)).unwrap();
        }
        assert!(
            matches!(relay.poll_event(), Some(EngineEvent::RoundClosed { cause: CloseCause::TargetReached, .. })),
            "a relay's round closes when every invited device of its region sent"
        );
        let sum = relay.strategy().partial_sum().unwrap().clone();
        // On the wire and back, as the parent receives it.
        let sum = PartialSum::from_le_bytes(&sum.to_le_bytes(), DIM, sum.total_weight(), sum.count()).unwrap();
        let meta = relay_meta(r, opened.round, &sum);
        let accepted = tree.handle_relay(T0 + 50, meta.clone(), &sum).unwrap();
        assert_eq!((accepted.accepted, accepted.closed_round), (3 * (r as u32 + 1), r == 2));
        if r == 0 {
            // A second sum of the same relay, a replayed one, one on another base: refused.
            assert_eq!(tree.handle_relay(T0 + 51, meta.clone(), &sum).unwrap_err().reason, RejectReason::Replay);
            let again = RelayMeta { nonce: Nonce([7; 16]), ..meta.clone() };
            assert_eq!(tree.handle_relay(T0 + 51, again, &sum).unwrap_err().reason, RejectReason::Duplicate);
            let other = RelayMeta { relay: relay_id(9), base_digest: Digest::of(b"v0"), ..meta.clone() };
            assert_eq!(tree.handle_relay(T0 + 51, other, &sum).unwrap_err().reason, RejectReason::WrongBaseModel);
            let lying = RelayMeta { relay: relay_id(9), update_count: 2, ..meta };
            assert_eq!(tree.handle_relay(T0 + 51, lying, &sum).unwrap_err().reason, RejectReason::Malformed);
            // The engine's snapshot counts the relay's three updates after a restart.
            let restored = RoundEngine::from_bytes(&tree.engine().to_bytes()).unwrap();
            assert_eq!(restored.round_status().unwrap().accepted, 3);
        }
    }
    let tree_model = tree.finalize(T0 + 100, opened.round, &global()).unwrap();
    assert_eq!(tree_model.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), flat_model.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
}

#[test]
fn a_followed_round_is_one_round_campaign() {
    let (_, opened) = root(9);
    let mut relay = follower(&opened, 2);
    // The region's devices are admitted exactly as at the root: a duplicate, a replay, a wrong
    // round are refused by name.
    relay.handle_update(T0 + 20, update(1, opened.round), &delta(1)).unwrap();
    assert_eq!(relay.handle_update(T0 + 21, update(1, opened.round), &delta(1)).unwrap_err().reason, RejectReason::Replay);
    let other_round = UpdateMeta { nonce: Nonce([9; 16]), ..update(2, RoundId(opened.round.0 + 1)) };
    assert_eq!(relay.handle_update(T0 + 21, other_round, &delta(2)).unwrap_err().reason, RejectReason::UnknownRound);
    // A second parent round cannot start while this one runs here.
    let next = FollowedRound {
        round: RoundId(opened.round.0 + 1),
        base_version: ModelVersion(2),
        base_digest: Digest::of(b"v2"),
        client: ClientConfig::default(),
        selection: Selection::All,
        deadline: T0 + 1_000_000,
        expected: 1,
        max_sample_count: 10,
    };
    assert!(matches!(relay.engine_mut().follow_round(T0 + 22, next.clone()), Err(EngineError::CampaignRunning(_))));
    // At its deadline the relay's round closes with what it has; forwarded, the campaign ends.
    relay.handle_timeout(opened.deadline - 10_000);
    assert!(matches!(relay.poll_event(), Some(EngineEvent::RoundClosed { cause: CloseCause::Deadline, .. })));
    relay
        .finalize_with(T0 + 30, opened.round, |s| {
            s.take_partial_sum();
            Ok(Vec::new())
        })
        .unwrap();
    relay.model_ready(T0 + 30, opened.round, opened.base_version, opened.base_digest).unwrap();
    assert!(matches!(relay.poll_event(), Some(EngineEvent::CampaignFinished { outcome: CampaignOutcome::Completed, .. })));
    assert_eq!(relay.strategy().partial_sum().unwrap().count(), 0, "the forwarded sum is gone");
    // The same round again (the parent still announces it): refused; the next one follows.
    let same = FollowedRound { round: opened.round, ..next.clone() };
    assert!(matches!(relay.engine_mut().follow_round(T0 + 40, same), Err(EngineError::NotCurrentRound(_))));
    relay.engine_mut().follow_round(T0 + 40, next).unwrap();
    // A round in which nobody of the region sent fails at its deadline and ends: nothing to forward.
    relay.handle_timeout(T0 + 1_000_000);
    let events: Vec<_> = std::iter::from_fn(|| relay.poll_event()).collect();
    assert!(events.iter().any(|e| matches!(e, EngineEvent::RoundFailed { .. })), "{events:?}");
    assert!(relay.engine().campaign_id().is_none());
}

#[test]
fn partial_sums_off_the_wire_are_bounded() {
    let mut sum = PartialSum::new(4);
    sum.fold(&[1.0, -2.0, 0.5, 0.0], 3).unwrap();
    let bytes = sum.to_le_bytes();
    assert_eq!(PartialSum::from_le_bytes(&bytes, 4, 3, 1).unwrap(), sum);
    assert!(PartialSum::from_le_bytes(&bytes[..48], 4, 3, 1).is_err(), "short");
    assert!(PartialSum::from_le_bytes(&bytes, 4, 0, 1).is_err(), "weight below the count");
    assert!(PartialSum::from_le_bytes(&bytes, 4, 3, 0).is_err(), "no updates");
    let mut huge = bytes.clone();
    huge[..16].copy_from_slice(&(1i128 << 101).to_le_bytes());
    assert!(PartialSum::from_le_bytes(&huge, 4, 3, 1).is_err(), "beyond what one in-range update reaches");
}

/// Asynchronous mode (FedBuff) over relays: a relay's sum made for buffer 1 that arrives after
/// buffer 1 closed joins the open buffer 2 as one contribution of all its updates, discounted by
/// its staleness as a whole (`PartialSum::discounted`: sums and weight by 1/√2 in ppm); a
/// second sum of the same relay waits for the next buffer (`overloaded`). The refold after a restart (`resume_merge`, staleness from the
/// round the sum was made for) gives the same buffer, bit for bit.
#[test]
fn a_relay_sum_for_an_earlier_buffer_joins_the_open_one_discounted_as_a_whole() {
    let spec = |k: u32| campaign(k, Some(BufferPolicy { max_staleness: 1 }));
    let mut engine = RoundEngine::new(fleet(), EngineConfig::default(), RoundId(1));
    engine.start_campaign(T0, spec(2)).unwrap();
    let Some(EngineEvent::RoundOpened(b1)) = engine.poll_event() else { panic!("buffer 1 opens") };
    let mut root = Coordinator::new(engine, fedavg());
    // Two devices close buffer 1 at the root; it publishes version 2 and buffer 2 opens.
    for i in 0..2 {
        root.handle_update(T0 + 1, update(i, b1.round), &delta(i)).unwrap();
    }
    root.finalize(T0 + 2, b1.round, &global()).unwrap();
    root.model_ready(T0 + 3, b1.round, ModelVersion(2), Digest::of(b"model v2")).unwrap();
    let b2 = std::iter::from_fn(|| root.poll_event())
        .find_map(|e| match e {
            EngineEvent::RoundOpened(a) => Some(a),
            _ => None,
        })
        .expect("buffer 2 opens");

    // Relay 1's region trained for buffer 1 on version 1: three updates, one sum.
    let mut region = PartialSum::new(DIM);
    for i in 2..5 {
        region.fold(&delta(i), 10 + 7 * i as u64).unwrap();
    }
    let meta = relay_meta(1, b1.round, &region);
    let accepted = root.handle_relay(T0 + 4, meta.clone(), &region).unwrap();
    assert_eq!((accepted.round, accepted.staleness, accepted.accepted), (b2.round, 1, 3));
    assert_eq!(accepted.weight, staleness_weight(region.total_weight(), 1));
    assert!(accepted.closed_round, "three updates reach buffer 2's target of 2");
    let discounted = region.discounted(1);
    assert_eq!(discounted.total_weight(), accepted.weight);
    assert_eq!(discounted.count(), 3);
    for (d, s) in discounted.raw().iter().zip(region.raw()) {
        assert_eq!(*d, s * 707_107 / 1_000_000, "every sum scaled by the same ppm factor, toward zero");
    }
    assert_eq!(root.strategy().partial_sum().unwrap().raw(), discounted.raw(), "buffer 2 holds the discounted sum");

    // The refold after a restart: the engine snapshot at buffer 2's opening, the sum merged again.
    let mut engine = RoundEngine::new(fleet(), EngineConfig::default(), RoundId(1));
    engine.start_campaign(T0, spec(2)).unwrap();
    let mut again = Coordinator::new(engine, fedavg());
    for i in 0..2 {
        again.handle_update(T0 + 1, update(i, b1.round), &delta(i)).unwrap();
    }
    again.finalize(T0 + 2, b1.round, &global()).unwrap();
    again.model_ready(T0 + 3, b1.round, ModelVersion(2), Digest::of(b"model v2")).unwrap();
    again.resume_merge(b2.round, b1.round, &region).unwrap();
    assert_eq!(again.strategy().partial_sum().unwrap().raw(), discounted.raw(), "the refold discounts as the admission did");
    assert_eq!(again.strategy().partial_sum().unwrap().total_weight(), accepted.weight);

    // In a fresh buffer 1 (target 10): a second sum of relay 1 waits for the next buffer.
    let mut engine = RoundEngine::new(fleet(), EngineConfig::default(), RoundId(1));
    engine.start_campaign(T0, spec(10)).unwrap();
    let mut wide = Coordinator::new(engine, fedavg());
    wide.handle_relay(T0 + 1, relay_meta(1, b1.round, &region), &region).unwrap();
    let second = RelayMeta { nonce: Nonce([42; 16]), ..relay_meta(1, b1.round, &region) };
    assert_eq!(wide.handle_relay(T0 + 2, second, &region).unwrap_err().reason, RejectReason::Overloaded);
    assert_eq!(wide.engine().staleness_of(b1.round), 0, "made for the open buffer: no discount");
}
