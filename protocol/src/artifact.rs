//! What a downloader learns about one published version: the version's record plus its chunk
//! list. The registry serves it; the TUF target pins its length and digest.

use serde::{Deserialize, Serialize};

use crate::Digest;
use crate::model::ModelInfo;

/// One chunk of an artifact, in order. Every chunk but the last is `chunk_size` long.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkRef {
    pub digest: Digest,
    pub len: u32,
}

/// Everything a downloader needs about one version: what it is, plus its chunk list. **Not
/// signed**: a client checks `model.length`/`digest` against the trusted TUF target before
/// trusting it, each chunk against its digest, and the whole against `model.digest`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub model: ModelInfo,
    pub chunk_size: u32,
    pub chunks: Vec<ChunkRef>,
}

impl Manifest {
    /// Byte offset of chunk `i` within the artifact.
    pub fn chunk_offset(&self, i: usize) -> u64 {
        i as u64 * self.chunk_size as u64
    }

    /// Checks that the chunk lengths add up to the length and that no chunk is empty or over
    /// the chunk size (a client allocates per chunk).
    pub fn validate(&self) -> Result<(), String> {
        let mut total = 0u64;
        for (i, c) in self.chunks.iter().enumerate() {
            if c.len == 0 || c.len > self.chunk_size {
                return Err(format!("chunk {i} has length {}", c.len));
            }
            total += c.len as u64;
        }
        if total != self.model.length {
            return Err(format!("chunks add up to {total} bytes, manifest says {}", self.model.length));
        }
        Ok(())
    }
}
