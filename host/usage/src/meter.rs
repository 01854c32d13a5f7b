//! Counting on the request path: one short critical section per answered call.
//!
//! Rows live in [`SHARDS`] maps, each behind its own mutex; a thread always uses the
//! same shard (assigned round robin the first time it counts), so a worker's lock is
//! almost never contended. A row is keyed by (window, caller, route); looking one up
//! borrows the caller and route (`Equivalent`), so once a caller is counted in a window
//! nothing is cloned or allocated for it again, and an emptied map keeps its capacity.
//!
//! Closing is ordered by the shard locks, not by clocks: the closer first raises
//! `open_from` (the oldest window still open), then drains each shard of older rows.
//! A call counted after the closer passed its shard reads the raised `open_from` under
//! the same lock, so it lands in an open window: no call reaches a closed window, and
//! none is lost or counted twice, however late its thread ran.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use hashbrown::{Equivalent, HashMap};
use postern_model::usage::{CallerKind, LATENCY_BUCKETS, Row, WINDOW_S, latency_bucket};

use crate::durable::Slots;

/// Maps the rows are spread over.
pub const SHARDS: usize = 64;

/// One answered call, as [`Meter::count`] takes it.
#[derive(Debug, Clone, Copy)]
pub struct Call<'a> {
    /// What `caller` names.
    pub kind: CallerKind,
    /// The API key's id or the OAuth app's `client_id`.
    pub caller: &'a Bytes,
    /// The route, `team/name`.
    pub route: &'a Arc<str>,
    /// The route's product.
    pub product: &'a Arc<str>,
    /// The status answered.
    pub status: u16,
    /// When the answer's head was sent.
    pub at: Instant,
    /// From the request's start to `at`.
    pub latency: Duration,
}

/// One row's counts within its window.
#[derive(Debug, Clone)]
pub struct Counts {
    /// The route's product.
    pub product: Arc<str>,
    /// By status class (1xx..5xx).
    pub status: [u64; 5],
    /// Latency histogram ([`postern_model::usage::LATENCY_BOUNDS_MS`]).
    pub latency: [u64; LATENCY_BUCKETS],
    /// Sum of latencies, microseconds.
    pub latency_us: u64,
}

impl Counts {
    pub(crate) fn new(product: Arc<str>) -> Counts {
        Counts { product, status: [0; 5], latency: [0; LATENCY_BUCKETS], latency_us: 0 }
    }

    pub(crate) fn add(&mut self, o: &Counts) {
        for (a, b) in self.status.iter_mut().zip(o.status) {
            *a += b;
        }
        for (a, b) in self.latency.iter_mut().zip(o.latency) {
            *a += b;
        }
        self.latency_us += o.latency_us;
    }

    /// Calls counted.
    pub fn calls(&self) -> u64 {
        self.status.iter().sum()
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct RowKey {
    window: u64,
    kind: CallerKind,
    caller: Bytes,
    route: Arc<str>,
}

/// The borrowed form of a [`RowKey`]: hashes and compares the same.
struct KeyRef<'a> {
    window: u64,
    kind: CallerKind,
    caller: &'a [u8],
    route: &'a str,
}

fn hash_parts<H: Hasher>(h: &mut H, window: u64, kind: CallerKind, caller: &[u8], route: &str) {
    h.write_u64(window);
    h.write_u8(kind as u8);
    h.write(caller);
    h.write_u8(0xff);
    h.write(route.as_bytes());
}

impl Hash for RowKey {
    fn hash<H: Hasher>(&self, h: &mut H) {
        hash_parts(h, self.window, self.kind, &self.caller, &self.route);
    }
}

impl Hash for KeyRef<'_> {
    fn hash<H: Hasher>(&self, h: &mut H) {
        hash_parts(h, self.window, self.kind, self.caller, self.route);
    }
}

impl Equivalent<RowKey> for KeyRef<'_> {
    fn equivalent(&self, k: &RowKey) -> bool {
        self.window == k.window && self.kind == k.kind && self.caller == &k.caller[..] && self.route == &*k.route
    }
}

/// A cache line of its own per shard, so two workers' locks never share one.
#[repr(align(128))]
#[derive(Debug, Default)]
struct Shard(Mutex<ShardRows>);

/// A shard's rows, each with its slot in the counts file (if the meter has one and a
/// slot was free), and the slots of closed windows not yet in the spool, by window.
#[derive(Debug, Default)]
struct ShardRows {
    rows: HashMap<RowKey, (Counts, Option<u32>)>,
    slots: Option<Slots>,
    closing: BTreeMap<u64, Vec<u32>>,
}

/// One window's rows, merged over shards, in a stable order.
pub type WindowRows = BTreeMap<(CallerKind, Bytes, Arc<str>), Counts>;

/// The node's usage counters.
#[derive(Debug)]
pub struct Meter {
    shards: Box<[Shard]>,
    /// The oldest window still open (window numbers are Unix seconds / [`WINDOW_S`]).
    open_from: AtomicU64,
    /// A fixed pair of clocks: request times are this Unix time plus the monotonic time
    /// since, so a clock stepped back can never move a call into a closed window.
    anchor: (Instant, u64),
    /// Rows counted in memory only: no slot of the counts file was free (or none is kept).
    not_durable: AtomicU64,
}

thread_local! {
    static SHARD: Cell<usize> = const { Cell::new(usize::MAX) };
}
static NEXT_SHARD: AtomicUsize = AtomicUsize::new(0);

fn my_shard() -> usize {
    SHARD.with(|s| {
        let mut i = s.get();
        if i == usize::MAX {
            i = NEXT_SHARD.fetch_add(1, Ordering::Relaxed) % SHARDS;
            s.set(i);
        }
        i
    })
}

impl Default for Meter {
    fn default() -> Meter {
        Meter::new()
    }
}

impl Meter {
    /// Empty counters, on the system clock.
    pub fn new() -> Meter {
        let unix_us = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64);
        Meter::with_anchor(Instant::now(), unix_us)
    }

    /// Empty counters on a clock that reads `unix_us` at `at` (tests move time with it).
    pub fn with_anchor(at: Instant, unix_us: u64) -> Meter {
        let meter = Meter {
            shards: (0..SHARDS).map(|_| Shard::default()).collect(),
            open_from: AtomicU64::new(0),
            anchor: (at, unix_us),
            not_durable: AtomicU64::new(0),
        };
        meter.open_from.store(meter.window_of(at), Ordering::Relaxed);
        meter
    }

    /// Unix microseconds at `at`, on this meter's clock.
    pub fn unix_us(&self, at: Instant) -> u64 {
        let (base, unix) = self.anchor;
        unix + at.saturating_duration_since(base).as_micros() as u64
    }

    /// The window holding `at`.
    pub fn window_of(&self, at: Instant) -> u64 {
        self.unix_us(at) / (WINDOW_S * 1_000_000)
    }

    /// Counts one answered call.
    pub fn count(&self, call: &Call<'_>) {
        let Call { kind, caller, route, product, status, at, latency } = *call;
        let class = usize::from(status / 100).clamp(1, 5) - 1;
        let us = latency.as_micros() as u64;
        let bucket = latency_bucket(us);
        let window = self.window_of(at);
        let Some(shard) = self.shards.get(my_shard()) else { return };
        let mut rows = shard.0.lock().unwrap_or_else(|p| p.into_inner());
        // Read under the lock: see the module's note on closing.
        let window = window.max(self.open_from.load(Ordering::Acquire));
        let probe = KeyRef { window, kind, caller, route };
        let ShardRows { rows, slots, .. } = &mut *rows;
        let (counts, slot) = match rows.get_mut(&probe) {
            Some(c) => c,
            None => {
                let slot = slots.as_mut().and_then(|s| s.take(window, kind, caller, route, product));
                if slots.is_some() && slot.is_none() {
                    self.not_durable.fetch_add(1, Ordering::Relaxed);
                }
                rows.entry(RowKey { window, kind, caller: caller.clone(), route: route.clone() })
                    .or_insert_with(|| (Counts::new(product.clone()), slot))
            }
        };
        counts.status[class] += 1;
        if let Some(b) = counts.latency.get_mut(bucket) {
            *b += 1;
        }
        counts.latency_us += us;
        if let (Some(slot), Some(slots)) = (*slot, slots.as_mut()) {
            slots.add(slot, class, bucket, us);
        }
    }

    /// Keeps the open windows' counts in the counts file from now on (one [`Slots`] per
    /// shard): each row counted after this has a slot, given back once its window is in
    /// the spool ([`Meter::spooled`]).
    pub fn keep_in(&self, slots: Vec<Slots>) {
        for (shard, slots) in self.shards.iter().zip(slots) {
            shard.0.lock().unwrap_or_else(|p| p.into_inner()).slots = Some(slots);
        }
    }

    /// Gives back the slots of the closed window `window`, now in the spool.
    pub fn spooled(&self, window: u64) {
        for shard in &self.shards {
            let mut rows = shard.0.lock().unwrap_or_else(|p| p.into_inner());
            let ShardRows { slots, closing, .. } = &mut *rows;
            let (Some(slots), Some(taken)) = (slots.as_mut(), closing.remove(&window)) else { continue };
            for slot in taken {
                slots.give_back(slot);
            }
        }
    }

    /// Rows counted in memory only, as no slot of the counts file was free.
    pub fn not_durable(&self) -> u64 {
        self.not_durable.load(Ordering::Relaxed)
    }

    /// Closes every window before `window`: from now on calls count in `window` or later.
    /// Returns the closed windows' rows by window, oldest first.
    pub fn close_before(&self, window: u64) -> BTreeMap<u64, WindowRows> {
        self.open_from.fetch_max(window, Ordering::AcqRel);
        let mut out: BTreeMap<u64, WindowRows> = BTreeMap::new();
        for shard in &self.shards {
            let mut rows = shard.0.lock().unwrap_or_else(|p| p.into_inner());
            let ShardRows { rows, closing, .. } = &mut *rows;
            for (k, (c, slot)) in rows.extract_if(|k, _| k.window < window) {
                if let Some(slot) = slot {
                    closing.entry(k.window).or_default().push(slot);
                }
                merge(out.entry(k.window).or_default(), k, c);
            }
        }
        out
    }

    /// A copy of the rows of every open window (the checkpoint), by window.
    pub fn open_rows(&self) -> BTreeMap<u64, WindowRows> {
        let mut out: BTreeMap<u64, WindowRows> = BTreeMap::new();
        for shard in &self.shards {
            let rows = shard.0.lock().unwrap_or_else(|p| p.into_inner());
            for (k, (c, _)) in rows.rows.iter() {
                merge(out.entry(k.window).or_default(), k.clone(), c.clone());
            }
        }
        out
    }

    /// The oldest window still open.
    pub fn open_from(&self) -> u64 {
        self.open_from.load(Ordering::Acquire)
    }
}

fn merge(into: &mut WindowRows, k: RowKey, c: Counts) {
    match into.entry((k.kind, k.caller, k.route)) {
        std::collections::btree_map::Entry::Occupied(mut e) => e.get_mut().add(&c),
        std::collections::btree_map::Entry::Vacant(e) => {
            e.insert(c);
        }
    }
}

/// The rows of one window as the record carries them.
pub fn to_rows(rows: &WindowRows) -> Vec<Row> {
    rows.iter()
        .map(|((kind, caller, route), c)| Row {
            caller: String::from_utf8_lossy(caller).into_owned(),
            kind: *kind,
            product: c.product.to_string(),
            route: route.to_string(),
            status: c.status,
            latency: c.latency.to_vec(),
            latency_us: c.latency_us,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: u64 = 1_796_083_200 * 1_000_000; // 2026-12-01T00:00:00Z

    /// Counts one call of key `k` on route `r`.
    fn count(m: &Meter, k: &Bytes, r: &Arc<str>, p: &Arc<str>, status: u16, at: Instant, ms: u64) {
        m.count(&Call {
            kind: CallerKind::Key,
            caller: k,
            route: r,
            product: p,
            status,
            at,
            latency: Duration::from_millis(ms),
        });
    }

    fn meter() -> (Meter, Instant) {
        let now = Instant::now();
        (Meter::with_anchor(now, T0), now)
    }

    #[test]
    fn calls_land_in_their_window_and_each_closes_once() {
        let (m, t) = meter();
        let (k, r, p): (Bytes, Arc<str>, Arc<str>) = (Bytes::from_static(b"k-1"), "t/r".into(), "search".into());
        let w0 = T0 / 10_000_000;
        count(&m, &k, &r, &p, 200, t, 4);
        count(&m, &k, &r, &p, 503, t + Duration::from_secs(3), 40);
        count(&m, &k, &r, &p, 200, t + Duration::from_secs(10), 4);
        let closed = m.close_before(w0 + 1);
        assert_eq!(closed.len(), 1);
        let rows = &closed[&w0];
        let c = &rows[&(CallerKind::Key, k.clone(), r.clone())];
        assert_eq!(c.status, [0, 1, 0, 0, 1]);
        assert_eq!(c.latency_us, 44_000);
        assert_eq!(c.latency.iter().sum::<u64>(), 2);
        // Closing again finds nothing; the open window keeps its call.
        assert!(m.close_before(w0 + 1).is_empty());
        assert_eq!(m.open_rows()[&(w0 + 1)].values().map(Counts::calls).sum::<u64>(), 1);
    }

    #[test]
    fn a_call_timed_in_a_closed_window_counts_in_the_oldest_open_one() {
        let (m, t) = meter();
        let (k, r, p): (Bytes, Arc<str>, Arc<str>) = (Bytes::from_static(b"app"), "t/r".into(), "p".into());
        let w0 = T0 / 10_000_000;
        assert!(m.close_before(w0 + 2).is_empty());
        m.count(&Call {
            kind: CallerKind::App,
            caller: &k,
            route: &r,
            product: &p,
            status: 200,
            at: t,
            latency: Duration::ZERO,
        });
        let closed = m.close_before(w0 + 3);
        assert_eq!(closed.keys().copied().collect::<Vec<_>>(), vec![w0 + 2]);
    }

    #[test]
    fn threads_counting_at_once_lose_nothing_while_windows_close() {
        let m = Arc::new(Meter::new());
        let (r, p): (Arc<str>, Arc<str>) = ("t/r".into(), "p".into());
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let workers: Vec<_> = (0..4)
            .map(|i| {
                let (m, r, p) = (m.clone(), r.clone(), p.clone());
                std::thread::spawn(move || {
                    let k = Bytes::from(format!("k-{}", i % 2));
                    for _ in 0..50_000 {
                        m.count(&Call {
                            kind: CallerKind::Key,
                            caller: &k,
                            route: &r,
                            product: &p,
                            status: 200,
                            at: Instant::now(),
                            latency: Duration::from_micros(10),
                        });
                    }
                })
            })
            .collect();
        let closer = {
            let (m, stop) = (m.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut total = 0;
                let mut w = m.open_from();
                while !stop.load(Ordering::Relaxed) {
                    // Close faster than time moves: every call after a close is pushed on.
                    w += 1;
                    total += m.close_before(w).values().flat_map(|r| r.values()).map(Counts::calls).sum::<u64>();
                }
                total
            })
        };
        for w in workers {
            w.join().ok();
        }
        stop.store(true, Ordering::Relaxed);
        let closed = closer.join().unwrap_or_default();
        let rest: u64 = m.close_before(u64::MAX).values().flat_map(|r| r.values()).map(Counts::calls).sum();
        assert_eq!(closed + rest, 200_000);
    }
}
