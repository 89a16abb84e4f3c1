//! The MQTT fallback upload path: a signed update split into frames on
//! `fedfleet/v1/<fleet>/devices/<id>/updates`, and the aggregator-side [`UpdateAssembler`] that
//! puts them back together under per-device and global memory limits and verifies them exactly
//! like a QUIC upload (same signed header, same [`PayloadCheck`]).
//!
//! Frames (all integers big-endian):
//! ```text
//! header: 'H' | version 1 | upload id [16] | chunk size u32 | chunk count u32 | Signed<UpdateHeader> envelope
//! chunk : 'C' | version 1 | upload id [16] | index u32      | chunk count u32 | payload bytes
//! ```
//! The upload id is the signed header's nonce. Chunks are sent in order on one topic at QoS 1,
//! which MQTT delivers in order; a repeated chunk (QoS 1 redelivery) is dropped, a gap aborts the
//! upload (the device re-sends it whole when no receipt comes).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use ed25519_dalek::VerifyingKey;
use fedfleet_protocol::limits::{MAX_CHUNK_BYTES, MAX_SIGNED_ENVELOPE_BYTES};
use fedfleet_protocol::{DeviceId, FleetId, PayloadCheck, RejectReason, SignedUpdate};

use crate::verify::{self, DeviceKeys, Rejected};

const HEADER_TAG: u8 = b'H';
const CHUNK_TAG: u8 = b'C';
const FRAME_VERSION: u8 = 1;
/// Tag, version, upload id, two u32.
pub const FRAME_PREFIX_LEN: usize = 1 + 1 + 16 + 4 + 4;
/// Default payload bytes per chunk frame: small enough for any broker's packet limit, large
/// enough that the per-message overhead does not matter.
pub const DEFAULT_CHUNK_BYTES: usize = 64 * 1024;

/// Splits a signed update and its payload into upload frames, header first.
///
/// # Panics
/// If `chunk_bytes` is 0 or above [`MAX_CHUNK_BYTES`].
pub fn encode_frames(signed: &SignedUpdate, payload: &[u8], chunk_bytes: usize) -> Vec<Vec<u8>> {
    assert!((1..=MAX_CHUNK_BYTES).contains(&chunk_bytes), "chunk size out of range");
    let id = signed.body().nonce;
    let count = payload.len().div_ceil(chunk_bytes) as u32;
    let mut frames = Vec::with_capacity(count as usize + 1);
    let envelope = signed.encode();
    let mut header = Vec::with_capacity(FRAME_PREFIX_LEN + envelope.len());
    header.extend_from_slice(&[HEADER_TAG, FRAME_VERSION]);
    header.extend_from_slice(&id);
    header.extend_from_slice(&(chunk_bytes as u32).to_be_bytes());
    header.extend_from_slice(&count.to_be_bytes());
    header.extend_from_slice(&envelope);
    frames.push(header);
    for (i, chunk) in payload.chunks(chunk_bytes).enumerate() {
        let mut f = Vec::with_capacity(FRAME_PREFIX_LEN + chunk.len());
        f.extend_from_slice(&[CHUNK_TAG, FRAME_VERSION]);
        f.extend_from_slice(&id);
        f.extend_from_slice(&(i as u32).to_be_bytes());
        f.extend_from_slice(&count.to_be_bytes());
        f.extend_from_slice(chunk);
        frames.push(f);
    }
    frames
}

/// A complete, verified update: the signature checked against the enrolled key of the device
/// named in both the topic and the header ([`VerifiedUpload::key`]), the payload against the
/// signed length and digest. Only the assembler makes one. Hand it to the same ingest as a QUIC
/// upload (which checks round, replay, shapes and values, and need not verify again what this
/// proves while the key is still the device's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifiedUpload {
    device: DeviceId,
    signed: SignedUpdate,
    payload: Vec<u8>,
    key: VerifyingKey,
}

impl VerifiedUpload {
    pub fn device(&self) -> &DeviceId {
        &self.device
    }
    pub fn signed(&self) -> &SignedUpdate {
        &self.signed
    }
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }
    /// The enrolled key the header's signature verified against.
    pub fn key(&self) -> &VerifyingKey {
        &self.key
    }
    pub fn into_payload(self) -> Vec<u8> {
        self.payload
    }
}

/// What one frame did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(clippy::large_enum_variant)] // short-lived, moved once
pub enum Assembled {
    /// Accepted; more frames are needed.
    Pending,
    /// A repeat of something already seen (QoS 1 redelivery, a re-sent header of the upload in
    /// progress), or a chunk of an upload already finished or refused; dropped without a
    /// rejection.
    Ignored,
    /// The last frame of a verified upload.
    Complete(VerifiedUpload),
}

/// Limits of the assembler. Memory is bounded by `max_total_bytes` (payload bytes of all uploads
/// in progress, reserved when a header is accepted) plus one chunk.
#[derive(Debug, Clone)]
pub struct AssemblerLimits {
    /// Largest payload accepted over MQTT (bigger updates belong on QUIC).
    pub max_update_bytes: u64,
    /// Payload bytes of all uploads in progress together.
    pub max_total_bytes: u64,
    /// An upload with no frame for this long is dropped (checked when frames arrive).
    pub idle_timeout: Duration,
}

impl Default for AssemblerLimits {
    fn default() -> Self {
        AssemblerLimits { max_update_bytes: 16 * 1024 * 1024, max_total_bytes: 256 * 1024 * 1024, idle_timeout: Duration::from_secs(120) }
    }
}

struct Upload {
    id: [u8; 16],
    signed: SignedUpdate,
    key: VerifyingKey,
    chunk_bytes: usize,
    count: u32,
    next: u32,
    check: PayloadCheck,
    buf: Vec<u8>,
    last_frame: Instant,
}

/// Reassembles upload frames per device. Sans-IO: the caller passes frames and the time.
/// At most one upload per device is in progress; a new header from a device replaces its
/// unfinished upload.
pub struct UpdateAssembler {
    fleet: FleetId,
    limits: AssemblerLimits,
    /// Boxed: an upload in progress holds a digest state of about 2 KB, and a map keeps the
    /// slots of the most uploads it ever held at once (a round's burst from a whole fleet).
    uploads: HashMap<DeviceId, Box<Upload>>,
    /// The last finished or refused upload id per device, so its stray frames are ignored.
    finished: HashMap<DeviceId, [u8; 16]>,
    reserved: u64,
}

/// Tag, upload id, two u32 fields, rest.
type Prefix<'a> = (u8, [u8; 16], u32, u32, &'a [u8]);

fn read_prefix(frame: &[u8]) -> Option<Prefix<'_>> {
    if frame.len() < FRAME_PREFIX_LEN || frame[1] != FRAME_VERSION {
        return None;
    }
    let id: [u8; 16] = frame[2..18].try_into().ok()?;
    let a = u32::from_be_bytes(frame[18..22].try_into().ok()?);
    let b = u32::from_be_bytes(frame[22..26].try_into().ok()?);
    Some((frame[0], id, a, b, &frame[FRAME_PREFIX_LEN..]))
}

impl UpdateAssembler {
    pub fn new(fleet: FleetId, limits: AssemblerLimits) -> Self {
        UpdateAssembler { fleet, limits, uploads: HashMap::new(), finished: HashMap::new(), reserved: 0 }
    }

    /// Uploads in progress.
    pub fn in_progress(&self) -> usize {
        self.uploads.len()
    }

    /// Payload bytes reserved by uploads in progress.
    pub fn reserved_bytes(&self) -> u64 {
        self.reserved
    }

    fn drop_upload(&mut self, device: &DeviceId) -> Option<Box<Upload>> {
        let up = self.uploads.remove(device)?;
        self.reserved -= up.signed.body().payload_len;
        self.finished.insert(device.clone(), up.id);
        Some(up)
    }

    /// Drops uploads idle for longer than the limit.
    pub fn expire(&mut self, now: Instant) -> Vec<DeviceId> {
        let idle: Vec<DeviceId> = self
            .uploads
            .iter()
            .filter(|(_, u)| now.saturating_duration_since(u.last_frame) > self.limits.idle_timeout)
            .map(|(d, _)| d.clone())
            .collect();
        for d in &idle {
            self.drop_upload(d);
        }
        idle
    }

    /// Takes one frame published on `topic` (the `devices/<device>/updates` topic of `device`).
    pub fn push(
        &mut self,
        topic: &str,
        device: &DeviceId,
        keys: &dyn DeviceKeys,
        frame: &[u8],
        now: Instant,
    ) -> Result<Assembled, Rejected> {
        self.expire(now);
        let reject = |reason, detail: String| Rejected::new(topic, Some(device), reason, detail);
        let Some((tag, id, a, b, rest)) = read_prefix(frame) else {
            return Err(reject(RejectReason::Malformed, "not an upload frame".into()));
        };
        match tag {
            // The header of the upload in progress again (a re-send after a reconnect): carry on
            // from the chunks already received. A header of a finished upload is a re-send too
            // (the receipt was lost) and is assembled again, so the aggregator can answer it again.
            HEADER_TAG if self.uploads.get(device).is_some_and(|u| u.id == id) => Ok(Assembled::Ignored),
            HEADER_TAG => {
                let result = self.new_upload(topic, device, keys, id, a, b, rest, now);
                if result.is_err() {
                    // Its chunks will follow: drop them quietly rather than refusing each one.
                    self.finished.insert(device.clone(), id);
                }
                result
            }
            CHUNK_TAG => self.chunk(topic, device, id, a, b, rest, now),
            other => Err(reject(RejectReason::Malformed, format!("unknown frame tag {other}"))),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn new_upload(
        &mut self,
        topic: &str,
        device: &DeviceId,
        keys: &dyn DeviceKeys,
        id: [u8; 16],
        chunk_bytes: u32,
        count: u32,
        envelope: &[u8],
        now: Instant,
    ) -> Result<Assembled, Rejected> {
        let reject = |reason, detail: String| Rejected::new(topic, Some(device), reason, detail);
        if envelope.len() > MAX_SIGNED_ENVELOPE_BYTES {
            return Err(reject(RejectReason::TooLarge, "header envelope too large".into()));
        }
        let (signed, key) = verify::update_header(topic, envelope, &self.fleet, device, keys)?;
        let h = signed.body();
        if h.nonce != id {
            return Err(reject(RejectReason::Malformed, "upload id is not the signed nonce".into()));
        }
        if h.payload_len > self.limits.max_update_bytes {
            return Err(reject(
                RejectReason::TooLarge,
                format!("payload of {} bytes is over the MQTT upload limit of {}; use QUIC", h.payload_len, self.limits.max_update_bytes),
            ));
        }
        let chunk = chunk_bytes as usize;
        if !(1..=MAX_CHUNK_BYTES).contains(&chunk) || h.payload_len.div_ceil(chunk_bytes as u64) != count as u64 {
            return Err(reject(
                RejectReason::Malformed,
                format!("{count} chunks of {chunk_bytes} bytes cannot carry {} bytes", h.payload_len),
            ));
        }
        // A new upload replaces this device's unfinished one.
        if let Some(old) = self.uploads.remove(device) {
            self.reserved -= old.signed.body().payload_len;
        }
        if self.reserved + h.payload_len > self.limits.max_total_bytes {
            return Err(reject(RejectReason::Overloaded, format!("{} payload bytes already in flight over MQTT", self.reserved)));
        }
        let len = h.payload_len;
        let check = PayloadCheck::new(h);
        if count == 0 {
            check.finish().map_err(|e| reject(e.reason(), e.to_string()))?;
            self.finished.insert(device.clone(), id);
            return Ok(Assembled::Complete(VerifiedUpload { device: device.clone(), signed, payload: Vec::new(), key }));
        }
        self.reserved += len;
        self.uploads.insert(
            device.clone(),
            Box::new(Upload {
                id,
                signed,
                key,
                chunk_bytes: chunk,
                count,
                next: 0,
                check,
                buf: Vec::with_capacity((len as usize).min(4 * chunk)),
                last_frame: now,
            }),
        );
        Ok(Assembled::Pending)
    }

    #[allow(clippy::too_many_arguments)]
    fn chunk(
        &mut self,
        topic: &str,
        device: &DeviceId,
        id: [u8; 16],
        index: u32,
        count: u32,
        bytes: &[u8],
        now: Instant,
    ) -> Result<Assembled, Rejected> {
        let reject = |reason, detail: String| Rejected::new(topic, Some(device), reason, detail);
        let up = match self.uploads.get_mut(device) {
            Some(up) if up.id == id => up,
            _ if self.finished.get(device) == Some(&id) => return Ok(Assembled::Ignored),
            _ => {
                return Err(reject(RejectReason::Malformed, "chunk of an upload whose header was not received".into()));
            }
        };
        if index < up.next {
            return Ok(Assembled::Ignored);
        }
        // Checked: a chunk may claim any index, u32::MAX included (found by fuzzing; `index + 1`
        // overflowed). Past the checks below, index == next < count.
        let last = index.checked_add(1) == Some(up.count);
        let problem = if count != up.count {
            Some(format!("chunk says {count} chunks, the header {}", up.count))
        } else if index > up.next {
            Some(format!("chunk {index} arrived, expected {}", up.next))
        } else if bytes.is_empty() || bytes.len() > up.chunk_bytes || (!last && bytes.len() != up.chunk_bytes) {
            Some(format!("chunk {index} has {} bytes", bytes.len()))
        } else {
            None
        };
        if let Some(detail) = problem {
            self.drop_upload(device);
            return Err(reject(RejectReason::Malformed, detail));
        }
        if let Err(e) = up.check.update(bytes) {
            self.drop_upload(device);
            return Err(reject(e.reason(), e.to_string()));
        }
        up.buf.extend_from_slice(bytes);
        up.next += 1;
        up.last_frame = now;
        if !last {
            return Ok(Assembled::Pending);
        }
        let up = self.drop_upload(device).expect("upload present");
        up.check.finish().map_err(|e| reject(e.reason(), e.to_string()))?;
        Ok(Assembled::Complete(VerifiedUpload { device: device.clone(), signed: up.signed, payload: up.buf, key: up.key }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ed25519_dalek::{SigningKey, VerifyingKey};
    use fedfleet_protocol::{DType, Digest, RoundId, Signed, UpdateHeader};

    fn setup() -> (FleetId, DeviceId, SigningKey, HashMap<DeviceId, VerifyingKey>) {
        let fleet = FleetId::new("demo").unwrap();
        let dev = DeviceId::new("d1").unwrap();
        let key = SigningKey::from_bytes(&[7; 32]);
        let mut keys = HashMap::new();
        keys.insert(dev.clone(), key.verifying_key());
        (fleet, dev, key, keys)
    }

    fn signed(fleet: &FleetId, dev: &DeviceId, key: &SigningKey, payload: &[u8], nonce: u8) -> SignedUpdate {
        Signed::sign(
            UpdateHeader {
                device: dev.clone(),
                fleet: fleet.clone(),
                round: RoundId(1),
                base_model: Digest([1; 32]),
                nonce: [nonce; 16],
                sample_count: 10,
                payload_len: payload.len() as u64,
                payload_digest: Digest::of(payload),
                payload_dtype: DType::F32,
            },
            key,
        )
    }

    #[test]
    fn reassembles_ignores_repeats_and_bounds_memory() {
        let (fleet, dev, key, keys) = setup();
        let payload: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
        let s = signed(&fleet, &dev, &key, &payload, 1);
        let frames = encode_frames(&s, &payload, 1000);
        assert_eq!(frames.len(), 11);
        let mut asm = UpdateAssembler::new(fleet.clone(), AssemblerLimits::default());
        let now = Instant::now();
        let t = "t";
        let mut done = None;
        for (i, f) in frames.iter().enumerate() {
            match asm.push(t, &dev, &keys, f, now).unwrap() {
                Assembled::Complete(v) => done = Some(v),
                Assembled::Pending => assert_eq!(asm.reserved_bytes(), 10_000),
                Assembled::Ignored => panic!("frame {i} ignored"),
            }
            if i == 3 {
                // QoS 1 redelivery of an earlier chunk and of the header.
                assert_eq!(asm.push(t, &dev, &keys, &frames[2], now).unwrap(), Assembled::Ignored);
                assert_eq!(asm.push(t, &dev, &keys, &frames[0], now).unwrap(), Assembled::Ignored);
            }
        }
        let v = done.unwrap();
        assert_eq!(v.payload(), payload);
        assert_eq!(asm.reserved_bytes(), 0);
        assert_eq!(asm.push(t, &dev, &keys, &frames[5], now).unwrap(), Assembled::Ignored);
        // The same upload sent again (its receipt was lost) is assembled again.
        let mut again = None;
        for f in &frames {
            if let Assembled::Complete(v) = asm.push(t, &dev, &keys, f, now).unwrap() {
                again = Some(v);
            }
        }
        assert_eq!(again.unwrap().payload(), payload);

        // Over the per-update and the global limits.
        let small = AssemblerLimits { max_update_bytes: 5_000, ..Default::default() };
        let mut asm = UpdateAssembler::new(fleet.clone(), small);
        let err = asm.push(t, &dev, &keys, &frames[0], now).unwrap_err();
        assert_eq!(err.reason, RejectReason::TooLarge);
        let tight = AssemblerLimits { max_total_bytes: 5_000, ..Default::default() };
        let mut asm = UpdateAssembler::new(fleet, tight);
        let err = asm.push(t, &dev, &keys, &frames[0], now).unwrap_err();
        assert_eq!(err.reason, RejectReason::Overloaded);
    }

    /// Regression (fuzz target `upload_frames`, corpus file `regression-chunk-index-u32-max`):
    /// a chunk claiming index u32::MAX after a valid header overflowed `index + 1` (a panic in
    /// debug builds). It is a gap: refused, and the upload dropped.
    #[test]
    fn a_chunk_index_of_u32_max_is_refused_without_overflow() {
        let (fleet, dev, key, keys) = setup();
        let payload = vec![3u8; 3000];
        let now = Instant::now();
        let frames = encode_frames(&signed(&fleet, &dev, &key, &payload, 6), &payload, 1000);
        let mut asm = UpdateAssembler::new(fleet, AssemblerLimits::default());
        assert_eq!(asm.push("t", &dev, &keys, &frames[0], now).unwrap(), Assembled::Pending);
        let mut chunk = frames[1].clone();
        chunk[18..22].copy_from_slice(&u32::MAX.to_be_bytes());
        let e = asm.push("t", &dev, &keys, &chunk, now).unwrap_err();
        assert_eq!(e.reason, RejectReason::Malformed);
        assert_eq!((asm.in_progress(), asm.reserved_bytes()), (0, 0));
    }

    #[test]
    fn refuses_gaps_bad_digests_strangers_and_expires() {
        let (fleet, dev, key, keys) = setup();
        let payload = vec![3u8; 3000];
        let now = Instant::now();
        let s = signed(&fleet, &dev, &key, &payload, 2);
        let frames = encode_frames(&s, &payload, 1000);
        let mut asm = UpdateAssembler::new(fleet.clone(), AssemblerLimits::default());
        asm.push("t", &dev, &keys, &frames[0], now).unwrap();
        let gap = asm.push("t", &dev, &keys, &frames[2], now).unwrap_err();
        assert_eq!(gap.reason, RejectReason::Malformed);
        assert_eq!(asm.in_progress(), 0);

        // Payload altered in the last chunk: digest mismatch at the end.
        let mut bad = frames.clone();
        let last = bad.last_mut().unwrap();
        let n = last.len() - 1;
        last[n] ^= 1;
        let s2 = signed(&fleet, &dev, &key, &payload, 3);
        let mut bad2 = encode_frames(&s2, &payload, 1000);
        let n2 = bad2[3].len() - 1;
        bad2[3][n2] ^= 1;
        asm.push("t", &dev, &keys, &bad2[0], now).unwrap();
        asm.push("t", &dev, &keys, &bad2[1], now).unwrap();
        asm.push("t", &dev, &keys, &bad2[2], now).unwrap();
        let e = asm.push("t", &dev, &keys, &bad2[3], now).unwrap_err();
        assert_eq!(e.reason, RejectReason::DigestMismatch);

        // Signed by someone else's key / unknown device.
        let other = SigningKey::from_bytes(&[9; 32]);
        let forged = encode_frames(&signed(&fleet, &dev, &other, &payload, 4), &payload, 1000);
        let e = asm.push("t", &dev, &keys, &forged[0], now).unwrap_err();
        assert_eq!(e.reason, RejectReason::BadSignature);
        assert_eq!(asm.push("t", &dev, &keys, &forged[1], now).unwrap(), Assembled::Ignored);
        let stranger = DeviceId::new("d9").unwrap();
        let e = asm.push("t", &stranger, &keys, &forged[0], now).unwrap_err();
        assert_eq!(e.reason, RejectReason::UnknownDevice);
        let e = asm.push("t", &dev, &keys, b"garbage", now).unwrap_err();
        assert_eq!(e.reason, RejectReason::Malformed);

        // Idle uploads expire and release their reservation.
        let s5 = signed(&fleet, &dev, &key, &payload, 5);
        let f5 = encode_frames(&s5, &payload, 1000);
        asm.push("t", &dev, &keys, &f5[0], now).unwrap();
        assert_eq!(asm.reserved_bytes(), 3000);
        assert_eq!(asm.expire(now + Duration::from_secs(600)), vec![dev.clone()]);
        assert_eq!(asm.reserved_bytes(), 0);
    }
}
