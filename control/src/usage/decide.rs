//! The platform's decisions on the intake, each recorded with who took it and when: a
//! node retired as of a sequence number (its later windows are refused, and a period no
//! longer waits for it), and the windows and changed counters reports held because their
//! period was already final (applied, reopening the period for the next reconcile, or
//! discarded).

use std::collections::BTreeMap;

use postern_model::usage::{Window, month_period};
use serde::Serialize;

use super::db::{DbError, Lock, Sql, int, vals};
use super::intake::{ApplyError, add_rows};
use super::params::rfc3339;
use super::quota::Quotas;
use super::reconcile::store_counters;
use super::store::UsageStore;

/// A node retired from the usage stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Retired {
    /// The node.
    pub node: String,
    /// Its last window that counts: those numbered past it are refused (`node_retired`).
    pub after: u64,
    /// When, RFC 3339.
    pub at: String,
    /// Who retired it (the token's name).
    pub by: String,
}

/// Windows held for one period, by what was decided of them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Held {
    /// The period, `YYYY-MM`.
    pub period: String,
    /// `held` (waiting for a decision), `applied` or `discarded`.
    pub state: String,
    /// Window parts (one per caller).
    pub parts: u64,
    /// Nodes' changed reports of their own counts.
    pub reports: u64,
    /// Calls in them.
    pub calls: u64,
    /// The nodes they came from.
    pub nodes: Vec<String>,
    /// Who decided, and when (RFC 3339), once decided.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decided_by: Option<String>,
    /// When it was decided.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decided_at: Option<String>,
}

/// What the platform decides of a period's held windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Add them to the period's totals; the period is reopened for the next reconcile.
    Apply,
    /// Keep them out of every total, for good.
    Discard,
}

impl Decision {
    fn state(self) -> &'static str {
        match self {
            Decision::Apply => "applied",
            Decision::Discard => "discarded",
        }
    }
}

impl UsageStore {
    /// Retires `node` as of its window numbered `after` (by default the highest it has
    /// applied): its windows numbered past it are refused from now on (rule
    /// `node_retired`), and no period waits for its counts or its missing windows again.
    /// `Err` with the reason when windows past `after` are already applied or the node is
    /// retired as of another number.
    pub fn retire(
        &self,
        node: &str,
        after: Option<u64>,
        by: &str,
        now: u64,
    ) -> Result<Result<Retired, String>, DbError> {
        self.tx(|sql| {
            sql.lock(Lock::Node(node))?;
            let top = sql
                .row("SELECT MAX(seq) FROM applied WHERE node = ?1", &vals![node])?
                .map(|r| r.opt_int(0))
                .transpose()?
                .flatten()
                .map_or(0, |t| t.max(0) as u64);
            let after = after.unwrap_or(top);
            if after < top {
                return Ok(Err(format!("node {node} has windows applied up to {top}: retire it as of {top} or later")));
            }
            sql.exec(
                "INSERT INTO retired (node, after_seq, at, by) VALUES (?1, ?2, ?3, ?4) ON CONFLICT (node) DO NOTHING",
                &vals![node, int(after)?, int(now)?, by],
            )?;
            let r = retired_of(sql, node)?.ok_or_else(|| DbError::Other("the retirement was not recorded".into()))?;
            if r.after != after {
                return Ok(Err(format!("node {node} is already retired as of window {}", r.after)));
            }
            Ok(Ok(r))
        })
    }

    /// Every retired node.
    pub fn retired(&self) -> Result<Vec<Retired>, DbError> {
        self.read(|sql| {
            sql.rows("SELECT node, after_seq, at, by FROM retired ORDER BY node", &[])?
                .iter()
                .map(retired_row)
                .collect()
        })
    }

    /// Windows held because their period was final when they came, per period and state.
    pub fn held(&self) -> Result<Vec<Held>, DbError> {
        self.read(|sql| {
            let rows = sql.rows(
                "SELECT period, state, node, COUNT(*), CAST(SUM(calls) AS BIGINT), MAX(decided_by), MAX(decided_at)
                 FROM held GROUP BY period, state, node ORDER BY period, state, node",
                &[],
            )?;
            let reports = sql.rows(
                "SELECT period, state, node, 0, 0, decided_by, decided_at FROM held_counters ORDER BY period, state, node",
                &[],
            )?;
            let mut out: BTreeMap<(String, String), Held> = BTreeMap::new();
            let n = rows.len();
            for (i, r) in rows.into_iter().chain(reports).enumerate() {
                let (period, state) = (r.text(0)?, r.text(1)?);
                let h = out.entry((period.clone(), state.clone())).or_insert_with(|| Held {
                    period,
                    state,
                    parts: 0,
                    reports: 0,
                    calls: 0,
                    nodes: Vec::new(),
                    decided_by: None,
                    decided_at: None,
                });
                let node = r.text(2)?;
                if !h.nodes.contains(&node) {
                    h.nodes.push(node);
                    h.nodes.sort();
                }
                if i >= n {
                    h.reports += 1;
                }
                h.parts = h.parts.saturating_add(r.count(3)?);
                h.calls = h.calls.saturating_add(r.count(4)?);
                if let Some(by) = r.opt_text(5)? {
                    h.decided_by = Some(by);
                }
                if let Some(at) = r.opt_int(6)? {
                    h.decided_at = Some(rfc3339(at.max(0) as u64));
                }
            }
            Ok(out.into_values().collect())
        })
    }

    /// Decides every window and counters report of `period` still held: applied (windows
    /// added to the totals as they would have been, reports kept for the reconcile, and the
    /// period reopened for the next reconcile) or discarded. Recorded with `by` and `now`.
    pub fn decide_held(
        &self,
        period: &str,
        decision: Decision,
        by: &str,
        now: u64,
        quotas: &Quotas,
    ) -> Result<Decided, ApplyError> {
        self.tx(|sql| {
            sql.lock(Lock::Periods { exclusive: true })?;
            let raws = sql.rows(
                "SELECT raw FROM held WHERE period = ?1 AND state = 'held' ORDER BY node, seq, part",
                &vals![period],
            )?;
            let reports = sql.rows(
                "SELECT node, period, through, calls, received, raw FROM held_counters
                 WHERE period = ?1 AND state = 'held' ORDER BY node",
                &vals![period],
            )?;
            let decided = Decided { parts: raws.len() as u64, reports: reports.len() as u64 };
            if decided == Decided::default() {
                return Ok(decided);
            }
            if decision == Decision::Apply {
                let mut windows = Vec::with_capacity(raws.len());
                for r in &raws {
                    let w: Window = serde_json::from_slice(&r.blob(0)?)
                        .map_err(|e| ApplyError::Unavailable(format!("a held window does not parse: {e}")))?;
                    windows.push(w);
                }
                add_rows(sql, &windows, now, quotas)?;
                for r in &reports {
                    let args =
                        vals![r.text(0)?, r.text(1)?, r.int(2)?, r.int(3)?, r.int(4)?, r.blob(5)?];
                    store_counters(sql, &args)?;
                }
                sql.exec(
                    "UPDATE periods SET final_at = NULL, late = late + ?2 WHERE period = ?1",
                    &vals![period, int(decided.parts)?],
                )?;
            }
            for table in ["held", "held_counters"] {
                sql.exec(
                    &format!(
                        "UPDATE {table} SET state = ?2, decided_by = ?3, decided_at = ?4 WHERE period = ?1 AND state = 'held'"
                    ),
                    &vals![period, decision.state(), by, int(now)?],
                )?;
            }
            Ok(decided)
        })
    }
}

/// What the platform decided at once of a period's held items.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Decided {
    /// Window parts.
    pub parts: u64,
    /// Nodes' counters reports.
    pub reports: u64,
}

/// Holds `fresh` parts whose period is final instead of adding them: the rest, to add.
/// A window never reopens a final period on its own; the platform decides
/// ([`UsageStore::decide_held`]).
pub(crate) fn hold_final(sql: &mut dyn Sql, fresh: Vec<Window>, now: u64) -> Result<Vec<Window>, ApplyError> {
    let mut finals: BTreeMap<String, bool> = BTreeMap::new();
    let mut keep = Vec::with_capacity(fresh.len());
    for w in fresh {
        let period = month_period(w.start).0;
        let is_final = match finals.get(&period) {
            Some(&f) => f,
            None => {
                let f = sql
                    .row("SELECT final_at FROM periods WHERE period = ?1", &vals![&period])?
                    .map(|r| r.opt_int(0))
                    .transpose()?
                    .flatten()
                    .is_some();
                finals.insert(period.clone(), f);
                f
            }
        };
        if !is_final {
            keep.push(w);
            continue;
        }
        let calls = w.rows.iter().try_fold(0u64, |a, r| a.checked_add(r.calls())).ok_or(DbError::Overflow)?;
        let raw = serde_json::to_vec(&w).map_err(|e| ApplyError::Unavailable(e.to_string()))?;
        sql.exec(
            "INSERT INTO held (node, seq, part, period, calls, received, raw, state)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, 'held') ON CONFLICT DO NOTHING",
            &vals![&w.node, int(w.seq)?, w.part, &period, int(calls)?, int(now)?, raw],
        )?;
    }
    Ok(keep)
}

/// The retirement of `node`, if it is retired.
pub(crate) fn retired_of(sql: &mut dyn Sql, node: &str) -> Result<Option<Retired>, DbError> {
    sql.row("SELECT node, after_seq, at, by FROM retired WHERE node = ?1", &vals![node])?
        .as_ref()
        .map(retired_row)
        .transpose()
}

fn retired_row(r: &super::db::DbRow) -> Result<Retired, DbError> {
    Ok(Retired { node: r.text(0)?, after: r.count(1)?, at: rfc3339(r.count(2)?), by: r.text(3)? })
}
