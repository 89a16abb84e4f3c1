//! The receipt key: a dedicated ed25519 key that signs receipts, round announcements and the
//! manifests the [`DirPublisher`](crate::publish::DirPublisher) writes.
//!
//! `data_dir/receipt.key` holds the 32 secret bytes in hex (mode 0600, never logged);
//! `data_dir/receipt.pub` the public key in hex, to hand to agents (they also receive it in
//! every `GetRound` answer). A dedicated key rather than the TLS key: it can be rotated or kept
//! in other storage without touching the server certificate.

use std::path::Path;

use ed25519_dalek::SigningKey;

pub const KEY_FILE: &str = "receipt.key";
pub const PUB_FILE: &str = "receipt.pub";

/// Loads the receipt key from `dir`, creating it on first start.
pub fn load_or_create(dir: &Path) -> std::io::Result<SigningKey> {
    let path = dir.join(KEY_FILE);
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let mut secret = [0u8; 32];
            hex::decode_to_slice(text.trim(), &mut secret).map_err(|e| {
                std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{}: not a hex ed25519 secret key: {e}", path.display()))
            })?;
            Ok(SigningKey::from_bytes(&secret))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::create_dir_all(dir)?;
            let key = SigningKey::generate(&mut rand_core::OsRng);
            write_secret(&path, hex::encode(key.to_bytes()).as_bytes())?;
            crate::persist::write_atomic(&dir.join(PUB_FILE), format!("{}\n", hex::encode(key.verifying_key().to_bytes())).as_bytes())?;
            Ok(key)
        }
        Err(e) => Err(e),
    }
}

fn write_secret(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    fedfleet_durable::write_atomic(path, bytes, fedfleet_durable::Mode::Secret)
}

pub use fedfleet_aggregator_client::read_receipt_key as read_public;
