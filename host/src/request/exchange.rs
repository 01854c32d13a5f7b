//! What one request learns on its way, and its one ending ([`Exchange::finish`]): every
//! answer rendered, stamped, counted, logged and traced there.

use std::sync::Arc;
use std::time::{Duration, Instant};

use http::header::CONTENT_LENGTH;
use http::{HeaderValue, Response, Uri};
use postern_builtin_filters::ratelimit::{RATELIMIT, RATELIMIT_POLICY};
use postern_filter_contract::{Context, Identity, Payer, Reply};

use crate::gateway::Gateway;
use crate::request::body::ResponseBody;
use crate::request::error::ProxyError;
use crate::request::headers::{self, X_REQUEST_ID};
use crate::request::respond;
use crate::snapshot::CompiledRoute;

/// How a request ended before the backend's answer could be relayed.
#[derive(Debug)]
pub(crate) enum Ending {
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
pub(crate) struct Exchange<'l> {
    pub(crate) start: Instant,
    pub(crate) rid: HeaderValue,
    /// The route, once one matched.
    pub(crate) route: Option<&'l CompiledRoute>,
    /// The filters' shared context, on routes with filters.
    pub(crate) cx: Option<Context>,
    /// Time spent waiting for the backend's response head.
    pub(crate) waited: Duration,
    /// The chosen backend's own counters, on a route split across backends.
    pub(crate) backend: Option<&'l crate::metrics::RouteMetrics>,
    /// The request's random id (its trace id unless the client sent one), which also
    /// decides whether a success is sampled for the access log.
    pub(crate) trace: u128,
    /// Request-phase filters that let the request go on (the next one, if any, answered).
    pub(crate) passed: u8,
    /// The listener's pool.
    pub(crate) pool: postern_model::Pool,
    /// What the access log and traces need of the request, when the node keeps either.
    pub(crate) seen: Option<Seen>,
    /// The client's trace context, if it sent a valid `traceparent`.
    pub(crate) tp: Option<headers::TraceParent>,
    /// When the request's parts ran, on a node that traces.
    pub(crate) marks: Option<Marks<'l>>,
}

/// Request-phase filters timed for a trace; later ones are covered by the server span.
const MAX_FILTER_SPANS: usize = 16;

/// When a request's parts ran, in nanoseconds from its arrival: kept on a node that
/// traces (two clock reads per filter and two for the backend call), because whether
/// a request is traced is known only at its end (every server error is).
pub(crate) struct Marks<'l> {
    /// Each request-phase filter's start and end.
    pub(crate) filters: [(u64, u64); MAX_FILTER_SPANS],
    /// The upstream call's span id: the parent id the backend was sent.
    pub(crate) up_span: u64,
    /// When the request was sent upstream (0: it was not).
    pub(crate) sent: u64,
    /// The cluster and endpoint it went to.
    pub(crate) to: Option<(&'l crate::cluster::Upstream, http::uri::Authority)>,
}

impl Marks<'_> {
    pub(crate) fn new() -> Self {
        Marks { filters: [(0, 0); MAX_FILTER_SPANS], up_span: 0, sent: 0, to: None }
    }
}

/// Nanoseconds since `start`.
pub(crate) fn since(start: Instant) -> u64 {
    nanos(start.elapsed())
}

/// A duration in nanoseconds, for a mark.
pub(crate) fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The request as it arrived, kept for the access log (clones of shared bytes).
pub(crate) struct Seen {
    pub(crate) method: http::Method,
    pub(crate) uri: Uri,
    pub(crate) length: Option<u64>,
    pub(crate) snapshot: u64,
}

impl Exchange<'_> {
    /// The one ending of every request: renders a filter's or the gateway's own answer,
    /// stamps what every response carries (`x-request-id`, the route's response headers,
    /// the rate-limit state), and counts it — status class, latency and gateway-added
    /// latency, per route, and the problem code.
    pub(crate) fn finish(
        mut self,
        gw: &Gateway,
        result: Result<Response<ResponseBody>, Ending>,
    ) -> Response<ResponseBody> {
        let (mut resp, made) = self.answer(gw, result);
        self.stamp(&mut resp);
        let status = resp.status().as_u16();
        let total = self.count(gw, status, made.is_some());
        let Some(seen) = self.seen.take() else { return resp };
        self.observe(gw, resp, &seen, status, made, total)
    }

    /// The response for `result`: the backend's, or a filter's or the gateway's own answer
    /// rendered, with `Some(code)` when the gateway (or a filter) made it (its problem code
    /// counted).
    fn answer(
        &self,
        gw: &Gateway,
        result: Result<Response<ResponseBody>, Ending>,
    ) -> (Response<ResponseBody>, Option<Option<&'static str>>) {
        match result {
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
        }
    }

    /// Stamps what every response carries: no body on a status that forbids one, the
    /// route's response headers, the rate-limit state and `x-request-id`.
    fn stamp(&self, resp: &mut Response<ResponseBody>) {
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
    }

    /// Counts the answer (by route, origin, pool, plan, backend, and the caller's usage on
    /// a metered route) with its time; returns the time from arrival to the response head.
    fn count(&self, gw: &Gateway, status: u16, made: bool) -> Duration {
        let m = self.route.map_or(&gw.metrics.unrouted, |r| &*r.metrics);
        m.count(status);
        m.count_origin(status, made);
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
        total
    }

    /// The response, watched to its body's end for the access log and the trace when
    /// either wants this request; as it is otherwise.
    fn observe(
        &self,
        gw: &Gateway,
        resp: Response<ResponseBody>,
        seen: &Seen,
        status: u16,
        made: Option<Option<&'static str>>,
        total: Duration,
    ) -> Response<ResponseBody> {
        let anonymous = || self.cx.as_ref().and_then(Context::identity).and_then(Identity::caller).is_none();
        let log = gw.access_log.as_ref().filter(|l| l.wants(status, self.trace, status < 400 || anonymous()));
        let tracer = gw.tracer.as_ref().filter(|t| t.wants(status, self.trace, self.debug()));
        if log.is_none() && tracer.is_none() {
            return resp;
        }
        let record = self.record(seen, status, made, total);
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
    pub(crate) fn trace_id(&self) -> u128 {
        self.tp.map_or(self.trace, |t| t.trace_id)
    }

    /// Whether the caller is under a debug-trace flag.
    pub(crate) fn debug(&self) -> bool {
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
