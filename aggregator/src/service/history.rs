//! The round history: one record per round that ended (published or failed), with its
//! updates, server-side metrics, refusals by reason and timings, kept in the store's
//! `round_history` journal for the console's campaign view. Records are written when a round
//! ends; the open round's facts wait in `Core::round_log`.

use super::*;
use serde::{Deserialize, Serialize};

/// Round records kept (older ones are trimmed).
pub(super) const KEEP: usize = 10_000;

/// What the history says of one round.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RoundRecord {
    pub campaign: Option<u64>,
    pub round: u64,
    /// `published`, or `failed: REASON`.
    pub outcome: String,
    /// The version the round's global model became.
    pub version: Option<u64>,
    /// Updates folded into the round (a relay's or a secure round's sum counts its devices).
    pub accepted: u32,
    /// Server-side evaluation of the published model (`accuracy`, `loss`, ...), DP spend and
    /// the promotion gate's figures.
    pub metrics: BTreeMap<String, f64>,
    /// `[promotion]`: what the gate decided (`promoted to stable: ...`, `candidate: ...`).
    pub promotion: Option<String>,
    /// Updates and requests refused while the round was open, by reason.
    pub rejected: BTreeMap<String, u64>,
    /// Refusal counts when the round opened (the base of `rejected`); not in the record.
    #[serde(skip)]
    rejected_at_open: BTreeMap<String, u64>,
    /// When the round's first update was accepted (the arrival pacer's measure starts there,
    /// not at the opening, so devices' training time does not count as the service's).
    #[serde(skip)]
    first_accepted_at_unix_ms: Option<u64>,
    pub opened_at_unix_ms: Option<u64>,
    pub closed_at_unix_ms: Option<u64>,
    pub published_at_unix_ms: Option<u64>,
}

impl Aggregator {
    pub(super) fn history_round_opened(&self, core: &mut Core, round: RoundId, now: Millis) {
        core.round_log = Some(RoundRecord {
            campaign: core.coord.engine().campaign_id().map(|c| c.0),
            round: round.0,
            opened_at_unix_ms: Some(now),
            rejected_at_open: self.shared.metrics.rejections(),
            ..RoundRecord::default()
        });
    }

    /// Notes a device's update accepted into `round` (the first one starts the pacer's measure).
    pub(super) fn history_update_accepted(&self, core: &mut Core, round: RoundId, now: Millis) {
        self.round_log(core, round).first_accepted_at_unix_ms.get_or_insert(now);
    }

    /// Teaches the arrival pacer what the round that just closed took, and turned away as
    /// `overloaded`, from its first accepted update (or its opening) to now (nothing after a
    /// restart mid-round: its opening is not known).
    pub(super) fn pace_after(&self, core: &mut Core, accepted: u64, now: Millis) {
        let Some(RoundRecord { opened_at_unix_ms: Some(opened), first_accepted_at_unix_ms: first, rejected_at_open, .. }) = &core.round_log
        else {
            return;
        };
        let refused = self.shared.metrics.rejected_count(RejectReason::Overloaded);
        let before = rejected_at_open.get(RejectReason::Overloaded.as_str()).copied().unwrap_or(refused);
        let since = first.unwrap_or(*opened);
        core.pacer.round_closed(accepted, refused.saturating_sub(before), now.saturating_sub(since));
    }

    /// The record of `round` so far (a fresh one when the service restarted meanwhile).
    fn round_log<'c>(&self, core: &'c mut Core, round: RoundId) -> &'c mut RoundRecord {
        if core.round_log.as_ref().is_none_or(|r| r.round != round.0) {
            core.round_log =
                Some(RoundRecord { campaign: core.coord.engine().campaign_id().map(|c| c.0), round: round.0, ..RoundRecord::default() });
        }
        core.round_log.as_mut().expect("set above")
    }

    pub(super) fn history_round_closed(&self, core: &mut Core, round: RoundId, accepted: u32, now: Millis) {
        let r = self.round_log(core, round);
        r.accepted = accepted;
        r.closed_at_unix_ms = Some(now);
    }

    /// Writes the round's record: `outcome`, and for a published round its version and metrics.
    pub(super) fn history_round_ended(
        &self,
        core: &mut Core,
        round: RoundId,
        outcome: &str,
        published: Option<(ModelVersion, &BTreeMap<String, f64>, Option<String>)>,
        now: Millis,
    ) {
        let rejections = self.shared.metrics.rejections();
        let mut r = std::mem::take(self.round_log(core, round));
        core.round_log = None;
        r.outcome = outcome.to_owned();
        r.rejected = rejections
            .into_iter()
            .map(|(k, n)| {
                let before = r.rejected_at_open.get(&k).copied().unwrap_or(n);
                (k, n.saturating_sub(before))
            })
            .filter(|(_, n)| *n > 0)
            .collect();
        if let Some((version, metrics, promotion)) = published {
            r.version = Some(version.0);
            r.promotion = promotion;
            r.metrics = metrics.clone();
            r.published_at_unix_ms = Some(now);
        }
        let bytes = serde_json::to_vec(&r).expect("a round record serializes");
        if let Err(e) = self.shared.history.append(&bytes) {
            tracing::warn!(error = %e, round = r.round, "cannot record the round in the history");
        }
    }

    /// The newest `limit` rounds, newest first.
    pub fn round_history(&self, limit: usize) -> Vec<RoundRecord> {
        let records = self.shared.history.newest(limit).unwrap_or_default();
        records.iter().filter_map(|b| serde_json::from_slice(b).ok()).collect()
    }
}
