//! The round engine on a fake clock: quorum, deadline and extension, stragglers, duplicates,
//! replays, revocation, sampling, campaigns, snapshot/restore.

use std::collections::BTreeSet;

use fedfleet_protocol::{DeviceId, Digest, FleetId, ModelVersion, RoundId, Selection};
use fedfleet_rounds::*;

/// The tests' clock starts here (unix ms).
pub(crate) const T0: Millis = 1_700_000_000_000;
pub(crate) const MIN: u64 = 60_000;

pub(crate) fn fleet() -> FleetId {
    FleetId::new("fleet-a").unwrap()
}
pub(crate) fn dev(i: usize) -> DeviceId {
    DeviceId::new(format!("dev-{i:05}")).unwrap()
}
fn base() -> Digest {
    Digest::of(b"model v1")
}
fn nonce(device: usize, k: u64) -> Nonce {
    let mut n = [0u8; 16];
    n[..8].copy_from_slice(&(device as u64).to_le_bytes());
    n[8..].copy_from_slice(&k.to_le_bytes());
    Nonce(n)
}

fn policy(target: u32, quorum: u32, extension_ms: u64) -> RoundPolicy {
    RoundPolicy {
        target_count: target,
        min_quorum: quorum,
        over_selection: 1.0,
        duration_ms: 10 * MIN,
        extension_ms,
        max_sample_count: 100_000,
    }
}

fn spec(devices: usize, policy: RoundPolicy) -> CampaignSpec {
    CampaignSpec {
        id: CampaignId(7),
        rounds: 3,
        base_version: ModelVersion(1),
        base_digest: base(),
        client: ClientConfig::default(),
        selection: fedfleet_rounds::Invitation::Explicit { devices: (0..devices).map(dev).collect() },
        policy,
        seed: [42; 32],
        max_consecutive_failures: 3,
        buffer: None,
        privacy: None,
    }
}

fn engine_with(spec: CampaignSpec) -> (RoundEngine, OpenedRound) {
    let mut e = RoundEngine::new(fleet(), EngineConfig::default(), RoundId(1));
    e.start_campaign(T0, spec).unwrap();
    let Some(EngineEvent::RoundOpened(a)) = e.poll_event() else { panic!("round must open") };
    assert_eq!(e.poll_event(), None);
    (e, a)
}

fn meta(device: usize, round: RoundId, k: u64) -> UpdateMeta {
    UpdateMeta {
        fleet: fleet(),
        device: dev(device),
        round,
        base_digest: base(),
        nonce: nonce(device, k),
        num_examples: 10 + device as u64,
        payload_digest: Digest::of(&device.to_le_bytes()),
    }
}

fn events(e: &mut RoundEngine) -> Vec<EngineEvent> {
    std::iter::from_fn(|| e.poll_event()).collect()
}

fn reason(r: Result<Accepted, Reject>) -> RejectReason {
    r.expect_err("must be refused").reason
}

#[test]
fn round_closes_early_at_target_and_stragglers_are_stale() {
    let (mut e, a) = engine_with(spec(10, policy(3, 2, 0)));
    assert_eq!(a.round, RoundId(1));
    assert_eq!(a.deadline, T0 + 10 * MIN);
    assert_eq!(e.poll_timeout(), Some(T0 + 10 * MIN));
    for (i, d) in [4, 1, 7].into_iter().enumerate() {
        let acc = e.handle_update(T0 + 1000 * i as u64, meta(d, a.round, 0)).unwrap();
        assert_eq!(acc.accepted, i as u32 + 1);
        assert_eq!(acc.closed_round, i == 2);
    }
    let ev = events(&mut e);
    let [EngineEvent::RoundClosed { round, cause, contributions, base_digest, .. }] = &ev[..] else { panic!("{ev:?}") };
    assert_eq!((*round, *cause, *base_digest), (RoundId(1), CloseCause::TargetReached, base()));
    let devices: Vec<_> = contributions.iter().map(|c| c.device.clone()).collect();
    assert_eq!(devices, vec![dev(1), dev(4), dev(7)], "sorted by device id");
    assert_eq!(contributions[0].weight, 11);
    assert_eq!(e.poll_timeout(), None, "nothing to time out while the model is finalized");
    // A straggler of the closed round.
    assert_eq!(reason(e.handle_update(T0 + 5000, meta(2, RoundId(1), 0))), RejectReason::StaleRound);
    assert_eq!(e.awaiting_model(), Some(RoundId(1)));
    // Publishing opens round 2 on the new base; round-1 updates stay stale.
    let v2 = Digest::of(b"model v2");
    e.model_ready(T0 + 6000, RoundId(1), ModelVersion(2), v2).unwrap();
    let ev = events(&mut e);
    let [EngineEvent::RoundOpened(a2)] = &ev[..] else { panic!("{ev:?}") };
    assert_eq!((a2.round, a2.base_version, a2.base_digest), (RoundId(2), ModelVersion(2), v2));
    assert_eq!(reason(e.handle_update(T0 + 7000, meta(2, RoundId(1), 1))), RejectReason::StaleRound);
    assert_eq!(reason(e.handle_update(T0 + 7000, meta(2, RoundId(2), 2))), RejectReason::WrongBaseModel);
    assert_eq!(reason(e.handle_update(T0 + 7000, meta(2, RoundId(3), 3))), RejectReason::UnknownRound);
}

#[test]
fn quorum_met_at_deadline_closes() {
    let (mut e, a) = engine_with(spec(10, policy(5, 2, MIN)));
    e.handle_update(T0 + 1, meta(0, a.round, 0)).unwrap();
    e.handle_update(T0 + 2, meta(1, a.round, 0)).unwrap();
    e.handle_timeout(a.deadline - 1);
    assert!(events(&mut e).is_empty());
    e.handle_timeout(a.deadline);
    let ev = events(&mut e);
    assert!(matches!(&ev[..], [EngineEvent::RoundClosed { cause: CloseCause::Deadline, contributions, .. }] if contributions.len() == 2));
}

#[test]
fn quorum_not_met_extends_once_then_fails_and_never_hangs() {
    let (mut e, a) = engine_with(spec(10, policy(5, 3, 2 * MIN)));
    e.handle_update(T0 + 1, meta(0, a.round, 0)).unwrap();
    e.handle_timeout(a.deadline);
    let ev = events(&mut e);
    assert_eq!(ev, vec![EngineEvent::RoundExtended { round: a.round, deadline: a.deadline + 2 * MIN, accepted: 1 }]);
    assert_eq!(e.poll_timeout(), Some(a.deadline + 2 * MIN));
    // Updates during the extension count.
    e.handle_update(a.deadline + 10, meta(1, a.round, 0)).unwrap();
    e.handle_timeout(a.deadline + 2 * MIN);
    let ev = events(&mut e);
    assert_eq!(ev[0], EngineEvent::RoundFailed { round: a.round, reason: FailReason::QuorumNotMet { accepted: 2, quorum: 3 } });
    assert_eq!(FailReason::QuorumNotMet { accepted: 2, quorum: 3 }.as_str(), "quorum_not_met");
    // The campaign goes on with a fresh round on the same base.
    let EngineEvent::RoundOpened(a2) = &ev[1] else { panic!("{ev:?}") };
    assert_eq!((a2.round, a2.base_digest), (RoundId(2), base()));
    assert_eq!(reason(e.handle_update(a.deadline + 3 * MIN, meta(3, a.round, 0))), RejectReason::StaleRound);
}

#[test]
fn a_late_shell_processes_extension_and_failure_in_one_call() {
    let (mut e, a) = engine_with(spec(10, policy(5, 3, 2 * MIN)));
    e.handle_timeout(a.deadline + 60 * MIN);
    let ev = events(&mut e);
    assert!(matches!(ev[0], EngineEvent::RoundExtended { .. }));
    assert!(matches!(ev[1], EngineEvent::RoundFailed { reason: FailReason::QuorumNotMet { accepted: 0, .. }, .. }));
    assert!(matches!(&ev[2], EngineEvent::RoundOpened(r) if r.opened_at == a.deadline + 60 * MIN));
}

#[test]
fn too_many_failures_end_the_campaign() {
    let (mut e, _) = engine_with(spec(10, policy(5, 3, 0)));
    let mut now = T0;
    for _ in 0..3 {
        now += 11 * MIN;
        e.handle_timeout(now);
    }
    let ev = events(&mut e);
    let fails = ev.iter().filter(|x| matches!(x, EngineEvent::RoundFailed { .. })).count();
    assert_eq!(fails, 3);
    assert_eq!(
        ev.last(),
        Some(&EngineEvent::CampaignFinished {
            campaign: CampaignId(7),
            outcome: CampaignOutcome::TooManyFailures,
            rounds_completed: 0,
            privacy: None
        })
    );
    assert_eq!(e.poll_timeout(), None);
    assert_eq!(e.campaign_id(), None);
}

#[test]
fn late_update_after_deadline_is_stale_even_before_handle_timeout() {
    let (mut e, a) = engine_with(spec(10, policy(5, 1, 0)));
    e.handle_update(T0 + 5, meta(0, a.round, 0)).unwrap();
    // The shell did not call handle_timeout; the update arrives at the deadline.
    assert_eq!(reason(e.handle_update(a.deadline, meta(1, a.round, 0))), RejectReason::StaleRound);
    assert!(matches!(events(&mut e)[..], [EngineEvent::RoundClosed { cause: CloseCause::Deadline, .. }]));
}

#[test]
fn duplicates_replays_and_admission_reasons() {
    let (mut e, a) = engine_with(spec(10, policy(8, 2, 0)));
    let r = a.round;
    e.handle_update(T0, meta(1, r, 0)).unwrap();
    assert_eq!(reason(e.handle_update(T0, meta(1, r, 1))), RejectReason::Duplicate);
    assert_eq!(reason(e.handle_update(T0, meta(1, r, 0))), RejectReason::Replay);
    assert_eq!(reason(e.handle_update(T0, meta(99, r, 0))), RejectReason::NotSelected);
    let mut m = meta(2, r, 0);
    m.fleet = FleetId::new("other").unwrap();
    assert_eq!(reason(e.handle_update(T0, m)), RejectReason::WrongFleet);
    let mut m = meta(2, r, 0);
    m.num_examples = 0;
    assert_eq!(reason(e.handle_update(T0, m)), RejectReason::BadSampleCount);
    let mut m = meta(2, r, 0);
    m.num_examples = 100_001;
    assert_eq!(reason(e.handle_update(T0, m)), RejectReason::BadSampleCount);
    // Refused updates leave no nonce behind: the same nonce is accepted once valid.
    e.handle_update(T0, meta(2, r, 0)).unwrap();
    // A nonce seen in an earlier round is a replay in a later one.
    e.handle_timeout(a.deadline);
    let closed = events(&mut e);
    assert!(matches!(closed[..], [EngineEvent::RoundClosed { .. }]));
    e.model_ready(a.deadline, r, ModelVersion(2), base()).unwrap();
    let ev = events(&mut e);
    let [EngineEvent::RoundOpened(a2)] = &ev[..] else { panic!() };
    assert_eq!(reason(e.handle_update(a.deadline + 1, meta(1, a2.round, 0))), RejectReason::Replay);
    e.handle_update(a.deadline + 1, meta(1, a2.round, 5)).unwrap();
    let err = e.handle_update(a.deadline + 1, meta(1, a2.round, 6)).unwrap_err();
    assert_eq!((err.reason, err.current_round), (RejectReason::Duplicate, Some(a2.round)));
    assert_eq!(err.reason.as_str(), "duplicate");
}

#[test]
fn revoked_device_mid_round_keeps_its_accepted_update_and_is_refused_after() {
    let (mut e, a) = engine_with(spec(10, policy(3, 1, 0)));
    e.handle_update(T0, meta(1, a.round, 0)).unwrap();
    e.revoke(dev(1));
    e.revoke(dev(2));
    e.revoke(dev(2)); // idempotent
    assert_eq!(
        events(&mut e),
        vec![
            EngineEvent::DeviceRevoked { device: dev(1), contributed_to: Some(a.round) },
            EngineEvent::DeviceRevoked { device: dev(2), contributed_to: None },
        ]
    );
    assert_eq!(reason(e.handle_update(T0 + 1, meta(2, a.round, 0))), RejectReason::Revoked);
    assert_eq!(reason(e.handle_update(T0 + 1, meta(1, a.round, 9))), RejectReason::Revoked);
    e.handle_update(T0 + 2, meta(3, a.round, 0)).unwrap();
    e.handle_timeout(a.deadline);
    let ev = events(&mut e);
    let [EngineEvent::RoundClosed { contributions, .. }] = &ev[..] else { panic!("{ev:?}") };
    assert_eq!(contributions.iter().map(|c| c.device.clone()).collect::<Vec<_>>(), vec![dev(1), dev(3)]);
    // Compromised key: the operator aborts the closed round instead of publishing it.
    e.abort_round(a.deadline, a.round, "dev-00001 compromised").unwrap();
    let ev = events(&mut e);
    assert!(matches!(&ev[0], EngineEvent::RoundFailed { reason: FailReason::Aborted { .. }, .. }));
    assert!(matches!(&ev[1], EngineEvent::RoundOpened(_)));
    e.reinstate(&dev(2));
    assert!(!e.is_revoked(&dev(2)));
}

#[test]
fn rate_sampling_is_deterministic_and_close_to_the_rate() {
    let devices: Vec<DeviceId> = (0..20_000).map(dev).collect();
    let pick = |seed: u64, rate: f64| -> BTreeSet<DeviceId> {
        let sel = Selection::Sample { rate_ppm: rate_to_ppm(rate), seed };
        devices.iter().filter(|d| sel.selects(d)).cloned().collect()
    };
    let seed = round_seed(&[1; 32], RoundId(5));
    assert_eq!(seed, round_seed(&[1; 32], RoundId(5)));
    let a = pick(seed, 0.1);
    assert_eq!(a, pick(seed, 0.1), "same seed, same selection");
    // Binomial(20000, 0.1): sd ≈ 42; allow 5 sd.
    assert!((a.len() as i64 - 2000).abs() < 210, "{}", a.len());
    let other = pick(round_seed(&[1; 32], RoundId(6)), 0.1);
    assert_ne!(a, other, "another round draws another sample");
    let overlap = a.intersection(&other).count();
    assert!(overlap < 400, "independent draws overlap about 1%: {overlap}");
    // Monotone in the rate: a higher rate selects a superset.
    assert!(a.is_subset(&pick(seed, 0.3)));

    // Through the engine, with over-selection: effective rate 0.1 × 1.5, announced in wire form
    // so devices decide for themselves exactly as the engine does.
    let mut p = policy(100, 10, 0);
    p.over_selection = 1.5;
    let mut s = spec(0, p);
    s.selection = fedfleet_rounds::Invitation::Rate { rate: 0.1 };
    let (e, ann) = engine_with(s);
    let Selection::Sample { rate_ppm, seed } = ann.selection.clone() else { panic!() };
    assert_eq!((rate_ppm, seed), (150_000, round_seed(&[42; 32], ann.round)));
    let n = devices.iter().filter(|d| e.is_selected(d)).count();
    assert!((n as i64 - 3000).abs() < 250, "{n}");
    assert!(devices.iter().all(|d| e.is_selected(d) == ann.selection.selects(d)));
    // An explicit list is announced as such.
    let (e, ann) = engine_with(spec(3, policy(2, 1, 0)));
    assert_eq!(ann.selection, Selection::Devices(vec![dev(0), dev(1), dev(2)]));
    assert!(e.is_selected(&dev(2)) && !e.is_selected(&dev(3)));
}

#[test]
fn campaign_runs_its_rounds_then_finishes() {
    let (mut e, mut a) = engine_with(spec(4, policy(2, 1, 0)));
    for k in 0..3u64 {
        e.handle_update(T0, meta(0, a.round, k)).unwrap();
        e.handle_update(T0, meta(1, a.round, k)).unwrap();
        assert!(matches!(events(&mut e)[..], [EngineEvent::RoundClosed { .. }]));
        e.model_ready(T0, a.round, ModelVersion(2 + k), base()).unwrap();
        let ev = events(&mut e);
        match &ev[..] {
            [EngineEvent::RoundOpened(next)] => a = next.clone(),
            [EngineEvent::CampaignFinished { outcome: CampaignOutcome::Completed, rounds_completed: 3, .. }] => {
                assert_eq!(k, 2)
            }
            other => panic!("{other:?}"),
        }
    }
    assert!(e.start_campaign(T0, spec(4, policy(2, 1, 0))).is_ok(), "a new campaign may start");
    assert!(matches!(e.start_campaign(T0, spec(4, policy(2, 1, 0))), Err(EngineError::CampaignRunning(_))));
    let ev = events(&mut e);
    let [EngineEvent::RoundOpened(next)] = &ev[..] else { panic!() };
    assert_eq!(next.round, RoundId(4), "round ids keep increasing across campaigns");
    e.stop_campaign(T0).unwrap();
    assert!(matches!(
        events(&mut e)[..],
        [
            EngineEvent::RoundFailed { reason: FailReason::CampaignStopped, .. },
            EngineEvent::CampaignFinished { outcome: CampaignOutcome::Stopped, .. }
        ]
    ));
}

#[test]
fn invalid_specs_are_refused() {
    let mut e = RoundEngine::new(fleet(), EngineConfig::default(), RoundId(1));
    for bad in [policy(2, 3, 0), policy(0, 0, 0)] {
        assert!(matches!(e.start_campaign(T0, spec(10, bad)), Err(EngineError::InvalidSpec(_))));
    }
    assert!(matches!(e.start_campaign(T0, spec(1, policy(3, 2, 0))), Err(EngineError::InvalidSpec(_))));
    let mut s = spec(10, policy(3, 2, 0));
    s.selection = fedfleet_rounds::Invitation::Rate { rate: 0.0 };
    assert!(matches!(e.start_campaign(T0, s), Err(EngineError::InvalidSpec(_))));
    assert!(e.poll_event().is_none());
}

#[test]
fn engine_snapshot_restores_to_the_same_behaviour() {
    let (mut e, a) = engine_with(spec(10, policy(6, 2, MIN)));
    e.handle_update(T0 + 1, meta(0, a.round, 0)).unwrap();
    e.handle_update(T0 + 2, meta(1, a.round, 0)).unwrap();
    e.revoke(dev(9));
    let bytes = e.to_bytes();
    let mut restored = RoundEngine::from_bytes(&bytes).unwrap();
    assert_eq!(restored, e);
    let json = serde_json::to_string(&e).unwrap();
    assert_eq!(serde_json::from_str::<RoundEngine>(&json).unwrap(), e);
    assert!(RoundEngine::from_bytes(&bytes[..bytes.len() / 2]).is_err());
    // Drive both identically, including a replay of an update accepted before the snapshot.
    for x in [&mut e, &mut restored] {
        assert_eq!(reason(x.handle_update(T0 + 3, meta(1, a.round, 0))), RejectReason::Replay);
        x.handle_update(T0 + 4, meta(2, a.round, 0)).unwrap();
        x.handle_timeout(a.deadline);
    }
    assert_eq!(events(&mut e), events(&mut restored));
    assert_eq!(e, restored);
}

#[test]
fn a_snapshot_from_the_round_boundary_plus_readmitted_records_is_the_engine_that_ran_on() {
    // The shell snapshots the engine when a round opens and keeps a record per accepted update;
    // re-admitting the records into that snapshot gives the engine that accepted them (and
    // closes the round where the last one reached the target).
    let (mut e, a) = engine_with(spec(10, policy(3, 2, MIN)));
    let at_open = e.to_bytes();
    let mut contributions = Vec::new();
    for d in 0..3 {
        let m = meta(d, a.round, 0);
        let acc = e.handle_update(T0 + 1 + d as u64, m.clone()).unwrap();
        contributions.push(Contribution {
            device: m.device,
            nonce: m.nonce,
            num_examples: acc.weight,
            weight: acc.weight,
            payload_digest: m.payload_digest,
            accepted_at: T0 + 1 + d as u64,
            updates: 1,
        });
    }
    let mut restored = RoundEngine::from_bytes(&at_open).unwrap();
    events(&mut restored);
    let mut original = events(&mut e);
    // Two records, the third not yet written: the round stays open, and a resend of a
    // readmitted update is a replay; the third then closes it with the same contributions.
    for c in &contributions[..2] {
        assert!(restored.readmit(a.round, c.clone()).unwrap());
        assert!(!restored.readmit(a.round, c.clone()).unwrap(), "readmitting twice changes nothing");
    }
    assert_eq!(restored.round_status().map(|s| s.accepted), Some(2));
    assert_eq!(reason(restored.check_update(T0 + 10, &meta(1, a.round, 0))), RejectReason::Replay);
    assert!(restored.readmit(a.round, contributions[2].clone()).unwrap());
    let replayed = events(&mut restored);
    assert!(matches!(&replayed[..], [EngineEvent::RoundClosed { cause: CloseCause::TargetReached, .. }]), "{replayed:?}");
    original.retain(|ev| matches!(ev, EngineEvent::RoundClosed { .. }));
    assert_eq!(replayed, original);
    assert_eq!(restored, e);
    assert!(matches!(restored.readmit(a.round, contributions[0].clone()), Err(EngineError::NotCurrentRound(_))));
}

/// Deltas for device `d`: mixed magnitudes, deterministic.
fn delta(d: usize, dim: usize) -> Vec<f32> {
    (0..dim).map(|j| (((d * 31 + j * 17) % 97) as f32 - 48.0) * 10f32.powi((d % 7) as i32 - 4)).collect()
}

fn fed_adam(dim: usize) -> ServerStrategy {
    let config = StrategyConfig::FedAdam { client: ClientConfig::default(), params: FedOptParams::adam() };
    ServerStrategy::new(&config, dim).unwrap()
}

/// Runs one round through a coordinator; `crash_after` persists, drops and restores it after
/// that many updates, then replays *every* update (the shell does not know which were committed).
fn run_round(crash_after: Option<usize>, order: &[usize]) -> (Vec<EngineEvent>, Vec<f32>, Vec<u8>) {
    let dim = 64;
    let global: Vec<f32> = (0..dim).map(|j| j as f32 * 0.01).collect();
    let (engine, a) = engine_with(spec(12, policy(20, 4, 0)));
    let mut c = Coordinator::new(engine, fed_adam(dim));
    let mut log = Vec::new();
    for (i, &d) in order.iter().enumerate() {
        if crash_after == Some(i) {
            let saved = postcard::to_stdvec(&c).unwrap();
            drop(c);
            c = postcard::from_bytes(&saved).unwrap();
            for &earlier in &order[..i] {
                let r = c.handle_update(T0 + 50, meta(earlier, a.round, 0), &delta(earlier, dim));
                assert_eq!(r.unwrap_err().reason, RejectReason::Replay);
            }
        }
        c.handle_update(T0 + i as u64, meta(d, a.round, 0), &delta(d, dim)).unwrap();
    }
    c.handle_timeout(a.deadline);
    while let Some(ev) = c.poll_event() {
        log.push(ev);
    }
    let model = c.finalize(a.deadline, a.round, &global).unwrap();
    c.model_ready(a.deadline, a.round, ModelVersion(2), Digest::of(b"v2")).unwrap();
    log.extend(std::iter::from_fn(|| c.poll_event()));
    (log, model, postcard::to_stdvec(c.strategy()).unwrap())
}

#[test]
fn snapshot_restore_and_replay_give_the_same_model() {
    let order: Vec<usize> = (0..10).collect();
    let (ev, model, state) = run_round(None, &order);
    for crash in [1, 5, 9] {
        let (ev2, model2, state2) = run_round(Some(crash), &order);
        // Accept times differ (replays), so compare what matters: contributors, model, state.
        let devices = |ev: &[EngineEvent]| match &ev[0] {
            EngineEvent::RoundClosed { contributions, .. } => contributions.iter().map(|c| c.device.clone()).collect::<Vec<_>>(),
            other => panic!("{other:?}"),
        };
        assert_eq!(devices(&ev), devices(&ev2));
        assert_eq!(model.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), model2.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
        assert_eq!(state, state2, "server optimizer state (m, v, t) identical");
    }
    // Arrival order does not matter either.
    let reversed: Vec<usize> = (0..10).rev().collect();
    let (_, model3, state3) = run_round(Some(4), &reversed);
    assert_eq!(model.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), model3.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
    assert_eq!(state, state3);
}

#[test]
fn coordinator_refuses_bad_payloads_without_recording_them() {
    let dim = 8;
    let (engine, a) = engine_with(spec(5, policy(5, 1, 0)));
    let mut c = Coordinator::new(engine, fed_adam(dim));
    let mut bad = delta(0, dim);
    bad[3] = f32::INFINITY;
    assert_eq!(c.handle_update(T0, meta(0, a.round, 0), &bad).unwrap_err().reason, RejectReason::NonFinite);
    assert_eq!(c.handle_update(T0, meta(0, a.round, 0), &bad[1..]).unwrap_err().reason, RejectReason::ShapeMismatch);
    assert_eq!(c.engine().round_status().unwrap().accepted, 0);
    // The same nonce, now with a good payload, is accepted: nothing was recorded.
    c.handle_update(T0, meta(0, a.round, 0), &delta(0, dim)).unwrap();
    assert_eq!(c.strategy().folded(), 1);
    // A failed round's folds are discarded before the next round folds.
    let _ = std::iter::from_fn(|| c.poll_event()).count();
    c.engine_mut().abort_round(T0, a.round, "operator").unwrap();
    let ev: Vec<_> = std::iter::from_fn(|| c.poll_event()).collect();
    let EngineEvent::RoundOpened(a2) = &ev[1] else { panic!("{ev:?}") };
    c.handle_update(T0 + 1, meta(1, a2.round, 0), &delta(1, dim)).unwrap();
    assert_eq!(c.strategy().folded(), 1);
    assert!(matches!(c.finalize(T0, a.round, &vec![0.0; dim]), Err(FinalizeError::NotAwaiting(_))));
}

#[test]
fn a_non_finite_model_is_never_handed_out_and_the_round_fails() {
    let dim = 4;
    let (engine, a) = engine_with(spec(12, policy(20, 1, 0)));
    let mut c = Coordinator::new(engine, fed_adam(dim));
    c.handle_update(T0, meta(0, a.round, 0), &delta(0, dim)).unwrap();
    c.handle_timeout(a.deadline);
    while c.poll_event().is_some() {}
    // Whatever path computed it (the tensor fold, an optimizer overflowing), the model is checked.
    let err = c.finalize_with(a.deadline, a.round, |_| Ok(vec![0.5, f32::INFINITY, 0.0, f32::NAN])).unwrap_err();
    assert!(err.to_string().contains("not finite (element 1 is inf)"), "{err}");
    let failed = std::iter::from_fn(|| c.poll_event()).any(|ev| matches!(ev, EngineEvent::RoundFailed { round, .. } if round == a.round));
    assert!(failed, "the round is reported failed");
}

/// A round whose invited devices are all in but a revoked one closes at once: the revoked
/// device's update never comes, so the round does not wait for its deadline.
#[test]
fn revoking_the_last_missing_invited_device_closes_the_round() {
    let (mut e, a) = engine_with(spec(3, policy(3, 1, 0)));
    e.handle_update(T0, meta(0, a.round, 0)).unwrap();
    let second = e.handle_update(T0 + 1, meta(1, a.round, 0)).unwrap();
    assert!(!second.closed_round, "device 2 may still come");
    events(&mut e);
    e.revoke(dev(2));
    let evs = events(&mut e);
    assert!(
        evs.iter().any(|ev| matches!(ev, EngineEvent::RoundClosed { round, cause: CloseCause::TargetReached, .. } if *round == a.round)),
        "{evs:?}"
    );
    // The next round's early close counts only the devices that can still take part.
    let Some(EngineEvent::RoundOpened(b)) = evs.iter().find(|ev| matches!(ev, EngineEvent::RoundOpened(_))).cloned().or_else(|| {
        e.model_ready(T0 + 2, a.round, ModelVersion(2), Digest::of(b"v2")).unwrap();
        e.poll_event()
    }) else {
        panic!("the next round opens")
    };
    assert_eq!(e.round_status().unwrap().target, 2, "the status reports the target the round closes at");
    let on_v2 = |device| UpdateMeta { base_digest: b.base_digest, ..meta(device, b.round, 1) };
    e.handle_update(T0 + 3, on_v2(0)).unwrap();
    assert!(e.handle_update(T0 + 4, on_v2(1)).unwrap().closed_round, "2 of the 2 devices left");
}
