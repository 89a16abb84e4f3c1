//! The rollout engine on its own: a fake clock (plain `now` values), no store, no sockets.

use fedfleet_protocol::{DeviceId, ModelVersion};

use fedfleet_rollout::*;

const SOAK: u64 = 60_000;
const T0: u64 = 1_700_000_000_000;

fn dev(i: usize) -> DeviceId {
    DeviceId::new(format!("cam-{i:05}")).unwrap()
}

fn plan(phases: Vec<Phase>) -> RolloutPlan {
    RolloutPlan {
        id: "rollout-7".into(),
        model: "mnist".into(),
        alias: "stable".into(),
        target: ModelVersion(2),
        previous: Some(ModelVersion(1)),
        phases,
        failure_threshold: 0.2,
        min_sample: 5,
    }
}

/// 1 %, 10 % and 100 %, each soaking [`SOAK`]; a device of the first phase runs the target
/// healthy from the start (the evidence every phase needs).
fn standard() -> Rollout {
    let mut r = Rollout::start(plan(vec![Phase::percent(1.0, SOAK), Phase::percent(10.0, SOAK), Phase::percent(100.0, SOAK)]), T0).unwrap();
    let canary = device_in_phase(&r, 0);
    r.handle_report(T0, canary, ModelVersion(2), VersionReport::Healthy);
    r
}

fn events(r: &mut Rollout) -> Vec<Event> {
    std::iter::from_fn(|| r.poll_event()).collect()
}

/// First device (by index) whose first phase is `phase`.
fn device_in_phase(r: &Rollout, phase: usize) -> DeviceId {
    (0..).map(dev).find(|d| r.first_phase(d) == Some(phase)).unwrap()
}

#[test]
fn phases_advance_after_soak() {
    let mut r = standard();
    assert_eq!(events(&mut r), vec![Event::Started { phase: 0 }]);
    assert_eq!(r.poll_timeout(), Some(T0 + SOAK));
    r.handle_timeout(T0 + SOAK - 1);
    assert_eq!(r.phase(), 0);
    assert!(events(&mut r).is_empty());
    r.handle_timeout(T0 + SOAK);
    assert_eq!(events(&mut r), vec![Event::PhaseAdvanced { phase: 1, at: T0 + SOAK }]);
    assert_eq!(r.poll_timeout(), Some(T0 + 2 * SOAK));
    // A late timer advances one phase; the next phase soaks from when it started.
    r.handle_timeout(T0 + 10 * SOAK);
    assert_eq!(events(&mut r), vec![Event::PhaseAdvanced { phase: 2, at: T0 + 10 * SOAK }]);
    r.handle_timeout(T0 + 11 * SOAK);
    assert_eq!(
        events(&mut r),
        vec![
            Event::Completed { at: T0 + 11 * SOAK },
            Event::SetAlias { model: "mnist".into(), alias: "stable".into(), version: Some(ModelVersion(2)) },
        ]
    );
    assert_eq!(r.status(), Status::Completed);
    assert_eq!(r.poll_timeout(), None);
    let a = r.assignment(&dev(123), T0 + 12 * SOAK);
    assert_eq!((a.version, a.reason), (Some(ModelVersion(2)), Reason::Completed));
}

#[test]
fn pause_holds_and_resume_continues_the_soak() {
    let mut r = standard();
    events(&mut r);
    r.handle_timeout(T0 + 10_000);
    r.pause(T0 + 10_000).unwrap();
    assert_eq!(r.poll_timeout(), None);
    r.handle_timeout(T0 + 100 * SOAK);
    assert_eq!(r.phase(), 0, "paused rollouts do not advance");
    // Paused: the audience keeps the target, nobody new joins.
    let inside = device_in_phase(&r, 0);
    let outside = device_in_phase(&r, 1);
    assert_eq!(r.assignment(&inside, T0 + 100 * SOAK).version, Some(ModelVersion(2)));
    assert_eq!(r.assignment(&outside, T0 + 100 * SOAK).version, Some(ModelVersion(1)));
    assert_eq!(r.pause(T0), Err(RolloutError::InvalidTransition { from: Status::Paused, action: "pause" }));
    let resume_at = T0 + 100 * SOAK;
    r.resume(resume_at).unwrap();
    // 10 s were soaked before the pause: 50 s remain.
    assert_eq!(r.poll_timeout(), Some(resume_at + SOAK - 10_000));
    r.handle_timeout(resume_at + SOAK - 10_001);
    assert_eq!(r.phase(), 0);
    r.handle_timeout(resume_at + SOAK - 10_000);
    assert_eq!(r.phase(), 1);
    assert_eq!(
        events(&mut r),
        vec![Event::Paused { phase: 0 }, Event::Resumed { phase: 0 }, Event::PhaseAdvanced { phase: 1, at: resume_at + 50_000 }]
    );
}

#[test]
fn abort_stops_new_assignments() {
    let mut r = Rollout::start(plan(vec![Phase::percent(50.0, SOAK), Phase::percent(100.0, SOAK)]), T0).unwrap();
    let healthy = device_in_phase(&r, 0);
    let pending = (0..).map(dev).filter(|d| r.first_phase(d) == Some(0)).nth(1).unwrap();
    let later = device_in_phase(&r, 1);
    assert_eq!(r.assignment(&pending, T0).version, Some(ModelVersion(2)));
    r.handle_report(T0 + 1, healthy.clone(), ModelVersion(2), VersionReport::Active);
    r.abort(T0 + 2, "operator: wrong model").unwrap();
    assert!(events(&mut r).contains(&Event::Aborted { phase: 0, reason: "operator: wrong model".into() }));
    // Time passes: nothing advances, nobody new gets the target.
    let a = r.assignment(&pending, T0 + 10 * SOAK);
    assert_eq!((a.version, a.reason), (Some(ModelVersion(1)), Reason::Aborted));
    assert_eq!(r.assignment(&later, T0 + 10 * SOAK).version, Some(ModelVersion(1)));
    // A device already healthy on the target keeps it (rollback is a separate decision).
    let a = r.assignment(&healthy, T0 + 10 * SOAK);
    assert_eq!((a.version, a.reason), (Some(ModelVersion(2)), Reason::AbortedKeep));
    assert_eq!(r.status(), Status::Aborted);
    assert!(r.resume(T0).is_err() && r.pause(T0).is_err() && r.abort(T0, "again").is_err());
    assert_eq!(r.poll_timeout(), None);
}

#[test]
fn failure_threshold_auto_aborts() {
    let cohort: Vec<DeviceId> = (0..20).map(dev).collect();
    let mut r = Rollout::start(plan(vec![Phase::cohort("beta", cohort.clone(), SOAK), Phase::percent(100.0, SOAK)]), T0).unwrap();
    events(&mut r);
    // Progress reports are not outcomes.
    for d in &cohort[..10] {
        r.handle_report(T0 + 1, d.clone(), ModelVersion(2), VersionReport::Downloaded);
    }
    // Four failures: below the minimum sample of five, no verdict yet.
    for d in &cohort[..4] {
        r.handle_report(T0 + 2, d.clone(), ModelVersion(2), VersionReport::Failed { reason: "NaN output".into() });
    }
    // Reports from outside the audience or about other versions do not count.
    r.handle_report(T0 + 2, dev(999), ModelVersion(2), VersionReport::Failed { reason: "x".into() });
    r.handle_report(T0 + 2, cohort[10].clone(), ModelVersion(1), VersionReport::Failed { reason: "x".into() });
    assert_eq!(r.status(), Status::Running);
    assert_eq!(r.summary().failure_rate, Some(1.0));
    // A failed device is sent back to the previous version.
    let a = r.assignment(&cohort[0], T0 + 3);
    assert_eq!((a.version, a.reason), (Some(ModelVersion(1)), Reason::DeviceFailed));
    r.handle_report(T0 + 3, cohort[5].clone(), ModelVersion(2), VersionReport::Healthy);
    assert_eq!(r.status(), Status::Aborted);
    assert_eq!(events(&mut r), vec![Event::AutoAborted { phase: 0, failure_rate: 0.8, failed: 4, reporting: 5 }]);
    r.handle_timeout(T0 + 10 * SOAK);
    assert_eq!(r.phase(), 0);
    assert_eq!(r.assignment(&cohort[9], T0 + 10 * SOAK).version, Some(ModelVersion(1)));
}

#[test]
fn a_failed_device_reporting_the_version_it_still_runs_keeps_its_failure_counted() {
    let cohort: Vec<DeviceId> = (0..3).map(dev).collect();
    let mut p = plan(vec![Phase::cohort("all", cohort.clone(), SOAK)]);
    p.min_sample = 3;
    let mut r = Rollout::start(p, T0).unwrap();
    events(&mut r);
    for (i, d) in cohort.iter().enumerate() {
        let t = T0 + 1 + i as u64;
        r.handle_report(t, d.clone(), ModelVersion(2), VersionReport::RolledBack { reason: "holdout -rmse worse".into() });
        // Sent back to v1, the device reports it active again before the next one fails.
        assert_eq!(r.assignment(d, t).version, Some(ModelVersion(1)));
        r.handle_report(t, d.clone(), ModelVersion(1), VersionReport::Active);
    }
    assert_eq!(r.status(), Status::Aborted, "{:?}", r.summary());
    assert!(matches!(events(&mut r)[..], [Event::AutoAborted { failed: 3, reporting: 3, .. }]));
}

#[test]
fn failures_under_threshold_do_not_abort() {
    let cohort: Vec<DeviceId> = (0..10).map(dev).collect();
    let mut r = Rollout::start(plan(vec![Phase::cohort("beta", cohort.clone(), SOAK)]), T0).unwrap();
    r.handle_report(T0, cohort[0].clone(), ModelVersion(2), VersionReport::RolledBack { reason: "latency".into() });
    for d in &cohort[1..10] {
        r.handle_report(T0, d.clone(), ModelVersion(2), VersionReport::Healthy);
    }
    assert_eq!(r.status(), Status::Running);
    assert_eq!(r.summary().failure_rate, Some(0.1));
    r.handle_timeout(T0 + SOAK);
    assert_eq!(r.status(), Status::Completed);
}

#[test]
fn rollback_restores_the_previous_version_for_all() {
    let mut r = standard();
    for t in 1..=3 {
        r.handle_timeout(T0 + t * SOAK);
    }
    assert_eq!(r.status(), Status::Completed);
    events(&mut r);
    r.rollback(T0 + 4 * SOAK).unwrap();
    assert_eq!(
        events(&mut r),
        vec![
            Event::RolledBack { to: Some(ModelVersion(1)) },
            Event::SetAlias { model: "mnist".into(), alias: "stable".into(), version: Some(ModelVersion(1)) },
        ]
    );
    for i in 0..200 {
        let a = r.assignment(&dev(i), T0 + 5 * SOAK);
        assert_eq!((a.version, a.reason), (Some(ModelVersion(1)), Reason::RolledBack));
    }
    assert!(r.rollback(T0).is_err());
    // Rolling back a running rollout does not touch the alias (it never moved).
    let mut r = standard();
    events(&mut r);
    r.rollback(T0 + 1).unwrap();
    assert_eq!(events(&mut r), vec![Event::RolledBack { to: Some(ModelVersion(1)) }]);
    assert_eq!(r.assignment(&device_in_phase(&r, 0), T0 + 2).version, Some(ModelVersion(1)));
}

#[test]
fn cohort_membership_is_deterministic() {
    let r = standard();
    let n = 20_000;
    let in1 = (0..n).filter(|&i| r.in_audience(&dev(i), 0)).count();
    let in10 = (0..n).filter(|&i| r.in_audience(&dev(i), 1)).count();
    let in100 = (0..n).filter(|&i| r.in_audience(&dev(i), 2)).count();
    assert!((120..=280).contains(&in1), "1% of {n} gave {in1}");
    assert!((1700..=2300).contains(&in10), "10% of {n} gave {in10}");
    assert_eq!(in100, n);
    // Same answer from a fresh engine and from the free function; different rollouts differ.
    let again = standard();
    let other = Rollout::start(RolloutPlan { id: "rollout-8".into(), ..plan(vec![Phase::percent(10.0, 1)]) }, T0).unwrap();
    let mut differs = 0;
    for i in 0..1000 {
        let d = dev(i);
        assert_eq!(r.first_phase(&d), again.first_phase(&d));
        assert_eq!(r.in_audience(&d, 1), in_percent("rollout-7", &d, 10.0));
        if r.in_audience(&d, 1) != other.in_audience(&d, 0) {
            differs += 1;
        }
    }
    assert!(differs > 50, "rollout ids must salt the buckets");
    // Named cohorts: exactly their members, then everyone.
    let beta = [dev(3), dev(7)];
    let c = Rollout::start(plan(vec![Phase::cohort("beta", beta.clone(), 1), Phase::percent(100.0, 1)]), T0).unwrap();
    assert!(c.in_audience(&dev(3), 0) && c.in_audience(&dev(7), 0) && !c.in_audience(&dev(4), 0));
    assert!(c.in_audience(&dev(4), 1));
}

#[test]
fn membership_is_monotonic_across_phases() {
    let mut r = standard();
    for i in 0..5000 {
        let d = dev(i);
        for p in 0..2 {
            assert!(!r.in_audience(&d, p) || r.in_audience(&d, p + 1), "{d} left the rollout after phase {p}");
        }
    }
    let early = device_in_phase(&r, 0);
    let mid = device_in_phase(&r, 1);
    let mut got_early = vec![];
    let mut got_mid = vec![];
    for t in 0..3 {
        let now = T0 + t * SOAK;
        r.handle_timeout(now);
        got_early.push(r.assignment(&early, now).version);
        got_mid.push(r.assignment(&mid, now).version);
    }
    assert_eq!(got_early, vec![Some(ModelVersion(2)); 3]);
    assert_eq!(got_mid, vec![Some(ModelVersion(1)), Some(ModelVersion(2)), Some(ModelVersion(2))]);
}

#[test]
fn no_phase_advances_on_time_alone() {
    // `min_healthy` 0 (the value that used to switch the gate off) still needs one healthy
    // device: a phase nobody reported on waits past its soak, then stalls at its deadline, and
    // the alias never moves.
    let mut ph = Phase::percent(100.0, SOAK);
    ph.deadline_ms = 3 * SOAK;
    let mut r = Rollout::start(plan(vec![ph]), T0).unwrap();
    events(&mut r);
    r.handle_timeout(T0 + 2 * SOAK);
    assert_eq!((r.status(), r.phase()), (Status::Running, 0));
    // A download is no outcome.
    r.handle_report(T0 + 2 * SOAK, dev(0), ModelVersion(2), VersionReport::Downloaded);
    r.handle_timeout(T0 + 3 * SOAK);
    assert_eq!(r.status(), Status::Aborted);
    assert_eq!(events(&mut r), vec![Event::Stalled { phase: 0, healthy: 0, min_healthy: 1, failed: 0 }]);
    assert_eq!(r.assignment(&dev(1), T0 + 3 * SOAK).version, Some(ModelVersion(1)));

    // A first phase with nobody in it so far widens on its soak (nothing to wait for); the last
    // phase does not complete without a healthy device.
    let mut r = Rollout::start(plan(vec![Phase::percent(1.0, SOAK), Phase::percent(100.0, SOAK)]), T0).unwrap();
    let outside = device_in_phase(&r, 1);
    r.handle_report(T0 + 1, outside.clone(), ModelVersion(1), VersionReport::Active);
    r.handle_timeout(T0 + SOAK);
    assert_eq!((r.status(), r.phase()), (Status::Running, 1));
    r.handle_timeout(T0 + 5 * SOAK);
    assert_eq!((r.status(), r.phase()), (Status::Running, 1), "no evidence, no completion");
    r.handle_report(T0 + 5 * SOAK, outside, ModelVersion(2), VersionReport::Healthy);
    r.handle_timeout(T0 + 5 * SOAK);
    assert_eq!(r.status(), Status::Completed);

    // The same rollout with one healthy device completes and moves the alias.
    let mut r = Rollout::start(plan(vec![Phase::percent(100.0, SOAK)]), T0).unwrap();
    r.handle_report(T0 + 1, dev(0), ModelVersion(2), VersionReport::Healthy);
    r.handle_timeout(T0 + SOAK);
    assert_eq!(r.status(), Status::Completed);
}

#[test]
fn min_healthy_gates_advancing() {
    let beta: Vec<DeviceId> = (0..3).map(dev).collect();
    let mut ph = Phase::cohort("beta", beta.clone(), SOAK);
    ph.min_healthy = 2;
    let mut r = Rollout::start(plan(vec![ph, Phase::percent(100.0, SOAK)]), T0).unwrap();
    r.handle_timeout(T0 + 5 * SOAK);
    assert_eq!(r.phase(), 0);
    r.handle_report(T0 + 5 * SOAK, beta[0].clone(), ModelVersion(2), VersionReport::Active);
    r.handle_report(T0 + 5 * SOAK, beta[1].clone(), ModelVersion(2), VersionReport::Healthy);
    r.handle_timeout(T0 + 5 * SOAK + 1);
    assert_eq!(r.phase(), 1);
}

#[test]
fn state_serializes_mid_rollout() {
    let mut r = standard();
    r.handle_timeout(T0 + SOAK);
    let d = device_in_phase(&r, 0);
    r.handle_report(T0 + SOAK, d.clone(), ModelVersion(2), VersionReport::Verified);
    r.pause(T0 + SOAK + 5).unwrap();
    // The device records travel apart from the rollout (a store keeps one key per device).
    let json = serde_json::to_string(&r).unwrap();
    let records = serde_json::to_string(r.devices()).unwrap();
    let header: Rollout = serde_json::from_str(&json).unwrap();
    assert!(header.devices().is_empty(), "records are not in the rollout's own serialization");
    let mut back = header.with_records(serde_json::from_str::<std::collections::BTreeMap<_, _>>(&records).unwrap());
    assert_eq!(back, r);
    back.resume(T0 + 2 * SOAK).unwrap();
    r.resume(T0 + 2 * SOAK).unwrap();
    assert_eq!(back.poll_timeout(), r.poll_timeout());
    assert_eq!(events(&mut back), events(&mut r));
}

#[test]
fn invalid_plans_are_refused() {
    assert!(matches!(Rollout::start(plan(vec![]), T0), Err(RolloutError::InvalidPlan(_))));
    assert!(matches!(Rollout::start(plan(vec![Phase::percent(0.0, 1)]), T0), Err(RolloutError::InvalidPlan(_))));
    assert!(matches!(Rollout::start(plan(vec![Phase::percent(101.0, 1)]), T0), Err(RolloutError::InvalidPlan(_))));
    let mut p = plan(vec![Phase::percent(100.0, 1)]);
    p.previous = Some(p.target);
    assert!(matches!(Rollout::start(p, T0), Err(RolloutError::InvalidPlan(_))));
}

#[test]
fn a_one_device_canary_that_fails_aborts_the_rollout_below_min_sample() {
    // min_sample 5 can never be reached by a one-device canary: once every named device has an
    // outcome, the rollout is judged on what it has instead of waiting forever.
    let canary = dev(0);
    let mut ph = Phase::cohort("canary", [canary.clone()], SOAK);
    ph.min_healthy = 1;
    let mut r = Rollout::start(plan(vec![ph, Phase::percent(100.0, SOAK)]), T0).unwrap();
    events(&mut r);
    r.handle_report(T0 + 10, canary, ModelVersion(2), VersionReport::Failed { reason: "health check".into() });
    assert_eq!(r.status(), Status::Aborted);
    assert_eq!(events(&mut r), vec![Event::AutoAborted { phase: 0, failure_rate: 1.0, failed: 1, reporting: 1 }]);
    assert_eq!(r.poll_timeout(), None);
}

#[test]
fn a_named_audience_that_can_no_longer_meet_min_healthy_stalls() {
    let beta: Vec<DeviceId> = (0..10).map(dev).collect();
    let mut ph = Phase::cohort("beta", beta.clone(), SOAK);
    ph.min_healthy = 10;
    let mut r = Rollout::start(plan(vec![ph, Phase::percent(100.0, SOAK)]), T0).unwrap();
    events(&mut r);
    r.handle_report(T0 + 10, beta[0].clone(), ModelVersion(2), VersionReport::Healthy);
    assert_eq!(r.status(), Status::Running);
    // One failure of ten is under the failure threshold's sample, but nine devices can no
    // longer make ten healthy.
    r.handle_report(T0 + 20, beta[1].clone(), ModelVersion(2), VersionReport::RolledBack { reason: "crash".into() });
    assert_eq!(r.status(), Status::Aborted);
    assert_eq!(events(&mut r), vec![Event::Stalled { phase: 0, healthy: 1, min_healthy: 10, failed: 1 }]);
}

#[test]
fn a_phase_past_its_deadline_without_enough_healthy_devices_stalls() {
    let mut ph = Phase::percent(10.0, SOAK);
    ph.min_healthy = 3;
    ph.deadline_ms = 5 * SOAK;
    let mut r = Rollout::start(plan(vec![ph, Phase::percent(100.0, SOAK)]), T0).unwrap();
    events(&mut r);
    let d = device_in_phase(&r, 0);
    r.handle_report(T0 + SOAK, d, ModelVersion(2), VersionReport::Healthy);
    r.handle_timeout(T0 + 5 * SOAK - 1);
    assert_eq!((r.status(), r.phase()), (Status::Running, 0));
    // Paused time does not count toward the deadline, as it does not count toward the soak.
    r.pause(T0 + 5 * SOAK - 1).unwrap();
    r.resume(T0 + 9 * SOAK).unwrap();
    r.handle_timeout(T0 + 9 * SOAK);
    assert_eq!(r.status(), Status::Running);
    r.handle_timeout(T0 + 9 * SOAK + 1);
    assert_eq!(r.status(), Status::Aborted);
    assert_eq!(
        events(&mut r),
        vec![Event::Paused { phase: 0 }, Event::Resumed { phase: 0 }, Event::Stalled { phase: 0, healthy: 1, min_healthy: 3, failed: 0 },]
    );
}

#[test]
fn a_deadline_shorter_than_the_soak_is_refused() {
    let mut ph = Phase::percent(10.0, SOAK);
    ph.deadline_ms = SOAK - 1;
    assert!(matches!(Rollout::start(plan(vec![ph]), T0), Err(RolloutError::InvalidPlan(m)) if m.contains("deadline")));
}

/// Issue 31: a rollout that failed on every device of a small fleet completed and moved
/// `stable`, because `min_sample` (5) was larger than the audience (3) and `min_healthy` was 0.
/// The phase gate judges the outcomes it has, however few.
#[test]
fn a_phase_whose_few_reports_all_failed_never_completes() {
    let mut r = Rollout::start(plan(vec![Phase::percent(34.0, SOAK), Phase::percent(100.0, SOAK)]), T0).unwrap();
    events(&mut r);
    let audience: Vec<DeviceId> = (0..).map(dev).filter(|d| r.first_phase(d) == Some(0)).take(3).collect();
    for d in &audience {
        r.handle_report(T0 + 1, d.clone(), ModelVersion(2), VersionReport::RolledBack { reason: "holdout accuracy 0.0 is worse".into() });
    }
    assert!(events(&mut r).is_empty(), "below min_sample: no early abort while soaking");
    r.handle_timeout(T0 + SOAK);
    let evs = events(&mut r);
    assert!(matches!(evs.as_slice(), [Event::AutoAborted { phase: 0, failed: 3, reporting: 3, .. }]), "{evs:?}");
    assert_eq!(r.status(), Status::Aborted);
    assert!(!evs.iter().any(|e| matches!(e, Event::SetAlias { .. })), "the alias never moves");
    // A device that never took part is sent the previous version, not the broken one.
    let newcomer = (0..).map(dev).find(|d| r.first_phase(d) == Some(1)).unwrap();
    assert_eq!(r.assignment(&newcomer, T0 + SOAK).version, Some(ModelVersion(1)));
}

/// The gate lets a phase through when its few reports are within the threshold.
#[test]
fn a_phase_whose_few_reports_are_healthy_advances() {
    let mut r = Rollout::start(plan(vec![Phase::percent(34.0, SOAK), Phase::percent(100.0, SOAK)]), T0).unwrap();
    events(&mut r);
    let d = device_in_phase(&r, 0);
    r.handle_report(T0 + 1, d, ModelVersion(2), VersionReport::Healthy);
    r.handle_timeout(T0 + SOAK);
    assert_eq!(events(&mut r), vec![Event::PhaseAdvanced { phase: 1, at: T0 + SOAK }]);
}
