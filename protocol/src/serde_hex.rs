//! Serde helpers: keys and signatures as lowercase hex strings in JSON (readable, and the form
//! the signed metadata uses), instead of the default array of numbers. ([`crate::Digest`] does
//! this itself.) [`vec`]: byte strings of any length, such as a device's queued update.

use serde::{Deserialize, Deserializer, Serializer};

pub mod bytes32 {
    use super::*;

    pub fn serialize<S: Serializer>(b: &[u8; 32], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&hex::encode(b))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<[u8; 32], D::Error> {
        let s = String::deserialize(d)?;
        let mut out = [0u8; 32];
        hex::decode_to_slice(&s, &mut out).map_err(serde::de::Error::custom)?;
        Ok(out)
    }
}

pub mod bytes64 {
    use super::*;

    pub fn serialize<S: Serializer>(b: &[u8; 64], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&hex::encode(b))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<[u8; 64], D::Error> {
        let s = String::deserialize(d)?;
        let mut out = [0u8; 64];
        hex::decode_to_slice(&s, &mut out).map_err(serde::de::Error::custom)?;
        Ok(out)
    }
}

/// A byte string of any length as hex: half the size of JSON's array of numbers (about 3.6
/// characters a byte) and far cheaper to write. Reads that array too, as records written before
/// hold it.
pub mod vec {
    use super::*;

    pub fn serialize<S: Serializer>(b: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&hex::encode(b))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Written {
            Hex(String),
            Numbers(Vec<u8>),
        }
        match Written::deserialize(d)? {
            Written::Hex(s) => hex::decode(&s).map_err(serde::de::Error::custom),
            Written::Numbers(v) => Ok(v),
        }
    }
}
