//! Training, health checks and model loading on top of `fedfleet-learning` (blocking; the shell
//! runs them on tokio's blocking pool).

use std::time::Instant;

use ed25519_dalek::SigningKey;
use fedfleet_learning::{Dataset, ModelSpec, OptimizerConfig, Predictor, TrainConfig, train_local};
use fedfleet_protocol::{BundleLimits, DType, DeviceId, RoundAnnouncement, Signed, TensorBundle, UpdateHeader};

use crate::lifecycle::HealthReport;

/// A signed update ready for the outbox.
#[derive(Debug, Clone)]
pub struct TrainedUpdate {
    pub header: Vec<u8>,
    pub payload: Vec<u8>,
    pub num_examples: usize,
    pub final_loss: Option<f64>,
}

/// Decodes a model: spec JSON + safetensors bytes.
pub fn load_model(spec_json: &str, bytes: &[u8]) -> Result<(ModelSpec, TensorBundle), String> {
    let spec = ModelSpec::from_json(spec_json).map_err(|e| format!("spec: {e}"))?;
    let bundle = TensorBundle::decode(bytes, &BundleLimits::default()).map_err(|e| format!("bundle: {e}"))?;
    Ok((spec, bundle))
}

/// Builds a predictor for a model.
pub fn predictor(spec_json: &str, bytes: &[u8]) -> Result<Predictor, String> {
    let (spec, bundle) = load_model(spec_json, bytes)?;
    Predictor::new(&spec, &bundle).map_err(|e| format!("load: {e}"))
}

/// Maps a round config to the learning crate's.
pub fn train_config(a: &RoundAnnouncement) -> TrainConfig {
    let c = &a.config;
    TrainConfig {
        epochs: c.local_epochs.max(1) as usize,
        batch_size: c.batch_size.max(1) as usize,
        lr: c.learning_rate as f64,
        optimizer: if c.optimizer.eq_ignore_ascii_case("adam") {
            OptimizerConfig::adam()
        } else {
            OptimizerConfig::Sgd { momentum: 0.0 }
        },
        prox_mu: c.fedprox_mu as f64,
        max_steps: None,
    }
}

/// Fine-tunes the base model on `data`, quantizes the delta per the round config, and signs it.
pub fn train_update(
    a: &RoundAnnouncement,
    spec_json: &str,
    base_bytes: &[u8],
    data: &Dataset,
    device: &DeviceId,
    key: &SigningKey,
    nonce: [u8; 16],
) -> Result<TrainedUpdate, String> {
    let (spec, global) = load_model(spec_json, base_bytes)?;
    let data = match a.config.max_samples {
        Some(max) if (data.len() as u64) > max => data.subset(&(0..max as usize).collect::<Vec<_>>()),
        _ => data.clone(),
    };
    let seed = a.config.seed ^ fedfleet_protocol::Digest::of(device.as_str().as_bytes()).0[0] as u64;
    let out = train_local(&spec, &global, &data, &train_config(a), seed).map_err(|e| format!("training: {e}"))?;
    let delta = match a.config.quantization {
        DType::F32 => out.delta,
        d => out.delta.quantize(d),
    };
    let payload = delta.encode();
    let header = UpdateHeader {
        device: device.clone(),
        fleet: a.fleet.clone(),
        round: a.round,
        base_model: a.base_model.digest,
        nonce,
        sample_count: out.num_examples as u64,
        payload_len: payload.len() as u64,
        payload_digest: fedfleet_protocol::Digest::of(&payload),
        payload_dtype: a.config.quantization,
    };
    let signed = Signed::sign(header, key);
    Ok(TrainedUpdate {
        header: signed.encode(),
        payload,
        num_examples: out.num_examples,
        final_loss: out.metrics.epochs.last().map(|e| e.loss as f64),
    })
}

/// Health check: the candidate loads, runs on the holdout without NaN/Inf, per-example latency
/// (p50/p99 over up to `latency_samples` examples), and the task's metric (accuracy, or minus
/// the RMSE for regression and reconstruction) of both models on the holdout.
pub fn health_check(
    candidate: (&str, &[u8]),
    active: Option<(&str, &[u8])>,
    holdout: &Dataset,
    latency_samples: usize,
) -> Result<HealthReport, String> {
    let p = predictor(candidate.0, candidate.1)?;
    if holdout.is_empty() {
        return Ok(HealthReport {
            holdout: 0,
            non_finite: false,
            latency_p50_ms: 0.0,
            latency_p99_ms: 0.0,
            candidate_score: 0.0,
            active_score: None,
            metric: "accuracy".into(),
        });
    }
    let (candidate_score, metric, finite) = task_score(candidate, holdout)?;
    let mut lat = Vec::new();
    for i in 0..holdout.len().min(latency_samples.max(1)) {
        let t = Instant::now();
        p.predict(holdout.example(i)).map_err(|e| format!("run: {e}"))?;
        lat.push(t.elapsed().as_secs_f64() * 1e3);
    }
    lat.sort_by(f64::total_cmp);
    let q = |f: f64| lat[((lat.len() - 1) as f64 * f).round() as usize];
    let active_score = match active {
        Some(model) => match task_score(model, holdout) {
            Ok((score, _, _)) => Some(score),
            Err(e) => {
                tracing::warn!(error = %e, "active model does not load for comparison");
                None
            }
        },
        None => None,
    };
    Ok(HealthReport {
        holdout: holdout.len(),
        non_finite: !finite,
        latency_p50_ms: q(0.5),
        latency_p99_ms: q(0.99),
        candidate_score,
        active_score,
        metric,
    })
}

/// The task's score of a model on `data` (higher is better), its name, and whether the loss was
/// finite.
fn task_score((spec_json, bytes): (&str, &[u8]), data: &Dataset) -> Result<(f64, String, bool), String> {
    let (spec, bundle) = load_model(spec_json, bytes)?;
    let r = fedfleet_learning::evaluate(&spec, &bundle, data).map_err(|e| format!("run: {e}"))?;
    let (name, _, higher_is_better) = r.metric();
    let metric = if higher_is_better { name.to_owned() } else { format!("-{name}") };
    Ok((r.score(), metric, r.loss.is_finite() && r.score().is_finite()))
}

/// Latency quantile helper for figures: `(p50, p99)` in ms.
pub fn quantiles_ms(mut v: Vec<f64>) -> (f64, f64) {
    if v.is_empty() {
        return (0.0, 0.0);
    }
    v.sort_by(f64::total_cmp);
    let q = |f: f64| v[((v.len() - 1) as f64 * f).round() as usize];
    (q(0.5), q(0.99))
}
