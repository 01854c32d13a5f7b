//! The intake: a batch of nodes' closed windows applied in one transaction, each once,
//! and the numbers a node still has to send.

use std::collections::{BTreeMap, BTreeSet};

use postern_model::protocol::{Missing, UsageAck};
use postern_model::usage::{LATENCY_BUCKETS, Row, Window, WindowError, month_period};

use super::db::{DbError, Engine, Lock, Sql, TxError, add, i64_of, int, vals};
use super::decide::{hold_final, retired_of};
use super::quota::{Quotas, use_quota};
use super::store::{UsageStore, hist_cols};

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
    Sql(#[from] DbError),
    /// Something the apply needs is not there now (the quotas, a worker thread).
    #[error("usage store: {0}")]
    Unavailable(String),
}

impl TxError for ApplyError {
    fn retryable(&self) -> bool {
        matches!(self, ApplyError::Sql(e) if e.retryable())
    }
}

/// Rows of a multi-row upsert at most (SQLite binds at most 32,766 values a statement).
const UPSERT_ROWS: usize = 500;

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
    /// otherwise the batch is refused whole and the refusal is recorded for the node. A
    /// batch that would take a total past `i64::MAX` is refused the same way (rule
    /// `total_overflow`), never clamped or wrapped.
    pub fn apply(&self, windows: &[Window], now: u64, quotas: &Quotas) -> Result<UsageAck, ApplyError> {
        self.ensure_months(windows.iter(), now)?;
        let result = self.tx(|sql| apply_in(sql, windows, now, quotas));
        let result = match result {
            Err(ApplyError::Sql(DbError::Overflow)) => Err(ApplyError::Refused(overflow(windows))),
            r => r,
        };
        if let Err(ApplyError::Refused(e)) = &result {
            // The batch rolled back; the refusal is recorded on its own.
            self.tx(|sql| record_refusal(sql, e, now))?;
        }
        result
    }

    /// Several requests' batches applied in one transaction (the intake's group commit),
    /// each answered as if applied alone, in order. When the group fails as a whole (a
    /// refusal, a conflict, the database), each batch is applied on its own, so that a
    /// refusal is only its own batch's and is recorded as [`UsageStore::apply`] does.
    pub fn apply_group(&self, batches: &[Vec<Window>], now: u64, quotas: &Quotas) -> Vec<Result<UsageAck, ApplyError>> {
        let one_by_one = || batches.iter().map(|b| self.apply(b, now, quotas)).collect();
        if batches.len() <= 1 || self.ensure_months(batches.iter().flatten(), now).is_err() {
            return one_by_one();
        }
        let all: Vec<&[Window]> = batches.iter().map(Vec::as_slice).collect();
        match self.tx(|sql| apply_group_in(sql, &all, now, quotas)) {
            Ok(acks) => acks.into_iter().map(Ok).collect(),
            Err(_) => one_by_one(),
        }
    }

    /// On PostgreSQL, makes the monthly partitions the per-minute rows of `windows` go to,
    /// before the batch's transaction (DDL would lock the parent table); months no longer
    /// kept get none.
    fn ensure_months<'a>(&self, windows: impl Iterator<Item = &'a Window>, now: u64) -> Result<(), DbError> {
        let Some(pool) = self.pool() else { return Ok(()) };
        let first = super::pg::Pool::first_kept(now);
        let months: BTreeSet<u64> = windows.map(|w| month_period(w.start).1).filter(|&m| m >= first).collect();
        for m in months {
            pool.ensure_month(m, now)?;
        }
        Ok(())
    }

    /// Records a window refused before it reached [`UsageStore::apply`] (its shape).
    pub fn refused(&self, e: &WindowError, now: u64) -> Result<(), DbError> {
        self.tx(|sql| record_refusal(sql, e, now))
    }

    /// Refusals of nodes' windows so far: by node and rule, with the last one's number,
    /// time and reason.
    pub fn refusals(&self) -> Result<Vec<Refusal>, DbError> {
        self.read(|sql| {
            sql.rows("SELECT node, rule, count, last_at, last_seq, last_why FROM refusals ORDER BY node, rule", &[])?
                .iter()
                .map(|r| {
                    Ok(Refusal {
                        node: r.text(0)?,
                        rule: r.text(1)?,
                        count: r.count(2)?,
                        last_at: r.count(3)?,
                        last_seq: r.count(4)?,
                        last_why: r.text(5)?,
                    })
                })
                .collect()
        })
    }
}

/// The refusal of a batch that would take a total past `i64::MAX`, named for its first
/// window.
fn overflow(windows: &[Window]) -> WindowError {
    let (node, seq) = windows.first().map_or((String::new(), 0), |w| (w.node.clone(), w.seq));
    WindowError::Invalid {
        node,
        seq,
        rule: "total_overflow",
        why: format!("the batch would take a total past {}: nothing of it is applied", i64::MAX),
    }
}

fn record_refusal(sql: &mut dyn Sql, e: &WindowError, now: u64) -> Result<(), DbError> {
    let WindowError::Invalid { node, seq, .. } = e;
    // The count stops at i64::MAX rather than refusing to count.
    sql.exec(
        "INSERT INTO refusals (node, rule, count, last_at, last_seq, last_why) VALUES (?1, ?2, 1, ?3, ?4, ?5)
         ON CONFLICT (node, rule) DO UPDATE SET
           count = CASE WHEN refusals.count < 9223372036854775807 THEN refusals.count + 1 ELSE refusals.count END,
           last_at = excluded.last_at, last_seq = excluded.last_seq, last_why = excluded.last_why",
        &vals![node, e.rule(), i64_of(now)?, i64_of(*seq)?, e.to_string()],
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
fn could_have_counted(sql: &mut dyn Sql, w: &Window, now: u64) -> Result<(), ApplyError> {
    let refuse = |rule: &'static str, why: String| {
        ApplyError::Refused(WindowError::Invalid { node: w.node.clone(), seq: w.seq, rule, why })
    };
    if w.start > now.saturating_add(CLOCK_ALLOWANCE_S) {
        return Err(refuse(
            "future_window",
            format!("starts at {} s, {} s ahead of the control plane's clock", w.start, w.start - now),
        ));
    }
    if let Some(r) = retired_of(sql, &w.node)?
        && w.seq > r.after
    {
        return Err(refuse(
            "node_retired",
            format!("the node was retired as of window {} by {} at {}", r.after, r.by, r.at),
        ));
    }
    let seq = i64_of(w.seq)?;
    let top = sql
        .row("SELECT seq FROM applied WHERE node = ?1 AND seq <> ?2 ORDER BY seq DESC LIMIT 1", &vals![&w.node, seq])?
        .map_or(Ok(0), |r| r.count(0))?;
    if w.seq > top.saturating_add(MAX_SEQ_GAP) {
        return Err(refuse(
            "seq_gap",
            format!("numbered {} above the node's highest number {top} (at most {MAX_SEQ_GAP})", w.seq - top),
        ));
    }
    let mut start_of = |q: &str, params: &[super::db::Val]| -> Result<Option<u64>, DbError> {
        sql.row(q, params)?.map(|r| r.count(0)).transpose()
    };
    let before = start_of(
        "SELECT start FROM applied WHERE node = ?1 AND seq < ?2 ORDER BY seq DESC LIMIT 1",
        &vals![&w.node, seq],
    )?;
    let after = start_of(
        "SELECT start FROM applied WHERE node = ?1 AND seq > ?2 ORDER BY seq ASC LIMIT 1",
        &vals![&w.node, seq],
    )?;
    let sibling = start_of(
        "SELECT start FROM applied WHERE node = ?1 AND seq = ?2 AND start <> ?3 LIMIT 1",
        &vals![&w.node, seq, int(w.start)?],
    )?;
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

/// Figures a total row adds: billable, 1xx..5xx, overshoot.
type TotalSums = [u64; 7];
/// Figures a minute row adds: 1xx..5xx, latency, the histogram.
type MinuteSums = [u64; 6 + LATENCY_BUCKETS];

/// `add` into `into`, checked: a sum past `i64::MAX` refuses the batch.
fn add_into<const N: usize>(into: &mut [u64; N], add: impl IntoIterator<Item = u64>) -> Result<(), DbError> {
    for (a, n) in into.iter_mut().zip(add) {
        *a = a.checked_add(n).filter(|&s| s <= i64::MAX as u64).ok_or(DbError::Overflow)?;
    }
    Ok(())
}

/// [`UsageStore::apply`] in one transaction: everything or nothing.
fn apply_in(sql: &mut dyn Sql, windows: &[Window], now: u64, quotas: &Quotas) -> Result<UsageAck, ApplyError> {
    let mut acks = apply_group_in(sql, &[windows], now, quotas)?;
    Ok(acks.pop().unwrap_or_default())
}

/// Batches applied in one transaction as if one after another (everything or nothing),
/// with an answer for each: the windows it added, its duplicates and what its nodes still
/// lack.
///
/// On PostgreSQL transactions run side by side: each takes the periods lock shared and its
/// nodes' locks (in order, all before any row), and writes its rows in key order (quota
/// use, totals, minutes) so two transactions never wait on each other in a circle.
fn apply_group_in(
    sql: &mut dyn Sql,
    batches: &[&[Window]],
    now: u64,
    quotas: &Quotas,
) -> Result<Vec<UsageAck>, ApplyError> {
    sql.lock(Lock::Periods { exclusive: false })?;
    let nodes: BTreeSet<&str> = batches.iter().flat_map(|b| b.iter().map(|w| w.node.as_str())).collect();
    for node in &nodes {
        sql.lock(Lock::Node(node))?;
    }
    let mut acks = vec![UsageAck::default(); batches.len()];
    let mut fresh: Vec<Window> = Vec::new();
    for (ack, batch) in acks.iter_mut().zip(batches) {
        for delivery in batch.iter() {
            let Some(new) = mark_parts(sql, delivery, now)? else {
                ack.duplicates += 1;
                sql.exec(
                    "INSERT INTO duplicates (node, windows) VALUES (?1, 1)
                     ON CONFLICT (node) DO UPDATE SET windows = duplicates.windows + 1",
                    &vals![&delivery.node],
                )?;
                continue;
            };
            // New: checked inside the transaction, so a refusal undoes its inserts. Its
            // parts share the node, number and start.
            could_have_counted(sql, delivery, now)?;
            ack.applied += 1;
            fresh.extend(new);
        }
    }
    // A window of a period already final is held for the platform's decision, never
    // added on its own: the period's export may have gone out.
    let fresh = hold_final(sql, fresh, now)?;
    add_rows(sql, &fresh, now, quotas)?;
    let mut missing: BTreeMap<&str, Vec<Missing>> = BTreeMap::new();
    for node in nodes {
        missing.insert(node, advance(sql, node)?);
    }
    for (ack, batch) in acks.iter_mut().zip(batches) {
        let of_batch: BTreeSet<&str> = batch.iter().map(|w| w.node.as_str()).collect();
        for node in of_batch {
            ack.missing.extend(missing.get(node).into_iter().flatten().cloned());
        }
    }
    Ok(acks)
}

/// Marks the parts of `delivery` applied (node, seq, part) and returns those new now, or
/// `None` for a duplicate (every part applied before, with the same contents). The same
/// part with other contents is a conflict.
fn mark_parts(sql: &mut dyn Sql, delivery: &Window, now: u64) -> Result<Option<Vec<Window>>, ApplyError> {
    // Each part once: a delivery adds what is new in it, and is a duplicate if
    // nothing is. Its parts (one per caller) are marked in a few multi-row inserts.
    let parts = delivery.split();
    let mut raws = Vec::with_capacity(parts.len());
    for w in &parts {
        raws.push(serde_json::to_vec(w).map_err(|e| ApplyError::Unavailable(e.to_string()))?);
    }
    let mut new: BTreeSet<u32> = BTreeSet::new();
    let indexed: Vec<(&Window, &Vec<u8>)> = parts.iter().zip(&raws).collect();
    for chunk in indexed.chunks(UPSERT_ROWS) {
        let mut params = Vec::with_capacity(chunk.len() * 9);
        for (w, raw) in chunk {
            let calls = w.rows.iter().try_fold(0u64, |a, r| a.checked_add(r.calls())).ok_or(DbError::Overflow)?;
            params.extend(vals![
                &w.node,
                int(w.seq)?,
                w.part,
                w.parts,
                int(w.start)?,
                w.recovered,
                int(calls)?,
                int(now)?,
                (*raw).clone()
            ]);
        }
        let inserted = sql.rows(
            &format!(
                "INSERT INTO applied (node, seq, part, parts, start, recovered, calls, received, raw)
                 VALUES {} ON CONFLICT DO NOTHING RETURNING part",
                placeholders(chunk.len(), 9)
            ),
            &params,
        )?;
        for r in inserted {
            new.insert(u32::try_from(r.int(0)?).map_err(|_| DbError::Overflow)?);
        }
    }
    if new.len() < parts.len() {
        // The same (node, seq, part) with other contents is not a re-send: the node
        // lost its spool and numbers again from 1. Nothing of the batch is applied;
        // the operator gives the node a new id.
        let known: BTreeMap<i64, Vec<u8>> = sql
            .rows(
                "SELECT part, raw FROM applied WHERE node = ?1 AND seq = ?2",
                &vals![&delivery.node, int(delivery.seq)?],
            )?
            .iter()
            .map(|r| Ok((r.int(0)?, r.blob(1)?)))
            .collect::<Result<_, DbError>>()?;
        for (w, raw) in &indexed {
            if !new.contains(&w.part) && known.get(&i64::from(w.part)) != Some(*raw) {
                return Err(ApplyError::Conflict { node: w.node.clone(), seq: w.seq });
            }
        }
    }
    if new.is_empty() {
        return Ok(None);
    }
    Ok(Some(parts.into_iter().filter(|w| new.contains(&w.part)).collect()))
}

/// Adds the rows of `fresh` parts (each new) to the quota use, totals and minutes.
pub(crate) fn add_rows(sql: &mut dyn Sql, fresh: &[Window], now: u64, quotas: &Quotas) -> Result<(), ApplyError> {
    // Quota use first, by caller (each caller's rows in their order: its overshoot
    // depends on it), then the sums in key order.
    let mut rows: Vec<(&Window, &Row)> = fresh.iter().flat_map(|w| w.rows.iter().map(move |r| (w, r))).collect();
    rows.sort_by(|a, b| {
        (a.1.kind.as_str(), &a.1.caller, &a.1.product).cmp(&(b.1.kind.as_str(), &b.1.caller, &b.1.product))
    });
    let kept_from = match sql.engine() {
        Engine::Postgres => super::pg::Pool::first_kept(now),
        Engine::Sqlite => 0,
    };
    let mut totals: BTreeMap<(&str, &str, &str, String), TotalSums> = BTreeMap::new();
    let mut minutes: BTreeMap<(&str, &str, &str, &str, u64), MinuteSums> = BTreeMap::new();
    for (w, r) in rows {
        let billable = r.billable();
        let overshoot = match quotas.of(r.kind, &r.caller) {
            Some(q) if billable > 0 => use_quota(sql, r, q, w.start, billable, now)?,
            _ => 0,
        };
        let (period, _, _) = month_period(w.start);
        let t = totals.entry((r.caller.as_str(), r.kind.as_str(), r.product.as_str(), period)).or_default();
        add_into(t, [billable - overshoot].into_iter().chain(r.status).chain([overshoot]))?;
        if w.start >= kept_from {
            let key =
                (r.caller.as_str(), r.kind.as_str(), r.route.as_str(), r.product.as_str(), w.start - w.start % 60);
            let m = minutes.entry(key).or_insert([0; 6 + LATENCY_BUCKETS]);
            add_into(m, r.status.into_iter().chain([r.latency_us]).chain(r.latency.iter().copied()))?;
        }
    }
    upsert_totals(sql, &totals)?;
    upsert_minutes(sql, &minutes)?;
    Ok(())
}

/// `VALUES (?1, …, ?k), (?k+1, …)`: `rows` tuples of `k` placeholders.
fn placeholders(rows: usize, k: usize) -> String {
    (0..rows)
        .map(|r| format!("({})", (1..=k).map(|c| format!("?{}", r * k + c)).collect::<Vec<_>>().join(", ")))
        .collect::<Vec<_>>()
        .join(", ")
}

fn upsert_totals(sql: &mut dyn Sql, totals: &BTreeMap<(&str, &str, &str, String), TotalSums>) -> Result<(), DbError> {
    let sets = ["billable", "s1", "s2", "s3", "s4", "s5", "overshoot"].map(|c| add("totals", c)).join(", ");
    let entries: Vec<_> = totals.iter().collect();
    for chunk in entries.chunks(UPSERT_ROWS) {
        let mut params = Vec::with_capacity(chunk.len() * 11);
        for ((caller, kind, product, period), sums) in chunk {
            params.extend(vals![*caller, *kind, *product, period]);
            for n in sums.iter() {
                params.push(int(*n)?);
            }
        }
        sql.exec(
            &format!(
                "INSERT INTO totals (caller, kind, product, period, billable, s1, s2, s3, s4, s5, overshoot)
                 VALUES {} ON CONFLICT (caller, kind, product, period) DO UPDATE SET {sets}",
                placeholders(chunk.len(), 11)
            ),
            &params,
        )?;
    }
    Ok(())
}

fn upsert_minutes(
    sql: &mut dyn Sql,
    minutes: &BTreeMap<(&str, &str, &str, &str, u64), MinuteSums>,
) -> Result<(), DbError> {
    let cols = hist_cols("");
    let k = 5 + 6 + LATENCY_BUCKETS;
    let sets = ["s1", "s2", "s3", "s4", "s5", "latency_us"]
        .into_iter()
        .map(str::to_owned)
        .chain((0..LATENCY_BUCKETS).map(|i| format!("h{i}")))
        .map(|c| add("minutes", &c))
        .collect::<Vec<_>>()
        .join(", ");
    let entries: Vec<_> = minutes.iter().collect();
    for chunk in entries.chunks(UPSERT_ROWS) {
        let mut params = Vec::with_capacity(chunk.len() * k);
        for ((caller, kind, route, product, minute), sums) in chunk {
            params.extend(vals![*caller, *kind, *route, *product, int(*minute)?]);
            for n in sums.iter() {
                params.push(int(*n)?);
            }
        }
        sql.exec(
            &format!(
                "INSERT INTO minutes (caller, kind, route, product, minute, s1, s2, s3, s4, s5, latency_us, {cols})
                 VALUES {} ON CONFLICT (caller, kind, route, product, minute) DO UPDATE SET {sets}",
                placeholders(chunk.len(), k)
            ),
            &params,
        )?;
    }
    Ok(())
}

/// Ranges asked for again in one answer at most.
const MISSING_RANGES: usize = 64;

/// Moves `node`'s contiguous mark (every number up to it applied) past the numbers now
/// applied, and returns the gaps above it, below the highest number applied.
fn advance(sql: &mut dyn Sql, node: &str) -> Result<Vec<Missing>, DbError> {
    let (mark, missing) = gaps(sql, node)?;
    sql.exec(
        "INSERT INTO contiguous (node, seq) VALUES (?1, ?2) ON CONFLICT (node) DO UPDATE SET seq = excluded.seq",
        &vals![node, int(mark)?],
    )?;
    Ok(missing)
}

/// `node`'s contiguous mark as the applied numbers have it now, and the gaps above it: the
/// numbers never seen and those with parts still to come.
pub(crate) fn gaps(sql: &mut dyn Sql, node: &str) -> Result<(u64, Vec<Missing>), DbError> {
    let mut mark =
        sql.row("SELECT seq FROM contiguous WHERE node = ?1", &vals![node])?.map_or(Ok(0), |r| r.count(0))?;
    let above = sql.rows(
        "SELECT seq, CASE WHEN COUNT(*) >= MAX(parts) THEN 1 ELSE 0 END FROM applied WHERE node = ?1 AND seq > ?2
         GROUP BY seq ORDER BY seq LIMIT 100000",
        &vals![node, int(mark)?],
    )?;
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
    for r in above {
        let (seq, complete) = (r.count(0)?, r.int(1)? != 0);
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
