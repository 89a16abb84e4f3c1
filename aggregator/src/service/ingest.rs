//! One upload from either transport: cheap checks first, then decode, admission, fold and the
//! durable commit that the signed receipt stands on.

use super::*;

/// Flattens a delta bundle in canonical (sorted-name) order, dequantizing to f32.
pub fn flatten(bundle: &TensorBundle, _dim: usize) -> Vec<f32> {
    bundle.flat_f32()
}

/// Splits a flat model into a bundle with `layout` (sorted-name order).
pub fn unflatten(layout: &Layout, values: &[f32]) -> TensorBundle {
    let mut b = TensorBundle::new();
    let mut off = 0;
    for (name, shape) in layout {
        let n: usize = shape.iter().product();
        b.insert_f32(name, shape.clone(), values[off..off + n].to_vec()).expect("layout from a valid bundle");
        off += n;
    }
    b
}

/// Decodes and checks an update payload against the base model: limits, layout, dtype, finite.
pub fn decode_update(payload: &[u8], base_layout: &Layout, limits: &BundleLimits, dtype: DType, dim: usize) -> Result<Vec<f32>, Rejection> {
    let bundle = TensorBundle::decode(payload, limits).map_err(|e| reject(e.reason(), e.to_string()))?;
    bundle.check_layout(base_layout).map_err(|e| reject(e.reason(), e.to_string()))?;
    if let Some((name, t)) = bundle.iter().find(|(_, t)| t.dtype() != dtype) {
        return Err(reject(
            RejectReason::WrongDtype,
            format!("tensor {name:?} is {}, the header signs {}", t.dtype().as_str(), dtype.as_str()),
        ));
    }
    bundle.check_finite().map_err(|e| reject(e.reason(), e.to_string()))?;
    Ok(flatten(&bundle, dim))
}

pub(super) fn decode_base(bytes: &[u8]) -> Result<(Layout, Vec<f32>), String> {
    let b = TensorBundle::decode(bytes, &BundleLimits::default()).map_err(|e| e.to_string())?;
    b.check_finite().map_err(|e| e.to_string())?;
    let layout = b.layout();
    let dim = b.num_params();
    Ok((layout, flatten(&b, dim)))
}

/// The delta of an accepted update, read back from the update store and decoded again.
pub(super) fn stored_delta(store: &Store, rec: &AcceptedRecord, base: &Base, dtype: DType) -> Result<Vec<f32>, String> {
    let bytes = store.read_update(&rec.payload_digest).map_err(|e| e.to_string())?;
    decode_update(&bytes, &base.sent.layout, &base.limits(), dtype, base.dim())
        .map_err(|r| format!("stored update {} no longer decodes: {}", rec.payload_digest, r.detail))
}

/// The whole payload an upload's header binds: `Chunk` frames up to `End` over QUIC (the first
/// byte past the signed length refused), or the MQTT upload's; its digest checked.
pub(super) async fn receive_payload(
    header: &impl fedfleet_protocol::envelope::PayloadBinding,
    payload: Payload<'_>,
) -> Result<Vec<u8>, Rejection> {
    let mut check = PayloadCheck::new(header);
    let refused = |e: fedfleet_protocol::EnvelopeError| reject(e.reason(), e.to_string());
    let stream = match payload {
        Payload::Mqtt(upload, _) => {
            let bytes = upload.into_payload();
            check.update(&bytes).map_err(refused)?;
            check.finish().map_err(refused)?;
            return Ok(bytes);
        }
        Payload::Quic(stream) => stream,
    };
    // A payload of one chunk is that chunk's buffer, not a copy; more chunks go into one
    // buffer of the length the checked header states.
    let mut payload = Vec::new();
    loop {
        match stream.recv().await {
            Ok(Some(Frame { kind: FrameKind::Chunk, body })) => {
                check.update(&body).map_err(refused)?;
                if payload.is_empty() {
                    payload = body;
                    payload.reserve_exact((header.payload_len() as usize).saturating_sub(payload.len()));
                } else {
                    payload.extend_from_slice(&body);
                }
            }
            Ok(Some(Frame { kind: FrameKind::End, .. })) => break,
            Ok(Some(f)) => return Err(reject(RejectReason::Malformed, format!("unexpected {:?} frame in a payload", f.kind))),
            Ok(None) => return Err(reject(RejectReason::Malformed, "stream ended before the End frame")),
            Err(e) => return Err(reject(RejectReason::Malformed, e.to_string())),
        }
    }
    check.finish().map_err(refused)?;
    Ok(payload)
}

/// An update whose header and payload digest passed every check: what step 7 verifies (its
/// signature, in a batch with the other queued uploads'), decodes, folds and commits.
pub(super) struct Checked {
    h: fedfleet_protocol::UpdateHeader,
    /// The signed header and its device's key, for the batch check on the fold thread.
    signed: SignedUpdate,
    key: ed25519_dalek::VerifyingKey,
    /// The signature verified against `key` already (by the MQTT control client): no batch
    /// check.
    signature_verified: bool,
    meta: UpdateMeta,
    payload: Vec<u8>,
    /// The payload already decoded (a large one is decoded before it joins the commit queue).
    delta: Option<Vec<f32>>,
    base: Base,
    dtype: DType,
    /// When the current ingest stage began (see [`crate::metrics::INGEST_STEPS`]).
    since: Instant,
}

impl Aggregator {
    // ----- ingest -----

    /// Checks, folds and commits one upload from either transport; the answer is the signed
    /// receipt. `peer` is the identity the transport authenticated (the QUIC client certificate,
    /// or the MQTT topic's device, whose key the control client already checked). The caller
    /// counts and reports a rejection.
    pub async fn ingest(&self, peer: &PeerIdentity, update: SignedUpdate, payload: Payload<'_>) -> Result<Signed<Receipt>, Rejection> {
        let sh = &self.shared;
        let mut since = Instant::now();
        let h = update.body().clone();
        // 1. The connection's certificate must be the header's device.
        match peer {
            PeerIdentity::Device(id) if *id == h.device => {}
            PeerIdentity::Device(id) => {
                return Err(reject(
                    RejectReason::IdentityMismatch,
                    format!("certificate is for device {id}, the header names {}", h.device),
                ));
            }
            PeerIdentity::Service(n) => {
                return Err(reject(RejectReason::NotPermitted, format!("service {n} cannot upload updates")));
            }
        }
        // Under secure aggregation no update travels in the clear: refused before any payload
        // byte is read.
        if sh.cfg.secure_aggregation.is_some() {
            return Err(reject(
                RejectReason::NotPermitted,
                "this aggregator takes updates only masked, through its secure-aggregation stages ([secure_aggregation])",
            ));
        }
        // 2. Enrollment and revocation: the signed revocation list (what `fedfleet-certs revoke`
        // writes and the handshake checks) and the allow-list, each re-read when it changes.
        let status = match sh.allow.status(&h.device) {
            DeviceStatus::Enrolled(_) if sh.revocation.is_revoked(&h.device) => DeviceStatus::Revoked,
            status => status,
        };
        let key = match status {
            DeviceStatus::Unknown => return Err(reject(RejectReason::UnknownDevice, format!("{} is not enrolled", h.device))),
            DeviceStatus::Revoked => {
                self.lock().coord.engine_mut().revoke(h.device.clone());
                return Err(reject(RejectReason::Revoked, format!("{} is revoked", h.device)));
            }
            DeviceStatus::Enrolled(k) => k,
        };
        if let Some(region) = sh.cfg.relay.as_ref().map(|r| &r.region).filter(|r| !r.is_empty())
            && !region.contains(&h.device)
        {
            return Err(reject(RejectReason::NotPermitted, format!("{} is not in this relay's region", h.device)));
        }
        // 3. The signature is checked on the fold thread, in a batch with the other uploads
        // queued there (see [`CommitQueue`]), before anything is folded or stored: the
        // connection already proved the device, and the payload it may send is bounded below.
        // (Not again for an MQTT upload the control client verified: step 7.)
        sh.metrics.ingest_step("authenticate", &mut since);
        // 4. A resend of an accepted update gets its receipt again (once the record is durable:
        // the first attempt may still be waiting for its flush), its signature checked here.
        // (The record's round is the one it was folded into: an asynchronous campaign folds an
        // update of an earlier buffer into the open one. The receipt names the update's own.)
        if let Some(receipt) = self.receipt_of_resend(&h.device, &h.nonce, &h.payload_digest, h.round)? {
            update.verify(&key).map_err(|e| reject(e.reason(), e.to_string()))?;
            return Ok(receipt);
        }
        // 5. Round, replay, duplicate, selection, sample count; size.
        let meta = UpdateMeta::from(&h);
        let (base, dtype) = {
            let mut core = self.lock();
            let now = self.now_ms();
            let r = core.coord.check_update(now, &meta);
            self.drain(&mut core, now);
            r.map_err(|r| reject(r.reason, format!("round {}: {}", h.round, r.reason)))?;
            let base = core.base.clone().ok_or_else(|| reject(RejectReason::Internal, "no base model"))?;
            (base, core.campaign.payload_dtype())
        };
        if h.payload_dtype != dtype {
            return Err(reject(
                RejectReason::WrongDtype,
                format!("the round asks for {}, the header signs {}", dtype.as_str(), h.payload_dtype.as_str()),
            ));
        }
        if h.payload_len > base.max_payload() {
            return Err(reject(
                RejectReason::TooLarge,
                format!("payload of {} bytes; the limit for this model is {}", h.payload_len, base.max_payload()),
            ));
        }
        // 6. Admission by bytes in flight, before the payload is read.
        let _in_flight = self.admit(&payload, h.payload_len)?;
        sh.metrics.ingest_step("admit", &mut since);
        // 7. The payload through the digest/length check (streamed over QUIC). An MQTT upload the
        // control client verified, with this same header against the device's key as it is
        // now, is not verified again: its signature and digest stand.
        let signature_verified = matches!(&payload, Payload::Mqtt(v, _) if *v.signed() == update && *v.key() == key);
        let payload = match payload {
            Payload::Mqtt(v, _) if signature_verified => v.into_payload(),
            payload => receive_payload(&h, payload).await?,
        };
        sh.metrics.ingest_step("receive", &mut since);
        self.commit(Checked { h, signed: update, key, signature_verified, meta, payload, delta: None, base, dtype, since }).await
    }

    /// The receipt of an accepted upload sent again (same sender, nonce, payload and round), once
    /// its record is durable (the first attempt may still be waiting for its flush).
    pub(super) fn receipt_of_resend(
        &self,
        sender: &fedfleet_protocol::DeviceId,
        nonce: &[u8; 16],
        payload_digest: &Digest,
        round: RoundId,
    ) -> Result<Option<Signed<Receipt>>, Rejection> {
        let store = &self.shared.store;
        let Ok(Some(rec)) = store.accepted(sender, nonce) else { return Ok(None) };
        if rec.payload_digest != *payload_digest {
            return Ok(None);
        }
        let receipt =
            Signed::<Receipt>::decode(&rec.receipt).map_err(|e| reject(RejectReason::Internal, format!("stored receipt: {e}")))?;
        if receipt.body().round != round {
            return Ok(None);
        }
        store.sync_all().unwrap_or_else(|e| abort_on_commit_failure(e));
        Ok(Some(receipt))
    }

    /// The commit point of an accepted upload (a device's update, or a relay's sum of `relayed`
    /// updates) folded into `folded_into`: the receipt signed and its record applied. Durable
    /// once [`Store::sync`] of the returned sequence number returns; only then may it be sent.
    pub(super) fn record_accepted(&self, receipt: Receipt, folded_into: RoundId, weight: u64, relayed: u64) -> (Signed<Receipt>, u64) {
        let (device, payload_digest, nonce) = (receipt.device.clone(), receipt.payload_digest, receipt.nonce);
        let receipt = Signed::sign(receipt, &self.shared.key);
        let rec = AcceptedRecord { round: folded_into, device, payload_digest, weight, receipt: receipt.encode(), relayed };
        let seq = self.shared.store.apply_update(&nonce, &rec).unwrap_or_else(|e| abort_on_commit_failure(e));
        (receipt, seq)
    }

    /// Takes `len` bytes of the `[admission] max_bytes_in_flight` budget until the permit drops;
    /// `overloaded` (with the retry-after) when it is spent. (An upload larger than the whole
    /// budget takes all of it, and waits for it alone.)
    pub(super) fn reserve_bytes(&self, len: u64) -> Result<tokio::sync::OwnedSemaphorePermit, Rejection> {
        self.shared.in_flight.clone().try_acquire_many_owned(self.in_flight_kib(len)).map_err(|_| self.budget_spent())
    }

    /// The refusal of an upload past the byte budget: `overloaded`, with the retry-after.
    fn budget_spent(&self) -> Rejection {
        let limits = self.shared.cfg.admission;
        let what = format!("{} bytes of updates in flight", limits.max_bytes_in_flight);
        reject(RejectReason::Overloaded, fedfleet_protocol::reject::overloaded_detail(what, limits.retry_after_ms))
    }

    /// Waits for `len` bytes of the `[admission] max_bytes_in_flight` budget, for an upload that
    /// arrived whole (over MQTT). Refusing it as `overloaded` at once would only make its device
    /// send it again through the broker; waiting holds the broker's deliveries back, and the
    /// broker queues them. Past `at_most` it is refused as a QUIC upload is: its caller stops
    /// reading its connection while it waits, and must not wait past the connection's keep-alive.
    pub async fn wait_for_bytes(&self, len: u64, at_most: Duration) -> Result<super::BytesInFlight, Rejection> {
        let acquire = self.shared.in_flight.clone().acquire_many_owned(self.in_flight_kib(len));
        match tokio::time::timeout(at_most, acquire).await {
            Ok(permit) => Ok(super::BytesInFlight { _permit: permit.expect("the in-flight semaphore is never closed") }),
            Err(_) => Err(self.budget_spent()),
        }
    }

    /// Step 6, admission by bytes in flight: a QUIC payload takes its share (or is refused as
    /// `overloaded`) before it is read; one that arrived whole holds its share already.
    pub(super) fn admit(&self, payload: &Payload<'_>, len: u64) -> Result<Option<tokio::sync::OwnedSemaphorePermit>, Rejection> {
        match payload {
            Payload::Quic(_) => self.reserve_bytes(len).map(Some),
            Payload::Mqtt(..) => Ok(None),
        }
    }

    /// The KiB of the in-flight budget an upload of `len` bytes takes.
    fn in_flight_kib(&self, len: u64) -> u32 {
        len.div_ceil(1024).clamp(1, u64::from(self.shared.cfg.admission.in_flight_kib())) as u32
    }

    /// Whether uploads beyond a group's `group_kib` hold in-flight bytes (streaming, or waiting
    /// to fold): their records are coming.
    fn others_in_flight(&self, group_kib: usize) -> bool {
        let sh = &self.shared;
        let held = (sh.cfg.admission.in_flight_kib() as usize).saturating_sub(sh.in_flight.available_permits());
        held > group_kib
    }

    /// Step 7: decode, check, fold and commit in the commit pipeline (see [`CommitQueue`]);
    /// the answer comes once the update's record is durable.
    pub(super) async fn commit(&self, mut checked: Checked) -> Result<Signed<Receipt>, Rejection> {
        let stopped = || reject(RejectReason::Internal, "the aggregator's commit pipeline has stopped");
        if checked.payload.len() > DECODE_ON_COMMIT_THREAD_MAX {
            // A big model's decode runs beside other uploads' rather than in the queue's line.
            let decoded = tokio::task::spawn_blocking(move || {
                let Checked { payload, base, dtype, .. } = &checked;
                checked.delta = Some(decode_update(payload, &base.sent.layout, &base.limits(), *dtype, base.dim())?);
                Ok(checked)
            });
            checked = decoded.await.map_err(|e| reject(RejectReason::Internal, e.to_string()))??;
        }
        let (answer, receipt) = tokio::sync::oneshot::channel();
        self.shared.commits.0.send(CommitJob { me: self.clone(), checked, answer }).map_err(|_| stopped())?;
        receipt.await.map_err(|_| stopped())?
    }

    /// Decodes, admits again, folds and records one update (not yet durable: the caller syncs
    /// the returned sequence number before the receipt may leave).
    fn fold_and_record(&self, checked: Checked) -> Result<(Signed<Receipt>, u64, Instant), Rejection> {
        let Checked { h, meta, payload, delta, base, dtype, mut since, .. } = checked;
        let sh = &self.shared;
        let delta = match delta {
            Some(delta) => delta,
            None => decode_update(&payload, &base.sent.layout, &base.limits(), dtype, base.dim())?,
        };
        sh.metrics.ingest_step("decode", &mut since);
        sh.store.put_update(h.round, &h.payload_digest, &payload).map_err(|e| reject(RejectReason::Internal, e.to_string()))?;
        drop(payload);
        sh.metrics.ingest_step("store_payload", &mut since);
        let mut core = self.lock();
        // A new version may have been published while the payload streamed: admission runs again
        // below (a synchronous round is over then; an asynchronous buffer takes the update,
        // discounted). The delta was decoded for this layout, which a campaign never changes.
        if core.base.as_ref().map(|b| &b.sent.layout) != Some(&base.sent.layout) {
            return Err(reject(RejectReason::StaleRound, "the model's layout changed while the payload streamed"));
        }
        let now = self.now_ms();
        let t = Instant::now();
        let accepted = core.coord.handle_update(now, meta, &delta);
        let accepted = match accepted {
            Ok(a) => a,
            Err(r) => {
                self.drain(&mut core, now);
                return Err(reject(r.reason, format!("round {}: {}", h.round, r.reason)));
            }
        };
        if core.coord.mode() == FoldMode::Streaming {
            sh.metrics.folded(delta.len() as u64 * 4, t.elapsed());
        }
        sh.metrics.ingest_step("fold", &mut since);
        self.history_update_accepted(&mut core, accepted.round, now);
        let receipt = Receipt {
            fleet: h.fleet.clone(),
            device: h.device.clone(),
            round: h.round,
            nonce: h.nonce,
            payload_digest: h.payload_digest,
            accepted_at_unix_ms: now,
        };
        let (receipt, seq) = self.record_accepted(receipt, accepted.round, accepted.weight, 0);
        sh.metrics.ingest_step("record", &mut since);
        sh.metrics.accepted.inc();
        sh.metrics.update_staleness.observe(f64::from(accepted.staleness));
        // Accepted payloads only: refused bytes are counted by their refusal, not here.
        sh.metrics.update_bytes.inc_by(h.payload_len);
        sh.metrics.round_accepted.set(accepted.accepted as i64);
        tracing::info!(device = %h.device, round = %accepted.round, accepted = accepted.accepted,
            target = accepted.target, staleness = accepted.staleness, "update accepted");
        self.drain(&mut core, now);
        Ok((receipt, seq, since))
    }
}

/// Payloads up to this size are decoded on the fold thread itself (a hand-off to another
/// thread would cost more than the decode).
const DECODE_ON_COMMIT_THREAD_MAX: usize = 1 << 20;

/// Most uploads one group commit covers: the first of a group waits for at most this many folds.
const MAX_COMMIT_GROUP: usize = 256;

/// How long a group commit waits for more folded uploads while others are still in flight: one
/// flush (three `fdatasync`s, and sled waking its writer threads) then covers them all. At a few
/// hundred uploads a second, each had a flush of its own.
const COMMIT_LINGER: Duration = Duration::from_millis(5);

/// Most queued uploads whose signatures the fold thread checks in one batch.
const MAX_SIGNATURE_BATCH: usize = 64;

/// The queue of checked uploads into the aggregator's commit pipeline: two threads, no thread or
/// lock wait per upload. The fold thread takes every upload waiting (up to
/// [`MAX_SIGNATURE_BATCH`]), checks their signatures in one ed25519 batch, then folds and
/// records each in turn; the sync thread takes every recorded upload waiting for it (up to
/// [`MAX_COMMIT_GROUP`]; while other uploads are in flight, it waits up to [`COMMIT_LINGER`]
/// for theirs), makes them durable with one flush and only then answers each, while the fold
/// thread goes on with the next ones. Both end when the last [`Aggregator`] handle (and with
/// it the queue) drops.
pub(super) struct CommitQueue(std::sync::mpsc::Sender<CommitJob>);

/// An update folded and recorded, waiting for the flush that makes its record durable.
struct Recorded {
    me: Aggregator,
    answer: tokio::sync::oneshot::Sender<Result<Signed<Receipt>, Rejection>>,
    receipt: Signed<Receipt>,
    seq: u64,
    since: Instant,
    /// The upload's share of the in-flight budget.
    kib: u32,
}

pub(super) struct CommitJob {
    /// The job carries its service handle, so the thread holds none between jobs.
    me: Aggregator,
    checked: Checked,
    answer: tokio::sync::oneshot::Sender<Result<Signed<Receipt>, Rejection>>,
}

impl CommitQueue {
    pub(super) fn start() -> std::io::Result<CommitQueue> {
        let (queue, jobs) = std::sync::mpsc::channel::<CommitJob>();
        let (to_sync, recorded) = std::sync::mpsc::channel::<Recorded>();
        std::thread::Builder::new().name("aggregator-sync".into()).spawn(move || {
            while let Ok(first) = recorded.recv() {
                let linger_until = Instant::now() + COMMIT_LINGER;
                let mut group_kib = first.kib as usize;
                let mut group = vec![first];
                while group.len() < MAX_COMMIT_GROUP {
                    let next = recorded.try_recv().ok().or_else(|| {
                        let wait = linger_until.saturating_duration_since(Instant::now());
                        group[0].me.others_in_flight(group_kib).then(|| recorded.recv_timeout(wait).ok()).flatten()
                    });
                    let Some(r) = next else { break };
                    group_kib += r.kib as usize;
                    group.push(r);
                }
                sync_group(group);
            }
        })?;
        std::thread::Builder::new().name("aggregator-fold".into()).spawn(move || {
            while let Ok(first) = jobs.recv() {
                let mut group = vec![first];
                while group.len() < MAX_SIGNATURE_BATCH
                    && let Ok(job) = jobs.try_recv()
                {
                    group.push(job);
                }
                for (CommitJob { me, mut checked, answer }, signature) in check_signatures(group) {
                    let kib = me.in_flight_kib(checked.h.payload_len);
                    // Waiting behind the group's earlier uploads is queueing, not decoding.
                    me.shared.metrics.ingest_step("queue", &mut checked.since);
                    let outcome = signature.and_then(|()| {
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| me.fold_and_record(checked)))
                            .unwrap_or_else(|_| Err(reject(RejectReason::Internal, "folding the update panicked")))
                    });
                    match outcome {
                        Ok((receipt, seq, since)) => {
                            let _ = to_sync.send(Recorded { me, answer, receipt, seq, since, kib });
                        }
                        Err(r) => {
                            let _ = answer.send(Err(r));
                        }
                    }
                }
            }
        })?;
        Ok(CommitQueue(queue))
    }
}

/// The signatures of a group of queued uploads not verified yet, checked in one batch; each
/// such upload's share of the batch's time is its `signature` stage.
fn check_signatures(mut group: Vec<CommitJob>) -> impl Iterator<Item = (CommitJob, Result<(), Rejection>)> {
    for job in &mut group {
        job.me.shared.metrics.ingest_step("queue", &mut job.checked.since);
    }
    let started = Instant::now();
    let items: Vec<_> = group.iter().filter(|j| !j.checked.signature_verified).map(|j| (&j.checked.signed, &j.checked.key)).collect();
    let mut verdicts = fedfleet_protocol::verify_batch(&items).into_iter();
    let share = started.elapsed() / items.len().max(1) as u32;
    let outcomes: Vec<_> = group
        .iter_mut()
        .map(|job| {
            // (One verified already waited for the batch: its `queue`.)
            if job.checked.signature_verified {
                return Ok(());
            }
            job.me.shared.metrics.ingest_add("signature", share);
            job.checked.since = Instant::now();
            verdicts.next().expect("a verdict for each unverified upload").map_err(|e| reject(e.reason(), e.to_string()))
        })
        .collect();
    group.into_iter().zip(outcomes)
}

/// One flush for a group of recorded updates, then their receipts.
fn sync_group(group: Vec<Recorded>) {
    let last = group.iter().map(|r| r.seq).max().unwrap_or(0);
    let sh = &group[0].me.shared;
    sh.store.sync(last).unwrap_or_else(|e| abort_on_commit_failure(e));
    sh.metrics.commit_flushes.inc();
    for Recorded { me, answer, receipt, mut since, .. } in group {
        me.shared.metrics.ingest_step("sync", &mut since);
        let _ = answer.send(Ok(receipt));
    }
}
