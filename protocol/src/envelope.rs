//! Signed envelopes.
//!
//! Everything that must survive an untrusted hop (an MQTT broker, a relay) is signed with ed25519
//! over a domain-separated message:
//!
//! ```text
//! "fedfleet/<kind>/v1" || 0x00 || canonical body bytes
//! ```
//!
//! The domain tag keeps a signature made for one kind of message from verifying as another. For
//! [`UpdateHeader`], [`RelayHeader`] and [`Receipt`](crate::messages::Receipt) the canonical bytes
//! are written by hand (fixed field order, big-endian integers, `u16`-length-prefixed strings), so
//! they do not depend on any serde or crate version; the golden-bytes test pins them. Control
//! messages (round announcements, rollout notices, device status) sign their postcard bytes.
//! Either way a [`Signed`] keeps the body bytes exactly as received and verifies over those, so a
//! verifier never re-encodes.
//!
//! Encoded envelope: `kind code u8 || body length u32 BE || body || signature [64]`.

use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};

use crate::bundle::DType;
use crate::ids::{DeviceId, Digest, FleetId, Hasher, IdError, RoundId};
use crate::limits::{MAX_CANONICAL_HEADER_BYTES, MAX_SIGNED_BODY_BYTES};
use crate::reject::RejectReason;

/// Bytes of an ed25519 signature.
pub const SIGNATURE_LEN: usize = 64;

const ENVELOPE_PREFIX_LEN: usize = 1 + 4;

/// What a signature is for; each kind has its own signing domain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Kind {
    /// A device's weight update header.
    Update,
    /// The aggregator's receipt for an accepted update.
    Receipt,
    /// A round announcement.
    Round,
    /// A rollout notice.
    Rollout,
    /// A device status report.
    Status,
    /// A relay aggregator's partial sum header.
    Relay,
    /// A model manifest.
    Manifest,
    /// A device's secure-aggregation message (keys, encrypted shares, masked input, unmasking).
    SecAgg,
}

impl Kind {
    pub const ALL: [Kind; 8] =
        [Kind::Update, Kind::Receipt, Kind::Round, Kind::Rollout, Kind::Status, Kind::Relay, Kind::Manifest, Kind::SecAgg];

    /// The signing domain, e.g. `"fedfleet/update/v1"`.
    pub const fn domain(self) -> &'static str {
        match self {
            Kind::Update => "fedfleet/update/v1",
            Kind::Receipt => "fedfleet/receipt/v1",
            Kind::Round => "fedfleet/round/v1",
            Kind::Rollout => "fedfleet/rollout/v1",
            Kind::Status => "fedfleet/status/v1",
            Kind::Relay => "fedfleet/relay/v1",
            Kind::Manifest => "fedfleet/manifest/v1",
            Kind::SecAgg => "fedfleet/secagg/v1",
        }
    }

    /// Stable one-byte code at the start of an encoded envelope. Never reuse a code.
    pub const fn code(self) -> u8 {
        match self {
            Kind::Update => 1,
            Kind::Receipt => 2,
            Kind::Round => 3,
            Kind::Rollout => 4,
            Kind::Status => 5,
            Kind::Relay => 6,
            Kind::Manifest => 7,
            Kind::SecAgg => 8,
        }
    }

    pub fn from_code(code: u8) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.code() == code)
    }

    /// The largest canonical body this kind may carry.
    pub const fn max_body_len(self) -> usize {
        match self {
            Kind::Update | Kind::Receipt | Kind::Relay => MAX_CANONICAL_HEADER_BYTES,
            Kind::Round | Kind::Rollout | Kind::Status | Kind::Manifest | Kind::SecAgg => MAX_SIGNED_BODY_BYTES,
        }
    }
}

/// The exact bytes an ed25519 key signs for `kind`.
pub fn signing_message(kind: Kind, canonical: &[u8]) -> Vec<u8> {
    let domain = kind.domain().as_bytes();
    let mut message = Vec::with_capacity(domain.len() + 1 + canonical.len());
    message.extend_from_slice(domain);
    message.push(0);
    message.extend_from_slice(canonical);
    message
}

/// Why an envelope or a payload was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EnvelopeError {
    #[error("envelope is truncated")]
    Truncated,
    #[error("{0} unexpected bytes after the envelope")]
    TrailingBytes(usize),
    #[error("{what} is {len} bytes; the limit is {max}")]
    TooLarge { what: &'static str, len: u64, max: u64 },
    #[error("expected a {expected:?} envelope, found kind code {found}")]
    WrongKind { expected: Kind, found: u8 },
    #[error("bad id in envelope: {0}")]
    BadId(IdError),
    #[error("unknown payload dtype code {0}")]
    UnknownDtype(u8),
    #[error("malformed body: {0}")]
    BadBody(String),
    #[error("weak (small-order) public key")]
    WeakKey,
    #[error("signature does not verify")]
    BadSignature,
    #[error("payload is {actual} bytes; the header signs {signed}")]
    LengthMismatch { signed: u64, actual: u64 },
    #[error("payload digest {actual} differs from the signed {signed}")]
    DigestMismatch { signed: Digest, actual: Digest },
}

// Printed in the message, so not also a `source`: a report of the chain would say it twice.
impl From<IdError> for EnvelopeError {
    fn from(e: IdError) -> Self {
        EnvelopeError::BadId(e)
    }
}

impl EnvelopeError {
    /// The named rejection reason this error is reported under.
    pub fn reason(&self) -> RejectReason {
        match self {
            EnvelopeError::Truncated
            | EnvelopeError::TrailingBytes(_)
            | EnvelopeError::WrongKind { .. }
            | EnvelopeError::BadId(_)
            | EnvelopeError::BadBody(_) => RejectReason::Malformed,
            EnvelopeError::UnknownDtype(_) => RejectReason::WrongDtype,
            EnvelopeError::TooLarge { .. } => RejectReason::TooLarge,
            EnvelopeError::WeakKey => RejectReason::WeakKey,
            EnvelopeError::BadSignature => RejectReason::BadSignature,
            EnvelopeError::LengthMismatch { .. } => RejectReason::LengthMismatch,
            EnvelopeError::DigestMismatch { .. } => RejectReason::DigestMismatch,
        }
    }
}

/// A body that can be signed: it has a kind and canonical bytes that parse back to it.
pub trait Signable: Sized {
    const KIND: Kind;
    fn canonical_bytes(&self) -> Vec<u8>;
    /// Parses canonical bytes; must refuse trailing bytes.
    fn from_canonical_bytes(bytes: &[u8]) -> Result<Self, EnvelopeError>;
}

/// A body with its signature. The body bytes are kept as signed, so verification never depends
/// on re-encoding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Signed<T> {
    body: T,
    body_bytes: Vec<u8>,
    signature: Signature,
}

/// A device's signed update header.
pub type SignedUpdate = Signed<UpdateHeader>;
/// A relay's signed partial-sum header.
pub type SignedRelay = Signed<RelayHeader>;

impl<T: Signable> Signed<T> {
    pub fn sign(body: T, key: &SigningKey) -> Self {
        let body_bytes = body.canonical_bytes();
        let signature = key.sign(&signing_message(T::KIND, &body_bytes));
        Signed { body, body_bytes, signature }
    }

    /// The body, unverified. Prefer [`Signed::verify`].
    pub fn body(&self) -> &T {
        &self.body
    }

    pub fn into_body(self) -> T {
        self.body
    }

    pub fn body_bytes(&self) -> &[u8] {
        &self.body_bytes
    }

    pub fn signature(&self) -> &Signature {
        &self.signature
    }

    /// The message the signature covers.
    pub fn signing_message(&self) -> Vec<u8> {
        signing_message(T::KIND, &self.body_bytes)
    }

    /// Strict ed25519 verification (refuses weak keys and non-canonical signatures).
    pub fn verify(&self, key: &VerifyingKey) -> Result<&T, EnvelopeError> {
        if key.is_weak() {
            return Err(EnvelopeError::WeakKey);
        }
        key.verify_strict(&self.signing_message(), &self.signature).map_err(|_| EnvelopeError::BadSignature)?;
        Ok(&self.body)
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(ENVELOPE_PREFIX_LEN + self.body_bytes.len() + SIGNATURE_LEN);
        out.push(T::KIND.code());
        // body_bytes is at most max_body_len (checked on decode, small by construction on sign).
        out.extend_from_slice(&(self.body_bytes.len() as u32).to_be_bytes());
        out.extend_from_slice(&self.body_bytes);
        out.extend_from_slice(&self.signature.to_bytes());
        out
    }

    /// Parses an envelope of kind `T::KIND`. Does not verify the signature.
    pub fn decode(bytes: &[u8]) -> Result<Self, EnvelopeError> {
        let Some((&code, rest)) = bytes.split_first() else {
            return Err(EnvelopeError::Truncated);
        };
        if code != T::KIND.code() {
            return Err(EnvelopeError::WrongKind { expected: T::KIND, found: code });
        }
        let Some((len, rest)) = rest.split_first_chunk::<4>() else {
            return Err(EnvelopeError::Truncated);
        };
        let body_len = u32::from_be_bytes(*len) as usize;
        let max = T::KIND.max_body_len();
        if body_len > max {
            return Err(EnvelopeError::TooLarge { what: "envelope body", len: body_len as u64, max: max as u64 });
        }
        let needed = body_len + SIGNATURE_LEN;
        if rest.len() < needed {
            return Err(EnvelopeError::Truncated);
        }
        if rest.len() > needed {
            return Err(EnvelopeError::TrailingBytes(rest.len() - needed));
        }
        let (body_bytes, signature) = rest.split_at(body_len);
        let signature: &[u8; SIGNATURE_LEN] = signature.try_into().map_err(|_| EnvelopeError::Truncated)?;
        let body = T::from_canonical_bytes(body_bytes)?;
        Ok(Signed { body, body_bytes: body_bytes.to_vec(), signature: Signature::from_bytes(signature) })
    }
}

/// Verifies many envelopes at once, returning one result per item in order.
///
/// Weak keys are refused first; the rest go through ed25519 batch verification (about 2-3x
/// faster per signature than one by one; a lone item is verified strictly on its own). A batch
/// that fails is split in halves and each half tried again, down to a few items verified
/// strictly one by one: a bad signature costs a few batches more, not one verification per
/// item of the batch. Batch verification does not refuse small-order `R` components the way
/// `verify_strict` does; only the key holder can produce those, so they forge nothing.
pub fn verify_batch<T: Signable>(items: &[(&Signed<T>, &VerifyingKey)]) -> Vec<Result<(), EnvelopeError>> {
    let mut results: Vec<Result<(), EnvelopeError>> =
        items.iter().map(|(_, key)| if key.is_weak() { Err(EnvelopeError::WeakKey) } else { Ok(()) }).collect();
    let candidates: Vec<usize> = (0..items.len()).filter(|&i| results[i].is_ok()).collect();
    let messages: Vec<Vec<u8>> = items.iter().map(|(signed, _)| signed.signing_message()).collect();
    verify_batch_into(items, &messages, &candidates, &mut results);
    results
}

/// Batches of at most this many are verified one by one after a failed batch.
const BATCH_SPLIT_FLOOR: usize = 4;

fn verify_batch_into<T: Signable>(
    items: &[(&Signed<T>, &VerifyingKey)],
    messages: &[Vec<u8>],
    candidates: &[usize],
    results: &mut [Result<(), EnvelopeError>],
) {
    let one_by_one = |results: &mut [Result<(), EnvelopeError>]| {
        for &i in candidates {
            let (signed, key) = items[i];
            results[i] = key.verify_strict(&messages[i], &signed.signature).map_err(|_| EnvelopeError::BadSignature);
        }
    };
    if candidates.len() <= 1 {
        return one_by_one(results);
    }
    let message_refs: Vec<&[u8]> = candidates.iter().map(|&i| messages[i].as_slice()).collect();
    let signatures: Vec<Signature> = candidates.iter().map(|&i| items[i].0.signature).collect();
    let keys: Vec<VerifyingKey> = candidates.iter().map(|&i| *items[i].1).collect();
    if ed25519_dalek::verify_batch(&message_refs, &signatures, &keys).is_ok() {
        return;
    }
    if candidates.len() <= BATCH_SPLIT_FLOOR {
        return one_by_one(results);
    }
    let (left, right) = candidates.split_at(candidates.len() / 2);
    verify_batch_into(items, messages, left, results);
    verify_batch_into(items, messages, right, results);
}

/// A fresh nonce for an update or relay header; the caller supplies the RNG (no I/O here).
pub fn random_nonce(rng: &mut impl rand_core::CryptoRngCore) -> [u8; 16] {
    let mut nonce = [0u8; 16];
    rng.fill_bytes(&mut nonce);
    nonce
}

/// Header of one device's weight update, signed with the device key. The payload itself (a
/// [`TensorBundle`](crate::bundle::TensorBundle) encoding) travels separately and is bound by
/// length and digest.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct UpdateHeader {
    pub device: DeviceId,
    pub fleet: FleetId,
    pub round: RoundId,
    /// Digest of the model the update was trained from.
    pub base_model: Digest,
    /// Random per upload; (device, round, nonce) is unique.
    pub nonce: [u8; 16],
    /// Local training samples: the update's FedAvg weight.
    pub sample_count: u64,
    pub payload_len: u64,
    pub payload_digest: Digest,
    pub payload_dtype: DType,
}

impl Signable for UpdateHeader {
    const KIND: Kind = Kind::Update;

    fn canonical_bytes(&self) -> Vec<u8> {
        let mut w = CanonicalWriter::default();
        w.upload_start(self.device.as_str(), &self.fleet, self.round, &self.base_model, &self.nonce);
        w.u64(self.sample_count);
        w.payload(self.payload_len, &self.payload_digest, self.payload_dtype);
        w.finish()
    }

    fn from_canonical_bytes(bytes: &[u8]) -> Result<Self, EnvelopeError> {
        let mut r = CanonicalReader::new(bytes);
        let (device, fleet, round, base_model, nonce) = r.upload_start()?;
        let sample_count = r.u64()?;
        let (payload_len, payload_digest, payload_dtype) = r.payload()?;
        r.finish()?;
        Ok(UpdateHeader { device, fleet, round, base_model, nonce, sample_count, payload_len, payload_digest, payload_dtype })
    }
}

/// Header of a relay aggregator's partial sum (Σ wᵢΔᵢ over `update_count` updates with
/// Σ wᵢ = `total_samples`), signed with the relay's key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RelayHeader {
    pub relay: DeviceId,
    pub fleet: FleetId,
    pub round: RoundId,
    pub base_model: Digest,
    pub nonce: [u8; 16],
    pub update_count: u64,
    pub total_samples: u64,
    pub payload_len: u64,
    pub payload_digest: Digest,
    pub payload_dtype: DType,
}

impl Signable for RelayHeader {
    const KIND: Kind = Kind::Relay;

    fn canonical_bytes(&self) -> Vec<u8> {
        let mut w = CanonicalWriter::default();
        w.upload_start(self.relay.as_str(), &self.fleet, self.round, &self.base_model, &self.nonce);
        w.u64(self.update_count);
        w.u64(self.total_samples);
        w.payload(self.payload_len, &self.payload_digest, self.payload_dtype);
        w.finish()
    }

    fn from_canonical_bytes(bytes: &[u8]) -> Result<Self, EnvelopeError> {
        let mut r = CanonicalReader::new(bytes);
        let (relay, fleet, round, base_model, nonce) = r.upload_start()?;
        let (update_count, total_samples) = (r.u64()?, r.u64()?);
        let (payload_len, payload_digest, payload_dtype) = r.payload()?;
        r.finish()?;
        Ok(RelayHeader { relay, fleet, round, base_model, nonce, update_count, total_samples, payload_len, payload_digest, payload_dtype })
    }
}

/// A header that binds a payload by length and digest.
pub trait PayloadBinding {
    fn payload_len(&self) -> u64;
    fn payload_digest(&self) -> Digest;
}

impl PayloadBinding for UpdateHeader {
    fn payload_len(&self) -> u64 {
        self.payload_len
    }
    fn payload_digest(&self) -> Digest {
        self.payload_digest
    }
}

impl PayloadBinding for RelayHeader {
    fn payload_len(&self) -> u64 {
        self.payload_len
    }
    fn payload_digest(&self) -> Digest {
        self.payload_digest
    }
}

/// Checks a whole payload against the length and digest its header signs.
pub fn verify_payload(header: &impl PayloadBinding, payload: &[u8]) -> Result<(), EnvelopeError> {
    let mut check = PayloadCheck::new(header);
    check.update(payload)?;
    check.finish()
}

/// Checks a payload that arrives in chunks: refuses the first byte past the signed length, and
/// compares the digest at the end.
#[derive(Clone)]
pub struct PayloadCheck {
    signed_len: u64,
    signed_digest: Digest,
    received: u64,
    hasher: Hasher,
}

impl PayloadCheck {
    pub fn new(header: &impl PayloadBinding) -> Self {
        PayloadCheck { signed_len: header.payload_len(), signed_digest: header.payload_digest(), received: 0, hasher: Hasher::new() }
    }

    pub fn update(&mut self, chunk: &[u8]) -> Result<(), EnvelopeError> {
        let received = self.received.saturating_add(chunk.len() as u64);
        if received > self.signed_len {
            return Err(EnvelopeError::LengthMismatch { signed: self.signed_len, actual: received });
        }
        self.received = received;
        self.hasher.update(chunk);
        Ok(())
    }

    /// Bytes accepted so far.
    pub fn received(&self) -> u64 {
        self.received
    }

    pub fn finish(self) -> Result<(), EnvelopeError> {
        if self.received != self.signed_len {
            return Err(EnvelopeError::LengthMismatch { signed: self.signed_len, actual: self.received });
        }
        let actual = self.hasher.finalize();
        if actual != self.signed_digest {
            return Err(EnvelopeError::DigestMismatch { signed: self.signed_digest, actual });
        }
        Ok(())
    }
}

/// Writes canonical bytes: big-endian integers, `u16`-length-prefixed UTF-8 strings, raw fixed
/// arrays.
#[derive(Default)]
pub(crate) struct CanonicalWriter(Vec<u8>);

impl CanonicalWriter {
    pub(crate) fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    pub(crate) fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_be_bytes());
    }
    pub(crate) fn bytes(&mut self, v: &[u8]) {
        self.0.extend_from_slice(v);
    }
    /// Strings here are ids, at most 64 bytes; longer ones are a programming error.
    pub(crate) fn str(&mut self, s: &str) {
        let len = u16::try_from(s.len()).expect("canonical strings are short ids");
        self.0.extend_from_slice(&len.to_be_bytes());
        self.0.extend_from_slice(s.as_bytes());
    }
    /// What every upload header (a device's update, a relay's partial sum) starts with: sender,
    /// fleet, round, base model, nonce.
    fn upload_start(&mut self, sender: &str, fleet: &FleetId, round: RoundId, base_model: &Digest, nonce: &[u8; 16]) {
        self.str(sender);
        self.str(fleet.as_str());
        self.u64(round.0);
        self.bytes(&base_model.0);
        self.bytes(nonce);
    }
    /// What every upload header ends with: the payload's length, digest and encoding.
    fn payload(&mut self, len: u64, digest: &Digest, dtype: DType) {
        self.u64(len);
        self.bytes(&digest.0);
        self.u8(dtype.code());
    }
    pub(crate) fn finish(self) -> Vec<u8> {
        self.0
    }
}

/// Reads what [`CanonicalWriter`] writes, refusing short input and trailing bytes.
pub(crate) struct CanonicalReader<'a>(&'a [u8]);

impl<'a> CanonicalReader<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        CanonicalReader(bytes)
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], EnvelopeError> {
        if self.0.len() < n {
            return Err(EnvelopeError::Truncated);
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    pub(crate) fn array<const N: usize>(&mut self) -> Result<[u8; N], EnvelopeError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }
    pub(crate) fn u64(&mut self) -> Result<u64, EnvelopeError> {
        Ok(u64::from_be_bytes(self.array()?))
    }
    pub(crate) fn digest(&mut self) -> Result<Digest, EnvelopeError> {
        Ok(Digest(self.array()?))
    }
    pub(crate) fn dtype(&mut self) -> Result<DType, EnvelopeError> {
        let [code] = self.array()?;
        DType::from_code(code).ok_or(EnvelopeError::UnknownDtype(code))
    }
    pub(crate) fn str(&mut self) -> Result<&'a str, EnvelopeError> {
        let len = u16::from_be_bytes(self.array()?) as usize;
        std::str::from_utf8(self.take(len)?).map_err(|_| EnvelopeError::BadBody("string is not UTF-8".into()))
    }
    /// Reads what [`CanonicalWriter::upload_start`] writes.
    fn upload_start(&mut self) -> Result<(DeviceId, FleetId, RoundId, Digest, [u8; 16]), EnvelopeError> {
        Ok((DeviceId::new(self.str()?)?, FleetId::new(self.str()?)?, RoundId(self.u64()?), self.digest()?, self.array()?))
    }
    /// Reads what [`CanonicalWriter::payload`] writes.
    fn payload(&mut self) -> Result<(u64, Digest, DType), EnvelopeError> {
        Ok((self.u64()?, self.digest()?, self.dtype()?))
    }
    pub(crate) fn finish(self) -> Result<(), EnvelopeError> {
        match self.0.len() {
            0 => Ok(()),
            n => Err(EnvelopeError::TrailingBytes(n)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn key(seed: u8) -> SigningKey {
        SigningKey::from_bytes(&[seed; 32])
    }

    fn header(payload: &[u8]) -> UpdateHeader {
        UpdateHeader {
            device: DeviceId::new("cam-1").unwrap(),
            fleet: FleetId::new("eu").unwrap(),
            round: RoundId(7),
            base_model: Digest([0xAB; 32]),
            nonce: [0x11; 16],
            sample_count: 600,
            payload_len: payload.len() as u64,
            payload_digest: Digest::of(payload),
            payload_dtype: DType::I8,
        }
    }

    #[test]
    fn canonical_header_golden_bytes() {
        let h = UpdateHeader { payload_len: 1024, payload_digest: Digest([0xCD; 32]), ..header(b"") };
        let expected = concat!(
            "0005",
            "63616d2d31", // device "cam-1"
            "0002",
            "6575",                                                             // fleet "eu"
            "0000000000000007",                                                 // round
            "abababababababababababababababababababababababababababababababab", // base model
            "11111111111111111111111111111111",                                 // nonce
            "0000000000000258",                                                 // sample count 600
            "0000000000000400",                                                 // payload length 1024
            "cdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcd", // payload digest
            "04",                                                               // dtype i8
        );
        assert_eq!(hex::encode(h.canonical_bytes()), expected);
        let message = signing_message(Kind::Update, &h.canonical_bytes());
        assert!(message.starts_with(b"fedfleet/update/v1\0"));
        assert_eq!(UpdateHeader::from_canonical_bytes(&h.canonical_bytes()).unwrap(), h);

        // ed25519 signatures are deterministic: pin the whole envelope too.
        let signed = Signed::sign(h, &key(7));
        assert_eq!(hex::encode(&signed.encode()[..5]), "0100000074");
        // Cross-checked with Python's `cryptography` Ed25519 over b"fedfleet/update/v1\0" + canonical.
        assert_eq!(hex::encode(signed.signature().to_bytes()), GOLDEN_SIGNATURE);
        assert_eq!(signed.encode()[5..121], signed.body_bytes()[..]);
    }

    const GOLDEN_SIGNATURE: &str =
        "22bb5127ea0193d7b6a19c4ffddcece0a56f6771545dfeb37357d305c0cad00ad5623a18b3ba2aa752b775a926e1ccf822fddcb3c6e8e9cc919272889d405e05";

    #[test]
    fn nonces_differ() {
        let mut rng = rand_core::OsRng;
        assert_ne!(random_nonce(&mut rng), random_nonce(&mut rng));
    }

    #[test]
    fn sign_verify_and_round_trip() {
        let payload = b"tensor bytes".to_vec();
        let signed = Signed::sign(header(&payload), &key(1));
        let decoded = SignedUpdate::decode(&signed.encode()).unwrap();
        assert_eq!(decoded, signed);
        assert_eq!(decoded.verify(&key(1).verifying_key()).unwrap(), signed.body());
        assert_eq!(decoded.verify(&key(2).verifying_key()), Err(EnvelopeError::BadSignature));
        verify_payload(decoded.body(), &payload).unwrap();
    }

    #[test]
    fn every_flipped_bit_is_rejected_with_its_reason() {
        let payload = b"some payload bytes".to_vec();
        let verifying = key(3).verifying_key();
        let bytes = Signed::sign(header(&payload), &key(3)).encode();
        let signature_start = bytes.len() - SIGNATURE_LEN;
        for bit in 0..bytes.len() * 8 {
            let mut flipped = bytes.clone();
            flipped[bit / 8] ^= 1 << (bit % 8);
            let reason = match SignedUpdate::decode(&flipped) {
                Ok(signed) => signed.verify(&verifying).map(|_| ()).unwrap_err().reason(),
                Err(e) => e.reason(),
            };
            if bit / 8 >= signature_start {
                assert_eq!(reason, RejectReason::BadSignature, "signature bit {bit}");
            } else {
                assert!(
                    matches!(
                        reason,
                        RejectReason::BadSignature | RejectReason::Malformed | RejectReason::WrongDtype | RejectReason::TooLarge
                    ),
                    "header bit {bit}: {reason}"
                );
            }
        }
        let h = header(&payload);
        for bit in 0..payload.len() * 8 {
            let mut flipped = payload.clone();
            flipped[bit / 8] ^= 1 << (bit % 8);
            assert_eq!(verify_payload(&h, &flipped).unwrap_err().reason(), RejectReason::DigestMismatch);
        }
        assert_eq!(verify_payload(&h, &payload[1..]).unwrap_err().reason(), RejectReason::LengthMismatch);
    }

    #[test]
    fn header_field_changes_break_the_signature() {
        let signed = Signed::sign(header(b"x"), &key(4));
        let verifying = key(4).verifying_key();
        let mut tampered = signed.body().clone();
        tampered.sample_count += 1;
        // Re-wrap the tampered body with the old signature.
        let forged = Signed { body_bytes: tampered.canonical_bytes(), body: tampered, signature: signed.signature };
        assert_eq!(forged.verify(&verifying), Err(EnvelopeError::BadSignature));
    }

    #[test]
    fn domains_separate_kinds() {
        let relay = RelayHeader {
            relay: DeviceId::new("relay-eu").unwrap(),
            fleet: FleetId::new("eu").unwrap(),
            round: RoundId(1),
            base_model: Digest([1; 32]),
            nonce: [2; 16],
            update_count: 3,
            total_samples: 90,
            payload_len: 0,
            payload_digest: Digest::of(b""),
            payload_dtype: DType::F32,
        };
        let signed = Signed::sign(relay, &key(5));
        let decoded = SignedRelay::decode(&signed.encode()).unwrap();
        decoded.verify(&key(5).verifying_key()).unwrap();
        assert!(matches!(SignedUpdate::decode(&signed.encode()), Err(EnvelopeError::WrongKind { .. })));
        // The same bytes signed under another domain do not verify.
        let other = key(5).sign(&signing_message(Kind::Update, signed.body_bytes()));
        let swapped = Signed { signature: other, ..decoded };
        assert_eq!(swapped.verify(&key(5).verifying_key()), Err(EnvelopeError::BadSignature));
        let domains: std::collections::BTreeSet<_> = Kind::ALL.iter().map(|k| k.domain()).collect();
        assert_eq!(domains.len(), Kind::ALL.len());
    }

    #[test]
    fn decode_refuses_short_long_and_oversize() {
        let bytes = Signed::sign(header(b""), &key(6)).encode();
        assert_eq!(SignedUpdate::decode(&[]), Err(EnvelopeError::Truncated));
        assert_eq!(SignedUpdate::decode(&bytes[..bytes.len() - 1]), Err(EnvelopeError::Truncated));
        let mut long = bytes.clone();
        long.push(0);
        assert_eq!(SignedUpdate::decode(&long), Err(EnvelopeError::TrailingBytes(1)));
        let mut huge = bytes;
        huge[1..5].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(matches!(SignedUpdate::decode(&huge), Err(EnvelopeError::TooLarge { .. })));
    }

    #[test]
    fn batch_verification_names_the_bad_items() {
        let keys: Vec<SigningKey> = (10..20).map(key).collect();
        let signed: Vec<SignedUpdate> = keys.iter().map(|k| Signed::sign(header(b"p"), k)).collect();
        let verifying: Vec<VerifyingKey> = keys.iter().map(SigningKey::verifying_key).collect();
        let mut items: Vec<(&SignedUpdate, &VerifyingKey)> = signed.iter().zip(&verifying).collect();
        assert!(verify_batch(&items).iter().all(Result::is_ok));

        items[3].1 = &verifying[4];
        // The identity point: a valid encoding, and weak.
        let mut identity = [0u8; 32];
        identity[0] = 1;
        let weak = VerifyingKey::from_bytes(&identity).unwrap();
        assert!(weak.is_weak());
        items[6].1 = &weak;
        let results = verify_batch(&items);
        for (i, r) in results.iter().enumerate() {
            match i {
                3 => assert_eq!(r, &Err(EnvelopeError::BadSignature)),
                6 => assert_eq!(r, &Err(EnvelopeError::WeakKey)),
                _ => assert_eq!(r, &Ok(())),
            }
        }
        assert!(verify_batch::<UpdateHeader>(&[]).is_empty());

        // Bad signatures spread over a batch big enough to be split: each named, the rest pass;
        // and a lone item on its own.
        let keys: Vec<SigningKey> = (20..60).map(key).collect();
        let signed: Vec<SignedUpdate> = keys.iter().map(|k| Signed::sign(header(b"q"), k)).collect();
        let verifying: Vec<VerifyingKey> = keys.iter().map(SigningKey::verifying_key).collect();
        let mut items: Vec<(&SignedUpdate, &VerifyingKey)> = signed.iter().zip(&verifying).collect();
        let bad = [0, 17, 18, 39];
        for &i in &bad {
            items[i].1 = &verifying[(i + 1) % verifying.len()];
        }
        for (i, r) in verify_batch(&items).iter().enumerate() {
            assert_eq!(r.is_err(), bad.contains(&i), "item {i}: {r:?}");
        }
        assert_eq!(verify_batch(&items[..1]), vec![Err(EnvelopeError::BadSignature)]);
        assert_eq!(verify_batch(&items[1..2]), vec![Ok(())]);
    }

    #[test]
    fn streamed_payload_check_stops_at_the_signed_length() {
        let payload = vec![9u8; 100];
        let h = header(&payload);
        let mut check = PayloadCheck::new(&h);
        for chunk in payload.chunks(7) {
            check.update(chunk).unwrap();
        }
        assert_eq!(check.received(), 100);
        check.clone().finish().unwrap();
        assert!(matches!(check.update(&[0]), Err(EnvelopeError::LengthMismatch { .. })));
    }
}
