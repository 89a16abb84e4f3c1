//! Regional relays, both ends of the link.
//!
//! **A relay** (`[relay]`, run by `fedfleet-aggregator relay`) is this service with its round
//! driven by its parent instead of an operator. [`Aggregator::follow_parent`] asks the parent for
//! its open round every `poll_interval_ms`, fetches the round's base model from it, and runs the
//! round for the devices of its region through its own engine (`RoundEngine::follow_round`):
//! devices see the parent's announcement re-signed with the relay's receipt key, with the relay's
//! earlier deadline, and every update goes through the same ingest as at the root (enrollment,
//! revocation, signature, replay, selection, shape, finite values, durable before its receipt).
//! When the round closes (every invited device of the region sent, or the relay's deadline),
//! [`Aggregator::forward`] sends its exact partial sum to the parent as one signed upload. A
//! relay with `[secure_aggregation]` runs the SecAgg+ stages over its region (the roster is its
//! region's devices) and announces the round as secure: it learns only its region's sum, which
//! is all it forwards, and the parent only the regions' sums.
//!
//! The relay's store is its outbox: the accepted updates stay on disk until the parent's receipt,
//! and a restarted relay refolds them into the same sum, signed under the same nonce (derived
//! from the relay, the round and the sum), so a resend is answered with the first receipt and the
//! parent never counts a region twice.
//!
//! **A parent** (`relays = [...]`) takes a partial sum in [`Aggregator::ingest_relay`] from a
//! service certificate it names, signed with that certificate's key, and merges it into the open
//! round exactly (`Coordinator::handle_relay`): FedAvg over relays is FedAvg over all devices,
//! bit for bit. A relay can itself be a parent, so trees have any depth.

use super::*;
use crate::client::{AggregatorClient, ClientError, UploadOutcome};
use crate::config::RelayConfig;
use crate::engine::{FollowedRound, RelayMeta};
use crate::strategy::fixed::PartialSum;
use ed25519_dalek::VerifyingKey;
use fedfleet_protocol::{DeviceId, RelayHeader, RoundAnnouncement, SignedRelay};
use ingest::receive_payload;

/// The relay's link to its parent: a client under the relay's service certificate, and the
/// parent's pinned receipt key.
pub(super) struct Parent {
    client: AggregatorClient,
    key: VerifyingKey,
}

/// The nonce a relay signs its partial sum of `round` with: the same for the same sum, so a
/// resend after a restart is recognised as one.
fn relay_nonce(relay: &DeviceId, round: RoundId, payload_digest: &Digest) -> [u8; 16] {
    let d = Digest::of(
        &[b"fedfleet relay nonce v1\0".as_slice(), relay.as_str().as_bytes(), &round.0.to_le_bytes(), &payload_digest.0].concat(),
    );
    d.0[..16].try_into().expect("16 bytes")
}

impl Aggregator {
    fn relay_config(&self) -> Option<&RelayConfig> {
        self.shared.cfg.relay.as_ref()
    }

    /// The relay's own name on its parent: its service certificate's (CN).
    fn relay_id(&self) -> Result<DeviceId, String> {
        DeviceId::new(self.shared.identity.name()).map_err(|e| format!("certificate name as a relay name: {e}"))
    }

    fn parent(&self) -> Result<&Parent, String> {
        if let Some(p) = self.shared.parent.get() {
            return Ok(p);
        }
        let rc = self.relay_config().ok_or("not a relay")?;
        let key = fedfleet_aggregator_client::read_receipt_key(&rc.parent_receipt_key)
            .map_err(|e| format!("relay.parent_receipt_key {}: {e}", rc.parent_receipt_key.display()))?;
        let tls = fedfleet_certs::tls::service_client_config(&self.shared.ca, &self.shared.identity, &[fedfleet_certs::ALPN_V1])
            .map_err(|e| e.to_string())?;
        let client = AggregatorClient::new(rc.parent, &rc.parent_server_name, tls).map_err(|e| e.to_string())?;
        Ok(self.shared.parent.get_or_init(|| Parent { client, key }))
    }

    /// The relay's loop: follow the parent's rounds until the service stops.
    pub(super) async fn follow_parent(&self) {
        let Some(interval) = self.relay_config().map(|r| Duration::from_millis(r.poll_interval_ms)) else { return };
        let mut last_error = String::new();
        loop {
            match self.follow_once().await {
                Ok(()) => last_error.clear(),
                // Said once per cause, not at every poll.
                Err(e) if e != last_error => {
                    tracing::warn!(error = %e, "cannot follow the parent's round; retrying");
                    self.shared.metrics.round("follow_failed");
                    last_error = e;
                }
                Err(_) => {}
            }
            tokio::time::sleep(interval).await;
        }
    }

    async fn follow_once(&self) -> Result<(), String> {
        let next = {
            let core = self.lock();
            if core.coord.engine().campaign_id().is_some() {
                return Ok(()); // a followed round is still open or being forwarded
            }
            core.coord.engine().next_round()
        };
        let parent = self.parent()?;
        let info = parent.client.current_round().await.map_err(|e| format!("parent: {e}"))?;
        if info.receipt_key != parent.key {
            return Err("the parent presents another receipt key than relay.parent_receipt_key pins; refusing it".into());
        }
        let Some(signed) = info.announcement else { return Ok(()) };
        let ann = signed.verify(&parent.key).map_err(|e| format!("parent's announcement: {e}"))?.clone();
        if ann.round < next {
            return Ok(()); // followed and forwarded already; the parent's round is open for others
        }
        if ann.fleet != self.shared.allow.fleet() {
            return Err(format!("the parent runs fleet {}, this relay's PKI is fleet {}", ann.fleet, self.shared.allow.fleet()));
        }
        let rc = self.relay_config().ok_or("not a relay")?;
        let now = self.now_ms();
        let deadline = ann.deadline_unix_ms.saturating_sub(rc.forward_margin_secs * 1000);
        if deadline <= now {
            return Ok(()); // too late to gather and forward anything for this round
        }
        self.hold_base(parent, &ann).await?;
        let expected = self.region_invited(&ann.selection);
        let sh = &self.shared;
        let mut core = self.lock();
        if core.base.as_ref().map(|b| b.digest) != Some(ann.base_model.digest) {
            return Err("the base model changed while it was fetched".into());
        }
        let followed = FollowedRound {
            round: ann.round,
            base_version: ann.base_model.version,
            base_digest: ann.base_model.digest,
            client: core.coord.strategy().configure(ann.round),
            selection: ann.selection.clone(),
            deadline,
            expected,
            max_sample_count: ann.config.max_samples.unwrap_or(u64::MAX),
        };
        core.coord.engine_mut().follow_round(now, followed).map_err(|e| e.to_string())?;
        core.campaign.dtype = ann.config.quantization.code();
        core.campaign.strategy = Some(format!("relay of {}", rc.parent));
        self.drain(&mut core, now);
        // Devices get the parent's round as it was announced, with this relay's deadline, under
        // this relay's key (the one they pin).
        let mut mine = RoundAnnouncement { deadline_unix_ms: deadline, ..ann.clone() };
        if let Some(s) = sh.cfg.secure_aggregation {
            // The region aggregates securely; a device must have trained before the keys stage ends.
            mine.config.secure_aggregation = true;
            let time_to_start = (deadline.saturating_sub(now) as f64 * s.stage_ends[0]) as u64;
            mine.config.start_window_ms = core.pacer.open_round(u64::from(expected), time_to_start);
            sh.metrics.arrivals_per_second.set(i64::from(core.pacer.rate()));
        }
        core.campaign.announcement = Some(Signed::sign(mine, &sh.key).encode());
        sh.announce.send_replace(core.campaign.announcement.clone());
        self.commit_boundary(&mut core, now);
        tracing::info!(round = %ann.round, expected, deadline, "following the parent's round");
        Ok(())
    }

    /// The devices of the region that `selection` invites and that may still send.
    fn region_invited(&self, selection: &fedfleet_protocol::Selection) -> u32 {
        self.region().iter().filter(|d| selection.selects(d) && self.sending_key(d).is_some()).count() as u32
    }

    /// The devices this service answers for: a relay's region (`relay.region`, or every enrolled
    /// device when it names none), else every enrolled device.
    pub(super) fn region(&self) -> Vec<DeviceId> {
        match self.relay_config() {
            Some(rc) if !rc.region.is_empty() => rc.region.clone(),
            _ => self.shared.allow.devices(),
        }
    }

    /// Makes the round's base model the one this relay holds, fetched from the parent (and
    /// checked against the announced digest) the first time.
    async fn hold_base(&self, parent: &Parent, ann: &RoundAnnouncement) -> Result<(), String> {
        let base = &ann.base_model;
        if self.lock().base.as_ref().is_some_and(|b| b.digest == base.digest) {
            return Ok(());
        }
        let sh = &self.shared;
        let bytes = match sh.store.model_record(&base.digest) {
            Ok(Some(_)) => sh.store.read_model(&base.digest).map_err(|e| e.to_string())?,
            _ => {
                let (_, bytes) = parent.client.fetch_model(&base.digest).await.map_err(|e| format!("base model {}: {e}", base.digest))?;
                let rec = ModelInfo::published(
                    NewVersion {
                        name: base.name.clone(),
                        spec: sh.spec_json.clone(),
                        parent: None,
                        metrics: BTreeMap::new(),
                        created_at_unix_ms: self.now_ms(),
                        publisher: format!("parent {}", self.relay_config().map(|r| r.parent.to_string()).unwrap_or_default()),
                        adapter: None,
                    },
                    base.version,
                    bytes.len() as u64,
                    base.digest,
                );
                sh.store.put_model(&base.digest, &bytes, &rec).map_err(|e| e.to_string())?;
                bytes
            }
        };
        let (layout, values) = decode_base(&bytes).map_err(|e| format!("base model {}: {e}", base.digest))?;
        if let Some(detail) = layout_change(&layout, &sh.spec.layout()) {
            return Err(format!("the parent's model {} is not this relay's model.spec: {detail}", base.digest));
        }
        let mut core = self.lock();
        core.base = Some(Base::new(base.digest, base.version, layout, values, &sh.spec.update_layout()));
        core.global = Some(GlobalRef { version: base.version, digest: base.digest });
        Ok(())
    }

    /// Forwards the closed `round`'s partial sum to the parent; on its receipt the round is
    /// done. A refusal by the parent (its round is over) fails the round here, named in the log;
    /// a transport error is retried by the driver.
    pub(super) async fn forward(&self, round: RoundId) -> Result<(), String> {
        let me = self.clone();
        let prepared = tokio::task::spawn_blocking(move || {
            // Every update in the sum is durable before the sum leaves.
            me.shared.store.sync_all().unwrap_or_else(|e| abort_on_commit_failure(e));
            let core = me.lock();
            if core.closing != Some(round) {
                return Ok(None);
            }
            let base = core.base.clone().ok_or("no base model")?;
            let sum = core.coord.strategy().partial_sum().filter(|s| !s.is_empty()).cloned().ok_or("the closed round folded nothing")?;
            Ok::<_, String>(Some((sum, base)))
        })
        .await
        .map_err(|e| e.to_string())??;
        let Some((sum, base)) = prepared else { return Ok(()) };
        let sh = &self.shared;
        let payload = sum.to_le_bytes();
        let relay = self.relay_id()?;
        let payload_digest = Digest::of(&payload);
        let header = RelayHeader {
            nonce: relay_nonce(&relay, round, &payload_digest),
            relay,
            fleet: sh.allow.fleet(),
            round,
            base_model: base.digest,
            update_count: sum.count(),
            total_samples: sum.total_weight(),
            payload_len: payload.len() as u64,
            payload_digest,
            // The payload is the sum's little-endian i128 grid values; the field is not read.
            payload_dtype: DType::F32,
        };
        let signed = Signed::sign(header, &sh.identity.signing_key());
        let parent = self.parent()?;
        let refusal = match parent.client.upload_encoded(&signed.encode(), &payload).await {
            Ok(UploadOutcome::Accepted(receipt)) => {
                let r = receipt.verify(&parent.key).map_err(|e| format!("parent's receipt: {e}"))?;
                if r.round != round || r.payload_digest != payload_digest {
                    return Err(format!("parent's receipt is for round {} / {}, not this sum", r.round, r.payload_digest));
                }
                None
            }
            Ok(UploadOutcome::Rejected(r)) | Err(ClientError::Refused(r)) => Some(r),
            Err(e) => return Err(format!("forwarding to the parent: {e}")),
        };
        if let Some(r) = &refusal
            && r.reason == RejectReason::Overloaded
        {
            return Err(format!("parent overloaded: {}", r.detail));
        }
        let me = self.clone();
        let updates = sum.count();
        tokio::task::spawn_blocking(move || {
            let mut core = me.lock();
            if core.closing != Some(round) {
                return Ok(());
            }
            core.closing = None;
            let now = me.now_ms();
            match refusal {
                None => {
                    // The sum left with the receipt: the round's fold is dropped, not finalized.
                    core.coord
                        .finalize_with(now, round, |s| {
                            s.take_partial_sum();
                            Ok(Vec::new())
                        })
                        .map_err(|e| e.to_string())?;
                    core.coord.model_ready(now, round, base.version, base.digest).map_err(|e| e.to_string())?;
                    me.shared.metrics.round("forwarded");
                    tracing::info!(round = %round, updates, "partial sum forwarded to the parent");
                }
                Some(r) => {
                    tracing::warn!(round = %round, updates, reason = %r.reason, detail = %r.detail, "the parent refused this round's partial sum: its updates are not in the parent's model");
                    core.coord.engine_mut().abort_round(now, round, format!("parent refused the partial sum: {}", r.reason)).map_err(|e| e.to_string())?;
                }
            }
            me.drain(&mut core, now);
            Ok::<(), String>(())
        })
        .await
        .map_err(|e| e.to_string())?
    }

    /// A relay's partial sum: its identity (a service named in `relays`, the header's relay),
    /// signature (that certificate's key), a resend answered with its first receipt, admission,
    /// size, the payload's digest; then merged and committed like an update.
    pub(super) async fn ingest_relay(
        &self,
        peer: &PeerIdentity,
        peer_key: Option<VerifyingKey>,
        signed: SignedRelay,
        payload: Payload<'_>,
    ) -> Result<Signed<Receipt>, Rejection> {
        let sh = &self.shared;
        let h = signed.body().clone();
        match peer {
            PeerIdentity::Service(n) if sh.cfg.relays.contains(n) && n.as_str() == h.relay.as_str() => {}
            PeerIdentity::Service(n) if sh.cfg.relays.contains(n) => {
                return Err(reject(RejectReason::IdentityMismatch, format!("certificate is for relay {n}, the header names {}", h.relay)));
            }
            other => {
                let who = match other {
                    PeerIdentity::Service(n) => format!("service {n}"),
                    PeerIdentity::Device(d) => format!("device {d}"),
                };
                return Err(reject(
                    RejectReason::NotPermitted,
                    format!("{who} is not named in `relays`: only relays forward partial sums"),
                ));
            }
        }
        let key = peer_key.ok_or_else(|| reject(RejectReason::IdentityMismatch, "the client certificate has no ed25519 key"))?;
        signed.verify(&key).map_err(|e| reject(e.reason(), e.to_string()))?;
        if let Some(receipt) = self.receipt_of_resend(&h.relay, &h.nonce, &h.payload_digest, h.round)? {
            return Ok(receipt);
        }
        let meta = RelayMeta::from(&h);
        let base = {
            let mut core = self.lock();
            let now = self.now_ms();
            let r = core.coord.engine_mut().check_relay(now, &meta);
            self.drain(&mut core, now);
            r.map_err(|r| reject(r.reason, format!("round {}: {}", h.round, r.reason)))?;
            core.base.clone().ok_or_else(|| reject(RejectReason::Internal, "no base model"))?
        };
        let expected = base.dim() as u64 * 16;
        if h.payload_len != expected {
            return Err(reject(
                RejectReason::ShapeMismatch,
                format!("a partial sum of this model is {expected} bytes, the header signs {}", h.payload_len),
            ));
        }
        let _in_flight = self.admit(&payload, h.payload_len)?;
        let payload = receive_payload(&h, payload).await?;
        let me = self.clone();
        tokio::task::spawn_blocking(move || me.merge_and_commit(h, meta, payload, base))
            .await
            .map_err(|e| reject(RejectReason::Internal, e.to_string()))?
    }

    fn merge_and_commit(&self, h: RelayHeader, meta: RelayMeta, payload: Vec<u8>, base: Base) -> Result<Signed<Receipt>, Rejection> {
        let sh = &self.shared;
        let partial = PartialSum::from_le_bytes(&payload, base.dim(), h.total_samples, h.update_count).map_err(|e| {
            let e = crate::strategy::StrategyError::Fold(e);
            reject(e.reason(), e.to_string())
        })?;
        sh.store.put_update(h.round, &h.payload_digest, &payload).map_err(|e| reject(RejectReason::Internal, e.to_string()))?;
        drop(payload);
        let mut core = self.lock();
        if core.base.as_ref().map(|b| b.digest) != Some(base.digest) {
            return Err(reject(RejectReason::StaleRound, "the round's base model changed while the partial sum streamed"));
        }
        let now = self.now_ms();
        let accepted = match core.coord.handle_relay(now, meta, &partial) {
            Ok(a) => a,
            Err(r) => {
                self.drain(&mut core, now);
                return Err(reject(r.reason, format!("round {}: {}", h.round, r.reason)));
            }
        };
        let receipt = Receipt {
            fleet: h.fleet.clone(),
            device: h.relay.clone(),
            round: h.round,
            nonce: h.nonce,
            payload_digest: h.payload_digest,
            accepted_at_unix_ms: now,
        };
        let (receipt, seq) = self.record_accepted(receipt, accepted.round, h.total_samples, h.update_count);
        sh.metrics.accepted.inc_by(h.update_count);
        sh.metrics.round_accepted.set(accepted.accepted as i64);
        tracing::info!(relay = %h.relay, round = %accepted.round, made_for = %h.round, staleness = accepted.staleness,
            updates = h.update_count, accepted = accepted.accepted, target = accepted.target, "relay's partial sum accepted");
        self.drain(&mut core, now);
        drop(core);
        sh.store.sync(seq).unwrap_or_else(|e| abort_on_commit_failure(e));
        Ok(receipt)
    }
}

/// A stored partial sum, read back for the refold after a restart.
pub(super) fn stored_partial(store: &Store, rec: &AcceptedRecord, base: &Base) -> Result<PartialSum, String> {
    let bytes = store.read_update(&rec.payload_digest).map_err(|e| e.to_string())?;
    PartialSum::from_le_bytes(&bytes, base.dim(), rec.weight, rec.relayed)
        .map_err(|e| format!("stored partial sum {} no longer decodes: {e}", rec.payload_digest))
}
