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

/// A refusal as the API answers it, counted like one over QUIC.
fn api_error(reg: &Registry, e: RegistryError) -> ApiError {
    match reg.count_refusal(&e) {
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
    let r = reg.clone();
    console::blocking(move || f(&r, r.now_ms())).await?.map_err(|e| api_error(reg, e))
}

/// A version as the API takes it: `3` or `v3`.
fn parse_version(text: &str) -> Option<ModelVersion> {
    text.trim_start_matches('v').parse().ok().map(ModelVersion)
}

/// `{version}`: `3`, `v3`, or `latest` (`None`).
fn version_param(c: &Call) -> Result<Option<ModelVersion>, ApiError> {
    match c.param("version") {
        "latest" => Ok(None),
        v => parse_version(v).map(Some).ok_or_else(|| ApiError::bad_request(format!("version {v:?} is neither a number nor `latest`"))),
    }
}

/// One evaluation metric, `KEY=VALUE` (`accuracy=0.97`): `publish --metrics` and the API's
/// `metrics` query.
pub fn parse_metric(kv: &str) -> Result<(String, f64), String> {
    let (k, v) = kv.split_once('=').ok_or("expected KEY=VALUE")?;
    let v: f64 = v.parse().map_err(|e| format!("{v:?}: {e}"))?;
    Ok((k.to_owned(), v))
}

/// What the console needs beyond the registry: where published artifacts are mirrored, and
/// the CA key that revokes (a registry with `[renewal]`).
#[derive(Clone, Default)]
pub struct ConsoleParts {
    pub mirror: Option<Arc<crate::objects::ArtifactMirror>>,
    pub revoker: Option<Revoker>,
}

/// The fleet CA's key and the PKI directory whose lists it signs.
#[derive(Clone)]
pub struct Revoker {
    pub issuer: Arc<fedfleet_certs::DeviceIssuer>,
    pub pki_dir: std::path::PathBuf,
}

/// The query of `POST /api/v1/models/{name}/versions`: the version's record, beside its bytes.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct PublishQuery {
    /// The model's spec, JSON.
    spec: String,
    /// The version this one was trained from (a query value is text).
    parent: Option<String>,
    /// `accuracy=0.97,loss=0.1`.
    #[serde(default)]
    metrics: String,
    #[serde(default)]
    publisher: String,
}

impl PublishQuery {
    fn new_version(self, name: String, caller: &console::Caller) -> Result<crate::store::NewVersion, ApiError> {
        let spec = fedfleet_protocol::SpecJson::parse(&self.spec).map_err(|e| ApiError::bad_request(format!("spec: {e}")))?;
        let metrics = self.metrics.split(',').filter(|kv| !kv.is_empty()).map(parse_metric).collect::<Result<BTreeMap<_, _>, _>>();
        let metrics = metrics.map_err(|e| ApiError::bad_request(format!("metrics: {e}")))?;
        let parent = match &self.parent {
            None => None,
            Some(p) => Some(parse_version(p).ok_or_else(|| ApiError::bad_request(format!("parent {p:?} is not a version number")))?),
        };
        Ok(crate::store::NewVersion {
            name,
            spec,
            parent,
            metrics: metrics.into_iter().collect(),
            created_at_unix_ms: 0,
            publisher: if self.publisher.is_empty() { caller.identity.clone() } else { self.publisher },
            adapter: None,
        })
    }
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
    let cohorts = reg.cohorts_by_device();
    match reg.admin(AdminRequest::DeviceStatus { device: None }, now)? {
        AdminAnswer::Devices { devices } => Ok(devices
            .iter()
            .map(|d| {
                let mut row = device_row(d, now);
                row["cohorts"] = json!(cohorts.get(&d.device).cloned().unwrap_or_default());
                row
            })
            .collect()),
        other => Err(RegistryError::Internal(format!("device status answered {other:?}"))),
    }
}

/// One version as `show` answers it, with its lineage (parents, newest first) and the devices
/// that run it.
fn version_detail(reg: &Registry, name: String, version: Option<ModelVersion>, now: u64) -> Result<Value, RegistryError> {
    let shown = reg.admin(AdminRequest::Show { name: name.clone(), version }, now)?;
    let AdminAnswer::Version(shown) = shown else {
        return Err(RegistryError::Internal(format!("show answered {shown:?}")));
    };
    let version = shown.model.version;
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
            && query.get("cohort").is_none_or(|c| d["cohorts"].as_array().is_some_and(|cs| cs.iter().any(|n| n == c)))
    };
    let shown: Vec<&Value> = all.iter().filter(|d| keep(d)).collect();
    let mut cohorts: Vec<&str> = all.iter().filter_map(|d| d["cohorts"].as_array()).flatten().filter_map(Value::as_str).collect();
    cohorts.sort_unstable();
    cohorts.dedup();
    json!({"total": all.len(), "online": online, "by_version": by_version, "healths": healths, "cohorts": cohorts, "devices": shown})
}

/// The registry's API table.
pub fn api(reg: Arc<Registry>, parts: ConsoleParts) -> Api {
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
            "One version (`latest`: the newest): its record and spec, the aliases on it, its lineage (parents, newest first) and the devices that run it",
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
        .upload(
            "/api/v1/models/{name}/versions",
            "Publishes the body (safetensors weights) as the model's next version; the query holds its record: `spec` (JSON, required), `parent`, `metrics` (`accuracy=0.97,loss=0.1`), `publisher` (default: the caller). Weights that are not a model of the spec are refused, naming every wrong tensor",
            fedfleet_protocol::limits::MAX_BUNDLE_BYTES,
            with(&(reg.clone(), parts.mirror.clone()), |(reg, mirror), c| async move {
                let query = serde_json::to_value(&c.query).and_then(serde_json::from_value::<PublishQuery>);
                let query = query.map_err(|e| ApiError::bad_request(format!("publish: {e}")))?;
                let new = query.new_version(c.param("name").to_owned(), &c.caller)?;
                let m = crate::server::publish_artifact(&reg, mirror.as_ref(), new, c.raw).await.map_err(|e| api_error(&reg, e))?;
                to_reply(crate::ops::published_answer(&m))
            }),
        )
        .read(
            "/api/v1/devices",
            "Every device that reported: version, state, health, last seen, online, the rollout cohorts naming it; `?version=v3&health=failed&online=true&cohort=canary` filter; counts per version",
            with(&reg, |reg, c| async move { Ok(fleet(blocking(&reg, devices).await?, &c.query)) }),
        )
        .read(
            "/api/v1/devices/{id}",
            "One device's last report as it sent it, and whether it is revoked",
            with(&reg, |reg, c| async move {
                let device = Some(c.param("id").to_owned());
                match blocking(&reg, move |reg, now| reg.admin(AdminRequest::DeviceStatus { device }, now)).await? {
                    AdminAnswer::Device(d) => to_reply(d),
                    other => Err(ApiError::internal(format!("device status answered {other:?}"))),
                }
            }),
        )
        .action(
            "/api/v1/devices/{id}/revoke",
            "Revokes a device (`{\"reason\": \"...\"}`): `revoked.json` is re-signed by the fleet CA, and every service refuses the device from its next request. Needs the CA key (`[renewal] ca_key`); without it, revoke on the CA's host with `fedfleet-certs revoke`",
            with(&parts.revoker, |revoker, c| async move {
                let Some(revoker) = revoker else {
                    return Err(ApiError::conflict(
                        "this registry holds no CA key ([renewal] ca_key): revoke on the CA's host with `fedfleet-certs revoke --id ID`",
                    ));
                };
                let id = fedfleet_protocol::DeviceId::new(c.param("id")).map_err(|e| ApiError::bad_request(format!("device id: {e}")))?;
                let reason = c.body.get("reason").and_then(Value::as_str).unwrap_or("revoked from the console").to_owned();
                let revoked = console::blocking(move || {
                    let pki = fedfleet_certs::Pki::open(&revoker.pki_dir)?;
                    revoker.issuer.revoke(&pki, &id, &reason)
                })
                .await?
                .map_err(|e| match e {
                    fedfleet_certs::CertError::NotEnrolled(_) => ApiError::not_found(e.to_string()),
                    fedfleet_certs::CertError::Revoked(_) => ApiError::conflict(e.to_string()),
                    e => ApiError::internal(e.to_string()),
                })?;
                Ok(json!({
                    "device": revoked.entry.device_id,
                    "serial": revoked.entry.serial,
                    "reason": revoked.entry.reason,
                    "revoked_at_unix": revoked.entry.revoked_at,
                    "revocation_list_version": revoked.list_version,
                }))
            }),
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
