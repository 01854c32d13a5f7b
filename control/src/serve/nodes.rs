//! Delivery to nodes: each lane's long poll (a delta on the credentials lane when the
//! node runs its base), ACKs and NACKs, route reports for the rollout, the published
//! credentials directory, and the watch on the store's heads.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Response, StatusCode};
use http_body_util::Full;

use postern_model::protocol::{self, Ack};
use postern_model::report::{Report, Watch};

use super::state::{Body, FORGET_AFTER, LIVE_FOR, LaneState, NodeState, Server, error, json};
use crate::rollout::NodeView;
use crate::store::{Lane, Version};

/// How often to look for versions published by another instance.
const STORE_POLL: Duration = Duration::from_millis(250);

impl Server {
    /// Keeps `<publish_dir>/credentials.json` at the credentials head, signed as stored:
    /// written on every new head (from this instance or another), retried every 5 s
    /// while the directory cannot be written.
    pub(super) async fn write_published(self: &Arc<Self>) {
        let Some(dir) = self.publish_dir.clone() else { return };
        let server = self.clone();
        let mut heads = self.heads.subscribe();
        tokio::spawn(async move {
            let mut written = 0;
            loop {
                let want = heads.borrow_and_update().1;
                if want > written {
                    match server.store.head(Lane::Credentials).await {
                        Ok(Some(v)) => {
                            let path = dir.join(protocol::DROP_CREDENTIALS);
                            let bytes = v.bytes.clone();
                            let wrote = tokio::task::spawn_blocking(move || {
                                postern_model::disk::write_atomic(&path, &bytes).map_err(|e| e.to_string())
                            })
                            .await
                            .unwrap_or_else(|e| Err(e.to_string()));
                            match wrote {
                                Ok(()) => written = v.number,
                                Err(e) => say!("publish dir: {e}"),
                            }
                        }
                        Ok(None) => {}
                        Err(e) => say!("publish dir: cannot read the credentials head: {e}"),
                    }
                }
                if let Ok(Err(_)) = tokio::time::timeout(Duration::from_secs(5), heads.changed()).await {
                    return;
                }
            }
        });
    }

    /// Picks up versions another instance published.
    pub(super) async fn watch_store(&self) {
        loop {
            tokio::time::sleep(STORE_POLL).await;
            // A publish here in progress sets its rollout up before nodes see its head.
            let Ok(_quiet) = self.publishing.try_lock() else { continue };
            let s = self.store.head(Lane::Snapshot).await.ok().flatten().map(|v| v.number);
            let c = self.store.head(Lane::Credentials).await.ok().flatten().map(|v| v.number);
            self.heads.send_if_modified(|h| {
                let next = (s.unwrap_or(h.0).max(h.0), c.unwrap_or(h.1).max(h.1), h.2);
                let changed = next != *h;
                *h = next;
                changed
            });
        }
    }

    fn touch(&self, node: &str) {
        if let Ok(mut nodes) = self.nodes.lock() {
            // Nodes gone for long are forgotten, with their reports.
            let before = nodes.len();
            nodes.retain(|_, n| n.seen.elapsed() < FORGET_AFTER);
            if nodes.len() != before
                && let Ok(mut reports) = self.reports.lock()
            {
                reports.retain(|name, _| nodes.contains_key(name));
            }
            let n = nodes.entry(node.to_owned()).or_insert_with(|| NodeState {
                snapshot: LaneState::default(),
                credentials: LaneState::default(),
                seen: Instant::now(),
                canary: false,
            });
            n.seen = Instant::now();
        }
    }

    pub(super) fn set_canary(&self, node: &str) {
        if let Ok(mut nodes) = self.nodes.lock()
            && let Some(n) = nodes.get_mut(node)
        {
            n.canary = true;
        }
    }

    /// The snapshot version node `node` should run: the head, unless a rollout has not
    /// reached it yet.
    fn snapshot_target(&self, node: &str, head: u64) -> u64 {
        let Ok(rollout) = self.rollout.lock() else { return head };
        rollout.as_ref().map_or(head, |r| r.target(node))
    }

    /// The delta from `base` to `version`, if the key service made one.
    fn delta(&self, base: u64, version: u64) -> Option<Bytes> {
        let deltas = self.deltas.lock().ok()?;
        deltas.iter().find(|(b, v, _)| *b == base && *v == version).map(|(_, _, d)| d.clone())
    }

    pub(super) async fn poll(&self, node: &str, kind: Lane, have: u64, wait: Duration, full: bool) -> Response<Body> {
        self.touch(node);
        let mut rx = self.heads.subscribe();
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let heads = *rx.borrow_and_update();
            let target = match kind {
                Lane::Snapshot => self.snapshot_target(node, heads.0),
                Lane::Credentials => heads.1,
            };
            if target != 0 && target != have {
                if kind == Lane::Credentials
                    && !full
                    && let Some(delta) = self.delta(have, target)
                {
                    self.touch(node);
                    let mut r = Response::new(Full::new(delta));
                    r.headers_mut()
                        .insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/json"));
                    return r;
                }
                let got = self.store.get(kind, target).await;
                self.touch(node);
                return match got {
                    Ok(Some(v)) => version_response(&v),
                    Ok(None) => error(StatusCode::SERVICE_UNAVAILABLE, "no version"),
                    Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
                };
            }
            if tokio::time::timeout_at(deadline, rx.changed()).await.is_err() {
                self.touch(node);
                let mut r = Response::new(Full::new(Bytes::new()));
                *r.status_mut() = StatusCode::NO_CONTENT;
                return r;
            }
        }
    }

    pub(super) fn record(&self, node: &str, kind: Lane, f: impl FnOnce(&mut LaneState)) {
        self.touch(node);
        if let Ok(mut nodes) = self.nodes.lock()
            && let Some(n) = nodes.get_mut(node)
        {
            f(match kind {
                Lane::Snapshot => &mut n.snapshot,
                Lane::Credentials => &mut n.credentials,
            });
        }
    }

    pub(super) fn ack(&self, node: &str, kind: Lane, ack: Ack) -> Response<Body> {
        let (ok, version, running) = (ack.ok, ack.version, ack.running);
        let error = ack.error.unwrap_or_default();
        self.record(node, kind, |lane| {
            if ok {
                lane.version = version;
                lane.refused = None;
            } else {
                lane.refused = Some((version, error));
            }
            lane.version = lane.version.max(running);
        });
        if !ack.ok {
            say!("node {node} refused {} v{}", kind.as_str(), ack.version);
        }
        json(StatusCode::OK, &serde_json::json!({"ok": true}))
    }

    pub(super) fn live_nodes(&self) -> Vec<(String, NodeState)> {
        let Ok(nodes) = self.nodes.lock() else { return Vec::new() };
        nodes.iter().filter(|(_, n)| n.seen.elapsed() < LIVE_FOR).map(|(k, n)| (k.clone(), n.clone())).collect()
    }

    pub(super) fn node_views(&self) -> Vec<NodeView> {
        self.live_nodes()
            .into_iter()
            .map(|(name, n)| NodeView {
                name,
                canary: n.canary,
                running: n.snapshot.version,
                refused: n.snapshot.refused,
            })
            .collect()
    }

    /// Takes a node's report; answers with the routes to report next.
    pub(super) fn report(&self, node: &str, report: Report) -> Watch {
        let version = report.snapshot;
        self.record(node, Lane::Snapshot, |lane| lane.version = version);
        let Ok(mut reports) = self.reports.lock() else { return Watch::default() };
        let previous = reports.remove(node);
        let Ok(mut rollout) = self.rollout.lock() else { return Watch::default() };
        let watch = match rollout.as_mut() {
            Some(r) => {
                // Differences across a version change are not attributed to either side.
                if let Some((was, before)) = &previous
                    && *was == version
                {
                    for (id, now) in &report.routes {
                        if let Some(then) = before.get(id) {
                            r.observe(id, version, &now.since(then));
                        }
                    }
                }
                Watch { routes: r.routes.clone(), all: r.routes.is_empty() }
            }
            None => Watch::default(),
        };
        reports.insert(node.to_owned(), (version, report.routes));
        watch
    }
}

pub(super) fn version_response(v: &Version) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::copy_from_slice(&v.bytes)));
    r.headers_mut().insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/json"));
    if let Ok(h) = http::HeaderValue::from_str(&v.number.to_string()) {
        r.headers_mut().insert("x-postern-version", h);
    }
    r
}
