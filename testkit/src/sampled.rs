//! A big fleet of which each round samples a few, in one process on the real protocol path:
//! every device has its own key and certificate, but holds nothing else until a round selects it.
//!
//! Round announcements reach the devices as a broadcast (one listener polls the aggregator and
//! shares what it hears, as the MQTT broker fans a retained announcement out): each device checks
//! its own selection from it ([`Selection::selects`], the hash the aggregator uses), and a device
//! that is not selected does nothing and never connects. A selected device that is online opens a
//! light agent (in-memory store, its own mTLS QUIC connections on a shared socket, its own share
//! of the shared read-only data), waits its simulated training time, trains for real, signs,
//! uploads, checks its receipt, and closes again.
//!
//! Device behaviour is drawn from [`DeviceBehaviour`]: long-tailed training times (log-normal),
//! availability that swings over a (compressed) day, and drop-outs after training. Every draw is
//! a function of the seed, the device and the round.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use fedfleet_agent::agent::Clock;
use fedfleet_agent::clients::{Aggregator, BaseModel, Registry, TransportError, UploadReply};
use fedfleet_agent::remote::RemoteAggregator;
use fedfleet_certs::DeviceIdentity;
use fedfleet_learning::Dataset;
use fedfleet_protocol::{DeviceId, DeviceStatus, FleetId, ModelRef, ModelVersion, RolloutNotice, RoundAnnouncement, RoundId};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::sim::{FleetOptions, MIN_EXAMPLES_PER_DEVICE, open_agent};

/// How simulated devices behave. Every draw is a function of `seed`, the device and the round.
#[derive(Debug, Clone, Copy)]
pub struct DeviceBehaviour {
    /// Median of the simulated training time in ms (log-normal; the real training runs as well).
    /// 0: none.
    pub train_median_ms: f64,
    /// σ of the log-normal training time: 1 gives a long tail (the slowest 1 % about 10x the median).
    pub train_sigma: f64,
    /// Probability that a selected device is online for its round, over the day's mean.
    pub availability: f64,
    /// Swing of that probability over the day (± this, a sine; each device's phase its own, as
    /// devices live in different time zones).
    pub diurnal: f64,
    /// Length of the simulated day.
    pub day: Duration,
    /// Probability that a device that trained goes away before its update is acknowledged.
    pub dropout: f64,
    pub seed: u64,
}

impl Default for DeviceBehaviour {
    /// Every selected device online, no simulated training time, no drop-outs.
    fn default() -> Self {
        DeviceBehaviour {
            train_median_ms: 0.0,
            train_sigma: 0.0,
            availability: 1.0,
            diurnal: 0.0,
            day: Duration::from_secs(600),
            dropout: 0.0,
            seed: 1,
        }
    }
}

impl DeviceBehaviour {
    fn rng(&self, device: usize, round: RoundId) -> ChaCha8Rng {
        ChaCha8Rng::seed_from_u64(self.seed ^ (device as u64).rotate_left(20) ^ round.0.rotate_left(44))
    }

    /// Whether device `index` is online for `round` at `elapsed` into the simulation.
    fn online(&self, rng: &mut ChaCha8Rng, index: usize, elapsed: Duration) -> bool {
        let phase = (index as f64 * 0.618_033_988_75).fract() * std::f64::consts::TAU;
        let day = elapsed.as_secs_f64() / self.day.as_secs_f64().max(1e-3) * std::f64::consts::TAU;
        let p = (self.availability + self.diurnal * (day + phase).sin()).clamp(0.0, 1.0);
        rng.r#gen::<f64>() < p
    }

    fn training_time(&self, rng: &mut ChaCha8Rng) -> Duration {
        if self.train_median_ms <= 0.0 {
            return Duration::ZERO;
        }
        // Box-Muller: one standard normal draw.
        let (u1, u2): (f64, f64) = (rng.r#gen::<f64>().max(f64::MIN_POSITIVE), rng.r#gen());
        let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
        Duration::from_secs_f64((self.train_median_ms * (self.train_sigma * z).exp() / 1e3).min(3_600.0))
    }
}

/// What the fleet did so far.
#[derive(Debug, Default)]
pub struct SampledStats {
    /// Rounds announced while the fleet listened.
    pub rounds: AtomicU64,
    /// Selections (a device selected in two rounds counts twice).
    pub selected: AtomicU64,
    /// Selected devices that were offline for their round.
    pub offline: AtomicU64,
    /// Devices that trained and went away before their receipt.
    pub dropped_out: AtomicU64,
    /// Devices whose update was acknowledged.
    pub acknowledged: AtomicU64,
    /// Devices that opened and ended without an acknowledged update (refused, round over, error).
    pub unfinished: AtomicU64,
    /// Devices open now, and the most at once.
    pub open: AtomicU64,
    pub peak_open: AtomicU64,
}

impl SampledStats {
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

/// A fleet of enrolled devices that open an agent only when a round selects them.
pub struct SampledFleet {
    options: Arc<FleetOptions>,
    identities: Vec<DeviceIdentity>,
    /// The fleet's examples, shared read-only; a device's share is cut from it when it opens.
    train: Arc<Dataset>,
    /// UDP sockets the open devices' connections share, round-robin.
    endpoints: Vec<quinn::Endpoint>,
    listener: RemoteAggregator,
    behaviour: DeviceBehaviour,
    clock: Arc<dyn Clock>,
    started: Instant,
    heard: Option<RoundId>,
    pub stats: Arc<SampledStats>,
    tasks: tokio::task::JoinSet<()>,
    /// Each device's TLS config, made at its first selection and kept (as a device keeps it
    /// between connections) so that its next selection resumes the TLS session: rustls resumes
    /// a ticket only with the config (verifier, certificate) that received it.
    tls: Vec<Option<rustls::ClientConfig>>,
}

/// Sockets shared by the open devices' connections.
const SOCKETS: usize = 32;

impl SampledFleet {
    /// A fleet of `identities` (enrolled, e.g. by `Pki::enroll_devices`); the aggregator and the
    /// registry as in `o` (its `devices` and `pki_dir` are not used: the identities carry both;
    /// stores are always light). `listener` is the identity whose connection hears the
    /// announcements for everyone. Must be called inside a tokio runtime.
    pub fn start(
        o: FleetOptions,
        identities: Vec<DeviceIdentity>,
        listener: &DeviceIdentity,
        behaviour: DeviceBehaviour,
    ) -> anyhow::Result<SampledFleet> {
        use anyhow::Context;
        let (mut train, _) = Dataset::digits_split().context("embedded digits data")?;
        if train.len() < MIN_EXAMPLES_PER_DEVICE {
            anyhow::bail!("the digits split has only {} examples", train.len());
        }
        // Shares are cut round-robin from the shuffled split (an IID deal without a copy per device).
        let mut order: Vec<usize> = (0..train.len()).collect();
        rand::seq::SliceRandom::shuffle(&mut order[..], &mut ChaCha8Rng::seed_from_u64(o.partition_seed));
        train = train.subset(&order);
        let tls = fedfleet_certs::tls::client_config(listener.ca(), listener, &[fedfleet_certs::ALPN_V1])?;
        let endpoints = (0..SOCKETS).map(|i| crate::sim::device_endpoint(&o, i, true, tls.clone())).collect::<Result<Vec<_>, _>>()?;
        let client = fedfleet_aggregator_client::client::AggregatorClient::on_endpoint(
            endpoints[0].clone(),
            o.aggregator_addr,
            &o.aggregator_server_name,
            tls,
        )
        .map_err(|e| anyhow::anyhow!("aggregator client: {e}"))?;
        let listener = RemoteAggregator::new(client, o.receipt_key).with_timeout(o.call_timeout);
        let mut options = o;
        options.light = Some(SOCKETS);
        options.devices = Vec::new();
        Ok(SampledFleet {
            options: Arc::new(options),
            train: Arc::new(train),
            endpoints,
            listener,
            behaviour,
            clock: Arc::new(fedfleet_agent::agent::SystemClock),
            started: Instant::now(),
            heard: None,
            stats: Arc::default(),
            tasks: tokio::task::JoinSet::new(),
            tls: vec![None; identities.len()],
            identities,
        })
    }

    /// Listens for the current round once; on a new one, every device checks its selection and
    /// the selected ones that are online start their part (in tasks of their own). Returns the
    /// round newly heard, if any.
    pub async fn step(&mut self) -> anyhow::Result<Option<RoundId>> {
        while let Some(done) = self.tasks.try_join_next() {
            if let Err(e) = done {
                anyhow::bail!("a device task failed: {e}");
            }
        }
        let announced = match self.listener.current_round(&self.options.fleet).await {
            Ok(Some(a)) if Some(a.round) != self.heard => a,
            Ok(_) => return Ok(None),
            Err(e) => {
                tracing::debug!(error = %e, "listening for rounds");
                return Ok(None);
            }
        };
        self.heard = Some(announced.round);
        self.stats.rounds.fetch_add(1, Ordering::Relaxed);
        let announced = Arc::new(announced);
        let elapsed = self.started.elapsed();
        for (index, identity) in self.identities.iter().enumerate() {
            // The device's own check, from the broadcast: no connection, no state.
            if !announced.selection.selects(identity.device_id()) {
                continue;
            }
            self.stats.selected.fetch_add(1, Ordering::Relaxed);
            let mut rng = self.behaviour.rng(index, announced.round);
            if !self.behaviour.online(&mut rng, index, elapsed) {
                self.stats.offline.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let device = SelectedDevice {
                index,
                identity: identity.clone(),
                share: self.share(index),
                endpoint: self.endpoints[index % self.endpoints.len()].clone(),
                training_time: self.behaviour.training_time(&mut rng),
                drops_out: rng.r#gen::<f64>() < self.behaviour.dropout,
                announced: announced.clone(),
                tls: match &mut self.tls[index] {
                    Some(tls) => tls.clone(),
                    slot => slot.insert(fedfleet_certs::tls::client_config(identity.ca(), identity, &[fedfleet_certs::ALPN_V1])?).clone(),
                },
            };
            let (options, clock, stats) = (self.options.clone(), self.clock.clone(), self.stats.clone());
            self.tasks.spawn(device.take_part(options, clock, stats));
        }
        Ok(Some(announced.round))
    }

    /// Waits for every open device to finish its part.
    pub async fn settle(&mut self) {
        while self.tasks.join_next().await.is_some() {}
    }

    fn share(&self, index: usize) -> Dataset {
        let n = self.train.len();
        let indices: Vec<usize> = (0..MIN_EXAMPLES_PER_DEVICE).map(|k| (index * MIN_EXAMPLES_PER_DEVICE + k) % n).collect();
        self.train.subset(&indices)
    }
}

/// One selected device's part in one round.
struct SelectedDevice {
    index: usize,
    identity: DeviceIdentity,
    share: Dataset,
    endpoint: quinn::Endpoint,
    training_time: Duration,
    drops_out: bool,
    announced: Arc<RoundAnnouncement>,
    tls: rustls::ClientConfig,
}

impl SelectedDevice {
    async fn take_part(self, o: Arc<FleetOptions>, clock: Arc<dyn Clock>, stats: Arc<SampledStats>) {
        tokio::time::sleep(self.training_time).await;
        let open = stats.open.fetch_add(1, Ordering::Relaxed) + 1;
        stats.peak_open.fetch_max(open, Ordering::Relaxed);
        let dir = o.data_dir.join(self.identity.device_id().as_str());
        let outcome = self.run(&o, &clock).await;
        let counter = match outcome {
            Ok(Outcome::Acknowledged) => &stats.acknowledged,
            Ok(Outcome::DroppedOut) => &stats.dropped_out,
            Ok(Outcome::Unfinished) => &stats.unfinished,
            Err(e) => {
                tracing::warn!(error = %e, "a sampled device failed");
                &stats.unfinished
            }
        };
        counter.fetch_add(1, Ordering::Relaxed);
        stats.open.fetch_sub(1, Ordering::Relaxed);
        // The device lets go of everything but its identity.
        let _ = std::fs::remove_dir_all(dir);
    }

    async fn run(self, o: &FleetOptions, clock: &Arc<dyn Clock>) -> anyhow::Result<Outcome> {
        let (announced, drops_out) = (self.announced.clone(), self.drops_out);
        let deadline_ms = announced.deadline_unix_ms;
        let mut wrap = |l: &crate::sim::AgentLinks| {
            let agg = BroadcastAggregator { announced: announced.clone(), inner: l.aggregator.clone(), drops_out };
            Ok((Arc::new(agg), Arc::new(NoRollouts)))
        };
        let (mut agent, acks) = open_agent(o, self.index, self.identity, self.share, self.endpoint, clock, Some(self.tls), &mut wrap)?;
        agent.poll_control().await?;
        loop {
            if let Err(e) = agent.drive().await {
                if drops_out {
                    return Ok(Outcome::DroppedOut);
                }
                return Err(e.into());
            }
            if !acks.acks().is_empty() {
                return Ok(Outcome::Acknowledged);
            }
            if drops_out && agent.core().state().last_round == Some(announced.round) {
                return Ok(Outcome::DroppedOut);
            }
            let waiting = agent.core().store().outbox().map(|o| o.len()).unwrap_or(0);
            if waiting == 0 && agent.core().state().last_round == Some(announced.round) {
                // Trained, and the update was settled without a receipt (refused or too late).
                return Ok(Outcome::Unfinished);
            }
            if clock.now_ms() > deadline_ms.saturating_add(10_000) {
                return Ok(Outcome::Unfinished);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

enum Outcome {
    Acknowledged,
    DroppedOut,
    Unfinished,
}

/// The aggregator as a sampled device sees it: the round it was selected for (from the
/// broadcast, no poll), and its own QUIC connection for the base model and the upload. A device
/// that drops out loses its connection before the upload.
struct BroadcastAggregator {
    announced: Arc<RoundAnnouncement>,
    inner: Arc<RemoteAggregator>,
    drops_out: bool,
}

impl Aggregator for BroadcastAggregator {
    async fn current_round(&self, fleet: &FleetId) -> Result<Option<RoundAnnouncement>, TransportError> {
        Ok(Some(RoundAnnouncement::clone(&self.announced)).filter(|a| &a.fleet == fleet))
    }
    async fn fetch_base_model(&self, model: &ModelRef) -> Result<BaseModel, TransportError> {
        self.inner.fetch_base_model(model).await
    }
    async fn upload(&self, signed_header: &[u8], payload: &[u8]) -> Result<UploadReply, TransportError> {
        if self.drops_out {
            return Err(TransportError("the device went offline (simulated drop-out)".into()));
        }
        self.inner.upload(signed_header, payload).await
    }
}

/// No rollouts in a sampled fleet: the registry is never asked.
struct NoRollouts;

impl Registry for NoRollouts {
    async fn metadata(&self, _: u64) -> Result<fedfleet_agent::clients::MetadataSet, TransportError> {
        Err(TransportError("no registry in a sampled fleet".into()))
    }
    async fn assignment(&self, _: &DeviceId) -> Result<Option<RolloutNotice>, TransportError> {
        Ok(None)
    }
    async fn download(&self, _: &str, _: ModelVersion, _: u64, _: u32) -> Result<Vec<u8>, TransportError> {
        Err(TransportError("no registry in a sampled fleet".into()))
    }
    async fn report(&self, _: &DeviceStatus) -> Result<(), TransportError> {
        Ok(())
    }
}
