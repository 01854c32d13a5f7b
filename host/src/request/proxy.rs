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
use postern_filter_contract::{Context, Identity, ResponseFlow};
use postern_router::Match;
use postern_validate::Coding;

use crate::gateway::Gateway;
use crate::request::body::{LimitedBody, ResponseBody, Stall, UpstreamBody, is_too_large};
use crate::request::chain::{run_body_filters, run_request_filters};
use crate::request::conn::ConnInfo;
use crate::request::error::ProxyError;
use crate::request::exchange::{Ending, Exchange, Marks, Seen, nanos};
use crate::request::grpc::{GRPC_TIMEOUT, grpc_answer, grpc_binding};
use crate::request::headers::{self, TRACEPARENT, X_DEADLINE_MS, X_REQUEST_ID};
use crate::request::retry::{Replay, exchange, retriable, retry};
use crate::snapshot::{CompiledRoute, Live, Rewrite};
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
