//! Pins the exact bits of the MLP and CNN presets (initial weights and one training run), as
//! computed by the code before the layer-graph engine replaced the hand-written modules. Any
//! change to init order, layouts, operations or the training loop shows up here.

use fedfleet_learning::model::init_bundle;
use fedfleet_learning::{Dataset, ModelSpec, OptimizerConfig, TrainConfig, train_local};
use fedfleet_protocol::bundle::TensorBundle;

fn digest(b: &TensorBundle) -> String {
    blake3::hash(&b.encode()).to_hex().to_string()
}

fn golden() -> Vec<(&'static str, String)> {
    let (train, _) = Dataset::digits_split().unwrap();
    let small = train.subset(&(0..256).collect::<Vec<_>>());
    let mlp = ModelSpec::digits_mlp();
    let cnn = ModelSpec::digits_cnn();
    let cnn_data = small.clone().reshaped(vec![1, 8, 8]).unwrap();
    let sgd = TrainConfig { local_epochs: 2, batch_size: 32, learning_rate: 0.05, proximal_mu: 0.01, ..TrainConfig::default() };
    let adam =
        TrainConfig { local_epochs: 1, batch_size: 32, learning_rate: 0.003, optimizer: OptimizerConfig::adam(), ..TrainConfig::default() };
    let g_mlp = init_bundle(&mlp, 7).unwrap();
    let g_cnn = init_bundle(&cnn, 7).unwrap();
    vec![
        ("init mlp 7", digest(&g_mlp)),
        ("init cnn 7", digest(&g_cnn)),
        ("delta mlp sgd+prox", digest(&train_local(&mlp, &g_mlp, &small, &sgd, 1).unwrap().delta)),
        ("delta mlp adam", digest(&train_local(&mlp, &g_mlp, &small, &adam, 2).unwrap().delta)),
        ("delta cnn sgd+prox", digest(&train_local(&cnn, &g_cnn, &cnn_data, &sgd, 1).unwrap().delta)),
        ("delta cnn adam", digest(&train_local(&cnn, &g_cnn, &cnn_data, &adam, 2).unwrap().delta)),
    ]
}

/// Digests computed on commit b47654e (hand-written `Mlp`/`Cnn` modules).
const PINNED: &[(&str, &str)] = &[
    ("init mlp 7", "e04e477fe528e340e4dec2709b9f71935ac09c5605d4001e5be30a88fcf2f770"),
    ("init cnn 7", "776f9a881990d6cb55929d4bdbc350d0e979a1e3a57de1eca0ac9512e6a4c681"),
    ("delta mlp sgd+prox", "01a09f4898698e855c5589bccf27cbe994da1b714020ffe7a9cdd1e825ea74a2"),
    ("delta mlp adam", "0278d7b6daa94fa077fee5a841d48ac7153e6beaef36cf7ef103372682021f03"),
    ("delta cnn sgd+prox", "7fb0a1f4d26078d1502986e74db80344697c909168d9f1f779da5f779ed8ba47"),
    ("delta cnn adam", "50833ae65afff8dc3a7890fde9d5c796cb5a78de35e2fd89b1afb15e7e8161a5"),
];

#[test]
fn presets_are_bit_identical_to_the_original_modules() {
    let got = golden();
    assert_eq!(got.len(), PINNED.len());
    for (name, want) in PINNED {
        let d = &got.iter().find(|(n, _)| n == name).unwrap().1;
        assert_eq!(d, want, "{name}");
    }
}
