//! The inbox: labelled examples the device's own application pushes through the local socket
//! (`{"examples": [{"input": [...], "label": 3}, ...]}`), kept in the agent's store and trained
//! on, beside the configured data, from the next round on. Bounded by `[inbox] max_examples`
//! and `max_bytes`, oldest dropped first; every push is flushed before it is acknowledged, so
//! an acknowledged example survives a kill -9. Every `holdout_every`-th example goes to the
//! health check's holdout instead of training. The count of examples not yet trained on is the
//! participation policy's `fresh_samples`.
//!
//! Feedback on a prediction: an inference request with `"feedback": true` keeps its inputs
//! (the last `max_asked`) and answers with one id per row; `{"feedback": [{"id": 17, "label":
//! 3}]}` later turns the kept input and the application's answer into an example. The kept
//! inputs are written without a flush: after a crash the newest ids may be unknown, and the
//! application pushes the example itself.

use std::sync::{Arc, Mutex};

use fedfleet_learning::{Dataset, Normalization};
use serde::{Deserialize, Serialize};

use crate::agent::LocalData;
use crate::store::{AgentStore, StoreError};

/// `[inbox]` in the agent config.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct InboxConfig {
    pub max_examples: u64,
    pub max_bytes: u64,
    /// Every n-th example pushed is held out for health checks (0: none).
    pub holdout_every: u64,
    /// Predictions whose inputs are kept for feedback (the newest).
    pub max_asked: u64,
}

impl Default for InboxConfig {
    fn default() -> Self {
        InboxConfig { max_examples: 10_000, max_bytes: 16 << 20, holdout_every: 5, max_asked: 1_000 }
    }
}

/// The application's answer to a prediction it asked for with `"feedback": true`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Feedback {
    /// The id the prediction was answered with.
    pub id: u64,
    /// The true class (classification).
    #[serde(default)]
    pub label: u32,
    /// The true targets (regression).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub target: Vec<f32>,
}

/// One labelled example, raw feature values as the application sees them (the `[data]`
/// normalisation is applied when it is trained on, as at inference).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Example {
    pub input: Vec<f32>,
    /// The class (classification).
    #[serde(default)]
    pub label: u32,
    /// The targets (regression); empty for classification.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub target: Vec<f32>,
}

impl Example {
    /// What the bound counts: the values it stores.
    fn bytes(&self) -> u64 {
        4 * (self.input.len() + self.target.len()) as u64 + 4
    }
}

/// What the inbox holds, as the socket reports it after a push.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct InboxStats {
    /// Examples accepted by this push.
    pub stored: u64,
    pub examples: u64,
    pub bytes: u64,
    /// Oldest examples dropped to stay within the bounds, ever.
    pub dropped: u64,
    /// Examples not yet trained on.
    pub fresh: u64,
}

/// Why a push was refused (nothing of it is stored).
#[derive(Debug, thiserror::Error)]
pub enum InboxError {
    #[error("example {index}: {detail}")]
    Invalid { index: usize, detail: String },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// What the inbox checks pushed examples against: the shape of the device's data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExampleShape {
    pub input_len: usize,
    pub num_classes: usize,
    pub targets: usize,
}

impl ExampleShape {
    pub fn of(data: &Dataset) -> Self {
        ExampleShape { input_len: data.example_len(), num_classes: data.num_classes, targets: data.targets_per_example() }
    }

    /// What a model of `spec` trains on: its input size, and its classes (classification),
    /// targets (regression) or nothing more (reconstruction).
    pub fn of_spec(spec: &fedfleet_learning::ModelSpec) -> Self {
        use fedfleet_learning::Task;
        let (num_classes, targets) = match spec.task() {
            Task::Classification => (spec.classes(), 0),
            Task::Regression => (0, spec.output_len()),
            Task::Reconstruction => (0, 0),
        };
        ExampleShape { input_len: spec.input_len(), num_classes, targets }
    }

    fn check(&self, e: &Example) -> Result<(), String> {
        if e.input.len() != self.input_len {
            return Err(format!("{} input values, the model takes {}", e.input.len(), self.input_len));
        }
        if e.target.len() != self.targets {
            return Err(format!("{} target values, the data has {}", e.target.len(), self.targets));
        }
        if self.targets == 0 && e.label as usize >= self.num_classes.max(1) {
            return Err(format!("label {} is not below the {} classes", e.label, self.num_classes));
        }
        if e.input.iter().chain(&e.target).any(|v| !v.is_finite()) {
            return Err("a value is NaN or infinite".into());
        }
        Ok(())
    }
}

const EXAMPLE: u8 = b'e';
const ASKED: u8 = b'a';
const META: &[u8] = b"m/meta";

/// Counters kept beside the examples, written in the same batch.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
struct Meta {
    next_seq: u64,
    examples: u64,
    bytes: u64,
    dropped: u64,
    /// Examples with a sequence number below this were trained on.
    trained_upto: u64,
    /// The id the next prediction kept for feedback gets.
    #[serde(default)]
    next_asked: u64,
}

impl Meta {
    /// Examples not yet trained on. The stored sequence numbers are `next_seq - examples ..
    /// next_seq` (only the oldest are ever dropped), so no scan is needed.
    fn fresh(&self) -> u64 {
        self.examples.min(self.next_seq.saturating_sub(self.trained_upto))
    }
}

fn key(seq: u64) -> [u8; 9] {
    prefixed(EXAMPLE, seq)
}

fn asked_key(id: u64) -> [u8; 9] {
    prefixed(ASKED, id)
}

fn prefixed(prefix: u8, n: u64) -> [u8; 9] {
    let mut k = [prefix; 9];
    k[1..].copy_from_slice(&n.to_be_bytes());
    k
}

/// A stored example and its sequence number.
fn decode_entry(kv: sled::Result<(sled::IVec, sled::IVec)>) -> Result<(u64, Example), StoreError> {
    let (k, v) = kv?;
    let seq = u64::from_be_bytes(k[1..9].try_into().expect("9-byte key"));
    let e = serde_json::from_slice(&v).map_err(|e| StoreError::Corrupt { key: format!("inbox {seq}"), detail: e.to_string() })?;
    Ok((seq, e))
}

/// The inbox over the agent store's `inbox` tree. Cheap to clone (one tree, one lock).
#[derive(Clone)]
pub struct Inbox {
    tree: sled::Tree,
    cfg: InboxConfig,
    /// `None` until the agent has a model, when the shape follows the model (no `[data]`).
    shape: Arc<Mutex<Option<ExampleShape>>>,
    follows_model: bool,
    /// Pushes and marks read-modify-write the counters.
    lock: Arc<Mutex<()>>,
    /// The store's space reserve, released before a write on a nearly full disk.
    reserve: Arc<fedfleet_durable::SpaceReserve>,
}

impl Inbox {
    /// An inbox whose examples are shaped like the device's data.
    pub fn open(store: &AgentStore, cfg: InboxConfig, shape: ExampleShape) -> Result<Self, StoreError> {
        Self::open_with(store, cfg, Some(shape), false)
    }

    /// An inbox of an agent without `[data]`: examples are shaped like the active model (see
    /// [`Inbox::model_activated`]); until there is one, pushes are refused by name.
    pub fn open_following_model(store: &AgentStore, cfg: InboxConfig) -> Result<Self, StoreError> {
        Self::open_with(store, cfg, None, true)
    }

    fn open_with(store: &AgentStore, cfg: InboxConfig, shape: Option<ExampleShape>, follows_model: bool) -> Result<Self, StoreError> {
        let shape = Arc::new(Mutex::new(shape));
        Ok(Inbox { tree: store.tree("inbox")?, cfg, shape, follows_model, lock: Arc::default(), reserve: store.reserve() })
    }

    /// The agent serves a model of `spec`: an inbox that follows the model takes its shape.
    pub fn model_activated(&self, spec: &fedfleet_learning::ModelSpec) {
        if self.follows_model {
            *self.shape.lock().unwrap_or_else(|p| p.into_inner()) = Some(ExampleShape::of_spec(spec));
        }
    }

    /// Longest push line the socket reads: the inbox's whole byte bound written as JSON text
    /// (up to ~6 characters per stored byte) and room for the keys. Longer lines are refused
    /// while they are read, without holding them.
    pub fn max_push_line(&self) -> usize {
        usize::try_from(self.cfg.max_bytes.saturating_mul(6).saturating_add(64 << 10)).unwrap_or(usize::MAX)
    }

    fn meta(&self) -> Result<Meta, StoreError> {
        match self.tree.get(META)? {
            None => Ok(Meta::default()),
            Some(b) => serde_json::from_slice(&b).map_err(|e| StoreError::Corrupt { key: "inbox meta".into(), detail: e.to_string() }),
        }
    }

    /// Stores `examples` (all or none), drops the oldest beyond the bounds, flushes.
    pub fn push(&self, examples: &[Example]) -> Result<InboxStats, InboxError> {
        let _guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        self.store(examples, &[])
    }

    /// Keeps the raw inputs of predictions for [`Inbox::feedback`]; returns their ids. Only the
    /// newest `max_asked` are kept.
    pub fn remember(&self, inputs: &[Vec<f32>]) -> Result<Vec<u64>, StoreError> {
        let _guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut meta = self.meta()?;
        let mut batch = sled::Batch::default();
        let first = meta.next_asked;
        for input in inputs {
            batch.insert(&asked_key(meta.next_asked), serde_json::to_vec(input).expect("input serializes"));
            meta.next_asked += 1;
        }
        let keep_from = meta.next_asked.saturating_sub(self.cfg.max_asked);
        for kv in self.tree.range(asked_key(0)..asked_key(keep_from)) {
            batch.remove(kv?.0);
        }
        batch.insert(META, serde_json::to_vec(&meta).expect("meta serializes"));
        crate::store::make_room(&self.reserve);
        self.tree.apply_batch(batch)?;
        Ok((first..meta.next_asked).collect())
    }

    /// Turns answers to kept predictions into examples (all or none; each id once), stored as a
    /// push is.
    pub fn feedback(&self, answers: &[Feedback]) -> Result<InboxStats, InboxError> {
        let _guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let meta = self.meta()?;
        let mut examples = Vec::with_capacity(answers.len());
        let mut ids = Vec::with_capacity(answers.len());
        for (index, a) in answers.iter().enumerate() {
            let invalid = |detail: String| InboxError::Invalid { index, detail };
            if ids.contains(&a.id) {
                return Err(invalid(format!("prediction {} is answered twice", a.id)));
            }
            let input = self.tree.get(asked_key(a.id)).map_err(StoreError::from)?.ok_or_else(|| {
                let kept_from = meta.next_asked.saturating_sub(self.cfg.max_asked);
                invalid(if a.id >= meta.next_asked {
                    format!("prediction {} is unknown: no prediction got that id", a.id)
                } else if a.id >= kept_from {
                    format!("prediction {} was already answered", a.id)
                } else {
                    format!("prediction {} is no longer kept (the newest {} are)", a.id, self.cfg.max_asked)
                })
            })?;
            let input = serde_json::from_slice(&input)
                .map_err(|e| StoreError::Corrupt { key: format!("asked {}", a.id), detail: e.to_string() })?;
            examples.push(Example { input, label: a.label, target: a.target.clone() });
            ids.push(a.id);
        }
        self.store(&examples, &ids)
    }

    /// One atomic, flushed write: `examples` in, the kept predictions `answered` out, the oldest
    /// examples dropped beyond the bounds. The caller holds the lock.
    fn store(&self, examples: &[Example], answered: &[u64]) -> Result<InboxStats, InboxError> {
        for (index, e) in examples.iter().enumerate() {
            let shape = *self.shape.lock().unwrap_or_else(|p| p.into_inner());
            let Some(shape) = shape else {
                return Err(InboxError::Invalid {
                    index,
                    detail: "this agent has no model yet: the inbox takes examples once one is installed".into(),
                });
            };
            shape.check(e).map_err(|detail| InboxError::Invalid { index, detail })?;
        }
        let mut meta = self.meta()?;
        let mut batch = sled::Batch::default();
        for id in answered {
            batch.remove(&asked_key(*id));
        }
        for e in examples {
            batch.insert(&key(meta.next_seq), serde_json::to_vec(e).expect("example serializes"));
            meta.next_seq += 1;
            meta.examples += 1;
            meta.bytes += e.bytes();
        }
        // Oldest first out, the new ones included if the push alone exceeds the bounds.
        let mut dropped_now: Vec<u64> = Vec::new();
        let first_new = meta.next_seq - examples.len() as u64;
        let mut old = self.tree.range(key(0)..key(first_new));
        let mut new = examples.iter().enumerate().map(|(i, e)| (first_new + i as u64, e.bytes()));
        while meta.examples > self.cfg.max_examples || meta.bytes > self.cfg.max_bytes {
            let (seq, bytes) = match old.next() {
                Some(kv) => {
                    let (seq, e) = decode_entry(kv)?;
                    (seq, e.bytes())
                }
                None => new.next().expect("the bounds count only stored examples"),
            };
            batch.remove(&key(seq));
            meta.examples -= 1;
            meta.bytes -= bytes;
            meta.dropped += 1;
            dropped_now.push(seq);
        }
        let accepted = examples.len() as u64 - dropped_now.iter().filter(|s| **s >= first_new).count() as u64;
        batch.insert(META, serde_json::to_vec(&meta).expect("meta serializes"));
        crate::store::make_room(&self.reserve);
        self.tree.apply_batch(batch).map_err(StoreError::from)?;
        self.tree.flush().map_err(StoreError::from)?;
        Ok(InboxStats { stored: accepted, examples: meta.examples, bytes: meta.bytes, dropped: meta.dropped, fresh: meta.fresh() })
    }

    /// Whether the application ever pushed anything (then `fresh` drives participation).
    pub fn in_use(&self) -> Result<bool, StoreError> {
        Ok(self.meta()?.next_seq > 0)
    }

    /// Examples not yet trained on.
    pub fn fresh(&self) -> Result<u64, StoreError> {
        Ok(self.meta()?.fresh())
    }

    /// Every stored example with its sequence number, oldest first.
    pub fn examples(&self) -> Result<Vec<(u64, Example)>, StoreError> {
        self.tree.range(key(0)..key(u64::MAX)).map(decode_entry).collect()
    }

    /// The next sequence number: a round that trained on `examples()` read before it marks
    /// everything below as trained on.
    pub fn next_seq(&self) -> Result<u64, StoreError> {
        Ok(self.meta()?.next_seq)
    }

    /// Everything below `upto` has been trained on (no longer fresh).
    pub fn mark_trained(&self, upto: u64) -> Result<(), StoreError> {
        let _guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut meta = self.meta()?;
        meta.trained_upto = meta.trained_upto.max(upto);
        crate::store::make_room(&self.reserve);
        self.tree.insert(META, serde_json::to_vec(&meta).expect("meta serializes"))?;
        self.tree.flush()?;
        Ok(())
    }

    /// The configured data plus the inbox: every `holdout_every`-th example into the holdout,
    /// the rest into training, normalised as the configured data is.
    pub fn merged_with(&self, base: &LocalData, normalization: &Normalization) -> Result<LocalData, StoreError> {
        let examples = self.examples()?;
        let mut data = base.clone();
        for (seq, e) in &examples {
            let every = self.cfg.holdout_every;
            let set = if every > 0 && seq % every == 0 { &mut data.holdout } else { &mut data.train };
            let mut input = e.input.clone();
            normalization.apply(&mut input);
            set.features.extend_from_slice(&input);
            set.labels.push(e.label);
            set.targets.extend_from_slice(&e.target);
        }
        Ok(data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ex(v: f32, label: u32) -> Example {
        Example { input: vec![v; 4], label, target: vec![] }
    }

    const SHAPE: ExampleShape = ExampleShape { input_len: 4, num_classes: 3, targets: 0 };

    #[test]
    fn bounded_oldest_dropped_first_and_kept_across_a_crash() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = InboxConfig { max_examples: 5, max_bytes: 1 << 20, holdout_every: 0, ..InboxConfig::default() };
        {
            let store = AgentStore::open(dir.path()).unwrap();
            let inbox = Inbox::open(&store, cfg, SHAPE).unwrap();
            let s = inbox.push(&(0..3).map(|i| ex(i as f32, 0)).collect::<Vec<_>>()).unwrap();
            assert_eq!((s.stored, s.examples, s.dropped, s.fresh), (3, 3, 0, 3));
            let s = inbox.push(&(3..7).map(|i| ex(i as f32, 1)).collect::<Vec<_>>()).unwrap();
            assert_eq!((s.stored, s.examples, s.dropped, s.fresh), (4, 5, 2, 5));
            assert_eq!(s.bytes, 5 * 20);
            // Dropped without any shutdown: every push was flushed before it returned.
        }
        let store = AgentStore::open(dir.path()).unwrap();
        let inbox = Inbox::open(&store, cfg, SHAPE).unwrap();
        let kept: Vec<f32> = inbox.examples().unwrap().iter().map(|(_, e)| e.input[0]).collect();
        assert_eq!(kept, vec![2.0, 3.0, 4.0, 5.0, 6.0], "the two oldest went first");
        inbox.mark_trained(inbox.next_seq().unwrap()).unwrap();
        assert_eq!(inbox.fresh().unwrap(), 0);
        let s = inbox.push(&[ex(7.0, 2)]).unwrap();
        assert_eq!((s.examples, s.fresh, s.dropped), (5, 1, 3));
    }

    #[test]
    fn the_byte_bound_holds_even_for_one_oversized_push() {
        let dir = tempfile::tempdir().unwrap();
        let store = AgentStore::open(dir.path()).unwrap();
        let cfg = InboxConfig { max_examples: 100, max_bytes: 50, holdout_every: 0, ..InboxConfig::default() };
        let inbox = Inbox::open(&store, cfg, SHAPE).unwrap();
        let s = inbox.push(&(0..4).map(|i| ex(i as f32, 0)).collect::<Vec<_>>()).unwrap();
        assert_eq!((s.stored, s.examples, s.bytes, s.dropped), (2, 2, 40, 2));
        let kept: Vec<f32> = inbox.examples().unwrap().iter().map(|(_, e)| e.input[0]).collect();
        assert_eq!(kept, vec![2.0, 3.0]);
    }

    #[test]
    fn bad_examples_are_refused_whole_with_their_index() {
        let dir = tempfile::tempdir().unwrap();
        let store = AgentStore::open(dir.path()).unwrap();
        let inbox = Inbox::open(&store, InboxConfig::default(), SHAPE).unwrap();
        for (bad, want) in [
            (Example { input: vec![0.0; 5], label: 0, target: vec![] }, "5 input values, the model takes 4"),
            (ex(0.0, 3), "label 3 is not below the 3 classes"),
            (ex(f32::NAN, 0), "NaN"),
        ] {
            let e = inbox.push(&[ex(1.0, 0), bad]).unwrap_err().to_string();
            assert!(e.starts_with("example 1: ") && e.contains(want), "{e}");
        }
        assert!(inbox.examples().unwrap().is_empty());
        assert!(!inbox.in_use().unwrap());
    }

    #[test]
    fn feedback_turns_a_kept_prediction_into_an_example_once() {
        let dir = tempfile::tempdir().unwrap();
        let store = AgentStore::open(dir.path()).unwrap();
        let cfg = InboxConfig { max_asked: 3, ..InboxConfig::default() };
        let inbox = Inbox::open(&store, cfg, SHAPE).unwrap();
        let ids = inbox.remember(&[vec![1.0; 4], vec![2.0; 4]]).unwrap();
        assert_eq!(ids, vec![0, 1]);
        let answer = |id, label| Feedback { id, label, target: vec![] };
        let s = inbox.feedback(&[answer(1, 2)]).unwrap();
        assert_eq!((s.stored, s.examples, s.fresh), (1, 1, 1));
        assert_eq!(inbox.examples().unwrap()[0].1, ex(2.0, 2));
        // Each prediction is answered once; a bad answer stores nothing of the batch.
        let again = inbox.feedback(&[answer(0, 1), answer(1, 0)]).unwrap_err().to_string();
        assert!(again.starts_with("example 1: prediction 1 was already answered"), "{again}");
        let never = inbox.feedback(&[answer(9, 1)]).unwrap_err().to_string();
        assert!(never.contains("prediction 9 is unknown: no prediction got that id"), "{never}");
        let bad = inbox.feedback(&[answer(0, 7)]).unwrap_err().to_string();
        assert!(bad.contains("label 7 is not below the 3 classes"), "{bad}");
        assert_eq!(inbox.examples().unwrap().len(), 1);
        // Only the newest max_asked inputs are kept.
        assert_eq!(inbox.remember(&[vec![3.0; 4], vec![4.0; 4], vec![5.0; 4]]).unwrap(), vec![2, 3, 4]);
        let gone = inbox.feedback(&[answer(0, 1)]).unwrap_err().to_string();
        assert!(gone.contains("the newest 3 are"), "{gone}");
        assert_eq!(inbox.feedback(&[answer(4, 1)]).unwrap().examples, 2);
    }

    #[test]
    fn an_inbox_only_agent_takes_examples_shaped_like_its_model() {
        let dir = tempfile::tempdir().unwrap();
        let store = AgentStore::open(dir.path()).unwrap();
        let inbox = Inbox::open_following_model(&store, InboxConfig::default()).unwrap();
        // No model yet: refused by name, nothing stored.
        let e = inbox.push(&[ex(1.0, 0)]).unwrap_err().to_string();
        assert!(e.contains("this agent has no model yet"), "{e}");
        let spec = fedfleet_learning::ModelSpec::from_json(r#"{"arch":"mlp","input":[4],"hidden":[8],"classes":3}"#).unwrap();
        inbox.model_activated(&spec);
        assert_eq!(inbox.push(&[ex(1.0, 2)]).unwrap().stored, 1);
        // Empty or wrongly sized examples are refused, not stored.
        let empty = Example { input: vec![], label: 0, target: vec![] };
        let e = inbox.push(&[empty]).unwrap_err().to_string();
        assert!(e.contains("0 input values, the model takes 4"), "{e}");
        assert_eq!(inbox.examples().unwrap().len(), 1);
    }

    #[test]
    fn merged_data_holds_out_every_nth_example_normalised() {
        let dir = tempfile::tempdir().unwrap();
        let store = AgentStore::open(dir.path()).unwrap();
        let cfg = InboxConfig { holdout_every: 2, ..InboxConfig::default() };
        let inbox = Inbox::open(&store, cfg, SHAPE).unwrap();
        inbox.push(&(0..5).map(|i| ex(i as f32, (i % 3) as u32)).collect::<Vec<_>>()).unwrap();
        let empty = Dataset { features: vec![], labels: vec![], targets: vec![], shape: vec![4], num_classes: 3 };
        let base = LocalData { train: empty.clone(), holdout: empty };
        let merged = inbox.merged_with(&base, &Normalization::Scale(0.5)).unwrap();
        assert_eq!(merged.train.labels, vec![1, 0]);
        assert_eq!(merged.holdout.labels, vec![0, 2, 1]);
        assert_eq!(merged.train.example(0), &[0.5; 4]);
    }
}
