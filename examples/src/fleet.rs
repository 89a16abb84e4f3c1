//! A fleet of real edge agents in one process, talking to the real aggregator and registry over
//! QUIC with their own device certificates.
//!
//! Each agent is the daemon's code path ([`fedfleet_agent::Agent`] around a
//! [`fedfleet_agent::Lifecycle`] on its own sled store) with its own identity, key and data
//! partition. The two small adapters below implement the agent's client traits on top of the
//! services' QUIC clients ([`AggregatorClient`], [`RegistryClient`]); they verify what the
//! services sign (round announcements and receipts with the aggregator's receipt key, assignments
//! with the registry's pinned root) before the lifecycle sees it.
//!
//! This is the demo's own fleet driver: it only uses public APIs of `fedfleet-agent`,
//! `fedfleet-aggregator` and `fedfleet-registry`.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use fedfleet_agent::clients::{BaseModel, MetadataSet, TransportError, UploadReply};
use fedfleet_agent::lifecycle::HealthPolicy;
use fedfleet_agent::{Agent, AgentStore, CoreConfig, Lifecycle, LocalData, ShellConfig, SlotModel, SystemClock};
use fedfleet_aggregator::client::{AggregatorClient, UploadOutcome};
use fedfleet_certs::{DeviceIdentity, Pki};
use fedfleet_learning::Dataset;
use fedfleet_protocol::{DeviceId, DeviceStatus, FleetId, ModelRef, ModelVersion, RolloutNotice, RoundAnnouncement};
use fedfleet_registry::client::RegistryClient;
use fedfleet_registry::tuf::{Root, Signed as TufSigned};

/// Where the services listen (loopback) and the TLS name their certificates carry.
#[derive(Debug, Clone)]
pub struct Endpoints {
    pub aggregator: SocketAddr,
    pub registry: SocketAddr,
    pub server_name: String,
}

fn transport(e: impl std::fmt::Display) -> TransportError {
    TransportError(e.to_string())
}

/// The aggregator as seen by one agent (QUIC, device certificate).
pub struct QuicAggregator {
    client: AggregatorClient,
}

impl fedfleet_agent::Aggregator for QuicAggregator {
    async fn current_round(&self, fleet: &FleetId) -> Result<Option<RoundAnnouncement>, TransportError> {
        let info = self.client.current_round().await.map_err(transport)?;
        let Some(signed) = info.announcement else { return Ok(None) };
        // The announcement is signed with the aggregator's receipt key.
        let a = signed.verify(&info.receipt_key).map_err(|e| transport(format!("announcement: {e}")))?;
        Ok((a.fleet == *fleet).then(|| a.clone()))
    }

    async fn fetch_base_model(&self, model: &ModelRef) -> Result<BaseModel, TransportError> {
        let (spec, bytes) = self.client.fetch_model(&model.digest).await.map_err(transport)?;
        Ok(BaseModel { spec, bytes })
    }

    async fn upload(&self, signed_header: &[u8], payload: &[u8]) -> Result<UploadReply, TransportError> {
        match self.client.upload_encoded(signed_header, payload).await.map_err(transport)? {
            UploadOutcome::Accepted(receipt) => {
                let key = self.client.current_round().await.map_err(transport)?.receipt_key;
                let r = receipt.verify(&key).map_err(|e| transport(format!("receipt: {e}")))?;
                Ok(UploadReply::Receipt(r.clone()))
            }
            UploadOutcome::Rejected(r) => Ok(UploadReply::Rejected(r)),
        }
    }
}

/// The registry as seen by one agent (QUIC, device certificate).
pub struct QuicRegistry {
    client: RegistryClient,
    model: String,
    root: Root,
}

impl fedfleet_agent::Registry for QuicRegistry {
    async fn metadata(&self, have_root_version: u64) -> Result<MetadataSet, TransportError> {
        let m = self.client.metadata(have_root_version).await.map_err(transport)?;
        Ok(MetadataSet { roots: m.roots, timestamp: m.timestamp, targets: m.targets })
    }

    async fn assignment(&self, device: &DeviceId) -> Result<Option<RolloutNotice>, TransportError> {
        let signed = self.client.assignment(&self.model).await.map_err(transport)?;
        let body = signed
            .verify(&self.root, device, fedfleet_registry::unix_ms())
            .map_err(|e| transport(format!("assignment: {e}")))?;
        Ok(body.to_notice())
    }

    async fn download(&self, name: &str, version: ModelVersion, offset: u64, max_len: u32) -> Result<Vec<u8>, TransportError> {
        self.client.read_range(name, version, offset, max_len).await.map_err(transport)
    }

    async fn report(&self, status: &DeviceStatus) -> Result<(), TransportError> {
        self.client.report(status).await.map_err(transport)
    }
}

pub type FleetAgent = Agent<QuicAggregator, QuicRegistry>;

/// One agent with what the demo shows about it.
pub struct Member {
    pub id: DeviceId,
    pub agent: FleetAgent,
    pub train_examples: usize,
}

/// The fleet.
pub struct Fleet {
    pub members: Vec<Member>,
}

/// What every agent starts from.
pub struct FleetSetup<'a> {
    pub pki: &'a Pki,
    pub endpoints: Endpoints,
    pub root: TufSigned<Root>,
    /// The factory model every device ships with (already published as this version).
    pub initial: SlotModel,
    pub initial_bytes: &'a [u8],
    /// (device id, local training data, local holdout) per agent.
    pub devices: Vec<(DeviceId, Dataset, Dataset)>,
    pub state_root: &'a Path,
    pub seed: u64,
}

impl Fleet {
    /// Builds every agent: identity from the PKI, its own store, QUIC clients.
    pub async fn start(s: FleetSetup<'_>) -> anyhow::Result<Fleet> {
        let mut members = Vec::with_capacity(s.devices.len());
        let root_body = s.root.body_unverified().map_err(|e| anyhow::anyhow!("pinned root: {e}"))?;
        for (i, (id, train, holdout)) in s.devices.into_iter().enumerate() {
            let ident = DeviceIdentity::load(s.pki.dir(), &id)?;
            let tls = fedfleet_certs::tls::client_config(s.pki.ca(), &ident, &[fedfleet_certs::ALPN_V1])?;
            let agg = AggregatorClient::new(s.endpoints.aggregator, &s.endpoints.server_name, tls.clone())
                .map_err(|e| anyhow::anyhow!("aggregator client for {id}: {e}"))?;
            let reg = RegistryClient::new(s.endpoints.registry, &s.endpoints.server_name, tls)
                .map_err(|e| anyhow::anyhow!("registry client for {id}: {e}"))?;
            let store = AgentStore::open(s.state_root.join(id.as_str()))?;
            store.put_blob(s.initial_bytes)?;
            let mut cfg = CoreConfig::new(id.clone(), s.pki.fleet().clone());
            cfg.local_samples = train.len() as u64;
            cfg.rng_seed = s.seed ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            cfg.health = HealthPolicy { max_latency_ms: 1_000.0, accuracy_margin: 0.05 };
            cfg.backoff.base_ms = 200;
            cfg.backoff.max_ms = 2_000;
            let core = Lifecycle::open(cfg, store, Some(s.root.clone()), Some(s.initial.clone()), fedfleet_registry::unix_ms())?;
            let shell = ShellConfig { latency_samples: 8, ..Default::default() };
            let train_examples = train.len();
            let agent = Agent::new(
                core,
                Arc::new(QuicAggregator { client: agg }),
                Arc::new(QuicRegistry {
                    client: reg,
                    model: s.initial.model.name.clone(),
                    root: root_body.clone(),
                }),
                ident.signing_key(),
                LocalData { train, holdout },
                Arc::new(SystemClock),
                shell,
            );
            members.push(Member { id, agent, train_examples });
        }
        Ok(Fleet { members })
    }

    /// Polls the control plane and drives every agent once (agents run in turn; training is
    /// CPU-bound and this box has few cores). `on_agent` is called after each agent.
    pub async fn step(&mut self, mut on_agent: impl FnMut(usize)) -> anyhow::Result<()> {
        for (i, m) in self.members.iter_mut().enumerate() {
            m.agent.poll_control().await?;
            m.agent.drive().await?;
            on_agent(i);
        }
        Ok(())
    }

    /// How many agents run `model` as their active model.
    pub fn active_on(&self, model: &ModelRef) -> usize {
        self.members
            .iter()
            .filter(|m| m.agent.core().active().is_some_and(|a| a.model == *model))
            .count()
    }

    pub fn len(&self) -> usize {
        self.members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }
}
