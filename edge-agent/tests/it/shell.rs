//! The tokio shell with real training on digits partitions and the in-memory services.

use fedfleet_agent::inference::{self, Request};
use fedfleet_learning::evaluate;
use fedfleet_protocol::{DType, RoundConfig};
use fedfleet_testkit::fakes::UploadFault;
use fedfleet_testkit::sim::SimFleet;

fn round_config() -> RoundConfig {
    RoundConfig { local_epochs: 2, batch_size: 16, learning_rate: 0.1, quantization: DType::F16, ..Default::default() }
}

/// `req` on the endpoint at `sock`, once it listens (the server task was just spawned).
async fn query_once_listening(sock: &std::path::Path, req: &impl serde::Serialize) -> inference::Response {
    for _ in 0..100 {
        if let Ok(r) = inference::query(sock, req).await {
            return r;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("the endpoint at {} never answered", sock.display());
}

#[tokio::test]
async fn fleet_trains_uploads_aggregates_and_rolls_out() {
    let dir = tempfile::tempdir().unwrap();
    let mut fleet = SimFleet::new(dir.path(), 2, 3).unwrap();
    let before = evaluate(&fleet.spec, &fleet.global, &fleet.test).unwrap().accuracy;
    let s = fleet.run_round(1, round_config()).await.unwrap();
    assert_eq!(s.updates, 2, "{s:?}");
    assert_eq!(s.activated, 2, "{s:?}");
    assert!(s.test_accuracy > before, "accuracy {before} -> {}", s.test_accuracy);
    for a in &fleet.agents {
        assert_eq!(a.core().active().unwrap().model, s.model);
        assert!(a.core().store().outbox().unwrap().is_empty());
    }

    // The local endpoint serves the newly active model.
    let sock = dir.path().join("agent.sock");
    let serving = fleet.agents[0].serving();
    assert_eq!(serving.get().unwrap().model, s.model);
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let path = sock.clone();
    let server = tokio::spawn(async move {
        inference::serve_unix(&path, serving, fedfleet_learning::Normalization::None, async {
            let _ = rx.await;
        })
        .await
    });
    let rows: Vec<Vec<f32>> = (0..3).map(|i| fleet.test.example(i).to_vec()).collect();
    let resp = query_once_listening(&sock, &Request { inputs: rows.clone(), feedback: false }).await;
    assert_eq!(resp.error, None);
    assert_eq!(resp.predictions.len(), 3);
    assert_eq!(resp.model.unwrap(), s.model);
    let bad = inference::query(&sock, &Request { inputs: vec![vec![1.0; 3]], feedback: false }).await.unwrap();
    assert!(bad.error.unwrap().contains("model takes 64"));
    tx.send(()).unwrap();
    server.await.unwrap().unwrap();
}

#[tokio::test]
async fn lost_receipts_and_resets_still_deliver_exactly_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut fleet = SimFleet::new(dir.path(), 1, 5).unwrap();
    fleet.agg.push_fault(UploadFault::Transport);
    fleet.agg.push_fault(UploadFault::LoseReceipt);
    fleet.agg.set_round(Some(fedfleet_protocol::RoundAnnouncement {
        fleet: fleet.fleet.clone(),
        round: fedfleet_protocol::RoundId(1),
        base_model: fleet.global_ref.clone(),
        config: RoundConfig { quantization: DType::I8, ..round_config() },
        deadline_unix_ms: u64::MAX,
        selection: fedfleet_protocol::Selection::All,
    }));
    fleet.agg.add_base_model(&fleet.spec.to_json(), fleet.global.encode());
    fleet.step().await.unwrap();
    assert_eq!(fleet.agents[0].core().store().outbox().unwrap().len(), 1, "kept until acknowledged");
    for _ in 0..5 {
        let Some(t) = fleet.agents[0].core().poll_timeout() else { break };
        fleet.clock.set(t);
        fleet.agents[0].drive().await.unwrap();
    }
    assert!(fleet.agents[0].core().store().outbox().unwrap().is_empty());
    assert_eq!(fleet.agg.attempts(), 3, "reset, lost receipt, replay");
    let acc = fleet.agg.accepted();
    assert_eq!(acc.len(), 1, "accepted exactly once");
    assert_eq!(acc[0].0.body().payload_dtype, DType::I8);
}

/// A device whose report of an activation no path took (the registry unreachable, no MQTT)
/// sends it again at its next poll, once: otherwise the rollout would wait on it for ever.
#[tokio::test]
async fn a_report_the_registry_did_not_take_is_sent_again_at_the_next_poll_and_only_until_taken() {
    let dir = tempfile::tempdir().unwrap();
    let mut fleet = SimFleet::new(dir.path(), 1, 7).unwrap();
    fleet.reg.fail_reports(usize::MAX);
    let s = fleet.run_round(1, round_config()).await.unwrap();
    assert_eq!(s.activated, 1, "{s:?}");
    assert!(fleet.reg.reports().is_empty(), "every report was lost");

    fleet.reg.fail_reports(0);
    fleet.step().await.unwrap();
    let reports = fleet.reg.reports();
    assert_eq!(reports.len(), 1, "the newest undelivered report only: {reports:?}");
    assert_eq!(reports[0].state.as_str(), "active");
    assert_eq!(reports[0].active.as_ref(), Some(&s.model));

    fleet.step().await.unwrap();
    assert_eq!(fleet.reg.reports().len(), 1, "a delivered report is not sent again");
}

/// A model like `g` with its first tensor moved by `by`: a base no device holds yet.
fn moved(g: &fedfleet_protocol::TensorBundle, by: f32) -> fedfleet_protocol::TensorBundle {
    let mut b = fedfleet_protocol::TensorBundle::new();
    for (i, (name, t)) in g.iter().enumerate() {
        let shift = if i == 0 { by } else { 0.0 };
        b.insert_f32(name, t.shape.clone(), t.to_f32_vec().iter().map(|v| v + shift).collect()).unwrap();
    }
    b
}

/// A round's base comes from the registry that published it, not from the aggregator; one the
/// registry cannot serve comes from the aggregator, which then alone serves bases for a while
/// (a registry that is down costs no round a timeout), and after that the registry again.
#[tokio::test]
async fn a_rounds_base_comes_from_the_registry_and_from_the_aggregator_when_the_registry_cannot_serve_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut fleet = SimFleet::new(dir.path(), 1, 11).unwrap();
    let spec = fleet.spec.to_json();
    let mut round = 0;
    let mut train_on = |fleet: &mut SimFleet, base: &fedfleet_protocol::ModelRef| {
        round += 1;
        fleet.agg.set_round(Some(fedfleet_protocol::RoundAnnouncement {
            fleet: fleet.fleet.clone(),
            round: fedfleet_protocol::RoundId(round),
            base_model: base.clone(),
            config: round_config(),
            deadline_unix_ms: u64::MAX,
            selection: fedfleet_protocol::Selection::All,
        }));
        round
    };
    let trained_on = |fleet: &SimFleet| fleet.agg.accepted().iter().map(|(h, _)| h.body().base_model).collect::<Vec<_>>();

    // Published in the registry only: the aggregator could not have served it.
    let b1 = moved(&fleet.global, 0.01).encode();
    let base1 = fleet.reg.publish("digits", &spec, b1.clone());
    train_on(&mut fleet, &base1);
    fleet.step().await.unwrap();
    assert_eq!(trained_on(&fleet), vec![base1.digest]);
    assert_eq!(fleet.reg.downloaded_bytes(), b1.len() as u64, "the base came from the registry");

    // A version the registry does not have: from the aggregator.
    let b2 = moved(&fleet.global, 0.02).encode();
    let d2 = fleet.agg.add_base_model(&spec, b2);
    let base2 = fedfleet_protocol::ModelRef { name: "digits".into(), version: fedfleet_protocol::ModelVersion(99), digest: d2 };
    train_on(&mut fleet, &base2);
    fleet.step().await.unwrap();
    assert_eq!(trained_on(&fleet), vec![base1.digest, d2]);

    // Both have the next one, but the registry is left alone for a while.
    let b3 = moved(&fleet.global, 0.03).encode();
    let base3 = fleet.reg.publish("digits", &spec, b3.clone());
    fleet.agg.add_base_model(&spec, b3);
    train_on(&mut fleet, &base3);
    fleet.step().await.unwrap();
    assert_eq!(trained_on(&fleet), vec![base1.digest, d2, base3.digest]);
    assert_eq!(fleet.reg.downloaded_bytes(), b1.len() as u64, "round 3's base came from the aggregator");

    // Five minutes later the registry serves bases again.
    fleet.clock.advance(301_000);
    let b4 = moved(&fleet.global, 0.04).encode();
    let base4 = fleet.reg.publish("digits", &spec, b4.clone());
    train_on(&mut fleet, &base4);
    fleet.step().await.unwrap();
    assert_eq!(trained_on(&fleet), vec![base1.digest, d2, base3.digest, base4.digest]);
    assert_eq!(fleet.reg.downloaded_bytes(), (b1.len() + b4.len()) as u64, "round 4's base came from the registry");
}

/// The application pushes labelled examples through the local socket; they are bounded, and the
/// next round trains on them beside the configured data (every 5th held out for health checks).
#[tokio::test]
async fn inbox_examples_pushed_through_the_socket_are_what_the_next_round_trains_on() {
    use fedfleet_agent::inbox::{Example, ExampleShape, Inbox, InboxConfig};
    use fedfleet_agent::inference::Push;
    use fedfleet_protocol::{RoundAnnouncement, RoundId, Selection};

    let dir = tempfile::tempdir().unwrap();
    let mut fleet = SimFleet::new(dir.path(), 1, 3).unwrap();
    let base_train = fleet.agents[0].data().train.len();
    let cfg = InboxConfig { max_examples: 30, max_bytes: 1 << 20, holdout_every: 5, ..InboxConfig::default() };
    let shape = ExampleShape::of(&fleet.agents[0].data().train);
    let inbox = Inbox::open(fleet.agents[0].core().store(), cfg, shape).unwrap();
    fleet.agents[0].set_inbox(inbox.clone(), fedfleet_learning::Normalization::None);

    let sock = dir.path().join("agent.sock");
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let (path, serving, endpoint_inbox) = (sock.clone(), fleet.agents[0].serving(), fleet.agents[0].inbox());
    let server = tokio::spawn(async move {
        inference::serve_unix_with_inbox(&path, serving, fedfleet_learning::Normalization::None, endpoint_inbox, async {
            let _ = rx.await;
        })
        .await
    });
    let examples: Vec<Example> =
        (0..40).map(|i| Example { input: fleet.test.example(i).to_vec(), label: fleet.test.labels[i], target: vec![] }).collect();
    let stats = query_once_listening(&sock, &Push { examples }).await.inbox.expect("push acknowledged");
    assert_eq!((stats.stored, stats.examples, stats.dropped, stats.fresh), (30, 30, 10, 30), "{stats:?}");
    let bad = Push { examples: vec![Example { input: vec![0.0; 63], label: 1, target: vec![] }] };
    let err = inference::query(&sock, &bad).await.unwrap().error.expect("refused");
    assert!(err.contains("example 0: 63 input values, the model takes 64"), "{err}");

    fleet.agg.set_round(Some(RoundAnnouncement {
        fleet: fleet.fleet.clone(),
        round: RoundId(1),
        base_model: fleet.global_ref.clone(),
        config: round_config(),
        deadline_unix_ms: u64::MAX,
        selection: Selection::All,
    }));
    fleet.agg.add_base_model(&fleet.spec.to_json(), fleet.global.encode());
    fleet.step().await.unwrap();
    let accepted = fleet.agg.accepted();
    assert_eq!(accepted.len(), 1);
    // 30 kept (sequence numbers 10..39); 10, 15, ..., 35 held out: 24 trained on.
    assert_eq!(accepted[0].0.body().sample_count, (base_train + 24) as u64);
    assert_eq!(inbox.fresh().unwrap(), 0, "trained on: no longer fresh");
    tx.send(()).unwrap();
    server.await.unwrap().unwrap();
}

/// Every round brings a new base model; a device holds the current one and its slots' models,
/// not every model it ever trained on (its disk would fill round after round).
#[tokio::test]
async fn a_device_keeps_the_current_round_base_and_its_slots_not_every_past_base() {
    let dir = tempfile::tempdir().unwrap();
    let mut fleet = SimFleet::new(dir.path(), 2, 3).unwrap();
    let first_base = fleet.global_ref.digest;
    for round in 1..=5 {
        fleet.run_round(round, round_config()).await.unwrap();
    }
    let store = fleet.agents[0].core().store();
    let blobs: Vec<String> = std::fs::read_dir(store.dir().join("blobs"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| !n.ends_with(".spec.json"))
        .collect();
    // The last round's base (the previous model), the active one, and room for one more.
    assert!(blobs.len() <= 3, "5 rounds left {} blobs: {blobs:?}", blobs.len());
    assert!(!store.has_blob(&first_base) && store.spec(&first_base).is_none(), "round 1's base is gone");
    let st = fleet.agents[0].core().state();
    for m in [&st.active, &st.previous].into_iter().flatten() {
        assert!(store.has_blob(&m.model.digest), "slot model {} kept", m.model.digest);
    }
}

#[tokio::test]
async fn fedbn_batch_norms_stay_on_the_device_and_are_used_for_training_and_inference() {
    use fedfleet_learning::{ModelSpec, Predictor, finetune::overlay_local};
    let spec = ModelSpec::from_json(
        r#"{"arch":"graph","input":[64],"layers":[{"type":"linear","name":"fc1","out_features":32},
            {"type":"batch_norm","name":"bn","local":true},{"type":"relu"},{"type":"linear","name":"fc2","out_features":10}]}"#,
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut fleet = SimFleet::with_spec(dir.path(), 2, 3, spec.clone()).unwrap();
    fleet.run_round(1, round_config()).await.unwrap();
    // The updates leave the batch norm out; each device kept its own.
    let local =
        |fleet: &SimFleet, i: usize| fleet.agents[i].core().store().local_state().unwrap().expect("local tensors kept after training");
    let (a, b) = (local(&fleet, 0), local(&fleet, 1));
    assert_eq!(
        a.layout().keys().cloned().collect::<Vec<_>>(),
        ["bn.bias", "bn.num_batches_tracked", "bn.running_mean", "bn.running_var", "bn.weight"]
    );
    assert_ne!(a.to_f32("bn.running_mean"), fleet.global.to_f32("bn.running_mean"), "the device's statistics moved");
    assert_ne!(a.to_f32("bn.running_mean"), b.to_f32("bn.running_mean"), "each device has its own");
    assert_eq!(fleet.global.to_f32("bn.running_mean"), fedfleet_learning::model::init_bundle(&spec, 3).unwrap().to_f32("bn.running_mean"));

    // The second round starts from the global model with the device's own batch norm, and the
    // installed model serves with it: the device's predictions, not the global model's.
    fleet.run_round(2, round_config()).await.unwrap();
    let a2 = local(&fleet, 0);
    assert!(
        a2.to_f32("bn.num_batches_tracked").unwrap()[0] > a.to_f32("bn.num_batches_tracked").unwrap()[0],
        "round 2 continued from round 1's statistics"
    );
    let served = fleet.agents[0].serving().get().expect("serving the installed model");
    let x = fleet.test.example(0);
    let got = served.predictor.predict(x, 1).unwrap().remove(0);
    let own = Predictor::new(&spec, &overlay_local(&fleet.global, &a2).unwrap()).unwrap().predict(x).unwrap().0;
    let global_only = Predictor::new(&spec, &fleet.global).unwrap().predict(x).unwrap().0;
    assert_eq!(got.probs, own.probs);
    assert_ne!(got.probs, global_only.probs);
}

#[tokio::test]
async fn feedback_on_a_prediction_becomes_an_example_the_next_round_trains_on() {
    use fedfleet_agent::inbox::{ExampleShape, Feedback, Inbox, InboxConfig};
    use fedfleet_agent::inference::FeedbackPush;

    let dir = tempfile::tempdir().unwrap();
    let mut fleet = SimFleet::new(dir.path(), 1, 3).unwrap();
    fleet.run_round(1, round_config()).await.unwrap();
    let base_train = fleet.agents[0].data().train.len();
    let shape = ExampleShape::of(&fleet.agents[0].data().train);
    let inbox = Inbox::open(fleet.agents[0].core().store(), InboxConfig::default(), shape).unwrap();
    fleet.agents[0].set_inbox(inbox, fedfleet_learning::Normalization::None);
    let sock = dir.path().join("agent.sock");
    let (_tx, rx) = tokio::sync::oneshot::channel::<()>();
    let (path, serving, endpoint_inbox) = (sock.clone(), fleet.agents[0].serving(), fleet.agents[0].inbox());
    tokio::spawn(async move {
        inference::serve_unix_with_inbox(&path, serving, fedfleet_learning::Normalization::None, endpoint_inbox, async {
            let _ = rx.await;
        })
        .await
    });

    // The application asks for predictions it may answer later.
    let rows: Vec<Vec<f32>> = (0..3).map(|i| fleet.test.example(i).to_vec()).collect();
    let asked = query_once_listening(&sock, &Request { inputs: rows, feedback: true }).await;
    assert_eq!((asked.error.as_deref(), asked.predictions.len(), asked.ids.clone()), (None, 3, vec![0, 1, 2]));
    let plain = inference::query(&sock, &Request { inputs: vec![fleet.test.example(0).to_vec()], feedback: false }).await.unwrap();
    assert!(plain.ids.is_empty(), "inputs are kept only when asked");
    // It answers two of them with the true label; an unknown id is refused.
    let answers = |ids: &[u64]| FeedbackPush {
        feedback: ids.iter().map(|&id| Feedback { id, label: fleet.test.labels[id as usize], target: vec![] }).collect(),
    };
    let stats = inference::query(&sock, &answers(&[1, 2])).await.unwrap().inbox.expect("feedback stored");
    assert_eq!((stats.stored, stats.examples, stats.fresh), (2, 2, 2));
    let err = inference::query(&sock, &answers(&[9])).await.unwrap().error.expect("refused");
    assert!(err.contains("prediction 9 is unknown"), "{err}");

    // The next round trains on them (the first example of the inbox is held out: 1 of 2).
    fleet.agg.set_round(Some(fedfleet_protocol::RoundAnnouncement {
        fleet: fleet.fleet.clone(),
        round: fedfleet_protocol::RoundId(2),
        base_model: fleet.global_ref.clone(),
        config: round_config(),
        deadline_unix_ms: u64::MAX,
        selection: fedfleet_protocol::Selection::All,
    }));
    fleet.agg.add_base_model(&fleet.spec.to_json(), fleet.global.encode());
    fleet.step().await.unwrap();
    let accepted = fleet.agg.drain_accepted();
    assert_eq!(accepted.len(), 1);
    assert_eq!(accepted[0].0.body().sample_count, (base_train + 1) as u64);
}
