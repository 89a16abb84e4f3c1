//! Hostile agents for the `poisoned` example: a compromised device trains like every other one,
//! but its upload path replaces the update with a hostile one before it leaves the device. The
//! replacement is signed with the device's own key (a compromised device holds it), so the
//! aggregator accepts it as genuine; only the aggregation strategy can limit the damage.

use ed25519_dalek::SigningKey;
use fedfleet_agent::clients::{TransportError, UploadReply};
use fedfleet_learning::sim as lsim;
use fedfleet_protocol::{BundleLimits, Digest, SignedUpdate, TensorBundle};

/// What a hostile agent sends instead of its honest update `Δ`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Attack {
    /// `-factor · Δ`: pushes the model away from where the honest agents take it.
    SignFlip { factor: f32 },
    /// Gaussian noise of standard deviation `std` in every parameter.
    Noise { std: f32 },
}

impl std::fmt::Display for Attack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Attack::SignFlip { factor } => write!(f, "sign flip ×{factor}"),
            Attack::Noise { std } => write!(f, "noise σ={std}"),
        }
    }
}

/// The hostile part of one agent's upload path.
pub struct HostileUplink {
    attack: Attack,
    key: SigningKey,
    seed: u64,
}

impl HostileUplink {
    pub fn new(attack: Attack, key: SigningKey, seed: u64) -> Self {
        HostileUplink { attack, key, seed }
    }

    /// The hostile update for an honest `(signed_header, payload)`: same round, nonce and
    /// sample count, a new payload (same encoding) and a header re-signed over it.
    pub fn corrupt(&self, signed_header: &[u8], payload: &[u8]) -> Result<(Vec<u8>, Vec<u8>), TransportError> {
        let bad = |e: String| TransportError(format!("hostile agent: {e}"));
        let signed = SignedUpdate::decode(signed_header).map_err(|e| bad(e.to_string()))?;
        let mut header = signed.body().clone();
        let honest = TensorBundle::decode(payload, &BundleLimits::default()).map_err(|e| bad(e.to_string()))?.dequantize();
        let hostile = match self.attack {
            Attack::SignFlip { factor } => lsim::scale(&honest, -factor).map_err(|e| bad(e.to_string()))?,
            Attack::Noise { std } => {
                // Per agent and round (not per nonce), so a run is reproducible.
                let seed = self.seed ^ header.round.0.rotate_left(32);
                gaussian_like(&honest, std, seed).map_err(|e| bad(e.to_string()))?
            }
        };
        let payload = hostile.quantize(header.payload_dtype).encode();
        header.payload_len = payload.len() as u64;
        header.payload_digest = Digest::of(&payload);
        Ok((SignedUpdate::sign(header, &self.key).encode(), payload))
    }

    /// The aggregator's receipt names the hostile payload; the device's own bookkeeping expects
    /// the honest one it queued, so the compromised upload path hands it a receipt for that.
    pub fn as_honest_reply(&self, honest_header: &[u8], reply: UploadReply) -> UploadReply {
        match (reply, SignedUpdate::decode(honest_header)) {
            (UploadReply::Receipt(mut r), Ok(h)) => {
                r.payload_digest = h.body().payload_digest;
                UploadReply::Receipt(r)
            }
            (reply, _) => reply,
        }
    }
}

/// Gaussian noise of standard deviation `std` with the layout of `like` (deterministic for a
/// seed): a hostile update, or the damage that makes a deliberately broken model.
pub fn gaussian_like(like: &TensorBundle, std: f32, seed: u64) -> Result<TensorBundle, fedfleet_protocol::BundleError> {
    let mut rng = Gaussian::new(seed);
    let mut out = TensorBundle::new();
    for (name, shape) in like.layout() {
        let n = shape.iter().product::<usize>();
        out.insert_f32(&name, shape, (0..n).map(|_| std * rng.next()).collect())?;
    }
    Ok(out)
}

/// Standard normal samples (splitmix64 + Box–Muller); deterministic for a seed.
struct Gaussian(u64);

impl Gaussian {
    fn new(seed: u64) -> Self {
        Gaussian(seed)
    }

    fn uniform(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        ((z >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    fn next(&mut self) -> f32 {
        let (u1, u2) = (self.uniform(), self.uniform());
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }
}
