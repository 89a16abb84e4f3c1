//! The demo end to end, in process, on a small fleet: PKI, registry, aggregator with its
//! embedded MQTT broker, agents over QUIC and MQTT on loopback, a campaign, the centralized
//! baseline, and the canary -> 100 % rollout.

use std::time::Duration;

use fedfleet::demo::{DemoOptions, run};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_fleet_trains_and_rolls_out() {
    let o = DemoOptions {
        agents: 6,
        rounds: 8,
        min_accuracy: 0.85,
        soak: Duration::from_millis(300),
        progress: false,
        baseline_epochs: 5,
        ..DemoOptions::default()
    };
    let r = run(&o).await.expect("demo setup");
    assert!(r.ok(), "demo failures: {:?}\nreport: {r:#?}", r.failures);
    assert_eq!(r.rounds.len(), 8);
    assert!(r.rounds.iter().all(|x| x.version.is_some() && x.participants > 0 && x.bytes_up > 0));
    assert!(r.final_accuracy >= 0.85, "final accuracy {}", r.final_accuracy);
    assert_eq!(r.rollout_status.as_deref(), Some("completed"));
    assert_eq!(r.agents_on_final, 6);
    let v0 = r.initial.as_ref().unwrap().version.0;
    assert_eq!(r.final_model.as_ref().unwrap().version.0, v0 + 8);
    // The control plane: every device seen through its signed MQTT status, rounds heard there.
    assert!(r.mqtt_broker.is_some());
    assert_eq!(r.mqtt_devices.1, 6, "devices known through MQTT presence");
    assert!(r.rounds.iter().any(|x| x.heard_over_mqtt > 0), "no round announcement heard over MQTT");
}

/// `fedfleet demo --pretrained`: the fleet fine-tunes a model pre-trained on MNIST on its own
/// digits; it starts well above chance, ends above where it started, and the fine-tuned model
/// rolls out to every agent through the devices' health checks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pretrained_model_is_fine_tuned_and_rolled_out() {
    let (setup, mnist_accuracy) = fedfleet::scenarios::mnist_pretrained(42, fedfleet::scenarios::PRETRAIN_EPOCHS).unwrap();
    assert!(mnist_accuracy > 0.9, "pre-training reached {mnist_accuracy}");
    let o = DemoOptions {
        agents: 6,
        rounds: 4,
        min_accuracy: 0.9,
        soak: Duration::from_millis(300),
        progress: false,
        baseline_epochs: 5,
        model: Some(setup),
        ..DemoOptions::default()
    };
    let r = run(&o).await.expect("demo setup");
    assert!(r.ok(), "demo failures: {:?}\nreport: {r:#?}", r.failures);
    assert!(r.initial_accuracy > 0.7, "the pre-trained model scores {} on digits", r.initial_accuracy);
    assert!(r.final_accuracy > r.initial_accuracy + 0.05, "{} -> {}", r.initial_accuracy, r.final_accuracy);
    assert_eq!(r.rollout_status.as_deref(), Some("completed"));
    assert_eq!(r.agents_on_final, 6);
}
