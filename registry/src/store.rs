//! The registry's store on sled: content-addressed chunks, artifacts, model versions and aliases.
//!
//! # Layout
//! One sled database, one tree per kind of record (all records are JSON so that the opaque model
//! `spec` round-trips; chunks are raw bytes):
//!
//! | tree        | key                                  | value                                  |
//! |-------------|--------------------------------------|----------------------------------------|
//! | `chunks`    | BLAKE3 digest of the chunk (32 B)    | the chunk's bytes                      |
//! | `artifacts` | BLAKE3 digest of the whole artifact  | [`Artifact`]: length, chunk size, list |
//! | `versions`  | `name \0 version(u64 BE)`            | [`ModelInfo`]                      |
//! | `heads`     | `name`                               | latest version (u64 BE)                |
//! | `aliases`   | `name \0 alias`                      | version (u64 BE)                       |
//! | `rollouts`  | rollout id                           | serialized [`crate::rollout::Rollout`] |
//! | `devices`   | device id                            | last status report (JSON, opaque here) |
//! | `meta`      | `format`, `seq`                      | [`FORMAT`]; commit sequence (u64 BE)   |
//!
//! Beside sled's files, the directory holds `COMMIT` ([`COMMIT_FILE`]): the last acknowledged
//! commit sequence, written by temp file + fsync + rename after every commit's flush.
//! # Publishing is atomic
//! [`Store::publish`] writes the chunks first (idempotent: a chunk is keyed by its digest, so a
//! retried or concurrent publish of the same bytes rewrites nothing), flushes, then writes the
//! artifact record, the version record and the model's head in **one sled transaction** and flushes
//! again. A crash before the transaction leaves only unreferenced chunks (invisible; reclaimed by
//! [`Store::gc`], reused by the next publish of the same bytes); a crash after the flush leaves the
//! whole version. There is no state in between.
//!
//! # Corruption
//! [`Store::open`] maps sled's corruption error to [`StoreError::Corrupt`]. That alone is not
//! enough: measured here, sled 0.34.7 recovers a damaged log by silently truncating it at the
//! damage, so a store with four published versions reopened with one. Therefore every commit
//! (publish, alias move or removal, rollout save) bumps a sequence number inside its sled
//! transaction, and after the flush the store records that number in the `COMMIT` file outside
//! sled. On open, a sled state older than the `COMMIT` file (or an empty database next to a
//! non-zero `COMMIT` file) is refused as [`StoreError::Corrupt`]: acknowledged data was lost. A
//! crash between the flush and the marker write leaves sled *ahead* of the marker, which is fine.
//! Then open checks referential integrity (every version's artifact and every artifact's chunks
//! are present, heads and aliases point at existing versions). A database that fails any check is
//! refused with a message that says what to do; the store never silently starts empty or older.
//! Every chunk read re-hashes the bytes.

use std::collections::{BTreeMap, HashSet};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use fedfleet_protocol::{DeviceId, Digest, Hasher, ModelVersion};
use serde::{Deserialize, Serialize};
use sled::Transactional;
use sled::transaction::{ConflictableTransactionError, TransactionError};

pub use fedfleet_protocol::artifact::{ChunkRef, Manifest};
pub use fedfleet_protocol::{ModelInfo, NewVersion};

/// Default chunk size: 1 MiB.
pub const DEFAULT_CHUNK_SIZE: u32 = 1 << 20;
/// Largest chunk size accepted by [`StoreConfig`].
pub const MAX_CHUNK_SIZE: u32 = 64 << 20;
/// Value of the `format` key in the `meta` tree.
pub const FORMAT: &str = "fedfleet-registry-store/1";
/// Name of the commit marker file in the store directory.
pub const COMMIT_FILE: &str = "COMMIT";
/// Longest model or alias name, in bytes.
pub const MAX_NAME_LEN: usize = 128;

/// Why the store refused an operation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    #[error(
        "registry database at {path} is corrupt ({detail}); refusing to start with an empty or \
         partial registry. Stop the service, move {path} aside, and restore it from a backup (or \
         re-publish the versions into a fresh directory)"
    )]
    Corrupt { path: PathBuf, detail: String },
    #[error(
        "registry database at {path} is inconsistent: {detail}. Restore it from a backup; \
         `fedfleet-registry check` shows the details"
    )]
    Inconsistent { path: PathBuf, detail: String },
    #[error("registry database at {path} was written as {found:?}, this build reads {FORMAT:?}")]
    WrongFormat { path: PathBuf, found: String },
    #[error("registry database at {path} is in use by another process (one process per database)")]
    Locked { path: PathBuf },
    #[error("sled: {0}")]
    Sled(sled::Error),
    #[error("reading the artifact: {0}")]
    Io(std::io::Error),
    #[error("invalid {what} name {name:?}: {reason}")]
    InvalidName { what: &'static str, name: String, reason: &'static str },
    #[error("chunk size {0} is outside 1..={MAX_CHUNK_SIZE}")]
    InvalidChunkSize(u32),
    #[error("metric {0:?} is not a finite number")]
    InvalidMetric(String),
    /// The version's record (spec, lineage, metrics) would not be read back as written.
    #[error("version record refused: {0}")]
    InvalidRecord(String),
    #[error("refusing to publish an empty artifact")]
    EmptyArtifact,
    #[error("unknown model version {name} v{version}")]
    UnknownVersion { name: String, version: ModelVersion },
    #[error("parent version {name} v{version} does not exist")]
    UnknownParent { name: String, version: ModelVersion },
    #[error("artifact {0} is not in the store")]
    UnknownArtifact(Digest),
    #[error("chunk {0} is not in the store")]
    MissingChunk(Digest),
    #[error("chunk {expected} is corrupt on disk: its bytes hash to {actual}")]
    CorruptChunk { expected: Digest, actual: Digest },
    #[error("artifact {expected} reassembles to {actual}")]
    CorruptArtifact { expected: Digest, actual: Digest },
    #[error("stored record under {key} does not decode: {detail}")]
    BadRecord { key: String, detail: String },
}

impl From<sled::Error> for StoreError {
    fn from(e: sled::Error) -> Self {
        StoreError::Sled(e)
    }
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// Store options.
#[derive(Debug, Clone, Copy)]
pub struct StoreConfig {
    /// Size of every chunk but the last of an artifact. Default 1 MiB.
    pub chunk_size: u32,
    /// Re-hash every chunk on open (slow for big stores). The referential check always runs.
    pub deep_check_on_open: bool,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self { chunk_size: DEFAULT_CHUNK_SIZE, deep_check_on_open: false }
    }
}

/// A stored blob: its digest (BLAKE3 of all bytes), length, and chunk list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Artifact {
    pub digest: Digest,
    pub length: u64,
    pub chunk_size: u32,
    pub chunks: Vec<ChunkRef>,
}

/// A write that is in sled but not yet durable; [`Store::sync`] makes it so.
#[must_use = "a write is durable only once Store::sync returns"]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unsynced(u64);

/// The manifest of a stored version.
fn manifest_of(model: ModelInfo, art: Artifact) -> Manifest {
    Manifest { model, chunk_size: art.chunk_size, chunks: art.chunks }
}

/// Counts from [`Store::check`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CheckReport {
    pub versions: u64,
    pub artifacts: u64,
    pub chunks: u64,
    /// Chunks no artifact references (left by an interrupted publish); see [`Store::gc`].
    pub orphan_chunks: u64,
}

/// The registry store. Cheap to share behind an `Arc`; all methods take `&self`.
pub struct Store {
    path: PathBuf,
    config: StoreConfig,
    db: sled::Db,
    pub(crate) chunks: sled::Tree,
    artifacts: sled::Tree,
    versions: sled::Tree,
    heads: sled::Tree,
    aliases: sled::Tree,
    rollouts: sled::Tree,
    /// `rollout id \0 device id` → that device's latest record in the rollout.
    rollout_devices: sled::Tree,
    devices: sled::Tree,
    meta: sled::Tree,
    /// Last sequence written to the `COMMIT` file.
    marker: Mutex<u64>,
    commit_marker: fedfleet_durable::CommitMarker,
    /// Held by publish and gc: gc must not collect the chunks of a publish in flight.
    write_lock: Mutex<()>,
    #[cfg(test)]
    pub(crate) fault: Option<fn(usize)>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("path", &self.path).field("config", &self.config).finish()
    }
}

fn map_open_err(path: &Path, e: sled::Error) -> StoreError {
    match e {
        sled::Error::Corruption { at, .. } => StoreError::Corrupt {
            path: path.to_owned(),
            detail: match at {
                Some(at) => format!("sled reports corruption at {at:?}"),
                None => "sled reports corruption".into(),
            },
        },
        sled::Error::ReportableBug(m) => {
            StoreError::Corrupt { path: path.to_owned(), detail: format!("sled failed while recovering: {m}") }
        }
        other => StoreError::Sled(other),
    }
}

fn open_sled(path: &Path) -> Result<sled::Db> {
    // sled's own bound: artifact chunks are read through this cache, and a smaller one is not
    // measured against a rollout of a model bigger than it.
    fedfleet_durable::open_sled(path, fedfleet_durable::SLED_DEFAULT_CACHE_BYTES).map_err(|e| {
        if fedfleet_durable::is_sled_lock_error(&e) { StoreError::Locked { path: path.to_owned() } } else { map_open_err(path, e) }
    })
}

pub(crate) fn validate_name(what: &'static str, name: &str) -> Result<()> {
    let bad = |reason| Err(StoreError::InvalidName { what, name: name.to_owned(), reason });
    if name.is_empty() {
        return bad("empty");
    }
    if name.len() > MAX_NAME_LEN {
        return bad("longer than 128 bytes");
    }
    if !name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-')) {
        return bad("only ASCII letters, digits, '.', '_' and '-' are allowed");
    }
    // Names become file and directory names on operators' and devices' disks (exports, slots,
    // spool files): `.`, `..`, hidden files and option-looking names are refused.
    if !name.as_bytes()[0].is_ascii_alphanumeric() {
        return bad("must start with an ASCII letter or digit");
    }
    Ok(())
}

fn version_key(name: &str, v: ModelVersion) -> Vec<u8> {
    let mut k = Vec::with_capacity(name.len() + 9);
    k.extend_from_slice(name.as_bytes());
    k.push(0);
    k.extend_from_slice(&v.0.to_be_bytes());
    k
}

fn alias_key(name: &str, alias: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(name.len() + alias.len() + 1);
    k.extend_from_slice(name.as_bytes());
    k.push(0);
    k.extend_from_slice(alias.as_bytes());
    k
}

fn prefix(name: &str) -> Vec<u8> {
    let mut k = name.as_bytes().to_vec();
    k.push(0);
    k
}

fn be_u64(key: &[u8], v: &[u8]) -> Result<u64> {
    let arr: [u8; 8] = v.try_into().map_err(|_| StoreError::BadRecord {
        key: String::from_utf8_lossy(key).into_owned(),
        detail: format!("expected 8 bytes, found {}", v.len()),
    })?;
    Ok(u64::from_be_bytes(arr))
}

fn decode<T: serde::de::DeserializeOwned>(key: &[u8], v: &[u8]) -> Result<T> {
    serde_json::from_slice(v).map_err(|e| StoreError::BadRecord {
        key: if key.len() == 32 { hex::encode(key) } else { String::from_utf8_lossy(key).into_owned() },
        detail: e.to_string(),
    })
}

/// Largest spec a version may carry, as JSON text, and its deepest nesting: bounds on what
/// every later read of the record (signing, manifests, devices) must parse.
pub const MAX_SPEC_BYTES: usize = 1 << 20;
pub const MAX_SPEC_DEPTH: usize = 32;

/// Refuses a record that would not read back as written (a NaN becomes `null`, deep nesting
/// passes the parser's recursion limit): once stored it would stop the registry signing.
fn check_record(meta: &NewVersion) -> Result<()> {
    fn depth(v: &serde_json::Value) -> usize {
        match v {
            serde_json::Value::Array(a) => 1 + a.iter().map(depth).max().unwrap_or(0),
            serde_json::Value::Object(o) => 1 + o.values().map(depth).max().unwrap_or(0),
            _ => 0,
        }
    }
    let spec_len = serde_json::to_vec(&meta.spec.0).map_or(usize::MAX, |b| b.len());
    if spec_len > MAX_SPEC_BYTES {
        return Err(StoreError::InvalidRecord(format!("the spec is {spec_len} bytes of JSON; the limit is {MAX_SPEC_BYTES}")));
    }
    let d = depth(&meta.spec.0);
    if d > MAX_SPEC_DEPTH {
        return Err(StoreError::InvalidRecord(format!("the spec nests {d} levels deep; the limit is {MAX_SPEC_DEPTH}")));
    }
    if let Some(a) = &meta.adapter
        && !(a.alpha.is_finite() && a.rank > 0)
    {
        return Err(StoreError::InvalidRecord(format!("adapter lineage: alpha {} and rank {} must be finite and > 0", a.alpha, a.rank)));
    }
    // NaN and infinities have no JSON form: the metrics and the lineage are checked above, and
    // a JSON spec cannot hold them. What is left is whether the record parses back.
    let probe = ModelInfo::published(meta.clone(), ModelVersion(1), 1, Digest::of(b""));
    serde_json::from_slice::<ModelInfo>(&encode(&probe))
        .map(|_| ())
        .map_err(|e| StoreError::InvalidRecord(format!("it would not read back: {e}")))
}

fn encode<T: Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).expect("registry records serialize")
}

fn bump_seq(m: &sled::transaction::TransactionalTree) -> std::result::Result<u64, ConflictableTransactionError<StoreError>> {
    let seq = match m.get("seq")? {
        Some(b) => be_u64(b"seq", &b).map_err(ConflictableTransactionError::Abort)?,
        None => 0,
    } + 1;
    m.insert("seq", &seq.to_be_bytes())?;
    Ok(seq)
}

fn tx_result<T>(r: std::result::Result<T, TransactionError<StoreError>>) -> Result<T> {
    match r {
        Ok(t) => Ok(t),
        Err(TransactionError::Abort(e)) => Err(e),
        Err(TransactionError::Storage(e)) => Err(e.into()),
    }
}

/// The `COMMIT` file (`fedfleet-registry-commit`, see [`fedfleet_durable::CommitMarker`]). Absent means 0.
fn marker(dir: &Path) -> fedfleet_durable::CommitMarker {
    fedfleet_durable::CommitMarker::new(dir, "fedfleet-registry-commit")
}

fn read_marker(dir: &Path) -> Result<u64> {
    marker(dir).read().map_err(|e| match e.kind() {
        std::io::ErrorKind::InvalidData => StoreError::Corrupt { path: dir.to_owned(), detail: e.to_string() },
        _ => StoreError::Io(e),
    })
}

fn read_full(r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

impl Store {
    /// Opens (or creates) the store at `path`. Fails with [`StoreError::Corrupt`] /
    /// [`StoreError::Inconsistent`] rather than starting empty over a damaged database.
    pub fn open(path: impl AsRef<Path>, config: StoreConfig) -> Result<Self> {
        let path = path.as_ref().to_owned();
        if config.chunk_size == 0 || config.chunk_size > MAX_CHUNK_SIZE {
            return Err(StoreError::InvalidChunkSize(config.chunk_size));
        }
        let existed = path.join("db").exists() || path.join("conf").exists();
        let marker = read_marker(&path)?;
        let db = open_sled(&path)?;
        let tree = |n: &str| db.open_tree(n).map_err(|e| map_open_err(&path, e));
        let meta = tree("meta")?;
        let mut store = Store {
            chunks: tree("chunks")?,
            artifacts: tree("artifacts")?,
            versions: tree("versions")?,
            heads: tree("heads")?,
            aliases: tree("aliases")?,
            rollouts: tree("rollouts")?,
            rollout_devices: tree("rollout_devices")?,
            devices: tree("devices")?,
            meta: meta.clone(),
            marker: Mutex::new(0),
            commit_marker: self::marker(&path),
            db,
            path,
            config,
            write_lock: Mutex::new(()),
            #[cfg(test)]
            fault: None,
        };
        match meta.get("format").map_err(|e| map_open_err(&store.path, e))? {
            Some(f) if f.as_ref() == FORMAT.as_bytes() => {}
            Some(f) => {
                return Err(StoreError::WrongFormat { path: store.path.clone(), found: String::from_utf8_lossy(&f).into_owned() });
            }
            None => {
                // A database that holds records but no format marker was not written by us, or
                // lost its metadata: refuse rather than guess.
                if (existed && !(store.versions.is_empty() && store.chunks.is_empty())) || marker > 0 {
                    return Err(StoreError::Corrupt { path: store.path.clone(), detail: "the format marker is missing".into() });
                }
                meta.insert("format", FORMAT)?;
                store.db.flush()?;
            }
        }
        let seq = store.seq()?;
        if seq < marker {
            return Err(StoreError::Corrupt {
                path: store.path.clone(),
                detail: format!(
                    "sled recovered commit {seq}, but commit {marker} was acknowledged \
                     ({COMMIT_FILE} file): acknowledged data was lost"
                ),
            });
        }
        *store.marker.get_mut().unwrap() = marker;
        store.check(config.deep_check_on_open).map_err(|e| match e {
            StoreError::Sled(e) => map_open_err(&store.path, e),
            StoreError::Inconsistent { .. } | StoreError::Corrupt { .. } => e,
            other => StoreError::Inconsistent { path: store.path.clone(), detail: other.to_string() },
        })?;
        Ok(store)
    }

    /// An append-only journal in this store's database (the console's audit trail).
    pub fn journal(&self, name: &str, keep: usize) -> Result<fedfleet_durable::Journal> {
        Ok(fedfleet_durable::Journal::open(&self.db, name, keep)?)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn config(&self) -> StoreConfig {
        self.config
    }

    /// Publishes `bytes` as the next version of `meta.name`. See [`Store::publish_reader`].
    pub fn publish(&self, meta: NewVersion, bytes: &[u8]) -> Result<Manifest> {
        self.publish_reader(meta, bytes)
    }

    /// Publishes the artifact read from `r` as the next version of `meta.name` (memory: one
    /// chunk). Idempotent: if the latest version has the same digest and parent, that version
    /// is returned and nothing new is published. Atomic: the version is visible after the returned `Ok`, and a crash at any point
    /// leaves either the whole version or nothing visible.
    pub fn publish_reader(&self, meta: NewVersion, mut r: impl Read) -> Result<Manifest> {
        validate_name("model", &meta.name)?;
        if let Some((k, _)) = meta.metrics.iter().find(|(_, v)| !v.is_finite()) {
            return Err(StoreError::InvalidMetric(k.clone()));
        }
        check_record(&meta)?;
        let _guard = self.write_lock.lock().unwrap_or_else(|p| p.into_inner());
        // Refused before a chunk is written (the commit checks again, under the transaction).
        if let Some(p) = meta.parent
            && self.versions.get(version_key(&meta.name, p))?.is_none()
        {
            return Err(StoreError::UnknownParent { name: meta.name.clone(), version: p });
        }

        // 1. chunks: content-addressed, idempotent.
        let cs = self.config.chunk_size;
        let mut buf = vec![0u8; cs as usize];
        let mut whole = Hasher::new();
        let mut length = 0u64;
        let mut chunks = Vec::new();
        loop {
            let n = read_full(&mut r, &mut buf).map_err(StoreError::Io)?;
            if n == 0 {
                break;
            }
            let data = &buf[..n];
            whole.update(data);
            length += n as u64;
            let digest = Digest::of(data);
            if !self.chunks.contains_key(digest.0)? {
                self.chunks.insert(digest.0, data)?;
            }
            chunks.push(ChunkRef { digest, len: n as u32 });
            #[cfg(test)]
            if let Some(f) = self.fault {
                f(chunks.len());
            }
            if n < buf.len() {
                break;
            }
        }
        if length == 0 {
            return Err(StoreError::EmptyArtifact);
        }
        let digest = whole.finalize();
        self.db.flush()?;
        #[cfg(test)]
        if let Some(f) = self.fault {
            f(usize::MAX);
        }

        // 2. artifact + version + head in one transaction.
        let artifact = Artifact { digest, length, chunk_size: cs, chunks };
        let art_bytes = encode(&artifact);
        let name = meta.name.clone();
        let res = (&self.artifacts, &self.versions, &self.heads, &self.meta).transaction(|(a, v, h, m)| {
            let head = match h.get(name.as_bytes())? {
                Some(b) => be_u64(name.as_bytes(), &b).map_err(ConflictableTransactionError::Abort)?,
                None => 0,
            };
            if let Some(p) = meta.parent
                && v.get(version_key(&name, p))?.is_none()
            {
                return Err(ConflictableTransactionError::Abort(StoreError::UnknownParent { name: name.clone(), version: p }));
            }
            // Idempotent on (parent, digest) against the head: a publisher that crashed
            // between publishing and recording the answer gets the same version back.
            if head > 0
                && let Some(b) = v.get(version_key(&name, ModelVersion(head)))?
            {
                let last: ModelInfo = decode(&version_key(&name, ModelVersion(head)), &b).map_err(ConflictableTransactionError::Abort)?;
                if last.digest == digest && last.parent == meta.parent {
                    return Ok((last, None));
                }
            }
            let version = ModelVersion(head + 1);
            let rec = ModelInfo::published(meta.clone(), version, length, digest);
            if a.get(digest.0)?.is_none() {
                a.insert(&digest.0, art_bytes.as_slice())?;
            }
            v.insert(version_key(&name, version), encode(&rec))?;
            h.insert(name.as_bytes(), &version.0.to_be_bytes())?;
            Ok((rec, Some(bump_seq(m)?)))
        });
        let (rec, seq) = tx_result(res)?;
        if let Some(seq) = seq {
            self.commit(seq)?;
        } else {
            tracing::info!(model = %rec.name, version = %rec.version, %digest, "publish repeated (same parent and digest): existing version");
            let art = self.artifact(&digest)?;
            return Ok(manifest_of(rec, art));
        }
        // An existing artifact with the same bytes but another chunk size stays as it was.
        let art = self.artifact(&digest)?;
        tracing::info!(model = %rec.name, version = %rec.version, %digest, length, "published");
        Ok(manifest_of(rec, art))
    }

    /// The stored artifact record for `digest`.
    pub fn artifact(&self, digest: &Digest) -> Result<Artifact> {
        match self.artifacts.get(digest.0)? {
            Some(b) => decode(&digest.0, &b),
            None => Err(StoreError::UnknownArtifact(*digest)),
        }
    }

    /// Every stored artifact's digest (in digest order).
    pub fn artifact_digests(&self) -> Result<Vec<Digest>> {
        self.artifacts
            .iter()
            .keys()
            .map(|k| {
                let k = k?;
                let d: [u8; 32] = k
                    .as_ref()
                    .try_into()
                    .map_err(|_| StoreError::BadRecord { key: hex::encode(&k), detail: "an artifact key is not 32 bytes".into() })?;
                Ok(Digest(d))
            })
            .collect()
    }

    /// The version record (no chunk list).
    pub fn version(&self, name: &str, version: ModelVersion) -> Result<ModelInfo> {
        let key = version_key(name, version);
        match self.versions.get(&key)? {
            Some(b) => decode(&key, &b),
            None => Err(StoreError::UnknownVersion { name: name.to_owned(), version }),
        }
    }

    /// The full manifest of a version: metadata plus chunk list.
    pub fn manifest(&self, name: &str, version: ModelVersion) -> Result<Manifest> {
        let rec = self.version(name, version)?;
        let art = self.artifact(&rec.digest)?;
        Ok(manifest_of(rec, art))
    }

    /// A chunk's bytes, re-hashed: a chunk whose bytes changed on disk is an error, never served.
    pub fn chunk(&self, digest: &Digest) -> Result<Vec<u8>> {
        let b = self.chunks.get(digest.0)?.ok_or(StoreError::MissingChunk(*digest))?;
        let actual = Digest::of(&b);
        if actual != *digest {
            return Err(StoreError::CorruptChunk { expected: *digest, actual });
        }
        Ok(b.to_vec())
    }

    /// Whether the store holds a chunk (no verification).
    pub fn has_chunk(&self, digest: &Digest) -> Result<bool> {
        Ok(self.chunks.contains_key(digest.0)?)
    }

    /// The chunks of `name`/`version` that a client holding `have` still needs, in artifact
    /// order, each once.
    pub fn missing_chunks(&self, name: &str, version: ModelVersion, have: &[Digest]) -> Result<Vec<ChunkRef>> {
        let m = self.manifest(name, version)?;
        let mut seen: HashSet<Digest> = have.iter().copied().collect();
        Ok(m.chunks.into_iter().filter(|c| seen.insert(c.digest)).collect())
    }

    /// Reassembles a whole artifact in memory, verifying every chunk and the total digest.
    pub fn read_artifact(&self, digest: &Digest) -> Result<Vec<u8>> {
        let art = self.artifact(digest)?;
        let mut out = Vec::with_capacity(art.length as usize);
        for c in &art.chunks {
            out.extend_from_slice(&self.chunk(&c.digest)?);
        }
        let actual = Digest::of(&out);
        if actual != *digest {
            return Err(StoreError::CorruptArtifact { expected: *digest, actual });
        }
        Ok(out)
    }

    /// Model names with at least one version, sorted.
    pub fn models(&self) -> Result<Vec<String>> {
        self.heads.iter().keys().map(|k| Ok(String::from_utf8_lossy(&k?).into_owned())).collect()
    }

    /// The latest version of `name`, if any.
    pub fn latest(&self, name: &str) -> Result<Option<ModelVersion>> {
        match self.heads.get(name.as_bytes())? {
            Some(b) => Ok(Some(ModelVersion(be_u64(name.as_bytes(), &b)?))),
            None => Ok(None),
        }
    }

    /// All versions of `name`, ascending.
    pub fn versions(&self, name: &str) -> Result<Vec<ModelVersion>> {
        let p = prefix(name);
        self.versions
            .scan_prefix(&p)
            .keys()
            .map(|k| {
                let k = k?;
                Ok(ModelVersion(be_u64(&k, &k[p.len()..])?))
            })
            .collect()
    }

    /// Points `alias` of model `name` at `version` (which must exist); returns the previous
    /// target. Flushed before returning.
    pub fn set_alias(&self, name: &str, alias: &str, version: ModelVersion) -> Result<Option<ModelVersion>> {
        validate_name("alias", alias)?;
        let vkey = version_key(name, version);
        let akey = alias_key(name, alias);
        let res = (&self.versions, &self.aliases, &self.meta).transaction(|(v, a, m)| {
            if v.get(&vkey)?.is_none() {
                return Err(ConflictableTransactionError::Abort(StoreError::UnknownVersion { name: name.to_owned(), version }));
            }
            let prev = a.insert(akey.as_slice(), &version.0.to_be_bytes())?;
            let prev = match prev {
                Some(b) => Some(ModelVersion(be_u64(&akey, &b).map_err(ConflictableTransactionError::Abort)?)),
                None => None,
            };
            Ok((prev, bump_seq(m)?))
        });
        let (prev, seq) = tx_result(res)?;
        self.commit(seq)?;
        tracing::info!(model = name, alias, %version, "alias moved");
        Ok(prev)
    }

    /// Removes an alias; returns its last target.
    pub fn remove_alias(&self, name: &str, alias: &str) -> Result<Option<ModelVersion>> {
        let akey = alias_key(name, alias);
        let res = (&self.aliases, &self.meta).transaction(|(a, m)| Ok((a.remove(akey.as_slice())?, bump_seq(m)?)));
        let (prev, seq) = tx_result(res)?;
        self.commit(seq)?;
        prev.map(|b| Ok(ModelVersion(be_u64(&akey, &b)?))).transpose()
    }

    /// Where `alias` of `name` points.
    pub fn alias(&self, name: &str, alias: &str) -> Result<Option<ModelVersion>> {
        let akey = alias_key(name, alias);
        self.aliases.get(&akey)?.map(|b| Ok(ModelVersion(be_u64(&akey, &b)?))).transpose()
    }

    /// All aliases of `name`.
    pub fn aliases(&self, name: &str) -> Result<BTreeMap<String, ModelVersion>> {
        let p = prefix(name);
        self.aliases
            .scan_prefix(&p)
            .map(|kv| {
                let (k, v) = kv?;
                Ok((String::from_utf8_lossy(&k[p.len()..]).into_owned(), ModelVersion(be_u64(&k, &v)?)))
            })
            .collect()
    }

    /// Persists a rollout's state (the shell calls this after each state change). Flushed.
    pub fn put_rollout(&self, rollout: &crate::rollout::Rollout) -> Result<()> {
        let written = self.write_rollout(rollout, None)?;
        self.sync(written)
    }

    /// Writes a rollout's state and the record `device` just changed in it, together: one
    /// record per report, however many devices the rollout has heard from. **Not yet durable**:
    /// the caller answers the report only after [`Store::sync`], which it calls once it has let
    /// go of its locks, so that other devices' reports and polls do not wait for this flush.
    pub fn write_rollout_report(&self, rollout: &crate::rollout::Rollout, device: &DeviceId) -> Result<Unsynced> {
        self.write_rollout(rollout, Some(device))
    }

    /// Makes a write durable (and every write before it): flush, then the commit marker. A
    /// write that an earlier sync already covered costs a flush with nothing left to write.
    pub fn sync(&self, written: Unsynced) -> Result<()> {
        self.commit(written.0)
    }

    fn write_rollout(&self, rollout: &crate::rollout::Rollout, device: Option<&DeviceId>) -> Result<Unsynced> {
        let bytes = encode(rollout);
        let record = device.and_then(|d| {
            let key = [prefix(rollout.id()), d.as_str().as_bytes().to_vec()].concat();
            rollout.devices().get(d).map(|rec| (key, encode(rec)))
        });
        let res = (&self.rollouts, &self.rollout_devices, &self.meta).transaction(|(r, d, m)| {
            r.insert(rollout.id().as_bytes(), bytes.as_slice())?;
            if let Some((key, value)) = &record {
                d.insert(key.as_slice(), value.as_slice())?;
            }
            bump_seq(m)
        });
        tx_result(res).map(Unsynced)
    }

    /// A persisted rollout.
    pub fn rollout(&self, id: &str) -> Result<Option<crate::rollout::Rollout>> {
        self.rollouts.get(id.as_bytes())?.map(|b| self.with_records(id.as_bytes(), &b)).transpose()
    }

    /// All persisted rollouts, by id.
    pub fn rollouts(&self) -> Result<Vec<crate::rollout::Rollout>> {
        self.rollouts
            .iter()
            .map(|kv| {
                let (k, v) = kv?;
                self.with_records(&k, &v)
            })
            .collect()
    }

    fn with_records(&self, id: &[u8], bytes: &[u8]) -> Result<crate::rollout::Rollout> {
        let rollout: crate::rollout::Rollout = decode(id, bytes)?;
        let p = [id, &[0]].concat();
        let mut records = Vec::new();
        for kv in self.rollout_devices.scan_prefix(&p) {
            let (k, v) = kv?;
            let device = DeviceId::new(String::from_utf8_lossy(&k[p.len()..]).into_owned())
                .map_err(|e| StoreError::BadRecord { key: String::from_utf8_lossy(&k).into_owned(), detail: e.to_string() })?;
            records.push((device, decode(&k, &v)?));
        }
        Ok(rollout.with_records(records))
    }

    /// Records a device's latest status report (JSON bytes chosen by the caller). Not a commit
    /// point: reports are frequent and re-sent, so this is not flushed (sled flushes within
    /// ~500 ms) and does not bump the commit sequence.
    pub fn put_device_status(&self, device: &str, record: &[u8]) -> Result<()> {
        self.devices.insert(device.as_bytes(), record)?;
        Ok(())
    }

    /// A device's latest status record, as stored by [`Store::put_device_status`].
    pub fn device_status(&self, device: &str) -> Result<Option<Vec<u8>>> {
        Ok(self.devices.get(device.as_bytes())?.map(|v| v.to_vec()))
    }

    /// Every device's latest status record, by device id.
    pub fn device_statuses(&self) -> Result<Vec<(String, Vec<u8>)>> {
        self.devices
            .iter()
            .map(|kv| {
                let (k, v) = kv?;
                Ok((String::from_utf8_lossy(&k).into_owned(), v.to_vec()))
            })
            .collect()
    }

    /// Checks referential integrity; with `deep`, also re-hashes every chunk. Returns counts.
    pub fn check(&self, deep: bool) -> Result<CheckReport> {
        let bad = |detail: String| StoreError::Inconsistent { path: self.path.clone(), detail };
        let mut rep = CheckReport::default();
        let mut heads: BTreeMap<String, u64> = BTreeMap::new();
        for kv in self.versions.iter() {
            let (k, v) = kv?;
            let rec: ModelInfo = decode(&k, &v).map_err(|e| bad(e.to_string()))?;
            if k.as_ref() != version_key(&rec.name, rec.version).as_slice() {
                return Err(bad(format!("version record {} v{} under a wrong key", rec.name, rec.version)));
            }
            if !self.artifacts.contains_key(rec.digest.0)? {
                return Err(bad(format!("{} v{} refers to artifact {} which is missing", rec.name, rec.version, rec.digest)));
            }
            let h = heads.entry(rec.name.clone()).or_default();
            *h = (*h).max(rec.version.0);
            rep.versions += 1;
        }
        for kv in self.heads.iter() {
            let (k, v) = kv?;
            let name = String::from_utf8_lossy(&k).into_owned();
            let head = be_u64(&k, &v).map_err(|e| bad(e.to_string()))?;
            if heads.remove(&name) != Some(head) {
                return Err(bad(format!("head of {name} says v{head}, which is not its latest version")));
            }
        }
        if let Some((name, _)) = heads.into_iter().next() {
            return Err(bad(format!("model {name} has versions but no head")));
        }
        let mut referenced = HashSet::new();
        for kv in self.artifacts.iter() {
            let (k, v) = kv?;
            let art: Artifact = decode(&k, &v).map_err(|e| bad(e.to_string()))?;
            let mut total = 0u64;
            for c in &art.chunks {
                if referenced.insert(c.digest) && !self.chunks.contains_key(c.digest.0)? {
                    return Err(bad(format!("artifact {} lacks chunk {}", art.digest, c.digest)));
                }
                total += c.len as u64;
            }
            if total != art.length || k.as_ref() != art.digest.0 {
                return Err(bad(format!("artifact {} record does not add up", art.digest)));
            }
            rep.artifacts += 1;
        }
        for kv in self.aliases.iter() {
            let (k, v) = kv?;
            let Some(sep) = k.iter().position(|&b| b == 0) else {
                return Err(bad("alias key without separator".into()));
            };
            let name = String::from_utf8_lossy(&k[..sep]).into_owned();
            let version = ModelVersion(be_u64(&k, &v).map_err(|e| bad(e.to_string()))?);
            if !self.versions.contains_key(version_key(&name, version))? {
                return Err(bad(format!("alias {} of {name} points at missing v{version}", String::from_utf8_lossy(&k[sep + 1..]))));
            }
        }
        for kv in self.chunks.iter() {
            let (k, v) = kv?;
            rep.chunks += 1;
            let d = Digest(k.as_ref().try_into().map_err(|_| bad("chunk key is not 32 bytes".into()))?);
            if !referenced.contains(&d) {
                rep.orphan_chunks += 1;
            }
            if deep {
                let actual = Digest::of(&v);
                if actual != d {
                    return Err(StoreError::Corrupt { path: self.path.clone(), detail: format!("chunk {d} hashes to {actual}") });
                }
            }
        }
        Ok(rep)
    }

    /// Deletes chunks that no artifact references (left by interrupted publishes). Returns how
    /// many were removed. Waits for a publish in flight.
    pub fn gc(&self) -> Result<u64> {
        let _guard = self.write_lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut referenced = HashSet::new();
        for v in self.artifacts.iter().values() {
            let v = v?;
            let art: Artifact = decode(b"artifact", &v)?;
            referenced.extend(art.chunks.iter().map(|c| c.digest));
        }
        let mut removed = 0;
        for k in self.chunks.iter().keys() {
            let k = k?;
            if k.len() != 32 || !referenced.contains(&Digest(k.as_ref().try_into().unwrap())) {
                self.chunks.remove(&k)?;
                removed += 1;
            }
        }
        self.db.flush()?;
        Ok(removed)
    }

    /// The commit sequence: bumped by every publish, alias change and rollout save.
    pub fn seq(&self) -> Result<u64> {
        match self.meta.get("seq")? {
            Some(b) => be_u64(b"seq", &b),
            None => Ok(0),
        }
    }

    /// Makes commit `seq` durable: flush sled, then record `seq` in the `COMMIT` file.
    fn commit(&self, seq: u64) -> Result<()> {
        self.db.flush()?;
        let mut last = self.marker.lock().unwrap_or_else(|p| p.into_inner());
        if seq > *last {
            self.commit_marker.write(seq).map_err(StoreError::Io)?;
            *last = seq;
        }
        Ok(())
    }

    /// Flushes everything to disk.
    pub fn flush(&self) -> Result<()> {
        self.db.flush()?;
        Ok(())
    }
}
