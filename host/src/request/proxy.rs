//! The request path, phase by phase: `handle` admits a request and ends it; `forward`
//! runs its phases in order, each a function below in the same order.
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
use postern_filter_contract::{Context, Identity, ResponseFlow};
use postern_router::Match;
use postern_validate::Coding;

use crate::cluster::Upstream;
use crate::gateway::Gateway;
use crate::request::body::{Held, LimitedBody, ResponseBody, Stall, UpstreamBody, is_too_large};
use crate::request::chain::{run_body_filters, run_request_filters};
use crate::request::conn::ConnInfo;
use crate::request::error::ProxyError;
use crate::request::exchange::{Ending, Exchange, Marks, Seen, nanos};
use crate::request::forwarded::Forwarding;
use crate::request::grpc::{GRPC_TIMEOUT, grpc_answer, grpc_binding};
use crate::request::headers::{self, TRACEPARENT, X_DEADLINE_MS, X_REQUEST_ID};
use crate::request::retry::{Replay, exchange, retriable, retry};
use crate::snapshot::{Backend, CompiledRoute, Live, Rewrite};
use http::uri::Authority;
use http_body_util::BodyExt;
use postern_transcode::Matched;

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

/// What every phase of one request reads: the node, the connection, the snapshot and
/// the route it was routed on.
struct Scene<'l> {
    gw: &'l Gateway,
    conn: &'l ConnInfo,
    live: &'l Live,
    route: &'l CompiledRoute,
    /// The host the request was routed on, as the backend is told it.
    host: HeaderValue,
    /// From a trusted hop: the client its chain names.
    hop: Option<Forwarding>,
}

/// What the route's checks of the request head decided.
struct Checked<'l> {
    /// The media type the body was admitted under, on routes that validate.
    admitted: Option<postern_validate::Admitted>,
    /// The gRPC method and its binding, on routes transcoded to gRPC.
    call: Option<Matched<'l>>,
}

/// The request path from routing to the backend's response head, phase by phase: route
/// → hygiene → authenticate → choose the backend → shed → limits and the route's
/// filters → check the head → reserve the backend → the upstream request → body work
/// → send → answer. Its ending (the access log, the trace, the metrics) is
/// [`Exchange::finish`]'s.
async fn forward<'l>(
    gw: &'l Gateway,
    conn: &'l Arc<ConnInfo>,
    live: &'l Live,
    ex: &mut Exchange<'l>,
    trace: u128,
    req: Request<Incoming>,
) -> Result<Response<ResponseBody>, Ending> {
    let (mut parts, body) = req.into_parts();
    let (route, host) = find_route(live, conn, &mut parts)?;
    ex.route = Some(route);
    let (hop, sticky) = hygiene(route, conn, &host, &mut parts)?;
    let scene = Scene { gw, conn, live, route, host, hop };

    if route.has_filters() {
        ex.cx = Some(Context::new(route.id.clone(), ex.rid.clone()));
    }
    let cx = ex.cx.as_ref();
    // Authentication first: the caller, and so its class and its backend, are known
    // before it is charged a token or any other filter runs.
    if let (Some(auth), Some(cx)) = (&route.auth, cx) {
        run_request_filters(std::slice::from_ref(auth), &mut parts, cx, &mut ex.passed, &mut ex.marks, ex.start)
            .await?;
    }
    let backend = choose_backend(route, live, cx, sticky)?;
    let upstream = &*backend.upstream;
    // The priority class, worked out once and only when a decision needs it: while
    // something sheds, or once the cluster is near its cap.
    let mut class = None;
    let class_of = |headers: &http::HeaderMap| crate::request::shed::class(route, live, cx, headers);
    crate::request::shed::admit(&gw.shed, upstream, || *class.get_or_insert_with(|| class_of(&parts.headers)))
        .map_err(ProxyError::Shed)?;
    if let Some(cx) = cx {
        for filters in [route.limit.as_slice(), &route.filters] {
            run_request_filters(filters, &mut parts, cx, &mut ex.passed, &mut ex.marks, ex.start).await?;
        }
        crate::request::canon::check_edited_path(&parts, &live.paths)?;
    }
    let checked = check_head(route, &parts, http_body::Body::is_end_stream(&body))?;

    // Reserve the backend: a host, a place in the cluster's cap and in the client's share
    // of it (once it is busy), the breaker's leave.
    let (at, endpoint) = upstream.pick(ex.start).ok_or(ProxyError::NoEndpoint)?;
    let endpoint = endpoint.clone();
    let cluster =
        upstream.permit(|| class.unwrap_or_else(|| class_of(&parts.headers))).ok_or(ProxyError::UpstreamOverloaded)?;
    let busy = upstream.in_flight() > upstream.max_inflight / 2;
    let held = Held { cluster, client: conn.hold(upstream.max_inflight, busy).ok_or(ProxyError::ClientShare)? };
    let ticket = upstream.breaker.admit(ex.start).map_err(ProxyError::CircuitOpen)?;
    // Admitted to the backend: its answer (or failure) counts for it.
    ex.backend = backend.metrics.as_deref();

    let grpc_query = upstream_uri(route, upstream, endpoint, checked.call.as_ref(), &mut parts)?;
    let (left, span) =
        upstream_headers(&scene, ex, trace, upstream.transport.http2, checked.call.is_some(), &mut parts);
    if let Some(m) = ex.marks.as_mut() {
        m.up_span = span;
        m.to = parts.uri.authority().map(|a| (upstream, a.clone()));
    }
    let (idle, until) = (route.body_idle.unwrap_or(gw.body_idle), ex.start + route.body_total);
    // On HTTP/2 the client reports a failed upload only as a cancelled stream: the body
    // keeps its own account of how it failed.
    let fate = upstream.transport.http2.then(Arc::<crate::request::body::Fate>::default);
    let body = LimitedBody::new(body, route.max_body_bytes, Stall::new(idle, until), fate.clone());
    let body = if route.buffer_body {
        UpstreamBody::Full(Some(read_whole(&scene, cx, &checked, grpc_query, left, &mut parts, body).await?))
    } else if http_body::Body::is_end_stream(&body) {
        // A request with no body is replayable as it is.
        UpstreamBody::Full(None)
    } else {
        UpstreamBody::Stream(body)
    };
    // What the client accepts, kept for the answer (the request goes on to the backend).
    let compress = route.compress.and_then(|min| {
        Some((min, crate::request::compress::negotiate(&parts.headers)?, parts.method == Method::HEAD))
    });
    let up = Request::from_parts(parts, body);
    let (resp, waited) = send(route, backend, at, ticket, up, left, fate.as_deref(), &mut ex.marks, ex.start).await;
    ex.waited = waited;
    let resp = resp?;
    let compress = compress.map(|(min, want, head)| (min, want, head, &scene.gw.compressing));
    answer(route, cx, checked.call.as_ref(), resp, Stall::new(idle, until), held, compress, ex.start).await
}

/// Route: one canonical request (one authority, one path), then its route in the
/// pool's table, and the host the backend is told.
fn find_route<'l>(
    live: &'l Live,
    conn: &ConnInfo,
    parts: &mut http::request::Parts,
) -> Result<(&'l CompiledRoute, HeaderValue), ProxyError> {
    crate::request::canon::path(parts, &live.paths)?;
    let routed = crate::request::canon::authority(parts)?;
    match live.router(conn.pool).find(&routed.host, &parts.method, parts.uri.path(), &parts.headers) {
        Match::Found(r) => Ok((r, routed.header)),
        Match::NotFound => Err(ProxyError::RouteNotFound),
        Match::MethodNotAllowed(allowed) => {
            let allow = HeaderValue::from_str(&allowed.to_allow_header()).unwrap_or(HeaderValue::from_static(""));
            Err(ProxyError::MethodNotAllowed(allow))
        }
    }
}

/// Hygiene: the declared length against the route's limit, the trusted hop's chain read
/// and every hop-by-hop and client-supplied identity header dropped. On a public route
/// its sticky header picks the backend here, before the credentials go (they are never
/// forwarded; on an authenticated route authentication takes them).
fn hygiene(
    route: &CompiledRoute,
    conn: &ConnInfo,
    host: &HeaderValue,
    parts: &mut http::request::Parts,
) -> Result<(Option<Forwarding>, Option<usize>), ProxyError> {
    // Content-Length is the fast path; counting bytes is the real limit.
    if let Some(len) = parts.headers.get(CONTENT_LENGTH) {
        match len.to_str().ok().and_then(|s| s.parse::<u64>().ok()) {
            Some(n) if n > route.max_body_bytes => {
                return Err(ProxyError::BodyTooLarge { limit: route.max_body_bytes });
            }
            Some(_) => {}
            None => return Err(ProxyError::BadRequest("invalid Content-Length")),
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
    let sticky = match route.product {
        Some(_) => None,
        None => {
            let key = route.split_header.as_ref().and_then(|h| parts.headers.get(h)).map(HeaderValue::as_bytes);
            let pick = route.pick(key);
            postern_builtin_filters::auth::strip_credentials(&mut parts.headers);
            Some(pick)
        }
    };
    Ok((hop, sticky))
}

/// Choose the backend, once: a stable hash of the caller, so one caller sees one
/// version — the public route's sticky pick, or the authenticated caller (its API key,
/// or its app for tokens); callers that never join a canary get the stable backend.
fn choose_backend<'l>(
    route: &'l CompiledRoute,
    live: &Live,
    cx: Option<&Context>,
    sticky: Option<usize>,
) -> Result<&'l Backend, ProxyError> {
    let i = match sticky {
        Some(i) => i,
        None => match cx.and_then(Context::identity) {
            Some(id) if route.backends.len() > 1 && live.never_canary.holds(id) => 0,
            id => route.pick(id.and_then(Identity::caller).map(|(_, caller)| &caller[..])),
        },
    };
    route.backend(i).ok_or(ProxyError::NoEndpoint)
}

/// Check the head, on routes that ask: the parameters and the body's media type before
/// the body is read or the backend asked; the gRPC binding this method and path take.
fn check_head<'l>(
    route: &'l CompiledRoute,
    parts: &http::request::Parts,
    empty: bool,
) -> Result<Checked<'l>, ProxyError> {
    let admitted = match &route.validator {
        None => None,
        Some(v) => {
            v.check_head(parts.uri.path(), parts.uri.query(), &parts.headers).map_err(ProxyError::Refused)?;
            let ct = parts.headers.get(CONTENT_TYPE).map(|v| v.to_str().unwrap_or("\u{fffd}"));
            Some(v.admit(ct, !empty).map_err(ProxyError::Refused)?)
        }
    };
    let call = match &route.grpc {
        None => None,
        Some(t) => Some(grpc_binding(t, &parts.method, parts.uri.path())?),
    };
    Ok(Checked { admitted, call })
}

/// The upstream URI: the chosen endpoint, and the path as the route rewrites it (a
/// gRPC call's goes to its method's path; its query, returned, is read into its message).
fn upstream_uri(
    route: &CompiledRoute,
    upstream: &Upstream,
    endpoint: Authority,
    call: Option<&Matched<'_>>,
    parts: &mut http::request::Parts,
) -> Result<Option<String>, ProxyError> {
    let grpc_query = call.and_then(|_| parts.uri.query().map(str::to_owned));
    let pq = match &route.rewrite {
        _ if let Some(m) = call => {
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
    Ok(grpc_query)
}

/// The upstream headers: the routed host, forwarding, the trace the backend continues,
/// the request id and the deadline; returns the deadline left and the upstream span.
fn upstream_headers(
    scene: &Scene<'_>,
    ex: &Exchange<'_>,
    trace: u128,
    http2: bool,
    grpc: bool,
    parts: &mut http::request::Parts,
) -> (Duration, u64) {
    let h = &mut parts.headers;
    h.insert(X_FORWARDED_HOST, scene.host.clone());
    if http2 {
        // On HTTP/2 the authority travels as `:authority` (the endpoint); a `Host` beside
        // it that differs is refused by some servers. The routed host is in
        // `X-Forwarded-Host`.
        h.remove(HOST);
    } else {
        h.insert(HOST, scene.host.clone());
    }
    set_forwarding(h, scene.conn, scene.hop.as_ref());
    // The backend continues the client's trace (or the request's own), as a child of
    // the node's upstream span; it is told to sample what the node traces from the start.
    let span = fastrand::u64(1..);
    let debug = ex.debug();
    let flags = match (&scene.gw.tracer, ex.tp) {
        (Some(t), _) if t.samples(trace, debug) => 1,
        (Some(_), tp) => tp.map_or(0, |t| t.flags),
        (None, tp) => tp.map_or(1, |t| t.flags),
    };
    h.insert(TRACEPARENT, headers::traceparent(ex.trace_id(), span, flags));
    h.insert(X_REQUEST_ID, ex.rid.clone());
    let left = scene.route.response_timeout.saturating_sub(ex.start.elapsed());
    h.insert(X_DEADLINE_MS, HeaderValue::from(u64::try_from(left.as_millis()).unwrap_or(u64::MAX)));
    if grpc {
        // The call's gRPC headers are the gateway's alone (a client's `grpc-encoding`
        // would have the backend compress an answer the gateway reads).
        postern_transcode::strip_grpc_headers(h);
        h.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        h.insert(http::header::TE, HeaderValue::from_static("trailers"));
        if let Ok(v) = HeaderValue::from_str(&postern_transcode::timeout_header(left)) {
            h.insert(GRPC_TIMEOUT, v);
        }
    }
    (left, span)
}

/// Body work, on routes that read the body whole: read it (the limit still counts
/// every byte), decode it (the limit applies to what it decodes to), validate it, let
/// the filters' body phase see it, transcode it; forwarded with its exact length.
async fn read_whole(
    scene: &Scene<'_>,
    cx: Option<&Context>,
    checked: &Checked<'_>,
    grpc_query: Option<String>,
    left: Duration,
    parts: &mut http::request::Parts,
    body: LimitedBody,
) -> Result<Bytes, Ending> {
    let route = scene.route;
    let too_large = || ProxyError::BodyTooLarge { limit: route.max_body_bytes };
    let bytes = match tokio::time::timeout(left, body.collect()).await {
        Err(_) => return Err(ProxyError::BodyTimeout.into()),
        Ok(Err(e)) if is_too_large(&e) => return Err(too_large().into()),
        Ok(Err(crate::request::body::BodyError::Stalled)) => return Err(ProxyError::BodyTimeout.into()),
        Ok(Err(e)) => return Err(ProxyError::BodyBroken(e).into()),
        Ok(Ok(c)) => c.to_bytes(),
    };
    let bytes = match parts.headers.remove(CONTENT_ENCODING) {
        None => bytes,
        Some(ce) => match Coding::from_header(ce.to_str().unwrap_or("?")) {
            Ok(None) => bytes,
            Ok(Some(coding)) => Bytes::from(
                postern_validate::decode::decode(coding, &bytes, route.max_body_bytes).map_err(ProxyError::Decode)?,
            ),
            Err(v) => return Err(ProxyError::Encoding(v).into()),
        },
    };
    if let (Some(v), Some(admitted)) = (&route.validator, checked.admitted) {
        v.check_body(admitted, &bytes).map_err(ProxyError::Refused)?;
    }
    if let Some(cx) = cx {
        run_body_filters(route, parts, &bytes, cx).await?;
        // The body phase edits the request as it goes upstream: its path must be
        // canonical too, and the forwarding headers stay the gateway's.
        crate::request::canon::check_edited_path(parts, &scene.live.paths)?;
        set_forwarding(&mut parts.headers, scene.conn, scene.hop.as_ref());
    }
    // JSON, path variables and query → the method's protobuf input, framed.
    let bytes = match &checked.call {
        None => bytes,
        Some(m) => m
            .request(grpc_query.as_deref(), &bytes, &postern_model::validate::JsonLimits::default())
            .map_err(ProxyError::Refused)?,
    };
    parts.headers.insert(CONTENT_LENGTH, HeaderValue::from(bytes.len()));
    Ok(bytes)
}

/// Send: to the reserved host, once more to another host when the first could not have
/// processed it and the route allows a retry (a method it allows, a POST only with
/// `Idempotency-Key` on a route whose service honours it, a body in hand and small).
#[allow(clippy::too_many_arguments)]
async fn send(
    route: &CompiledRoute,
    backend: &Backend,
    at: usize,
    ticket: postern_protect::Ticket,
    up: Request<UpstreamBody>,
    left: Duration,
    fate: Option<&crate::request::body::Fate>,
    marks: &mut Option<Marks<'_>>,
    start: Instant,
) -> (Result<Response<Incoming>, ProxyError>, Duration) {
    let upstream = &*backend.upstream;
    let replay = match up.body() {
        UpstreamBody::Full(b)
            if b.as_ref().map_or(0, |b| b.len() as u64) <= postern_model::RETRY_BODY_BYTES
                && upstream.has_other()
                && route.retry.allows(up.method(), up.headers()) =>
        {
            // Boxed: the request's future stays small for the requests that keep no copy.
            Some(Box::new(Replay {
                method: up.method().clone(),
                uri: up.uri().clone(),
                headers: up.headers().clone(),
                body: b.clone(),
            }))
        }
        _ => None,
    };
    let sent = Instant::now();
    if let Some(m) = marks.as_mut() {
        m.sent = nanos(sent.saturating_duration_since(start));
    }
    if upstream.has_other() {
        // The budget's base: what was first sent to a cluster a retry can go to.
        upstream.budget.request(sent);
    }
    let mut result = exchange(route, backend, at, ticket, up, left, fate).await;
    if let Some(r) = replay
        && retriable(&result)
    {
        result = retry(route, backend, at, r, start, result).await;
    }
    (result, Instant::now().saturating_duration_since(sent))
}

/// Answer: the backend's head through the filters' response phase, its body streamed
/// (holding the cluster's place until it ends) or, for a gRPC call, read and turned
/// into JSON; compressed when the client accepts it.
#[allow(clippy::too_many_arguments)]
async fn answer(
    route: &CompiledRoute,
    cx: Option<&Context>,
    call: Option<&Matched<'_>>,
    resp: Response<Incoming>,
    stall: Stall,
    mut held: Held,
    compress: Option<(u64, crate::request::compress::Coding, bool, &Arc<crate::request::compress::Slots>)>,
    start: Instant,
) -> Result<Response<ResponseBody>, Ending> {
    let (mut rp, rb) = resp.into_parts();
    if rp.status.is_informational() {
        // No upgrade is ever asked for, and interim answers are not relayed.
        return Err(ProxyError::UpstreamProtocol("the backend answered with an unsolicited 1xx").into());
    }
    let body = match call {
        None => {
            // Handed to the client: until it asks for the body, the answer waits on it.
            held.client.waits();
            ResponseBody::Upstream { body: rb, stall, held: Some(held) }
        }
        Some(m) => {
            let json = grpc_answer(m, &mut rp, rb, route.response_timeout, start).await?;
            // The call is over: its places are free.
            drop(held);
            ResponseBody::full(json)
        }
    };
    headers::strip_hop_by_hop(&mut rp.headers);
    if let Some(cx) = cx {
        for f in route.chain() {
            if let ResponseFlow::Wait(fut) = f.on_response(&mut rp, cx) {
                fut.await.map_err(Ending::Reply)?;
            }
        }
    }
    // Past the node's cap on streams compressed at once, the answer goes as it is.
    let body = match compress.and_then(|(min, want, head, slots)| {
        let coding = crate::request::compress::choose(min, head, Some(want), rp.status, &rp.headers)?;
        Some((coding, slots.take()?))
    }) {
        None => body,
        Some((coding, slot)) => {
            let body = body.compressed(coding, slot).map_err(|_| ProxyError::Internal("cannot start compressing"))?;
            crate::request::compress::mark(coding, &mut rp.headers);
            body
        }
    };
    Ok(Response::from_parts(rp, body))
}

/// The forwarding headers the backend is told: from the connection, or from a trusted
/// hop's chain.
fn set_forwarding(h: &mut http::HeaderMap, conn: &ConnInfo, hop: Option<&Forwarding>) {
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
