//! Trains the digits MLP briefly and writes it as a safetensors file a PyTorch user can load,
//! next to its ModelSpec JSON, then prints the logits of the first test example for checking.
//!
//! ```text
//! cargo run -p fedfleet-learning --example export_model -- /tmp/digits_mlp
//! ```
//!
//! In PyTorch:
//! ```python
//! import torch, torch.nn as nn
//! from collections import OrderedDict
//! from safetensors.torch import load_file
//! m = nn.Sequential(OrderedDict(fc1=nn.Linear(64, 64), relu=nn.ReLU(), fc2=nn.Linear(64, 10)))
//! m.load_state_dict(load_file("/tmp/digits_mlp/model.safetensors"))
//! ```

use fedfleet_learning::model::init_bundle;
use fedfleet_learning::{Dataset, Model, ModelSpec, Predictor, TrainConfig, evaluate, sim, train_local};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::path::PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| "digits_mlp".into()));
    std::fs::create_dir_all(&dir)?;
    let spec = ModelSpec::digits_mlp();
    let (train, test) = Dataset::digits_split()?;
    let g = init_bundle(&spec, 1)?;
    let out = train_local(&spec, &g, &train, &TrainConfig { local_epochs: 5, ..TrainConfig::default() }, 1)?;
    let local = sim::apply_delta(&g, &out.delta, 1.0)?;
    Model::from_bundle(&spec, &local)?.save_safetensors(dir.join("model.safetensors"))?;
    std::fs::write(dir.join("spec.json"), spec.to_json())?;
    let acc = evaluate(&spec, &local, &test)?.accuracy;
    let (p, _) = Predictor::new(&spec, &local)?.predict(test.example(0))?;
    let x: Vec<String> = test.example(0).iter().map(|v| v.to_string()).collect();
    println!("wrote {} (test accuracy {acc:.4})", dir.join("model.safetensors").display());
    println!("spec: {}", spec.to_json());
    println!("first test example (label {}): [{}]", test.labels[0], x.join(","));
    println!("predicted {:?} with probabilities {:?}", p.label, p.probs);
    Ok(())
}
