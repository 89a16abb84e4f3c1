//! The registry client, for agents and operator tools.
//!
//! ```ignore
//! let tls = fedfleet_certs::tls::client_config(&ca, &device, &[fedfleet_certs::ALPN_V1])?;
//! let reg = RegistryClient::connect(addr, "localhost", tls).await?;
//! let md = reg.metadata(verifier.root().version).await?;          // feed to tuf::Verifier
//! let a = reg.assignment("mnist").await?.verify(verifier.root(), &my_id, now)?;
//! let target = verifier.target("mnist", a.target.unwrap().version, now)?.clone();
//! let mut cache = DirChunkCache::open(state_dir.join("chunks"))?;
//! let report = reg.download_target(&target, &mut cache, &slot_path).await?;
//! reg.report(&status).await?;
//! ```
//!
//! # Downloads
//! [`RegistryClient::download`] fetches the manifest, asks only for chunks the [`ChunkCache`]
//! lacks (so a device holding an earlier version's chunks fetches only what differs, and a
//! download resumes where it stopped, even after a process restart with a [`DirChunkCache`]),
//! checks every chunk's digest **on arrival** (a bad chunk is dropped and asked for again),
//! reconnects after a lost connection (bounded retries without progress), then assembles the
//! artifact into `dest` (temp file + rename), re-checking each cached chunk (a chunk corrupted
//! in the cache is removed and refetched) and the whole digest and length. The manifest is not
//! signed: [`RegistryClient::download_target`] first checks it against the trusted TUF target,
//! which bounds the download (endless data) and pins the final digest.
//!
//! The client is `Send + Sync`; methods take `&self` and may run concurrently (each request is
//! its own QUIC stream on one shared connection). Cache I/O is plain blocking `std::fs`.

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use fedfleet_net::{FramedStream, NetError, RpcConnection};
use fedfleet_protocol::{DeviceStatus, Digest, FrameKind, Hasher, ModelVersion, Rejection};

use crate::admin::AdminAnswer;
use crate::wire::{self, AdminRequest, MetadataSet, Request, Response, SignedAssignment, VersionSel};
use fedfleet_protocol::ModelInfo;
use fedfleet_protocol::artifact::Manifest;

/// Chunks asked for per request stream.
const BATCH: usize = 64;

/// Why a client call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    #[error("transport: {0}")]
    Net(NetError),
    #[error("registry refused ({}): {}", .0.reason, .0.detail)]
    Rejected(Rejection),
    #[error("not found: {0}")]
    NotFound(String),
    #[error("denied: {0}")]
    Denied(String),
    #[error("invalid: {0}")]
    Invalid(String),
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error("chunk cache: {0}")]
    Cache(std::io::Error),
    #[error("manifest of {name} v{version} does not match the trusted target: {detail}")]
    TargetMismatch { name: String, version: ModelVersion, detail: String },
    #[error("gave up after {attempts} attempts without progress; last error: {last}")]
    GaveUp { attempts: u32, last: String },
    #[error("writing {path}: {cause}")]
    Io { path: PathBuf, cause: std::io::Error },
}

// Printed in the message, so not also a `source`: a report of the chain would say it twice.
impl From<NetError> for ClientError {
    fn from(e: NetError) -> Self {
        match e.refusal("registry") {
            Some(r) => ClientError::Rejected(r),
            None => ClientError::Net(e),
        }
    }
}

impl ClientError {
    /// Whether retrying later may help (the connection broke).
    pub fn is_transport(&self) -> bool {
        matches!(self, ClientError::Net(_) | ClientError::GaveUp { .. })
    }
}

/// Where downloaded chunks are kept, by digest. Implementations need not verify on `get`: the
/// client re-hashes every chunk it reads back.
pub trait ChunkCache {
    /// Whether a chunk is held (cheap; not verified).
    fn contains(&self, digest: &Digest) -> bool;
    /// A held chunk's bytes.
    fn get(&self, digest: &Digest) -> std::io::Result<Option<Vec<u8>>>;
    /// Stores a verified chunk.
    fn put(&mut self, digest: &Digest, bytes: &[u8]) -> std::io::Result<()>;
    /// Drops a chunk (found corrupt).
    fn remove(&mut self, digest: &Digest) -> std::io::Result<()>;
}

/// A directory of chunk files named by hex digest (survives restarts: downloads resume).
#[derive(Debug, Clone)]
pub struct DirChunkCache {
    dir: PathBuf,
}

impl DirChunkCache {
    pub fn open(dir: impl Into<PathBuf>) -> std::io::Result<Self> {
        let dir = dir.into();
        std::fs::create_dir_all(&dir)?;
        Ok(DirChunkCache { dir })
    }

    pub fn path_of(&self, digest: &Digest) -> PathBuf {
        self.dir.join(digest.to_hex())
    }

    /// Removes every chunk not in `keep` (e.g. chunks of versions no slot holds any more).
    pub fn retain(&mut self, keep: &HashSet<Digest>) -> std::io::Result<u64> {
        let keep: HashSet<String> = keep.iter().map(|d| d.to_hex()).collect();
        let mut removed = 0;
        for e in std::fs::read_dir(&self.dir)? {
            let e = e?;
            if !keep.contains(&*e.file_name().to_string_lossy()) {
                std::fs::remove_file(e.path())?;
                removed += 1;
            }
        }
        Ok(removed)
    }
}

impl ChunkCache for DirChunkCache {
    fn contains(&self, digest: &Digest) -> bool {
        self.path_of(digest).is_file()
    }
    fn get(&self, digest: &Digest) -> std::io::Result<Option<Vec<u8>>> {
        match std::fs::read(self.path_of(digest)) {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }
    fn put(&mut self, digest: &Digest, bytes: &[u8]) -> std::io::Result<()> {
        let p = self.path_of(digest);
        let tmp = p.with_extension("tmp");
        std::fs::write(&tmp, bytes)?;
        std::fs::rename(&tmp, &p)
    }
    fn remove(&mut self, digest: &Digest) -> std::io::Result<()> {
        match std::fs::remove_file(self.path_of(digest)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }
}

/// An in-memory cache (tests, small models).
#[derive(Debug, Clone, Default)]
pub struct MemChunkCache {
    pub chunks: HashMap<Digest, Vec<u8>>,
}

impl ChunkCache for MemChunkCache {
    fn contains(&self, digest: &Digest) -> bool {
        self.chunks.contains_key(digest)
    }
    fn get(&self, digest: &Digest) -> std::io::Result<Option<Vec<u8>>> {
        Ok(self.chunks.get(digest).cloned())
    }
    fn put(&mut self, digest: &Digest, bytes: &[u8]) -> std::io::Result<()> {
        self.chunks.insert(*digest, bytes.to_vec());
        Ok(())
    }
    fn remove(&mut self, digest: &Digest) -> std::io::Result<()> {
        self.chunks.remove(digest);
        Ok(())
    }
}

/// What a download did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DownloadReport {
    pub chunks_total: u64,
    /// Chunks already in the cache (delta / resume).
    pub chunks_reused: u64,
    pub chunks_fetched: u64,
    /// Verified chunk payload bytes received.
    pub bytes_fetched: u64,
    /// Chunks that arrived with a wrong digest and were asked for again.
    pub corrupt_on_arrival: u64,
    /// Cached chunks found corrupt at assembly and refetched.
    pub corrupt_in_cache: u64,
    /// Transport failures recovered from (reconnects).
    pub reconnects: u64,
    /// Bytes read from the chunk streams (frame prefixes and partial chunks included).
    pub wire_bytes: u64,
}

/// A connection to the registry that reconnects on demand.
pub struct RegistryClient {
    rpc: RpcConnection,
    /// Consecutive failures without progress before a call gives up. Default 5.
    pub max_retries: u32,
    wire_bytes: AtomicU64,
}

impl std::fmt::Debug for RegistryClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistryClient").field("rpc", &self.rpc).finish()
    }
}

/// The response a frame carries.
fn response_of(f: fedfleet_net::Frame) -> Result<Response, ClientError> {
    if f.kind != FrameKind::Message {
        return Err(ClientError::Protocol(format!("expected a response, got {:?}", f.kind)));
    }
    wire::decode(&f.body).map_err(|e| ClientError::Protocol(e.to_string()))
}

/// An operator command's answer, or why there is none.
fn admin_answer(r: Response) -> Result<AdminAnswer, ClientError> {
    match r {
        Response::Admin(json) => serde_json::from_str(&json).map_err(|e| ClientError::Protocol(e.to_string())),
        r => Err(response_error(r)),
    }
}

fn response_error(r: Response) -> ClientError {
    match r {
        Response::Rejected(r) => ClientError::Rejected(r),
        Response::NotFound(d) => ClientError::NotFound(d),
        Response::Denied(d) => ClientError::Denied(d),
        Response::Invalid(d) => ClientError::Invalid(d),
        other => ClientError::Protocol(format!("unexpected response {other:?}")),
    }
}

use fedfleet_net::rpc::backoff;

impl RegistryClient {
    /// A client for the registry at `addr` (TLS name `server_name`), with a config from
    /// `fedfleet_certs::tls::client_config` (devices) or `service_client_config` (operators).
    /// Connects lazily; must be called inside a tokio runtime.
    pub fn new(addr: SocketAddr, server_name: &str, tls: rustls::ClientConfig) -> Result<Self, ClientError> {
        Ok(Self::with_rpc(RpcConnection::new(addr, server_name, tls)?))
    }

    /// As [`new`](Self::new), on a client endpoint shared with other clients
    /// ([`RpcConnection::on_endpoint`]).
    pub fn on_endpoint(
        endpoint: quinn::Endpoint,
        addr: SocketAddr,
        server_name: &str,
        tls: rustls::ClientConfig,
    ) -> Result<Self, ClientError> {
        Ok(Self::with_rpc(RpcConnection::on_endpoint(endpoint, addr, server_name, tls)?))
    }

    /// See [`RpcConnection::keep_alive`] (simulators only).
    pub fn keep_alive(mut self, interval: std::time::Duration) -> Self {
        self.rpc = self.rpc.keep_alive(interval);
        self
    }

    fn with_rpc(rpc: RpcConnection) -> Self {
        RegistryClient { rpc, max_retries: fedfleet_net::rpc::DEFAULT_MAX_RETRIES, wire_bytes: AtomicU64::new(0) }
    }

    /// [`RegistryClient::new`] plus the handshake (fails fast if the registry is unreachable).
    /// A refused client certificate surfaces on the first request, not here.
    pub async fn connect(addr: SocketAddr, server_name: &str, tls: rustls::ClientConfig) -> Result<Self, ClientError> {
        let c = Self::new(addr, server_name, tls)?;
        c.rpc.connection().await?;
        Ok(c)
    }

    /// Bytes read from response streams so far (all requests, frame prefixes included).
    pub fn wire_bytes(&self) -> u64 {
        self.wire_bytes.load(Ordering::Relaxed)
    }

    /// Opens a stream and sends `req` (finishing our side unless `more` follows).
    async fn start(&self, req: &Request, more: bool) -> Result<FramedStream, ClientError> {
        let mut s = self.rpc.open_stream().await?;
        let body = wire::encode(req).map_err(|e| ClientError::Protocol(e.to_string()))?;
        s.send(FrameKind::Message, &body).await?;
        if !more {
            s.finish();
        }
        Ok(s)
    }

    async fn read_response(&self, s: &mut FramedStream) -> Result<Response, ClientError> {
        response_of(s.expect().await?)
    }

    /// One request/response, retried with reconnects on transport errors (idempotent requests).
    async fn call(&self, req: &Request) -> Result<Response, ClientError> {
        self.rpc
            .retry(self.max_retries, ClientError::is_transport, || async {
                let mut s = self.start(req, false).await?;
                let r = self.read_response(&mut s).await;
                self.wire_bytes.fetch_add(s.bytes_read(), Ordering::Relaxed);
                r
            })
            .await
    }

    /// Signed metadata: roots newer than `have_root_version`, timestamp, targets. Feed them to
    /// `tuf::Verifier` (`update_root` each, `update_timestamp`, `update_targets`).
    pub async fn metadata(&self, have_root_version: u64) -> Result<MetadataSet, ClientError> {
        match self.call(&Request::Metadata { have_root_version }).await? {
            Response::Metadata(m) => Ok(m),
            r => Err(response_error(r)),
        }
    }

    /// A version's manifest (by number, alias or latest).
    pub async fn manifest(&self, name: &str, version: impl Into<VersionSel>) -> Result<Manifest, ClientError> {
        let req = Request::Manifest { name: name.to_owned(), version: version.into() };
        match self.call(&req).await? {
            Response::Manifest(m) => {
                m.validate().map_err(ClientError::Protocol)?;
                Ok(m)
            }
            r => Err(response_error(r)),
        }
    }

    /// "What should I run of `model`?", signed with the registry's timestamp key: check it with
    /// [`SignedAssignment::verify`] against the pinned root before acting on it.
    pub async fn assignment(&self, model: &str) -> Result<SignedAssignment, ClientError> {
        match self.call(&Request::Assignment { model: model.to_owned() }).await? {
            Response::Assignment(a) => Ok(a),
            r => Err(response_error(r)),
        }
    }

    /// A renewed certificate (PEM) for this device's current one. Not retried: the caller
    /// checks again at its next interval.
    pub async fn renew_certificate(&self) -> Result<String, ClientError> {
        let mut s = self.start(&Request::RenewCertificate, false).await?;
        match self.read_response(&mut s).await? {
            Response::Certificate { pem } => Ok(pem),
            r => Err(response_error(r)),
        }
    }

    /// Presents `tls` (a renewed certificate) from the next connection on.
    pub async fn set_tls(&self, tls: rustls::ClientConfig) -> Result<(), ClientError> {
        Ok(self.rpc.set_tls(tls).await?)
    }

    /// Sends a status report (the registry takes the device id from the certificate and
    /// refuses a report naming another device).
    pub async fn report(&self, status: &DeviceStatus) -> Result<(), ClientError> {
        match self.call(&Request::Report(status.clone())).await? {
            Response::Ok => Ok(()),
            r => Err(response_error(r)),
        }
    }

    /// Up to `max_len` bytes of an artifact from `offset` (for byte-range resumers; unverified:
    /// check the whole against the trusted target).
    pub async fn read_range(&self, name: &str, version: ModelVersion, offset: u64, max_len: u32) -> Result<Vec<u8>, ClientError> {
        let req = Request::Range { name: name.to_owned(), version, offset, max_len };
        self.rpc
            .retry(self.max_retries, ClientError::is_transport, || async {
                let mut s = self.start(&req, false).await?;
                let r = self.read_range_body(&mut s).await;
                self.wire_bytes.fetch_add(s.bytes_read(), Ordering::Relaxed);
                r
            })
            .await
    }

    async fn read_range_body(&self, s: &mut FramedStream) -> Result<Vec<u8>, ClientError> {
        let len = match self.read_response(s).await? {
            Response::Range { len } => len as usize,
            r => return Err(response_error(r)),
        };
        let mut out = Vec::with_capacity(len.min(wire::MAX_RANGE_LEN as usize));
        loop {
            let f = s.expect().await?;
            match f.kind {
                FrameKind::Chunk if out.len() + f.body.len() <= len => out.extend_from_slice(&f.body),
                FrameKind::End if out.len() == len => return Ok(out),
                FrameKind::Message => {
                    return Err(response_error(wire::decode(&f.body).map_err(|e| ClientError::Protocol(e.to_string()))?));
                }
                k => {
                    return Err(ClientError::Protocol(format!("unexpected {k:?} frame in a range")));
                }
            }
        }
    }

    /// Downloads `name`/`version` into `dest`. See the module docs.
    pub async fn download<C: ChunkCache>(
        &self,
        name: &str,
        version: ModelVersion,
        cache: &mut C,
        dest: &Path,
    ) -> Result<DownloadReport, ClientError> {
        let m = self.manifest(name, version).await?;
        self.download_manifest(&m, cache, dest).await
    }

    /// Downloads a trusted TUF target: the manifest must agree with its length and digest.
    pub async fn download_target<C: ChunkCache>(
        &self,
        target: &ModelInfo,
        cache: &mut C,
        dest: &Path,
    ) -> Result<DownloadReport, ClientError> {
        let m = self.manifest(&target.name, target.version).await?;
        if m.model.length != target.length || m.model.digest != target.digest {
            return Err(ClientError::TargetMismatch {
                name: target.name.clone(),
                version: target.version,
                detail: format!(
                    "manifest says {} bytes {}, target says {} bytes {}",
                    m.model.length, m.model.digest, target.length, target.digest
                ),
            });
        }
        self.download_manifest(&m, cache, dest).await
    }

    /// Fetches what the cache lacks, then assembles `dest`; refetches chunks found corrupt.
    pub async fn download_manifest<C: ChunkCache>(&self, m: &Manifest, cache: &mut C, dest: &Path) -> Result<DownloadReport, ClientError> {
        let mut report = DownloadReport::default();
        for round in 0.. {
            self.fetch_missing(m, cache, &mut report).await?;
            let bad = assemble(m, cache, dest)?;
            if bad == 0 {
                return Ok(report);
            }
            report.corrupt_in_cache += bad;
            if round >= 3 {
                return Err(ClientError::GaveUp { attempts: round + 1, last: format!("{bad} cached chunk(s) corrupt again") });
            }
        }
        unreachable!()
    }

    /// Fetches every chunk of `m` that `cache` lacks, verifying each on arrival. Resumes across
    /// lost connections; gives up after `max_retries` consecutive attempts without progress.
    pub async fn fetch_missing<C: ChunkCache>(&self, m: &Manifest, cache: &mut C, report: &mut DownloadReport) -> Result<(), ClientError> {
        m.validate().map_err(ClientError::Protocol)?;
        let mut first = true;
        let mut failures = 0u32;
        loop {
            let mut seen = HashSet::new();
            let mut missing = Vec::new();
            for (i, c) in m.chunks.iter().enumerate() {
                if seen.insert(c.digest) && !cache.contains(&c.digest) {
                    missing.push(i as u32);
                }
            }
            if first {
                report.chunks_total = m.chunks.len() as u64;
                report.chunks_reused = (seen.len() - missing.len()) as u64;
                first = false;
            }
            if missing.is_empty() {
                return Ok(());
            }
            for batch in missing.chunks(BATCH) {
                let mut stored = 0u64;
                let res = self.fetch_batch(m, batch, cache, report, &mut stored).await;
                if stored > 0 {
                    failures = 0;
                }
                match res {
                    Ok(()) if stored > 0 => {}
                    Ok(()) => {
                        failures += 1;
                        if failures > self.max_retries {
                            return Err(ClientError::GaveUp { attempts: failures, last: "every chunk of a batch arrived corrupt".into() });
                        }
                    }
                    Err(e) if e.is_transport() => {
                        failures += 1;
                        report.reconnects += 1;
                        tracing::debug!(error = %e, failures, "chunk stream broke; reconnecting");
                        self.rpc.forget().await;
                        if failures > self.max_retries {
                            return Err(ClientError::GaveUp { attempts: failures, last: e.to_string() });
                        }
                        tokio::time::sleep(backoff(failures)).await;
                        break; // recompute what is missing
                    }
                    Err(e) => return Err(e),
                }
            }
        }
    }

    async fn fetch_batch<C: ChunkCache>(
        &self,
        m: &Manifest,
        batch: &[u32],
        cache: &mut C,
        report: &mut DownloadReport,
        stored: &mut u64,
    ) -> Result<(), ClientError> {
        let req = Request::Chunks { name: m.model.name.clone(), version: m.model.version, indices: batch.to_vec() };
        let mut s = self.start(&req, false).await?;
        let res = async {
            match self.read_response(&mut s).await? {
                Response::Chunks { count } if count as usize == batch.len() => {}
                Response::Chunks { count } => {
                    return Err(ClientError::Protocol(format!("asked for {} chunks, told {count}", batch.len())));
                }
                r => return Err(response_error(r)),
            }
            for &i in batch {
                let c = m.chunks[i as usize];
                let mut buf = Vec::with_capacity(c.len as usize);
                while buf.len() < c.len as usize {
                    let f = s.expect().await?;
                    match f.kind {
                        FrameKind::Chunk if buf.len() + f.body.len() <= c.len as usize => buf.extend_from_slice(&f.body),
                        FrameKind::Chunk => return Err(ClientError::Protocol(format!("chunk {i} overruns its length"))),
                        FrameKind::Message => {
                            return Err(response_error(wire::decode(&f.body).map_err(|e| ClientError::Protocol(e.to_string()))?));
                        }
                        k => return Err(ClientError::Protocol(format!("unexpected {k:?} frame"))),
                    }
                }
                if Digest::of(&buf) != c.digest {
                    report.corrupt_on_arrival += 1;
                    tracing::warn!(chunk = i, digest = %c.digest, "chunk arrived corrupt; will ask again");
                    continue;
                }
                cache.put(&c.digest, &buf).map_err(ClientError::Cache)?;
                *stored += 1;
                report.chunks_fetched += 1;
                report.bytes_fetched += buf.len() as u64;
            }
            match s.expect().await?.kind {
                FrameKind::End => Ok(()),
                k => Err(ClientError::Protocol(format!("expected End, got {k:?}"))),
            }
        }
        .await;
        report.wire_bytes += s.bytes_read();
        self.wire_bytes.fetch_add(s.bytes_read(), Ordering::Relaxed);
        res
    }

    /// Sends an operator command (needs an operator service certificate). Not retried.
    pub async fn admin(&self, req: AdminRequest) -> Result<AdminAnswer, ClientError> {
        let mut s = self.start(&Request::Admin(req), false).await?;
        admin_answer(self.read_response(&mut s).await?)
    }

    /// Publishes an artifact read from `r` (an `AdminRequest::Publish` carrying the metadata).
    pub async fn publish(&self, req: AdminRequest, r: impl std::io::Read) -> Result<AdminAnswer, ClientError> {
        if !matches!(req, AdminRequest::Publish(_)) {
            return Err(ClientError::Protocol("publish needs AdminRequest::Publish".into()));
        }
        let mut s = self.start(&Request::Admin(req), true).await?;
        let sent = match send_artifact(&mut s, r).await {
            Ok(sent) => sent,
            Err(read) => {
                // Without its `End`, the registry takes the artifact as broken off and publishes nothing.
                s.finish();
                return Err(read);
            }
        };
        // The registry may refuse and stop reading before the artifact is in (a service that is
        // not an operator, an artifact over the limit): its answer says why.
        admin_answer(response_of(s.finish_and_answer(sent).await?)?)
    }

    /// Closes the connection politely.
    pub async fn close(&self) {
        self.rpc.close().await;
    }
}

/// An artifact read from `r` as `Chunk` frames and an `End`: the error is reading `r`'s, the
/// result inside how the writing went (a write error may be the registry refusing it).
async fn send_artifact(s: &mut FramedStream, mut r: impl std::io::Read) -> Result<Result<(), NetError>, ClientError> {
    let mut buf = vec![0u8; wire::FRAME_DATA];
    loop {
        let n = r.read(&mut buf).map_err(|cause| ClientError::Io { path: PathBuf::from("<artifact>"), cause })?;
        if n == 0 {
            return Ok(s.send(FrameKind::End, &[]).await);
        }
        if let Err(e) = s.send(FrameKind::Chunk, &buf[..n]).await {
            return Ok(Err(e));
        }
    }
}

/// Writes the artifact of `m` from `cache` to `dest` (temp file + fsync + rename), re-hashing
/// every chunk and the whole. Returns how many cached chunks were missing or corrupt (they are
/// removed from the cache and `dest` is not written); 0 means `dest` now holds the artifact.
pub fn assemble<C: ChunkCache>(m: &Manifest, cache: &mut C, dest: &Path) -> Result<u64, ClientError> {
    let io = |cause| ClientError::Io { path: dest.to_owned(), cause };
    let tmp = dest.with_extension("partial");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&tmp).map_err(io)?);
    let mut whole = Hasher::new();
    let mut bad = HashSet::new();
    for c in &m.chunks {
        match cache.get(&c.digest).map_err(ClientError::Cache)? {
            Some(b) if b.len() == c.len as usize && Digest::of(&b) == c.digest => {
                whole.update(&b);
                f.write_all(&b).map_err(io)?;
            }
            _ => {
                if bad.insert(c.digest) {
                    tracing::warn!(digest = %c.digest, "cached chunk missing or corrupt; refetching");
                    cache.remove(&c.digest).map_err(ClientError::Cache)?;
                }
            }
        }
    }
    if !bad.is_empty() {
        drop(f);
        let _ = std::fs::remove_file(&tmp);
        return Ok(bad.len() as u64);
    }
    let file = f.into_inner().map_err(|e| io(e.into_error()))?;
    file.sync_all().map_err(io)?;
    drop(file);
    let got = whole.finalize();
    if got != m.model.digest {
        let _ = std::fs::remove_file(&tmp);
        return Err(ClientError::Protocol(format!("artifact reassembles to {got}, manifest says {}", m.model.digest)));
    }
    std::fs::rename(&tmp, dest).map_err(io)?;
    Ok(0)
}
