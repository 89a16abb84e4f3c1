//! In-memory aggregator and registry for tests, simulation and the demo. They keep the services'
//! contracts that the agent relies on: the aggregator verifies signatures and payload digests
//! (when it knows the device key), answers a resend of an accepted update with `Replay`, and can
//! be told to fail or to lose receipts; the registry signs TUF metadata with its own keys.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::Mutex;

use ed25519_dalek::{SigningKey, VerifyingKey};
use fedfleet_protocol::tuf::{Root, SignedMetadata, sign_targets_and_timestamp};
use fedfleet_protocol::{
    DeviceId, DeviceStatus, Digest, FleetId, ModelRef, ModelVersion, Receipt, RejectReason, Rejection, RolloutAction, RolloutNotice,
    RoundAnnouncement, RoundId, SignedUpdate, verify_payload,
};
use fedfleet_protocol::{ModelInfo, SpecJson};

use fedfleet_agent::clients::{Aggregator, BaseModel, MetadataSet, Registry, TransportError, UploadReply};

/// A fault injected into the next upload.
#[derive(Debug, Clone, PartialEq)]
pub enum UploadFault {
    /// Fail before the aggregator sees the update.
    Transport,
    /// Accept the update but lose the reply.
    LoseReceipt,
    /// Answer with this rejection.
    Reject(RejectReason),
}

#[derive(Default)]
struct AggInner {
    round: Option<RoundAnnouncement>,
    base: HashMap<Digest, BaseModel>,
    keys: HashMap<DeviceId, VerifyingKey>,
    faults: VecDeque<UploadFault>,
    seen: HashSet<(DeviceId, RoundId, [u8; 16])>,
    accepted: Vec<(SignedUpdate, Vec<u8>)>,
    attempts: usize,
}

/// In-memory aggregator.
#[derive(Default)]
pub struct FakeAggregator {
    inner: Mutex<AggInner>,
}

impl FakeAggregator {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn set_round(&self, r: Option<RoundAnnouncement>) {
        self.inner.lock().unwrap().round = r;
    }
    /// Makes a base model fetchable; returns its digest.
    pub fn add_base_model(&self, spec: &str, bytes: Vec<u8>) -> Digest {
        let d = Digest::of(&bytes);
        self.inner.lock().unwrap().base.insert(d, BaseModel { spec: spec.to_owned(), bytes });
        d
    }
    /// Enrolls a device key: its uploads are then signature-checked.
    pub fn enroll(&self, device: DeviceId, key: VerifyingKey) {
        self.inner.lock().unwrap().keys.insert(device, key);
    }
    pub fn push_fault(&self, f: UploadFault) {
        self.inner.lock().unwrap().faults.push_back(f);
    }
    /// Accepted updates (each exactly once).
    pub fn accepted(&self) -> Vec<(SignedUpdate, Vec<u8>)> {
        self.inner.lock().unwrap().accepted.clone()
    }
    /// Upload calls seen, including failed ones.
    pub fn attempts(&self) -> usize {
        self.inner.lock().unwrap().attempts
    }
    /// Takes the accepted updates out (for a simulated aggregation step).
    pub fn drain_accepted(&self) -> Vec<(SignedUpdate, Vec<u8>)> {
        std::mem::take(&mut self.inner.lock().unwrap().accepted)
    }

    fn ingest(inner: &mut AggInner, header: &[u8], payload: &[u8]) -> UploadReply {
        let rej = |r: RejectReason, d: &str| UploadReply::Rejected(Rejection::new(r, d));
        let signed = match SignedUpdate::decode(header) {
            Ok(s) => s,
            Err(e) => return rej(e.reason(), &e.to_string()),
        };
        let h = signed.body().clone();
        if let Some(k) = inner.keys.get(&h.device)
            && let Err(e) = signed.verify(k)
        {
            return rej(e.reason(), &e.to_string());
        }
        if let Err(e) = verify_payload(&h, payload) {
            return rej(e.reason(), &e.to_string());
        }
        match &inner.round {
            Some(r) if r.round == h.round => {}
            _ => return rej(RejectReason::StaleRound, "round not open"),
        }
        if !inner.seen.insert((h.device.clone(), h.round, h.nonce)) {
            return rej(RejectReason::Replay, "already accepted");
        }
        inner.accepted.push((signed, payload.to_vec()));
        UploadReply::Receipt(Receipt {
            fleet: h.fleet,
            device: h.device,
            round: h.round,
            nonce: h.nonce,
            payload_digest: h.payload_digest,
            accepted_at_unix_ms: 0,
        })
    }
}

impl Aggregator for FakeAggregator {
    async fn current_round(&self, fleet: &FleetId) -> Result<Option<RoundAnnouncement>, TransportError> {
        Ok(self.inner.lock().unwrap().round.clone().filter(|r| &r.fleet == fleet))
    }
    async fn fetch_base_model(&self, model: &ModelRef) -> Result<BaseModel, TransportError> {
        self.inner.lock().unwrap().base.get(&model.digest).cloned().ok_or_else(|| TransportError(format!("no base model {}", model.digest)))
    }
    async fn upload(&self, header: &[u8], payload: &[u8]) -> Result<UploadReply, TransportError> {
        let mut inner = self.inner.lock().unwrap();
        inner.attempts += 1;
        match inner.faults.pop_front() {
            Some(UploadFault::Transport) => Err(TransportError("connection reset (injected)".into())),
            Some(UploadFault::LoseReceipt) => {
                let _ = Self::ingest(&mut inner, header, payload);
                Err(TransportError("connection lost before the receipt (injected)".into()))
            }
            Some(UploadFault::Reject(r)) => Ok(UploadReply::Rejected(Rejection::new(r, "injected"))),
            None => Ok(Self::ingest(&mut inner, header, payload)),
        }
    }
}

struct RegInner {
    root_key: SigningKey,
    targets_key: SigningKey,
    timestamp_key: SigningKey,
    root: SignedMetadata<Root>,
    targets: Vec<ModelInfo>,
    artifacts: BTreeMap<(String, ModelVersion), Vec<u8>>,
    meta_version: u64,
    /// Expiry of targets and timestamp.
    expires: u64,
    /// Sign the targets with a key the root does not trust.
    forge_targets: bool,
    assignments: HashMap<DeviceId, RolloutNotice>,
    broadcast: Option<RolloutNotice>,
    download_faults: usize,
    /// Report calls still to fail (and not record).
    report_faults: usize,
    corrupt_downloads: bool,
    reports: Vec<DeviceStatus>,
    downloaded_bytes: u64,
}

/// In-memory registry with real TUF signing.
pub struct FakeRegistry {
    inner: Mutex<RegInner>,
}

impl FakeRegistry {
    /// Keys derived from `seed`; metadata expires at `expires` (unix ms).
    pub fn new(seed: u8, expires: u64) -> Self {
        let root_key = SigningKey::from_bytes(&[seed.wrapping_add(1); 32]);
        let targets_key = SigningKey::from_bytes(&[seed.wrapping_add(2); 32]);
        let timestamp_key = SigningKey::from_bytes(&[seed.wrapping_add(3); 32]);
        let root = SignedMetadata::single_key_root(expires, &root_key, &targets_key.verifying_key(), &timestamp_key.verifying_key());
        FakeRegistry {
            inner: Mutex::new(RegInner {
                root_key,
                targets_key,
                timestamp_key,
                root,
                targets: Vec::new(),
                artifacts: BTreeMap::new(),
                meta_version: 0,
                expires,
                forge_targets: false,
                assignments: HashMap::new(),
                broadcast: None,
                download_faults: 0,
                report_faults: 0,
                corrupt_downloads: false,
                reports: Vec::new(),
                downloaded_bytes: 0,
            }),
        }
    }

    /// The root to pin at enrollment.
    pub fn pinned_root(&self) -> SignedMetadata<Root> {
        self.inner.lock().unwrap().root.clone()
    }

    /// Publishes a version; returns its reference.
    pub fn publish(&self, name: &str, spec_json: &str, bytes: Vec<u8>) -> ModelRef {
        let mut i = self.inner.lock().unwrap();
        let version = ModelVersion(i.targets.iter().filter(|t| t.name == name).count() as u64 + 1);
        let digest = Digest::of(&bytes);
        i.targets.push(ModelInfo {
            name: name.to_owned(),
            version,
            length: bytes.len() as u64,
            digest,
            spec: SpecJson(serde_json::from_str(spec_json).expect("spec is JSON")),
            parent: None,
            metrics: BTreeMap::new(),
            created_at_unix_ms: 0,
            publisher: String::new(),
            adapter: None,
        });
        i.artifacts.insert((name.to_owned(), version), bytes);
        i.meta_version += 1;
        ModelRef { name: name.to_owned(), version, digest }
    }

    /// A notice installing `model` on the whole fleet.
    pub fn notice(fleet: &FleetId, rollout_id: u64, model: &ModelRef) -> RolloutNotice {
        RolloutNotice {
            fleet: fleet.clone(),
            rollout_id,
            alias: "stable".into(),
            model: model.clone(),
            length: 0,
            phase: 1,
            percent_bp: fedfleet_protocol::messages::BASIS_POINTS,
            cohort: None,
            action: RolloutAction::Install,
            issued_at_unix_ms: 0,
        }
    }

    pub fn assign(&self, device: DeviceId, notice: RolloutNotice) {
        self.inner.lock().unwrap().assignments.insert(device, notice);
    }
    /// Assigns every device.
    pub fn assign_all(&self, notice: Option<RolloutNotice>) {
        self.inner.lock().unwrap().broadcast = notice;
    }
    /// From now on, targets are signed by an untrusted key.
    pub fn forge_targets(&self, on: bool) {
        let mut i = self.inner.lock().unwrap();
        i.forge_targets = on;
        i.meta_version += 1;
    }
    /// The next `n` download calls fail.
    pub fn fail_downloads(&self, n: usize) {
        self.inner.lock().unwrap().download_faults = n;
    }
    /// The next `n` report calls fail (the registry unreachable); the reports are lost.
    pub fn fail_reports(&self, n: usize) {
        self.inner.lock().unwrap().report_faults = n;
    }
    /// Serve artifacts with one byte flipped.
    pub fn corrupt_downloads(&self, on: bool) {
        self.inner.lock().unwrap().corrupt_downloads = on;
    }
    pub fn reports(&self) -> Vec<DeviceStatus> {
        self.inner.lock().unwrap().reports.clone()
    }
    pub fn downloaded_bytes(&self) -> u64 {
        self.inner.lock().unwrap().downloaded_bytes
    }
}

impl Registry for FakeRegistry {
    async fn metadata(&self, _have_root_version: u64) -> Result<MetadataSet, TransportError> {
        let i = self.inner.lock().unwrap();
        let forged = SigningKey::from_bytes(&[0xEE; 32]);
        let tkey = if i.forge_targets { &forged } else { &i.targets_key };
        let (targets, timestamp) = sign_targets_and_timestamp(i.meta_version.max(1), i.expires, i.targets.clone(), tkey, &i.timestamp_key);
        let _ = &i.root_key;
        Ok(MetadataSet { roots: Vec::new(), timestamp, targets })
    }
    async fn assignment(&self, device: &DeviceId) -> Result<Option<RolloutNotice>, TransportError> {
        let i = self.inner.lock().unwrap();
        Ok(i.assignments.get(device).cloned().or_else(|| i.broadcast.clone()))
    }
    async fn download(&self, name: &str, version: ModelVersion, offset: u64, max_len: u32) -> Result<Vec<u8>, TransportError> {
        let mut i = self.inner.lock().unwrap();
        if i.download_faults > 0 {
            i.download_faults -= 1;
            return Err(TransportError("download interrupted (injected)".into()));
        }
        let corrupt = i.corrupt_downloads;
        let bytes = i.artifacts.get(&(name.to_owned(), version)).ok_or_else(|| TransportError(format!("no artifact {name} v{version}")))?;
        let start = (offset as usize).min(bytes.len());
        let end = (start + max_len as usize).min(bytes.len());
        let mut out = bytes[start..end].to_vec();
        if corrupt && !out.is_empty() {
            out[0] ^= 0xFF;
        }
        i.downloaded_bytes += out.len() as u64;
        Ok(out)
    }
    async fn model_info(&self, name: &str, version: ModelVersion) -> Result<ModelInfo, TransportError> {
        let i = self.inner.lock().unwrap();
        i.targets
            .iter()
            .find(|t| t.name == name && t.version == version)
            .cloned()
            .ok_or_else(|| TransportError(format!("no model {name} v{version}")))
    }
    async fn report(&self, status: &DeviceStatus) -> Result<(), TransportError> {
        let mut i = self.inner.lock().unwrap();
        if i.report_faults > 0 {
            i.report_faults -= 1;
            return Err(TransportError("registry unreachable (injected)".into()));
        }
        i.reports.push(status.clone());
        Ok(())
    }
}
