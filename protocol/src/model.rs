//! Model metadata: the one description of a model version that the aggregator, the registry,
//! the agent and the operator tools share.
//!
//! - [`NewVersion`]: what a publisher states (name, spec, parent, metrics, lineage); the
//!   registry assigns the version number and measures length and digest from the bytes.
//! - [`ModelInfo`]: a version as published: the statement plus version, length and digest. The
//!   registry stores it, serves it in manifests and signs it into TUF targets; the aggregator
//!   keeps one per global model it holds; the agent reads the spec and metrics from it.
//!
//! Both encode in JSON (files, operator output, TUF metadata) and in postcard (wire, stores);
//! the spec is a JSON value in the first and JSON text in the second ([`SpecJson`]), because
//! postcard is not self-describing.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::ids::{Digest, ModelVersion};
use crate::messages::ModelRef;

/// A model's architecture description (the learning crate's `ModelSpec` as JSON).
///
/// Serialized as a JSON value by human-readable formats and as JSON text by binary ones.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SpecJson(pub serde_json::Value);

impl SpecJson {
    /// Parses JSON text.
    pub fn parse(text: &str) -> Result<SpecJson, serde_json::Error> {
        serde_json::from_str(text).map(SpecJson)
    }
}

/// Compact JSON text.
impl std::fmt::Display for SpecJson {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl From<serde_json::Value> for SpecJson {
    fn from(v: serde_json::Value) -> Self {
        SpecJson(v)
    }
}

impl std::ops::Deref for SpecJson {
    type Target = serde_json::Value;
    fn deref(&self) -> &serde_json::Value {
        &self.0
    }
}

impl Serialize for SpecJson {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() { self.0.serialize(s) } else { s.serialize_str(&self.0.to_string()) }
    }
}

impl<'de> Deserialize<'de> for SpecJson {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        if d.is_human_readable() {
            serde_json::Value::deserialize(d).map(SpecJson)
        } else {
            let text = String::deserialize(d)?;
            SpecJson::parse(&text).map_err(|e| serde::de::Error::custom(format!("model spec: {e}")))
        }
    }
}

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

/// What a publisher states about a version it publishes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NewVersion {
    /// Model name, e.g. `mnist-cnn`; versions are numbered per name.
    pub name: String,
    pub spec: SpecJson,
    /// The version this one was trained from, if any (same model name).
    pub parent: Option<ModelVersion>,
    /// Evaluation metrics, e.g. `{"accuracy": 0.97}`. Must be finite.
    pub metrics: BTreeMap<String, f64>,
    /// Unix milliseconds, supplied by the caller (the stores read no clock).
    #[serde(alias = "created_at")]
    pub created_at_unix_ms: u64,
    /// Who published: an operator name, or the aggregator's identity (empty: the registry
    /// names the publisher by its certificate).
    pub publisher: String,
    /// The adapters merged into this version, if it is an adapter fine-tune of `parent`.
    #[serde(default)]
    pub adapter: Option<AdapterLineage>,
}

/// A published model version. Field order is wire order (postcard): append only.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelInfo {
    pub name: String,
    pub version: ModelVersion,
    /// Artifact length in bytes.
    pub length: u64,
    /// BLAKE3 of the artifact.
    pub digest: Digest,
    pub spec: SpecJson,
    pub parent: Option<ModelVersion>,
    pub metrics: BTreeMap<String, f64>,
    #[serde(alias = "created_at")]
    pub created_at_unix_ms: u64,
    pub publisher: String,
    #[serde(default)]
    pub adapter: Option<AdapterLineage>,
}

impl ModelInfo {
    /// The version `new` became: numbered `version`, its artifact `length` bytes with `digest`.
    pub fn published(new: NewVersion, version: ModelVersion, length: u64, digest: Digest) -> ModelInfo {
        let NewVersion { name, spec, parent, metrics, created_at_unix_ms, publisher, adapter } = new;
        ModelInfo { name, version, length, digest, spec, parent, metrics, created_at_unix_ms, publisher, adapter }
    }

    /// What identifies the version: name, number and digest.
    pub fn model_ref(&self) -> ModelRef {
        ModelRef { name: self.name.clone(), version: self.version, digest: self.digest }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> ModelInfo {
        ModelInfo::published(
            NewVersion {
                name: "mnist-mlp".into(),
                spec: SpecJson(serde_json::json!({"arch": "mlp", "input": [1, 28, 28]})),
                parent: Some(ModelVersion(2)),
                metrics: [("accuracy".to_owned(), 0.97)].into_iter().collect(),
                created_at_unix_ms: 6,
                publisher: "aggregator-eu".into(),
                adapter: Some(AdapterLineage { method: "lora".into(), rank: 2, alpha: 2.0, tensors: vec!["fc2.weight".into()] }),
            },
            ModelVersion(3),
            1234,
            Digest::of(b"model"),
        )
    }

    #[test]
    fn the_spec_is_a_json_value_in_json_and_text_in_postcard() {
        let m = info();
        let json = serde_json::to_value(&m).unwrap();
        assert_eq!(json["spec"]["arch"], "mlp");
        assert_eq!(serde_json::from_value::<ModelInfo>(json).unwrap(), m);
        let bytes = postcard::to_stdvec(&m).unwrap();
        let text = br#"{"arch":"mlp","input":[1,28,28]}"#;
        assert!(bytes.windows(text.len()).any(|w| w == text));
        assert_eq!(postcard::from_bytes::<ModelInfo>(&bytes).unwrap(), m);
    }

    #[test]
    fn records_written_before_the_rename_still_read() {
        let old = r#"{"name":"m","version":1,"spec":{},"length":3,"digest":"%D","parent":null,
                      "metrics":{},"created_at":5,"publisher":"op"}"#
            .replace("%D", &Digest::of(b"abc").to_hex());
        let m: ModelInfo = serde_json::from_str(&old).unwrap();
        assert_eq!((m.created_at_unix_ms, m.adapter), (5, None));
    }

    #[test]
    fn a_spec_that_is_not_json_is_refused_by_name() {
        let mut m = info();
        m.spec = SpecJson::default();
        let mut bytes = postcard::to_stdvec(&m).unwrap();
        let at = bytes.windows(4).position(|w| w == b"null").unwrap();
        bytes[at] = b'!';
        let e = postcard::from_bytes::<ModelInfo>(&bytes).unwrap_err();
        assert!(e.to_string().contains("model spec") || matches!(e, postcard::Error::SerdeDeCustom), "{e}");
    }
}
