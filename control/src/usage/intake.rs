//! The intake: a batch of nodes' closed windows applied in one transaction, each once,
//! and the numbers a node still has to send.

use postern_model::protocol::{Missing, UsageAck};
use postern_model::usage::{LATENCY_BUCKETS, Window, month_period};
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
