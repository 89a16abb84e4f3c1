//! The real services in this process, on 127.0.0.1: a fleet PKI ([`fleet_pki`]), a registry
//! ([`RunningRegistry`]) and an aggregator ([`RunningAggregator`]) set up as their daemons do, and
//! the TLS of their clients. The demo, the scenario examples and every end-to-end test start
//! their services here.

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use fedfleet_aggregator::config::Config as AggregatorConfig;
use fedfleet_aggregator::lifecycle::AggregatorService;
use fedfleet_aggregator::publish::{Publisher, RegistryPublisher};
use fedfleet_aggregator::service::Aggregator;
use fedfleet_certs::{ALPN_V1, DeviceIdentity, Pki, ServerIdentity, tls};
use fedfleet_net::Shutdown;
use fedfleet_protocol::{DeviceId, FleetId, SharedClock, SystemClock};
use fedfleet_registry::config::{Config as RegistryConfig, RenewalConfig};
use fedfleet_registry::ops::Registry;
use fedfleet_registry::server::Faults;
use fedfleet_registry::service::RegistryService;
use fedfleet_registry::{Root, SignedMetadata};

/// The TLS name every in-process service answers to (each service certificate also names
/// `127.0.0.1`).
pub const SERVER_NAME: &str = "localhost";

/// A fresh fleet PKI in `dir`: the CA, one service identity per name in `services`, one device
/// identity per device, all valid for `days`.
pub fn fleet_pki(dir: &Path, fleet: &FleetId, services: &[&str], devices: &[DeviceId], days: u32) -> anyhow::Result<Pki> {
    Pki::init_loopback(dir, fleet, services, devices, days).context("creating the fleet PKI")
}

/// A relay's config from its root's (`fedfleet-aggregator relay`): the root's settings (model,
/// campaign, strategy, ...) less what only the root has (its address, identity, state, metrics,
/// `[publish]` and the relays under it), with the relay's `listen`, `server_identity` and
/// `data_dir`, and its `metrics_addr` if given. The caller adds `[relay]` (and `relays`, for a
/// relay with relays below it).
pub fn relay_config(root: &str, listen: &str, identity: &str, data_dir: &str, metrics: Option<SocketAddr>) -> String {
    let root_only = ["registry = ", "server_name = ", "[publish]", "relays = "];
    root.lines()
        .filter(|l| !root_only.iter().any(|k| l.starts_with(k)))
        .filter_map(|l| match l {
            l if l.starts_with("listen = ") => Some(format!("listen = \"{listen}\"")),
            l if l.starts_with("server_identity = ") => Some(format!("server_identity = \"{identity}\"")),
            l if l.starts_with("data_dir = ") => Some(format!("data_dir = {data_dir:?}")),
            l if l.starts_with("metrics_addr = ") => metrics.map(|m| format!("metrics_addr = \"{m}\"")),
            l => Some(l.to_owned()),
        })
        .map(|l| l + "\n")
        .collect()
}

/// TLS of a client holding the service certificate `name` (an operator, or a service calling another).
pub fn service_tls(pki: &Pki, name: &str) -> anyhow::Result<rustls::ClientConfig> {
    let id = ServerIdentity::load(pki.dir(), name).with_context(|| format!("service identity {name}"))?;
    Ok(tls::service_client_config(pki.ca(), &id, &[ALPN_V1])?)
}

/// TLS of an enrolled device's client.
pub fn device_tls(pki: &Pki, device: &DeviceId) -> anyhow::Result<rustls::ClientConfig> {
    let id = DeviceIdentity::load(pki.dir(), device).with_context(|| format!("identity of {device}"))?;
    Ok(tls::client_config(pki.ca(), &id, &[ALPN_V1])?)
}

/// A server task and its shutdown switch.
struct Serving {
    shutdown: Shutdown,
    task: tokio::task::JoinHandle<()>,
}

impl Serving {
    fn spawn<F: Future<Output = ()> + Send + 'static>(serve: impl FnOnce(Shutdown) -> F) -> Serving {
        let shutdown = Shutdown::new();
        Serving { task: tokio::spawn(serve(shutdown.clone())), shutdown }
    }

    /// Stops accepting, lets requests in flight finish; panics unless the task ends within 30 s.
    async fn stop(self) {
        self.shutdown.trigger();
        tokio::time::timeout(Duration::from_secs(30), self.task)
            .await
            .expect("the service stops within 30 s")
            .expect("the service task ends without a panic");
    }
}

/// How [`RunningRegistry::start`] sets the registry up (as `registry.toml` would). `Default`:
/// operators `operator` and `aggregator` (which publishes global models), the default chunk
/// size and metadata lifetimes, the system clock, no certificate renewal.
#[derive(Clone)]
pub struct RegistrySetup {
    /// Service certificates allowed to send operator commands.
    pub operators: Vec<String>,
    pub chunk_size: u32,
    /// Validity of the TUF root.
    pub key_days: u32,
    /// Device certificate renewal with the fleet CA's key, for this many days (`None`: refused).
    pub renewal_days: Option<u32>,
    /// The registry's clock (TLS, metadata, rollouts, renewal).
    pub clock: SharedClock,
    /// `[console]`: the operator API and dashboard.
    pub console: Option<fedfleet_http::console::ConsoleConfig>,
    /// `[object_store]`: every artifact also written to an S3-compatible bucket.
    pub object_store: Option<fedfleet_registry::objects::ObjectStoreConfig>,
}

impl Default for RegistrySetup {
    fn default() -> Self {
        RegistrySetup {
            operators: vec!["operator".into(), "aggregator".into()],
            chunk_size: RegistryConfig::default().chunk_size,
            key_days: 30,
            renewal_days: None,
            clock: SystemClock::shared(),
            console: None,
            object_store: None,
        }
    }
}

/// A registry serving QUIC (mTLS, the PKI's `registry` certificate) on 127.0.0.1.
pub struct RunningRegistry {
    pub reg: Arc<Registry>,
    /// The signed root every device pins.
    pub pinned_root: SignedMetadata<Root>,
    pub addr: SocketAddr,
    pub data_dir: PathBuf,
    /// Faults the tests inject into the server.
    pub faults: Arc<Faults>,
    /// The operator console's address, with [`RegistrySetup::console`].
    pub console_addr: Option<SocketAddr>,
    serving: Serving,
}

impl RunningRegistry {
    /// Fresh TUF keys and store in `data_dir` (the ones there if it has them), served on a
    /// free port through the daemon's own lifecycle ([`RegistryService`]). Call inside a tokio
    /// runtime.
    pub fn start(pki: &Pki, data_dir: &Path, setup: RegistrySetup) -> anyhow::Result<RunningRegistry> {
        let cfg = RegistryConfig {
            listen: ([127, 0, 0, 1], 0).into(),
            data_dir: data_dir.to_owned(),
            pki_dir: pki.dir().to_owned(),
            server_identity: "registry".into(),
            metrics: None,
            chunk_size: setup.chunk_size,
            operators: setup.operators,
            root_days: setup.key_days,
            renewal: setup.renewal_days.map(|days| RenewalConfig { ca_key: pki.dir().join("ca.key"), days }),
            console: setup.console,
            object_store: setup.object_store,
            ..RegistryConfig::default()
        };
        let service = RegistryService::open(cfg, setup.clock).context("opening the registry")?;
        let reg = service.registry().clone();
        let faults = service.faults();
        let pinned_root = reg.signer().context("the registry has no signing keys")?.root().clone();
        let bound = service.bind().context("binding the registry")?;
        let (addr, console_addr) = (bound.local_addr()?, bound.console_addr());
        let serving = Serving::spawn(|shutdown| async move {
            if let Err(e) = bound.run(shutdown).await {
                panic!("the registry stopped with an error: {e}");
            }
        });
        Ok(RunningRegistry { reg, pinned_root, addr, data_dir: data_dir.to_owned(), faults, console_addr, serving })
    }

    /// Stops serving; panics unless the server ends within 30 s.
    pub async fn stop(self) {
        self.serving.stop().await;
    }
}

/// An aggregator serving QUIC (mTLS, its configured identity) on 127.0.0.1.
pub struct RunningAggregator {
    pub agg: Aggregator,
    pub addr: SocketAddr,
    /// The operators' own address (`operator_listen`), if the config sets one.
    pub operator_addr: Option<SocketAddr>,
    /// The operator console's address, if the config has `[console]`.
    pub console_addr: Option<SocketAddr>,
    serving: Serving,
}

impl RunningAggregator {
    /// Opens `cfg`'s data directory and serves on `cfg.listen` (retrying for 5 s while a stopped
    /// predecessor's endpoint still holds the port). Call inside a tokio runtime.
    pub async fn start(cfg: AggregatorConfig, publisher: Box<dyn Publisher>) -> anyhow::Result<RunningAggregator> {
        Self::start_at(cfg, publisher, SystemClock::shared()).await
    }

    /// As [`RunningAggregator::start`] on `clock` (deadlines move when the test moves it and
    /// calls [`Aggregator::clock_moved`]).
    pub async fn start_at(cfg: AggregatorConfig, publisher: Box<dyn Publisher>, clock: SharedClock) -> anyhow::Result<RunningAggregator> {
        let listen = cfg.listen;
        let service = AggregatorService::open_with(cfg, None, publisher, clock).context("opening the aggregator")?;
        let mut tries = 0;
        let bound = loop {
            match service.bind().await {
                Ok(b) => break b,
                Err(_) if tries < 50 => {
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => return Err(e).with_context(|| format!("binding {listen}")),
            }
        };
        let (agg, addr, operator_addr, console_addr) =
            (bound.aggregator().clone(), bound.local_addr()?, bound.operator_addr(), bound.console_addr());
        let serving = Serving::spawn(|shutdown| async move {
            if let Err(e) = bound.run(shutdown).await {
                panic!("the aggregator stopped with an error: {e}");
            }
        });
        Ok(RunningAggregator { agg, addr, operator_addr, console_addr, serving })
    }

    /// As [`RunningAggregator::start`], publishing every global model into the registry at
    /// `registry` with the aggregator's service certificate.
    pub async fn publishing_to(cfg: AggregatorConfig, registry: SocketAddr) -> anyhow::Result<RunningAggregator> {
        let publisher = RegistryPublisher::connect_lazy(&cfg.pki_dir, &cfg.server_identity, registry, SERVER_NAME)
            .map_err(|e| anyhow::anyhow!("publisher: {e}"))?;
        Self::start(cfg, Box::new(publisher)).await
    }

    /// Stops serving and waits for the server task; other clones of the service stay usable.
    pub async fn stop(self) {
        drop(self.agg);
        self.serving.stop().await;
    }
}
