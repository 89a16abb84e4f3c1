//! Secure aggregation for one round: SecAgg+ (Bell, Bonawitz, Gascón, Lepoint, Raykova, CCS 2020).
//! Sans-IO: every input carries `now` (unix ms) where time matters, randomness comes in as seeds
//! from the shell, and messages go in and out as values. No clock, socket, disk or async.
//!
//! The aggregator learns the sum of the surviving devices' updates and nothing else about any one
//! of them, as long as fewer than `threshold` of a device's neighbours collude with it.
//!
//! # The protocol (one round)
//! The aggregator fixes a [`Roster`]: the round's devices with their signing keys, the
//! [`Params`] and a graph seed. Every device's neighbours are its `degree` nearest devices on a
//! ring shuffled by that seed (a random Harary graph, [`Roster::neighbours`]): each device talks
//! to `degree` others, not to all `n`.
//! 1. **Keys** — each device sends two X25519 public keys (`c`: to encrypt shares, `s`: to agree
//!    pairwise masks) and a commitment to its self-mask seed `b`. The aggregator forwards each
//!    device its neighbours' signed adverts.
//! 2. **Shares** — each device splits its `s` secret key and `b` into Shamir shares (threshold
//!    `t`, one per neighbour that advertised), encrypts each pair to its neighbour (ChaCha20-
//!    Poly1305 under a key agreed from the `c` keys) and sends them; the aggregator forwards each
//!    device the ciphertexts addressed to it.
//! 3. **Masked input** — each device sends `y = q + PRG(b) + Σⱼ ±PRG(sᵢⱼ) mod 2⁶⁴`, where `q` is
//!    its weighted update quantized on the grid ([`encode`]) and `sᵢⱼ` the seed agreed with each
//!    neighbour `j` whose shares it received (`+` towards a later roster index, `−` towards an
//!    earlier one, so the pairwise masks of two survivors cancel in the sum).
//! 4. **Unmask** — the aggregator names the survivors (masked input received) and the dropped
//!    (shares sent, no masked input) among each device's neighbours. A device answers once: the
//!    `b` share of each survivor and the `s` share of each dropped neighbour, never both for one
//!    device. With `t` shares the aggregator rebuilds every survivor's `b` (checked against its
//!    commitment) and every dropped device's `s` key (checked against its public key), removes
//!    the self-masks and the dropped devices' pairwise masks, and holds `Σ q` exactly.
//!
//! Every device message is signed by the device ([`Kind::SecAgg`]) and bound to the round and
//! the roster's digest (the session), so a message of another round or roster is refused. A
//! stage closes when every expected device answered or at its deadline; a stage left with fewer
//! than `t` devices fails the round with its reason ([`Failure`]), never a wrong sum.
//!
//! # The grid
//! A device multiplies its update by its weight (sample count, clamped to [`MAX_WEIGHT`]),
//! clamps every value to `±clip` and rounds it to the grid `2^-frac_bits` ([`encode`]); the
//! weight rides as one more coordinate, so the aggregator learns only `Σ w`. [`Params::validate`]
//! refuses a grid whose sum over the roster could leave `±2⁶³`: the sum modulo 2⁶⁴ is then the
//! exact integer sum. [`Aggregate::to_fixed`] moves it onto the round engine's 2⁻⁴⁸ grid.
//!
//! # Noise on the grid (DP-FedAvg under secure aggregation)
//! With `dp_fedavg`, device `i` clips its update to `C`, adds `N(0, σ²/q)` per coordinate
//! (`σ = z·C`, `q` the quorum) in f32, and only then is it clamped and rounded here. So the
//! aggregator holds `Σᵢ r(xᵢ + nᵢ)` over the `m ≥ q` survivors, where `r` clamps to `±clip` and
//! rounds to the grid, and the accountant (the sampled Gaussian's RDP, `fedfleet-rounds`) books
//! it as the continuous mechanism `Σ xᵢ + N(0, σ²·m/q)`, whose noise is at least `σ²`. What that
//! leaves out, stated rather than claimed away:
//! - **Rounding.** `Σᵢ r(xᵢ + nᵢ) = Σᵢ (xᵢ + nᵢ) + E` with `|E| ≤ m·2^-(frac_bits+1)` per
//!   coordinate, and `E` depends on the data: the release is not a post-processing of the
//!   Gaussian sum, so the booked ε is not a proof for it. At `frac_bits = 24` the step is
//!   6·10⁻⁸, about 10⁻⁵ of a typical device's noise share (`σ/√q` ≥ 10⁻³): the gap is small in
//!   size, not closed in proof. The rigorous route is the distributed discrete Gaussian
//!   (Kairouz, Liu, Steinke, ICML 2021: noise drawn on the grid after a randomized rounding with
//!   a norm check, accounted as a sum of discrete Gaussians); it is not built.
//! - **Clamping.** A value past `±clip` (1000 by default) is clamped, also data-dependently;
//!   at noise shares far below `clip` this has probability below 10⁻¹⁰⁰ per coordinate.
//! - **Survivors past the quorum** add noise (`m/q` ≥ 1): the accounting stays conservative.

use std::collections::{BTreeMap, BTreeSet};

use chacha20::ChaCha20Rng;
use chacha20::rand_core::{Rng, SeedableRng};
use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{ChaCha20Poly1305, Key, Nonce};
use ed25519_dalek::{SigningKey, VerifyingKey};
use fedfleet_protocol::envelope::{EnvelopeError, Kind, Signable, Signed};
use fedfleet_protocol::{DeviceId, Digest, RoundId};
use serde::{Deserialize, Serialize};
use x25519_dalek::{PublicKey, StaticSecret};
use zeroize::Zeroizing;

/// Largest weight one device's update carries (sample counts above it count as this many).
pub const MAX_WEIGHT: u64 = 1 << 24;
/// Most devices one roster may hold (Shamir over GF(256) gives at most 255 shares per secret,
/// so `degree` is bounded separately; this bounds the sum).
pub const MAX_DEVICES: usize = 1 << 20;
/// Most neighbours a device may have: one Shamir share each, and GF(256) has 255 points.
pub const MAX_DEGREE: u16 = 254;
/// Most model coordinates one round may mask.
pub const MAX_DIM: u32 = 1 << 28;

/// Bytes of one Shamir share of a 32-byte secret: the x coordinate, then 32 bytes.
const SHARE_LEN: usize = 33;

/// The round's protocol parameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Params {
    /// Shares needed to rebuild a device's secrets; also the fewest devices a stage may end with.
    pub threshold: u16,
    /// Neighbours per device (even; every other device when the roster is smaller).
    pub degree: u16,
    /// Fractional bits of the grid the updates are quantized to.
    pub frac_bits: u8,
    /// Every weighted value is clamped to `[-clip, clip]` before quantizing.
    pub clip: f64,
}

impl Params {
    /// Checks the parameters for a roster of `n` devices (a clear error for each bad value).
    pub fn validate(&self, n: usize) -> Result<(), SecAggError> {
        let bad = |s: String| Err(SecAggError::InvalidParams(s));
        if n == 0 || n > MAX_DEVICES {
            return bad(format!("{n} devices; a roster holds 1..={MAX_DEVICES}"));
        }
        if self.degree < 2 || !self.degree.is_multiple_of(2) || self.degree > MAX_DEGREE {
            return bad(format!("degree {} must be even, in 2..={MAX_DEGREE}", self.degree));
        }
        let neighbours = (self.degree as usize).min(n - 1);
        if self.threshold < 2 || self.threshold as usize > neighbours {
            return bad(format!("threshold {} must be at least 2 and at most the {neighbours} neighbours a device has", self.threshold));
        }
        if self.frac_bits > 40 {
            return bad(format!("frac_bits {} above 40", self.frac_bits));
        }
        if !(self.clip.is_finite() && self.clip > 0.0) {
            return bad(format!("clip {} must be finite and positive", self.clip));
        }
        // Every coordinate of the sum stays inside ±2^63: n · clip · 2^F < 2^62 (a factor 2 spare).
        let bound = n as f64 * (self.clip * (1u64 << self.frac_bits) as f64 + 1.0);
        if bound >= (1u64 << 62) as f64 {
            return bad(format!(
                "{n} devices × clip {} on a 2^-{} grid can overflow the 64-bit sum; lower clip or frac_bits",
                self.clip, self.frac_bits
            ));
        }
        Ok(())
    }
}

/// Who takes part in the round, as the aggregator fixed it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Roster {
    pub round: RoundId,
    pub params: Params,
    /// Model coordinates (the masked vector has one more: the weight).
    pub dim: u32,
    /// Seeds the neighbour graph; fresh per round.
    pub graph_seed: [u8; 32],
    /// The devices, sorted by id, with their ed25519 verifying keys.
    pub devices: Vec<(DeviceId, [u8; 32])>,
}

impl Roster {
    /// A roster; the devices are sorted and must be distinct.
    pub fn new(
        round: RoundId,
        params: Params,
        dim: u32,
        graph_seed: [u8; 32],
        mut devices: Vec<(DeviceId, [u8; 32])>,
    ) -> Result<Roster, SecAggError> {
        devices.sort_by(|a, b| a.0.cmp(&b.0));
        if devices.windows(2).any(|w| w[0].0 == w[1].0) {
            return Err(SecAggError::InvalidParams("a device is listed twice".into()));
        }
        if dim == 0 || dim > MAX_DIM {
            return Err(SecAggError::InvalidParams(format!("dimension {dim} outside 1..={MAX_DIM}")));
        }
        params.validate(devices.len())?;
        Ok(Roster { round, params, dim, graph_seed, devices })
    }

    /// The roster as the aggregator sends it to devices.
    pub fn to_bytes(&self) -> Vec<u8> {
        postcard::to_stdvec(self).expect("a roster encodes")
    }

    /// A roster as a device receives it, checked as [`Roster::new`] checks one (sorted, distinct
    /// devices, dimension, parameters for its size).
    pub fn from_bytes(bytes: &[u8]) -> Result<Roster, SecAggError> {
        let r: Roster = postcard::from_bytes(bytes).map_err(|e| SecAggError::InvalidParams(format!("roster does not decode: {e}")))?;
        let checked = Roster::new(r.round, r.params, r.dim, r.graph_seed, r.devices.clone())?;
        if checked.devices != r.devices {
            return Err(SecAggError::InvalidParams("roster devices are not sorted".into()));
        }
        Ok(checked)
    }

    /// What the aggregator signs (with its receipt key) so that a device takes only the
    /// aggregator's own roster: the session under a context of its own.
    pub fn signing_bytes(&self) -> Vec<u8> {
        [&b"fedfleet secagg roster v1\0"[..], &self.session()].concat()
    }

    /// The session every message is bound to: a digest of the whole roster.
    pub fn session(&self) -> [u8; 32] {
        let bytes = postcard::to_stdvec(self).expect("a roster encodes");
        blake3::derive_key("fedfleet secagg session v1", &bytes)
    }

    pub fn len(&self) -> usize {
        self.devices.len()
    }

    pub fn is_empty(&self) -> bool {
        self.devices.is_empty()
    }

    pub fn index(&self, device: &DeviceId) -> Option<usize> {
        self.devices.binary_search_by(|(d, _)| d.cmp(device)).ok()
    }

    pub fn device(&self, i: usize) -> &DeviceId {
        &self.devices[i].0
    }

    /// The neighbours of device `i` (roster indices, ascending): the `degree / 2` devices on
    /// each side of it on the ring ordered by `blake3(graph_seed, device)`.
    pub fn neighbours(&self, i: usize) -> Vec<usize> {
        let ring = self.ring();
        let at = ring.iter().position(|&j| j == i).expect("i is in the roster");
        self.around(&ring, at)
    }

    /// [`Roster::neighbours`] of every device, from one ordering of the ring.
    pub fn neighbour_lists(&self) -> Vec<Vec<usize>> {
        let ring = self.ring();
        let mut lists = vec![Vec::new(); ring.len()];
        for (at, &i) in ring.iter().enumerate() {
            lists[i] = self.around(&ring, at);
        }
        lists
    }

    /// The roster indices in ring order.
    fn ring(&self) -> Vec<usize> {
        let mut keyed: Vec<(blake3::Hash, usize)> = (0..self.devices.len())
            .map(|j| {
                let mut h = blake3::Hasher::new_keyed(&self.graph_seed);
                h.update(self.devices[j].0.as_str().as_bytes());
                (h.finalize(), j)
            })
            .collect();
        keyed.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
        keyed.into_iter().map(|(_, j)| j).collect()
    }

    /// The devices within `degree / 2` places of ring position `at`, ascending.
    fn around(&self, ring: &[usize], at: usize) -> Vec<usize> {
        let n = ring.len();
        let half = (self.params.degree as usize / 2).min((n - 1) / 2 + 1);
        let mut out = BTreeSet::new();
        for d in 1..=half {
            out.insert(ring[(at + d) % n]);
            out.insert(ring[(at + n - d) % n]);
        }
        out.remove(&ring[at]);
        out.into_iter().collect()
    }
}

/// A device's message, signed by it ([`Kind::SecAgg`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub round: RoundId,
    pub session: [u8; 32],
    pub device: DeviceId,
    pub body: Body,
}

/// What a device says at each stage.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Body {
    /// Stage 1: public keys for share encryption (`c`) and masks (`s`), and `blake3` of the
    /// self-mask seed.
    Keys { c_public: [u8; 32], s_public: [u8; 32], b_commitment: [u8; 32] },
    /// Stage 2: one ciphertext per neighbour.
    Shares { to: Vec<(DeviceId, Vec<u8>)> },
    /// Stage 3: the masked vector travels beside this message, bound by its digest; `pairs`
    /// names the neighbours whose pairwise masks are in it (those whose shares it decrypted).
    Masked { digest: Digest, coordinates: u64, pairs: Vec<DeviceId> },
    /// Stage 4: the self-mask share of each surviving neighbour and the key share of each dropped
    /// one.
    Unmask { self_mask: Vec<(DeviceId, Vec<u8>)>, key: Vec<(DeviceId, Vec<u8>)> },
}

impl Body {
    fn stage(&self) -> Stage {
        match self {
            Body::Keys { .. } => Stage::Keys,
            Body::Shares { .. } => Stage::Shares,
            Body::Masked { .. } => Stage::Masked,
            Body::Unmask { .. } => Stage::Unmask,
        }
    }
}

impl Signable for Message {
    const KIND: Kind = Kind::SecAgg;

    fn canonical_bytes(&self) -> Vec<u8> {
        postcard::to_stdvec(self).expect("postcard writes plain structs to a Vec without error")
    }

    fn from_canonical_bytes(bytes: &[u8]) -> Result<Self, EnvelopeError> {
        if bytes.len() > Kind::SecAgg.max_body_len() {
            return Err(EnvelopeError::TooLarge {
                what: "secagg message",
                len: bytes.len() as u64,
                max: Kind::SecAgg.max_body_len() as u64,
            });
        }
        let (m, rest) = postcard::take_from_bytes(bytes).map_err(|e| EnvelopeError::BadBody(e.to_string()))?;
        if !rest.is_empty() {
            return Err(EnvelopeError::TrailingBytes(rest.len()));
        }
        Ok(m)
    }
}

/// The aggregator's request at stage 4, for one device: which of its neighbours survived and
/// which dropped out after sending their shares.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UnmaskRequest {
    pub survivors: Vec<DeviceId>,
    pub dropped: Vec<DeviceId>,
}

/// The stages of a round, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Stage {
    Keys,
    Shares,
    Masked,
    Unmask,
    Done,
    Failed,
}

/// The round's parameters or roster are unusable, or a device cannot go on.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum SecAggError {
    #[error("invalid secure-aggregation parameters: {0}")]
    InvalidParams(String),
    #[error("device {0} is not in the round's roster")]
    NotInRoster(DeviceId),
    #[error("{0}")]
    Refused(Refusal),
    #[error("only {have} of this device's neighbours are left; {need} are needed")]
    TooFewNeighbours { have: usize, need: usize },
    #[error("the update has {got} coordinates; the round masks {expected}")]
    WrongDimension { expected: usize, got: usize },
    #[error("the aggregator already asked this device to unmask; it answers once per round")]
    AlreadyAnswered,
    #[error("the aggregator's unmask request is inconsistent: {0}")]
    BadRequest(String),
    #[error("this device's stage is {now:?}; {input} does not apply")]
    OutOfOrder { now: Stage, input: &'static str },
}

/// Why the aggregator refused one device message (the round goes on without it). Named, so the
/// shell can count and report each reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refusal {
    #[error("signature does not verify with the device's key")]
    BadSignature,
    #[error("message of another round or roster (a replay)")]
    WrongSession,
    #[error("device {0} is not in the round's roster")]
    NotInRoster(DeviceId),
    #[error("a {got:?} message while the round is at {now:?}")]
    WrongStage { now: Stage, got: Stage },
    #[error("device {0} already sent this stage's message")]
    Duplicate(DeviceId),
    #[error("device {0} was not in the previous stage")]
    NotExpected(DeviceId),
    #[error("weak (low-order) X25519 public key")]
    WeakKey,
    #[error("share for {about}: {detail}")]
    MalformedShare { about: DeviceId, detail: String },
    #[error("both the self-mask share and the key share of {about} (the consistency check)")]
    InconsistentShares { about: DeviceId },
    #[error("the masked vector: {0}")]
    BadVector(String),
    #[error("{0} masked its vector with other neighbours than those whose shares it was sent")]
    MaskSetMismatch(DeviceId),
}

impl Refusal {
    /// The reason's name in metrics and logs.
    pub fn name(&self) -> &'static str {
        match self {
            Refusal::BadSignature => "bad_signature",
            Refusal::WrongSession => "wrong_session",
            Refusal::NotInRoster(_) => "not_in_roster",
            Refusal::WrongStage { .. } => "wrong_stage",
            Refusal::Duplicate(_) => "duplicate",
            Refusal::NotExpected(_) => "not_expected",
            Refusal::WeakKey => "weak_key",
            Refusal::MalformedShare { .. } => "malformed_share",
            Refusal::InconsistentShares { .. } => "inconsistent_shares",
            Refusal::BadVector(_) => "bad_vector",
            Refusal::MaskSetMismatch(_) => "mask_set_mismatch",
        }
    }
}

/// Why a round's secure aggregation failed: the round publishes nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Failure {
    #[error("{stage:?} stage ended with {have} devices; the threshold is {threshold}")]
    BelowThreshold { stage: Stage, have: usize, threshold: usize },
    #[error("{device}'s secret cannot be rebuilt: {have} shares of the {need} needed arrived")]
    Unrecoverable { device: DeviceId, have: usize, need: usize },
    #[error("{device}'s rebuilt secret does not match what it advertised (a bad share)")]
    ShareMismatch { device: DeviceId },
}

impl Failure {
    pub fn name(&self) -> &'static str {
        match self {
            Failure::BelowThreshold { .. } => "below_threshold",
            Failure::Unrecoverable { .. } => "unrecoverable",
            Failure::ShareMismatch { .. } => "share_mismatch",
        }
    }
}

/// Deadlines of the four stages, unix ms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Deadlines {
    pub keys: u64,
    pub shares: u64,
    pub masked: u64,
    pub unmask: u64,
}

/// The unmasked result: `Σ q` over the survivors, exactly.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Aggregate {
    pub round: RoundId,
    /// Per coordinate, the sum of the survivors' quantized weighted values (units 2^-frac_bits).
    pub sums: Vec<i64>,
    /// `Σ w` over the survivors.
    pub total_weight: u64,
    pub frac_bits: u8,
    pub survivors: Vec<DeviceId>,
    /// Devices that sent their shares but no masked input: their masks were removed.
    pub dropped: Vec<DeviceId>,
}

impl Aggregate {
    /// The sums on a finer grid of `2^-frac_bits` units (the round engine's is 2⁻⁴⁸): exact.
    pub fn to_fixed(&self, frac_bits: u32) -> Option<Vec<i128>> {
        let shift = frac_bits.checked_sub(self.frac_bits as u32)?;
        Some(self.sums.iter().map(|&s| (s as i128) << shift).collect())
    }

    /// The weighted mean, coordinate by coordinate.
    pub fn mean(&self) -> Vec<f64> {
        let scale = (1u64 << self.frac_bits) as f64 * self.total_weight.max(1) as f64;
        self.sums.iter().map(|&s| s as f64 / scale).collect()
    }
}

/// A device's update on the grid: `round(clamp(w·Δ, ±clip) · 2^F)` per coordinate, two's
/// complement in `u64`, then the weight. What the masks hide and the aggregate sums.
pub fn encode(update: &[f32], weight: u64, params: &Params) -> Vec<u64> {
    let w = weight.clamp(1, MAX_WEIGHT);
    let scale = (1u64 << params.frac_bits) as f64;
    let mut out: Vec<u64> = update
        .iter()
        .map(|&x| {
            let v = (w as f64 * x as f64).clamp(-params.clip, params.clip);
            let v = if v.is_nan() { 0.0 } else { v };
            ((v * scale).round() as i64) as u64
        })
        .collect();
    out.push(w);
    out
}

/// Adds `sign · PRG(seed)` to `acc`, modulo 2⁶⁴.
fn apply_mask(acc: &mut [u64], seed: &[u8; 32], add: bool) {
    let mut rng = ChaCha20Rng::from_seed(*seed);
    for a in acc.iter_mut() {
        let m = rng.next_u64();
        *a = if add { a.wrapping_add(m) } else { a.wrapping_sub(m) };
    }
}

fn kdf(context: &str, parts: &[&[u8]]) -> [u8; 32] {
    let mut material = Vec::new();
    for p in parts {
        material.extend_from_slice(&(p.len() as u32).to_be_bytes());
        material.extend_from_slice(p);
    }
    blake3::derive_key(context, &material)
}

fn index_bytes(i: usize) -> [u8; 4] {
    (i as u32).to_be_bytes()
}

/// The pairwise mask seed of roster devices `i` and `j` (the same from both sides).
fn pairwise_seed(shared: &[u8; 32], session: &[u8; 32], i: usize, j: usize) -> [u8; 32] {
    let (lo, hi) = (i.min(j), i.max(j));
    kdf("fedfleet secagg pairwise mask v1", &[shared, session, &index_bytes(lo), &index_bytes(hi)])
}

fn self_mask_seed(b: &[u8; 32], session: &[u8; 32]) -> [u8; 32] {
    kdf("fedfleet secagg self mask v1", &[b, session])
}

fn b_commitment(b: &[u8; 32], session: &[u8; 32]) -> [u8; 32] {
    kdf("fedfleet secagg self-mask commitment v1", &[b, session])
}

/// Key and nonce of the share ciphertext from `from` to `to` (one direction of the pair's key).
fn share_cipher(shared: &[u8; 32], session: &[u8; 32], from: usize, to: usize) -> (ChaCha20Poly1305, [u8; 12]) {
    let key = kdf("fedfleet secagg share key v1", &[shared, session]);
    let nonce = kdf("fedfleet secagg share nonce v1", &[session, &index_bytes(from), &index_bytes(to)]);
    (ChaCha20Poly1305::new(Key::from_slice(&key)), *nonce.first_chunk::<12>().expect("12 bytes"))
}

fn share_aad(session: &[u8; 32], from: usize, to: usize) -> Vec<u8> {
    [&session[..], &index_bytes(from), &index_bytes(to)].concat()
}

/// What one device holds for another: a share of its `s` key and of its self-mask seed.
#[derive(Serialize, Deserialize)]
struct SharePair {
    key: Vec<u8>,
    self_mask: Vec<u8>,
}

fn agree(secret: &StaticSecret, public: &[u8; 32]) -> Option<[u8; 32]> {
    let shared = secret.diffie_hellman(&PublicKey::from(*public));
    shared.was_contributory().then(|| *shared.as_bytes())
}

/// Shamir shares of `secret` for `holders` devices, threshold `t` (share `k` has x = k + 1).
fn deal(secret: &[u8; 32], t: u16, holders: usize, rng: &mut ChaCha20Rng) -> Vec<Vec<u8>> {
    blahaj::Sharks(t as u8).dealer_rng(secret, rng).take(holders).map(|s| Vec::from(&s)).collect()
}

fn recover(t: u16, shares: &[Vec<u8>]) -> Option<[u8; 32]> {
    let shares: Vec<blahaj::Share> = shares.iter().filter_map(|s| blahaj::Share::try_from(s.as_slice()).ok()).collect();
    let secret = blahaj::Sharks(t as u8).recover(&shares).ok()?;
    secret.try_into().ok()
}

// ----- the device -----

/// One device's side of a round.
pub struct Client {
    roster: Roster,
    session: [u8; 32],
    me: usize,
    key: SigningKey,
    c_secret: StaticSecret,
    s_secret: StaticSecret,
    b: Zeroizing<[u8; 32]>,
    rng: ChaCha20Rng,
    stage: Stage,
    /// Neighbours that advertised keys: (c public, s public).
    keys: BTreeMap<usize, ([u8; 32], [u8; 32])>,
    /// Neighbours whose shares arrived (they are in the masks), with what they sent.
    held: BTreeMap<usize, SharePair>,
}

impl Client {
    /// Joins `roster` as `device`; `entropy` (32 fresh random bytes from the shell) seeds every
    /// secret this device makes in the round. Returns the stage-1 message.
    pub fn new(roster: Roster, device: &DeviceId, key: SigningKey, entropy: [u8; 32]) -> Result<(Client, Signed<Message>), SecAggError> {
        let me = roster.index(device).ok_or_else(|| SecAggError::NotInRoster(device.clone()))?;
        let session = roster.session();
        let mut rng = ChaCha20Rng::from_seed(kdf("fedfleet secagg device rng v1", &[&entropy, &session]));
        let mut draw = || {
            let mut b = [0u8; 32];
            rng.fill_bytes(&mut b);
            b
        };
        let (c_secret, s_secret, b) = (StaticSecret::from(draw()), StaticSecret::from(draw()), Zeroizing::new(draw()));
        let body = Body::Keys {
            c_public: PublicKey::from(&c_secret).to_bytes(),
            s_public: PublicKey::from(&s_secret).to_bytes(),
            b_commitment: b_commitment(&b, &session),
        };
        let client = Client {
            roster,
            session,
            me,
            key,
            c_secret,
            s_secret,
            b,
            rng,
            stage: Stage::Keys,
            keys: BTreeMap::new(),
            held: BTreeMap::new(),
        };
        let msg = client.sign(body);
        Ok((client, msg))
    }

    pub fn stage(&self) -> Stage {
        self.stage
    }

    fn sign(&self, body: Body) -> Signed<Message> {
        Signed::sign(
            Message { round: self.roster.round, session: self.session, device: self.roster.device(self.me).clone(), body },
            &self.key,
        )
    }

    fn expect(&self, stage: Stage, input: &'static str) -> Result<(), SecAggError> {
        if self.stage != stage {
            return Err(SecAggError::OutOfOrder { now: self.stage, input });
        }
        Ok(())
    }

    /// Stage 2: the neighbours' adverts (as the aggregator forwards them), each checked against
    /// the roster; returns this device's encrypted shares.
    pub fn on_keys(&mut self, adverts: &[Signed<Message>]) -> Result<Signed<Message>, SecAggError> {
        self.expect(Stage::Keys, "neighbours' keys")?;
        let neighbours: BTreeSet<usize> = self.roster.neighbours(self.me).into_iter().collect();
        for advert in adverts {
            let (from, body) = verify(&self.roster, &self.session, advert).map_err(SecAggError::Refused)?;
            let Body::Keys { c_public, s_public, .. } = body else {
                return Err(SecAggError::Refused(Refusal::WrongStage { now: Stage::Keys, got: body.stage() }));
            };
            if neighbours.contains(&from) {
                self.keys.insert(from, (*c_public, *s_public));
            }
        }
        let t = self.roster.params.threshold;
        if self.keys.len() < t as usize {
            return Err(SecAggError::TooFewNeighbours { have: self.keys.len(), need: t as usize });
        }
        let holders: Vec<usize> = self.keys.keys().copied().collect();
        let key_shares = deal(&self.s_secret.to_bytes(), t, holders.len(), &mut self.rng);
        let mask_shares = deal(&self.b, t, holders.len(), &mut self.rng);
        let mut to = Vec::with_capacity(holders.len());
        for ((j, key), self_mask) in holders.iter().zip(key_shares).zip(mask_shares) {
            let (c_public, _) = self.keys[j];
            let shared = agree(&self.c_secret, &c_public).ok_or(SecAggError::Refused(Refusal::WeakKey))?;
            let (cipher, nonce) = share_cipher(&shared, &self.session, self.me, *j);
            let plain = Zeroizing::new(postcard::to_stdvec(&SharePair { key, self_mask }).expect("encodes"));
            let aad = share_aad(&self.session, self.me, *j);
            let ct = cipher.encrypt(Nonce::from_slice(&nonce), Payload { msg: &plain, aad: &aad }).expect("encryption cannot fail");
            to.push((self.roster.device(*j).clone(), ct));
        }
        self.stage = Stage::Shares;
        Ok(self.sign(Body::Shares { to }))
    }

    /// Stage 3: the ciphertexts addressed to this device, then its update; returns the signed
    /// message and the masked vector it binds.
    pub fn on_shares(
        &mut self,
        shares: &[(DeviceId, Vec<u8>)],
        update: &[f32],
        weight: u64,
    ) -> Result<(Signed<Message>, Vec<u64>), SecAggError> {
        self.expect(Stage::Shares, "neighbours' shares")?;
        if update.len() != self.roster.dim as usize {
            return Err(SecAggError::WrongDimension { expected: self.roster.dim as usize, got: update.len() });
        }
        for (from, ct) in shares {
            let Some(j) = self.roster.index(from).filter(|j| self.keys.contains_key(j)) else { continue };
            let (c_public, _) = self.keys[&j];
            let Some(shared) = agree(&self.c_secret, &c_public) else { continue };
            let (cipher, nonce) = share_cipher(&shared, &self.session, j, self.me);
            let aad = share_aad(&self.session, j, self.me);
            // A share that does not decrypt is left out: that neighbour's masks are not used.
            let Ok(plain) = cipher.decrypt(Nonce::from_slice(&nonce), Payload { msg: ct, aad: &aad }) else { continue };
            let plain = Zeroizing::new(plain);
            if let Ok(pair) = postcard::from_bytes::<SharePair>(&plain) {
                self.held.insert(j, pair);
            }
        }
        let t = self.roster.params.threshold as usize;
        if self.held.len() < t {
            return Err(SecAggError::TooFewNeighbours { have: self.held.len(), need: t });
        }
        let mut y = encode(update, weight, &self.roster.params);
        apply_mask(&mut y, &self_mask_seed(&self.b, &self.session), true);
        for &j in self.held.keys() {
            let (_, s_public) = self.keys[&j];
            let shared = agree(&self.s_secret, &s_public).ok_or(SecAggError::Refused(Refusal::WeakKey))?;
            apply_mask(&mut y, &pairwise_seed(&shared, &self.session, self.me, j), self.me < j);
        }
        self.stage = Stage::Masked;
        let digest = Digest::of(&vector_bytes(&y));
        let pairs = self.held.keys().map(|&j| self.roster.device(j).clone()).collect();
        Ok((self.sign(Body::Masked { digest, coordinates: y.len() as u64, pairs }), y))
    }

    /// Stage 4: answers the aggregator's request once. Refuses a request that names this device
    /// dropped, names a neighbour both ways, or leaves fewer than `threshold` survivors.
    pub fn on_unmask(&mut self, request: &UnmaskRequest) -> Result<Signed<Message>, SecAggError> {
        if self.stage == Stage::Done {
            return Err(SecAggError::AlreadyAnswered);
        }
        self.expect(Stage::Masked, "an unmask request")?;
        let me = self.roster.device(self.me);
        let survivors: BTreeSet<&DeviceId> = request.survivors.iter().collect();
        let dropped: BTreeSet<&DeviceId> = request.dropped.iter().collect();
        if dropped.contains(me) || !survivors.contains(me) {
            return Err(SecAggError::BadRequest("it does not list this device as a survivor".into()));
        }
        if let Some(both) = survivors.intersection(&dropped).next() {
            return Err(SecAggError::BadRequest(format!("{both} is named a survivor and dropped")));
        }
        if survivors.len() < self.roster.params.threshold as usize {
            return Err(SecAggError::BadRequest(format!(
                "{} survivors, under the threshold {}",
                survivors.len(),
                self.roster.params.threshold
            )));
        }
        let (mut self_mask, mut key) = (Vec::new(), Vec::new());
        for (&j, pair) in &self.held {
            let id = self.roster.device(j);
            if survivors.contains(id) {
                self_mask.push((id.clone(), pair.self_mask.clone()));
            } else if dropped.contains(id) {
                key.push((id.clone(), pair.key.clone()));
            }
        }
        self.stage = Stage::Done;
        Ok(self.sign(Body::Unmask { self_mask, key }))
    }
}

/// The bytes a masked vector's digest covers (little-endian u64s).
pub fn vector_bytes(v: &[u64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Checks a device message's session and signature against the roster; its sender's index.
fn verify<'a>(roster: &Roster, session: &[u8; 32], msg: &'a Signed<Message>) -> Result<(usize, &'a Body), Refusal> {
    let m = msg.body();
    let i = roster.index(&m.device).ok_or_else(|| Refusal::NotInRoster(m.device.clone()))?;
    let key = VerifyingKey::from_bytes(&roster.devices[i].1).map_err(|_| Refusal::BadSignature)?;
    msg.verify(&key).map_err(|_| Refusal::BadSignature)?;
    if m.round != roster.round || &m.session != session {
        return Err(Refusal::WrongSession);
    }
    Ok((i, &m.body))
}

// ----- the aggregator -----

struct Advert {
    signed: Signed<Message>,
    s_public: [u8; 32],
    b_commitment: [u8; 32],
}

/// The aggregator's side of a round.
pub struct Server {
    roster: Roster,
    session: [u8; 32],
    deadlines: Deadlines,
    stage: Stage,
    failure: Option<Failure>,
    neighbours: Vec<Vec<usize>>,
    /// U1: devices that advertised keys.
    adverts: BTreeMap<usize, Advert>,
    /// U2: devices that sent shares, with their ciphertexts by recipient.
    shares: BTreeMap<usize, BTreeMap<usize, Vec<u8>>>,
    /// U3: devices whose masked vector arrived.
    masked: BTreeMap<usize, Vec<u64>>,
    /// Stage-4 answers: per responder, (self-mask shares, key shares) by device.
    answers: BTreeMap<usize, (BTreeMap<usize, Vec<u8>>, BTreeMap<usize, Vec<u8>>)>,
    result: Option<Aggregate>,
}

impl Server {
    pub fn new(roster: Roster, deadlines: Deadlines) -> Server {
        let neighbours = roster.neighbour_lists();
        let session = roster.session();
        Server {
            roster,
            session,
            deadlines,
            stage: Stage::Keys,
            failure: None,
            neighbours,
            adverts: BTreeMap::new(),
            shares: BTreeMap::new(),
            masked: BTreeMap::new(),
            answers: BTreeMap::new(),
            result: None,
        }
    }

    pub fn roster(&self) -> &Roster {
        &self.roster
    }

    pub fn stage(&self) -> Stage {
        self.stage
    }

    pub fn failure(&self) -> Option<&Failure> {
        self.failure.as_ref()
    }

    /// The unmasked sum, once the round is done.
    pub fn result(&self) -> Option<&Aggregate> {
        self.result.as_ref()
    }

    /// When [`Server::handle_timeout`] should next run: the current stage's deadline.
    pub fn poll_timeout(&self) -> Option<u64> {
        match self.stage {
            Stage::Keys => Some(self.deadlines.keys),
            Stage::Shares => Some(self.deadlines.shares),
            Stage::Masked => Some(self.deadlines.masked),
            Stage::Unmask => Some(self.deadlines.unmask),
            Stage::Done | Stage::Failed => None,
        }
    }

    /// Closes the current stage if its deadline passed (with whoever answered).
    pub fn handle_timeout(&mut self, now: u64) {
        if self.poll_timeout().is_some_and(|d| now >= d) {
            self.close_stage();
        }
    }

    /// Whether device `i` is expected at the current stage: it took part in the previous one.
    fn expects(&self, i: usize) -> bool {
        match self.stage {
            Stage::Keys => true,
            Stage::Shares => self.adverts.contains_key(&i),
            Stage::Masked => self.shares.contains_key(&i),
            Stage::Unmask => self.masked.contains_key(&i),
            Stage::Done | Stage::Failed => false,
        }
    }

    /// How many devices the current stage expects.
    fn expected_count(&self) -> usize {
        match self.stage {
            Stage::Keys => self.roster.len(),
            Stage::Shares => self.adverts.len(),
            Stage::Masked => self.shares.len(),
            Stage::Unmask => self.masked.len(),
            Stage::Done | Stage::Failed => 0,
        }
    }

    fn answered(&self) -> usize {
        match self.stage {
            Stage::Keys => self.adverts.len(),
            Stage::Shares => self.shares.len(),
            Stage::Masked => self.masked.len(),
            Stage::Unmask => self.answers.len(),
            Stage::Done | Stage::Failed => 0,
        }
    }

    fn fail(&mut self, failure: Failure) {
        self.stage = Stage::Failed;
        self.failure = Some(failure);
    }

    fn close_stage(&mut self) {
        let t = self.roster.params.threshold as usize;
        let have = self.answered();
        if have < t {
            let stage = self.stage;
            return self.fail(Failure::BelowThreshold { stage, have, threshold: t });
        }
        self.stage = match self.stage {
            Stage::Keys => Stage::Shares,
            Stage::Shares => Stage::Masked,
            Stage::Masked => Stage::Unmask,
            Stage::Unmask => return self.unmask(),
            s => s,
        };
    }

    /// A device's message (and, at stage 3, the masked vector it binds). A refused message
    /// changes nothing; the round goes on without it.
    pub fn handle(&mut self, msg: &Signed<Message>, vector: Option<&[u64]>) -> Result<(), Refusal> {
        let (i, body) = verify(&self.roster, &self.session, msg)?;
        if body.stage() != self.stage {
            return Err(Refusal::WrongStage { now: self.stage, got: body.stage() });
        }
        if !self.expects(i) {
            return Err(Refusal::NotExpected(self.roster.device(i).clone()));
        }
        let device = self.roster.device(i).clone();
        match body {
            Body::Keys { c_public, s_public, b_commitment } => {
                if self.adverts.contains_key(&i) {
                    return Err(Refusal::Duplicate(device));
                }
                if is_low_order(c_public) || is_low_order(s_public) {
                    return Err(Refusal::WeakKey);
                }
                let advert = Advert { signed: msg.clone(), s_public: *s_public, b_commitment: *b_commitment };
                self.adverts.insert(i, advert);
            }
            Body::Shares { to } => {
                if self.shares.contains_key(&i) {
                    return Err(Refusal::Duplicate(device));
                }
                let mut by_recipient = BTreeMap::new();
                for (to, ct) in to {
                    let j = self.roster.index(to).ok_or_else(|| Refusal::NotInRoster(to.clone()))?;
                    if !self.neighbours[i].contains(&j) || !self.adverts.contains_key(&j) || by_recipient.contains_key(&j) {
                        return Err(Refusal::MalformedShare {
                            about: to.clone(),
                            detail: "not a neighbour that advertised keys, or twice".into(),
                        });
                    }
                    by_recipient.insert(j, ct.clone());
                }
                self.shares.insert(i, by_recipient);
            }
            Body::Masked { digest, coordinates, pairs } => {
                if self.masked.contains_key(&i) {
                    return Err(Refusal::Duplicate(device));
                }
                // The unmasking removes the masks of exactly the pairs whose shares this device
                // was forwarded; a vector masked with other pairs would unmask to a wrong sum.
                // (Shares only go to neighbours, so only i's neighbours can have sent it any.)
                let forwarded: Vec<&DeviceId> = self.neighbours[i]
                    .iter()
                    .filter(|j| self.shares.get(j).is_some_and(|to| to.contains_key(&i)))
                    .map(|&j| self.roster.device(j))
                    .collect();
                if pairs.iter().collect::<Vec<_>>() != forwarded {
                    return Err(Refusal::MaskSetMismatch(device));
                }
                let v = vector.ok_or_else(|| Refusal::BadVector("missing".into()))?;
                let want = self.roster.dim as usize + 1;
                if v.len() != want || *coordinates != want as u64 {
                    return Err(Refusal::BadVector(format!("{} coordinates; the round masks {want}", v.len())));
                }
                if Digest::of(&vector_bytes(v)) != *digest {
                    return Err(Refusal::BadVector("does not match its signed digest".into()));
                }
                self.masked.insert(i, v.to_vec());
            }
            Body::Unmask { self_mask, key } => {
                if self.answers.contains_key(&i) {
                    return Err(Refusal::Duplicate(device));
                }
                let answer = self.check_unmask(i, self_mask, key)?;
                self.answers.insert(i, answer);
            }
        }
        if self.answered() == self.expected_count() {
            self.close_stage();
        }
        Ok(())
    }

    /// Stage 2 → device: the adverts of its neighbours that advertised.
    pub fn keys_for(&self, device: &DeviceId) -> Vec<Signed<Message>> {
        let Some(i) = self.roster.index(device) else { return Vec::new() };
        self.neighbours[i].iter().filter_map(|j| self.adverts.get(j)).map(|a| a.signed.clone()).collect()
    }

    /// Stage 3 → device: the ciphertexts its neighbours addressed to it.
    pub fn shares_for(&self, device: &DeviceId) -> Vec<(DeviceId, Vec<u8>)> {
        let Some(i) = self.roster.index(device) else { return Vec::new() };
        self.shares.iter().filter_map(|(&from, to)| to.get(&i).map(|ct| (self.roster.device(from).clone(), ct.clone()))).collect()
    }

    /// Stage 4 → device: which of its neighbours that sent shares survived and which dropped.
    pub fn unmask_request_for(&self, device: &DeviceId) -> UnmaskRequest {
        let Some(i) = self.roster.index(device) else { return UnmaskRequest { survivors: Vec::new(), dropped: Vec::new() } };
        let mut survivors: Vec<DeviceId> = self.masked.keys().map(|&j| self.roster.device(j).clone()).collect();
        survivors.sort();
        let dropped = self.neighbours[i]
            .iter()
            .filter(|j| self.shares.contains_key(j) && !self.masked.contains_key(j))
            .map(|&j| self.roster.device(j).clone())
            .collect();
        UnmaskRequest { survivors, dropped }
    }

    /// The shares a responder may give: of survivors it holds a share of, self-mask shares only;
    /// of dropped ones, key shares only; never both for one device; each well formed.
    fn check_unmask(
        &self,
        i: usize,
        self_mask: &[(DeviceId, Vec<u8>)],
        key: &[(DeviceId, Vec<u8>)],
    ) -> Result<(BTreeMap<usize, Vec<u8>>, BTreeMap<usize, Vec<u8>>), Refusal> {
        let (mut masks, mut keys) = (BTreeMap::new(), BTreeMap::new());
        for (list, out) in [(self_mask, &mut masks), (key, &mut keys)] {
            for (about, share) in list {
                let j = self.roster.index(about).ok_or_else(|| Refusal::NotInRoster(about.clone()))?;
                let malformed = |detail: String| Refusal::MalformedShare { about: about.clone(), detail };
                // Which x this responder's share of j carries: its place among j's holders.
                let Some(place) = self.holders(j).iter().position(|&h| h == i) else {
                    return Err(malformed("this device holds no share of it".into()));
                };
                let x = share.first().copied().unwrap_or(0);
                if share.len() != SHARE_LEN || x as usize != place + 1 {
                    return Err(malformed(format!(
                        "{} bytes with x = {x}; expected {SHARE_LEN} bytes with x = {}",
                        share.len(),
                        place + 1
                    )));
                }
                if out.insert(j, share.clone()).is_some() {
                    return Err(malformed("given twice".into()));
                }
            }
        }
        // Both secrets of one device would unmask its update: the consistency check.
        if let Some(j) = masks.keys().find(|j| keys.contains_key(j)) {
            return Err(Refusal::InconsistentShares { about: self.roster.device(*j).clone() });
        }
        for (j, survivor) in masks.keys().map(|&j| (j, true)).chain(keys.keys().map(|&j| (j, false))) {
            if self.masked.contains_key(&j) != survivor {
                let detail = if survivor { "a self-mask share of a device that dropped out" } else { "a key share of a survivor" };
                return Err(Refusal::MalformedShare { about: self.roster.device(j).clone(), detail: detail.into() });
            }
        }
        Ok((masks, keys))
    }

    /// The devices holding shares of `j` (its neighbours that advertised, as `j` dealt them).
    fn holders(&self, j: usize) -> Vec<usize> {
        match self.shares.get(&j) {
            Some(to) => to.keys().copied().collect(),
            None => Vec::new(),
        }
    }

    fn unmask(&mut self) {
        match self.unmasked() {
            Ok(agg) => {
                self.result = Some(agg);
                self.stage = Stage::Done;
            }
            Err(f) => self.fail(f),
        }
    }

    fn unmasked(&self) -> Result<Aggregate, Failure> {
        let t = self.roster.params.threshold;
        let dim = self.roster.dim as usize + 1;
        let mut sum = vec![0u64; dim];
        for v in self.masked.values() {
            for (a, x) in sum.iter_mut().zip(v) {
                *a = a.wrapping_add(*x);
            }
        }
        let gather = |j: usize, survivor: bool| -> Vec<Vec<u8>> {
            self.answers.values().filter_map(|(m, k)| if survivor { m.get(&j) } else { k.get(&j) }).cloned().collect()
        };
        let rebuild = |j: usize, survivor: bool| -> Result<[u8; 32], Failure> {
            let shares = gather(j, survivor);
            let device = self.roster.device(j).clone();
            if shares.len() < t as usize {
                return Err(Failure::Unrecoverable { device, have: shares.len(), need: t as usize });
            }
            recover(t, &shares).ok_or(Failure::ShareMismatch { device })
        };
        // Survivors: remove the self-masks.
        for &j in self.masked.keys() {
            let b = Zeroizing::new(rebuild(j, true)?);
            if b_commitment(&b, &self.session) != self.adverts[&j].b_commitment {
                return Err(Failure::ShareMismatch { device: self.roster.device(j).clone() });
            }
            apply_mask(&mut sum, &self_mask_seed(&b, &self.session), false);
        }
        // Dropped after sharing: remove their pairwise masks from the survivors that added them.
        let mut dropped = Vec::new();
        for &j in self.shares.keys().filter(|j| !self.masked.contains_key(j)) {
            let secret = StaticSecret::from(rebuild(j, false)?);
            if PublicKey::from(&secret).to_bytes() != self.adverts[&j].s_public {
                return Err(Failure::ShareMismatch { device: self.roster.device(j).clone() });
            }
            for &i in self.masked.keys().filter(|i| self.shares[&j].contains_key(i)) {
                let shared =
                    agree(&secret, &self.adverts[&i].s_public).ok_or(Failure::ShareMismatch { device: self.roster.device(i).clone() })?;
                // Survivor i added sign(i, j)·PRG: subtract it.
                apply_mask(&mut sum, &pairwise_seed(&shared, &self.session, i, j), i > j);
            }
            dropped.push(self.roster.device(j).clone());
        }
        let total_weight = sum.pop().expect("the weight coordinate");
        Ok(Aggregate {
            round: self.roster.round,
            sums: sum.into_iter().map(|x| x as i64).collect(),
            total_weight,
            frac_bits: self.roster.params.frac_bits,
            survivors: self.masked.keys().map(|&j| self.roster.device(j).clone()).collect(),
            dropped,
        })
    }
}

/// Whether an X25519 public key is one of the low-order points (an agreement with it is all zeros).
fn is_low_order(k: &[u8; 32]) -> bool {
    let probe = StaticSecret::from([7u8; 32]);
    !probe.diffie_hellman(&PublicKey::from(*k)).was_contributory()
}
