//! The intake: a batch of nodes' closed windows applied in one transaction, each once,
//! and the numbers a node still has to send.

use postern_model::protocol::{Missing, UsageAck};
use postern_model::usage::{LATENCY_BUCKETS, Window, WindowError, month_period};
use rusqlite::{Connection, OptionalExtension, params};

use super::quota::{Quotas, use_quota};
use super::store::{UsageStore, hist_cols, sql_int};

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
    /// A window the node could not have counted: nothing of the batch is applied, and
    /// the refusal is counted for the node under its rule.
    #[error("{0}")]
    Refused(#[from] WindowError),
    /// The database failed.
    #[error("usage store: {0}")]
    Sql(#[from] rusqlite::Error),
    /// Something the apply needs is not there now (the quotas, a worker thread).
    #[error("usage store: {0}")]
    Unavailable(String),
}

impl UsageStore {
    /// Applies checked windows in one transaction: each is added once, a window already
    /// applied is counted as a duplicate and changes nothing. `now` is Unix seconds.
    ///
    /// The billable calls of a caller on a quota are added to its period's use in the
    /// same transaction: passing 80 % and 100 % raises an event, and on a hard quota
    /// 100 % raises an over-quota flag until the period's end; the calls past a hard
    /// quota (admitted before the flag reached the nodes) are overshoot, not billed.
    ///
    /// Each new part must be one its node could have counted ([`could_have_counted`]);
    /// otherwise the batch is refused whole and the refusal is recorded for the node.
    pub fn apply(&self, windows: &[Window], now: u64, quotas: &Quotas) -> Result<UsageAck, ApplyError> {
        let mut conn = self.lock();
        let result = apply_in(&mut conn, windows, now, quotas);
        if let Err(ApplyError::Refused(e)) = &result {
            // The batch rolled back; the refusal is recorded on its own.
            record_refusal(&conn, e, now)?;
        }
        result
    }

    /// Records a window refused before it reached [`UsageStore::apply`] (its shape).
    pub fn refused(&self, e: &WindowError, now: u64) -> rusqlite::Result<()> {
        record_refusal(&self.lock(), e, now)
    }

    /// Refusals of nodes' windows so far: by node and rule, with the last one's number,
    /// time and reason.
    pub fn refusals(&self) -> rusqlite::Result<Vec<Refusal>> {
        let conn = self.lock();
        let mut stmt = conn.prepare_cached(
            "SELECT node, rule, count, last_at, last_seq, last_why FROM refusals ORDER BY node, rule",
        )?;
        stmt.query_map([], |r| {
            Ok(Refusal {
                node: r.get(0)?,
                rule: r.get(1)?,
                count: r.get::<_, i64>(2)?.max(0) as u64,
                last_at: r.get::<_, i64>(3)?.max(0) as u64,
                last_seq: r.get::<_, i64>(4)?.max(0) as u64,
                last_why: r.get(5)?,
            })
        })?
        .collect()
    }
}

fn record_refusal(conn: &Connection, e: &WindowError, now: u64) -> rusqlite::Result<()> {
    let WindowError::Invalid { node, seq, .. } = e;
    conn.execute(
        "INSERT INTO refusals (node, rule, count, last_at, last_seq, last_why) VALUES (?1, ?2, 1, ?3, ?4, ?5)
         ON CONFLICT DO UPDATE SET count = count + 1, last_at = excluded.last_at,
           last_seq = excluded.last_seq, last_why = excluded.last_why",
        params![node, e.rule(), sql_int(now), sql_int(*seq), e.to_string()],
    )?;
    Ok(())
}

/// Refusals of one node's windows under one rule.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Refusal {
    /// The node.
    pub node: String,
    /// The rule its windows broke.
    pub rule: String,
    /// How many batches were refused for it.
    pub count: u64,
    /// When the last was, Unix seconds.
    pub last_at: u64,
    /// The last refused window's number.
    pub last_seq: u64,
    /// Why the last was refused.
    pub last_why: String,
}

/// How far ahead of the control plane's clock a node's clock may run: a window may start
/// at most this long after now.
pub const CLOCK_ALLOWANCE_S: u64 = 60;

/// How far above its highest applied number a node's next window may be numbered: a node
/// ships its spool oldest first, so a real gap is a few numbers; a larger one is a node
/// that lost its spool (give it a new id) or one making numbers up.
pub const MAX_SEQ_GAP: u64 = 100_000;

/// Whether `w`, a part not applied before, is one its node could have counted, against
/// what the store holds of that node: not starting in the future (beyond
/// [`CLOCK_ALLOWANCE_S`]), numbered at most [`MAX_SEQ_GAP`] above the node's highest
/// number, and in time order with its neighbours (no window after it starts earlier, none
/// before it later, its other parts start with it), so a node cannot back-date calls
/// behind its own later windows.
fn could_have_counted(tx: &rusqlite::Transaction<'_>, w: &Window, now: u64) -> Result<(), ApplyError> {
    let refuse = |rule: &'static str, why: String| {
        ApplyError::Refused(WindowError::Invalid { node: w.node.clone(), seq: w.seq, rule, why })
    };
    if w.start > now.saturating_add(CLOCK_ALLOWANCE_S) {
        return Err(refuse(
            "future_window",
            format!("starts at {} s, {} s ahead of the control plane's clock", w.start, w.start - now),
        ));
    }
    let seq = sql_int(w.seq);
    let top: Option<i64> = tx
        .query_row(
            "SELECT seq FROM applied WHERE node = ?1 AND seq <> ?2 ORDER BY seq DESC LIMIT 1",
            params![w.node, seq],
            |r| r.get(0),
        )
        .optional()?;
    let top = top.map_or(0, |t| t.max(0) as u64);
    if w.seq > top.saturating_add(MAX_SEQ_GAP) {
        return Err(refuse(
            "seq_gap",
            format!("numbered {} above the node's highest number {top} (at most {MAX_SEQ_GAP})", w.seq - top),
        ));
    }
    let start_of = |sql: &str| -> rusqlite::Result<Option<u64>> {
        Ok(tx.query_row(sql, params![w.node, seq], |r| r.get::<_, i64>(0)).optional()?.map(|s| s.max(0) as u64))
    };
    let before = start_of("SELECT start FROM applied WHERE node = ?1 AND seq < ?2 ORDER BY seq DESC LIMIT 1")?;
    let after = start_of("SELECT start FROM applied WHERE node = ?1 AND seq > ?2 ORDER BY seq ASC LIMIT 1")?;
    let sibling: Option<u64> = tx
        .query_row(
            "SELECT start FROM applied WHERE node = ?1 AND seq = ?2 AND part <> ?3 LIMIT 1",
            params![w.node, seq, w.part],
            |r| r.get::<_, i64>(0),
        )
        .optional()?
        .map(|s| s.max(0) as u64);
    if let Some(b) = before.filter(|&b| b > w.start) {
        return Err(refuse("time_order", format!("starts at {} s, before its predecessor's {b} s", w.start)));
    }
    if let Some(a) = after.filter(|&a| a < w.start) {
        return Err(refuse("time_order", format!("starts at {} s, after its successor's {a} s", w.start)));
    }
    if let Some(s) = sibling.filter(|&s| s != w.start) {
        return Err(refuse("time_order", format!("starts at {} s, its other parts at {s} s", w.start)));
    }
    Ok(())
}

/// [`UsageStore::apply`] on its connection: everything or nothing.
fn apply_in(conn: &mut Connection, windows: &[Window], now: u64, quotas: &Quotas) -> Result<UsageAck, ApplyError> {
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
        let adds = (0..LATENCY_BUCKETS).map(|i| format!("h{i} = h{i} + excluded.h{i}")).collect::<Vec<_>>().join(", ");
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
                    // New: checked inside the transaction, so a refusal undoes its insert.
                    could_have_counted(&tx, &w, now)?;
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
pub(crate) fn gaps(conn: &Connection, node: &str) -> rusqlite::Result<(u64, Vec<Missing>)> {
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
