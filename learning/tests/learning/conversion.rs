use crate::bits;
use fedfleet_learning::model::{init_bundle, load_bundle, save_bundle};
use fedfleet_learning::{Dataset, Model, ModelSpec, TrainConfig, sim, train_local};
use fedfleet_protocol::bundle::{BundleLimits, TensorBundle};

fn specs() -> Vec<ModelSpec> {
    vec![
        ModelSpec::digits_mlp(),
        ModelSpec::digits_cnn(),
        ModelSpec::mnist_cnn(),
        ModelSpec::Mlp { input: vec![1, 8, 8], hidden: vec![32, 16], classes: 10 },
    ]
}

#[test]
fn spec_json_round_trip_and_rejections() {
    let s = ModelSpec::from_json(r#"{"arch":"mlp","input":[64],"hidden":[64],"classes":10}"#).unwrap();
    assert_eq!(s, ModelSpec::digits_mlp());
    for spec in specs() {
        assert_eq!(ModelSpec::from_json(&spec.to_json()).unwrap(), spec);
    }
    assert!(ModelSpec::from_json(r#"{"arch":"mlp","input":[64],"hidden":[64],"classes":10,"x":1}"#).is_err());
    assert!(ModelSpec::from_json(r#"{"arch":"rnn","input":[64],"hidden":[64],"classes":10}"#).is_err());
    assert!(ModelSpec::from_json(r#"{"arch":"mlp","input":[64],"hidden":[0],"classes":10}"#).is_err());
    assert!(ModelSpec::from_json(r#"{"arch":"cnn","input":[64],"channels":[4],"hidden":[],"classes":10}"#).is_err());
    assert!(ModelSpec::from_json(r#"{"arch":"mlp","input":[64],"hidden":[],"classes":1}"#).is_err());
}

#[test]
fn parameter_names_and_pytorch_shapes() {
    let l = ModelSpec::digits_mlp().layout();
    let names: Vec<_> = l.iter().map(|(n, s)| format!("{n}{s:?}")).collect();
    assert_eq!(names, ["fc1.bias[64]", "fc1.weight[64, 64]", "fc2.bias[10]", "fc2.weight[10, 64]"]);
    let c = ModelSpec::digits_cnn().layout();
    assert_eq!(c["conv1.weight"], vec![16, 1, 3, 3]);
    assert_eq!(c["conv2.weight"], vec![32, 16, 3, 3]);
    assert_eq!(c["fc1.weight"], vec![64, 32 * 2 * 2]);
    assert_eq!(c["fc2.weight"], vec![10, 64]);
    assert_eq!(ModelSpec::mnist_cnn().layout()["fc1.weight"], vec![128, 32 * 7 * 7]);
    assert_eq!(ModelSpec::digits_mlp().num_params(), 64 * 64 + 64 + 64 * 10 + 10);
}

#[test]
fn round_trip_is_bit_exact_for_every_arch() {
    for spec in specs() {
        let b0 = init_bundle(&spec, 11).unwrap();
        assert_eq!(b0.layout(), spec.layout());
        let m = Model::from_bundle(&spec, &b0).unwrap();
        let b1 = m.to_bundle().unwrap();
        assert_eq!(bits(&b0), bits(&b1), "{}", spec.to_json());
        // through the safetensors codec
        let b2 = TensorBundle::decode(&b1.encode(), &BundleLimits::default()).unwrap();
        assert_eq!(bits(&b0), bits(&b2));
        // init(seed) is the same as from_bundle(init_bundle(seed))
        assert_eq!(bits(&fedfleet_learning::Model::init(&spec, 11).unwrap().to_bundle().unwrap()), bits(&b0));
        assert_ne!(bits(&fedfleet_learning::Model::init(&spec, 12).unwrap().to_bundle().unwrap()), bits(&b0));
    }
}

#[test]
fn trained_weights_survive_a_file_round_trip() {
    let spec = ModelSpec::digits_mlp();
    let (train, _) = Dataset::digits_split().unwrap();
    let g = init_bundle(&spec, 3).unwrap();
    let cfg = TrainConfig { max_steps: Some(5), ..TrainConfig::default() };
    let out = train_local(&spec, &g, &train, &cfg, 1).unwrap();
    let local = sim::apply_delta(&g, &out.delta, 1.0).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    Model::from_bundle(&spec, &local).unwrap().save_safetensors(&path).unwrap();
    let back = Model::load_safetensors(&spec, &path).unwrap().to_bundle().unwrap();
    assert_eq!(bits(&local), bits(&back));
    save_bundle(&local, &path).unwrap();
    assert_eq!(bits(&load_bundle(&path).unwrap()), bits(&local));
    // wrong spec is refused with a layout error naming the tensor
    let err = Model::load_safetensors(&ModelSpec::digits_cnn(), &path).unwrap_err().to_string();
    assert!(err.contains("conv1.weight"), "{err}");
}

/// The file stores linear weights as PyTorch's [out, in]: y = W x + b computed by hand from
/// the bundle must equal burn's forward pass.
#[test]
fn bundle_layout_is_pytorch_out_in() {
    use burn::tensor::{Tensor, TensorData};
    let spec = ModelSpec::Mlp { input: vec![5], hidden: vec![], classes: 3 };
    let b = init_bundle(&spec, 5).unwrap();
    let w = b.to_f32("fc1.weight").unwrap(); // [3, 5]
    let bias = b.to_f32("fc1.bias").unwrap();
    let x = [0.5f32, -1.0, 2.0, 0.25, 1.5];
    let model = Model::from_bundle(&spec, &b).unwrap();
    let y: Vec<f32> = model
        .forward(Tensor::from_data(TensorData::new(x.to_vec(), [1, 5]), model.device()))
        .unwrap()
        .into_data()
        .try_into_vec::<f32>()
        .unwrap();
    for o in 0..3 {
        let manual: f32 = (0..5).map(|i| w[o * 5 + i] * x[i]).sum::<f32>() + bias[o];
        assert!((manual - y[o]).abs() < 1e-5, "{manual} vs {}", y[o]);
    }
}

#[test]
fn layout_mismatch_is_refused() {
    let spec = ModelSpec::digits_mlp();
    let mut b = TensorBundle::new();
    b.insert_f32("fc1.weight", vec![64, 64], vec![0.0; 64 * 64]).unwrap();
    let err = Model::from_bundle(&spec, &b).unwrap_err().to_string();
    assert!(err.contains("missing fc1.bias"), "{err}");
    let other = init_bundle(&ModelSpec::Mlp { input: vec![64], hidden: vec![32], classes: 10 }, 1).unwrap();
    let err = Model::from_bundle(&spec, &other).unwrap_err().to_string();
    assert!(err.contains("fc1.weight has shape [32, 64], expected [64, 64]"), "{err}");
}
