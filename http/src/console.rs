//! The operator console: a versioned JSON API (`/api/v1/...`) with its OpenAPI document, and
//! the dashboard page that uses it, served by the registry and the aggregator alike.
//!
//! A service describes its API as a table of operations ([`Api`]): path, summary, the role it
//! needs, and the handler, which calls the same service method as the QUIC operator request.
//! The table builds both the router and the OpenAPI document, so the two cannot disagree.
//!
//! Access ([`Access`]), decided per request:
//! - `Authorization: Bearer T`: the token's name and role from the tokens file; an unknown
//!   token is refused (401), whatever else the request carries.
//! - A TLS client certificate of the fleet CA (checked in the handshake, revocation included):
//!   a service named in the service's `operators` list is an operator; any other identity (a
//!   device, another service) is refused (403).
//! - No credentials from a loopback peer: the `loopback` role (operator by default, so the
//!   dashboard works out of the box on the machine itself); from anywhere else, 401.
//! - A non-loopback `listen` needs `tls = true`: tokens and certificates never cross a network
//!   in the clear.
//!
//! Every operator action, allowed or refused, and every refused request is recorded in the
//! service's audit journal (who, what, when, outcome) and logged under the `audit` target.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Query, RawPathParams};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodFilter, on};
use axum::{Extension, Router};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// The dashboard: one page, no build step; it reads `/api/v1` to learn which views to show.
const DASHBOARD_HTML: &str = include_str!("../assets/console.html");

/// Most connections the console serves at once (operators, not devices).
const MAX_CONNECTIONS: usize = 256;
/// A TLS handshake that takes longer is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Audit entries a service keeps (older ones are trimmed).
pub const AUDIT_KEEP: usize = 100_000;

/// `[console]` in a service's config.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ConsoleConfig {
    /// Where the API and the dashboard listen (TCP).
    pub listen: SocketAddr,
    /// Serve HTTPS with the service's certificate; required for a non-loopback `listen`.
    #[serde(default)]
    pub tls: bool,
    /// Bearer tokens with their roles (TOML, `[[token]] name role token`, or `token_blake3`, the
    /// token's BLAKE3 hash in hex, so the file need not hold it), relative to the config file.
    /// Keep it readable by the service's user only.
    #[serde(default)]
    pub tokens: Option<PathBuf>,
    /// What a loopback caller without credentials may do: `operator` (default), `reader`, or
    /// `none` (credentials needed from loopback too).
    #[serde(default)]
    pub loopback: LoopbackAccess,
    /// Address of the other service's console, linked from the page's navigation.
    #[serde(default)]
    pub peer: Option<String>,
}

impl ConsoleConfig {
    /// Refuses a console that would take credentials over plain HTTP off the machine; makes
    /// the tokens path absolute against `base` (the config file's directory).
    pub fn resolve(&mut self, base: &Path) -> Result<(), String> {
        if !self.listen.ip().is_loopback() && !self.tls {
            return Err(format!(
                "[console] listen = {} is not loopback: set tls = true (operators then bring a client certificate of the fleet CA or a bearer token)",
                self.listen
            ));
        }
        if let Some(t) = self.tokens.as_mut()
            && t.is_relative()
        {
            *t = base.join(&*t);
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LoopbackAccess {
    #[default]
    Operator,
    Reader,
    None,
}

/// What a caller may do: read everything, or also act.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Reader,
    Operator,
}

/// Who is calling, as the audit journal names them: `loopback`, `token:NAME` or `cert:NAME`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Caller {
    pub identity: String,
    pub role: Role,
}

/// The tokens file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TokensFile {
    #[serde(default)]
    token: Vec<TokenEntry>,
}

/// One `[[token]]`: the token itself, or only its BLAKE3 hash (`token_blake3`, 64 hex digits,
/// e.g. `printf %s "$TOKEN" | b3sum`), so that the file does not hold the secret.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenEntry {
    name: String,
    role: Role,
    token: Option<String>,
    token_blake3: Option<String>,
}

impl TokenEntry {
    fn hash(&self) -> Result<blake3::Hash, String> {
        match (&self.token, &self.token_blake3) {
            (Some(t), None) if t.len() < MIN_TOKEN_LEN => Err(format!("token {:?} is shorter than {MIN_TOKEN_LEN} characters", self.name)),
            (Some(t), None) => Ok(blake3::hash(t.as_bytes())),
            (None, Some(hex)) => blake3::Hash::from_hex(hex.trim())
                .map_err(|e| format!("token {:?}: token_blake3 is not a BLAKE3 hash in hex (64 digits): {e}", self.name)),
            _ => Err(format!("token {:?}: give exactly one of `token` and `token_blake3`", self.name)),
        }
    }
}

/// Shortest token accepted: guessing one must not be practical.
const MIN_TOKEN_LEN: usize = 20;

/// Who may call, and how they prove it.
#[derive(Debug, Clone)]
struct Access {
    loopback: LoopbackAccess,
    /// blake3(token) → (name, role): the hash compare is constant-time.
    tokens: Vec<(blake3::Hash, String, Role)>,
    operators: Vec<String>,
}

impl Access {
    /// Reads `cfg.tokens` (if any); `operators` are the service names whose certificates act.
    fn load(cfg: &ConsoleConfig, operators: &[String]) -> Result<Access, String> {
        let mut tokens = Vec::new();
        if let Some(path) = &cfg.tokens {
            let text = std::fs::read_to_string(path).map_err(|e| format!("console tokens {}: {e}", path.display()))?;
            let file: TokensFile = toml::from_str(&text).map_err(|e| format!("console tokens {}: {e}", path.display()))?;
            for t in file.token {
                let hash = t.hash().map_err(|e| format!("console tokens {}: {e}", path.display()))?;
                if tokens.iter().any(|(_, n, _): &(blake3::Hash, String, Role)| *n == t.name) {
                    return Err(format!("console tokens {}: the name {:?} is used twice", path.display(), t.name));
                }
                if tokens.iter().any(|(h, _, _): &(blake3::Hash, String, Role)| *h == hash) {
                    return Err(format!("console tokens {}: {:?} has the token of another entry", path.display(), t.name));
                }
                tokens.push((hash, t.name, t.role));
            }
        }
        Ok(Access { loopback: cfg.loopback, tokens, operators: operators.to_vec() })
    }

    /// The caller of one request, or the refusal (401: no or unknown credentials, 403: an
    /// identity that may not use the console) with who the caller claimed to be, for the audit.
    fn authenticate(&self, headers: &HeaderMap, conn: &ConnInfo) -> Result<Caller, (String, ApiError)> {
        let refuse = |who: String, status, message: String| Err((who, ApiError::new(status, message)));
        if let Some(value) = headers.get(header::AUTHORIZATION) {
            let token = value.to_str().ok().and_then(|v| v.strip_prefix("Bearer ")).map(str::trim);
            let Some(token) = token else {
                return refuse("anonymous".into(), StatusCode::UNAUTHORIZED, "the Authorization header is not `Bearer TOKEN`".into());
            };
            let hash = blake3::hash(token.as_bytes());
            return match self.tokens.iter().find(|(h, _, _)| *h == hash) {
                Some((_, name, role)) => Ok(Caller { identity: format!("token:{name}"), role: *role }),
                None => refuse("token:unknown".into(), StatusCode::UNAUTHORIZED, "unknown bearer token".into()),
            };
        }
        if let Some(certs) = &conn.certs {
            return match fedfleet_certs::peer_identity(certs) {
                Ok(fedfleet_certs::PeerIdentity::Service(name)) if self.operators.contains(&name) => {
                    Ok(Caller { identity: format!("cert:{name}"), role: Role::Operator })
                }
                Ok(fedfleet_certs::PeerIdentity::Service(name)) => refuse(
                    format!("cert:{name}"),
                    StatusCode::FORBIDDEN,
                    format!("service certificate {name:?} is not in this service's operators list"),
                ),
                Ok(fedfleet_certs::PeerIdentity::Device(id)) => refuse(
                    format!("device:{id}"),
                    StatusCode::FORBIDDEN,
                    format!("device certificate {id:?} may not use the operator console"),
                ),
                Err(e) => refuse("cert:unknown".into(), StatusCode::FORBIDDEN, format!("client certificate without a fleet identity: {e}")),
            };
        }
        let role = match (conn.peer.ip().is_loopback(), self.loopback) {
            (true, LoopbackAccess::Operator) => Role::Operator,
            (true, LoopbackAccess::Reader) => Role::Reader,
            _ => {
                return refuse(
                    "anonymous".into(),
                    StatusCode::UNAUTHORIZED,
                    "credentials required: a bearer token or an operator client certificate".into(),
                );
            }
        };
        Ok(Caller { identity: "loopback".into(), role })
    }
}

/// One connection's facts, put on every request it carries.
#[derive(Debug, Clone)]
struct ConnInfo {
    peer: SocketAddr,
    /// The verified client certificate chain, over TLS when one was presented.
    certs: Option<Vec<rustls::pki_types::CertificateDer<'static>>>,
}

/// A request as a handler sees it.
#[derive(Debug)]
pub struct Call {
    /// The `{name}` segments of the path.
    pub params: BTreeMap<String, String>,
    pub query: BTreeMap<String, String>,
    /// The JSON body (`null` when empty, and for an upload).
    pub body: Value,
    /// An upload's bytes (empty for the other operations).
    pub raw: Bytes,
    pub caller: Caller,
}

impl Call {
    /// A path segment the route declares.
    pub fn param(&self, name: &str) -> &str {
        self.params.get(name).map(String::as_str).unwrap_or_default()
    }

    /// `?limit=N`: `default` when absent, at most `max`.
    pub fn limit(&self, default: usize, max: usize) -> Result<usize, ApiError> {
        match self.query.get("limit") {
            None => Ok(default),
            Some(l) => Ok(l.parse::<usize>().map_err(|e| ApiError::bad_request(format!("limit {l:?}: {e}")))?.min(max)),
        }
    }

    /// A body field, decoded (`None` when absent).
    pub fn field<T: serde::de::DeserializeOwned>(&self, name: &str) -> Result<Option<T>, ApiError> {
        match self.body.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => serde_json::from_value(v.clone()).map(Some).map_err(|e| ApiError::bad_request(format!("field {name:?}: {e}"))),
        }
    }
}

/// A refusal or failure: the status and a message for the operator.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError { status, message: message.into() }
    }
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, message)
    }
    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, message)
    }
    /// The request is well formed but does not apply now (a rollout in the wrong state, ...).
    pub fn conflict(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::CONFLICT, message)
    }
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        json_response(self.status, &json!({"error": self.message, "status": self.status.as_u16()}))
    }
}

fn json_response(status: StatusCode, v: &Value) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], serde_json::to_vec(v).unwrap_or_default()).into_response()
}

/// What a handler answers.
pub type Reply = Result<Value, ApiError>;

/// A handler's answer from any serializable value.
pub fn to_reply(v: impl Serialize) -> Reply {
    serde_json::to_value(v).map_err(|e| ApiError::internal(e.to_string()))
}

/// A handler of the table with its own clone of the service's `state`.
pub fn with<S, F, Fut>(state: &S, f: F) -> impl Fn(Call) -> Fut + Send + Sync + 'static
where
    S: Clone + Send + Sync + 'static,
    F: Fn(S, Call) -> Fut + Send + Sync + 'static,
{
    let state = state.clone();
    move |c| f(state.clone(), c)
}

/// Runs blocking work (a store read, a lock taken for long) off the async threads.
pub async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| ApiError::internal(format!("the request's task failed: {e}")))
}

fn reply_response(r: Reply) -> Response {
    match r {
        Ok(v) => json_response(StatusCode::OK, &v),
        Err(e) => e.into_response(),
    }
}
type Handler = Arc<dyn Fn(Call) -> Pin<Box<dyn Future<Output = Reply> + Send>> + Send + Sync>;

struct Op {
    method: Method,
    path: &'static str,
    summary: &'static str,
    role: Role,
    /// What the body is: JSON up to [`MAX_JSON_BODY`], or an upload's bytes up to a bound.
    body: BodyKind,
    handler: Handler,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BodyKind {
    Json,
    /// Raw bytes (`application/octet-stream`) of at most this many.
    Upload(usize),
}

/// Largest JSON body an operation reads.
const MAX_JSON_BODY: usize = 1 << 20;

/// A service's API: its operations, from which the router and the OpenAPI document are built.
pub struct Api {
    service: &'static str,
    /// The dashboard views this service has (`campaign`, `fleet`, `versions`, `rollouts`).
    views: Vec<&'static str>,
    ops: Vec<Op>,
}

impl Api {
    pub fn new(service: &'static str, views: &[&'static str]) -> Api {
        Api { service, views: views.to_vec(), ops: Vec::new() }
    }

    fn op<F, Fut>(mut self, method: Method, path: &'static str, summary: &'static str, role: Role, f: F) -> Self
    where
        F: Fn(Call) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Reply> + Send + 'static,
    {
        debug_assert!(path.starts_with("/api/v1/"), "{path}");
        self.ops.push(Op { method, path, summary, role, body: BodyKind::Json, handler: Arc::new(move |c| Box::pin(f(c))) });
        self
    }

    /// A read (GET), open to readers and operators.
    pub fn read<F, Fut>(self, path: &'static str, summary: &'static str, f: F) -> Self
    where
        F: Fn(Call) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Reply> + Send + 'static,
    {
        self.op(Method::GET, path, summary, Role::Reader, f)
    }

    /// A read for operators only (the audit journal).
    pub fn operator_read<F, Fut>(self, path: &'static str, summary: &'static str, f: F) -> Self
    where
        F: Fn(Call) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Reply> + Send + 'static,
    {
        self.op(Method::GET, path, summary, Role::Operator, f)
    }

    /// An operator action (POST with a JSON body), audited whatever its outcome.
    pub fn action<F, Fut>(self, path: &'static str, summary: &'static str, f: F) -> Self
    where
        F: Fn(Call) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Reply> + Send + 'static,
    {
        self.op(Method::POST, path, summary, Role::Operator, f)
    }

    /// An operator action whose body is bytes (`application/octet-stream`, at most
    /// `max_bytes`, read only once the caller is known to be an operator), in [`Call::raw`];
    /// its parameters come in the query.
    pub fn upload<F, Fut>(mut self, path: &'static str, summary: &'static str, max_bytes: usize, f: F) -> Self
    where
        F: Fn(Call) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Reply> + Send + 'static,
    {
        self = self.op(Method::POST, path, summary, Role::Operator, f);
        self.ops.last_mut().expect("just pushed").body = BodyKind::Upload(max_bytes);
        self
    }

    /// The OpenAPI 3.1 document of every operation, built from the table the router uses.
    pub fn openapi(&self) -> Value {
        let mut paths = serde_json::Map::new();
        for op in &self.ops {
            let parameters: Vec<Value> = op
                .path
                .split('/')
                .filter_map(|s| s.strip_prefix('{').and_then(|s| s.strip_suffix('}')))
                .map(|name| json!({"name": name, "in": "path", "required": true, "schema": {"type": "string"}}))
                .collect();
            let id = format!("{}{}", op.method.as_str().to_lowercase(), op.path.replace(['{', '}'], "").replace(['/', '-'], "_"));
            let mut operation = json!({
                "operationId": id,
                "summary": op.summary,
                "tags": [self.service],
                "x-fedfleet-role": op.role,
                "parameters": parameters,
                "security": [{"bearer": []}, {"clientCertificate": []}, {}],
                "responses": {
                    "200": {"description": "the answer", "content": {"application/json": {"schema": {"type": "object"}}}},
                    "400": {"$ref": "#/components/responses/Error"},
                    "401": {"$ref": "#/components/responses/Error"},
                    "403": {"$ref": "#/components/responses/Error"},
                    "404": {"$ref": "#/components/responses/Error"},
                    "409": {"$ref": "#/components/responses/Error"},
                },
            });
            match op.body {
                BodyKind::Upload(max) => {
                    operation["requestBody"] = json!({"required": true, "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary", "maxLength": max}}}});
                    operation["responses"]["413"] = json!({"$ref": "#/components/responses/Error"});
                }
                BodyKind::Json if op.method == Method::POST => {
                    operation["requestBody"] = json!({"required": false, "content": {"application/json": {"schema": {"type": "object"}}}});
                }
                BodyKind::Json => {}
            }
            let entry = paths.entry(op.path.to_owned()).or_insert_with(|| json!({}));
            entry[op.method.as_str().to_lowercase()] = operation;
        }
        json!({
            "openapi": "3.1.0",
            "info": {"title": format!("fedfleet {} API", self.service), "version": "v1"},
            "paths": paths,
            "components": {
                "securitySchemes": {
                    "bearer": {"type": "http", "scheme": "bearer"},
                    "clientCertificate": {"type": "mutualTLS", "description": "a service certificate of the fleet CA named in the service's operators list"},
                },
                "responses": {"Error": {"description": "refused or failed", "content": {"application/json": {"schema": {
                    "type": "object", "required": ["error", "status"],
                    "properties": {"error": {"type": "string"}, "status": {"type": "integer"}},
                }}}}},
            },
        })
    }
}

/// One entry of the audit journal.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AuditEntry {
    pub at_unix_ms: u64,
    /// `loopback`, `token:NAME`, `cert:NAME`; for a refused caller who it claimed to be:
    /// `anonymous`, `token:unknown`, `device:ID`, `cert:NAME`.
    pub identity: String,
    pub peer: String,
    /// `METHOD /path`.
    pub action: String,
    pub status: u16,
    /// The refusal's or failure's message; empty on success.
    pub detail: String,
}

/// Everything the console's handlers share.
struct Shared {
    api: Api,
    access: Access,
    audit: fedfleet_durable::Journal,
    now_ms: Box<dyn Fn() -> u64 + Send + Sync>,
}

impl Shared {
    /// Records one entry, durably, off the async threads (sled's flush is blocking I/O).
    async fn audit(&self, conn: &ConnInfo, identity: &str, action: String, outcome: &Reply) {
        let (status, detail) = match outcome {
            Ok(_) => (200, String::new()),
            Err(e) => (e.status.as_u16(), e.message.clone()),
        };
        let entry =
            AuditEntry { at_unix_ms: (self.now_ms)(), identity: identity.to_owned(), peer: conn.peer.to_string(), action, status, detail };
        tracing::info!(target: "audit", identity = %entry.identity, peer = %entry.peer, action = %entry.action, status, detail = %entry.detail, "console");
        let bytes = serde_json::to_vec(&entry).expect("an audit entry serializes");
        let journal = self.audit.clone();
        match blocking(move || journal.append(&bytes).and_then(|()| journal.flush())).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::error!(error = %e, "cannot write the audit journal"),
            Err(e) => tracing::error!(error = %e.message, "cannot write the audit journal"),
        }
    }

    /// Authenticates, authorizes, runs and audits one operation.
    async fn dispatch(self: Arc<Self>, op: usize, conn: ConnInfo, headers: HeaderMap, call: CallParts) -> Response {
        let op = &self.api.ops[op];
        let action = format!("{} {}", op.method, call.path);
        let caller = match self.access.authenticate(&headers, &conn) {
            Ok(c) => c,
            Err((who, e)) => {
                let refused = Err(e);
                self.audit(&conn, &who, action, &refused).await;
                return reply_response(refused);
            }
        };
        if caller.role < op.role {
            let refused =
                Err(ApiError::new(StatusCode::FORBIDDEN, format!("{} has the reader role; {action} is for operators", caller.identity)));
            self.audit(&conn, &caller.identity, action, &refused).await;
            return reply_response(refused);
        }
        // The body is read only now: a caller who may not act cannot make the service buffer it.
        let limit = match op.body {
            BodyKind::Json => MAX_JSON_BODY,
            BodyKind::Upload(max) => max,
        };
        let bytes = axum::body::to_bytes(call.body, limit).await.map_err(|e| {
            ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, format!("the body could not be read within its limit of {limit} bytes: {e}"))
        });
        let body = match (op.body, bytes) {
            (_, Err(e)) => Err(e),
            (BodyKind::Upload(_), Ok(raw)) => Ok((Value::Null, raw)),
            (BodyKind::Json, Ok(raw)) if raw.is_empty() => Ok((Value::Null, raw)),
            (BodyKind::Json, Ok(raw)) => serde_json::from_slice(&raw)
                .map(|v| (v, Bytes::new()))
                .map_err(|e| ApiError::bad_request(format!("the body is not JSON: {e}"))),
        };
        let identity = caller.identity.clone();
        let outcome = match body {
            Ok((body, raw)) => (op.handler)(Call { params: call.params, query: call.query, body, raw, caller }).await,
            Err(e) => Err(e),
        };
        // Actions are audited whatever their outcome; reads only when refused (above).
        if op.method == Method::POST {
            self.audit(&conn, &identity, action, &outcome).await;
        }
        reply_response(outcome)
    }
}

struct CallParts {
    path: String,
    params: BTreeMap<String, String>,
    query: BTreeMap<String, String>,
    body: axum::body::Body,
}

/// A console ready to serve: the service's [`Api`] plus the built-in operations
/// (`GET /api/v1`, `/api/v1/openapi.json`, `/api/v1/audit`) and the dashboard at `/`.
pub struct Console {
    shared: Arc<Shared>,
}

impl Console {
    /// `operators`: the service names whose certificates act; `audit`: the service's journal;
    /// `now_ms`: its clock. Fails on a bad tokens file.
    pub fn new(
        api: Api,
        cfg: &ConsoleConfig,
        operators: &[String],
        audit: fedfleet_durable::Journal,
        now_ms: impl Fn() -> u64 + Send + Sync + 'static,
    ) -> Result<Console, String> {
        let access = Access::load(cfg, operators)?;
        let api = with_builtins(api, audit.clone(), cfg.peer.clone());
        Ok(Console { shared: Arc::new(Shared { api, access, audit, now_ms: Box::new(now_ms) }) })
    }

    fn router(&self) -> Router {
        let mut router = Router::new();
        for (i, op) in self.shared.api.ops.iter().enumerate() {
            let shared = self.shared.clone();
            let filter = if op.method == Method::POST { MethodFilter::POST } else { MethodFilter::GET };
            let path = op.path.to_owned();
            let handler = move |raw: RawPathParams,
                                Query(query): Query<BTreeMap<String, String>>,
                                Extension(conn): Extension<ConnInfo>,
                                headers: HeaderMap,
                                body: axum::body::Body| {
                let shared = shared.clone();
                let params: BTreeMap<String, String> = raw.iter().map(|(k, v)| (k.to_owned(), v.to_owned())).collect();
                let concrete = params.iter().fold(path.clone(), |p, (k, v)| p.replace(&format!("{{{k}}}"), v));
                async move { shared.dispatch(i, conn, headers, CallParts { path: concrete, params, query, body }).await }
            };
            // axum 0.7 spells path parameters `:name`.
            let axum_path: String = op
                .path
                .split('/')
                .map(|s| s.strip_prefix('{').and_then(|s| s.strip_suffix('}')).map_or_else(|| s.to_owned(), |n| format!(":{n}")))
                .collect::<Vec<_>>()
                .join("/");
            router = router.route(&axum_path, on(filter, handler));
        }
        let page = |_: Extension<ConnInfo>| async {
            ([(header::CONTENT_TYPE, "text/html; charset=utf-8"), (header::CACHE_CONTROL, "no-cache")], DASHBOARD_HTML)
        };
        router.route("/", axum::routing::get(page)).fallback(|| async {
            ApiError::not_found("no such page or API path (the API is under /api/v1; its document at /api/v1/openapi.json)")
        })
    }

    /// Serves on `listener` (HTTPS with `tls`) until `shutdown` resolves.
    pub async fn serve(self, listener: tokio::net::TcpListener, tls: Option<rustls::ServerConfig>, shutdown: impl Future<Output = ()>) {
        let router = self.router();
        let acceptor = tls.map(|t| tokio_rustls::TlsAcceptor::from(Arc::new(t)));
        let mut handlers = fedfleet_net::serve::accept_until(
            &listener,
            MAX_CONNECTIONS,
            shutdown,
            || tracing::warn!("console connection refused: too many open"),
            move |(tcp, peer): (tokio::net::TcpStream, SocketAddr)| {
                let (router, acceptor) = (router.clone(), acceptor.clone());
                async move {
                    match acceptor {
                        None => serve_connection(tcp, ConnInfo { peer, certs: None }, router).await,
                        Some(acceptor) => match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                            Ok(Ok(stream)) => {
                                let certs =
                                    stream.get_ref().1.peer_certificates().map(|c| c.iter().map(|c| c.clone().into_owned()).collect());
                                serve_connection(stream, ConnInfo { peer, certs }, router).await
                            }
                            Ok(Err(e)) => tracing::info!(%peer, error = %e, "console TLS handshake refused"),
                            Err(_) => tracing::info!(%peer, "console TLS handshake timed out"),
                        },
                    }
                }
            },
        )
        .await;
        // Browsers keep connections open: close them with the service.
        handlers.shutdown().await;
    }
}

async fn serve_connection<Io>(io: Io, conn: ConnInfo, router: Router)
where
    Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(move |mut req: axum::http::Request<hyper::body::Incoming>| {
        req.extensions_mut().insert(conn.clone());
        let mut router = router.clone();
        async move { tower_service::Service::call(&mut router, req).await }
    });
    if let Err(e) = hyper::server::conn::http1::Builder::new().serve_connection(hyper_util::rt::TokioIo::new(io), service).await {
        tracing::debug!(error = %e, "console connection ended");
    }
}

/// The operations every console has.
fn with_builtins(api: Api, audit: fedfleet_durable::Journal, peer: Option<String>) -> Api {
    let (service, views) = (api.service, api.views.clone());
    // The document lists itself: it is made once the table is complete.
    let document: Arc<std::sync::OnceLock<Value>> = Arc::default();
    let served = document.clone();
    let api = api
        .operator_read(
            "/api/v1/audit",
            "The audit journal, newest first (`?limit=N`, default 100): who did what, when, with what outcome",
            with(&audit, |audit, c| async move {
                let limit = c.limit(100, 10_000)?;
                let entries = blocking(move || audit.newest(limit)).await?.map_err(|e| ApiError::internal(e.to_string()))?;
                let entries: Vec<Value> = entries.iter().filter_map(|b| serde_json::from_slice(b).ok()).collect();
                Ok(json!({"entries": entries}))
            }),
        )
        .read("/api/v1/openapi.json", "This document", move |_| {
            let doc = served.get().cloned().unwrap_or(Value::Null);
            async move { Ok(doc) }
        })
        // `/api/v1/` with the trailing slash: the page asks for it.
        .read("/api/v1/", "Which service this is, its dashboard views, and who the caller is", move |c| {
            let (views, peer) = (views.clone(), peer.clone());
            async move { Ok(json!({"service": service, "api": "v1", "views": views, "peer": peer, "caller": c.caller})) }
        });
    let _ = document.set(api.openapi());
    api
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(tokens: &str) -> Result<Access, String> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokens.toml");
        std::fs::write(&path, tokens).unwrap();
        let cfg = ConsoleConfig {
            listen: ([127, 0, 0, 1], 0).into(),
            tls: false,
            tokens: Some(path),
            loopback: LoopbackAccess::default(),
            peer: None,
        };
        Access::load(&cfg, &[])
    }

    #[test]
    fn a_token_is_given_in_the_clear_or_as_its_blake3_hash_only() {
        let hash = blake3::hash(b"ops-token-0123456789abc").to_hex();
        let access = load(&format!(
            "[[token]]\nname = \"viewer\"\nrole = \"reader\"\ntoken = \"viewer-token-0123456789\"\n\
             [[token]]\nname = \"ops\"\nrole = \"operator\"\ntoken_blake3 = \"{hash}\"\n"
        ))
        .unwrap();
        assert_eq!(access.tokens[0].0, blake3::hash(b"viewer-token-0123456789"));
        assert_eq!((access.tokens[1].0.to_hex(), access.tokens[1].2), (hash, Role::Operator));

        let refused = |text: &str, why: &str| {
            let e = load(text).err().unwrap_or_else(|| panic!("{text} was accepted"));
            assert!(e.contains(why), "{e}");
        };
        refused("[[token]]\nname = \"a\"\nrole = \"reader\"\ntoken = \"short\"\n", "shorter than 20");
        refused("[[token]]\nname = \"a\"\nrole = \"reader\"\ntoken_blake3 = \"abc\"\n", "not a BLAKE3 hash");
        refused("[[token]]\nname = \"a\"\nrole = \"reader\"\n", "exactly one of");
        refused(
            &format!("[[token]]\nname = \"a\"\nrole = \"reader\"\ntoken = \"viewer-token-0123456789\"\ntoken_blake3 = \"{hash}\"\n"),
            "exactly one of",
        );
        let twice = format!("[[token]]\nname = \"a\"\nrole = \"reader\"\ntoken_blake3 = \"{hash}\"\n");
        refused(&format!("{twice}{}", twice.replace("\"a\"", "\"b\"")), "the token of another entry");
    }
}
