//! fedfleet's model descriptions without the engine that runs them: the presets and layer
//! graphs of [`ModelSpec`], the tensor layout each implies (PyTorch `state_dict` names and
//! shapes), what fine-tuning does with each tensor, and the bounds on a spec's cost.
//!
//! `fedfleet-learning` builds and trains models from these; the registry, which links no
//! engine, checks with [`check_weights`] that every artifact it is asked to publish is a model of
//! the spec it is published with.

pub mod graph;
pub mod spec;

use fedfleet_protocol::bundle::{LayoutDiff, TensorBundle};
pub use graph::{AdapterInit, FineTune, GraphSpec, Layer, Task};
pub use spec::{CustomSpec, ModelSpec, TensorDecl, TensorRole};

/// Why a spec, or weights for it, are not usable. Every problem is named.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SpecError {
    /// The model spec is not usable (zero sizes, unknown shapes, over a cost bound...).
    #[error("invalid model spec: {0}")]
    InvalidSpec(String),
    /// A tensor bundle does not have the parameter layout the spec requires.
    #[error("bundle does not match the model layout: {0}")]
    Layout(String),
    /// Weights are not a model of their spec: every wrong tensor and every one holding NaN or
    /// infinities.
    #[error("the weights are not a model of their spec: {0}")]
    Weights(String),
}

/// Checks that the bundle has exactly the spec's tensors and shapes, naming every difference.
pub fn check_layout(spec: &ModelSpec, bundle: &TensorBundle) -> Result<(), SpecError> {
    spec.validate()?;
    let problems = layout_problems(spec, bundle);
    if problems.is_empty() {
        return Ok(());
    }
    Err(SpecError::Layout(format!("{} ({}): {}", spec.arch(), spec.to_json(), problems.join("; "))))
}

/// Checks that `bundle` is a model of `spec`: the spec is valid and within its cost bounds, the
/// tensors are exactly the spec's with its shapes, and every value is finite. Every problem is
/// named.
pub fn check_weights(spec: &ModelSpec, bundle: &TensorBundle) -> Result<(), SpecError> {
    spec.validate()?;
    let mut problems = layout_problems(spec, bundle);
    problems.extend(bundle.iter().filter(|(_, t)| !t.is_finite()).map(|(n, _)| format!("{n} holds NaN or infinities")));
    if problems.is_empty() {
        return Ok(());
    }
    Err(SpecError::Weights(problems.join("; ")))
}

fn layout_problems(spec: &ModelSpec, bundle: &TensorBundle) -> Vec<String> {
    let diff = LayoutDiff::between(&spec.layout(), &bundle.layout());
    let missing = diff.missing.iter().map(|(name, _)| format!("missing {name}"));
    let reshaped = diff.reshaped.iter().map(|(name, got, want)| format!("{name} has shape {got:?}, expected {want:?}"));
    let unexpected = diff.unexpected.iter().map(|(name, _)| format!("unexpected {name}"));
    missing.chain(reshaped).chain(unexpected).collect()
}
