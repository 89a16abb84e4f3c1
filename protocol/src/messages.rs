//! Control messages, encoded with postcard.
//!
//! postcard is compact and its wire format is stable across 1.x, but it is not self-describing:
//! fields are positional and enum variants are indices. So **append only**: add enum variants at
//! the end, never reorder fields; a breaking change gets a new `v2` topic/ALPN. Free-form JSON (a
//! model spec) travels as a string for the same reason.
//!
//! Messages that cross an untrusted hop are wrapped in [`Signed`](crate::envelope::Signed): a
//! [`Receipt`] signs hand-written canonical bytes like the update header; announcements, rollout
//! notices, device status and manifests sign their postcard bytes.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::bundle::DType;
use crate::envelope::{CanonicalReader, CanonicalWriter, EnvelopeError, Kind, Signable};
use crate::ids::{DeviceId, Digest, FleetId, ModelVersion, RoundId};
use crate::limits::{MAX_DETAIL_LEN, MAX_MESSAGE_BYTES};
use crate::model::ModelInfo;
use crate::reject::RejectReason;

/// Why a message was not encoded or decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MessageError {
    #[error("message is {len} bytes; the limit is {max}")]
    TooLarge { len: usize, max: usize },
    #[error("malformed message: {0}")]
    Malformed(String),
    #[error("{0} unexpected bytes after the message")]
    TrailingBytes(usize),
    #[error("cannot encode message: {0}")]
    Encode(String),
}

impl MessageError {
    pub fn reason(&self) -> RejectReason {
        match self {
            MessageError::TooLarge { .. } => RejectReason::TooLarge,
            MessageError::Malformed(_) | MessageError::TrailingBytes(_) => RejectReason::Malformed,
            MessageError::Encode(_) => RejectReason::Internal,
        }
    }
}

/// postcard bytes of `value`, refused if longer than `max`.
pub fn encode<T: Serialize>(value: &T, max: usize) -> Result<Vec<u8>, MessageError> {
    let bytes = postcard::to_stdvec(value).map_err(|e| MessageError::Encode(e.to_string()))?;
    if bytes.len() > max {
        return Err(MessageError::TooLarge { len: bytes.len(), max });
    }
    Ok(bytes)
}

/// Parses postcard bytes; refuses input longer than `max` before parsing, and trailing bytes.
pub fn decode<T: DeserializeOwned>(bytes: &[u8], max: usize) -> Result<T, MessageError> {
    if bytes.len() > max {
        return Err(MessageError::TooLarge { len: bytes.len(), max });
    }
    let (value, rest) = postcard::take_from_bytes(bytes).map_err(|e| MessageError::Malformed(e.to_string()))?;
    if !rest.is_empty() {
        return Err(MessageError::TrailingBytes(rest.len()));
    }
    Ok(value)
}

/// A model version, pinned by digest.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ModelRef {
    pub name: String,
    pub version: ModelVersion,
    pub digest: Digest,
}

/// How devices train in one round (inside the signed announcement).
///
/// The client-training vocabulary is `local_epochs`, `batch_size`, `learning_rate`, `optimizer`,
/// `proximal_mu` everywhere (the round engine's `ClientConfig`, the aggregator's `[campaign]`,
/// `fedfleet-learning`'s `TrainConfig`); the old config-file keys `lr`, `mu` and `fedprox_mu`
/// are accepted as aliases by the self-describing formats. postcard is positional: renaming a
/// field keeps the bytes, so the field order here must not change.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoundConfig {
    pub local_epochs: u32,
    pub batch_size: u32,
    #[serde(alias = "lr")]
    pub learning_rate: f32,
    /// Local optimizer name: "sgd" or "adam".
    pub optimizer: String,
    /// FedProx proximal weight; 0 trains plain FedAvg.
    #[serde(alias = "fedprox_mu", alias = "mu")]
    pub proximal_mu: f32,
    /// The dtype devices upload their update in.
    pub quantization: DType,
    /// Devices with fewer local samples skip the round.
    pub min_samples: u64,
    /// Cap on an update's sample count (its aggregation weight); `None` for no cap.
    pub max_samples: Option<u64>,
    /// Base seed for local shuffling, mixed with the device id.
    pub seed: u64,
    /// The round aggregates securely (SecAgg+): a device sends its update only masked, through
    /// the aggregator's secure-aggregation stages, never as a plain upload.
    #[serde(default)]
    pub secure_aggregation: bool,
    /// Devices spread their start over this many ms after they hear of the round, each at its
    /// own point ([`RoundAnnouncement::start_offset_ms`]), so a round opened for a whole fleet
    /// does not reach the aggregator as one burst of downloads and uploads. 0: start at once.
    #[serde(default)]
    pub start_window_ms: u64,
    /// Clipping and Gaussian noise the device applies to its update before it signs or masks
    /// it (differential privacy on the device: local DP, or DP-FedAvg's noise split across
    /// the devices of a securely aggregated round). `None`: the update goes as trained.
    #[serde(default)]
    pub device_privacy: Option<DevicePrivacy>,
}

/// What a device does to its update for differential privacy (see [`RoundConfig`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DevicePrivacy {
    /// The update (the delta from the base model) is scaled to L2 norm at most this.
    pub clip_norm: f64,
    /// Standard deviation of the Gaussian noise added to each coordinate after clipping,
    /// drawn from the device's own randomness (nobody else learns it).
    pub noise_stddev: f64,
    /// The update counts once whatever its sample count (DP-FedAvg bounds a device's whole
    /// influence by `clip_norm`): its secure-aggregation weight is 1.
    pub count_once: bool,
}

impl DevicePrivacy {
    /// Finite, `clip_norm > 0`, `noise_stddev >= 0`: what a device checks before using it.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.clip_norm.is_finite() && self.clip_norm > 0.0) {
            return Err(format!("device privacy: clip_norm {} must be a finite number > 0", self.clip_norm));
        }
        if !(self.noise_stddev.is_finite() && self.noise_stddev >= 0.0) {
            return Err(format!("device privacy: noise_stddev {} must be a finite number >= 0", self.noise_stddev));
        }
        Ok(())
    }
}

impl Default for RoundConfig {
    fn default() -> Self {
        RoundConfig {
            local_epochs: 1,
            batch_size: 32,
            learning_rate: 0.01,
            optimizer: "sgd".to_owned(),
            proximal_mu: 0.0,
            quantization: DType::F32,
            min_samples: 1,
            max_samples: None,
            seed: 0,
            secure_aggregation: false,
            start_window_ms: 0,
            device_privacy: None,
        }
    }
}

/// Which devices take part in a round.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Selection {
    /// Every enrolled device.
    All,
    /// Exactly these devices.
    Devices(Vec<DeviceId>),
    /// Each device independently with probability `rate_ppm / 1_000_000`, decided by hashing the
    /// seed and the device id, so devices and the aggregator agree without talking.
    Sample { rate_ppm: u32, seed: u64 },
}

/// Parts per million in [`Selection::Sample`].
pub const PPM: u32 = 1_000_000;

impl Selection {
    pub fn selects(&self, device: &DeviceId) -> bool {
        match self {
            Selection::All => true,
            Selection::Devices(devices) => devices.contains(device),
            Selection::Sample { rate_ppm, seed } => {
                let mut hasher = blake3::Hasher::new();
                hasher.update(b"fedfleet/sample/v1\0");
                hasher.update(&seed.to_be_bytes());
                hasher.update(device.as_str().as_bytes());
                bucket(hasher.finalize().as_bytes(), u64::from(PPM)) < u64::from(*rate_ppm)
            }
        }
    }
}

/// A hash's first 8 bytes, big-endian, modulo `buckets`: an even draw from `0..buckets`.
fn bucket(hash: &[u8; 32], buckets: u64) -> u64 {
    let mut first = [0u8; 8];
    first.copy_from_slice(&hash[..8]);
    u64::from_be_bytes(first) % buckets
}

/// The aggregator opens a round.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoundAnnouncement {
    pub fleet: FleetId,
    pub round: RoundId,
    /// The model devices train from; updates must name its digest.
    pub base_model: ModelRef,
    pub config: RoundConfig,
    /// Updates arriving after this are refused.
    pub deadline_unix_ms: u64,
    pub selection: Selection,
}

impl RoundAnnouncement {
    /// When `device` starts on this round, in ms after it hears of it: a point in
    /// `[0, config.start_window_ms)` from a hash of the round and the device, so the selected
    /// devices spread evenly over the window, and one device picks the same point on every hearing.
    pub fn start_offset_ms(&self, device: &DeviceId) -> u64 {
        if self.config.start_window_ms == 0 {
            return 0;
        }
        let mut hasher = blake3::Hasher::new();
        hasher.update(b"fedfleet/start/v1\0");
        hasher.update(&self.round.0.to_be_bytes());
        hasher.update(device.as_str().as_bytes());
        bucket(hasher.finalize().as_bytes(), self.config.start_window_ms)
    }
}

/// The aggregator accepted an update. Signed by the aggregator, so a device can prove it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Receipt {
    pub fleet: FleetId,
    pub device: DeviceId,
    pub round: RoundId,
    pub nonce: [u8; 16],
    pub payload_digest: Digest,
    pub accepted_at_unix_ms: u64,
}

/// The receiver refused something; `reason` is the metric label, `detail` is for humans.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rejection {
    pub reason: RejectReason,
    pub detail: String,
}

impl Rejection {
    /// A rejection whose detail is cut to [`MAX_DETAIL_LEN`] bytes.
    pub fn new(reason: RejectReason, detail: impl Into<String>) -> Self {
        let mut detail = detail.into();
        if detail.len() > MAX_DETAIL_LEN {
            let mut end = MAX_DETAIL_LEN;
            while !detail.is_char_boundary(end) {
                end -= 1;
            }
            detail.truncate(end);
        }
        Rejection { reason, detail }
    }
}

/// What devices in a rollout phase should do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RolloutAction {
    /// Download, verify, health-check and activate the model.
    Install,
    /// Stop installing; keep what is active.
    Pause,
    /// Stop the rollout; devices that activated the model keep it until told otherwise.
    Abort,
    /// Go back to this model.
    RollBack { to: ModelRef },
}

/// Basis points in [`RolloutNotice::percent_bp`]: 10 000 is the whole fleet.
pub const BASIS_POINTS: u32 = 10_000;

/// The registry moves an alias to a model, phase by phase.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RolloutNotice {
    pub fleet: FleetId,
    pub rollout_id: u64,
    /// The alias being moved, e.g. "stable".
    pub alias: String,
    pub model: ModelRef,
    /// Artifact length, so a device can refuse endless data.
    pub length: u64,
    pub phase: u32,
    /// Share of the fleet in this phase, in basis points (100 = 1 %).
    pub percent_bp: u32,
    /// If set, only devices in this named cohort take part.
    pub cohort: Option<String>,
    pub action: RolloutAction,
    pub issued_at_unix_ms: u64,
}

/// A device's fixed rollout bucket in `0..10_000`. It depends only on the device id, so the same
/// devices are the first 1 % of every rollout and a growing phase only adds devices.
pub fn rollout_bucket(device: &DeviceId) -> u32 {
    let mut hasher = blake3::Hasher::new();
    hasher.update(b"fedfleet/rollout-bucket/v1\0");
    hasher.update(device.as_str().as_bytes());
    bucket(hasher.finalize().as_bytes(), u64::from(BASIS_POINTS)) as u32
}

impl RolloutNotice {
    /// Whether `device` (in `device_cohort`, if it has one) is part of this phase.
    pub fn includes(&self, device: &DeviceId, device_cohort: Option<&str>) -> bool {
        if let Some(cohort) = &self.cohort
            && device_cohort != Some(cohort.as_str())
        {
            return false;
        }
        rollout_bucket(device) < self.percent_bp
    }
}

/// Where a device is in training and in installing models.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum DeviceState {
    Idle,
    Training {
        round: RoundId,
    },
    Downloading,
    Downloaded,
    /// Length, digest and signed metadata checked.
    Verified,
    /// Health checks passed in the inactive slot.
    Healthy,
    Active,
    RolledBack {
        reason: String,
    },
    Failed {
        reason: String,
    },
    /// An install could not be written to the device's storage: nothing of it is kept, the
    /// active model serves on, and the device retries with backoff. A fault of the device, not
    /// a verdict on the model, so rollouts do not count it as a failure. (Appended: postcard.)
    InstallDeferred {
        fault: StorageFault,
        detail: String,
    },
}

/// Why a device's storage refused an install.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum StorageFault {
    /// No space left, or less than the artifact's signed length plus the agent's headroom.
    DiskFull,
    /// Any other I/O error.
    Io,
}

impl StorageFault {
    /// Stable snake_case name, for logs, metrics and the registry's device status.
    pub const fn as_str(self) -> &'static str {
        match self {
            StorageFault::DiskFull => "disk_full",
            StorageFault::Io => "io",
        }
    }
}

impl std::fmt::Display for StorageFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl DeviceState {
    /// Stable snake_case name for metrics.
    pub fn as_str(&self) -> &'static str {
        match self {
            DeviceState::Idle => "idle",
            DeviceState::Training { .. } => "training",
            DeviceState::Downloading => "downloading",
            DeviceState::Downloaded => "downloaded",
            DeviceState::Verified => "verified",
            DeviceState::Healthy => "healthy",
            DeviceState::Active => "active",
            DeviceState::RolledBack { .. } => "rolled_back",
            DeviceState::Failed { .. } => "failed",
            DeviceState::InstallDeferred { .. } => "install_deferred",
        }
    }
}

/// A device's heartbeat and status report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceStatus {
    pub fleet: FleetId,
    pub device: DeviceId,
    pub reported_at_unix_ms: u64,
    pub state: DeviceState,
    /// The model serving inference.
    pub active: Option<ModelRef>,
    /// The model in the inactive slot, if any.
    pub staged: Option<ModelRef>,
    pub rollout_id: Option<u64>,
}

/// Every control message. Append variants at the end only.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Message {
    RoundAnnouncement(RoundAnnouncement),
    Receipt(Receipt),
    Rejection(Rejection),
    Manifest(ModelInfo),
    Rollout(RolloutNotice),
    Status(DeviceStatus),
}

impl Message {
    pub fn encode(&self) -> Result<Vec<u8>, MessageError> {
        encode(self, MAX_MESSAGE_BYTES)
    }

    pub fn decode(bytes: &[u8]) -> Result<Message, MessageError> {
        decode(bytes, MAX_MESSAGE_BYTES)
    }
}

impl Signable for Receipt {
    const KIND: Kind = Kind::Receipt;

    fn canonical_bytes(&self) -> Vec<u8> {
        let mut w = CanonicalWriter::default();
        w.str(self.fleet.as_str());
        w.str(self.device.as_str());
        w.u64(self.round.0);
        w.bytes(&self.nonce);
        w.bytes(&self.payload_digest.0);
        w.u64(self.accepted_at_unix_ms);
        w.finish()
    }

    fn from_canonical_bytes(bytes: &[u8]) -> Result<Self, EnvelopeError> {
        let mut r = CanonicalReader::new(bytes);
        let receipt = Receipt {
            fleet: FleetId::new(r.str()?)?,
            device: DeviceId::new(r.str()?)?,
            round: RoundId(r.u64()?),
            nonce: r.array()?,
            payload_digest: r.digest()?,
            accepted_at_unix_ms: r.u64()?,
        };
        r.finish()?;
        Ok(receipt)
    }
}

macro_rules! postcard_signable {
    ($($ty:ty => $kind:expr,)*) => {$(
        impl Signable for $ty {
            const KIND: Kind = $kind;

            fn canonical_bytes(&self) -> Vec<u8> {
                postcard::to_stdvec(self).expect("postcard writes plain structs to a Vec without error")
            }

            fn from_canonical_bytes(bytes: &[u8]) -> Result<Self, EnvelopeError> {
                decode(bytes, Self::KIND.max_body_len()).map_err(|e| EnvelopeError::BadBody(e.to_string()))
            }
        }
    )*};
}

postcard_signable! {
    RoundAnnouncement => Kind::Round,
    RolloutNotice => Kind::Rollout,
    DeviceStatus => Kind::Status,
    ModelInfo => Kind::Manifest,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::Signed;
    use ed25519_dalek::SigningKey;

    fn model() -> ModelRef {
        ModelRef { name: "mnist-mlp".into(), version: ModelVersion(3), digest: Digest::of(b"model") }
    }

    pub(crate) fn samples() -> Vec<Message> {
        let fleet = FleetId::new("eu").unwrap();
        let device = DeviceId::new("cam-1").unwrap();
        vec![
            Message::RoundAnnouncement(RoundAnnouncement {
                fleet: fleet.clone(),
                round: RoundId(4),
                base_model: model(),
                config: RoundConfig { quantization: DType::I8, proximal_mu: 0.01, ..RoundConfig::default() },
                deadline_unix_ms: 1_700_000_000_000,
                selection: Selection::Sample { rate_ppm: 250_000, seed: 9 },
            }),
            Message::Receipt(Receipt {
                fleet: fleet.clone(),
                device: device.clone(),
                round: RoundId(4),
                nonce: [3; 16],
                payload_digest: Digest::of(b"p"),
                accepted_at_unix_ms: 5,
            }),
            Message::Rejection(Rejection::new(RejectReason::StaleRound, "round 3 is closed")),
            Message::Manifest(ModelInfo {
                name: "mnist-mlp".into(),
                version: ModelVersion(3),
                length: 1234,
                digest: Digest::of(b"model"),
                spec: crate::SpecJson(serde_json::json!({"arch": "mlp", "input": [1, 28, 28]})),
                parent: Some(ModelVersion(2)),
                metrics: [("accuracy".to_owned(), 0.97)].into_iter().collect(),
                created_at_unix_ms: 6,
                publisher: "aggregator-eu".into(),
                adapter: None,
            }),
            Message::Rollout(RolloutNotice {
                fleet: fleet.clone(),
                rollout_id: 1,
                alias: "stable".into(),
                model: model(),
                length: 1234,
                phase: 0,
                percent_bp: 100,
                cohort: None,
                action: RolloutAction::RollBack { to: model() },
                issued_at_unix_ms: 7,
            }),
            Message::Status(DeviceStatus {
                fleet,
                device,
                reported_at_unix_ms: 8,
                state: DeviceState::RolledBack { reason: "nan in output".into() },
                active: Some(model()),
                staged: None,
                rollout_id: Some(1),
            }),
        ]
    }

    #[test]
    fn messages_round_trip() {
        for message in samples() {
            let bytes = message.encode().unwrap();
            assert_eq!(Message::decode(&bytes).unwrap(), message);
            let mut long = bytes.clone();
            long.push(0);
            assert_eq!(Message::decode(&long), Err(MessageError::TrailingBytes(1)));
            assert!(Message::decode(&bytes[..bytes.len() - 1]).is_err());
        }
        assert!(matches!(decode::<Message>(&[0; 16], 8), Err(MessageError::TooLarge { .. })));
        assert!(matches!(encode(&samples()[0], 8), Err(MessageError::TooLarge { .. })));
    }

    #[test]
    fn start_offsets_spread_a_fleet_evenly_over_the_window() {
        let Message::RoundAnnouncement(mut a) = samples().remove(0) else { unreachable!() };
        let device = |i: usize| DeviceId::new(format!("dev-{i}")).unwrap();
        assert_eq!(a.start_offset_ms(&device(1)), 0, "no window: start at once");
        a.config.start_window_ms = 10_000;
        let mut per_second = [0u32; 10];
        for i in 0..10_000 {
            let offset = a.start_offset_ms(&device(i));
            assert!(offset < 10_000);
            assert_eq!(offset, a.start_offset_ms(&device(i)), "the same point on every hearing");
            per_second[(offset / 1_000) as usize] += 1;
        }
        // 1,000 a second expected; a binomial's spread is about 30.
        assert!(per_second.iter().all(|&n| (850..1_150).contains(&n)), "{per_second:?}");
        let next = RoundAnnouncement { round: RoundId(5), ..a.clone() };
        assert_ne!(
            (0..10).map(|i| a.start_offset_ms(&device(i))).collect::<Vec<_>>(),
            (0..10).map(|i| next.start_offset_ms(&device(i))).collect::<Vec<_>>(),
            "another round, other points"
        );
    }

    #[test]
    fn decoding_validates_ids() {
        // A status whose device id has a '/' in it: ids are checked while decoding.
        let Message::Status(mut status) = samples().pop().unwrap() else { unreachable!() };
        status.rollout_id = None;
        let mut bytes = encode(&status, 1024).unwrap();
        let at = bytes.iter().position(|&b| b == b'c').unwrap();
        bytes[at] = b'/';
        assert!(matches!(decode::<DeviceStatus>(&bytes, 1024), Err(MessageError::Malformed(_))));
    }

    #[test]
    fn signed_control_messages_verify() {
        let key = SigningKey::from_bytes(&[9; 32]);
        for message in samples() {
            let ok = match message {
                Message::RoundAnnouncement(m) => check(m, &key),
                Message::Receipt(m) => check(m, &key),
                Message::Manifest(m) => check(m, &key),
                Message::Rollout(m) => check(m, &key),
                Message::Status(m) => check(m, &key),
                Message::Rejection(_) => true,
            };
            assert!(ok);
        }
        fn check<T: Signable + PartialEq + std::fmt::Debug>(body: T, key: &SigningKey) -> bool {
            let signed = Signed::sign(body, key);
            let decoded = Signed::<T>::decode(&signed.encode()).unwrap();
            decoded.verify(&key.verifying_key()).unwrap() == signed.body()
        }
    }

    #[test]
    fn receipt_canonical_golden_bytes() {
        let Message::Receipt(receipt) = &samples()[1] else { unreachable!() };
        let expected = concat!(
            "0002",
            "6575", // fleet "eu"
            "0005",
            "63616d2d31",                       // device "cam-1"
            "0000000000000004",                 // round
            "03030303030303030303030303030303", // nonce
        );
        let bytes = hex::encode(receipt.canonical_bytes());
        assert!(bytes.starts_with(expected));
        assert!(bytes.ends_with(&format!("{}0000000000000005", Digest::of(b"p").to_hex())));
        assert_eq!(bytes.len(), (4 + 7 + 8 + 16 + 32 + 8) * 2);
    }

    #[test]
    fn sampling_and_rollout_buckets_are_deterministic() {
        let devices: Vec<DeviceId> = (0..2000).map(|i| DeviceId::new(format!("dev-{i}")).unwrap()).collect();
        let quarter = Selection::Sample { rate_ppm: PPM / 4, seed: 1 };
        let chosen = devices.iter().filter(|d| quarter.selects(d)).count();
        assert!((400..600).contains(&chosen), "{chosen}");
        assert!(devices.iter().all(|d| { Selection::Sample { rate_ppm: PPM, seed: 1 }.selects(d) }));
        assert!(!devices.iter().any(|d| { Selection::Sample { rate_ppm: 0, seed: 1 }.selects(d) }));

        let Message::Rollout(mut notice) = samples()[4].clone() else { unreachable!() };
        notice.percent_bp = 1_000;
        let in_ten: Vec<_> = devices.iter().filter(|d| notice.includes(d, None)).collect();
        assert!((120..280).contains(&in_ten.len()), "{}", in_ten.len());
        notice.percent_bp = 5_000;
        assert!(in_ten.iter().all(|d| notice.includes(d, None)), "growing a phase only adds devices");
        notice.cohort = Some("lab".into());
        assert!(!devices.iter().any(|d| notice.includes(d, Some("field"))));
        assert_eq!(rollout_bucket(&devices[0]), rollout_bucket(&devices[0].clone()));
    }

    #[test]
    fn rejection_detail_is_bounded() {
        let r = Rejection::new(RejectReason::Internal, "é".repeat(MAX_DETAIL_LEN));
        assert!(r.detail.len() <= MAX_DETAIL_LEN);
    }
}
