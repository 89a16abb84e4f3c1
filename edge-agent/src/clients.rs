//! What the agent needs from the services, as two traits. The aggregator's and the registry's
//! QUIC client modules implement them; [`crate::fakes`] has in-memory versions for tests and
//! simulation.

use std::future::Future;

use fedfleet_aggregator_client::wire::SecAggView;
use fedfleet_protocol::{
    DeviceId, DeviceStatus, FleetId, ModelInfo, ModelRef, ModelVersion, Receipt, Rejection, RolloutNotice, RoundAnnouncement, RoundId,
};
use fedfleet_secagg::Roster;

pub use crate::lifecycle::MetadataSet;

/// The connection failed or broke; the request may be retried.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("transport: {0}")]
pub struct TransportError(pub String);

const REVOKED: &str = "this device's certificate is revoked: ";

impl TransportError {
    /// The service refused this device's certificate as revoked (at the handshake).
    pub fn certificate_revoked(detail: impl std::fmt::Display) -> TransportError {
        TransportError(format!("{REVOKED}{detail}"))
    }

    pub fn is_certificate_revoked(&self) -> bool {
        self.0.starts_with(REVOKED)
    }
}

/// The aggregator's answer to an upload.
#[derive(Debug, Clone, PartialEq)]
pub enum UploadReply {
    Receipt(Receipt),
    Rejected(Rejection),
}

/// A round's base model: its spec (JSON) and safetensors bytes. The agent checks the bytes
/// against the digest in the round announcement.
#[derive(Debug, Clone, PartialEq)]
pub struct BaseModel {
    pub spec: String,
    pub bytes: Vec<u8>,
}

/// The aggregator, as seen by an agent.
pub trait Aggregator: Send + Sync + 'static {
    /// The round currently open for `fleet`, if any (polled; MQTT announcements feed the same
    /// input later).
    fn current_round(&self, fleet: &FleetId) -> impl Future<Output = Result<Option<RoundAnnouncement>, TransportError>> + Send;
    /// The base model of a round, by reference.
    fn fetch_base_model(&self, model: &ModelRef) -> impl Future<Output = Result<BaseModel, TransportError>> + Send;
    /// Sends one signed update: `signed_header` is an encoded `SignedUpdate` envelope, `payload`
    /// the safetensors bytes it binds. A lost connection before the reply is a
    /// `TransportError`; the agent then resends the same bytes, and the aggregator answers a
    /// resend of an accepted update with its receipt again or with `Replay`/`Duplicate`.
    fn upload(&self, signed_header: &[u8], payload: &[u8]) -> impl Future<Output = Result<UploadReply, TransportError>> + Send;
    /// Secure aggregation: the roster of `round`, verified as the aggregator's own.
    fn secagg_roster(&self, round: RoundId) -> impl Future<Output = Result<Roster, TransportError>> + Send {
        let _ = round;
        async { Err(no_secure_aggregation()) }
    }
    /// Secure aggregation: one signed stage message (`vector`: the masked vector's bytes at the
    /// masked stage, else empty). `Ok(Err(_))`: the aggregator refused it, by name.
    fn secagg_send(&self, message: &[u8], vector: &[u8]) -> impl Future<Output = Result<Result<(), Rejection>, TransportError>> + Send {
        let _ = (message, vector);
        async { Err(no_secure_aggregation()) }
    }
    /// Secure aggregation: what the current stage of `round` hands this device; a receipt in it
    /// is verified as signed by the aggregator.
    fn secagg_poll(&self, round: RoundId) -> impl Future<Output = Result<SecAggView, TransportError>> + Send {
        let _ = round;
        async { Err(no_secure_aggregation()) }
    }
}

fn no_secure_aggregation() -> TransportError {
    TransportError("this aggregator client has no secure-aggregation path".into())
}

/// The registry, as seen by an agent.
pub trait Registry: Send + Sync + 'static {
    /// Signed metadata: every root newer than `have_root_version` (in order), the current
    /// timestamp and the targets it names.
    fn metadata(&self, have_root_version: u64) -> impl Future<Output = Result<MetadataSet, TransportError>> + Send;
    /// This device's current rollout assignment, if any.
    fn assignment(&self, device: &DeviceId) -> impl Future<Output = Result<Option<RolloutNotice>, TransportError>> + Send;
    /// Up to `max_len` bytes of the artifact of `name`/`version`, starting at `offset` (resumable
    /// downloads). An empty answer before the end is an error.
    fn download(
        &self,
        name: &str,
        version: ModelVersion,
        offset: u64,
        max_len: u32,
    ) -> impl Future<Output = Result<Vec<u8>, TransportError>> + Send;
    /// A status report (install steps with their reasons, heartbeats).
    fn report(&self, status: &DeviceStatus) -> impl Future<Output = Result<(), TransportError>> + Send;
    /// The description of `name`/`version` (length, digest, spec): how a round's base model is
    /// fetched from the registry instead of the aggregator. Unchecked: the agent compares the
    /// digest with the round's signed announcement and the bytes with the digest.
    fn model_info(&self, name: &str, version: ModelVersion) -> impl Future<Output = Result<ModelInfo, TransportError>> + Send {
        let _ = (name, version);
        async { Err(TransportError("this registry client describes no models".into())) }
    }
}

/// Clients for a daemon whose service clients are not linked in yet: every call fails with a
/// transport error, so the agent serves its active model and keeps its outbox until a real
/// client is configured.
#[derive(Debug, Clone, Default)]
pub struct Unlinked;

fn unlinked<T>() -> Result<T, TransportError> {
    Err(TransportError("no QUIC client linked in this build".into()))
}

impl Aggregator for Unlinked {
    async fn current_round(&self, _: &FleetId) -> Result<Option<RoundAnnouncement>, TransportError> {
        unlinked()
    }
    async fn fetch_base_model(&self, _: &ModelRef) -> Result<BaseModel, TransportError> {
        unlinked()
    }
    async fn upload(&self, _: &[u8], _: &[u8]) -> Result<UploadReply, TransportError> {
        unlinked()
    }
}

impl Registry for Unlinked {
    async fn metadata(&self, _: u64) -> Result<MetadataSet, TransportError> {
        unlinked()
    }
    async fn assignment(&self, _: &DeviceId) -> Result<Option<RolloutNotice>, TransportError> {
        unlinked()
    }
    async fn download(&self, _: &str, _: ModelVersion, _: u64, _: u32) -> Result<Vec<u8>, TransportError> {
        unlinked()
    }
    async fn report(&self, _: &DeviceStatus) -> Result<(), TransportError> {
        unlinked()
    }
}
