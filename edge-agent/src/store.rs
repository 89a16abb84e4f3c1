//! The agent's durable state: one sled database with a `state` tree (the lifecycle's
//! [`PersistedState`](crate::lifecycle::PersistedState), JSON) and an `outbox` tree (signed updates
//! not yet acknowledged, binary records), plus content-addressed model blobs as files (`blobs/<digest>`), written
//! temp file + fsync + rename. Every write that is a commit point is flushed before it returns.
//! A round's base model keeps its spec beside it (`blobs/<digest>.spec.json`); the store keeps
//! what its caller names ([`AgentStore::retain_blobs`]), so a device that takes part in round
//! after round holds one base model, not every one it trained on.
//!
//! A full disk: `reserve` holds [`STORE_RESERVE_BYTES`] the store gets back when the filesystem
//! runs low (before a commit, or when sled cannot open for want of space), and takes again once
//! there is room. Downloads leave [`DOWNLOAD_HEADROOM_BYTES`] free besides.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use fedfleet_durable::SpaceReserve;

use fedfleet_protocol::Digest;

/// The database's page cache on a device. sled's default (1 GiB) keeps what is written to it,
/// and the outbox holds signed updates the size of the model.
const SLED_CACHE_BYTES: u64 = 16 << 20;

/// Why the store refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    #[error(
        "agent store at {path} cannot be opened ({detail}); if it is damaged, move it aside and \
         re-enroll: unacknowledged updates in its outbox would be lost"
    )]
    Open { path: PathBuf, detail: String },
    #[error("agent store: {0}")]
    Sled(sled::Error),
    #[error("agent store record {key} does not decode: {detail} (the store may be damaged)")]
    Corrupt { key: String, detail: String },
    #[error("blob {digest} on disk does not match its digest (damaged); it will be fetched again")]
    BlobCorrupt { digest: Digest },
    #[error("agent store I/O on {path}: {cause}")]
    Io { path: PathBuf, cause: std::io::Error },
}

// Printed in the message, so not also a `source`: a report of the chain would say it twice.
impl From<sled::Error> for StoreError {
    fn from(e: sled::Error) -> Self {
        StoreError::Sled(e)
    }
}

impl StoreError {
    fn io(path: &Path, cause: std::io::Error) -> Self {
        StoreError::Io { path: path.to_owned(), cause }
    }
}

pub use fedfleet_agent_core::{OutboxEntry, Persist, Saved};

/// Room the store can get back on a full disk: two of sled's 512 KiB segments (opening needs a
/// free one; the other is for the commits that follow).
pub const STORE_RESERVE_BYTES: u64 = 1 << 20;
/// What a download leaves free beside the reserve: the store's own growth (state, outbox).
pub const DOWNLOAD_HEADROOM_BYTES: u64 = 1 << 20;

const STATE_KEY: &[u8] = b"state";
const LOCAL_STATE_KEY: &[u8] = b"local_state";

/// Durable store of one agent. One process per store (sled locks the directory).
pub struct AgentStore {
    dir: PathBuf,
    records: Records,
    reserve: Arc<SpaceReserve>,
}

/// Where the lifecycle's records (state, outbox) live.
enum Records {
    /// A device's: one sled database, flushed at every commit point.
    Sled { db: sled::Db, state: sled::Tree, outbox: sled::Tree },
    /// A simulated device's ([`AgentStore::in_memory`]): nothing outlives the process and no
    /// file stays open, so that one process can simulate ten thousand devices.
    Memory(Mutex<MemoryRecords>),
}

#[derive(Default)]
struct MemoryRecords {
    state: BTreeMap<&'static [u8], Vec<u8>>,
    outbox: BTreeMap<u64, Vec<u8>>,
    /// Model blobs by digest, and the specs of those that are round bases.
    blobs: BTreeMap<Digest, Vec<u8>>,
    specs: BTreeMap<Digest, String>,
}

impl MemoryRecords {
    fn lock(m: &Mutex<MemoryRecords>) -> std::sync::MutexGuard<'_, MemoryRecords> {
        m.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl AgentStore {
    /// Opens (creating if needed) the store in `dir`.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self, StoreError> {
        let dir = dir.as_ref().to_owned();
        fs::create_dir_all(dir.join("blobs")).map_err(|e| StoreError::io(&dir, e))?;
        fs::create_dir_all(dir.join("partial")).map_err(|e| StoreError::io(&dir, e))?;
        let db_path = dir.join("db");
        let reserve = Arc::new(SpaceReserve::new(dir.join("reserve"), STORE_RESERVE_BYTES));
        let db = match fedfleet_durable::open_sled(&db_path, SLED_CACHE_BYTES) {
            Err(e) if fedfleet_durable::is_sled_out_of_space(&e) && reserve.release() => {
                tracing::warn!(dir = %dir.display(), "disk full: released the store's space reserve to open it");
                fedfleet_durable::open_sled(&db_path, SLED_CACHE_BYTES)
            }
            other => other,
        }
        .map_err(|e| StoreError::Open { path: db_path.clone(), detail: e.to_string() })?;
        let state = db.open_tree("state")?;
        let outbox = db.open_tree("outbox")?;
        let store = AgentStore { dir, records: Records::Sled { db, state, outbox }, reserve };
        store.restore_reserve();
        Ok(store)
    }

    /// A store for a simulated device: state, outbox and model blobs in memory (lost with the
    /// process, and no file held open or created but a resumable download's partial file), no
    /// space reserve. Not for a real device: an update in its outbox would not survive a restart.
    /// `dir` is not created until a download needs it: a sampled fleet opens a store for every
    /// device a round selects, and a directory made and removed each time cost 12 % of its CPU.
    pub fn in_memory(dir: impl AsRef<Path>) -> Result<Self, StoreError> {
        let dir = dir.as_ref().to_owned();
        let reserve = Arc::new(SpaceReserve::new(dir.join("reserve"), 0));
        Ok(AgentStore { dir, records: Records::Memory(Mutex::default()), reserve })
    }

    fn get_state(&self, key: &'static [u8]) -> Result<Option<Vec<u8>>, StoreError> {
        match &self.records {
            Records::Sled { state, .. } => Ok(state.get(key)?.map(|v| v.to_vec())),
            Records::Memory(m) => Ok(MemoryRecords::lock(m).state.get(key).cloned()),
        }
    }

    /// Writes a state record and flushes.
    fn put_state(&self, key: &'static [u8], bytes: &[u8]) -> Result<(), StoreError> {
        match &self.records {
            Records::Sled { db, state, .. } => {
                self.make_room();
                state.insert(key, bytes)?;
                db.flush()?;
            }
            Records::Memory(m) => {
                MemoryRecords::lock(m).state.insert(key, bytes.to_vec());
            }
        }
        Ok(())
    }

    /// Takes the space reserve again if it was released and the disk has room for it.
    pub fn restore_reserve(&self) {
        match self.reserve.take(DOWNLOAD_HEADROOM_BYTES) {
            Ok(true) => {}
            Ok(false) => tracing::debug!("disk nearly full: the store's space reserve stays released"),
            Err(e) => tracing::warn!(error = %e, "cannot write the store's space reserve"),
        }
    }

    /// The reserve, for writers of other trees of this database (the inbox).
    pub fn reserve(&self) -> Arc<SpaceReserve> {
        self.reserve.clone()
    }

    /// Before a commit: on a nearly full disk, gives the reserve back so the commit fits (a
    /// failed sled write would leave the database unusable until it is reopened).
    pub fn make_room(&self) {
        make_room(&self.reserve);
    }

    /// The tensors this device keeps out of its updates (FedBN's local batch norms). Bytes that
    /// no longer decode are ignored with a warning: the model's own tensors serve instead.
    pub fn local_state(&self) -> Result<Option<fedfleet_protocol::TensorBundle>, StoreError> {
        let Some(bytes) = self.get_state(LOCAL_STATE_KEY)? else { return Ok(None) };
        match fedfleet_protocol::TensorBundle::decode(&bytes, &fedfleet_protocol::BundleLimits::default()) {
            Ok(b) => Ok(Some(b)),
            Err(e) => {
                tracing::warn!(error = %e, "stored local tensors do not decode; using the model's own");
                Ok(None)
            }
        }
    }

    /// Replaces the local tensors and flushes.
    pub fn put_local_state(&self, bytes: &[u8]) -> Result<(), StoreError> {
        self.put_state(LOCAL_STATE_KEY, bytes)
    }

    /// Another tree of the same database (e.g. the inbox's), flushed by its owner. An in-memory
    /// store has none.
    pub fn tree(&self, name: &str) -> Result<sled::Tree, StoreError> {
        match &self.records {
            Records::Sled { db, .. } => Ok(db.open_tree(name)?),
            Records::Memory(_) => {
                Err(StoreError::Open { path: self.dir.clone(), detail: format!("an in-memory store has no {name} tree") })
            }
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The raw persisted state (JSON), if any.
    pub fn load_state_raw(&self) -> Result<Option<Vec<u8>>, StoreError> {
        self.get_state(STATE_KEY)
    }

    /// Writes the state and flushes (a commit point).
    pub fn save_state_raw(&self, bytes: &[u8]) -> Result<(), StoreError> {
        self.put_state(STATE_KEY, bytes)
    }

    /// What the lifecycle core needs to open: the saved state and the outbox.
    pub fn saved(&self) -> Result<Saved, StoreError> {
        Ok(Saved { state: self.load_state_raw()?, outbox: self.outbox()? })
    }

    /// Makes one of the core's writes durable (each write flushes).
    pub fn apply(&self, write: &Persist) -> Result<(), StoreError> {
        match write {
            Persist::State(bytes) => self.save_state_raw(bytes),
            Persist::PutOutbox(entry) => self.put_outbox(entry),
            Persist::RemoveOutbox(id) => self.remove_outbox(*id),
        }
    }

    /// Adds an entry and flushes.
    pub fn put_outbox(&self, e: &OutboxEntry) -> Result<(), StoreError> {
        let bytes = encode_entry(e);
        match &self.records {
            Records::Sled { db, outbox, .. } => {
                self.make_room();
                outbox.insert(e.id.to_be_bytes(), bytes)?;
                db.flush()?;
            }
            Records::Memory(m) => {
                MemoryRecords::lock(m).outbox.insert(e.id, bytes);
            }
        }
        Ok(())
    }

    /// Removes an entry and flushes.
    pub fn remove_outbox(&self, id: u64) -> Result<(), StoreError> {
        match &self.records {
            Records::Sled { db, outbox, .. } => {
                self.make_room();
                outbox.remove(id.to_be_bytes())?;
                db.flush()?;
            }
            Records::Memory(m) => {
                MemoryRecords::lock(m).outbox.remove(&id);
            }
        }
        Ok(())
    }

    pub fn outbox_entry(&self, id: u64) -> Result<Option<OutboxEntry>, StoreError> {
        let bytes = match &self.records {
            Records::Sled { outbox, .. } => outbox.get(id.to_be_bytes())?.map(|v| v.to_vec()),
            Records::Memory(m) => MemoryRecords::lock(m).outbox.get(&id).cloned(),
        };
        bytes.map(|v| decode_entry(id, &v)).transpose()
    }

    /// Every pending entry, oldest first.
    pub fn outbox(&self) -> Result<Vec<OutboxEntry>, StoreError> {
        let mut out = Vec::new();
        match &self.records {
            Records::Sled { outbox, .. } => {
                for kv in outbox.iter() {
                    let (k, v) = kv?;
                    let id = <[u8; 8]>::try_from(k.as_ref()).map(u64::from_be_bytes).unwrap_or(0);
                    out.push(decode_entry(id, &v)?);
                }
            }
            Records::Memory(m) => {
                for (id, v) in &MemoryRecords::lock(m).outbox {
                    out.push(decode_entry(*id, v)?);
                }
            }
        }
        Ok(out)
    }

    pub fn blob_path(&self, digest: &Digest) -> PathBuf {
        self.dir.join("blobs").join(digest.to_hex())
    }

    /// Where a resumable download of `digest` accumulates.
    pub fn partial_path(&self, digest: &Digest) -> PathBuf {
        self.dir.join("partial").join(format!("{}.part", digest.to_hex()))
    }

    /// Where a round base's spec is kept, beside its blob.
    fn spec_path(&self, digest: &Digest) -> PathBuf {
        self.dir.join("blobs").join(format!("{}.spec.json", digest.to_hex()))
    }

    fn memory(&self) -> Option<std::sync::MutexGuard<'_, MemoryRecords>> {
        match &self.records {
            Records::Memory(m) => Some(MemoryRecords::lock(m)),
            Records::Sled { .. } => None,
        }
    }

    pub fn has_blob(&self, digest: &Digest) -> bool {
        match self.memory() {
            Some(m) => m.blobs.contains_key(digest),
            None => self.blob_path(digest).is_file(),
        }
    }

    /// Stores a blob under its digest: temp file, fsync, rename, fsync of the directory.
    pub fn put_blob(&self, bytes: &[u8]) -> Result<Digest, StoreError> {
        let digest = Digest::of(bytes);
        if let Some(mut m) = self.memory() {
            m.blobs.entry(digest).or_insert_with(|| bytes.to_vec());
            return Ok(digest);
        }
        let path = self.blob_path(&digest);
        if path.is_file() {
            return Ok(digest);
        }
        write_atomic(&path, bytes)?;
        Ok(digest)
    }

    /// Moves a completed partial download into the blob store (after its digest was checked).
    pub fn promote_partial(&self, digest: &Digest) -> Result<(), StoreError> {
        let from = self.partial_path(digest);
        if let Some(mut m) = self.memory() {
            let bytes = fs::read(&from).map_err(|e| StoreError::io(&from, e))?;
            m.blobs.insert(*digest, bytes);
            return fs::remove_file(&from).map_err(|e| StoreError::io(&from, e));
        }
        let to = self.blob_path(digest);
        fs::rename(&from, &to).map_err(|e| StoreError::io(&from, e))?;
        fedfleet_durable::sync_parent(&to).map_err(|e| StoreError::io(&to, e))
    }

    /// Reads a blob and checks its digest.
    pub fn get_blob(&self, digest: &Digest) -> Result<Option<Vec<u8>>, StoreError> {
        if let Some(m) = self.memory() {
            return Ok(m.blobs.get(digest).cloned());
        }
        let path = self.blob_path(digest);
        match fs::read(&path) {
            Ok(b) if Digest::of(&b) == *digest => Ok(Some(b)),
            Ok(_) => {
                let _ = fs::remove_file(&path);
                Err(StoreError::BlobCorrupt { digest: *digest })
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(StoreError::io(&path, e)),
        }
    }

    /// Keeps the spec of the round base `digest` (its blob is [`Self::put_blob`]'s).
    pub fn put_spec(&self, digest: &Digest, spec: &str) -> Result<(), StoreError> {
        if let Some(mut m) = self.memory() {
            m.specs.insert(*digest, spec.to_owned());
            return Ok(());
        }
        write_atomic(&self.spec_path(digest), spec.as_bytes())
    }

    /// The spec kept for the round base `digest`, if any.
    pub fn spec(&self, digest: &Digest) -> Option<String> {
        match self.memory() {
            Some(m) => m.specs.get(digest).cloned(),
            None => fs::read_to_string(self.spec_path(digest)).ok(),
        }
    }

    /// Removes a blob, its spec and any partial download of it.
    pub fn remove_blob(&self, digest: &Digest) {
        if let Some(mut m) = self.memory() {
            m.blobs.remove(digest);
            m.specs.remove(digest);
        } else {
            let _ = fs::remove_file(self.blob_path(digest));
            let _ = fs::remove_file(self.spec_path(digest));
        }
        let _ = fs::remove_file(self.partial_path(digest));
    }

    /// Removes every blob (and spec) not in `keep`; what is not named a blob or a spec (a
    /// partial download, another file) stays. The caller names all the models its state refers
    /// to: a blob no state names is a round base of a past round, or a model that rotated out.
    pub fn retain_blobs(&self, keep: &[Digest]) -> Result<(), StoreError> {
        if let Some(mut m) = self.memory() {
            m.blobs.retain(|d, _| keep.contains(d));
            m.specs.retain(|d, _| keep.contains(d));
            return Ok(());
        }
        let dir = self.dir.join("blobs");
        for entry in fs::read_dir(&dir).map_err(|e| StoreError::io(&dir, e))? {
            let name = entry.map_err(|e| StoreError::io(&dir, e))?.file_name();
            let Some(name) = name.to_str() else { continue };
            let Ok(digest) = name.strip_suffix(".spec.json").unwrap_or(name).parse::<Digest>() else { continue };
            if !keep.contains(&digest) {
                let _ = fs::remove_file(dir.join(name));
            }
        }
        Ok(())
    }
}

/// Releases `reserve` when less than [`DOWNLOAD_HEADROOM_BYTES`] is free.
pub fn make_room(reserve: &SpaceReserve) {
    if reserve.release_if_below(DOWNLOAD_HEADROOM_BYTES) {
        tracing::warn!(reserve = %reserve.path().display(), "disk nearly full: released the store's space reserve");
    }
}

/// The first byte of an outbox record in binary. Records written before it are JSON with the
/// bytes in hex (they begin with `{`) and still read: hex and JSON escaping of every update cost
/// a device more CPU than signing it, and twice its bytes on disk.
const OUTBOX_RECORD_V2: u8 = 2;
/// Version, id, round, nonce, payload digest, creation time, header length.
const OUTBOX_FIXED_LEN: usize = 1 + 8 + 8 + 16 + 32 + 8 + 4;

/// An outbox record: the fixed fields (little-endian), then the signed header, then the payload.
fn encode_entry(e: &OutboxEntry) -> Vec<u8> {
    let mut v = Vec::with_capacity(OUTBOX_FIXED_LEN + e.header.len() + e.payload.len());
    v.push(OUTBOX_RECORD_V2);
    v.extend_from_slice(&e.id.to_le_bytes());
    v.extend_from_slice(&e.round.0.to_le_bytes());
    v.extend_from_slice(&e.nonce);
    v.extend_from_slice(&e.payload_digest.0);
    v.extend_from_slice(&e.created_at_ms.to_le_bytes());
    v.extend_from_slice(&u32::try_from(e.header.len()).expect("a signed header is far below 4 GiB").to_le_bytes());
    v.extend_from_slice(&e.header);
    v.extend_from_slice(&e.payload);
    v
}

fn decode_entry(id: u64, v: &[u8]) -> Result<OutboxEntry, StoreError> {
    let corrupt = |detail: String| StoreError::Corrupt { key: format!("outbox/{id}"), detail };
    if v.first() != Some(&OUTBOX_RECORD_V2) {
        return serde_json::from_slice(v).map_err(|e| corrupt(e.to_string()));
    }
    let Some((fixed, rest)) = v.split_first_chunk::<OUTBOX_FIXED_LEN>() else {
        return Err(corrupt(format!("a binary record of {} bytes, shorter than its {OUTBOX_FIXED_LEN} fixed ones", v.len())));
    };
    let mut at = 1;
    let mut take = |n: usize| {
        at += n;
        &fixed[at - n..at]
    };
    let u64_at = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
    let entry_id = u64_at(take(8));
    let round = fedfleet_protocol::RoundId(u64_at(take(8)));
    let nonce: [u8; 16] = take(16).try_into().expect("16 bytes");
    let payload_digest = Digest(take(32).try_into().expect("32 bytes"));
    let created_at_ms = u64_at(take(8));
    let header_len = u32::from_le_bytes(take(4).try_into().expect("4 bytes")) as usize;
    if entry_id != id {
        return Err(corrupt(format!("the record names entry {entry_id}")));
    }
    if header_len > rest.len() {
        return Err(corrupt(format!("a header of {header_len} bytes in the {} left", rest.len())));
    }
    let (header, payload) = rest.split_at(header_len);
    Ok(OutboxEntry { id, round, nonce, payload_digest, header: header.to_vec(), payload: payload.to_vec(), created_at_ms })
}

/// Writes `path` atomically and durably (`fedfleet_durable::write_atomic`).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), StoreError> {
    fedfleet_durable::write_atomic(path, bytes, fedfleet_durable::Mode::Public).map_err(|e| StoreError::io(path, e))
}

#[cfg(test)]
mod error_tests {
    /// The CLIs print errors with their chain (`{:#}`): a cause the message already shows must
    /// not come again as its source (issue 15.6: "an error message that repeats its cause").
    #[test]
    fn a_store_error_names_its_cause_once() {
        let e = super::StoreError::from(sled::Error::Unsupported("no space left on device".into()));
        let printed = format!("{:#}", anyhow::Error::from(e));
        assert_eq!(printed.matches("no space left on device").count(), 1, "{printed}");
        assert!(printed.starts_with("agent store: "), "{printed}");
    }
}

#[cfg(test)]
mod memory_tests {
    use super::*;

    fn entry(id: u64) -> OutboxEntry {
        OutboxEntry {
            id,
            round: fedfleet_protocol::RoundId(id),
            nonce: [id as u8; 16],
            payload_digest: Digest::of(&id.to_le_bytes()),
            header: vec![1, 2, 3],
            payload: vec![id as u8; 8],
            created_at_ms: 7,
        }
    }

    /// A sled store (`sled/`) and an in-memory one (`memory/`) in a fresh directory.
    fn both_stores() -> (tempfile::TempDir, AgentStore, AgentStore) {
        let dir = tempfile::tempdir().unwrap();
        let sled_store = AgentStore::open(dir.path().join("sled")).unwrap();
        let memory = AgentStore::in_memory(dir.path().join("memory")).unwrap();
        (dir, sled_store, memory)
    }

    /// Both backends keep the same records; the in-memory one holds no database file open.
    #[test]
    fn an_in_memory_store_keeps_what_a_sled_store_keeps_and_opens_no_database() {
        let (dir, sled_store, memory) = both_stores();
        for store in [&sled_store, &memory] {
            assert_eq!(store.saved().unwrap().state, None);
            store.apply(&Persist::State(b"{\"v\":1}".to_vec())).unwrap();
            store.apply(&Persist::PutOutbox(entry(2))).unwrap();
            store.apply(&Persist::PutOutbox(entry(1))).unwrap();
            store.apply(&Persist::RemoveOutbox(2)).unwrap();
            let saved = store.saved().unwrap();
            assert_eq!(saved.state.as_deref(), Some(&b"{\"v\":1}"[..]));
            assert_eq!(saved.outbox, vec![entry(1)]);
            assert_eq!(store.outbox_entry(1).unwrap(), Some(entry(1)));
            let blob = store.put_blob(b"model").unwrap();
            assert_eq!(store.get_blob(&blob).unwrap().as_deref(), Some(&b"model"[..]));
            store.put_spec(&blob, "{}").unwrap();
            assert_eq!(store.spec(&blob).as_deref(), Some("{}"));
        }
        assert!(dir.path().join("sled/db").exists());
        assert!(!dir.path().join("memory/db").exists());
        assert!(!dir.path().join("memory/reserve").exists(), "a simulated device reserves no disk");
        assert!(memory.tree("inbox").unwrap_err().to_string().contains("in-memory store has no inbox tree"));
        assert!(!dir.path().join("memory").exists(), "a simulated device's store stays in memory: not even its directory is made");
    }

    /// Queued updates are written in binary, the payload's bytes as they are; outboxes written
    /// before (JSON, with the bytes in hex or, earlier, as arrays of numbers) still read.
    #[test]
    fn an_outbox_entry_is_written_in_binary_and_ones_written_as_json_still_read() {
        let e = entry(3);
        let record = encode_entry(&e);
        assert_eq!(record.len(), OUTBOX_FIXED_LEN + 3 + 8, "no byte besides the fields, header and payload");
        assert!(record.ends_with(&[1, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3]));
        assert_eq!(decode_entry(3, &record).unwrap(), e);
        let json = String::from_utf8(serde_json::to_vec(&e).unwrap()).unwrap();
        assert!(json.contains(r#""payload":"0303030303030303""#), "{json}");
        let numbers = json
            .replace(r#""header":"010203""#, r#""header":[1,2,3]"#)
            .replace(r#""payload":"0303030303030303""#, r#""payload":[3,3,3,3,3,3,3,3]"#);
        assert_ne!(numbers, json);
        assert_eq!(decode_entry(3, numbers.as_bytes()).unwrap(), e);
        assert_eq!(decode_entry(3, json.as_bytes()).unwrap(), e);
        // Both stores write and read it back, the sled one across a reopen.
        let (dir, sled_store, memory) = both_stores();
        for store in [&sled_store, &memory] {
            store.put_outbox(&e).unwrap();
            assert_eq!(store.outbox_entry(3).unwrap(), Some(e.clone()));
        }
        drop(sled_store);
        assert_eq!(AgentStore::open(dir.path().join("sled")).unwrap().outbox().unwrap(), vec![e]);
    }

    /// A damaged binary record is refused by name, not read as another entry.
    #[test]
    fn a_truncated_or_misnamed_outbox_record_is_refused_as_corrupt() {
        let record = encode_entry(&entry(3));
        let refused = |id: u64, bytes: &[u8]| match decode_entry(id, bytes) {
            Err(StoreError::Corrupt { key, detail }) => format!("{key}: {detail}"),
            other => panic!("{other:?}"),
        };
        assert!(refused(3, &record[..40]).contains("shorter than its 77 fixed ones"));
        assert!(refused(3, &record[..OUTBOX_FIXED_LEN + 2]).contains("a header of 3 bytes in the 2 left"));
        assert!(refused(4, &record).contains("outbox/4: the record names entry 3"));
    }

    /// A store keeps the blobs (and specs) it is told to keep, and nothing else it named.
    #[test]
    fn retaining_blobs_removes_past_round_bases_and_keeps_the_named_ones_and_partial_downloads() {
        let (dir, sled_store, memory) = both_stores();
        for store in [&sled_store, &memory] {
            let [old, kept, active] = [&b"round 1"[..], b"round 2", b"active"].map(|b| store.put_blob(b).unwrap());
            store.put_spec(&old, "old").unwrap();
            store.put_spec(&kept, "kept").unwrap();
            // As a download does: an in-memory store has no directory until then.
            std::fs::create_dir_all(store.partial_path(&old).parent().unwrap()).unwrap();
            std::fs::write(store.partial_path(&old), b"half").unwrap();
            store.retain_blobs(&[kept, active]).unwrap();
            assert!(!store.has_blob(&old) && store.spec(&old).is_none());
            assert!(store.has_blob(&kept) && store.spec(&kept).as_deref() == Some("kept"));
            assert!(store.has_blob(&active));
            assert!(store.partial_path(&old).exists(), "a partial download is not a blob");
        }
        let left: std::collections::BTreeSet<String> =
            std::fs::read_dir(dir.path().join("sled/blobs")).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        assert_eq!(left.len(), 3, "two blobs and one spec: {left:?}");
    }
}
