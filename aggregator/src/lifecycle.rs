//! The aggregator's lifecycle, one path for `fedfleet-aggregator serve` and the test kit:
//! [`AggregatorService::open`] (state, identities, the publisher; a clock passed in) →
//! [`AggregatorService::bind`] (QUIC, `/metrics`, the MQTT control plane) →
//! [`BoundAggregator::run`] until a [`Shutdown`] is triggered.

use std::net::SocketAddr;

use fedfleet_net::Shutdown;
use fedfleet_protocol::SharedClock;

use crate::config::{Config, MqttConfig};
use crate::mqtt::Mqtt;
use crate::publish::{DirPublisher, Publisher, RegistryPublisher};
use crate::service::{Aggregator, ServiceError};

/// An opened aggregator: its state is resumed and its publisher is ready; nothing listens yet.
pub struct AggregatorService {
    agg: Aggregator,
    mqtt: Option<MqttConfig>,
    listen: SocketAddr,
    operator_listen: Option<SocketAddr>,
    metrics: Option<(SocketAddr, bool)>,
}

/// The console, bound: its listener and what it serves.
struct BoundConsole {
    listener: tokio::net::TcpListener,
    console: fedfleet_http::console::Console,
    tls: Option<rustls::ServerConfig>,
}

impl AggregatorService {
    /// Opens `cfg.data_dir` and publishes where `cfg` says: into the registry of `[publish]`, or
    /// into the data directory's `published/` (signed with the receipt key).
    pub fn open(cfg: Config, mqtt: Option<MqttConfig>, clock: SharedClock) -> Result<AggregatorService, ServiceError> {
        let publisher = configured_publisher(&cfg)?;
        Self::open_with(cfg, mqtt, publisher, clock)
    }

    /// [`AggregatorService::open`] with a publisher of the caller's.
    pub fn open_with(
        cfg: Config,
        mqtt: Option<MqttConfig>,
        publisher: Box<dyn Publisher>,
        clock: SharedClock,
    ) -> Result<AggregatorService, ServiceError> {
        let (listen, operator_listen) = (cfg.listen, cfg.operator_listen);
        let metrics = cfg.metrics_addr.map(|a| (a, cfg.metrics_public));
        let agg = Aggregator::open(cfg, publisher, clock)?;
        Ok(AggregatorService { agg, mqtt, listen, operator_listen, metrics })
    }

    pub fn aggregator(&self) -> &Aggregator {
        &self.agg
    }

    /// Listens on `addr` instead of the config's `listen`.
    pub fn listen_on(mut self, addr: SocketAddr) -> Self {
        self.listen = addr;
        self
    }

    /// Binds QUIC, then `/metrics`, then starts MQTT (the embedded broker listens here). A
    /// failed bind starts nothing, so a caller may retry while a predecessor lets the port go.
    pub async fn bind(&self) -> Result<BoundAggregator, ServiceError> {
        let endpoint = self.agg.bind(self.listen)?;
        let operators = self.operator_listen.map(|addr| self.agg.bind(addr)).transpose()?;
        let metrics = match self.metrics {
            None => None,
            Some((addr, public)) => Some(fedfleet_http::bind(addr, public).await.map_err(|cause| ServiceError::Metrics { addr, cause })?),
        };
        let console = match &self.agg.config().console {
            None => None,
            Some(c) => {
                let listener = tokio::net::TcpListener::bind(c.listen)
                    .await
                    .map_err(|cause| ServiceError::Console(format!("{}: {cause}", c.listen)))?;
                let audit = self.agg.journal("audit", fedfleet_http::console::AUDIT_KEEP)?;
                let clock = self.agg.clock();
                let api = crate::console::api(self.agg.clone());
                let console = fedfleet_http::console::Console::new(api, c, &self.agg.config().operators, audit, move || clock.now_ms())
                    .map_err(ServiceError::Console)?;
                let tls = if c.tls { Some(self.agg.console_tls()?) } else { None };
                Some(BoundConsole { listener, console, tls })
            }
        };
        let mqtt = match &self.mqtt {
            Some(m) => crate::mqtt::start(&self.agg, m).await?,
            None => None,
        };
        Ok(BoundAggregator { agg: self.agg.clone(), endpoint, operators, metrics, console, mqtt })
    }
}

/// The publisher `cfg` names.
fn configured_publisher(cfg: &Config) -> Result<Box<dyn Publisher>, ServiceError> {
    Ok(match &cfg.publish {
        Some(p) => {
            tracing::info!(registry = %p.registry, "publishing into the registry");
            let publisher = RegistryPublisher::connect_lazy(&cfg.pki_dir, &cfg.server_identity, p.registry, &p.server_name)
                .map_err(|e| ServiceError::Publisher(format!("[publish] registry = {}: {}", p.registry, e.0)))?;
            Box::new(publisher)
        }
        None => {
            std::fs::create_dir_all(&cfg.data_dir)
                .map_err(|e| ServiceError::ReceiptKey { path: cfg.data_dir.clone(), cause: e.to_string() })?;
            let key = crate::keys::load_or_create(&cfg.data_dir)
                .map_err(|e| ServiceError::ReceiptKey { path: cfg.data_dir.clone(), cause: e.to_string() })?;
            Box::new(DirPublisher::new(cfg.publish_dir(), key, format!("fedfleet-aggregator/{}", cfg.server_identity)))
        }
    })
}

/// An aggregator bound to its addresses, ready to [`run`](BoundAggregator::run).
pub struct BoundAggregator {
    agg: Aggregator,
    endpoint: quinn::Endpoint,
    /// `operator_listen`'s endpoint, if configured.
    operators: Option<quinn::Endpoint>,
    metrics: Option<tokio::net::TcpListener>,
    console: Option<BoundConsole>,
    mqtt: Option<Mqtt>,
}

impl BoundAggregator {
    /// The QUIC address (with the port picked when `listen` had port 0).
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.endpoint.local_addr()
    }

    /// The operators' QUIC address, if `operator_listen` is set.
    pub fn operator_addr(&self) -> Option<SocketAddr> {
        self.operators.as_ref().and_then(|e| e.local_addr().ok())
    }

    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// The operator console's address (`[console]`).
    pub fn console_addr(&self) -> Option<SocketAddr> {
        self.console.as_ref().and_then(|c| c.listener.local_addr().ok())
    }

    /// The embedded MQTT broker's address (none in external mode or without `[mqtt]`).
    pub fn broker_addr(&self) -> Option<SocketAddr> {
        self.mqtt.as_ref().and_then(|m| m.broker_addr())
    }

    pub fn aggregator(&self) -> &Aggregator {
        &self.agg
    }

    /// Serves `/metrics`, watches this service's certificate expiry and serves QUIC until
    /// `shutdown` is triggered; then stops the MQTT control plane.
    pub async fn run(self, shutdown: Shutdown) -> Result<(), ServiceError> {
        let BoundAggregator { agg, endpoint, operators, metrics, console, mqtt } = self;
        let name = agg.config().server_identity.clone();
        let validity = agg.identity().validity()?;
        let clock = agg.clock();
        // Warn well before this service's own certificate lapses (on start, then hourly).
        let watcher = tokio::spawn(fedfleet_http::watch_certificate_expiry(
            agg.metrics().certificate_expiry_seconds.clone(),
            std::time::Duration::from_secs(3600),
            move || fedfleet_certs::renewal::warn_if_expiring(&name, validity, clock.now_secs()),
        ));
        let metrics_server = metrics.map(|l| {
            tracing::info!(addr = ?l.local_addr().ok(), "metrics at /metrics");
            tokio::spawn(fedfleet_http::serve_metrics(l, agg.metrics()))
        });
        let console = console.map(|c| {
            tracing::info!(addr = ?c.listener.local_addr().ok(), tls = c.tls.is_some(), "operator console (API and dashboard)");
            tokio::spawn(c.console.serve(c.listener, c.tls, shutdown.wait()))
        });
        // A promotion the last run decided but did not carry out.
        let promotion = tokio::spawn({
            let agg = agg.clone();
            async move { agg.finish_promotion().await }
        });
        agg.run(endpoint, operators, shutdown).await;
        promotion.abort();
        if let Some(m) = mqtt {
            m.shutdown().await;
        }
        for task in std::iter::once(watcher).chain(metrics_server).chain(console) {
            task.abort();
        }
        Ok(())
    }
}
