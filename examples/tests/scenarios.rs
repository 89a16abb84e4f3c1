//! The examples' scenarios, small: each one's claim on a few agents and rounds (the examples
//! run them at full size; measured figures are in examples/README.md).

use std::time::Duration;

use fedfleet::demo::Ui;
use fedfleet::scenarios::{
    PersonalizeOptions, PoisonedOptions, RolloutScenarioOptions, TransferOptions, personalize, poisoned, rollout_with_abort, transfer,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn robust_strategy_survives_hostile_agents_that_break_fedavg() {
    let o = PoisonedOptions { agents: 10, rounds: 8, strategies: vec!["fedavg".into(), "median".into()], ..Default::default() };
    let rows = poisoned(&o, |_| {}).await.expect("campaigns ran");
    let [clean, fedavg, median] = rows.as_slice() else { panic!("three campaigns: {rows:?}") };
    assert_eq!((clean.hostile, fedavg.hostile, median.hostile), (0, 2, 2), "{rows:?}");
    assert!(rows.iter().all(|r| r.rounds_completed == 8), "{rows:?}");
    assert!(fedavg.final_accuracy < clean.final_accuracy - 0.10, "the attack hurts FedAvg: {rows:?}");
    // Measured: 74 % after 8 rounds (89.7 % clean, 10 % for FedAvg under attack).
    assert!(median.final_accuracy >= 0.60, "the median keeps the model useful: {rows:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn personalized_models_beat_the_global_one_on_local_data() {
    let o = PersonalizeOptions { agents: 8, rounds: 8, ..Default::default() };
    let r = personalize(&o).await.expect("campaign and fine-tuning ran");
    assert!(!r.devices.is_empty());
    let (global, personalized) = r.means();
    assert!(personalized > global, "personalized {personalized} vs global {global}: {r:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_version_is_aborted_and_the_fleet_stays_on_the_good_one() {
    let o = RolloutScenarioOptions { agents: 8, rounds: 4, soak: Duration::from_millis(300), ..Default::default() };
    let r = rollout_with_abort(&o, &Ui::quiet()).await.expect("scenario ran");
    assert_eq!(r.good_rollout, "completed", "{r:#?}");
    assert_eq!(r.broken_rollout, "aborted", "{r:#?}");
    assert!(r.failed_health_checks >= 1, "{r:#?}");
    assert_eq!((r.on_good, r.on_broken), (8, 0), "{r:#?}");
}

/// Bring your own model: a pre-trained model fine-tuned over the real services in three modes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pretrained_model_is_fine_tuned_full_head_only_and_with_lora() {
    let o = TransferOptions { agents: 8, rounds: 6, pretrain_epochs: 4, ..Default::default() };
    let r = transfer(&o, |_| {}).await.expect("pre-training and three campaigns ran");
    let [full, head, lora] = r.rows.as_slice() else { panic!("three modes: {r:#?}") };
    assert!(r.source_accuracy > 0.85, "pre-training worked on its own distribution: {r:#?}");
    // Updates carry only the trainable tensors, and the aggregator folds exactly those.
    assert_eq!((full.trainable, head.trainable), (17_226, 650), "{r:#?}");
    assert!(head.bytes_per_update <= 0.05 * full.bytes_per_update, "{r:#?}");
    assert!(lora.bytes_per_update <= 0.05 * full.bytes_per_update, "{r:#?}");
    for row in &r.rows {
        assert!(row.after > row.before, "{} does not beat the pre-trained model: {r:#?}", row.mode);
        // The registry serves what the campaign trained; it names the version trained from.
        assert_eq!(row.published_accuracy, row.after, "{}", row.mode);
        assert_eq!(row.published.parent.map(|p| p.0), Some(row.published.version.0 - 1), "{}", row.mode);
    }
    // Under LoRA it publishes the merged model (a plain MLP, no adapter tensors) and keeps the
    // lineage: the rank and the weights the adapters were merged into.
    assert_eq!(lora.published.spec["layers"][1]["name"], "fc1");
    assert!(lora.published.spec.get("finetune").is_none(), "{}", lora.published.spec);
    let adapter = lora.published.adapter.as_ref().expect("LoRA lineage recorded");
    assert_eq!(
        (adapter.method.as_str(), adapter.rank, adapter.tensors.clone()),
        ("lora", o.lora_rank as u32, vec!["fc2.weight".to_string(), "fc3.weight".to_string()])
    );
    assert!(full.published.adapter.is_none() && head.published.adapter.is_none());
}
