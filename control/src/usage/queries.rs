//! What the usage API reads: rows by minute, day or route, a period's totals, and what
//! the store holds of each node's windows.

use postern_model::protocol::Missing;
use postern_model::usage::{LATENCY_BUCKETS, quantile_ms};
use serde::Serialize;

use super::db::{DbError, Val, i64_of, vals};
use super::intake::gaps;
use super::params::rfc3339;
use super::store::{UsageStore, round2};

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

/// The longest range a team's query may span: what it reads is bounded (a team has no
/// caller to narrow by, so its query reads every caller's rows of the range).
pub const MAX_TEAM_RANGE_S: u64 = 31 * 86_400;

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

/// A route's answers over a range, every caller's: how many, and the latency 99.9 % of
/// them stayed under (the upper bound of the histogram bucket it falls in).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct RouteLatency {
    /// `team/name`.
    pub route: String,
    /// Answers counted.
    pub calls: u64,
    /// The bucket bound 99.9 % of the answers stayed under; `None` past the last bound.
    pub p999_ms: Option<u64>,
}

impl UsageStore {
    /// Each metered route's answers in [`from`, `to`) (Unix seconds), a team's only when
    /// `team` is given, with its p99.9 from the per-minute histograms.
    pub fn route_latency(&self, from: u64, to: u64, team: Option<&str>) -> Result<Vec<RouteLatency>, DbError> {
        let sums = (0..LATENCY_BUCKETS).map(|i| format!("CAST(SUM(h{i}) AS BIGINT)")).collect::<Vec<_>>().join(", ");
        let mut params: Vec<Val> = vals![i64_of(from)?, i64_of(to)?].into();
        let mut filter = String::new();
        if let Some(team) = team {
            let prefix = format!("{team}/");
            let chars = i64::try_from(prefix.chars().count()).unwrap_or(i64::MAX);
            params.push(prefix.into());
            params.push(chars.into());
            filter.push_str(" AND substr(route, 1, ?4) = ?3");
        }
        let sql_text = format!(
            "SELECT route, {sums} FROM minutes WHERE minute >= ?1 AND minute < ?2{filter}
             GROUP BY route ORDER BY route LIMIT {MAX_ROWS}"
        );
        self.read(|sql| {
            sql.rows(&sql_text, &params)?
                .iter()
                .map(|r| {
                    let mut hist = [0u64; LATENCY_BUCKETS];
                    for (i, v) in hist.iter_mut().enumerate() {
                        *v = r.count(1 + i)?;
                    }
                    let calls = hist.iter().try_fold(0u64, |a, &n| a.checked_add(n)).ok_or(DbError::Overflow)?;
                    Ok(RouteLatency { route: r.text(0)?, calls, p999_ms: bound_of(&hist, 0.999) })
                })
                .collect()
        })
    }

    /// Usage rows for `q`, at most [`MAX_ROWS`]. A team's range is at most
    /// [`MAX_TEAM_RANGE_S`] (refused as [`DbError::Other`] otherwise; the API checks it
    /// first).
    pub fn query(&self, q: &Query) -> Result<Vec<UsageRow>, DbError> {
        if q.team.is_some() && q.to.saturating_sub(q.from) > MAX_TEAM_RANGE_S {
            return Err(DbError::Other(format!("a team's range is at most {} days", MAX_TEAM_RANGE_S / 86_400)));
        }
        let bucket = match q.by {
            By::Route => "NULL",
            By::Minute => "minute",
            By::Day => "(minute / 86400) * 86400",
        };
        let sums = (0..LATENCY_BUCKETS).map(|i| format!("CAST(SUM(h{i}) AS BIGINT)")).collect::<Vec<_>>().join(", ");
        // Only the filters given, so each engine plans with the index that fits (a
        // caller's primary key, or the time index).
        let mut params: Vec<Val> = vals![i64_of(q.from)?, i64_of(q.to)?].into();
        let mut filter = String::new();
        if let Some(caller) = &q.caller {
            params.push(caller.into());
            filter.push_str(&format!(" AND caller = ?{}", params.len()));
        }
        if let Some(product) = &q.product {
            params.push(product.into());
            filter.push_str(&format!(" AND product = ?{}", params.len()));
        }
        if let Some(team) = &q.team {
            let prefix = format!("{team}/");
            let chars = i64::try_from(prefix.chars().count()).unwrap_or(i64::MAX);
            params.push(prefix.into());
            params.push(chars.into());
            filter.push_str(&format!(" AND substr(route, 1, ?{}) = ?{}", params.len(), params.len() - 1));
        }
        let sql_text = format!(
            "SELECT caller, kind, route, product, {bucket} AS at,
                    CAST(SUM(s1) AS BIGINT), CAST(SUM(s2) AS BIGINT), CAST(SUM(s3) AS BIGINT),
                    CAST(SUM(s4) AS BIGINT), CAST(SUM(s5) AS BIGINT), CAST(SUM(latency_us) AS BIGINT), {sums}
             FROM minutes
             WHERE minute >= ?1 AND minute < ?2{filter}
             GROUP BY caller, kind, route, product, at
             ORDER BY caller, kind, route, product, at
             LIMIT {MAX_ROWS}"
        );
        self.read(|sql| {
            sql.rows(&sql_text, &params)?
                .iter()
                .map(|r| {
                    let mut s = [0u64; 5];
                    for (i, v) in s.iter_mut().enumerate() {
                        *v = r.count(5 + i)?;
                    }
                    let latency_us = r.count(10)?;
                    let mut hist = [0u64; LATENCY_BUCKETS];
                    for (i, v) in hist.iter_mut().enumerate() {
                        *v = r.count(11 + i)?;
                    }
                    let calls = s.iter().try_fold(0u64, |a, &n| a.checked_add(n)).ok_or(DbError::Overflow)?;
                    Ok(UsageRow {
                        caller: r.text(0)?,
                        kind: r.text(1)?,
                        route: r.text(2)?,
                        product: r.text(3)?,
                        at: r.opt_int(4)?.map(|t| rfc3339(t.max(0) as u64)),
                        calls,
                        billable: s[1].checked_add(s[2]).ok_or(DbError::Overflow)?,
                        status: StatusClasses::from(s),
                        latency_ms: LatencySummary {
                            mean: if calls == 0 { 0.0 } else { round2(latency_us as f64 / calls as f64 / 1000.0) },
                            p50: round2(quantile_ms(&hist, 0.5).unwrap_or(0.0)),
                            p99: round2(quantile_ms(&hist, 0.99).unwrap_or(0.0)),
                        },
                    })
                })
                .collect()
        })
    }

    /// Totals of one billing period, for one caller or all.
    pub fn totals(&self, period: &str, caller: Option<&str>) -> Result<Vec<Total>, DbError> {
        self.read(|sql| totals_in(sql, period, caller))
    }

    /// Per node: windows applied, the last sequence number and how many below it are
    /// missing (what the reconciler chases).
    pub fn nodes(&self) -> Result<Vec<NodeWindows>, DbError> {
        self.read(|sql| {
            let rows = sql
                .rows(
                    "SELECT a.node, COUNT(DISTINCT a.seq), MAX(a.seq),
                            COUNT(DISTINCT CASE WHEN a.recovered <> 0 THEN a.seq END), COALESCE(MAX(d.windows), 0)
                     FROM applied a LEFT JOIN duplicates d ON d.node = a.node GROUP BY a.node ORDER BY a.node",
                    &[],
                )?
                .iter()
                .map(|r| {
                    Ok(NodeWindows {
                        node: r.text(0)?,
                        windows: r.count(1)?,
                        last_seq: r.count(2)?,
                        missing: 0,
                        recovered: r.count(3)?,
                        duplicates: r.count(4)?,
                    })
                })
                .collect::<Result<Vec<_>, DbError>>()?;
            rows.into_iter()
                .map(|mut n| {
                    let (_, missing) = gaps(sql, &n.node)?;
                    n.missing = missing.iter().map(|m| m.to - m.from + 1).sum();
                    Ok(n)
                })
                .collect()
        })
    }

    /// `node`'s runs of missing window numbers (a window is missing until every part of
    /// it is in), below the highest it has applied.
    pub fn missing(&self, node: &str) -> Result<Vec<Missing>, DbError> {
        self.read(|sql| Ok(gaps(sql, node)?.1))
    }
}

/// Totals of one billing period, for one caller or all, in a transaction.
pub(crate) fn totals_in(
    sql: &mut dyn super::db::Sql,
    period: &str,
    caller: Option<&str>,
) -> Result<Vec<Total>, DbError> {
    let cols = "SELECT caller, kind, product, period, billable, s1, s2, s3, s4, s5, overshoot FROM totals";
    let rows = match caller {
        Some(c) => sql.rows(
            &format!("{cols} WHERE period = ?1 AND caller = ?2 ORDER BY caller, kind, product"),
            &vals![period, c],
        )?,
        None => sql.rows(&format!("{cols} WHERE period = ?1 ORDER BY caller, kind, product"), &vals![period])?,
    };
    rows.iter()
        .map(|r| {
            let mut s = [0u64; 5];
            for (i, v) in s.iter_mut().enumerate() {
                *v = r.count(5 + i)?;
            }
            Ok(Total {
                caller: r.text(0)?,
                kind: r.text(1)?,
                product: r.text(2)?,
                period: r.text(3)?,
                billable: r.count(4)?,
                overshoot: r.count(10)?,
                calls: s.iter().try_fold(0u64, |a, &n| a.checked_add(n)).ok_or(DbError::Overflow)?,
                status: StatusClasses::from(s),
            })
        })
        .collect()
}

/// The bound of the histogram bucket holding quantile `q` of `hist` (calls by
/// [`postern_model::usage::LATENCY_BOUNDS_MS`]); `None` when it is past the last bound or
/// nothing was counted.
fn bound_of(hist: &[u64; LATENCY_BUCKETS], q: f64) -> Option<u64> {
    let total: u64 = hist.iter().sum();
    let rank = (q * total as f64).ceil().max(1.0) as u64;
    let mut seen = 0u64;
    for (i, &n) in hist.iter().enumerate() {
        seen = seen.saturating_add(n);
        if total > 0 && seen >= rank {
            return postern_model::usage::LATENCY_BOUNDS_MS.get(i).map(|&b| u64::from(b));
        }
    }
    None
}
