//! A retry budget per cluster per node: retries in a sliding window may be at most a
//! share of the requests first sent in it, or a small floor, whichever is more. When it
//! is spent, failures are answered as they are, so retries can never multiply the load
//! of a backend that is already failing.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::window::Window;

/// How much a cluster may retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetConfig {
    /// The sliding window requests and retries are counted over.
    pub window: Duration,
    /// Retries may be this percentage of the requests in the window...
    pub percent: u8,
    /// ...or this many, whichever is more.
    pub min_retries: u32,
}

impl Default for BudgetConfig {
    /// 10 % of the last 10 s's requests, at least 10 retries.
    fn default() -> BudgetConfig {
        BudgetConfig { window: Duration::from_secs(10), percent: 10, min_retries: 10 }
    }
}

/// One cluster's retry budget on this node.
#[derive(Debug)]
pub struct RetryBudget {
    config: BudgetConfig,
    /// `a`: requests first sent; `b`: retries.
    window: Window,
    retried: AtomicU64,
    denied: AtomicU64,
}

impl RetryBudget {
    /// A budget whose clock starts at `origin`.
    pub fn new(config: BudgetConfig, origin: Instant) -> RetryBudget {
        RetryBudget {
            config,
            window: Window::new(config.window, origin),
            retried: AtomicU64::new(0),
            denied: AtomicU64::new(0),
        }
    }

    /// Its configuration.
    pub fn config(&self) -> &BudgetConfig {
        &self.config
    }

    /// Counts a request sent the first time.
    pub fn request(&self, now: Instant) {
        self.window.add(self.window.ms(now), 1, 0);
    }

    /// Takes one retry from the budget if it has one (spent even if the retry then
    /// goes nowhere: the breaker may still refuse it; [`RetryBudget::sent`] counts
    /// the ones that went).
    pub fn try_retry(&self, now: Instant) -> bool {
        let ms = self.window.ms(now);
        let (requests, retries) = self.window.sum(ms);
        let share = u64::from(requests) * u64::from(self.config.percent) / 100;
        if u64::from(retries) >= share.max(u64::from(self.config.min_retries)) {
            self.denied.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        self.window.add(ms, 0, 1);
        true
    }

    /// Counts a retry sent to the backend.
    pub fn sent(&self) {
        self.retried.fetch_add(1, Ordering::Relaxed);
    }

    /// Retries sent.
    pub fn retried(&self) -> u64 {
        self.retried.load(Ordering::Relaxed)
    }

    /// Retries it refused (spent).
    pub fn denied(&self) -> u64 {
        self.denied.load(Ordering::Relaxed)
    }

    /// Requests and retries in the window ending at `now`.
    pub fn counts(&self, now: Instant) -> (u32, u32) {
        self.window.sum(self.window.ms(now))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_are_a_share_of_requests_with_a_floor() {
        let o = Instant::now();
        let b = RetryBudget::new(BudgetConfig::default(), o);
        // No traffic: the floor of 10.
        assert_eq!((0..20).filter(|_| b.try_retry(o)).count(), 10);
        // 500 requests: 10 % is 50, of which 10 are spent.
        for _ in 0..500 {
            b.request(o + Duration::from_secs(1));
        }
        assert_eq!((0..100).filter(|_| b.try_retry(o + Duration::from_secs(1))).count(), 40);
        assert_eq!(b.counts(o + Duration::from_secs(1)), (500, 50));
        // Eleven seconds on, all of it has left the window: the floor again.
        let later = o + Duration::from_secs(12);
        assert_eq!((0..20).filter(|_| b.try_retry(later)).count(), 10);
    }

    #[test]
    fn a_share_of_zero_allows_only_the_floor() {
        let o = Instant::now();
        let b = RetryBudget::new(BudgetConfig { percent: 0, min_retries: 0, ..BudgetConfig::default() }, o);
        for _ in 0..1000 {
            b.request(o);
        }
        assert!(!b.try_retry(o));
    }
}
