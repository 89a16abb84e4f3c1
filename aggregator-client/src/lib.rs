//! The aggregator's QUIC wire protocol ([`wire`]) and its client ([`client`]), for devices,
//! operators and tests. Devices link this crate, never the aggregator service.

pub mod client;
pub mod wire;

use std::path::Path;

use ed25519_dalek::VerifyingKey;

pub use client::{AggregatorClient, ClientError, RoundInfo, UploadOutcome};

/// Reads the aggregator's `receipt.pub` file (hex ed25519 public key), which devices pin.
pub fn read_receipt_key(path: &Path) -> std::io::Result<VerifyingKey> {
    let text = std::fs::read_to_string(path)?;
    let mut b = [0u8; 32];
    hex::decode_to_slice(text.trim(), &mut b)
        .ok()
        .and_then(|_| VerifyingKey::from_bytes(&b).ok())
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidData, "not a hex ed25519 public key"))
}
