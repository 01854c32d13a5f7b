//! The usage store: nodes' closed windows applied exactly once, and what billing and the
//! usage API read from them.
//!
//! One SQLite database (`usage.db` beside a directory store) in WAL mode with
//! `synchronous=FULL`: a commit is on disk before the intake acknowledges. A batch of
//! windows is one transaction that records each window's (node, seq) in `applied` — a
//! window already there is a duplicate and adds nothing — and adds its rows to `totals`
//! (per caller, product and billing period) and `minutes` (per caller, route, product
//! and minute, with the latency histogram). A failed write rolls the whole batch back
//! and the node sends it again: a window is never "seen but not added".
//!
//! SQLite is the embedded store because it gives exactly that transaction on one file
//! with no server to run; the directory store gives atomic renames of whole files, not
//! a counter and its dedupe key in one commit.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use postern_model::credentials::{Credentials, QuotaFlag};
use postern_model::protocol::{Missing, UsageAck};
use postern_model::usage::{CallerKind, LATENCY_BUCKETS, NodeCounters, Window, month_period, quantile_ms};
use postern_model::{Plan, Quota, QuotaMode};
use rusqlite::{Connection, OptionalExtension, params};
use serde::Serialize;

/// The usage database of a control plane.
#[derive(Debug)]
pub struct UsageStore {
    conn: Mutex<Connection>,
    path: PathBuf,
}

/// Why a batch was not applied (nothing of it was).
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// A window's (node, seq) was applied before with other contents.
    #[error(
        "usage window {node}/{seq} was applied before with other contents: the node numbers its windows again \
         (its spool was lost?); give it a new node id"
    )]
    Conflict {
        /// The node.
        node: String,
        /// The sequence number.
        seq: u64,
    },
    /// The database failed.
    #[error("usage store: {0}")]
    Sql(#[from] rusqlite::Error),
    /// Something the apply needs is not there now (the quotas, a worker thread).
    #[error("usage store: {0}")]
    Unavailable(String),
}

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
    s1: u64,
    #[serde(rename = "2xx")]
    s2: u64,
    #[serde(rename = "3xx")]
    s3: u64,
    #[serde(rename = "4xx")]
    s4: u64,
    #[serde(rename = "5xx")]
    s5: u64,
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

/// Who is on which quota: each plan's quota and the plan of every API key and OAuth app,
/// from the published snapshot and credentials.
#[derive(Debug, Default, Clone)]
pub struct Quotas {
    plans: HashMap<String, Quota>,
    keys: HashMap<String, String>,
    apps: HashMap<String, String>,
}

impl Quotas {
    /// The quotas of `plans`, for the callers of `creds` on a plan that has one.
    pub fn new(plans: &BTreeMap<String, Plan>, creds: &Credentials) -> Quotas {
        let plans: HashMap<String, Quota> =
            plans.iter().filter_map(|(name, p)| Some((name.clone(), p.quota?))).collect();
        if plans.is_empty() {
            return Quotas::default();
        }
        let keys =
            creds.keys.iter().filter(|k| plans.contains_key(&k.plan)).map(|k| (k.id.clone(), k.plan.clone())).collect();
        let apps = creds
            .apps
            .iter()
            .filter(|(_, a)| plans.contains_key(&a.plan))
            .map(|(id, a)| (id.clone(), a.plan.clone()))
            .collect();
        Quotas { plans, keys, apps }
    }

    /// The quota `caller` is on, if any.
    pub fn of(&self, kind: CallerKind, caller: &str) -> Option<Quota> {
        let plans = match kind {
            CallerKind::Key => &self.keys,
            CallerKind::App => &self.apps,
        };
        self.plans.get(plans.get(caller)?).copied()
    }
}

/// A warning the quota service raised: a caller passed 80 % or 100 % of its quota.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct QuotaEvent {
    /// Its number, in the order raised.
    pub id: u64,
    /// `quota.warning` (80 %) or `quota.exhausted` (100 %).
    #[serde(rename = "type")]
    pub kind: String,
    /// When the window that crossed was applied (RFC 3339).
    pub at: String,
    /// Key id or `client_id`.
    pub caller: String,
    /// `key` or `app`.
    pub caller_kind: String,
    /// The product.
    pub product: String,
    /// The period's bounds (RFC 3339).
    pub period_start: String,
    /// End (exclusive).
    pub period_end: String,
    /// 80 or 100.
    pub percent: u64,
    /// Calls used when it was raised.
    pub used: u64,
    /// The quota.
    pub quota: u64,
    /// `hard` or `overage`.
    pub mode: String,
    /// Whether the webhook took it.
    pub delivered: bool,
    /// Deliveries tried.
    pub attempts: u64,
}

/// The applied parts of windows: (node, seq, part) is applied once; `raw` is the part as
/// it was applied, to tell a re-send (the same bytes) from a renumbering node.
const APPLIED: &str = "CREATE TABLE IF NOT EXISTS applied (
    node TEXT NOT NULL, seq INTEGER NOT NULL, part INTEGER NOT NULL, parts INTEGER NOT NULL,
    start INTEGER NOT NULL, recovered INTEGER NOT NULL, calls INTEGER NOT NULL, received INTEGER NOT NULL,
    raw BLOB NOT NULL, PRIMARY KEY (node, seq, part)) WITHOUT ROWID;";

/// Rewrites a whole-window `applied` table as parts ([`Window::split`]).
fn migrate_applied(conn: &Connection) -> anyhow::Result<()> {
    let tx = conn.unchecked_transaction()?;
    tx.execute_batch(&format!("ALTER TABLE applied RENAME TO applied_by_window; {APPLIED}"))?;
    {
        let mut read = tx.prepare("SELECT raw, received FROM applied_by_window")?;
        let mut insert = tx.prepare(
            "INSERT INTO applied (node, seq, part, parts, start, recovered, calls, received, raw)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
        )?;
        let mut rows = read.query([])?;
        while let Some(r) = rows.next()? {
            let raw: Vec<u8> = r.get(0)?;
            let received: i64 = r.get(1)?;
            let w: Window = serde_json::from_slice(&raw)?;
            for p in w.split() {
                let calls: u64 = p.rows.iter().map(|r| r.calls()).sum();
                insert.execute(params![
                    p.node,
                    sql_int(p.seq),
                    p.part,
                    p.parts,
                    sql_int(p.start),
                    p.recovered,
                    sql_int(calls),
                    received,
                    serde_json::to_vec(&p)?
                ])?;
            }
        }
    }
    tx.execute_batch("DROP TABLE applied_by_window")?;
    tx.commit()?;
    Ok(())
}

fn hist_cols(prefix: &str) -> String {
    (0..LATENCY_BUCKETS).map(|i| format!("{prefix}h{i}")).collect::<Vec<_>>().join(", ")
}

impl UsageStore {
    /// Opens (creating) the database at `path`.
    pub fn open(path: &Path) -> anyhow::Result<UsageStore> {
        let conn = Connection::open(path).map_err(|e| anyhow::anyhow!("usage store {}: {e}", path.display()))?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "FULL")?;
        conn.busy_timeout(std::time::Duration::from_secs(10))?;
        // A store made before windows were applied by part has `applied` keyed by
        // (node, seq): its windows are split into their parts once, in one transaction.
        let by_window = conn.prepare("SELECT seq FROM applied LIMIT 0").is_ok()
            && conn.prepare("SELECT part FROM applied LIMIT 0").is_err();
        if by_window {
            migrate_applied(&conn)?;
        }
        let hist_decl = (0..LATENCY_BUCKETS).map(|i| format!("h{i} INTEGER NOT NULL")).collect::<Vec<_>>().join(", ");
        conn.execute_batch(&format!(
            "{APPLIED}
             CREATE TABLE IF NOT EXISTS totals (
                caller TEXT NOT NULL, kind TEXT NOT NULL, product TEXT NOT NULL, period TEXT NOT NULL,
                billable INTEGER NOT NULL, s1 INTEGER NOT NULL, s2 INTEGER NOT NULL, s3 INTEGER NOT NULL,
                s4 INTEGER NOT NULL, s5 INTEGER NOT NULL, overshoot INTEGER NOT NULL DEFAULT 0,
                PRIMARY KEY (caller, kind, product, period)) WITHOUT ROWID;
             CREATE TABLE IF NOT EXISTS minutes (
                caller TEXT NOT NULL, kind TEXT NOT NULL, route TEXT NOT NULL, product TEXT NOT NULL,
                minute INTEGER NOT NULL,
                s1 INTEGER NOT NULL, s2 INTEGER NOT NULL, s3 INTEGER NOT NULL, s4 INTEGER NOT NULL,
                s5 INTEGER NOT NULL, latency_us INTEGER NOT NULL, {hist_decl},
                PRIMARY KEY (caller, kind, route, product, minute)) WITHOUT ROWID;
             CREATE INDEX IF NOT EXISTS minutes_by_time ON minutes (minute);
             CREATE TABLE IF NOT EXISTS contiguous (
                node TEXT NOT NULL PRIMARY KEY, seq INTEGER NOT NULL) WITHOUT ROWID;
             CREATE TABLE IF NOT EXISTS periods (
                period TEXT NOT NULL PRIMARY KEY, final_at INTEGER, late INTEGER NOT NULL) WITHOUT ROWID;
             CREATE TABLE IF NOT EXISTS duplicates (
                node TEXT NOT NULL PRIMARY KEY, windows INTEGER NOT NULL) WITHOUT ROWID;
             CREATE TABLE IF NOT EXISTS quota_use (
                caller TEXT NOT NULL, kind TEXT NOT NULL, product TEXT NOT NULL,
                period_start INTEGER NOT NULL, period_end INTEGER NOT NULL, used INTEGER NOT NULL,
                PRIMARY KEY (caller, kind, product, period_start)) WITHOUT ROWID;
             CREATE TABLE IF NOT EXISTS quota_events (
                id INTEGER PRIMARY KEY AUTOINCREMENT, at INTEGER NOT NULL,
                caller TEXT NOT NULL, kind TEXT NOT NULL, product TEXT NOT NULL,
                period_start INTEGER NOT NULL, period_end INTEGER NOT NULL, percent INTEGER NOT NULL,
                used INTEGER NOT NULL, quota INTEGER NOT NULL, mode TEXT NOT NULL,
                delivered INTEGER NOT NULL DEFAULT 0, attempts INTEGER NOT NULL DEFAULT 0,
                next_try INTEGER NOT NULL DEFAULT 0,
                UNIQUE (caller, kind, product, period_start, percent));
             CREATE TABLE IF NOT EXISTS over_quota (
                caller TEXT NOT NULL, kind TEXT NOT NULL, product TEXT NOT NULL, until INTEGER NOT NULL,
                quota INTEGER NOT NULL, period_s INTEGER NOT NULL, since INTEGER NOT NULL,
                PRIMARY KEY (caller, kind, product, until)) WITHOUT ROWID;
             CREATE TABLE IF NOT EXISTS node_counters (
                node TEXT NOT NULL, period TEXT NOT NULL, through INTEGER NOT NULL, calls INTEGER NOT NULL,
                received INTEGER NOT NULL, raw BLOB NOT NULL, PRIMARY KEY (node, period)) WITHOUT ROWID;
             CREATE TABLE IF NOT EXISTS corrections (
                node TEXT NOT NULL, period TEXT NOT NULL, caller TEXT NOT NULL, kind TEXT NOT NULL,
                product TEXT NOT NULL, s1 INTEGER NOT NULL, s2 INTEGER NOT NULL, s3 INTEGER NOT NULL,
                s4 INTEGER NOT NULL, s5 INTEGER NOT NULL,
                PRIMARY KEY (node, period, caller, kind, product)) WITHOUT ROWID;"
        ))?;
        // `overshoot` came with quotas: a store made before them gains the column.
        let has_overshoot = conn.prepare("SELECT overshoot FROM totals LIMIT 0").is_ok();
        if !has_overshoot {
            conn.execute_batch("ALTER TABLE totals ADD COLUMN overshoot INTEGER NOT NULL DEFAULT 0")?;
        }
        Ok(UsageStore { conn: Mutex::new(conn), path: path.to_owned() })
    }

    /// Where the database is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Applies checked windows in one transaction: each is added once, a window already
    /// applied is counted as a duplicate and changes nothing. `now` is Unix seconds.
    ///
    /// The billable calls of a caller on a quota are added to its period's use in the
    /// same transaction: passing 80 % and 100 % raises an event, and on a hard quota
    /// 100 % raises an over-quota flag until the period's end; the calls past a hard
    /// quota (admitted before the flag reached the nodes) are overshoot, not billed.
    pub fn apply(&self, windows: &[Window], now: u64, quotas: &Quotas) -> Result<UsageAck, ApplyError> {
        let mut conn = self.lock();
        let tx = conn.transaction()?;
        let mut ack = UsageAck::default();
        {
            let mut mark = tx.prepare_cached(
                "INSERT INTO applied (node, seq, part, parts, start, recovered, calls, received, raw)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9) ON CONFLICT DO NOTHING",
            )?;
            let mut reopen = tx.prepare_cached(
                "UPDATE periods SET final_at = NULL, late = late + 1 WHERE period = ?1 AND final_at IS NOT NULL",
            )?;
            let mut total = tx.prepare_cached(
                "INSERT INTO totals (caller, kind, product, period, billable, s1, s2, s3, s4, s5, overshoot)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)
                 ON CONFLICT DO UPDATE SET billable = billable + excluded.billable,
                   s1 = s1 + excluded.s1, s2 = s2 + excluded.s2, s3 = s3 + excluded.s3,
                   s4 = s4 + excluded.s4, s5 = s5 + excluded.s5, overshoot = overshoot + excluded.overshoot",
            )?;
            let cols = hist_cols("");
            let marks = (12..12 + LATENCY_BUCKETS).map(|i| format!("?{i}")).collect::<Vec<_>>().join(", ");
            let adds =
                (0..LATENCY_BUCKETS).map(|i| format!("h{i} = h{i} + excluded.h{i}")).collect::<Vec<_>>().join(", ");
            let mut minute = tx.prepare_cached(&format!(
                "INSERT INTO minutes (caller, kind, route, product, minute, s1, s2, s3, s4, s5, latency_us, {cols})
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, {marks})
                 ON CONFLICT DO UPDATE SET s1 = s1 + excluded.s1, s2 = s2 + excluded.s2,
                   s3 = s3 + excluded.s3, s4 = s4 + excluded.s4, s5 = s5 + excluded.s5,
                   latency_us = latency_us + excluded.latency_us, {adds}"
            ))?;
            for delivery in windows {
                // Each part once: a delivery adds what is new in it, and is a duplicate
                // if nothing is.
                let mut fresh_parts = Vec::new();
                for w in delivery.split() {
                    let raw = serde_json::to_vec(&w).unwrap_or_default();
                    let calls: u64 = w.rows.iter().map(|r| r.calls()).sum();
                    let fresh = mark.execute(params![
                        w.node,
                        sql_int(w.seq),
                        w.part,
                        w.parts,
                        sql_int(w.start),
                        w.recovered,
                        sql_int(calls),
                        sql_int(now),
                        raw
                    ])? == 1;
                    if fresh {
                        fresh_parts.push(w);
                        continue;
                    }
                    // The same (node, seq, part) with other contents is not a re-send: the
                    // node lost its spool and numbers again from 1. Nothing of the batch
                    // is applied; the operator gives the node a new id.
                    let known: Vec<u8> = tx.query_row(
                        "SELECT raw FROM applied WHERE node = ?1 AND seq = ?2 AND part = ?3",
                        params![w.node, sql_int(w.seq), w.part],
                        |r| r.get(0),
                    )?;
                    if known != raw {
                        return Err(ApplyError::Conflict { node: w.node.clone(), seq: w.seq });
                    }
                }
                if fresh_parts.is_empty() {
                    ack.duplicates += 1;
                    tx.execute(
                        "INSERT INTO duplicates (node, windows) VALUES (?1, 1)
                         ON CONFLICT DO UPDATE SET windows = windows + 1",
                        params![delivery.node],
                    )?;
                    continue;
                }
                ack.applied += 1;
                for w in &fresh_parts {
                    let (period, _, _) = month_period(w.start);
                    // A window of a period already final reopens it: the export waits for the
                    // next reconcile.
                    reopen.execute(params![period])?;
                    let minute_start = sql_int(w.start - w.start % 60);
                    for r in &w.rows {
                        let s = r.status.map(sql_int);
                        let billable = r.billable();
                        let overshoot = match quotas.of(r.kind, &r.caller) {
                            Some(q) if billable > 0 => use_quota(&tx, r, q, w.start, billable, now)?,
                            _ => 0,
                        };
                        total.execute(params![
                            r.caller,
                            r.kind.as_str(),
                            r.product,
                            period,
                            sql_int(billable - overshoot),
                            s[0],
                            s[1],
                            s[2],
                            s[3],
                            s[4],
                            sql_int(overshoot)
                        ])?;
                        let mut values: Vec<Box<dyn rusqlite::ToSql>> = vec![
                            Box::new(r.caller.clone()),
                            Box::new(r.kind.as_str()),
                            Box::new(r.route.clone()),
                            Box::new(r.product.clone()),
                            Box::new(minute_start),
                        ];
                        values.extend(s.iter().map(|&n| Box::new(n) as Box<dyn rusqlite::ToSql>));
                        values.push(Box::new(sql_int(r.latency_us)));
                        values.extend(r.latency.iter().map(|&n| Box::new(sql_int(n)) as Box<dyn rusqlite::ToSql>));
                        minute.execute(rusqlite::params_from_iter(values.iter()))?;
                    }
                }
            }
        }
        let nodes: std::collections::BTreeSet<&str> = windows.iter().map(|w| w.node.as_str()).collect();
        for node in nodes {
            ack.missing.extend(advance(&tx, node)?);
        }
        tx.commit()?;
        Ok(ack)
    }

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

    /// Stores a node's own counters of a period complete on it (checked): the report with
    /// the highest `through` is kept, and a changed one reopens a final period until the
    /// next reconcile. `now` is Unix seconds.
    pub fn put_counters(&self, c: &NodeCounters, now: u64) -> rusqlite::Result<()> {
        let raw = serde_json::to_vec(c).unwrap_or_default();
        let mut conn = self.lock();
        let tx = conn.transaction()?;
        let changed = tx.execute(
            "INSERT INTO node_counters (node, period, through, calls, received, raw) VALUES (?1, ?2, ?3, ?4, ?5, ?6)
             ON CONFLICT DO UPDATE SET through = excluded.through, calls = excluded.calls,
               received = excluded.received, raw = excluded.raw
             WHERE excluded.through >= node_counters.through AND excluded.raw != node_counters.raw",
            params![c.node, c.period, sql_int(c.through), sql_int(c.calls()), sql_int(now), raw],
        )? == 1;
        if changed {
            tx.execute(
                "UPDATE periods SET final_at = NULL WHERE period = ?1 AND final_at IS NOT NULL",
                params![c.period],
            )?;
        }
        tx.commit()
    }

    /// A node's own counters of `period`, as last reported.
    pub fn counters(&self, node: &str, period: &str) -> rusqlite::Result<Option<NodeCounters>> {
        counters_of(&self.lock(), node, period)
    }

    /// Reconciles billing period `period` (`YYYY-MM`) at Unix second `now`: the period
    /// is final once it has ended (and [`CLOSE_GRACE_S`] passed), and every node that
    /// counted calls in it has reported its own counters of it and the store has every
    /// one of its windows up to the last number they cover, but those the node no longer
    /// had when asked for them. Each such node's counts are then compared with the
    /// store's: what the store lacks becomes a correction added to the totals (and taken
    /// back as windows arrive), so the export bills what the node answered. `None` for a
    /// period name that is not one.
    pub fn reconcile(&self, period: &str, now: u64) -> rusqlite::Result<Option<Reconciled>> {
        let Some((start, end)) = postern_model::usage::parse_month(period) else { return Ok(None) };
        let mut conn = self.lock();
        let tx = conn.transaction()?;
        let mut blocking = Vec::new();
        if now < end + CLOSE_GRACE_S {
            blocking.push(format!(
                "the period ends at {}; its last windows may arrive until {}",
                rfc3339(end),
                rfc3339(end + CLOSE_GRACE_S)
            ));
        }
        let mut counted: BTreeMap<String, (u64, u64)> = {
            let mut stmt = tx.prepare_cached(
                "SELECT node, COUNT(DISTINCT seq), SUM(calls) FROM applied WHERE start >= ?1 AND start < ?2
                 GROUP BY node ORDER BY node",
            )?;
            stmt.query_map(params![sql_int(start), sql_int(end)], |r| {
                Ok((r.get(0)?, (r.get::<_, i64>(1)?.max(0) as u64, r.get::<_, i64>(2)?.max(0) as u64)))
            })?
            .collect::<rusqlite::Result<_>>()?
        };
        // A node whose every window of the period is lost still reported its counts.
        {
            let mut stmt = tx.prepare_cached("SELECT node FROM node_counters WHERE period = ?1")?;
            for node in stmt.query_map(params![period], |r| r.get::<_, String>(0))? {
                counted.entry(node?).or_default();
            }
        }
        let mut nodes = Vec::with_capacity(counted.len());
        for (node, (windows, calls)) in counted {
            let last_start: Option<i64> =
                tx.query_row("SELECT MAX(start) FROM applied WHERE node = ?1", params![node], |r| r.get(0))?;
            let mut pn = PeriodNode {
                node: node.clone(),
                windows,
                calls,
                missing: Vec::new(),
                last_window: last_start.map(|t| rfc3339(t.max(0) as u64)),
                own_calls: None,
                corrected: 0,
                counted_less: 0,
            };
            let Some(own) = counters_of(&tx, &node, period)? else {
                blocking.push(format!(
                    "node {node} has not reported its own counts of {period} (it does once every window before the period's end is spooled)"
                ));
                nodes.push(pn);
                continue;
            };
            pn.own_calls = Some(own.calls());
            pn.missing = lacking(&tx, &own)?;
            if !pn.missing.is_empty() {
                let runs: Vec<String> = pn.missing.iter().map(|m| format!("{}..{}", m.from, m.to)).collect();
                blocking.push(format!("node {node} lacks windows {} (it is asked for them)", runs.join(", ")));
                nodes.push(pn);
                continue;
            }
            let beyond: i64 = tx.query_row(
                "SELECT COUNT(*) FROM applied WHERE node = ?1 AND start >= ?2 AND start < ?3 AND seq > ?4",
                params![node, sql_int(start), sql_int(end), sql_int(own.through)],
                |r| r.get(0),
            )?;
            if beyond > 0 {
                blocking.push(format!(
                    "node {node} has windows of {period} numbered past {}, the last its counts cover: it numbered again from 1 (give it a new id)",
                    own.through
                ));
                nodes.push(pn);
                continue;
            }
            (pn.corrected, pn.counted_less) = compare(&tx, &own, (start, end), windows > 0 && calls == own.calls())?;
            nodes.push(pn);
        }
        let (callers, billable): (i64, i64) = tx.query_row(
            "SELECT COUNT(*), COALESCE(SUM(billable), 0) FROM totals WHERE period = ?1",
            params![period],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )?;
        let late: i64 = tx
            .query_row("SELECT late FROM periods WHERE period = ?1", params![period], |r| r.get(0))
            .optional()?
            .unwrap_or(0);
        let final_at = blocking.is_empty().then_some(now);
        tx.execute(
            "INSERT INTO periods (period, final_at, late) VALUES (?1, ?2, 0)
             ON CONFLICT DO UPDATE SET final_at = excluded.final_at",
            params![period, final_at.map(sql_int)],
        )?;
        tx.commit()?;
        Ok(Some(Reconciled {
            period: period.to_owned(),
            is_final: final_at.is_some(),
            final_at: final_at.map(rfc3339),
            blocking,
            nodes,
            callers: callers.max(0) as u64,
            billable: billable.max(0) as u64,
            late_windows: late.max(0) as u64,
        }))
    }

    /// Whether period `period` is final now (reconciled, and no window came since).
    pub fn is_final(&self, period: &str) -> rusqlite::Result<bool> {
        let final_at: Option<Option<i64>> = self
            .lock()
            .query_row("SELECT final_at FROM periods WHERE period = ?1", params![period], |r| r.get(0))
            .optional()?;
        Ok(matches!(final_at, Some(Some(_))))
    }

    /// The billing export of a final period: one total per caller and product. `Err`
    /// with the reason while the period is not final.
    pub fn export(&self, period: &str) -> rusqlite::Result<Result<Vec<Total>, String>> {
        let final_at: Option<Option<i64>> = self
            .lock()
            .query_row("SELECT final_at FROM periods WHERE period = ?1", params![period], |r| r.get(0))
            .optional()?;
        match final_at {
            Some(Some(_)) => self.totals(period, None).map(Ok),
            Some(None) => Ok(Err(format!(
                "period {period} is not final: windows arrived after its last reconcile, or it did not pass; reconcile it"
            ))),
            None => Ok(Err(format!("period {period} was never reconciled"))),
        }
    }
}

/// How long after a period's end its last windows may still be on their way (nodes close
/// a window 250 ms after its end and send it at once; a node that is down delays it, and
/// the reconcile says which).
pub const CLOSE_GRACE_S: u64 = 60;

/// What a reconcile found.
#[derive(Debug, Clone, Serialize)]
pub struct Reconciled {
    /// `YYYY-MM`.
    pub period: String,
    /// Whether the period is final: its export is billable.
    #[serde(rename = "final")]
    pub is_final: bool,
    /// When it was marked final.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub final_at: Option<String>,
    /// What keeps it from being final.
    pub blocking: Vec<String>,
    /// Every node that counted calls in it.
    pub nodes: Vec<PeriodNode>,
    /// Callers (key or app, and product) with calls in it.
    pub callers: u64,
    /// Billable calls in it.
    pub billable: u64,
    /// Windows that arrived after it was final (each reopened it).
    pub late_windows: u64,
}

/// One node's part of a period.
#[derive(Debug, Clone, Serialize)]
pub struct PeriodNode {
    /// The node.
    pub node: String,
    /// Its windows in the period.
    pub windows: u64,
    /// Calls in them.
    pub calls: u64,
    /// Its sequence numbers the store lacks.
    pub missing: Vec<Missing>,
    /// The start of its newest window (any period), if it has one.
    pub last_window: Option<String>,
    /// Calls in its own counts of the period, once it reported them.
    pub own_calls: Option<u64>,
    /// Calls its counts hold that the store never got (windows the node no longer had
    /// when asked): added to the totals as corrections.
    pub corrected: u64,
    /// Calls the store applied beyond the node's own counts (its counters file was lost
    /// and counted again from what its spool still held): the store's count stands.
    pub counted_less: u64,
}

/// A node's reported counters of `period`.
fn counters_of(conn: &Connection, node: &str, period: &str) -> rusqlite::Result<Option<NodeCounters>> {
    let raw: Option<Vec<u8>> = conn
        .query_row("SELECT raw FROM node_counters WHERE node = ?1 AND period = ?2", params![node, period], |r| r.get(0))
        .optional()?;
    Ok(raw.and_then(|raw| serde_json::from_slice(&raw).ok()))
}

/// The node's numbers up to the last its counts cover that the store lacks, but those it
/// no longer had when asked for them.
fn lacking(conn: &Connection, own: &NodeCounters) -> rusqlite::Result<Vec<Missing>> {
    let (_, mut missing) = gaps(conn, &own.node)?;
    let top: Option<i64> =
        conn.query_row("SELECT MAX(seq) FROM applied WHERE node = ?1", params![own.node], |r| r.get(0))?;
    let top = top.map_or(0, |t| t.max(0) as u64);
    if top < own.through {
        missing.push(Missing { node: own.node.clone(), from: top + 1, to: own.through });
    }
    let mut out: Vec<Missing> = Vec::new();
    for m in missing {
        // The numbers of the run in no unavailable run, as runs again.
        let mut from = m.from;
        let to = m.to.min(own.through);
        while from <= to {
            match own.unavailable.iter().filter(|&&(f, t)| t >= from && f <= to).min() {
                Some(&(f, t)) if f <= from => from = t.saturating_add(1),
                Some(&(f, t)) => {
                    out.push(Missing { node: m.node.clone(), from, to: f - 1 });
                    from = t.saturating_add(1);
                }
                None => {
                    out.push(Missing { node: m.node.clone(), from, to });
                    break;
                }
            }
        }
    }
    Ok(out)
}

/// Compares a node's own counts of a period (`[start, end)`) with the store's and writes
/// the difference as corrections to the totals, replacing the last ones; returns the
/// calls corrected and the calls the store has beyond the node's counts. With `agree`
/// (the node totals match) and no corrections standing, nothing is read: the store
/// applies each window once, so it can only lack calls, never hold others.
fn compare(
    tx: &rusqlite::Transaction<'_>,
    own: &NodeCounters,
    (start, end): (u64, u64),
    agree: bool,
) -> rusqlite::Result<(u64, u64)> {
    let standing: i64 = tx.query_row(
        "SELECT COUNT(*) FROM corrections WHERE node = ?1 AND period = ?2",
        params![own.node, own.period],
        |r| r.get(0),
    )?;
    if agree && standing == 0 {
        return Ok((0, 0));
    }
    type Key = (String, String, String);
    let mut stored: BTreeMap<Key, [u64; 5]> = BTreeMap::new();
    {
        let mut stmt = tx.prepare_cached("SELECT raw FROM applied WHERE node = ?1 AND start >= ?2 AND start < ?3")?;
        let mut rows = stmt.query(params![own.node, sql_int(start), sql_int(end)])?;
        while let Some(r) = rows.next()? {
            let raw: Vec<u8> = r.get(0)?;
            let Ok(w) = serde_json::from_slice::<Window>(&raw) else { continue };
            for row in w.rows {
                let s = stored.entry((row.caller, row.kind.as_str().to_owned(), row.product)).or_default();
                for (a, n) in s.iter_mut().zip(row.status) {
                    *a = a.saturating_add(n);
                }
            }
        }
    }
    let mut wanted: BTreeMap<Key, [u64; 5]> = BTreeMap::new();
    let mut counted_less = 0u64;
    for r in &own.rows {
        let key = (r.caller.clone(), r.kind.as_str().to_owned(), r.product.clone());
        let have = stored.remove(&key).unwrap_or_default();
        let mut lack = [0u64; 5];
        for i in 0..5 {
            lack[i] = r.status[i].saturating_sub(have[i]);
            counted_less += have[i].saturating_sub(r.status[i]);
        }
        if lack.iter().any(|&n| n > 0) {
            wanted.insert(key, lack);
        }
    }
    counted_less += stored.values().flatten().sum::<u64>();
    // The totals move by the new corrections less the standing ones.
    let mut delta: BTreeMap<Key, [i64; 5]> = wanted.iter().map(|(k, v)| (k.clone(), v.map(sql_int))).collect();
    {
        let mut stmt = tx.prepare_cached(
            "SELECT caller, kind, product, s1, s2, s3, s4, s5 FROM corrections WHERE node = ?1 AND period = ?2",
        )?;
        let old = stmt.query_map(params![own.node, own.period], |r| {
            let mut s = [0i64; 5];
            for (i, v) in s.iter_mut().enumerate() {
                *v = r.get(3 + i)?;
            }
            Ok(((r.get(0)?, r.get(1)?, r.get(2)?), s))
        })?;
        for o in old {
            let (k, s) = o?;
            let d = delta.entry(k).or_default();
            for i in 0..5 {
                d[i] -= s[i];
            }
        }
    }
    let mut total = tx.prepare_cached(
        "INSERT INTO totals (caller, kind, product, period, billable, s1, s2, s3, s4, s5, overshoot)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, 0)
         ON CONFLICT DO UPDATE SET billable = billable + excluded.billable,
           s1 = s1 + excluded.s1, s2 = s2 + excluded.s2, s3 = s3 + excluded.s3,
           s4 = s4 + excluded.s4, s5 = s5 + excluded.s5",
    )?;
    for ((caller, kind, product), d) in &delta {
        if d.iter().all(|&n| n == 0) {
            continue;
        }
        total.execute(params![caller, kind, product, own.period, d[1] + d[2], d[0], d[1], d[2], d[3], d[4]])?;
    }
    tx.execute("DELETE FROM corrections WHERE node = ?1 AND period = ?2", params![own.node, own.period])?;
    let mut put = tx.prepare_cached(
        "INSERT INTO corrections (node, period, caller, kind, product, s1, s2, s3, s4, s5)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)",
    )?;
    let mut corrected = 0u64;
    for ((caller, kind, product), s) in &wanted {
        let s = s.map(sql_int);
        put.execute(params![own.node, own.period, caller, kind, product, s[0], s[1], s[2], s[3], s[4]])?;
        corrected += s.iter().sum::<i64>().max(0) as u64;
    }
    if corrected > 0 || standing > 0 || counted_less > 0 {
        eprintln!(
            "posternctl: usage reconcile {}: node {}: {corrected} calls the store lacks added as corrections, {counted_less} applied beyond its own counts",
            own.period, own.node
        );
    }
    Ok((corrected, counted_less))
}

/// Adds `billable` calls of row `r` (a window starting at `start`) to its caller's use
/// of quota `q`, raising the 80 % and 100 % events and a hard quota's flag as they are
/// passed; returns the calls past a hard quota (overshoot).
fn use_quota(
    tx: &rusqlite::Transaction<'_>,
    r: &postern_model::usage::Row,
    q: Quota,
    start: u64,
    billable: u64,
    now: u64,
) -> rusqlite::Result<u64> {
    let (ps, pe) = q.anchor.period(start);
    let kind = r.kind.as_str();
    let before: u64 = tx
        .query_row(
            "SELECT used FROM quota_use WHERE caller = ?1 AND kind = ?2 AND product = ?3 AND period_start = ?4",
            params![r.caller, kind, r.product, sql_int(ps)],
            |row| row.get::<_, i64>(0),
        )
        .optional()?
        .map_or(0, |n| n.max(0) as u64);
    let after = before.saturating_add(billable);
    tx.execute(
        "INSERT INTO quota_use (caller, kind, product, period_start, period_end, used) VALUES (?1, ?2, ?3, ?4, ?5, ?6)
         ON CONFLICT DO UPDATE SET used = excluded.used",
        params![r.caller, kind, r.product, sql_int(ps), sql_int(pe), sql_int(after)],
    )?;
    let mode = match q.mode {
        QuotaMode::Hard => "hard",
        QuotaMode::Overage => "overage",
    };
    for percent in [80u64, 100] {
        let mark = (u128::from(q.calls) * u128::from(percent)).div_ceil(100) as u64;
        if before < mark && mark <= after {
            tx.execute(
                "INSERT INTO quota_events (at, caller, kind, product, period_start, period_end, percent, used, quota, mode)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10) ON CONFLICT DO NOTHING",
                params![
                    sql_int(now),
                    r.caller,
                    kind,
                    r.product,
                    sql_int(ps),
                    sql_int(pe),
                    sql_int(percent),
                    sql_int(after),
                    sql_int(q.calls),
                    mode
                ],
            )?;
        }
    }
    if q.mode != QuotaMode::Hard {
        return Ok(0);
    }
    if before < q.calls && q.calls <= after {
        tx.execute(
            "INSERT INTO over_quota (caller, kind, product, until, quota, period_s, since)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7) ON CONFLICT DO NOTHING",
            params![r.caller, kind, r.product, sql_int(pe), sql_int(q.calls), sql_int(pe - ps), sql_int(now)],
        )?;
    }
    Ok(after.saturating_sub(before.max(q.calls)))
}

fn caller_kind(s: &str) -> CallerKind {
    if s == "app" { CallerKind::App } else { CallerKind::Key }
}

impl UsageStore {
    /// The over-quota flags still live at `now`, in a stable order.
    pub fn live_flags(&self, now: u64) -> rusqlite::Result<Vec<QuotaFlag>> {
        let conn = self.lock();
        let mut stmt = conn.prepare_cached(
            "SELECT caller, kind, product, until, quota, period_s FROM over_quota WHERE until > ?1
             ORDER BY caller, kind, product, until",
        )?;
        let rows = stmt.query_map(params![sql_int(now)], |r| {
            Ok(QuotaFlag {
                caller: r.get(0)?,
                kind: caller_kind(&r.get::<_, String>(1)?),
                product: r.get(2)?,
                until: r.get::<_, i64>(3)?.max(0) as u64,
                quota: r.get::<_, i64>(4)?.max(0) as u64,
                period_s: r.get::<_, i64>(5)?.max(0) as u64,
            })
        })?;
        rows.collect()
    }

    /// Quota events, oldest first: those after number `after`, at most `limit`; only the
    /// ones the webhook has not taken and whose next try is due at `due` when given.
    pub fn events(&self, after: u64, limit: usize, due: Option<u64>) -> rusqlite::Result<Vec<QuotaEvent>> {
        let conn = self.lock();
        let mut stmt = conn.prepare_cached(
            "SELECT id, at, caller, kind, product, period_start, period_end, percent, used, quota, mode,
                    delivered, attempts
             FROM quota_events WHERE id > ?1 AND (?2 IS NULL OR (delivered = 0 AND next_try <= ?2))
             ORDER BY id LIMIT ?3",
        )?;
        let n = |r: &rusqlite::Row<'_>, i: usize| r.get::<_, i64>(i).map(|v| v.max(0) as u64);
        let rows = stmt.query_map(params![sql_int(after), due.map(sql_int), limit as i64], |r| {
            let percent = n(r, 7)?;
            Ok(QuotaEvent {
                id: n(r, 0)?,
                kind: if percent >= 100 { "quota.exhausted" } else { "quota.warning" }.to_owned(),
                at: rfc3339(n(r, 1)?),
                caller: r.get(2)?,
                caller_kind: r.get(3)?,
                product: r.get(4)?,
                period_start: rfc3339(n(r, 5)?),
                period_end: rfc3339(n(r, 6)?),
                percent,
                used: n(r, 8)?,
                quota: n(r, 9)?,
                mode: r.get(10)?,
                delivered: r.get::<_, i64>(11)? != 0,
                attempts: n(r, 12)?,
            })
        })?;
        rows.collect()
    }

    /// Records a webhook delivery of event `id`: taken, or to try again at `next_try`.
    pub fn delivered(&self, id: u64, ok: bool, next_try: u64) -> rusqlite::Result<()> {
        self.lock().execute(
            "UPDATE quota_events SET attempts = attempts + 1, delivered = ?2, next_try = ?3 WHERE id = ?1",
            params![sql_int(id), ok, sql_int(next_try)],
        )?;
        Ok(())
    }

    /// A caller's use of its quota on `product` in the period holding `t`: (used, period start, end).
    pub fn quota_use(
        &self,
        caller: &str,
        kind: CallerKind,
        product: &str,
        t: u64,
    ) -> rusqlite::Result<Option<(u64, u64, u64)>> {
        self.lock()
            .query_row(
                "SELECT used, period_start, period_end FROM quota_use
                 WHERE caller = ?1 AND kind = ?2 AND product = ?3 AND period_start <= ?4 AND period_end > ?4",
                params![caller, kind.as_str(), product, sql_int(t)],
                |r| {
                    let n = |i| r.get::<_, i64>(i).map(|v| v.max(0) as u64);
                    Ok((n(0)?, n(1)?, n(2)?))
                },
            )
            .optional()
    }
}

/// Ranges asked for again in one answer at most.
const MISSING_RANGES: usize = 64;

/// Moves `node`'s contiguous mark (every number up to it applied) past the numbers now
/// applied, and returns the gaps above it, below the highest number applied.
fn advance(tx: &rusqlite::Transaction<'_>, node: &str) -> rusqlite::Result<Vec<Missing>> {
    let (mark, missing) = gaps(tx, node)?;
    tx.execute(
        "INSERT INTO contiguous (node, seq) VALUES (?1, ?2) ON CONFLICT DO UPDATE SET seq = excluded.seq",
        params![node, sql_int(mark)],
    )?;
    Ok(missing)
}

/// `node`'s contiguous mark as the applied numbers have it now, and the gaps above it: the
/// numbers never seen and those with parts still to come.
fn gaps(conn: &Connection, node: &str) -> rusqlite::Result<(u64, Vec<Missing>)> {
    let mut mark: u64 = conn
        .query_row("SELECT seq FROM contiguous WHERE node = ?1", params![node], |r| r.get::<_, i64>(0))
        .optional()?
        .map_or(0, |n| n.max(0) as u64);
    let mut stmt = conn.prepare_cached(
        "SELECT seq, COUNT(*) >= MAX(parts) FROM applied WHERE node = ?1 AND seq > ?2
         GROUP BY seq ORDER BY seq LIMIT 100000",
    )?;
    let above: Vec<(u64, bool)> = stmt
        .query_map(params![node, sql_int(mark)], |r| Ok((r.get::<_, i64>(0)?.max(0) as u64, r.get::<_, bool>(1)?)))?
        .collect::<rusqlite::Result<_>>()?;
    let mut missing: Vec<Missing> = Vec::new();
    let mut lack = |from: u64, to: u64| {
        let full = missing.len() >= MISSING_RANGES;
        match missing.last_mut() {
            Some(last) if last.to + 1 == from => last.to = to,
            _ if !full => missing.push(Missing { node: node.to_owned(), from, to }),
            _ => {}
        }
    };
    // The lowest number not looked at yet, and whether all below it are in.
    let mut next = mark + 1;
    let mut whole = true;
    for (seq, complete) in above {
        if seq > next {
            whole = false;
            lack(next, seq - 1);
        }
        if !complete {
            whole = false;
            lack(seq, seq);
        } else if whole {
            mark = seq;
        }
        next = seq + 1;
    }
    Ok((mark, missing))
}

/// SQLite integers are signed: counts and times beyond `i64::MAX` do not occur, and are
/// clamped rather than wrapped if they ever did.
fn sql_int(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// `YYYY-MM-DDTHH:MM:SSZ`.
pub fn rfc3339(t: u64) -> String {
    humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + std::time::Duration::from_secs(t)).to_string()
}

/// A time as the usage API takes it: Unix seconds, `YYYY-MM-DD` (UTC midnight) or RFC 3339
/// in UTC.
pub fn parse_time(s: &str) -> Option<u64> {
    if let Ok(n) = s.parse::<u64>() {
        return Some(n);
    }
    let s = if s.len() == 10 { format!("{s}T00:00:00Z") } else { s.to_owned() };
    let t = humantime::parse_rfc3339_weak(&s).ok()?;
    t.duration_since(std::time::UNIX_EPOCH).ok().map(|d| d.as_secs())
}

/// Percent-encodes a query parameter's value.
pub fn query_escape(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for b in v.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~:".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Decodes a percent-encoded query parameter's value (`+` is a space).
pub fn query_unescape(v: &str) -> Option<String> {
    let mut out = Vec::with_capacity(v.len());
    let mut bytes = v.bytes();
    while let Some(b) = bytes.next() {
        match b {
            b'%' => {
                let hex = [bytes.next()?, bytes.next()?];
                out.push(u8::from_str_radix(std::str::from_utf8(&hex).ok()?, 16).ok()?);
            }
            b'+' => out.push(b' '),
            b => out.push(b),
        }
    }
    String::from_utf8(out).ok()
}

/// A `GET /v1/usage` answer as a table, for `posternctl usage`.
pub fn table(v: &serde_json::Value) -> String {
    let rows = v["rows"].as_array().map(Vec::as_slice).unwrap_or_default();
    let timed = v["by"].as_str() != Some("route");
    let mut head = vec!["CALLER", "ROUTE", "PRODUCT"];
    if timed {
        head.push("AT");
    }
    head.extend(["CALLS", "BILLABLE", "2XX", "3XX", "4XX", "5XX", "P50 MS", "P99 MS"]);
    let mut lines: Vec<Vec<String>> = vec![head.iter().map(|h| (*h).to_owned()).collect()];
    let n = |x: &serde_json::Value| x.as_u64().map_or_else(|| "-".to_owned(), |n| n.to_string());
    let f = |x: &serde_json::Value| x.as_f64().map_or_else(|| "-".to_owned(), |n| format!("{n:.1}"));
    for r in rows {
        let mut line = vec![
            format!("{} ({})", r["caller"].as_str().unwrap_or("?"), r["kind"].as_str().unwrap_or("?")),
            r["route"].as_str().unwrap_or("?").to_owned(),
            r["product"].as_str().unwrap_or("?").to_owned(),
        ];
        if timed {
            line.push(r["at"].as_str().unwrap_or("-").to_owned());
        }
        line.extend([
            n(&r["calls"]),
            n(&r["billable"]),
            n(&r["status"]["2xx"]),
            n(&r["status"]["3xx"]),
            n(&r["status"]["4xx"]),
            n(&r["status"]["5xx"]),
            f(&r["latency_ms"]["p50"]),
            f(&r["latency_ms"]["p99"]),
        ]);
        lines.push(line);
    }
    let widths: Vec<usize> =
        (0..head.len()).map(|i| lines.iter().map(|l| l.get(i).map_or(0, String::len)).max().unwrap_or(0)).collect();
    let mut out = format!(
        "usage from {} to {}, by {}\n",
        v["from"].as_str().unwrap_or("?"),
        v["to"].as_str().unwrap_or("?"),
        v["by"].as_str().unwrap_or("?")
    );
    for l in &lines {
        let cells: Vec<String> = l.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    if rows.is_empty() {
        out.push_str("(no calls in this range)\n");
    }
    if v["truncated"].as_bool() == Some(true) {
        out.push_str(&format!("(the first {MAX_ROWS} rows: narrow the range or name a key)\n"));
    }
    out
}

/// The most characters a [`chart`] line takes: a longer range folds consecutive minutes
/// into one character.
pub const CHART_WIDTH: u64 = 120;

/// `posternctl usage --last`: a whole number and one unit, `s`, `m`, `h` or `d` (`90s`,
/// `30m`, `1h`, `2d`), as seconds.
pub fn parse_last(s: &str) -> Result<u64, String> {
    let bad = || format!("{s:?} is not a duration like 90s, 30m, 1h or 2d (a whole number and one of s, m, h, d)");
    let digits = match s.chars().last() {
        Some(u @ ('s' | 'm' | 'h' | 'd')) => s.strip_suffix(u).unwrap_or_default(),
        _ => return Err(bad()),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    // A narrower form of the one duration grammar: read by the one parser.
    let too_long = || format!("{s:?} is longer than any range the usage store holds");
    let secs = crate::config::parse_duration(s).map_err(|_| too_long())?.as_secs();
    if secs == 0 {
        return Err(format!("{s:?} is an empty range: give more than zero"));
    }
    Ok(secs)
}

/// One caller and route in a [`chart`].
struct ChartBlock {
    calls: u64,
    s4: u64,
    s5: u64,
    p99: f64,
    /// Calls per character.
    spark: Vec<u64>,
    /// Per character: 0 no errors, 1 some 4xx, 2 some 5xx.
    errors: Vec<u8>,
}

/// A `GET /v1/usage?by=minute` answer as a plain-text chart, for `posternctl usage
/// --chart`: per caller and route, a header with the totals, a sparkline of calls per
/// minute over the whole range (scaled to the block's largest count; a blank for none),
/// a line marking the minutes with 5xx (`!`) or else 4xx (`x`), and the times of the
/// first and last characters. Minutes without a row count as none; a range over
/// [`CHART_WIDTH`] minutes folds consecutive minutes into one character.
pub fn chart(v: &serde_json::Value) -> String {
    const LEVELS: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];
    const PAD: &str = "          ";
    let (from_s, to_s) = (v["from"].as_str().unwrap_or("?"), v["to"].as_str().unwrap_or("?"));
    let (Some(from), Some(to)) = (parse_time(from_s), parse_time(to_s)) else {
        return format!("usage from {from_s} to {to_s}: not a range of RFC 3339 times\n");
    };
    // The rows are the minutes starting at or after `from` and before `to`.
    let first = from.div_ceil(60).saturating_mul(60);
    let minutes = to.saturating_sub(first).div_ceil(60);
    let per = minutes.div_ceil(CHART_WIDTH).max(1);
    let width = minutes.div_ceil(per);
    let mut out = match per {
        1 => format!("usage from {from_s} to {to_s}, one character a minute\n"),
        _ => format!("usage from {from_s} to {to_s}, one character per {per} minutes\n"),
    };
    let rows = v["rows"].as_array().map(Vec::as_slice).unwrap_or_default();
    let mut blocks: BTreeMap<(&str, &str, &str), ChartBlock> = BTreeMap::new();
    for r in rows {
        let key = (
            r["caller"].as_str().unwrap_or("?"),
            r["kind"].as_str().unwrap_or("?"),
            r["route"].as_str().unwrap_or("?"),
        );
        let b = blocks.entry(key).or_insert_with(|| ChartBlock {
            calls: 0,
            s4: 0,
            s5: 0,
            p99: 0.0,
            spark: vec![0; usize::try_from(width).unwrap_or(0)],
            errors: vec![0; usize::try_from(width).unwrap_or(0)],
        });
        let calls = r["calls"].as_u64().unwrap_or(0);
        let s4 = r["status"]["4xx"].as_u64().unwrap_or(0);
        let s5 = r["status"]["5xx"].as_u64().unwrap_or(0);
        b.calls += calls;
        b.s4 += s4;
        b.s5 += s5;
        b.p99 = b.p99.max(r["latency_ms"]["p99"].as_f64().unwrap_or(0.0));
        let Some(at) = r["at"].as_str().and_then(parse_time).filter(|&t| t >= first && t < to) else {
            continue;
        };
        let i = usize::try_from((at - first) / 60 / per).unwrap_or(usize::MAX);
        if let (Some(n), Some(e)) = (b.spark.get_mut(i), b.errors.get_mut(i)) {
            *n += calls;
            *e = (*e).max(if s5 > 0 {
                2
            } else if s4 > 0 {
                1
            } else {
                0
            });
        }
    }
    if !blocks.is_empty() && width > 0 {
        out.push_str("errors: ! some 5xx, x some 4xx, · neither\n");
    }
    let label = |t: u64, dated: bool| {
        let s = rfc3339(t);
        let label = if dated { s.get(5..16) } else { s.get(11..16) };
        label.map_or(s.clone(), |l| l.replace('T', " "))
    };
    let last = first.saturating_add((width.saturating_sub(1)).saturating_mul(per * 60));
    let dated = rfc3339(first).get(..10) != rfc3339(last).get(..10);
    let (left, right) = (label(first, dated), label(last, dated));
    let axis = if width <= 1 {
        left
    } else {
        let gap = usize::try_from(width).unwrap_or(0).saturating_sub(left.len() + right.len()).max(1);
        format!("{left}{}{right}", " ".repeat(gap))
    };
    for ((caller, kind, route), b) in &blocks {
        out.push_str(&format!(
            "\n{caller} ({kind})  {route}  calls {}, 4xx {}, 5xx {}, p99 max {:.1} ms\n",
            b.calls, b.s4, b.s5, b.p99
        ));
        if width == 0 {
            continue;
        }
        let max = b.spark.iter().copied().max().unwrap_or(0);
        let spark: String = b
            .spark
            .iter()
            .map(|&n| match (u128::from(n) * 8).div_ceil(u128::from(max).max(1)) {
                0 => ' ',
                l => LEVELS[usize::try_from(l.min(8) - 1).unwrap_or(7)],
            })
            .collect();
        let errors: String = b
            .errors
            .iter()
            .map(|e| match e {
                2 => '!',
                1 => 'x',
                _ => '·',
            })
            .collect();
        let unit = if per == 1 { "a minute".to_owned() } else { format!("per {per} minutes") };
        out.push_str(&format!("  calls   {spark}  max {max} {unit}\n"));
        out.push_str(&format!("  errors  {errors}\n"));
        out.push_str(&format!("{PAD}{axis}\n"));
    }
    if rows.is_empty() {
        out.push_str("(no calls in this range)\n");
    } else if width == 0 {
        out.push_str("(the range holds no whole minute)\n");
    }
    if v["truncated"].as_bool() == Some(true) {
        out.push_str(&format!("(the first {MAX_ROWS} rows: narrow the range or name a key)\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use postern_model::usage::{CallerKind, Row, latency_bucket};

    fn row(caller: &str, route: &str, status: [u64; 5], ms: u64) -> Row {
        let mut latency = vec![0; LATENCY_BUCKETS];
        latency[latency_bucket(ms * 1000)] = status.iter().sum();
        Row {
            caller: caller.into(),
            kind: CallerKind::Key,
            product: "search".into(),
            route: route.into(),
            status,
            latency,
            latency_us: ms * 1000 * status.iter().sum::<u64>(),
        }
    }

    fn window(node: &str, seq: u64, start: u64, rows: Vec<Row>) -> Window {
        Window::new(node.into(), seq, start, false, rows)
    }

    // 2026-12-01T00:00:00Z.
    const DEC: u64 = 1_796_083_200;

    #[test]
    fn a_window_is_added_once_however_often_it_comes() {
        let dir = tempfile::tempdir().unwrap();
        let store = UsageStore::open(&dir.path().join("usage.db")).unwrap();
        let w1 = window("a", 1, DEC, vec![row("k1", "search/query", [0, 7, 1, 2, 0], 4)]);
        let w2 = window("a", 2, DEC + 10, vec![row("k1", "search/query", [0, 3, 0, 0, 1], 40)]);
        let ack = |applied, duplicates| UsageAck { applied, duplicates, missing: Vec::new() };
        assert_eq!(store.apply(std::slice::from_ref(&w1), DEC, &Quotas::default()).unwrap(), ack(1, 0));
        assert_eq!(store.apply(&[w1.clone(), w2], DEC, &Quotas::default()).unwrap(), ack(1, 1));
        assert_eq!(store.apply(std::slice::from_ref(&w1), DEC, &Quotas::default()).unwrap(), ack(0, 1));
        // Other contents under a known (node, seq): refused whole.
        let mut other = w1;
        other.rows[0].status[1] += 1;
        other.rows[0].latency[latency_bucket(4000)] += 1;
        let w3 = window("a", 3, DEC + 20, vec![row("k1", "search/query", [0, 1, 0, 0, 0], 4)]);
        assert!(matches!(store.apply(&[w3, other], DEC, &Quotas::default()), Err(ApplyError::Conflict { seq: 1, .. })));
        let t = store.totals("2026-12", None).unwrap();
        assert_eq!(t.len(), 1);
        assert_eq!((t[0].billable, t[0].calls), (11, 14));
        let q = Query { caller: None, product: None, team: None, from: DEC, to: DEC + 60, by: By::Route };
        let rows = store.query(&q).unwrap();
        assert_eq!(rows.len(), 1);
        assert_eq!((rows[0].calls, rows[0].billable, rows[0].at.clone()), (14, 11, None));
        assert!(rows[0].latency_ms.p99 > 30.0, "{:?}", rows[0].latency_ms);
        let nodes = store.nodes().unwrap();
        assert_eq!((nodes[0].windows, nodes[0].last_seq, nodes[0].missing, nodes[0].duplicates), (2, 2, 0, 2));
        // Reopened, everything is still there.
        drop(store);
        let store = UsageStore::open(&dir.path().join("usage.db")).unwrap();
        assert_eq!(store.totals("2026-12", Some("k1")).unwrap()[0].billable, 11);
    }

    #[test]
    fn rows_group_by_minute_and_day_and_a_team_sees_its_routes() {
        let dir = tempfile::tempdir().unwrap();
        let store = UsageStore::open(&dir.path().join("usage.db")).unwrap();
        let windows = vec![
            window(
                "a",
                1,
                DEC,
                vec![row("k1", "search/query", [0, 1, 0, 0, 0], 1), row("k2", "pay/charge", [0, 2, 0, 0, 0], 1)],
            ),
            window("a", 2, DEC + 60, vec![row("k1", "search/query", [0, 4, 0, 0, 0], 1)]),
            window("b", 5, DEC - 10, vec![row("k1", "search/query", [0, 8, 0, 0, 0], 1)]),
        ];
        store.apply(&windows, DEC, &Quotas::default()).unwrap();
        let all = |by| Query { caller: Some("k1".into()), product: None, team: None, from: DEC, to: DEC + 120, by };
        let by_minute = store.query(&all(By::Minute)).unwrap();
        assert_eq!(by_minute.iter().map(|r| r.calls).collect::<Vec<_>>(), vec![1, 4]);
        assert_eq!(by_minute[0].at.as_deref(), Some("2026-12-01T00:00:00Z"));
        let by_day = store.query(&all(By::Day)).unwrap();
        assert_eq!(by_day.iter().map(|r| r.calls).collect::<Vec<_>>(), vec![5]);
        let mut q = all(By::Route);
        q.caller = None;
        q.team = Some("pay".into());
        assert_eq!(store.query(&q).unwrap().iter().map(|r| r.route.as_str()).collect::<Vec<_>>(), vec!["pay/charge"]);
        // The November window is November's.
        assert_eq!(store.totals("2026-11", Some("k1")).unwrap()[0].billable, 8);
        assert_eq!(store.totals("2026-12", Some("k1")).unwrap()[0].billable, 5);
        // Node b's windows 1..4 never came.
        assert_eq!(store.nodes().unwrap()[1].missing, 4);
    }

    #[test]
    fn gaps_below_the_highest_number_are_asked_for_until_filled() {
        let dir = tempfile::tempdir().unwrap();
        let store = UsageStore::open(&dir.path().join("usage.db")).unwrap();
        let w = |seq| window("a", seq, DEC + seq * 10, vec![row("k1", "search/query", [0, 1, 0, 0, 0], 1)]);
        let missing = |ack: UsageAck| ack.missing.iter().map(|m| (m.from, m.to)).collect::<Vec<_>>();
        assert_eq!(missing(store.apply(&[w(1), w(2)], DEC, &Quotas::default()).unwrap()), vec![]);
        // 3..5 and 7 never came.
        assert_eq!(missing(store.apply(&[w(6), w(8)], DEC, &Quotas::default()).unwrap()), vec![(3, 5), (7, 7)]);
        assert_eq!(missing(store.apply(&[w(4), w(9)], DEC, &Quotas::default()).unwrap()), vec![(3, 3), (5, 5), (7, 7)]);
        assert_eq!(missing(store.apply(&[w(3), w(5), w(7)], DEC, &Quotas::default()).unwrap()), vec![]);
        assert_eq!(store.totals("2026-12", Some("k1")).unwrap()[0].billable, 9);
        assert_eq!(store.nodes().unwrap()[0].missing, 0);
    }

    #[test]
    fn parts_apply_once_whichever_way_they_come_and_a_window_is_in_once_all_are() {
        let dir = tempfile::tempdir().unwrap();
        let store = UsageStore::open(&dir.path().join("usage.db")).unwrap();
        let q = Quotas::default();
        let whole = |seq| {
            window(
                "a",
                seq,
                DEC + seq * 10,
                vec![row("k2", "search/query", [0, 2, 0, 0, 0], 1), row("k1", "search/query", [0, 1, 0, 0, 0], 1)],
            )
        };
        let missing = |ack: UsageAck| ack.missing.iter().map(|m| (m.from, m.to)).collect::<Vec<_>>();
        // Window 1 whole (HTTP); window 2 by parts (Kafka), one part late.
        assert_eq!(store.apply(&[whole(1)], DEC, &q).unwrap().applied, 1);
        let parts = whole(2).split();
        assert_eq!(parts.len(), 2);
        assert_eq!(missing(store.apply(&[parts[1].clone()], DEC, &q).unwrap()), vec![(2, 2)]);
        assert_eq!(missing(store.apply(&[whole(3).split()[0].clone()], DEC, &q).unwrap()), vec![(2, 3)]);
        assert_eq!(store.nodes().unwrap()[0].missing, 2);
        // The whole window 2 sent again adds only its missing part.
        let ack = store.apply(&[whole(2)], DEC, &q).unwrap();
        assert_eq!((ack.applied, ack.duplicates, missing(ack)), (1, 0, vec![(3, 3)]));
        // Window 1's parts, as Kafka carries them: duplicates.
        let ack = store.apply(&whole(1).split(), DEC, &q).unwrap();
        assert_eq!((ack.applied, ack.duplicates), (0, 2));
        let ack = store.apply(&whole(3).split(), DEC, &q).unwrap();
        assert_eq!((ack.applied, ack.duplicates, missing(ack)), (1, 1, vec![]));
        let billed = |k| store.totals("2026-12", Some(k)).unwrap()[0].billable;
        assert_eq!((billed("k1"), billed("k2")), (3, 6));
        let n = &store.nodes().unwrap()[0];
        assert_eq!((n.windows, n.last_seq, n.missing, n.duplicates), (3, 3, 0, 3));
    }

    #[test]
    fn a_store_of_whole_windows_is_rewritten_as_parts() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("usage.db");
        let w = window(
            "a",
            1,
            DEC,
            vec![row("k2", "search/query", [0, 2, 0, 0, 0], 1), row("k1", "search/query", [0, 1, 0, 0, 0], 1)],
        );
        {
            // The table as it was before parts.
            let conn = Connection::open(&path).unwrap();
            conn.execute_batch(
                "CREATE TABLE applied (
                    node TEXT NOT NULL, seq INTEGER NOT NULL, start INTEGER NOT NULL,
                    recovered INTEGER NOT NULL, calls INTEGER NOT NULL, received INTEGER NOT NULL,
                    raw BLOB NOT NULL, PRIMARY KEY (node, seq)) WITHOUT ROWID;",
            )
            .unwrap();
            conn.execute(
                "INSERT INTO applied VALUES ('a', 1, ?1, 0, 3, ?1, ?2)",
                params![sql_int(DEC), serde_json::to_vec(&w).unwrap()],
            )
            .unwrap();
        }
        let store = UsageStore::open(&path).unwrap();
        let ack = store.apply(std::slice::from_ref(&w), DEC, &Quotas::default()).unwrap();
        assert_eq!((ack.applied, ack.duplicates), (0, 1));
        let n = &store.nodes().unwrap()[0];
        assert_eq!((n.windows, n.last_seq), (1, 1));
    }

    #[test]
    fn a_period_is_final_once_ended_and_complete_and_a_late_window_reopens_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = UsageStore::open(&dir.path().join("usage.db")).unwrap();
        let none = Quotas::default();
        let w = |seq, start| window("a", seq, start, vec![row("k1", "search/query", [0, 2, 0, 1, 0], 1)]);
        let after = DEC + CLOSE_GRACE_S;
        store.apply(&[w(1, DEC - 20), w(3, DEC + 10)], DEC, &none).unwrap();
        let r = store.reconcile("2026-11", after).unwrap().unwrap();
        assert!(!r.is_final && r.blocking.len() == 1 && r.blocking[0].contains("node a has not reported"), "{r:?}");
        // The node's own counts cover number 3: window 2 is missing.
        store.put_counters(&own("a", 3, &[("k1", [0, 4, 0, 2, 0])], &[]), DEC).unwrap();
        let r = store.reconcile("2026-11", after).unwrap().unwrap();
        assert!(!r.is_final && r.blocking.len() == 1 && r.blocking[0].contains("lacks windows 2..2"), "{r:?}");
        assert!(store.export("2026-11").unwrap().is_err());
        store.apply(&[w(2, DEC - 10)], DEC, &none).unwrap();
        // Not before the period's end and its grace.
        assert!(!store.reconcile("2026-11", after - 1).unwrap().unwrap().is_final);
        let r = store.reconcile("2026-11", after).unwrap().unwrap();
        assert!(r.is_final, "{r:?}");
        assert_eq!((r.billable, r.callers, r.nodes[0].windows, r.nodes[0].calls), (4, 1, 2, 6));
        assert_eq!((r.nodes[0].own_calls, r.nodes[0].corrected, r.nodes[0].counted_less), (Some(6), 0, 0));
        let export = store.export("2026-11").unwrap().unwrap();
        assert_eq!((export.len(), export[0].billable, export[0].status.s4), (1, 4, 2));
        // December is still open.
        assert!(!store.reconcile("2026-12", after).unwrap().unwrap().is_final);

        // Node c lost window 2 for good (the store asked, the spool no longer held it):
        // its own counts stand for it, as a correction.
        let c = |seq, start, ok| window("c", seq, start, vec![row("k3", "search/query", [0, ok, 0, 0, 0], 1)]);
        store.apply(&[c(1, DEC - 20, 2), c(3, DEC + 10, 1)], DEC, &none).unwrap();
        assert!(
            !store.reconcile("2026-11", after).unwrap().unwrap().is_final,
            "a new node reopens nothing but is not reported"
        );
        store.put_counters(&own("c", 2, &[("k3", [0, 5, 0, 0, 0])], &[(2, 2)]), DEC).unwrap();
        let r = store.reconcile("2026-11", after).unwrap().unwrap();
        assert!(r.is_final, "{r:?}");
        let node_c = r.nodes.iter().find(|n| n.node == "c").unwrap();
        assert_eq!((node_c.calls, node_c.own_calls, node_c.corrected), (2, Some(5), 3), "{r:?}");
        assert_eq!(r.billable, 4 + 5);
        let k3 = |store: &UsageStore| store.totals("2026-11", Some("k3")).unwrap()[0].billable;
        assert_eq!(k3(&store), 5);
        // Reconciling again changes nothing.
        assert_eq!(store.reconcile("2026-11", after).unwrap().unwrap().billable, 9);
        // The window comes after all (it was late, not lost): the correction is taken back.
        store.apply(&[c(2, DEC - 10, 3)], DEC, &none).unwrap();
        assert!(!store.is_final("2026-11").unwrap());
        let r = store.reconcile("2026-11", after).unwrap().unwrap();
        let node_c = r.nodes.iter().find(|n| n.node == "c").unwrap();
        assert_eq!((r.is_final, node_c.corrected, r.billable, k3(&store)), (true, 0, 9, 5), "{r:?}");
        // Late: node c's first window (November was final then) and this one.
        assert_eq!(r.late_windows, 2);
        // A changed report reopens the period; an older one is ignored.
        store.put_counters(&own("c", 2, &[("k3", [0, 6, 0, 0, 0])], &[(2, 2)]), DEC).unwrap();
        assert!(!store.is_final("2026-11").unwrap());
        store.put_counters(&own("c", 1, &[("k3", [0, 9, 0, 0, 0])], &[]), DEC).unwrap();
        assert_eq!(store.counters("c", "2026-11").unwrap().map(|c| c.through), Some(2));
        let r = store.reconcile("2026-11", after).unwrap().unwrap();
        assert_eq!((r.is_final, r.billable, k3(&store)), (true, 10, 6), "{r:?}");
        // A node that counts less than the store applied (its counters file was lost) is
        // never corrected down.
        store
            .apply(&[window("d", 1, DEC - 10, vec![row("k4", "search/query", [0, 3, 0, 0, 0], 1)])], DEC, &none)
            .unwrap();
        store.put_counters(&own("d", 1, &[("k4", [0, 1, 0, 0, 0])], &[]), DEC).unwrap();
        let r = store.reconcile("2026-11", after).unwrap().unwrap();
        let node_d = r.nodes.iter().find(|n| n.node == "d").unwrap();
        assert_eq!((r.is_final, node_d.corrected, node_d.counted_less, r.billable), (true, 0, 2, 13), "{r:?}");
        // Windows numbered past what the counts cover: the node numbers again.
        store
            .apply(&[window("d", 2, DEC - 10, vec![row("k4", "search/query", [0, 1, 0, 0, 0], 1)])], DEC, &none)
            .unwrap();
        let r = store.reconcile("2026-11", after).unwrap().unwrap();
        assert!(!r.is_final && r.blocking.iter().any(|b| b.contains("numbered past 1")), "{r:?}");
        assert_eq!(store.reconcile("2026-13", after).unwrap().map(|r| r.period), None);
    }

    fn own(node: &str, through: u64, rows: &[(&str, [u64; 5])], unavailable: &[(u64, u64)]) -> NodeCounters {
        let c = NodeCounters {
            node: node.into(),
            period: "2026-11".into(),
            through,
            rows: rows
                .iter()
                .map(|(caller, status)| postern_model::usage::CounterRow {
                    kind: CallerKind::Key,
                    caller: (*caller).into(),
                    product: "search".into(),
                    status: *status,
                })
                .collect(),
            unavailable: unavailable.to_vec(),
        };
        assert_eq!(c.check(), Ok(()));
        c
    }

    /// A `GET /v1/usage?by=minute` row, as the control plane answers it.
    fn minute_row(caller: &str, kind: &str, at: u64, ok: u64, s4: u64, s5: u64, p99: f64) -> serde_json::Value {
        serde_json::json!({
            "caller": caller, "kind": kind, "route": "search/query", "product": "search",
            "at": rfc3339(at), "calls": ok + s4 + s5, "billable": ok,
            "status": {"1xx": 0, "2xx": ok, "3xx": 0, "4xx": s4, "5xx": s5},
            "latency_ms": {"mean": 1.0, "p50": 1.0, "p99": p99},
        })
    }

    #[test]
    fn last_takes_a_whole_number_and_one_unit() {
        assert_eq!(parse_last("90s"), Ok(90));
        assert_eq!(parse_last("30m"), Ok(1800));
        assert_eq!(parse_last("1h"), Ok(3600));
        assert_eq!(parse_last("2d"), Ok(172_800));
        for bad in ["", "h", "1", "1w", "1H", "1.5h", "-1h", "+1h", "1h30m", " 1h", "1 h", "1hh", "één"] {
            let e = parse_last(bad).unwrap_err();
            assert!(e.contains("not a duration like 90s, 30m, 1h or 2d"), "{bad:?}: {e}");
        }
        assert!(parse_last("0m").unwrap_err().contains("empty range"));
        assert!(parse_last("99999999999999999999d").unwrap_err().contains("longer than"));
        assert!(parse_last("999999999999999999d").unwrap_err().contains("longer than"));
    }

    #[test]
    fn a_chart_shows_each_caller_and_route_per_minute() {
        // From mid-minute: the rows start at the next whole minute (00:00), and the range
        // holds 12 minutes. k1 has a spike at 00:06, 5xx at 00:02, 4xx at 00:07, nothing
        // at 00:04 and after 00:09.
        let m = |i: u64| DEC + 60 * i;
        let rows = vec![
            minute_row("k1", "key", m(0), 10, 0, 0, 12.0),
            minute_row("k1", "key", m(1), 20, 0, 0, 12.0),
            minute_row("k1", "key", m(2), 8, 0, 2, 40.0),
            minute_row("k1", "key", m(3), 11, 0, 0, 12.0),
            minute_row("k1", "key", m(5), 45, 0, 0, 12.0),
            minute_row("k1", "key", m(6), 120, 0, 0, 180.5),
            minute_row("k1", "key", m(7), 7, 3, 0, 12.0),
            minute_row("k1", "key", m(8), 10, 0, 0, 12.0),
            minute_row("k1", "key", m(9), 10, 0, 0, 12.0),
            minute_row("portal", "app", m(3), 2, 1, 1, 950.0),
            minute_row("portal", "app", m(9), 8, 0, 0, 20.0),
        ];
        let v = serde_json::json!({
            "from": "2026-11-30T23:59:30Z", "to": "2026-12-01T00:11:30Z", "by": "minute",
            "truncated": false, "rows": rows,
        });
        let text = chart(&v);
        assert_eq!(
            text.lines().collect::<Vec<_>>(),
            [
                "usage from 2026-11-30T23:59:30Z to 2026-12-01T00:11:30Z, one character a minute",
                "errors: ! some 5xx, x some 4xx, · neither",
                "",
                "k1 (key)  search/query  calls 246, 4xx 3, 5xx 2, p99 max 180.5 ms",
                "  calls   ▁▂▁▁ ▃█▁▁▁    max 120 a minute",
                "  errors  ··!····x····",
                "          00:00  00:11",
                "",
                "portal (app)  search/query  calls 12, 4xx 1, 5xx 1, p99 max 950.0 ms",
                "  calls      ▄     █    max 8 a minute",
                "  errors  ···!········",
                "          00:00  00:11",
            ],
            "{text}"
        );
    }

    #[test]
    fn a_chart_of_more_than_120_minutes_folds_them() {
        // 180 minutes from 23:00 the day before: two minutes a character, 90 characters.
        let start = DEC - 3600;
        let mut rows: Vec<serde_json::Value> = (0..180)
            .map(|i| match i {
                100 => minute_row("k1", "key", start + 60 * i, 31, 0, 0, 12.0),
                101 => minute_row("k1", "key", start + 60 * i, 0, 0, 1, 400.0),
                151 => minute_row("k1", "key", start + 60 * i, 0, 1, 0, 12.0),
                _ => minute_row("k1", "key", start + 60 * i, 1, 0, 0, 12.0),
            })
            .collect();
        // Outside the range: counted in the totals, not drawn.
        rows.push(minute_row("k1", "key", start + 60 * 180, 5, 0, 0, 12.0));
        let v = serde_json::json!({
            "from": rfc3339(start), "to": rfc3339(start + 180 * 60), "by": "minute", "truncated": true, "rows": rows,
        });
        let text = chart(&v);
        let spark = format!("{}█{}", "▁".repeat(50), "▁".repeat(39));
        let errors = format!("{}!{}x{}", "·".repeat(50), "·".repeat(24), "·".repeat(14));
        let axis = format!("11-30 23:00{}12-01 01:58", " ".repeat(90 - 22));
        assert_eq!(
            text.lines().collect::<Vec<_>>(),
            [
                "usage from 2026-11-30T23:00:00Z to 2026-12-01T02:00:00Z, one character per 2 minutes",
                "errors: ! some 5xx, x some 4xx, · neither",
                "",
                "k1 (key)  search/query  calls 215, 4xx 1, 5xx 1, p99 max 400.0 ms",
                &format!("  calls   {spark}  max 32 per 2 minutes"),
                &format!("  errors  {errors}"),
                &format!("          {axis}"),
                "(the first 10000 rows: narrow the range or name a key)",
            ],
            "{text}"
        );
        assert_eq!(spark.chars().count(), 90);
        assert_eq!(errors.chars().count(), 90);
        assert_eq!(axis.len(), 90);
    }

    #[test]
    fn a_chart_says_when_there_is_nothing_to_draw() {
        let v = serde_json::json!({
            "from": "2026-12-01T00:00:00Z", "to": "2026-12-01T01:00:00Z", "by": "minute", "rows": [],
        });
        assert_eq!(
            chart(&v),
            "usage from 2026-12-01T00:00:00Z to 2026-12-01T01:00:00Z, one character a minute\n\
             (no calls in this range)\n"
        );
        let v = serde_json::json!({"error": "no"});
        assert_eq!(chart(&v), "usage from ? to ?: not a range of RFC 3339 times\n");
        // A range within one minute holds no minute's row.
        let v = serde_json::json!({
            "from": "2026-12-01T00:00:10Z", "to": "2026-12-01T00:00:50Z", "by": "minute",
            "rows": [minute_row("k1", "key", DEC, 1, 0, 0, 1.0)],
        });
        assert_eq!(chart(&v).lines().last(), Some("(the range holds no whole minute)"));
    }

    #[test]
    fn times_parse_as_the_api_takes_them() {
        assert_eq!(parse_time("1796083200"), Some(DEC));
        assert_eq!(parse_time("2026-12-01"), Some(DEC));
        assert_eq!(parse_time("2026-12-01T00:01:00Z"), Some(DEC + 60));
        assert_eq!(parse_time("yesterday"), None);
        assert_eq!(rfc3339(DEC), "2026-12-01T00:00:00Z");
        assert_eq!(
            query_unescape(&query_escape("2026-12-01T00:00:00+01:00 a")).as_deref(),
            Some("2026-12-01T00:00:00+01:00 a")
        );
        assert_eq!(query_unescape("%zz"), None);
    }

    fn quotas(mode: QuotaMode, calls: u64, every: u64) -> Quotas {
        let plans: BTreeMap<String, Plan> = [(
            "metered".to_owned(),
            Plan {
                products: vec!["search".into()],
                rate_limit: None,
                app_rate_limit: None,
                fail_closed: false,
                quota: Some(Quota { calls, mode, anchor: postern_model::usage::Anchor::EverySeconds(every) }),
                priority: None,
            },
        )]
        .into();
        let mut creds = Credentials::empty();
        creds.keys = vec![postern_model::credentials::ApiKey {
            id: "k1".into(),
            sha256: "ab".repeat(32),
            app: "a".into(),
            tenant: "t".into(),
            plan: "metered".into(),
            scopes: vec![],
            priority: Default::default(),
            status: Default::default(),
            successor: None,
            expires_at: None,
        }];
        Quotas::new(&plans, &creds)
    }

    #[test]
    fn a_hard_quota_flags_its_caller_and_bills_no_overshoot() {
        let dir = tempfile::tempdir().unwrap();
        let store = UsageStore::open(&dir.path().join("usage.db")).unwrap();
        let q = quotas(QuotaMode::Hard, 100, 60);
        assert!(q.of(CallerKind::Key, "k1").is_some() && q.of(CallerKind::Key, "k2").is_none());
        // 70 calls (and 5 refused ones, not billable), then 15: 80 % is passed.
        let w = |seq, start, ok| window("a", seq, start, vec![row("k1", "search/query", [0, ok, 0, 5, 0], 4)]);
        store.apply(&[w(1, DEC, 70)], DEC, &q).unwrap();
        assert_eq!(store.events(0, 10, None).unwrap(), vec![], "70 of 100: nothing yet");
        store.apply(&[w(2, DEC + 10, 15)], DEC + 11, &q).unwrap();
        let events = store.events(0, 10, None).unwrap();
        assert_eq!(events.iter().map(|e| (e.percent, e.used)).collect::<Vec<_>>(), vec![(80, 85)]);
        assert_eq!(store.live_flags(DEC + 12).unwrap(), vec![], "not flagged below 100 %");
        // 30 more: 100 % is passed in this window; 15 of them are overshoot. A duplicate
        // delivery of it changes nothing.
        store.apply(&[w(3, DEC + 20, 30)], DEC + 21, &q).unwrap();
        store.apply(&[w(3, DEC + 20, 30)], DEC + 22, &q).unwrap();
        let events = store.events(0, 10, None).unwrap();
        assert_eq!(
            events.iter().map(|e| (e.percent, e.kind.as_str())).collect::<Vec<_>>(),
            vec![(80, "quota.warning"), (100, "quota.exhausted")]
        );
        let flags = store.live_flags(DEC + 22).unwrap();
        assert_eq!(flags.len(), 1);
        assert_eq!(
            (flags[0].caller.as_str(), flags[0].until, flags[0].quota, flags[0].period_s),
            ("k1", DEC + 60, 100, 60)
        );
        assert_eq!(store.live_flags(DEC + 60).unwrap(), vec![], "the flag lifts at the period's end");
        // Calls admitted before the flag reached the nodes: overshoot, not billed.
        store.apply(&[w(4, DEC + 30, 4)], DEC + 31, &q).unwrap();
        let t = &store.totals("2026-12", Some("k1")).unwrap()[0];
        assert_eq!((t.billable, t.overshoot, t.calls), (100, 19, 119 + 20));
        assert_eq!(store.quota_use("k1", CallerKind::Key, "search", DEC + 30).unwrap(), Some((119, DEC, DEC + 60)));
        // The next period starts from nothing.
        store.apply(&[w(5, DEC + 60, 10)], DEC + 61, &q).unwrap();
        assert_eq!(
            store.quota_use("k1", CallerKind::Key, "search", DEC + 60).unwrap(),
            Some((10, DEC + 60, DEC + 120))
        );
        let t = &store.totals("2026-12", Some("k1")).unwrap()[0];
        assert_eq!((t.billable, t.overshoot), (110, 19));
        // The webhook's bookkeeping: an event taken is not offered again.
        let due = store.events(0, 10, Some(DEC + 100)).unwrap();
        assert_eq!(due.len(), 2);
        store.delivered(due[0].id, true, 0).unwrap();
        store.delivered(due[1].id, false, DEC + 200).unwrap();
        assert_eq!(store.events(0, 10, Some(DEC + 100)).unwrap(), vec![], "one taken, one not due yet");
        assert_eq!(store.events(0, 10, Some(DEC + 200)).unwrap().len(), 1);
    }

    #[test]
    fn an_overage_quota_warns_and_bills_everything() {
        let dir = tempfile::tempdir().unwrap();
        let store = UsageStore::open(&dir.path().join("usage.db")).unwrap();
        let q = quotas(QuotaMode::Overage, 10, 60);
        store.apply(&[window("a", 1, DEC, vec![row("k1", "search/query", [0, 25, 0, 0, 0], 4)])], DEC, &q).unwrap();
        assert_eq!(store.events(0, 10, None).unwrap().iter().map(|e| e.percent).collect::<Vec<_>>(), vec![80, 100]);
        assert_eq!(store.live_flags(DEC).unwrap(), vec![], "overage is never blocked");
        let t = &store.totals("2026-12", Some("k1")).unwrap()[0];
        assert_eq!((t.billable, t.overshoot), (25, 0));
    }
}
