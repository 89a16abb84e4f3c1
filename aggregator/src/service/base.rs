//! The round's base model as the service holds it: the full layout, the tensors updates carry,
//! and the merge of a folded update back into the full model.

use super::*;

/// The base model of the open round, decoded. Every upload holds a clone while it is checked
/// and folded, so its parts are shared, not copied.
#[derive(Clone)]
pub(super) struct Base {
    pub(super) digest: Digest,
    pub(super) version: ModelVersion,
    pub(super) layout: Arc<Layout>,
    pub(super) values: Arc<Vec<f32>>,
    pub(super) sent: Arc<Sent>,
}

/// The part of the model an update carries: the spec's update layout (every tensor, or only the
/// trainable ones when the spec freezes layers, trains LoRA adapters or keeps batch norms local).
/// Strategies fold and step over these coordinates only; the rest of the model is carried over.
pub(super) struct Sent {
    pub(super) layout: Layout,
    /// Where each sent tensor lies in the full flat model, in (sorted-name) bundle order.
    pub(super) ranges: Vec<std::ops::Range<usize>>,
    pub(super) dim: usize,
}

impl Sent {
    pub(super) fn of(full: &Layout, sent: &Layout) -> Sent {
        let mut ranges = Vec::new();
        let mut offset = 0;
        for (name, shape) in full {
            let n: usize = shape.iter().product();
            if sent.contains_key(name) {
                ranges.push(offset..offset + n);
            }
            offset += n;
        }
        Sent { layout: sent.clone(), dim: ranges.iter().map(|r| r.len()).sum(), ranges }
    }
}

impl Base {
    pub(super) fn new(
        digest: Digest,
        version: ModelVersion,
        layout: impl Into<Arc<Layout>>,
        values: Vec<f32>,
        sent_layout: &Layout,
    ) -> Self {
        let layout = layout.into();
        let sent = Arc::new(Sent::of(&layout, sent_layout));
        Base { digest, version, layout, values: Arc::new(values), sent }
    }
    /// Coordinates an update carries (what strategies fold).
    pub(super) fn dim(&self) -> usize {
        self.sent.dim
    }
    pub(super) fn max_payload(&self) -> u64 {
        self.dim() as u64 * 4 + HEADER_SLACK + self.sent.layout.len() as u64 * 512
    }
    pub(super) fn limits(&self) -> BundleLimits {
        BundleLimits { max_bytes: self.max_payload() as usize, max_tensors: self.sent.layout.len(), max_params: self.dim() }
    }
    /// The base's values at the sent coordinates: the global model the strategy steps.
    pub(super) fn global(&self) -> Vec<f32> {
        if self.sent.dim == self.values.len() {
            return self.values.to_vec();
        }
        self.sent.ranges.iter().flat_map(|r| self.values[r.clone()].iter().copied()).collect()
    }
    /// The full model: the base with the sent coordinates replaced by `sent_values`.
    pub(super) fn merged(&self, sent_values: Vec<f32>) -> Vec<f32> {
        if self.sent.dim == self.values.len() {
            return sent_values;
        }
        let mut out = self.values.to_vec();
        let mut offset = 0;
        for r in &self.sent.ranges {
            out[r.clone()].copy_from_slice(&sent_values[offset..offset + r.len()]);
            offset += r.len();
        }
        out
    }
}
