//! A sliding window of two counts over ten buckets of atomic counters: adding is a few
//! relaxed atomic operations, summing reads the ten buckets. Counts from a slot a whole
//! window old are dropped as their bucket is reused.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Buckets in the window.
const BUCKETS: usize = 10;

#[derive(Debug, Default)]
struct Bucket {
    /// The bucket's slot number (ms since origin / bucket width, plus one); 0 unused.
    slot: AtomicU64,
    a: AtomicU32,
    b: AtomicU32,
}

/// Two counts (`a`, `b`) over a sliding window, on a clock of milliseconds since its
/// origin.
#[derive(Debug)]
pub(crate) struct Window {
    origin: Instant,
    bucket_ms: u64,
    buckets: [Bucket; BUCKETS],
}

impl Window {
    /// A window of `width` (at least 10 ms) whose clock starts at `origin`.
    pub(crate) fn new(width: Duration, origin: Instant) -> Window {
        let ms = u64::try_from(width.as_millis()).unwrap_or(u64::MAX).max(BUCKETS as u64);
        Window { origin, bucket_ms: ms / BUCKETS as u64, buckets: Default::default() }
    }

    /// `now` on the window's clock (saturating below `u64::MAX`, which callers may use
    /// as a marker).
    pub(crate) fn ms(&self, now: Instant) -> u64 {
        u64::try_from(now.saturating_duration_since(self.origin).as_millis()).unwrap_or(u64::MAX - 1)
    }

    fn slot(&self, ms: u64) -> u64 {
        ms / self.bucket_ms + 1
    }

    /// Adds to the counts of the bucket of `ms` (ms since the owner's origin).
    pub(crate) fn add(&self, ms: u64, a: u32, b: u32) {
        let slot = self.slot(ms);
        let bucket = &self.buckets[(slot % BUCKETS as u64) as usize];
        let seen = bucket.slot.load(Ordering::Acquire);
        if seen > slot {
            // A count for a slot whose bucket already moved on (a late caller): it has
            // left the window.
            return;
        }
        if seen != slot && bucket.slot.compare_exchange(seen, slot, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            // This bucket last counted a slot a whole window ago: start it again.
            bucket.a.store(0, Ordering::Relaxed);
            bucket.b.store(0, Ordering::Relaxed);
        }
        if a > 0 {
            bucket.a.fetch_add(a, Ordering::Relaxed);
        }
        if b > 0 {
            bucket.b.fetch_add(b, Ordering::Relaxed);
        }
    }

    /// The counts in the window that ends at `ms`.
    pub(crate) fn sum(&self, ms: u64) -> (u32, u32) {
        let slot = self.slot(ms);
        let oldest = slot.saturating_sub(BUCKETS as u64 - 1);
        let (mut a, mut b) = (0u32, 0u32);
        for bucket in &self.buckets {
            let s = bucket.slot.load(Ordering::Acquire);
            if s >= oldest && s <= slot {
                a = a.saturating_add(bucket.a.load(Ordering::Relaxed));
                b = b.saturating_add(bucket.b.load(Ordering::Relaxed));
            }
        }
        (a, b)
    }

    /// Forgets every count.
    pub(crate) fn clear(&self) {
        for bucket in &self.buckets {
            bucket.a.store(0, Ordering::Relaxed);
            bucket.b.store(0, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_leave_the_window_as_it_slides() {
        let w = Window::new(Duration::from_secs(10), Instant::now());
        w.add(0, 5, 1);
        w.add(4_999, 5, 2);
        assert_eq!(w.sum(5_000), (10, 3));
        // At 10.5 s the first second's bucket is out of the window.
        assert_eq!(w.sum(10_500), (5, 2));
        // Reusing its bucket drops its old counts.
        w.add(20_000, 1, 0);
        assert_eq!(w.sum(20_000), (1, 0));
        // A late count for a slot that bucket has left behind is dropped.
        w.add(10_000, 7, 7);
        assert_eq!(w.sum(20_000), (1, 0));
        w.clear();
        assert_eq!(w.sum(20_000), (0, 0));
    }
}
