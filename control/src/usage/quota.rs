//! Quotas in the usage store: who is on which quota, each caller's use of its period,
//! the 80 % and 100 % events, and a hard quota's over-quota flags.

use std::collections::{BTreeMap, HashMap};

use postern_model::credentials::{Credentials, QuotaFlag};
use postern_model::usage::CallerKind;
use postern_model::{Plan, Quota, QuotaMode};
use serde::Serialize;

use super::db::{DbError, DbRow, Sql, add, i64_of, int, vals};
use super::params::rfc3339;
use super::store::UsageStore;

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
/// passed; returns the calls past a hard quota (overshoot). The use is added in the
/// database (and read back), so batches applied side by side each see the other's.
pub(crate) fn use_quota(
    sql: &mut dyn Sql,
    r: &postern_model::usage::Row,
    q: Quota,
    start: u64,
    billable: u64,
    now: u64,
) -> Result<u64, DbError> {
    let (ps, pe) = q.anchor.period(start);
    let kind = r.kind.as_str();
    let after = sql
        .row(
            &format!(
                "INSERT INTO quota_use (caller, kind, product, period_start, period_end, used) VALUES (?1, ?2, ?3, ?4, ?5, ?6)
                 ON CONFLICT (caller, kind, product, period_start) DO UPDATE SET {} RETURNING used",
                add("quota_use", "used")
            ),
            &vals![&r.caller, kind, &r.product, int(ps)?, int(pe)?, int(billable)?],
        )?
        .ok_or_else(|| DbError::Other("quota use: no row returned".into()))?
        .count(0)?;
    let before = after.checked_sub(billable).ok_or(DbError::Overflow)?;
    let mode = match q.mode {
        QuotaMode::Hard => "hard",
        QuotaMode::Overage => "overage",
    };
    for percent in [80u64, 100] {
        let mark = u64::try_from((u128::from(q.calls) * u128::from(percent)).div_ceil(100)).unwrap_or(u64::MAX);
        if before < mark && mark <= after {
            sql.exec(
                "INSERT INTO quota_events (at, caller, kind, product, period_start, period_end, percent, used, quota, mode)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10) ON CONFLICT DO NOTHING",
                &vals![
                    int(now)?,
                    &r.caller,
                    kind,
                    &r.product,
                    int(ps)?,
                    int(pe)?,
                    int(percent)?,
                    int(after)?,
                    int(q.calls)?,
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
        sql.exec(
            "INSERT INTO over_quota (caller, kind, product, until, quota, period_s, since)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7) ON CONFLICT DO NOTHING",
            &vals![&r.caller, kind, &r.product, int(pe)?, int(q.calls)?, int(pe - ps)?, int(now)?],
        )?;
    }
    Ok(after.saturating_sub(before.max(q.calls)))
}

fn caller_kind(s: &str) -> CallerKind {
    if s == "app" { CallerKind::App } else { CallerKind::Key }
}

fn flag(r: &DbRow) -> Result<QuotaFlag, DbError> {
    Ok(QuotaFlag {
        caller: r.text(0)?,
        kind: caller_kind(&r.text(1)?),
        product: r.text(2)?,
        until: r.count(3)?,
        quota: r.count(4)?,
        period_s: r.count(5)?,
    })
}

const LIVE_FLAGS: &str = "SELECT caller, kind, product, until, quota, period_s FROM over_quota WHERE until > ?1
     ORDER BY caller, kind, product, until";

impl UsageStore {
    /// The over-quota flags still live at `now`, in a stable order.
    pub fn live_flags(&self, now: u64) -> Result<Vec<QuotaFlag>, DbError> {
        self.read(|sql| sql.rows(LIVE_FLAGS, &vals![i64_of(now)?])?.iter().map(flag).collect())
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
    ) -> Result<Vec<QuotaFlag>, DbError> {
        self.tx(|sql| {
            let lifted: Vec<QuotaFlag> = sql
                .rows(LIVE_FLAGS, &vals![i64_of(now)?])?
                .iter()
                .map(flag)
                .collect::<Result<Vec<_>, _>>()?
                .into_iter()
                .filter(|f| f.caller == caller && f.kind == kind && product.is_none_or(|p| f.product == p))
                .collect();
            for f in &lifted {
                sql.exec(
                    "DELETE FROM over_quota WHERE caller = ?1 AND kind = ?2 AND product = ?3 AND until = ?4",
                    &vals![&f.caller, f.kind.as_str(), &f.product, int(f.until)?],
                )?;
            }
            Ok(lifted)
        })
    }

    /// Quota events, oldest first: those after number `after`, at most `limit`; only the
    /// ones the webhook has not taken and whose next try is due at `due` when given.
    pub fn events(&self, after: u64, limit: usize, due: Option<u64>) -> Result<Vec<QuotaEvent>, DbError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        self.read(|sql| {
            let cols = "SELECT id, at, caller, kind, product, period_start, period_end, percent, used, quota, mode,
                        delivered, attempts FROM quota_events";
            let rows = match due {
                Some(due) => sql.rows(
                    &format!("{cols} WHERE id > ?1 AND delivered = 0 AND next_try <= ?2 ORDER BY id LIMIT ?3"),
                    &vals![i64_of(after)?, i64_of(due)?, limit],
                )?,
                None => {
                    sql.rows(&format!("{cols} WHERE id > ?1 ORDER BY id LIMIT ?2"), &vals![i64_of(after)?, limit])?
                }
            };
            rows.iter()
                .map(|r| {
                    let percent = r.count(7)?;
                    Ok(QuotaEvent {
                        id: r.count(0)?,
                        kind: if percent >= 100 { "quota.exhausted" } else { "quota.warning" }.to_owned(),
                        at: rfc3339(r.count(1)?),
                        caller: r.text(2)?,
                        caller_kind: r.text(3)?,
                        product: r.text(4)?,
                        period_start: rfc3339(r.count(5)?),
                        period_end: rfc3339(r.count(6)?),
                        percent,
                        used: r.count(8)?,
                        quota: r.count(9)?,
                        mode: r.text(10)?,
                        delivered: r.int(11)? != 0,
                        attempts: r.count(12)?,
                    })
                })
                .collect()
        })
    }

    /// Records a webhook delivery of event `id`: taken, or to try again at `next_try`.
    pub fn delivered(&self, id: u64, ok: bool, next_try: u64) -> Result<(), DbError> {
        self.tx(|sql| {
            sql.exec(
                "UPDATE quota_events SET attempts = attempts + 1, delivered = ?2, next_try = ?3 WHERE id = ?1",
                &vals![i64_of(id)?, ok, i64_of(next_try)?],
            )
            .map(drop)
        })
    }

    /// A caller's use of its quota on `product` in the period holding `t`: (used, period start, end).
    pub fn quota_use(
        &self,
        caller: &str,
        kind: CallerKind,
        product: &str,
        t: u64,
    ) -> Result<Option<(u64, u64, u64)>, DbError> {
        self.read(|sql| {
            sql.row(
                "SELECT used, period_start, period_end FROM quota_use
                 WHERE caller = ?1 AND kind = ?2 AND product = ?3 AND period_start <= ?4 AND period_end > ?4",
                &vals![caller, kind.as_str(), product, i64_of(t)?],
            )?
            .map(|r| Ok((r.count(0)?, r.count(1)?, r.count(2)?)))
            .transpose()
        })
    }
}
