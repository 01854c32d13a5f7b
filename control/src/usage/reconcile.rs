//! Reconciling a period: each node's own counts against the store's, the difference
//! written as corrections, and the period made final once ended and complete.

use std::collections::BTreeMap;

use postern_model::protocol::Missing;
use postern_model::usage::{NodeCounters, Window};
use rusqlite::{Connection, OptionalExtension, params};
use serde::Serialize;

use super::intake::gaps;
use super::params::rfc3339;
use super::queries::Total;
use super::store::{UsageStore, sql_int};

impl UsageStore {
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
