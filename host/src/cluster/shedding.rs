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

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use postern_model::Priority;
use postern_protect::{Ramp, Shedder};

/// The node's own shedding state.
#[derive(Debug)]
pub struct NodeShed {
    /// The ramp driven by the node's CPU.
    pub cpu: Shedder,
    /// CPU percentage at or over which the node sheds (0: never).
    pub(crate) threshold: u32,
    /// The last reading, in percent of the node's cores.
    pub(crate) reading: AtomicU32,
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
}
