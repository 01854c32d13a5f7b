//! Quotas in the usage store: who is on which quota, each caller's use of its period,
//! the 80 % and 100 % events, and a hard quota's over-quota flags.

use std::collections::{BTreeMap, HashMap};

use postern_model::credentials::{Credentials, QuotaFlag};
use postern_model::usage::CallerKind;
use postern_model::{Plan, Quota, QuotaMode};
use rusqlite::{OptionalExtension, params};
use serde::Serialize;

use super::params::rfc3339;
use super::store::{UsageStore, sql_int};

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

/// Adds `billable` calls of row `r` (a window starting at `start`) to its caller's use
/// of quota `q`, raising the 80 % and 100 % events and a hard quota's flag as they are
/// passed; returns the calls past a hard quota (overshoot).
pub(crate) fn use_quota(
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
    // A flag stands for the period that holds now, never a window's: a late window of a
    // period already over flags nothing, and none can flag a period to come.
    if before < q.calls && q.calls <= after && q.anchor.period(now) == (ps, pe) {
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

    /// Lifts the live over-quota flags of `caller` (a key id, or an app's `client_id` with
    /// `kind` app), on `product` or on every product; returns the flags lifted. Its use
    /// stays: the flag is not raised again in that period.
    pub fn lift_flags(
        &self,
        caller: &str,
        kind: CallerKind,
        product: Option<&str>,
        now: u64,
    ) -> rusqlite::Result<Vec<QuotaFlag>> {
        let lifted: Vec<QuotaFlag> = self
            .live_flags(now)?
            .into_iter()
            .filter(|f| f.caller == caller && f.kind == kind && product.is_none_or(|p| f.product == p))
            .collect();
        let conn = self.lock();
        for f in &lifted {
            conn.execute(
                "DELETE FROM over_quota WHERE caller = ?1 AND kind = ?2 AND product = ?3 AND until = ?4",
                params![f.caller, f.kind.as_str(), f.product, sql_int(f.until)],
            )?;
        }
        Ok(lifted)
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
