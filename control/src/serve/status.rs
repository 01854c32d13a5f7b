//! `GET /v1/status`: the fleet's versions, who is behind, and the rollout in progress.

use std::collections::BTreeMap;

use http::{Response, StatusCode};

use super::state::{Body, LaneState, NodeState, Server, json};
use crate::rollout::Rollout;

/// Keeps, in a rollout's description, only `team`'s routes (ids `team/name`).
fn own_routes_only(rollout: &mut serde_json::Value, team: &str) {
    let prefix = format!("{team}/");
    if let Some(routes) = rollout.get_mut("routes").and_then(serde_json::Value::as_array_mut) {
        routes.retain(|r| r.as_str().is_some_and(|id| id.starts_with(&prefix)));
    }
    if let Some(compared) = rollout.get_mut("compared").and_then(serde_json::Value::as_object_mut) {
        compared.retain(|id, _| id.starts_with(&prefix));
    }
}

impl Server {
    /// The fleet's versions and the rollout in progress; a team sees the rollout's routes
    /// and their comparisons only for its own routes.
    pub(super) async fn status(&self, team: Option<&str>) -> Response<Body> {
        let (s, c, _) = *self.heads.borrow();
        let live = self.live_nodes();
        let on = |v: u64, lane: fn(&NodeState) -> &LaneState| live.iter().filter(|(_, n)| lane(n).version == v).count();
        let on_snapshot = on(s, |n| &n.snapshot);
        let on_credentials = on(c, |n| &n.credentials);
        let laggards: Vec<&String> = live
            .iter()
            .filter(|(_, n)| n.snapshot.version != s || n.credentials.version != c)
            .map(|(k, _)| k)
            .collect();
        let nodes: BTreeMap<&String, serde_json::Value> = live
            .iter()
            .map(|(k, n)| {
                (
                    k,
                    serde_json::json!({
                        "snapshot": n.snapshot,
                        "credentials": n.credentials,
                        "seen_ms_ago": n.seen.elapsed().as_millis() as u64,
                    }),
                )
            })
            .collect();
        let summary = format!(
            "{on_snapshot} of {} nodes on v{s}{}",
            live.len(),
            if laggards.is_empty() {
                String::new()
            } else {
                format!("; behind: {}", laggards.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", "))
            }
        );
        json(
            StatusCode::OK,
            &serde_json::json!({
                "summary": summary,
                "snapshot": s,
                "credentials": c,
                "nodes_on_snapshot": on_snapshot,
                "nodes_on_credentials": on_credentials,
                "live_nodes": live.len(),
                "laggards": laggards,
                "nodes": nodes,
                "rollout": self.rollout.lock().ok().and_then(|r| r.as_ref().map(Rollout::describe)).map(|mut r| {
                    if let Some(team) = team {
                        own_routes_only(&mut r, team);
                    }
                    r
                }),
                "last_rollout": self.last_rollout.lock().ok().and_then(|l| l.clone()),
            }),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_team_sees_only_its_own_routes_in_a_rollout() {
        let mut r = serde_json::json!({
            "to": 3,
            "routes": ["t/a", "x/b", "t/c"],
            "compared": {"t/a": {}, "x/b": {}},
        });
        own_routes_only(&mut r, "t");
        assert_eq!(r["routes"], serde_json::json!(["t/a", "t/c"]));
        assert_eq!(r["compared"], serde_json::json!({"t/a": {}}));
        assert_eq!(r["to"], 3);
    }
}
