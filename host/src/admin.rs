//! The admin listener (127.0.0.1:9901 by default): `/healthz`, `/readyz`, `/metrics`
//! (Prometheus text) and `/snapshot` (running version and hash).

use std::sync::Arc;
use std::time::UNIX_EPOCH;

use http::header::CONTENT_TYPE;
use http::{HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;

use crate::body::ResponseBody;
use crate::proxy::Gateway;

fn text(status: StatusCode, content_type: &'static str, body: impl Into<bytes::Bytes>) -> Response<ResponseBody> {
    let mut r = Response::new(ResponseBody::full(body));
    *r.status_mut() = status;
    r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

/// Serves one admin request.
pub async fn handle(gw: Arc<Gateway>, req: Request<Incoming>) -> Response<ResponseBody> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return text(StatusCode::METHOD_NOT_ALLOWED, "text/plain", "GET only\n");
    }
    match req.uri().path() {
        "/healthz" => text(StatusCode::OK, "text/plain", "ok\n"),
        "/readyz" => {
            let live = gw.live.load();
            let creds = gw.auth.credentials.load();
            let (keys, signing_keys, apps, deny) = creds.counts();
            let ratelimit = match &gw.ratesync {
                None => serde_json::json!({"mode": "local"}),
                Some(s) => serde_json::json!({
                    "mode": "fleet",
                    "state": s.state(),
                    "last_sync_ms_ago": s.since_ok_ms(),
                    "nodes": s.nodes.load(std::sync::atomic::Ordering::Relaxed),
                    "keys": s.keys.load(std::sync::atomic::Ordering::Relaxed),
                }),
            };
            let body = serde_json::json!({
                "ready": true,
                "ratelimit": ratelimit,
                "snapshot": {"version": live.version, "hash": live.hash, "routes": live.route_count},
                "credentials": {"version": creds.version, "keys": keys, "signing_keys": signing_keys, "apps": apps, "deny": deny},
            });
            text(StatusCode::OK, "application/json", body.to_string())
        }
        "/metrics" => {
            let mut out = gw.metrics.render();
            crate::metrics::render_auth(&mut out, &gw.auth.stats);
            if let Some(s) = &gw.ratesync {
                crate::metrics::render_ratesync(&mut out, s);
            }
            text(StatusCode::OK, "text/plain; version=0.0.4", out)
        }
        "/snapshot" => {
            let live = gw.live.load();
            let loaded = live.loaded_at.duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
            let body = serde_json::json!({
                "version": live.version,
                "hash": live.hash,
                "routes": live.route_count,
                "loaded_at": loaded,
            });
            text(StatusCode::OK, "application/json", body.to_string())
        }
        _ => text(StatusCode::NOT_FOUND, "text/plain", "try /healthz, /readyz, /metrics or /snapshot\n"),
    }
}
