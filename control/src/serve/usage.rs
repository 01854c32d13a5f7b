//! The usage endpoints: nodes' windows and counters in, and what billing and teams read
//! out (rows, totals, the export), each run on the usage store off the async workers.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;

use postern_model::protocol::{self, UsageAck};
use postern_model::usage::{CallerKind, Window};

use super::role::Role;
use super::state::{Body, Server, error, json, read_json};
use crate::usage::{ApplyError, By, Decision, Query, UsageStore};

/// A response timeout this many times a route's observed p99.9 or more is advised on.
pub const ADVICE_RATIO: u64 = 10;
/// Answers a route needs in the range before its p99.9 is worth advice.
pub const ADVICE_MIN_CALLS: u64 = 100;

/// A usage batch's body at most: nodes send 4 MiB batches, or one window when a window is
/// larger (a busy node's 10 s of distinct callers × routes).
const USAGE_BODY_LIMIT: usize = 64 << 20;

/// A usage query's parameters, decoded.
fn usage_params(query: &str) -> Result<Vec<(String, String)>, String> {
    query
        .split('&')
        .filter(|kv| !kv.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            let v = crate::usage::query_unescape(v).ok_or_else(|| format!("{k}: not percent-encoded UTF-8"))?;
            Ok((k.to_owned(), v))
        })
        .collect()
}

impl Server {
    /// `POST /v1/usage`: a node's closed windows, applied exactly once. Every window must
    /// be well formed and the token's own node's; otherwise nothing is applied.
    pub(super) async fn usage_intake(&self, role: &Role, req: Request<Incoming>) -> Response<Body> {
        let Some(store) = self.usage.clone() else {
            return error(StatusCode::SERVICE_UNAVAILABLE, "this control plane keeps no usage store (--usage-db)");
        };
        let signature = req.headers().get(postern_model::usage::SIGNATURE_HEADER).map(|v| v.as_bytes().to_vec());
        let body = match Limited::new(req.into_body(), USAGE_BODY_LIMIT).collect().await {
            Ok(b) => b.to_bytes(),
            Err(e) => return error(StatusCode::BAD_REQUEST, format!("body: {e} (at most {USAGE_BODY_LIMIT} bytes)")),
        };
        let batch: protocol::UsageBatch = match serde_json::from_slice(&body) {
            Ok(b) => b,
            Err(e) => return error(StatusCode::BAD_REQUEST, format!("body: {e}")),
        };
        // Signed usage: a batch is one node's, signed over its bytes by that node's key.
        if let (true, Some(first)) = (self.usage_keys.enforced(), batch.windows.first()) {
            let node = first.node.clone();
            let why = if batch.windows.iter().any(|w| w.node != node) {
                Err("a signed batch holds one node's windows".to_owned())
            } else {
                self.usage_keys.check(&node, &body, signature.as_deref())
            };
            if let Err(why) = why {
                let e =
                    postern_model::usage::WindowError::Invalid { node, seq: first.seq, rule: super::signed::RULE, why };
                let (store, now) = (store.clone(), postern_model::disk::unix_now());
                say!("usage refused: {e}");
                return match store.run(move |s| s.refused(&e, now).map(|()| e)).await {
                    Ok(Ok(e)) => error(StatusCode::FORBIDDEN, e.to_string()),
                    Ok(Err(e)) => error(StatusCode::SERVICE_UNAVAILABLE, format!("usage store: {e}")),
                    Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
                };
            }
        }
        for w in &batch.windows {
            if !role.speaks_for(&w.node) {
                return error(StatusCode::FORBIDDEN, format!("this token speaks for another node, not {}", w.node));
            }
            if let Err(e) = w.check() {
                // Out of shape: refused, and counted for the node it names.
                let (store, now) = (store.clone(), postern_model::disk::unix_now());
                let recorded = store.run(move |s| s.refused(&e, now).map(|()| e)).await;
                return match recorded {
                    Ok(Ok(e)) => error(StatusCode::BAD_REQUEST, e.to_string()),
                    Ok(Err(e)) => error(StatusCode::SERVICE_UNAVAILABLE, format!("usage store: {e}")),
                    Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
                };
            }
        }
        match self.apply_intake(store, batch.windows).await {
            Ok(ack) => json(StatusCode::OK, &serde_json::to_value(ack).unwrap_or_default()),
            Err(e @ ApplyError::Conflict { .. }) => {
                say!("{e}");
                error(StatusCode::CONFLICT, e.to_string())
            }
            Err(e @ ApplyError::Refused(_)) => {
                say!("{e}");
                error(StatusCode::UNPROCESSABLE_ENTITY, e.to_string())
            }
            Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        }
    }

    /// `PUT /v1/nodes/<node>/usage/counters`: the node's own counts of a period complete
    /// on it, for the reconciler; 204 once stored.
    pub(super) async fn usage_counters(&self, node: String, req: Request<Incoming>) -> Response<Body> {
        let Some(store) = self.usage.clone() else {
            return error(StatusCode::SERVICE_UNAVAILABLE, "this control plane keeps no usage store (--usage-db)");
        };
        let counters: postern_model::usage::NodeCounters = match read_json(req, USAGE_BODY_LIMIT).await {
            Ok(c) => c,
            Err(r) => return r,
        };
        if counters.node != node {
            return error(StatusCode::BAD_REQUEST, format!("counters of node {} sent for node {node}", counters.node));
        }
        if let Err(e) = counters.check() {
            return error(StatusCode::BAD_REQUEST, e.to_string());
        }
        let now = postern_model::disk::unix_now();
        let (node, period) = (counters.node.clone(), counters.period.clone());
        match store.run(move |s| s.put_counters(&counters, now)).await {
            Ok(Ok(crate::usage::Counted::Stored)) => {
                let mut r = Response::new(Full::new(Bytes::new()));
                *r.status_mut() = StatusCode::NO_CONTENT;
                r
            }
            Ok(Ok(crate::usage::Counted::Held)) => {
                say!("usage: node {node}'s changed counters of final period {period} held for the platform");
                json(
                    StatusCode::ACCEPTED,
                    &serde_json::json!({ "held": true, "why": format!(
                        "{period} is final: a changed report waits for the platform's decision (posternctl usage held)"
                    ) }),
                )
            }
            Ok(Err(e)) => error(StatusCode::SERVICE_UNAVAILABLE, format!("usage store: {e}")),
            Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        }
    }

    /// Applies checked windows (from the intake or the Kafka stream) in one transaction,
    /// with the quotas as published now, and wakes the flag publisher.
    pub(super) async fn apply_usage(
        &self,
        store: Arc<UsageStore>,
        windows: Vec<Window>,
    ) -> Result<UsageAck, ApplyError> {
        let quotas = self.quotas().await.map_err(|e| ApplyError::Unavailable(format!("quotas: {e}")))?;
        let now = postern_model::disk::unix_now();
        let ack = store
            .run(move |s| s.apply(&windows, now, &quotas))
            .await
            .map_err(|e| ApplyError::Unavailable(e.to_string()))??;
        self.quota.wake.notify_one();
        Ok(ack)
    }

    /// Applies one request's checked windows through the intake's group commit (with the
    /// batches of other requests that arrive meanwhile), and wakes the flag publisher.
    async fn apply_intake(&self, store: Arc<UsageStore>, windows: Vec<Window>) -> Result<UsageAck, ApplyError> {
        let Some(intake) = &self.intake else { return self.apply_usage(store, windows).await };
        let quotas = self.quotas().await.map_err(|e| ApplyError::Unavailable(format!("quotas: {e}")))?;
        let ack = intake.apply(windows, postern_model::disk::unix_now(), quotas).await?;
        self.quota.wake.notify_one();
        Ok(ack)
    }

    /// `GET /v1/usage/advice?last=7d`: each route of the published snapshot (a team's own,
    /// for a team's token) with its response timeout beside the p99.9 of its metered
    /// answers over `last`, and advice where the timeout is [`ADVICE_RATIO`] times that or
    /// more (never an error: a timeout is the team's to choose).
    pub(super) async fn timeout_advice(&self, team: Option<&str>, last: Option<&str>) -> Response<Body> {
        let Some(store) = self.usage.clone() else {
            return error(StatusCode::SERVICE_UNAVAILABLE, "this control plane keeps no usage store (--usage-db)");
        };
        let last = match last.map(crate::usage::parse_last).unwrap_or(Ok(7 * 86_400)) {
            Ok(s) => s,
            Err(e) => return error(StatusCode::BAD_REQUEST, format!("last: {e}")),
        };
        let now = postern_model::disk::unix_now();
        let from = now.saturating_sub(last);
        let head = match self.store.head(crate::store::Lane::Snapshot).await {
            Ok(Some(v)) => v,
            Ok(None) => return error(StatusCode::NOT_FOUND, "nothing is published yet"),
            Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        };
        let owned = team.map(str::to_owned);
        let latency = match store.run(move |s| s.route_latency(from, now + 60, owned.as_deref())).await {
            Ok(Ok(l)) => l,
            Ok(Err(e)) => return error(StatusCode::SERVICE_UNAVAILABLE, format!("usage store: {e}")),
            Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        };
        let team = team.map(|t| format!("{t}/"));
        let routes = tokio::task::spawn_blocking(move || {
            let snapshot = postern_model::SnapshotFile::open(&head.bytes).map(|(_, s)| s).map_err(|e| e.to_string())?;
            Ok::<_, String>(
                snapshot
                    .routes
                    .iter()
                    .filter(|r| team.as_ref().is_none_or(|t| r.id.starts_with(t.as_str())))
                    .map(|r| advice_of(&r.id, r.timeouts.response_ms, latency.iter().find(|l| l.route == r.id)))
                    .collect::<Vec<_>>(),
            )
        })
        .await;
        match routes {
            Ok(Ok(routes)) => json(
                StatusCode::OK,
                &serde_json::json!({
                    "from": crate::usage::rfc3339(from),
                    "to": crate::usage::rfc3339(now),
                    "ratio": ADVICE_RATIO,
                    "routes": routes,
                }),
            ),
            Ok(Err(e)) => error(StatusCode::SERVICE_UNAVAILABLE, format!("the published snapshot: {e}")),
            Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        }
    }

    /// `POST /v1/usage/flags/lift?key=K|app=A[&product=P]`: the platform lifts a caller's
    /// over-quota flags (audited as its token's name); the answer comes once every live
    /// node runs credentials without them, or after `wait` naming the stale ones.
    pub(super) async fn lift_flags(
        &self,
        who: &str,
        caller: (String, CallerKind),
        product: Option<String>,
        wait: Duration,
    ) -> Response<Body> {
        let Some(store) = self.usage.clone() else {
            return error(StatusCode::SERVICE_UNAVAILABLE, "this control plane keeps no usage store (--usage-db)");
        };
        let now = postern_model::disk::unix_now();
        let (name, kind) = caller.clone();
        let lifted = match store.run(move |s| s.lift_flags(&name, kind, product.as_deref(), now)).await {
            Ok(Ok(l)) => l,
            Ok(Err(e)) => return error(StatusCode::SERVICE_UNAVAILABLE, format!("usage store: {e}")),
            Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        };
        if lifted.is_empty() {
            return error(StatusCode::NOT_FOUND, format!("{} {} has no live over-quota flag", kind.as_str(), caller.0));
        }
        let version = match self.publish_flags_as(who, "quota-lift").await {
            Ok(v) => v,
            Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        };
        let (acked, stale) = self.wait_acks(version, wait).await;
        json(
            StatusCode::OK,
            &serde_json::json!({
                "lifted": lifted,
                "credentials": {"version": version, "acked": acked, "stale": stale},
            }),
        )
    }

    /// `POST /v1/usage/nodes/retire?node=N[&after=SEQ]`: the platform retires a node (as
    /// its token's name) as of its window `after` (by default the last it applied): its
    /// later windows are refused, and no period waits for it again.
    pub(super) async fn retire_node(&self, who: &str, node: String, after: Option<u64>) -> Response<Body> {
        let Some(store) = self.usage.clone() else {
            return error(StatusCode::SERVICE_UNAVAILABLE, "this control plane keeps no usage store (--usage-db)");
        };
        let (now, by) = (postern_model::disk::unix_now(), who.to_owned());
        match store.run(move |s| s.retire(&node, after, &by, now)).await {
            Ok(Ok(Ok(r))) => {
                say!("usage: node {} retired as of window {} by {}", r.node, r.after, r.by);
                json(StatusCode::OK, &serde_json::json!({ "retired": r }))
            }
            Ok(Ok(Err(why))) => error(StatusCode::CONFLICT, why),
            Ok(Err(e)) => error(StatusCode::SERVICE_UNAVAILABLE, format!("usage store: {e}")),
            Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        }
    }

    /// `POST /v1/usage/held/apply|discard?period=P`: the platform decides what becomes of
    /// the windows held because `period` was final when they came (as its token's name).
    pub(super) async fn decide_held(&self, who: &str, period: String, decision: Decision) -> Response<Body> {
        let Some(store) = self.usage.clone() else {
            return error(StatusCode::SERVICE_UNAVAILABLE, "this control plane keeps no usage store (--usage-db)");
        };
        let quotas = match self.quotas().await {
            Ok(q) => q,
            Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, format!("quotas: {e}")),
        };
        let (now, by, p) = (postern_model::disk::unix_now(), who.to_owned(), period.clone());
        match store.run(move |s| s.decide_held(&p, decision, &by, now, &quotas)).await {
            Ok(Ok(d)) => {
                say!(
                    "usage: {} held window parts and {} counters reports of {period}: {decision:?} by {who}",
                    d.parts,
                    d.reports
                );
                self.quota.wake.notify_one();
                json(StatusCode::OK, &serde_json::json!({ "period": period, "decided": d.parts, "reports": d.reports }))
            }
            Ok(Err(e)) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
            Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        }
    }

    /// Runs `f` on the usage store off the async workers.
    pub(super) async fn usage_read(
        &self,
        f: impl FnOnce(&UsageStore) -> Result<serde_json::Value, crate::usage::DbError> + Send + 'static,
    ) -> Response<Body> {
        let Some(store) = self.usage.clone() else {
            return error(StatusCode::SERVICE_UNAVAILABLE, "this control plane keeps no usage store (--usage-db)");
        };
        match store.run(f).await {
            Ok(Ok(v)) => json(StatusCode::OK, &v),
            Ok(Err(e)) => error(StatusCode::SERVICE_UNAVAILABLE, format!("usage store: {e}")),
            Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        }
    }

    /// `GET /v1/usage?key=&product=&from=&to=&by=route|minute|day`; a team reads only
    /// its own routes' rows.
    pub(super) async fn usage_query(&self, team: Option<&str>, query: &str) -> Response<Body> {
        let params = match usage_params(query) {
            Ok(p) => p,
            Err(e) => return error(StatusCode::BAD_REQUEST, e),
        };
        let get = |name: &str| params.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
        let Some(by) = By::parse(get("by").as_deref().unwrap_or("route")) else {
            return error(StatusCode::BAD_REQUEST, "by is route, minute or day");
        };
        let now = postern_model::disk::unix_now();
        let time = |name: &str, default: u64| match get(name) {
            None => Ok(default),
            Some(v) => crate::usage::parse_time(&v)
                .ok_or_else(|| format!("{name}: {v:?} is not Unix seconds, YYYY-MM-DD or RFC 3339")),
        };
        let (from, to) = match (time("from", postern_model::usage::month_period(now).1), time("to", now + 60)) {
            (Ok(f), Ok(t)) if f < t => (f, t),
            (Ok(_), Ok(_)) => return error(StatusCode::BAD_REQUEST, "from must be before to"),
            (Err(e), _) | (_, Err(e)) => return error(StatusCode::BAD_REQUEST, e),
        };
        // A team reads every caller's rows of its routes: its range is bounded (the
        // default, this month so far, is cut at the bound).
        let max = crate::usage::MAX_TEAM_RANGE_S;
        let to = if team.is_some() && get("to").is_none() { to.min(from.saturating_add(max)) } else { to };
        if team.is_some() && to - from > max {
            return error(
                StatusCode::BAD_REQUEST,
                format!("team_range: a team's query spans at most {} days; narrow from and to", max / 86_400),
            );
        }
        let q = Query { caller: get("key"), product: get("product"), team: team.map(str::to_owned), from, to, by };
        let by_name = get("by").unwrap_or_else(|| "route".into());
        self.usage_read(move |u| {
            let rows = u.query(&q)?;
            Ok(serde_json::json!({
                "from": crate::usage::rfc3339(from),
                "to": crate::usage::rfc3339(to),
                "by": by_name,
                "truncated": rows.len() == crate::usage::MAX_ROWS,
                "rows": rows,
            }))
        })
        .await
    }

    /// `GET /v1/usage/export?period=YYYY-MM`: a final period's billing export, one JSON
    /// line per caller and product; 409 while the period is not final.
    pub(super) async fn usage_export(&self, period: String) -> Response<Body> {
        let Some(store) = self.usage.clone() else {
            return error(StatusCode::SERVICE_UNAVAILABLE, "this control plane keeps no usage store (--usage-db)");
        };
        match store.run(move |s| s.export(&period)).await {
            Ok(Ok(Ok(totals))) => {
                let mut body = String::new();
                for t in totals {
                    body.push_str(&serde_json::to_string(&t).unwrap_or_default());
                    body.push('\n');
                }
                let mut r = Response::new(Full::new(Bytes::from(body)));
                r.headers_mut()
                    .insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/x-ndjson"));
                r
            }
            Ok(Ok(Err(why))) => error(StatusCode::CONFLICT, why),
            Ok(Err(e)) => error(StatusCode::SERVICE_UNAVAILABLE, format!("usage store: {e}")),
            Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        }
    }

    /// `GET /v1/usage/totals?period=YYYY-MM&key=`: billing totals (platform only).
    pub(super) async fn usage_totals(&self, query: &str) -> Response<Body> {
        let params = match usage_params(query) {
            Ok(p) => p,
            Err(e) => return error(StatusCode::BAD_REQUEST, e),
        };
        let get = |name: &str| params.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
        let period =
            get("period").unwrap_or_else(|| postern_model::usage::month_period(postern_model::disk::unix_now()).0);
        if postern_model::usage::parse_month(&period).is_none() {
            return error(StatusCode::BAD_REQUEST, "period is YYYY-MM");
        }
        let caller = get("key");
        self.usage_read(move |u| {
            let totals = u.totals(&period, caller.as_deref())?;
            Ok(serde_json::json!({ "period": period, "totals": totals }))
        })
        .await
    }
}

/// One route's line of the timeout advice.
fn advice_of(route: &str, timeout_ms: u64, seen: Option<&crate::usage::RouteLatency>) -> serde_json::Value {
    let (calls, p999) = seen.map_or((0, None), |l| (l.calls, l.p999_ms));
    let advice = match p999 {
        Some(p) if calls >= ADVICE_MIN_CALLS && timeout_ms >= p.saturating_mul(ADVICE_RATIO) => Some(format!(
            "the response timeout ({timeout_ms} ms) is {}x the p99.9 of {calls} answers (under {p} ms): a stuck \
             backend holds each caller that long; about {} ms would still pass them all",
            timeout_ms / p.max(1),
            p.saturating_mul(4)
        )),
        _ => None,
    };
    serde_json::json!({
        "route": route,
        "timeout_ms": timeout_ms,
        "calls": calls,
        "p999_ms": p999,
        "advice": advice,
    })
}
