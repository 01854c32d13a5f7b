//! The key service's endpoints: a change to the repository's credential files (create,
//! rotate, revoke, deny), compiled against the published plans and published on the fast
//! lane, answered once the live nodes run it.

use std::time::Duration;

use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use postern_model::protocol::MAX_WAIT_S;

use super::state::{Body, JSON_BODY_LIMIT, Server, error, json, read_json};
use crate::keyservice::Op;
use crate::store::{Change, Lane};

impl Server {
    /// A key-service request: its JSON body made into `op`, waiting for ACKs up to
    /// `?wait_acks=S` (5 s by default).
    pub(super) async fn key_request<T: serde::de::DeserializeOwned>(
        &self,
        who: &str,
        req: Request<Incoming>,
        wait_acks: Option<String>,
        op: impl FnOnce(T) -> Op,
    ) -> Response<Body> {
        let wait = Duration::from_secs(wait_acks.and_then(|v| v.parse().ok()).unwrap_or(5u64).min(MAX_WAIT_S));
        match read_json(req, JSON_BODY_LIMIT).await {
            Ok(body) => self.key_op(who, op(body), wait).await,
            Err(e) => e,
        }
    }

    /// A key service change: applied to the repository's credential files, compiled
    /// against the published plans, published on the fast lane; the answer (with a new
    /// raw key, shown only here) comes once every live node runs it, or after `wait`
    /// naming the stale ones.
    async fn key_op(&self, who: &str, op: Op, wait: Duration) -> Response<Body> {
        let (action, note) = op.describe();
        let one = self.publishing.lock().await;
        let plans = match self.store.head(Lane::Snapshot).await {
            Ok(Some(v)) => match postern_model::SnapshotFile::open(&v.bytes) {
                Ok((_, s)) => s.plans,
                Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
            },
            Ok(None) => return error(StatusCode::CONFLICT, "publish a snapshot (with its plans) first"),
            Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        };
        let base = match self.store.head(Lane::Credentials).await {
            Ok(v) => v,
            Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        };
        let repo = self.repo.clone();
        let applied = match tokio::task::spawn_blocking(move || crate::keyservice::apply(&repo, &plans, op)).await {
            Ok(Ok(done)) => done,
            Ok(Err(errors)) => {
                return json(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    &serde_json::json!({"error": "refused", "errors": errors}),
                );
            }
            Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        };
        // Over-quota and debug-trace flags are set at run time: the change keeps the head's.
        let was =
            base.as_ref().and_then(|b| postern_model::credentials::Credentials::open(&b.bytes).ok()).map(|(_, c)| c);
        let mut applied = applied;
        let mut answer = std::mem::take(&mut applied.answer);
        applied.credentials.keep_flags(was.as_ref());
        let content = match serde_json::value::to_raw_value(&applied.credentials) {
            Ok(c) => c,
            Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        };
        let change = Change { kind: Lane::Credentials, content: &content, who, action, note: &note };
        let (v, changed) = match self.store.publish(&change).await {
            Ok(v) => v,
            Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        };
        if changed && let (Some(base), Some(was)) = (base, was) {
            let delta = postern_model::credentials::CredentialsDelta {
                keys: applied.keys,
                deny: applied.deny,
                ..postern_model::credentials::CredentialsDelta::between(base.number, v.number)
            };
            self.offer_delta(&base, &v, delta, &was, &applied.credentials);
        }
        self.heads.send_modify(|h| h.1 = h.1.max(v.number));
        drop(one);
        answer["credentials"] = serde_json::json!({"version": v.number, "changed": changed});
        if changed {
            let (acked, stale) = self.wait_acks(v.number, wait).await;
            answer["credentials"]["acked"] = serde_json::json!(acked);
            answer["credentials"]["stale"] = serde_json::json!(stale);
        }
        json(StatusCode::OK, &answer)
    }
}
