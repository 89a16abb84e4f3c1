//! What a downloader learns about one published version: the version's record plus its chunk
//! list. The registry serves it; the TUF target pins its length and digest.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{Digest, ModelVersion};

/// How a version was derived from its parent by adapter fine-tuning (LoRA): the published
/// model has the adapters merged into its weights, and this says which. Kept by the registry
/// with the version so that a merged model can be traced to its parent and its adapters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdapterLineage {
    /// `"lora"`.
    pub method: String,
    pub rank: u32,
    /// The scaling numerator (updates were scaled by alpha / rank).
    pub alpha: f64,
    /// The base weights the adapters were merged into, e.g. `fc2.weight`.
    pub tensors: Vec<String>,
}

/// One chunk of an artifact, in order. Every chunk but the last is `chunk_size` long.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkRef {
    pub digest: Digest,
    pub len: u32,
}

/// Everything a downloader needs about one version: the version record plus its chunk list.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub name: String,
    pub version: ModelVersion,
    pub spec: serde_json::Value,
    pub length: u64,
    pub digest: Digest,
    pub parent: Option<ModelVersion>,
    pub metrics: BTreeMap<String, f64>,
    pub created_at: u64,
    pub publisher: String,
    /// Set when the version is a merged adapter fine-tune of its parent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adapter: Option<AdapterLineage>,
    pub chunk_size: u32,
    pub chunks: Vec<ChunkRef>,
}

impl Manifest {
    /// Byte offset of chunk `i` within the artifact.
    pub fn chunk_offset(&self, i: usize) -> u64 {
        i as u64 * self.chunk_size as u64
    }
}

