//! The layer-graph description: JSON, validation errors, presets as graphs, tasks, fine-tuning
//! modes, FedBN-local batch norms and state_dict mismatch reports.

use crate::bits;
use fedfleet_learning::finetune::{attach_adapters, base_spec, merge_lora, overlay_local};
use fedfleet_learning::interop::{export_state_dict, import_state_dict};
use fedfleet_learning::model::init_bundle;
use fedfleet_learning::{
    Dataset, LearningError, Model, ModelSpec, OptimizerConfig, Predictor, Task, TensorRole, TrainConfig, evaluate, sim, train_local,
};
use fedfleet_protocol::bundle::TensorBundle;

fn graph(json: &str) -> Result<ModelSpec, LearningError> {
    ModelSpec::from_json(json).map_err(Into::into)
}

fn err(json: &str) -> String {
    match graph(json) {
        Ok(_) => panic!("accepted: {json}"),
        Err(e) => e.to_string(),
    }
}

fn example() -> ModelSpec {
    graph(include_str!("../fixtures/example_model.json")).unwrap()
}

#[test]
fn the_readme_example_parses_compiles_and_round_trips() {
    let spec = example();
    assert_eq!(ModelSpec::from_json(&spec.to_json()).unwrap(), spec);
    let layout = spec.layout();
    assert_eq!(layout["stem.weight"], vec![8, 3, 3, 3]);
    assert!(!layout.contains_key("stem.bias"));
    assert_eq!(layout["stem_bn.num_batches_tracked"], Vec::<usize>::new());
    assert_eq!(layout["block1.layers.0.depthwise.weight"], vec![8, 1, 3, 3]);
    assert_eq!(layout["block1.layers.0.pointwise.weight"], vec![8, 8, 1, 1]);
    assert_eq!(layout["block1.layers.1.running_var"], vec![8]);
    assert_eq!(layout["layers.6.weight"], vec![8, 8, 3]);
    assert_eq!(layout["head.weight"], vec![4, 8]);
    assert_eq!(spec.classes(), 4);
    // The 0-dimensional counter survives the protocol's codec.
    let b = init_bundle(&spec, 1).unwrap();
    let decoded = TensorBundle::decode(&b.encode(), &fedfleet_protocol::bundle::BundleLimits::default()).unwrap();
    assert_eq!(bits(&decoded), bits(&b));
    let roles: std::collections::HashMap<_, _> = spec.roles().into_iter().collect();
    assert_eq!(roles["head.weight"], TensorRole::Sent);
    assert_eq!(roles["block1.layers.1.running_mean"], TensorRole::Sent);
    assert_eq!(roles["layers.6.weight"], TensorRole::Fixed);
    // stem_bn is local but frozen by the patterns: it does not change at all.
    assert_eq!(roles["stem_bn.weight"], TensorRole::Fixed);
}

#[test]
fn the_readme_example_trains_and_summarises() {
    let spec = example();
    let mut r = fedfleet_learning::rng::rng(3, 50);
    let n = 24;
    let features = (0..n * 3 * 16 * 16).map(|_| fedfleet_learning::rng::uniform(&mut r, 0.0, 1.0) as f32).collect();
    let data =
        Dataset { features, labels: (0..n as u32).map(|i| i % 4).collect(), targets: vec![], shape: vec![3, 16, 16], num_classes: 4 };
    let g = init_bundle(&spec, 1).unwrap();
    let cfg = TrainConfig { local_epochs: 1, batch_size: 8, ..TrainConfig::default() };
    let out = train_local(&spec, &g, &data, &cfg, 1).unwrap();
    assert_eq!(out.delta.layout(), spec.update_layout());
    assert!(out.delta.check_finite().is_ok() && out.metrics.delta_norm > 0.0);
    assert!(out.delta.get("stem.weight").is_none() && out.delta.get("stem_bn.weight").is_none());
    assert!(out.delta.get("block1.layers.1.num_batches_tracked").is_some());
    let summary = spec.summary().unwrap();
    assert!(summary.contains("3.0    separable_conv2d     block1.layers.0 "), "{summary}");
    assert!(summary.contains("3      residual             block1 "), "{summary}");
    assert!(summary.contains("[8, 64] -> [8, 64]"), "{summary}");
    assert!(summary.ends_with("19 tensors, 670 values, 204 trainable; task Classification; output [4]"), "{summary}");
}

#[test]
fn errors_name_the_layer() {
    let e = err(r#"{"arch":"graph","input":[16,8,8],"layers":[
        {"type":"conv2d","out_channels":16,"kernel_size":3,"padding":1},
        {"type":"conv2d","name":"backbone.1","in_channels":8,"out_channels":8,"kernel_size":3}]}"#);
    assert!(e.contains(r#"layer 1 (conv2d "backbone.1"): in_channels 8 but input [16, 8, 8] has 16 channels"#), "{e}");
    let e = err(r#"{"arch":"graph","input":[4],"layers":[{"type":"linear","out_features":4},
        {"type":"residual","layers":[{"type":"linear","out_features":3}]}]}"#);
    assert!(e.contains(r#"layer 1 (residual "layers.1"): the block gives [3] but the shortcut gives [4]"#), "{e}");
    let e =
        err(r#"{"arch":"graph","input":[4],"layers":[{"type":"residual","layers":[{"type":"conv2d","out_channels":3,"kernel_size":3}]}]}"#);
    assert!(e.contains(r#"layer 0.0 (conv2d "layers.0.layers.0"): expects input [channels, height, width] but gets [4]"#), "{e}");
    let e = err(r#"{"arch":"graph","input":[3,4,4],"layers":[{"type":"conv2d","out_channels":4,"kernel_size":7}]}"#);
    assert!(e.contains("layer 0 (conv2d") && e.contains("larger than the input"), "{e}");
    let e = err(r#"{"arch":"graph","input":[5,6],"layers":[{"type":"multihead_attention","num_heads":4}]}"#);
    assert!(e.contains("embed_dim 6 is not divisible by num_heads 4"), "{e}");
    let e = err(
        r#"{"arch":"graph","input":[5],"layers":[{"type":"linear","out_features":4},{"type":"embedding","num_embeddings":3,"embedding_dim":2}]}"#,
    );
    assert!(e.contains("layer 1 (embedding") && e.contains("first layer"), "{e}");
    let e = err(r#"{"arch":"graph","input":[5],"layers":[{"type":"linear","out_features":1}]}"#);
    assert!(e.contains("classification needs an output of [classes >= 2]"), "{e}");
    let e = err(r#"{"arch":"graph","input":[5],"task":"reconstruction","layers":[{"type":"linear","out_features":4}]}"#);
    assert!(e.contains("shaped like the input [5]"), "{e}");
    let e = err(
        r#"{"arch":"graph","input":[5],"layers":[{"type":"linear","name":"a","out_features":5},{"type":"linear","name":"a","out_features":2}]}"#,
    );
    assert!(e.contains(r#"two tensors are called "a.weight""#), "{e}");
    let e = err(
        r#"{"arch":"graph","input":[5],"layers":[{"type":"linear","out_features":2}],"finetune":{"mode":"freeze","trainable":["head.*"]}}"#,
    );
    assert!(e.contains(r#"freeze pattern "head.*" matches no parameter"#), "{e}");
    let e = err(
        r#"{"arch":"graph","input":[5],"layers":[{"type":"linear","out_features":2}],"finetune":{"mode":"lora","rank":2,"alpha":4,"targets":["x*"]}}"#,
    );
    assert!(e.contains(r#"lora target "x*" matches no linear or convolution layer"#), "{e}");
}

#[test]
fn bad_json_is_an_error_not_a_panic() {
    for bad in [
        "",
        "{",
        r#"{"arch":"graph"}"#,
        r#"{"arch":"graph","input":[4],"layers":[]}"#,
        r#"{"arch":"graph","input":[],"layers":[{"type":"relu"}]}"#,
        r#"{"arch":"graph","input":[0],"layers":[{"type":"relu"}]}"#,
        r#"{"arch":"graph","input":[1,1,1,1],"layers":[{"type":"relu"}]}"#,
        r#"{"arch":"graph","input":[4],"layers":[{"type":"transformer"}]}"#,
        r#"{"arch":"graph","input":[4],"layers":[{"type":"relu"}],"bogus":1}"#,
        r#"{"arch":"graph","input":[4],"task":"ranking","layers":[{"type":"relu"}]}"#,
        r#"{"arch":"graph","input":[4],"layers":[{"type":"linear","out_features":2,"extra":1}]}"#,
        r#"{"arch":"graph","input":[4],"layers":[{"type":"linear","out_features":0}]}"#,
        r#"{"arch":"graph","input":[4],"layers":[{"type":"linear","out_features":-1}]}"#,
        r#"{"arch":"graph","input":[4],"layers":[{"type":"dropout","p":1.5}]}"#,
        r#"{"arch":"graph","input":[4],"layers":[{"type":"reshape","shape":[3]}]}"#,
        r#"{"arch":"graph","input":[4],"layers":[{"type":"global_avg_pool"}]}"#,
        r#"{"arch":"graph","input":[2,4],"layers":[{"type":"conv1d","out_channels":3,"kernel_size":1,"groups":2}]}"#,
        r#"{"arch":"graph","input":[2,4],"layers":[{"type":"max_pool1d","kernel_size":2,"padding":2}]}"#,
        r#"{"arch":"graph","input":[99999999,99999999],"layers":[{"type":"relu"}]}"#,
        r#"{"arch":"graph","input":[4],"layers":[{"type":"linear","out_features":2}],"finetune":{"mode":"lora","rank":0,"alpha":1}}"#,
        r#"{"arch":"graph","input":[4],"layers":[{"type":"linear","out_features":2}],"finetune":{"mode":"freeze","frozen":["*"]}}"#,
        r#"{"arch":"graph","input":[4,4,4],"layers":[{"type":"conv2d","out_channels":2,"kernel_size":3,"padding":18446744073709551615}]}"#,
        r#"{"arch":"graph","input":[4,4,4],"layers":[{"type":"conv2d","out_channels":2,"kernel_size":1048576,"padding":1048576}]}"#,
        r#"{"arch":"graph","input":[4],"layers":[{"type":"reshape","shape":[18446744073709551615,2]}]}"#,
    ] {
        assert!(matches!(graph(bad), Err(LearningError::InvalidSpec(_))), "{bad}");
    }
}

#[test]
fn presets_written_as_graphs_behave_identically() {
    let (train, _) = Dataset::digits_split().unwrap();
    let small = train.subset(&(0..128).collect::<Vec<_>>());
    for preset in [ModelSpec::digits_mlp(), ModelSpec::digits_cnn()] {
        let as_graph = ModelSpec::Graph(preset.to_graph());
        let reparsed = ModelSpec::from_json(&as_graph.to_json()).unwrap();
        assert_eq!(reparsed, as_graph);
        assert_eq!(as_graph.layout(), preset.layout());
        let g = init_bundle(&preset, 5).unwrap();
        assert_eq!(bits(&init_bundle(&as_graph, 5).unwrap()), bits(&g));
        let data = small.clone().reshaped(preset.input_shape().to_vec()).unwrap();
        let cfg = TrainConfig { local_epochs: 1, batch_size: 16, ..TrainConfig::default() };
        let a = train_local(&preset, &g, &data, &cfg, 3).unwrap();
        let b = train_local(&as_graph, &g, &data, &cfg, 3).unwrap();
        assert_eq!(bits(&a.delta), bits(&b.delta), "{}", preset.arch());
    }
}

/// y = A·x + b with fixed A, b, x ~ U(-1, 1): 200 examples of 6 features, 2 targets.
fn regression_data() -> Dataset {
    let mut r = fedfleet_learning::rng::rng(9, 77);
    let n = 200;
    let features: Vec<f32> = (0..n * 6).map(|_| fedfleet_learning::rng::uniform(&mut r, -1.0, 1.0) as f32).collect();
    let targets = features
        .chunks(6)
        .flat_map(|x| {
            let y0 = 0.5 * x[0] - x[1] + 0.25 * x[5] + 0.1;
            let y1 = x[2] * 0.8 + x[3] - 0.3;
            [y0, y1]
        })
        .collect();
    Dataset { features, labels: vec![0; n], targets, shape: vec![6], num_classes: 2 }
}

#[test]
fn regression_trains_and_reports_rmse_as_a_score() {
    let spec = graph(
        r#"{"arch":"graph","input":[6],"task":"regression","layers":[
        {"type":"linear","out_features":16},{"type":"tanh"},{"type":"linear","out_features":2}]}"#,
    )
    .unwrap();
    assert_eq!(spec.task(), Task::Regression);
    let data = regression_data();
    let g = init_bundle(&spec, 1).unwrap();
    let before = evaluate(&spec, &g, &data).unwrap();
    let cfg =
        TrainConfig { local_epochs: 30, batch_size: 16, learning_rate: 0.01, optimizer: OptimizerConfig::adam(), ..TrainConfig::default() };
    let out = train_local(&spec, &g, &data, &cfg, 1).unwrap();
    let after = evaluate(&spec, &sim::apply_delta(&g, &out.delta, 1.0).unwrap(), &data).unwrap();
    let (name, rmse, higher_better) = after.metric();
    assert_eq!((name, higher_better), ("rmse", false));
    assert!(rmse < 0.1 && rmse < before.rmse.unwrap() / 4.0, "rmse {} -> {rmse}", before.rmse.unwrap());
    assert!(after.mae.unwrap() <= rmse + 1e-12);
    assert!(after.score() > before.score());
    assert!((after.loss - rmse * rmse).abs() < 1e-9);
    // A regression model answers with values, not classes.
    let (p, _) = Predictor::new(&spec, &g).unwrap().predict(data.example(0)).unwrap();
    assert_eq!((p.label, p.values.len(), p.anomaly_score), (None, spec.output_len(), None));
    // Targets must be there, one per output.
    let mut missing = data.clone();
    missing.targets.pop();
    assert!(matches!(train_local(&spec, &g, &missing, &cfg, 1), Err(LearningError::InputMismatch(_))));
}

#[test]
fn an_autoencoder_scores_outliers_higher() {
    let spec = graph(
        r#"{"arch":"graph","input":[6],"task":"reconstruction","layers":[
        {"type":"linear","out_features":3},{"type":"linear","out_features":6}]}"#,
    )
    .unwrap();
    // Data on a 2-dimensional subspace of R^6; the outlier is off it.
    let base = regression_data();
    let features: Vec<f32> = base.features.chunks(6).flat_map(|x| [x[0], x[1], x[0] + x[1], x[0] - x[1], 0.5 * x[0], -x[1]]).collect();
    let data = Dataset { features, labels: vec![0; 200], targets: vec![], shape: vec![6], num_classes: 2 };
    let g = init_bundle(&spec, 2).unwrap();
    let cfg =
        TrainConfig { local_epochs: 40, batch_size: 16, learning_rate: 0.01, optimizer: OptimizerConfig::adam(), ..TrainConfig::default() };
    let out = train_local(&spec, &g, &data, &cfg, 1).unwrap();
    let trained = sim::apply_delta(&g, &out.delta, 1.0).unwrap();
    let before = evaluate(&spec, &g, &data).unwrap();
    let report = evaluate(&spec, &trained, &data).unwrap();
    assert!(report.rmse.unwrap() < before.rmse.unwrap() / 3.0, "{} -> {}", before.rmse.unwrap(), report.rmse.unwrap());
    let p = Predictor::new(&spec, &trained).unwrap();
    let normal = p.anomaly_scores(data.example(0), 1).unwrap()[0];
    let outlier = p.anomaly_scores(&[1.0, -1.0, 1.0, 1.0, -1.0, 1.0], 1).unwrap()[0];
    assert!(outlier > 10.0 * normal, "outlier {outlier} normal {normal}");
    // Inference answers with the reconstruction and the same score.
    let (answer, _) = p.predict(data.example(0)).unwrap();
    assert_eq!((answer.label, answer.values.len(), answer.anomaly_score), (None, 6, Some(normal)));
}

fn mlp_with(finetune: &str) -> ModelSpec {
    graph(&format!(
        r#"{{"arch":"graph","input":[64],"layers":[
        {{"type":"linear","name":"body","out_features":32}},{{"type":"relu"}},
        {{"type":"linear","name":"head","out_features":10}}]{finetune}}}"#
    ))
    .unwrap()
}

#[test]
fn freezing_sends_only_the_head() {
    let (train, _) = Dataset::digits_split().unwrap();
    let full = mlp_with("");
    let head_only = mlp_with(r#","finetune":{"mode":"freeze","trainable":["head.*"]}"#);
    let frozen_body = mlp_with(r#","finetune":{"mode":"freeze","frozen":["body.*"]}"#);
    let g = init_bundle(&full, 4).unwrap();
    let cfg = TrainConfig { local_epochs: 1, ..TrainConfig::default() };
    let a = train_local(&head_only, &g, &train, &cfg, 1).unwrap();
    let names: Vec<_> = a.delta.layout().into_keys().collect();
    assert_eq!(names, ["head.bias", "head.weight"]);
    assert_eq!(head_only.num_trainable(), 32 * 10 + 10);
    let b = train_local(&frozen_body, &g, &train, &cfg, 1).unwrap();
    assert_eq!(bits(&a.delta), bits(&b.delta));
    let all = train_local(&full, &g, &train, &cfg, 1).unwrap();
    assert!(a.metrics.update_bytes < all.metrics.update_bytes / 4, "{} vs {}", a.metrics.update_bytes, all.metrics.update_bytes);
    assert_eq!(a.metrics.update_bytes, a.delta.encode().len());
}

#[test]
fn lora_trains_only_adapters_and_merges_into_the_base_weights() {
    let (train, test) = Dataset::digits_split().unwrap();
    let base = mlp_with("");
    let lora = mlp_with(r#","finetune":{"mode":"lora","rank":4,"alpha":8}"#);
    assert_eq!(base_spec(&lora), base);
    let layout = lora.layout();
    assert_eq!(layout["body.lora_A"], vec![4, 64]);
    assert_eq!(layout["body.lora_B"], vec![32, 4]);
    assert_eq!(layout["head.lora_A"], vec![4, 32]);
    // Pre-trained base weights, then adapters: the adapted model starts equal to the base.
    let cfg = TrainConfig { local_epochs: 2, ..TrainConfig::default() };
    let g0 = init_bundle(&base, 4).unwrap();
    let pre = sim::apply_delta(&g0, &train_local(&base, &g0, &train, &cfg, 1).unwrap().delta, 1.0).unwrap();
    let start = attach_adapters(&lora, &pre, 11).unwrap();
    // The same start from a PyTorch file of the base model.
    let file = export_state_dict(&base, &pre).unwrap();
    assert_eq!(bits(&fedfleet_learning::interop::import_pretrained(&lora, &file, 11).unwrap()), bits(&start));
    assert!(import_state_dict(&lora, &file).is_err(), "the adapters are missing from a base file");
    assert_eq!(bits(&merge_lora(&lora, &start).unwrap()), bits(&pre));
    let out =
        train_local(&lora, &start, &train, &TrainConfig { local_epochs: 1, learning_rate: 0.02, ..TrainConfig::default() }, 2).unwrap();
    let names: Vec<_> = out.delta.layout().into_keys().collect();
    assert_eq!(names, ["body.lora_A", "body.lora_B", "head.lora_A", "head.lora_B"]);
    assert_eq!(out.delta.layout(), lora.update_layout());
    let tuned = sim::apply_update(&start, &out.delta, 1.0).unwrap();
    let merged = merge_lora(&lora, &tuned).unwrap();
    assert_eq!(merged.layout(), base.layout());
    // The merged plain model computes what the adapted model computes.
    let a = Predictor::new(&lora, &tuned).unwrap().outputs(&test.features[..64 * 20], 20).unwrap();
    let b = Predictor::new(&base, &merged).unwrap().outputs(&test.features[..64 * 20], 20).unwrap();
    let worst = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
    assert!(worst < 1e-4, "merged differs by {worst}");
    assert_ne!(bits(&merged), bits(&pre), "training moved the adapters");
    // Conv layers get adapters in peft's layout.
    let conv = graph(
        r#"{"arch":"graph","input":[2,6,6],"layers":[{"type":"conv2d","name":"c","out_channels":4,"kernel_size":3},
        {"type":"flatten"},{"type":"linear","name":"fc","out_features":3}],"finetune":{"mode":"lora","rank":2,"alpha":2,"targets":["c"]}}"#,
    )
    .unwrap();
    assert_eq!(conv.layout()["c.lora_A"], vec![2, 2, 3, 3]);
    assert_eq!(conv.layout()["c.lora_B"], vec![4, 2, 1, 1]);
    assert!(!conv.layout().contains_key("fc.lora_A"));
}

#[test]
fn lora_also_trains_the_named_parameters_in_full_and_merges_them() {
    let (train, test) = Dataset::digits_split().unwrap();
    let base = mlp_with("");
    let lora = mlp_with(r#","finetune":{"mode":"lora","rank":2,"alpha":2,"targets":["body"],"also_train":["head.*"]}"#);
    let update: Vec<_> = lora.update_layout().into_keys().collect();
    assert_eq!(update, ["body.lora_A", "body.lora_B", "head.bias", "head.weight"]);
    let start = attach_adapters(&lora, &init_bundle(&base, 4).unwrap(), 11).unwrap();
    let out =
        train_local(&lora, &start, &train, &TrainConfig { local_epochs: 1, learning_rate: 0.05, ..TrainConfig::default() }, 2).unwrap();
    assert_eq!(out.delta.layout(), lora.update_layout());
    let tuned = sim::apply_update(&start, &out.delta, 1.0).unwrap();
    let merged = merge_lora(&lora, &tuned).unwrap();
    assert_eq!(merged.to_f32("head.weight"), tuned.to_f32("head.weight"), "the head is merged as trained");
    let a = Predictor::new(&lora, &tuned).unwrap().outputs(&test.features[..64 * 20], 20).unwrap();
    let b = Predictor::new(&base, &merged).unwrap().outputs(&test.features[..64 * 20], 20).unwrap();
    assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() < 1e-4));
    let bad = err(r#"{"arch":"graph","input":[64],"layers":[{"type":"linear","name":"fc","out_features":3}],
        "finetune":{"mode":"lora","rank":2,"alpha":2,"also_train":["nope.*"]}}"#);
    assert!(bad.contains("also_train pattern \"nope.*\" matches no parameter"), "{bad}");
}

#[test]
fn ffa_lora_trains_and_sends_only_b_and_keeps_a_as_it_started() {
    let (train, _) = Dataset::digits_split().unwrap();
    let base = mlp_with("");
    let ffa = mlp_with(r#","finetune":{"mode":"lora","rank":2,"alpha":2,"targets":["body"],"freeze_a":true}"#);
    let update: Vec<_> = ffa.update_layout().into_keys().collect();
    assert_eq!(update, ["body.lora_B"]);
    assert_eq!(fedfleet_learning::ModelSpec::from_json(&ffa.to_json()).unwrap(), ffa, "freeze_a round-trips");
    let start = attach_adapters(&ffa, &init_bundle(&base, 4).unwrap(), 11).unwrap();
    let out =
        train_local(&ffa, &start, &train, &TrainConfig { local_epochs: 1, learning_rate: 0.05, ..TrainConfig::default() }, 2).unwrap();
    assert_eq!(out.delta.layout(), ffa.update_layout());
    let tuned = sim::apply_update(&start, &out.delta, 1.0).unwrap();
    assert_eq!(tuned.to_f32("body.lora_A"), start.to_f32("body.lora_A"));
    assert_ne!(tuned.to_f32("body.lora_B"), start.to_f32("body.lora_B"));
}

#[test]
fn batch_norm_updates_statistics_in_training_and_fedbn_keeps_them_local() {
    let spec_json = |local: bool| {
        format!(
            r#"{{"arch":"graph","input":[1,8,8],"layers":[{{"type":"conv2d","out_channels":4,"kernel_size":3,"padding":1}},
            {{"type":"batch_norm","name":"bn","local":{local}}},{{"type":"relu"}},{{"type":"global_avg_pool"}},
            {{"type":"linear","out_features":10}}]}}"#
        )
    };
    let (train, test) = Dataset::digits_split().unwrap();
    let (train, test) = (train.reshaped(vec![1, 8, 8]).unwrap(), test.reshaped(vec![1, 8, 8]).unwrap());
    let shared = graph(&spec_json(false)).unwrap();
    let fedbn = graph(&spec_json(true)).unwrap();
    let g = init_bundle(&shared, 3).unwrap();
    let cfg = TrainConfig { local_epochs: 1, ..TrainConfig::default() };
    let a = train_local(&shared, &g, &train, &cfg, 1).unwrap();
    let steps = a.metrics.steps as f32;
    assert_eq!(a.delta.to_f32("bn.num_batches_tracked").unwrap(), vec![steps]);
    assert!(a.delta.to_f32("bn.running_mean").unwrap().iter().any(|v| *v != 0.0));
    assert!(a.local_state.is_empty());
    let b = train_local(&fedbn, &g, &train, &cfg, 1).unwrap();
    assert!(b.delta.layout().keys().all(|n| !n.starts_with("bn.")));
    assert_eq!(b.local_state.layout().len(), 5);
    assert_eq!(bits(&b.delta), bits(&sim_subset(&a.delta, &b.delta)));
    let next = sim::apply_update(&g, &b.delta, 1.0).unwrap();
    assert_eq!(next.layout(), g.layout());
    assert_eq!(next.to_f32("bn.weight"), g.to_f32("bn.weight"), "local tensors are not in the update");
    // Evaluation uses the running statistics: the trained model evaluates the same twice and
    // differently from one with the initial statistics.
    let local = sim::apply_delta(&g, &a.delta, 1.0).unwrap();
    let r1 = evaluate(&shared, &local, &test).unwrap();
    assert_eq!(r1, evaluate(&shared, &local, &test).unwrap());
    let mut stale = TensorBundle::new();
    for (n, t) in local.iter() {
        stale.insert(n, if n.starts_with("bn.running") { g.get(n).unwrap().clone() } else { t.clone() }).unwrap();
    }
    assert_ne!(r1.loss, evaluate(&shared, &stale, &test).unwrap().loss);
    // FedBN: the device's own batch norm goes back over the next global model.
    let resumed = overlay_local(&g, &b.local_state).unwrap();
    assert_eq!(resumed.to_f32("bn.running_mean"), b.local_state.to_f32("bn.running_mean"));
    assert_eq!(resumed.to_f32("layers.0.weight"), g.to_f32("layers.0.weight"));
}

fn sim_subset(from: &TensorBundle, like: &TensorBundle) -> TensorBundle {
    let mut out = TensorBundle::new();
    for (n, _) in like.iter() {
        out.insert(n, from.get(n).unwrap().clone()).unwrap();
    }
    out
}

#[test]
fn dropout_is_seeded_and_only_active_in_training() {
    let spec = graph(
        r#"{"arch":"graph","input":[64],"layers":[{"type":"linear","out_features":32},{"type":"relu"},
        {"type":"dropout","p":0.5},{"type":"linear","out_features":10}]}"#,
    )
    .unwrap();
    let (train, test) = Dataset::digits_split().unwrap();
    let g = init_bundle(&spec, 1).unwrap();
    let cfg = TrainConfig { local_epochs: 1, ..TrainConfig::default() };
    let a = train_local(&spec, &g, &train, &cfg, 1).unwrap();
    assert_eq!(bits(&a.delta), bits(&train_local(&spec, &g, &train, &cfg, 1).unwrap().delta));
    assert_ne!(bits(&a.delta), bits(&train_local(&spec, &g, &train, &cfg, 2).unwrap().delta));
    let m = Model::from_bundle(&spec, &g).unwrap();
    let p = Predictor::from_model(m);
    assert_eq!(p.outputs(test.example(0), 1).unwrap(), p.outputs(test.example(0), 1).unwrap());
}

#[test]
fn bad_token_ids_are_refused() {
    let spec = graph(
        r#"{"arch":"graph","input":[3],"layers":[{"type":"embedding","num_embeddings":5,"embedding_dim":2},
        {"type":"flatten"},{"type":"linear","out_features":2}]}"#,
    )
    .unwrap();
    let p = Predictor::new(&spec, &init_bundle(&spec, 1).unwrap()).unwrap();
    assert!(p.outputs(&[0.0, 4.0, 2.0], 1).is_ok());
    for bad in [[0.0, 5.0, 1.0], [0.5, 1.0, 1.0], [-1.0, 0.0, 0.0], [f32::NAN, 0.0, 0.0]] {
        assert!(matches!(p.outputs(&bad, 1), Err(LearningError::InputMismatch(_))), "{bad:?}");
    }
}

#[test]
fn a_mismatched_state_dict_lists_every_problem() {
    use safetensors::tensor::{Dtype, TensorView};
    let spec = example();
    let good = export_state_dict(&spec, &init_bundle(&spec, 1).unwrap()).unwrap();
    assert!(import_state_dict(&spec, &good).is_ok());
    // Rebuild the file: drop head.bias, reshape head.weight, make stem.weight F64 (accepted),
    // make stem_bn.running_mean I32, stem_bn.num_batches_tracked F32, add an extra tensor.
    let file = safetensors::SafeTensors::deserialize(&good).unwrap();
    let mut owned: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, v) in file.tensors() {
        let (dtype, shape, data) = match name.as_str() {
            "head.bias" => continue,
            "head.weight" => (Dtype::F32, vec![8, 4], v.data().to_vec()),
            "stem.weight" => (
                Dtype::F64,
                v.shape().to_vec(),
                v.data().chunks(4).flat_map(|c| (f32::from_le_bytes(c.try_into().unwrap()) as f64).to_le_bytes()).collect(),
            ),
            "stem_bn.running_mean" => (Dtype::I32, v.shape().to_vec(), v.data().to_vec()),
            "stem_bn.num_batches_tracked" => (Dtype::F64, vec![], 0f64.to_le_bytes().to_vec()),
            _ => (v.dtype(), v.shape().to_vec(), v.data().to_vec()),
        };
        owned.push((name, dtype, shape, data));
    }
    owned.push(("classifier.weight".into(), Dtype::F32, vec![2], vec![0; 8]));
    let views: Vec<(String, TensorView)> =
        owned.iter().map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap())).collect();
    let bad = safetensors::tensor::serialize(views, None).unwrap();
    let e = import_state_dict(&spec, &bad).unwrap_err();
    let LearningError::StateDict(problems) = &e else { panic!("{e}") };
    assert_eq!(problems.0.len(), 5, "{e}");
    let text = e.to_string();
    for want in [
        "missing head.bias [4]",
        "head.weight has shape [8, 4], expected [4, 8]",
        "stem_bn.running_mean has dtype I32",
        "stem_bn.num_batches_tracked has dtype F64, expected I64",
        "unexpected classifier.weight [2]",
    ] {
        assert!(text.contains(want), "{want:?} not in {text}");
    }
    assert!(!text.contains("stem.weight"), "F64 is converted: {text}");
    assert!(matches!(import_state_dict(&spec, b"not safetensors"), Err(LearningError::Safetensors(_))));
}

#[test]
fn scaffold_works_on_the_update_layout_of_a_partial_model() {
    use fedfleet_learning::{ScaffoldState, train_local_scaffold};
    let (train, _) = Dataset::digits_split().unwrap();
    let spec = mlp_with(r#","finetune":{"mode":"lora","rank":2,"alpha":2}"#);
    let g = init_bundle(&spec, 1).unwrap();
    let zeros = |layout: fedfleet_protocol::bundle::Layout| {
        let mut b = TensorBundle::new();
        for (n, s) in layout {
            let len = s.iter().product();
            b.insert_f32(n, s, vec![0.0; len]).unwrap();
        }
        b
    };
    let state = ScaffoldState { server_c: zeros(spec.update_layout()), client_c: zeros(spec.update_layout()) };
    let cfg = TrainConfig { local_epochs: 1, ..TrainConfig::default() };
    let (out, sc) = train_local_scaffold(&spec, &g, &train, &cfg, 1, &state).unwrap();
    // With zero variates SCAFFOLD is plain training.
    assert_eq!(bits(&out.delta), bits(&train_local(&spec, &g, &train, &cfg, 1).unwrap().delta));
    assert_eq!(sc.client_c.layout(), spec.update_layout());
}

#[test]
fn a_custom_model_declares_its_tensors_and_which_an_update_carries() {
    let spec = ModelSpec::from_json(
        r#"{"arch":"custom","kind":"acme/kws","input":[40,16],"output":12,"trainable":["head.*"],
            "tensors":[{"name":"conv.weight","shape":[8,16,3]},{"name":"conv.bias","shape":[8]},
                       {"name":"head.weight","shape":[12,8]},{"name":"head.bias","shape":[12]}]}"#,
    )
    .unwrap();
    assert_eq!((spec.arch(), spec.input_len(), spec.output_len(), spec.classes()), ("custom", 640, 12, 12));
    assert!(!spec.is_builtin());
    assert_eq!(spec.layout().len(), 4);
    assert_eq!(spec.update_layout().keys().cloned().collect::<Vec<_>>(), ["head.bias", "head.weight"]);
    assert_eq!((spec.num_params(), spec.num_trainable()), (8 * 48 + 8 + 96 + 12, 108));
    assert!(spec.summary().unwrap().contains("custom model \"acme/kws\""));
    let err = spec.plan().unwrap_err().to_string();
    assert!(err.contains("Trainer"), "{err}");
    for (bad, says) in [
        (r#""tensors":[{"name":"a","shape":[2]},{"name":"a","shape":[3]}]"#, "declared twice"),
        (r#""tensors":[{"name":"a","shape":[0,2]}]"#, "empty or too large"),
        (r#""tensors":[{"name":"a","shape":[2]}],"trainable":["b*"]"#, "matches no tensor"),
        (r#""tensors":[]"#, "declares no tensors"),
    ] {
        let json = format!(r#"{{"arch":"custom","kind":"k","input":[4],"output":2,{bad}}}"#);
        let err = ModelSpec::from_json(&json).unwrap_err().to_string();
        assert!(err.contains(says), "{bad}: {err}");
    }
}

/// Specs are checked for cost, not only shape, before anything is allocated (the error names
/// the figure and its limit).
#[test]
fn specs_too_costly_to_hold_or_run_are_refused_by_name() {
    let err = |json: &str| match ModelSpec::from_json(json) {
        Err(fedfleet_modelspec::SpecError::InvalidSpec(m)) => m,
        other => panic!("{json}: expected InvalidSpec, got {other:?}"),
    };
    // 16 layers of 16384×16384: 4.3e9 parameters.
    let big = format!(
        r#"{{"arch":"graph","input":[16384],"task":"regression","layers":[{}]}}"#,
        vec![r#"{"type":"linear","out_features":16384}"#; 16].join(",")
    );
    let e = err(&big);
    assert!(e.contains("parameter values; the limit is 268435456"), "{e}");
    // A small attention model whose scores need 2^40 values per example.
    let e = err(r#"{"arch":"graph","input":[524288,4],"task":"regression","layers":[{"type":"multihead_attention","num_heads":4}]}"#);
    assert!(e.contains("one example's forward pass produces") && e.contains("the limit is 67108864"), "{e}");
    // LoRA rank above the layer it adapts.
    let e = err(
        r#"{"arch":"graph","input":[16],"layers":[{"type":"linear","name":"fc","out_features":8}],"finetune":{"mode":"lora","rank":64,"alpha":8}}"#,
    );
    assert!(e.contains(r#"lora rank 64 exceeds layer "fc" (8 outputs, 16 inputs)"#), "{e}");
    // A custom model's declared tensors count too.
    let e = err(
        r#"{"arch":"custom","kind":"acme/huge","input":[4],"output":2,"tensors":[{"name":"a","shape":[16384,16384]},{"name":"b","shape":[16384,16384]}]}"#,
    );
    assert!(e.contains("values; the limit is 268435456"), "{e}");
    // Within the bounds, the same shapes pass.
    ModelSpec::from_json(
        r#"{"arch":"graph","input":[16],"layers":[{"type":"linear","out_features":8}],"finetune":{"mode":"lora","rank":8,"alpha":8}}"#,
    )
    .unwrap();
}
