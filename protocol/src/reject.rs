//! Named reasons for refusing anything a peer sent.
//!
//! The aggregator, the registry and the agent answer every refusal with one of these, and count
//! it in metrics under [`RejectReason::as_str`]. The names are part of the wire and of dashboards:
//! add variants, never rename.

use std::fmt;

use serde::{Deserialize, Serialize};

macro_rules! reasons {
    ($($(#[$doc:meta])* $variant:ident => $name:literal,)*) => {
        /// Why an update, envelope, bundle or message was refused.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[non_exhaustive]
        pub enum RejectReason {
            $($(#[$doc])* $variant,)*
        }

        impl RejectReason {
            /// Every reason, for registering metric labels up front.
            pub const ALL: &'static [RejectReason] = &[$(RejectReason::$variant,)*];

            /// Stable snake_case name, used as a metric label and in logs.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $(RejectReason::$variant => $name,)*
                }
            }
        }
    };
}

reasons! {
    /// The sender's id is not enrolled in this fleet.
    UnknownDevice => "unknown_device",
    /// The sender's certificate or key has been revoked.
    Revoked => "revoked",
    /// The sender's key is a weak (small-order) ed25519 key.
    WeakKey => "weak_key",
    /// The round is over or older than the current one.
    StaleRound => "stale_round",
    /// The round id is not known (not yet announced, or from the future).
    UnknownRound => "unknown_round",
    /// The device was not selected for this round.
    NotSelected => "not_selected",
    /// The round deadline has passed.
    DeadlinePassed => "deadline_passed",
    /// The (device, round, nonce) triple was seen before.
    Replay => "replay",
    /// The device already has an accepted update in this round (or, under secure aggregation,
    /// already sent this stage's message).
    Duplicate => "duplicate",
    /// The signature does not verify against the enrolled key.
    BadSignature => "bad_signature",
    /// The bytes do not hash to the signed digest.
    DigestMismatch => "digest_mismatch",
    /// The payload length differs from the signed length.
    LengthMismatch => "length_mismatch",
    /// Tensor names or shapes differ from the round's base model.
    ShapeMismatch => "shape_mismatch",
    /// The payload dtype is not the one the round asked for, or not supported.
    WrongDtype => "wrong_dtype",
    /// A tensor holds NaN or infinity.
    NonFinite => "non_finite",
    /// Something is over a size limit.
    TooLarge => "too_large",
    /// The header names another fleet.
    WrongFleet => "wrong_fleet",
    /// The update was trained from another base model.
    WrongBaseModel => "wrong_base_model",
    /// The sample count is zero or above the round's cap.
    BadSampleCount => "bad_sample_count",
    /// The bytes do not parse (truncated, trailing bytes, unknown tag, bad id).
    Malformed => "malformed",
    /// The sender is over its rate or the server is over capacity.
    Overloaded => "overloaded",
    /// A failure on our side; the sender may retry.
    Internal => "internal",
    /// The authenticated peer (certificate) is not the party the message names.
    IdentityMismatch => "identity_mismatch",
    /// The authenticated peer may not make this request (e.g. a device asking for operator commands).
    NotPermitted => "not_permitted",
    /// The sender's certificate is past its validity: it must be re-enrolled (renewal needs a
    /// certificate that is still valid).
    CertificateExpired => "certificate_expired",
    /// Asynchronous mode: the update's base model is more versions behind the current one than
    /// the campaign's staleness bound.
    TooStale => "too_stale",
    /// A secure-aggregation message was refused by the protocol; the detail starts with the
    /// protocol's own reason (`wrong_session`, `inconsistent_shares`, `malformed_share`, …).
    SecAggRefused => "secagg_refused",
    /// The round's secure aggregation failed (`below_threshold`, `unrecoverable`,
    /// `share_mismatch`): the round publishes nothing and the device's update is not in a model.
    SecAggFailed => "secagg_failed",
}

impl fmt::Display for RejectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The detail of an `overloaded` refusal (an upload's, or the reason a connection was closed
/// with): what is full, and when to come back. [`retry_after_ms`] reads it back.
pub fn overloaded_detail(what: impl fmt::Display, retry_after_ms: u64) -> String {
    format!("{what}; retry after {retry_after_ms} ms")
}

/// The retry-after that text ending in an [`overloaded_detail`] names.
pub fn retry_after_ms(text: &str) -> Option<u64> {
    text.rsplit_once("retry after ")?.1.strip_suffix(" ms")?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_overloaded_detail_reads_back_its_retry_after() {
        let d = overloaded_detail("268435456 bytes of updates in flight", 1_000);
        assert_eq!(d, "268435456 bytes of updates in flight; retry after 1000 ms");
        assert_eq!(retry_after_ms(&format!("overloaded: {d}")), Some(1_000));
        assert_eq!(retry_after_ms("overloaded"), None);
    }

    #[test]
    fn names_are_unique_snake_case() {
        let mut seen = std::collections::BTreeSet::new();
        for reason in RejectReason::ALL {
            let name = reason.as_str();
            assert!(name.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'), "{name}");
            assert!(seen.insert(name), "duplicate {name}");
        }
        assert_eq!(RejectReason::DigestMismatch.to_string(), "digest_mismatch");
    }
}
