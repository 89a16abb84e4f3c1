//! Certificate renewal: before the device certificate lapses, the agent asks the registry for a
//! new one over its current mTLS connection (same id, fleet and key: the key that signs its
//! weight updates stays the one the aggregator's allow-list pins), writes it crash-safely over
//! the old file and presents it on every later connection. Until the new file is written the
//! old certificate stays in use, so a failed or interrupted renewal changes nothing.

use std::sync::Arc;
use std::time::Duration;

use fedfleet_certs::{DeviceIdentity, Validity};
use fedfleet_protocol::RejectReason;
use fedfleet_registry_client::client::ClientError as RegError;

use crate::agent::Clock;
use crate::config::IdentityPaths;
use crate::remote::{RemoteAggregator, RemoteRegistry};

/// `[renewal]` of `agent.toml`.
#[derive(Debug, Clone, Copy, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RenewalConfig {
    /// Renew this long before the certificate expires (or in the last third of its lifetime,
    /// whichever comes first).
    pub renew_before_days: u64,
    /// How often the agent looks at its certificate's expiry.
    pub check_interval_secs: u64,
}

impl Default for RenewalConfig {
    fn default() -> Self {
        RenewalConfig { renew_before_days: 30, check_interval_secs: 3600 }
    }
}

/// What a check did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RenewalOutcome {
    /// Not in the renewal window yet.
    NotDue { not_after: i64 },
    /// A new certificate is on disk and in use.
    Renewed { not_after: i64 },
}

#[derive(Debug, thiserror::Error)]
pub enum RenewalError {
    /// The certificate on disk cannot be loaded (expired: the fleet refuses it; re-enroll).
    #[error("device identity: {0}")]
    Identity(fedfleet_certs::CertError),
    /// The registry refused, with its named reason.
    #[error("the registry refused to renew this device's certificate ({reason}): {detail}")]
    Refused { reason: RejectReason, detail: String },
    /// The registry could not be reached; the next check tries again.
    #[error("certificate renewal: {0}")]
    Transport(String),
    #[error("writing the renewed certificate {path}: {error}")]
    Write { path: std::path::PathBuf, error: String },
}

// Printed in the message, so not also a `source`: a report of the chain would say it twice.
impl From<fedfleet_certs::CertError> for RenewalError {
    fn from(e: fedfleet_certs::CertError) -> Self {
        RenewalError::Identity(e)
    }
}

/// Renews the device certificate through the registry and switches the service clients to it.
pub struct Renewer {
    paths: IdentityPaths,
    config: RenewalConfig,
    registry: Arc<RemoteRegistry>,
    aggregator: Option<Arc<RemoteAggregator>>,
    clock: Arc<dyn Clock>,
}

impl Renewer {
    /// `clock` judges expiry and the TLS validity of the new configs.
    pub fn new(
        paths: IdentityPaths,
        config: RenewalConfig,
        registry: Arc<RemoteRegistry>,
        aggregator: Option<Arc<RemoteAggregator>>,
        clock: Arc<dyn Clock>,
    ) -> Self {
        Renewer { paths, config, registry, aggregator, clock }
    }

    fn now_secs(&self) -> i64 {
        (self.clock.now_ms() / 1000) as i64
    }

    /// The identity on disk, judged at the clock's time.
    pub fn identity(&self) -> Result<DeviceIdentity, fedfleet_certs::CertError> {
        DeviceIdentity::from_files_at(&self.paths.cert, &self.paths.key, &self.paths.ca, self.now_secs())
    }

    /// Renews if the certificate is in its renewal window.
    pub async fn check(&self) -> Result<RenewalOutcome, RenewalError> {
        let now = self.now_secs();
        let current = self.identity()?;
        let validity = current.validity();
        let renew_before = (self.config.renew_before_days * 86_400) as i64;
        if !validity.renewal_due(now, renew_before) {
            return Ok(RenewalOutcome::NotDue { not_after: validity.not_after });
        }
        self.renew(&current, now).await
    }

    async fn renew(&self, current: &DeviceIdentity, now: i64) -> Result<RenewalOutcome, RenewalError> {
        let pem = match self.registry.client().renew_certificate().await {
            Ok(pem) => pem,
            Err(RegError::Rejected(r)) => return Err(RenewalError::Refused { reason: r.reason, detail: r.detail }),
            Err(RegError::Denied(d)) => return Err(RenewalError::Refused { reason: RejectReason::NotPermitted, detail: d }),
            Err(e) => return Err(RenewalError::Transport(e.to_string())),
        };
        let renewed = current.renewed(&pem, now)?;
        // Written whole or not at all; the key file is unchanged (same key).
        fedfleet_durable::write_atomic(&self.paths.cert, pem.as_bytes(), fedfleet_durable::Mode::Public)
            .map_err(|e| RenewalError::Write { path: self.paths.cert.clone(), error: e.to_string() })?;
        let clock = self.clock.clone();
        let time = fedfleet_certs::tls::clock_time(move || clock.now_ms());
        let tls = fedfleet_certs::tls::client_config_at(renewed.ca(), &renewed, &[fedfleet_certs::ALPN_V1], time)?;
        self.registry.client().set_tls(tls.clone()).await.map_err(|e| RenewalError::Transport(e.to_string()))?;
        if let Some(a) = &self.aggregator {
            a.client().set_tls(tls).await.map_err(|e| RenewalError::Transport(e.to_string()))?;
        }
        let Validity { not_after, .. } = renewed.validity();
        tracing::info!(device = %renewed.device_id(), not_after = %fedfleet_certs::renewal::rfc3339(not_after), "renewed this device's certificate");
        Ok(RenewalOutcome::Renewed { not_after })
    }

    /// Checks now and every `check_interval_secs`, logging what happens, until dropped.
    pub async fn run(self) {
        loop {
            match self.check().await {
                Ok(RenewalOutcome::NotDue { not_after }) => {
                    tracing::debug!(not_after = %fedfleet_certs::renewal::rfc3339(not_after), "certificate not due for renewal")
                }
                Ok(RenewalOutcome::Renewed { .. }) => {}
                Err(e @ RenewalError::Transport(_)) => tracing::warn!(error = %e, "certificate renewal failed; retrying at the next check"),
                Err(e) => tracing::error!(error = %e, "certificate renewal failed"),
            }
            tokio::time::sleep(Duration::from_secs(self.config.check_interval_secs.max(1))).await;
        }
    }
}
