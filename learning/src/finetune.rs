//! Fine-tuning helpers around the modes of [`crate::FineTune`]: start LoRA from pre-trained
//! weights, merge adapters into the base weights, and put device-local (FedBN) tensors back
//! over a new global model.

use crate::error::LearningError;
use crate::graph::{FineTune, Op, Node};
use crate::model::init_bundle;
use crate::spec::ModelSpec;
use fedfleet_protocol::bundle::TensorBundle;

/// The same model with full fine-tuning: what the adapters merge into, and the layout of
/// pre-trained weights.
pub fn base_spec(spec: &ModelSpec) -> ModelSpec {
    match spec {
        ModelSpec::Graph(g) => {
            let mut g = g.clone();
            g.finetune = FineTune::Full;
            ModelSpec::Graph(g)
        }
        other => other.clone(),
    }
}

/// A LoRA model's starting bundle: the pre-trained `base` weights (layout of
/// [`base_spec`]) plus fresh adapters from `seed` (A like the layer's weight init, B zero, so
/// the adapted model computes exactly what the base model does).
pub fn attach_adapters(spec: &ModelSpec, base: &TensorBundle, seed: u64) -> Result<TensorBundle, LearningError> {
    crate::model::check_layout(&base_spec(spec), base)?;
    let fresh = init_bundle(spec, seed)?;
    let mut out = TensorBundle::new();
    for (name, t) in fresh.iter() {
        out.insert(name, base.get(name).unwrap_or(t).clone())?;
    }
    Ok(out)
}

/// A LoRA spec's adapters: rank, alpha, and the base weights they adapt (`fc2.weight`, ...).
/// `None` for the other fine-tuning modes.
pub fn lora_adapters(spec: &ModelSpec) -> Option<(usize, f64, Vec<String>)> {
    let FineTune::Lora { rank, alpha, .. } = spec.finetune() else { return None };
    let adapted = spec.layout().keys().filter_map(|n| n.strip_suffix(".lora_A").map(|layer| format!("{layer}.weight"))).collect();
    Some((rank, alpha.0, adapted))
}

/// Folds every adapter into its layer: `W + (alpha / r) · B·A` (B·A reshaped to W's shape),
/// computed in f64 and rounded once. Returns the bundle of [`base_spec`] (no adapter tensors).
/// A spec without LoRA returns the bundle unchanged.
pub fn merge_lora(spec: &ModelSpec, bundle: &TensorBundle) -> Result<TensorBundle, LearningError> {
    let plan = spec.plan()?;
    crate::model::check_layout(spec, bundle)?;
    let mut merged: Vec<(usize, Vec<f32>)> = Vec::new();
    fn walk(nodes: &[Node], out: &mut Vec<(usize, usize, usize, f64)>) {
        for n in nodes {
            match &n.op {
                Op::Linear { weight, lora: Some(l), .. } | Op::Conv { weight, lora: Some(l), .. } => {
                    out.push((*weight, l.a, l.b, l.scale))
                }
                Op::Residual { body, shortcut } => {
                    walk(body, out);
                    walk(shortcut, out);
                }
                Op::Sequence(nodes) => walk(nodes, out),
                _ => {}
            }
        }
    }
    let mut adapters = Vec::new();
    walk(&plan.nodes, &mut adapters);
    let value = |slot: usize| -> Result<Vec<f32>, LearningError> {
        bundle.to_f32(&plan.slots[slot].name).ok_or_else(|| LearningError::Layout(format!("tensor {} missing", plan.slots[slot].name)))
    };
    for (w, a, b, scale) in adapters {
        let (wv, av, bv) = (value(w)?, value(a)?, value(b)?);
        let (out, r) = (plan.slots[b].shape[0], plan.slots[b].shape[1]);
        let fan = av.len() / r;
        let mut merged_w = wv;
        for o in 0..out {
            for j in 0..fan {
                let ba: f64 = (0..r).map(|k| bv[o * r + k] as f64 * av[k * fan + j] as f64).sum();
                let i = o * fan + j;
                merged_w[i] = (merged_w[i] as f64 + scale * ba) as f32;
            }
        }
        merged.push((w, merged_w));
    }
    let base = base_spec(spec);
    let mut result = TensorBundle::new();
    for p in base.params() {
        let values = match merged.iter().find(|(s, _)| plan.slots[*s].name == p.name) {
            Some((_, v)) => v.clone(),
            None => bundle.to_f32(&p.name).ok_or_else(|| LearningError::Layout(format!("tensor {} missing", p.name)))?,
        };
        result.insert_f32(p.name, p.shape, values)?;
    }
    Ok(result)
}

/// `global` with the tensors of `local_state` (a [`crate::TrainOutcome::local_state`])
/// replacing its own: how a FedBN device resumes with its own batch norms.
pub fn overlay_local(global: &TensorBundle, local_state: &TensorBundle) -> Result<TensorBundle, LearningError> {
    let mut out = TensorBundle::new();
    for (name, t) in global.iter() {
        let t = match local_state.get(name) {
            Some(local) if local.shape == t.shape => local,
            Some(local) => {
                return Err(LearningError::Layout(format!(
                    "local {name} has shape {:?}, the global model {:?}",
                    local.shape, t.shape
                )));
            }
            None => t,
        };
        out.insert(name, t.clone())?;
    }
    if let Some((name, _)) = local_state.iter().find(|(n, _)| global.get(n).is_none()) {
        return Err(LearningError::Layout(format!("local tensor {name} is not in the global model")));
    }
    Ok(out)
}
