//! The server's state (nodes, lane heads, the rollout, the stores) and what every
//! endpoint shares: its answers as JSON and errors, and request bodies read as JSON.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use serde::{Deserialize, Serialize};
use sha2::Digest as _;
use tokio::sync::watch;

use postern_model::report::RouteCounts;

use super::role::Role;
use crate::rollout::{Rollout, RolloutSettings};
use crate::store::Store;
use crate::usage::{Quotas, UsageStore};

/// A node counts as live while it polled within this long.
pub(super) const LIVE_FOR: Duration = Duration::from_secs(60);
/// A node not heard from for this long is dropped from the maps (status, reports).
pub(super) const FORGET_AFTER: Duration = Duration::from_secs(3600);

/// One admin token.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenEntry {
    /// Who holds it (audited).
    pub name: String,
    /// `platform`, `node`, `node:<name>` or `team:<name>`.
    pub role: Role,
    /// SHA-256 of the token, hex.
    pub sha256: String,
}

/// What a node last told us about one lane.
#[derive(Debug, Clone, Default, Serialize)]
pub struct LaneState {
    /// The version it runs.
    pub version: u64,
    /// The last version it refused, and why.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refused: Option<(u64, String)>,
}

#[derive(Debug, Clone)]
pub(super) struct NodeState {
    pub(super) snapshot: LaneState,
    pub(super) credentials: LaneState,
    pub(super) seen: Instant,
    pub(super) canary: bool,
}

pub(super) struct Server {
    pub(super) store: Store,
    pub(super) repo: PathBuf,
    pub(super) tokens: Vec<TokenEntry>,
    /// Heads by lane as last seen, and a count of rollout stage changes; waiters watch them.
    pub(super) heads: watch::Sender<(u64, u64, u64)>,
    pub(super) nodes: Mutex<BTreeMap<String, NodeState>>,
    /// One publish at a time from this instance (the store orders instances).
    pub(super) publishing: tokio::sync::Mutex<()>,
    pub(super) rollout_settings: RolloutSettings,
    /// The rollout in progress.
    pub(super) rollout: Mutex<Option<Rollout>>,
    /// How the last rollout ended.
    pub(super) last_rollout: Mutex<Option<serde_json::Value>>,
    /// Each node's last report: the version it ran and its route totals.
    pub(super) reports: Mutex<BTreeMap<String, LastReport>>,
    /// The key service's recent changes as deltas (base, version, document): a node
    /// running the base gets the delta instead of the whole table.
    pub(super) deltas: Mutex<std::collections::VecDeque<(u64, u64, Bytes)>>,
    /// See [`ServeSettings::publish_dir`].
    pub(super) publish_dir: Option<PathBuf>,
    /// See [`ServeSettings::usage_db`].
    pub(super) usage: Option<Arc<UsageStore>>,
    /// The HTTP intake's group commit into [`Server::usage`].
    pub(super) intake: Option<crate::usage::Coalescer>,
    /// Quotas, over-quota flags and quota events.
    pub(super) quota: QuotaService,
    /// The Kafka consumer's counters, when it runs.
    pub(super) stream: StreamStats,
    /// Which key speaks for which node's usage.
    pub(super) usage_keys: super::signed::UsageKeys,
}

/// Deltas kept for nodes a few changes behind.
pub(super) const DELTAS_KEPT: usize = 256;

pub(super) type Body = Full<Bytes>;

/// A node's last report: the snapshot version it ran and its route totals.
pub(super) type LastReport = (u64, BTreeMap<String, RouteCounts>);

pub(super) fn json(status: StatusCode, v: &serde_json::Value) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from(v.to_string())));
    *r.status_mut() = status;
    r.headers_mut().insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/json"));
    r
}

pub(super) fn error(status: StatusCode, msg: impl Into<String>) -> Response<Body> {
    json(status, &serde_json::json!({"error": msg.into()}))
}

impl Server {
    pub(super) fn who(&self, req: &Request<Incoming>) -> Option<&TokenEntry> {
        let auth = req.headers().get(http::header::AUTHORIZATION)?.to_str().ok()?;
        let token = auth.strip_prefix("Bearer ")?;
        let digest = hex::encode(sha2::Sha256::digest(token.as_bytes()));
        self.tokens.iter().find(|t| t.sha256.eq_ignore_ascii_case(&digest))
    }
}

/// What a JSON request body of the API weighs at most (usage intake aside).
pub(super) const JSON_BODY_LIMIT: usize = 64 * 1024;

/// A request body of at most `limit` bytes, as JSON; a 400 naming what is wrong otherwise.
pub(super) async fn read_json<T: serde::de::DeserializeOwned>(
    req: Request<Incoming>,
    limit: usize,
) -> Result<T, Response<Body>> {
    let body = Limited::new(req.into_body(), limit)
        .collect()
        .await
        .map_err(|e| error(StatusCode::BAD_REQUEST, format!("body: {e} (at most {limit} bytes)")))?
        .to_bytes();
    serde_json::from_slice(&body).map_err(|e| error(StatusCode::BAD_REQUEST, format!("body: {e}")))
}

/// Quotas compiled as of (snapshot head, credentials head).
pub(super) type QuotaCache = Option<((u64, u64), Arc<Quotas>)>;

/// The quota service's state in a server.
#[derive(Debug, Default)]
pub(super) struct QuotaService {
    /// The quotas as of (snapshot head, credentials head).
    pub(super) quotas: std::sync::Mutex<QuotaCache>,
    /// Woken after every applied batch.
    pub(super) wake: tokio::sync::Notify,
    /// Where quota events are posted.
    pub(super) webhook: Option<Arc<super::quota::Webhook>>,
}

/// What the consumer did, for `GET /v1/usage/stream`.
#[derive(Debug, Default)]
pub(super) struct StreamStats {
    pub(super) running: std::sync::atomic::AtomicBool,
    pub(super) consumed: AtomicU64,
    pub(super) applied: AtomicU64,
    pub(super) duplicates: AtomicU64,
    pub(super) rejected: AtomicU64,
    pub(super) batches: AtomicU64,
    pub(super) last_error: Mutex<Option<String>>,
}
