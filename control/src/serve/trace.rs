//! Per-key debug tracing: `POST /v1/trace` sets a debug-trace flag for one API key or
//! OAuth app on the credentials lane, delivered as a delta like a revocation, so every
//! node traces every request of that caller within a second or so. The flag carries its
//! expiry, which each node reads on its own clock: tracing turns itself off without
//! another message. A later call for the same caller replaces the flag (`for_s: 0`
//! ends it now).

use std::time::Duration;

use http::{Response, StatusCode};
use postern_model::credentials::{Credentials, CredentialsDelta, TraceFlag, set_trace_flags};
use postern_model::disk::unix_now;
use postern_model::usage::CallerKind;
use serde::Deserialize;

use super::state::{Body, Server, error, json};
use crate::store::{Change, Lane};

/// The longest a debug trace may run: a week.
pub const MAX_TRACE_S: u64 = 7 * 24 * 3600;

/// `POST /v1/trace`: one caller, and for how long.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceBody {
    /// An API key, by id.
    #[serde(default)]
    pub key: Option<String>,
    /// An OAuth app, by `client_id`.
    #[serde(default)]
    pub app: Option<String>,
    /// Seconds from now; 0 ends the caller's tracing.
    pub for_s: u64,
}

impl Server {
    /// Publishes the caller's debug-trace flag and answers once every live node runs it
    /// (or after `wait`, naming the stale ones).
    pub(super) async fn debug_trace(&self, who: &str, body: TraceBody, wait: Duration) -> Response<Body> {
        let (kind, caller) = match (body.key, body.app) {
            (Some(k), None) => (CallerKind::Key, k),
            (None, Some(a)) => (CallerKind::App, a),
            _ => return error(StatusCode::BAD_REQUEST, "name one caller: key or app"),
        };
        if body.for_s > MAX_TRACE_S {
            return error(StatusCode::BAD_REQUEST, format!("a debug trace runs at most {MAX_TRACE_S} s (a week)"));
        }
        let one = self.publishing.lock().await;
        let base = match self.store.head(Lane::Credentials).await {
            Ok(Some(v)) => v,
            Ok(None) => return error(StatusCode::CONFLICT, "publish credentials first"),
            Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        };
        let was = match Credentials::open(&base.bytes) {
            Ok((_, c)) => c,
            Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        };
        let known = match kind {
            CallerKind::Key => was.keys.iter().any(|k| k.id == caller),
            CallerKind::App => was.apps.contains_key(&caller),
        };
        if !known {
            return error(StatusCode::NOT_FOUND, format!("no {} {caller:?} in the credentials", kind.as_str()));
        }
        let now = unix_now();
        let flag = TraceFlag { caller, kind, until: now + body.for_s };
        let mut creds = was.clone();
        // Flags that ended go with the next change (that version then goes whole).
        creds.debug_trace.retain(|f| f.until > now);
        set_trace_flags(&mut creds.debug_trace, std::slice::from_ref(&flag));
        let content = match serde_json::value::to_raw_value(&creds) {
            Ok(c) => c,
            Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        };
        let note = match body.for_s {
            0 => format!("debug trace off: {} {}", kind.as_str(), flag.caller),
            s => format!("debug trace: {} {} for {s} s", kind.as_str(), flag.caller),
        };
        let change = Change { kind: Lane::Credentials, content: &content, who, action: "trace", note: &note };
        let (v, changed) = match self.store.publish(&change).await {
            Ok(v) => v,
            Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        };
        if changed {
            let delta = CredentialsDelta {
                debug_trace: vec![flag.clone()],
                ..CredentialsDelta::between(base.number, v.number)
            };
            self.offer_delta(&base, &v, delta, &was, &creds);
            say!("credentials v{}: {note}", v.number);
        }
        self.heads.send_modify(|h| h.1 = h.1.max(v.number));
        drop(one);
        let mut answer = serde_json::json!({
            "caller": flag.caller,
            "kind": kind.as_str(),
            "until": flag.until,
            "credentials": {"version": v.number, "changed": changed},
        });
        if changed {
            let (acked, stale) = self.wait_acks(v.number, wait).await;
            answer["credentials"]["acked"] = serde_json::json!(acked);
            answer["credentials"]["stale"] = serde_json::json!(stale);
        }
        json(StatusCode::OK, &answer)
    }
}
