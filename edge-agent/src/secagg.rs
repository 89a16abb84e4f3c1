//! The device's side of a securely aggregated round: its trained update, which never leaves the
//! device in the clear, goes through the aggregator's SecAgg+ stages (`fedfleet_secagg::Client`,
//! the sans-IO protocol) by polling for what each stage hands it, until the round's sum is
//! unmasked (a receipt) or the round's secure aggregation fails (a named refusal).

use std::time::Duration;

use ed25519_dalek::SigningKey;
use fedfleet_agent_core::lifecycle::UploadOutcome;
use fedfleet_protocol::{
    BundleLimits, DeviceId, Millis, Receipt, RejectReason, Rejection, RoundAnnouncement, Signed, SignedUpdate, TensorBundle,
};
use fedfleet_secagg::{Client, Message, Stage};

use crate::clients::Aggregator;

/// How often the stages are polled.
const POLL: Duration = Duration::from_millis(200);

fn refused(reason: RejectReason, detail: impl Into<String>) -> UploadOutcome {
    UploadOutcome::Rejected(Rejection::new(reason, detail))
}

/// Runs `round`'s stages for the update in `header`/`payload` until the round's sum holds it or
/// the round has no use for it; `now` reads the device clock (the round's deadline bounds the
/// wait). A transport error before this device's first message is retried by the caller; one
/// after it ends the device's part in the round (its secrets are gone with this call).
pub async fn securely_aggregate<A: Aggregator>(
    agg: &A,
    key: &SigningKey,
    device: &DeviceId,
    round: &RoundAnnouncement,
    header: &[u8],
    payload: &[u8],
    now: impl Fn() -> Millis,
) -> UploadOutcome {
    let header = match SignedUpdate::decode(header) {
        Ok(h) => h.body().clone(),
        Err(e) => return refused(RejectReason::Malformed, format!("the outbox header does not decode: {e}")),
    };
    let update = match TensorBundle::decode(payload, &BundleLimits::default()) {
        Ok(b) => b.flat_f32(),
        Err(e) => return refused(RejectReason::Malformed, format!("the outbox payload does not decode: {e}")),
    };
    // DP-FedAvg counts each device once (its noise share is sized for that).
    let weight = match round.config.device_privacy {
        Some(p) if p.count_once => 1,
        _ => header.sample_count.min(round.config.max_samples.unwrap_or(u64::MAX)).max(1),
    };
    let roster = match agg.secagg_roster(round.round).await {
        Ok(r) => r,
        Err(e) => return UploadOutcome::TransportError(e.0),
    };
    let mut entropy = [0u8; 32];
    rand::RngCore::fill_bytes(&mut rand::rngs::OsRng, &mut entropy);
    let (mut client, keys) = match Client::new(roster, device, key.clone(), entropy) {
        Ok(c) => c,
        Err(e) => return refused(RejectReason::NotSelected, e.to_string()),
    };
    if let Err(outcome) = send(agg, &keys, &[], round, &now).await {
        return outcome;
    }
    let mut masked_digest = None;
    loop {
        if now() >= round.deadline_unix_ms {
            return refused(RejectReason::DeadlinePassed, "the round's deadline passed during secure aggregation");
        }
        tokio::time::sleep(POLL).await;
        let view = match agg.secagg_poll(round.round).await {
            Ok(v) => v,
            Err(e) => {
                tracing::debug!(error = %e, "secure-aggregation poll failed; polling again");
                continue;
            }
        };
        let step = match (view.stage, client.stage()) {
            (Stage::Shares, Stage::Keys) => {
                let adverts: Result<Vec<Signed<Message>>, _> = view.keys.iter().map(|b| Signed::<Message>::decode(b)).collect();
                adverts.map_err(|e| e.to_string()).and_then(|a| client.on_keys(&a).map_err(|e| e.to_string())).map(|m| (m, Vec::new()))
            }
            (Stage::Masked, Stage::Shares) => client.on_shares(&view.shares, &update, weight).map_err(|e| e.to_string()).map(|(m, y)| {
                let bytes = fedfleet_secagg::vector_bytes(&y);
                masked_digest = Some(fedfleet_protocol::Digest::of(&bytes));
                (m, bytes)
            }),
            (Stage::Unmask, Stage::Masked) => match &view.unmask {
                Some(request) => client.on_unmask(request).map_err(|e| e.to_string()).map(|m| (m, Vec::new())),
                None => continue,
            },
            (Stage::Done, _) => {
                return match view.receipt.as_deref().map(Signed::<Receipt>::decode) {
                    Some(Ok(r)) if r.body().device == *device && Some(r.body().payload_digest) == masked_digest => {
                        UploadOutcome::SecurelyAggregated(r.body().clone())
                    }
                    Some(_) => refused(RejectReason::Malformed, "the secure-aggregation receipt does not name this device's masked vector"),
                    None => refused(RejectReason::SecAggFailed, "the round's sum was unmasked without this device's update"),
                };
            }
            (Stage::Failed, _) => return refused(RejectReason::SecAggFailed, view.failure.unwrap_or_default()),
            (server, mine) if server > acts_at(mine) => {
                return refused(
                    RejectReason::SecAggFailed,
                    format!("the round moved on to its {server:?} stage while this device was at {mine:?}"),
                );
            }
            _ => continue,
        };
        match step {
            Ok((message, vector)) => {
                if let Err(outcome) = send(agg, &message, &vector, round, &now).await {
                    return outcome;
                }
            }
            Err(e) => return refused(RejectReason::SecAggFailed, e),
        }
    }
}

/// The aggregator's stage at which a device at `mine` sends its next message.
fn acts_at(mine: Stage) -> Stage {
    match mine {
        Stage::Keys => Stage::Shares,
        Stage::Shares => Stage::Masked,
        Stage::Masked => Stage::Unmask,
        other => other,
    }
}

/// Sends one stage message. An `overloaded` refusal took nothing in (the aggregator turned the
/// connection or the message away before reading it), so the same message goes again after the
/// retry-after it names plus up to as much again of jitter (a crowd refused together does not
/// return together), within the round's deadline; the device keeps its secrets meanwhile. A lost
/// answer (a transport error: a dropped connection, an MQTT answer that did not come) sends the
/// same message again after a poll interval, and a `duplicate` refusal of a copy sent again
/// means an earlier copy was taken. Any other refusal ends the device's part.
async fn send<A: Aggregator>(
    agg: &A,
    message: &Signed<Message>,
    vector: &[u8],
    round: &RoundAnnouncement,
    now: &impl Fn() -> Millis,
) -> Result<(), UploadOutcome> {
    let bytes = message.encode();
    let mut sent_before = false;
    loop {
        match agg.secagg_send(&bytes, vector).await {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(r)) if sent_before && is_duplicate(&r) => {
                tracing::debug!("a stage message sent again was a duplicate: the first copy arrived");
                return Ok(());
            }
            Ok(Err(r)) if r.reason == RejectReason::Overloaded => {
                // A refusal naming no retry-after: the admission's default, as for a connection
                // refused before its handshake.
                let default = fedfleet_net::admission::DEFAULT_RETRY_AFTER.as_millis() as u64;
                let after = fedfleet_protocol::reject::retry_after_ms(&r.detail).unwrap_or(default);
                let wait = after + rand::Rng::gen_range(&mut rand::rngs::OsRng, 0..=after);
                if now().saturating_add(wait) >= round.deadline_unix_ms {
                    return Err(UploadOutcome::Rejected(r));
                }
                tracing::debug!(retry_in_ms = wait, detail = %r.detail, "secure-aggregation message turned away for load; sending it again");
                tokio::time::sleep(Duration::from_millis(wait)).await;
            }
            Ok(Err(r)) => return Err(UploadOutcome::Rejected(r)),
            Err(e) => {
                if now().saturating_add(POLL.as_millis() as u64) >= round.deadline_unix_ms {
                    return Err(refused(RejectReason::SecAggFailed, format!("lost the aggregator during secure aggregation: {}", e.0)));
                }
                tracing::debug!(error = %e, "a stage message got no answer; sending it again");
                sent_before = true;
                tokio::time::sleep(POLL).await;
            }
        }
    }
}

/// The aggregator's refusal of a second message of one stage from the same device.
fn is_duplicate(r: &Rejection) -> bool {
    r.reason == RejectReason::Duplicate
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use fedfleet_protocol::{FleetId, ModelRef, ModelVersion, RoundConfig, RoundId, Selection};

    use fedfleet_secagg::Body;

    use super::*;
    use crate::clients::{BaseModel, TransportError, UploadReply};

    /// Answers the `n`th send (from 1) with `answer(n)`; counts every send.
    struct Scripted {
        sends: Mutex<u32>,
        answer: fn(u32) -> Result<Result<(), Rejection>, TransportError>,
    }

    impl Scripted {
        fn new(answer: fn(u32) -> Result<Result<(), Rejection>, TransportError>) -> Self {
            Scripted { sends: Mutex::new(0), answer }
        }
        fn sends(&self) -> u32 {
            *self.sends.lock().unwrap()
        }
    }

    impl Aggregator for Scripted {
        async fn current_round(&self, _: &FleetId) -> Result<Option<RoundAnnouncement>, TransportError> {
            Ok(None)
        }
        async fn fetch_base_model(&self, _: &ModelRef) -> Result<BaseModel, TransportError> {
            Err(TransportError("no models here".into()))
        }
        async fn upload(&self, _: &[u8], _: &[u8]) -> Result<UploadReply, TransportError> {
            Err(TransportError("no uploads here".into()))
        }
        async fn secagg_send(&self, _: &[u8], _: &[u8]) -> Result<Result<(), Rejection>, TransportError> {
            let mut sends = self.sends.lock().unwrap();
            *sends += 1;
            (self.answer)(*sends)
        }
    }

    fn overloaded() -> Result<Result<(), Rejection>, TransportError> {
        Ok(Err(Rejection::new(RejectReason::Overloaded, fedfleet_protocol::reject::overloaded_detail("device connections", 20))))
    }

    fn duplicate() -> Result<Result<(), Rejection>, TransportError> {
        Ok(Err(Rejection::new(RejectReason::Duplicate, "duplicate: device dev-1 already sent this stage's message")))
    }

    fn round(deadline_unix_ms: u64) -> RoundAnnouncement {
        RoundAnnouncement {
            fleet: FleetId::new("f").unwrap(),
            round: RoundId(1),
            base_model: ModelRef { name: "m".into(), version: ModelVersion(1), digest: fedfleet_protocol::Digest::of(b"m") },
            config: RoundConfig::default(),
            deadline_unix_ms,
            selection: Selection::All,
        }
    }

    fn keys() -> Signed<Message> {
        let body = Body::Keys { c_public: [1; 32], s_public: [2; 32], b_commitment: [3; 32] };
        let m = Message { round: RoundId(1), session: [0; 32], device: DeviceId::new("dev-1").unwrap(), body };
        Signed::sign(m, &SigningKey::from_bytes(&[4; 32]))
    }

    /// A stage message whose answer was lost goes again, and the duplicate refusal of the copy
    /// tells the device the first one arrived: it stays in the round. A duplicate refusal of a
    /// first send is a refusal; a lost answer past the deadline ends the device's part.
    #[tokio::test]
    async fn a_stage_message_whose_answer_was_lost_is_sent_again_and_a_duplicate_means_taken() {
        // The first copy was taken but its answer lost; the copy is refused as a duplicate.
        let lost_then_duplicate = |n| if n == 1 { Err(TransportError("mqtt request: no answer within 3s".into())) } else { duplicate() };
        let lost = Scripted::new(lost_then_duplicate);
        assert!(send(&lost, &keys(), &[], &round(u64::MAX), &|| 1_000).await.is_ok());
        assert_eq!(lost.sends(), 2);

        let first = Scripted::new(|_| duplicate());
        let Err(UploadOutcome::Rejected(r)) = send(&first, &keys(), &[], &round(u64::MAX), &|| 1_000).await else { panic!("refused") };
        assert_eq!(r.reason, RejectReason::Duplicate);

        let lost = Scripted::new(lost_then_duplicate);
        let Err(UploadOutcome::Rejected(r)) = send(&lost, &keys(), &[], &round(1_100), &|| 1_000).await else { panic!("given up") };
        assert_eq!((r.reason, lost.sends()), (RejectReason::SecAggFailed, 1));
    }

    /// A stage message turned away for load goes again after the retry-after (the device keeps
    /// its part in the round); one that could only go again after the deadline is given up with
    /// the refusal as it came.
    #[tokio::test]
    async fn a_stage_message_turned_away_for_load_is_sent_again_after_its_retry_after() {
        let busy = Scripted::new(|n| if n <= 3 { overloaded() } else { Ok(Ok(())) });
        let start = std::time::Instant::now();
        let clock = || 1_000 + start.elapsed().as_millis() as u64;
        assert!(send(&busy, &keys(), &[], &round(u64::MAX), &clock).await.is_ok());
        assert_eq!(busy.sends(), 4, "three refusals, then taken");
        let waited = start.elapsed().as_millis();
        assert!(waited >= 60, "each retry waits at least the 20 ms retry-after: waited {waited} ms");

        let busy = Scripted::new(|n| if n <= 1 { overloaded() } else { Ok(Ok(())) });
        let Err(UploadOutcome::Rejected(r)) = send(&busy, &keys(), &[], &round(1_010), &|| 1_000).await else { panic!("given up") };
        assert_eq!((r.reason, busy.sends()), (RejectReason::Overloaded, 1));
    }
}
