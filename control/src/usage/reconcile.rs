//! Reconciling a period: each node's own counts against the store's, the difference
//! written as corrections, and the period made final once ended and complete.

use std::collections::BTreeMap;

use postern_model::protocol::Missing;
use postern_model::usage::{NodeCounters, Window};
use serde::Serialize;

use super::db::{DbError, Lock, Sql, add, i64_of, int, vals};
use super::decide::retired_of;
use super::intake::gaps;
use super::params::rfc3339;
use super::queries::{Total, totals_in};
use super::store::UsageStore;

impl UsageStore {
    /// Stores a node's own counters of a period complete on it (checked): the report with
    /// the highest `through` is kept. A changed report of a period already final is held
    /// for the platform's decision ([`UsageStore::decide_held`]), never stored on its own:
    /// the period's export may have gone out. `now` is Unix seconds.
    pub fn put_counters(&self, c: &NodeCounters, now: u64) -> Result<Counted, DbError> {
        let raw = serde_json::to_vec(c).map_err(|e| DbError::Other(e.to_string()))?;
        let calls = c.calls();
        self.tx(|sql| {
            sql.lock(Lock::Periods { exclusive: true })?;
            let args = vals![&c.node, &c.period, int(c.through)?, int(calls)?, int(now)?, raw.clone()];
            if !matches!(final_at(sql, &c.period)?, Some(Some(_))) {
                store_counters(sql, &args)?;
                return Ok(Counted::Stored);
            }
            let known = sql.row(
                "SELECT through, raw FROM node_counters WHERE node = ?1 AND period = ?2",
                &vals![&c.node, &c.period],
            )?;
            let changes = match known {
                Some(r) => c.through >= r.count(0)? && r.blob(1)? != raw,
                None => true,
            };
            if !changes {
                return Ok(Counted::Stored);
            }
            sql.exec(
                "INSERT INTO held_counters (node, period, through, calls, received, raw, state)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, 'held')
                 ON CONFLICT (node, period) DO UPDATE SET through = excluded.through, calls = excluded.calls,
                   received = excluded.received, raw = excluded.raw, state = 'held', decided_by = NULL,
                   decided_at = NULL
                 WHERE excluded.through >= held_counters.through AND excluded.raw <> held_counters.raw",
                &args,
            )?;
            Ok(Counted::Held)
        })
    }

    /// A node's own counters of `period`, as last reported.
    pub fn counters(&self, node: &str, period: &str) -> Result<Option<NodeCounters>, DbError> {
        self.read(|sql| counters_of(sql, node, period))
    }

    /// Reconciles billing period `period` (`YYYY-MM`) at Unix second `now`: the period
    /// is final once it has ended (and [`CLOSE_GRACE_S`] passed), and every node that
    /// counted calls in it has reported its own counters of it and the store has every
    /// one of its windows up to the last number they cover, but those the node no longer
    /// had when asked for them. Each such node's counts are then compared with the
    /// store's: what the store lacks becomes a correction added to the totals (and taken
    /// back as windows arrive), so the export bills what the node answered. `None` for a
    /// period name that is not one.
    pub fn reconcile(&self, period: &str, now: u64) -> Result<Option<Reconciled>, DbError> {
        let Some((start, end)) = postern_model::usage::parse_month(period) else { return Ok(None) };
        self.tx(|sql| reconcile_in(sql, period, (start, end), now).map(Some))
    }

    /// Whether period `period` is final now (reconciled, and no window came since).
    pub fn is_final(&self, period: &str) -> Result<bool, DbError> {
        self.read(|sql| Ok(matches!(final_at(sql, period)?, Some(Some(_)))))
    }

    /// The billing export of a final period: one total per caller and product. `Err`
    /// with the reason while the period is not final.
    pub fn export(&self, period: &str) -> Result<Result<Vec<Total>, String>, DbError> {
        self.read(|sql| match final_at(sql, period)? {
            Some(Some(_)) => totals_in(sql, period, None).map(Ok),
            Some(None) => Ok(Err(format!(
                "period {period} is not final: windows arrived after its last reconcile, or it did not pass; reconcile it"
            ))),
            None => Ok(Err(format!("period {period} was never reconciled"))),
        })
    }
}

/// What became of a node's counters report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counted {
    /// Stored for the period's next reconcile (or the same as, or older than, the one kept).
    Stored,
    /// A change to a period already final: held for the platform's decision.
    Held,
}

/// Keeps a node's report (`node, period, through, calls, received, raw`) unless the one
/// kept covers more or is the same; whether it was stored.
pub(crate) fn store_counters(sql: &mut dyn Sql, args: &[super::db::Val]) -> Result<bool, DbError> {
    Ok(sql.exec(
        "INSERT INTO node_counters (node, period, through, calls, received, raw) VALUES (?1, ?2, ?3, ?4, ?5, ?6)
         ON CONFLICT (node, period) DO UPDATE SET through = excluded.through, calls = excluded.calls,
           received = excluded.received, raw = excluded.raw
         WHERE excluded.through >= node_counters.through AND excluded.raw <> node_counters.raw",
        args,
    )? == 1)
}

/// When `period` was made final: `None` if never reconciled, `Some(None)` if reopened.
fn final_at(sql: &mut dyn Sql, period: &str) -> Result<Option<Option<i64>>, DbError> {
    sql.row("SELECT final_at FROM periods WHERE period = ?1", &vals![period])?.map(|r| r.opt_int(0)).transpose()
}

/// [`UsageStore::reconcile`] in one transaction, which no batch of windows overlaps.
fn reconcile_in(sql: &mut dyn Sql, period: &str, (start, end): (u64, u64), now: u64) -> Result<Reconciled, DbError> {
    sql.lock(Lock::Periods { exclusive: true })?;
    let mut blocking = Vec::new();
    if now < end + CLOSE_GRACE_S {
        blocking.push(format!(
            "the period ends at {}; its last windows may arrive until {}",
            rfc3339(end),
            rfc3339(end + CLOSE_GRACE_S)
        ));
    }
    let mut counted: BTreeMap<String, (u64, u64)> = sql
        .rows(
            "SELECT node, COUNT(DISTINCT seq), CAST(SUM(calls) AS BIGINT) FROM applied WHERE start >= ?1 AND start < ?2
             GROUP BY node ORDER BY node",
            &vals![int(start)?, int(end)?],
        )?
        .iter()
        .map(|r| Ok((r.text(0)?, (r.count(1)?, r.count(2)?))))
        .collect::<Result<_, DbError>>()?;
    // A node whose every window of the period is lost still reported its counts.
    for r in sql.rows("SELECT node FROM node_counters WHERE period = ?1", &vals![period])? {
        counted.entry(r.text(0)?).or_default();
    }
    let mut nodes = Vec::with_capacity(counted.len());
    let mut waived = Vec::new();
    for (node, (windows, calls)) in counted {
        let last_start = sql.row("SELECT MAX(start) FROM applied WHERE node = ?1", &vals![&node])?;
        let last_start = last_start.map(|r| r.opt_int(0)).transpose()?.flatten();
        let mut pn = PeriodNode {
            node: node.clone(),
            windows,
            calls,
            missing: Vec::new(),
            last_window: last_start.map(|t| rfc3339(t.max(0) as u64)),
            own_calls: None,
            corrected: 0,
            counted_less: 0,
            retired_after: None,
        };
        // A retired node holds up no period: what the store has of it stands.
        pn.retired_after = retired_of(sql, &node)?.map(|r| r.after);
        let blocking = if pn.retired_after.is_some() { &mut waived } else { &mut blocking };
        let Some(own) = counters_of(sql, &node, period)? else {
            blocking.push(format!(
                "node {node} has not reported its own counts of {period} (it does once every window before the period's end is spooled)"
            ));
            nodes.push(pn);
            continue;
        };
        pn.own_calls = Some(own.calls());
        pn.missing = lacking(sql, &own)?;
        if !pn.missing.is_empty() {
            let runs: Vec<String> = pn.missing.iter().map(|m| format!("{}..{}", m.from, m.to)).collect();
            blocking.push(format!("node {node} lacks windows {} (it is asked for them)", runs.join(", ")));
            nodes.push(pn);
            continue;
        }
        let beyond = sql
            .row(
                "SELECT COUNT(*) FROM applied WHERE node = ?1 AND start >= ?2 AND start < ?3 AND seq > ?4",
                &vals![&node, int(start)?, int(end)?, int(own.through)?],
            )?
            .map_or(Ok(0), |r| r.count(0))?;
        if beyond > 0 {
            blocking.push(format!(
                "node {node} has windows of {period} numbered past {}, the last its counts cover: it numbered again from 1 (give it a new id)",
                own.through
            ));
            nodes.push(pn);
            continue;
        }
        (pn.corrected, pn.counted_less) = compare(sql, &own, (start, end), windows > 0 && calls == own.calls())?;
        nodes.push(pn);
    }
    let (callers, billable) = sql
        .row(
            "SELECT COUNT(*), CAST(COALESCE(SUM(billable), 0) AS BIGINT) FROM totals WHERE period = ?1",
            &vals![period],
        )?
        .map_or(Ok((0, 0)), |r| Ok::<_, DbError>((r.count(0)?, r.count(1)?)))?;
    let late = sql.row("SELECT late FROM periods WHERE period = ?1", &vals![period])?.map_or(Ok(0), |r| r.count(0))?;
    let final_at = blocking.is_empty().then_some(now);
    sql.exec(
        "INSERT INTO periods (period, final_at, late) VALUES (?1, ?2, 0)
         ON CONFLICT (period) DO UPDATE SET final_at = excluded.final_at",
        &vals![period, final_at.map(i64_of).transpose()?],
    )?;
    Ok(Reconciled {
        period: period.to_owned(),
        is_final: final_at.is_some(),
        final_at: final_at.map(rfc3339),
        blocking,
        waived,
        nodes,
        callers,
        billable,
        late_windows: late,
    })
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
    /// What would keep it from being final but for the retirement of the node it names.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub waived: Vec<String>,
    /// Every node that counted calls in it.
    pub nodes: Vec<PeriodNode>,
    /// Callers (key or app, and product) with calls in it.
    pub callers: u64,
    /// Billable calls in it.
    pub billable: u64,
    /// Window parts that came after it was final, held, and applied by the platform
    /// (each time reopening it).
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
    /// The node was retired as of this window: the period does not wait for it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retired_after: Option<u64>,
}

/// A node's reported counters of `period`.
fn counters_of(sql: &mut dyn Sql, node: &str, period: &str) -> Result<Option<NodeCounters>, DbError> {
    let raw = sql.row("SELECT raw FROM node_counters WHERE node = ?1 AND period = ?2", &vals![node, period])?;
    let raw = raw.map(|r| r.blob(0)).transpose()?;
    Ok(raw.and_then(|raw| serde_json::from_slice(&raw).ok()))
}

/// The node's numbers up to the last its counts cover that the store lacks, but those it
/// no longer had when asked for them.
fn lacking(sql: &mut dyn Sql, own: &NodeCounters) -> Result<Vec<Missing>, DbError> {
    let (_, mut missing) = gaps(sql, &own.node)?;
    let top = sql.row("SELECT MAX(seq) FROM applied WHERE node = ?1", &vals![&own.node])?;
    let top = top.map(|r| r.opt_int(0)).transpose()?.flatten().map_or(0, |t| t.max(0) as u64);
    if top < own.through {
        missing.push(Missing { node: own.node.clone(), from: top + 1, to: own.through });
    }
    let mut out: Vec<Missing> = Vec::new();
    for m in missing {
        // The numbers of the run in no unavailable run, as runs again.
        // Each step moves past one unavailable run (checked runs end at or below
        // `through`, far below u64::MAX), so there are at most that many steps plus one.
        let mut from = m.from;
        let to = m.to.min(own.through);
        for _ in 0..=own.unavailable.len() {
            if from > to {
                break;
            }
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
            if from == u64::MAX {
                break;
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
    sql: &mut dyn Sql,
    own: &NodeCounters,
    (start, end): (u64, u64),
    agree: bool,
) -> Result<(u64, u64), DbError> {
    let standing = sql
        .row("SELECT COUNT(*) FROM corrections WHERE node = ?1 AND period = ?2", &vals![&own.node, &own.period])?
        .map_or(Ok(0), |r| r.count(0))?;
    if agree && standing == 0 {
        return Ok((0, 0));
    }
    type Key = (String, String, String);
    let mut stored: BTreeMap<Key, [u64; 5]> = BTreeMap::new();
    for r in sql.rows(
        "SELECT raw FROM applied WHERE node = ?1 AND start >= ?2 AND start < ?3",
        &vals![&own.node, int(start)?, int(end)?],
    )? {
        let Ok(w) = serde_json::from_slice::<Window>(&r.blob(0)?) else { continue };
        for row in w.rows {
            let s = stored.entry((row.caller, row.kind.as_str().to_owned(), row.product)).or_default();
            for (a, n) in s.iter_mut().zip(row.status) {
                *a = a.checked_add(n).ok_or(DbError::Overflow)?;
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
            counted_less = counted_less.saturating_add(have[i].saturating_sub(r.status[i]));
        }
        if lack.iter().any(|&n| n > 0) {
            wanted.insert(key, lack);
        }
    }
    counted_less = stored.values().flatten().fold(counted_less, |a, &n| a.saturating_add(n));
    // The totals move by the new corrections less the standing ones.
    let mut delta: BTreeMap<Key, [i64; 5]> = BTreeMap::new();
    for (k, v) in &wanted {
        let mut d = [0i64; 5];
        for i in 0..5 {
            d[i] = i64_of(v[i])?;
        }
        delta.insert(k.clone(), d);
    }
    for r in sql.rows(
        "SELECT caller, kind, product, s1, s2, s3, s4, s5 FROM corrections WHERE node = ?1 AND period = ?2",
        &vals![&own.node, &own.period],
    )? {
        let d = delta.entry((r.text(0)?, r.text(1)?, r.text(2)?)).or_default();
        for (i, d) in d.iter_mut().enumerate() {
            *d = d.checked_sub(r.int(3 + i)?).ok_or(DbError::Overflow)?;
        }
    }
    let sets = ["billable", "s1", "s2", "s3", "s4", "s5"].map(|c| add("totals", c)).join(", ");
    let upsert = format!(
        "INSERT INTO totals (caller, kind, product, period, billable, s1, s2, s3, s4, s5, overshoot)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, 0)
         ON CONFLICT (caller, kind, product, period) DO UPDATE SET {sets}"
    );
    for ((caller, kind, product), d) in &delta {
        if d.iter().all(|&n| n == 0) {
            continue;
        }
        let billable = d[1].checked_add(d[2]).ok_or(DbError::Overflow)?;
        sql.exec(&upsert, &vals![caller, kind, product, &own.period, billable, d[0], d[1], d[2], d[3], d[4]])?;
    }
    sql.exec("DELETE FROM corrections WHERE node = ?1 AND period = ?2", &vals![&own.node, &own.period])?;
    let mut corrected = 0u64;
    for ((caller, kind, product), s) in &wanted {
        sql.exec(
            "INSERT INTO corrections (node, period, caller, kind, product, s1, s2, s3, s4, s5)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)",
            &vals![
                &own.node,
                &own.period,
                caller,
                kind,
                product,
                int(s[0])?,
                int(s[1])?,
                int(s[2])?,
                int(s[3])?,
                int(s[4])?
            ],
        )?;
        corrected = s.iter().try_fold(corrected, |a, &n| a.checked_add(n)).ok_or(DbError::Overflow)?;
    }
    if corrected > 0 || standing > 0 || counted_less > 0 {
        eprintln!(
            "posternctl: usage reconcile {}: node {}: {corrected} calls the store lacks added as corrections, {counted_less} applied beyond its own counts",
            own.period, own.node
        );
    }
    Ok((corrected, counted_less))
}
