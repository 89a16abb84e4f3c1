//! The registry's operator console (`fedfleet_http::console`): models, versions with their
//! lineage and the devices that run them, the fleet, rollouts, and the operator actions. Each
//! operation calls [`Registry::admin`] (or the store), as the QUIC operator request does.

use std::collections::BTreeMap;
use std::sync::Arc;

use fedfleet_http::console::{self, Api, ApiError, Call, Reply, to_reply, with};
use fedfleet_protocol::ModelVersion;
use serde_json::{Value, json};

use crate::admin::{AdminAnswer, DeviceReport, VersionListed};
use crate::ops::Registry;
use crate::wire::{AdminRequest, RolloutCommand, RolloutStart};
use crate::{Refusal, RegistryError};

/// A device whose last report is older than this is shown offline.
pub const ONLINE_WINDOW_MS: u64 = 5 * 60 * 1000;
/// Most parents a lineage answer walks.
const MAX_LINEAGE: usize = 256;

fn api_error(e: RegistryError) -> ApiError {
    match e.refusal() {
        Refusal::NotFound => ApiError::not_found(e.to_string()),
        Refusal::Invalid(_) => ApiError::conflict(e.to_string()),
        Refusal::Internal => ApiError::internal(e.to_string()),
    }
}

/// Runs `f` on a blocking thread (the store is sled) with the registry's clock read.
async fn blocking<T: Send + 'static>(
    reg: &Arc<Registry>,
    f: impl FnOnce(&Registry, u64) -> Result<T, RegistryError> + Send + 'static,
) -> Result<T, ApiError> {
    let reg = reg.clone();
    console::blocking(move || f(&reg, reg.now_ms())).await?.map_err(api_error)
}

fn version_param(c: &Call) -> Result<ModelVersion, ApiError> {
    let v = c.param("version");
    v.trim_start_matches('v').parse().map(ModelVersion).map_err(|_| ApiError::bad_request(format!("version {v:?} is not a number")))
}

/// One device as the fleet view shows it, from its stored report (see [`Registry::report`]).
fn device_row(d: &DeviceReport, now: u64) -> Value {
    let r = &d.report;
    let state = r["state"].as_str().unwrap_or("unknown");
    let health = match state {
        "healthy" | "active" => "healthy",
        "failed" | "rolled_back" => state,
        "install_deferred" => "deferred",
        "unknown" => "unknown",
        _ => "ok",
    };
    // The registry's own clock: a device's clock may be off.
    let seen = r["received_at"].as_u64().or_else(|| r["reported_at"].as_u64());
    let version = |m: &Value| m["version"].as_u64().map(|v| format!("v{v}"));
    json!({
        "device": d.device,
        "revoked": d.revoked,
        "model": r["active"]["name"],
        "version": version(&r["active"]),
        "staged": version(&r["staged"]),
        "state": state,
        "health": health,
        "reason": r["reason"],
        "last_seen_unix_ms": seen,
        "online": seen.is_some_and(|t| now.saturating_sub(t) < ONLINE_WINDOW_MS),
    })
}

fn devices(reg: &Registry, now: u64) -> Result<Vec<Value>, RegistryError> {
    match reg.admin(AdminRequest::DeviceStatus { device: None }, now)? {
        AdminAnswer::Devices { devices } => Ok(devices.iter().map(|d| device_row(d, now)).collect()),
        other => Err(RegistryError::Internal(format!("device status answered {other:?}"))),
    }
}

/// One version as `show` answers it, with its lineage (parents, newest first) and the devices
/// that run it.
fn version_detail(reg: &Registry, name: String, version: ModelVersion, now: u64) -> Result<Value, RegistryError> {
    let shown = reg.admin(AdminRequest::Show { name: name.clone(), version: Some(version) }, now)?;
    let AdminAnswer::Version(shown) = shown else {
        return Err(RegistryError::Internal(format!("show answered {shown:?}")));
    };
    let mut lineage = Vec::new();
    let mut parent = shown.model.parent;
    while let Some(p) = parent.filter(|_| lineage.len() < MAX_LINEAGE) {
        let m = reg.store().version(&name, p)?;
        parent = m.parent;
        lineage.push(VersionListed::of(&m));
    }
    let tag = format!("v{version}");
    let running: Vec<Value> = devices(reg, now)?
        .into_iter()
        .filter(|d| d["model"] == json!(name) && d["version"] == json!(tag))
        .map(|d| d["device"].clone())
        .collect();
    let mut out = serde_json::to_value(&shown).map_err(|e| RegistryError::Internal(e.to_string()))?;
    out["lineage"] = json!(lineage);
    out["devices"] = json!(running);
    Ok(out)
}

/// The `?version=&health=&online=` filters of the fleet view, and its counts.
fn fleet(all: Vec<Value>, query: &BTreeMap<String, String>) -> Value {
    let mut by_version: BTreeMap<String, u64> = BTreeMap::new();
    for d in &all {
        *by_version.entry(d["version"].as_str().unwrap_or("none").to_owned()).or_default() += 1;
    }
    let mut healths: Vec<&str> = all.iter().filter_map(|d| d["health"].as_str()).collect();
    healths.sort_unstable();
    healths.dedup();
    let online = all.iter().filter(|d| d["online"] == json!(true)).count();
    let keep = |d: &Value| {
        query.get("version").is_none_or(|v| d["version"].as_str().unwrap_or("none") == v)
            && query.get("health").is_none_or(|h| d["health"] == json!(h))
            && query.get("online").is_none_or(|o| d["online"].as_bool().map(|b| if b { "true" } else { "false" }) == Some(o.as_str()))
    };
    let shown: Vec<&Value> = all.iter().filter(|d| keep(d)).collect();
    json!({"total": all.len(), "online": online, "by_version": by_version, "healths": healths, "devices": shown})
}

/// The registry's API table.
pub fn api(reg: Arc<Registry>) -> Api {
    let mut api = Api::new("registry", &["fleet", "versions", "rollouts"])
        .read(
            "/api/v1/models",
            "Every model: its versions (metrics, lineage, publisher) and aliases",
            with(&reg, |reg, _| async move {
                match blocking(&reg, |reg, now| reg.admin(AdminRequest::List, now)).await? {
                    AdminAnswer::Models { models } => to_reply(json!({ "models": models })),
                    other => Err(ApiError::internal(format!("list answered {other:?}"))),
                }
            }),
        )
        .read(
            "/api/v1/models/{name}/versions/{version}",
            "One version: its record and spec, the aliases on it, its lineage (parents, newest first) and the devices that run it",
            with(&reg, |reg, c| async move {
                let (name, version) = (c.param("name").to_owned(), version_param(&c)?);
                blocking(&reg, move |reg, now| version_detail(reg, name, version, now)).await
            }),
        )
        .action(
            "/api/v1/models/{name}/aliases/{alias}",
            "Points an alias at a version (`{\"version\": N}`): promotes a version by hand, e.g. to `stable`",
            with(&reg, |reg, c| async move {
                let version: ModelVersion = c.field("version")?.ok_or_else(|| ApiError::bad_request("the body needs \"version\""))?;
                let (name, alias) = (c.param("name").to_owned(), c.param("alias").to_owned());
                to_reply(blocking(&reg, move |reg, now| reg.admin(AdminRequest::AliasSet { name, alias, version }, now)).await?)
            }),
        )
        .read(
            "/api/v1/devices",
            "Every device that reported: version, state, health, last seen, online; `?version=v3&health=failed&online=true` filter; counts per version",
            with(&reg, |reg, c| async move { Ok(fleet(blocking(&reg, devices).await?, &c.query)) }),
        )
        .read(
            "/api/v1/rollouts",
            "Every rollout: plan, status, phase, outcomes, failure rate",
            with(&reg, |reg, _| async move { rollout_reply(blocking(&reg, |reg, now| reg.admin(AdminRequest::RolloutStatus { id: None }, now)).await?) }),
        )
        .read(
            "/api/v1/rollouts/{id}",
            "One rollout",
            with(&reg, |reg, c| async move {
                let id = c.param("id").to_owned();
                rollout_reply(blocking(&reg, move |reg, now| reg.admin(AdminRequest::RolloutStatus { id: Some(id) }, now)).await?)
            }),
        )
        .action(
            "/api/v1/rollouts",
            "Starts a rollout (`{\"model\", \"alias\", \"target\", \"phases\", \"failure_threshold\", \"min_sample\"}`, as `rollout start`)",
            with(&reg, |reg, c| async move {
                let start: RolloutStart = serde_json::from_value(c.body).map_err(|e| ApiError::bad_request(format!("rollout: {e}")))?;
                rollout_reply(blocking(&reg, move |reg, now| reg.admin(AdminRequest::RolloutStart(start), now)).await?)
            }),
        );
    let commands: [(&'static str, &'static str, fn(&Call) -> RolloutCommand); 4] = [
        ("/api/v1/rollouts/{id}/pause", "Pauses a running rollout", |_| RolloutCommand::Pause),
        ("/api/v1/rollouts/{id}/resume", "Resumes a paused rollout", |_| RolloutCommand::Resume),
        ("/api/v1/rollouts/{id}/abort", "Aborts a rollout (`{\"reason\": \"...\"}`); the alias stays where it was", |c| {
            RolloutCommand::Abort { reason: c.body.get("reason").and_then(Value::as_str).unwrap_or("aborted from the console").to_owned() }
        }),
        ("/api/v1/rollouts/{id}/rollback", "Rolls a rollout back: the alias returns to the previous version", |_| RolloutCommand::Rollback),
    ];
    for (path, summary, command) in commands {
        api = api.action(
            path,
            summary,
            with(&reg, move |reg, c| {
                let (id, command) = (c.param("id").to_owned(), command(&c));
                async move { rollout_reply(blocking(&reg, move |reg, now| reg.admin(AdminRequest::Rollout { id, command }, now)).await?) }
            }),
        );
    }
    api
}

/// A rollout answer without the CLI's `answer` tag.
fn rollout_reply(a: AdminAnswer) -> Reply {
    match a {
        AdminAnswer::Rollout(r) => to_reply(r),
        AdminAnswer::Rollouts { rollouts } => to_reply(json!({"rollouts": rollouts})),
        other => Err(ApiError::internal(format!("a rollout command answered {other:?}"))),
    }
}
