//! What a node tells the control plane about its traffic during a staged rollout: per
//! route, cumulative responses, 5xx responses and a latency histogram, by the snapshot
//! version it runs. The control plane takes differences between reports, so a lost
//! report costs nothing but resolution.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Upper bounds of the latency histogram buckets, in microseconds; one more bucket holds
/// everything slower. Shared by `/metrics` and by rollout reports.
pub const LATENCY_BOUNDS_US: [u64; 18] = [
    50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000, 1_000_000, 2_500_000,
    5_000_000, 10_000_000, 30_000_000,
];

/// Number of latency buckets, the overflow bucket included.
pub const LATENCY_BUCKETS: usize = LATENCY_BOUNDS_US.len() + 1;

/// Cumulative counts of one route on one node since the node started.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteCounts {
    /// Responses.
    pub n: u64,
    /// 5xx responses (the backend's and the gateway's own).
    pub e5: u64,
    /// Responses per latency bucket ([`LATENCY_BUCKETS`] entries).
    pub h: Vec<u64>,
}

impl RouteCounts {
    /// What happened between `earlier` and `self` (counters only grow; a restart or a
    /// mismatched shape gives zero rather than nonsense).
    pub fn since(&self, earlier: &RouteCounts) -> RouteCounts {
        if self.n < earlier.n || self.h.len() != earlier.h.len() {
            return RouteCounts::default();
        }
        RouteCounts {
            n: self.n - earlier.n,
            e5: self.e5.saturating_sub(earlier.e5),
            h: self.h.iter().zip(&earlier.h).map(|(a, b)| a.saturating_sub(*b)).collect(),
        }
    }
}

/// One node's report.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Report {
    /// The snapshot version the node runs.
    pub snapshot: u64,
    /// Counts of the routes the control plane asked for.
    pub routes: BTreeMap<String, RouteCounts>,
}

/// The control plane's answer: which routes to report next time.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Watch {
    /// Route ids to report.
    pub routes: Vec<String>,
    /// Report every route that served traffic.
    #[serde(default)]
    pub all: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn differences_never_go_negative() {
        let a = RouteCounts { n: 10, e5: 2, h: vec![5, 5] };
        let b = RouteCounts { n: 15, e5: 2, h: vec![7, 8] };
        assert_eq!(b.since(&a), RouteCounts { n: 5, e5: 0, h: vec![2, 3] });
        // A node that restarted reports smaller totals: nothing is counted.
        assert_eq!(a.since(&b), RouteCounts::default());
    }
}
