//! The real service clients behind [`crate::clients`]: [`RemoteAggregator`] over
//! `fedfleet_aggregator_client::client::AggregatorClient` and [`RemoteRegistry`] over
//! `fedfleet_registry_client::client::RegistryClient` (both QUIC + mTLS with the device identity).
//!
//! Trust:
//! - The aggregator's announcements and receipts are verified with the **pinned** receipt key
//!   (`receipt.pub`, from the agent config). An aggregator that presents another key in
//!   `GetRound` is refused (transport error: the agent keeps its outbox and retries), so a
//!   compromised or misconfigured server cannot feed rounds or fake receipts.
//! - Registry assignments are verified against the timestamp role of the registry root: the
//!   pinned root at first, then every newer root that chains from it (learned from
//!   [`Registry::metadata`] answers). Targets/timestamps themselves are verified by the
//!   lifecycle core's TUF verifier.
//!
//! Downloads: the [`Registry::download`] trait method asks for `(offset, max_len)` byte
//! ranges (the shell keeps a resumable partial file), so it maps onto
//! `RegistryClient::read_range`; the chunked delta download (`download_target` with a
//! `DirChunkCache`) does not fit that shape and is not used here.

use std::sync::{Arc, Mutex};

use ed25519_dalek::VerifyingKey;
use fedfleet_aggregator_client::client::{AggregatorClient, ClientError as AggError, UploadOutcome};
use fedfleet_aggregator_client::wire::SecAggView;
use fedfleet_protocol::tuf::Verifier;
use fedfleet_protocol::tuf::{Root, SignedMetadata};
use fedfleet_protocol::{
    DeviceId, DeviceStatus, FleetId, ModelRef, ModelVersion, Receipt, RejectReason, Rejection, RoundAnnouncement, RoundId, Signed,
};
use fedfleet_registry_client::client::{ClientError as RegError, RegistryClient};
use fedfleet_secagg::Roster;

use crate::agent::Clock;
use crate::clients::{Aggregator, BaseModel, MetadataSet, Registry, TransportError, UploadReply};

pub(crate) fn agg_err(e: AggError) -> TransportError {
    match &e {
        AggError::Refused(r) if r.reason == RejectReason::Revoked => TransportError::certificate_revoked(format!("aggregator: {e}")),
        _ => TransportError(format!("aggregator: {e}")),
    }
}

fn reg_err(e: RegError) -> TransportError {
    match &e {
        RegError::Rejected(r) if r.reason == RejectReason::Revoked => TransportError::certificate_revoked(format!("registry: {e}")),
        _ => TransportError(format!("registry: {e}")),
    }
}

/// An acknowledged upload, as the agent saw it (for accounting in tests and the fleet).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Ack {
    pub device: DeviceId,
    pub round: fedfleet_protocol::RoundId,
    pub nonce: [u8; 16],
    pub payload_digest: fedfleet_protocol::Digest,
    /// `true`: a signed receipt; `false`: a `Replay`/`Duplicate` answer to a resend.
    pub receipt: bool,
}

/// [`Aggregator`] over QUIC, with the aggregator's receipt key pinned.
pub struct RemoteAggregator {
    client: AggregatorClient,
    receipt_key: VerifyingKey,
    acks: Mutex<Vec<Ack>>,
    timeout: std::time::Duration,
}

/// Each call's time limit by default (QUIC does not report an unreachable server before its idle
/// timeout; the agent retries a timed-out upload with the same bytes). A service that died holds
/// the agent's loop no longer than this per call: installs from mirrors, inference and the
/// outbox go on.
pub const DEFAULT_CALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(15);

/// `f`, failed as a transport error after `timeout`.
async fn within<T, E>(
    timeout: std::time::Duration,
    service: &str,
    what: &str,
    f: impl std::future::Future<Output = Result<T, E>>,
    map: impl FnOnce(E) -> TransportError,
) -> Result<T, TransportError> {
    match tokio::time::timeout(timeout, f).await {
        Ok(r) => r.map_err(map),
        Err(_) => Err(TransportError(format!("{service}: {what} timed out after {timeout:?}"))),
    }
}

impl RemoteAggregator {
    /// Wraps a connected client. `receipt_key` is the aggregator's `receipt.pub`: announcements
    /// and receipts signed by any other key are refused.
    pub fn new(client: AggregatorClient, receipt_key: VerifyingKey) -> Self {
        RemoteAggregator { client, receipt_key, acks: Mutex::new(Vec::new()), timeout: DEFAULT_CALL_TIMEOUT }
    }

    /// Sets each call's time limit (default [`DEFAULT_CALL_TIMEOUT`]).
    pub fn with_timeout(mut self, t: std::time::Duration) -> Self {
        self.timeout = t;
        self
    }

    async fn limited<T>(&self, what: &str, f: impl std::future::Future<Output = Result<T, AggError>>) -> Result<T, TransportError> {
        within(self.timeout, "aggregator", what, f, agg_err).await
    }

    /// Every upload acknowledged so far (receipts and `Replay`/`Duplicate` answers), in order.
    pub fn acks(&self) -> Vec<Ack> {
        self.acks.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn client(&self) -> &AggregatorClient {
        &self.client
    }

    fn record(&self, header: &[u8], receipt: bool) {
        if let Ok(h) = fedfleet_protocol::SignedUpdate::decode(header) {
            let b = h.body();
            self.acks.lock().unwrap_or_else(|p| p.into_inner()).push(Ack {
                device: b.device.clone(),
                round: b.round,
                nonce: b.nonce,
                payload_digest: b.payload_digest,
                receipt,
            });
        }
    }
}

/// A round announcement checked against the pinned receipt key, however it arrived (polled, or
/// pushed to a simulated device); `None` when it is another fleet's.
pub fn verified_round(
    signed: &Signed<RoundAnnouncement>,
    receipt_key: &VerifyingKey,
    fleet: &FleetId,
) -> Result<Option<RoundAnnouncement>, TransportError> {
    let a = signed.verify(receipt_key).map_err(|e| TransportError(format!("round announcement signature: {e}")))?;
    Ok((&a.fleet == fleet).then(|| a.clone()))
}

impl Aggregator for RemoteAggregator {
    async fn current_round(&self, fleet: &FleetId) -> Result<Option<RoundAnnouncement>, TransportError> {
        let info = self.limited("round poll", self.client.current_round()).await?;
        if info.receipt_key != self.receipt_key {
            return Err(TransportError(format!(
                "aggregator presents receipt key {} but {} is pinned; refusing it",
                hex_key(&info.receipt_key),
                hex_key(&self.receipt_key)
            )));
        }
        let Some(signed) = info.announcement else { return Ok(None) };
        verified_round(&signed, &self.receipt_key, fleet)
    }

    async fn fetch_base_model(&self, model: &ModelRef) -> Result<BaseModel, TransportError> {
        let (spec, bytes) = self.limited("model fetch", self.client.fetch_model(&model.digest)).await?;
        Ok(BaseModel { spec, bytes })
    }

    async fn upload(&self, signed_header: &[u8], payload: &[u8]) -> Result<UploadReply, TransportError> {
        let sent = match tokio::time::timeout(self.timeout, self.client.upload_encoded(signed_header, payload)).await {
            Ok(r) => r,
            Err(_) => return Err(TransportError(format!("aggregator: upload timed out after {:?}", self.timeout))),
        };
        match sent {
            Ok(UploadOutcome::Accepted(r)) => {
                let receipt: Receipt =
                    r.verify(&self.receipt_key).map_err(|e| TransportError(format!("receipt not signed by the pinned key: {e}")))?.clone();
                self.record(signed_header, true);
                Ok(UploadReply::Receipt(receipt))
            }
            Ok(UploadOutcome::Rejected(r)) => {
                if matches!(r.reason, fedfleet_protocol::RejectReason::Replay | fedfleet_protocol::RejectReason::Duplicate) {
                    self.record(signed_header, false);
                }
                Ok(UploadReply::Rejected(r))
            }
            // A refusal of the request itself (e.g. overloaded) is a named rejection too.
            Err(AggError::Refused(r)) => Ok(UploadReply::Rejected(r)),
            Err(e) => Err(agg_err(e)),
        }
    }

    async fn secagg_roster(&self, round: RoundId) -> Result<Roster, TransportError> {
        self.limited("secure-aggregation roster", self.client.secagg_roster(round, &self.receipt_key)).await
    }

    async fn secagg_send(&self, message: &[u8], vector: &[u8]) -> Result<Result<(), Rejection>, TransportError> {
        match tokio::time::timeout(self.timeout, self.client.secagg_send(message, vector)).await {
            Ok(Ok(())) => Ok(Ok(())),
            Ok(Err(AggError::Refused(r))) => Ok(Err(r)),
            Ok(Err(e)) => Err(agg_err(e)),
            Err(_) => Err(TransportError(format!("aggregator: secure-aggregation message timed out after {:?}", self.timeout))),
        }
    }

    async fn secagg_poll(&self, round: RoundId) -> Result<SecAggView, TransportError> {
        let view = self.limited("secure-aggregation poll", self.client.secagg_poll(round)).await?;
        check_view_receipt(view, &self.receipt_key)
    }
}

/// A secure-aggregation view whose receipt (if it has one) is signed by `receipt_key`.
pub(crate) fn check_view_receipt(view: SecAggView, receipt_key: &VerifyingKey) -> Result<SecAggView, TransportError> {
    if let Some(bytes) = &view.receipt {
        Signed::<Receipt>::decode(bytes)
            .map_err(|e| e.to_string())
            .and_then(|r| r.verify(receipt_key).map(|_| ()).map_err(|e| e.to_string()))
            .map_err(|e| TransportError(format!("secure-aggregation receipt not signed by the pinned key: {e}")))?;
    }
    Ok(view)
}

fn hex_key(k: &VerifyingKey) -> String {
    k.to_bytes().iter().map(|b| format!("{b:02x}")).collect()
}

/// [`Registry`] over QUIC for one model name.
pub struct RemoteRegistry {
    client: RegistryClient,
    model: String,
    root: Mutex<SignedMetadata<Root>>,
    clock: Arc<dyn Clock>,
    timeout: std::time::Duration,
}

impl RemoteRegistry {
    /// Wraps a client. `pinned_root` is the root installed at enrollment (assignments are
    /// verified against it and the roots that chain from it); `model` the model name whose
    /// assignments this device follows. Uses the system clock for expiry checks.
    pub fn new(client: RegistryClient, model: impl Into<String>, pinned_root: SignedMetadata<Root>) -> Self {
        Self::with_clock(client, model, pinned_root, Arc::new(crate::agent::SystemClock))
    }

    /// [`RemoteRegistry::new`] with the clock that assignment expiry is checked against.
    pub fn with_clock(client: RegistryClient, model: impl Into<String>, pinned_root: SignedMetadata<Root>, clock: Arc<dyn Clock>) -> Self {
        RemoteRegistry { client, model: model.into(), root: Mutex::new(pinned_root), clock, timeout: DEFAULT_CALL_TIMEOUT }
    }

    /// Sets each call's time limit (default [`DEFAULT_CALL_TIMEOUT`]).
    pub fn with_timeout(mut self, t: std::time::Duration) -> Self {
        self.timeout = t;
        self
    }

    pub fn client(&self) -> &RegistryClient {
        &self.client
    }

    fn root_body(&self) -> Result<Root, TransportError> {
        let r = self.root.lock().unwrap_or_else(|p| p.into_inner()).clone();
        r.body_unverified().map_err(|e| TransportError(format!("pinned root: {e}")))
    }
}

impl Registry for RemoteRegistry {
    async fn metadata(&self, have_root_version: u64) -> Result<MetadataSet, TransportError> {
        let m = within(self.timeout, "registry", "metadata", self.client.metadata(have_root_version), reg_err).await?;
        // Follow root rotations for assignment checks (only roots that chain from ours).
        if !m.roots.is_empty() {
            let mut g = self.root.lock().unwrap_or_else(|p| p.into_inner());
            if let Ok(mut v) = Verifier::new(g.clone()) {
                for r in &m.roots {
                    if v.update_root(r).is_err() {
                        break;
                    }
                }
                *g = v.root_signed().clone();
            }
        }
        Ok(MetadataSet { roots: m.roots, timestamp: m.timestamp, targets: m.targets })
    }

    async fn assignment(&self, device: &DeviceId) -> Result<Option<fedfleet_protocol::RolloutNotice>, TransportError> {
        // NotFound is an answer (nothing assigned), not a failure.
        let ask = async {
            match self.client.assignment(&self.model).await {
                Err(RegError::NotFound(_)) => Ok(None),
                r => r.map(Some),
            }
        };
        let Some(signed) = within(self.timeout, "registry", "assignment", ask, reg_err).await? else { return Ok(None) };
        let root = self.root_body()?;
        let body = signed.verify(&root, device, self.clock.now_ms()).map_err(|e| TransportError(format!("assignment refused: {e}")))?;
        Ok(body.to_notice())
    }

    async fn download(&self, name: &str, version: ModelVersion, offset: u64, max_len: u32) -> Result<Vec<u8>, TransportError> {
        within(self.timeout, "registry", "download", self.client.read_range(name, version, offset, max_len), reg_err).await
    }

    async fn report(&self, status: &DeviceStatus) -> Result<(), TransportError> {
        within(self.timeout, "registry", "report", self.client.report(status), reg_err).await
    }

    async fn model_info(&self, name: &str, version: ModelVersion) -> Result<fedfleet_protocol::ModelInfo, TransportError> {
        within(self.timeout, "registry", "manifest", self.client.manifest(name, version), reg_err).await.map(|m| m.model)
    }
}
