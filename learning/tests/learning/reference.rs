//! PyTorch interop against the numpy reference fixtures (`tests/fixtures/make_reference.py`):
//! one small model per layer kind, its state_dict written with PyTorch names/layouts/dtypes,
//! fixed inputs and the reference forward pass. Also: two training runs over each model give
//! finite, non-zero deltas, a federated round over each (three devices' deltas in the
//! aggregator's exact fold) gives the same finite aggregate in any order, and export → import →
//! export is byte-identical.

use fedfleet_learning::interop::{export_state_dict, import_state_dict, load_state_dict};
use fedfleet_learning::{Dataset, Model, ModelSpec, TrainConfig, train_local};
use fedfleet_protocol::bundle::{BundleLimits, TensorBundle};
use std::path::PathBuf;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/reference")
}

pub struct Case {
    pub name: String,
    pub spec: ModelSpec,
    pub input: Vec<f32>,
    pub input_shape: Vec<usize>,
    pub output: Vec<f32>,
}

pub fn cases() -> Vec<Case> {
    let index: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir().join("cases.json")).unwrap()).unwrap();
    index
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let name = c["name"].as_str().unwrap().to_string();
            let spec = ModelSpec::from_json(&c["spec"].to_string()).unwrap_or_else(|e| panic!("{name}: {e}"));
            let io = TensorBundle::decode(&std::fs::read(dir().join(format!("{name}.io.safetensors"))).unwrap(), &BundleLimits::default())
                .unwrap();
            let input_shape = io.get("input").unwrap().shape.clone();
            Case { name, spec, input: io.to_f32("input").unwrap(), input_shape, output: io.to_f32("output").unwrap() }
        })
        .collect()
}

#[test]
fn every_layer_kind_matches_the_numpy_reference() {
    let cases = cases();
    assert_eq!(cases.len(), 26);
    for c in &cases {
        let weights = load_state_dict(&c.spec, dir().join(format!("{}.safetensors", c.name))).unwrap_or_else(|e| panic!("{}: {e}", c.name));
        let model = Model::from_bundle(&c.spec, &weights).unwrap();
        let n = c.input_shape[0];
        let p = fedfleet_learning::Predictor::from_model(model);
        let got = p.outputs(&c.input, n).unwrap();
        assert_eq!(got.len(), c.output.len(), "{}", c.name);
        let worst = got.iter().zip(&c.output).map(|(a, b)| (a - b).abs() / b.abs().max(1.0)).fold(0.0f32, f32::max);
        eprintln!("{:<22} max rel error {worst:.2e} over {} values", c.name, got.len());
        assert!(worst <= 1e-5, "{}: max error {worst:e}\n got  {got:?}\n want {:?}", c.name, c.output);
    }
}

#[test]
fn export_import_round_trip_is_byte_identical() {
    for c in cases() {
        let weights = load_state_dict(&c.spec, dir().join(format!("{}.safetensors", c.name))).unwrap();
        let bytes = export_state_dict(&c.spec, &weights).unwrap();
        let again = export_state_dict(&c.spec, &import_state_dict(&c.spec, &bytes).unwrap()).unwrap();
        assert_eq!(bytes, again, "{}", c.name);
        assert_eq!(import_state_dict(&c.spec, &bytes).unwrap(), weights, "{}", c.name);
    }
}

/// The case's inputs repeated to 12 examples, with regression targets near the reference
/// outputs (so the loss has a gradient).
fn training_set(c: &Case) -> Dataset {
    let n = c.input_shape[0];
    let mut features = Vec::new();
    let mut targets = Vec::new();
    for r in 0..4 {
        features.extend_from_slice(&c.input);
        targets.extend(c.output.iter().enumerate().map(|(i, y)| y + 0.1 * ((i + r) % 3) as f32 - 0.1));
    }
    Dataset { features, labels: vec![0; 4 * n], targets, shape: c.input_shape[1..].to_vec(), num_classes: 2 }
}

#[test]
fn two_training_runs_over_each_layer_kind_give_finite_deltas() {
    for c in cases() {
        let weights = load_state_dict(&c.spec, dir().join(format!("{}.safetensors", c.name))).unwrap();
        let data = training_set(&c);
        let cfg = TrainConfig { local_epochs: 2, batch_size: 4, learning_rate: 0.01, ..TrainConfig::default() };
        for seed in [1, 2] {
            let out = train_local(&c.spec, &weights, &data, &cfg, seed).unwrap_or_else(|e| panic!("{}: {e}", c.name));
            assert_eq!(out.delta.layout(), c.spec.update_layout(), "{}", c.name);
            assert!(out.delta.check_finite().is_ok(), "{} seed {seed}: non-finite delta", c.name);
            assert!(out.metrics.delta_norm > 0.0 && out.metrics.delta_norm.is_finite(), "{} seed {seed}", c.name);
        }
    }
}

#[test]
fn a_federated_round_over_each_layer_kind_aggregates_finitely_and_in_any_order() {
    use fedfleet_rounds::strategy::fixed::PartialSum;
    for c in cases() {
        let weights = load_state_dict(&c.spec, dir().join(format!("{}.safetensors", c.name))).unwrap();
        let data = training_set(&c);
        let cfg = TrainConfig { local_epochs: 1, batch_size: 4, learning_rate: 0.01, ..TrainConfig::default() };
        // Three devices: their own seeds and example counts (the FedAvg weights).
        let deltas: Vec<(Vec<f32>, u64)> = [(1, 4), (2, 7), (3, 12)]
            .into_iter()
            .map(|(seed, weight)| {
                let out = train_local(&c.spec, &weights, &data, &cfg, seed).unwrap_or_else(|e| panic!("{}: {e}", c.name));
                let flat: Vec<f32> = out.delta.iter().flat_map(|(_, t)| t.to_f32_vec()).collect();
                (flat, weight)
            })
            .collect();
        let fold = |order: [usize; 3]| {
            let mut sum = PartialSum::new(deltas[0].0.len());
            for i in order {
                sum.fold(&deltas[i].0, deltas[i].1).unwrap_or_else(|e| panic!("{}: {e}", c.name));
            }
            sum.mean().unwrap()
        };
        let (a, b, d) = (fold([0, 1, 2]), fold([2, 0, 1]), fold([1, 2, 0]));
        assert!(a.iter().all(|v| v.is_finite()), "{}: non-finite aggregate", c.name);
        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a), bits(&b), "{}: the aggregate depends on arrival order", c.name);
        assert_eq!(bits(&a), bits(&d), "{}: the aggregate depends on arrival order", c.name);
        assert!(a.iter().any(|v| *v != 0.0), "{}: nothing aggregated", c.name);
    }
}
