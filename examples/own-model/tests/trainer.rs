//! The team's trainer on its own: it learns, its update is exactly the spec's update layout, and
//! its weights round-trip through a PyTorch `state_dict` byte for byte. The campaign through the
//! real services is `tests/tests/it/own_model.rs`.

use fedfleet_agent::{ModelView, RoundJob, Trainer};
use fedfleet_example_own_model::{GatedTrainer, accuracy, init_weights, spec};
use fedfleet_learning::{Dataset, sim::apply_delta};
use fedfleet_protocol::RoundConfig;

#[test]
fn the_gated_mlp_learns_digits_and_its_update_is_the_declared_layout() {
    let (train, test) = Dataset::digits_split().unwrap();
    let spec = spec();
    let mut w = init_weights(7);
    let before = accuracy(&w, &test).unwrap();
    let config = RoundConfig { local_epochs: 3, batch_size: 16, learning_rate: 0.2, ..RoundConfig::default() };
    for round in 1..=3u64 {
        let job = RoundJob { round: fedfleet_protocol::RoundId(round), config: &config, seed: round, data: &train };
        let out = GatedTrainer.train(ModelView { spec: &spec, weights: &w }, job).unwrap();
        out.delta.check_layout(&spec.update_layout()).unwrap();
        assert_eq!(out.num_examples, train.len());
        w = apply_delta(&w, &out.delta, 1.0).unwrap();
    }
    let after = accuracy(&w, &test).unwrap();
    assert!(before < 0.3 && after > 0.85, "accuracy {before:.3} -> {after:.3}");

    let bytes = fedfleet_learning::interop::export_state_dict(&spec, &w).unwrap();
    let back = fedfleet_learning::interop::import_pretrained(&spec, &bytes, 0).unwrap();
    assert_eq!(fedfleet_learning::interop::export_state_dict(&spec, &back).unwrap(), bytes);
}
