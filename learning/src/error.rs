//! Error types. Every rejection carries a named reason.

use fedfleet_protocol::bundle::BundleError;
use std::path::PathBuf;

/// Errors from the dataset loaders. Row-level problems carry the 1-based line number.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// Reading a file failed.
    #[error("cannot read {path}: {cause}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        cause: std::io::Error,
    },
    /// The gzip stream is corrupt or truncated.
    #[error("{what}: gzip stream is corrupt: {cause}")]
    Gzip {
        /// Which input.
        what: String,
        /// The cause.
        cause: std::io::Error,
    },
    /// A CSV row is malformed.
    #[error("{what}: line {line}: {reason}")]
    Csv {
        /// Which input (file name or "digits.csv.gz").
        what: String,
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// An IDX file is malformed.
    #[error("{what}: IDX byte offset {offset}: {reason}")]
    Idx {
        /// Which input.
        what: String,
        /// Byte offset (in the uncompressed stream) where the problem was found.
        offset: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// A `.npy` / `.npz` file is malformed or holds an unsupported dtype.
    #[error("{what}: {reason}")]
    Npy {
        /// Which input (file, or `archive:entry.npy`).
        what: String,
        /// What is wrong with it.
        reason: String,
    },
    /// An image does not decode.
    #[error("image {path}: {reason}")]
    Image {
        /// The file.
        path: PathBuf,
        /// The decoder's message.
        reason: String,
    },
    /// The inputs are individually valid but do not fit together (e.g. image/label counts).
    #[error("{0}")]
    Mismatch(String),
    /// The data set has no rows.
    #[error("{0}: no examples")]
    Empty(String),
}

/// Errors from models, conversion, training and evaluation.
#[derive(Debug, thiserror::Error)]
pub enum LearningError {
    /// The model spec is not usable (zero sizes, unknown shapes...).
    #[error("invalid model spec: {0}")]
    InvalidSpec(String),
    /// A tensor bundle does not have the parameter layout the spec requires.
    #[error("bundle does not match the model layout: {0}")]
    Layout(String),
    /// Bundle codec error.
    #[error("tensor bundle: {0}")]
    Bundle(BundleError),
    /// Data loading error.
    #[error(transparent)]
    Data(#[from] DataError),
    /// File I/O error.
    #[error("cannot access {path}: {cause}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        cause: std::io::Error,
    },
    /// The data does not fit the model.
    #[error("data does not fit the model: {0}")]
    InputMismatch(String),
    /// Training produced NaN/Inf.
    #[error("training diverged: non-finite loss at step {step}")]
    NonFinite {
        /// Optimizer step at which it happened.
        step: usize,
    },
    /// Bad training configuration.
    #[error("invalid training config: {0}")]
    InvalidConfig(String),
    /// A PyTorch `state_dict` does not match the model description (every problem listed).
    #[error("state_dict does not match the model: {0}")]
    StateDict(crate::interop::StateDictProblems),
    /// A safetensors file could not be parsed or written.
    #[error("safetensors: {0}")]
    Safetensors(String),
    /// Reading a tensor back from burn failed.
    #[error("tensor read failed: {0}")]
    Tensor(String),
}

// Printed in the message, so not also a `source`: a report of the chain would say it twice.
impl From<BundleError> for LearningError {
    fn from(e: BundleError) -> Self {
        LearningError::Bundle(e)
    }
}

impl From<fedfleet_modelspec::SpecError> for LearningError {
    fn from(e: fedfleet_modelspec::SpecError) -> Self {
        use fedfleet_modelspec::SpecError;
        match e {
            SpecError::InvalidSpec(m) => LearningError::InvalidSpec(m),
            SpecError::Layout(m) | SpecError::Weights(m) => LearningError::Layout(m),
        }
    }
}
