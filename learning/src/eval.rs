//! Evaluation (loss, accuracy, confusion counts) and inference (batch and single example,
//! with measured latency).

use crate::data::Dataset;
use crate::error::LearningError;
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
    /// Mean cross-entropy (natural log).
    pub loss: f64,
    /// Fraction of examples whose arg-max class is the label.
    pub accuracy: f64,
    /// Examples evaluated.
    pub num_examples: usize,
    /// `confusion[true][predicted]` counts.
    pub confusion: Vec<Vec<u64>>,
}

impl EvalReport {
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
    let classes = spec.classes();
    let f = data.example_len();
    let mut confusion = vec![vec![0u64; classes]; classes];
    let mut loss = 0.0f64;
    let mut correct = 0usize;
    let idx: Vec<usize> = (0..data.len()).collect();
    for batch in idx.chunks(256) {
        let lo = batch[0] * f;
        let hi = (batch[batch.len() - 1] + 1) * f;
        let logits = logits_of(model, &data.features[lo..hi], batch.len())?;
        for (row, (&i, p)) in batch.iter().zip(argmax_rows(&logits, classes)).enumerate() {
            let y = data.labels[i] as usize;
            let z = &logits[row * classes..(row + 1) * classes];
            let m = z.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
            let lse = m + z.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln();
            loss += lse - z[y] as f64;
            confusion[y][p] += 1;
            correct += usize::from(p == y);
        }
    }
    let n = data.len();
    Ok(EvalReport { loss: loss / n as f64, accuracy: correct as f64 / n as f64, num_examples: n, confusion })
}

fn logits_of(model: &Model, features: &[f32], n: usize) -> Result<Vec<f32>, LearningError> {
    let f = model.spec().input_len();
    if features.len() != n * f {
        return Err(LearningError::InputMismatch(format!(
            "{} values for {n} examples of {f} values",
            features.len()
        )));
    }
    let x: Tensor<2> = Tensor::from_data(TensorData::new(features.to_vec(), [n, f]), model.device());
    read(model.forward(x))
}

/// One prediction.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    /// Arg-max class.
    pub label: usize,
    /// Softmax probabilities.
    pub probs: Vec<f32>,
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

    /// Predicts `n` examples given as `n * input_len` values.
    pub fn predict_batch(&self, features: &[f32], n: usize) -> Result<BatchPrediction, LearningError> {
        let start = Instant::now();
        let classes = self.model.spec().classes();
        let logits = logits_of(&self.model, features, n)?;
        let predictions = logits
            .chunks(classes)
            .map(|z| {
                let m = z.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                let e: Vec<f32> = z.iter().map(|&v| (v - m).exp()).collect();
                let s: f32 = e.iter().sum();
                let probs: Vec<f32> = e.iter().map(|v| v / s).collect();
                let label = argmax_rows(z, classes).next().unwrap_or(0);
                Prediction { label, probs }
            })
            .collect();
        Ok(BatchPrediction { predictions, latency: start.elapsed() })
    }

    /// Predicts one example; returns the prediction and its latency.
    pub fn predict(&self, features: &[f32]) -> Result<(Prediction, Duration), LearningError> {
        let mut b = self.predict_batch(features, 1)?;
        Ok((b.predictions.remove(0), b.latency))
    }
}
