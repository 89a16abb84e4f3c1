//! Integration tests of fedfleet-learning (one test binary: one link of burn).

mod conversion;
mod data;
mod files;
mod golden;
mod graph;
mod partition;
mod reference;
mod sim;
mod train;

use fedfleet_protocol::bundle::TensorBundle;

/// Every value of every tensor as raw bits, by name.
pub fn bits(b: &TensorBundle) -> Vec<(String, Vec<usize>, Vec<u32>)> {
    b.layout()
        .into_iter()
        .map(|(n, s)| {
            let v = b.to_f32(&n).unwrap().iter().map(|x| x.to_bits()).collect();
            (n, s, v)
        })
        .collect()
}
