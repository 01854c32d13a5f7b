//! Passive outlier ejection and the choice of host within a cluster.
//!
//! A host that fails `consecutive` times in a row (a connect failure, a reset, a timeout,
//! a 5xx) is ejected: no request is sent to it for `base` × the times it was ejected
//! before (capped at `max`), after which it takes requests again. Never more than
//! `max_percent` of a cluster's hosts are out at once, so a cluster-wide failure is the
//! breaker's to judge, not ejection's. A host that stayed in for longer than `max` since
//! its last ejection starts its back-off anew.
//!
//! Requests go to the less loaded of two hosts drawn at random (by weight) among those
//! in: power of two choices on requests in flight.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// When a host is ejected and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EjectConfig {
    /// Failures in a row that eject a host.
    pub consecutive: u32,
    /// The first ejection's length; each further one is this times the count.
    pub base: Duration,
    /// The longest ejection.
    pub max: Duration,
    /// The most of a cluster's hosts that may be out at once, in percent.
    pub max_percent: u8,
}

impl Default for EjectConfig {
    /// 5 failures in a row; 30 s, 60 s, ... up to 5 min; at most half the hosts.
    fn default() -> EjectConfig {
        EjectConfig { consecutive: 5, base: Duration::from_secs(30), max: Duration::from_secs(300), max_percent: 50 }
    }
}

#[derive(Debug, Default)]
struct Host {
    /// Requests in flight to it now.
    in_flight: AtomicU32,
    /// Failures in a row.
    fails: AtomicU32,
    /// Out until this many ms after the origin (0: in).
    until: AtomicU64,
    /// Times ejected in the current back-off.
    times: AtomicU32,
    /// Times ejected in all.
    ejections: AtomicU64,
}

/// One cluster's hosts on this node: load, failures and ejections.
#[derive(Debug)]
pub struct Hosts {
    config: EjectConfig,
    origin: Instant,
    hosts: Box<[Host]>,
    /// Host index per weighted slot (a host named twice has two slots).
    slots: Box<[u16]>,
}

/// A request waiting for a host's answer; counted in its load while it lives.
#[derive(Debug)]
pub struct Waiting<'h>(&'h AtomicU32);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What `/readyz` shows of one host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostState {
    /// Requests in flight to it.
    pub in_flight: u32,
    /// How long it stays out, if it is out.
    pub ejected_for: Option<Duration>,
    /// Times it was ejected.
    pub ejections: u64,
}

impl Hosts {
    /// `hosts` hosts drawn by `slots` (each slot names a host index, so a host named
    /// twice is drawn twice as often).
    pub fn new(hosts: usize, slots: Vec<u16>, config: EjectConfig, origin: Instant) -> Hosts {
        Hosts { config, origin, hosts: (0..hosts).map(|_| Host::default()).collect(), slots: slots.into() }
    }

    /// Its configuration.
    pub fn config(&self) -> &EjectConfig {
        &self.config
    }

    /// How many hosts.
    pub fn len(&self) -> usize {
        self.hosts.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.hosts.is_empty()
    }

    fn ms(&self, now: Instant) -> u64 {
        u64::try_from(now.saturating_duration_since(self.origin).as_millis()).unwrap_or(u64::MAX)
    }

    fn is_in(&self, i: usize, ms: u64) -> bool {
        self.hosts.get(i).is_some_and(|h| h.until.load(Ordering::Relaxed) <= ms)
    }

    /// The host for a request: of two weighted draws (`draws`, any numbers) among the
    /// hosts that are in, the one with fewer requests in flight; `None` with no hosts.
    pub fn pick(&self, now: Instant, draws: [u32; 2]) -> Option<usize> {
        let n = self.slots.len();
        if n == 0 {
            return None;
        }
        let ms = self.ms(now);
        let slot = |d: u32| usize::from(self.slots[d as usize % n]);
        let (a, b) = (slot(draws[0]), slot(draws[1]));
        let chosen = match (self.is_in(a, ms), self.is_in(b, ms)) {
            (true, true) => {
                let load = |i: usize| self.hosts[i].in_flight.load(Ordering::Relaxed);
                if load(b) < load(a) { b } else { a }
            }
            (true, false) => a,
            (false, true) => b,
            // Both out: the next slot that is in; were none (hosts ejected at the same
            // moment), the first draw after all — ejection never leaves a cluster empty.
            (false, false) => {
                let start = draws[0] as usize % n;
                (1..n).map(|k| usize::from(self.slots[(start + k) % n])).find(|&i| self.is_in(i, ms)).unwrap_or(a)
            }
        };
        Some(chosen)
    }

    /// A host other than `not` that is in (for a retry), starting from a draw.
    pub fn pick_other(&self, not: usize, now: Instant, draw: u32) -> Option<usize> {
        let n = self.slots.len();
        let ms = self.ms(now);
        (0..n).map(|k| usize::from(self.slots[(draw as usize + k) % n])).find(|&i| i != not && self.is_in(i, ms))
    }

    /// Counts a request to host `i` as waiting for its answer until the returned guard
    /// drops.
    pub fn start(&self, i: usize) -> Option<Waiting<'_>> {
        let c = &self.hosts.get(i)?.in_flight;
        c.fetch_add(1, Ordering::Relaxed);
        Some(Waiting(c))
    }

    /// Records how a request to host `i` went; returns whether this ejected it.
    pub fn record(&self, i: usize, failed: bool, now: Instant) -> bool {
        let Some(h) = self.hosts.get(i) else { return false };
        if !failed {
            if h.fails.load(Ordering::Relaxed) != 0 {
                h.fails.store(0, Ordering::Relaxed);
            }
            return false;
        }
        let ms = self.ms(now);
        let until = h.until.load(Ordering::Relaxed);
        if until > ms {
            // Out already: what was in flight when it went says nothing new.
            return false;
        }
        if h.fails.fetch_add(1, Ordering::Relaxed) + 1 < self.config.consecutive {
            return false;
        }
        // Within the share, and never the last host in.
        let n = self.hosts.len();
        let out = (0..n).filter(|&k| !self.is_in(k, ms)).count();
        if out + 1 >= n || (out + 1) * 100 > n * usize::from(self.config.max_percent) {
            return false;
        }
        let max = u64::try_from(self.config.max.as_millis()).unwrap_or(u64::MAX);
        let base = u64::try_from(self.config.base.as_millis()).unwrap_or(u64::MAX);
        // In for longer than the longest ejection since the last: the back-off starts anew.
        let times = if ms > until.saturating_add(max) { 1 } else { h.times.load(Ordering::Relaxed) + 1 };
        let length = base.saturating_mul(u64::from(times)).min(max);
        // One failure of many at once ejects it (the others find it out).
        if h.until
            .compare_exchange(until, ms.saturating_add(length).max(1), Ordering::Relaxed, Ordering::Relaxed)
            .is_err()
        {
            return false;
        }
        h.times.store(times, Ordering::Relaxed);
        h.fails.store(0, Ordering::Relaxed);
        h.ejections.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Hosts out at `now`, and ejections in all.
    pub fn ejected(&self, now: Instant) -> (usize, u64) {
        let ms = self.ms(now);
        let out = (0..self.hosts.len()).filter(|&i| !self.is_in(i, ms)).count();
        (out, self.hosts.iter().map(|h| h.ejections.load(Ordering::Relaxed)).sum())
    }

    /// Host `i`'s state at `now`.
    pub fn state(&self, i: usize, now: Instant) -> Option<HostState> {
        let h = self.hosts.get(i)?;
        let ms = self.ms(now);
        let until = h.until.load(Ordering::Relaxed);
        Some(HostState {
            in_flight: h.in_flight.load(Ordering::Relaxed),
            ejected_for: (until > ms).then(|| Duration::from_millis(until - ms)),
            ejections: h.ejections.load(Ordering::Relaxed),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(n: u16) -> (Hosts, Instant) {
        let o = Instant::now();
        (Hosts::new(usize::from(n), (0..n).collect(), EjectConfig::default(), o), o)
    }

    #[test]
    fn the_less_loaded_of_two_is_picked() {
        let (h, o) = hosts(3);
        let _held: Vec<Waiting<'_>> = [0, 0, 0, 0, 1].iter().filter_map(|&i| h.start(i)).collect();
        assert_eq!(h.pick(o, [0, 1]), Some(1));
        assert_eq!(h.pick(o, [1, 2]), Some(2));
        assert_eq!(h.pick(o, [3, 0]), Some(0), "the same host drawn twice");
        let empty = Hosts::new(0, vec![], EjectConfig::default(), o);
        assert_eq!(empty.pick(o, [0, 1]), None);
    }

    #[test]
    fn consecutive_failures_eject_with_back_off_and_a_success_resets_the_count() {
        let (h, o) = hosts(4);
        let at = |s: u64| o + Duration::from_secs(s);
        for _ in 0..4 {
            assert!(!h.record(0, true, at(0)));
        }
        h.record(0, false, at(0));
        for _ in 0..4 {
            assert!(!h.record(0, true, at(0)), "the success started the count again");
        }
        assert!(h.record(0, true, at(0)), "the fifth in a row ejects");
        for _ in 0..20 {
            assert!(!h.record(0, true, at(1)), "failures of requests sent before it went out count for nothing");
        }
        assert_eq!(h.state(0, at(10)).unwrap().ejected_for, Some(Duration::from_secs(20)));
        // While out it is never picked, not even when both draws name it.
        assert_eq!(h.pick(at(10), [0, 0]), Some(1));
        assert_eq!(h.pick_other(1, at(10), 0), Some(2));
        // Back after 30 s; failing again, out for 60 s.
        assert_eq!(h.pick(at(30), [0, 0]), Some(0));
        for _ in 0..5 {
            h.record(0, true, at(31));
        }
        assert_eq!(h.state(0, at(31)).unwrap().ejected_for, Some(Duration::from_secs(60)));
        assert_eq!(h.state(0, at(31)).unwrap().ejections, 2);
        // Healthy for longer than the longest ejection: the back-off starts anew.
        for _ in 0..5 {
            h.record(0, true, at(1000));
        }
        assert_eq!(h.state(0, at(1000)).unwrap().ejected_for, Some(Duration::from_secs(30)));
    }

    #[test]
    fn never_more_than_the_share_of_hosts_is_out() {
        let (h, o) = hosts(4);
        let fail = |i: usize| (0..5).fold(false, |ejected, _| h.record(i, true, o) || ejected);
        assert!(fail(0) && fail(1), "two of four: half");
        assert!(!fail(2), "a third would be more than half");
        assert!(h.pick(o, [0, 1]).is_some_and(|i| i >= 2));
        let (one, o) = hosts(1);
        assert!(!(0..50).any(|_| one.record(0, true, o)), "a lone host is never ejected");
        assert_eq!(one.pick(o, [7, 9]), Some(0));
        // Even where every host may go, the last one in stays.
        let all = Hosts::new(2, vec![0, 1], EjectConfig { max_percent: 100, ..EjectConfig::default() }, o);
        assert!((0..5).fold(false, |e, _| all.record(0, true, o) || e));
        assert!(!(0..50).any(|_| all.record(1, true, o)), "the last host in stays in");
    }

    #[test]
    fn weights_are_slots() {
        let o = Instant::now();
        let h = Hosts::new(2, vec![0, 0, 0, 1], EjectConfig::default(), o);
        let picks = (0..400u32).filter(|&d| h.pick(o, [d, d]) == Some(0)).count();
        assert_eq!(picks, 300);
    }
}
