//! The model code the agent runs for a round, a health check and inference: the [`Trainer`]
//! trait a device team implements around its own burn module (what Flower's `ClientApp` wraps,
//! without Python on the device), and [`GraphTrainer`], the built-in one for layer-graph models.
//!
//! The agent keeps everything else: which rounds to join, signing, the outbox, installs, A/B
//! slots, health-check decisions and rollbacks. A trainer only computes.

use std::sync::Arc;

use fedfleet_learning::{Dataset, ModelSpec, OptimizerConfig, Prediction, Predictor, TrainConfig};
use fedfleet_protocol::{RoundConfig, RoundId, TensorBundle};

/// A model as the agent hands it to a trainer: its spec and its weights (`state_dict` names).
#[derive(Clone, Copy)]
pub struct ModelView<'a> {
    pub spec: &'a ModelSpec,
    pub weights: &'a TensorBundle,
}

/// One round's local training.
pub struct RoundJob<'a> {
    /// The round being trained for.
    pub round: RoundId,
    /// Its settings as the aggregator announced them (epochs, batch size, learning rate,
    /// optimizer); [`RoundJob::train_config`] maps them to `fedfleet-learning`'s.
    pub config: &'a RoundConfig,
    /// This device's seed for the round (the round's seed mixed with the device id).
    pub seed: u64,
    /// The agent's data: the configured `[data]` and what the application pushed into the
    /// inbox, capped at the round's `max_samples`. A trainer with its own data source may
    /// ignore it.
    pub data: &'a Dataset,
}

impl RoundJob<'_> {
    /// The round's settings as `fedfleet-learning` takes them.
    pub fn train_config(&self) -> TrainConfig {
        let c = self.config;
        TrainConfig {
            local_epochs: c.local_epochs.max(1) as usize,
            batch_size: c.batch_size.max(1) as usize,
            learning_rate: c.learning_rate as f64,
            optimizer: if c.optimizer.eq_ignore_ascii_case("adam") {
                OptimizerConfig::adam()
            } else {
                OptimizerConfig::Sgd { momentum: 0.0 }
            },
            proximal_mu: c.proximal_mu as f64,
            max_steps: None,
        }
    }
}

/// What local training produced.
pub struct LocalUpdate {
    /// Trained minus global weights, for exactly the tensors the spec's update carries
    /// ([`ModelSpec::update_layout`]); the agent refuses anything else before signing.
    pub delta: TensorBundle,
    /// Examples trained on (the aggregator weights the update by it).
    pub num_examples: usize,
    /// The last epoch's mean loss, for the log.
    pub loss: Option<f64>,
    /// Trained values of tensors that stay on the device (FedBN's local batch norms): the agent
    /// keeps them and lays them over every later global model, for training and inference.
    /// Empty for most models.
    pub local_state: TensorBundle,
}

/// A model's score on the device's holdout.
#[derive(Debug, Clone)]
pub struct Evaluation {
    /// The metric behind `score`, e.g. `accuracy` or `-rmse`.
    pub metric: String,
    /// Higher is better (the health check and promotion compare it).
    pub score: f64,
    /// Examples scored; 0: nothing to check on (the health check passes on the other checks).
    pub examples: usize,
    /// Whether the loss and the score were finite.
    pub finite: bool,
}

/// A loaded model answering inference requests.
pub trait Serve: Send + Sync {
    /// Values per input example.
    fn input_len(&self) -> usize;
    /// Answers `n` examples given as `n * input_len` normalised values.
    fn predict(&self, inputs: &[f32], n: usize) -> Result<Vec<Prediction>, String>;
}

/// The device team's model code. Every method runs on a blocking thread; errors are reported
/// (a failed round, a failed health check) and never stop the agent.
pub trait Trainer: Send + Sync + 'static {
    /// Fine-tunes `model` (the round's global model) and returns the delta of the tensors an
    /// update carries.
    fn train(&self, model: ModelView<'_>, job: RoundJob<'_>) -> Result<LocalUpdate, String>;
    /// Scores `model` on the holdout (the agent's, from `[data]` and the inbox; a trainer with
    /// its own data may score on its own holdout instead).
    fn evaluate(&self, model: ModelView<'_>, holdout: &Dataset) -> Result<Evaluation, String>;
    /// Loads `model` for inference.
    fn load(&self, model: ModelView<'_>) -> Result<Arc<dyn Serve>, String>;
    /// Examples the trainer holds of its own, beyond the agent's data (for the participation
    /// policy and the round's weighting); `0` when it trains on what the agent hands it.
    fn own_examples(&self) -> usize {
        0
    }
}

/// The built-in trainer: runs any layer-graph spec (the MLP and CNN presets included) on
/// `fedfleet-learning`'s engine.
#[derive(Debug, Default, Clone, Copy)]
pub struct GraphTrainer;

impl Serve for Predictor {
    fn input_len(&self) -> usize {
        self.model().spec().input_len()
    }
    fn predict(&self, inputs: &[f32], n: usize) -> Result<Vec<Prediction>, String> {
        self.predict_batch(inputs, n).map(|b| b.predictions).map_err(|e| e.to_string())
    }
}

impl Trainer for GraphTrainer {
    fn train(&self, model: ModelView<'_>, job: RoundJob<'_>) -> Result<LocalUpdate, String> {
        builtin_only(model.spec)?;
        let out = fedfleet_learning::train_local(model.spec, model.weights, job.data, &job.train_config(), job.seed)
            .map_err(|e| e.to_string())?;
        let loss = out.metrics.epochs.last().map(|e| e.loss);
        Ok(LocalUpdate { delta: out.delta, num_examples: out.num_examples, loss, local_state: out.local_state })
    }

    fn evaluate(&self, model: ModelView<'_>, holdout: &Dataset) -> Result<Evaluation, String> {
        builtin_only(model.spec)?;
        if holdout.is_empty() {
            return Ok(Evaluation { metric: "accuracy".into(), score: 0.0, examples: 0, finite: true });
        }
        let r = fedfleet_learning::evaluate(model.spec, model.weights, holdout).map_err(|e| e.to_string())?;
        let (name, _, higher_is_better) = r.metric();
        let metric = if higher_is_better { name.to_owned() } else { format!("-{name}") };
        Ok(Evaluation { metric, score: r.score(), examples: r.num_examples, finite: r.loss.is_finite() && r.score().is_finite() })
    }

    fn load(&self, model: ModelView<'_>) -> Result<Arc<dyn Serve>, String> {
        builtin_only(model.spec)?;
        Ok(Arc::new(Predictor::new(model.spec, model.weights).map_err(|e| e.to_string())?))
    }
}

fn builtin_only(spec: &ModelSpec) -> Result<(), String> {
    match spec {
        ModelSpec::Custom(c) => Err(format!(
            "model \"{}\" is a custom model: this agent has no trainer for it (build the agent with the team's Trainer)",
            c.kind
        )),
        _ => Ok(()),
    }
}
