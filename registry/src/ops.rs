//! [`Registry`]: the store, the live rollouts and the metadata signer behind one handle, with
//! every operation the service and the operator CLI perform. The QUIC shell (`server`) and the
//! offline CLI call the same methods, so an operator command does the same thing whether it
//! arrives over QUIC or opens the store directly.
//!
//! Rollouts: every rollout lives in memory (loaded from the store on open) and is persisted with
//! [`Store::put_rollout`] after every input that changed it. [`Registry::drive`] feeds the clock
//! ([`Rollout::handle_timeout`]), applies [`RolloutEvent::SetAlias`] to the store, counts events
//! in metrics and returns the next deadline. A crash between an alias move and the rollout's
//! save replays the same transition on restart (the saved state predates it): alias moves are
//! idempotent.

use fedfleet_protocol::SharedClock;
use std::collections::BTreeMap;
use std::io::Read;
use std::sync::{Arc, Mutex};

use fedfleet_protocol::{DeviceId, DeviceStatus, FleetId, ModelRef, ModelVersion};
use serde_json::{Value, json};

use crate::Refusal;
use crate::RegistryError;
use crate::metadata::MetadataSigner;
use crate::metrics::Metrics;
use crate::rollout::{Event as RolloutEvent, Rollout, RolloutPlan, Status, VersionReport};
use crate::store::{Manifest, NewVersion, Store};
use fedfleet_registry_client::admin::{
    AdminAnswer, AliasMoved, DeviceReport, ModelListing, PublishedVersion, RolloutReport, VersionListed, VersionShown,
};

use crate::wire::{AdminRequest, AssignmentBody, AssignmentSource, MetadataSet, RolloutCommand, RolloutStart, SignedAssignment};

/// The alias devices run when no rollout decides for them.
pub const DEFAULT_ALIAS: &str = "stable";

/// The registry's state behind one handle.
pub struct Registry {
    store: Store,
    fleet: FleetId,
    rollouts: Mutex<BTreeMap<String, Rollout>>,
    signer: Option<MetadataSigner>,
    metrics: Arc<Metrics>,
    /// The fleet's revocation list: device status marks revoked devices (their last report
    /// alone would still read "active").
    revocation: Option<Arc<fedfleet_certs::RevocationWatcher>>,
    /// What every request, report and signature is timed by (a fake clock in tests).
    clock: SharedClock,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry").field("store", &self.store).finish()
    }
}

fn event_name(e: &RolloutEvent) -> &'static str {
    match e {
        RolloutEvent::Started { .. } => "started",
        RolloutEvent::PhaseAdvanced { .. } => "phase_advanced",
        RolloutEvent::Paused { .. } => "paused",
        RolloutEvent::Resumed { .. } => "resumed",
        RolloutEvent::Completed { .. } => "completed",
        RolloutEvent::SetAlias { .. } => "set_alias",
        RolloutEvent::Aborted { .. } => "aborted",
        RolloutEvent::AutoAborted { .. } => "auto_aborted",
        RolloutEvent::RolledBack { .. } => "rolled_back",
        RolloutEvent::Stalled { .. } => "stalled",
    }
}

/// The rollout engine's view of a protocol device state (`None`: not about an install).
fn engine_state(s: &fedfleet_protocol::DeviceState) -> Option<VersionReport> {
    use fedfleet_protocol::DeviceState as P;
    Some(match s {
        P::Downloaded => VersionReport::Downloaded,
        P::Verified => VersionReport::Verified,
        P::Healthy => VersionReport::Healthy,
        P::Active => VersionReport::Active,
        P::RolledBack { reason } => VersionReport::RolledBack { reason: reason.clone() },
        P::Failed { reason } => VersionReport::Failed { reason: reason.clone() },
        // The device's storage, not the model: it retries, and the rollout keeps assigning it.
        P::InstallDeferred { .. } => return None,
        _ => return None,
    })
}

fn model_ref_text(m: &Option<ModelRef>) -> Value {
    match m {
        Some(m) => json!({"name": m.name, "version": m.version.0, "digest": m.digest.to_hex()}),
        None => Value::Null,
    }
}

impl Registry {
    /// Wraps an open store. Loads persisted rollouts; with a signer, signs fresh metadata.
    pub fn new(
        store: Store,
        fleet: FleetId,
        signer: Option<MetadataSigner>,
        metrics: Arc<Metrics>,
        clock: SharedClock,
    ) -> Result<Self, RegistryError> {
        let rollouts: BTreeMap<String, Rollout> = store.rollouts()?.into_iter().map(|r| (r.id().to_owned(), r)).collect();
        for r in rollouts.values() {
            metrics.rollout_summary(r.id(), &r.summary());
        }
        let reg = Registry { store, fleet, rollouts: Mutex::new(rollouts), signer, metrics, revocation: None, clock };
        reg.refresh_metadata(reg.now_ms())?;
        Ok(reg)
    }

    /// Device status answers mark the devices this list revokes.
    pub fn with_revocation(mut self, revocation: Arc<fedfleet_certs::RevocationWatcher>) -> Self {
        self.revocation = Some(revocation);
        self
    }

    /// Whether the fleet's revocation list (if loaded) names `id`.
    pub fn is_revoked(&self, id: &fedfleet_protocol::DeviceId) -> bool {
        self.revocation.as_ref().is_some_and(|w| w.is_revoked(id))
    }

    /// A stored status record as JSON, with `"revoked": true` for a revoked device.
    fn device_report(&self, device: &str, record: &[u8]) -> DeviceReport {
        let report = serde_json::from_slice::<Value>(record).unwrap_or(Value::Null);
        let revoked = self.revocation.as_ref().is_some_and(|w| fedfleet_protocol::DeviceId::new(device).is_ok_and(|id| w.is_revoked(&id)));
        DeviceReport { device: device.to_owned(), revoked, report }
    }

    /// Counts a refused or failed request by its reason (logging a failure), for either
    /// transport; returns the kind of refusal.
    pub fn count_refusal(&self, e: &RegistryError) -> Refusal {
        let refusal = e.refusal();
        match refusal {
            Refusal::NotFound => self.metrics.rejection_named("not_found"),
            Refusal::Invalid(name) => self.metrics.rejection_named(name),
            Refusal::Internal => {
                tracing::error!(error = %e, "request failed");
                self.metrics.rejection(fedfleet_protocol::RejectReason::Internal);
            }
        }
        refusal
    }

    /// The named cohorts of every rollout plan, by device (a cohort is a named set of devices
    /// in a plan), from the rollouts in memory.
    pub fn cohorts_by_device(&self) -> BTreeMap<String, Vec<String>> {
        let rollouts = self.rollouts.lock().unwrap_or_else(|p| p.into_inner());
        let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for phase in rollouts.values().flat_map(|r| &r.plan().phases) {
            if let crate::rollout::Audience::Cohort { name, devices } = &phase.audience {
                for d in devices {
                    let names = out.entry(d.to_string()).or_default();
                    if !names.contains(name) {
                        names.push(name.clone());
                    }
                }
            }
        }
        out
    }

    /// The registry's clock, read (unix ms).
    pub fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }

    pub fn clock(&self) -> &SharedClock {
        &self.clock
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    pub fn fleet(&self) -> &FleetId {
        &self.fleet
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    pub fn signer(&self) -> Option<&MetadataSigner> {
        self.signer.as_ref()
    }

    /// Re-signs targets (if changed) and the timestamp.
    pub fn refresh_metadata(&self, now: u64) -> Result<(), RegistryError> {
        if let Some(s) = &self.signer {
            s.refresh(&self.store, now)?;
        }
        Ok(())
    }

    /// Re-signs the timestamp if it is due (the service calls this periodically).
    pub fn refresh_timestamp_if_due(&self, now: u64) -> Result<(), RegistryError> {
        match &self.signer {
            Some(s) if s.timestamp_due(now) => s.refresh(&self.store, now),
            _ => Ok(()),
        }
    }

    /// Signed metadata for a client holding root `have_root_version`.
    pub fn metadata(&self, have_root_version: u64) -> Option<MetadataSet> {
        self.signer.as_ref()?.metadata(have_root_version)
    }

    /// Publishes a new version and re-signs the targets.
    pub fn publish(&self, meta: NewVersion, r: impl Read) -> Result<Manifest, RegistryError> {
        let m = self.store.publish_reader(meta, r)?;
        self.refresh_metadata(self.now_ms())?;
        Ok(m)
    }

    /// Drains a rollout's events: alias moves go to the store; everything is logged and counted.
    /// Persists the rollout if anything happened or `dirty`.
    fn pump(&self, r: &mut Rollout, mut dirty: bool) -> Result<(), RegistryError> {
        while let Some(ev) = r.poll_event() {
            dirty = true;
            self.metrics.rollout_event(event_name(&ev));
            tracing::info!(rollout = r.id(), event = ?ev, "rollout event");
            if let RolloutEvent::SetAlias { model, alias, version } = ev {
                match version {
                    Some(v) => {
                        self.store.set_alias(&model, &alias, v)?;
                    }
                    None => {
                        self.store.remove_alias(&model, &alias)?;
                    }
                }
            }
        }
        if dirty {
            self.store.put_rollout(r)?;
        }
        self.metrics.rollout_summary(r.id(), &r.summary());
        Ok(())
    }

    /// Applies due rollout timeouts. Returns the earliest next deadline (unix ms).
    pub fn drive(&self, now: u64) -> Result<Option<u64>, RegistryError> {
        let mut rollouts = self.rollouts.lock().unwrap_or_else(|p| p.into_inner());
        let mut next: Option<u64> = None;
        for r in rollouts.values_mut() {
            if r.status() == Status::Running {
                r.handle_timeout(now);
                self.pump(r, false)?;
            }
            if let Some(t) = r.poll_timeout() {
                next = Some(next.map_or(t, |n| n.min(t)));
            }
        }
        Ok(next)
    }

    /// Records a device's status (the caller has checked that `status.device` is the peer) and
    /// feeds install outcomes to the model's latest rollout.
    pub fn report(&self, status: &DeviceStatus, now: u64) -> Result<(), RegistryError> {
        let (reason, state) = match &status.state {
            fedfleet_protocol::DeviceState::RolledBack { reason } | fedfleet_protocol::DeviceState::Failed { reason } => {
                (Some(reason.clone()), status.state.as_str())
            }
            fedfleet_protocol::DeviceState::InstallDeferred { fault, detail } => {
                (Some(format!("{fault}: {detail}")), status.state.as_str())
            }
            s => (None, s.as_str()),
        };
        self.metrics.device_report(state);
        let record = json!({
            "device": status.device.as_str(),
            "state": state,
            "reason": reason,
            "active": model_ref_text(&status.active),
            "staged": model_ref_text(&status.staged),
            "reported_at": status.reported_at_unix_ms,
            "received_at": now,
        });
        self.store.put_device_status(status.device.as_str(), record.to_string().as_bytes())?;
        let Some(state) = engine_state(&status.state) else {
            return Ok(());
        };
        let about = match state {
            VersionReport::Active => status.active.as_ref().or(status.staged.as_ref()),
            _ => status.staged.as_ref().or(status.active.as_ref()),
        };
        let Some(model) = about else {
            return Ok(());
        };
        let written = {
            let mut rollouts = self.rollouts.lock().unwrap_or_else(|p| p.into_inner());
            let Some(r) = rollouts.values_mut().filter(|r| r.plan().model == model.name).max_by_key(|r| r.started_at()) else {
                return Ok(());
            };
            r.handle_report(now, status.device.clone(), model.version, state);
            let written = self.store.write_rollout_report(r, &status.device)?;
            // What the report set off (a phase advanced, an alias moved) is flushed here, before
            // anyone else can act on it.
            self.pump(r, false)?;
            written
        };
        // Durable before it is answered, but flushed with the rollouts unlocked: the fleet's
        // other reports and polls do not queue behind this fsync, and reports that come
        // together overlap their flushes.
        self.store.sync(written)?;
        Ok(())
    }

    /// "What should `device` run of `model`?" The model's latest rollout decides while it is
    /// running, paused or aborted (an abort keeps healthy devices on the target); otherwise the
    /// `stable` alias does.
    pub fn assignment(&self, device: &DeviceId, model: &str, now: u64) -> Result<AssignmentBody, RegistryError> {
        let (version, source) = {
            let mut rollouts = self.rollouts.lock().unwrap_or_else(|p| p.into_inner());
            match rollouts.values_mut().filter(|r| r.plan().model == model).max_by_key(|r| r.started_at()) {
                Some(r) if matches!(r.status(), Status::Running | Status::Paused | Status::Aborted) => {
                    let a = r.assignment(device, now);
                    self.pump(r, false)?;
                    (a.version, AssignmentSource::Rollout { id: r.id().to_owned(), reason: a.reason })
                }
                _ => match self.store.alias(model, DEFAULT_ALIAS)? {
                    Some(v) => (Some(v), AssignmentSource::Alias { alias: DEFAULT_ALIAS.into() }),
                    None => (None, AssignmentSource::Nothing),
                },
            }
        };
        let (target, length) = match version {
            Some(v) => {
                let rec = self.store.version(model, v)?;
                (Some(ModelRef { name: model.to_owned(), version: v, digest: rec.digest }), Some(rec.length))
            }
            None => (None, None),
        };
        let ttl = self.signer.as_ref().map_or(3_600_000, |s| s.assignment_ttl_ms());
        Ok(AssignmentBody {
            fleet: self.fleet.clone(),
            device: device.clone(),
            model: model.to_owned(),
            target,
            length,
            source,
            issued_at_unix_ms: now,
            expires_unix_ms: now + ttl,
        })
    }

    /// A signed assignment (needs the signer, i.e. the service).
    pub fn signed_assignment(&self, device: &DeviceId, model: &str, now: u64) -> Result<SignedAssignment, RegistryError> {
        let body = self.assignment(device, model, now)?;
        let signer = self.signer.as_ref().ok_or_else(|| RegistryError::Config("no signing keys loaded".into()))?;
        Ok(signer.sign_assignment(&body))
    }

    /// Runs an operator command (all but `Publish`, which carries bytes: see
    /// [`Registry::publish`]).
    pub fn admin(&self, req: AdminRequest, now: u64) -> Result<AdminAnswer, RegistryError> {
        match req {
            AdminRequest::Publish(_) => Err(RegistryError::Invalid("publish carries the artifact bytes; use Registry::publish".into())),
            AdminRequest::List => {
                let mut models = Vec::new();
                for name in self.store.models()? {
                    let mut versions = Vec::new();
                    for v in self.store.versions(&name)? {
                        versions.push(VersionListed::of(&self.store.version(&name, v)?));
                    }
                    let aliases = self.store.aliases(&name)?.into_iter().collect();
                    models.push(ModelListing { name, versions, aliases });
                }
                Ok(AdminAnswer::Models { models })
            }
            AdminRequest::Show { name, version } => {
                let v = match version {
                    Some(v) => v,
                    None => self.store.latest(&name)?.ok_or_else(|| RegistryError::NotFound(format!("no model named {name:?}")))?,
                };
                let m = self.store.manifest(&name, v)?;
                let aliases = self.store.aliases(&name)?.into_iter().filter(|(_, t)| *t == v).map(|(a, _)| a).collect();
                Ok(AdminAnswer::Version(VersionShown { chunk_size: m.chunk_size, chunks: m.chunks.len(), aliases, model: m.model }))
            }
            AdminRequest::AliasSet { name, alias, version } => {
                let previous = self.store.set_alias(&name, &alias, version)?;
                Ok(AdminAnswer::Alias(AliasMoved { name, alias, version, previous }))
            }
            AdminRequest::RolloutStart(start) => self.rollout_start(start, now),
            AdminRequest::Rollout { id, command } => {
                let mut rollouts = self.rollouts.lock().unwrap_or_else(|p| p.into_inner());
                let r = rollouts.get_mut(&id).ok_or_else(|| RegistryError::NotFound(format!("no rollout {id:?}")))?;
                match command {
                    RolloutCommand::Pause => r.pause(now),
                    RolloutCommand::Resume => r.resume(now),
                    RolloutCommand::Abort { reason } => r.abort(now, &reason),
                    RolloutCommand::Rollback => r.rollback(now),
                }?;
                self.pump(r, true)?;
                Ok(AdminAnswer::Rollout(rollout_report(r)))
            }
            AdminRequest::RolloutStatus { id } => {
                let mut rollouts = self.rollouts.lock().unwrap_or_else(|p| p.into_inner());
                for r in rollouts.values_mut() {
                    if r.status() == Status::Running {
                        r.handle_timeout(now);
                        self.pump(r, false)?;
                    }
                }
                match id {
                    Some(id) => rollouts
                        .get(&id)
                        .map(|r| AdminAnswer::Rollout(rollout_report(r)))
                        .ok_or_else(|| RegistryError::NotFound(format!("no rollout {id:?}"))),
                    None => Ok(AdminAnswer::Rollouts { rollouts: rollouts.values().map(rollout_report).collect() }),
                }
            }
            AdminRequest::DeviceStatus { device } => match device {
                Some(d) => self
                    .store
                    .device_status(&d)?
                    .map(|b| AdminAnswer::Device(self.device_report(&d, &b)))
                    .ok_or_else(|| RegistryError::NotFound(format!("no report from device {d:?}"))),
                None => Ok(AdminAnswer::Devices {
                    devices: self.store.device_statuses()?.iter().map(|(d, b)| self.device_report(d, b)).collect(),
                }),
            },
        }
    }

    fn rollout_start(&self, s: RolloutStart, now: u64) -> Result<AdminAnswer, RegistryError> {
        self.store.version(&s.model, s.target)?;
        let previous = self.store.alias(&s.model, &s.alias)?;
        let id = s.id.unwrap_or_else(|| format!("{}-{}-v{}-{now}", s.model, s.alias, s.target));
        let mut rollouts = self.rollouts.lock().unwrap_or_else(|p| p.into_inner());
        if rollouts.contains_key(&id) {
            return Err(RegistryError::Invalid(format!("rollout {id:?} exists")));
        }
        if let Some(r) = rollouts.values().find(|r| r.plan().model == s.model && matches!(r.status(), Status::Running | Status::Paused)) {
            return Err(RegistryError::Invalid(format!(
                "rollout {:?} of {} is still {:?}; pause/abort it or wait for it to finish",
                r.id(),
                s.model,
                r.status()
            )));
        }
        let plan = RolloutPlan {
            id: id.clone(),
            model: s.model,
            alias: s.alias,
            target: s.target,
            previous,
            phases: s.phases,
            failure_threshold: s.failure_threshold,
            min_sample: s.min_sample,
        };
        let mut r = Rollout::start(plan, now)?;
        r.handle_timeout(now);
        self.pump(&mut r, true)?;
        let out = AdminAnswer::Rollout(rollout_report(&r));
        rollouts.insert(id, r);
        Ok(out)
    }
}

fn rollout_report(r: &Rollout) -> RolloutReport {
    let p = r.plan();
    RolloutReport {
        id: p.id.clone(),
        model: p.model.clone(),
        alias: p.alias.clone(),
        target: p.target,
        previous: p.previous,
        summary: r.summary(),
        failure_threshold: p.failure_threshold,
        started_at: r.started_at(),
        ended_at: r.ended_at(),
        reporting_devices: r.devices().len(),
        plan: p.phases.clone(),
    }
}

/// What a publish answers the operator: the version, its length, digest and chunk count.
pub fn published_answer(m: &Manifest) -> AdminAnswer {
    AdminAnswer::Published(PublishedVersion {
        name: m.model.name.clone(),
        version: m.model.version,
        length: m.model.length,
        digest: m.model.digest,
        chunks: m.chunks.len(),
    })
}

/// Convenience for callers holding a version selector.
pub fn resolve_version(store: &Store, name: &str, sel: &crate::wire::VersionSel) -> Result<ModelVersion, RegistryError> {
    use crate::wire::VersionSel;
    match sel {
        VersionSel::Number(v) => Ok(*v),
        VersionSel::Alias(a) => store.alias(name, a)?.ok_or_else(|| RegistryError::NotFound(format!("model {name:?} has no alias {a:?}"))),
        VersionSel::Latest => store.latest(name)?.ok_or_else(|| RegistryError::NotFound(format!("no model named {name:?}"))),
    }
}

/// Refuses an artifact that is not a model of the spec it is published with (a tensor missing,
/// unexpected or of the wrong shape, NaN or infinities, a spec over the cost bounds): every
/// device would refuse it, or serve it, after the registry had signed it. Every problem is
/// named. Memory: the artifact, which the network path bounds by `MAX_BUNDLE_BYTES`.
pub fn check_artifact(new: &NewVersion, artifact: &[u8]) -> Result<(), RegistryError> {
    use fedfleet_modelspec::ModelSpec;
    use serde::Deserialize;
    let refuse = |what: String| RegistryError::NotAModel(format!("{} is not published: {what}", new.name));
    let spec = ModelSpec::deserialize(&new.spec.0).map_err(|e| refuse(format!("its spec is not a model spec ({e}); pass --spec FILE")))?;
    let bundle = fedfleet_protocol::TensorBundle::decode(artifact, &fedfleet_protocol::BundleLimits::default())
        .map_err(|e| refuse(format!("the artifact is not a tensor bundle: {e}")))?;
    fedfleet_modelspec::check_weights(&spec, &bundle).map_err(|e| refuse(e.to_string()))
}
