//! REST→gRPC on a transcoded route: the binding a request takes, and the backend's
//! gRPC answer read whole and turned into JSON or a problem.

use std::time::{Duration, Instant};

use http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use http::{HeaderName, HeaderValue};
use http_body_util::BodyExt;
use hyper::body::Incoming;

use crate::request::error::ProxyError;

/// The largest gRPC answer a transcoded route reads (it is turned into JSON whole).
const MAX_GRPC_ANSWER: usize = 4 << 20;
/// The gRPC deadline header.
pub(crate) const GRPC_TIMEOUT: HeaderName = HeaderName::from_static("grpc-timeout");

/// The binding a transcoded route's request takes: 404 if none takes its path, 405
/// with `Allow` if only other methods do.
pub(crate) fn grpc_binding<'t>(
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
pub(crate) async fn grpc_answer(
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
