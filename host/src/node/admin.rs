//! The admin listener (127.0.0.1:9901 by default): `/healthz`, `/readyz`, `/metrics`
//! (Prometheus text) and `/snapshot` (running version and hash).

use std::sync::Arc;
use std::time::UNIX_EPOCH;

use http::header::CONTENT_TYPE;
use http::{HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;

use crate::gateway::Gateway;
use crate::request::body::ResponseBody;

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
            let now = std::time::Instant::now();
            let clusters: serde_json::Map<String, serde_json::Value> =
                live.upstreams.iter().map(|u| (u.name.to_string(), u.state(now))).collect();
            let body = serde_json::json!({
                "ready": true,
                "clusters": clusters,
                "shed": gw.shed.state(),
                "admission": gw.admission.state(),
                "ratelimit": ratelimit,
                "snapshot": {"version": live.version, "hash": live.hash, "routes": live.route_count},
                "credentials": {"version": creds.version, "keys": keys, "signing_keys": signing_keys, "apps": apps, "deny": deny},
                "usage": gw.usage.as_ref().map_or(serde_json::json!({"metered": false}), |u| u.state()),
            });
            text(StatusCode::OK, "application/json", body.to_string())
        }
        "/metrics" => {
            let mut out = gw.metrics.render();
            crate::node::exposition::render_upstreams(&mut out, &gw.live.load().upstreams);
            crate::node::exposition::render_shed(&mut out, &gw.shed, &gw.admission, &gw.live.load().upstreams);
            crate::node::exposition::render_compression(&mut out, &gw.compressing);
            crate::node::exposition::render_auth(&mut out, &gw.auth.stats);
            if let Some(s) = &gw.ratesync {
                crate::node::exposition::render_ratesync(&mut out, s);
            }
            if let Some(u) = &gw.usage {
                crate::node::exposition::render_usage(&mut out, u);
                crate::node::exposition::render_top_callers(&mut out, &u.top_callers());
            }
            if let Some(log) = &gw.access_log {
                crate::node::exposition::render_access_log(&mut out, log);
            }
            if let Some(tracer) = &gw.tracer {
                crate::node::exposition::render_traces(&mut out, tracer);
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
        "/usage/windows" => usage_windows(&gw, req.uri().query().unwrap_or_default()).await,
        _ => {
            text(StatusCode::NOT_FOUND, "text/plain", "try /healthz, /readyz, /metrics, /snapshot or /usage/windows\n")
        }
    }
}

/// `/usage/windows?from=A&to=B`: spooled usage windows A..=B as the spool holds them,
/// for a re-send the control plane's reconciler asks for.
async fn usage_windows(gw: &Gateway, query: &str) -> Response<ResponseBody> {
    let Some(usage) = gw.usage.clone() else {
        return text(StatusCode::NOT_FOUND, "text/plain", "this node meters no usage\n");
    };
    let param = |name: &str| {
        query.split('&').find_map(|kv| kv.strip_prefix(name)?.strip_prefix('=')).and_then(|v| v.parse::<u64>().ok())
    };
    let (Some(from), Some(to)) = (param("from"), param("to")) else {
        return text(StatusCode::BAD_REQUEST, "text/plain", "usage/windows needs ?from=SEQ&to=SEQ\n");
    };
    match tokio::task::spawn_blocking(move || usage.windows(from, to)).await {
        Ok(Ok(windows)) => text(StatusCode::OK, "application/json", postern_usage::batch_body(&windows)),
        Ok(Err(e)) => text(StatusCode::SERVICE_UNAVAILABLE, "text/plain", format!("{e}\n")),
        Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, "text/plain", format!("{e}\n")),
    }
}
