//! Signed model metadata in the spirit of TUF, and the client-side verifier agents use.
//!
//! # Roles
//! - **root** ([`Root`]): the keys and thresholds of every role (root itself, `targets`,
//!   `timestamp`), a version and an expiry. Pinned on the device at enrollment. A new root version
//!   must be signed by a threshold of the *old* root's root keys **and** a threshold of its *own*
//!   root keys; this is how keys (any role's) are rotated.
//! - **targets** ([`Targets`]): every installable model version as a [`ModelInfo`] (length,
//!   digest, spec, metrics, parent, publisher, adapter lineage). Signed offline or by the
//!   publisher key.
//! - **timestamp** ([`Timestamp`]): the version, length and digest of the current targets
//!   metadata; signed by an online key with a short expiry, so a frozen mirror is noticed quickly.
//!
//! # Bytes that are signed
//! Each metadata body is serialized once, by its signer, with `serde_json::to_string` (struct
//! fields in declaration order, every map a `BTreeMap` so keys are sorted, no whitespace; floats
//! in serde_json's shortest round-trip form). That text travels verbatim in [`SignedMetadata::signed`];
//! signatures are Ed25519 over
//!
//! ```text
//! "fedfleet/tuf/<role>/v1\0" || signed-text
//! ```
//!
//! so a signature for one role can never be replayed as another. Verifiers check signatures over
//! the exact received text and only then parse it: they never re-serialize, so the canonical form
//! only matters for reproducibility (same body → same bytes → same digest in the timestamp).
//! Verification uses `verify_strict` (no malleable or small-order signatures) and weak keys are
//! refused in a root. A key id is `hex(blake3(public key bytes))`.
//!
//! # The verifier
//! [`Verifier`] is pure: it reads no clock and does no I/O; `now` (unix ms) is passed in. It
//! holds the pinned root and the last trusted timestamp and targets, is serializable so the agent
//! can persist it, and refuses with a named [`TufError`] reason: bad signature, under-threshold
//! signatures, expired metadata (freeze), a version lower than the last trusted (rollback), a
//! root rotation not signed by the old root or by the new root's threshold, targets that do not
//! match the timestamp, and artifacts whose length or digest differ.
//!
//! Update order is TUF's: [`Verifier::update_root`] (each next version in turn), then
//! [`Verifier::update_timestamp`], then [`Verifier::update_targets`], then
//! [`Verifier::verify_artifact`]. When a root rotation changes the timestamp keys, the trusted
//! timestamp is dropped along with its version floor (TUF's recovery from a fast-forward attack
//! with a compromised key); when it changes the targets keys, the trusted targets body is dropped
//! (it was signed by the old keys) but its version floor is kept.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::marker::PhantomData;

use crate::{Digest, ModelVersion};
use ed25519_dalek::{Signer, SigningKey, VerifyingKey};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::model::ModelInfo;
use crate::serde_hex;

/// A metadata role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Root,
    Targets,
    Timestamp,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Root => "root",
            Role::Targets => "targets",
            Role::Timestamp => "timestamp",
        }
    }

    /// The signature domain: `fedfleet/tuf/<role>/v1\0`.
    pub fn domain(self) -> Vec<u8> {
        format!("fedfleet/tuf/{}/v1\0", self.as_str()).into_bytes()
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `hex(blake3(public key))`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct KeyId(pub String);

impl KeyId {
    pub fn of(key: &VerifyingKey) -> KeyId {
        KeyId(Digest::of(key.as_bytes()).to_hex())
    }
}

impl fmt::Display for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A public key as listed in a root.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PublicKey {
    /// Always `"ed25519"`.
    pub scheme: String,
    #[serde(with = "serde_hex::bytes32")]
    pub public: [u8; 32],
}

impl PublicKey {
    pub fn ed25519(key: &VerifyingKey) -> Self {
        PublicKey { scheme: "ed25519".into(), public: key.to_bytes() }
    }

    pub fn key_id(&self) -> KeyId {
        KeyId(Digest::of(&self.public).to_hex())
    }
}

/// Which keys may sign for a role, and how many must.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoleKeys {
    pub keyids: BTreeSet<KeyId>,
    pub threshold: u32,
}

impl RoleKeys {
    pub fn new(keys: &[&VerifyingKey], threshold: u32) -> Self {
        RoleKeys { keyids: keys.iter().map(|k| KeyId::of(k)).collect(), threshold }
    }

    /// Counts the valid signatures over `msg` (strict ed25519, public keys from `root`) by
    /// distinct keys of this role. Signatures by other keys are ignored; the first of this role's
    /// keys whose signature does not verify (or is not 64 bytes) is remembered for the error.
    pub fn count_signatures<'a>(
        &self,
        root: &Root,
        msg: &[u8],
        signatures: impl IntoIterator<Item = (&'a KeyId, &'a [u8])>,
    ) -> SignatureCount {
        let mut valid = BTreeSet::new();
        let mut bad = None;
        for (keyid, sig) in signatures {
            if !self.keyids.contains(keyid) || valid.contains(keyid) {
                continue;
            }
            let ok = <[u8; 64]>::try_from(sig).is_ok_and(|sig| {
                root.keys
                    .get(keyid)
                    .and_then(|k| VerifyingKey::from_bytes(&k.public).ok())
                    .is_some_and(|vk| vk.verify_strict(msg, &ed25519_dalek::Signature::from_bytes(&sig)).is_ok())
            });
            if ok {
                valid.insert(keyid.clone());
            } else if bad.is_none() {
                bad = Some(keyid.clone());
            }
        }
        SignatureCount { valid: valid.len() as u32, threshold: self.threshold, bad }
    }
}

/// The root of trust.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Root {
    pub version: u64,
    /// Unix ms; expired when `now >= expires`.
    pub expires: u64,
    pub keys: BTreeMap<KeyId, PublicKey>,
    pub root: RoleKeys,
    pub targets: RoleKeys,
    pub timestamp: RoleKeys,
}

impl Root {
    /// A root listing exactly the keys of the three roles.
    pub fn new(
        version: u64,
        expires: u64,
        root: (&[&VerifyingKey], u32),
        targets: (&[&VerifyingKey], u32),
        timestamp: (&[&VerifyingKey], u32),
    ) -> Self {
        let mut keys = BTreeMap::new();
        for k in root.0.iter().chain(targets.0).chain(timestamp.0) {
            keys.insert(KeyId::of(k), PublicKey::ed25519(k));
        }
        Root {
            version,
            expires,
            keys,
            root: RoleKeys::new(root.0, root.1),
            targets: RoleKeys::new(targets.0, targets.1),
            timestamp: RoleKeys::new(timestamp.0, timestamp.1),
        }
    }

    pub fn role(&self, role: Role) -> &RoleKeys {
        match role {
            Role::Root => &self.root,
            Role::Targets => &self.targets,
            Role::Timestamp => &self.timestamp,
        }
    }

    /// Structural checks: thresholds in 1..=keys, key ids match keys, every role key listed,
    /// no weak keys.
    pub fn validate(&self) -> Result<(), TufError> {
        let bad = |s: String| Err(TufError::InvalidRoot(s));
        for (id, k) in &self.keys {
            if k.scheme != "ed25519" {
                return bad(format!("key {id} has unsupported scheme {:?}", k.scheme));
            }
            if &k.key_id() != id {
                return bad(format!("key id {id} does not match its key"));
            }
            match VerifyingKey::from_bytes(&k.public) {
                Ok(vk) if !vk.is_weak() => {}
                _ => return bad(format!("key {id} is not a valid strong ed25519 key")),
            }
        }
        for role in [Role::Root, Role::Targets, Role::Timestamp] {
            let rk = self.role(role);
            if rk.threshold == 0 || rk.threshold as usize > rk.keyids.len() {
                return bad(format!("{role} threshold {} with {} keys", rk.threshold, rk.keyids.len()));
            }
            if let Some(id) = rk.keyids.iter().find(|id| !self.keys.contains_key(*id)) {
                return bad(format!("{role} names key {id} which the root does not list"));
            }
        }
        Ok(())
    }
}

/// The list of installable versions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Targets {
    pub version: u64,
    pub expires: u64,
    pub targets: Vec<ModelInfo>,
}

impl Targets {
    pub fn get(&self, name: &str, version: ModelVersion) -> Option<&ModelInfo> {
        self.targets.iter().find(|t| t.name == name && t.version == version)
    }
}

/// Version, length and digest of a signed metadata text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetaRef {
    pub version: u64,
    pub length: u64,
    pub digest: Digest,
}

/// Short-lived pointer to the current targets.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Timestamp {
    pub version: u64,
    pub expires: u64,
    pub targets: MetaRef,
}

impl SignedMetadata<Root> {
    /// A version-1 root naming one key per role (threshold 1), signed by its root key: what
    /// `fedfleet-registry init-keys` writes, and what the tests' and the simulator's registries pin.
    pub fn single_key_root(expires: u64, root: &SigningKey, targets: &VerifyingKey, timestamp: &VerifyingKey) -> Self {
        let body = Root::new(1, expires, (&[&root.verifying_key()], 1), (&[targets], 1), (&[timestamp], 1));
        SignedMetadata::sign(&body, &[root])
    }
}

/// `models` as targets `version` signed by `targets_key`, and the timestamp of the same version
/// naming them signed by `timestamp_key`, both expiring at `expires`: one publication of an
/// in-memory registry (the service itself re-signs through its `MetadataSigner`).
pub fn sign_targets_and_timestamp(
    version: u64,
    expires: u64,
    models: Vec<ModelInfo>,
    targets_key: &SigningKey,
    timestamp_key: &SigningKey,
) -> (SignedMetadata<Targets>, SignedMetadata<Timestamp>) {
    let targets = SignedMetadata::sign(&Targets { version, expires, targets: models }, &[targets_key]);
    let ts = Timestamp::for_targets(version, expires, &targets).expect("targets just signed parse");
    (targets, SignedMetadata::sign(&ts, &[timestamp_key]))
}

impl Timestamp {
    /// A timestamp pointing at `targets`.
    pub fn for_targets(version: u64, expires: u64, targets: &SignedMetadata<Targets>) -> Result<Self, TufError> {
        let body = targets.body_unverified()?;
        Ok(Timestamp {
            version,
            expires,
            targets: MetaRef { version: body.version, length: targets.signed.len() as u64, digest: Digest::of(targets.signed.as_bytes()) },
        })
    }
}

/// A metadata body.
pub trait Metadata: Serialize + DeserializeOwned {
    const ROLE: Role;
    fn version(&self) -> u64;
    fn expires(&self) -> u64;
}

impl Metadata for Root {
    const ROLE: Role = Role::Root;
    fn version(&self) -> u64 {
        self.version
    }
    fn expires(&self) -> u64 {
        self.expires
    }
}
impl Metadata for Targets {
    const ROLE: Role = Role::Targets;
    fn version(&self) -> u64 {
        self.version
    }
    fn expires(&self) -> u64 {
        self.expires
    }
}
impl Metadata for Timestamp {
    const ROLE: Role = Role::Timestamp;
    fn version(&self) -> u64 {
        self.version
    }
    fn expires(&self) -> u64 {
        self.expires
    }
}

/// One signature.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Signature {
    pub keyid: KeyId,
    #[serde(with = "serde_hex::bytes64")]
    pub sig: [u8; 64],
}

/// A metadata body's exact JSON text plus signatures over it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(bound = "")]
pub struct SignedMetadata<T> {
    /// The body as serialized by the signer. Signatures cover `role.domain() || signed`.
    pub signed: String,
    pub signatures: Vec<Signature>,
    #[serde(skip)]
    _body: PhantomData<fn() -> T>,
}

impl<T: Metadata> SignedMetadata<T> {
    /// Serializes `body` (canonical form, see the module docs), unsigned.
    pub fn new(body: &T) -> Self {
        SignedMetadata { signed: serde_json::to_string(body).expect("metadata serializes"), signatures: Vec::new(), _body: PhantomData }
    }

    /// Serializes and signs with every key given.
    pub fn sign(body: &T, keys: &[&SigningKey]) -> Self {
        let mut s = Self::new(body);
        for k in keys {
            s.add_signature(k);
        }
        s
    }

    /// The bytes a signature covers.
    pub fn message(&self) -> Vec<u8> {
        let mut m = T::ROLE.domain();
        m.extend_from_slice(self.signed.as_bytes());
        m
    }

    /// Adds (or replaces) the signature of `key`.
    pub fn add_signature(&mut self, key: &SigningKey) {
        let keyid = KeyId::of(&key.verifying_key());
        let sig = key.sign(&self.message()).to_bytes();
        self.signatures.retain(|s| s.keyid != keyid);
        self.signatures.push(Signature { keyid, sig });
    }

    /// Parses the body **without** checking signatures (for signers and tools).
    pub fn body_unverified(&self) -> Result<T, TufError> {
        serde_json::from_str(&self.signed).map_err(|e| TufError::Malformed { role: T::ROLE, detail: e.to_string() })
    }

    /// Counts valid signatures over this metadata by distinct keys of `role` listed in `root`.
    fn check(&self, root: &Root, role: &RoleKeys) -> SignatureCount {
        role.count_signatures(root, &self.message(), self.signatures.iter().map(|s| (&s.keyid, &s.sig[..])))
    }
}

/// What [`RoleKeys::count_signatures`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignatureCount {
    /// Distinct role keys with a valid signature.
    pub valid: u32,
    pub threshold: u32,
    /// The first role key whose signature did not verify.
    pub bad: Option<KeyId>,
}

impl SignatureCount {
    fn into_result(self, role: Role) -> Result<(), TufError> {
        if self.valid >= self.threshold {
            return Ok(());
        }
        match self.bad {
            Some(keyid) => Err(TufError::BadSignature { role, keyid }),
            None => Err(TufError::UnderThreshold { role, valid: self.valid, threshold: self.threshold }),
        }
    }
}

/// Why metadata or an artifact was refused. Each variant is one named reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TufError {
    #[error("{role} metadata does not parse: {detail}")]
    Malformed { role: Role, detail: String },
    #[error("invalid root: {0}")]
    InvalidRoot(String),
    #[error("bad signature on {role} metadata by key {keyid}")]
    BadSignature { role: Role, keyid: KeyId },
    #[error("{role} metadata has {valid} valid signature(s), {threshold} required")]
    UnderThreshold { role: Role, valid: u32, threshold: u32 },
    #[error("new root is not signed by the trusted root's threshold ({valid} of {threshold})")]
    RootNotSignedByOldRoot { valid: u32, threshold: u32 },
    #[error("new root is not signed by its own root threshold ({valid} of {threshold})")]
    RootNotSignedByNewRoot { valid: u32, threshold: u32 },
    #[error("root v{got} skips versions after trusted v{trusted}; apply them in order")]
    RootVersionSkipped { trusted: u64, got: u64 },
    #[error("{role} metadata expired at {expires} (now {now}): possible freeze attack")]
    Expired { role: Role, expires: u64, now: u64 },
    #[error("{role} metadata v{got} is older than trusted v{trusted}: rollback")]
    Rollback { role: Role, trusted: u64, got: u64 },
    #[error("{role} metadata v{version} differs from the trusted metadata of the same version")]
    VersionReused { role: Role, version: u64 },
    #[error("no trusted {role} metadata yet")]
    Missing { role: Role },
    #[error("targets metadata does not match the timestamp: {detail}")]
    TargetsMismatchTimestamp { detail: String },
    #[error("no target {name} v{version} in the trusted targets")]
    UnknownTarget { name: String, version: ModelVersion },
    #[error("artifact is {got} bytes, targets say {expected}")]
    LengthMismatch { expected: u64, got: u64 },
    #[error("artifact digest {got} differs from the targets' {expected}")]
    DigestMismatch { expected: Digest, got: Digest },
}

/// Client-side verifier state. Pure: no clock, no I/O. Serializable for persistence.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Verifier {
    root: Root,
    root_signed: SignedMetadata<Root>,
    timestamp: Option<Timestamp>,
    targets: Option<Targets>,
    /// Highest timestamp / targets versions ever trusted (rollback floors).
    timestamp_floor: u64,
    targets_floor: u64,
}

impl Verifier {
    /// Trusts a pinned root (shipped at enrollment). It must be valid and signed by its own root
    /// threshold; its expiry is checked when metadata is updated, not here, so an expired pinned
    /// root can still be rotated forward.
    pub fn new(pinned: SignedMetadata<Root>) -> Result<Self, TufError> {
        let root = pinned.body_unverified()?;
        root.validate()?;
        pinned.check(&root, &root.root).into_result(Role::Root)?;
        Ok(Verifier { root, root_signed: pinned, timestamp: None, targets: None, timestamp_floor: 0, targets_floor: 0 })
    }

    pub fn root(&self) -> &Root {
        &self.root
    }

    /// The signed form of the trusted root (for persistence or handing to a peer).
    pub fn root_signed(&self) -> &SignedMetadata<Root> {
        &self.root_signed
    }

    pub fn timestamp(&self) -> Option<&Timestamp> {
        self.timestamp.as_ref()
    }

    pub fn targets(&self) -> Option<&Targets> {
        self.targets.as_ref()
    }

    /// Moves to the next root version. It must be exactly `trusted + 1`, signed by a threshold of
    /// the trusted root's root keys and by a threshold of its own root keys. Returns `false` when
    /// it is the trusted root itself.
    pub fn update_root(&mut self, new: &SignedMetadata<Root>) -> Result<bool, TufError> {
        let body = new.body_unverified()?;
        if body.version <= self.root.version {
            if body.version == self.root.version && new.signed == self.root_signed.signed {
                return Ok(false);
            }
            if body.version == self.root.version {
                return Err(TufError::VersionReused { role: Role::Root, version: body.version });
            }
            return Err(TufError::Rollback { role: Role::Root, trusted: self.root.version, got: body.version });
        }
        if body.version != self.root.version + 1 {
            return Err(TufError::RootVersionSkipped { trusted: self.root.version, got: body.version });
        }
        let old = new.check(&self.root, &self.root.root);
        if old.valid < old.threshold {
            return Err(TufError::RootNotSignedByOldRoot { valid: old.valid, threshold: old.threshold });
        }
        body.validate()?;
        let own = new.check(&body, &body.root);
        if own.valid < own.threshold {
            return Err(TufError::RootNotSignedByNewRoot { valid: own.valid, threshold: own.threshold });
        }
        if body.timestamp != self.root.timestamp {
            self.timestamp = None;
            self.timestamp_floor = 0;
        }
        if body.targets != self.root.targets {
            self.targets = None;
        }
        self.root = body;
        self.root_signed = new.clone();
        Ok(true)
    }

    fn fresh(role: Role, expires: u64, now: u64) -> Result<(), TufError> {
        if now >= expires {
            return Err(TufError::Expired { role, expires, now });
        }
        Ok(())
    }

    /// Accepts a new timestamp. Returns `false` when it is the trusted one again.
    pub fn update_timestamp(&mut self, new: &SignedMetadata<Timestamp>, now: u64) -> Result<bool, TufError> {
        Self::fresh(Role::Root, self.root.expires, now)?;
        new.check(&self.root, &self.root.timestamp).into_result(Role::Timestamp)?;
        let body = new.body_unverified()?;
        if body.version < self.timestamp_floor {
            return Err(TufError::Rollback { role: Role::Timestamp, trusted: self.timestamp_floor, got: body.version });
        }
        if let Some(t) = &self.timestamp
            && body.version == t.version
        {
            if &body != t {
                return Err(TufError::VersionReused { role: Role::Timestamp, version: body.version });
            }
            Self::fresh(Role::Timestamp, body.expires, now)?;
            return Ok(false);
        }
        if body.targets.version < self.targets_floor {
            return Err(TufError::Rollback { role: Role::Targets, trusted: self.targets_floor, got: body.targets.version });
        }
        Self::fresh(Role::Timestamp, body.expires, now)?;
        self.timestamp_floor = body.version;
        // Targets the new timestamp no longer names are no longer current.
        if self.targets.as_ref().is_some_and(|t| t.version != body.targets.version) {
            self.targets = None;
        }
        self.timestamp = Some(body);
        Ok(true)
    }

    /// Accepts the targets the trusted timestamp points at. Returns `false` when they are the
    /// trusted ones again.
    pub fn update_targets(&mut self, new: &SignedMetadata<Targets>, now: u64) -> Result<bool, TufError> {
        Self::fresh(Role::Root, self.root.expires, now)?;
        let ts = self.timestamp.as_ref().ok_or(TufError::Missing { role: Role::Timestamp })?;
        Self::fresh(Role::Timestamp, ts.expires, now)?;
        let want = ts.targets;
        if new.signed.len() as u64 != want.length {
            return Err(TufError::TargetsMismatchTimestamp {
                detail: format!("length {} but timestamp says {}", new.signed.len(), want.length),
            });
        }
        let got = Digest::of(new.signed.as_bytes());
        if got != want.digest {
            return Err(TufError::TargetsMismatchTimestamp { detail: format!("digest {got} but timestamp says {}", want.digest) });
        }
        new.check(&self.root, &self.root.targets).into_result(Role::Targets)?;
        let body = new.body_unverified()?;
        if body.version != want.version {
            return Err(TufError::TargetsMismatchTimestamp {
                detail: format!("version {} but timestamp says {}", body.version, want.version),
            });
        }
        if body.version < self.targets_floor {
            return Err(TufError::Rollback { role: Role::Targets, trusted: self.targets_floor, got: body.version });
        }
        Self::fresh(Role::Targets, body.expires, now)?;
        let changed = self.targets.as_ref() != Some(&body);
        self.targets_floor = body.version;
        self.targets = Some(body);
        Ok(changed)
    }

    /// The trusted target `name`/`version`, if all trusted metadata is still fresh at `now`.
    /// Use its `length` to cap a download (endless-data attack).
    pub fn target(&self, name: &str, version: ModelVersion, now: u64) -> Result<&ModelInfo, TufError> {
        Self::fresh(Role::Root, self.root.expires, now)?;
        let ts = self.timestamp.as_ref().ok_or(TufError::Missing { role: Role::Timestamp })?;
        Self::fresh(Role::Timestamp, ts.expires, now)?;
        let tg = self.targets.as_ref().ok_or(TufError::Missing { role: Role::Targets })?;
        Self::fresh(Role::Targets, tg.expires, now)?;
        tg.get(name, version).ok_or_else(|| TufError::UnknownTarget { name: name.to_owned(), version })
    }

    /// Checks a downloaded artifact against the trusted targets.
    pub fn verify_artifact(&self, name: &str, version: ModelVersion, bytes: &[u8], now: u64) -> Result<&ModelInfo, TufError> {
        let t = self.target(name, version, now)?;
        if bytes.len() as u64 != t.length {
            return Err(TufError::LengthMismatch { expected: t.length, got: bytes.len() as u64 });
        }
        self.verify_artifact_digest(name, version, t.length, Digest::of(bytes), now)
    }

    /// Checks an artifact's length and digest (computed while streaming) against the trusted
    /// targets.
    pub fn verify_artifact_digest(
        &self,
        name: &str,
        version: ModelVersion,
        length: u64,
        digest: Digest,
        now: u64,
    ) -> Result<&ModelInfo, TufError> {
        let t = self.target(name, version, now)?;
        if length != t.length {
            return Err(TufError::LengthMismatch { expected: t.length, got: length });
        }
        if digest != t.digest {
            return Err(TufError::DigestMismatch { expected: t.digest, got: digest });
        }
        Ok(t)
    }
}
