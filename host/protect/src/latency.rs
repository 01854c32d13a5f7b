//! A cluster's latency against its normal, as a shedding signal: requests record how
//! long the backend took (one relaxed add into a power-of-two bucket), and a tick off
//! the request path takes the p99 of what arrived since the last tick and compares it
//! with the cluster's normal p99 — a slow moving average of the ticks' p99s, updated only
//! while the cluster is not slow, so a slow spell never becomes the normal.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

/// Bucket `i` holds latencies up to 2^i ms (the last one, anything longer).
const BUCKETS: usize = 17;
/// A tick with fewer samples says nothing.
const MIN_SAMPLES: u64 = 20;
/// Slow: a tick's p99 more than this many times the normal.
const FACTOR: u64 = 4;
/// The normal moves by 1/this of the difference per tick (at 250 ms, about a minute).
const SMOOTHING: u64 = 256;
/// Ticks with samples before the normal is trusted.
const WARM_TICKS: u32 = 8;

/// One cluster's latency record on a node.
#[derive(Debug, Default)]
pub struct Latency {
    buckets: [AtomicU64; BUCKETS],
    /// The counts at the last tick.
    seen: [AtomicU64; BUCKETS],
    /// The normal p99, in µs (0: none yet).
    normal_us: AtomicU64,
    /// The last tick's p99, in µs.
    last_us: AtomicU64,
    warm: AtomicU32,
}

impl Latency {
    /// Records one request's time to the backend's answer.
    pub fn observe(&self, took: Duration) {
        let ms = u64::try_from(took.as_millis()).unwrap_or(u64::MAX);
        let i = (u64::BITS - ms.saturating_sub(1).leading_zeros()) as usize;
        if let Some(b) = self.buckets.get(i.min(BUCKETS - 1)) {
            b.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// One tick (a single caller): whether the requests since the last tick were slow,
    /// their p99 over [`FACTOR`] × the normal.
    pub fn tick(&self) -> bool {
        let mut counts = [0u64; BUCKETS];
        for (i, c) in counts.iter_mut().enumerate() {
            let now = self.buckets[i].load(Ordering::Relaxed);
            *c = now.saturating_sub(self.seen[i].swap(now, Ordering::Relaxed));
        }
        let n: u64 = counts.iter().sum();
        if n < MIN_SAMPLES {
            return false;
        }
        // The bucket holding the 99th percentile, as its upper bound.
        let rank = (n * 99).div_ceil(100);
        let mut cum = 0;
        let i = counts.iter().position(|c| {
            cum += c;
            cum >= rank
        });
        let p99_us = 1000u64 << i.unwrap_or(BUCKETS - 1);
        self.last_us.store(p99_us, Ordering::Relaxed);
        let normal = self.normal_us.load(Ordering::Relaxed);
        let warm = self.warm.load(Ordering::Relaxed);
        let slow = warm >= WARM_TICKS && normal > 0 && p99_us > normal.saturating_mul(FACTOR);
        if !slow {
            let next = if normal == 0 {
                p99_us
            } else if p99_us >= normal {
                normal + (p99_us - normal).div_ceil(SMOOTHING)
            } else {
                normal - (normal - p99_us).div_ceil(SMOOTHING)
            };
            self.normal_us.store(next, Ordering::Relaxed);
            self.warm.store(warm.saturating_add(1), Ordering::Relaxed);
        }
        slow
    }

    /// (the normal p99, the last tick's p99), for `/readyz`.
    pub fn p99s(&self) -> (Duration, Duration) {
        let us = |a: &AtomicU64| Duration::from_micros(a.load(Ordering::Relaxed));
        (us(&self.normal_us), us(&self.last_us))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tick_with(l: &Latency, ms: u64, n: u32) -> bool {
        for _ in 0..n {
            l.observe(Duration::from_millis(ms));
        }
        l.tick()
    }

    #[test]
    fn a_cluster_far_slower_than_its_normal_is_slow_and_the_spell_does_not_become_normal() {
        let l = Latency::default();
        assert!(!l.tick(), "no samples: nothing to say");
        for _ in 0..WARM_TICKS {
            assert!(!tick_with(&l, 80, 100));
        }
        assert_eq!(l.p99s().0, Duration::from_millis(128), "80 ms falls in the 128 ms bucket");
        assert!(!tick_with(&l, 200, 100), "under four times the normal");
        assert!(tick_with(&l, 3000, 100), "3 s against a normal of 128 ms");
        for _ in 0..100 {
            assert!(tick_with(&l, 3000, 100), "still slow: a slow spell never becomes the normal");
        }
        assert!(!tick_with(&l, 80, 100), "back to normal");
        assert!(!tick_with(&l, 3000, 5), "too few samples to judge");
    }

    #[test]
    fn a_new_cluster_is_not_judged_before_it_has_a_normal() {
        let l = Latency::default();
        assert!(!tick_with(&l, 5000, 100));
        assert!(!tick_with(&l, 5000, 100));
    }
}
