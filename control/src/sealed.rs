//! Messages a service signs for one device over MQTT, in a signing domain of their own: the
//! aggregator's refusals of uploads ([`crate::rejection`]) and its answers to requests
//! ([`crate::exchange`]). One framing and one verification for both:
//!
//! ```text
//! message   = domain 0x00 body      (what the signature covers)
//! wire      = tag | 1 | u32 BE body length | body | ed25519 signature[64]
//! str       = u16 BE length | UTF-8 bytes;  u64 = 8 bytes BE   (inside bodies)
//! ```
//!
//! Signed bytes are written by hand and verified as received, never re-encoded. Each domain
//! differs from every `fedfleet-protocol` envelope domain (`fedfleet/<kind>/v1`), and the NUL ends
//! it, so one kind's signature can never be taken for another's.

use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use fedfleet_protocol::{DeviceId, FleetId, RejectReason};

const VERSION: u8 = 1;

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

/// The body of a sealed message: its domain, wire tag, name (in errors), size bound, and
/// canonical bytes; the fleet and device it is for.
pub trait SealedBody: Sized {
    /// The signing domain (followed by a NUL byte, then the body).
    const DOMAIN: &'static str;
    const TAG: u8;
    const NAME: &'static str;
    /// A body over this many bytes is refused before anything is copied.
    const MAX_BODY_BYTES: usize;
    fn canonical_bytes(&self) -> Vec<u8>;
    fn from_canonical_bytes(bytes: &[u8]) -> Result<Self, SealError>;
    fn fleet(&self) -> &FleetId;
    fn device(&self) -> &DeviceId;
}

/// A body with the service's signature over its bytes as received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sealed<T> {
    body: T,
    body_bytes: Vec<u8>,
    signature: Signature,
}

/// What a sealed message's signature covers: its domain, a NUL, its body.
pub(crate) fn message(domain: &str, body: &[u8]) -> Vec<u8> {
    let mut m = Vec::with_capacity(domain.len() + 1 + body.len());
    m.extend_from_slice(domain.as_bytes());
    m.push(0);
    m.extend_from_slice(body);
    m
}

impl<T: SealedBody> Sealed<T> {
    pub fn sign(body: T, key: &SigningKey) -> Self {
        let body_bytes = body.canonical_bytes();
        let signature = key.sign(&message(T::DOMAIN, &body_bytes));
        Sealed { body, body_bytes, signature }
    }

    /// The body, unverified: call [`Sealed::verify`] before trusting it.
    pub fn body(&self) -> &T {
        &self.body
    }

    /// Strict ed25519 verification against the pinned service key.
    pub fn verify(&self, key: &VerifyingKey) -> Result<&T, SealError> {
        if key.is_weak() {
            return Err(SealError::BadSignature);
        }
        key.verify_strict(&message(T::DOMAIN, &self.body_bytes), &self.signature).map_err(|_| SealError::BadSignature)?;
        Ok(&self.body)
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut w = Vec::with_capacity(6 + self.body_bytes.len() + 64);
        w.push(T::TAG);
        w.push(VERSION);
        w.extend_from_slice(&(self.body_bytes.len() as u32).to_be_bytes());
        w.extend_from_slice(&self.body_bytes);
        w.extend_from_slice(&self.signature.to_bytes());
        w
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, SealError> {
        let malformed = |m: &str| SealError::Malformed(format!("{}: {m}", T::NAME));
        let [tag, version, rest @ ..] = bytes else {
            return Err(malformed("truncated"));
        };
        if *tag != T::TAG || *version != VERSION {
            return Err(malformed("not version 1"));
        }
        let (len, rest) = rest.split_at_checked(4).ok_or_else(|| malformed("truncated"))?;
        let len = u32::from_be_bytes(len.try_into().expect("4 bytes")) as usize;
        if len > T::MAX_BODY_BYTES || rest.len() != len + 64 {
            return Err(malformed("body length does not match"));
        }
        let (body_bytes, sig) = rest.split_at(len);
        let signature = Signature::from_bytes(sig.try_into().expect("64 bytes"));
        let body = T::from_canonical_bytes(body_bytes)?;
        Ok(Sealed { body, body_bytes: body_bytes.to_vec(), signature })
    }
}

pub(crate) fn put_str(b: &mut Vec<u8>, s: &str) {
    // Every string in a body is bounded (ids ≤ 64, reason names, a rejection's detail ≤ 1 KiB).
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
