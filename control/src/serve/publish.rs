//! Publishing and rolling back: the repository compiled (`compile_repo`) and published
//! on the lanes that changed, a team's publish held to its own routes, a rollback as a
//! new version; and the waits for the nodes' ACKs and for the nodes that serve it.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use http::{Response, StatusCode};

use super::state::{Body, NodeState, Server, error, json};
use crate::rollout::Rollout;
use crate::store::{Change, Lane};

impl Server {
    /// Compiles the repository and publishes whatever changed; a team may publish only
    /// when everything that changed is its own.
    pub(super) async fn publish(
        &self,
        who: &str,
        team: Option<&str>,
        wait_acks: Duration,
        wait: Duration,
    ) -> Response<Body> {
        let one = self.publishing.lock().await;
        let repo = self.repo.clone();
        // Over-quota and debug-trace flags are set at run time: the credentials compiled
        // keep the head's.
        let flags = match self.store.head(Lane::Credentials).await {
            Ok(head) => head.and_then(|v| postern_model::credentials::Credentials::open(&v.bytes).ok()).map(|(_, c)| c),
            Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        };
        let compiled = tokio::task::spawn_blocking(move || publishable(&repo, flags)).await;
        let Publishable { snapshot: new, snapshot_json: snapshot, credentials, modules } = match compiled {
            Ok(Ok(c)) => c,
            Ok(Err(errors)) => {
                return json(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    &serde_json::json!({"error": "refused", "errors": errors}),
                );
            }
            Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        };
        let previous = match self.store.head(Lane::Snapshot).await {
            Ok(v) => v,
            Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        };
        // The published snapshot, parsed once for the team check and the rollout.
        let old = previous.as_ref().and_then(|v| postern_model::SnapshotFile::open(&v.bytes).ok());
        let snapshot_changes = old.as_ref().is_none_or(|(f, _)| f.content.get() != snapshot.get());
        if let Some(team) = team {
            let foreign = self.foreign_changes(team, old.as_ref().map(|(_, s)| s), &new, &credentials).await;
            if !foreign.is_empty() {
                return json(
                    StatusCode::FORBIDDEN,
                    &serde_json::json!({
                        "error": format!("team {team} may publish only changes to its own routes"),
                        "errors": foreign,
                    }),
                );
            }
        }
        if snapshot_changes && let Some(busy) = self.rollout.lock().ok().and_then(|r| r.as_ref().map(|r| r.to)) {
            return error(
                StatusCode::CONFLICT,
                format!("v{busy} is rolling out; publish once it is done, or roll back"),
            );
        }
        for (hex, bytes) in &modules {
            if let Err(e) = self.store.put_module(hex, bytes).await {
                return error(StatusCode::SERVICE_UNAVAILABLE, format!("cannot store module {hex}: {e}"));
            }
        }
        let s = match self
            .store
            .publish(&Change { kind: Lane::Snapshot, content: &snapshot, who, action: "publish", note: "" })
            .await
        {
            Ok(v) => v,
            Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        };
        let c = match self
            .store
            .publish(&Change { kind: Lane::Credentials, content: &credentials, who, action: "publish", note: "" })
            .await
        {
            Ok(v) => v,
            Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        };
        let mut rollout = serde_json::Value::Null;
        // Who serves the new version first: the first stage's nodes, or every node.
        let mut first_stage = None;
        if s.1
            && !self.rollout_settings.dwell.is_zero()
            && let (Some(from), Some((_, old))) = (&previous, &old)
        {
            let nodes = self.node_views();
            if !nodes.is_empty() {
                let routes = crate::plan::changed_routes(old, &new);
                let r = Rollout::start(from.number, s.0.number, who, routes, &nodes, &self.rollout_settings);
                rollout = r.describe();
                first_stage = Some(r.members.clone());
                if let Ok(mut slot) = self.rollout.lock() {
                    *slot = Some(r);
                }
            }
        }
        // The rollout (if any) is in place before any node can see the new head.
        self.heads.send_modify(|h| *h = (h.0.max(s.0.number), h.1.max(c.0.number), h.2 + 1));
        let mut body = serde_json::json!({
            "snapshot": {"version": s.0.number, "hash": s.0.hash, "changed": s.1},
            "credentials": {"version": c.0.number, "hash": c.0.hash, "changed": c.1},
            "rollout": rollout,
        });
        // Published: the key service and revocations may go on while this waits for ACKs.
        drop(one);
        if c.1 && !wait_acks.is_zero() {
            // The fast lane: answer once every live node runs the new credentials.
            let (acked, stale) = self.wait_acks(c.0.number, wait_acks).await;
            body["credentials"]["acked"] = serde_json::json!(acked);
            body["credentials"]["stale"] = serde_json::json!(stale);
        }
        if !s.1 {
            body["summary"] = match c.1 {
                true => format!("credentials v{} published; snapshot v{} unchanged", c.0.number, s.0.number),
                false => format!("nothing changed: v{} stays", s.0.number),
            }
            .into();
        } else if !wait.is_zero() {
            let served = self.wait_serving(s.0.number, first_stage.as_ref(), wait).await;
            body["summary"] = served
                .summary(&format!("v{} published", s.0.number), first_stage.is_some(), self.rollout_settings.dwell)
                .into();
            body["snapshot"]["served"] = served.to_json();
        }
        json(StatusCode::OK, &body)
    }

    /// What a publish by `team` would change that is not the team's: other teams' routes,
    /// platform files, credentials.
    async fn foreign_changes(
        &self,
        team: &str,
        old: Option<&postern_model::Snapshot>,
        new: &postern_model::Snapshot,
        credentials: &serde_json::value::RawValue,
    ) -> Vec<String> {
        let Some(old) = old else { return vec!["the first version is published by the platform".to_owned()] };
        let mut out = Vec::new();
        for (owner, changes) in crate::plan::diff(old, new) {
            if owner != team {
                for (change, id) in changes {
                    out.push(format!("{} {id} belongs to {owner}", format!("{change:?}").to_lowercase()));
                }
            }
        }
        let creds_head = self.store.head(Lane::Credentials).await.ok().flatten();
        let same_creds = creds_head
            .and_then(|v| postern_model::SnapshotFile::open_envelope(&v.bytes).ok())
            .is_some_and(|f| f.content.get() == credentials.get());
        if !same_creds {
            out.push("credentials (keys, signing keys, apps, deny list) belong to platform".to_owned());
        }
        out
    }

    pub(super) async fn wait_acks(&self, version: u64, limit: Duration) -> (Vec<String>, Vec<String>) {
        let deadline = Instant::now() + limit;
        loop {
            let live = self.live_nodes();
            let (acked, stale): (Vec<_>, Vec<_>) =
                live.into_iter().partition(|(_, n)| n.credentials.version >= version);
            let names = |v: Vec<(String, NodeState)>| v.into_iter().map(|(k, _)| k).collect::<Vec<_>>();
            if stale.is_empty() || Instant::now() >= deadline {
                return (names(acked), names(stale));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    pub(super) async fn rollback(&self, who: &str, to: u64, wait: Duration) -> Response<Body> {
        let one = self.publishing.lock().await;
        let old = match self.store.get(Lane::Snapshot, to).await {
            Ok(Some(v)) => v,
            Ok(None) => return error(StatusCode::NOT_FOUND, format!("no snapshot v{to}")),
            Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        };
        let content = match postern_model::SnapshotFile::open_envelope(&old.bytes) {
            Ok(f) => f.content,
            Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        };
        // A rollback reaches every node at once: it ends any rollout.
        if let Some(r) = self.take_rollout() {
            self.set_last(serde_json::json!({"to": r.to, "from": r.from, "outcome": "rolled_back", "by": who}));
        }
        let note = format!("contents of v{to}");
        let change = Change { kind: Lane::Snapshot, content: &content, who, action: "rollback", note: &note };
        let (v, changed) = match self.store.publish(&change).await {
            Ok(v) => v,
            Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        };
        self.heads.send_modify(|h| {
            h.0 = h.0.max(v.number);
            h.2 += 1;
        });
        drop(one);
        let mut body = serde_json::json!({"snapshot": {"version": v.number, "hash": v.hash, "changed": changed, "contents_of": to}});
        if !wait.is_zero() {
            let served = self.wait_serving(v.number, None, wait).await;
            body["summary"] = served
                .summary(&format!("v{} (the contents of v{to}) published", v.number), false, Duration::ZERO)
                .into();
            body["snapshot"]["served"] = served.to_json();
        }
        json(StatusCode::OK, &body)
    }

    /// Waits up to `limit` until every live node of `nodes` (every live node with `None`)
    /// runs snapshot `version` or a later one, or one of them refuses it.
    async fn wait_serving(&self, version: u64, nodes: Option<&BTreeSet<String>>, limit: Duration) -> Served {
        let deadline = Instant::now() + limit;
        loop {
            let mut served = Served::default();
            for (name, n) in self.live_nodes() {
                if nodes.is_some_and(|only| !only.contains(&name)) {
                    continue;
                }
                if n.snapshot.version >= version {
                    served.serving.push(name);
                } else if let Some((_, why)) = n.snapshot.refused.filter(|(v, _)| *v >= version) {
                    served.refused.push((name, why));
                } else {
                    served.behind.push(name);
                }
            }
            if served.behind.is_empty() || Instant::now() >= deadline {
                served.waited = limit.saturating_sub(deadline.saturating_duration_since(Instant::now()));
                return served;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// Which nodes serve a version a publish or a rollback waited for.
#[derive(Debug, Default)]
struct Served {
    /// Nodes that run it (or a later version).
    serving: Vec<String>,
    /// Nodes that run an older one still.
    behind: Vec<String>,
    /// Nodes that refused it, with their reasons.
    refused: Vec<(String, String)>,
    /// How long the wait took.
    waited: Duration,
}

impl Served {
    /// One line for a person: who serves what was published (`what`: "v2 published"),
    /// and what comes next.
    fn summary(&self, what: &str, staged: bool, dwell: Duration) -> String {
        let list = |v: &[String]| v.join(", ");
        if let Some((node, why)) = self.refused.first() {
            return format!("{what}; {node} refused it: {why}");
        }
        if !self.behind.is_empty() {
            return format!("{what}; not yet served by {} after {} s", list(&self.behind), self.waited.as_secs());
        }
        match (self.serving.is_empty(), staged) {
            (true, _) => format!("{what}; no live node to serve it"),
            (false, true) => format!(
                "{what}: served by {} (the first stage); the rest follow stage by stage, {} s each",
                list(&self.serving),
                dwell.as_secs()
            ),
            (false, false) => format!("{what}: served by every live node ({})", list(&self.serving)),
        }
    }

    /// True when every node waited for serves the version.
    fn complete(&self) -> bool {
        self.behind.is_empty() && self.refused.is_empty()
    }

    fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "complete": self.complete(),
            "serving": self.serving,
            "behind": self.behind,
            "refused": self.refused.iter().map(|(n, why)| serde_json::json!({"node": n, "reason": why})).collect::<Vec<_>>(),
            "waited_ms": self.waited.as_millis() as u64,
        })
    }
}

/// A compiled repository ready to publish: the snapshot, both lanes serialised, the modules.
struct Publishable {
    /// The snapshot, as compiled.
    snapshot: postern_model::Snapshot,
    /// The same, serialised: what is published.
    snapshot_json: Box<serde_json::value::RawValue>,
    /// The credential state, serialised.
    credentials: Box<serde_json::value::RawValue>,
    /// Modules by hex digest.
    modules: Vec<(String, Vec<u8>)>,
}

/// Compiles the repository's snapshot and credential state, with the modules it names.
fn publishable(
    repo: &std::path::Path,
    flags: Option<postern_model::credentials::Credentials>,
) -> Result<Publishable, Vec<String>> {
    let (compiled, mut creds) = crate::compile::compile_repo(repo).map_err(|e| match e {
        crate::compile::RepoError::Rejected(r) => r.0.iter().map(ToString::to_string).collect::<Vec<_>>(),
        crate::compile::RepoError::Credentials(errors) => errors,
    })?;
    creds.keep_flags(flags.as_ref());
    let mut modules = Vec::new();
    for (digest, src) in &compiled.modules {
        let bytes = std::fs::read(src).map_err(|e| vec![format!("{}: {e}", src.display())])?;
        modules.push((digest.trim_start_matches("sha256:").to_owned(), bytes));
    }
    let snapshot_json = serde_json::value::to_raw_value(&compiled.snapshot).map_err(|e| vec![e.to_string()])?;
    let credentials = serde_json::value::to_raw_value(&creds).map_err(|e| vec![e.to_string()])?;
    Ok(Publishable { snapshot: compiled.snapshot, snapshot_json, credentials, modules })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_for_serving_says_who_serves_who_is_behind_and_who_refused() {
        let names = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        let dwell = Duration::from_secs(10);
        let first = Served { serving: names(&["node-a"]), ..Served::default() };
        assert!(first.complete());
        assert_eq!(
            first.summary("v2 published", true, dwell),
            "v2 published: served by node-a (the first stage); the rest follow stage by stage, 10 s each"
        );
        let all = Served { serving: names(&["a", "b"]), ..Served::default() };
        assert_eq!(all.summary("v3 published", false, dwell), "v3 published: served by every live node (a, b)");
        let late = Served {
            serving: names(&["a"]),
            behind: names(&["b", "c"]),
            waited: Duration::from_secs(60),
            ..Served::default()
        };
        assert!(!late.complete());
        assert_eq!(late.summary("v4 published", false, dwell), "v4 published; not yet served by b, c after 60 s");
        assert_eq!(late.to_json()["behind"], serde_json::json!(["b", "c"]));
        let refused = Served { refused: vec![("a".to_owned(), "bad signature".to_owned())], ..Served::default() };
        assert!(!refused.complete());
        assert_eq!(refused.summary("v5 published", true, dwell), "v5 published; a refused it: bad signature");
        assert_eq!(refused.to_json()["refused"], serde_json::json!([{"node": "a", "reason": "bad signature"}]));
        assert_eq!(Served::default().summary("v6 published", true, dwell), "v6 published; no live node to serve it");
    }
}
