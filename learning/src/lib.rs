//! fedfleet learning: models described as JSON layer graphs (with the MLP and CNN as presets)
//! run by one burn engine, datasets and loaders (CSV, IDX, NPY/NPZ, image folders),
//! partitioners, local training for classification, regression and reconstruction with full,
//! frozen or LoRA fine-tuning, evaluation, inference, PyTorch `state_dict` interop, and
//! conversion between the engine and tensor bundles.
//!
//! Everything runs on burn's pure-Rust CPU backend (`Device::flex()`; single-threaded in this
//! build, which is what makes training bit-for-bit reproducible from a seed). See the crate
//! README for an API tour and the tensor naming of the safetensors files.
//!
//! ```no_run
//! use fedfleet_learning::{ModelSpec, Dataset, TrainConfig, train_local, evaluate};
//! let spec = ModelSpec::digits_mlp();
//! let (train, test) = Dataset::digits_split().unwrap();
//! let global = fedfleet_learning::Model::init(&spec, 7).unwrap().to_bundle().unwrap();
//! let out = train_local(&spec, &global, &train, &TrainConfig::default(), 1).unwrap();
//! let local = fedfleet_learning::sim::apply_delta(&global, &out.delta, 1.0).unwrap();
//! let report = evaluate(&spec, &local, &test).unwrap();
//! println!("accuracy {:.3}", report.accuracy);
//! ```

pub mod data;
pub mod error;
pub mod eval;
pub mod files;
pub mod finetune;
pub use fedfleet_modelspec::graph;
pub mod interop;
pub mod model;
pub mod partition;
pub mod rng;
pub mod sim;
pub use fedfleet_modelspec::spec;
pub mod train;

pub use data::{CsvOptions, Dataset, LabelColumn, Normalization};
pub use error::{DataError, LearningError};
pub use eval::{BatchPrediction, EvalReport, Prediction, Predictor, anomaly_scores, evaluate};
pub use files::ImageFolderOptions;
pub use graph::{AdapterInit, FineTune, GraphSpec, Layer, Task};
pub use model::Model;
pub use partition::Partition;
pub use spec::{CustomSpec, ModelSpec, TensorDecl, TensorRole};
pub use train::{
    OptimizerConfig, ScaffoldOutcome, ScaffoldState, TrainConfig, TrainMetrics, TrainOutcome, train_local, train_local_scaffold,
};

/// The plain CPU device every inference and evaluation path uses (`Device::flex()`).
pub fn cpu_device() -> burn::tensor::Device {
    burn::tensor::Device::flex()
}

/// The autodiff-enabled CPU device local training uses (`Device::flex().autodiff()`).
pub fn train_device() -> burn::tensor::Device {
    burn::tensor::Device::flex().autodiff()
}
