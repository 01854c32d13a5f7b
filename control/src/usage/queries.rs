//! What the usage API reads: rows by minute, day or route, a period's totals, and what
//! the store holds of each node's windows.

use postern_model::protocol::Missing;
use postern_model::usage::{LATENCY_BUCKETS, quantile_ms};
use rusqlite::params;
use serde::Serialize;

use super::intake::gaps;
use super::params::rfc3339;
use super::store::{UsageStore, round2, sql_int};

/// How [`UsageStore::query`] groups rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum By {
    /// One row per caller and route over the whole range.
    Route,
    /// Per minute.
    Minute,
    /// Per UTC day.
    Day,
}

impl By {
    /// `route`, `minute` or `day`.
    pub fn parse(s: &str) -> Option<By> {
        match s {
            "route" => Some(By::Route),
            "minute" => Some(By::Minute),
            "day" => Some(By::Day),
            _ => None,
        }
    }
}

/// What to read.
#[derive(Debug, Clone)]
pub struct Query {
    /// One caller (key id or `client_id`), or every one.
    pub caller: Option<String>,
    /// One product, or every one.
    pub product: Option<String>,
    /// Only routes of this team (`team/…`).
    pub team: Option<String>,
    /// Unix seconds, inclusive.
    pub from: u64,
    /// Unix seconds, exclusive.
    pub to: u64,
    /// Grouping.
    pub by: By,
}

/// Rows a query answers at most.
pub const MAX_ROWS: usize = 10_000;

/// One row of a usage answer.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct UsageRow {
    /// Key id or `client_id`.
    pub caller: String,
    /// `key` or `app`.
    pub kind: String,
    /// `team/name`.
    pub route: String,
    /// The route's product.
    pub product: String,
    /// The minute's or day's start (RFC 3339); absent when grouped by route.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub at: Option<String>,
    /// Every answered call.
    pub calls: u64,
    /// Calls answered 2xx or 3xx.
    pub billable: u64,
    /// Calls by status class.
    pub status: StatusClasses,
    /// Latency in milliseconds.
    pub latency_ms: LatencySummary,
}

/// Calls by status class.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct StatusClasses {
    #[serde(rename = "1xx")]
    pub(crate) s1: u64,
    #[serde(rename = "2xx")]
    pub(crate) s2: u64,
    #[serde(rename = "3xx")]
    pub(crate) s3: u64,
    #[serde(rename = "4xx")]
    pub(crate) s4: u64,
    #[serde(rename = "5xx")]
    pub(crate) s5: u64,
}

impl StatusClasses {
    fn from(s: [u64; 5]) -> StatusClasses {
        StatusClasses { s1: s[0], s2: s[1], s3: s[2], s4: s[3], s5: s[4] }
    }
}

/// Mean and quantiles (from the histogram, interpolated within a bucket).
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct LatencySummary {
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
}

/// A caller's total for one product and billing period.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Total {
    /// Key id or `client_id`.
    pub caller: String,
    /// `key` or `app`.
    pub kind: String,
    /// The product.
    pub product: String,
    /// `YYYY-MM`.
    pub period: String,
    /// Calls answered 2xx or 3xx, but for overshoot: what is billed.
    pub billable: u64,
    /// Calls answered 2xx or 3xx past a hard quota, admitted before its flag reached
    /// the nodes: counted, not billed.
    pub overshoot: u64,
    /// Every answered call.
    pub calls: u64,
    /// Calls by status class.
    pub status: StatusClasses,
}

/// What the store holds of one node's windows.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct NodeWindows {
    /// The node.
    pub node: String,
    /// Windows applied.
    pub windows: u64,
    /// The highest sequence number applied.
    pub last_seq: u64,
    /// Sequence numbers below `last_seq` never received.
    pub missing: u64,
    /// Windows rebuilt by the node from a checkpoint after a crash.
    pub recovered: u64,
    /// Deliveries of windows already applied, dropped.
    pub duplicates: u64,
}

impl UsageStore {
    /// Usage rows for `q`, at most [`MAX_ROWS`].
    pub fn query(&self, q: &Query) -> rusqlite::Result<Vec<UsageRow>> {
        let bucket = match q.by {
            By::Route => "NULL",
            By::Minute => "minute",
            By::Day => "(minute / 86400) * 86400",
        };
        let sums = (0..LATENCY_BUCKETS).map(|i| format!("SUM(h{i})")).collect::<Vec<_>>().join(", ");
        let sql = format!(
            "SELECT caller, kind, route, product, {bucket} AS at,
                    SUM(s1), SUM(s2), SUM(s3), SUM(s4), SUM(s5), SUM(latency_us), {sums}
             FROM minutes
             WHERE minute >= ?1 AND minute < ?2
               AND (?3 IS NULL OR caller = ?3)
               AND (?4 IS NULL OR product = ?4)
               AND (?5 IS NULL OR substr(route, 1, length(?5)) = ?5)
             GROUP BY caller, kind, route, product, at
             ORDER BY caller, kind, route, product, at
             LIMIT {MAX_ROWS}"
        );
        let team = q.team.as_ref().map(|t| format!("{t}/"));
        let conn = self.lock();
        let mut stmt = conn.prepare_cached(&sql)?;
        let rows = stmt.query_map(params![sql_int(q.from), sql_int(q.to), q.caller, q.product, team], |r| {
            let mut s = [0u64; 5];
            for (i, v) in s.iter_mut().enumerate() {
                *v = r.get::<_, i64>(5 + i)?.max(0) as u64;
            }
            let latency_us = r.get::<_, i64>(10)?.max(0) as u64;
            let mut hist = [0u64; LATENCY_BUCKETS];
            for (i, v) in hist.iter_mut().enumerate() {
                *v = r.get::<_, i64>(11 + i)?.max(0) as u64;
            }
            let calls: u64 = s.iter().sum();
            let at: Option<i64> = r.get(4)?;
            Ok(UsageRow {
                caller: r.get(0)?,
                kind: r.get(1)?,
                route: r.get(2)?,
                product: r.get(3)?,
                at: at.map(|t| rfc3339(t.max(0) as u64)),
                calls,
                billable: s[1] + s[2],
                status: StatusClasses::from(s),
                latency_ms: LatencySummary {
                    mean: if calls == 0 { 0.0 } else { round2(latency_us as f64 / calls as f64 / 1000.0) },
                    p50: round2(quantile_ms(&hist, 0.5).unwrap_or(0.0)),
                    p99: round2(quantile_ms(&hist, 0.99).unwrap_or(0.0)),
                },
            })
        })?;
        rows.collect()
    }

    /// Totals of one billing period, for one caller or all.
    pub fn totals(&self, period: &str, caller: Option<&str>) -> rusqlite::Result<Vec<Total>> {
        let conn = self.lock();
        let mut stmt = conn.prepare_cached(
            "SELECT caller, kind, product, period, billable, s1, s2, s3, s4, s5, overshoot FROM totals
             WHERE period = ?1 AND (?2 IS NULL OR caller = ?2) ORDER BY caller, kind, product",
        )?;
        let rows = stmt.query_map(params![period, caller], |r| {
            let mut s = [0u64; 5];
            for (i, v) in s.iter_mut().enumerate() {
                *v = r.get::<_, i64>(5 + i)?.max(0) as u64;
            }
            Ok(Total {
                caller: r.get(0)?,
                kind: r.get(1)?,
                product: r.get(2)?,
                period: r.get(3)?,
                billable: r.get::<_, i64>(4)?.max(0) as u64,
                overshoot: r.get::<_, i64>(10)?.max(0) as u64,
                calls: s.iter().sum(),
                status: StatusClasses::from(s),
            })
        })?;
        rows.collect()
    }

    /// Per node: windows applied, the last sequence number and how many below it are
    /// missing (what the reconciler chases).
    pub fn nodes(&self) -> rusqlite::Result<Vec<NodeWindows>> {
        let conn = self.lock();
        let mut stmt = conn.prepare_cached(
            "SELECT a.node, COUNT(DISTINCT a.seq), MAX(a.seq), COUNT(DISTINCT CASE WHEN a.recovered THEN a.seq END),
                    COALESCE(MAX(d.windows), 0)
             FROM applied a LEFT JOIN duplicates d ON d.node = a.node GROUP BY a.node ORDER BY a.node",
        )?;
        let rows = stmt
            .query_map([], |r| {
                Ok(NodeWindows {
                    node: r.get(0)?,
                    windows: r.get::<_, i64>(1)?.max(0) as u64,
                    last_seq: r.get::<_, i64>(2)?.max(0) as u64,
                    missing: 0,
                    recovered: r.get::<_, i64>(3)?.max(0) as u64,
                    duplicates: r.get::<_, i64>(4)?.max(0) as u64,
                })
            })?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        drop(stmt);
        rows.into_iter()
            .map(|mut n| {
                let (_, missing) = gaps(&conn, &n.node)?;
                n.missing = missing.iter().map(|m| m.to - m.from + 1).sum();
                Ok(n)
            })
            .collect()
    }

    /// `node`'s runs of missing window numbers (a window is missing until every part of
    /// it is in), below the highest it has applied.
    pub fn missing(&self, node: &str) -> rusqlite::Result<Vec<Missing>> {
        Ok(gaps(&self.lock(), node)?.1)
    }
}
