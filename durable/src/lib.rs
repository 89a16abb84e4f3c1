//! Crash-safe file writes shared by every fedfleet store.
//!
//! - [`write_atomic`]: a file is either its old bytes or its new bytes after any crash
//!   (temp file, fsync, rename, fsync of the directory).
//! - [`CommitMarker`]: the last acknowledged commit sequence, kept in a file beside a sled
//!   database. sled 0.34 can reopen a damaged log as a shorter, valid-looking database; a store
//!   whose own sequence is behind its marker has lost acknowledged commits and must refuse to open.
//! - [`open_sled`]: opening a sled database, waiting for a lock a just-closed handle still holds.
//! - [`SpaceReserve`]: bytes held in a file beside a store and given back when the disk is full,
//!   so the store can still open and commit (sled needs a free 512 KiB segment to open).
//! - [`Journal`]: an append-only, bounded record log in a sled tree (the operator audit trail,
//!   the aggregator's round history), read newest first.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Whether `e` says another handle holds the database's file lock.
pub fn is_sled_lock_error(e: &sled::Error) -> bool {
    matches!(e, sled::Error::Io(io) if io.kind() == io::ErrorKind::WouldBlock
        || io.to_string().contains("could not acquire lock"))
}

/// sled's own page-cache bound (1 GiB). Its cache keeps what is written to it, so a store that
/// takes records for ever (the aggregator's, one per accepted update: about 130 B each at the
/// peak of a 10,000-device campaign, heaptrack) grows towards it; stores name a smaller bound.
pub const SLED_DEFAULT_CACHE_BYTES: u64 = 1 << 30;

/// Opens the sled database at `path` with a page cache of `cache_bytes`, waiting up to ~2 s for
/// its file lock: sled 0.34 releases it from a background thread shortly after the last handle
/// drops, so a reopen right after a close (a restart in the same process, a test) can find it
/// still held. A lock still held after that (another live process) is returned as the error
/// [`is_sled_lock_error`] names.
pub fn open_sled(path: &Path, cache_bytes: u64) -> sled::Result<sled::Db> {
    let mut tries = 0;
    loop {
        match sled::Config::new().path(path).cache_capacity(cache_bytes).open() {
            Err(e) if is_sled_lock_error(&e) && tries < 100 => {
                tries += 1;
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            other => return other,
        }
    }
}

/// Whether `e` says the filesystem is out of space (ENOSPC) or the writer over its quota.
pub fn is_out_of_space(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded)
}

/// The same for a sled error (sled reports I/O as `sled::Error::Io`).
pub fn is_sled_out_of_space(e: &sled::Error) -> bool {
    matches!(e, sled::Error::Io(io) if is_out_of_space(io))
}

/// Bytes an unprivileged writer may still put on the filesystem holding `path`.
pub fn available_space(path: &Path) -> io::Result<u64> {
    fs2::available_space(path)
}

/// A file of `bytes` written zeros, kept beside a store as room it can get back: a full disk
/// (filled by anyone) would otherwise stop the store from opening or committing. Released
/// when the filesystem runs low, taken again once there is space.
#[derive(Debug)]
pub struct SpaceReserve {
    path: PathBuf,
    bytes: u64,
}

impl SpaceReserve {
    pub fn new(path: impl Into<PathBuf>, bytes: u64) -> Self {
        SpaceReserve { path: path.into(), bytes }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn is_held(&self) -> bool {
        fs::metadata(&self.path).is_ok_and(|m| m.len() == self.bytes)
    }

    fn dir(&self) -> &Path {
        self.path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."))
    }

    /// Takes the reserve unless held already, if that still leaves `keep_free` bytes available.
    /// Returns whether it is held.
    pub fn take(&self, keep_free: u64) -> io::Result<bool> {
        if self.is_held() {
            return Ok(true);
        }
        if available_space(self.dir())? < self.bytes.saturating_add(keep_free) {
            return Ok(false);
        }
        // Written, not just sized: a sparse file would hold no blocks.
        write_atomic(&self.path, &vec![0u8; self.bytes as usize], Mode::Public)?;
        Ok(true)
    }

    /// Gives the reserve back to the filesystem; returns whether it was held.
    pub fn release(&self) -> bool {
        let held = fs::metadata(&self.path).is_ok();
        held && fs::remove_file(&self.path).is_ok()
    }

    /// Releases the reserve if fewer than `min_free` bytes are available (or that is unknown).
    /// Returns whether it released it.
    pub fn release_if_below(&self, min_free: u64) -> bool {
        let low = available_space(self.dir()).map_or(true, |free| free < min_free);
        low && self.release()
    }
}

/// Who may read a file written by [`write_atomic`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// 0644.
    Public,
    /// 0600 from creation on: private keys.
    Secret,
}

impl Mode {
    fn bits(self) -> u32 {
        match self {
            Mode::Public => 0o644,
            Mode::Secret => 0o600,
        }
    }
}

/// Writes `bytes` to `path` atomically and durably: a fresh temp file in the same directory,
/// fsync, rename over `path`, fsync of the directory. The temp file is removed on failure.
pub fn write_atomic(path: &Path, bytes: &[u8], mode: Mode) -> io::Result<()> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    // Unique per process and call, so concurrent writers never share a temp file.
    let tmp: PathBuf = dir.join(format!(".{name}.{}.{}.tmp", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed)));
    let written = (|| {
        let mut f = OpenOptions::new().write(true).create_new(true).mode(mode.bits()).open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        fs::rename(&tmp, path)
    })();
    if let Err(e) = written {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    File::open(dir)?.sync_all()
}

/// Makes a rename into `path`'s directory durable: fsync of the directory.
pub fn sync_parent(path: &Path) -> io::Result<()> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    File::open(dir)?.sync_all()
}

/// The commit marker file. It is written on every group commit, so it is overwritten in place
/// (one write and one `fdatasync`, no new file or rename): two slots of [`MARKER_SLOT`] bytes,
/// each a line `<prefix> <seq> <check>` padded with spaces, written in turn. A write torn by a
/// crash leaves a slot whose check fails, and the other slot still holds the sequence before it.
/// A one-line `<prefix> <seq>` file (the earlier layout, written whole by rename) is still read,
/// and replaced by the two-slot layout on the first write.
#[derive(Debug)]
pub struct CommitMarker {
    path: PathBuf,
    prefix: &'static str,
    /// The open file and the slot the next write goes to, from the first write on.
    open: std::sync::Mutex<Option<(File, usize)>>,
}

/// Bytes per slot of the commit marker.
pub const MARKER_SLOT: usize = 128;

impl CommitMarker {
    /// The marker at `dir/COMMIT`, tagged with `prefix` (e.g. `fedfleet-registry-commit`).
    pub fn new(dir: &Path, prefix: &'static str) -> Self {
        CommitMarker { path: dir.join("COMMIT"), prefix, open: std::sync::Mutex::new(None) }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The recorded sequence; 0 when there is no marker yet. A marker that does not parse is an
    /// `InvalidData` error: the caller must treat the store as damaged, not as new.
    pub fn read(&self) -> io::Result<u64> {
        let bytes = match fs::read(&self.path) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
            Err(e) => return Err(e),
        };
        let bad = || io::Error::new(io::ErrorKind::InvalidData, format!("{} does not parse", self.path.display()));
        if bytes.len() == 2 * MARKER_SLOT {
            let slots = self.slots(&bytes);
            return slots.into_iter().flatten().max().ok_or_else(bad);
        }
        std::str::from_utf8(&bytes)
            .ok()
            .and_then(|text| text.strip_prefix(self.prefix))
            .and_then(|rest| rest.trim().parse().ok())
            .ok_or_else(bad)
    }

    /// Records `seq` durably. Call only after the database itself has been flushed.
    pub fn write(&self, seq: u64) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        let (file, next) = match open.as_mut() {
            Some(open) => open,
            None => {
                // First write of this handle: continue a two-slot file from its older slot, or
                // lay one out whole (by rename, so a crash leaves the old marker or the new one).
                let existing = fs::read(&self.path).ok().filter(|b| b.len() == 2 * MARKER_SLOT);
                let older = match existing.map(|b| self.slots(&b)) {
                    Some([a, b]) => usize::from(a.unwrap_or(0) > b.unwrap_or(0)),
                    None => {
                        let slot = self.slot(seq);
                        write_atomic(&self.path, &[slot.as_slice(), slot.as_slice()].concat(), Mode::Public)?;
                        *open = Some((OpenOptions::new().write(true).open(&self.path)?, 0));
                        return Ok(());
                    }
                };
                open.insert((OpenOptions::new().write(true).open(&self.path)?, older))
            }
        };
        file.write_all_at(&self.slot(seq), (*next * MARKER_SLOT) as u64)?;
        file.sync_data()?;
        *next ^= 1;
        Ok(())
    }

    fn slot(&self, seq: u64) -> Vec<u8> {
        let line = format!("{} {seq}", self.prefix);
        let mut slot = format!("{line} {:016x}", marker_check(&line)).into_bytes();
        slot.resize(MARKER_SLOT - 1, b' ');
        slot.push(b'\n');
        slot
    }

    /// Each slot's sequence, `None` where the slot is torn or not this marker's.
    fn slots(&self, bytes: &[u8]) -> [Option<u64>; 2] {
        let parse = |slot: &[u8]| {
            let text = std::str::from_utf8(slot).ok()?.trim_end();
            let (line, check) = text.rsplit_once(' ')?;
            let seq = line.strip_prefix(self.prefix)?.strip_prefix(' ')?.parse().ok()?;
            (u64::from_str_radix(check, 16).ok()? == marker_check(line)).then_some(seq)
        };
        [parse(&bytes[..MARKER_SLOT]), parse(&bytes[MARKER_SLOT..])]
    }
}

/// FNV-1a over a marker line: enough to tell a torn slot from a whole one.
fn marker_check(line: &str) -> u64 {
    line.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// An append-only log of records in one sled tree, keyed by a monotonic id so that it reads
/// back in append order. It keeps the newest `keep` records: older ones are trimmed on append,
/// so an endless stream of entries (say, refused requests) cannot fill the disk.
#[derive(Debug, Clone)]
pub struct Journal {
    tree: sled::Tree,
    keep: usize,
    /// Appends read the last key and write the next: one at a time.
    append: std::sync::Arc<std::sync::Mutex<()>>,
}

impl Journal {
    pub fn open(db: &sled::Db, name: &str, keep: usize) -> sled::Result<Journal> {
        Ok(Journal { tree: db.open_tree(name)?, keep: keep.max(1), append: Default::default() })
    }

    /// Appends `record` (not flushed: the caller's next commit or flush makes it durable).
    pub fn append(&self, record: &[u8]) -> sled::Result<()> {
        let _one = self.append.lock().unwrap_or_else(|p| p.into_inner());
        let next = match self.tree.last()? {
            Some((k, _)) => Self::id(&k) + 1,
            None => 0,
        };
        self.tree.insert(next.to_be_bytes(), record)?;
        // Keys are consecutive, so the oldest kept one is `next + 1 - keep`; one trim per append
        // keeps the log at `keep` without counting it (sled's `len` walks the whole tree).
        let oldest_kept = (next + 1).saturating_sub(self.keep as u64);
        if let Some((k, _)) = self.tree.first()?
            && Self::id(&k) < oldest_kept
        {
            self.tree.remove(k)?;
        }
        Ok(())
    }

    fn id(key: &[u8]) -> u64 {
        u64::from_be_bytes(key.try_into().unwrap_or([0; 8]))
    }

    /// The newest `limit` records, newest first.
    pub fn newest(&self, limit: usize) -> sled::Result<Vec<Vec<u8>>> {
        self.tree.iter().rev().take(limit).map(|r| r.map(|(_, v)| v.to_vec())).collect()
    }

    pub fn flush(&self) -> sled::Result<()> {
        self.tree.flush().map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn journal_keeps_the_newest_records_in_order_across_reopen() {
        let dir = tempfile::tempdir().unwrap();
        {
            let db = sled::open(dir.path()).unwrap();
            let j = Journal::open(&db, "log", 3).unwrap();
            for i in 0..5u8 {
                j.append(&[i]).unwrap();
            }
            assert_eq!(j.newest(10).unwrap(), vec![vec![4], vec![3], vec![2]]);
            j.flush().unwrap();
        }
        // `open_sled`: the first handle's lock is released by a background thread after the drop.
        let db = open_sled(dir.path(), 1 << 20).unwrap();
        let j = Journal::open(&db, "log", 3).unwrap();
        j.append(&[5]).unwrap();
        assert_eq!(j.newest(2).unwrap(), vec![vec![5], vec![4]]);
    }

    #[test]
    fn atomic_write_replaces_and_sets_mode() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("key.pem");
        write_atomic(&p, b"one", Mode::Secret).unwrap();
        write_atomic(&p, b"two", Mode::Secret).unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"two");
        assert_eq!(fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o600);
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1, "no temp file left behind");
    }

    #[test]
    fn failed_write_leaves_old_bytes_and_no_temp() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("sub");
        fs::create_dir(&target).unwrap();
        // Renaming a file over a non-empty directory fails.
        fs::write(target.join("x"), b"x").unwrap();
        assert!(write_atomic(&target, b"new", Mode::Public).is_err());
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn a_reserve_is_taken_only_with_room_to_spare_and_released_when_low() {
        let dir = tempfile::tempdir().unwrap();
        let r = SpaceReserve::new(dir.path().join("reserve"), 4096);
        assert!(!r.take(u64::MAX / 2).unwrap(), "no filesystem has that much to spare");
        assert!(!r.is_held());
        assert!(r.take(0).unwrap());
        assert!(r.is_held());
        assert!(!r.release_if_below(0), "not below 0 bytes");
        assert!(r.release_if_below(u64::MAX));
        assert!(!r.is_held());
        assert!(!r.release(), "nothing left to release");
    }

    #[test]
    fn marker_round_trips_and_refuses_garbage() {
        let dir = tempfile::tempdir().unwrap();
        let m = CommitMarker::new(dir.path(), "fedfleet-test-commit");
        assert_eq!(m.read().unwrap(), 0);
        m.write(42).unwrap();
        assert_eq!(m.read().unwrap(), 42);
        fs::write(m.path(), "garbage").unwrap();
        assert_eq!(m.read().unwrap_err().kind(), io::ErrorKind::InvalidData);
    }

    #[test]
    fn marker_slots_survive_a_torn_write_and_continue_across_handles() {
        use std::os::unix::fs::FileExt;
        let dir = tempfile::tempdir().unwrap();
        let m = CommitMarker::new(dir.path(), "fedfleet-test-commit");
        for seq in 1..=5 {
            m.write(seq).unwrap();
            assert_eq!(m.read().unwrap(), seq);
        }
        assert_eq!(fs::metadata(m.path()).unwrap().len(), 2 * MARKER_SLOT as u64);
        // A new handle overwrites the older slot, never the newest.
        let again = CommitMarker::new(dir.path(), "fedfleet-test-commit");
        again.write(6).unwrap();
        assert_eq!(again.read().unwrap(), 6);
        again.write(7).unwrap();
        // A crash tears the slot being written: the other one still holds the sequence before.
        let bytes = fs::read(m.path()).unwrap();
        let newest = if bytes[..MARKER_SLOT].starts_with(b"fedfleet-test-commit 7 ") { 0 } else { 1 };
        let file = OpenOptions::new().write(true).open(m.path()).unwrap();
        file.write_all_at(b"fedfleet-test-commit 9", (newest * MARKER_SLOT) as u64).unwrap();
        assert_eq!(again.read().unwrap(), 6);
        // Both slots torn: damaged, not new.
        file.write_all_at(b"x", ((newest ^ 1) * MARKER_SLOT) as u64).unwrap();
        assert_eq!(again.read().unwrap_err().kind(), io::ErrorKind::InvalidData);
    }

    #[test]
    fn a_one_line_marker_is_read_and_replaced_by_slots_on_the_first_write() {
        let dir = tempfile::tempdir().unwrap();
        let m = CommitMarker::new(dir.path(), "fedfleet-test-commit");
        fs::write(m.path(), "fedfleet-test-commit 41\n").unwrap();
        assert_eq!(m.read().unwrap(), 41);
        m.write(42).unwrap();
        assert_eq!(m.read().unwrap(), 42);
        assert_eq!(fs::metadata(m.path()).unwrap().len(), 2 * MARKER_SLOT as u64);
        m.write(43).unwrap();
        assert_eq!(CommitMarker::new(dir.path(), "fedfleet-test-commit").read().unwrap(), 43);
    }
}
