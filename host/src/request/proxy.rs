//! The request path: id → snapshot → route → header hygiene → filters → rewrite →
//! forward (streaming, with the route's timeouts) → response filters → metrics.
//!
//! Nothing here takes a lock, makes a network call other than to the backend, or holds
//! anything across an `.await` but the request's own state.

use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{CONTENT_ENCODING, CONTENT_LENGTH, CONTENT_TYPE, HOST};
use http::uri::PathAndQuery;
use http::{HeaderName, HeaderValue, Method, Request, Response, Uri, Version};
use hyper::body::Incoming;
use postern_builtin_filters::ratelimit::{RATELIMIT, RATELIMIT_POLICY};
use postern_filter_contract::{Context, Flow, Identity, Payer, Reply, RequestHead, ResponseFlow};
use postern_router::Match;
use postern_validate::Coding;

use crate::gateway::Gateway;
use crate::request::body::{LimitedBody, ResponseBody, Stall, UpstreamBody, is_too_large};
use crate::request::conn::ConnInfo;
use crate::request::error::ProxyError;
use crate::request::headers::{self, TRACEPARENT, X_DEADLINE_MS, X_REQUEST_ID};
use crate::request::respond;
use crate::snapshot::{Backend, CompiledRoute, Live, Rewrite};
use http_body_util::BodyExt;

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
const FORWARDED: HeaderName = HeaderName::from_static("forwarded");
const X_REAL_IP: HeaderName = HeaderName::from_static("x-real-ip");

fn rewrite_path(path: &str, query: Option<&str>, rw: &Rewrite) -> Option<PathAndQuery> {
    let mut out = String::with_capacity(path.len() + 16);
    match rw {
        Rewrite::Full(p) => out.push_str(p),
        Rewrite::Prefix { segments, with } => {
            // Skip the route's leading segments; keep the rest with its leading '/'.
            let mut rest = path;
            for _ in 0..*segments {
                let r = rest.strip_prefix('/').unwrap_or(rest);
                rest = r.find('/').map_or("", |i| &r[i..]);
            }
            out.push_str(with);
            if rest.is_empty() {
                if out.is_empty() {
                    out.push('/');
                }
            } else {
                out.push_str(rest);
            }
        }
    }
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    PathAndQuery::from_maybe_shared(out).ok()
}

/// How a request ended before the backend's answer could be relayed.
#[derive(Debug)]
enum Ending {
    /// A filter answered the request itself.
    Reply(Reply),
    /// The gateway could not serve it.
    Error(ProxyError),
}

impl From<ProxyError> for Ending {
    fn from(e: ProxyError) -> Ending {
        Ending::Error(e)
    }
}

/// What one request has learnt on its way, for its one [`Exchange::finish`].
struct Exchange<'l> {
    start: Instant,
    rid: HeaderValue,
    /// The route, once one matched.
    route: Option<&'l CompiledRoute>,
    /// The filters' shared context, on routes with filters.
    cx: Option<Context>,
    /// Time spent waiting for the backend's response head.
    waited: Duration,
    /// The chosen backend's own counters, on a route split across backends.
    backend: Option<&'l crate::metrics::RouteMetrics>,
    /// The request's random id (its trace id unless the client sent one), which also
    /// decides whether a success is sampled for the access log.
    trace: u128,
    /// Request-phase filters that let the request go on (the next one, if any, answered).
    passed: u8,
    /// The listener's pool.
    pool: postern_model::Pool,
    /// What the access log and traces need of the request, when the node keeps either.
    seen: Option<Seen>,
    /// The client's trace context, if it sent a valid `traceparent`.
    tp: Option<headers::TraceParent>,
    /// When the request's parts ran, on a node that traces.
    marks: Option<Marks<'l>>,
}

/// Request-phase filters timed for a trace; later ones are covered by the server span.
const MAX_FILTER_SPANS: usize = 16;

/// When a request's parts ran, in nanoseconds from its arrival: kept on a node that
/// traces (two clock reads per filter and two for the backend call), because whether
/// a request is traced is known only at its end (every server error is).
struct Marks<'l> {
    /// Each request-phase filter's start and end.
    filters: [(u64, u64); MAX_FILTER_SPANS],
    /// The upstream call's span id: the parent id the backend was sent.
    up_span: u64,
    /// When the request was sent upstream (0: it was not).
    sent: u64,
    /// The cluster and endpoint it went to.
    to: Option<(&'l crate::cluster::Upstream, http::uri::Authority)>,
}

impl Marks<'_> {
    fn new() -> Self {
        Marks { filters: [(0, 0); MAX_FILTER_SPANS], up_span: 0, sent: 0, to: None }
    }
}

/// Nanoseconds since `start`.
fn since(start: Instant) -> u64 {
    nanos(start.elapsed())
}

/// A duration in nanoseconds, for a mark.
fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The request as it arrived, kept for the access log (clones of shared bytes).
struct Seen {
    method: http::Method,
    uri: Uri,
    length: Option<u64>,
    snapshot: u64,
}

/// Serves one request: every way it can end goes through [`Exchange::finish`].
pub async fn handle(gw: Arc<Gateway>, conn: Arc<ConnInfo>, req: Request<Incoming>) -> Response<ResponseBody> {
    let start = Instant::now();
    let (trace, rid) = headers::new_request_id();
    let live = gw.live.load_full();
    let tp = headers::TraceParent::parse(req.headers().get(TRACEPARENT));
    let seen = (gw.access_log.is_some() || gw.tracer.is_some()).then(|| Seen {
        method: req.method().clone(),
        uri: req.uri().clone(),
        length: req.headers().get(CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok()),
        snapshot: live.version,
    });
    let mut ex = Exchange {
        start,
        rid,
        route: None,
        cx: None,
        waited: Duration::ZERO,
        backend: None,
        trace,
        passed: 0,
        pool: conn.pool,
        seen,
        tp,
        marks: gw.tracer.as_ref().map(|_| Marks::new()),
    };
    let admitted = gw.admission.admit(conn.pool);
    let result = match admitted {
        Some(_) => forward(&gw, &conn, &live, &mut ex, trace, req).await,
        None => Err(ProxyError::NodeOverloaded.into()),
    };
    let resp = ex.finish(&gw, result);
    drop(admitted);
    resp
}

impl Exchange<'_> {
    /// The one ending of every request: renders a filter's or the gateway's own answer,
    /// stamps what every response carries (`x-request-id`, the route's response headers,
    /// the rate-limit state), and counts it — status class, latency and gateway-added
    /// latency, per route, and the problem code.
    fn finish(mut self, gw: &Gateway, result: Result<Response<ResponseBody>, Ending>) -> Response<ResponseBody> {
        // `Some(code)` when the gateway (or a filter) made the answer.
        let (mut resp, made) = match result {
            Ok(resp) => (resp, None),
            Err(Ending::Reply(reply)) => {
                let code = match &reply {
                    Reply::Problem(p) => {
                        gw.metrics.problem(p.code);
                        Some(p.code)
                    }
                    _ => None,
                };
                (respond::reply(reply, &self.rid), Some(code))
            }
            Err(Ending::Error(e)) => {
                let p = respond::error(&e);
                gw.metrics.problem(p.code);
                (respond::problem(&p, &self.rid), Some(Some(p.code)))
            }
        };
        if matches!(resp.status().as_u16(), 204 | 304) {
            // Statuses that forbid a body go out without one and without a length, on
            // every protocol, whoever made them (a filter's reply, the backend).
            let h = resp.headers_mut();
            h.remove(CONTENT_LENGTH);
            h.remove(http::header::TRANSFER_ENCODING);
            if let ResponseBody::Full(b) = resp.body_mut() {
                *b = None;
            }
        }
        let h = resp.headers_mut();
        if let Some(route) = self.route {
            for (k, v) in &route.response_headers {
                h.insert(k.clone(), v.clone());
            }
        }
        if let Some((policy, state)) = self.cx.as_ref().and_then(|cx| cx.rate_limit.get()) {
            h.insert(RATELIMIT_POLICY, policy.clone());
            h.insert(RATELIMIT, state.clone());
        }
        h.insert(X_REQUEST_ID, self.rid.clone());
        let m = self.route.map_or(&gw.metrics.unrouted, |r| &*r.metrics);
        let status = resp.status().as_u16();
        m.count(status);
        m.count_origin(status, made.is_some());
        gw.metrics.count_pool(self.pool, status);
        let plan = self.cx.as_ref().and_then(Context::identity).and_then(|i| i.plan.as_ref());
        gw.metrics.count_plan(plan, status);
        let now = Instant::now();
        let total = now.saturating_duration_since(self.start);
        if let (Some(usage), Some(route)) = (&gw.usage, self.route)
            && let Some(product) = &route.product
            && let Some(id) = self.cx.as_ref().and_then(Context::identity)
            && let Some((payer, caller)) = id.caller()
        {
            let kind = match payer {
                Payer::Key => postern_model::usage::CallerKind::Key,
                Payer::App => postern_model::usage::CallerKind::App,
            };
            usage.meter.count(&postern_usage::Call {
                kind,
                caller,
                route: &route.id,
                product,
                status,
                at: now,
                latency: total,
            });
        }
        m.latency.observe(total);
        m.added.observe(total.saturating_sub(self.waited));
        if let Some(b) = self.backend {
            b.count(status);
            b.latency.observe(total);
        }
        let Some(seen) = self.seen.take() else { return resp };
        let log = gw.access_log.as_ref().filter(|l| l.wants(status, self.trace));
        let tracer = gw.tracer.as_ref().filter(|t| t.wants(status, self.trace, self.debug()));
        if log.is_none() && tracer.is_none() {
            return resp;
        }
        let record = self.record(&seen, status, made, total);
        let (logged, traced) = match (log, tracer) {
            (Some(l), Some(t)) => (Some((record.clone(), l.clone())), Some((self.trace(*record, made), t.clone()))),
            (Some(l), None) => (Some((record, l.clone())), None),
            (_, t) => (None, t.map(|t| (self.trace(*record, made), t.clone()))),
        };
        let (parts, body) = resp.into_parts();
        Response::from_parts(parts, body.observed(logged, traced, self.start))
    }

    /// The trace the request belongs to: the client's when it sent a valid
    /// `traceparent`, else its own random id.
    fn trace_id(&self) -> u128 {
        self.tp.map_or(self.trace, |t| t.trace_id)
    }

    /// Whether the caller is under a debug-trace flag.
    fn debug(&self) -> bool {
        self.cx.as_ref().is_some_and(|cx| cx.debug_trace.get().is_some())
    }

    /// The request-phase filters that ran (the one that answered included), each with
    /// its outcome.
    fn outcomes(&self, made: Option<Option<&'static str>>) -> impl Iterator<Item = (&Arc<str>, &'static str)> {
        let names = self.route.map_or(&[][..], |r| &r.filter_names[..]);
        let passed = usize::from(self.passed);
        let answered = made.is_some() && self.cx.is_some() && passed < names.len();
        names.iter().take(passed + usize::from(answered)).enumerate().map(move |(i, name)| {
            let outcome = match (i < passed, made) {
                (true, _) => "continue",
                (false, Some(Some("filter_failed"))) => "failed",
                (false, _) => "answered",
            };
            (name, outcome)
        })
    }

    /// The trace of this `request`, with its filters' and upstream call's spans.
    fn trace(
        &self,
        request: postern_observe::Record,
        made: Option<Option<&'static str>>,
    ) -> Box<postern_observe::trace::Trace> {
        use postern_observe::trace::{Span, SpanKind};
        let mut spans = Vec::new();
        if let Some(m) = &self.marks {
            let authenticated = self.route.is_some_and(|r| r.product.is_some());
            for (i, (f, &(start, end))) in request.filters.iter().zip(&m.filters).enumerate() {
                spans.push(Span {
                    kind: if i == 0 && authenticated { SpanKind::Auth } else { SpanKind::Filter },
                    name: f.name.clone(),
                    id: fastrand::u64(1..),
                    start: Duration::from_nanos(start),
                    end: Duration::from_nanos(end),
                    outcome: f.outcome,
                    status: None,
                    address: None,
                    error: (f.outcome == "failed").then_some("filter_failed"),
                });
            }
            if let Some((up, address)) = &m.to
                && m.sent > 0
            {
                let failed = match made {
                    // The backend answered; a filter may have answered after it.
                    None => (request.status >= 500).then_some("upstream server error"),
                    // The gateway's answer for a call that failed (timeout, refused, broken).
                    Some(code) => code.filter(|c| c.starts_with("upstream")),
                };
                let sent = Duration::from_nanos(m.sent);
                spans.push(Span {
                    kind: SpanKind::Upstream,
                    name: up.name.to_string(),
                    id: m.up_span,
                    start: sent,
                    end: sent + self.waited,
                    outcome: "",
                    status: made.is_none().then_some(request.status),
                    address: Some(address.to_string()),
                    error: failed,
                });
            }
        }
        Box::new(postern_observe::trace::Trace {
            trace_id: self.trace_id(),
            parent: self.tp.map_or(0, |t| t.parent),
            span_id: fastrand::u64(1..),
            debug: self.debug(),
            spans,
            request,
        })
    }

    /// The access-log record of this request; the body's end fills in sizes and time.
    fn record(
        &self,
        seen: &Seen,
        status: u16,
        made: Option<Option<&'static str>>,
        head: Duration,
    ) -> Box<postern_observe::Record> {
        let id = self.cx.as_ref().and_then(Context::identity);
        let filters = self
            .outcomes(made)
            .map(|(name, outcome)| postern_observe::log::FilterOutcome { name: name.to_string(), outcome })
            .collect();
        Box::new(postern_observe::Record {
            // The arrival's wall-clock time, derived only for a request that is logged.
            at: std::time::SystemTime::now().checked_sub(head),
            request_id: String::from_utf8_lossy(self.rid.as_bytes()).into_owned(),
            // The client's trace when it sent one: the line and the trace meet on it.
            trace_id: format!("{:032x}", self.trace_id()),
            pool: self.pool.as_str(),
            method: seen.method.as_str().to_owned(),
            path: seen.uri.path().to_owned(),
            route: self.route.map(|r| r.id.to_string()),
            caller: caller(id),
            plan: id.and_then(|i| i.plan.as_ref()).map(|p| String::from_utf8_lossy(p).into_owned()),
            status,
            code: made.flatten(),
            origin: if made.is_some() { "gateway" } else { "upstream" },
            bytes_in: seen.length,
            bytes_out: 0,
            head,
            total: head,
            upstream: self.waited,
            snapshot: seen.snapshot,
            filters,
            body: "complete",
        })
    }
}

/// The caller as logged and traced: how it authenticated, and its key id or `client_id`.
fn caller(id: Option<&Identity>) -> Option<(postern_observe::log::CallerKind, String)> {
    id.and_then(Identity::caller).map(|(payer, c)| {
        let kind = match payer {
            Payer::Key => postern_observe::log::CallerKind::Key,
            Payer::App => postern_observe::log::CallerKind::App,
        };
        (kind, String::from_utf8_lossy(c).into_owned())
    })
}

/// Runs the filters' request phase in order; the first that answers ends the request.
/// On a node that traces, each filter's start and end are marked.
async fn run_request_filters(
    filters: &[Arc<dyn postern_filter_contract::Filter>],
    parts: &mut RequestHead,
    cx: &Context,
    passed: &mut u8,
    marks: &mut Option<Marks<'_>>,
    start: Instant,
) -> Result<(), Ending> {
    for f in filters {
        let began = marks.as_ref().map(|_| since(start));
        let flow = match f.on_request(parts, cx) {
            Flow::Continue => Ok(()),
            Flow::Respond(r) => Err(Ending::Reply(r)),
            Flow::Wait(fut) => fut.await.map_err(Ending::Reply),
        };
        if let (Some(m), Some(began)) = (marks.as_mut(), began)
            && let Some(slot) = m.filters.get_mut(usize::from(*passed))
        {
            *slot = (began, since(start));
        }
        flow?;
        *passed = passed.saturating_add(1);
    }
    Ok(())
}

/// Runs the filters' request-body phase in order; the first that answers ends the request.
async fn run_body_filters(
    route: &CompiledRoute,
    parts: &mut RequestHead,
    body: &[u8],
    cx: &Context,
) -> Result<(), Ending> {
    for f in &route.filters {
        match f.on_request_body(parts, body, cx) {
            Flow::Continue => {}
            Flow::Respond(r) => return Err(Ending::Reply(r)),
            Flow::Wait(fut) => fut.await.map_err(Ending::Reply)?,
        }
    }
    Ok(())
}

/// The request path from routing to the backend's response head.
async fn forward<'l>(
    gw: &Gateway,
    conn: &ConnInfo,
    live: &'l Live,
    ex: &mut Exchange<'l>,
    trace: u128,
    req: Request<Incoming>,
) -> Result<Response<ResponseBody>, Ending> {
    let (mut parts, body) = req.into_parts();
    // One canonical request before routing: one authority, one path.
    crate::request::canon::path(&mut parts, &live.paths)?;
    let routed = crate::request::canon::authority(&parts)?;
    let route: &'l CompiledRoute =
        match live.router(conn.pool).find(&routed.host, &parts.method, parts.uri.path(), &parts.headers) {
            Match::Found(r) => r,
            Match::NotFound => return Err(ProxyError::RouteNotFound.into()),
            Match::MethodNotAllowed(allowed) => {
                let allow = HeaderValue::from_str(&allowed.to_allow_header()).unwrap_or(HeaderValue::from_static(""));
                return Err(ProxyError::MethodNotAllowed(allow).into());
            }
        };
    let host = routed.header;
    ex.route = Some(route);
    let too_large = ProxyError::BodyTooLarge { limit: route.max_body_bytes };

    // Content-Length is the fast path; counting bytes is the real limit.
    if let Some(len) = parts.headers.get(CONTENT_LENGTH) {
        match len.to_str().ok().and_then(|s| s.parse::<u64>().ok()) {
            Some(n) if n > route.max_body_bytes => return Err(too_large.into()),
            Some(_) => {}
            None => return Err(ProxyError::BadRequest("invalid Content-Length").into()),
        }
    }

    // From a trusted hop, its X-Forwarded-For names the client (read before it goes).
    let hop = conn
        .via_hop
        .as_ref()
        .map(|hops| crate::request::forwarded::through_hops(&parts.headers, conn.peer.ip(), &conn.proto, hops));
    headers::strip_hop_by_hop(&mut parts.headers);
    headers::strip_client_identity(&mut parts.headers);
    // The backend is told the host the request was routed on, whatever the client's
    // `Connection` listed.
    parts.headers.insert(HOST, host.clone());
    // The backend: a stable hash of the caller, so one caller sees one version. On public
    // routes the caller is the route's sticky header (read before credentials are dropped:
    // they are never forwarded, and on authenticated routes the auth filter takes them).
    let public_pick = if route.product.is_some() {
        None
    } else {
        let key = route.split_header.as_ref().and_then(|h| parts.headers.get(h)).map(HeaderValue::as_bytes);
        let pick = route.split(key);
        postern_builtin_filters::auth::strip_credentials(&mut parts.headers);
        Some(pick)
    };

    if !route.filters.is_empty() {
        ex.cx = Some(Context::new(route.id.clone(), ex.rid.clone()));
    }
    let cx = ex.cx.as_ref();
    // On authenticated routes the first filter authenticates: the caller, and so its
    // class and its backend, are known before any other filter runs.
    let (first, rest) = route.filters.split_at(usize::from(route.product.is_some()).min(route.filters.len()));
    if let Some(cx) = cx {
        run_request_filters(first, &mut parts, cx, &mut ex.passed, &mut ex.marks, ex.start).await?;
    }

    // On authenticated routes the caller is its API key, or its app for tokens.
    let upstream = match public_pick {
        Some(pick) => pick,
        None => {
            let id = cx.and_then(Context::identity);
            match id {
                // Callers that never join a canary get the route's stable backend.
                Some(id) if route.backends.len() > 1 && live.never_canary.holds(id) => route.backends.first(),
                _ => route.split(id.and_then(Identity::caller).map(|(_, caller)| &caller[..])),
            }
        }
    };
    let backend = upstream.ok_or(ProxyError::NoEndpoint)?;
    let upstream = &*backend.upstream;
    // Shed by priority before the caller is charged a token or a filter runs.
    let class = crate::request::shed::admit(&gw.shed, upstream, || {
        crate::request::shed::class(route, live, cx, &parts.headers)
    })
    .map_err(ProxyError::Shed)?;
    if let Some(cx) = cx {
        run_request_filters(rest, &mut parts, cx, &mut ex.passed, &mut ex.marks, ex.start).await?;
        crate::request::canon::check_edited_path(&parts, &live.paths)?;
    }
    // On routes that validate: the parameters and the body's media type, before the
    // body is read or the backend is asked.
    let admitted = match &route.validator {
        None => None,
        Some(v) => {
            v.check_head(parts.uri.path(), parts.uri.query(), &parts.headers).map_err(ProxyError::Refused)?;
            let ct = parts.headers.get(CONTENT_TYPE).map(|v| v.to_str().unwrap_or("\u{fffd}"));
            Some(v.admit(ct, !http_body::Body::is_end_stream(&body)).map_err(ProxyError::Refused)?)
        }
    };
    // On routes transcoded to gRPC: the binding this method and path take.
    let call = match &route.grpc {
        None => None,
        Some(t) => Some(grpc_binding(t, &parts.method, parts.uri.path())?),
    };
    let (at, endpoint) = upstream.pick(ex.start).ok_or(ProxyError::NoEndpoint)?;
    let endpoint = endpoint.clone();
    let permit = upstream
        .permit(|| class.unwrap_or_else(|| crate::request::shed::class(route, live, cx, &parts.headers)))
        .ok_or(ProxyError::UpstreamOverloaded)?;
    let ticket = upstream.breaker.admit(ex.start).map_err(ProxyError::CircuitOpen)?;
    // Admitted to the backend: its answer (or failure) counts for it.
    ex.backend = backend.metrics.as_deref();

    // A gRPC call's query is read into its message; the call goes to its method's path.
    let grpc_query = call.as_ref().and_then(|_| parts.uri.query().map(str::to_owned));
    let pq = match &route.rewrite {
        _ if let Some(m) = &call => {
            parts.method = http::Method::POST;
            PathAndQuery::from_str(m.binding.grpc_path()).map_err(|_| ProxyError::Internal("a gRPC path"))?
        }
        None => parts.uri.path_and_query().cloned().unwrap_or_else(|| PathAndQuery::from_static("/")),
        Some(rw) => rewrite_path(parts.uri.path(), parts.uri.query(), rw)
            .ok_or(ProxyError::BadRequest("the rewritten path is not valid"))?,
    };
    let mut uri_parts = http::uri::Parts::default();
    uri_parts.scheme = Some(upstream.transport.scheme());
    uri_parts.authority = Some(endpoint);
    uri_parts.path_and_query = Some(pq);
    parts.uri = Uri::from_parts(uri_parts).map_err(|_| ProxyError::Internal("cannot build the upstream URI"))?;
    parts.version = Version::HTTP_11;

    let h = &mut parts.headers;
    h.insert(X_FORWARDED_HOST, host.clone());
    if upstream.transport.http2 {
        // On HTTP/2 the authority travels as `:authority` (the endpoint); a `Host` beside
        // it that differs is refused by some servers. The routed host is in
        // `X-Forwarded-Host`.
        h.remove(HOST);
    } else {
        h.insert(HOST, host);
    }
    set_forwarding(h, conn, hop.as_ref());
    // The backend continues the client's trace (or the request's own), as a child of
    // the node's upstream span; it is told to sample what the node traces from the start.
    let span = fastrand::u64(1..);
    let debug = ex.debug();
    let flags = match (&gw.tracer, ex.tp) {
        (Some(t), _) if t.samples(trace, debug) => 1,
        (Some(_), tp) => tp.map_or(0, |t| t.flags),
        (None, tp) => tp.map_or(1, |t| t.flags),
    };
    h.insert(TRACEPARENT, headers::traceparent(ex.trace_id(), span, flags));
    if let Some(m) = ex.marks.as_mut() {
        m.up_span = span;
        m.to = parts.uri.authority().map(|a| (upstream, a.clone()));
    }
    h.insert(X_REQUEST_ID, ex.rid.clone());
    let left = route.response_timeout.saturating_sub(ex.start.elapsed());
    h.insert(X_DEADLINE_MS, HeaderValue::from(u64::try_from(left.as_millis()).unwrap_or(u64::MAX)));
    if call.is_some() {
        // The call's gRPC headers are the gateway's alone (a client's `grpc-encoding`
        // would have the backend compress an answer the gateway reads).
        postern_transcode::strip_grpc_headers(h);
        h.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        h.insert(http::header::TE, HeaderValue::from_static("trailers"));
        if let Ok(v) = HeaderValue::from_str(&postern_transcode::timeout_header(left)) {
            h.insert(GRPC_TIMEOUT, v);
        }
    }

    let body_idle = route.body_idle.unwrap_or(gw.body_idle);
    let body_until = ex.start + route.body_total;
    // On HTTP/2 the client reports a failed upload only as a cancelled stream: the body
    // keeps its own account of how it failed.
    let fate = upstream.transport.http2.then(Arc::<crate::request::body::Fate>::default);
    let body = LimitedBody::new(body, route.max_body_bytes, Stall::new(body_idle, body_until), fate.clone());
    let body = if route.buffer_body {
        // Small bodies on routes that opt in: read whole (the limit still counts every
        // byte), let filters see it, forward it with its exact length.
        let bytes = match tokio::time::timeout(left, body.collect()).await {
            Err(_) => return Err(ProxyError::BodyTimeout.into()),
            Ok(Err(e)) if is_too_large(&e) => return Err(too_large.into()),
            Ok(Err(crate::request::body::BodyError::Stalled)) => return Err(ProxyError::BodyTimeout.into()),
            Ok(Err(e)) => return Err(ProxyError::BodyBroken(e).into()),
            Ok(Ok(c)) => c.to_bytes(),
        };
        // A compressed body: the route's limit applies to what it decodes to.
        let bytes = match parts.headers.remove(CONTENT_ENCODING) {
            None => bytes,
            Some(ce) => match Coding::from_header(ce.to_str().unwrap_or("?")) {
                Ok(None) => bytes,
                Ok(Some(coding)) => Bytes::from(
                    postern_validate::decode::decode(coding, &bytes, route.max_body_bytes)
                        .map_err(ProxyError::Decode)?,
                ),
                Err(v) => return Err(ProxyError::Encoding(v).into()),
            },
        };
        if let (Some(v), Some(admitted)) = (&route.validator, admitted) {
            v.check_body(admitted, &bytes).map_err(ProxyError::Refused)?;
        }
        if let Some(cx) = cx {
            run_body_filters(route, &mut parts, &bytes, cx).await?;
            // The body phase edits the request as it goes upstream: its path must be
            // canonical too, and the forwarding headers stay the gateway's.
            crate::request::canon::check_edited_path(&parts, &live.paths)?;
            set_forwarding(&mut parts.headers, conn, hop.as_ref());
        }
        // JSON, path variables and query → the method's protobuf input, framed.
        let bytes = match &call {
            None => bytes,
            Some(m) => m
                .request(grpc_query.as_deref(), &bytes, &postern_model::validate::JsonLimits::default())
                .map_err(ProxyError::Refused)?,
        };
        parts.headers.insert(CONTENT_LENGTH, HeaderValue::from(bytes.len()));
        UpstreamBody::Full(Some(bytes))
    } else {
        UpstreamBody::Stream(body)
    };
    // A request with no body is replayable as it is.
    let body = match body {
        UpstreamBody::Stream(b) if http_body::Body::is_end_stream(&b) => UpstreamBody::Full(None),
        body => body,
    };
    // What is needed to send it once more, kept only for a request that may be retried:
    // a method the route allows (a POST only with `Idempotency-Key` on a route whose
    // service honours it), a cluster with another host, a body already in hand and small.
    let replay = match &body {
        UpstreamBody::Full(b)
            if b.as_ref().map_or(0, |b| b.len() as u64) <= postern_model::RETRY_BODY_BYTES
                && upstream.has_other()
                && route.retry.allows(&parts.method, &parts.headers) =>
        {
            // Boxed: the request's future stays small for the requests that keep no copy.
            Some(Box::new(Replay {
                method: parts.method.clone(),
                uri: parts.uri.clone(),
                headers: parts.headers.clone(),
                body: b.clone(),
            }))
        }
        _ => None,
    };
    // What the client accepts, kept for the answer (the request goes on to the backend).
    let compress = route.compress.and_then(|min| {
        Some((min, crate::request::compress::negotiate(&parts.headers)?, parts.method == Method::HEAD))
    });
    let up = Request::from_parts(parts, body);
    let sent = Instant::now();
    if let Some(m) = ex.marks.as_mut() {
        m.sent = nanos(sent.saturating_duration_since(ex.start));
    }
    if upstream.has_other() {
        // The budget's base: what was first sent to a cluster a retry can go to.
        upstream.budget.request(sent);
    }
    let mut result = exchange(route, backend, at, ticket, up, left, fate.as_deref()).await;
    if let Some(r) = replay
        && retriable(&result)
    {
        result = retry(route, backend, at, r, ex.start, result).await;
    }
    ex.waited = Instant::now().saturating_duration_since(sent);
    let resp = result?;

    let (mut rp, rb) = resp.into_parts();
    if rp.status.is_informational() {
        // No upgrade is ever asked for, and interim answers are not relayed.
        return Err(ProxyError::UpstreamProtocol("the backend answered with an unsolicited 1xx").into());
    }
    let body = match &call {
        None => ResponseBody::Upstream { body: rb, stall: Stall::new(body_idle, body_until), permit: Some(permit) },
        Some(m) => {
            let json = grpc_answer(m, &mut rp, rb, route.response_timeout, ex.start).await?;
            // The call is over: its place in the cluster's cap is free.
            drop(permit);
            ResponseBody::full(json)
        }
    };
    headers::strip_hop_by_hop(&mut rp.headers);
    if let Some(cx) = cx {
        for f in &route.filters {
            if let ResponseFlow::Wait(fut) = f.on_response(&mut rp, cx) {
                fut.await.map_err(Ending::Reply)?;
            }
        }
    }
    let body = match compress
        .and_then(|(min, want, head)| crate::request::compress::choose(min, head, Some(want), rp.status, &rp.headers))
    {
        None => body,
        Some(coding) => {
            let body = body.compressed(coding).map_err(|_| ProxyError::Internal("cannot start compressing"))?;
            crate::request::compress::mark(coding, &mut rp.headers);
            body
        }
    };
    Ok(Response::from_parts(rp, body))
}

/// The largest gRPC answer a transcoded route reads (it is turned into JSON whole).
const MAX_GRPC_ANSWER: usize = 4 << 20;
/// The gRPC deadline header.
const GRPC_TIMEOUT: HeaderName = HeaderName::from_static("grpc-timeout");

/// The binding a transcoded route's request takes: 404 if none takes its path, 405
/// with `Allow` if only other methods do.
fn grpc_binding<'t>(
    t: &'t postern_transcode::Transcoder,
    method: &http::Method,
    path: &str,
) -> Result<postern_transcode::Matched<'t>, ProxyError> {
    t.find(method, path).ok_or_else(|| {
        let others = t.other_methods(path);
        if others.is_empty() {
            return ProxyError::RouteNotFound;
        }
        let allow: Vec<&str> = others.iter().map(http::Method::as_str).collect();
        ProxyError::MethodNotAllowed(HeaderValue::from_str(&allow.join(", ")).unwrap_or(HeaderValue::from_static("")))
    })
}

/// A gRPC call's answer read whole and turned into JSON: its head becomes a JSON answer's
/// (gRPC's own headers dropped); a status other than OK is the caller's problem through
/// the one table of `postern_transcode::status`.
async fn grpc_answer(
    m: &postern_transcode::Matched<'_>,
    rp: &mut http::response::Parts,
    rb: Incoming,
    timeout: Duration,
    start: Instant,
) -> Result<Vec<u8>, ProxyError> {
    let left = timeout.saturating_sub(start.elapsed());
    let limited = http_body_util::Limited::new(rb, MAX_GRPC_ANSWER);
    let collected = match tokio::time::timeout(left, limited.collect()).await {
        Err(_) => return Err(ProxyError::ResponseTimeout { timeout }),
        Ok(Err(_)) => return Err(ProxyError::UpstreamProtocol("the gRPC answer broke off or was too large")),
        Ok(Ok(c)) => c,
    };
    let trailers = collected.trailers().cloned();
    let body = collected.to_bytes();
    if rp.status != http::StatusCode::OK {
        return Err(ProxyError::UpstreamProtocol("the gRPC backend answered with an HTTP error"));
    }
    match postern_transcode::outcome(&rp.headers, trailers.as_ref()) {
        None => Err(ProxyError::UpstreamProtocol("the gRPC answer has no grpc-status")),
        Some((0, _)) => {
            let json =
                m.response(&body).map_err(|_| ProxyError::UpstreamProtocol("the gRPC answer does not decode"))?;
            let h = &mut rp.headers;
            h.remove(CONTENT_LENGTH);
            h.remove(http::header::TRAILER);
            postern_transcode::strip_grpc_headers(h);
            let ct = if m.binding.server_streaming() { "application/x-ndjson" } else { "application/json" };
            h.insert(CONTENT_TYPE, HeaderValue::from_static(ct));
            Ok(json)
        }
        Some((code, message)) => Err(ProxyError::Grpc { code, message }),
    }
}

/// A request as it went to the backend, kept to send it once more.
struct Replay {
    method: http::Method,
    uri: Uri,
    headers: http::HeaderMap,
    body: Option<bytes::Bytes>,
}

/// A backend's mark on a 503 that says it did not process the request (safe to retry).
const X_NOT_PROCESSED: HeaderName = HeaderName::from_static("x-postern-not-processed");
/// A backend's mark on a 503 that says it is overloaded (its own limiter refused).
const X_OVERLOADED: HeaderName = HeaderName::from_static("x-postern-overloaded");
/// The mark on a retried request, so the backend (or a proxy behind it) does not retry it
/// again.
const X_RETRY: HeaderName = HeaderName::from_static("x-postern-retry");

/// Sends one request to host `host` of the cluster within `left` and tells the breaker
/// and the host's outlier count how it went: a timeout, a failed exchange or a 5xx is a
/// failure; what the caller caused (a body over the route's limit, an upload it broke
/// off) says nothing of the backend and is not recorded.
async fn exchange(
    route: &CompiledRoute,
    backend: &Backend,
    host: usize,
    ticket: postern_protect::Ticket,
    up: Request<UpstreamBody>,
    left: Duration,
    fate: Option<&crate::request::body::Fate>,
) -> Result<Response<Incoming>, ProxyError> {
    let upstream = &*backend.upstream;
    let pool = upstream.pool(host).ok_or(ProxyError::NoEndpoint)?;
    let waiting = upstream.hosts.start(host);
    let sent = Instant::now();
    let result = tokio::time::timeout(left, backend.client.send(pool, up)).await;
    drop(waiting);
    let done = Instant::now();
    if !matches!(result, Ok(Err(_))) {
        // An answer, or none in time: how long the backend took (for the latency signal).
        upstream.latency.observe(done.saturating_duration_since(sent));
    }
    let record = |failed: bool| {
        upstream.breaker.record(ticket, failed, done);
        upstream.hosts.record(host, failed, done);
    };
    match result {
        Err(_) => {
            record(true);
            Err(ProxyError::ResponseTimeout { timeout: route.response_timeout })
        }
        Ok(Err(e)) => {
            let e = match fate.and_then(crate::request::body::Fate::get) {
                Some(crate::request::body::FateKind::TooLarge) => {
                    ProxyError::BodyTooLarge { limit: route.max_body_bytes }
                }
                Some(crate::request::body::FateKind::Client) => ProxyError::ClientBodyBroken(e),
                Some(crate::request::body::FateKind::Stalled) => ProxyError::BodyTimeout,
                None => ProxyError::from_client(e, route.max_body_bytes),
            };
            if e.origin() != crate::request::error::Origin::Downstream {
                record(true);
            }
            Err(e)
        }
        Ok(Ok(resp)) => {
            record(resp.status().is_server_error());
            if resp.status() == http::StatusCode::SERVICE_UNAVAILABLE && resp.headers().contains_key(X_OVERLOADED) {
                // The backend's own concurrency limiter fired: its routes shed by priority.
                upstream.shed.strain();
            }
            Ok(resp)
        }
    }
}

/// Whether a first attempt's outcome may be retried: a connect failure, a connection
/// closed or reset before any response byte, or a 503 the backend marked as not
/// processed. Never a timeout (the backend may be working on it), a response it could
/// not parse, or a response whose head was relayed.
fn retriable(r: &Result<Response<Incoming>, ProxyError>) -> bool {
    match r {
        Err(ProxyError::ConnectRefused(_) | ProxyError::ConnectTimeout(_)) => true,
        Err(ProxyError::UpstreamBroken(e)) => closed_before_answer(e),
        Ok(resp) => {
            resp.status() == http::StatusCode::SERVICE_UNAVAILABLE && resp.headers().contains_key(X_NOT_PROCESSED)
        }
        _ => false,
    }
}

/// Whether the backend closed or reset the connection before its answer began (hyper's
/// incomplete message, or a reset or aborted socket), as opposed to answering bytes
/// that were not HTTP.
fn closed_before_answer(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if err.downcast_ref::<hyper::Error>().is_some_and(hyper::Error::is_incomplete_message) {
            return true;
        }
        if err.downcast_ref::<std::io::Error>().is_some_and(|io| {
            matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::ConnectionAborted
                    | std::io::ErrorKind::BrokenPipe
            )
        }) {
            return true;
        }
        cur = err.source();
    }
    false
}

/// Sends the request once more, to another host, if the cluster's budget, its breaker
/// and the route's deadline allow; otherwise the first outcome stands.
async fn retry(
    route: &CompiledRoute,
    backend: &Backend,
    tried: usize,
    r: Box<Replay>,
    start: Instant,
    first: Result<Response<Incoming>, ProxyError>,
) -> Result<Response<Incoming>, ProxyError> {
    let upstream = &*backend.upstream;
    let now = Instant::now();
    let left = route.response_timeout.saturating_sub(now.saturating_duration_since(start));
    if left.is_zero() {
        return first;
    }
    let Some((other_host, other)) = upstream.pick_other(tried, now) else { return first };
    let other = other.clone();
    if !upstream.budget.try_retry(now) {
        return first;
    }
    let Ok(ticket) = upstream.breaker.admit(now) else { return first };
    let Replay { method, uri, mut headers, body } = *r;
    let mut uri = http::uri::Parts::from(uri);
    uri.authority = Some(other);
    let Ok(uri) = Uri::from_parts(uri) else { return first };
    headers.insert(X_RETRY, HeaderValue::from_static("1"));
    headers.insert(X_DEADLINE_MS, HeaderValue::from(u64::try_from(left.as_millis()).unwrap_or(u64::MAX)));
    let mut up = Request::new(UpstreamBody::Full(body));
    *up.method_mut() = method;
    *up.uri_mut() = uri;
    *up.version_mut() = Version::HTTP_11;
    *up.headers_mut() = headers;
    drop(first);
    upstream.budget.sent();
    exchange(route, backend, other_host, ticket, up, left, None).await
}

/// The forwarding headers the backend is told: from the connection, or from a trusted
/// hop's chain.
fn set_forwarding(h: &mut http::HeaderMap, conn: &ConnInfo, hop: Option<&crate::request::forwarded::Forwarding>) {
    match hop {
        None => {
            h.insert(X_FORWARDED_FOR, conn.xff.clone());
            h.insert(X_REAL_IP, conn.xff.clone());
            h.insert(X_FORWARDED_PROTO, conn.proto.clone());
            h.insert(FORWARDED, conn.forwarded.clone());
        }
        Some(f) => {
            h.insert(X_FORWARDED_FOR, f.xff.clone());
            h.insert(X_REAL_IP, f.client.clone());
            h.insert(X_FORWARDED_PROTO, f.proto.clone());
            h.insert(FORWARDED, f.forwarded.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_rewrite_keeps_the_rest() {
        let rw = Rewrite::Prefix { segments: 2, with: "/orders".into() };
        assert_eq!(rewrite_path("/v1/orders/7", Some("a=1"), &rw).unwrap().as_str(), "/orders/7?a=1");
        assert_eq!(rewrite_path("/v1/orders", None, &rw).unwrap().as_str(), "/orders");
        let rw = Rewrite::Prefix { segments: 2, with: String::new() };
        assert_eq!(rewrite_path("/v1/echo/x/y", None, &rw).unwrap().as_str(), "/x/y");
        assert_eq!(rewrite_path("/v1/echo", None, &rw).unwrap().as_str(), "/");
        let rw = Rewrite::Full("/health".into());
        assert_eq!(rewrite_path("/anything/here", Some("q"), &rw).unwrap().as_str(), "/health?q");
    }
}
