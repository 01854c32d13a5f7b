//! One exchange with a backend host, and a retriable failure sent once more to another
//! host within the cluster's retry budget.

use std::time::{Duration, Instant};

use http::{HeaderName, HeaderValue, Request, Response, Uri, Version};
use hyper::body::Incoming;

use crate::request::body::UpstreamBody;
use crate::request::error::ProxyError;
use crate::request::headers::X_DEADLINE_MS;
use crate::snapshot::{Backend, CompiledRoute};

/// A request as it went to the backend, kept to send it once more.
pub(crate) struct Replay {
    pub(crate) method: http::Method,
    pub(crate) uri: Uri,
    pub(crate) headers: http::HeaderMap,
    pub(crate) body: Option<bytes::Bytes>,
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
pub(crate) async fn exchange(
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
pub(crate) fn retriable(r: &Result<Response<Incoming>, ProxyError>) -> bool {
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
pub(crate) async fn retry(
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
