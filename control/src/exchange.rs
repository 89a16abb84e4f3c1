//! Requests a device makes of a service over MQTT, and the service's signed answers: what a QUIC
//! stream carries as a request and its response, for devices on the MQTT path. The aggregator
//! serves the secure-aggregation stages this way (its `wire::Request`/`wire::Response`, the same
//! postcard messages as over QUIC), so a device whose uploads go over MQTT aggregates securely
//! over MQTT too.
//!
//! ```text
//! request  on devices/<id>/requests (device -> service), QoS 0, not retained:
//!   'Q' | 1 | id u64 BE | u32 BE message length | message | attachment (the rest)
//! answer   on devices/<id>/answers (service -> device), QoS 0, not retained:
//!   message = "fedfleet/mqtt-answer/v1" 0x00 body      (what the signature covers)
//!   body    = str fleet | str device | id u64 BE | answer bytes (the rest)
//!   wire    = 'A' | 1 | u32 BE body length | body | ed25519 signature[64]
//! ```
//!
//! The id is the device's (random), and its answer names it, so a device matches answers to the
//! request it waits on and drops strays. The message is the service's request encoding; the
//! attachment is bulk bytes a QUIC request streams after it as chunks (a masked vector).
//!
//! **Trust.** Requests are not signed as a whole: the broker's access rules let only the device
//! publish on its own `requests` topic, and what a request carries that matters is signed by the
//! device inside it (a secure-aggregation stage message, which binds its masked vector by
//! digest). Answers are signed with the service's receipt key, the key devices pin for
//! announcements and receipts, so a broker can neither forge nor alter one: a device trusts an
//! answer over MQTT as it trusts the same response over mTLS QUIC.

use fedfleet_protocol::{DeviceId, FleetId};

use crate::sealed::{Reader, SealError, Sealed, SealedBody, put_str};

/// The answers' signing domain (followed by a NUL byte, then the body).
pub const DOMAIN: &str = "fedfleet/mqtt-answer/v1";
const REQUEST_TAG: u8 = b'Q';
const ANSWER_TAG: u8 = b'A';
const VERSION: u8 = 1;
/// Tag, version, id, message length.
pub const REQUEST_PREFIX_LEN: usize = 1 + 1 + 8 + 4;
/// Largest answer body: a secure-aggregation view of a big round (keys of every neighbour) fits
/// with room; the MQTT packet limit bounds it again.
pub const MAX_ANSWER_BYTES: usize = 4 * 1024 * 1024;

/// A device's request, as the service receives it (the device from the topic it came on).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceRequest {
    pub device: DeviceId,
    pub id: u64,
    pub message: Vec<u8>,
    pub attachment: Vec<u8>,
}

/// The request frame for `message` and its `attachment`.
pub fn encode_request(id: u64, message: &[u8], attachment: &[u8]) -> Vec<u8> {
    let mut w = Vec::with_capacity(REQUEST_PREFIX_LEN + message.len() + attachment.len());
    w.extend_from_slice(&[REQUEST_TAG, VERSION]);
    w.extend_from_slice(&id.to_be_bytes());
    w.extend_from_slice(&(message.len() as u32).to_be_bytes());
    w.extend_from_slice(message);
    w.extend_from_slice(attachment);
    w
}

/// A request frame from `device` (named by the topic); the MQTT packet limit bounds its size.
pub fn decode_request(device: &DeviceId, bytes: &[u8]) -> Result<DeviceRequest, SealError> {
    let malformed = |m: &str| SealError::Malformed(format!("request: {m}"));
    if bytes.len() < REQUEST_PREFIX_LEN || bytes[0] != REQUEST_TAG || bytes[1] != VERSION {
        return Err(malformed("not a version 1 request"));
    }
    let id = u64::from_be_bytes(bytes[2..10].try_into().expect("8 bytes"));
    let len = u32::from_be_bytes(bytes[10..14].try_into().expect("4 bytes")) as usize;
    let (message, attachment) =
        bytes[REQUEST_PREFIX_LEN..].split_at_checked(len).ok_or_else(|| malformed("message length past the end"))?;
    Ok(DeviceRequest { device: device.clone(), id, message: message.to_vec(), attachment: attachment.to_vec() })
}

/// What a service answers one request with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub fleet: FleetId,
    pub device: DeviceId,
    /// The request's id.
    pub id: u64,
    /// The service's response encoding.
    pub bytes: Vec<u8>,
}

impl SealedBody for Answer {
    const DOMAIN: &'static str = DOMAIN;
    const TAG: u8 = ANSWER_TAG;
    const NAME: &'static str = "answer";
    const MAX_BODY_BYTES: usize = MAX_ANSWER_BYTES;

    fn canonical_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(96 + self.bytes.len());
        put_str(&mut b, self.fleet.as_str());
        put_str(&mut b, self.device.as_str());
        b.extend_from_slice(&self.id.to_be_bytes());
        b.extend_from_slice(&self.bytes);
        b
    }

    fn from_canonical_bytes(bytes: &[u8]) -> Result<Self, SealError> {
        let mut r = Reader(bytes);
        let fleet = FleetId::new(r.str()?).map_err(|e| SealError::Malformed(format!("answer: fleet: {e}")))?;
        let device = DeviceId::new(r.str()?).map_err(|e| SealError::Malformed(format!("answer: device: {e}")))?;
        let id = r.u64()?;
        Ok(Answer { fleet, device, id, bytes: r.0.to_vec() })
    }
    fn fleet(&self) -> &FleetId {
        &self.fleet
    }
    fn device(&self) -> &DeviceId {
        &self.device
    }
}

/// An [`Answer`] with the service's signature over its bytes as received.
pub type SignedAnswer = Sealed<Answer>;

#[cfg(test)]
mod tests {
    use ed25519_dalek::SigningKey;

    use super::*;

    fn sample() -> Answer {
        Answer {
            fleet: FleetId::new("demo").unwrap(),
            device: DeviceId::new("cam-1").unwrap(),
            id: 77,
            bytes: b"a postcard response".to_vec(),
        }
    }

    #[test]
    fn requests_round_trip_with_their_attachment() {
        let device = DeviceId::new("cam-1").unwrap();
        let wire = encode_request(9, b"message", b"vector bytes");
        let r = decode_request(&device, &wire).unwrap();
        assert_eq!((r.id, r.message.as_slice(), r.attachment.as_slice()), (9, &b"message"[..], &b"vector bytes"[..]));
        assert_eq!(decode_request(&device, &encode_request(1, b"m", b"")).unwrap().attachment, b"");
        for n in 0..REQUEST_PREFIX_LEN + 6 {
            assert!(decode_request(&device, &wire[..n]).is_err(), "{n} bytes");
        }
        let mut other = wire.clone();
        other[0] = b'A';
        assert!(decode_request(&device, &other).is_err());
    }

    #[test]
    fn answers_verify_against_the_signing_key_only_and_refuse_tampering() {
        let key = SigningKey::from_bytes(&[9; 32]);
        let wire = SignedAnswer::sign(sample(), &key).encode();
        assert_eq!(SignedAnswer::decode(&wire).unwrap().verify(&key.verifying_key()).unwrap(), &sample());
        let other = SigningKey::from_bytes(&[10; 32]).verifying_key();
        assert_eq!(SignedAnswer::decode(&wire).unwrap().verify(&other), Err(SealError::BadSignature));
        for i in 0..wire.len() {
            let mut w = wire.clone();
            w[i] ^= 0x01;
            if let Ok(s) = SignedAnswer::decode(&w) {
                assert!(s.verify(&key.verifying_key()).is_err(), "bit {i} flipped and still verifies");
            }
        }
        for n in 0..wire.len() {
            assert!(SignedAnswer::decode(&wire[..n]).is_err());
        }
    }

    #[test]
    fn an_answer_is_never_a_rejection() {
        let key = SigningKey::from_bytes(&[9; 32]);
        let wire = SignedAnswer::sign(sample(), &key).encode();
        assert!(crate::SignedRejection::decode(&wire).is_err());
        assert_ne!(DOMAIN, crate::rejection::DOMAIN);
        for kind in fedfleet_protocol::envelope::Kind::ALL {
            assert_ne!(kind.domain(), DOMAIN);
        }
    }
}
