//! The rollout engine: moves an alias of a model to a new version in phases. Sans-IO.
//!
//! The engine reads no clock and touches no disk or socket: every input carries `now` (unix ms),
//! outputs are polled ([`Rollout::poll_event`], [`Rollout::poll_timeout`]), and the whole state
//! serializes (the shell stores it in sled with [`crate::Store::put_rollout`] after each input).
//!
//! # Audience
//! A plan is a list of [`Phase`]s. Phase *k*'s audience is the **union of the audiences of phases
//! 0..=k**, so a device that is in the rollout stays in it as phases advance (monotonic). An
//! audience is either a percentage of the fleet or a named cohort (an explicit device list):
//! - percentage `p`: the device is in iff `bucket(rollout_id, device_id) < p`, where `bucket`
//!   maps the first 8 bytes of `blake3(rollout_id || 0x00 || device_id)` (big endian) uniformly
//!   onto `[0, 100)` in steps of 10⁻⁴ %. Deterministic, independent per rollout, and no device
//!   list is needed; the `0x00` separator keeps `("ab","c")` and `("a","bc")` apart.
//! - cohort: the device id is in the cohort's set.
//!
//! # Progress and failure
//! Each phase soaks for at least `soak_ms` of *running* time (time spent paused does not count),
//! and until `min_healthy` devices of the audience so far, and never fewer than one, report the
//! target healthy or active: a phase advances, and the alias moves, on evidence, never on time
//! alone. (One exception: a phase none of whose audience so far has reported at all, such as the
//! 1 % phase of a small fleet, widens on its soak, as nobody runs the target yet; the last phase
//! always needs a healthy device.) A phase still short at its `deadline_ms` stalls the rollout.
//! After the last phase the rollout completes and asks the shell to point the alias at the
//! target ([`Event::SetAlias`]); until then the alias keeps the previous version and only the
//! audience is told to run the target.
//!
//! Device reports ([`VersionReport`]) drive the failure rate: among audience devices that reported
//! an *outcome* for the target (healthy, active, failed, rolled back), the share that failed or
//! rolled back. Downloads and verifications are recorded but are not outcomes. When at least
//! `min_sample` devices reported an outcome and the share exceeds `failure_threshold`, the rollout
//! aborts itself ([`Event::AutoAborted`]) at once. At the end of a phase's soak the same share is
//! judged over however many outcomes there are (fewer than `min_sample` included): a phase whose
//! reporting devices mostly failed never advances, so a rollout that failed everywhere never
//! completes or moves the alias.
//!
//! # What a device should run ([`Rollout::assignment`])
//! | state                | in audience, healthy | in audience, failed | not in audience |
//! |----------------------|----------------------|---------------------|-----------------|
//! | running / paused     | target               | previous            | previous        |
//! | completed            | target               | target              | target          |
//! | aborted              | target if it reported healthy/active, else previous           |||
//! | rolled back          | previous             | previous            | previous        |
//!
//! Pausing freezes the phase (no new devices); aborting stops all new assignments of the target;
//! rolling back sends everyone to the previous version (and moves the alias back if the rollout
//! had completed).

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use fedfleet_protocol::{DeviceId, ModelVersion};
use serde::{Deserialize, Serialize};

/// Resolution of percentages: 1 unit = 10⁻⁴ %.
const BUCKETS: u64 = 1_000_000;

/// Who a phase adds to the rollout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Audience {
    /// A deterministic pseudo-random share of the fleet, in percent (0, 100].
    Percent(f64),
    /// A named, explicit set of devices.
    Cohort { name: String, devices: BTreeSet<DeviceId> },
}

/// One phase of a rollout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Phase {
    pub audience: Audience,
    /// Minimum running time in this phase before the next one starts, in ms.
    pub soak_ms: u64,
    /// Devices of the audience so far that must report the target healthy/active before the
    /// phase advances; read as at least 1 (a rollout advances on evidence, never on time alone).
    #[serde(default)]
    pub min_healthy: u32,
    /// Most running time, in ms, the phase may take to meet `min_healthy`; past it the rollout
    /// stops as stalled ([`Event::Stalled`]) instead of waiting forever. 0: no deadline.
    #[serde(default)]
    pub deadline_ms: u64,
}

impl Phase {
    /// Healthy devices the phase needs before it advances: `min_healthy`, and never fewer than one.
    pub fn required_healthy(&self) -> u32 {
        self.min_healthy.max(1)
    }

    pub fn percent(p: f64, soak_ms: u64) -> Self {
        Phase { audience: Audience::Percent(p), soak_ms, min_healthy: 0, deadline_ms: 0 }
    }

    pub fn cohort(name: &str, devices: impl IntoIterator<Item = DeviceId>, soak_ms: u64) -> Self {
        Phase {
            audience: Audience::Cohort { name: name.to_owned(), devices: devices.into_iter().collect() },
            soak_ms,
            min_healthy: 0,
            deadline_ms: 0,
        }
    }
}

/// What the operator asked for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RolloutPlan {
    /// Unique id; also salts the percentage buckets.
    pub id: String,
    pub model: String,
    /// The alias being moved, e.g. `stable`.
    pub alias: String,
    pub target: ModelVersion,
    /// Where the alias pointed before (what devices outside the audience run); `None` if nothing.
    pub previous: Option<ModelVersion>,
    pub phases: Vec<Phase>,
    /// Auto-abort when failed / reporting exceeds this share, in [0, 1].
    pub failure_threshold: f64,
    /// Outcomes needed before the failure rate is judged.
    pub min_sample: u32,
}

impl RolloutPlan {
    fn validate(&self) -> Result<(), RolloutError> {
        let bad = |s: String| Err(RolloutError::InvalidPlan(s));
        if self.id.is_empty() {
            return bad("empty rollout id".into());
        }
        if self.phases.is_empty() {
            return bad("no phases".into());
        }
        for (i, p) in self.phases.iter().enumerate() {
            if let Audience::Percent(x) = p.audience
                && !(x > 0.0 && x <= 100.0)
            {
                return bad(format!("phase {i}: percentage {x} outside (0, 100]"));
            }
            if p.deadline_ms != 0 && p.deadline_ms < p.soak_ms {
                return bad(format!("phase {i}: deadline {} ms is shorter than its soak {} ms", p.deadline_ms, p.soak_ms));
            }
        }
        if !(0.0..=1.0).contains(&self.failure_threshold) {
            return bad(format!("failure threshold {} outside [0, 1]", self.failure_threshold));
        }
        if Some(self.target) == self.previous {
            return bad("target equals the previous version".into());
        }
        Ok(())
    }
}

/// Where the rollout stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Running,
    Paused,
    Completed,
    Aborted,
    RolledBack,
}

impl Status {
    /// The name operators see (as serialized).
    pub fn name(self) -> &'static str {
        match self {
            Status::Running => "running",
            Status::Paused => "paused",
            Status::Completed => "completed",
            Status::Aborted => "aborted",
            Status::RolledBack => "rolled_back",
        }
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A device's report about one version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VersionReport {
    Downloaded,
    Verified,
    Healthy,
    Active,
    RolledBack { reason: String },
    Failed { reason: String },
}

impl VersionReport {
    /// `Some(true)` for a success outcome, `Some(false)` for a failure, `None` while in progress.
    pub fn outcome(&self) -> Option<bool> {
        match self {
            VersionReport::Downloaded | VersionReport::Verified => None,
            VersionReport::Healthy | VersionReport::Active => Some(true),
            VersionReport::RolledBack { .. } | VersionReport::Failed { .. } => Some(false),
        }
    }
}

/// The latest report of one device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceRecord {
    pub version: ModelVersion,
    pub state: VersionReport,
    pub at: u64,
    /// First phase whose audience includes the device (`None`: in no phase). Cached at report.
    pub first_phase: Option<usize>,
}

/// Why a device got its assignment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// In the audience of the current phase.
    InRollout { phase: usize },
    /// Not (yet) in the audience: stay on the previous version.
    NotInAudience { phase: usize },
    /// In the audience but reported a failure for the target: stay on the previous version.
    DeviceFailed,
    /// The rollout completed: the alias points at the target.
    Completed,
    /// Aborted; this device already runs the target healthily and keeps it.
    AbortedKeep,
    /// Aborted; no new device gets the target.
    Aborted,
    /// Rolled back: everyone returns to the previous version.
    RolledBack,
}

/// Answer to "what should I run?" (the shell signs it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Assignment {
    pub model: String,
    /// `None`: no version of this model (there was none before a first rollout).
    pub version: Option<ModelVersion>,
    pub reason: Reason,
}

/// Things the shell must act on or log, polled in order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Event {
    Started {
        phase: usize,
    },
    PhaseAdvanced {
        phase: usize,
        at: u64,
    },
    Paused {
        phase: usize,
    },
    Resumed {
        phase: usize,
    },
    Completed {
        at: u64,
    },
    /// Point `alias` of `model` at `version` (`None`: remove the alias).
    SetAlias {
        model: String,
        alias: String,
        version: Option<ModelVersion>,
    },
    Aborted {
        phase: usize,
        reason: String,
    },
    AutoAborted {
        phase: usize,
        failure_rate: f64,
        failed: u32,
        reporting: u32,
    },
    RolledBack {
        to: Option<ModelVersion>,
    },
    /// The phase cannot meet `min_healthy`: its deadline passed, or too few devices of a named
    /// audience are left that could still report healthy. The rollout is aborted.
    Stalled {
        phase: usize,
        healthy: u32,
        min_healthy: u32,
        failed: u32,
    },
}

/// An operator command that does not apply in the current state.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RolloutError {
    #[error("invalid rollout plan: {0}")]
    InvalidPlan(String),
    #[error("cannot {action} a rollout that is {from:?}")]
    InvalidTransition { from: Status, action: &'static str },
}

/// Counts for status displays.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub status: Status,
    pub phase: usize,
    pub phases: usize,
    /// Outcomes of audience devices for the target.
    pub healthy: u32,
    pub failed: u32,
    /// Audience devices that reported progress but no outcome yet.
    pub in_progress: u32,
    pub failure_rate: Option<f64>,
}

/// One rollout's state machine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Rollout {
    plan: RolloutPlan,
    status: Status,
    phase: usize,
    /// Running time already soaked in this phase before `running_since`.
    soaked_ms: u64,
    running_since: u64,
    started_at: u64,
    ended_at: Option<u64>,
    alias_moved: bool,
    /// Not in the serialized rollout: a store keeps each device's record under a key of its own
    /// (rewriting every record at each report is quadratic in the fleet) and hands them back to
    /// [`Rollout::with_records`]. Still read from records written before that.
    #[serde(default, skip_serializing)]
    devices: BTreeMap<DeviceId, DeviceRecord>,
    /// Derived from `devices`, so that a phase gate costs the number of phases, not of devices.
    #[serde(skip)]
    tally: Tally,
    events: VecDeque<Event>,
}

/// Device records by the first phase whose audience holds them.
#[derive(Debug, Clone, Default, PartialEq)]
struct Tally {
    /// Records about the target: [healthy, failed, in progress].
    target: Vec<[u32; 3]>,
    /// Records about any version.
    any: Vec<u32>,
}

impl Tally {
    fn new(phases: usize) -> Tally {
        Tally { target: vec![[0; 3]; phases], any: vec![0; phases] }
    }

    fn count(&mut self, rec: &DeviceRecord, target: ModelVersion, add: bool) {
        let Some(f) = rec.first_phase.filter(|&f| f < self.any.len()) else { return };
        let bump = |n: &mut u32| *n = if add { *n + 1 } else { n.saturating_sub(1) };
        bump(&mut self.any[f]);
        if rec.version == target {
            let k = match rec.state.outcome() {
                Some(true) => 0,
                Some(false) => 1,
                None => 2,
            };
            bump(&mut self.target[f][k]);
        }
    }
}

/// The bucket of `device` in rollout `rollout_id`, in [0, 1_000_000) (units of 10⁻⁴ %).
pub fn bucket(rollout_id: &str, device: &DeviceId) -> u64 {
    let mut h = blake3::Hasher::new();
    h.update(rollout_id.as_bytes());
    h.update(&[0]);
    h.update(device.as_str().as_bytes());
    let x = u64::from_be_bytes(h.finalize().as_bytes()[..8].try_into().unwrap());
    ((x as u128 * BUCKETS as u128) >> 64) as u64
}

/// Whether `device` is in the first `percent` % of rollout `rollout_id`.
pub fn in_percent(rollout_id: &str, device: &DeviceId, percent: f64) -> bool {
    bucket(rollout_id, device) < percent_limit(percent)
}

fn percent_limit(percent: f64) -> u64 {
    (percent.clamp(0.0, 100.0) * (BUCKETS as f64 / 100.0)).round() as u64
}

impl Rollout {
    /// Starts a rollout at `now` in phase 0.
    pub fn start(plan: RolloutPlan, now: u64) -> Result<Self, RolloutError> {
        plan.validate()?;
        let phases = plan.phases.len();
        let mut r = Rollout {
            plan,
            status: Status::Running,
            phase: 0,
            soaked_ms: 0,
            running_since: now,
            started_at: now,
            ended_at: None,
            alias_moved: false,
            devices: BTreeMap::new(),
            tally: Tally::new(phases),
            events: VecDeque::new(),
        };
        r.events.push_back(Event::Started { phase: 0 });
        Ok(r)
    }

    pub fn id(&self) -> &str {
        &self.plan.id
    }

    pub fn plan(&self) -> &RolloutPlan {
        &self.plan
    }

    pub fn status(&self) -> Status {
        self.status
    }

    /// Index of the current phase (the last one reached, once finished).
    pub fn phase(&self) -> usize {
        self.phase
    }

    pub fn started_at(&self) -> u64 {
        self.started_at
    }

    pub fn ended_at(&self) -> Option<u64> {
        self.ended_at
    }

    /// Latest report of every device that reported.
    pub fn devices(&self) -> &BTreeMap<DeviceId, DeviceRecord> {
        &self.devices
    }

    /// The first phase whose audience includes `device`, if any.
    pub fn first_phase(&self, device: &DeviceId) -> Option<usize> {
        let b = bucket(&self.plan.id, device);
        self.plan.phases.iter().position(|p| match &p.audience {
            Audience::Percent(x) => b < percent_limit(*x),
            Audience::Cohort { devices, .. } => devices.contains(device),
        })
    }

    /// Whether `device` is in the audience of phases 0..=`phase`.
    pub fn in_audience(&self, device: &DeviceId, phase: usize) -> bool {
        self.first_phase(device).is_some_and(|f| f <= phase)
    }

    fn active(&self) -> bool {
        matches!(self.status, Status::Running | Status::Paused)
    }

    /// A rollout read back from a store with its device records (kept apart, see `devices`).
    pub fn with_records(mut self, records: impl IntoIterator<Item = (DeviceId, DeviceRecord)>) -> Rollout {
        self.devices.extend(records);
        self.tally = Tally::new(self.plan.phases.len());
        for rec in self.devices.values() {
            self.tally.count(rec, self.plan.target, true);
        }
        self
    }

    /// (healthy, failed, in progress) among audience devices' reports for the target.
    fn counts(&self) -> (u32, u32, u32) {
        let upto = (self.phase + 1).min(self.tally.target.len());
        self.tally.target[..upto].iter().fold((0, 0, 0), |(h, f, p), [a, b, c]| (h + a, f + b, p + c))
    }

    /// Whether any device of the audience so far has reported (any version).
    fn audience_seen(&self) -> bool {
        self.tally.any.iter().take(self.phase + 1).any(|&n| n > 0)
    }

    pub fn summary(&self) -> Summary {
        let (healthy, failed, in_progress) = self.counts();
        let reporting = healthy + failed;
        Summary {
            status: self.status,
            phase: self.phase,
            phases: self.plan.phases.len(),
            healthy,
            failed,
            in_progress,
            failure_rate: (reporting > 0).then(|| failed as f64 / reporting as f64),
        }
    }

    /// How many devices the audience of phases 0..=`phase` holds, when every one is named
    /// (cohorts only); `None` when a percentage makes it depend on the fleet's size.
    fn known_audience(&self, phase: usize) -> Option<u32> {
        let mut named = BTreeSet::new();
        for p in &self.plan.phases[..=phase] {
            match &p.audience {
                Audience::Percent(_) => return None,
                Audience::Cohort { devices, .. } => named.extend(devices),
            }
        }
        Some(named.len() as u32)
    }

    fn check_failures(&mut self, now: u64) {
        if !self.active() {
            return;
        }
        let (ok, failed, _) = self.counts();
        let reporting = ok + failed;
        let audience = self.known_audience(self.phase);
        // Every device of a named audience has an outcome: judge now, however few they are
        // (otherwise a one-device canary that failed would leave the rollout waiting forever).
        let all_reported = audience.is_some_and(|n| reporting >= n);
        if reporting > 0 && (reporting >= self.plan.min_sample || all_reported) {
            let rate = failed as f64 / reporting as f64;
            if rate > self.plan.failure_threshold {
                self.end_aborted(now);
                tracing::warn!(rollout = %self.plan.id, phase = self.phase, rate, "auto-abort");
                self.events.push_back(Event::AutoAborted { phase: self.phase, failure_rate: rate, failed, reporting });
                return;
            }
        }
        let min_healthy = self.plan.phases[self.phase].required_healthy();
        if self.status == Status::Running && audience.is_some_and(|n| n.saturating_sub(failed) < min_healthy) {
            self.stall(now, ok, failed);
        }
    }

    fn end_aborted(&mut self, now: u64) {
        self.status = Status::Aborted;
        self.ended_at = Some(now);
    }

    fn stall(&mut self, now: u64, healthy: u32, failed: u32) {
        let min_healthy = self.plan.phases[self.phase].required_healthy();
        self.end_aborted(now);
        tracing::warn!(rollout = %self.plan.id, phase = self.phase, healthy, min_healthy, failed, "stalled");
        self.events.push_back(Event::Stalled { phase: self.phase, healthy, min_healthy, failed });
    }

    /// A device's report. Recorded in every state; judged only while running or paused.
    pub fn handle_report(&mut self, now: u64, device: DeviceId, version: ModelVersion, state: VersionReport) {
        // A device that failed the target goes on reporting the version it still runs (it is
        // sent back to it); that must not erase the failure the rollout is judged by.
        let failed_target = |r: &DeviceRecord| r.version == self.plan.target && r.state.outcome() == Some(false);
        if version != self.plan.target && self.devices.get(&device).is_some_and(failed_target) {
            return;
        }
        let first_phase = self.first_phase(&device);
        let rec = DeviceRecord { version, state, at: now, first_phase };
        self.tally.count(&rec, self.plan.target, true);
        if let Some(old) = self.devices.insert(device, rec) {
            self.tally.count(&old, self.plan.target, false);
        }
        self.check_failures(now);
    }

    /// Advances phases whose soak has elapsed.
    pub fn handle_timeout(&mut self, now: u64) {
        while self.status == Status::Running {
            let phase = &self.plan.phases[self.phase];
            let soaked = self.soaked_ms + now.saturating_sub(self.running_since);
            if soaked < phase.soak_ms {
                return;
            }
            // The phase's gate judges every outcome it has, however few: `min_sample` only
            // keeps an early abort from firing on the first reports while the phase soaks. A
            // phase whose devices mostly failed never advances, and never completes the rollout.
            let (healthy, failed, _) = self.counts();
            let reporting = healthy + failed;
            if reporting > 0 && failed as f64 / reporting as f64 > self.plan.failure_threshold {
                let rate = failed as f64 / reporting as f64;
                self.end_aborted(now);
                tracing::warn!(rollout = %self.plan.id, phase = self.phase, rate, "auto-abort at the phase gate");
                self.events.push_back(Event::AutoAborted { phase: self.phase, failure_rate: rate, failed, reporting });
                return;
            }
            // Evidence, not time alone: whatever `min_healthy` says, at least one device of the
            // audience so far runs the target healthy before the audience widens or the alias
            // moves. Only a phase whose audience so far holds no device that has reported (a 1 %
            // phase of a small fleet) widens on its soak: nobody runs the target, so there is
            // nothing to wait for; the last phase never completes without a healthy device.
            let last = self.phase + 1 == self.plan.phases.len();
            let audience_seen = self.audience_seen();
            let wait_for_evidence = phase.min_healthy > 0 || last || audience_seen;
            if wait_for_evidence && healthy < phase.required_healthy() {
                if phase.deadline_ms > 0 && soaked >= phase.deadline_ms {
                    self.stall(now, healthy, failed);
                }
                return;
            }
            if self.phase + 1 == self.plan.phases.len() {
                self.status = Status::Completed;
                self.ended_at = Some(now);
                self.alias_moved = true;
                self.events.push_back(Event::Completed { at: now });
                self.events.push_back(Event::SetAlias {
                    model: self.plan.model.clone(),
                    alias: self.plan.alias.clone(),
                    version: Some(self.plan.target),
                });
                return;
            }
            self.phase += 1;
            self.soaked_ms = 0;
            self.running_since = now;
            self.events.push_back(Event::PhaseAdvanced { phase: self.phase, at: now });
            // The new phase's gate may already be out of reach of its named audience.
            self.check_failures(now);
        }
    }

    /// When [`Rollout::handle_timeout`] should next be called (unix ms), if anything is pending
    /// on time. A phase waiting for `min_healthy` reports also advances on a later timeout.
    pub fn poll_timeout(&self) -> Option<u64> {
        if self.status != Status::Running {
            return None;
        }
        // Past the soak this stays in the past: a phase waiting for healthy reports (or for its
        // deadline) is judged on every later timeout.
        let soak = self.plan.phases[self.phase].soak_ms;
        Some(self.running_since + soak.saturating_sub(self.soaked_ms))
    }

    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// Freezes the current phase: no new devices, no advancing.
    pub fn pause(&mut self, now: u64) -> Result<(), RolloutError> {
        if self.status != Status::Running {
            return Err(RolloutError::InvalidTransition { from: self.status, action: "pause" });
        }
        self.soaked_ms += now.saturating_sub(self.running_since);
        self.status = Status::Paused;
        self.events.push_back(Event::Paused { phase: self.phase });
        Ok(())
    }

    /// Continues a paused rollout; the remaining soak time continues from where it stopped.
    pub fn resume(&mut self, now: u64) -> Result<(), RolloutError> {
        if self.status != Status::Paused {
            return Err(RolloutError::InvalidTransition { from: self.status, action: "resume" });
        }
        self.status = Status::Running;
        self.running_since = now;
        self.events.push_back(Event::Resumed { phase: self.phase });
        self.handle_timeout(now);
        Ok(())
    }

    /// Stops the rollout: no device newly gets the target.
    pub fn abort(&mut self, now: u64, reason: &str) -> Result<(), RolloutError> {
        if !self.active() {
            return Err(RolloutError::InvalidTransition { from: self.status, action: "abort" });
        }
        self.status = Status::Aborted;
        self.ended_at = Some(now);
        self.events.push_back(Event::Aborted { phase: self.phase, reason: reason.to_owned() });
        Ok(())
    }

    /// Sends every device back to the previous version (and the alias, if it had moved).
    pub fn rollback(&mut self, now: u64) -> Result<(), RolloutError> {
        if self.status == Status::RolledBack {
            return Err(RolloutError::InvalidTransition { from: self.status, action: "roll back" });
        }
        self.status = Status::RolledBack;
        self.ended_at.get_or_insert(now);
        self.events.push_back(Event::RolledBack { to: self.plan.previous });
        if self.alias_moved {
            self.alias_moved = false;
            self.events.push_back(Event::SetAlias {
                model: self.plan.model.clone(),
                alias: self.plan.alias.clone(),
                version: self.plan.previous,
            });
        }
        Ok(())
    }

    /// What `device` should run now. Applies due timeouts first, so the answer is current.
    pub fn assignment(&mut self, device: &DeviceId, now: u64) -> Assignment {
        self.handle_timeout(now);
        let target = Some(self.plan.target);
        let previous = self.plan.previous;
        let failed_here = self.devices.get(device).is_some_and(|r| r.version == self.plan.target && r.state.outcome() == Some(false));
        let healthy_here = self.devices.get(device).is_some_and(|r| r.version == self.plan.target && r.state.outcome() == Some(true));
        let (version, reason) = match self.status {
            Status::Running | Status::Paused => {
                if !self.in_audience(device, self.phase) {
                    (previous, Reason::NotInAudience { phase: self.phase })
                } else if failed_here {
                    (previous, Reason::DeviceFailed)
                } else {
                    (target, Reason::InRollout { phase: self.phase })
                }
            }
            Status::Completed => (target, Reason::Completed),
            Status::Aborted if healthy_here && self.in_audience(device, self.phase) => (target, Reason::AbortedKeep),
            Status::Aborted => (previous, Reason::Aborted),
            Status::RolledBack => (previous, Reason::RolledBack),
        };
        Assignment { model: self.plan.model.clone(), version, reason }
    }
}
