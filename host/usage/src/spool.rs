//! The node's usage spool: closed windows on local disk until the usage stream has
//! acknowledged them, and for a while after, for re-sends the reconciler asks for.
//!
//! ```text
//! <dir>/head.json              {"node", "next", "acked"}: written whole (temp, fsync, rename)
//! <dir>/seg-<first seq>.log    records [len u32 LE][crc32 u32 LE][window JSON], each fsynced
//! <dir>/open.counts            the open windows' counts, memory-mapped (see `durable`)
//! ```
//!
//! A record is spooled once its bytes and the file's data are synced. At open every
//! segment is read through: a record cut short or failing its CRC ends its segment,
//! which is truncated there (a crash tears at most the tail being written). Sequence
//! numbers run on across segments and restarts and are never reused: `head.json` keeps
//! the next one even when every segment has been freed.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use postern_model::disk;
use serde::{Deserialize, Serialize};

/// Bytes before each record: its length and its CRC-32.
const FRAME: u64 = 8;
/// The largest record a segment may hold.
const MAX_RECORD: u32 = 256 << 20;

/// Why the spool could not take or give a record.
#[derive(Debug, thiserror::Error)]
pub enum SpoolError {
    /// Writing, syncing or reading failed (a full disk, a lost device).
    #[error("usage spool {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    /// The spool holds as much as it may; unacknowledged records are never dropped.
    #[error("usage spool full: {used} bytes of {cap}, all of it not yet acknowledged")]
    Full {
        /// Bytes held.
        used: u64,
        /// The cap.
        cap: u64,
    },
    /// The spool belongs to another node.
    #[error("usage spool {dir} belongs to node {owner}, not {node}: give it its own directory")]
    Owner {
        /// The spool directory.
        dir: PathBuf,
        /// The node it was made for.
        owner: String,
        /// The node opening it.
        node: String,
    },
    /// A file of the spool is not what it should be.
    #[error("usage spool {path}: {why}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> SpoolError + '_ {
    move |source| SpoolError::Io { path: path.to_path_buf(), source }
}

#[derive(Debug, Serialize, Deserialize)]
struct Head {
    node: String,
    next: u64,
    acked: u64,
    /// The start of the newest record (kept when its segment is freed).
    #[serde(default)]
    last_start: u64,
}

/// The fields of a record the index needs.
#[derive(Deserialize)]
struct RecordHead {
    seq: u64,
    start: u64,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    seq: u64,
    start: u64,
    offset: u64,
    len: u32,
}

#[derive(Debug)]
struct Segment {
    path: PathBuf,
    len: u64,
    entries: Vec<Entry>,
    /// When its last record was written.
    written: SystemTime,
}

/// Sizes and ages the spool keeps to.
#[derive(Debug, Clone, Copy)]
pub struct SpoolLimits {
    /// Bytes of segments at most.
    pub cap: u64,
    /// A segment is closed and a new one started past this size.
    pub segment: u64,
    /// Acknowledged segments are kept this long for re-sends (unless space is needed).
    pub retain: Duration,
}

impl SpoolLimits {
    /// The defaults with a size cap of `cap` bytes; segments are an eighth of it at most,
    /// so acknowledged ones can be freed long before the cap.
    pub fn with_cap(cap: u64) -> SpoolLimits {
        let d = SpoolLimits::default();
        SpoolLimits { cap, segment: d.segment.min((cap / 8).max(1)), ..d }
    }
}

impl Default for SpoolLimits {
    fn default() -> SpoolLimits {
        SpoolLimits { cap: 1 << 30, segment: 16 << 20, retain: Duration::from_secs(48 * 3600) }
    }
}

/// What opening found.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Opened {
    /// Records in the spool.
    pub records: usize,
    /// Bytes cut from torn or corrupt tails.
    pub cut_bytes: u64,
}

/// The spool of one node.
#[derive(Debug)]
pub struct Spool {
    dir: PathBuf,
    node: String,
    limits: SpoolLimits,
    segments: Vec<Segment>,
    /// The append handle on the last segment.
    file: Option<File>,
    next: u64,
    acked: u64,
    /// The start of the newest record appended (windows close in order).
    last_start: u64,
}

impl Spool {
    /// The node a spool in `dir` was made for, if there is one.
    pub fn owner(dir: &Path) -> Result<Option<String>, SpoolError> {
        let path = dir.join("head.json");
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice::<Head>(&bytes)
                .map(|h| Some(h.node))
                .map_err(|e| SpoolError::Corrupt { path, why: e.to_string() }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(SpoolError::Io { path, source: e }),
        }
    }

    /// Opens (or makes) the spool in `dir` for `node`: reads every segment, cuts torn
    /// tails, and refuses a spool made for another node.
    pub fn open(dir: &Path, node: &str, limits: SpoolLimits) -> Result<(Spool, Opened), SpoolError> {
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let head_path = dir.join("head.json");
        let head = match std::fs::read(&head_path) {
            Ok(bytes) => serde_json::from_slice::<Head>(&bytes)
                .map_err(|e| SpoolError::Corrupt { path: head_path.clone(), why: e.to_string() })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Head { node: node.to_owned(), next: 1, acked: 0, last_start: 0 }
            }
            Err(e) => return Err(SpoolError::Io { path: head_path, source: e }),
        };
        if head.node != node {
            return Err(SpoolError::Owner { dir: dir.to_path_buf(), owner: head.node, node: node.to_owned() });
        }
        let mut names: Vec<(u64, PathBuf)> = std::fs::read_dir(dir)
            .map_err(io(dir))?
            .filter_map(Result::ok)
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                let first = name.strip_prefix("seg-")?.strip_suffix(".log")?.parse().ok()?;
                Some((first, e.path()))
            })
            .collect();
        names.sort();
        let mut opened = Opened::default();
        let mut segments = Vec::with_capacity(names.len());
        let mut next = head.next.max(1);
        let mut last_start = head.last_start;
        for (_, path) in names {
            let (seg, cut) = scan(&path)?;
            opened.cut_bytes += cut;
            opened.records += seg.entries.len();
            if let Some(last) = seg.entries.last() {
                next = next.max(last.seq + 1);
                last_start = last_start.max(last.start);
            }
            segments.push(seg);
        }
        let spool = Spool {
            dir: dir.to_path_buf(),
            node: node.to_owned(),
            limits,
            segments,
            file: None,
            next,
            acked: head.acked,
            last_start,
        };
        spool.write_head()?;
        Ok((spool, opened))
    }

    /// The size cap.
    pub fn cap(&self) -> u64 {
        self.limits.cap
    }

    /// The sequence number the next record gets.
    pub fn next_seq(&self) -> u64 {
        self.next
    }

    /// The highest sequence number acknowledged by the usage stream.
    pub fn acked(&self) -> u64 {
        self.acked
    }

    /// Bytes of segments held.
    pub fn bytes(&self) -> u64 {
        self.segments.iter().map(|s| s.len).sum()
    }

    /// Records not yet acknowledged.
    pub fn unacked(&self) -> u64 {
        self.next.saturating_sub(self.acked + 1)
    }

    /// The start of the newest record if one was appended with `seq >= from` (freed or
    /// not: the head keeps it).
    pub fn last_start_since(&self, from: u64) -> Option<u64> {
        (self.next > from).then_some(self.last_start)
    }

    /// Appends one record made by `make(seq)` for the next sequence number, synced
    /// before it returns. On any error nothing is spooled and the number is not used.
    pub fn append(&mut self, make: impl FnOnce(u64) -> Vec<u8>) -> Result<u64, SpoolError> {
        let seq = self.next;
        let body = make(seq);
        let len = u32::try_from(body.len()).ok().filter(|&l| l <= MAX_RECORD).ok_or_else(|| SpoolError::Corrupt {
            path: self.dir.clone(),
            why: format!("a record of {} bytes is over the limit", body.len()),
        })?;
        let need = FRAME + u64::from(len);
        if self.bytes() + need > self.limits.cap {
            self.free(need)?;
            if self.bytes() + need > self.limits.cap {
                return Err(SpoolError::Full { used: self.bytes(), cap: self.limits.cap });
            }
        }
        if self.segments.last().is_none_or(|s| s.len >= self.limits.segment) || self.file.is_none() {
            self.roll(seq)?;
        }
        let Some(seg) = self.segments.last_mut() else {
            return Err(SpoolError::Corrupt { path: self.dir.clone(), why: "no segment to write".into() });
        };
        let Some(file) = self.file.as_mut() else {
            return Err(SpoolError::Corrupt { path: seg.path.clone(), why: "segment not open".into() });
        };
        let mut frame = Vec::with_capacity(need as usize);
        frame.extend_from_slice(&len.to_le_bytes());
        frame.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
        frame.extend_from_slice(&body);
        let offset = seg.len;
        let wrote = file.write_all(&frame).and_then(|()| file.sync_data());
        if let Err(e) = wrote {
            // Leave no partial record behind: cut back to the last good one.
            let _ = file.set_len(offset);
            let _ = file.seek(SeekFrom::Start(offset));
            return Err(SpoolError::Io { path: seg.path.clone(), source: e });
        }
        let start = serde_json::from_slice::<RecordHead>(&body).map_or(0, |h| h.start);
        seg.entries.push(Entry { seq, start, offset, len });
        seg.len += need;
        seg.written = SystemTime::now();
        self.next = seq + 1;
        self.last_start = self.last_start.max(start);
        // The head keeps the number too, so a record damaged on disk later (not a torn
        // tail: this one was synced) never gets its number reused. If this write fails
        // the record itself still carries it.
        let _ = self.write_head();
        Ok(seq)
    }

    /// Starts a new segment whose first record is `seq`.
    fn roll(&mut self, seq: u64) -> Result<(), SpoolError> {
        let reuse = self.segments.last().is_some_and(|s| s.len < self.limits.segment);
        let path = match self.segments.last() {
            Some(s) if reuse => s.path.clone(),
            _ => self.dir.join(format!("seg-{seq:020}.log")),
        };
        let file = OpenOptions::new().create(true).append(true).open(&path).map_err(io(&path))?;
        if !reuse {
            // The new name must survive a crash as well as the records in it.
            File::open(&self.dir).and_then(|d| d.sync_all()).map_err(io(&self.dir))?;
            self.segments.push(Segment { path, len: 0, entries: Vec::new(), written: SystemTime::now() });
        }
        self.file = Some(file);
        Ok(())
    }

    /// Records from `from` on, at most `max` of them or `max_bytes` (at least one), as
    /// stored: `(seq, window JSON)`.
    pub fn read(&self, from: u64, max: usize, max_bytes: u64) -> Result<Vec<(u64, Vec<u8>)>, SpoolError> {
        let mut out = Vec::new();
        let mut bytes = 0u64;
        for seg in &self.segments {
            if seg.entries.last().is_none_or(|e| e.seq < from) {
                continue;
            }
            let mut file = File::open(&seg.path).map_err(io(&seg.path))?;
            for e in seg.entries.iter().filter(|e| e.seq >= from) {
                if out.len() >= max || (!out.is_empty() && bytes + u64::from(e.len) > max_bytes) {
                    return Ok(out);
                }
                let mut buf = vec![0u8; e.len as usize];
                file.seek(SeekFrom::Start(e.offset + FRAME)).map_err(io(&seg.path))?;
                file.read_exact(&mut buf).map_err(io(&seg.path))?;
                bytes += u64::from(e.len);
                out.push((e.seq, buf));
            }
        }
        Ok(out)
    }

    /// The usage stream has every record up to `seq`: frees what is past keeping.
    pub fn ack(&mut self, seq: u64) -> Result<(), SpoolError> {
        if seq <= self.acked {
            return Ok(());
        }
        self.acked = seq.min(self.next.saturating_sub(1));
        self.write_head()?;
        self.free(0)
    }

    /// Deletes acknowledged segments (the one being written only once it is full) older
    /// than the retention, and more of them, oldest first, until `need` bytes fit under
    /// the cap.
    fn free(&mut self, need: u64) -> Result<(), SpoolError> {
        let now = SystemTime::now();
        while let Some(seg) = self.segments.first() {
            let acked = seg.entries.last().is_none_or(|e| e.seq <= self.acked);
            let old = now.duration_since(seg.written).unwrap_or_default() >= self.limits.retain;
            let tight = self.bytes() + need > self.limits.cap;
            // The segment being written goes only once it is full: the next append
            // starts a new one.
            let last = self.segments.len() == 1;
            if !acked || !(old || tight) || (last && seg.len < self.limits.segment) {
                break;
            }
            if last {
                self.file = None;
            }
            let seg = self.segments.remove(0);
            std::fs::remove_file(&seg.path).map_err(io(&seg.path))?;
        }
        Ok(())
    }

    fn write_head(&self) -> Result<(), SpoolError> {
        let head = Head { node: self.node.clone(), next: self.next, acked: self.acked, last_start: self.last_start };
        let path = self.dir.join("head.json");
        let bytes = serde_json::to_vec(&head).unwrap_or_default();
        disk::write_atomic(&path, &bytes).map_err(|e| SpoolError::Corrupt { path, why: e.to_string() })
    }

    /// Keeps `next` in the head (called at a clean stop, and on the closer's heartbeat).
    pub fn sync_head(&self) -> Result<(), SpoolError> {
        self.write_head()
    }

    /// The spool's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// Reads a segment through, truncating it at the first record that is cut short or
/// fails its CRC. Returns the segment and the bytes cut.
fn scan(path: &Path) -> Result<(Segment, u64), SpoolError> {
    let bytes = std::fs::read(path).map_err(io(path))?;
    let mut entries = Vec::new();
    let mut at = 0usize;
    let good = loop {
        let Some(frame) = bytes.get(at..at + FRAME as usize) else { break at };
        let len = u32::from_le_bytes([frame[0], frame[1], frame[2], frame[3]]);
        let crc = u32::from_le_bytes([frame[4], frame[5], frame[6], frame[7]]);
        let body_at = at + FRAME as usize;
        let Some(body) = bytes.get(body_at..body_at + len as usize) else { break at };
        if len > MAX_RECORD || crc32fast::hash(body) != crc {
            break at;
        }
        let Ok(head) = serde_json::from_slice::<RecordHead>(body) else { break at };
        entries.push(Entry { seq: head.seq, start: head.start, offset: at as u64, len });
        at = body_at + len as usize;
    };
    let cut = (bytes.len() - good) as u64;
    if cut > 0 {
        tracing::warn!(path = %path.display(), cut_bytes = cut, kept = entries.len(), "usage spool: a torn or corrupt tail was cut");
        let f = OpenOptions::new().write(true).open(path).map_err(io(path))?;
        f.set_len(good as u64).and_then(|()| f.sync_all()).map_err(io(path))?;
    }
    let written = std::fs::metadata(path).and_then(|m| m.modified()).unwrap_or_else(|_| SystemTime::now());
    Ok((Segment { path: path.to_path_buf(), len: good as u64, entries, written }, cut))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(seq: u64) -> Vec<u8> {
        format!(r#"{{"node":"n","seq":{seq},"start":{},"rows":[]}}"#, seq * 10).into_bytes()
    }

    fn limits() -> SpoolLimits {
        SpoolLimits { cap: 1 << 20, segment: 200, retain: Duration::from_secs(3600) }
    }

    #[test]
    fn records_survive_a_reopen_and_numbers_are_never_reused() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let (mut s, _) = Spool::open(dir.path(), "n", limits()).unwrap_or_else(|e| panic!("{e}"));
        for want in 1..=10 {
            assert_eq!(s.append(record).ok(), Some(want));
        }
        assert!(s.segments.len() > 1, "rolled over at 200 bytes");
        drop(s);
        let (mut s, opened) = Spool::open(dir.path(), "n", limits()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(opened, Opened { records: 10, cut_bytes: 0 });
        assert_eq!(s.next_seq(), 11);
        let got = s.read(4, 3, u64::MAX).unwrap_or_default();
        assert_eq!(got.iter().map(|r| r.0).collect::<Vec<_>>(), vec![4, 5, 6]);
        assert_eq!(got[0].1, record(4));
        assert_eq!(s.last_start_since(8), Some(100));
        // Everything acknowledged and past keeping: freed, but the numbering goes on.
        s.limits.retain = Duration::ZERO;
        s.ack(10).unwrap_or_else(|e| panic!("{e}"));
        assert!(s.segments.len() <= 1 && s.bytes() < 200, "only a segment still being written stays");
        assert_eq!(s.append(record).ok(), Some(11), "a freed spool numbers on");
        s.ack(11).unwrap_or_else(|e| panic!("{e}"));
        drop(s);
        let (s, _) = Spool::open(dir.path(), "n", limits()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((s.next_seq(), s.acked(), s.unacked()), (12, 11, 0));
        // The newest record's start outlives its segment (crash recovery reads it).
        assert_eq!((s.last_start_since(11), s.last_start_since(12)), (Some(110), None));
        assert!(Spool::open(dir.path(), "other", limits()).unwrap_err().to_string().contains("belongs to node n"));
    }

    #[test]
    fn a_torn_or_corrupt_tail_is_cut_at_the_last_good_record() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let big = SpoolLimits { segment: 1 << 20, ..limits() };
        let (mut s, _) = Spool::open(dir.path(), "n", big).unwrap_or_else(|e| panic!("{e}"));
        for _ in 0..3 {
            s.append(record).unwrap_or_else(|e| panic!("{e}"));
        }
        let path = s.segments[0].path.clone();
        let good = s.segments[0].len;
        drop(s);
        // A crash mid-write: half a frame at the end.
        let mut f = OpenOptions::new().append(true).open(&path).unwrap_or_else(|e| panic!("{e}"));
        f.write_all(&[50, 0, 0, 0, 1, 2]).unwrap_or_else(|e| panic!("{e}"));
        drop(f);
        let (mut s, opened) = Spool::open(dir.path(), "n", big).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(opened, Opened { records: 3, cut_bytes: 6 });
        assert_eq!(std::fs::metadata(&path).map(|m| m.len()).ok(), Some(good));
        assert_eq!(s.append(record).ok(), Some(4));
        drop(s);
        // A flipped byte inside the last record: it and what follows are cut.
        let mut bytes = std::fs::read(&path).unwrap_or_default();
        let n = bytes.len();
        bytes[n - 3] ^= 0x20;
        std::fs::write(&path, &bytes).unwrap_or_else(|e| panic!("{e}"));
        let (s, opened) = Spool::open(dir.path(), "n", big).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(opened.records, 3);
        assert!(opened.cut_bytes > 0);
        assert_eq!(s.next_seq(), 5, "the cut record's number is not reused");
    }

    #[test]
    fn a_full_spool_refuses_new_records_and_keeps_every_unacknowledged_one() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let tight = SpoolLimits { cap: 300, segment: 100, retain: Duration::from_secs(3600) };
        let (mut s, _) = Spool::open(dir.path(), "n", tight).unwrap_or_else(|e| panic!("{e}"));
        let mut n = 0;
        while s.append(record).is_ok() {
            n += 1;
        }
        assert!(n >= 3, "{n}");
        assert!(matches!(s.append(record), Err(SpoolError::Full { .. })));
        assert_eq!(s.next_seq(), n + 1, "a refused record uses no number");
        assert_eq!(s.read(1, usize::MAX, u64::MAX).map(|r| r.len()).ok(), Some(n as usize));
        // Acknowledged (even within retention) makes room: the oldest segments go first.
        s.ack(n).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s.append(record).ok(), Some(n + 1));
    }
}
