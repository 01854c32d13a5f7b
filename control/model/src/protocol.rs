//! The node protocol: everything a node and the control plane say to each other, as
//! types both sides share, so neither builds a URL or a JSON body by hand.
//!
//! | request | body | answer |
//! |---|---|---|
//! | `GET` [`Poll::path`] `?`[`Poll::query`] | — | 200 with the lane's version (a sealed envelope, or on the credentials lane a [`crate::credentials::DeltaDoc`]), or 204 after `wait` seconds with nothing new |
//! | `POST` [`Ack::path`] | [`Ack`] | 2xx |
//! | `POST` [`report_path`] | [`crate::report::Report`] | [`crate::report::Watch`] |
//! | `GET` [`module_path`] | — | the module's bytes, which hash to its digest |
//! | `POST` [`USAGE_PATH`] | [`UsageBatch`] (windows of the token's node) | [`UsageAck`] once every window is applied or known |
//! | `GET` `/v1/nodes/<node>/usage/missing` | — | [`UsageAck`] with only the node's missing runs |
//! | `PUT` [`counters_path`] | [`crate::usage::NodeCounters`] of a period complete on the node | 204 once stored |

use serde::{Deserialize, Serialize};

/// The file a control plane keeps at its credentials head in a publish directory, and
/// nodes poll there (`postern --credentials-dir`).
pub const DROP_CREDENTIALS: &str = "credentials.json";

/// How often nodes read the publish directory by default, in seconds.
pub const DROP_POLL_S: u64 = 60;

/// The longest a long poll may wait, in seconds.
pub const MAX_WAIT_S: u64 = 60;
/// How long a node's long poll waits by default, in seconds.
pub const DEFAULT_WAIT_S: u64 = 25;

/// The two lanes versions travel on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Lane {
    /// Routes, clusters, plans, filters: the staged lane.
    Snapshot,
    /// Keys, signing keys, apps, deny list: the fast lane.
    Credentials,
}

impl Lane {
    /// Both lanes.
    pub const ALL: [Lane; 2] = [Lane::Snapshot, Lane::Credentials];

    /// The name used in paths, tables and URLs.
    pub fn as_str(self) -> &'static str {
        match self {
            Lane::Snapshot => "snapshot",
            Lane::Credentials => "credentials",
        }
    }

    /// The lane named `name` in a path.
    pub fn parse(name: &str) -> Option<Lane> {
        Lane::ALL.into_iter().find(|l| l.as_str() == name)
    }
}

/// A node's long poll on one lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Poll {
    /// The version the node has (the control plane answers when its head differs).
    pub have: u64,
    /// The version the node runs now (it may have booted from disk, with no ACK).
    pub running: Option<u64>,
    /// How long to wait for a change, in seconds (at most [`MAX_WAIT_S`]).
    pub wait_s: u64,
    /// The node is a canary: staged rollouts give it new snapshots first.
    pub canary: bool,
    /// Send a whole version, not a delta (after a delta failed to apply).
    pub full: bool,
}

impl Default for Poll {
    fn default() -> Poll {
        Poll { have: 0, running: None, wait_s: DEFAULT_WAIT_S, canary: false, full: false }
    }
}

impl Poll {
    /// `/v1/nodes/<node>/<lane>`.
    pub fn path(node: &str, lane: Lane) -> String {
        format!("/v1/nodes/{node}/{}", lane.as_str())
    }

    /// The query string, without `?`.
    pub fn query(&self) -> String {
        let mut q = format!("have={}", self.have);
        if let Some(r) = self.running {
            q.push_str(&format!("&running={r}"));
        }
        q.push_str(&format!("&wait={}", self.wait_s));
        if self.canary {
            q.push_str("&canary=1");
        }
        if self.full {
            q.push_str("&full=1");
        }
        q
    }

    /// Reads a query string; missing or unreadable values take their defaults, and the
    /// wait is capped at [`MAX_WAIT_S`].
    pub fn from_query(query: &str) -> Poll {
        let param = |name: &str| query.split('&').find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='));
        let number = |name: &str| param(name).and_then(|v| v.parse::<u64>().ok());
        Poll {
            have: number("have").unwrap_or(0),
            running: number("running"),
            wait_s: number("wait").unwrap_or(DEFAULT_WAIT_S).min(MAX_WAIT_S),
            canary: param("canary") == Some("1"),
            full: param("full") == Some("1"),
        }
    }
}

/// A node's answer to a version it was given: applied (ACK) or refused with the reason
/// (NACK), and the version it runs now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Ack {
    /// The version it was given.
    pub version: u64,
    /// Applied.
    pub ok: bool,
    /// Why not.
    #[serde(default)]
    pub error: Option<String>,
    /// The version it runs now.
    #[serde(default)]
    pub running: u64,
}

impl Ack {
    /// `/v1/nodes/<node>/<lane>/ack`.
    pub fn path(node: &str, lane: Lane) -> String {
        format!("/v1/nodes/{node}/{}/ack", lane.as_str())
    }
}

/// `/v1/nodes/<node>/report`.
pub fn report_path(node: &str) -> String {
    format!("/v1/nodes/{node}/report")
}

/// Where nodes send their closed usage windows.
pub const USAGE_PATH: &str = "/v1/usage";

/// Usage windows of one node, in sequence order.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UsageBatch {
    /// The windows.
    pub windows: Vec<crate::usage::Window>,
}

/// What the intake did with a [`UsageBatch`]: every window is now applied exactly once.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageAck {
    /// Windows added to the totals now.
    pub applied: u64,
    /// Windows applied before (a re-send): nothing changed.
    pub duplicates: u64,
    /// Sequence numbers of the batch's nodes the store never got, below the highest it
    /// has: the node sends them again from its spool.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub missing: Vec<Missing>,
}

/// `/v1/nodes/<node>/usage/counters`: where a node reports its own count of a period.
pub fn counters_path(node: &str) -> String {
    format!("/v1/nodes/{node}/usage/counters")
}

/// A run of one node's sequence numbers the usage store lacks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Missing {
    /// The node.
    pub node: String,
    /// The first missing number.
    pub from: u64,
    /// The last, inclusive.
    pub to: u64,
}

/// `/v1/modules/<hex>`: a filter module by the hex of its SHA-256.
pub fn module_path(hex: &str) -> String {
    format!("/v1/modules/{hex}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poll_reads_back_what_it_writes() {
        let p = Poll { have: 7, running: Some(6), wait_s: 25, canary: true, full: true };
        assert_eq!(p.query(), "have=7&running=6&wait=25&canary=1&full=1");
        assert_eq!(Poll::from_query(&p.query()), p);
        let plain = Poll { have: 3, ..Poll::default() };
        assert_eq!(plain.query(), "have=3&wait=25");
        assert_eq!(Poll::from_query(&plain.query()), plain);
        assert_eq!(Poll::from_query("wait=999&have=x").wait_s, MAX_WAIT_S);
        assert_eq!(Poll::from_query("wait=999&have=x").have, 0);
        assert_eq!(Poll::path("n-1", Lane::Credentials), "/v1/nodes/n-1/credentials");
    }

    #[test]
    fn lanes_and_acks_have_one_spelling() {
        for lane in Lane::ALL {
            assert_eq!(Lane::parse(lane.as_str()), Some(lane));
        }
        assert_eq!(Lane::parse("routes"), None);
        let nack = Ack { version: 4, ok: false, error: Some("bad".into()), running: 3 };
        let text = serde_json::to_string(&nack).unwrap();
        assert_eq!(text, r#"{"version":4,"ok":false,"error":"bad","running":3}"#);
        assert_eq!(serde_json::from_str::<Ack>(&text).unwrap(), nack);
        assert_eq!(Ack::path("n", Lane::Snapshot), "/v1/nodes/n/snapshot/ack");
    }
}
