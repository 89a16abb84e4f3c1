//! Evaluation (loss, accuracy, confusion counts) and inference (batch and single example,
//! with measured latency).

use crate::data::Dataset;
use crate::error::LearningError;
use crate::graph::Task;
use crate::model::{Model, read};
use crate::spec::ModelSpec;
use crate::train::{argmax_rows, check_data};
use burn::tensor::{Tensor, TensorData};
use fedfleet_protocol::bundle::TensorBundle;
use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};

/// Evaluation of a model on a labelled set.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EvalReport {
    /// The task evaluated.
    pub task: Task,
    /// Classification: mean cross-entropy (natural log). Regression and reconstruction: mean
    /// squared error over every output value.
    pub loss: f64,
    /// Classification: fraction of examples whose arg-max class is the label. Other tasks: 0.
    pub accuracy: f64,
    /// Regression/reconstruction: root mean squared error.
    pub rmse: Option<f64>,
    /// Regression/reconstruction: mean absolute error.
    pub mae: Option<f64>,
    /// Examples evaluated.
    pub num_examples: usize,
    /// Classification: `confusion[true][predicted]` counts. Empty for other tasks.
    pub confusion: Vec<Vec<u64>>,
}

impl EvalReport {
    /// The task's headline metric oriented so that higher is better, for health checks and
    /// promotion gates: accuracy for classification, `-RMSE` for regression and
    /// reconstruction.
    pub fn score(&self) -> f64 {
        match self.task {
            Task::Classification => self.accuracy,
            Task::Regression | Task::Reconstruction => -self.rmse.unwrap_or(f64::INFINITY),
        }
    }

    /// Name of the metric behind [`EvalReport::score`] (`"accuracy"` or `"rmse"`), and whether
    /// that metric itself is better when higher.
    pub fn metric(&self) -> (&'static str, f64, bool) {
        match self.task {
            Task::Classification => ("accuracy", self.accuracy, true),
            Task::Regression | Task::Reconstruction => ("rmse", self.rmse.unwrap_or(f64::INFINITY), false),
        }
    }

    /// Per-class recall (`None` for classes absent from the data).
    pub fn per_class_accuracy(&self) -> Vec<Option<f64>> {
        self.confusion
            .iter()
            .enumerate()
            .map(|(k, row)| {
                let total: u64 = row.iter().sum();
                (total > 0).then(|| row[k] as f64 / total as f64)
            })
            .collect()
    }
}

/// Evaluates the weights in `bundle` on `data` (CPU, batches of 256).
pub fn evaluate(spec: &ModelSpec, bundle: &TensorBundle, data: &Dataset) -> Result<EvalReport, LearningError> {
    let model = Model::from_bundle(spec, bundle)?;
    evaluate_model(&model, data)
}

/// Evaluates an already built model.
pub fn evaluate_model(model: &Model, data: &Dataset) -> Result<EvalReport, LearningError> {
    let spec = model.spec();
    check_data(spec, data)?;
    let task = spec.task();
    let k = spec.output_len();
    let f = data.example_len();
    let mut confusion = if task == Task::Classification { vec![vec![0u64; k]; k] } else { Vec::new() };
    let (mut loss, mut abs) = (0.0f64, 0.0f64);
    let mut correct = 0usize;
    let idx: Vec<usize> = (0..data.len()).collect();
    for batch in idx.chunks(256) {
        let lo = batch[0] * f;
        let hi = (batch[batch.len() - 1] + 1) * f;
        let out = logits_of(model, &data.features[lo..hi], batch.len())?;
        for (row, &i) in batch.iter().enumerate() {
            let z = &out[row * k..(row + 1) * k];
            match task {
                Task::Classification => {
                    let y = data.labels[i] as usize;
                    let p = argmax_rows(z, k).next().unwrap_or(0);
                    let m = z.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
                    let lse = m + z.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln();
                    loss += lse - z[y] as f64;
                    confusion[y][p] += 1;
                    correct += usize::from(p == y);
                }
                Task::Regression | Task::Reconstruction => {
                    let t = if task == Task::Regression { &data.targets[i * k..(i + 1) * k] } else { data.example(i) };
                    for (&o, &y) in z.iter().zip(t) {
                        let e = o as f64 - y as f64;
                        loss += e * e;
                        abs += e.abs();
                    }
                }
            }
        }
    }
    let n = data.len();
    Ok(match task {
        Task::Classification => EvalReport {
            task,
            loss: loss / n as f64,
            accuracy: correct as f64 / n as f64,
            rmse: None,
            mae: None,
            num_examples: n,
            confusion,
        },
        Task::Regression | Task::Reconstruction => {
            let mse = loss / (n * k) as f64;
            EvalReport {
                task,
                loss: mse,
                accuracy: 0.0,
                rmse: Some(mse.sqrt()),
                mae: Some(abs / (n * k) as f64),
                num_examples: n,
                confusion,
            }
        }
    })
}

/// Per-example anomaly score of an autoencoder: the mean squared reconstruction error of each
/// example (higher = more anomalous).
pub fn anomaly_scores(model: &Model, features: &[f32], n: usize) -> Result<Vec<f32>, LearningError> {
    if model.spec().task() != Task::Reconstruction {
        return Err(LearningError::InvalidConfig("anomaly scores need a reconstruction model".into()));
    }
    let out = logits_of(model, features, n)?;
    let f = model.spec().input_len();
    Ok(out.chunks(f).zip(features.chunks(f)).map(|(o, x)| reconstruction_error(o, x)).collect())
}

/// Mean squared error between a reconstruction and its input.
fn reconstruction_error(out: &[f32], x: &[f32]) -> f32 {
    (out.iter().zip(x).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>() / x.len().max(1) as f64) as f32
}

fn logits_of(model: &Model, features: &[f32], n: usize) -> Result<Vec<f32>, LearningError> {
    let f = model.spec().input_len();
    if features.len() != n * f {
        return Err(LearningError::InputMismatch(format!("{} values for {n} examples of {f} values", features.len())));
    }
    let x: Tensor<2> = Tensor::from_data(TensorData::new(features.to_vec(), [n, f]), model.device());
    read(model.forward(x)?)
}

/// One prediction: the fields of the model's task are set.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    /// Classification: arg-max class.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<usize>,
    /// Classification: softmax probabilities.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub probs: Vec<f32>,
    /// Regression: the predicted targets. Reconstruction: the reconstructed input.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub values: Vec<f32>,
    /// Reconstruction: the mean squared reconstruction error (higher = more anomalous).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub anomaly_score: Option<f32>,
}

impl Prediction {
    /// A classifier's answer from its logits.
    pub fn from_logits(z: &[f32]) -> Prediction {
        let m = z.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let e: Vec<f32> = z.iter().map(|&v| (v - m).exp()).collect();
        let s: f32 = e.iter().sum();
        let probs: Vec<f32> = e.iter().map(|v| v / s).collect();
        let label = argmax_rows(z, z.len()).next().unwrap_or(0);
        Prediction { label: Some(label), probs, ..Prediction::default() }
    }

    /// The probability of the predicted class (0 when there is none).
    pub fn confidence(&self) -> f32 {
        self.label.and_then(|l| self.probs.get(l)).copied().unwrap_or(0.0)
    }
}

/// Predictions for a batch, with the time the forward pass took.
#[derive(Clone, Debug, PartialEq)]
pub struct BatchPrediction {
    /// One per example.
    pub predictions: Vec<Prediction>,
    /// Wall-clock time from input to probabilities (tensor build, forward, read-back, softmax).
    pub latency: Duration,
}

/// An inference session: a model on the CPU device, ready to answer.
#[derive(Clone, Debug)]
pub struct Predictor {
    model: Model,
}

impl Predictor {
    /// Builds the model from a bundle.
    pub fn new(spec: &ModelSpec, bundle: &TensorBundle) -> Result<Predictor, LearningError> {
        Ok(Predictor { model: Model::from_bundle(spec, bundle)? })
    }

    /// Wraps a model.
    pub fn from_model(model: Model) -> Predictor {
        Predictor { model }
    }

    /// The model.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// Predicts `n` examples given as `n * input_len` values: classes and probabilities
    /// (classification), values (regression), or reconstructions with their anomaly scores.
    pub fn predict_batch(&self, features: &[f32], n: usize) -> Result<BatchPrediction, LearningError> {
        let start = Instant::now();
        let width: usize = self.model.net().plan().output.iter().product();
        let out = logits_of(&self.model, features, n)?;
        let task = self.model.spec().task();
        let f = self.model.spec().input_len();
        let predictions = out
            .chunks(width.max(1))
            .enumerate()
            .map(|(i, z)| match task {
                Task::Classification => Prediction::from_logits(z),
                Task::Regression => Prediction { values: z.to_vec(), ..Prediction::default() },
                Task::Reconstruction => {
                    let x = &features[i * f..(i + 1) * f];
                    Prediction { values: z.to_vec(), anomaly_score: Some(reconstruction_error(z, x)), ..Prediction::default() }
                }
            })
            .collect();
        Ok(BatchPrediction { predictions, latency: start.elapsed() })
    }

    /// Raw outputs (logits, regression values or reconstructions), `output_len` per example.
    pub fn outputs(&self, features: &[f32], n: usize) -> Result<Vec<f32>, LearningError> {
        logits_of(&self.model, features, n)
    }

    /// Anomaly scores of a reconstruction model (see [`anomaly_scores`]).
    pub fn anomaly_scores(&self, features: &[f32], n: usize) -> Result<Vec<f32>, LearningError> {
        anomaly_scores(&self.model, features, n)
    }

    /// Predicts one example; returns the prediction and its latency.
    pub fn predict(&self, features: &[f32]) -> Result<(Prediction, Duration), LearningError> {
        let mut b = self.predict_batch(features, 1)?;
        Ok((b.predictions.remove(0), b.latency))
    }
}
