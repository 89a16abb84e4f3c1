//! Fine-tuning helpers around the modes of [`crate::FineTune`]: start LoRA from pre-trained
//! weights, merge adapters into the base weights, and put device-local (FedBN) tensors back
//! over a new global model.

use crate::error::LearningError;
use crate::graph::{AdapterInit, FineTune, Node, Op};
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
    let principal = matches!(spec.finetune(), FineTune::Lora { init_a: AdapterInit::Principal, .. });
    let mut out = TensorBundle::new();
    for (name, t) in fresh.iter() {
        match name.strip_suffix(".lora_A").filter(|_| principal) {
            Some(layer) => {
                let weight = format!("{layer}.weight");
                let w = base.to_f32(&weight).ok_or_else(|| LearningError::Layout(format!("tensor {weight} missing")))?;
                let r = t.shape[0];
                let fan = t.shape[1..].iter().product::<usize>();
                out.insert_f32(name, t.shape.clone(), principal_directions(&w, fan, r))?;
            }
            None => out.insert(name, base.get(name).unwrap_or(t).clone())?,
        }
    }
    Ok(out)
}

/// The top-`r` right singular vectors of `w` (`[out, fan]`, row-major) as the rows of an
/// `[r, fan]` matrix: orthogonal iteration on `wᵀw` in f64 from a fixed start, so every
/// device computes the same rows from the same weights. Signs are normalised (largest entry
/// of each row positive).
fn principal_directions(w: &[f32], fan: usize, r: usize) -> Vec<f32> {
    let out = w.len() / fan;
    let mut gram = vec![0f64; fan * fan];
    for o in 0..out {
        let row = &w[o * fan..(o + 1) * fan];
        for i in 0..fan {
            let wi = row[i] as f64;
            for j in 0..fan {
                gram[i * fan + j] += wi * row[j] as f64;
            }
        }
    }
    // Start from a fixed, full-rank basis; 200 iterations settle a 128-wide Gram matrix.
    let mut q: Vec<Vec<f64>> = (0..r)
        .map(|k| (0..fan).map(|i| 1.0 / (1.0 + ((i * 7 + k * 13) % 17) as f64) + if i % r == k { 1.0 } else { 0.0 }).collect())
        .collect();
    for _ in 0..200 {
        let mut next: Vec<Vec<f64>> =
            q.iter().map(|v| (0..fan).map(|i| (0..fan).map(|j| gram[i * fan + j] * v[j]).sum()).collect()).collect();
        for k in 0..next.len() {
            let (done, rest) = next.split_at_mut(k);
            let v = &mut rest[0];
            for p in done.iter() {
                let dot: f64 = v.iter().zip(p).map(|(a, b)| a * b).sum();
                v.iter_mut().zip(p).for_each(|(a, b)| *a -= dot * b);
            }
            let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
            if norm > 0.0 {
                v.iter_mut().for_each(|x| *x /= norm);
            }
        }
        q = next;
    }
    let mut rows = Vec::with_capacity(r * fan);
    for v in q {
        let big = v.iter().copied().fold(0.0f64, |m, x| if x.abs() > m.abs() { x } else { m });
        let sign = if big < 0.0 { -1.0 } else { 1.0 };
        rows.extend(v.iter().map(|x| (x * sign) as f32));
    }
    rows
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
                Op::Linear { weight, lora: Some(l), .. } | Op::Conv { weight, lora: Some(l), .. } => out.push((*weight, l.a, l.b, l.scale)),
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
                return Err(LearningError::Layout(format!("local {name} has shape {:?}, the global model {:?}", local.shape, t.shape)));
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

#[cfg(test)]
mod tests {
    use super::principal_directions;

    #[test]
    fn principal_directions_are_the_top_right_singular_vectors() {
        // W = U·diag(3, 2, 1)·Vᵀ with V a rotation in the first two input coordinates.
        let (c, s) = (0.6f32, 0.8f32);
        let w = [3.0 * c, 3.0 * s, 0.0, 0.0, -2.0 * s, 2.0 * c, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0];
        let a = principal_directions(&w, 4, 2);
        let expected = [c, s, 0.0, 0.0, -s, c, 0.0, 0.0];
        let sign = |row: &[f32]| if row.iter().fold(0f32, |m, x| if x.abs() > m.abs() { *x } else { m }) < 0.0 { -1.0 } else { 1.0 };
        for k in 0..2 {
            let (got, want) = (&a[k * 4..k * 4 + 4], &expected[k * 4..k * 4 + 4]);
            let flip = sign(want);
            for (g, w) in got.iter().zip(want) {
                assert!((g - flip * w).abs() < 1e-5, "row {k}: {got:?} vs {want:?}");
            }
        }
        // Deterministic: the same weights give the same rows, bit for bit.
        assert_eq!(principal_directions(&w, 4, 2), a);
    }
}
