//! What the registry answers an operator command: one typed answer per kind, JSON on the wire
//! (each object carries its kind under `answer`), printed by the CLI as text or as it is.

use std::collections::BTreeMap;

use fedfleet_protocol::{Digest, ModelInfo, ModelVersion};
use fedfleet_rollout::{Phase, Summary};
use serde::{Deserialize, Serialize};

/// An operator command's answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "answer", rename_all = "snake_case")]
pub enum AdminAnswer {
    /// `publish`: the version the artifact became.
    Published(PublishedVersion),
    /// `list`: every model, its versions (without their specs) and aliases.
    Models { models: Vec<ModelListing> },
    /// `show`: one version, whole.
    Version(VersionShown),
    /// `alias set`: where the alias points now and pointed before.
    Alias(AliasMoved),
    /// A rollout command or `rollout status ID`.
    Rollout(RolloutReport),
    /// `rollout status` without an id: every rollout.
    Rollouts { rollouts: Vec<RolloutReport> },
    /// `device status ID`.
    Device(DeviceReport),
    /// `device status` without an id: every device that reported.
    Devices { devices: Vec<DeviceReport> },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PublishedVersion {
    pub name: String,
    pub version: ModelVersion,
    pub length: u64,
    pub digest: Digest,
    pub chunks: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelListing {
    pub name: String,
    pub versions: Vec<VersionListed>,
    pub aliases: BTreeMap<String, ModelVersion>,
}

/// A version in a listing: what `show` gives, less the spec and the chunk list.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VersionListed {
    pub version: ModelVersion,
    pub length: u64,
    pub digest: Digest,
    pub parent: Option<ModelVersion>,
    pub created_at_unix_ms: u64,
    pub publisher: String,
    /// The version is a LoRA fine-tune merged into its base weights (see `show` for the lineage).
    pub adapter: bool,
    /// Its evaluation (`accuracy`, `loss`, ...) and, from the aggregator's promotion gate, the
    /// decision (`gate_*`). Absent from registries that predate it.
    #[serde(default)]
    pub metrics: BTreeMap<String, f64>,
}

impl VersionListed {
    pub fn of(m: &ModelInfo) -> VersionListed {
        VersionListed {
            version: m.version,
            length: m.length,
            digest: m.digest,
            parent: m.parent,
            created_at_unix_ms: m.created_at_unix_ms,
            publisher: m.publisher.clone(),
            adapter: m.adapter.is_some(),
            metrics: m.metrics.clone(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VersionShown {
    #[serde(flatten)]
    pub model: ModelInfo,
    pub chunk_size: u32,
    pub chunks: usize,
    pub aliases: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AliasMoved {
    pub name: String,
    pub alias: String,
    pub version: ModelVersion,
    pub previous: Option<ModelVersion>,
}

/// A rollout's plan and where it stands.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RolloutReport {
    pub id: String,
    pub model: String,
    pub alias: String,
    pub target: ModelVersion,
    pub previous: Option<ModelVersion>,
    /// Status, phase (0-based; the last one reached once it ended) and outcome counts.
    #[serde(flatten)]
    pub summary: Summary,
    pub failure_threshold: f64,
    pub started_at: u64,
    pub ended_at: Option<u64>,
    pub reporting_devices: usize,
    pub plan: Vec<Phase>,
}

/// A device's last status report (as the device sent it) and whether it is revoked.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceReport {
    pub device: String,
    pub revoked: bool,
    pub report: serde_json::Value,
}
