//! What each filter costs, per route: invocations, outcomes by kind, fuel and time.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::output::Rule;

/// Once a filter outruns its slice or fails costly on a route, its calls there go
/// straight to the idle pool for this long.
pub(crate) const POOL_FOR_MS: u64 = 10_000;

/// How a filter call ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Returned a decision within every limit.
    Ok,
    /// Ran out of fuel.
    Fuel,
    /// Used its deadline of CPU time (the thread's, not the wall clock's).
    Deadline,
    /// Asked for more linear memory (or tables, instances) than allowed.
    Memory,
    /// Overflowed its stack (native stack, or a Rust guest's shadow stack, which shows
    /// as an out-of-bounds memory access).
    Stack,
    /// A Rust panic (the guest wrote a panic message, then aborted).
    Panic,
    /// Any other trap (`unreachable`, division by zero, ...).
    Trap,
    /// Returned something a [`Rule`] refuses (limits, headers, status, path).
    BadOutput(Rule),
    /// Called the host more often than allowed.
    HostCalls,
    /// Could not be instantiated.
    Instantiate,
    /// Skipped without running: the filter is quarantined on this route.
    Quarantined,
    /// Not run, or stopped unfinished, because the node was too busy, not because of
    /// the filter: the idle pool's queue was full, or its wall-clock backstop passed
    /// before the filter had used its deadline of CPU. Never counts towards quarantine.
    Overloaded,
}

impl Outcome {
    /// Every outcome, in the order metrics list them.
    pub const ALL: [Outcome; 12] = [
        Outcome::Ok,
        Outcome::Fuel,
        Outcome::Deadline,
        Outcome::Memory,
        Outcome::Stack,
        Outcome::Panic,
        Outcome::Trap,
        Outcome::BadOutput(Rule::HeaderCount),
        Outcome::HostCalls,
        Outcome::Instantiate,
        Outcome::Quarantined,
        Outcome::Overloaded,
    ];

    /// Label used in metrics and problem details.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Fuel => "fuel_exhausted",
            Outcome::Deadline => "deadline_exceeded",
            Outcome::Memory => "memory_limit",
            Outcome::Stack => "stack_overflow",
            Outcome::Panic => "guest_panic",
            Outcome::Trap => "trap",
            Outcome::BadOutput(_) => "bad_output",
            Outcome::HostCalls => "host_call_limit",
            Outcome::Instantiate => "instantiate_failed",
            Outcome::Quarantined => "quarantined",
            Outcome::Overloaded => "overloaded",
        }
    }

    /// A failure that may have held its thread for long: out of fuel, time, memory,
    /// stack or host calls, or an oversized answer. After one, the route's next calls
    /// run on the idle pool for a while instead of on a worker ([`FilterStats::demote`]).
    pub fn is_costly(self) -> bool {
        matches!(
            self,
            Outcome::Fuel
                | Outcome::Deadline
                | Outcome::Memory
                | Outcome::Stack
                | Outcome::HostCalls
                | Outcome::BadOutput(_)
        )
    }

    /// A failure of the node, not of the filter: it never counts towards quarantine.
    pub fn is_node_failure(self) -> bool {
        matches!(self, Outcome::Overloaded | Outcome::Quarantined)
    }

    fn index(self) -> usize {
        let kind = std::mem::discriminant(&self);
        Outcome::ALL.iter().position(|o| std::mem::discriminant(o) == kind).unwrap_or(0)
    }
}

/// 2^(j/8) for j in 0..8, in 1/65,536ths: the steps of an octave of fuel buckets.
const OCTAVE_STEPS: [u64; 8] = [65_536, 71_468, 77_936, 84_990, 92_682, 101_070, 110_218, 120_194];
/// The first octave of fuel buckets: 2^10 = 1,024 (nothing runs on less).
const FUEL_FIRST_OCTAVE: usize = 10;
/// Fuel bucket bounds: eight to an octave from 1,024 to ~123 M (past the 100 M maximum),
/// each 2^(1/8) (9.05 %) above the last, so a percentile interpolated within its bucket is
/// within 9.05 % of the true one; then +Inf.
const FUEL_BOUNDS: [u64; 17 * 8 + 1] = {
    let mut b = [u64::MAX; 17 * 8 + 1];
    let mut i = 0;
    while i < 17 * 8 {
        b[i] = (OCTAVE_STEPS[i % 8] << (FUEL_FIRST_OCTAVE + i / 8)) >> 16;
        i += 1;
    }
    b
};
const TIME_BOUNDS_US: [u64; 12] = [5, 10, 25, 50, 100, 250, 1_000, 5_000, 25_000, 100_000, 250_000, u64::MAX];

/// Counters of one filter on one route.
#[derive(Debug)]
pub struct FilterStats {
    outcomes: [AtomicU64; Outcome::ALL.len()],
    /// Refused answers by the rule they broke.
    refusals: [AtomicU64; Rule::ALL.len()],
    fuel: [AtomicU64; FUEL_BOUNDS.len()],
    fuel_sum: AtomicU64,
    fuel_max: AtomicU64,
    time: [AtomicU64; TIME_BOUNDS_US.len()],
    time_sum_us: AtomicU64,
    time_max_us: AtomicU64,
    /// CPU time of sampled calls (one in 64 on each thread).
    cpu: [AtomicU64; TIME_BOUNDS_US.len()],
    cpu_sum_us: AtomicU64,
    cpu_max_us: AtomicU64,
    /// Times the filter was quarantined on this route.
    pub quarantines: AtomicU64,
    /// Calls that outran their slice on the worker and ran again on the idle pool.
    pub reruns: AtomicU64,
    /// Until when (milliseconds of the runtime's clock) calls go straight to the idle
    /// pool: set when a call outruns its slice or fails costly ([`Self::demote`]).
    #[doc(hidden)]
    pub pool_until_ms: AtomicU64,
    counters: Mutex<BTreeMap<String, u64>>,
}

impl Default for FilterStats {
    fn default() -> Self {
        let zero = |_| AtomicU64::new(0);
        FilterStats {
            outcomes: std::array::from_fn(zero),
            refusals: std::array::from_fn(zero),
            fuel: std::array::from_fn(zero),
            fuel_sum: AtomicU64::new(0),
            fuel_max: AtomicU64::new(0),
            time: std::array::from_fn(zero),
            time_sum_us: AtomicU64::new(0),
            time_max_us: AtomicU64::new(0),
            cpu: std::array::from_fn(zero),
            cpu_sum_us: AtomicU64::new(0),
            cpu_max_us: AtomicU64::new(0),
            quarantines: AtomicU64::new(0),
            reruns: AtomicU64::new(0),
            pool_until_ms: AtomicU64::new(0),
            counters: Mutex::new(BTreeMap::new()),
        }
    }
}

impl FilterStats {
    /// Sends this filter's next calls on this route to the idle pool for
    /// [`POOL_FOR_MS`].
    pub fn demote(&self) {
        let until = crate::clock::coarse_ms().saturating_add(POOL_FOR_MS);
        self.pool_until_ms.fetch_max(until, Ordering::Relaxed);
    }

    /// Records one call.
    pub fn record(&self, outcome: Outcome, fuel: u64, took: Duration) {
        if let Some(c) = self.outcomes.get(outcome.index()) {
            c.fetch_add(1, Ordering::Relaxed);
        }
        if let Outcome::BadOutput(rule) = outcome
            && let Some(c) = self.refusals.get(rule.index())
        {
            c.fetch_add(1, Ordering::Relaxed);
        }
        if outcome == Outcome::Quarantined {
            return;
        }
        let i = FUEL_BOUNDS.partition_point(|&b| b < fuel);
        if let Some(b) = self.fuel.get(i) {
            b.fetch_add(1, Ordering::Relaxed);
        }
        self.fuel_sum.fetch_add(fuel, Ordering::Relaxed);
        self.fuel_max.fetch_max(fuel, Ordering::Relaxed);
        let us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        let i = TIME_BOUNDS_US.partition_point(|&b| b < us);
        if let Some(b) = self.time.get(i) {
            b.fetch_add(1, Ordering::Relaxed);
        }
        self.time_sum_us.fetch_add(us, Ordering::Relaxed);
        self.time_max_us.fetch_max(us, Ordering::Relaxed);
    }

    /// Records the CPU time of one sampled call.
    pub(crate) fn record_cpu(&self, cpu: Duration) {
        let us = u64::try_from(cpu.as_micros()).unwrap_or(u64::MAX);
        let i = TIME_BOUNDS_US.partition_point(|&b| b < us);
        if let Some(b) = self.cpu.get(i) {
            b.fetch_add(1, Ordering::Relaxed);
        }
        self.cpu_sum_us.fetch_add(us, Ordering::Relaxed);
        self.cpu_max_us.fetch_max(us, Ordering::Relaxed);
    }

    /// Calls that ended with `outcome`.
    pub fn count(&self, outcome: Outcome) -> u64 {
        self.outcomes.get(outcome.index()).map_or(0, |c| c.load(Ordering::Relaxed))
    }

    /// Answers refused for breaking `rule`.
    pub fn refused(&self, rule: Rule) -> u64 {
        self.refusals.get(rule.index()).map_or(0, |c| c.load(Ordering::Relaxed))
    }

    /// Adds to a filter-defined counter (the `counter-add` host call). Names are capped
    /// by the caller.
    pub fn counter_add(&self, name: &str, delta: u64) {
        let mut m = self.counters.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(v) = m.get_mut(name) {
            *v = v.saturating_add(delta);
        } else if m.len() < 64 {
            m.insert(name.to_owned(), delta);
        }
    }

    /// Prometheus text for this filter; `labels` is `route="..",filter=".."`.
    pub fn render(&self, out: &mut String, labels: &str) {
        for o in Outcome::ALL {
            let n = self.count(o);
            if n > 0 || o == Outcome::Ok {
                let _ = writeln!(out, "postern_filter_calls_total{{{labels},outcome=\"{}\"}} {n}", o.as_str());
            }
        }
        for r in Rule::ALL {
            let n = self.refused(r);
            if n > 0 {
                let _ = writeln!(out, "postern_filter_refusals_total{{{labels},rule=\"{}\"}} {n}", r.as_str());
            }
        }
        let mut cum = 0;
        for (b, c) in FUEL_BOUNDS.iter().zip(&self.fuel) {
            cum += c.load(Ordering::Relaxed);
            let le = if *b == u64::MAX { "+Inf".to_owned() } else { b.to_string() };
            let _ = writeln!(out, "postern_filter_fuel_bucket{{{labels},le=\"{le}\"}} {cum}");
        }
        let _ = writeln!(out, "postern_filter_fuel_sum{{{labels}}} {}", self.fuel_sum.load(Ordering::Relaxed));
        let _ = writeln!(out, "postern_filter_fuel_count{{{labels}}} {cum}");
        let _ = writeln!(out, "postern_filter_fuel_max{{{labels}}} {}", self.fuel_max.load(Ordering::Relaxed));
        seconds(out, "postern_filter_duration_seconds", labels, &self.time, &self.time_sum_us, &self.time_max_us);
        seconds(out, "postern_filter_cpu_seconds", labels, &self.cpu, &self.cpu_sum_us, &self.cpu_max_us);
        let _ =
            writeln!(out, "postern_filter_quarantines_total{{{labels}}} {}", self.quarantines.load(Ordering::Relaxed));
        let _ = writeln!(out, "postern_filter_reruns_total{{{labels}}} {}", self.reruns.load(Ordering::Relaxed));
        let m = self.counters.lock().unwrap_or_else(|p| p.into_inner());
        for (name, v) in m.iter() {
            let name: String = name.chars().filter(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            let _ = writeln!(out, "postern_filter_counter_total{{{labels},name=\"{name}\"}} {v}");
        }
    }
}

/// A histogram of microsecond buckets as Prometheus seconds, and its largest observation
/// (`<name>_max`, a gauge).
fn seconds(out: &mut String, name: &str, labels: &str, buckets: &[AtomicU64], sum_us: &AtomicU64, max_us: &AtomicU64) {
    let mut cum = 0;
    for (b, c) in TIME_BOUNDS_US.iter().zip(buckets) {
        cum += c.load(Ordering::Relaxed);
        let le = if *b == u64::MAX { "+Inf".to_owned() } else { (*b as f64 / 1e6).to_string() };
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{le}\"}} {cum}");
    }
    let secs = sum_us.load(Ordering::Relaxed) as f64 / 1e6;
    let _ = writeln!(out, "{name}_sum{{{labels}}} {secs}");
    let _ = writeln!(out, "{name}_count{{{labels}}} {cum}");
    let _ = writeln!(out, "{name}_max{{{labels}}} {}", max_us.load(Ordering::Relaxed) as f64 / 1e6);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fuel_buckets_are_each_about_nine_percent_wider_than_the_last() {
        assert_eq!(FUEL_BOUNDS[0], 1024);
        assert_eq!(FUEL_BOUNDS[8], 2048);
        assert_eq!(FUEL_BOUNDS[16 * 8], 1 << 26);
        assert!(FUEL_BOUNDS[17 * 8 - 1] > 100_000_000, "past the platform maximum");
        assert_eq!(FUEL_BOUNDS[17 * 8], u64::MAX);
        for w in FUEL_BOUNDS[..17 * 8].windows(2) {
            let ratio = w[1] as f64 / w[0] as f64;
            assert!((1.089..1.092).contains(&ratio), "{w:?}");
        }
    }

    #[test]
    fn the_largest_call_is_kept_exactly() {
        let s = FilterStats::default();
        s.record(Outcome::Ok, 22_099, Duration::from_micros(40));
        s.record(Outcome::Ok, 2_410, Duration::from_micros(12));
        s.record_cpu(Duration::from_micros(9));
        let mut out = String::new();
        s.render(&mut out, "route=\"t/r\",filter=\"f\"");
        assert!(out.contains("postern_filter_fuel_max{route=\"t/r\",filter=\"f\"} 22099\n"), "{out}");
        assert!(out.contains("postern_filter_duration_seconds_max{route=\"t/r\",filter=\"f\"} 0.00004\n"), "{out}");
        assert!(out.contains("postern_filter_cpu_seconds_max{route=\"t/r\",filter=\"f\"} 0.000009\n"), "{out}");
        assert!(out.contains("postern_filter_fuel_sum{route=\"t/r\",filter=\"f\"} 24509\n"), "{out}");
    }
}
