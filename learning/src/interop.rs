//! PyTorch interop: safetensors `state_dict` files with PyTorch names, layouts and dtypes.
//!
//! Import checks a file against a model's description and lists every mismatch at once
//! (missing, unexpected, wrong shape, wrong dtype). Floating tensors may be F32, F64, F16 or
//! BF16 (converted to f32); `num_batches_tracked` must be I64, as PyTorch writes it. Export
//! writes F32 tensors and I64 counters with the metadata `{"format": "pt"}`, so
//! `safetensors.torch.load_file` + `load_state_dict(strict=True)` accepts it; exporting an
//! imported export gives the same bytes.

use crate::error::LearningError;
use crate::spec::ModelSpec;
use fedfleet_protocol::bundle::TensorBundle;
use safetensors::tensor::{Dtype, SafeTensors, View};
use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::path::Path;

/// One difference between a `state_dict` file and a model description.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StateDictProblem {
    /// The model has this tensor, the file does not.
    Missing { name: String, shape: Vec<usize> },
    /// The file has a tensor the model does not.
    Unexpected { name: String, shape: Vec<usize> },
    /// Both have it, with different shapes.
    WrongShape { name: String, expected: Vec<usize>, found: Vec<usize> },
    /// Both have it, the file's dtype is not accepted for it.
    WrongDtype { name: String, expected: &'static str, found: String },
    /// A value is NaN or infinite.
    NotFinite { name: String },
}

impl fmt::Display for StateDictProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StateDictProblem::Missing { name, shape } => write!(f, "missing {name} {shape:?}"),
            StateDictProblem::Unexpected { name, shape } => write!(f, "unexpected {name} {shape:?}"),
            StateDictProblem::WrongShape { name, expected, found } => {
                write!(f, "{name} has shape {found:?}, expected {expected:?}")
            }
            StateDictProblem::WrongDtype { name, expected, found } => {
                write!(f, "{name} has dtype {found}, expected {expected}")
            }
            StateDictProblem::NotFinite { name } => write!(f, "{name} has NaN or infinite values"),
        }
    }
}

/// Every problem of a rejected `state_dict`, joined by `; ` when displayed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateDictProblems(pub Vec<StateDictProblem>);

impl fmt::Display for StateDictProblems {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{p}")?;
        }
        Ok(())
    }
}

fn float_values(dtype: Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
    Some(match dtype {
        Dtype::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        Dtype::F64 => bytes.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")) as f32).collect(),
        Dtype::F16 => bytes.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        Dtype::BF16 => bytes.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        _ => return None,
    })
}

/// Parses a safetensors `state_dict` and checks it against `spec`; returns the weights as an
/// f32 bundle (counters as their f32 value). Every mismatch is reported in one
/// [`LearningError::StateDict`].
pub fn import_state_dict(spec: &ModelSpec, bytes: &[u8]) -> Result<TensorBundle, LearningError> {
    let slots = state_dict_slots(spec)?;
    // The safetensors crate keeps the last of a repeated name: which one was meant is unknown.
    let names = fedfleet_protocol::bundle::safetensors_names(bytes, &fedfleet_protocol::bundle::BundleLimits::default())
        .map_err(|e| LearningError::Safetensors(e.to_string()))?;
    let mut seen = std::collections::HashSet::new();
    if let Some(dup) = names.iter().find(|n| !seen.insert(n.as_str())) {
        return Err(LearningError::Safetensors(format!("tensor {dup:?} is listed twice in the file")));
    }
    let file = SafeTensors::deserialize(bytes).map_err(|e| LearningError::Safetensors(e.to_string()))?;
    let views: HashMap<String, _> = file.tensors().into_iter().collect();
    let mut problems = Vec::new();
    let mut bundle = TensorBundle::new();
    for slot in &slots {
        let Some(view) = views.get(&slot.name) else {
            problems.push(StateDictProblem::Missing { name: slot.name.clone(), shape: slot.shape.clone() });
            continue;
        };
        if view.shape() != slot.shape.as_slice() {
            problems.push(StateDictProblem::WrongShape {
                name: slot.name.clone(),
                expected: slot.shape.clone(),
                found: view.shape().to_vec(),
            });
            continue;
        }
        let values = if slot.integer {
            if view.dtype() != Dtype::I64 {
                problems.push(StateDictProblem::WrongDtype {
                    name: slot.name.clone(),
                    expected: "I64",
                    found: format!("{:?}", view.dtype()),
                });
                continue;
            }
            view.data().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")) as f32).collect()
        } else {
            match float_values(view.dtype(), view.data()) {
                Some(v) => v,
                None => {
                    problems.push(StateDictProblem::WrongDtype {
                        name: slot.name.clone(),
                        expected: "a float (F32, F64, F16, BF16)",
                        found: format!("{:?}", view.dtype()),
                    });
                    continue;
                }
            }
        };
        if values.iter().any(|v| !v.is_finite()) {
            problems.push(StateDictProblem::NotFinite { name: slot.name.clone() });
            continue;
        }
        bundle.insert_f32(slot.name.clone(), slot.shape.clone(), values)?;
    }
    let mut names: Vec<&String> = views.keys().collect();
    names.sort();
    for name in names {
        if !slots.iter().any(|s| &s.name == name) {
            problems.push(StateDictProblem::Unexpected { name: name.clone(), shape: views[name].shape().to_vec() });
        }
    }
    if problems.is_empty() { Ok(bundle) } else { Err(LearningError::StateDict(StateDictProblems(problems))) }
}

/// One tensor of a `state_dict` as the spec declares it.
struct StateSlot {
    name: String,
    shape: Vec<usize>,
    /// Stored as I64 (batch norm's `num_batches_tracked`).
    integer: bool,
}

/// The tensors of `spec`'s `state_dict`: the compiled plan's, or a custom model's declared ones.
fn state_dict_slots(spec: &ModelSpec) -> Result<Vec<StateSlot>, LearningError> {
    if !spec.is_builtin() {
        spec.validate()?;
        return Ok(spec.params().into_iter().map(|p| StateSlot { name: p.name, shape: p.shape, integer: false }).collect());
    }
    Ok(spec.plan()?.slots.into_iter().map(|s| StateSlot { name: s.name, shape: s.shape, integer: s.integer }).collect())
}

struct Owned {
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl View for Owned {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        (&self.bytes[..]).into()
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

/// Writes `bundle` (checked against `spec`) as a PyTorch `state_dict` in safetensors form:
/// F32 tensors, `num_batches_tracked` as I64.
pub fn export_state_dict(spec: &ModelSpec, bundle: &TensorBundle) -> Result<Vec<u8>, LearningError> {
    let slots = state_dict_slots(spec)?;
    crate::model::check_layout(spec, bundle)?;
    let mut views = Vec::with_capacity(slots.len());
    for slot in &slots {
        let v = bundle.to_f32(&slot.name).ok_or_else(|| LearningError::Layout(format!("tensor {} missing", slot.name)))?;
        let (dtype, bytes) = if slot.integer {
            (Dtype::I64, v.iter().flat_map(|x| (*x as i64).to_le_bytes()).collect())
        } else {
            (Dtype::F32, v.iter().flat_map(|x| x.to_le_bytes()).collect())
        };
        views.push((slot.name.clone(), Owned { dtype, shape: slot.shape.clone(), bytes }));
    }
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::tensor::serialize(views, Some(metadata)).map_err(|e| LearningError::Safetensors(e.to_string()))
}

/// Pre-trained weights for a model that fine-tunes with LoRA: the file holds the base model's
/// `state_dict` (no adapters), checked against [`crate::finetune::base_spec`]; fresh adapters
/// from `seed` are added ([`crate::finetune::attach_adapters`]). For other modes this is
/// [`import_state_dict`].
pub fn import_pretrained(spec: &ModelSpec, bytes: &[u8], seed: u64) -> Result<TensorBundle, LearningError> {
    if !spec.is_builtin() {
        return import_state_dict(spec, bytes);
    }
    let base = import_state_dict(&crate::finetune::base_spec(spec), bytes)?;
    crate::finetune::attach_adapters(spec, &base, seed)
}

/// [`import_state_dict`] from a file.
pub fn load_state_dict(spec: &ModelSpec, path: impl AsRef<Path>) -> Result<TensorBundle, LearningError> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|cause| LearningError::Io { path: path.to_path_buf(), cause })?;
    import_state_dict(spec, &bytes)
}

/// [`export_state_dict`] to a file (temp name, then rename).
pub fn save_state_dict(spec: &ModelSpec, bundle: &TensorBundle, path: impl AsRef<Path>) -> Result<(), LearningError> {
    let path = path.as_ref();
    let bytes = export_state_dict(spec, bundle)?;
    let tmp = path.with_extension("safetensors.tmp");
    let io = |cause| LearningError::Io { path: path.to_path_buf(), cause };
    std::fs::write(&tmp, bytes).map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}
