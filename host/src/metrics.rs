//! Lock-free request metrics, rendered as Prometheus text on the admin listener.
//!
//! Each route's counters live in one [`RouteMetrics`] that snapshot builds reuse by
//! route id, so counters survive reloads and a request only touches atomics.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use postern_wasm::FilterStats;

use postern_model::report::{LATENCY_BOUNDS_US as BOUNDS_US, RouteCounts};

/// A fixed-bucket histogram of durations.
#[derive(Debug, Default)]
pub struct Histogram {
    pub(crate) buckets: [AtomicU64; BOUNDS_US.len() + 1],
    pub(crate) sum_us: AtomicU64,
}

impl Histogram {
    /// Records one observation.
    pub fn observe(&self, d: Duration) {
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        let i = BOUNDS_US.partition_point(|&b| b < us);
        if let Some(b) = self.buckets.get(i) {
            b.fetch_add(1, Ordering::Relaxed);
        }
        self.sum_us.fetch_add(us, Ordering::Relaxed);
    }
}

/// Counters of one route (or of requests that matched no route).
#[derive(Debug, Default)]
pub struct RouteMetrics {
    /// Responses by status class.
    pub(crate) by_class: Classes,
    /// Total time until the response head was sent.
    pub latency: Histogram,
    /// Time the gateway itself added (total minus waiting for the backend).
    pub added: Histogram,
    /// 5xx answers the gateway (or a filter) made itself; the rest of `by_class[5]`
    /// came from the backend.
    pub(crate) gateway_5xx: AtomicU64,
    /// 401, 403 and 429 answers.
    pub(crate) denied: [AtomicU64; 3],
}

/// The statuses counted per route as refusals.
pub(crate) const DENIED: [u16; 3] = [401, 403, 429];

/// Counters by status class (index 1..=5 for 1xx..5xx, 0 for anything else).
#[derive(Debug, Default)]
pub(crate) struct Classes(pub(crate) [AtomicU64; 6]);

impl Classes {
    fn count(&self, status: u16) {
        let class = usize::from(status / 100);
        let i = if (1..=5).contains(&class) { class } else { 0 };
        if let Some(c) = self.0.get(i) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// `(class label, count)` of the classes counted at all.
    pub(crate) fn counted(&self) -> impl Iterator<Item = (String, u64)> + '_ {
        self.0.iter().enumerate().filter_map(|(i, c)| {
            let n = c.load(Ordering::Relaxed);
            (n > 0).then(|| (if i == 0 { "other".to_owned() } else { format!("{i}xx") }, n))
        })
    }
}

/// Plans counted on their own; callers of further plans count as `other`.
const PLAN_SLOTS: usize = 16;

/// One plan's counters: the slot is claimed by the first request of the plan.
#[derive(Debug, Default)]
pub(crate) struct PlanSlot {
    pub(crate) name: std::sync::OnceLock<bytes::Bytes>,
    pub(crate) classes: Classes,
}

impl RouteMetrics {
    /// Totals for a rollout report.
    pub fn totals(&self) -> RouteCounts {
        RouteCounts {
            n: self.by_class.0.iter().map(|c| c.load(Ordering::Relaxed)).sum(),
            e5: self.by_class.0[5].load(Ordering::Relaxed),
            h: self.latency.buckets.iter().map(|b| b.load(Ordering::Relaxed)).collect(),
        }
    }

    /// Counts who made a response: the gateway's own 5xx apart from the backend's, and
    /// the refusals (401, 403, 429).
    pub fn count_origin(&self, status: u16, by_gateway: bool) {
        if status >= 500 && by_gateway {
            self.gateway_5xx.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(i) = DENIED.iter().position(|&d| d == status)
            && let Some(c) = self.denied.get(i)
        {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Counts one response.
    pub fn count(&self, status: u16) {
        self.by_class.count(status);
    }
}

/// Stable codes of responses the gateway makes itself, for the errors counter.
pub const PROBLEM_CODES: [&str; 32] = [
    "invalid_credentials",
    "insufficient_scope",
    "product_not_in_plan",
    "rate_limited",
    "rate_limit_unavailable",
    "route_not_found",
    "method_not_allowed",
    "payload_too_large",
    "bad_request",
    "upstream_unavailable",
    "upstream_timeout",
    "upstream_protocol_error",
    "upstream_overloaded",
    "circuit_open",
    "shed",
    "node_overloaded",
    "filter_failed",
    "invalid_path",
    "misdirected_request",
    "validation_failed",
    "invalid_json",
    "unsupported_media_type",
    "unsupported_encoding",
    "invalid_encoding",
    // The commonest gRPC statuses of transcoded calls (postern_transcode::status); the
    // rest count as `other`.
    "invalid_argument",
    "deadline_exceeded",
    "not_found",
    "internal",
    "unavailable",
    "internal_error",
    "service_unavailable",
    "other",
];

/// (route id, filter name).
pub(crate) type FilterKey = (Arc<str>, String);
/// (route id, backend cluster).
pub(crate) type BackendKey = (Arc<str>, Arc<str>);

/// All metrics of the process.
#[derive(Debug, Default)]
pub struct Metrics {
    pub(crate) routes: Mutex<BTreeMap<Arc<str>, Arc<RouteMetrics>>>,
    /// Per (route, backend cluster) on routes split across backends (canaries).
    pub(crate) backends: Mutex<BTreeMap<BackendKey, Arc<RouteMetrics>>>,
    pub(crate) filters: Mutex<BTreeMap<FilterKey, Arc<FilterStats>>>,
    /// Requests that matched no route.
    pub unrouted: RouteMetrics,
    pub(crate) problems: [AtomicU64; PROBLEM_CODES.len()],
    /// Snapshots applied.
    pub reloads_ok: AtomicU64,
    /// Snapshots refused.
    pub reloads_failed: AtomicU64,
    /// Version of the running snapshot.
    pub snapshot_version: AtomicU64,
    /// Open client connections.
    pub connections: AtomicU64,
    /// Client connections closed at accept: over the listener's or the address's cap.
    pub connections_refused: AtomicU64,
    /// Client connections closed by the gateway: no first request in time, or idle.
    pub connections_timed_out: AtomicU64,
    /// Credential states applied.
    pub credentials_ok: AtomicU64,
    /// Credential states refused.
    pub credentials_failed: AtomicU64,
    /// Version of the live credential state.
    pub credentials_version: AtomicU64,
    /// Files of folders others can write (the publish directory, the snapshot's folder)
    /// refused before reading: a symbolic link, not a regular file, or over its size cap.
    pub files_refused: AtomicU64,
    /// Responses by pool (public, partner) and status class.
    pub(crate) pools: [Classes; 2],
    /// Responses by the caller's plan and status class (a bounded set of plans).
    pub(crate) plans: [PlanSlot; PLAN_SLOTS],
    /// Responses of callers of plans past the slots, and of callers with no plan.
    pub(crate) other_plans: Classes,
}

impl Metrics {
    /// The metrics of route `id`, created on first use; called when a snapshot is built,
    /// never per request.
    pub fn route(&self, id: &Arc<str>) -> Arc<RouteMetrics> {
        let mut map = self.routes.lock().unwrap_or_else(|p| p.into_inner());
        map.entry(id.clone()).or_default().clone()
    }

    /// The metrics of backend `cluster` of route `id` (a route split across backends, so
    /// versions compare on the same mix of callers), created on first use.
    pub fn backend(&self, id: &Arc<str>, cluster: &Arc<str>) -> Arc<RouteMetrics> {
        let mut map = self.backends.lock().unwrap_or_else(|p| p.into_inner());
        map.entry((id.clone(), cluster.clone())).or_default().clone()
    }

    /// The stats of Wasm filter `name` on route `id`, created on first use; called when a
    /// snapshot is built.
    pub fn filter(&self, id: &Arc<str>, name: &str) -> Arc<FilterStats> {
        let mut map = self.filters.lock().unwrap_or_else(|p| p.into_inner());
        map.entry((id.clone(), name.to_owned())).or_default().clone()
    }

    /// Totals of the routes named (every route that served traffic when `all`), for a
    /// rollout report; off the request path.
    pub fn route_totals(&self, ids: &[String], all: bool) -> BTreeMap<String, RouteCounts> {
        let map = self.routes.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = BTreeMap::new();
        if all {
            for (id, m) in map.iter() {
                let t = m.totals();
                if t.n > 0 {
                    out.insert(id.to_string(), t);
                }
            }
        } else {
            for id in ids {
                if let Some(m) = map.get(id.as_str()) {
                    out.insert(id.clone(), m.totals());
                }
            }
        }
        out
    }

    /// Counts a response by the listener's pool.
    pub fn count_pool(&self, pool: postern_model::Pool, status: u16) {
        let i = usize::from(pool == postern_model::Pool::Partner);
        if let Some(c) = self.pools.get(i) {
            c.count(status);
        }
    }

    /// Counts a response of an authenticated caller by its plan: the first
    /// [`PLAN_SLOTS`] plans seen have their own series, the rest count as `other`.
    /// Lock-free; nothing is allocated once a plan has its slot.
    pub fn count_plan(&self, plan: Option<&bytes::Bytes>, status: u16) {
        let Some(plan) = plan else { return };
        for slot in &self.plans {
            let name = slot.name.get_or_init(|| plan.clone());
            if name == plan {
                slot.classes.count(status);
                return;
            }
        }
        self.other_plans.count(status);
    }

    /// Counts a response the gateway made itself.
    pub fn problem(&self, code: &str) {
        let i = PROBLEM_CODES.iter().position(|c| *c == code).unwrap_or(PROBLEM_CODES.len() - 1);
        if let Some(c) = self.problems.get(i) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }
}
