//! Accepted update payloads, appended to one segment file per round (`updates/<round>.seg`)
//! instead of a file each: creating a file per update was the aggregator's largest CPU cost
//! (ext4 inode allocation and two fsyncs per update; see benches/README.md, "Where the
//! aggregator's CPU goes").
//!
//! An entry is `digest (32 B) | length (u64 LE) | payload`. Appends are not synced one by one:
//! [`Segments::sync`] fdatasyncs every segment written since the previous call, and the store
//! calls it before it flushes sled at each group commit, so a payload is durable before any
//! receipt of it is sent. A crash can leave a torn entry at a segment's end: opening truncates a
//! segment at its first entry that is incomplete or does not hash to its digest (nothing after it
//! was ever synced, since entries are appended in order and synced as a prefix).
//!
//! (The earlier layout, a file per payload, belongs to state format 1, which the store refuses.)

use std::collections::{HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use fedfleet_protocol::{Digest, RoundId};

/// Bytes of an entry before its payload.
const HEADER: u64 = 32 + 8;

/// Where a payload is: `len` bytes at `offset` of `round`'s segment.
#[derive(Debug, Clone, Copy)]
struct Loc {
    round: u64,
    offset: u64,
    len: u64,
}

#[derive(Default)]
struct Inner {
    index: HashMap<Digest, Loc>,
    /// Append handles and their lengths, by round.
    open: HashMap<u64, (File, u64)>,
    /// Rounds appended to since the last sync.
    dirty: HashSet<u64>,
}

/// The payload store (see the module docs).
pub struct Segments {
    dir: PathBuf,
    inner: Mutex<Inner>,
}

fn segment_name(round: u64) -> String {
    format!("{round}.seg")
}

impl Segments {
    /// Indexes `dir` (created if missing), truncating torn segment tails.
    pub fn open(dir: &Path) -> io::Result<Segments> {
        std::fs::create_dir_all(dir)?;
        let mut inner = Inner::default();
        for entry in std::fs::read_dir(dir)? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(round) = name.strip_suffix(".seg").and_then(|r| r.parse::<u64>().ok()) {
                scan(&entry.path(), round, &mut inner.index)?;
            }
        }
        Ok(Segments { dir: dir.to_owned(), inner: Mutex::new(inner) })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Appends `bytes` (whose digest is `digest`) to `round`'s segment; a payload already stored
    /// (a resend) is not written twice. Durable after the next [`Segments::sync`].
    pub fn put(&self, round: RoundId, digest: &Digest, bytes: &[u8]) -> io::Result<()> {
        let mut guard = self.lock();
        let inner = &mut *guard;
        if inner.index.contains_key(digest) {
            return Ok(());
        }
        let round = round.0;
        let (file, len) = match inner.open.entry(round) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                let path = self.dir.join(segment_name(round));
                let file = OpenOptions::new().create(true).append(true).read(true).open(&path)?;
                let len = file.metadata()?.len();
                // The new file's name must survive a crash too.
                fedfleet_durable::sync_parent(&path)?;
                v.insert((file, len))
            }
        };
        let offset = *len;
        let mut entry = Vec::with_capacity(HEADER as usize + bytes.len());
        entry.extend_from_slice(&digest.0);
        entry.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        entry.extend_from_slice(bytes);
        if let Err(e) = file.write_all(&entry) {
            // Leave no torn entry for later appends to follow.
            let _ = file.set_len(offset);
            return Err(e);
        }
        *len += entry.len() as u64;
        inner.index.insert(*digest, Loc { round, offset: offset + HEADER, len: bytes.len() as u64 });
        inner.dirty.insert(round);
        Ok(())
    }

    /// Whether the payload `digest` is stored.
    pub fn contains(&self, digest: &Digest) -> bool {
        self.lock().index.contains_key(digest)
    }

    /// The payload `digest`, checked against it. `Ok(None)`: not stored.
    pub fn get(&self, digest: &Digest) -> io::Result<Option<Vec<u8>>> {
        let Some(Loc { round, offset, len }) = self.lock().index.get(digest).copied() else { return Ok(None) };
        let mut bytes = vec![0; len as usize];
        File::open(self.dir.join(segment_name(round)))?.read_exact_at(&mut bytes, offset)?;
        if Digest::of(&bytes) != *digest {
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("stored payload {digest} does not hash to its digest")));
        }
        Ok(Some(bytes))
    }

    /// Makes every payload put so far durable (one fdatasync per segment written to).
    pub fn sync(&self) -> io::Result<()> {
        let mut inner = self.lock();
        let dirty: Vec<u64> = inner.dirty.drain().collect();
        for round in dirty {
            if let Some((file, _)) = inner.open.get(&round) {
                file.sync_data()?;
            }
        }
        Ok(())
    }

    /// Deletes the segments that hold no payload in `keep`: those of rounds before `keep_from`,
    /// and with `startup` any other (written, then refused). Returns how many went.
    pub fn retain(&self, keep: &HashSet<Digest>, keep_from: RoundId, startup: bool) -> io::Result<usize> {
        let mut inner = self.lock();
        let needed: HashSet<u64> = inner.index.iter().filter(|(d, _)| keep.contains(*d)).map(|(_, l)| l.round).collect();
        let doomed: HashSet<u64> =
            inner.index.values().map(|l| l.round).filter(|r| !needed.contains(r) && (startup || *r < keep_from.0)).collect();
        inner.index.retain(|_, l| !doomed.contains(&l.round));
        for round in &doomed {
            inner.open.remove(round);
            inner.dirty.remove(round);
            let _ = std::fs::remove_file(self.dir.join(segment_name(*round)));
        }
        Ok(doomed.len())
    }
}

/// Indexes the entries of one segment, truncating it at the first torn or damaged one.
fn scan(path: &Path, round: u64, index: &mut HashMap<Digest, Loc>) -> io::Result<()> {
    let mut file = OpenOptions::new().read(true).write(true).open(path)?;
    let size = file.metadata()?.len();
    let mut bytes = Vec::with_capacity(size as usize);
    file.read_to_end(&mut bytes)?;
    let mut at = 0u64;
    while at + HEADER <= size {
        let h = at as usize;
        let digest = Digest(bytes[h..h + 32].try_into().expect("32 bytes"));
        let len = u64::from_le_bytes(bytes[h + 32..h + 40].try_into().expect("8 bytes"));
        let start = at + HEADER;
        if len > size - start || Digest::of(&bytes[start as usize..(start + len) as usize]) != digest {
            break;
        }
        index.insert(digest, Loc { round, offset: start, len });
        at = start + len;
    }
    if at < size {
        tracing::warn!(segment = %path.display(), kept = at, dropped = size - at, "truncating a torn payload segment");
        file.set_len(at)?;
        file.sync_data()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_survive_a_reopen_and_a_torn_tail_is_cut_off() {
        let dir = tempfile::tempdir().unwrap();
        let payloads: Vec<Vec<u8>> = (0..5u8).map(|i| vec![i; 1000 + i as usize]).collect();
        {
            let s = Segments::open(dir.path()).unwrap();
            for (i, p) in payloads.iter().enumerate() {
                s.put(RoundId(1 + (i as u64 % 2)), &Digest::of(p), p).unwrap();
            }
            s.put(RoundId(1), &Digest::of(&payloads[0]), &payloads[0]).unwrap(); // a resend: not twice
            s.sync().unwrap();
        }
        let seg1 = dir.path().join("1.seg");
        let full = std::fs::metadata(&seg1).unwrap().len();
        assert_eq!(full, 3 * HEADER + 1000 + 1002 + 1004, "round 1 holds payloads 0, 2, 4 once each");
        // A crash mid-append: half an entry at the end.
        let mut f = OpenOptions::new().append(true).open(&seg1).unwrap();
        f.write_all(&Digest::of(b"torn").0).unwrap();
        f.write_all(&100u64.to_le_bytes()).unwrap();
        f.write_all(&[9; 10]).unwrap();
        drop(f);
        let s = Segments::open(dir.path()).unwrap();
        assert_eq!(std::fs::metadata(&seg1).unwrap().len(), full, "the torn entry is cut off");
        for p in &payloads {
            assert_eq!(s.get(&Digest::of(p)).unwrap().as_deref(), Some(p.as_slice()));
        }
        assert_eq!(s.get(&Digest::of(b"torn")).unwrap(), None);
        // New appends follow the last good entry.
        s.put(RoundId(1), &Digest::of(b"next"), b"next").unwrap();
        drop(s);
        assert_eq!(Segments::open(dir.path()).unwrap().get(&Digest::of(b"next")).unwrap().as_deref(), Some(b"next".as_slice()));
    }

    #[test]
    fn retain_drops_old_segments_unless_a_kept_payload_lives_there() {
        let dir = tempfile::tempdir().unwrap();
        let s = Segments::open(dir.path()).unwrap();
        let (a, b, c) = (b"round one".as_slice(), b"trained for one, folded into three".as_slice(), b"round two".as_slice());
        s.put(RoundId(1), &Digest::of(a), a).unwrap();
        s.put(RoundId(1), &Digest::of(b), b).unwrap();
        s.put(RoundId(2), &Digest::of(c), c).unwrap();
        let keep: HashSet<Digest> = [Digest::of(b)].into();
        assert_eq!(s.retain(&keep, RoundId(3), false).unwrap(), 1, "round 2's segment goes");
        assert!(s.contains(&Digest::of(a)) && s.contains(&Digest::of(b)), "round 1 holds a kept payload");
        assert!(!s.contains(&Digest::of(c)) && !dir.path().join("2.seg").exists());
        assert_eq!(s.retain(&HashSet::new(), RoundId(3), false).unwrap(), 1);
        assert!(!dir.path().join("1.seg").exists());
    }
}
