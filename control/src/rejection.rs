//! The aggregator's signed answer to a refused MQTT upload, on `devices/<id>/rejections`.
//!
//! Over QUIC a refused upload is answered on the same stream with a `Rejection`; over MQTT there
//! is no stream, so the aggregator publishes a [`SignedRejection`] to the device instead, signed
//! with its receipt key (the key devices pin for announcements and receipts). It names the update
//! it refuses by (device, round, nonce, payload digest), so a device matches it to its pending
//! upload exactly as it matches a receipt, and hands the reason to its lifecycle like a QUIC
//! refusal.
//!
//! Only uploads whose signed header and payload digest verified are answered: the refusal is
//! then about the update the device signed (stale round, shape, NaN, ...), never about bytes a
//! broker may have damaged or forged in transit (those are dropped and the device re-sends).
//!
//! Signed bytes are written by hand and verified as received:
//!
//! ```text
//! message   = "fedfleet/mqtt-rejection/v1" 0x00 body      (what the signature covers)
//! body      = str fleet | str device | u64 round | nonce[16] | digest[32]
//!             | str reason (RejectReason::as_str) | str detail | u64 rejected_at_unix_ms
//! str       = u16 BE length | UTF-8 bytes;  u64 = 8 bytes BE
//! wire      = 'J' | 1 | u32 BE body length | body | ed25519 signature[64]
//! ```
//!
//! The domain differs from every `fedfleet-protocol` envelope domain (`fedfleet/<kind>/v1`), and
//! the NUL ends it, so a rejection's signature can never be taken for a receipt's or an
//! announcement's.

use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use fedfleet_protocol::{DeviceId, Digest, FleetId, RejectReason, RoundId, UpdateHeader};

/// The signing domain (followed by a NUL byte, then the body).
pub const DOMAIN: &str = "fedfleet/mqtt-rejection/v1";
/// Longest `detail` kept (longer ones are cut at a character boundary).
pub const MAX_DETAIL_BYTES: usize = 1024;
const TAG: u8 = b'J';
const VERSION: u8 = 1;
const MAX_BODY_BYTES: usize = 4096;

/// Which update was refused, why, and when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UploadRejection {
    pub fleet: FleetId,
    pub device: DeviceId,
    pub round: RoundId,
    pub nonce: [u8; 16],
    pub payload_digest: Digest,
    pub reason: RejectReason,
    pub detail: String,
    pub rejected_at_unix_ms: u64,
}

impl UploadRejection {
    /// The refusal of the update `header` names.
    pub fn of(header: &UpdateHeader, reason: RejectReason, detail: impl Into<String>, now_ms: u64) -> Self {
        let mut detail = detail.into();
        if detail.len() > MAX_DETAIL_BYTES {
            let mut end = MAX_DETAIL_BYTES;
            while !detail.is_char_boundary(end) {
                end -= 1;
            }
            detail.truncate(end);
        }
        UploadRejection {
            fleet: header.fleet.clone(),
            device: header.device.clone(),
            round: header.round,
            nonce: header.nonce,
            payload_digest: header.payload_digest,
            reason,
            detail,
            rejected_at_unix_ms: now_ms,
        }
    }

    /// Whether this refuses the update `header` names.
    pub fn refuses(&self, header: &UpdateHeader) -> bool {
        self.device == header.device
            && self.fleet == header.fleet
            && self.round == header.round
            && self.nonce == header.nonce
            && self.payload_digest == header.payload_digest
    }

    fn canonical_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(128 + self.detail.len());
        put_str(&mut b, self.fleet.as_str());
        put_str(&mut b, self.device.as_str());
        b.extend_from_slice(&self.round.0.to_be_bytes());
        b.extend_from_slice(&self.nonce);
        b.extend_from_slice(&self.payload_digest.0);
        put_str(&mut b, self.reason.as_str());
        put_str(&mut b, &self.detail);
        b.extend_from_slice(&self.rejected_at_unix_ms.to_be_bytes());
        b
    }

    fn from_canonical_bytes(bytes: &[u8]) -> Result<Self, SealError> {
        let mut r = Reader(bytes);
        let fleet = FleetId::new(r.str()?).map_err(|e| SealError::Malformed(format!("fleet: {e}")))?;
        let device = DeviceId::new(r.str()?).map_err(|e| SealError::Malformed(format!("device: {e}")))?;
        let round = RoundId(r.u64()?);
        let nonce: [u8; 16] = r.array()?;
        let payload_digest = Digest(r.array()?);
        let name = r.str()?;
        let reason = RejectReason::ALL
            .iter()
            .copied()
            .find(|x| x.as_str() == name)
            .ok_or_else(|| SealError::Malformed(format!("unknown reason {name:?}")))?;
        let detail = r.str()?.to_owned();
        if detail.len() > MAX_DETAIL_BYTES {
            return Err(SealError::Malformed("detail too long".into()));
        }
        let rejected_at_unix_ms = r.u64()?;
        if !r.0.is_empty() {
            return Err(SealError::Malformed("trailing bytes".into()));
        }
        Ok(UploadRejection { fleet, device, round, nonce, payload_digest, reason, detail, rejected_at_unix_ms })
    }
}

/// Why a message a service signed for one device (a rejection, an answer) was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SealError {
    #[error("malformed {0}")]
    Malformed(String),
    #[error("signature does not verify")]
    BadSignature,
}

impl SealError {
    pub fn reason(&self) -> RejectReason {
        match self {
            SealError::Malformed(_) => RejectReason::Malformed,
            SealError::BadSignature => RejectReason::BadSignature,
        }
    }
}

/// An [`UploadRejection`] with the aggregator's signature over its bytes as received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedRejection {
    body: UploadRejection,
    body_bytes: Vec<u8>,
    signature: Signature,
}

/// What a sealed message's signature covers: its domain, a NUL, its body.
fn message(domain: &str, body: &[u8]) -> Vec<u8> {
    let mut m = Vec::with_capacity(domain.len() + 1 + body.len());
    m.extend_from_slice(domain.as_bytes());
    m.push(0);
    m.extend_from_slice(body);
    m
}

/// `body` signed by `key` in `domain`.
pub(crate) fn seal(domain: &str, body: &[u8], key: &SigningKey) -> Signature {
    key.sign(&message(domain, body))
}

/// Strict ed25519 verification of a sealed body against a pinned key.
pub(crate) fn verify_seal(domain: &str, body: &[u8], signature: &Signature, key: &VerifyingKey) -> Result<(), SealError> {
    if key.is_weak() {
        return Err(SealError::BadSignature);
    }
    key.verify_strict(&message(domain, body), signature).map_err(|_| SealError::BadSignature)
}

/// The wire form of a sealed body: `tag | 1 | u32 BE body length | body | signature[64]`.
pub(crate) fn encode_sealed(tag: u8, body: &[u8], signature: &Signature) -> Vec<u8> {
    let mut w = Vec::with_capacity(6 + body.len() + 64);
    w.push(tag);
    w.push(VERSION);
    w.extend_from_slice(&(body.len() as u32).to_be_bytes());
    w.extend_from_slice(body);
    w.extend_from_slice(&signature.to_bytes());
    w
}

/// The body and signature of [`encode_sealed`]'s bytes (`what` names it in errors); a body over
/// `max_body` bytes is refused before anything is copied.
pub(crate) fn decode_sealed<'a>(tag: u8, what: &str, bytes: &'a [u8], max_body: usize) -> Result<(&'a [u8], Signature), SealError> {
    let malformed = |m: &str| SealError::Malformed(format!("{what}: {m}"));
    let [t, version, rest @ ..] = bytes else {
        return Err(malformed("truncated"));
    };
    if *t != tag || *version != VERSION {
        return Err(malformed("not version 1"));
    }
    let (len, rest) = rest.split_at_checked(4).ok_or_else(|| malformed("truncated"))?;
    let len = u32::from_be_bytes(len.try_into().expect("4 bytes")) as usize;
    if len > max_body || rest.len() != len + 64 {
        return Err(malformed("body length does not match"));
    }
    let (body, sig) = rest.split_at(len);
    Ok((body, Signature::from_bytes(sig.try_into().expect("64 bytes"))))
}

impl SignedRejection {
    pub fn sign(body: UploadRejection, key: &SigningKey) -> Self {
        let body_bytes = body.canonical_bytes();
        let signature = seal(DOMAIN, &body_bytes, key);
        SignedRejection { body, body_bytes, signature }
    }

    /// The body, unverified: call [`SignedRejection::verify`] before trusting it.
    pub fn body(&self) -> &UploadRejection {
        &self.body
    }

    /// Strict ed25519 verification against the pinned aggregator key.
    pub fn verify(&self, key: &VerifyingKey) -> Result<&UploadRejection, SealError> {
        verify_seal(DOMAIN, &self.body_bytes, &self.signature, key)?;
        Ok(&self.body)
    }

    pub fn encode(&self) -> Vec<u8> {
        encode_sealed(TAG, &self.body_bytes, &self.signature)
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, SealError> {
        let (body_bytes, signature) = decode_sealed(TAG, "rejection", bytes, MAX_BODY_BYTES)?;
        let body = UploadRejection::from_canonical_bytes(body_bytes)?;
        Ok(SignedRejection { body, body_bytes: body_bytes.to_vec(), signature })
    }
}

pub(crate) fn put_str(b: &mut Vec<u8>, s: &str) {
    // Every string here is bounded (ids ≤ 64, reason names, detail ≤ MAX_DETAIL_BYTES).
    b.extend_from_slice(&(s.len() as u16).to_be_bytes());
    b.extend_from_slice(s.as_bytes());
}

pub(crate) struct Reader<'a>(pub(crate) &'a [u8]);

impl<'a> Reader<'a> {
    pub(crate) fn take(&mut self, n: usize) -> Result<&'a [u8], SealError> {
        let (head, tail) = self.0.split_at_checked(n).ok_or_else(|| SealError::Malformed("truncated".into()))?;
        self.0 = tail;
        Ok(head)
    }
    pub(crate) fn array<const N: usize>(&mut self) -> Result<[u8; N], SealError> {
        Ok(self.take(N)?.try_into().expect("N bytes"))
    }
    pub(crate) fn u64(&mut self) -> Result<u64, SealError> {
        Ok(u64::from_be_bytes(self.array()?))
    }
    pub(crate) fn str(&mut self) -> Result<&'a str, SealError> {
        let len = u16::from_be_bytes(self.array()?) as usize;
        std::str::from_utf8(self.take(len)?).map_err(|_| SealError::Malformed("not UTF-8".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> UploadRejection {
        UploadRejection {
            fleet: FleetId::new("demo").unwrap(),
            device: DeviceId::new("cam-1").unwrap(),
            round: RoundId(7),
            nonce: [3; 16],
            payload_digest: Digest::of(b"payload"),
            reason: RejectReason::ShapeMismatch,
            detail: "tensor fc1.weight: [64, 64], expected [64, 32]".into(),
            rejected_at_unix_ms: 1_700_000_000_000,
        }
    }

    #[test]
    fn round_trips_and_verifies_against_the_signing_key_only() {
        let key = SigningKey::from_bytes(&[9; 32]);
        let signed = SignedRejection::sign(sample(), &key);
        let wire = signed.encode();
        let back = SignedRejection::decode(&wire).unwrap();
        assert_eq!(back.verify(&key.verifying_key()).unwrap(), &sample());
        let other = SigningKey::from_bytes(&[10; 32]).verifying_key();
        assert_eq!(back.verify(&other), Err(SealError::BadSignature));
    }

    #[test]
    fn tampering_and_truncation_are_refused() {
        let key = SigningKey::from_bytes(&[9; 32]);
        let wire = SignedRejection::sign(sample(), &key).encode();
        // A flipped bit anywhere in the body or signature: malformed or bad signature, never Ok.
        for i in 0..wire.len() {
            let mut w = wire.clone();
            w[i] ^= 0x01;
            if let Ok(s) = SignedRejection::decode(&w) {
                assert!(s.verify(&key.verifying_key()).is_err(), "bit {i} flipped and still verifies");
            }
        }
        for n in 0..wire.len() {
            assert!(SignedRejection::decode(&wire[..n]).is_err());
        }
        let mut longer = wire.clone();
        longer.push(0);
        assert!(SignedRejection::decode(&longer).is_err());
    }

    #[test]
    fn the_signed_message_is_in_its_own_domain() {
        for kind in fedfleet_protocol::envelope::Kind::ALL {
            assert_ne!(kind.domain(), DOMAIN);
        }
        let body = sample().canonical_bytes();
        assert!(message(DOMAIN, &body).starts_with(b"fedfleet/mqtt-rejection/v1\0"));
    }
}
