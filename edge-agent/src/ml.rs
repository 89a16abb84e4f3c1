//! A round's update, health checks and model loading, run through the agent's [`Trainer`]
//! (blocking; the shell runs them on tokio's blocking pool). Signing and the checks on what a
//! trainer returns live here, so that a team's trainer cannot skip them.

use std::sync::Arc;
use std::time::Instant;

use ed25519_dalek::SigningKey;
use fedfleet_learning::{Dataset, ModelSpec};
use fedfleet_protocol::{BundleLimits, DType, DeviceId, RoundAnnouncement, Signed, TensorBundle, UpdateHeader};

use crate::lifecycle::HealthReport;
use crate::trainer::{ModelView, RoundJob, Serve, Trainer};

/// A signed update ready for the outbox, and the tensors the device keeps.
#[derive(Debug, Clone)]
pub struct TrainedUpdate {
    pub header: Vec<u8>,
    pub payload: Vec<u8>,
    pub num_examples: usize,
    pub final_loss: Option<f64>,
    /// FedBN's local tensors after this round (empty for most models).
    pub local_state: TensorBundle,
}

/// `weights` with this device's local tensors laid over them (FedBN: its own batch norms, not
/// the global model's). Local tensors that no longer fit the model (another architecture) are
/// ignored, with a warning.
pub fn with_local(weights: TensorBundle, local: Option<&TensorBundle>) -> TensorBundle {
    match local.filter(|l| !l.is_empty()) {
        None => weights,
        Some(l) => fedfleet_learning::finetune::overlay_local(&weights, l).unwrap_or_else(|e| {
            tracing::warn!(error = %e, "this device's local tensors do not fit the model; using the model's own");
            weights
        }),
    }
}

/// Decodes a model: spec JSON + safetensors bytes.
pub fn load_model(spec_json: &str, bytes: &[u8]) -> Result<(ModelSpec, TensorBundle), String> {
    let spec = ModelSpec::from_json(spec_json).map_err(|e| format!("spec: {e}"))?;
    let bundle = TensorBundle::decode(bytes, &BundleLimits::default()).map_err(|e| format!("bundle: {e}"))?;
    Ok((spec, bundle))
}

/// Loads a model for inference with `trainer` (with the device's local tensors).
pub fn load_served(trainer: &dyn Trainer, spec_json: &str, bytes: &[u8], local: Option<&TensorBundle>) -> Result<Arc<dyn Serve>, String> {
    let (spec, weights) = load_model(spec_json, bytes)?;
    let weights = with_local(weights, local);
    trainer.load(ModelView { spec: &spec, weights: &weights }).map_err(|e| format!("load: {e}"))
}

/// Fine-tunes the base model (with the device's local tensors) with `trainer`, checks what it
/// returned against the spec's update layout, quantizes the delta per the round config, and
/// signs it.
#[allow(clippy::too_many_arguments)]
pub fn train_update(
    trainer: &dyn Trainer,
    a: &RoundAnnouncement,
    spec_json: &str,
    base_bytes: &[u8],
    data: &Dataset,
    local: Option<&TensorBundle>,
    device: &DeviceId,
    key: &SigningKey,
    nonce: [u8; 16],
) -> Result<TrainedUpdate, String> {
    let (spec, global) = load_model(spec_json, base_bytes)?;
    let global = with_local(global, local);
    let data = match a.config.max_samples {
        Some(max) if (data.len() as u64) > max => data.subset(&(0..max as usize).collect::<Vec<_>>()),
        _ => data.clone(),
    };
    let seed = a.config.seed ^ fedfleet_protocol::Digest::of(device.as_str().as_bytes()).0[0] as u64;
    let out = trainer
        .train(ModelView { spec: &spec, weights: &global }, RoundJob { round: a.round, config: &a.config, seed, data: &data })
        .map_err(|e| format!("training: {e}"))?;
    out.delta
        .check_layout(&spec.update_layout())
        .map_err(|e| format!("the trainer's update does not match the spec's update layout: {e}"))?;
    out.delta.check_finite().map_err(|e| format!("the trainer's update: {e}"))?;
    if out.num_examples == 0 {
        return Err("the trainer trained on no examples".into());
    }
    // Differential privacy on the device, before the update is signed (or masked).
    let delta = match &a.config.device_privacy {
        Some(p) => {
            let (private, did) = fedfleet_agent_core::privacy::privatize(&out.delta, p, &mut rand::rngs::OsRng)?;
            tracing::info!(norm = did.norm, scale = did.scale, noise_stddev = p.noise_stddev, "update clipped and noised on the device");
            private
        }
        None => out.delta,
    };
    let delta = match a.config.quantization {
        DType::F32 => delta,
        d => delta.quantize(d),
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
        final_loss: out.loss,
        local_state: out.local_state,
    })
}

/// Health check: the candidate loads, its task metric on the holdout (accuracy, or minus the
/// RMSE for regression and reconstruction) is finite and is compared with the active model's,
/// and per-example latency (p50/p99 over up to `latency_samples` holdout examples).
pub fn health_check(
    trainer: &dyn Trainer,
    candidate: (&str, &[u8]),
    active: Option<(&str, &[u8])>,
    holdout: &Dataset,
    local: Option<&TensorBundle>,
    latency_samples: usize,
) -> Result<HealthReport, String> {
    let (spec, weights) = load_model(candidate.0, candidate.1)?;
    let weights = with_local(weights, local);
    let view = ModelView { spec: &spec, weights: &weights };
    let served = trainer.load(view).map_err(|e| format!("load: {e}"))?;
    let eval = trainer.evaluate(view, holdout).map_err(|e| format!("run: {e}"))?;
    let mut lat = Vec::new();
    let n = holdout.len().min(latency_samples.max(1));
    for i in 0..n {
        let t = Instant::now();
        served.predict(holdout.example(i), 1).map_err(|e| format!("run: {e}"))?;
        lat.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let (latency_p50_ms, latency_p99_ms) = quantiles_ms(lat);
    let active_score = match active {
        Some((spec_json, bytes)) if eval.examples > 0 => {
            let score = load_model(spec_json, bytes)
                .and_then(|(s, w)| trainer.evaluate(ModelView { spec: &s, weights: &with_local(w, local) }, holdout));
            match score {
                Ok(e) => Some(e.score),
                Err(e) => {
                    tracing::warn!(error = %e, "active model does not load for comparison");
                    None
                }
            }
        }
        _ => None,
    };
    Ok(HealthReport {
        holdout: eval.examples,
        non_finite: !eval.finite,
        latency_p50_ms,
        latency_p99_ms,
        candidate_score: if eval.examples > 0 { eval.score } else { 0.0 },
        active_score,
        chance_score: chance_score(&spec, &eval.metric),
        metric: eval.metric,
    })
}

/// What guessing scores: 1/classes for a classifier's accuracy; no level for other metrics.
fn chance_score(spec: &ModelSpec, metric: &str) -> Option<f64> {
    let classes = spec.classes();
    (metric == "accuracy" && spec.task() == fedfleet_learning::Task::Classification && classes >= 2).then(|| 1.0 / classes as f64)
}

/// Latency quantiles for figures: `(p50, p99)` in ms.
pub fn quantiles_ms(mut v: Vec<f64>) -> (f64, f64) {
    if v.is_empty() {
        return (0.0, 0.0);
    }
    v.sort_by(f64::total_cmp);
    let q = |f: f64| v[((v.len() - 1) as f64 * f).round() as usize];
    (q(0.5), q(0.99))
}

#[cfg(test)]
mod tests {
    use fedfleet_protocol::{DevicePrivacy, FleetId, ModelRef, ModelVersion, RoundConfig, RoundId, Selection};

    use super::*;
    use crate::trainer::GraphTrainer;

    /// The update `train_update` signs for `privacy`, flattened.
    fn trained(privacy: Option<DevicePrivacy>) -> Vec<f32> {
        let spec = ModelSpec::Mlp { input: vec![64], hidden: vec![16], classes: 10 };
        let base = fedfleet_learning::model::init_bundle(&spec, 3).unwrap().encode();
        let data = Dataset::digits().unwrap().subset(&(0..64).collect::<Vec<_>>());
        let a = RoundAnnouncement {
            fleet: FleetId::new("f").unwrap(),
            round: RoundId(1),
            base_model: ModelRef { name: "m".into(), version: ModelVersion(1), digest: fedfleet_protocol::Digest::of(&base) },
            config: RoundConfig { learning_rate: 0.5, device_privacy: privacy, ..RoundConfig::default() },
            deadline_unix_ms: u64::MAX,
            selection: Selection::All,
        };
        let key = SigningKey::from_bytes(&[4; 32]);
        let device = DeviceId::new("dev-1").unwrap();
        let u = train_update(&GraphTrainer, &a, &spec.to_json(), &base, &data, None, &device, &key, [0; 16]).unwrap();
        TensorBundle::decode(&u.payload, &BundleLimits::default()).unwrap().flat_f32()
    }

    fn norm(v: &[f32]) -> f64 {
        v.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt()
    }

    #[test]
    fn a_round_with_device_privacy_gets_a_clipped_and_noised_update() {
        let plain = trained(None);
        assert!(norm(&plain) > 0.01, "training moved the model: {}", norm(&plain));
        let clipped = trained(Some(DevicePrivacy { clip_norm: 0.01, noise_stddev: 0.0, count_once: false }));
        assert!(norm(&clipped) <= 0.01 && norm(&clipped) > 0.0099, "{}", norm(&clipped));
        // Noise far above the clipped update: the payload's spread is the noise's. The noise is
        // fresh each run; over these 1,210 coordinates the estimate's own spread is about 2 %
        // (0.5/sqrt(2n)), so the bound is 6 of those, not a coin flip.
        let noised = trained(Some(DevicePrivacy { clip_norm: 0.01, noise_stddev: 0.5, count_once: false }));
        assert_eq!(noised.len(), 1210);
        let sd = (noised.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>() / noised.len() as f64).sqrt();
        assert!((sd - 0.5).abs() < 0.06, "{sd}");
    }
}
