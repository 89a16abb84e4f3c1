//! Identifiers and the content digest.
//!
//! The content digest is BLAKE3-256 everywhere (chunks, artifacts, payloads, headers): one choice,
//! fast on every core, and a 32-byte output that fits the signed header.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Longest device or fleet id, in bytes.
pub const MAX_ID_LEN: usize = 64;

/// Why an id string was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    #[error("id is empty")]
    Empty,
    #[error("id is {0} bytes long; at most {MAX_ID_LEN} are allowed")]
    TooLong(usize),
    #[error("id contains {0:?}; only ASCII letters, digits, '.', '_' and '-' are allowed")]
    BadChar(char),
    #[error("digest must be 64 hex characters")]
    BadDigest,
}

fn validate_id(s: &str) -> Result<(), IdError> {
    if s.is_empty() {
        return Err(IdError::Empty);
    }
    if s.len() > MAX_ID_LEN {
        return Err(IdError::TooLong(s.len()));
    }
    match s.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))) {
        Some(c) => Err(IdError::BadChar(c)),
        None => Ok(()),
    }
}

macro_rules! string_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(String);

        impl $name {
            pub fn new(s: impl Into<String>) -> Result<Self, IdError> {
                let s = s.into();
                validate_id(&s)?;
                Ok(Self(s))
            }
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }
        impl TryFrom<String> for $name {
            type Error = IdError;
            fn try_from(s: String) -> Result<Self, IdError> {
                Self::new(s)
            }
        }
        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.0
            }
        }
        impl FromStr for $name {
            type Err = IdError;
            fn from_str(s: &str) -> Result<Self, IdError> {
                Self::new(s)
            }
        }
        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    };
}

string_id!(
    /// A device's identity: the CN of its certificate, 1..=64 bytes of `[A-Za-z0-9._-]`.
    DeviceId
);
string_id!(
    /// A fleet: one CA, one aggregator, one registry.
    FleetId
);

macro_rules! number_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(pub u64);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }
    };
}

number_id!(
    /// A training round, unique within a fleet and increasing.
    RoundId
);
number_id!(
    /// A model version, monotonic per model name.
    ModelVersion
);

/// A BLAKE3-256 content digest. Human-readable formats (JSON: status files, `--json` output,
/// saved agent state) carry it as 64 lowercase hex digits, like every log line; binary formats
/// (postcard on the wire) as its 32 bytes.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Digest(pub [u8; 32]);

impl Serialize for Digest {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() { s.serialize_str(&self.to_hex()) } else { self.0.serialize(s) }
    }
}

impl<'de> Deserialize<'de> for Digest {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        if !d.is_human_readable() {
            return <[u8; 32]>::deserialize(d).map(Digest);
        }
        /// Hex, or the array of 32 numbers JSON written before hex (saved agent state).
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Text {
            Hex(String),
            Bytes([u8; 32]),
        }
        match Text::deserialize(d)? {
            Text::Hex(s) => s.parse().map_err(serde::de::Error::custom),
            Text::Bytes(b) => Ok(Digest(b)),
        }
    }
}

impl Digest {
    pub fn of(bytes: &[u8]) -> Self {
        Digest(*blake3::hash(bytes).as_bytes())
    }
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

/// Incremental digest for data that arrives in pieces (streamed payloads, chunks).
#[derive(Default, Clone)]
pub struct Hasher(blake3::Hasher);

impl Hasher {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn update(&mut self, bytes: &[u8]) -> &mut Self {
        self.0.update(bytes);
        self
    }
    pub fn finalize(&self) -> Digest {
        Digest(*self.0.finalize().as_bytes())
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Digest({})", self.to_hex())
    }
}
impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}
impl FromStr for Digest {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, IdError> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out).map_err(|_| IdError::BadDigest)?;
        Ok(Digest(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_are_hex_in_json_and_bytes_in_postcard() {
        let d = Digest::of(b"x");
        let json = serde_json::to_string(&d).unwrap();
        assert_eq!(json, format!("\"{}\"", d.to_hex()));
        assert_eq!(serde_json::from_str::<Digest>(&json).unwrap(), d);
        // JSON saved before hex (an array of 32 numbers) still reads.
        let old = serde_json::to_string(&d.0).unwrap();
        assert_eq!(serde_json::from_str::<Digest>(&old).unwrap(), d);
        let wire = postcard::to_stdvec(&d).unwrap();
        assert_eq!(wire, d.0.to_vec());
        assert_eq!(postcard::from_bytes::<Digest>(&wire).unwrap(), d);
        assert!(serde_json::from_str::<Digest>("\"zz\"").is_err());
    }

    #[test]
    fn ids_are_validated() {
        assert!(DeviceId::new("cam-042.eu_1").is_ok());
        assert_eq!(DeviceId::new(""), Err(IdError::Empty));
        assert_eq!(DeviceId::new("a/b"), Err(IdError::BadChar('/')));
        assert_eq!(DeviceId::new("x".repeat(65)), Err(IdError::TooLong(65)));
        assert!(serde_json::from_str::<DeviceId>("\"a b\"").is_err());
    }

    #[test]
    fn digest_hex_round_trips() {
        let d = Digest::of(b"fedfleet");
        assert_eq!(d.to_hex().parse::<Digest>().unwrap(), d);
        assert!("zz".parse::<Digest>().is_err());
    }
}
