//! A circuit breaker per cluster per node: it opens when more than a share of the
//! requests in a sliding window failed (and there were enough of them to judge), answers
//! at once while open, then lets a small share through as probes and closes on a probe's
//! success.
//!
//! The window is ten buckets of atomic counters, so recording an outcome is a few relaxed
//! atomic adds and admitting a request to a closed breaker is one load; nothing locks.
//! Every call takes the time from the caller, so tests drive the clock.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::window::Window;

/// `state` while closed.
const CLOSED: u64 = 0;
/// `state` while half-open (probing); any other value is open, until that many
/// milliseconds after the breaker's origin.
const HALF_OPEN: u64 = u64::MAX;

/// When a breaker opens and how it probes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerConfig {
    /// The sliding window outcomes are judged over.
    pub window: Duration,
    /// Requests in the window before the breaker may open.
    pub min_requests: u32,
    /// It opens when more than this percentage of them failed.
    pub failure_percent: u8,
    /// How long it stays open before probing.
    pub open_for: Duration,
    /// The percentage of requests let through as probes while half-open (at least one
    /// in a hundred).
    pub probe_percent: u8,
}

impl Default for BreakerConfig {
    /// Opens when more than half of at least 100 requests in 10 s failed, for 10 s, then
    /// lets 5 % through as probes.
    fn default() -> BreakerConfig {
        BreakerConfig {
            window: Duration::from_secs(10),
            min_requests: 100,
            failure_percent: 50,
            open_for: Duration::from_secs(10),
            probe_percent: 5,
        }
    }
}

/// The breaker's state, for `/readyz` and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Requests pass.
    Closed,
    /// Requests are refused; probing starts after the duration.
    Open(Duration),
    /// A share of requests pass as probes.
    HalfOpen,
}

impl State {
    /// A stable label.
    pub fn as_str(self) -> &'static str {
        match self {
            State::Closed => "closed",
            State::Open(_) => "open",
            State::HalfOpen => "half_open",
        }
    }
}

/// A request let through: tell the breaker how it went with [`Breaker::record`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub struct Ticket {
    probe: bool,
}

/// One cluster's breaker on this node.
#[derive(Debug)]
pub struct Breaker {
    config: BreakerConfig,
    /// `a`: requests; `b`: failures; its clock is the breaker's.
    window: Window,
    /// [`CLOSED`], [`HALF_OPEN`], or open until this many ms after `origin` (plus one).
    state: AtomicU64,
    /// Requests seen while half-open (every n-th is a probe).
    seen_half_open: AtomicU32,
    /// Times it opened.
    opened: AtomicU64,
    /// Requests it refused.
    refused: AtomicU64,
}

impl Breaker {
    /// A closed breaker whose clock starts at `origin`.
    pub fn new(config: BreakerConfig, origin: Instant) -> Breaker {
        Breaker {
            config,
            window: Window::new(config.window, origin),
            state: AtomicU64::new(CLOSED),
            seen_half_open: AtomicU32::new(0),
            opened: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        }
    }

    /// Its configuration.
    pub fn config(&self) -> &BreakerConfig {
        &self.config
    }

    /// Whether a request may go to the cluster at `now`: a ticket, or how long until the
    /// breaker probes again.
    pub fn admit(&self, now: Instant) -> Result<Ticket, Duration> {
        let state = self.state.load(Ordering::Acquire);
        if state == CLOSED {
            return Ok(Ticket { probe: false });
        }
        if state != HALF_OPEN {
            let until = state - 1;
            let t = self.window.ms(now);
            if t < until {
                self.refused.fetch_add(1, Ordering::Relaxed);
                return Err(Duration::from_millis(until - t));
            }
            // Open long enough: the first to see it starts probing.
            if self.state.compare_exchange(state, HALF_OPEN, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                self.seen_half_open.store(0, Ordering::Relaxed);
            }
        }
        // `probe_percent` of requests, spread evenly (the first is always one).
        let p = u64::from(self.config.probe_percent.clamp(1, 100));
        let seen = u64::from(self.seen_half_open.fetch_add(1, Ordering::Relaxed));
        if seen * p % 100 < p {
            return Ok(Ticket { probe: true });
        }
        self.refused.fetch_add(1, Ordering::Relaxed);
        // Half-open: a probe answers soon; a second is a fair hint.
        Err(Duration::from_secs(1))
    }

    /// Records how an admitted request went (`failed`: a connect failure, a timeout, a
    /// reset, a 5xx from the backend). A probe's outcome closes or reopens the breaker; a
    /// failure that tips the window opens it.
    pub fn record(&self, ticket: Ticket, failed: bool, now: Instant) {
        let t = self.window.ms(now);
        self.window.add(t, 1, u32::from(failed));
        if ticket.probe {
            if failed {
                // Only a breaker still probing opens again: a late failed probe leaves one
                // that another probe closed (or reopened) as it is.
                self.open_from(HALF_OPEN, t);
            } else if self.state.compare_exchange(HALF_OPEN, CLOSED, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                self.window.clear();
            }
            return;
        }
        if failed && self.state.load(Ordering::Acquire) == CLOSED {
            let (total, failures) = self.window.sum(t);
            if total >= self.config.min_requests
                && u64::from(failures) * 100 > u64::from(total) * u64::from(self.config.failure_percent)
            {
                self.open_from(CLOSED, t);
            }
        }
    }

    /// Opens the breaker if it is in state `from`.
    fn open_from(&self, from: u64, t: u64) {
        let until = t.saturating_add(u64::try_from(self.config.open_for.as_millis()).unwrap_or(u64::MAX / 2));
        let to = until.saturating_add(1).min(HALF_OPEN - 1);
        if self.state.compare_exchange(from, to, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            self.opened.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The state at `now`.
    pub fn state(&self, now: Instant) -> State {
        match self.state.load(Ordering::Acquire) {
            CLOSED => State::Closed,
            HALF_OPEN => State::HalfOpen,
            s => {
                let t = self.window.ms(now);
                if t + 1 < s { State::Open(Duration::from_millis(s - 1 - t)) } else { State::HalfOpen }
            }
        }
    }

    /// Times it opened.
    pub fn opened(&self) -> u64 {
        self.opened.load(Ordering::Relaxed)
    }

    /// Requests it refused.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(origin: Instant, ms: u64) -> Instant {
        origin + Duration::from_millis(ms)
    }

    /// `n` requests at `ms` (those the breaker admits), the last `failed` of them failing.
    fn traffic(b: &Breaker, origin: Instant, ms: u64, n: u32, failed: u32) {
        for i in 0..n {
            if let Ok(t) = b.admit(at(origin, ms)) {
                b.record(t, i >= n - failed, at(origin, ms));
            }
        }
    }

    #[test]
    fn it_opens_only_past_the_share_with_enough_requests() {
        let o = Instant::now();
        let b = Breaker::new(BreakerConfig::default(), o);
        // 99 requests, all failed: too few to judge.
        traffic(&b, o, 0, 99, 99);
        assert_eq!(b.state(at(o, 0)), State::Closed);
        // Exactly half of 200 failed: not more than half.
        let b = Breaker::new(BreakerConfig::default(), o);
        traffic(&b, o, 0, 100, 0);
        traffic(&b, o, 500, 100, 100);
        assert_eq!(b.state(at(o, 500)), State::Closed);
        // One more failure tips it.
        let t = b.admit(at(o, 600)).unwrap();
        b.record(t, true, at(o, 600));
        assert_eq!(b.state(at(o, 600)), State::Open(Duration::from_secs(10)));
        assert_eq!(b.opened(), 1);
        assert_eq!(b.admit(at(o, 1600)), Err(Duration::from_secs(9)));
        assert_eq!(b.refused(), 1);
    }

    #[test]
    fn outcomes_older_than_the_window_are_forgotten() {
        let o = Instant::now();
        let b = Breaker::new(BreakerConfig::default(), o);
        // 80 failures, then 11 s later 30 more: 110 failures, but never 100 in 10 s.
        traffic(&b, o, 0, 80, 80);
        traffic(&b, o, 11_000, 30, 30);
        assert_eq!(b.state(at(o, 11_000)), State::Closed);
        // Within the window they add up: 30 + 80 = 110 failures of 110.
        traffic(&b, o, 15_000, 80, 80);
        assert!(matches!(b.state(at(o, 15_000)), State::Open(_)));
    }

    #[test]
    fn it_probes_after_open_for_and_closes_on_success_or_reopens_on_failure() {
        let o = Instant::now();
        let b = Breaker::new(BreakerConfig::default(), o);
        traffic(&b, o, 0, 100, 100);
        assert!(matches!(b.state(at(o, 0)), State::Open(_)));
        // After 10 s: one request in twenty goes through as a probe.
        let admitted: Vec<Ticket> = (0..40).filter_map(|_| b.admit(at(o, 10_000)).ok()).collect();
        assert_eq!(admitted.len(), 2);
        assert!(admitted.iter().all(|t| t.probe));
        assert_eq!(b.state(at(o, 10_000)), State::HalfOpen);
        // A failed probe opens it for another 10 s.
        b.record(admitted[0], true, at(o, 10_050));
        assert_eq!(b.state(at(o, 10_050)), State::Open(Duration::from_secs(10)));
        assert_eq!(b.opened(), 2);
        assert!(b.admit(at(o, 20_000)).is_err());
        // Probing again; a probe that succeeds closes it, with a clean window.
        let probe = (0..20).find_map(|_| b.admit(at(o, 20_050)).ok()).expect("a probe");
        b.record(probe, false, at(o, 20_100));
        assert_eq!(b.state(at(o, 20_100)), State::Closed);
        traffic(&b, o, 20_200, 99, 99);
        assert_eq!(b.state(at(o, 20_200)), State::Closed, "the old failures were forgotten");
    }

    #[test]
    fn a_late_failed_probe_leaves_a_closed_breaker_closed() {
        let o = Instant::now();
        let config = BreakerConfig { min_requests: 2, probe_percent: 100, ..BreakerConfig::default() };
        let b = Breaker::new(config, o);
        traffic(&b, o, 0, 2, 2);
        let (first, second) = (b.admit(at(o, 10_000)).unwrap(), b.admit(at(o, 10_000)).unwrap());
        assert!(first.probe && second.probe);
        b.record(first, false, at(o, 10_010));
        b.record(second, true, at(o, 10_020));
        assert_eq!((b.state(at(o, 10_020)), b.opened()), (State::Closed, 1));
    }

    #[test]
    fn probes_are_the_share_asked_for() {
        let o = Instant::now();
        for p in [1u8, 5, 34, 50, 99] {
            let b = Breaker::new(BreakerConfig { min_requests: 1, probe_percent: p, ..BreakerConfig::default() }, o);
            traffic(&b, o, 0, 1, 1);
            let probes = (0..1000).filter(|_| b.admit(at(o, 10_000)).is_ok()).count();
            assert_eq!(probes, usize::from(p) * 10, "{p} %");
        }
    }

    #[test]
    fn a_request_admitted_while_closed_never_closes_an_open_breaker() {
        let o = Instant::now();
        let b = Breaker::new(BreakerConfig { min_requests: 2, ..BreakerConfig::default() }, o);
        let slow = b.admit(at(o, 0)).unwrap();
        traffic(&b, o, 0, 2, 2);
        assert!(matches!(b.state(at(o, 0)), State::Open(_)));
        b.record(slow, false, at(o, 100));
        assert!(matches!(b.state(at(o, 100)), State::Open(_)));
    }

    #[test]
    fn thresholds_come_from_the_config() {
        let o = Instant::now();
        let config = BreakerConfig {
            window: Duration::from_secs(1),
            min_requests: 10,
            failure_percent: 20,
            open_for: Duration::from_millis(500),
            probe_percent: 100,
        };
        let b = Breaker::new(config, o);
        traffic(&b, o, 0, 10, 3);
        assert_eq!(b.state(at(o, 0)), State::Open(Duration::from_millis(500)));
        // Every request probes at 100 %.
        assert!(b.admit(at(o, 500)).is_ok_and(|t| t.probe) && b.admit(at(o, 500)).is_ok_and(|t| t.probe));
    }
}
