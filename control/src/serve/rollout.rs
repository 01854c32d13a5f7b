//! The rollout in progress, moved on ten times a second: stage by stage, done, or
//! reverted by publishing the contents it started from as a new version.

use std::time::Duration;

use super::state::Server;
use crate::rollout::{Rollout, Step};
use crate::store::{Change, Lane};

impl Server {
    /// Moves the rollout in progress on, ten times a second.
    pub(super) async fn drive_rollouts(&self) {
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let nodes = self.node_views();
            let step = match self.rollout.lock() {
                Ok(mut r) => match r.as_mut() {
                    Some(r) => r.tick(&nodes, &self.rollout_settings),
                    None => continue,
                },
                Err(_) => continue,
            };
            match step {
                Step::Wait => {}
                Step::Deliver => self.heads.send_modify(|h| h.2 += 1),
                Step::Done => {
                    if let Some(r) = self.take_rollout() {
                        say!("v{} is on every node", r.to);
                        self.set_last(serde_json::json!({"to": r.to, "from": r.from, "outcome": "done"}));
                    }
                    self.heads.send_modify(|h| h.2 += 1);
                }
                Step::Revert(why) => self.revert(why).await,
            }
        }
    }

    pub(super) fn take_rollout(&self) -> Option<Rollout> {
        self.rollout.lock().ok().and_then(|mut r| r.take())
    }

    pub(super) fn set_last(&self, v: serde_json::Value) {
        if let Ok(mut last) = self.last_rollout.lock() {
            *last = Some(v);
        }
    }

    /// Publishes the contents the rollout started from as a new version, on every node.
    async fn revert(&self, why: String) {
        let _one = self.publishing.lock().await;
        let Some(r) = self.take_rollout() else { return };
        say!("reverting v{}: {why}", r.to);
        let note = format!("v{} reverted to the contents of v{}: {why}", r.to, r.from);
        let published = match self.store.get(Lane::Snapshot, r.from).await {
            Ok(Some(old)) => match postern_model::SnapshotFile::open_envelope(&old.bytes) {
                Ok(f) => {
                    let change = Change {
                        kind: Lane::Snapshot,
                        content: &f.content,
                        who: "rollout",
                        action: "auto-revert",
                        note: &note,
                    };
                    self.store.publish(&change).await.map_err(|e| e.to_string())
                }
                Err(e) => Err(e.to_string()),
            },
            Ok(None) => Err(format!("v{} is gone", r.from)),
            Err(e) => Err(e.to_string()),
        };
        match published {
            Ok((v, _)) => {
                self.set_last(serde_json::json!({
                    "to": r.to, "from": r.from, "outcome": "reverted", "reason": why, "revert_version": v.number,
                }));
                self.heads.send_modify(|h| {
                    h.0 = h.0.max(v.number);
                    h.2 += 1;
                });
            }
            Err(e) => {
                // The rollout stays stopped where it was: nodes keep what they run.
                say!("cannot publish the revert of v{}: {e}", r.to);
                self.set_last(serde_json::json!({
                    "to": r.to, "from": r.from, "outcome": "revert_failed", "reason": why, "error": e,
                }));
                if let Ok(mut slot) = self.rollout.lock() {
                    *slot = Some(r);
                }
            }
        }
    }
}
