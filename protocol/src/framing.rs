//! Length-prefixed frames for QUIC streams, sans-IO.
//!
//! ```text
//! magic+version u8 (0xF1) || kind u8 || body length u32 BE || body
//! ```
//!
//! The high nibble of the first byte marks a fedfleet stream, the low nibble is the framing
//! version. Each kind has its own maximum body length, checked from the 6-byte prefix before any
//! body byte is buffered for it, so a peer cannot make us allocate by claiming a large frame.
//!
//! A typical upload stream is `Signed` (the signed update header), then `Chunk`s of the payload,
//! then `End`; the answer is a `Signed` receipt or a `Message` carrying a rejection.

use crate::limits::{MAX_CHUNK_BYTES, MAX_MESSAGE_BYTES, MAX_SIGNED_ENVELOPE_BYTES};

/// First byte of every frame in framing version 1.
pub const FRAME_MAGIC_V1: u8 = 0xF1;
/// Bytes before the body: magic/version, kind, length.
pub const FRAME_PREFIX_LEN: usize = 6;

const MAGIC_MASK: u8 = 0xF0;
const FRAMING_VERSION: u8 = FRAME_MAGIC_V1 & !MAGIC_MASK;

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FrameKind {
    /// A postcard [`Message`](crate::messages::Message).
    Message,
    /// An encoded [`Signed`](crate::envelope::Signed) envelope; its first byte names its kind.
    Signed,
    /// A piece of a payload or artifact.
    Chunk,
    /// End of a chunked payload; empty body.
    End,
}

impl FrameKind {
    pub const ALL: [FrameKind; 4] = [FrameKind::Message, FrameKind::Signed, FrameKind::Chunk, FrameKind::End];

    /// Stable code on the wire. Never reuse a code.
    pub const fn code(self) -> u8 {
        match self {
            FrameKind::Message => 1,
            FrameKind::Signed => 2,
            FrameKind::Chunk => 3,
            FrameKind::End => 4,
        }
    }

    pub fn from_code(code: u8) -> Option<FrameKind> {
        FrameKind::ALL.into_iter().find(|k| k.code() == code)
    }

    /// Largest body this kind may carry.
    pub const fn max_body_len(self) -> usize {
        match self {
            FrameKind::Message => MAX_MESSAGE_BYTES,
            FrameKind::Signed => MAX_SIGNED_ENVELOPE_BYTES,
            FrameKind::Chunk => MAX_CHUNK_BYTES,
            FrameKind::End => 0,
        }
    }
}

/// One decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub kind: FrameKind,
    pub body: Vec<u8>,
}

/// Why a stream of frames was refused. After any error the stream must be closed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    #[error("not a fedfleet frame (first byte {0:#04x})")]
    BadMagic(u8),
    #[error("framing version {0} is not supported")]
    UnsupportedVersion(u8),
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    #[error("{kind:?} frame claims {len} bytes; the limit is {max}")]
    TooLarge { kind: FrameKind, len: u64, max: usize },
    #[error("stream ended inside a frame ({0} bytes buffered)")]
    Truncated(usize),
}

impl FrameError {
    pub fn reason(&self) -> crate::reject::RejectReason {
        use crate::reject::RejectReason;
        match self {
            FrameError::TooLarge { .. } => RejectReason::TooLarge,
            _ => RejectReason::Malformed,
        }
    }
}

/// Encodes one frame; refuses a body over its kind's limit.
pub fn encode_frame(kind: FrameKind, body: &[u8]) -> Result<Vec<u8>, FrameError> {
    if body.len() > kind.max_body_len() {
        return Err(FrameError::TooLarge { kind, len: body.len() as u64, max: kind.max_body_len() });
    }
    let mut out = Vec::with_capacity(FRAME_PREFIX_LEN + body.len());
    out.push(FRAME_MAGIC_V1);
    out.push(kind.code());
    // Fits: every kind's limit is below u32::MAX.
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(body);
    Ok(out)
}

/// Incremental frame decoder: [`push`](Self::push) bytes as they arrive, then
/// [`poll`](Self::poll) until it returns `Ok(None)`. The first error is sticky.
#[derive(Debug, Default)]
pub struct FrameDecoder {
    buf: Vec<u8>,
    start: usize,
    error: Option<FrameError>,
}

impl FrameDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Buffers bytes read from the stream. Ignored after an error.
    pub fn push(&mut self, bytes: &[u8]) {
        if self.error.is_none() {
            self.buf.extend_from_slice(bytes);
        }
    }

    /// Bytes received but not yet returned in a frame.
    pub fn buffered(&self) -> usize {
        self.buf.len() - self.start
    }

    /// The next complete frame, `None` if more bytes are needed.
    pub fn poll(&mut self) -> Result<Option<Frame>, FrameError> {
        if let Some(error) = &self.error {
            return Err(error.clone());
        }
        match self.next_frame() {
            Ok(frame) => Ok(frame),
            Err(error) => {
                self.error = Some(error.clone());
                self.buf = Vec::new();
                self.start = 0;
                Err(error)
            }
        }
    }

    /// Call at end of stream: refuses a partial frame left in the buffer.
    pub fn finish(&self) -> Result<(), FrameError> {
        match (&self.error, self.buffered()) {
            (Some(error), _) => Err(error.clone()),
            (None, 0) => Ok(()),
            (None, n) => Err(FrameError::Truncated(n)),
        }
    }

    fn next_frame(&mut self) -> Result<Option<Frame>, FrameError> {
        let pending = &self.buf[self.start..];
        // Check each prefix byte as soon as it is here, so garbage is refused early.
        if let Some(&magic) = pending.first() {
            if magic & MAGIC_MASK != FRAME_MAGIC_V1 & MAGIC_MASK {
                return Err(FrameError::BadMagic(magic));
            }
            if magic & !MAGIC_MASK != FRAMING_VERSION {
                return Err(FrameError::UnsupportedVersion(magic & !MAGIC_MASK));
            }
        }
        let Some(&code) = pending.get(1) else {
            return Ok(None);
        };
        let kind = FrameKind::from_code(code).ok_or(FrameError::UnknownKind(code))?;
        let Some(len) = pending.get(2..FRAME_PREFIX_LEN) else {
            return Ok(None);
        };
        let len = u32::from_be_bytes([len[0], len[1], len[2], len[3]]);
        if len as usize > kind.max_body_len() {
            return Err(FrameError::TooLarge { kind, len: u64::from(len), max: kind.max_body_len() });
        }
        let total = FRAME_PREFIX_LEN + len as usize;
        if pending.len() < total {
            return Ok(None);
        }
        if pending.len() == total {
            // This frame ends the buffer (an upload's payload chunk, typically, after its header
            // frame): the buffer becomes the body, so a stream waiting on its commit keeps no
            // second copy.
            let mut body = std::mem::take(&mut self.buf);
            body.drain(..self.start + FRAME_PREFIX_LEN);
            body.shrink_to_fit();
            self.start = 0;
            return Ok(Some(Frame { kind, body }));
        }
        let frame = Frame { kind, body: pending[FRAME_PREFIX_LEN..total].to_vec() };
        self.start += total;
        if self.start == self.buf.len() {
            self.buf.clear();
            self.start = 0;
        } else if self.start > self.buf.len() / 2 {
            self.buf.drain(..self.start);
            self.start = 0;
        }
        Ok(Some(frame))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_split_anywhere_decode_the_same() {
        let frames = vec![
            Frame { kind: FrameKind::Signed, body: vec![1, 2, 3] },
            Frame { kind: FrameKind::Chunk, body: vec![7; 1000] },
            Frame { kind: FrameKind::End, body: vec![] },
            Frame { kind: FrameKind::Message, body: b"hello".to_vec() },
        ];
        let wire: Vec<u8> = frames.iter().flat_map(|f| encode_frame(f.kind, &f.body).unwrap()).collect();
        for piece in [1, 2, 5, 6, 7, 100, wire.len()] {
            let mut decoder = FrameDecoder::new();
            let mut out = Vec::new();
            for chunk in wire.chunks(piece) {
                decoder.push(chunk);
                while let Some(frame) = decoder.poll().unwrap() {
                    out.push(frame);
                }
            }
            decoder.finish().unwrap();
            assert_eq!(out, frames, "piece size {piece}");
        }
    }

    #[test]
    fn a_frame_that_ends_the_buffer_becomes_its_body_and_the_decoder_keeps_no_copy() {
        let body = vec![9u8; 20_000];
        let mut wire = encode_frame(FrameKind::Chunk, &body).unwrap();
        let mut decoder = FrameDecoder::new();
        // A header frame first, in the same buffer, as an upload's arrives.
        decoder.push(&encode_frame(FrameKind::Signed, &[1, 2, 3]).unwrap());
        for piece in wire.chunks(1_200) {
            decoder.push(piece);
        }
        assert_eq!(decoder.poll().unwrap().unwrap(), Frame { kind: FrameKind::Signed, body: vec![1, 2, 3] });
        let frame = decoder.poll().unwrap().unwrap();
        assert_eq!(frame, Frame { kind: FrameKind::Chunk, body: body.clone() });
        assert_eq!(decoder.buf.capacity(), 0, "the buffer became the body");
        // The next frames decode as before.
        wire.extend(encode_frame(FrameKind::End, &[]).unwrap());
        decoder.push(&wire);
        assert_eq!(decoder.poll().unwrap().unwrap(), Frame { kind: FrameKind::Chunk, body });
        assert_eq!(decoder.poll().unwrap().unwrap(), Frame { kind: FrameKind::End, body: vec![] });
        decoder.finish().unwrap();
    }

    #[test]
    fn oversize_claim_is_refused_from_the_prefix_alone() {
        let mut decoder = FrameDecoder::new();
        // A 4 GiB - 1 chunk: only the 6-byte prefix is ever pushed.
        decoder.push(&[FRAME_MAGIC_V1, FrameKind::Chunk.code(), 0xFF, 0xFF, 0xFF, 0xFF]);
        let err = decoder.poll().unwrap_err();
        assert_eq!(err, FrameError::TooLarge { kind: FrameKind::Chunk, len: u32::MAX as u64, max: MAX_CHUNK_BYTES });
        assert_eq!(decoder.buffered(), 0);
        decoder.push(&[0; 64]);
        assert_eq!(decoder.buffered(), 0, "nothing is buffered after an error");
        assert_eq!(decoder.poll().unwrap_err(), err, "errors are sticky");

        let mut end = FrameDecoder::new();
        end.push(&[FRAME_MAGIC_V1, FrameKind::End.code(), 0, 0, 0, 1]);
        assert!(matches!(end.poll(), Err(FrameError::TooLarge { .. })));
        assert!(encode_frame(FrameKind::Chunk, &vec![0; MAX_CHUNK_BYTES + 1]).is_err());
    }

    #[test]
    fn garbage_is_refused_at_the_first_bad_byte() {
        let mut d = FrameDecoder::new();
        d.push(b"G");
        assert_eq!(d.poll(), Err(FrameError::BadMagic(b'G')));
        let mut d = FrameDecoder::new();
        d.push(&[0xF2]);
        assert_eq!(d.poll(), Err(FrameError::UnsupportedVersion(2)));
        let mut d = FrameDecoder::new();
        d.push(&[FRAME_MAGIC_V1, 99]);
        assert_eq!(d.poll(), Err(FrameError::UnknownKind(99)));
        let mut d = FrameDecoder::new();
        d.push(&[FRAME_MAGIC_V1, FrameKind::Chunk.code(), 0, 0]);
        assert_eq!(d.poll(), Ok(None));
        assert_eq!(d.finish(), Err(FrameError::Truncated(4)));
    }
}
