//! Who gets into a service's QUIC endpoint, and in what order. A peer that has not
//! authenticated holds only a handshake slot, for a bounded time; under load (over half the
//! slots in use) only a bounded number per source address, and sources prove their address
//! first (a stateless retry). Once the
//! certificate is known, devices and services (operators, the registry's publisher, relays)
//! draw from separate pools, so no flood of strangers or devices fills what an operator needs.
//! Past a pool, a peer is told `overloaded` with a retry-after in the close reason.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Application close code of a connection turned away for load (its reason says when to retry).
pub const OVERLOADED: u32 = 0x4f4c; // "OL"

/// The retry-after a turned-away peer is told by default, and what a client assumes when the
/// endpoint refused it before the handshake (a QUIC refusal has no room for one).
pub const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(2);

/// How long a service gives a handshake (`AdmissionConfig::handshake_timeout`'s default), and
/// so how long a client waits for one: past it the service has dropped it.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How many of each, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionConfig {
    /// Handshakes in progress at once, all sources together.
    pub handshakes: usize,
    /// Handshakes in progress at once from one IP address while the endpoint is busy (over
    /// half of `handshakes` in use).
    pub per_source: usize,
    /// A handshake not finished by then is dropped.
    pub handshake_timeout: Duration,
    /// Authenticated device connections.
    pub devices: usize,
    /// Authenticated service connections (operators, publishers), kept apart from devices'.
    pub services: usize,
    /// The retry-after a turned-away peer is told.
    pub retry_after: Duration,
}

impl AdmissionConfig {
    /// `devices` device connections and the defaults for the rest.
    pub fn for_devices(devices: usize) -> Self {
        AdmissionConfig {
            handshakes: 256,
            per_source: 64,
            handshake_timeout: HANDSHAKE_TIMEOUT,
            devices,
            services: 64,
            retry_after: DEFAULT_RETRY_AFTER,
        }
    }

    /// Every connection task the endpoint may run at once (the accept loop's bound).
    pub fn total(&self) -> usize {
        self.handshakes + self.devices + self.services
    }
}

/// What kind of peer an authenticated connection is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerClass {
    Device,
    Service,
}

/// Why a connection was not admitted.
#[derive(Debug)]
pub enum Refused {
    /// Its source already has `per_source` handshakes in progress.
    SourceBusy,
    /// `handshakes` are in progress.
    HandshakesFull,
    /// Sent a stateless retry: the peer comes back with a validated address.
    Retried,
    /// The handshake did not finish within `handshake_timeout`.
    HandshakeTimeout,
    /// The handshake failed (a TLS alert, a refused certificate, ...).
    HandshakeFailed(quinn::ConnectionError),
    /// Its pool is full; the peer was told to retry after a while.
    Overloaded(PeerClass),
}

/// An admitted connection; its pool slot is held while this lives.
pub struct Admitted {
    pub conn: quinn::Connection,
    _slot: OwnedSemaphorePermit,
}

/// The admission state of one endpoint. Cheap to share (`Arc`).
pub struct Admission {
    cfg: AdmissionConfig,
    handshakes: Arc<Semaphore>,
    devices: Arc<Semaphore>,
    services: Arc<Semaphore>,
    sources: Arc<Mutex<HashMap<IpAddr, usize>>>,
}

/// One handshake counted against its source until dropped.
struct SourceSlot {
    sources: Arc<Mutex<HashMap<IpAddr, usize>>>,
    ip: IpAddr,
}

impl Drop for SourceSlot {
    fn drop(&mut self) {
        let mut s = self.sources.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = s.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                s.remove(&self.ip);
            }
        }
    }
}

impl Admission {
    pub fn new(cfg: AdmissionConfig) -> Arc<Admission> {
        Arc::new(Admission {
            cfg,
            handshakes: Arc::new(Semaphore::new(cfg.handshakes)),
            devices: Arc::new(Semaphore::new(cfg.devices)),
            services: Arc::new(Semaphore::new(cfg.services)),
            sources: Arc::default(),
        })
    }

    pub fn config(&self) -> &AdmissionConfig {
        &self.cfg
    }

    fn enter_source(&self, ip: IpAddr, busy: bool) -> Option<SourceSlot> {
        let mut s = self.sources.lock().unwrap_or_else(|p| p.into_inner());
        let n = s.entry(ip).or_insert(0);
        if busy && *n >= self.cfg.per_source {
            return None;
        }
        *n += 1;
        Some(SourceSlot { sources: self.sources.clone(), ip })
    }

    /// Runs `incoming`'s handshake under the handshake bounds, then admits the connection into
    /// the pool of its class (`classify` reads the peer's certificate).
    pub async fn admit(
        &self,
        incoming: quinn::Incoming,
        classify: impl FnOnce(&quinn::Connection) -> PeerClass,
    ) -> Result<Admitted, Refused> {
        // Under load, a source proves it receives at its address before it costs a handshake.
        let busy = self.handshakes.available_permits() < self.cfg.handshakes / 2;
        if busy && !incoming.remote_address_validated() && incoming.may_retry() {
            return match incoming.retry() {
                Ok(()) => Err(Refused::Retried),
                Err(e) => {
                    e.into_incoming().refuse();
                    Err(Refused::HandshakesFull)
                }
            };
        }
        // The per-source bound applies under load only: many devices behind one NAT address
        // connect freely while the endpoint has room.
        let source = match self.enter_source(incoming.remote_address().ip(), busy) {
            Some(s) => s,
            None => {
                incoming.refuse();
                return Err(Refused::SourceBusy);
            }
        };
        let Ok(handshake) = self.handshakes.clone().try_acquire_owned() else {
            incoming.refuse();
            return Err(Refused::HandshakesFull);
        };
        let connecting = incoming.accept().map_err(Refused::HandshakeFailed)?;
        let conn = match tokio::time::timeout(self.cfg.handshake_timeout, connecting).await {
            Err(_) => return Err(Refused::HandshakeTimeout),
            Ok(Err(e)) => return Err(Refused::HandshakeFailed(e)),
            Ok(Ok(c)) => c,
        };
        drop((handshake, source));
        let class = classify(&conn);
        // Services may also take a device slot when their own pool is full; devices never
        // take a service slot.
        let slot = match class {
            PeerClass::Service => self.services.clone().try_acquire_owned().or_else(|_| self.devices.clone().try_acquire_owned()),
            PeerClass::Device => self.devices.clone().try_acquire_owned(),
        };
        match slot {
            Ok(slot) => Ok(Admitted { conn, _slot: slot }),
            Err(_) => {
                let reason = fedfleet_protocol::reject::overloaded_detail("overloaded", self.cfg.retry_after.as_millis() as u64);
                conn.close(OVERLOADED.into(), reason.as_bytes());
                Err(Refused::Overloaded(class))
            }
        }
    }
}
