//! The aggregator's operator console (`fedfleet_http::console`): the campaign, its rounds
//! (updates, server-side accuracy and loss, refusals by reason, timings) and the campaign
//! actions, each calling the same [`Aggregator`] method as the QUIC operator request.

use fedfleet_http::console::{Api, ApiError, blocking, to_reply, with};
use serde_json::json;

use crate::service::Aggregator;
use crate::wire::CampaignOverrides;

/// Rounds the history answers by default (`?limit=N`, at most 10,000).
const DEFAULT_ROUNDS: usize = 200;

/// Rounds read to count the newest campaign's published rounds (a longer campaign shows this).
const CAMPAIGN_SCAN: usize = 1_000;

/// The aggregator's API table.
pub fn api(agg: Aggregator) -> Api {
    Api::new("aggregator", &["campaign"])
        .read(
            "/api/v1/campaign",
            "Where the campaign stands: rounds completed, the open round, the global model, the outcome, the privacy spend and mode",
            with(&agg, |agg, _| async move {
                let mut status = to_reply(agg.status())?;
                // The newest campaign in the history (the running one, or the last one once it
                // finished and the status no longer names it) and its published rounds.
                let history = blocking(move || agg.round_history(CAMPAIGN_SCAN)).await?;
                let campaign = history.first().and_then(|r| r.campaign);
                let published = history.iter().take_while(|r| r.campaign == campaign).filter(|r| r.version.is_some()).count();
                status["history"] = json!({"campaign": campaign, "rounds_published": published});
                Ok(status)
            }),
        )
        .read(
            "/api/v1/rounds",
            "The rounds that ended, newest first (`?limit=N`): outcome, version, updates, accuracy, loss, refusals by reason, timings; and the service's refusals by reason",
            with(&agg, |agg, c| async move {
                let limit = c.limit(DEFAULT_ROUNDS, 10_000)?;
                let (rounds, rejected) = blocking(move || (agg.round_history(limit), agg.metrics().rejections())).await?;
                Ok(json!({"rounds": rounds, "rejected": rejected}))
            }),
        )
        .action(
            "/api/v1/campaign/start",
            "Starts a campaign (`{\"rounds\", \"target_count\", \"min_quorum\", \"deadline_secs\", \"seed\"}`, each optional: the config's `[campaign]` otherwise)",
            with(&agg, |agg, c| async move {
                let overrides: CampaignOverrides = match c.body {
                    serde_json::Value::Null => CampaignOverrides::default(),
                    body => serde_json::from_value(body).map_err(|e| ApiError::bad_request(format!("campaign: {e}")))?,
                };
                to_reply(agg.start_campaign(overrides).await.map_err(ApiError::conflict)?)
            }),
        )
        .action(
            "/api/v1/campaign/stop",
            "Stops the running campaign (its open round fails)",
            with(&agg, |agg, _| async move { to_reply(blocking(move || agg.stop_campaign()).await?.map_err(ApiError::conflict)?) }),
        )
}
