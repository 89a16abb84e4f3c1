//! The async shell around one [`Lifecycle`]: executes its actions with the service clients,
//! the store and `fedfleet-learning`, and feeds the results back. Used by the daemon (real
//! clock) and by simulation and tests (fake clock): the same code path.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use ed25519_dalek::SigningKey;
use fedfleet_learning::{Dataset, Normalization};
use fedfleet_protocol::{DeviceStatus, Digest, ModelRef, RoundAnnouncement, StorageFault, TensorBundle};
use rand::RngCore;

use crate::clients::{Aggregator, BaseModel, Registry, UploadReply};
use crate::inbox::Inbox;
use crate::lifecycle::{Action, AgentError, Conditions, DurableLifecycle, Input, Millis, SlotModel, UploadOutcome};
use crate::ml;
use crate::store::{DOWNLOAD_HEADROOM_BYTES, write_atomic};
use crate::trainer::{GraphTrainer, Serve, Trainer};

pub use fedfleet_protocol::{Clock, SystemClock};

/// The agent's clock: Unix ms that never go backwards. It is the system clock while that moves
/// forward; when the system clock steps back (a bad NTP answer, a reset RTC) it keeps counting from
/// where it was on the monotonic clock, so pending retries fire on time instead of waiting out
/// the step. The daemon raises it to the latest time the store saw, so a restart on a
/// stepped-back clock does not undo that.
pub struct MonotonicClock {
    wall: Box<dyn Fn() -> Millis + Send + Sync>,
    elapsed: Box<dyn Fn() -> Millis + Send + Sync>,
    last: std::sync::Mutex<Reading>,
}

/// The clock's last reading, the monotonic clock at it, and whether the wall clock was behind.
#[derive(Debug, Clone, Copy)]
struct Reading {
    at: Millis,
    elapsed: Millis,
    behind: bool,
}

impl MonotonicClock {
    /// Over the system clock and `std::time::Instant`.
    pub fn system() -> Self {
        Self::over(SystemClock::shared())
    }

    /// Over the wall clock `wall` and `std::time::Instant`.
    pub fn over(wall: fedfleet_protocol::SharedClock) -> Self {
        let start = std::time::Instant::now();
        Self::with_sources(move || wall.now_ms(), move || start.elapsed().as_millis() as u64)
    }

    /// Over a wall clock and a monotonic one (ms since any origin): tests step the wall clock.
    pub fn with_sources(wall: impl Fn() -> Millis + Send + Sync + 'static, elapsed: impl Fn() -> Millis + Send + Sync + 'static) -> Self {
        let last = std::sync::Mutex::new(Reading { at: wall(), elapsed: elapsed(), behind: false });
        MonotonicClock { wall: Box::new(wall), elapsed: Box::new(elapsed), last }
    }

    /// Never reads earlier than `t` from now on.
    pub fn raise_to(&self, t: Millis) {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        last.at = last.at.max(t);
    }
}

/// How far behind the wall clock may fall before it counts as a step back (and is logged).
const STEP_BACK_MS: Millis = 1_000;

impl Clock for MonotonicClock {
    fn now_ms(&self) -> Millis {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let elapsed = (self.elapsed)();
        let wall = (self.wall)();
        // The wall clock while it moves forward (no drift of our own); the monotonic clock's
        // count from the last reading while the wall clock is behind it.
        let now = if wall >= last.at { wall } else { last.at + elapsed.saturating_sub(last.elapsed) };
        let behind = wall + STEP_BACK_MS < now;
        if behind && !last.behind {
            tracing::warn!(behind_ms = now - wall, "system clock stepped back; agent time keeps counting forward");
        }
        *last = Reading { at: now, elapsed, behind };
        now
    }
}

/// The model serving inference.
#[derive(Clone)]
pub struct Served {
    pub model: ModelRef,
    pub predictor: Arc<dyn Serve>,
}

/// Shared handle to the serving model, swapped atomically on activation.
#[derive(Clone, Default)]
pub struct Serving(Arc<RwLock<Option<Served>>>);

impl Serving {
    pub fn get(&self) -> Option<Served> {
        self.0.read().unwrap_or_else(|p| p.into_inner()).clone()
    }
    pub fn set(&self, s: Served) {
        *self.0.write().unwrap_or_else(|p| p.into_inner()) = Some(s);
    }
}

/// The device's local data.
#[derive(Debug, Clone)]
pub struct LocalData {
    pub train: Dataset,
    pub holdout: Dataset,
}

/// Shell settings.
#[derive(Debug, Clone)]
pub struct ShellConfig {
    /// Bytes per download request.
    pub download_chunk: u32,
    /// Examples timed in a health check.
    pub latency_samples: usize,
    /// Where `status.json` is written on every report (read by `fedfleet-agent status`).
    pub status_file: Option<std::path::PathBuf>,
    /// JSON file the device writes with its conditions (`{"idle":..,"charging":..,
    /// "fresh_samples":..}`), read at every control poll.
    pub conditions_file: Option<std::path::PathBuf>,
    /// Where artifacts are downloaded from before (or instead of) the registry.
    pub mirrors: Option<Arc<crate::mirror::Mirrors>>,
    /// A round's base model from the registry (and the mirrors) before the aggregator.
    pub round_bases_from_registry: bool,
}

impl Default for ShellConfig {
    fn default() -> Self {
        ShellConfig {
            download_chunk: 256 * 1024,
            latency_samples: 64,
            status_file: None,
            conditions_file: None,
            mirrors: None,
            round_bases_from_registry: true,
        }
    }
}

/// One agent: lifecycle core + clients + data + serving handle.
pub struct Agent<A, R> {
    core: DurableLifecycle,
    agg: Arc<A>,
    reg: Arc<R>,
    key: SigningKey,
    data: Arc<LocalData>,
    serving: Serving,
    clock: Arc<dyn Clock>,
    cfg: ShellConfig,
    /// Examples the application pushed, with the normalisation of the configured data.
    inbox: Option<(Inbox, Normalization)>,
    /// The model code rounds, health checks and inference run.
    trainer: Arc<dyn Trainer>,
    /// Polls in a row on which a service refused this device's certificate as revoked: the
    /// poll interval doubles with each (see [`Agent::poll_interval`]).
    refused_as_revoked: u32,
    /// The last announced round that aggregates securely: its update goes through the stages.
    secure_round: Option<RoundAnnouncement>,
    /// The newest status report no path took (the registry unreachable): sent again at each
    /// poll until one is delivered or a newer report replaces it. Without it a lost report of
    /// an activation would leave the rollout waiting on this device for ever (the MQTT
    /// heartbeat repeats it, but a device may run without MQTT).
    undelivered_report: Option<DeviceStatus>,
    /// Until when round bases come from the aggregator only: set for a while after the registry
    /// failed to serve one, so that a registry that is down does not cost every round a timeout.
    bases_from_aggregator_until: Millis,
}

/// How long round bases come from the aggregator after the registry failed to serve one.
const REGISTRY_BASES_PAUSE: Duration = Duration::from_secs(300);

/// The longest a device whose certificate the services refuse as revoked waits between polls.
const REVOKED_POLL_MAX: Duration = Duration::from_secs(3600);

impl<A: Aggregator, R: Registry> Agent<A, R> {
    pub fn new(
        core: DurableLifecycle,
        agg: Arc<A>,
        reg: Arc<R>,
        key: SigningKey,
        data: LocalData,
        clock: Arc<dyn Clock>,
        cfg: ShellConfig,
    ) -> Self {
        let trainer = Arc::new(GraphTrainer);
        Agent {
            core,
            agg,
            reg,
            key,
            data: Arc::new(data),
            serving: Serving::default(),
            clock,
            cfg,
            inbox: None,
            trainer,
            refused_as_revoked: 0,
            secure_round: None,
            undelivered_report: None,
            bases_from_aggregator_until: 0,
        }
    }

    /// Runs rounds, health checks and inference with a device team's own model code instead of
    /// the built-in layer-graph engine.
    pub fn with_trainer(mut self, trainer: Arc<dyn Trainer>) -> Self {
        self.trainer = trainer;
        self
    }

    pub fn core(&self) -> &DurableLifecycle {
        &self.core
    }
    pub fn core_mut(&mut self) -> &mut DurableLifecycle {
        &mut self.core
    }
    pub fn serving(&self) -> Serving {
        self.serving.clone()
    }
    pub fn data(&self) -> &LocalData {
        &self.data
    }

    /// The inbox, if any (the local endpoint takes pushes into it).
    pub fn inbox(&self) -> Option<Inbox> {
        self.inbox.as_ref().map(|(i, _)| i.clone())
    }

    /// Trains (and health-checks) on the inbox's examples too, from the next round on.
    pub fn set_inbox(&mut self, inbox: Inbox, normalization: Normalization) {
        self.inbox = Some((inbox, normalization));
    }

    /// The data a round trains and checks on: the configured data, plus the inbox (and the
    /// inbox sequence number everything trained on is below).
    fn round_data(&self) -> Result<(Arc<LocalData>, Option<u64>), AgentError> {
        match &self.inbox {
            Some((inbox, norm)) if inbox.in_use()? => {
                let upto = inbox.next_seq()?;
                Ok((Arc::new(inbox.merged_with(&self.data, norm)?), Some(upto)))
            }
            _ => Ok((self.data.clone(), None)),
        }
    }
    fn now(&self) -> Millis {
        self.clock.now_ms()
    }

    /// Feeds one input at the current time.
    pub fn input(&mut self, input: Input) -> Result<(), AgentError> {
        let now = self.now();
        self.core.handle(now, input)
    }

    /// Asks the services for the open round and this device's assignment.
    pub async fn poll_control(&mut self) -> Result<(), AgentError> {
        self.poll(true).await
    }

    /// Asks the aggregator for the open round only: for a device woken by a pushed announcement
    /// (a new round changes no assignment; the registry is asked at the next full poll).
    pub async fn poll_round(&mut self) -> Result<(), AgentError> {
        self.poll(false).await
    }

    async fn poll(&mut self, with_registry: bool) -> Result<(), AgentError> {
        let mut conditions = self.cfg.conditions_file.as_ref().map(|path| {
            std::fs::read(path)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))
                .unwrap_or_else(|e| {
                    tracing::warn!(path = %path.display(), error = %e, "conditions file unreadable; not training");
                    Conditions { idle: false, charging: false, fresh_samples: 0 }
                })
        });
        // Once the application feeds the inbox, its untrained examples are the fresh samples.
        if let Some((inbox, _)) = &self.inbox
            && inbox.in_use()?
        {
            conditions.get_or_insert_with(Conditions::default).fresh_samples = inbox.fresh()?;
        }
        if let Some(c) = conditions {
            self.input(Input::Conditions(c))?;
        }
        let fleet = self.core.state().fleet.clone();
        let mut revoked = None;
        match self.agg.current_round(&fleet).await {
            Ok(Some(r)) => {
                if r.config.secure_aggregation {
                    self.secure_round = Some(r.clone());
                }
                self.input(Input::RoundAnnounced(r))?
            }
            Ok(None) => {}
            Err(e) if e.is_certificate_revoked() => revoked = Some(e),
            Err(e) => tracing::debug!(error = %e, "round poll failed"),
        }
        if with_registry {
            if let Some(status) = self.undelivered_report.take() {
                self.deliver_report(status).await;
            }
            let device = self.core.state().device.clone();
            match self.reg.assignment(&device).await {
                Ok(Some(n)) => self.input(Input::Assignment(n))?,
                Ok(None) => {}
                Err(e) if e.is_certificate_revoked() => revoked = Some(e),
                Err(e) => tracing::debug!(error = %e, "assignment poll failed"),
            }
        }
        match revoked {
            Some(e) => {
                self.input(Input::CertificateRevoked { detail: e.to_string() })?;
                self.refused_as_revoked += 1;
                // Said once; a device that keeps knocking is only slowed down.
                if self.refused_as_revoked == 1 {
                    tracing::warn!(error = %e, "the services refuse this certificate as revoked: polling them less and less often (at most hourly); enroll the device again to rejoin");
                } else {
                    tracing::debug!(error = %e, polls = self.refused_as_revoked, "still refused as revoked");
                }
            }
            None => self.refused_as_revoked = 0,
        }
        Ok(())
    }

    /// How long to wait before the next poll: `poll`, doubled for each poll in a row on which
    /// a service refused this device's certificate as revoked, up to an hour (or `poll`, if
    /// longer). A revoked device does not knock every few seconds for ever.
    pub fn poll_interval(&self, poll: Duration) -> Duration {
        let doubled = poll.saturating_mul(1u32 << self.refused_as_revoked.min(16));
        doubled.min(REVOKED_POLL_MAX.max(poll))
    }

    /// Fires due timers, then executes queued actions until none are left. Returns how many
    /// actions ran.
    pub async fn drive(&mut self) -> Result<usize, AgentError> {
        let mut n = 0;
        loop {
            let now = self.now();
            if self.core.poll_timeout().is_some_and(|t| t <= now) {
                self.core.handle_timeout(now)?;
            }
            let Some(action) = self.core.poll_action() else { return Ok(n) };
            n += 1;
            self.execute(action).await?;
        }
    }

    async fn execute(&mut self, action: Action) -> Result<(), AgentError> {
        tracing::debug!(?action, "action");
        match action {
            Action::Serve { slot, model } => match self.load_blob(&model) {
                Ok(bytes) => match ml::load_served(self.trainer.as_ref(), &model.spec, &bytes, self.local_state()?.as_ref()) {
                    Ok(p) => {
                        tracing::info!(?slot, name = %model.model.name, version = %model.model.version, "serving model");
                        if let (Some((inbox, _)), Ok(spec)) = (&self.inbox, fedfleet_learning::ModelSpec::from_json(&model.spec)) {
                            inbox.model_activated(&spec);
                        }
                        self.serving.set(Served { model: model.model, predictor: p });
                    }
                    Err(e) => tracing::error!(error = %e, "active model does not load; inference unavailable"),
                },
                Err(e) => tracing::error!(error = %e, "active model blob missing; inference unavailable"),
            },
            Action::Train(a) => {
                let round = a.round;
                let (data, inbox_upto) = self.round_data()?;
                let input = match self.base_model(&a.base_model).await {
                    Err(reason) => Input::BaseModelUnavailable { round, reason },
                    Ok((spec, bytes)) => {
                        let key = self.key.clone();
                        let device = self.core.state().device.clone();
                        let trainer = self.trainer.clone();
                        let local = self.local_state()?;
                        let mut nonce = [0u8; 16];
                        rand::rngs::OsRng.fill_bytes(&mut nonce);
                        let res = tokio::task::spawn_blocking(move || {
                            // Timed inside the blocking task: no wait for a free thread.
                            let started = std::time::Instant::now();
                            ml::train_update(trainer.as_ref(), &a, &spec, &bytes, &data.train, local.as_ref(), &device, &key, nonce)
                                .map(|u| (u, started.elapsed()))
                        })
                        .await
                        .unwrap_or_else(|e| Err(format!("training task panicked: {e}")));
                        match res {
                            Ok((u, took)) => {
                                let train_ms = took.as_secs_f64() * 1e3;
                                tracing::info!(%round, examples = u.num_examples, loss = ?u.final_loss, bytes = u.payload.len(), train_ms, "trained");
                                if !u.local_state.is_empty() {
                                    self.core.store().put_local_state(&u.local_state.encode())?;
                                }
                                if let (Some((inbox, _)), Some(upto)) = (&self.inbox, inbox_upto) {
                                    inbox.mark_trained(upto)?;
                                }
                                Input::TrainingDone { round, header: u.header, payload: u.payload }
                            }
                            Err(reason) => Input::TrainingFailed { round, reason },
                        }
                    }
                };
                self.input(input)?;
            }
            Action::Upload { outbox_id } => {
                let Some(e) = self.core.outbox_entry(outbox_id).cloned() else { return Ok(()) };
                // A securely aggregated round takes the update only masked, never as an upload.
                if let Some(round) = self.secure_round.clone().filter(|a| a.round == e.round) {
                    let device = self.core.state().device.clone();
                    let clock = self.clock.clone();
                    let outcome =
                        crate::secagg::securely_aggregate(self.agg.as_ref(), &self.key, &device, &round, &e.header, &e.payload, || {
                            clock.now_ms()
                        })
                        .await;
                    return self.input(Input::UploadResult { outbox_id, outcome });
                }
                let outcome = match self.agg.upload(&e.header, &e.payload).await {
                    Ok(UploadReply::Receipt(r)) => UploadOutcome::Receipt(r),
                    Ok(UploadReply::Rejected(r)) => UploadOutcome::Rejected(r),
                    Err(t) => UploadOutcome::TransportError(t.0),
                };
                self.input(Input::UploadResult { outbox_id, outcome })?;
            }
            Action::FetchMetadata { model, root_version } => {
                let result = self.reg.metadata(root_version).await.map_err(|e| e.to_string());
                self.input(Input::Metadata { model, result })?;
            }
            Action::Download { model, length } => {
                let input = match self.download(&model, length).await {
                    Ok((length, digest)) => Input::DownloadDone { model, length, digest },
                    Err(DownloadError::Transport(reason)) => Input::DownloadFailed { model, reason },
                    Err(DownloadError::Storage { fault, detail }) => Input::StorageFailed { model, fault, detail },
                };
                self.input(input)?;
            }
            Action::Discard { digest } => {
                let st = self.core.state();
                let keep = st.slot_digests().any(|d| d == digest);
                if !keep {
                    self.core.store().remove_blob(&digest);
                }
            }
            Action::HealthCheck { candidate, active, .. } => {
                let model = candidate.model.clone();
                let cand = self.load_blob(&candidate);
                let act = active.as_ref().map(|a| self.load_blob(a).map(|b| (a.spec.clone(), b)));
                let (data, _) = self.round_data()?;
                let samples = self.cfg.latency_samples;
                let trainer = self.trainer.clone();
                let local = self.local_state()?;
                let result = match cand {
                    Err(e) => Err(format!("does not load: {e}")),
                    Ok(cb) => tokio::task::spawn_blocking(move || {
                        let act = act.and_then(|r| r.ok());
                        ml::health_check(
                            trainer.as_ref(),
                            (&candidate.spec, &cb),
                            act.as_ref().map(|(s, b)| (s.as_str(), b.as_slice())),
                            &data.holdout,
                            local.as_ref(),
                            samples,
                        )
                    })
                    .await
                    .unwrap_or_else(|e| Err(format!("health check panicked: {e}"))),
                };
                self.input(Input::HealthResult { model, result })?;
            }
            Action::Rollback { model, reason } => {
                tracing::warn!(name = %model.name, version = %model.version, %reason, "candidate rolled back; active model keeps serving");
            }
            Action::Report(status) => {
                if let Some(path) = &self.cfg.status_file
                    && let Ok(json) = serde_json::to_vec_pretty(&status)
                    && let Err(e) = write_atomic(path, &json)
                {
                    tracing::warn!(error = %e, "cannot write status file");
                }
                self.deliver_report(status).await;
            }
        }
        Ok(())
    }

    /// Sends `status`; kept for the next poll if no path took it (a newer report replaces it).
    async fn deliver_report(&mut self, status: DeviceStatus) {
        match self.reg.report(&status).await {
            Ok(()) => self.undelivered_report = None,
            Err(e) => {
                tracing::debug!(error = %e, "status report not delivered; sent again at the next poll");
                self.undelivered_report = Some(status);
            }
        }
    }

    /// This device's local tensors (FedBN), if it trained a model that keeps any.
    fn local_state(&self) -> Result<Option<TensorBundle>, AgentError> {
        Ok(self.core.store().local_state()?)
    }

    fn load_blob(&self, m: &SlotModel) -> Result<Vec<u8>, String> {
        self.core
            .store()
            .get_blob(&m.model.digest)
            .map_err(|e| e.to_string())?
            .ok_or_else(|| format!("blob {} not in the store", m.model.digest))
    }

    /// The base model of a round: from the cache by digest, else from the registry (or its
    /// mirrors) by name and version, else from the aggregator. Every round's base is a published
    /// version, and fetching it where rollouts come from takes half of each update's bytes off
    /// the aggregator (issue 27).
    async fn base_model(&mut self, m: &ModelRef) -> Result<(String, Vec<u8>), String> {
        {
            let store = self.core.store();
            if let (Ok(Some(bytes)), Some(spec)) = (store.get_blob(&m.digest), store.spec(&m.digest)) {
                return Ok((spec, bytes));
            }
        }
        let from_registry = if self.cfg.round_bases_from_registry && self.now() >= self.bases_from_aggregator_until {
            match self.base_from_registry(m).await {
                Ok(base) => Some(base),
                Err(e) => {
                    tracing::info!(name = %m.name, version = %m.version, error = %e, "round base not from the registry: from the aggregator for a while");
                    self.bases_from_aggregator_until = self.now() + REGISTRY_BASES_PAUSE.as_millis() as Millis;
                    None
                }
            }
        } else {
            None
        };
        // The registry's bytes were checked against the digest as they were fetched.
        let base = match from_registry {
            Some(base) => base,
            None => {
                let base = self.agg.fetch_base_model(m).await.map_err(|e| format!("base model: {e}"))?;
                let got = Digest::of(&base.bytes);
                if got != m.digest {
                    return Err(format!("base model digest {got} differs from the round's {}", m.digest));
                }
                base
            }
        };
        let store = self.core.store();
        store.put_blob(&base.bytes).map_err(|e| e.to_string())?;
        store.put_spec(&m.digest, &base.spec).map_err(|e| e.to_string())?;
        // A new round's base: the past rounds' bases (and models that rotated out of the slots)
        // go, or a device would keep every model it ever trained on.
        let st = self.core.state();
        let mut keep = vec![m.digest];
        keep.extend(st.slot_digests());
        keep.extend(st.install.as_ref().map(|job| job.model.digest));
        if let Err(e) = store.retain_blobs(&keep) {
            tracing::warn!(error = %e, "past round bases not removed");
        }
        Ok((base.spec, base.bytes))
    }

    /// Up to `want` bytes (never none) of `model`'s artifact from `offset`: from the mirrors
    /// while they serve it (`mirrors` becomes `None` at the first that does not, or, with
    /// `registry_fallback` off, that is an error), else from the registry. `mirrored` is set
    /// once a mirror served bytes.
    async fn artifact_range(
        &self,
        model: &ModelRef,
        offset: u64,
        want: u32,
        mirrors: &mut Option<&Arc<crate::mirror::Mirrors>>,
        mirrored: &mut bool,
    ) -> Result<Vec<u8>, DownloadError> {
        if let Some(m) = *mirrors {
            match m.read_range(&model.digest, offset, want).await {
                Ok(b) if !b.is_empty() => {
                    *mirrored = true;
                    return Ok(b);
                }
                Ok(_) => tracing::info!(digest = %model.digest, offset, "mirror sent nothing"),
                Err(e) => tracing::info!(digest = %model.digest, error = %e, "mirror did not serve the artifact"),
            }
            if !m.registry_fallback {
                return Err(DownloadError::Transport(format!(
                    "no mirror served bytes {offset}.. of {} and registry_fallback is off",
                    model.digest
                )));
            }
            *mirrors = None;
        }
        let chunk =
            self.reg.download(&model.name, model.version, offset, want).await.map_err(|e| DownloadError::Transport(e.to_string()))?;
        if chunk.is_empty() {
            return Err(DownloadError::Transport(format!("registry sent nothing at offset {offset} of {}", model.digest)));
        }
        Ok(chunk)
    }

    /// A round's base through the registry: its description by name and version, checked
    /// against the announced digest and bounded before a byte is fetched, then its bytes, from
    /// the mirrors first. In memory, not through the resumable download an install uses (a
    /// file written and synced chunk by chunk): a base is fetched again if the device restarts
    /// mid-round, and the file's syncs cost simulated devices more than the whole fetch.
    async fn base_from_registry(&self, m: &ModelRef) -> Result<BaseModel, String> {
        let info = self.reg.model_info(&m.name, m.version).await.map_err(|e| e.0)?;
        if info.digest != m.digest {
            return Err(format!("the registry's {} v{} is {}, the round's base {}", m.name, m.version, info.digest, m.digest));
        }
        if info.length > fedfleet_protocol::limits::MAX_BUNDLE_BYTES as u64 {
            return Err(format!("{} bytes, over the {} a model may have", info.length, fedfleet_protocol::limits::MAX_BUNDLE_BYTES));
        }
        let spec = serde_json::to_string(&info.spec.0).map_err(|e| format!("spec: {e}"))?;
        let mut mirrors = self.cfg.mirrors.as_ref().filter(|mm| mm.serves(&m.digest));
        let mut mirrored = false;
        let mut bytes = Vec::new();
        while (bytes.len() as u64) < info.length {
            let have = bytes.len() as u64;
            let want = (info.length - have).min(self.cfg.download_chunk as u64) as u32;
            let chunk = match self.artifact_range(m, have, want, &mut mirrors, &mut mirrored).await {
                Ok(c) => c,
                Err(DownloadError::Transport(e) | DownloadError::Storage { detail: e, .. }) => return Err(e),
            };
            bytes.extend_from_slice(&chunk[..chunk.len().min((info.length - have) as usize)]);
        }
        let got = Digest::of(&bytes);
        if got != m.digest {
            if mirrored && let Some(mm) = &self.cfg.mirrors {
                mm.refuse(&m.digest);
            }
            return Err(format!("fetched {got}, the round's base is {}", m.digest));
        }
        Ok(BaseModel { spec, bytes })
    }

    /// Resumable download into the partial file; returns the length and digest of what is there
    /// once `length` bytes are in. The blob is moved into the store only if its digest is the
    /// expected one (the core still verifies it against the signed targets). Refused before
    /// the first byte when the disk has no room for the rest plus the store's headroom.
    async fn download(&self, model: &ModelRef, length: u64) -> Result<(u64, Digest), DownloadError> {
        use std::io::Write;
        let store = self.core.store();
        if let Ok(Some(b)) = store.get_blob(&model.digest) {
            return Ok((b.len() as u64, model.digest));
        }
        let path = store.partial_path(&model.digest);
        let mut have = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        if have > length {
            let _ = std::fs::remove_file(&path);
            have = 0;
        }
        let dir = path.parent().unwrap_or(store.dir());
        // An in-memory store makes its directory only when a download needs it.
        std::fs::create_dir_all(dir).map_err(|e| DownloadError::storage(dir, e))?;
        // Space freed since a full disk: the store gets its reserve back first.
        store.restore_reserve();
        let available = fedfleet_durable::available_space(dir).map_err(|e| DownloadError::storage(dir, e))?;
        let needed = (length - have).saturating_add(DOWNLOAD_HEADROOM_BYTES);
        if available < needed {
            return Err(DownloadError::Storage {
                fault: StorageFault::DiskFull,
                detail: format!(
                    "{} bytes of the artifact to store and {DOWNLOAD_HEADROOM_BYTES} kept free for the agent's store, {available} available in {}",
                    length - have,
                    dir.display()
                ),
            });
        }
        // Mirrors first (a partial file may hold bytes from either source: equal if honest, and
        // the whole is checked below), the registry for what they cannot serve.
        let mut mirrors = self.cfg.mirrors.as_ref().filter(|m| m.serves(&model.digest));
        // A partial file resumed from an earlier attempt may hold mirrored bytes too.
        let mut mirrored = have > 0 && self.cfg.mirrors.is_some();
        let mut f = std::fs::OpenOptions::new().create(true).append(true).open(&path).map_err(|e| DownloadError::storage(&path, e))?;
        while have < length {
            let want = (length - have).min(self.cfg.download_chunk as u64) as u32;
            let chunk = self.artifact_range(model, have, want, &mut mirrors, &mut mirrored).await?;
            let take = chunk.len().min((length - have) as usize);
            f.write_all(&chunk[..take]).and_then(|()| f.sync_data()).map_err(|e| DownloadError::storage(&path, e))?;
            have += take as u64;
        }
        drop(f);
        let bytes = std::fs::read(&path).map_err(|e| DownloadError::storage(&path, e))?;
        let digest = Digest::of(&bytes);
        if digest == model.digest {
            store.promote_partial(&digest).map_err(|e| DownloadError::Storage { fault: StorageFault::Io, detail: e.to_string() })?;
        } else if mirrored && let Some(m) = &self.cfg.mirrors {
            // A mirror (or the store behind it) served other bytes: refused, never staged. The
            // verified metadata still names the artifact, so the install is retried, not failed.
            tracing::warn!(reason = "digest_mismatch", expected = %model.digest, got = %digest, mirrors = ?m, "artifact from a mirror refused: its bytes do not match the signed digest");
            let _ = std::fs::remove_file(&path);
            m.refuse(&model.digest);
            return Err(DownloadError::Transport(format!(
                "mirrored artifact refused (digest_mismatch): {digest}, signed {}",
                model.digest
            )));
        }
        Ok((bytes.len() as u64, digest))
    }
}

/// Why a download stopped: the registry (retried a bounded number of times) or this device's
/// storage (the install is deferred, see [`Input::StorageFailed`]).
#[derive(Debug)]
enum DownloadError {
    Transport(String),
    Storage { fault: StorageFault, detail: String },
}

impl DownloadError {
    fn storage(path: &std::path::Path, e: std::io::Error) -> Self {
        let fault = if fedfleet_durable::is_out_of_space(&e) { StorageFault::DiskFull } else { StorageFault::Io };
        DownloadError::Storage { fault, detail: format!("{}: {e}", path.display()) }
    }
}

/// Runs an agent until `shutdown` resolves: polls the control plane every `poll`, drives the
/// core, and sleeps until the next timer or poll.
pub async fn run_agent<A: Aggregator, R: Registry>(
    agent: &mut Agent<A, R>,
    poll: Duration,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), AgentError> {
    tokio::pin!(shutdown);
    loop {
        agent.poll_control().await?;
        agent.drive().await?;
        let now = agent.now();
        let mut wait = agent.poll_interval(poll);
        if let Some(t) = agent.core.poll_timeout() {
            wait = wait.min(Duration::from_millis(t.saturating_sub(now)));
        }
        tokio::select! {
            _ = &mut shutdown => return Ok(()),
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::{Clock, MonotonicClock};

    const DAY: u64 = 86_400_000;

    /// A wall clock and a monotonic clock the test moves by hand.
    fn clock(wall0: u64) -> (MonotonicClock, Arc<AtomicU64>, Arc<AtomicU64>) {
        let (wall, mono) = (Arc::new(AtomicU64::new(wall0)), Arc::new(AtomicU64::new(0)));
        let (w, m) = (wall.clone(), mono.clone());
        let c = MonotonicClock::with_sources(move || w.load(Ordering::SeqCst), move || m.load(Ordering::SeqCst));
        (c, wall, mono)
    }

    #[test]
    fn a_step_back_is_counted_through_and_the_wall_clock_is_followed_again_once_it_catches_up() {
        let (c, wall, mono) = clock(10 * DAY);
        assert_eq!(c.now_ms(), 10 * DAY);
        // A retry due in 2 s, then the system clock steps back a day.
        let due = c.now_ms() + 2_000;
        wall.fetch_sub(DAY, Ordering::SeqCst);
        mono.fetch_add(500, Ordering::SeqCst);
        wall.fetch_add(500, Ordering::SeqCst);
        assert_eq!(c.now_ms(), 10 * DAY + 500, "no step back");
        mono.fetch_add(1_500, Ordering::SeqCst);
        wall.fetch_add(1_500, Ordering::SeqCst);
        assert!(c.now_ms() >= due, "the retry is due after 2 s, not after a day");
        // The wall clock is set right again (forwards): followed at once.
        wall.store(10 * DAY + 60_000, Ordering::SeqCst);
        assert_eq!(c.now_ms(), 10 * DAY + 60_000);
    }

    #[test]
    fn a_restart_on_a_stepped_back_clock_starts_from_the_latest_time_seen() {
        let (c, _wall, mono) = clock(9 * DAY);
        c.raise_to(10 * DAY);
        assert_eq!(c.now_ms(), 10 * DAY);
        mono.fetch_add(1_000, Ordering::SeqCst);
        assert_eq!(c.now_ms(), 10 * DAY + 1_000);
    }
}
