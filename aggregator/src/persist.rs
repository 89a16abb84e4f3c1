//! The aggregator's durable state: sled for records, content-addressed files for big blobs.
//!
//! ```text
//! data_dir/
//!   db/                 sled (one process per database)
//!   COMMIT              last acknowledged commit sequence (temp file + fsync + rename)
//!   updates/<round>.seg accepted update payloads of recent rounds, appended (safetensors, as
//!                       received; see `segments`)
//!   models/<digest>     global models (safetensors), indexed by the `models` tree
//!   receipt.key|.pub    the receipt-signing key (see `keys`)
//! ```
//!
//! | tree       | key                      | value (postcard)                                    |
//! |------------|--------------------------|-----------------------------------------------------|
//! | `meta`     | `format`                 | [`FORMAT`]                                          |
//! |            | `engine`                 | `RoundEngine::to_bytes` (small)                     |
//! |            | `strategy`               | `ServerStrategy` at the last round boundary         |
//! |            | `global`                 | [`GlobalRef`]: the current global model             |
//! |            | `campaign`               | [`CampaignMeta`]: strategy name, dtype, last outcome |
//! |            | `arrival_rate`           | the pacer's learned rate (u32 BE), at boundaries    |
//! | `accepted` | device `\0` nonce        | [`AcceptedRecord`]: round, payload digest, weight, signed receipt |
//! | `models`   | digest                   | [`ModelInfo`]                                     |
//! | `sequence` | `seq`                    | the commit sequence (u64 BE) as of the last sync    |
//!
//! `seq` has a tree of its own: sled rewrites a tree's node whole every so many writes, and a
//! node holding the strategy's snapshot (about 16 bytes a parameter) beside a counter written
//! often became a blob file written, fsynced and deleted every ~14 updates (a profile at 1,000
//! devices: 3 % of the aggregator's samples creating blob files). Stores from before kept it in
//! `meta`; it moves on open.
//!
//! # Commit points
//!
//! * **Accepted update**: the payload is appended to its round's segment first (a resend is not
//!   written twice); then one sled insert stores the accepted record and the update takes the
//!   next commit sequence number, counted in memory ([`Store::apply_update`], under the service
//!   lock); then, outside the lock, [`Store::sync`] fdatasyncs the segments written to, writes
//!   `seq`, flushes sled and writes the `COMMIT` file; only then does the device get its receipt.
//!   `sync` is a group commit: one fdatasync and one flush make every payload and record before
//!   them durable, so concurrent uploads share them. Not a sled transaction per update: sled
//!   0.34 seals and writes its log buffer twice for every transaction (`pin_log`), two small
//!   writes and two wake-ups of its whole I/O pool per update. sled may flush a record on its
//!   own before its payload is synced: a record of the open round whose payload is missing
//!   after a crash was never acknowledged, and the restart drops it ([`Store::forget_accepted`];
//!   the device's resend is then taken). A round's model is computed only after a `sync` of
//!   everything applied, so nothing folded into a published model can be lost.
//! * **Round boundary** (campaign start, model published, round failed, campaign stopped): one
//!   transaction stores the engine, the strategy (its partial sum is empty then; optimizer state
//!   such as Adam moments is in it) and the global model reference; a sync follows.
//!
//! The partial sum is **not** written per update (for 10 M parameters its i128 sums are 160 MB).
//! On restart the strategy is restored from the last boundary and the open (or closed but
//! unpublished) round's accepted payloads are **refolded** from `updates/`. The fold is exact
//! integer arithmetic, so the refolded sum — and the next global model — is bit-identical to the
//! one an uncrashed run computes. An update is never lost (its record is flushed before the
//! receipt) and never counted twice (the refold starts from the boundary's empty sum, and the
//! engine snapshot holds its nonce, so a resend is a replay).
//!
//! # Corruption
//!
//! As in the registry's store (same idea, separate code): sled 0.34 can silently truncate a
//! damaged log, so every sync writes `seq` (the last commit it covers) just before its flush, and
//! the `COMMIT` file outside sled records the last flushed one. sled recovers a prefix of its
//! log, so a recovered `seq` at or past the marker means nothing acknowledged was lost. On
//! open, sled behind the marker, a missing format marker, an undecodable snapshot or a missing
//! payload/model file is refused with [`StoreError::Corrupt`], saying what to do; the service
//! never silently starts empty.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use fedfleet_protocol::{DType, DeviceId, Digest, ModelInfo, ModelVersion, RoundId};
use serde::{Deserialize, Serialize};
use sled::transaction::TransactionError;

/// Value of `meta/format`.
pub const FORMAT: &str = "fedfleet-aggregator-state/2";
/// Formats this version refuses by name (its campaign state changed shape since).
const OLDER_FORMATS: &[&str] = &["fedfleet-aggregator-state/1"];
/// The commit marker file.
pub const COMMIT_FILE: &str = "COMMIT";
const MARKER_PREFIX: &str = "fedfleet-aggregator-commit";

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(
        "aggregator state in {path} is damaged: {detail}. Acknowledged updates may be lost; restore \
         the data directory from a backup, or move it aside to start over (devices' updates of the \
         open round will be refused as stale)"
    )]
    Corrupt { path: PathBuf, detail: String },
    #[error("aggregator state in {path} is locked by another process (one aggregator per data dir)")]
    Locked { path: PathBuf },
    #[error("sled: {0}")]
    Sled(sled::Error),
    #[error("I/O on {path}: {cause}")]
    Io { path: PathBuf, cause: std::io::Error },
}

// Printed in the message, so not also a `source`: a report of the chain would say it twice.
impl From<sled::Error> for StoreError {
    fn from(e: sled::Error) -> Self {
        StoreError::Sled(e)
    }
}

type Result<T> = std::result::Result<T, StoreError>;

/// The current global model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GlobalRef {
    pub version: ModelVersion,
    pub digest: Digest,
}

/// Campaign-level facts the engine does not keep.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CampaignMeta {
    pub strategy: Option<String>,
    /// `DType::code()` of the round's payloads.
    pub dtype: u8,
    pub last_outcome: Option<String>,
    /// Id of the last campaign started.
    pub last_campaign: u64,
    /// The open round's encoded `Signed<RoundAnnouncement>`.
    pub announcement: Option<Vec<u8>>,
    /// What the last DP campaign spent, once it finished.
    pub last_privacy: Option<fedfleet_rounds::PrivacyStatus>,
}

impl CampaignMeta {
    /// The dtype of the round's payloads (f32 before any campaign set one).
    pub fn payload_dtype(&self) -> DType {
        DType::from_code(self.dtype).unwrap_or(DType::F32)
    }
}

/// One accepted update.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AcceptedRecord {
    pub round: RoundId,
    pub device: DeviceId,
    pub payload_digest: Digest,
    pub weight: u64,
    /// The encoded `Signed<Receipt>` sent to the device (sent again on a resend).
    pub receipt: Vec<u8>,
    /// A relay's partial sum of this many device updates; 0 for a device's own update.
    pub relayed: u64,
}

/// An [`AcceptedRecord`] as written before relays existed (no `relayed`).
#[derive(Deserialize)]
struct AcceptedRecordV1 {
    round: RoundId,
    device: DeviceId,
    payload_digest: Digest,
    weight: u64,
    receipt: Vec<u8>,
}

impl AcceptedRecord {
    /// Decodes a record of this version or of the one before it.
    fn decode(bytes: &[u8]) -> std::result::Result<Self, postcard::Error> {
        postcard::from_bytes(bytes).or_else(|e| {
            let v1: AcceptedRecordV1 = postcard::from_bytes(bytes).map_err(|_| e)?;
            Ok(AcceptedRecord {
                round: v1.round,
                device: v1.device,
                payload_digest: v1.payload_digest,
                weight: v1.weight,
                receipt: v1.receipt,
                relayed: 0,
            })
        })
    }
}

/// What a round boundary writes.
pub struct Boundary<'a> {
    pub engine: &'a [u8],
    pub strategy: Option<&'a [u8]>,
    pub global: Option<GlobalRef>,
    pub campaign: Option<&'a CampaignMeta>,
    /// The arrival rate the pacer has learned (`crate::pacing`).
    pub arrival_rate: Option<u32>,
}

pub struct Store {
    dir: PathBuf,
    updates: crate::segments::Segments,
    db: sled::Db,
    meta: sled::Tree,
    accepted: sled::Tree,
    models: sled::Tree,
    /// The commit sequence alone (see the module docs).
    sequence: sled::Tree,
    /// The last commit sequence number given out; `sequence` holds it as of the last sync.
    last_seq: AtomicU64,
    /// The last sequence made durable, and the `COMMIT` file that records it.
    marker: Mutex<u64>,
    commit_marker: fedfleet_durable::CommitMarker,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
    move |cause| StoreError::Io { path: path.to_owned(), cause }
}

fn corrupt(dir: &Path, detail: impl Into<String>) -> StoreError {
    StoreError::Corrupt { path: dir.to_owned(), detail: detail.into() }
}

/// Writes `bytes` to `path` atomically and durably (`fedfleet_durable::write_atomic`).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    fedfleet_durable::write_atomic(path, bytes, fedfleet_durable::Mode::Public)
}

fn accepted_key(device: &DeviceId, nonce: &[u8; 16]) -> Vec<u8> {
    let mut k = device.as_str().as_bytes().to_vec();
    k.push(0);
    k.extend_from_slice(nonce);
    k
}

fn enc<T: Serialize>(v: &T) -> Vec<u8> {
    postcard::to_stdvec(v).expect("state serializes")
}

/// The database's page cache. sled's default (1 GiB) would fill with every accepted update's
/// record over a long campaign; what the service reads back is the current round's.
const SLED_CACHE_BYTES: u64 = 64 << 20;

impl Store {
    /// Opens (or creates) the state in `dir`, refusing a damaged database.
    pub fn open(dir: &Path) -> Result<Store> {
        for sub in ["updates", "models"] {
            std::fs::create_dir_all(dir.join(sub)).map_err(io(dir))?;
        }
        let marker = read_marker(dir)?;
        let db_path = dir.join("db");
        let existed = db_path.exists();
        let db = fedfleet_durable::open_sled(&db_path, SLED_CACHE_BYTES).map_err(|e| match e {
            ref e if fedfleet_durable::is_sled_lock_error(e) => StoreError::Locked { path: dir.to_owned() },
            sled::Error::Corruption { .. } => corrupt(dir, format!("sled reports corruption: {e}")),
            other => StoreError::Sled(other),
        })?;
        let updates = crate::segments::Segments::open(&dir.join("updates")).map_err(io(dir))?;
        let store = Store {
            updates,
            meta: db.open_tree("meta")?,
            accepted: db.open_tree("accepted")?,
            models: db.open_tree("models")?,
            sequence: db.open_tree("sequence")?,
            last_seq: AtomicU64::new(0),
            db,
            dir: dir.to_owned(),
            marker: Mutex::new(marker),
            commit_marker: self::marker(dir),
        };
        match store.meta.get("format")? {
            Some(f) if f.as_ref() == FORMAT.as_bytes() => {}
            Some(f) if OLDER_FORMATS.iter().any(|o| o.as_bytes() == f.as_ref()) => {
                return Err(corrupt(
                    dir,
                    format!(
                        "it was written by an earlier fedfleet-aggregator ({}), whose campaign state this version \
                         cannot read; finish or stop its campaign with that version first",
                        String::from_utf8_lossy(&f)
                    ),
                ));
            }
            Some(f) => {
                return Err(corrupt(dir, format!("unknown format {:?}", String::from_utf8_lossy(&f))));
            }
            None => {
                if marker > 0 || (existed && !store.accepted.is_empty()) {
                    return Err(corrupt(dir, "the format marker is missing"));
                }
                store.meta.insert("format", FORMAT)?;
                store.db.flush()?;
            }
        }
        // A store from before `sequence` had its own tree: the counter moves, once.
        if store.sequence.get("seq")?.is_none()
            && let Some(old) = store.meta.get("seq")?
        {
            store.sequence.insert("seq", old)?;
            store.meta.remove("seq")?;
            store.db.flush()?;
        }
        let seq = store.seq()?;
        if seq < marker {
            return Err(corrupt(
                dir,
                format!(
                    "sled recovered commit {seq}, but commit {marker} was acknowledged \
                     ({COMMIT_FILE} file)"
                ),
            ));
        }
        store.last_seq.store(seq, Ordering::SeqCst);
        Ok(store)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// An append-only journal in this store's database (round history, the console's audit).
    pub fn journal(&self, name: &str, keep: usize) -> Result<fedfleet_durable::Journal> {
        Ok(fedfleet_durable::Journal::open(&self.db, name, keep)?)
    }

    /// The commit sequence as sled holds it: as of the last sync (updates applied since are
    /// counted in memory only).
    pub fn seq(&self) -> Result<u64> {
        Ok(match self.sequence.get("seq")? {
            Some(b) if b.len() == 8 => u64::from_be_bytes(b.as_ref().try_into().expect("8 bytes")),
            Some(_) => return Err(corrupt(&self.dir, "sequence/seq is not 8 bytes")),
            None => 0,
        })
    }

    fn get<T: for<'de> Deserialize<'de>>(&self, key: &str) -> Result<Option<T>> {
        match self.meta.get(key)? {
            None => Ok(None),
            Some(b) => postcard::from_bytes(&b).map(Some).map_err(|e| corrupt(&self.dir, format!("meta/{key} does not decode: {e}"))),
        }
    }

    /// The arrival rate the pacer had learned at the last round boundary, if any.
    pub fn arrival_rate(&self) -> Result<Option<u32>> {
        match self.meta.get("arrival_rate")? {
            None => Ok(None),
            Some(b) if b.len() == 4 => Ok(Some(u32::from_be_bytes(b.as_ref().try_into().expect("4 bytes")))),
            Some(_) => Err(corrupt(&self.dir, "meta/arrival_rate is not 4 bytes")),
        }
    }

    pub fn engine(&self) -> Result<Option<Vec<u8>>> {
        Ok(self.meta.get("engine")?.map(|b| b.to_vec()))
    }
    pub fn strategy(&self) -> Result<Option<Vec<u8>>> {
        Ok(self.meta.get("strategy")?.map(|b| b.to_vec()))
    }
    pub fn global(&self) -> Result<Option<GlobalRef>> {
        self.get("global")
    }
    pub fn campaign_meta(&self) -> Result<CampaignMeta> {
        Ok(self.get("campaign")?.unwrap_or_default())
    }

    /// The record of an accepted (device, nonce), if any.
    pub fn accepted(&self, device: &DeviceId, nonce: &[u8; 16]) -> Result<Option<AcceptedRecord>> {
        match self.accepted.get(accepted_key(device, nonce))? {
            None => Ok(None),
            Some(b) => {
                AcceptedRecord::decode(&b).map(Some).map_err(|e| corrupt(&self.dir, format!("accepted record does not decode: {e}")))
            }
        }
    }

    /// Every accepted record of `round`, in key order.
    pub fn accepted_in(&self, round: RoundId) -> Result<Vec<AcceptedRecord>> {
        let mut out = Vec::new();
        for kv in self.accepted.iter() {
            let (_, v) = kv?;
            let rec = AcceptedRecord::decode(&v).map_err(|e| corrupt(&self.dir, format!("accepted record does not decode: {e}")))?;
            if rec.round == round {
                out.push(rec);
            }
        }
        Ok(out)
    }

    /// Stores an update payload trained for `round` (before its commit; durable with the
    /// [`Store::sync`] that makes its record durable).
    pub fn put_update(&self, round: RoundId, digest: &Digest, bytes: &[u8]) -> Result<()> {
        let dir = self.dir.join("updates");
        self.updates.put(round, digest, bytes).map_err(io(&dir))
    }

    /// Whether the payload `digest` is stored.
    pub fn has_update(&self, digest: &Digest) -> bool {
        self.updates.contains(digest)
    }

    pub fn read_update(&self, digest: &Digest) -> Result<Vec<u8>> {
        match self.updates.get(digest) {
            Ok(Some(bytes)) => Ok(bytes),
            Ok(None) => Err(corrupt(&self.dir, format!("the payload of accepted update {digest} is missing"))),
            Err(e) => Err(corrupt(&self.dir, format!("accepted update payload {digest}: {e}"))),
        }
    }

    /// Removes the record of an update that was never acknowledged (its payload was lost in a
    /// crash before the group commit that would have made both durable).
    pub fn forget_accepted(&self, nonce: &[u8; 16], rec: &AcceptedRecord) -> Result<()> {
        self.accepted.remove(accepted_key(&rec.device, nonce))?;
        Ok(())
    }

    /// Applies the commit of an accepted update (see the module docs; the payload must be
    /// stored) and returns its sequence number: durable once [`Store::sync`] of it returns. The
    /// record alone: the engine's snapshot is written at round boundaries, and a restart
    /// re-admits the open round's records into it (`RoundEngine::readmit`), so an update costs
    /// the same whatever the round's size.
    pub fn apply_update(&self, nonce: &[u8; 16], rec: &AcceptedRecord) -> Result<u64> {
        self.accepted.insert(accepted_key(&rec.device, nonce), enc(rec))?;
        // Numbered after the insert: a sync that reads this number covers the record.
        Ok(self.next_seq())
    }

    fn next_seq(&self) -> u64 {
        self.last_seq.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// Commit point of a round boundary.
    pub fn commit_boundary(&self, b: Boundary<'_>) -> Result<()> {
        let global = b.global.map(|g| enc(&g));
        let campaign = b.campaign.map(enc);
        let res = self.meta.transaction(|m| {
            m.insert("engine", b.engine)?;
            if let Some(s) = b.strategy {
                m.insert("strategy", s)?;
            }
            if let Some(g) = &global {
                m.insert("global", g.as_slice())?;
            }
            if let Some(c) = &campaign {
                m.insert("campaign", c.as_slice())?;
            }
            if let Some(r) = b.arrival_rate {
                m.insert("arrival_rate", &r.to_be_bytes())?;
            }
            Ok(())
        });
        tx(res)?;
        let seq = self.next_seq();
        self.sync(seq)
    }

    /// Deletes payload files of rounds before `keep_from` (folded into a published model or
    /// discarded with a failed round); their accepted records stay (replays, receipts). With
    /// `startup` (no upload in flight), also files no record names (written, then refused).
    pub fn gc_updates(&self, keep_from: RoundId, startup: bool) -> Result<usize> {
        let mut keep = std::collections::HashSet::new();
        for kv in self.accepted.iter() {
            let (_, v) = kv?;
            if let Ok(rec) = postcard::from_bytes::<AcceptedRecord>(&v)
                && rec.round >= keep_from
            {
                keep.insert(rec.payload_digest);
            }
        }
        let dir = self.dir.join("updates");
        self.updates.retain(&keep, keep_from, startup).map_err(io(&dir))
    }

    // ----- models -----

    pub fn model_path(&self, digest: &Digest) -> PathBuf {
        self.dir.join("models").join(format!("{}.safetensors", digest.to_hex()))
    }

    /// Stores a global model file and its record (durably).
    pub fn put_model(&self, digest: &Digest, bytes: &[u8], rec: &ModelInfo) -> Result<()> {
        let p = self.model_path(digest);
        write_atomic(&p, bytes).map_err(io(&p))?;
        self.models.insert(digest.0, enc(rec))?;
        self.db.flush()?;
        Ok(())
    }

    pub fn model_record(&self, digest: &Digest) -> Result<Option<ModelInfo>> {
        match self.models.get(digest.0)? {
            None => Ok(None),
            Some(b) => postcard::from_bytes(&b).map(Some).map_err(|e| corrupt(&self.dir, format!("model record does not decode: {e}"))),
        }
    }

    /// The bytes of a held model, checked against its digest.
    pub fn read_model(&self, digest: &Digest) -> Result<Vec<u8>> {
        let p = self.model_path(digest);
        let bytes = std::fs::read(&p).map_err(|e| corrupt(&self.dir, format!("model {}: {e}", p.display())))?;
        if Digest::of(&bytes) != *digest {
            return Err(corrupt(&self.dir, format!("{} does not hash to its name", p.display())));
        }
        Ok(bytes)
    }

    /// Makes every transaction applied up to `seq` durable: flush, then the `COMMIT` file. A
    /// group commit: callers queue on the marker lock, and one flush covers every transaction
    /// applied before it started, so a caller whose `seq` is already covered returns at once.
    pub fn sync(&self, seq: u64) -> Result<()> {
        let mut durable = self.marker.lock().unwrap_or_else(|p| p.into_inner());
        if seq <= *durable {
            return Ok(());
        }
        let target = self.last_seq.load(Ordering::SeqCst).max(seq);
        // Payloads before the records that name them.
        self.updates.sync().map_err(io(&self.dir.join("updates")))?;
        // Written after every record it covers and flushed with them (see the module docs).
        // Only syncs write it, under the marker lock, so it never goes back.
        self.sequence.insert("seq", &target.to_be_bytes())?;
        self.db.flush()?;
        let m = &self.commit_marker;
        m.write(target).map_err(io(m.path()))?;
        *durable = target;
        Ok(())
    }

    /// [`Store::sync`] of everything applied so far.
    pub fn sync_all(&self) -> Result<()> {
        self.sync(self.last_seq.load(Ordering::SeqCst))
    }
}

fn tx<T>(res: std::result::Result<T, TransactionError<StoreError>>) -> Result<T> {
    match res {
        Ok(t) => Ok(t),
        Err(TransactionError::Abort(e)) => Err(e),
        Err(TransactionError::Storage(e)) => Err(e.into()),
    }
}

fn marker(dir: &Path) -> fedfleet_durable::CommitMarker {
    fedfleet_durable::CommitMarker::new(dir, MARKER_PREFIX)
}

fn read_marker(dir: &Path) -> Result<u64> {
    let m = marker(dir);
    m.read().map_err(|e| match e.kind() {
        std::io::ErrorKind::InvalidData => corrupt(dir, e.to_string()),
        _ => io(m.path())(e),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Update `i`'s accepted record in round 1.
    fn rec(i: u8) -> AcceptedRecord {
        AcceptedRecord {
            round: RoundId(1),
            device: DeviceId::new(format!("dev-{i}")).unwrap(),
            payload_digest: Digest::of(&[i]),
            weight: 1,
            receipt: vec![i],
            relayed: 0,
        }
    }

    #[test]
    fn refuses_a_database_behind_its_marker() {
        let dir = tempfile::tempdir().unwrap();
        {
            let s = Store::open(dir.path()).unwrap();
            assert_eq!(s.arrival_rate().unwrap(), None);
            s.commit_boundary(Boundary { engine: b"e", strategy: None, global: None, campaign: None, arrival_rate: Some(166) }).unwrap();
            assert_eq!(s.seq().unwrap(), 1);
        }
        assert_eq!(Store::open(dir.path()).unwrap().arrival_rate().unwrap(), Some(166), "kept with the boundary");
        std::fs::write(dir.path().join(COMMIT_FILE), format!("{MARKER_PREFIX} 5\n")).unwrap();
        let err = Store::open(dir.path()).err().expect("refused");
        assert!(matches!(err, StoreError::Corrupt { .. }), "{err}");
        assert!(err.to_string().contains("commit 5 was acknowledged"), "{err}");
        // An empty database next to a non-zero marker is refused too.
        std::fs::remove_dir_all(dir.path().join("db")).unwrap();
        assert!(matches!(Store::open(dir.path()), Err(StoreError::Corrupt { .. })));
    }

    #[test]
    fn a_state_of_an_earlier_format_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        {
            let s = Store::open(dir.path()).unwrap();
            s.meta.insert("format", "fedfleet-aggregator-state/1").unwrap();
            s.db.flush().unwrap();
        }
        let err = Store::open(dir.path()).err().expect("refused").to_string();
        assert!(err.contains("written by an earlier fedfleet-aggregator (fedfleet-aggregator-state/1)"), "{err}");
    }

    #[test]
    fn one_sync_makes_every_applied_update_durable() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open(dir.path()).unwrap();
        let seqs: Vec<u64> = (0..3).map(|i| s.apply_update(&[i; 16], &rec(i)).unwrap()).collect();
        assert_eq!(seqs, [1, 2, 3]);
        assert_eq!(read_marker(dir.path()).unwrap(), 0, "nothing is acknowledged before a sync");
        // The first caller's flush covers the later transactions; their syncs return at once.
        s.sync(seqs[0]).unwrap();
        assert_eq!(read_marker(dir.path()).unwrap(), 3);
        s.sync(seqs[2]).unwrap();
        drop(s);
        let s = Store::open(dir.path()).unwrap();
        assert_eq!(s.accepted_in(RoundId(1)).unwrap().len(), 3);
    }

    /// An update costs one sled insert: the commit sequence is counted in memory and written by
    /// the sync that covers it (a sled transaction per update wrote sled's log twice), and a
    /// reopened store counts on from what the last sync wrote.
    #[test]
    fn the_commit_sequence_is_written_by_the_sync_not_by_each_update() {
        let dir = tempfile::tempdir().unwrap();
        {
            let s = Store::open(dir.path()).unwrap();
            assert_eq!([1, 2].map(|i| s.apply_update(&[i; 16], &rec(i)).unwrap()), [1, 2]);
            assert_eq!(s.seq().unwrap(), 0, "not written per update");
            s.sync(2).unwrap();
            assert_eq!((s.seq().unwrap(), read_marker(dir.path()).unwrap()), (2, 2));
            // Applied, never synced: a crash may keep or lose it; nothing acknowledged it.
            assert_eq!(s.apply_update(&[3; 16], &rec(3)).unwrap(), 3);
        }
        let s = Store::open(dir.path()).unwrap();
        assert_eq!(s.apply_update(&[4; 16], &rec(4)).unwrap(), 3, "counts on from the last sync");
        s.sync_all().unwrap();
        assert_eq!(read_marker(dir.path()).unwrap(), 3);
    }

    /// A store from before `sequence` had a tree of its own keeps counting where it was, and
    /// its acknowledged commits stay acknowledged.
    #[test]
    fn a_commit_sequence_kept_in_meta_moves_to_its_own_tree_on_open() {
        let dir = tempfile::tempdir().unwrap();
        {
            let s = Store::open(dir.path()).unwrap();
            for i in 0..3 {
                s.apply_update(&[i; 16], &rec(i)).unwrap();
            }
            s.sync(3).unwrap();
            // The earlier layout: the counter in `meta`.
            let seq = s.sequence.remove("seq").unwrap().unwrap();
            s.meta.insert("seq", seq).unwrap();
            s.db.flush().unwrap();
        }
        let s = Store::open(dir.path()).expect("a moved counter covers the acknowledged commit 3");
        assert_eq!(s.seq().unwrap(), 3);
        assert!(s.meta.get("seq").unwrap().is_none());
        assert_eq!(s.apply_update(&[9; 16], &rec(9)).unwrap(), 4);
    }

    #[test]
    fn records_written_before_relays_still_decode() {
        #[derive(Serialize)]
        struct V1<'a>(RoundId, &'a DeviceId, Digest, u64, Vec<u8>);
        let device = DeviceId::new("dev-1").unwrap();
        let old = postcard::to_stdvec(&V1(RoundId(4), &device, Digest::of(b"x"), 7, vec![1, 2])).unwrap();
        let rec = AcceptedRecord::decode(&old).unwrap();
        assert_eq!((rec.round, rec.weight, rec.relayed, rec.receipt), (RoundId(4), 7, 0, vec![1, 2]));
        let new = AcceptedRecord { relayed: 3, ..AcceptedRecord::decode(&old).unwrap() };
        assert_eq!(AcceptedRecord::decode(&enc(&new)).unwrap(), new);
    }
}
