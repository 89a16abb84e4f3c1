//! The durable shell: `DurableLifecycle` writes what the core returns to the sled `AgentStore`
//! (outbox entries put and removed, the state with an activation) and reopens from it after a
//! crash. The core's behaviour is tested without sled in `agent-core/tests/lifecycle.rs`.

use fedfleet_agent::Registry;
use fedfleet_agent::lifecycle::{Action, HealthReport, Input, UploadOutcome};
use fedfleet_protocol::{RejectReason, Rejection};
use fedfleet_testkit::fakes::FakeRegistry;

use crate::support::*;

fn train_and_finish(
    lc: &mut fedfleet_agent::DurableLifecycle,
    round: u64,
    base: &fedfleet_protocol::ModelRef,
    payload: &[u8],
    nonce: u8,
) -> u64 {
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
fn restart_resends_exactly_the_unacknowledged_updates() {
    let dir = tempfile::tempdir().unwrap();
    let (reg, v1) = registry();
    let (a, b, c);
    {
        let mut lc = open(dir.path(), &reg, &v1);
        a = train_and_finish(&mut lc, 1, &v1, b"delta-1", 1);
        b = train_and_finish(&mut lc, 2, &v1, b"delta-2", 2);
        c = train_and_finish(&mut lc, 3, &v1, b"delta-3", 3);
        lc.handle(T0, Input::UploadResult { outbox_id: b, outcome: UploadOutcome::Receipt(receipt(2, b"delta-2", 2)) }).unwrap();
        lc.handle(T0, Input::UploadResult { outbox_id: c, outcome: UploadOutcome::TransportError("down".into()) }).unwrap();
        // crash: dropped without any shutdown
    }
    let mut lc = open(dir.path(), &reg, &v1);
    let acts = drain(&mut lc);
    assert!(matches!(acts[0], Action::Serve { .. }), "{acts:?}");
    assert_eq!(uploads(&acts), vec![a, c]);
    assert!(!acts.iter().any(|x| matches!(x, Action::Train(_))), "finished rounds are not retrained");
    // Round 1's receipt was lost before the crash: the aggregator answers the resend with Replay.
    lc.handle(T0, Input::UploadResult { outbox_id: a, outcome: UploadOutcome::Rejected(Rejection::new(RejectReason::Replay, "seen")) })
        .unwrap();
    lc.handle(T0, Input::UploadResult { outbox_id: c, outcome: UploadOutcome::Receipt(receipt(3, b"delta-3", 3)) }).unwrap();
    assert!(lc.store().outbox().unwrap().is_empty());
    drop(lc);
    let mut lc = open(dir.path(), &reg, &v1);
    assert!(uploads(&drain(&mut lc)).is_empty());
    // Rounds already done are not joined again.
    lc.handle(T0, Input::RoundAnnounced(announcement(3, &v1))).unwrap();
    assert!(drain(&mut lc).is_empty());
}

/// Drives an install of `v2` up to the health check; returns the staged model ref.
async fn install_to_health_check(lc: &mut fedfleet_agent::DurableLifecycle, reg: &FakeRegistry, v2: &fedfleet_protocol::ModelRef) {
    drain(lc);
    lc.handle(T0, Input::Assignment(FakeRegistry::notice(&fleet(), 1, v2))).unwrap();
    let acts = drain(lc);
    assert!(acts.iter().any(|a| matches!(a, Action::FetchMetadata { model, .. } if model == v2)), "{acts:?}");
    let set = reg.metadata(1).await.unwrap();
    lc.handle(T0, Input::Metadata { model: v2.clone(), result: Ok(set) }).unwrap();
    let acts = drain(lc);
    let len = acts.iter().find_map(|a| if let Action::Download { length, .. } = a { Some(*length) } else { None }).expect("download");
    lc.handle(T0, Input::DownloadDone { model: v2.clone(), length: len, digest: v2.digest }).unwrap();
    let acts = drain(lc);
    assert!(acts.iter().any(|a| matches!(a, Action::HealthCheck { candidate, .. } if &candidate.model == v2)), "{acts:?}");
    assert_eq!(lc.staged().map(|m| &m.model), Some(v2));
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

#[tokio::test]
async fn healthy_candidate_is_activated_atomically() {
    let dir = tempfile::tempdir().unwrap();
    let (reg, v1) = registry();
    let v2 = reg.publish("digits", SPEC, b"model v2 bytes".to_vec());
    let mut lc = open(dir.path(), &reg, &v1);
    install_to_health_check(&mut lc, &reg, &v2).await;
    lc.handle(T0, Input::HealthResult { model: v2.clone(), result: Ok(report(0.90, 0.91)) }).unwrap();
    let acts = drain(&mut lc);
    assert!(acts.iter().any(|a| matches!(a, Action::Serve { model, .. } if model.model == v2)));
    let states: Vec<_> = acts.iter().filter_map(|a| if let Action::Report(s) = a { Some(s.state.as_str()) } else { None }).collect();
    assert_eq!(states, vec!["healthy", "active"]);
    assert_eq!(lc.active().unwrap().model, v2);
    assert_eq!(lc.state().previous.as_ref().unwrap().model, v1);
    drop(lc);
    let mut lc = open(dir.path(), &reg, &v1);
    assert_eq!(lc.active().unwrap().model, v2);
    assert!(matches!(drain(&mut lc).as_slice(), [Action::Serve { model, .. }] if model.model == v2));
}
