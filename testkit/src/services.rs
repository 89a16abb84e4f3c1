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
use fedfleet_aggregator::publish::{Publisher, RegistryPublisher};
use fedfleet_aggregator::service::Aggregator;
use fedfleet_certs::{ALPN_V1, AllowList, DeviceIdentity, DeviceIssuer, Pki, RevocationWatcher, ServerIdentity, tls};
use fedfleet_protocol::{DeviceId, FleetId};
use fedfleet_registry::metadata::{self, Lifetimes, MetadataSigner};
use fedfleet_registry::ops::Registry;
use fedfleet_registry::server::{self, Faults, Renewal, ServerOptions, ServiceClock};
use fedfleet_registry::store::{Store, StoreConfig};
use fedfleet_registry::{Root, SignedMetadata};

/// The TLS name every in-process service answers to (each service certificate also names
/// `127.0.0.1`).
pub const SERVER_NAME: &str = "localhost";

/// A fresh fleet PKI in `dir`: the CA, one service identity per name in `services`, one device
/// identity per device, all valid for `days`.
pub fn fleet_pki(dir: &Path, fleet: &FleetId, services: &[&str], devices: &[DeviceId], days: u32) -> anyhow::Result<Pki> {
    let pki = Pki::init(dir, fleet, days, false).context("creating the fleet CA")?;
    let sans = [SERVER_NAME.to_owned(), "127.0.0.1".to_owned()];
    for name in services {
        pki.issue_server(name, &sans, days, false).with_context(|| format!("issuing the {name} identity"))?;
    }
    for d in devices {
        pki.enroll_device(d, days, false).with_context(|| format!("enrolling {d}"))?;
    }
    Ok(pki)
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

/// A server task and its stop switch.
struct Serving {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl Serving {
    fn spawn<F: Future<Output = ()> + Send + 'static>(serve: impl FnOnce(tokio::sync::oneshot::Receiver<()>) -> F) -> Serving {
        let (stop, stopped) = tokio::sync::oneshot::channel();
        Serving { stop, task: tokio::spawn(serve(stopped)) }
    }

    /// Stops accepting, lets requests in flight finish; panics unless the task ends within 30 s.
    async fn stop(self) {
        drop(self.stop);
        tokio::time::timeout(Duration::from_secs(30), self.task)
            .await
            .expect("the service stops within 30 s")
            .expect("the service task ends without a panic");
    }
}

/// How [`RunningRegistry::start`] sets the registry up. `Default`: operators `operator` and
/// `aggregator` (which publishes global models), the default store and metadata lifetimes, the
/// system clock, no certificate renewal.
#[derive(Clone)]
pub struct RegistrySetup {
    /// Service certificates allowed to send operator commands.
    pub operators: Vec<String>,
    pub store: StoreConfig,
    pub lifetimes: Lifetimes,
    /// Validity of the TUF signing keys.
    pub key_days: u32,
    /// Device certificate renewal with the fleet CA's key, for this many days (`None`: refused).
    pub renewal_days: Option<u32>,
    /// The registry's clock, for TLS and renewal (`None`: the system clock).
    pub clock: Option<Arc<dyn Fn() -> u64 + Send + Sync>>,
}

impl Default for RegistrySetup {
    fn default() -> Self {
        RegistrySetup {
            operators: vec!["operator".into(), "aggregator".into()],
            store: StoreConfig::default(),
            lifetimes: Lifetimes::default(),
            key_days: 30,
            renewal_days: None,
            clock: None,
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
    serving: Serving,
}

impl RunningRegistry {
    /// Fresh TUF keys and store in `data_dir`, served on a free port. Call inside a tokio runtime.
    pub fn start(pki: &Pki, data_dir: &Path, setup: RegistrySetup) -> anyhow::Result<RunningRegistry> {
        std::fs::create_dir_all(data_dir).with_context(|| format!("creating {}", data_dir.display()))?;
        metadata::init_keys(data_dir, setup.key_days, false).context("registry signing keys")?;
        let signer = MetadataSigner::load(data_dir, setup.lifetimes)?;
        let store = Store::open(data_dir.join("store"), setup.store)?;
        let revocation = Arc::new(RevocationWatcher::open(pki.dir())?);
        let reg = Arc::new(Registry::new(store, pki.fleet().clone(), Some(signer), Default::default())?.with_revocation(revocation.clone()));
        let pinned_root = reg.signer().context("the registry has no signing keys")?.root().clone();
        let identity = ServerIdentity::load(pki.dir(), "registry").context("the registry's identity")?;
        let server_tls = match &setup.clock {
            None => tls::server_config(pki.ca(), &identity, revocation, &[ALPN_V1])?,
            Some(c) => {
                let c = c.clone();
                tls::server_config_at(pki.ca(), &identity, revocation, &[ALPN_V1], tls::clock_time(move || c()))?
            }
        };
        let endpoint = fedfleet_net::server_endpoint(([127, 0, 0, 1], 0).into(), server_tls)?;
        let addr = endpoint.local_addr()?;
        let mut opts = ServerOptions::new(data_dir.join("incoming"));
        opts.operators = setup.operators;
        if let Some(days) = setup.renewal_days {
            let issuer = DeviceIssuer::load(&pki.ca_cert_path(), &pki.dir().join("ca.key")).context("the CA key for renewal")?;
            let allow_list = AllowList::load(pki.allow_list_path())?;
            opts.renewal = Some(Renewal { issuer: Arc::new(issuer), allow_list: Some(Arc::new(allow_list)), days });
        }
        if let Some(c) = setup.clock {
            opts.clock = ServiceClock::new(move || c());
        }
        let faults = opts.faults.clone();
        let serving = Serving::spawn(|stopped| {
            server::run(endpoint, reg.clone(), opts, async move {
                let _ = stopped.await;
            })
        });
        Ok(RunningRegistry { reg, pinned_root, addr, data_dir: data_dir.to_owned(), faults, serving })
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
    serving: Serving,
}

impl RunningAggregator {
    /// Opens `cfg`'s data directory and serves on `cfg.listen` (retrying for 5 s while a stopped
    /// predecessor's endpoint still holds the port). Call inside a tokio runtime.
    pub async fn start(cfg: AggregatorConfig, publisher: Box<dyn Publisher>) -> anyhow::Result<RunningAggregator> {
        let listen = cfg.listen;
        let agg = Aggregator::open(cfg, publisher).context("opening the aggregator")?;
        let mut tries = 0;
        let endpoint = loop {
            match agg.bind(listen) {
                Ok(e) => break e,
                Err(_) if tries < 50 => {
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => return Err(e).with_context(|| format!("binding {listen}")),
            }
        };
        let addr = endpoint.local_addr()?;
        let serving = Serving::spawn(|stopped| {
            agg.clone().run(endpoint, async move {
                let _ = stopped.await;
            })
        });
        Ok(RunningAggregator { agg, addr, serving })
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
