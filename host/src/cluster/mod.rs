//! A backend cluster on this node: its hosts and their pools, the choice of host, its
//! breaker, retry budget, shedding and latency, its cap on requests in flight, and the
//! connectors that reach it.

pub mod connect;
pub mod shedding;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use http::uri::Authority;

/// A backend cluster: its hosts, each request to the less loaded of two drawn by
/// weight among those not ejected.
#[derive(Debug)]
pub struct Upstream {
    /// Cluster name.
    pub name: Arc<str>,
    /// Distinct hosts (a list may name one twice, as a weight), as `hosts` indexes them.
    pub(crate) endpoints: Vec<Authority>,
    /// The hosts' load, failures and ejections, kept across snapshots while the
    /// cluster's endpoint list stays the same.
    pub hosts: Arc<postern_protect::Hosts>,
    /// Requests in flight to the cluster, kept across snapshots.
    pub(crate) inflight: Arc<AtomicU32>,
    pub(crate) max_inflight: u32,
    /// The cluster's circuit breaker on this node, kept across snapshots while its
    /// settings stay the same.
    pub breaker: Arc<postern_protect::Breaker>,
    /// The cluster's retry budget on this node, kept the same way.
    pub budget: Arc<postern_protect::RetryBudget>,
    /// The cluster's priority shedding on this node, kept across snapshots.
    pub shed: Arc<postern_protect::Shedder>,
    /// How long its backend takes, against its normal, kept across snapshots.
    pub latency: Arc<postern_protect::Latency>,
    /// Requests in flight at which the cluster counts as overloaded.
    pub(crate) shed_at: u32,
    /// Requests in flight from which the lower classes may not take every place.
    pub(crate) reserved_from: u32,
    /// How the gateway speaks to its hosts.
    pub transport: crate::cluster::connect::Transport,
    /// Open connections by backend host (the node's, across clusters).
    pub(crate) conns: Arc<crate::cluster::connect::Conns>,
    /// Each host's idle connections, by the hosts' index.
    pub(crate) pools: Vec<Arc<crate::cluster::connect::HostPool>>,
}

/// The share of a cluster's cap, in percent, each class may fill (by rank: `critical`,
/// `standard`, `free`, `sheddable`).
pub const CAP_SHARE: [u64; 4] = [100, 90, 80, 70];

impl Upstream {
    /// Connections open to the cluster's hosts now (a host shared with another cluster
    /// counts in both).
    pub fn open_connections(&self) -> u64 {
        let default = if self.transport.tls.is_some() { 443 } else { 80 };
        self.endpoints
            .iter()
            .map(|a| self.conns.open(&format!("{}:{}", a.host(), a.port_u16().unwrap_or(default))))
            .sum()
    }

    /// The host for a request (its index and authority): the less loaded of two drawn
    /// by weight among the hosts not ejected.
    pub fn pick(&self, now: std::time::Instant) -> Option<(usize, &Authority)> {
        let i = self.hosts.pick(now, [fastrand::u32(..), fastrand::u32(..)])?;
        Some((i, self.endpoints.get(i)?))
    }

    /// The idle connections of host `i` (an index [`Upstream::pick`] gave).
    pub fn pool(&self, i: usize) -> Option<&Arc<crate::cluster::connect::HostPool>> {
        self.pools.get(i)
    }

    /// Whether the cluster has two hosts or more (a retry goes to another).
    pub fn has_other(&self) -> bool {
        self.endpoints.len() > 1
    }

    /// Another host than `not` that is not ejected, for a retry; `None` when there is none.
    pub fn pick_other(&self, not: usize, now: std::time::Instant) -> Option<(usize, &Authority)> {
        let i = self.hosts.pick_other(not, now, fastrand::u32(..))?;
        Some((i, self.endpoints.get(i)?))
    }

    /// Whether the cluster is overloaded now: its requests in flight at the shedding
    /// mark, or its answers since the last tick far slower than its normal (a full cap,
    /// or a backend's overload answer, strain its shedder directly). Called once per
    /// shedding tick.
    pub fn overloaded(&self) -> bool {
        let slow = self.latency.tick();
        slow || self.in_flight() >= self.shed_at
    }

    /// Requests in flight to the cluster now.
    pub fn in_flight(&self) -> u32 {
        self.inflight.load(Ordering::Relaxed)
    }

    /// What `/readyz` shows of the cluster.
    pub fn state(&self, now: std::time::Instant) -> serde_json::Value {
        let b = &self.breaker;
        let state = b.state(now);
        let mut breaker = serde_json::json!({"state": state.as_str(), "opened": b.opened(), "refused": b.refused()});
        if let postern_protect::State::Open(left) = state {
            breaker["probing_in_ms"] = u64::try_from(left.as_millis()).unwrap_or(u64::MAX).into();
        }
        let (requests, retries) = self.budget.counts(now);
        let (normal, last) = self.latency.p99s();
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        let hosts: Vec<serde_json::Value> = (0..self.endpoints.len())
            .filter_map(|i| {
                let h = self.hosts.state(i, now)?;
                let mut v = serde_json::json!({
                    "endpoint": self.endpoints[i].as_str(), "in_flight": h.in_flight, "ejections": h.ejections,
                });
                if let Some(d) = h.ejected_for {
                    v["ejected_for_ms"] = u64::try_from(d.as_millis()).unwrap_or(u64::MAX).into();
                }
                Some(v)
            })
            .collect();
        serde_json::json!({
            "endpoints": self.endpoints.len(),
            "hosts": hosts,
            "in_flight": self.in_flight(),
            "max_in_flight": self.max_inflight,
            "breaker": breaker,
            "retry_budget": {"requests": requests, "retries": retries, "retried": self.budget.retried(), "denied": self.budget.denied()},
            "shed": {"at_in_flight": self.shed_at, "level": self.shed.level(), "shed": crate::cluster::shedding::classes(&self.shed.shed())},
            "latency": {"normal_p99_ms": ms(normal), "last_p99_ms": ms(last)},
        })
    }

    /// A place in the cluster's connection cap, or `None` when it is full for the
    /// request's class (which strains the cluster's shedder: its routes start shedding
    /// by priority). The last places are kept for the higher classes: a class may fill
    /// only its [`CAP_SHARE`] of the cap, so `critical` requests still find room when
    /// the others have filled theirs.
    pub fn permit(&self, class: impl FnOnce() -> postern_model::Priority) -> Option<postern_protect::Permit> {
        let max = if self.in_flight() >= self.reserved_from {
            let share = CAP_SHARE.get(class().rank()).copied().unwrap_or(100);
            (u64::from(self.max_inflight) * share / 100).max(1) as u32
        } else {
            self.max_inflight
        };
        let p = postern_protect::Permit::take(&self.inflight, max);
        if p.is_none() {
            self.shed.strain();
        }
        p
    }
}
