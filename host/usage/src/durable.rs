//! The open windows' counts in a memory-mapped file beside the spool (`open.counts`), so
//! that `kill -9` of the node loses no counted call: the process's stores to the mapping
//! are the kernel's page cache, which outlives the process (only a crash of the machine
//! loses what was not yet written back).
//!
//! ```text
//! header (4 KiB)   magic "PSTNCNT1", slot size, shards, slots a shard, and the spool's
//!                  next number when this run began counting
//! shard 0          SLOTS slots of SLOT bytes, then shard 1, … (each its own mapping)
//! slot             window + 1 (0: free) u64, kind u8, three name lengths u8,
//!                  status [u64; 5], latency_us u64, latency [u64; LATENCY_BUCKETS],
//!                  caller, route, product (each at most NAME_MAX bytes)
//! ```
//!
//! A row's slot is taken under its shard's lock when the row first counts (its names
//! written before its window, so a slot with a window is whole) and given back once its
//! window is in the spool. A call adds its latency bucket and time before its status
//! class, so a row torn by a kill counts its status and its histogram is trimmed to it.
//! At start the slots of the last run are read back: windows the spool took after that
//! run began (the spool keeps the start of its newest record) are skipped, the others
//! become recovered windows; then the file starts afresh. A row that finds no free slot,
//! or whose names are too long, counts in memory only (`not_durable`).
//!
//! The file is the node's own, in its spool directory. Everything read back is bounded:
//! a slot out of shape (a length, a kind, a count past what one row may hold) is skipped
//! and named in the log, never trusted.
#![allow(unsafe_code)]

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use memmap2::{MmapMut, MmapOptions};
use postern_model::usage::{CallerKind, LATENCY_BUCKETS, MAX_ROW_CALLS};

use crate::meter::{Counts, SHARDS, WindowRows};

/// Bytes a slot takes.
pub const SLOT: usize = 1024;
/// Slots a shard has.
pub const SLOTS: usize = 1024;
/// Bytes of a caller, route or product name a slot holds at most.
pub const NAME_MAX: usize = 255;
const HEADER: usize = 4096;
const MAGIC: &[u8; 8] = b"PSTNCNT1";
const REGION: usize = SLOT * SLOTS;

const KIND: usize = 8;
const LENS: usize = 9;
const STATUS: usize = 16;
const LATENCY_US: usize = STATUS + 5 * 8;
const LATENCY: usize = LATENCY_US + 8;
const NAMES: usize = LATENCY + LATENCY_BUCKETS * 8;
const _: () = assert!(NAMES + 3 * NAME_MAX <= SLOT, "a slot holds its names");
const _: () = assert!(REGION.is_multiple_of(4096), "a shard's mapping starts on a page");

/// The slots of one shard, used under the shard's lock.
#[derive(Debug)]
pub struct Slots {
    map: MmapMut,
    /// Slots given back, to take before any never used.
    free: Vec<u32>,
    /// The first slot never used in this run.
    fresh: u32,
}

impl Slots {
    /// Takes a slot for the row (`window`, `kind`, `caller`, `route`) of `product`; `None`
    /// when every slot is taken or a name is too long.
    pub fn take(&mut self, window: u64, kind: CallerKind, caller: &[u8], route: &str, product: &str) -> Option<u32> {
        let names = [caller, route.as_bytes(), product.as_bytes()];
        if names.iter().any(|n| n.len() > NAME_MAX) {
            return None;
        }
        let slot = match self.free.pop() {
            Some(s) => s,
            None if (self.fresh as usize) < SLOTS => {
                self.fresh += 1;
                self.fresh - 1
            }
            None => return None,
        };
        let base = slot as usize * SLOT;
        let s = self.map.get_mut(base..base + SLOT)?;
        s[KIND..NAMES].fill(0);
        s[KIND] = kind as u8;
        let mut at = NAMES;
        for (i, n) in names.iter().enumerate() {
            s[LENS + i] = n.len() as u8;
            s[at..at + n.len()].copy_from_slice(n);
            at += NAME_MAX;
        }
        // Last: a slot with a window is whole.
        put(s, 0, window + 1);
        Some(slot)
    }

    /// Adds one call to `slot`: its latency bucket and time, then its status class.
    pub fn add(&mut self, slot: u32, class: usize, bucket: usize, us: u64) {
        let base = slot as usize * SLOT;
        let Some(s) = self.map.get_mut(base..base + SLOT) else { return };
        bump(s, LATENCY + bucket.min(LATENCY_BUCKETS - 1) * 8, 1);
        bump(s, LATENCY_US, us);
        bump(s, STATUS + class.min(4) * 8, 1);
    }

    /// Gives `slot` back: its window is in the spool.
    pub fn give_back(&mut self, slot: u32) {
        let base = slot as usize * SLOT;
        if let Some(s) = self.map.get_mut(base..base + 8) {
            put(s, 0, 0);
            self.free.push(slot);
        }
    }
}

fn get(s: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    if let Some(src) = s.get(at..at + 8) {
        b.copy_from_slice(src);
    }
    u64::from_le_bytes(b)
}

fn put(s: &mut [u8], at: usize, v: u64) {
    if let Some(dst) = s.get_mut(at..at + 8) {
        dst.copy_from_slice(&v.to_le_bytes());
    }
}

fn bump(s: &mut [u8], at: usize, n: u64) {
    put(s, at, get(s, at).wrapping_add(n));
}

/// What the last run left: its windows by number, and the spool's next number when it
/// began counting.
#[derive(Debug, Default)]
pub struct Found {
    /// The spool's next number when the run that wrote the file began.
    pub next: u64,
    /// Its rows by window.
    pub windows: BTreeMap<u64, WindowRows>,
    /// Slots skipped as out of shape.
    pub skipped: u64,
}

/// The file of a node's open counts.
#[derive(Debug)]
pub struct Durable {
    path: PathBuf,
}

impl Durable {
    /// The file in spool directory `dir`.
    pub fn in_dir(dir: &Path) -> Durable {
        Durable { path: dir.join("open.counts") }
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads what the last run left (nothing if there is no file).
    pub fn read(&self) -> std::io::Result<Found> {
        let mut file = match File::open(&self.path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Found::default()),
            Err(e) => return Err(e),
        };
        let mut header = vec![0u8; HEADER];
        if file.read_exact(&mut header).is_err() || &header[..8] != MAGIC {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "not a counts file (its magic)"));
        }
        let shape = (get(&header, 8), get(&header, 16) & 0xffff_ffff, get(&header, 16) >> 32);
        if shape != (SLOT as u64, SHARDS as u64, SLOTS as u64) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("counts file of another shape (slot, shards, slots) {shape:?}"),
            ));
        }
        let next = get(&header, 24);
        let mut found = Found { next, ..Found::default() };
        let mut slot = vec![0u8; SLOT];
        let mut region = vec![0u8; REGION];
        for _ in 0..SHARDS {
            // A file cut short (a full disk at its creation) ends what can be read.
            let mut whole = Read::by_ref(&mut file).take(REGION as u64);
            region.clear();
            whole.read_to_end(&mut region)?;
            for chunk in region.chunks_exact(SLOT) {
                slot.copy_from_slice(chunk);
                if get(&slot, 0) == 0 {
                    continue;
                }
                match read_slot(&slot) {
                    Some((window, key, counts)) if counts.calls() > 0 => {
                        merge(found.windows.entry(window).or_default(), key, counts);
                    }
                    Some(_) => {}
                    None => found.skipped += 1,
                }
            }
        }
        Ok(found)
    }

    /// Starts the file afresh for a run that begins counting at the spool's number `next`,
    /// and maps each shard's slots.
    pub fn create(&self, next: u64) -> std::io::Result<Vec<Slots>> {
        let tmp = self.path.with_extension("counts.tmp");
        {
            let mut file = OpenOptions::new().write(true).create(true).truncate(true).open(&tmp)?;
            let mut header = [0u8; 32];
            header[..8].copy_from_slice(MAGIC);
            put(&mut header, 8, SLOT as u64);
            put(&mut header, 16, SHARDS as u64 | ((SLOTS as u64) << 32));
            put(&mut header, 24, next);
            file.write_all(&header)?;
            // Sparse: a page takes room once a row is counted in it.
            file.set_len((HEADER + SHARDS * REGION) as u64)?;
            file.sync_all()?;
        }
        std::fs::rename(&tmp, &self.path)?;
        if let Some(dir) = self.path.parent() {
            File::open(dir)?.sync_all()?;
        }
        let file = OpenOptions::new().read(true).write(true).open(&self.path)?;
        (0..SHARDS)
            .map(|i| {
                // SAFETY: the file is this node's own (its spool directory, which one node
                // process uses at a time) and stays at its full length while mapped; each
                // shard maps its own region, used only under that shard's lock, so no two
                // mappings alias. Another process writing the file would change counts (read
                // back bounded, as any hostile file) but not this process's memory safety
                // beyond those bytes.
                let map =
                    unsafe { MmapOptions::new().offset((HEADER + i * REGION) as u64).len(REGION).map_mut(&file) }?;
                Ok(Slots { map, free: Vec::new(), fresh: 0 })
            })
            .collect()
    }
}

/// A row's key in a window: who, and on which route.
type RowKey = (CallerKind, Bytes, Arc<str>);

/// One slot read back: its window, row key and counts; `None` if out of shape.
fn read_slot(s: &[u8]) -> Option<(u64, RowKey, Counts)> {
    let window = get(s, 0).checked_sub(1)?;
    let kind = match s[KIND] {
        k if k == CallerKind::Key as u8 => CallerKind::Key,
        k if k == CallerKind::App as u8 => CallerKind::App,
        _ => return None,
    };
    let mut names = [&[][..]; 3];
    for (i, n) in names.iter_mut().enumerate() {
        let len = usize::from(s[LENS + i]);
        let at = NAMES + i * NAME_MAX;
        *n = s.get(at..at + len)?;
    }
    let route: Arc<str> = std::str::from_utf8(names[1]).ok()?.into();
    let product: Arc<str> = std::str::from_utf8(names[2]).ok()?.into();
    let mut counts = Counts::new(product);
    for (i, c) in counts.status.iter_mut().enumerate() {
        *c = get(s, STATUS + i * 8);
    }
    for (i, c) in counts.latency.iter_mut().enumerate() {
        *c = get(s, LATENCY + i * 8);
    }
    counts.latency_us = get(s, LATENCY_US);
    let calls = counts.status.iter().try_fold(0u64, |a, &c| a.checked_add(c))?;
    if calls > MAX_ROW_CALLS || counts.latency.iter().any(|&c| c > MAX_ROW_CALLS) {
        return None;
    }
    // A call cut by the kill between its bucket and its status class: the status stands.
    let mut extra = counts.latency.iter().sum::<u64>().checked_sub(calls)?;
    for b in counts.latency.iter_mut().rev() {
        let cut = extra.min(*b);
        *b -= cut;
        extra -= cut;
    }
    Some((window, (kind, Bytes::copy_from_slice(names[0]), route), counts))
}

fn merge(into: &mut WindowRows, key: RowKey, c: Counts) {
    match into.entry(key) {
        std::collections::btree_map::Entry::Occupied(mut e) => e.get_mut().add(&c),
        std::collections::btree_map::Entry::Vacant(e) => {
            e.insert(c);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::time::{Duration, Instant};

    use super::*;
    use crate::meter::{Call, Meter};

    const T0: u64 = 1_796_083_200 * 1_000_000; // 2026-12-01T00:00:00Z

    fn call<'a>(k: &'a Bytes, r: &'a Arc<str>, p: &'a Arc<str>, status: u16, at: Instant, ms: u64) -> Call<'a> {
        Call { kind: CallerKind::Key, caller: k, route: r, product: p, status, at, latency: Duration::from_millis(ms) }
    }

    #[test]
    fn counts_stay_in_the_file_until_their_window_is_spooled() {
        let dir = tempfile::tempdir().unwrap();
        let file = Durable::in_dir(dir.path());
        assert!(file.read().unwrap().windows.is_empty(), "no file: nothing found");
        let t = Instant::now();
        let m = Meter::with_anchor(t, T0);
        m.keep_in(file.create(7).unwrap());
        let (k, r, p): (Bytes, Arc<str>, Arc<str>) = (Bytes::from_static(b"k-1"), "t/r".into(), "search".into());
        let w0 = T0 / 10_000_000;
        for _ in 0..3 {
            m.count(&call(&k, &r, &p, 200, t, 4));
        }
        m.count(&call(&k, &r, &p, 200, t + Duration::from_secs(10), 4));
        m.count(&call(&k, &r, &p, 503, t + Duration::from_secs(11), 40));
        // Closed but not yet in the spool: still found, as the kill would leave it.
        let closed = m.close_before(w0 + 1);
        let found = file.read().unwrap();
        assert_eq!(found.next, 7);
        assert_eq!(found.windows.keys().copied().collect::<Vec<_>>(), vec![w0, w0 + 1]);
        let key = (CallerKind::Key, k.clone(), r.clone());
        let f0 = &found.windows[&w0][&key];
        assert_eq!((f0.status, f0.latency_us, &*f0.product), (closed[&w0][&key].status, 12_000, "search"));
        // Spooled: its slots are given back and taken again by the next row.
        m.spooled(w0);
        let found = file.read().unwrap();
        assert_eq!(found.windows.keys().copied().collect::<Vec<_>>(), vec![w0 + 1]);
        let f1 = &found.windows[&(w0 + 1)][&key];
        assert_eq!((f1.status, f1.latency_us, f1.latency.iter().sum::<u64>()), ([0, 1, 0, 0, 1], 44_000, 2));
        assert_eq!(m.not_durable(), 0);
        let k2 = Bytes::from_static(b"k-2");
        m.count(&call(&k2, &r, &p, 200, t + Duration::from_secs(12), 4));
        let found = file.read().unwrap();
        assert_eq!(found.windows[&(w0 + 1)].len(), 2);
        // A new run starts the file afresh.
        drop(m);
        let _slots = file.create(9).unwrap();
        let found = file.read().unwrap();
        assert_eq!((found.next, found.windows.len()), (9, 0));
    }

    #[test]
    fn a_call_cut_by_the_kill_counts_by_its_status_and_a_slot_out_of_shape_is_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let file = Durable::in_dir(dir.path());
        let mut shards = file.create(1).unwrap();
        let s = &mut shards[0];
        let whole = s.take(5, CallerKind::App, b"app-1", "t/r", "p").unwrap();
        s.add(whole, 1, 3, 100);
        s.add(whole, 1, 3, 100);
        // Killed between the bucket and the status class of the third call.
        bump(&mut s.map[whole as usize * SLOT..], LATENCY + 20 * 8, 1);
        let bad_kind = s.take(5, CallerKind::Key, b"k", "t/r", "p").unwrap();
        s.add(bad_kind, 1, 0, 1);
        s.map[bad_kind as usize * SLOT + KIND] = 9;
        let too_many = s.take(5, CallerKind::Key, b"k2", "t/r", "p").unwrap();
        put(&mut s.map[too_many as usize * SLOT..], STATUS + 8, MAX_ROW_CALLS + 1);
        let bad_name = s.take(5, CallerKind::Key, b"k3", "t/r", "p").unwrap();
        s.add(bad_name, 1, 0, 1);
        s.map[bad_name as usize * SLOT + NAMES + NAME_MAX] = 0xff;
        // Too long a name takes no slot: that row counts in memory only.
        assert_eq!(s.take(5, CallerKind::Key, &[b'x'; NAME_MAX + 1], "t/r", "p"), None);
        drop(shards);
        let found = file.read().unwrap();
        assert_eq!(found.skipped, 3);
        let rows = &found.windows[&5];
        assert_eq!(rows.len(), 1);
        let c = &rows[&(CallerKind::App, Bytes::from_static(b"app-1"), Arc::from("t/r"))];
        assert_eq!((c.status, c.latency[3], c.latency[20], c.latency_us), ([0, 2, 0, 0, 0], 2, 0, 200));
    }

    #[test]
    fn a_file_that_is_not_a_counts_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let file = Durable::in_dir(dir.path());
        std::fs::write(file.path(), b"{\"not\": \"counts\"}").unwrap();
        assert_eq!(file.read().unwrap_err().kind(), std::io::ErrorKind::InvalidData);
        let mut header = vec![0u8; HEADER];
        header[..8].copy_from_slice(MAGIC);
        put(&mut header, 8, 512);
        std::fs::write(file.path(), &header).unwrap();
        let e = file.read().unwrap_err();
        assert!(e.to_string().contains("another shape"), "{e}");
    }
}
