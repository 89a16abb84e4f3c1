//! The lifecycle core driven directly: an in-memory disk that applies its writes, a fake clock
//! (plain `u64` times) and a registry that signs real TUF metadata. No sled, no sockets, no
//! training. (edge-agent's `tests/it/lifecycle.rs` keeps the tests of its sled-backed shell.)

mod support;

use fedfleet_agent_core::lifecycle::{
    Action, Conditions, HealthFailure, HealthReport, Input, InstallPhase, MAX_HEALTH_CHECK_STARTS, ROUND_PROGRESS_REPORT_MS, RoundRefusal,
    UploadOutcome,
};
use fedfleet_protocol::{DeviceState, RejectReason, Rejection};

use support::*;

fn train_and_finish(lc: &mut Device, round: u64, base: &fedfleet_protocol::ModelRef, payload: &[u8], nonce: u8) -> u64 {
    lc.handle(T0, Input::RoundAnnounced(announcement(round, base))).unwrap();
    let acts = drain(lc);
    assert!(acts.iter().any(|a| matches!(a, Action::Train(r) if r.round.0 == round)), "{acts:?}");
    let header = signed_update(round, base, payload, nonce);
    lc.handle(T0, Input::TrainingDone { round: fedfleet_protocol::RoundId(round), header, payload: payload.to_vec() }).unwrap();
    let ups = uploads(&drain(lc));
    assert_eq!(ups.len(), 1);
    ups[0]
}

#[test]
fn upload_retried_with_backoff_until_receipt() {
    let disk = Disk::new();
    let (reg, v1) = registry();
    let mut lc = open(&disk, &reg, &v1);
    drain(&mut lc);
    let id = train_and_finish(&mut lc, 1, &v1, b"delta-1", 1);
    let mut now = T0;
    let mut prev_max = 0;
    for attempt in 1..=5u32 {
        lc.handle(now, Input::UploadResult { outbox_id: id, outcome: UploadOutcome::TransportError("reset".into()) }).unwrap();
        assert!(uploads(&drain(&mut lc)).is_empty(), "no immediate retry");
        let at = lc.poll_timeout().expect("retry timer");
        let d = 1_000u64 << (attempt - 1);
        assert!(at - now >= d / 2 && at - now <= d, "attempt {attempt}: delay {} not in [{}, {d}]", at - now, d / 2);
        assert!(d > prev_max || attempt == 1);
        prev_max = d;
        lc.handle_timeout(at - 1);
        assert!(uploads(&drain(&mut lc)).is_empty(), "not before the timer");
        lc.handle_timeout(at);
        assert_eq!(uploads(&drain(&mut lc)), vec![id]);
        now = at;
    }
    // A receipt that does not match the update is not an acknowledgement.
    lc.handle(now, Input::UploadResult { outbox_id: id, outcome: UploadOutcome::Receipt(receipt(1, b"delta-1", 2)) }).unwrap();
    assert_eq!(lc.pending_uploads(), vec![id]);
    assert!(disk.has_outbox_entry(id));
    let at = lc.poll_timeout().unwrap();
    lc.handle_timeout(at);
    assert_eq!(uploads(&drain(&mut lc)), vec![id]);
    lc.handle(at, Input::UploadResult { outbox_id: id, outcome: UploadOutcome::Receipt(receipt(1, b"delta-1", 1)) }).unwrap();
    assert!(lc.pending_uploads().is_empty());
    assert!(disk.outbox_ids().is_empty());
    // Left, unless a retry already passed it: the report that the round was trained.
    if let Some(at) = lc.poll_timeout() {
        assert_eq!(at, T0 + ROUND_PROGRESS_REPORT_MS);
        lc.handle_timeout(at);
        assert!(matches!(drain(&mut lc).as_slice(), [Action::Report(s)] if s.state == DeviceState::Idle));
    }
    assert_eq!(lc.poll_timeout(), None);
}

/// Issue 27: two reports a round from every device were two of the registry's five requests an
/// update. Round progress goes out at most once a minute, carried by the latest status; a
/// failure goes out at once and takes the pending progress with it.
#[test]
fn round_progress_is_reported_at_most_once_a_minute_and_a_failure_at_once() {
    let disk = Disk::new();
    let (reg, v1) = registry();
    let mut lc = open(&disk, &reg, &v1);
    drain(&mut lc);
    let reports = |lc: &mut Device| -> Vec<String> {
        drain(lc).into_iter().filter_map(|a| if let Action::Report(s) = a { Some(s.state.as_str().to_owned()) } else { None }).collect()
    };
    let round = |n: u64| fedfleet_protocol::RoundId(n);
    lc.handle(T0, Input::RoundAnnounced(announcement(1, &v1))).unwrap();
    assert_eq!(reports(&mut lc), ["training"], "the first report goes out at once");
    for (n, at) in [(1, T0 + 1_000), (2, T0 + 3_000)] {
        if n > 1 {
            lc.handle(at - 1_000, Input::RoundAnnounced(announcement(n, &v1))).unwrap();
            assert_eq!(reports(&mut lc), Vec::<String>::new(), "round {n} joined");
        }
        let header = signed_update(n, &v1, b"delta", n as u8);
        lc.handle(at, Input::TrainingDone { round: round(n), header, payload: b"delta".to_vec() }).unwrap();
        assert_eq!(reports(&mut lc), Vec::<String>::new(), "round {n} trained");
        let id = *lc.pending_uploads().last().unwrap();
        lc.handle(at, Input::UploadResult { outbox_id: id, outcome: UploadOutcome::Receipt(receipt(n, b"delta", n as u8)) }).unwrap();
        assert_eq!(reports(&mut lc), Vec::<String>::new(), "round {n} acknowledged");
    }
    let due = T0 + ROUND_PROGRESS_REPORT_MS;
    assert_eq!(lc.poll_timeout(), Some(due));
    lc.handle_timeout(due - 1);
    assert_eq!(reports(&mut lc), Vec::<String>::new());
    lc.handle_timeout(due);
    assert_eq!(reports(&mut lc), ["idle"], "the latest state, once");
    assert_eq!(lc.poll_timeout(), None);
    // Round 3 is joined within the minute: held; its failure is reported at once.
    lc.handle(due + 1_000, Input::RoundAnnounced(announcement(3, &v1))).unwrap();
    assert_eq!(reports(&mut lc), Vec::<String>::new());
    assert_eq!(lc.poll_timeout(), Some(due + ROUND_PROGRESS_REPORT_MS));
    lc.handle(due + 2_000, Input::TrainingFailed { round: round(3), reason: "out of memory".into() }).unwrap();
    assert_eq!(reports(&mut lc), ["failed"]);
    assert_eq!(lc.poll_timeout(), None, "the failure carried the progress");
}

#[test]
fn jitter_is_deterministic_for_a_seed() {
    let run = || {
        let disk = Disk::new();
        let (reg, v1) = registry();
        let mut lc = open(&disk, &reg, &v1);
        let id = train_and_finish(&mut lc, 1, &v1, b"p", 1);
        lc.handle(T0, Input::UploadResult { outbox_id: id, outcome: UploadOutcome::TransportError("x".into()) }).unwrap();
        lc.poll_timeout().unwrap()
    };
    assert_eq!(run(), run());
}

#[test]
fn restart_resends_exactly_the_unacknowledged_updates() {
    let disk = Disk::new();
    let (reg, v1) = registry();
    let (a, b, c);
    {
        let mut lc = open(&disk, &reg, &v1);
        a = train_and_finish(&mut lc, 1, &v1, b"delta-1", 1);
        b = train_and_finish(&mut lc, 2, &v1, b"delta-2", 2);
        c = train_and_finish(&mut lc, 3, &v1, b"delta-3", 3);
        lc.handle(T0, Input::UploadResult { outbox_id: b, outcome: UploadOutcome::Receipt(receipt(2, b"delta-2", 2)) }).unwrap();
        lc.handle(T0, Input::UploadResult { outbox_id: c, outcome: UploadOutcome::TransportError("down".into()) }).unwrap();
        // crash: dropped without any shutdown
    }
    let mut lc = open(&disk, &reg, &v1);
    let acts = drain(&mut lc);
    assert!(matches!(acts[0], Action::Serve { .. }), "{acts:?}");
    assert_eq!(uploads(&acts), vec![a, c]);
    assert!(!acts.iter().any(|x| matches!(x, Action::Train(_))), "finished rounds are not retrained");
    // Round 1's receipt was lost before the crash: the aggregator answers the resend with Replay.
    lc.handle(T0, Input::UploadResult { outbox_id: a, outcome: UploadOutcome::Rejected(Rejection::new(RejectReason::Replay, "seen")) })
        .unwrap();
    lc.handle(T0, Input::UploadResult { outbox_id: c, outcome: UploadOutcome::Receipt(receipt(3, b"delta-3", 3)) }).unwrap();
    assert!(disk.outbox_ids().is_empty());
    drop(lc);
    let mut lc = open(&disk, &reg, &v1);
    assert!(uploads(&drain(&mut lc)).is_empty());
    // Rounds already done are not joined again.
    lc.handle(T0, Input::RoundAnnounced(announcement(3, &v1))).unwrap();
    assert!(drain(&mut lc).is_empty());
}

#[test]
fn crash_during_training_retrains_and_permanent_rejection_drops() {
    let disk = Disk::new();
    let (reg, v1) = registry();
    {
        let mut lc = open(&disk, &reg, &v1);
        lc.handle(T0, Input::RoundAnnounced(announcement(5, &v1))).unwrap();
    }
    let mut lc = open(&disk, &reg, &v1);
    let acts = drain(&mut lc);
    assert!(acts.iter().any(|a| matches!(a, Action::Train(r) if r.round.0 == 5)), "{acts:?}");
    let header = signed_update(5, &v1, b"d", 1);
    lc.handle(T0, Input::TrainingDone { round: fedfleet_protocol::RoundId(5), header, payload: b"d".to_vec() }).unwrap();
    let id = uploads(&drain(&mut lc))[0];
    lc.handle(
        T0,
        Input::UploadResult { outbox_id: id, outcome: UploadOutcome::Rejected(Rejection::new(RejectReason::StaleRound, "closed")) },
    )
    .unwrap();
    assert!(disk.outbox_ids().is_empty());
    let acts = drain(&mut lc);
    assert!(
        acts.iter().any(
            |a| matches!(a, Action::Report(s) if matches!(&s.state, DeviceState::Failed { reason } if reason.contains("stale_round")))
        ),
        "{acts:?}"
    );
}

/// A device whose update is refused as revoked stops training, and still knows it after a
/// restart (it trained every round before, each refused).
#[test]
fn a_device_refused_as_revoked_joins_no_more_rounds_even_after_a_restart() {
    let disk = Disk::new();
    let (reg, v1) = registry();
    {
        let mut lc = open(&disk, &reg, &v1);
        drain(&mut lc);
        let id = train_and_finish(&mut lc, 1, &v1, b"delta-1", 1);
        lc.handle(
            T0,
            Input::UploadResult { outbox_id: id, outcome: UploadOutcome::Rejected(Rejection::new(RejectReason::Revoked, "cam revoked")) },
        )
        .unwrap();
        drain(&mut lc);
        lc.handle(T0, Input::RoundAnnounced(announcement(2, &v1))).unwrap();
        assert!(!drain(&mut lc).iter().any(|a| matches!(a, Action::Train(_))), "trained after being revoked");
    }
    let mut lc = open(&disk, &reg, &v1);
    drain(&mut lc);
    let round = announcement(3, &v1);
    assert_eq!(lc.round_refusal(T0, &round), Some(RoundRefusal::Revoked));
    lc.handle(T0, Input::RoundAnnounced(round)).unwrap();
    assert!(!drain(&mut lc).iter().any(|a| matches!(a, Action::Train(_))), "trained after a restart");
}

#[test]
fn unavailable_base_model_is_asked_again_until_the_deadline() {
    let disk = Disk::new();
    let (reg, v1) = registry();
    let mut lc = open(&disk, &reg, &v1);
    let ann = announcement(7, &v1);
    let deadline = ann.deadline_unix_ms;
    lc.handle(T0, Input::RoundAnnounced(ann)).unwrap();
    assert!(drain(&mut lc).iter().any(|a| matches!(a, Action::Train(r) if r.round.0 == 7)));
    // A transient failure: the round stays in progress and Train comes back after the backoff.
    let round = fedfleet_protocol::RoundId(7);
    lc.handle(T0, Input::BaseModelUnavailable { round, reason: "connection lost".into() }).unwrap();
    assert!(matches!(lc.state().last_state, DeviceState::Training { .. }));
    let at = lc.poll_timeout().expect("a retry is scheduled");
    assert!(at > T0 && at < deadline, "{at}");
    lc.handle_timeout(at - 1);
    assert!(!drain(&mut lc).iter().any(|a| matches!(a, Action::Train(_))), "not before the backoff");
    lc.handle_timeout(at);
    assert!(drain(&mut lc).iter().any(|a| matches!(a, Action::Train(r) if r.round.0 == 7)), "asked again");
    // Once the next ask would land after the deadline, the round is given up with the reason.
    lc.handle(deadline - 1, Input::BaseModelUnavailable { round, reason: "connection lost".into() }).unwrap();
    assert!(lc.state().round.is_none());
    assert!(
        matches!(&lc.state().last_state, DeviceState::Failed { reason } if reason.contains("connection lost")),
        "{:?}",
        lc.state().last_state
    );
    assert_eq!(lc.poll_timeout(), None);
}

/// Issue 27: an upload refused as `overloaded` waits the retry-after the service named, plus
/// the backoff's jitter (so a refused crowd does not come back in lockstep), and stays in the
/// outbox until a receipt.
#[test]
fn an_overloaded_upload_waits_the_named_retry_after_plus_jitter() {
    let disk = Disk::new();
    let (reg, v1) = registry();
    let mut lc = open(&disk, &reg, &v1);
    drain(&mut lc);
    let id = train_and_finish(&mut lc, 1, &v1, b"delta-1", 1);
    let busy = Rejection::new(RejectReason::Overloaded, "268435456 bytes of updates in flight; retry after 5000 ms");
    lc.handle(T0, Input::UploadResult { outbox_id: id, outcome: UploadOutcome::Rejected(busy) }).unwrap();
    let at = lc.poll_timeout().expect("a retry is scheduled");
    // 5 s named, plus the first backoff step's jitter (500..=1000 ms with base 1 s).
    assert!((T0 + 5_500..=T0 + 6_000).contains(&at), "retry at +{} ms", at - T0);
    assert!(disk.has_outbox_entry(id));
    lc.handle_timeout(at);
    assert_eq!(uploads(&drain(&mut lc)), vec![id]);
}

/// Issue 27: a round with a start window is joined at once (the device is training for it and
/// says so) but its training starts at the device's own point in the window, capped at half the
/// time left before the deadline.
#[test]
fn a_round_with_a_start_window_starts_training_at_the_devices_point_in_it() {
    let disk = Disk::new();
    let (reg, v1) = registry();
    let mut lc = open(&disk, &reg, &v1);
    drain(&mut lc);
    let mut a = announcement(1, &v1);
    a.config.start_window_ms = 60_000;
    let offset = a.start_offset_ms(&lc.state().device);
    assert!(offset > 0, "this device's point in a minute's window is not its start");
    lc.handle(T0, Input::RoundAnnounced(a.clone())).unwrap();
    assert!(!drain(&mut lc).iter().any(|x| matches!(x, Action::Train(_))), "not before its point");
    assert_eq!(lc.state().round.as_ref().map(|r| r.round), Some(a.round), "joined at once");
    assert_eq!(lc.poll_timeout(), Some(T0 + offset));
    lc.handle_timeout(T0 + offset - 1);
    assert!(drain(&mut lc).is_empty());
    lc.handle_timeout(T0 + offset);
    assert!(drain(&mut lc).iter().any(|x| matches!(x, Action::Train(r) if r.round == a.round)));

    // Heard late: at most half the time left.
    let mut late = announcement(2, &v1);
    late.config.start_window_ms = 3_600_000;
    late.deadline_unix_ms = T0 + 1_000;
    let mut lc = open(&Disk::new(), &reg, &v1);
    drain(&mut lc);
    lc.handle(T0, Input::RoundAnnounced(late)).unwrap();
    assert!(lc.poll_timeout().is_some_and(|at| at <= T0 + 500), "{:?}", lc.poll_timeout());
}

#[test]
fn participation_conditions_gate_training() {
    let disk = Disk::new();
    let (reg, v1) = registry();
    let mut lc = open(&disk, &reg, &v1);
    drain(&mut lc);
    lc.handle(T0, Input::Conditions(Conditions { idle: false, charging: true, fresh_samples: 10 })).unwrap();
    lc.handle(T0, Input::RoundAnnounced(announcement(1, &v1))).unwrap();
    assert!(drain(&mut lc).is_empty());
    let mut late = announcement(1, &v1);
    late.deadline_unix_ms = T0;
    lc.handle(T0, Input::Conditions(Conditions::default())).unwrap();
    lc.handle(T0, Input::RoundAnnounced(late)).unwrap();
    assert!(drain(&mut lc).is_empty(), "deadline passed");
    lc.handle(T0, Input::RoundAnnounced(announcement(1, &v1))).unwrap();
    assert!(drain(&mut lc).iter().any(|a| matches!(a, Action::Train(_))));
}

/// Issue 31 defect 4: a fresh aggregator counts rounds from 1 again; its rounds are joined, not
/// skipped as done, while a round the device did is still not trained twice.
#[test]
fn a_fresh_aggregator_instance_is_joined_from_its_first_round() {
    let disk = Disk::new();
    let (reg, v1) = registry();
    let mut lc = open(&disk, &reg, &v1);
    drain(&mut lc);
    train_and_finish(&mut lc, 8, &v1, b"round 8", 1);
    assert_eq!(lc.round_refusal(T0, &announcement(8, &v1)), Some(RoundRefusal::AlreadyDone(fedfleet_protocol::RoundId(8))));
    // The fresh instance's round 1 starts from another model: joined (also after a restart).
    let fresh = reg.publish("digits", SPEC, b"fresh instance's initial model".to_vec());
    let mut lc = open(&disk, &reg, &v1);
    drain(&mut lc);
    assert_eq!(lc.round_refusal(T0, &announcement(1, &fresh)), None);
    train_and_finish(&mut lc, 1, &fresh, b"fresh round 1", 2);
    train_and_finish(&mut lc, 2, &fresh, b"fresh round 2", 3);
    assert_eq!(lc.round_refusal(T0, &announcement(2, &fresh)), Some(RoundRefusal::AlreadyDone(fedfleet_protocol::RoundId(2))));
}

/// Drives an install of `v2` up to the health check; returns the staged model ref.
fn install_to_health_check(lc: &mut Device, reg: &Registry, v2: &fedfleet_protocol::ModelRef) {
    drain(lc);
    lc.handle(T0, Input::Assignment(Registry::notice(&fleet(), 1, v2))).unwrap();
    let acts = drain(lc);
    assert!(acts.iter().any(|a| matches!(a, Action::FetchMetadata { model, .. } if model == v2)), "{acts:?}");
    let set = reg.metadata();
    lc.handle(T0, Input::Metadata { model: v2.clone(), result: Ok(set) }).unwrap();
    let acts = drain(lc);
    let len = acts.iter().find_map(|a| if let Action::Download { length, .. } = a { Some(*length) } else { None }).expect("download");
    lc.handle(T0, Input::DownloadDone { model: v2.clone(), length: len, digest: v2.digest }).unwrap();
    let acts = drain(lc);
    assert!(acts.iter().any(|a| matches!(a, Action::HealthCheck { candidate, .. } if &candidate.model == v2)), "{acts:?}");
    assert_eq!(lc.staged().map(|m| &m.model), Some(v2));
}

/// A device on v1 whose install of a newly published v2 waits for its health check: the disk,
/// the registry, v1, v2 and the device.
fn v2_in_health_check() -> (Disk, Registry, fedfleet_protocol::ModelRef, fedfleet_protocol::ModelRef, Device) {
    let disk = Disk::new();
    let (reg, v1) = registry();
    let v2 = reg.publish("digits", SPEC, b"model v2 bytes".to_vec());
    let mut lc = open(&disk, &reg, &v1);
    install_to_health_check(&mut lc, &reg, &v2);
    (disk, reg, v1, v2, lc)
}

fn report(cand: f64, active: f64) -> HealthReport {
    HealthReport {
        holdout: 50,
        non_finite: false,
        latency_p50_ms: 1.0,
        latency_p99_ms: 2.0,
        candidate_score: cand,
        active_score: Some(active),
        chance_score: Some(0.1),
        metric: "accuracy".into(),
    }
}

#[test]
fn healthy_candidate_is_activated_atomically() {
    let (disk, reg, v1, v2, mut lc) = v2_in_health_check();
    lc.handle(T0, Input::HealthResult { model: v2.clone(), result: Ok(report(0.90, 0.91)) }).unwrap();
    let acts = drain(&mut lc);
    assert!(acts.iter().any(|a| matches!(a, Action::Serve { model, .. } if model.model == v2)));
    let states: Vec<_> = acts.iter().filter_map(|a| if let Action::Report(s) = a { Some(s.state.as_str()) } else { None }).collect();
    assert_eq!(states, vec!["healthy", "active"]);
    assert_eq!(lc.active().unwrap().model, v2);
    assert_eq!(lc.state().previous.as_ref().unwrap().model, v1);
    drop(lc);
    let mut lc = open(&disk, &reg, &v1);
    assert_eq!(lc.active().unwrap().model, v2);
    assert!(matches!(drain(&mut lc).as_slice(), [Action::Serve { model, .. }] if model.model == v2));
}

/// Seen in the kill -9 suite: an agent killed right after its activation was committed, before
/// its report left, ran the new model while the registry waited for it; the rollout never ended.
#[test]
fn a_device_restarted_after_activating_reports_it_once_when_it_hears_the_assignment_again() {
    let (disk, reg, v1, v2, mut lc) = v2_in_health_check();
    lc.handle(T0, Input::HealthResult { model: v2.clone(), result: Ok(report(0.90, 0.91)) }).unwrap();
    drop(lc); // killed: the actions, its report among them, never ran
    let mut lc = open(&disk, &reg, &v1);
    drain(&mut lc);
    let reports = |lc: &mut Device| {
        lc.handle(T0, Input::Assignment(Registry::notice(&fleet(), 1, &v2))).unwrap();
        drain(lc)
            .into_iter()
            .filter_map(|a| if let Action::Report(s) = a { Some((s.state.as_str().to_owned(), s.active)) } else { None })
            .collect::<Vec<_>>()
    };
    assert_eq!(reports(&mut lc), vec![("active".to_owned(), Some(v2.clone()))]);
    assert_eq!(reports(&mut lc), vec![], "once per process, not at every poll");
}

#[test]
fn on_a_small_holdout_one_example_worse_is_noise_not_a_regression() {
    // 14 held-out examples at 12/14 for the active model: the candidate's 11/14 is 7 points
    // lower, under one standard error of the difference (14.6 points); 8/14 is beyond it. A
    // perfect 14/14 against 13/14 is noise too.
    let small = |cand: f64, active: f64| HealthReport { holdout: 14, ..report(cand, active) };
    let disk = Disk::new();
    let (reg, v1) = registry();
    let v2 = reg.publish("digits", SPEC, b"model v2 bytes".to_vec());
    let mut lc = open(&disk, &reg, &v1);
    assert_eq!(lc.judge(&small(11.0 / 14.0, 12.0 / 14.0)), Ok(()));
    let refused = lc.judge(&small(8.0 / 14.0, 12.0 / 14.0)).unwrap_err();
    assert!(matches!(refused, HealthFailure::Worse { .. }), "{refused:?}");
    assert!(refused.to_string().contains("worse than the active model's 0.8571 by more than 0.1578"), "{refused}");
    assert_eq!(lc.judge(&small(13.0 / 14.0, 1.0)), Ok(()));
    install_to_health_check(&mut lc, &reg, &v2);
    lc.handle(T0, Input::HealthResult { model: v2.clone(), result: Ok(small(11.0 / 14.0, 12.0 / 14.0)) }).unwrap();
    drain(&mut lc);
    assert_eq!(lc.active().unwrap().model, v2);
}

#[test]
fn a_first_install_that_answers_worse_than_guessing_is_refused() {
    // A device with no model yet has nothing to compare a candidate with: the floor is what
    // guessing scores (10 classes: 0.1), judged with the same standard error. Classes swapped
    // (nothing right on 50 examples) is refused; an untrained model's 3 of 50 is chance, not
    // a fault; the floor holds beside an active model too.
    let first = |cand: f64| HealthReport { active_score: None, ..report(cand, 0.0) };
    let disk = Disk::new();
    let (reg, _) = registry();
    let v2 = reg.publish("digits", SPEC, b"model v2 bytes".to_vec());
    let mut lc = Device::open(core_cfg(), &disk, Some(reg.pinned_root()), None, T0).unwrap();
    let refused = lc.judge(&first(0.0)).unwrap_err();
    assert!(matches!(refused, HealthFailure::BelowChance { .. }), "{refused:?}");
    assert!(refused.to_string().contains("accuracy 0.0000 is below guessing's 0.1000 by more than 0.0482"), "{refused}");
    assert_eq!(lc.judge(&first(3.0 / 50.0)), Ok(()));
    assert_eq!(lc.judge(&first(0.9)), Ok(()));
    assert!(matches!(lc.judge(&report(0.0, 0.0)), Err(HealthFailure::BelowChance { .. })));
    // Through the lifecycle: the broken first install is rolled back, nothing is served.
    install_to_health_check(&mut lc, &reg, &v2);
    lc.handle(T0, Input::HealthResult { model: v2.clone(), result: Ok(first(0.0)) }).unwrap();
    let acts = drain(&mut lc);
    assert!(
        acts.iter().any(|a| matches!(a, Action::Rollback { model, reason } if model == &v2 && reason.contains("below guessing"))),
        "{acts:?}"
    );
    assert!(!acts.iter().any(|a| matches!(a, Action::Serve { .. })), "{acts:?}");
    assert!(lc.active().is_none());
}

#[test]
fn health_check_failure_rolls_back_and_reports() {
    let disk = Disk::new();
    let (reg, v1) = registry();
    let v2 = reg.publish("digits", SPEC, b"model v2 bytes".to_vec());
    let mut lc = open(&disk, &reg, &v1);
    install_to_health_check(&mut lc, &reg, &v2);
    lc.handle(T0, Input::HealthResult { model: v2.clone(), result: Ok(report(0.80, 0.90)) }).unwrap();
    let acts = drain(&mut lc);
    assert!(
        acts.iter().any(|a| matches!(a, Action::Rollback { model, reason } if model == &v2 && reason.contains("accuracy"))),
        "{acts:?}"
    );
    assert!(acts.iter().any(|a| matches!(a, Action::Report(s) if matches!(&s.state, DeviceState::RolledBack { reason } if reason.contains("worse than the active")))), "{acts:?}");
    // The report names the failed candidate, so the registry counts the failure against it.
    assert!(acts.iter().any(|a| matches!(a, Action::Report(s) if matches!(s.state, DeviceState::RolledBack { .. }) && s.staged.as_ref() == Some(&v2) && s.active.as_ref() == Some(&v1))), "{acts:?}");
    assert!(!acts.iter().any(|a| matches!(a, Action::Serve { .. })));
    assert_eq!(lc.active().unwrap().model, v1);
    assert!(lc.staged().is_none());
    // The same rollout is not retried; the state survives a restart.
    lc.handle(T0, Input::Assignment(Registry::notice(&fleet(), 1, &v2))).unwrap();
    assert!(!drain(&mut lc).iter().any(|a| matches!(a, Action::FetchMetadata { .. })));
    drop(lc);
    let lc = open(&disk, &reg, &v1);
    assert_eq!(lc.active().unwrap().model, v1);
    assert!(lc.state().install.is_none());

    // Other failures: NaN outputs, latency, failing to load.
    let disk = Disk::new();
    let mut lc = open(&disk, &reg, &v1);
    for (i, (res, why)) in [
        (Ok(HealthReport { non_finite: true, ..report(0.9, 0.9) }), "NaN"),
        (Ok(HealthReport { latency_p99_ms: 500.0, ..report(0.9, 0.9) }), "latency"),
        (Err("does not load: bundle: truncated".to_string()), "does not load"),
    ]
    .into_iter()
    .enumerate()
    {
        let v = reg.publish("digits", SPEC, format!("candidate {i}").into_bytes());
        install_to_health_check(&mut lc, &reg, &v);
        lc.handle(T0, Input::HealthResult { model: v.clone(), result: res }).unwrap();
        let acts = drain(&mut lc);
        assert!(acts.iter().any(|a| matches!(a, Action::Rollback { reason, .. } if reason.contains(why))), "{why}: {acts:?}");
        assert_eq!(lc.active().unwrap().model, v1);
    }
}

#[test]
fn crash_between_staging_and_activation_keeps_the_old_model_active() {
    let disk = Disk::new();
    let (reg, v1) = registry();
    let v2 = reg.publish("digits", SPEC, b"model v2 bytes".to_vec());
    {
        let mut lc = open(&disk, &reg, &v1);
        install_to_health_check(&mut lc, &reg, &v2);
        // crash: the health result never arrives
    }
    let mut lc = open(&disk, &reg, &v1);
    assert_eq!(lc.active().unwrap().model, v1);
    assert_eq!(lc.state().install.as_ref().unwrap().phase, InstallPhase::Staged);
    let acts = drain(&mut lc);
    assert!(matches!(&acts[0], Action::Serve { model, .. } if model.model == v1), "{acts:?}");
    assert!(
        acts.iter().any(|a| matches!(a, Action::HealthCheck { candidate, .. } if candidate.model == v2)),
        "re-checked, not activated: {acts:?}"
    );
    assert!(!acts.iter().any(|a| matches!(a, Action::Serve { model, .. } if model.model == v2)));
}

#[test]
fn a_health_check_that_kills_the_agent_is_given_up_after_a_bounded_number_of_starts() {
    let disk = Disk::new();
    let (reg, v1) = registry();
    let v2 = reg.publish("digits", SPEC, b"model v2 bytes".to_vec());
    {
        let mut lc = open(&disk, &reg, &v1);
        install_to_health_check(&mut lc, &reg, &v2);
        // The check takes the agent down (e.g. out of memory): no result, ever.
    }
    // Each start counts the check before it runs; the candidate is checked again...
    for start in 2..=MAX_HEALTH_CHECK_STARTS {
        let mut lc = open(&disk, &reg, &v1);
        let acts = drain(&mut lc);
        assert!(
            acts.iter().any(|a| matches!(a, Action::HealthCheck { candidate, .. } if candidate.model == v2)),
            "start {start}: {acts:?}"
        );
        assert_eq!(lc.state().install.as_ref().unwrap().health_checks_started, start);
    }
    // ...until the bound: then it is given up, reported as rolled back, and the old model serves on.
    let mut lc = open(&disk, &reg, &v1);
    let acts = drain(&mut lc);
    assert!(!acts.iter().any(|a| matches!(a, Action::HealthCheck { .. })), "{acts:?}");
    let given_up = |r: &str| r.contains("health check started 3 times without finishing");
    assert!(acts.iter().any(|a| matches!(a, Action::Rollback { reason, .. } if given_up(reason))), "{acts:?}");
    assert!(
        acts.iter().any(|a| matches!(a, Action::Report(s) if s.staged.as_ref() == Some(&v2)
            && matches!(&s.state, DeviceState::RolledBack { reason } if given_up(reason)))),
        "{acts:?}"
    );
    assert_eq!(lc.active().unwrap().model, v1);
    assert!(lc.state().install.is_none());
    let lc = open(&disk, &reg, &v1);
    assert!(lc.state().install.is_none(), "given up for good");
}

#[test]
fn unverifiable_manifest_is_never_staged() {
    let disk = Disk::new();
    let (reg, v1) = registry();
    let v2 = reg.publish("digits", SPEC, b"model v2 bytes".to_vec());
    let mut lc = open(&disk, &reg, &v1);
    drain(&mut lc);

    // 1. Targets signed by an untrusted key.
    reg.forge_targets(true);
    lc.handle(T0, Input::Assignment(Registry::notice(&fleet(), 1, &v2))).unwrap();
    drain(&mut lc);
    let set = reg.metadata();
    lc.handle(T0, Input::Metadata { model: v2.clone(), result: Ok(set) }).unwrap();
    let acts = drain(&mut lc);
    assert!(!acts.iter().any(|a| matches!(a, Action::Download { .. } | Action::HealthCheck { .. })), "{acts:?}");
    assert!(
        acts.iter().any(
            |a| matches!(a, Action::Report(s) if matches!(&s.state, DeviceState::Failed { reason } if reason.contains("metadata refused")))
        ),
        "{acts:?}"
    );
    assert!(lc.staged().is_none());
    reg.forge_targets(false);

    // 2. An assignment whose digest differs from the signed targets.
    let mut fake = v2.clone();
    fake.digest = fedfleet_protocol::Digest::of(b"evil");
    lc.handle(T0, Input::Assignment(Registry::notice(&fleet(), 2, &fake))).unwrap();
    drain(&mut lc);
    lc.handle(T0, Input::Metadata { model: fake.clone(), result: Ok(reg.metadata()) }).unwrap();
    let acts = drain(&mut lc);
    assert!(!acts.iter().any(|a| matches!(a, Action::Download { .. })), "{acts:?}");
    assert!(lc.staged().is_none());

    // 3. Expired metadata (freeze).
    let disk2 = Disk::new();
    let old = Registry::new(1, T0 - 1);
    let o1 = old.publish("digits", SPEC, b"a".to_vec());
    let o2 = old.publish("digits", SPEC, b"b".to_vec());
    let mut lc2 = open(&disk2, &old, &o1);
    drain(&mut lc2);
    lc2.handle(T0, Input::Assignment(Registry::notice(&fleet(), 1, &o2))).unwrap();
    drain(&mut lc2);
    lc2.handle(T0, Input::Metadata { model: o2.clone(), result: Ok(old.metadata()) }).unwrap();
    assert!(!drain(&mut lc2).iter().any(|a| matches!(a, Action::Download { .. })));

    // 4. Verified metadata, but the downloaded bytes differ: refused, discarded, not staged.
    lc.handle(T0, Input::Assignment(Registry::notice(&fleet(), 3, &v2))).unwrap();
    drain(&mut lc);
    lc.handle(T0, Input::Metadata { model: v2.clone(), result: Ok(reg.metadata()) }).unwrap();
    let acts = drain(&mut lc);
    let len = acts.iter().find_map(|a| if let Action::Download { length, .. } = a { Some(*length) } else { None }).unwrap();
    lc.handle(T0, Input::DownloadDone { model: v2.clone(), length: len, digest: fedfleet_protocol::Digest::of(b"tampered") }).unwrap();
    let acts = drain(&mut lc);
    assert!(acts.iter().any(|a| matches!(a, Action::Discard { .. })));
    assert!(!acts.iter().any(|a| matches!(a, Action::HealthCheck { .. })), "{acts:?}");
    assert!(lc.staged().is_none());
    assert_eq!(lc.active().unwrap().model, v1);
}

/// A device on v1 assigned v2, its metadata verified: downloading v2.
fn downloading_v2(disk: &Disk) -> (Device, fedfleet_protocol::ModelRef) {
    let (reg, v1) = registry();
    let v2 = reg.publish("digits", SPEC, b"model v2 bytes".to_vec());
    let mut lc = open(disk, &reg, &v1);
    drain(&mut lc);
    lc.handle(T0, Input::Assignment(Registry::notice(&fleet(), 1, &v2))).unwrap();
    drain(&mut lc);
    lc.handle(T0, Input::Metadata { model: v2.clone(), result: Ok(reg.metadata()) }).unwrap();
    drain(&mut lc);
    (lc, v2)
}

#[test]
fn failed_downloads_are_retried_then_given_up() {
    let disk = Disk::new();
    let (mut lc, v2) = downloading_v2(&disk);
    let mut now = T0;
    for _ in 0..4 {
        lc.handle(now, Input::DownloadFailed { model: v2.clone(), reason: "reset".into() }).unwrap();
        now = lc.poll_timeout().expect("retry scheduled");
        lc.handle_timeout(now);
        assert!(drain(&mut lc).iter().any(|a| matches!(a, Action::Download { .. })));
    }
    lc.handle(now, Input::DownloadFailed { model: v2.clone(), reason: "reset".into() }).unwrap();
    let acts = drain(&mut lc);
    assert!(
        acts.iter().any(
            |a| matches!(a, Action::Report(s) if matches!(&s.state, DeviceState::Failed { reason } if reason.contains("after 5 attempts")))
        ),
        "{acts:?}"
    );
    assert!(lc.state().install.is_none());
}

#[test]
fn a_registry_turning_downloads_away_for_load_defers_the_install_without_failing_it() {
    let disk = Disk::new();
    let (mut lc, v2) = downloading_v2(&disk);
    let overloaded = || fedfleet_protocol::reject::overloaded_detail("registry refused (overloaded): admission", 2_000);
    // Far more refusals than the install's five attempts: none counts, each waits its retry-after.
    let mut now = T0;
    for _ in 0..20 {
        lc.handle(now, Input::DownloadFailed { model: v2.clone(), reason: overloaded() }).unwrap();
        let acts = drain(&mut lc);
        assert!(!acts.iter().any(|a| matches!(a, Action::Report(s) if matches!(s.state, DeviceState::Failed { .. }))), "{acts:?}");
        let next = lc.poll_timeout().expect("come-back scheduled");
        assert!(next >= now + 2_000, "came back {} ms later, before the retry-after", next - now);
        now = next;
        lc.handle_timeout(now);
        assert!(drain(&mut lc).iter().any(|a| matches!(a, Action::Download { .. })));
    }
    assert_eq!(lc.state().install.as_ref().map(|j| j.attempts), Some(0));
    lc.handle(now, Input::DownloadDone { model: v2.clone(), length: 14, digest: fedfleet_protocol::Digest::of(b"model v2 bytes") })
        .unwrap();
    assert!(drain(&mut lc).iter().any(|a| matches!(a, Action::HealthCheck { .. })));
}

#[test]
fn a_clock_stepped_back_does_not_make_expired_metadata_fresh_again() {
    const HOUR: u64 = 3_600_000;
    let disk = Disk::new();
    let reg = Registry::new(1, T0 + HOUR);
    let v1 = reg.publish("digits", SPEC, b"model v1 bytes".to_vec());
    let v2 = reg.publish("digits", SPEC, b"model v2 bytes".to_vec());
    let try_install = |lc: &mut Device, now: u64, rollout: u64, set| {
        lc.handle(now, Input::Assignment(Registry::notice(&fleet(), rollout, &v2))).unwrap();
        drain(lc);
        lc.handle(now, Input::Metadata { model: v2.clone(), result: Ok(set) }).unwrap();
        drain(lc)
    };
    let expired = |acts: &[Action]| {
        !acts.iter().any(|a| matches!(a, Action::Download { .. }))
            && acts
                .iter()
                .any(|a| matches!(a, Action::Report(s) if matches!(&s.state, DeviceState::Failed { reason } if reason.contains("expired"))))
    };
    {
        let mut lc = open(&disk, &reg, &v1);
        drain(&mut lc);
        // Two hours on, the metadata (expiring an hour after T0) is refused.
        let acts = try_install(&mut lc, T0 + 2 * HOUR, 1, reg.metadata());
        assert!(expired(&acts), "{acts:?}");
        // The clock steps back a day: still expired.
        let acts = try_install(&mut lc, T0 - 24 * HOUR, 2, reg.metadata());
        assert!(expired(&acts), "{acts:?}");
    }
    // And after a restart on the stepped-back clock.
    let mut lc = open(&disk, &reg, &v1);
    drain(&mut lc);
    assert_eq!(lc.state().latest_time, T0 + 2 * HOUR);
    let acts = try_install(&mut lc, T0 - 24 * HOUR, 3, reg.metadata());
    assert!(expired(&acts), "{acts:?}");
    assert_eq!(lc.active().unwrap().model, v1);
}
