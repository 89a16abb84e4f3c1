//! The aggregator's QUIC client, for agents, the operator CLI and tests. See [`crate::wire`] for
//! the protocol.
//!
//! ```no_run
//! # async fn demo(tls: rustls::ClientConfig, update: fedfleet_protocol::SignedUpdate, payload: Vec<u8>)
//! # -> Result<(), fedfleet_aggregator::client::ClientError> {
//! use fedfleet_aggregator::client::{AggregatorClient, UploadOutcome};
//! let client = AggregatorClient::connect("127.0.0.1:7400".parse().unwrap(), "localhost", tls).await?;
//! let round = client.current_round().await?;              // Option<Signed<RoundAnnouncement>>
//! if let Some(ann) = round.announcement {
//!     let a = ann.verify(&round.receipt_key).expect("signed by the aggregator");
//!     let (_spec, _base) = client.fetch_model(&a.base_model.digest).await?;
//!     // ... train, build the signed update ...
//! }
//! match client.upload(&update, &payload).await? {
//!     UploadOutcome::Accepted(receipt) => { receipt.verify(&round.receipt_key).unwrap(); }
//!     UploadOutcome::Rejected(r) => eprintln!("refused: {} ({})", r.reason, r.detail),
//! }
//! # Ok(()) }
//! ```
//!
//! The client holds one QUIC connection and reconnects on the next call when it was closed (idle
//! timeout, server restart). Every call opens its own stream. A `ClientError` means the outcome is
//! unknown (e.g. the connection broke before the receipt): resend the same bytes; the aggregator
//! answers a resend of an accepted update with the same receipt.

use std::net::SocketAddr;

use ed25519_dalek::VerifyingKey;
use fedfleet_net::{FramedStream, NetError, RpcConnection};
use fedfleet_protocol::framing::{Frame, FrameKind};
use fedfleet_protocol::messages;
use fedfleet_protocol::{Digest, Message, Receipt, Rejection, RoundAnnouncement, RoundId, Signed, SignedUpdate};

use crate::wire::{CampaignStatus, MAX_WIRE_MESSAGE, Request, Response};

/// What happened to an upload.
#[derive(Debug, Clone, PartialEq)]
pub enum UploadOutcome {
    /// Accepted, folded and persisted; the receipt is signed with the aggregator's receipt key.
    Accepted(Signed<Receipt>),
    /// Refused with a named reason.
    Rejected(Rejection),
}

/// The open round, as served by `GetRound`.
#[derive(Debug, Clone)]
pub struct RoundInfo {
    /// `None` when no round is open. Verify it with `receipt_key`.
    pub announcement: Option<Signed<RoundAnnouncement>>,
    /// The aggregator's receipt key (pin it on first contact).
    pub receipt_key: VerifyingKey,
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error(transparent)]
    Net(NetError),
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error("refused: {} ({})", .0.reason, .0.detail)]
    Refused(Rejection),
}

impl From<NetError> for ClientError {
    fn from(e: NetError) -> Self {
        match e.refusal("aggregator") {
            Some(r) => ClientError::Refused(r),
            None => ClientError::Net(e),
        }
    }
}

impl ClientError {
    /// Whether retrying later may help (the connection broke).
    pub fn is_transport(&self) -> bool {
        matches!(self, ClientError::Net(_))
    }
}

fn proto(e: impl std::fmt::Display) -> ClientError {
    ClientError::Protocol(e.to_string())
}

/// A client of one aggregator.
pub struct AggregatorClient {
    rpc: RpcConnection,
    /// Consecutive transport failures an idempotent call survives. Default 2.
    pub max_retries: u32,
}

impl AggregatorClient {
    /// Connects with a device (`fedfleet_certs::tls::client_config`) or operator
    /// (`service_client_config`) TLS config whose ALPN is `fedfleet/1`.
    pub async fn connect(addr: SocketAddr, server_name: &str, tls: rustls::ClientConfig) -> Result<Self, ClientError> {
        let client = Self::new(addr, server_name, tls)?;
        client.rpc.connection().await?;
        Ok(client)
    }

    /// Like [`connect`](Self::connect) but without the handshake: the first call connects (an
    /// agent can start while the aggregator is down). Must be called inside a tokio runtime.
    pub fn new(addr: SocketAddr, server_name: &str, tls: rustls::ClientConfig) -> Result<Self, ClientError> {
        // Two quick retries: an agent polls again anyway, and its outbox retries uploads.
        Ok(AggregatorClient { rpc: RpcConnection::new(addr, server_name, tls)?, max_retries: 2 })
    }

    /// As [`new`](Self::new), on a client endpoint shared with other clients
    /// ([`RpcConnection::on_endpoint`]).
    pub fn on_endpoint(
        endpoint: quinn::Endpoint,
        addr: SocketAddr,
        server_name: &str,
        tls: rustls::ClientConfig,
    ) -> Result<Self, ClientError> {
        Ok(AggregatorClient { rpc: RpcConnection::on_endpoint(endpoint, addr, server_name, tls)?, max_retries: 2 })
    }

    /// Presents `tls` (a renewed certificate) from the next connection on.
    pub async fn set_tls(&self, tls: rustls::ClientConfig) -> Result<(), ClientError> {
        Ok(self.rpc.set_tls(tls).await?)
    }

    /// See [`RpcConnection::keep_alive`] (simulators only).
    pub fn keep_alive(mut self, interval: std::time::Duration) -> Self {
        self.rpc = self.rpc.keep_alive(interval);
        self
    }

    /// One request and its answer on a new stream, without retries.
    async fn call_once(&self, req: &Request) -> Result<(Response, FramedStream), ClientError> {
        let mut s = self.rpc.open_stream().await?;
        let body = messages::encode(req, MAX_WIRE_MESSAGE).map_err(proto)?;
        s.send(FrameKind::Message, &body).await?;
        s.finish();
        let f = s.expect().await?;
        if f.kind != FrameKind::Message {
            return Err(proto(format!("unexpected {:?} frame", f.kind)));
        }
        let resp: Response = messages::decode(&f.body, MAX_WIRE_MESSAGE).map_err(proto)?;
        if let Response::Error(r) = resp {
            return Err(ClientError::Refused(r));
        }
        Ok((resp, s))
    }

    /// An idempotent request: retried with reconnects on transport errors.
    async fn call(&self, req: &Request) -> Result<(Response, FramedStream), ClientError> {
        self.rpc.retry(self.max_retries, ClientError::is_transport, || self.call_once(req)).await
    }

    /// The open round's signed announcement (if any) and the aggregator's receipt key.
    pub async fn current_round(&self) -> Result<RoundInfo, ClientError> {
        match self.call(&Request::GetRound).await?.0 {
            Response::Round { announcement, receipt_key } => Ok(RoundInfo {
                announcement: announcement.map(|b| Signed::<RoundAnnouncement>::decode(&b)).transpose().map_err(proto)?,
                receipt_key: VerifyingKey::from_bytes(&receipt_key).map_err(proto)?,
            }),
            other => Err(proto(format!("unexpected answer {other:?}"))),
        }
    }

    /// A model the aggregator holds (a round's base model), checked against `digest`:
    /// `(spec JSON, safetensors bytes)`.
    pub async fn fetch_model(&self, digest: &Digest) -> Result<(String, Vec<u8>), ClientError> {
        let (resp, mut s) = self.call(&Request::GetModel { digest: *digest }).await?;
        let Response::Model { spec, length } = resp else {
            return Err(proto(format!("unexpected answer {resp:?}")));
        };
        if length > fedfleet_protocol::limits::MAX_BUNDLE_BYTES as u64 {
            return Err(proto(format!("model of {length} bytes is over the bundle limit")));
        }
        let mut bytes = Vec::with_capacity(length as usize);
        loop {
            let f = s.expect().await?;
            match f.kind {
                FrameKind::Chunk if bytes.len() as u64 + f.body.len() as u64 <= length => bytes.extend_from_slice(&f.body),
                FrameKind::End => break,
                k => return Err(proto(format!("unexpected {k:?} frame or too many bytes"))),
            }
        }
        if bytes.len() as u64 != length || Digest::of(&bytes) != *digest {
            return Err(proto("model bytes do not match the requested digest"));
        }
        Ok((spec, bytes))
    }

    /// Uploads one signed update and its payload (the delta bundle's safetensors bytes).
    pub async fn upload(&self, update: &SignedUpdate, payload: &[u8]) -> Result<UploadOutcome, ClientError> {
        self.upload_encoded(&update.encode(), payload).await
    }

    /// Same as [`upload`](Self::upload) with the header already encoded (what an agent's outbox
    /// stores). The bytes are sent as given.
    pub async fn upload_encoded(&self, signed_header: &[u8], payload: &[u8]) -> Result<UploadOutcome, ClientError> {
        let answer = self
            .exchange(async |s| {
                s.send(FrameKind::Signed, signed_header).await?;
                s.send_payload(payload).await
            })
            .await?;
        match answer.kind {
            FrameKind::Signed => Ok(UploadOutcome::Accepted(Signed::<Receipt>::decode(&answer.body).map_err(proto)?)),
            FrameKind::Message => match Message::decode(&answer.body).map_err(proto)? {
                Message::Rejection(r) => Ok(UploadOutcome::Rejected(r)),
                other => Err(proto(format!("unexpected message {other:?}"))),
            },
            k => Err(proto(format!("unexpected {k:?} frame"))),
        }
    }

    /// Operator: start, status or stop (needs an operator service certificate). Not retried:
    /// a start whose answer was lost must be checked with a status request first.
    pub async fn campaign(&self, req: Request) -> Result<CampaignStatus, ClientError> {
        match self.call_once(&req).await?.0 {
            Response::Status(s) => Ok(s),
            other => Err(proto(format!("unexpected answer {other:?}"))),
        }
    }

    /// Secure aggregation: the open round's roster, checked and verified with `receipt_key`.
    pub async fn secagg_roster(&self, round: RoundId, receipt_key: &VerifyingKey) -> Result<fedfleet_secagg::Roster, ClientError> {
        secagg_roster_of(self.call(&Request::SecAggRoster { round }).await?.0, round, receipt_key)
    }

    /// Secure aggregation: sends one stage message (and at the masked stage its vector).
    pub async fn secagg_send(&self, message: &[u8], vector: &[u8]) -> Result<(), ClientError> {
        let req = Request::SecAggSend { message: message.to_vec(), vector_len: vector.len() as u64 };
        let request = messages::encode(&req, MAX_WIRE_MESSAGE).map_err(proto)?;
        let send = || async {
            let f = self
                .exchange(async |s| {
                    s.send(FrameKind::Message, &request).await?;
                    if vector.is_empty() { Ok(()) } else { s.send_payload(vector).await }
                })
                .await?;
            secagg_taken(messages::decode::<Response>(&f.body, MAX_WIRE_MESSAGE).map_err(proto)?)
        };
        self.rpc.retry(self.max_retries, ClientError::is_transport, send).await
    }

    /// Secure aggregation: what the current stage of `round` hands this device.
    pub async fn secagg_poll(&self, round: RoundId) -> Result<crate::wire::SecAggView, ClientError> {
        secagg_view(self.call(&Request::SecAggPoll { round }).await?.0)
    }

    /// Writes a request on a fresh stream and reads its answer, also after a write error
    /// ([`FramedStream::finish_and_answer`]).
    async fn exchange(&self, write: impl AsyncFnOnce(&mut FramedStream) -> Result<(), NetError>) -> Result<Frame, ClientError> {
        let mut s = self.rpc.open_stream().await?;
        let sent = write(&mut s).await;
        Ok(s.finish_and_answer(sent).await?)
    }

    /// Closes the connection.
    pub async fn close(&self) {
        self.rpc.close().await;
    }
}

// What the secure-aggregation responses mean, whichever way they came (QUIC here, MQTT on the
// agent's MQTT path).

/// The roster in the answer to [`Request::SecAggRoster`] for `round`, verified with `receipt_key`.
pub fn secagg_roster_of(response: Response, round: RoundId, receipt_key: &VerifyingKey) -> Result<fedfleet_secagg::Roster, ClientError> {
    let (roster, signature) = match response {
        Response::SecAggRoster { roster, signature } => (roster, signature),
        Response::Error(r) => return Err(ClientError::Refused(r)),
        other => return Err(proto(format!("unexpected answer to a roster request: {other:?}"))),
    };
    let roster = fedfleet_secagg::Roster::from_bytes(&roster).map_err(proto)?;
    let signature = ed25519_dalek::Signature::from_slice(&signature).map_err(proto)?;
    receipt_key
        .verify_strict(&roster.signing_bytes(), &signature)
        .map_err(|_| proto("the roster is not signed by the pinned receipt key"))?;
    if roster.round != round {
        return Err(proto(format!("asked for round {round}'s roster, got round {}'s", roster.round)));
    }
    Ok(roster)
}

/// Whether the answer to [`Request::SecAggSend`] took the message (a refusal is `Refused`).
pub fn secagg_taken(response: Response) -> Result<(), ClientError> {
    match response {
        Response::SecAggTaken => Ok(()),
        Response::Error(r) => Err(ClientError::Refused(r)),
        other => Err(proto(format!("unexpected answer {other:?}"))),
    }
}

/// The view in the answer to [`Request::SecAggPoll`].
pub fn secagg_view(response: Response) -> Result<crate::wire::SecAggView, ClientError> {
    match response {
        Response::SecAgg(v) => Ok(v),
        Response::Error(r) => Err(ClientError::Refused(r)),
        other => Err(proto(format!("unexpected answer {other:?}"))),
    }
}
