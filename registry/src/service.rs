//! The registry's lifecycle, one path for `fedfleet-registry serve` and the test kit:
//! [`RegistryService::open`] (signing keys, PKI, store, signer; a clock passed in) →
//! [`RegistryService::bind`] (the QUIC endpoint, `/metrics`, the MQTT control plane) →
//! [`BoundRegistry::run`] until a [`Shutdown`] is triggered.

use std::net::SocketAddr;
use std::sync::Arc;

use fedfleet_net::Shutdown;
use fedfleet_protocol::SharedClock;

use crate::RegistryError;
use crate::config::Config;
use crate::metadata::{self, MetadataSigner};
use crate::metrics::Metrics;
use crate::mqtt::RegistryMqtt;
use crate::ops::Registry;
use crate::server::{self, Faults, Renewal, ServerOptions};
use crate::store::{Store, StoreConfig};

/// Context for a start-up step's error.
fn step(what: impl std::fmt::Display) -> impl FnOnce(RegistryError) -> RegistryError {
    move |e| RegistryError::Config(format!("{what}: {e}"))
}

/// An opened registry: its state is loaded and its keys are ready; nothing listens yet.
pub struct RegistryService {
    cfg: Config,
    clock: SharedClock,
    reg: Arc<Registry>,
    identity: fedfleet_certs::ServerIdentity,
    tls: rustls::ServerConfig,
    opts: ServerOptions,
    /// The console's HTTPS config (`[console] tls = true`).
    console_tls: Option<rustls::ServerConfig>,
}

impl RegistryService {
    /// Opens `cfg.data_dir` (creating the TUF keys and root on first start), the PKI at
    /// `cfg.pki_dir` and the store. Every time the registry reads is `clock`'s.
    pub fn open(cfg: Config, clock: SharedClock) -> Result<RegistryService, RegistryError> {
        std::fs::create_dir_all(&cfg.data_dir).map_err(|cause| RegistryError::Io { path: cfg.data_dir.clone(), cause })?;
        if !metadata::keys_exist(&cfg.data_dir) {
            metadata::init_keys(&cfg.data_dir, cfg.root_days, false, clock.now_ms())?;
            tracing::info!(root = %cfg.data_dir.join(metadata::ROOT_JSON).display(), "created signing keys and root; pin root.json on devices");
        }
        let pki = fedfleet_certs::Pki::open(&cfg.pki_dir).map_err(|e| step(format!("PKI {}", cfg.pki_dir.display()))(e.into()))?;
        let identity = fedfleet_certs::ServerIdentity::load(&cfg.pki_dir, &cfg.server_identity).map_err(|e| {
            step(format!("server identity {:?} (fedfleet-certs issue-server --name {})", cfg.server_identity, cfg.server_identity))(
                e.into(),
            )
        })?;
        let revocation = Arc::new(fedfleet_certs::RevocationWatcher::open(&cfg.pki_dir)?);
        let tls_clock = clock.clone();
        let tls = fedfleet_certs::tls::server_config_at(
            pki.ca(),
            &identity,
            revocation.clone(),
            &[fedfleet_certs::ALPN_V1],
            fedfleet_certs::tls::clock_time(move || tls_clock.now_ms()),
        )?;
        let store = Store::open(cfg.store_dir(), StoreConfig { chunk_size: cfg.chunk_size, ..StoreConfig::default() })?;
        let signer = MetadataSigner::load(&cfg.data_dir, cfg.lifetimes())?;
        let metrics = Arc::new(Metrics::default());
        let renewal = match &cfg.renewal {
            None => None,
            Some(r) => {
                let issuer = fedfleet_certs::DeviceIssuer::load(&pki.ca_cert_path(), &r.ca_key)
                    .map_err(|e| step(format!("[renewal] ca_key {}", r.ca_key.display()))(e.into()))?;
                let allow = fedfleet_certs::AllowList::load(pki.allow_list_path())
                    .map_err(|e| step(format!("[renewal] needs the allow-list {}", pki.allow_list_path().display()))(e.into()))?;
                tracing::info!(days = r.days, "renewing device certificates");
                Some(Renewal { issuer: Arc::new(issuer), allow_list: Some(Arc::new(allow)), days: r.days })
            }
        };
        let console_tls = match cfg.console.as_ref().filter(|c| c.tls) {
            None => None,
            Some(_) => {
                let console_clock = clock.clone();
                let time = fedfleet_certs::tls::clock_time(move || console_clock.now_ms());
                Some(
                    fedfleet_certs::tls::console_server_config(pki.ca(), &identity, revocation.clone(), time)
                        .map_err(|e| step("[console] TLS")(e.into()))?,
                )
            }
        };
        let reg = Arc::new(Registry::new(store, pki.fleet().clone(), Some(signer), metrics, clock.clone())?.with_revocation(revocation));
        let mut opts = ServerOptions::new(cfg.spool_dir());
        opts.operators = cfg.operators.clone();
        opts.max_connections = cfg.max_connections;
        opts.renewal = renewal;
        if let Some(o) = &cfg.object_store {
            let mirror = crate::objects::ArtifactMirror::open(o).map_err(step("[object_store]"))?;
            tracing::info!(store = ?mirror, "artifacts mirrored to the object store");
            opts.mirror = Some(Arc::new(mirror));
        }
        Ok(RegistryService { cfg, clock, reg, identity, tls, opts, console_tls })
    }

    pub fn registry(&self) -> &Arc<Registry> {
        &self.reg
    }

    /// The console's mirror and (with `[renewal]`) the CA key it revokes with.
    fn console_parts(&self) -> crate::console::ConsoleParts {
        let revoker =
            self.opts.renewal.as_ref().map(|r| crate::console::Revoker { issuer: r.issuer.clone(), pki_dir: self.cfg.pki_dir.clone() });
        crate::console::ConsoleParts { mirror: self.opts.mirror.clone(), revoker }
    }

    #[doc(hidden)]
    pub fn faults(&self) -> Arc<Faults> {
        self.opts.faults.clone()
    }

    /// Binds `cfg.listen` (QUIC). Call inside a tokio runtime.
    pub fn bind(self) -> Result<BoundRegistry, RegistryError> {
        // Clients of a crashed predecessor are reset at once (keys seeded from this identity).
        let endpoint = fedfleet_net::server_endpoint_restartable(
            self.cfg.listen,
            self.tls.clone(),
            &self.identity.derive_secret("fedfleet-registry 2026 QUIC endpoint"),
        )?;
        let console = match &self.cfg.console {
            None => None,
            Some(c) => {
                let listener = std::net::TcpListener::bind(c.listen)
                    .and_then(|l| l.set_nonblocking(true).map(|()| l))
                    .and_then(tokio::net::TcpListener::from_std)
                    .map_err(|cause| RegistryError::Config(format!("console on {}: {cause}", c.listen)))?;
                Some(listener)
            }
        };
        Ok(BoundRegistry { service: self, endpoint, console })
    }
}

/// A registry bound to its addresses, ready to [`run`](BoundRegistry::run).
pub struct BoundRegistry {
    service: RegistryService,
    endpoint: quinn::Endpoint,
    /// `[console]`'s listener.
    console: Option<tokio::net::TcpListener>,
}

impl BoundRegistry {
    /// The QUIC address (with the port picked when `listen` had port 0).
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.endpoint.local_addr()
    }

    pub fn registry(&self) -> &Arc<Registry> {
        &self.service.reg
    }

    /// The operator console's address (`[console]`, with the port picked when it had port 0).
    pub fn console_addr(&self) -> Option<SocketAddr> {
        self.console.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// Starts `/metrics` (`cfg.metrics`) and the MQTT control plane (`cfg.mqtt`), then serves
    /// until `shutdown` is triggered; then stops the MQTT client and flushes the store.
    pub async fn run(self, shutdown: Shutdown) -> Result<(), RegistryError> {
        let BoundRegistry { service, endpoint, console } = self;
        let cfg = &service.cfg;
        let metrics = match cfg.metrics {
            None => None,
            Some(addr) => Some(
                fedfleet_http::bind(addr, cfg.metrics_public)
                    .await
                    .map_err(|cause| RegistryError::Config(format!("metrics on {addr}: {cause}")))?,
            ),
        };
        let console = match (&cfg.console, console) {
            (Some(c), Some(listener)) => {
                let audit = service.reg.store().journal("audit", fedfleet_http::console::AUDIT_KEEP)?;
                let clock = service.clock.clone();
                let api = crate::console::api(service.reg.clone(), service.console_parts());
                let console = fedfleet_http::console::Console::new(api, c, &cfg.operators, audit, move || clock.now_ms())
                    .map_err(RegistryError::Config)?;
                tracing::info!(addr = ?listener.local_addr().ok(), tls = c.tls, "operator console (API and dashboard)");
                Some(tokio::spawn(console.serve(listener, service.console_tls.clone(), shutdown.wait())))
            }
            _ => None,
        };
        let mqtt: Option<RegistryMqtt> =
            crate::mqtt::start(service.reg.clone(), cfg).await.map_err(step("starting the MQTT control plane"))?;
        // Warn well before this service's own certificate lapses (on start, then hourly).
        let (name, clock) = (cfg.server_identity.clone(), service.clock.clone());
        let validity = service.identity.validity()?;
        let watcher = tokio::spawn(fedfleet_http::watch_certificate_expiry(
            service.reg.metrics().certificate_expiry_seconds.clone(),
            std::time::Duration::from_secs(3600),
            move || fedfleet_certs::renewal::warn_if_expiring(&name, validity, clock.now_secs()),
        ));
        let metrics_server = metrics.map(|l| {
            tracing::info!(addr = ?l.local_addr().ok(), "metrics on /metrics");
            tokio::spawn(fedfleet_http::serve_metrics(l, service.reg.metrics().clone()))
        });
        server::run(endpoint, service.reg.clone(), service.opts, shutdown).await;
        if let Some(m) = mqtt {
            m.shutdown().await;
        }
        for task in std::iter::once(watcher).chain(metrics_server).chain(console) {
            task.abort();
        }
        Ok(())
    }
}
