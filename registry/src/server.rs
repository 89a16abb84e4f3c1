//! The QUIC service shell (mini-redis shape): [`run`] `select!`s the accept loop against a
//! shutdown future; each connection's peer identity comes from its mTLS certificate; each
//! stream is one request ([`crate::wire`]). A background task drives rollout timers and
//! re-signs the timestamp. On shutdown the endpoint closes, handlers get a few seconds to
//! finish, and the store is flushed.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use fedfleet_certs::PeerIdentity;
use fedfleet_net::admission::{Admission, AdmissionConfig, Refused};
use fedfleet_net::{FramedStream, NetError};
use fedfleet_protocol::{FrameKind, RejectReason};

use crate::ops::{Registry, resolve_version};
use crate::store::NewVersion;
use crate::wire::{self, AdminRequest, FRAME_DATA, Request, Response};
use crate::{Refusal, RegistryError};

/// How long a stream may take to send its request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Test-only fault injection (hidden from docs; all off by default).
#[doc(hidden)]
#[derive(Debug)]
pub struct Faults {
    /// Close the connection after this many more chunk-payload bytes (one shot; `u64::MAX` off).
    pub cut_after_bytes: AtomicU64,
    /// Flip one byte in each of the next this-many chunks served.
    pub corrupt_chunks: AtomicU32,
}

impl Default for Faults {
    fn default() -> Self {
        Faults { cut_after_bytes: AtomicU64::new(u64::MAX), corrupt_chunks: AtomicU32::new(0) }
    }
}

/// Device certificate renewal (`[renewal]` in `registry.toml`).
#[derive(Debug, Clone)]
pub struct Renewal {
    /// The fleet CA and its key.
    pub issuer: Arc<fedfleet_certs::DeviceIssuer>,
    /// `devices.json`: a device must be enrolled, not revoked, with the key it presents.
    pub allow_list: Option<Arc<fedfleet_certs::AllowList>>,
    /// Validity of a renewed certificate.
    pub days: u32,
}

/// Service options beside the registry itself.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// Service certificate names (CN) allowed to send operator commands.
    pub operators: Vec<String>,
    /// Concurrent connections; more are refused until one ends.
    pub max_connections: usize,
    /// Directory for incoming publishes (spooled to disk, then published).
    pub spool_dir: std::path::PathBuf,
    /// Device certificate renewal; `None`: `RenewCertificate` is refused (`not_permitted`).
    pub renewal: Option<Renewal>,
    /// The object store every published artifact is also written to.
    pub mirror: Option<Arc<crate::objects::ArtifactMirror>>,
    #[doc(hidden)]
    pub faults: Arc<Faults>,
}

impl ServerOptions {
    pub fn new(spool_dir: impl Into<std::path::PathBuf>) -> Self {
        ServerOptions {
            operators: vec!["operator".into()],
            max_connections: 16384,
            spool_dir: spool_dir.into(),
            renewal: None,
            mirror: None,
            faults: Arc::new(Faults::default()),
        }
    }
}

struct Ctx {
    reg: Arc<Registry>,
    opts: ServerOptions,
}

/// Serves `endpoint` until `shutdown` is triggered.
pub async fn run(endpoint: quinn::Endpoint, reg: Arc<Registry>, opts: ServerOptions, shutdown: fedfleet_net::Shutdown) {
    let ctx = Arc::new(Ctx { reg: reg.clone(), opts });
    let timer = tokio::spawn(timer_loop(reg.clone(), shutdown.clone()));
    let uploader = ctx.opts.mirror.clone().map(|m| tokio::spawn(m.run(reg.clone(), shutdown.clone())));
    tracing::info!(addr = ?endpoint.local_addr().ok(), "registry serving");
    let admission = Admission::new(AdmissionConfig::for_devices(ctx.opts.max_connections));
    let handlers = fedfleet_net::serve::accept_until(
        &endpoint,
        admission.config().total(),
        shutdown.wait(),
        || ctx.reg.metrics().rejection(RejectReason::Overloaded),
        |incoming| connection(incoming, ctx.clone(), admission.clone()),
    )
    .await;
    tracing::info!("registry shutting down");
    shutdown.trigger();
    // Registry handlers serve a connection until it closes: close first, then let them end.
    endpoint.close(0u32.into(), b"shutting down");
    fedfleet_net::serve::drain(&endpoint, handlers, Duration::from_secs(5)).await;
    let _ = timer.await;
    if let Some(u) = uploader {
        let _ = u.await;
    }
    if let Err(e) = reg.store().flush() {
        tracing::error!(error = %e, "flush on shutdown failed");
    }
}

async fn timer_loop(reg: Arc<Registry>, shutdown: fedfleet_net::Shutdown) {
    let stop = shutdown.wait();
    tokio::pin!(stop);
    loop {
        let now = reg.now_ms();
        let next = {
            let reg = reg.clone();
            tokio::task::spawn_blocking(move || {
                if let Err(e) = reg.refresh_timestamp_if_due(now) {
                    tracing::error!(error = %e, "re-signing the timestamp failed");
                }
                match reg.drive(now) {
                    Ok(n) => n,
                    Err(e) => {
                        tracing::error!(error = %e, "driving rollouts failed");
                        None
                    }
                }
            })
            .await
            .unwrap_or(None)
        };
        let wait = next.map(|t| t.saturating_sub(now)).unwrap_or(1000).clamp(50, 1000);
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(wait)) => {}
            _ = &mut stop => return,
        }
    }
}

async fn connection(incoming: quinn::Incoming, ctx: Arc<Ctx>, admission: Arc<Admission>) {
    let remote = incoming.remote_address();
    let admitted = match admission.admit(incoming, fedfleet_net::peer::class).await {
        Ok(a) => a,
        Err(r @ (Refused::HandshakeTimeout | Refused::Retried)) => {
            tracing::debug!(%remote, refused = ?r, "handshake not finished");
            return;
        }
        Err(Refused::HandshakeFailed(e)) => {
            handshake_failed(&ctx, remote, e);
            return;
        }
        Err(r) => {
            tracing::debug!(%remote, refused = ?r, "connection refused: overloaded");
            ctx.reg.metrics().rejection(RejectReason::Overloaded);
            return;
        }
    };
    let conn = admitted.conn.clone();
    serve_connection(conn, remote, ctx).await;
    drop(admitted);
}

fn handshake_failed(ctx: &Ctx, remote: std::net::SocketAddr, e: quinn::ConnectionError) {
    tracing::debug!(%remote, error = %e, "handshake failed");
    match fedfleet_net::tls_alert(&e) {
        Some(fedfleet_net::ALERT_CERTIFICATE_EXPIRED) => ctx.reg.metrics().rejection(RejectReason::CertificateExpired),
        Some(fedfleet_net::ALERT_CERTIFICATE_REVOKED) => ctx.reg.metrics().rejection(RejectReason::Revoked),
        _ => ctx.reg.metrics().rejection_named("handshake"),
    }
}

/// Serves an admitted connection's streams until it closes.
async fn serve_connection(conn: quinn::Connection, remote: std::net::SocketAddr, ctx: Arc<Ctx>) {
    let peer = match fedfleet_net::peer::checked_identity(&conn, ctx.reg.now_ms()) {
        Ok(p) => p,
        Err(fedfleet_net::peer::PeerRefusal::Expired(e)) => {
            tracing::info!(%remote, error = %e, "refusing a resumed session");
            ctx.reg.metrics().rejection(RejectReason::CertificateExpired);
            return;
        }
        Err(fedfleet_net::peer::PeerRefusal::NoIdentity(e)) => {
            tracing::warn!(%remote, error = %e, "refusing peer");
            ctx.reg.metrics().rejection_named("denied");
            return;
        }
    };
    ctx.reg.metrics().connections.inc();
    tracing::debug!(%remote, ?peer, "connection");
    while let Ok((send, recv)) = conn.accept_bi().await {
        let (ctx, conn, peer) = (ctx.clone(), conn.clone(), peer.clone());
        tokio::spawn(async move {
            let mut s = FramedStream::new(send, recv);
            if let Err(e) = stream(&ctx, &conn, &peer, &mut s).await {
                tracing::debug!(%remote, error = %e, "stream ended with an error");
            }
            s.finish();
        });
    }
}

async fn send(s: &mut FramedStream, r: &Response) -> Result<(), NetError> {
    let bytes = wire::encode(r).unwrap_or_else(|e| wire::encode(&wire::rejected(RejectReason::Internal, e.to_string())).expect("encodes"));
    s.send(FrameKind::Message, &bytes).await
}

/// Turns an error into the response the client sees, counting it.
fn error_response(ctx: &Ctx, e: RegistryError) -> Response {
    match ctx.reg.count_refusal(&e) {
        Refusal::NotFound => Response::NotFound(e.to_string()),
        Refusal::Invalid(_) => Response::Invalid(e.to_string()),
        Refusal::Internal => wire::rejected(RejectReason::Internal, e.to_string()),
    }
}

fn denied(ctx: &Ctx, why: String) -> Response {
    ctx.reg.metrics().rejection_named("denied");
    Response::Denied(why)
}

fn request_kind(r: &Request) -> &'static str {
    match r {
        Request::Metadata { .. } => "metadata",
        Request::Manifest { .. } => "manifest",
        Request::Chunks { .. } => "chunks",
        Request::Range { .. } => "range",
        Request::Assignment { .. } => "assignment",
        Request::Report(_) => "report",
        Request::Admin(AdminRequest::Publish(_)) => "admin_publish",
        Request::Admin(_) => "admin",
        Request::RenewCertificate => "renew_certificate",
    }
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T, RegistryError> + Send + 'static) -> Result<T, RegistryError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| RegistryError::Internal(format!("a worker task failed: {e}")))?
}

async fn stream(ctx: &Arc<Ctx>, conn: &quinn::Connection, peer: &PeerIdentity, s: &mut FramedStream) -> Result<(), NetError> {
    let frame = match tokio::time::timeout(REQUEST_TIMEOUT, s.expect()).await {
        Ok(f) => f?,
        Err(_) => return Ok(()),
    };
    let m = ctx.reg.metrics();
    if frame.kind != FrameKind::Message {
        m.rejection(RejectReason::Malformed);
        return send(s, &wire::rejected(RejectReason::Malformed, "expected a request message")).await;
    }
    let req: Request = match wire::decode(&frame.body) {
        Ok(r) => r,
        Err(e) => {
            m.rejection(e.reason());
            return send(s, &wire::rejected(e.reason(), e.to_string())).await;
        }
    };
    m.request(request_kind(&req));
    // A connection made before the revocation keeps no access: the signed list is checked at
    // every request, as at every handshake.
    if let PeerIdentity::Device(id) = peer
        && ctx.reg.is_revoked(id)
    {
        m.rejection(RejectReason::Revoked);
        return send(s, &wire::rejected(RejectReason::Revoked, format!("device {id} is revoked"))).await;
    }
    let reg = ctx.reg.clone();
    let now = ctx.reg.now_ms();
    let resp = match req {
        Request::RenewCertificate => match peer {
            PeerIdentity::Device(id) => renew_certificate(ctx, conn, id, now),
            PeerIdentity::Service(n) => denied(ctx, format!("service {n} has no device certificate to renew")),
        },
        Request::Metadata { have_root_version } => match reg.metadata(have_root_version) {
            Some(md) => Response::Metadata(md),
            None => wire::rejected(RejectReason::Internal, "no signed metadata (no keys loaded)"),
        },
        Request::Manifest { name, version } => {
            match resolve_version(reg.store(), &name, &version).and_then(|v| Ok(reg.store().manifest(&name, v)?)) {
                Ok(man) => Response::Manifest(man),
                Err(e) => error_response(ctx, e),
            }
        }
        Request::Chunks { name, version, indices } => return serve_chunks(ctx, conn, s, &name, version, &indices).await,
        Request::Range { name, version, offset, max_len } => return serve_range(ctx, conn, s, &name, version, offset, max_len).await,
        Request::Assignment { model } => match peer {
            PeerIdentity::Device(id) => {
                let id = id.clone();
                match blocking(move || reg.signed_assignment(&id, &model, now)).await {
                    Ok(a) => Response::Assignment(a),
                    Err(e) => error_response(ctx, e),
                }
            }
            PeerIdentity::Service(n) => denied(ctx, format!("service {n} has no assignment")),
        },
        Request::Report(status) => match peer {
            PeerIdentity::Device(id) if *id != status.device => {
                m.rejection(RejectReason::IdentityMismatch);
                wire::rejected(RejectReason::IdentityMismatch, format!("report names {} but the certificate is {id}", status.device))
            }
            PeerIdentity::Device(_) if status.fleet != *reg.fleet() => {
                m.rejection(RejectReason::WrongFleet);
                wire::rejected(RejectReason::WrongFleet, format!("this is fleet {}", reg.fleet()))
            }
            PeerIdentity::Device(_) => match blocking(move || reg.report(&status, now)).await {
                Ok(()) => Response::Ok,
                Err(e) => error_response(ctx, e),
            },
            PeerIdentity::Service(n) => denied(ctx, format!("service {n} cannot report device status")),
        },
        Request::Admin(req) => match peer {
            PeerIdentity::Service(n) if ctx.opts.operators.iter().any(|o| o == n) => match req {
                AdminRequest::Publish(new) => publish(ctx, s, new, n).await.unwrap_or_else(|e| error_response(ctx, e)),
                req => match blocking(move || reg.admin(req, now)).await {
                    Ok(v) => Response::Admin(admin_json(&v)),
                    Err(e) => error_response(ctx, e),
                },
            },
            PeerIdentity::Service(n) => denied(ctx, format!("service {n} is not an operator")),
            PeerIdentity::Device(d) => denied(ctx, format!("device {d} cannot send operator commands")),
        },
    };
    send(s, &resp).await
}

/// An operator answer as the wire carries it.
fn admin_json(a: &fedfleet_registry_client::admin::AdminAnswer) -> String {
    serde_json::to_string(a).expect("admin answers serialize")
}

/// Issues a device a new certificate for the one it is connected with (same id, fleet, key),
/// after checking it is enrolled with that key (and not revoked on the allow-list).
fn renew_certificate(ctx: &Ctx, conn: &quinn::Connection, id: &fedfleet_protocol::DeviceId, now_ms: u64) -> Response {
    let m = ctx.reg.metrics();
    let refuse = |reason: RejectReason, detail: String| {
        m.rejection(reason);
        tracing::info!(device = %id, %reason, %detail, "certificate renewal refused");
        wire::rejected(reason, detail)
    };
    let Some(r) = &ctx.opts.renewal else {
        return refuse(RejectReason::NotPermitted, "this registry does not renew certificates (no [renewal] ca_key)".into());
    };
    // A revoked device never gets here: every request of one is refused in `stream`.
    let Some(cert) = fedfleet_net::peer::certificates(conn).and_then(|c| c.into_iter().next()) else {
        return refuse(RejectReason::Internal, "no peer certificate".into());
    };
    if let Some(allow) = &r.allow_list {
        let presented = fedfleet_certs::certificate_key(&cert).ok();
        match allow.status(id) {
            fedfleet_certs::DeviceStatus::Unknown => {
                return refuse(RejectReason::UnknownDevice, format!("device {id} is not enrolled"));
            }
            fedfleet_certs::DeviceStatus::Revoked => return refuse(RejectReason::Revoked, format!("device {id} is revoked")),
            fedfleet_certs::DeviceStatus::Enrolled(k) if Some(k) != presented => {
                return refuse(RejectReason::IdentityMismatch, format!("device {id} is enrolled with another key"));
            }
            fedfleet_certs::DeviceStatus::Enrolled(_) => {}
        }
    }
    match r.issuer.renew(&cert, r.days, (now_ms / 1000) as i64) {
        Ok(c) => {
            m.certificates_renewed.inc();
            tracing::info!(device = %id, serial = %c.serial, not_after = %fedfleet_certs::renewal::rfc3339(c.not_after), "renewed device certificate");
            Response::Certificate { pem: c.pem }
        }
        Err(e) => refuse(RejectReason::Internal, format!("renewal failed: {e}")),
    }
}

async fn publish(ctx: &Arc<Ctx>, s: &mut FramedStream, mut new: NewVersion, peer_name: &str) -> Result<Response, RegistryError> {
    use tokio::io::AsyncWriteExt;
    let dir = &ctx.opts.spool_dir;
    let io = |p: &std::path::Path| {
        let p = p.to_owned();
        move |cause| RegistryError::Io { path: p, cause }
    };
    tokio::fs::create_dir_all(dir).await.map_err(io(dir))?;
    let mut nonce = [0u8; 8];
    rand_core::RngCore::fill_bytes(&mut rand_core::OsRng, &mut nonce);
    let path = dir.join(format!("{}.part", hex::encode(nonce)));
    let mut f = tokio::fs::File::create(&path).await.map_err(io(&path))?;
    let mut total = 0u64;
    let res = async {
        loop {
            let fr = s.expect().await.map_err(|e| RegistryError::Invalid(format!("upload broke off: {e}")))?;
            match fr.kind {
                FrameKind::Chunk => {
                    total += fr.body.len() as u64;
                    if total > fedfleet_protocol::limits::MAX_BUNDLE_BYTES as u64 {
                        return Err(RegistryError::Invalid("artifact over the size limit".into()));
                    }
                    f.write_all(&fr.body).await.map_err(io(&path))?;
                }
                FrameKind::End => break,
                _ => {
                    return Err(RegistryError::Invalid("expected Chunk or End frames".into()));
                }
            }
        }
        f.flush().await.map_err(io(&path))?;
        drop(f);
        if new.publisher.is_empty() {
            new.publisher = peer_name.to_owned();
        }
        let artifact = tokio::fs::read(&path).await.map_err(io(&path))?;
        publish_artifact(&ctx.reg, ctx.opts.mirror.as_ref(), new, artifact).await
    }
    .await;
    let _ = tokio::fs::remove_file(&path).await;
    Ok(Response::Admin(admin_json(&crate::ops::published_answer(&res?))))
}

/// Checks `artifact` against its spec and publishes it (stamped with the registry's clock), then
/// writes it to the object store: the publish of the QUIC request and of the console's upload.
pub async fn publish_artifact(
    reg: &Arc<Registry>,
    mirror: Option<&Arc<crate::objects::ArtifactMirror>>,
    mut new: NewVersion,
    artifact: impl AsRef<[u8]> + Send + 'static,
) -> Result<crate::store::Manifest, RegistryError> {
    let r = reg.clone();
    new.created_at_unix_ms = reg.now_ms();
    let m = blocking(move || {
        crate::ops::check_artifact(&new, artifact.as_ref())?;
        r.publish(new, artifact.as_ref())
    })
    .await?;
    if let Some(mirror) = mirror {
        mirror.after_publish(reg, m.model.digest).await;
    }
    Ok(m)
}

/// Sends `bytes` as Chunk frames, honouring the cut fault. Returns false if the connection was
/// cut.
async fn send_data(ctx: &Ctx, conn: &quinn::Connection, s: &mut FramedStream, bytes: &[u8]) -> Result<bool, NetError> {
    let f = &ctx.opts.faults;
    let budget = f.cut_after_bytes.load(Ordering::Relaxed);
    if budget != u64::MAX {
        if budget < bytes.len() as u64 {
            f.cut_after_bytes.store(u64::MAX, Ordering::Relaxed);
            for piece in bytes[..budget as usize].chunks(FRAME_DATA) {
                s.send(FrameKind::Chunk, piece).await?;
            }
            tracing::warn!("fault injection: cutting the connection");
            conn.close(2u32.into(), b"fault injection: cut");
            return Ok(false);
        }
        f.cut_after_bytes.store(budget - bytes.len() as u64, Ordering::Relaxed);
    }
    for piece in bytes.chunks(FRAME_DATA) {
        s.send(FrameKind::Chunk, piece).await?;
    }
    let m = ctx.reg.metrics();
    m.bytes_served.inc_by(bytes.len() as u64);
    Ok(true)
}

async fn serve_chunks(
    ctx: &Arc<Ctx>,
    conn: &quinn::Connection,
    s: &mut FramedStream,
    name: &str,
    version: fedfleet_protocol::ModelVersion,
    indices: &[u32],
) -> Result<(), NetError> {
    let man = match ctx.reg.store().manifest(name, version) {
        Ok(m) => m,
        Err(e) => return send(s, &error_response(ctx, e.into())).await,
    };
    if indices.len() > wire::MAX_CHUNKS_PER_REQUEST {
        ctx.reg.metrics().rejection(RejectReason::TooLarge);
        return send(s, &wire::rejected(RejectReason::TooLarge, "too many chunks in one request")).await;
    }
    if let Some(i) = indices.iter().find(|&&i| i as usize >= man.chunks.len()) {
        ctx.reg.metrics().rejection(RejectReason::Malformed);
        return send(s, &wire::rejected(RejectReason::Malformed, format!("no chunk {i}"))).await;
    }
    send(s, &Response::Chunks { count: indices.len() as u32 }).await?;
    for &i in indices {
        let c = man.chunks[i as usize];
        let mut bytes = match ctx.reg.store().chunk(&c.digest) {
            Ok(b) => b,
            Err(e) => return send(s, &error_response(ctx, e.into())).await,
        };
        if ctx.opts.faults.corrupt_chunks.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1)).is_ok() {
            tracing::warn!(chunk = i, "fault injection: corrupting a chunk");
            bytes[0] ^= 0xff;
        }
        if !send_data(ctx, conn, s, &bytes).await? {
            return Ok(());
        }
        ctx.reg.metrics().chunks_served.inc();
    }
    s.send(FrameKind::End, &[]).await
}

#[allow(clippy::too_many_arguments)]
async fn serve_range(
    ctx: &Arc<Ctx>,
    conn: &quinn::Connection,
    s: &mut FramedStream,
    name: &str,
    version: fedfleet_protocol::ModelVersion,
    offset: u64,
    max_len: u32,
) -> Result<(), NetError> {
    let man = match ctx.reg.store().manifest(name, version) {
        Ok(m) => m,
        Err(e) => return send(s, &error_response(ctx, e.into())).await,
    };
    let end = man.model.length.min(offset.saturating_add(max_len.min(wire::MAX_RANGE_LEN) as u64));
    let len = end.saturating_sub(offset) as u32;
    send(s, &Response::Range { len }).await?;
    let cs = man.chunk_size as u64;
    let mut pos = offset;
    while pos < end {
        let i = (pos / cs) as usize;
        let c = man.chunks[i];
        let bytes = match ctx.reg.store().chunk(&c.digest) {
            Ok(b) => b,
            Err(e) => return send(s, &error_response(ctx, e.into())).await,
        };
        let start = (pos - i as u64 * cs) as usize;
        let stop = ((end - i as u64 * cs) as usize).min(bytes.len());
        if !send_data(ctx, conn, s, &bytes[start..stop]).await? {
            return Ok(());
        }
        pos += (stop - start) as u64;
    }
    s.send(FrameKind::End, &[]).await
}
