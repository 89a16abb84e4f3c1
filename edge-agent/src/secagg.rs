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
    if let Err(outcome) = send(agg, &keys, &[]).await {
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
                if let Err(outcome) = send(agg, &message, &vector).await {
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

/// Sends one stage message; a refusal or a lost connection ends the device's part.
async fn send<A: Aggregator>(agg: &A, message: &Signed<Message>, vector: &[u8]) -> Result<(), UploadOutcome> {
    match agg.secagg_send(&message.encode(), vector).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(r)) => Err(UploadOutcome::Rejected(r)),
        Err(e) => Err(refused(RejectReason::SecAggFailed, format!("lost the aggregator during secure aggregation: {}", e.0))),
    }
}
