//! Priority load shedding on a node: two kinds of signal, each with its own ramp
//! ([`postern_protect::Shedder`]).
//!
//! - The node's CPU: this process's CPU time over the last second, as a share of the
//!   cores it may run on (its workers, at most the machine's). Over the threshold (75 %
//!   by default), every route sheds its sheddable and then its free requests (never
//!   standard or critical ones).
//! - Each cluster's own overload: its requests in flight at or over `shedAtPercent` of
//!   its cap, its answers far slower than its normal p99, a request its full cap
//!   refused, or a 503 from its backend marked `x-postern-overloaded` (its own
//!   concurrency limiter fired). Only that cluster's routes shed.
//!
//! A tick off the request path reads the signals and moves each ramp a step; a request
//! reads two levels and, only when one is above zero, its class and one random draw.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use http::{HeaderMap, HeaderName};
use postern_filter_contract::{Context, Identity};
use postern_model::Priority;
use postern_protect::{Ramp, Shedder};
use tokio::sync::watch;

use crate::proxy::Gateway;
use crate::snapshot::{CompiledRoute, Live, Upstream};

/// How often the signals are read and the ramps moved.
pub const TICK: Duration = Duration::from_millis(250);
/// The CPU reading is the average over this many ticks (one second).
const CPU_TICKS: usize = 4;

/// The mark of a client's retry (`x-retry-attempt: N`, N ≥ 1): such requests are
/// sheddable whatever their plan.
const X_RETRY_ATTEMPT: HeaderName = HeaderName::from_static("x-retry-attempt");

/// The node's own shedding state.
#[derive(Debug)]
pub struct NodeShed {
    /// The ramp driven by the node's CPU.
    pub cpu: Shedder,
    /// CPU percentage at or over which the node sheds (0: never).
    threshold: u32,
    /// The last reading, in percent of the node's cores.
    reading: AtomicU32,
}

impl NodeShed {
    /// A node that sheds once its CPU is at `threshold` percent (0: never on CPU).
    pub fn new(threshold: u32) -> NodeShed {
        // The CPU alone sheds sheddable and free requests, never standard or critical
        // ones: a busy node that keeps up is not a reason to refuse paid traffic (a
        // cluster's own overload may go further).
        let ramp = Ramp { max: 200, ..Ramp::default() };
        NodeShed { cpu: Shedder::new(ramp), threshold, reading: AtomicU32::new(0) }
    }

    /// What `/readyz` shows.
    pub fn state(&self) -> serde_json::Value {
        let shed = self.cpu.shed();
        serde_json::json!({
            "cpu_percent": self.reading.load(Ordering::Relaxed),
            "cpu_threshold_percent": self.threshold,
            "level": self.cpu.level(),
            "shed": classes(&shed),
        })
    }

    /// The last CPU reading, in percent.
    pub fn cpu_percent(&self) -> u32 {
        self.reading.load(Ordering::Relaxed)
    }
}

/// The node's admission budget: requests being served at once (from arrival to the
/// response head), with a share kept for the partner pool — the public pool may hold
/// only the rest, so a public spike cannot starve partner requests on a node serving
/// both.
#[derive(Debug)]
pub struct Admission {
    max: u32,
    public_max: u32,
    total: AtomicU32,
    public: AtomicU32,
    refused: [AtomicU64; 2],
}

/// A request's place in the admission budget, given back on drop.
#[derive(Debug)]
pub struct Admitted<'a> {
    admission: &'a Admission,
    public: bool,
}

impl Drop for Admitted<'_> {
    fn drop(&mut self) {
        self.admission.total.fetch_sub(1, Ordering::Relaxed);
        if self.public {
            self.admission.public.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl Admission {
    /// At most `max` requests at once (0: no budget), of which the public pool may hold
    /// all but `partner_share` percent.
    pub fn new(max: u32, partner_share: u32) -> Admission {
        let max = if max == 0 { u32::MAX } else { max };
        let public_share = u64::from(100u32.saturating_sub(partner_share.min(100)));
        // At least one place for each pool that has a share.
        let public_max = (u64::from(max) * public_share / 100).max(u64::from(public_share > 0)) as u32;
        Admission { max, public_max, total: AtomicU32::new(0), public: AtomicU32::new(0), refused: Default::default() }
    }

    /// A place for a request of `pool`, or `None` (counted) when its share is full.
    pub fn admit(&self, pool: postern_model::Pool) -> Option<Admitted<'_>> {
        let public = pool == postern_model::Pool::Public;
        if self.total.fetch_add(1, Ordering::Relaxed) >= self.max {
            self.total.fetch_sub(1, Ordering::Relaxed);
            self.refused[usize::from(public)].fetch_add(1, Ordering::Relaxed);
            return None;
        }
        if public && self.public.fetch_add(1, Ordering::Relaxed) >= self.public_max {
            self.public.fetch_sub(1, Ordering::Relaxed);
            self.total.fetch_sub(1, Ordering::Relaxed);
            self.refused[1].fetch_add(1, Ordering::Relaxed);
            return None;
        }
        Some(Admitted { admission: self, public })
    }

    /// (in flight, refused) of the partner pool, then of the public pool.
    pub fn counts(&self) -> [(u32, u64); 2] {
        let total = self.total.load(Ordering::Relaxed);
        let public = self.public.load(Ordering::Relaxed);
        let refused = |i: usize| self.refused[i].load(Ordering::Relaxed);
        [(total.saturating_sub(public), refused(0)), (public, refused(1))]
    }

    /// What `/readyz` shows.
    pub fn state(&self) -> serde_json::Value {
        let [(partner, partner_refused), (public, public_refused)] = self.counts();
        let max = if self.max == u32::MAX { serde_json::Value::Null } else { self.max.into() };
        serde_json::json!({
            "max_in_flight": max,
            "public_max_in_flight": if self.max == u32::MAX { serde_json::Value::Null } else { self.public_max.into() },
            "in_flight": {"public": public, "partner": partner},
            "refused": {"public": public_refused, "partner": partner_refused},
        })
    }
}

/// Per-class counts as a JSON object.
pub fn classes(counts: &[u64; 4]) -> serde_json::Value {
    Priority::ALL.iter().map(|p| (p.as_str().to_owned(), serde_json::Value::from(counts[p.rank()]))).collect()
}

/// The class of a request: a client's retry is sheddable; otherwise the route's class,
/// or the caller's plan's, or `standard`.
pub fn class(route: &CompiledRoute, live: &Live, cx: Option<&Context>, headers: &HeaderMap) -> Priority {
    if headers.get(X_RETRY_ATTEMPT).is_some_and(|v| !matches!(v.as_bytes(), b"0" | b"")) {
        return Priority::Sheddable;
    }
    if let Some(p) = route.priority {
        return p;
    }
    cx.and_then(Context::identity)
        .and_then(|id: &Identity| id.plan.as_ref())
        .and_then(|plan| std::str::from_utf8(plan).ok())
        .and_then(|plan| live.priorities.get(plan).copied())
        .unwrap_or_default()
}

/// Whether a request may go on to `upstream` (with its class, if it had to be worked
/// out), or the class it was shed as.
pub fn admit(
    node: &NodeShed,
    upstream: &Upstream,
    class: impl FnOnce() -> Priority,
) -> Result<Option<Priority>, Priority> {
    if node.cpu.level() == 0 && upstream.shed.level() == 0 {
        return Ok(None);
    }
    let class = class();
    let draw = fastrand::u32(..100);
    if node.cpu.admits(class.rank(), draw) && upstream.shed.admits(class.rank(), draw) {
        Ok(Some(class))
    } else {
        Err(class)
    }
}

/// This process's CPU time so far (user and system), from `/proc/self/stat`.
fn cpu_time() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command's closing parenthesis start at the 3rd (state); utime
    // and stime are the 14th and 15th, in clock ticks of 10 ms (USER_HZ on Linux).
    let mut fields = stat.rsplit_once(')')?.1.split_ascii_whitespace();
    let utime: u64 = fields.nth(11)?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(Duration::from_millis((utime + stime).saturating_mul(10)))
}

/// The CPU used between two readings, as a percentage of `cores` over the wall time.
fn percent(from: (Instant, Duration), to: (Instant, Duration), cores: u32) -> u32 {
    let wall = to.0.saturating_duration_since(from.0).as_secs_f64() * f64::from(cores.max(1));
    if wall <= 0.0 {
        return 0;
    }
    let used = to.1.saturating_sub(from.1).as_secs_f64();
    (used / wall * 100.0).round().clamp(0.0, 1000.0) as u32
}

/// Reads the signals every [`TICK`] and moves the ramps, until `stop`.
pub async fn run(gw: Arc<Gateway>, workers: Option<usize>, mut stop: watch::Receiver<bool>) {
    // The cores the node may use: its workers, at most the machine's.
    let available = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    let cores = u32::try_from(workers.unwrap_or(available).clamp(1, available)).unwrap_or(u32::MAX);
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut samples: VecDeque<(Instant, Duration)> = VecDeque::with_capacity(CPU_TICKS + 1);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        if let Some(t) = cpu_time() {
            samples.push_back((Instant::now(), t));
            if samples.len() > CPU_TICKS + 1 {
                samples.pop_front();
            }
        }
        let node = &gw.shed;
        if let (Some(&first), Some(&last)) = (samples.front(), samples.back()) {
            node.reading.store(percent(first, last, cores), Ordering::Relaxed);
        }
        node.cpu.adjust(node.threshold > 0 && node.cpu_percent() >= node.threshold);
        for u in &gw.live.load().upstreams {
            u.shed.adjust(u.overloaded());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_public_pool_never_takes_the_partner_share() {
        use postern_model::Pool;
        let a = Admission::new(10, 40);
        let public: Vec<_> = (0..10).filter_map(|_| a.admit(Pool::Public)).collect();
        assert_eq!(public.len(), 6, "the public pool holds at most 60 %");
        let partner: Vec<_> = (0..10).filter_map(|_| a.admit(Pool::Partner)).collect();
        assert_eq!(partner.len(), 4, "the partner pool has the rest");
        assert_eq!(a.counts(), [(4, 6), (6, 4)]);
        drop(public);
        assert_eq!(a.counts()[1].0, 0);
        assert!(a.admit(Pool::Partner).is_some(), "the partner pool may use what the public pool left");
        let open = Admission::new(0, 30);
        let held: Vec<_> = (0..1000).filter_map(|_| open.admit(Pool::Public)).collect();
        assert_eq!(held.len(), 1000, "no budget: everything is admitted");
    }

    #[test]
    fn cpu_readings_are_a_share_of_the_cores() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let cpu = Duration::from_millis;
        assert_eq!(percent((at(0), cpu(0)), (at(1000), cpu(1500)), 2), 75);
        assert_eq!(percent((at(0), cpu(100)), (at(1000), cpu(600)), 1), 50);
        assert_eq!(percent((at(0), cpu(0)), (at(0), cpu(10)), 2), 0, "no time passed");
        assert!(cpu_time().is_some(), "/proc/self/stat is readable");
    }
}
