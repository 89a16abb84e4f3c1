//! Local fine-tuning throughput (examples/s) and peak RSS per model preset and fine-tuning
//! mode, batch 32. Each preset runs in its own child process so that its peak RSS (VmHWM from
//! /proc/self/status) is its own.
//!
//! Reproduce (release build; burn's flex backend runs on one CPU thread here):
//!
//! ```text
//! cargo run --release -p fedfleet-learning --example bench_finetune
//! cargo run --release -p fedfleet-learning --example bench_finetune -- cnn   # one preset
//! ```
//!
//! Prints figures only; asserts nothing about time.

use fedfleet_learning::finetune::attach_adapters;
use fedfleet_learning::model::init_bundle;
use fedfleet_learning::{Dataset, ModelSpec, TrainConfig, train_local};

const PRESETS: &[&str] = &["mlp", "cnn", "mlp-freeze-head", "mlp-lora4", "resnet-bn", "gru", "attention", "autoencoder"];
const STEPS: usize = 40;

fn peak_rss_kib() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines().find(|l| l.starts_with("VmHWM:"))?.split_whitespace().nth(1)?.parse().ok()
}

fn graph(json: &str) -> ModelSpec {
    ModelSpec::from_json(json).expect("bench spec")
}

/// Random examples of `shape` (values in [0, 1)) with labels below `classes`.
fn synthetic(shape: &[usize], classes: usize, n: usize) -> Dataset {
    let mut r = fedfleet_learning::rng::rng(1, 99);
    let len: usize = shape.iter().product();
    let features = (0..n * len).map(|_| fedfleet_learning::rng::uniform(&mut r, 0.0, 1.0) as f32).collect();
    let labels = (0..n).map(|i| (i % classes) as u32).collect();
    Dataset { features, labels, targets: vec![], shape: shape.to_vec(), num_classes: classes }
}

fn setup(name: &str) -> (ModelSpec, fedfleet_protocol::bundle::TensorBundle, Dataset) {
    let (digits, _) = Dataset::digits_split().expect("digits");
    let mlp = |finetune: &str| {
        graph(&format!(
            r#"{{"arch":"graph","input":[64],"layers":[{{"type":"linear","name":"fc1","out_features":64}},{{"type":"relu"}},
            {{"type":"linear","name":"fc2","out_features":10}}]{finetune}}}"#
        ))
    };
    let spec = match name {
        "mlp" => ModelSpec::digits_mlp(),
        "cnn" => ModelSpec::digits_cnn(),
        "mlp-freeze-head" => mlp(r#","finetune":{"mode":"freeze","trainable":["fc2.*"]}"#),
        "mlp-lora4" => mlp(r#","finetune":{"mode":"lora","rank":4,"alpha":8}"#),
        "resnet-bn" => graph(include_str!("../tests/fixtures/example_model.json")),
        "gru" => graph(
            r#"{"arch":"graph","input":[8,8],"layers":[{"type":"gru","hidden_size":32,"output":"last"},{"type":"linear","out_features":10}]}"#,
        ),
        "attention" => graph(
            r#"{"arch":"graph","input":[8,8],"layers":[{"type":"linear","out_features":32},{"type":"multihead_attention","num_heads":4},
            {"type":"layer_norm"},{"type":"global_avg_pool"},{"type":"linear","out_features":10}]}"#,
        ),
        "autoencoder" => graph(
            r#"{"arch":"graph","input":[64],"task":"reconstruction","layers":[{"type":"linear","out_features":16},{"type":"relu"},
            {"type":"linear","out_features":64}]}"#,
        ),
        other => panic!("unknown preset {other}; one of {PRESETS:?}"),
    };
    // Digits (64 values) fit every preset but the image one, which gets random 3x16x16 data.
    let data = if spec.input_len() == 64 {
        digits.reshaped(spec.input_shape().to_vec()).expect("64 values")
    } else {
        synthetic(spec.input_shape(), spec.classes(), 1280)
    };
    let global = if name == "mlp-lora4" {
        let base = fedfleet_learning::finetune::base_spec(&spec);
        attach_adapters(&spec, &init_bundle(&base, 1).expect("init"), 2).expect("adapters")
    } else {
        init_bundle(&spec, 1).expect("init")
    };
    (spec, global, data)
}

fn run_one(name: &str) {
    let (spec, global, data) = setup(name);
    let cfg = TrainConfig { local_epochs: 100, batch_size: 32, max_steps: Some(STEPS), ..TrainConfig::default() };
    // warm-up (allocator, first-call costs)
    let _ = train_local(&spec, &global, &data, &TrainConfig { max_steps: Some(2), ..cfg.clone() }, 0).expect("warm-up");
    let out = train_local(&spec, &global, &data, &cfg, 1).expect("train");
    println!(
        "{name:<16} params {:>7}  trainable {:>7}  update {:>7} B  {:>8.0} examples/s  peak RSS {:>6} KiB",
        spec.num_params(),
        spec.num_trainable(),
        out.metrics.update_bytes,
        out.metrics.examples_per_sec,
        peak_rss_kib().map_or("?".into(), |k| k.to_string()),
    );
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(name) = args.first() {
        run_one(name);
        return;
    }
    println!("bench_finetune: batch 32, {STEPS} optimizer steps per preset, one process per preset");
    let exe = std::env::current_exe().expect("own path");
    for name in PRESETS {
        let status = std::process::Command::new(&exe).arg(name).status().expect("spawn");
        if !status.success() {
            eprintln!("{name}: failed ({status})");
        }
    }
}
