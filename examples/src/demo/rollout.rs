//! Step 8: a staged rollout through the registry's operator API, watched until every phase
//! ends.

use super::*;

// ----- 8. rollout -----

/// How long past its soak a phase may wait for its devices to report the target healthy.
const PHASE_DEADLINE: Duration = Duration::from_secs(120);

/// A phased rollout: percent of the fleet per phase, soak per phase, and the auto-abort rule.
#[derive(Debug, Clone)]
pub struct RolloutPlan {
    pub percents: Vec<f64>,
    pub soak: Duration,
    /// Abort once more than this fraction of the reporting devices failed their health check.
    pub failure_threshold: f64,
    /// Reports needed before the failure rate counts.
    pub min_sample: u32,
}

impl RolloutPlan {
    /// The demo's: canary 10 % then 100 %, abort above a 20 % failure rate (3 reports at least).
    pub fn canary(soak: Duration) -> Self {
        RolloutPlan { percents: vec![10.0, 100.0], soak, failure_threshold: 0.2, min_sample: 3 }
    }
}

/// How a rollout ended.
#[derive(Debug, Clone)]
pub struct RolloutOutcome {
    /// The registry's final status: completed, aborted, ... (or timeout).
    pub status: String,
    pub phases: Vec<PhaseOutcome>,
    /// Agents serving the target at the end.
    pub agents_on_target: usize,
    /// The registry's counts when the rollout ended: devices reporting the target healthy, and
    /// devices whose install or health check of it failed.
    pub healthy: u64,
    pub failed: u64,
    /// The fleet's device states when the registry ended the rollout ([`Fleet::states_summary`]).
    pub states_at_end: String,
}

/// Rolls `target` out to the `stable` alias phase by phase, each phase soaking and waiting until
/// every device of its audience reports the new version healthy; the registry aborts by itself
/// when too many devices fail their health check. Prints each phase and the fleet's device
/// states at each phase change.
pub async fn rollout(
    ui: &Ui,
    op: &RegistryClient,
    fleet: &mut Fleet,
    target: &ModelRef,
    plan: &RolloutPlan,
) -> anyhow::Result<RolloutOutcome> {
    let id = format!("{}-stable-v{}", target.name, target.version.0);
    let percents = &plan.percents;
    let soak = plan.soak;
    let mut audiences: Vec<Vec<DeviceId>> = percents
        .iter()
        .map(|p| fleet.ids.iter().filter(|&d| fedfleet_registry::rollout::in_percent(&id, d, *p)).cloned().collect())
        .collect();
    let mut canary_cohort = false;
    if audiences[0].is_empty() {
        // No device falls in the first percentage at this fleet size: the canary is the one
        // device with the lowest bucket, as a named cohort.
        if let Some(d) = fleet.ids.iter().min_by_key(|d| fedfleet_registry::rollout::bucket(&id, d)) {
            audiences[0] = vec![d.clone()];
            canary_cohort = true;
        }
    }
    let phases: Vec<Phase> = percents
        .iter()
        .zip(&audiences)
        .enumerate()
        .map(|(i, (p, a))| {
            let mut ph = if i == 0 && canary_cohort {
                Phase::cohort("canary", a.iter().cloned(), soak.as_millis() as u64)
            } else {
                Phase::percent(*p, soak.as_millis() as u64)
            };
            ph.min_healthy = a.len() as u32;
            // A phase whose devices never all report healthy ends the rollout instead of the demo.
            ph.deadline_ms = ph.soak_ms + PHASE_DEADLINE.as_millis() as u64;
            ph
        })
        .collect();
    let canaries: Vec<&str> = audiences[0].iter().map(|d| d.as_str()).collect();
    let later: Vec<String> = percents[1..].iter().zip(&audiences[1..]).map(|(p, a)| format!("{p} % ({} agents)", a.len())).collect();
    ui.line(format!(
        "rollout {id}: {} v{} -> stable, phases {} % ({} canar{}: {}{}){}{}, soak {:.1} s each",
        target.name,
        target.version.0,
        percents[0],
        canaries.len(),
        if canaries.len() == 1 { "y" } else { "ies" },
        if canaries.is_empty() { "none".into() } else { canaries.join(", ") },
        if canary_cohort { ", as a cohort: no device falls in the first phase at this fleet size" } else { "" },
        if later.is_empty() { "" } else { " -> " },
        later.join(" -> "),
        soak.as_secs_f64()
    ));
    ui.line(format!("  devices at start: {}", fleet.states_summary()));
    op.admin(AdminRequest::RolloutStart(RolloutStart {
        id: Some(id.clone()),
        model: target.name.clone(),
        alias: "stable".into(),
        target: target.version,
        phases,
        failure_threshold: plan.failure_threshold,
        min_sample: plan.min_sample,
    }))
    .await
    .map_err(|e| anyhow::anyhow!("rollout start: {e}"))?;
    let spinner = ui.spinner("rollout");
    let t0 = Instant::now();
    let mut phase = 0usize;
    let mut outcome = RolloutOutcome {
        status: String::new(),
        phases: Vec::new(),
        agents_on_target: 0,
        healthy: 0,
        failed: 0,
        states_at_end: String::new(),
    };
    let status = loop {
        if t0.elapsed() > Duration::from_secs(300) {
            break "timeout".to_owned();
        }
        // Status first, then a step: the device states printed at a phase change are those the
        // registry judged, before the agents act on the next phase.
        let answer =
            op.admin(AdminRequest::RolloutStatus { id: Some(id.clone()) }).await.map_err(|e| anyhow::anyhow!("rollout status: {e}"))?;
        let fedfleet_registry::admin::AdminAnswer::Rollout(report) = answer else { anyhow::bail!("rollout status answered {answer:?}") };
        let s = report.summary;
        let now_phase = s.phase;
        let status = s.status.name().to_owned();
        let (healthy, failed) = (s.healthy as u64, s.failed as u64);
        spinner.set_message(format!(
            "phase {}/{} {} ({} healthy, {} failed, {} in progress)",
            now_phase + 1,
            percents.len(),
            status,
            healthy,
            failed,
            s.in_progress
        ));
        let finished = status != "running" && status != "paused";
        while phase < now_phase || (finished && phase < percents.len() && status == "completed") {
            let o = PhaseOutcome {
                phase,
                percent: percents[phase],
                audience: audiences[phase].len(),
                healthy: healthy.min(audiences[phase].len() as u64),
                failed,
                took: t0.elapsed(),
            };
            ui.line(format!(
                "  phase {}/{} ({:>3} %): {:>2} agents in audience, {:>2} healthy, {} failed; {} at {:.1} s",
                o.phase + 1,
                percents.len(),
                o.percent,
                o.audience,
                o.healthy,
                o.failed,
                if o.phase + 1 < percents.len() { "advanced" } else { "completed" },
                o.took.as_secs_f64()
            ));
            ui.line(format!("    devices: {}", fleet.states_summary()));
            outcome.phases.push(o);
            phase += 1;
        }
        if finished {
            outcome.states_at_end = fleet.states_summary();
            (outcome.healthy, outcome.failed) = (healthy, failed);
            if status != "completed" {
                ui.line(format!("  phase {}/{}: rollout {status} ({healthy} healthy, {failed} failed)", phase + 1, percents.len()));
                ui.line(format!("    devices: {}", outcome.states_at_end));
            }
            break status;
        }
        fleet.step(|_| {}).await?;
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    spinner.finish_and_clear();
    // Let every agent pick up its final assignment and report.
    for _ in 0..3 {
        fleet.step(|_| {}).await?;
    }
    ui.line(format!("  devices at end: {}", fleet.states_summary()));
    outcome.status = status;
    outcome.agents_on_target = fleet.active_on(target);
    Ok(outcome)
}

/// The demo's rollout of the final model; anything short of every agent on it is a failure.
pub(super) async fn run_rollout(
    ui: &Ui,
    op: &RegistryClient,
    fleet: &mut Fleet,
    target: &ModelRef,
    soak: Duration,
    report: &mut DemoReport,
) -> anyhow::Result<()> {
    let o = rollout(ui, op, fleet, target, &RolloutPlan::canary(soak)).await?;
    report.phases = o.phases;
    report.agents_on_final = o.agents_on_target;
    report.rollout_status = Some(o.status.clone());
    if o.status == "timeout" {
        report.failures.push("the rollout did not finish in 300 s".into());
    } else if o.status != "completed" {
        report.failures.push(format!("rollout ended {}", o.status));
    }
    if report.agents_on_final != fleet.len() {
        report.failures.push(format!("{} of {} agents run v{}", report.agents_on_final, fleet.len(), target.version.0));
    }
    Ok(())
}

pub(super) fn human_bytes(b: u64) -> String {
    if b >= 1 << 20 {
        format!("{:.2} MiB", b as f64 / (1u64 << 20) as f64)
    } else if b >= 1 << 10 {
        format!("{:.1} KiB", b as f64 / 1024.0)
    } else {
        format!("{b} B")
    }
}
