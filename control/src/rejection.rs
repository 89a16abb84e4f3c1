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

use fedfleet_protocol::{DeviceId, Digest, FleetId, RejectReason, RoundId, UpdateHeader};

use crate::sealed::{Reader, SealError, Sealed, SealedBody, put_str};

/// The signing domain (followed by a NUL byte, then the body).
pub const DOMAIN: &str = "fedfleet/mqtt-rejection/v1";
/// Longest `detail` kept (longer ones are cut at a character boundary).
pub const MAX_DETAIL_BYTES: usize = 1024;
const TAG: u8 = b'J';
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
}

impl SealedBody for UploadRejection {
    const DOMAIN: &'static str = DOMAIN;
    const TAG: u8 = TAG;
    const NAME: &'static str = "rejection";
    const MAX_BODY_BYTES: usize = MAX_BODY_BYTES;

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
    fn fleet(&self) -> &FleetId {
        &self.fleet
    }
    fn device(&self) -> &DeviceId {
        &self.device
    }
}

/// An [`UploadRejection`] with the aggregator's signature over its bytes as received.
pub type SignedRejection = Sealed<UploadRejection>;

#[cfg(test)]
mod tests {
    use ed25519_dalek::SigningKey;

    use super::*;
    use crate::sealed::message;

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
