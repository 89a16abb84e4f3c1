//! Secure aggregation (`[secure_aggregation]`): the open round's SecAgg+ stages, run by the
//! sans-IO `fedfleet_secagg::Server` and relayed between the round's devices through this
//! service (devices poll for what each stage hands them). When the stages end the unmasked sum
//! enters the round like a relay's partial sum: persisted (the sum only), recorded, merged
//! exactly, and the round closes at once. No device's update, masked or clear, is written
//! anywhere; a restart loses the stages in progress, and that round fails by its deadline.

use fedfleet_protocol::DeviceId;
use fedfleet_secagg::{Deadlines, Message, Roster, Server, Stage};

use super::*;
use crate::engine::RelayMeta;
use crate::strategy::{FRAC_BITS, PartialSum};
use crate::wire::SecAggView;

/// The contributor the unmasked sum is recorded under in the round engine (it is no device).
const SUM_CONTRIBUTOR: &str = "secagg.sum";

/// Where a stage message's masked vector comes from: streamed after it (QUIC), or attached to
/// it (an MQTT request), with the budget share its caller waited for when it carries a vector.
pub(super) enum Attached<'a> {
    Streamed(&'a mut FramedStream),
    Bytes(&'a [u8], Option<&'a BytesInFlight>),
}

/// The open round's secure aggregation.
pub(super) struct SecAggRound {
    server: Server,
    roster: Vec<u8>,
    signature: Vec<u8>,
    /// Each survivor's masked vector digest: what its receipt names.
    masked: BTreeMap<DeviceId, Digest>,
    /// Once the sum is in the round: each survivor's signed receipt.
    receipts: BTreeMap<DeviceId, Vec<u8>>,
    /// The stages ended (merged, or failed and the round aborted).
    settled: bool,
}

impl Aggregator {
    /// At a round's opening: its roster (the enrolled, unrevoked devices of its region that its
    /// selection invites)
    /// and stage deadlines spread over the time to its deadline. `None` (logged) when no
    /// roster can be made: devices then get no stages and the round fails at its deadline.
    pub(super) fn open_secagg(
        &self,
        core: &Core,
        round: RoundId,
        selection: &fedfleet_protocol::Selection,
        deadline: Millis,
        now: Millis,
    ) -> Option<SecAggRound> {
        let sh = &self.shared;
        let cfg = sh.cfg.secure_aggregation?;
        let dim = core.base.as_ref()?.dim() as u32;
        let devices: Vec<(DeviceId, [u8; 32])> = self
            .region()
            .into_iter()
            .filter(|d| selection.selects(d))
            .filter_map(|d| self.sending_key(&d).map(|k| (d, k.to_bytes())))
            .collect();
        let mut graph_seed = [0u8; 32];
        rand_core::RngCore::fill_bytes(&mut rand_core::OsRng, &mut graph_seed);
        let roster = Roster::new(round, cfg.params(devices.len()), dim, graph_seed, devices)
            .inspect_err(|e| tracing::error!(round = %round, error = %e, "secure aggregation cannot start: the round will fail"))
            .ok()?;
        let roster_bytes = roster.to_bytes();
        // The roster travels in one wire message (with its signature): a roster too large for one
        // (some 14,000 devices) gets no stages rather than an answer that cannot be encoded.
        if roster_bytes.len() + 1024 > MAX_WIRE_MESSAGE {
            tracing::error!(round = %round, devices = roster.len(), bytes = roster_bytes.len(),
                "secure aggregation cannot start: the roster is larger than one wire message (sample fewer devices per round); the round will fail");
            return None;
        }
        let span = deadline.saturating_sub(now) as f64;
        let at = |f: f64| now + (span * f) as u64;
        let [keys, shares, masked, unmask] = cfg.stage_ends.map(at);
        let signature = ed25519_dalek::Signer::sign(sh.key.as_ref(), &roster.signing_bytes()).to_bytes().to_vec();
        tracing::info!(round = %round, devices = roster.len(), threshold = roster.params.threshold, "secure aggregation: keys stage open");
        Some(SecAggRound {
            roster: roster_bytes,
            server: Server::new(roster, Deadlines { keys, shares, masked, unmask }),
            signature,
            masked: BTreeMap::new(),
            receipts: BTreeMap::new(),
            settled: false,
        })
    }

    /// `campaign status`'s view of secure aggregation (`None` when the service aggregates in the clear).
    pub(super) fn secagg_report(&self, core: &Core) -> Option<crate::wire::SecAggReport> {
        let cfg = self.shared.cfg.secure_aggregation?;
        let open_round = core.secagg.as_ref().map(|r| {
            let roster = r.server.roster();
            crate::wire::SecAggRoundReport {
                round: roster.round,
                stage: r.server.stage(),
                roster: roster.devices.len() as u32,
                threshold: roster.params.threshold,
                failure: r.server.failure().map(|f| format!("{}: {f}", f.name())),
            }
        });
        Some(crate::wire::SecAggReport {
            degree: cfg.degree,
            threshold_fraction: cfg.threshold_fraction,
            clip: cfg.clip,
            frac_bits: cfg.frac_bits,
            open_round,
        })
    }

    /// The next stage deadline of the open round's secure aggregation (none once it ended).
    pub(super) fn secagg_timeout(core: &Core) -> Option<Millis> {
        core.secagg.as_ref().and_then(|s| s.server.poll_timeout())
    }

    /// Stage deadlines due at `now`, then what the stages' end means for the round.
    pub(super) fn secagg_tick(&self, core: &mut Core, now: Millis) {
        if let Some(s) = core.secagg.as_mut() {
            s.server.handle_timeout(now);
        }
        self.secagg_settle(core, now);
    }

    /// `peer`'s roster of `round`.
    pub(super) fn secagg_roster(&self, peer: &PeerIdentity, round: RoundId) -> Response {
        self.in_session(peer, round, |s, _| Response::SecAggRoster { roster: s.roster.clone(), signature: s.signature.clone() })
    }

    /// What `round`'s current stage hands `peer`.
    pub(super) fn secagg_poll(&self, peer: &PeerIdentity, round: RoundId) -> Response {
        self.in_session(peer, round, |s, device| Response::SecAgg(view(s, device)))
    }

    /// `answer` from `round`'s session, if `peer` is a device in it.
    fn in_session(&self, peer: &PeerIdentity, round: RoundId, answer: impl FnOnce(&SecAggRound, &DeviceId) -> Response) -> Response {
        let core = self.lock();
        match secagg_device(peer).and_then(|device| Ok((self.session(&core, round, device)?, device))) {
            Ok((s, device)) => answer(s, device),
            Err(r) => Response::Error(r),
        }
    }

    /// A device's secure-aggregation request over MQTT (`crate::mqtt`): the requests and
    /// answers of QUIC, the masked vector attached to its message instead of streamed after it.
    /// Nothing else is served this way. `in_flight`: the attachment's budget share, which the
    /// caller waited for ([`Aggregator::wait_for_bytes`]); without it a masked vector is refused
    /// as `overloaded` when the budget is spent, as over QUIC.
    pub async fn secagg_over_mqtt(
        &self,
        device: &DeviceId,
        message: &[u8],
        attachment: &[u8],
        in_flight: Option<&BytesInFlight>,
    ) -> Response {
        let peer = PeerIdentity::Device(device.clone());
        match messages::decode::<Request>(message, MAX_WIRE_MESSAGE) {
            Ok(Request::SecAggRoster { round }) => self.secagg_roster(&peer, round),
            Ok(Request::SecAggPoll { round }) => self.secagg_poll(&peer, round),
            Ok(Request::SecAggSend { message, vector_len }) => {
                self.secagg_message(&peer, &message, vector_len, Attached::Bytes(attachment, in_flight)).await
            }
            Ok(other) => Response::Error(reject(
                RejectReason::NotPermitted,
                format!("over MQTT the aggregator answers secure-aggregation requests only, not {other:?}"),
            )),
            Err(e) => Response::Error(reject(RejectReason::Malformed, format!("request: {e}"))),
        }
    }

    /// Takes one stage message of `peer` (and its masked vector).
    pub(super) async fn secagg_message(&self, peer: &PeerIdentity, message: &[u8], vector_len: u64, vector: Attached<'_>) -> Response {
        let sent = match secagg_device(peer) {
            Ok(device) => self.secagg_send(device, message, vector_len, vector).await,
            Err(r) => Err(r),
        };
        match sent {
            Ok(()) => Response::SecAggTaken,
            Err(r) => {
                tracing::info!(peer = ?peer, reason = %r.reason, detail = %r.detail, "secure-aggregation message refused");
                Response::Error(r)
            }
        }
    }

    /// The open round's session, if `device` is in it.
    fn session<'a>(&self, core: &'a Core, round: RoundId, device: &DeviceId) -> Result<&'a SecAggRound, Rejection> {
        let s = [&core.secagg, &core.secagg_before]
            .into_iter()
            .flatten()
            .find(|s| s.server.roster().round == round)
            .ok_or_else(|| reject(RejectReason::UnknownRound, format!("no secure aggregation open for round {round}")))?;
        if s.server.roster().index(device).is_none() {
            return Err(reject(RejectReason::NotSelected, format!("{device} is not in round {round}'s roster")));
        }
        Ok(s)
    }

    async fn secagg_send(&self, device: &DeviceId, message: &[u8], vector_len: u64, attached: Attached<'_>) -> Result<(), Rejection> {
        let signed = Signed::<Message>::decode(message).map_err(|e| reject(e.reason(), e.to_string()))?;
        if signed.body().device != *device {
            return Err(reject(
                RejectReason::IdentityMismatch,
                format!("certificate is for device {device}, the message names {}", signed.body().device),
            ));
        }
        // The masked vector's size is the roster's, checked before a byte of it is read.
        let expected = {
            let core = self.lock();
            let s = self.session(&core, signed.body().round, device)?;
            (s.server.roster().dim as u64 + 1) * 8
        };
        if let Attached::Bytes(bytes, _) = &attached
            && bytes.len() as u64 != vector_len
        {
            return Err(reject(
                RejectReason::LengthMismatch,
                format!("the request announces a masked vector of {vector_len} bytes and attaches {}", bytes.len()),
            ));
        }
        // The vector's share of the in-flight budget is held until the protocol has taken it.
        let (vector, _in_flight) = if vector_len == 0 {
            (None, None)
        } else if vector_len != expected {
            return Err(reject(
                RejectReason::LengthMismatch,
                format!("a masked vector of this round is {expected} bytes, not {vector_len}"),
            ));
        } else {
            let reserved = match &attached {
                Attached::Bytes(_, Some(_)) => None,
                _ => Some(self.reserve_bytes(vector_len)?),
            };
            let vector = match attached {
                Attached::Streamed(stream) => receive_vector(stream, vector_len as usize).await?,
                Attached::Bytes(bytes, _) => words(bytes),
            };
            (Some(vector), reserved)
        };
        let me = self.clone();
        let device = device.clone();
        tokio::task::spawn_blocking(move || {
            let mut core = me.lock();
            let now = me.now_ms();
            let s = core
                .secagg
                .as_mut()
                .filter(|s| s.server.roster().round == signed.body().round)
                .ok_or_else(|| reject(RejectReason::StaleRound, "the round's secure aggregation ended"))?;
            s.server.handle_timeout(now);
            s.server.handle(&signed, vector.as_deref()).map_err(|r| {
                me.shared.metrics.secagg_refused(r.name());
                // A second message of a stage is the same refusal as a second update.
                let reason =
                    if matches!(r, fedfleet_secagg::Refusal::Duplicate(_)) { RejectReason::Duplicate } else { RejectReason::SecAggRefused };
                reject(reason, format!("{}: {r}", r.name()))
            })?;
            if let (fedfleet_secagg::Body::Masked { digest, .. }, Some(_)) = (&signed.body().body, &vector) {
                s.masked.insert(device, *digest);
            }
            me.secagg_settle(&mut core, now);
            Ok(())
        })
        .await
        .map_err(|e| reject(RejectReason::Internal, e.to_string()))?
    }

    /// Once the stages have ended: the sum merged into the round (which closes), or the round
    /// aborted with the protocol's reason. Runs once per round.
    fn secagg_settle(&self, core: &mut Core, now: Millis) {
        let Some(s) = core.secagg.as_mut().filter(|s| !s.settled) else { return };
        let round = s.server.roster().round;
        match s.server.stage() {
            Stage::Done => {
                s.settled = true;
                let agg = s.server.result().expect("done ⇒ a result").clone();
                match self.merge_sum(core, &agg, now) {
                    Ok(()) => {
                        let s = core.secagg.as_mut().expect("still open");
                        s.receipts = self.survivor_receipts(round, &s.masked, &agg.survivors, now);
                        tracing::info!(round = %round, survivors = agg.survivors.len(), dropped = agg.dropped.len(),
                            "secure aggregation: the round's sum is unmasked and merged");
                        // Nothing more can come: close the round now rather than at its deadline.
                        let _ = core.coord.engine_mut().close_round_now(now, round);
                    }
                    Err(e) => {
                        tracing::error!(round = %round, error = %e, "secure aggregation: the unmasked sum was refused; the round fails");
                        let _ = core.coord.engine_mut().abort_round(now, round, format!("secure aggregation: {e}"));
                    }
                }
            }
            Stage::Failed => {
                s.settled = true;
                let failure = s.server.failure().map(|f| format!("{}: {f}", f.name())).unwrap_or_default();
                tracing::warn!(round = %round, %failure, "secure aggregation failed: the round publishes nothing");
                self.shared.metrics.round("secagg_failed");
                let _ = core.coord.engine_mut().abort_round(now, round, format!("secure aggregation failed: {failure}"));
            }
            _ => return,
        }
        self.drain(core, now);
    }

    /// The unmasked sum into the round: stored (the sum alone), recorded under a receipt of its
    /// own, merged exactly. Durable before this returns.
    fn merge_sum(&self, core: &mut Core, agg: &fedfleet_secagg::Aggregate, now: Millis) -> Result<(), String> {
        let sh = &self.shared;
        let sums = agg.to_fixed(FRAC_BITS).ok_or("the secure-aggregation grid is finer than the fold's")?;
        let count = agg.survivors.len() as u64;
        let partial = PartialSum::from_raw(sums, agg.total_weight, count).map_err(|e| e.to_string())?;
        let bytes = partial.to_le_bytes();
        let payload_digest = Digest::of(&bytes);
        let contributor = DeviceId::new(SUM_CONTRIBUTOR).expect("a valid id");
        let nonce = *blake3::derive_key("fedfleet secagg sum nonce v1", &agg.round.0.to_le_bytes()).first_chunk::<16>().expect("16 bytes");
        let base_digest = core.base.as_ref().map(|b| b.digest).ok_or("no base model")?;
        let meta = RelayMeta {
            fleet: sh.allow.fleet(),
            relay: contributor.clone(),
            round: agg.round,
            base_digest,
            nonce: crate::engine::Nonce(nonce),
            update_count: count,
            total_weight: agg.total_weight,
            payload_digest,
        };
        sh.store.put_update(agg.round, &payload_digest, &bytes).map_err(|e| e.to_string())?;
        let accepted = core.coord.handle_relay(now, meta, &partial).map_err(|r| format!("{}", r.reason))?;
        let receipt =
            Receipt { fleet: sh.allow.fleet(), device: contributor, round: agg.round, nonce, payload_digest, accepted_at_unix_ms: now };
        let (_, seq) = self.record_accepted(receipt, accepted.round, agg.total_weight, count);
        sh.store.sync(seq).unwrap_or_else(|e| abort_on_commit_failure(e));
        sh.metrics.accepted.inc_by(count);
        sh.metrics.round_accepted.set(accepted.accepted as i64);
        Ok(())
    }

    /// A receipt for each survivor, naming its masked vector (all it sent of its update).
    fn survivor_receipts(
        &self,
        round: RoundId,
        masked: &BTreeMap<DeviceId, Digest>,
        survivors: &[DeviceId],
        now: Millis,
    ) -> BTreeMap<DeviceId, Vec<u8>> {
        let fleet = self.shared.allow.fleet();
        survivors
            .iter()
            .filter_map(|d| masked.get(d).map(|digest| (d, digest)))
            .map(|(d, digest)| {
                let r = Receipt {
                    fleet: fleet.clone(),
                    device: d.clone(),
                    round,
                    nonce: [0; 16],
                    payload_digest: *digest,
                    accepted_at_unix_ms: now,
                };
                (d.clone(), Signed::sign(r, &self.shared.key).encode())
            })
            .collect()
    }
}

/// The device a secure-aggregation request comes from (services take no part).
fn secagg_device(peer: &PeerIdentity) -> Result<&DeviceId, Rejection> {
    match peer {
        PeerIdentity::Device(d) => Ok(d),
        PeerIdentity::Service(_) => Err(reject(RejectReason::NotPermitted, "secure aggregation is between the aggregator and devices")),
    }
}

/// What the current stage hands `device`.
fn view(s: &SecAggRound, device: &DeviceId) -> SecAggView {
    let server = &s.server;
    let stage = server.stage();
    SecAggView {
        stage,
        keys: if stage == Stage::Shares { server.keys_for(device).iter().map(|m| m.encode()).collect() } else { Vec::new() },
        shares: if stage == Stage::Masked { server.shares_for(device) } else { Vec::new() },
        unmask: (stage == Stage::Unmask).then(|| server.unmask_request_for(device)),
        receipt: s.receipts.get(device).cloned(),
        failure: server.failure().map(|f| format!("{}: {f}", f.name())),
    }
}

/// A masked vector of exactly `len` bytes from `Chunk` frames and an `End`.
async fn receive_vector(stream: &mut FramedStream, len: usize) -> Result<Vec<u64>, Rejection> {
    let mut bytes = Vec::with_capacity(len);
    loop {
        match stream.recv().await {
            Ok(Some(Frame { kind: FrameKind::Chunk, body })) if bytes.len() + body.len() <= len => bytes.extend_from_slice(&body),
            Ok(Some(Frame { kind: FrameKind::End, .. })) if bytes.len() == len => break,
            Ok(Some(f)) => {
                return Err(reject(RejectReason::LengthMismatch, format!("{:?} frame past or short of the {len} bytes announced", f.kind)));
            }
            Ok(None) => return Err(reject(RejectReason::Malformed, "stream ended before the End frame")),
            Err(e) => return Err(reject(RejectReason::Malformed, e.to_string())),
        }
    }
    Ok(words(&bytes))
}

/// A masked vector's little-endian words.
fn words(bytes: &[u8]) -> Vec<u64> {
    bytes.chunks_exact(8).map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes"))).collect()
}
