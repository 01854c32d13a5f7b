//! `posternctl serve`: publishes versions from the config repository into the store and
//! delivers them to nodes.
//!
//! Nodes hold a long poll per lane (`GET /v1/nodes/<node>/<lane>?have=N&wait=S`): the
//! answer comes as soon as the lane's head differs from `have`, or after `S` seconds with
//! 204 — the long-lived stream and the periodic poll in one request. A node builds what it
//! got beside its live state, swaps, and ACKs or NACKs (`POST .../ack`); `/v1/status`
//! says who is on what. Publishing (`POST /v1/publish`) compiles the repository with the
//! same compiler as `posternctl compile` and refuses, untouched, anything that fails;
//! `POST /v1/rollback?to=N` publishes version N's contents as a new version. The fast
//! lane (credentials) can wait for every live node's ACK before answering (`?wait_acks=S`);
//! a publish can wait until the first stage's nodes serve the new snapshot, a rollback
//! until every live node does (`?wait=S`, answering who serves it, who is behind and who
//! refused it).
//!
//! A changed snapshot is rolled out in stages (see [`crate::rollout`]): the long poll
//! gives each node the version its stage says, nodes report the compared routes' counts
//! (`POST /v1/nodes/<node>/report`), and a regression re-publishes the old contents as a
//! new version (`auto-revert` in the audit trail). A rollback reaches every node at once
//! and ends any rollout.
//!
//! Every request carries a bearer token; tokens are listed by SHA-256 with a role:
//! `platform` (publish, rollback), `node` (receive, ACK), or `team:<name>` (read status
//! and audit). Every change is audited (who, what, when, version).

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use serde::{Deserialize, Serialize};
use sha2::Digest as _;
use tokio::sync::watch;

use postern_model::protocol::{self, Ack, MAX_WAIT_S, Poll, UsageAck};
use postern_model::report::{Report, RouteCounts, Watch};
use postern_model::usage::Window;

use crate::keyservice::Op;
use crate::rollout::{NodeView, Rollout, RolloutSettings, Step};
use crate::store::{Change, Lane, Store, Version};
use crate::usage::{ApplyError, By, Query, UsageStore};

mod quota;
mod stream;
mod trace;

pub use stream::UsageKafka;

/// A node counts as live while it polled within this long.
const LIVE_FOR: Duration = Duration::from_secs(60);
/// A node not heard from for this long is dropped from the maps (status, reports).
const FORGET_AFTER: Duration = Duration::from_secs(3600);

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

/// Whether a node token may act for `node`: a token bound to a node (`node:<name>`)
/// speaks only for it; an unbound fleet token (`node`) for any.
fn speaks_for(role: &str, node: &str) -> bool {
    match role.strip_prefix("node:") {
        Some(bound) => bound == node,
        None => role == "node",
    }
}
/// How often to look for versions published by another instance.
const STORE_POLL: Duration = Duration::from_millis(250);

/// Serving settings.
#[derive(Debug, Clone)]
pub struct ServeSettings {
    /// The config repository.
    pub repo: PathBuf,
    /// Listen address.
    pub listen: SocketAddr,
    /// Token list (JSON: `[{"name", "role", "sha256"}]`).
    pub tokens: PathBuf,
    /// How snapshots are rolled out.
    pub rollout: RolloutSettings,
    /// Certificate chain and private key (PEM) to serve HTTPS with; plain HTTP without.
    pub tls: Option<(PathBuf, PathBuf)>,
    /// Where every credentials version is also written, signed, as `credentials.json`:
    /// the directory (a shared volume or mounted bucket) nodes poll when their streams
    /// are down.
    pub publish_dir: Option<PathBuf>,
    /// The usage store nodes' windows are applied to (none: the intake answers 503).
    pub usage_db: Option<PathBuf>,
    /// Where quota events (80 % and 100 % of a quota) are posted.
    pub quota_webhook: Option<String>,
    /// The usage stream on Kafka, consumed into the usage store beside the HTTP intake.
    pub usage_kafka: Option<UsageKafka>,
}

/// One admin token.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenEntry {
    /// Who holds it (audited).
    pub name: String,
    /// `platform`, `node` or `team:<name>`.
    pub role: String,
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
struct NodeState {
    snapshot: LaneState,
    credentials: LaneState,
    seen: Instant,
    canary: bool,
}

struct Server {
    store: Store,
    repo: PathBuf,
    tokens: Vec<TokenEntry>,
    /// Heads by lane as last seen, and a count of rollout stage changes; waiters watch them.
    heads: watch::Sender<(u64, u64, u64)>,
    nodes: Mutex<BTreeMap<String, NodeState>>,
    /// One publish at a time from this instance (the store orders instances).
    publishing: tokio::sync::Mutex<()>,
    rollout_settings: RolloutSettings,
    /// The rollout in progress.
    rollout: Mutex<Option<Rollout>>,
    /// How the last rollout ended.
    last_rollout: Mutex<Option<serde_json::Value>>,
    /// Each node's last report: the version it ran and its route totals.
    reports: Mutex<BTreeMap<String, LastReport>>,
    /// The key service's recent changes as deltas (base, version, document): a node
    /// running the base gets the delta instead of the whole table.
    deltas: Mutex<std::collections::VecDeque<(u64, u64, Bytes)>>,
    /// See [`ServeSettings::publish_dir`].
    publish_dir: Option<PathBuf>,
    /// See [`ServeSettings::usage_db`].
    usage: Option<Arc<UsageStore>>,
    /// Quotas, over-quota flags and quota events.
    quota: quota::QuotaService,
    /// The Kafka consumer's counters, when it runs.
    stream: stream::StreamStats,
}

/// A usage batch's body at most: nodes send 4 MiB batches, or one window when a window is
/// larger (a busy node's 10 s of distinct callers × routes).
const USAGE_BODY_LIMIT: usize = 64 << 20;

/// A usage query's parameters, decoded.
fn usage_params(query: &str) -> Result<Vec<(String, String)>, String> {
    query
        .split('&')
        .filter(|kv| !kv.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            let v = crate::usage::query_unescape(v).ok_or_else(|| format!("{k}: not percent-encoded UTF-8"))?;
            Ok((k.to_owned(), v))
        })
        .collect()
}

/// Deltas kept for nodes a few changes behind.
const DELTAS_KEPT: usize = 256;

type Body = Full<Bytes>;

/// A node's last report: the snapshot version it ran and its route totals.
type LastReport = (u64, BTreeMap<String, RouteCounts>);

fn json(status: StatusCode, v: &serde_json::Value) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from(v.to_string())));
    *r.status_mut() = status;
    r.headers_mut().insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/json"));
    r
}

fn error(status: StatusCode, msg: impl Into<String>) -> Response<Body> {
    json(status, &serde_json::json!({"error": msg.into()}))
}

/// Open connections the control plane's HTTP server holds at most (two long polls per
/// node, plus operators).
const MAX_CONNECTIONS: usize = 4096;

/// Runs the control plane until the process is stopped.
pub async fn serve(settings: ServeSettings, store: Store) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(&settings.tokens)
        .map_err(|e| anyhow::anyhow!("cannot read tokens {}: {e}", settings.tokens.display()))?;
    let tokens: Vec<TokenEntry> =
        serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("tokens {}: {e}", settings.tokens.display()))?;
    for t in &tokens {
        let role_ok = t.role == "platform"
            || t.role == "node"
            || t.role.strip_prefix("node:").is_some_and(|n| !n.is_empty())
            || t.role.strip_prefix("team:").is_some_and(|n| !n.is_empty());
        anyhow::ensure!(role_ok, "token {}: role must be platform, node:<name>, node or team:<name>", t.name);
        anyhow::ensure!(
            t.sha256.len() == 64 && hex::decode(&t.sha256).is_ok(),
            "token {}: sha256 must be 64 hex digits",
            t.name
        );
    }
    let heads = (
        store.head(Lane::Snapshot).await?.map_or(0, |v| v.number),
        store.head(Lane::Credentials).await?.map_or(0, |v| v.number),
        0,
    );
    let usage = match &settings.usage_db {
        Some(path) => {
            let path = path.clone();
            let store = tokio::task::spawn_blocking(move || UsageStore::open(&path)).await??;
            eprintln!("posternctl serve: usage store {}", store.path().display());
            Some(Arc::new(store))
        }
        None => None,
    };
    let server = Arc::new(Server {
        store,
        usage,
        repo: settings.repo,
        tokens,
        heads: watch::Sender::new(heads),
        nodes: Mutex::new(BTreeMap::new()),
        publishing: tokio::sync::Mutex::new(()),
        rollout_settings: settings.rollout,
        rollout: Mutex::new(None),
        last_rollout: Mutex::new(None),
        reports: Mutex::new(BTreeMap::new()),
        deltas: Mutex::new(std::collections::VecDeque::new()),
        publish_dir: settings.publish_dir,
        quota: quota::QuotaService::new(settings.quota_webhook),
        stream: stream::StreamStats::default(),
    });
    let tls = match &settings.tls {
        Some((cert, key)) => {
            Some(tokio_rustls::TlsAcceptor::from(postern_model::tls::server_config(cert, key, &[b"http/1.1"], None)?))
        }
        None => None,
    };
    server.write_published().await;
    // Room for a fleet of nodes reconnecting at once (`TcpListener::bind` asks for 128).
    let listener = postern_model::net::listen(settings.listen, postern_model::net::BACKLOG)?;
    let addr = listener.local_addr()?;
    eprintln!("posternctl serve: listening on {addr}");
    outln!("{addr}");
    {
        let server = server.clone();
        tokio::spawn(async move { server.watch_store().await });
    }
    {
        let server = server.clone();
        tokio::spawn(async move { server.drive_rollouts().await });
    }
    if server.usage.is_some() {
        tokio::spawn(server.clone().flag_loop());
        tokio::spawn(server.clone().reconcile_loop());
        if let Some(url) = server.quota.webhook.clone() {
            tokio::spawn(server.clone().webhook_loop(url));
        }
        if let Some(kafka) = settings.usage_kafka {
            let consumer = stream::consumer(&kafka).await?;
            eprintln!("posternctl serve: consuming usage from Kafka topic {} at {}", kafka.topic, kafka.brokers);
            tokio::spawn(server.clone().consume_usage(consumer));
        }
    } else if settings.usage_kafka.is_some() {
        anyhow::bail!("--usage-kafka needs a usage store (--usage-db)");
    }
    // Bounded: open connections (every node holds two long polls), the time a request
    // head may take, the wait between requests on a kept-alive connection (both the
    // header timeout), and request bodies (64 KiB, `read_json`).
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            drop(stream);
            continue;
        };
        let server = server.clone();
        let tls = tls.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| {
                let server = server.clone();
                async move { Ok::<_, std::convert::Infallible>(server.handle(req).await) }
            });
            let http = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(Duration::from_secs(10))
                .max_buf_size(64 * 1024)
                .clone();
            match tls {
                // The handshake has the header timeout's bound too.
                Some(tls) => {
                    if let Ok(Ok(stream)) = tokio::time::timeout(Duration::from_secs(10), tls.accept(stream)).await {
                        let _ = http.serve_connection(hyper_util::rt::TokioIo::new(stream), svc).await;
                    }
                }
                None => {
                    let _ = http.serve_connection(hyper_util::rt::TokioIo::new(stream), svc).await;
                }
            }
            drop(slot);
        });
    }
}

impl Server {
    /// Keeps `<publish_dir>/credentials.json` at the credentials head, signed as stored:
    /// written on every new head (from this instance or another), retried every 5 s
    /// while the directory cannot be written.
    async fn write_published(self: &Arc<Self>) {
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
                                Err(e) => eprintln!("posternctl serve: publish dir: {e}"),
                            }
                        }
                        Ok(None) => {}
                        Err(e) => eprintln!("posternctl serve: publish dir: cannot read the credentials head: {e}"),
                    }
                }
                if let Ok(Err(_)) = tokio::time::timeout(Duration::from_secs(5), heads.changed()).await {
                    return;
                }
            }
        });
    }

    /// Picks up versions another instance published.
    async fn watch_store(&self) {
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

    fn who(&self, req: &Request<Incoming>) -> Option<&TokenEntry> {
        let auth = req.headers().get(http::header::AUTHORIZATION)?.to_str().ok()?;
        let token = auth.strip_prefix("Bearer ")?;
        let digest = hex::encode(sha2::Sha256::digest(token.as_bytes()));
        self.tokens.iter().find(|t| t.sha256.eq_ignore_ascii_case(&digest))
    }

    async fn handle(self: Arc<Self>, req: Request<Incoming>) -> Response<Body> {
        let Some(who) = self.who(&req).cloned() else {
            return error(StatusCode::UNAUTHORIZED, "a valid bearer token is required");
        };
        let path = req.uri().path().to_owned();
        let query = req.uri().query().unwrap_or_default().to_owned();
        let param = |name: &str| -> Option<String> {
            query.split('&').find_map(|kv| kv.strip_prefix(name)?.strip_prefix('=').map(str::to_owned))
        };
        let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        let role = who.role.as_str();
        let is_node = role == "node" || role.starts_with("node:");
        if let ["v1", "nodes", node, ..] = parts.as_slice()
            && is_node
            && !speaks_for(role, node)
        {
            return error(StatusCode::FORBIDDEN, format!("this token speaks for another node, not {node}"));
        }
        match (req.method().clone(), parts.as_slice()) {
            (Method::GET, ["v1", "nodes", node, lane]) if is_node => {
                let Some(kind) = Lane::parse(lane) else { return error(StatusCode::NOT_FOUND, "no such lane") };
                let poll = Poll::from_query(&query);
                // What the node runs now (it may have booted from disk, with no ACK).
                if let Some(running) = poll.running {
                    self.record(node, kind, |lane| lane.version = running);
                }
                if poll.canary {
                    self.set_canary(node);
                }
                self.poll(node, kind, poll.have, Duration::from_secs(poll.wait_s), poll.full).await
            }
            (Method::POST, ["v1", "nodes", node, lane, "ack"]) if is_node => {
                let Some(kind) = Lane::parse(lane) else { return error(StatusCode::NOT_FOUND, "no such lane") };
                let node = (*node).to_owned();
                match read_json::<Ack>(req, JSON_BODY_LIMIT).await {
                    Ok(ack) => self.ack(&node, kind, ack),
                    Err(e) => e,
                }
            }
            (Method::GET, ["v1", "nodes", node, "usage", "missing"]) if is_node => {
                let node = (*node).to_owned();
                self.usage_read(move |u| {
                    u.missing(&node).map(|missing| {
                        serde_json::to_value(protocol::UsageAck { missing, ..Default::default() }).unwrap_or_default()
                    })
                })
                .await
            }
            (Method::PUT, ["v1", "nodes", node, "usage", "counters"]) if is_node => {
                let node = (*node).to_owned();
                self.usage_counters(node, req).await
            }
            (Method::POST, ["v1", "nodes", node, "report"]) if is_node => {
                let node = (*node).to_owned();
                match read_json::<Report>(req, JSON_BODY_LIMIT).await {
                    Ok(report) => {
                        let watch = self.report(&node, report);
                        json(StatusCode::OK, &serde_json::to_value(watch).unwrap_or_default())
                    }
                    Err(e) => e,
                }
            }
            (Method::GET, ["v1", "modules", hex]) if is_node || role == "platform" => {
                match self.store.module(hex).await {
                    Ok(Some(b)) => Response::new(Full::new(Bytes::from(b))),
                    Ok(None) => error(StatusCode::NOT_FOUND, "no such module"),
                    Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
                }
            }
            (Method::POST, ["v1", "keys"]) if role == "platform" => {
                self.key_request(&who.name, req, param("wait_acks"), Op::Create).await
            }
            (Method::POST, ["v1", "keys", "revoke"]) if role == "platform" => {
                self.key_request(&who.name, req, param("wait_acks"), Op::Revoke).await
            }
            (Method::POST, ["v1", "keys", id, "rotate"]) if role == "platform" => {
                let id = (*id).to_owned();
                self.key_request(&who.name, req, param("wait_acks"), |b| Op::Rotate(id, b)).await
            }
            (Method::POST, ["v1", "deny"]) if role == "platform" => {
                self.key_request(&who.name, req, param("wait_acks"), Op::Deny).await
            }
            (Method::POST, ["v1", "trace"]) if role == "platform" => {
                let wait = Duration::from_secs(
                    param("wait_acks").and_then(|v| v.parse().ok()).unwrap_or(5u64).min(MAX_WAIT_S),
                );
                match read_json::<trace::TraceBody>(req, JSON_BODY_LIMIT).await {
                    Ok(body) => self.debug_trace(&who.name, body, wait).await,
                    Err(e) => e,
                }
            }
            (Method::POST, ["v1", "usage"]) if is_node => self.usage_intake(role, req).await,
            (Method::GET, ["v1", "usage"]) if !is_node => self.usage_query(role.strip_prefix("team:"), &query).await,
            (Method::GET, ["v1", "usage", "totals"]) if role == "platform" => self.usage_totals(&query).await,
            (Method::POST, ["v1", "usage", "reconcile"]) if role == "platform" => {
                let Some(period) = param("period").filter(|p| postern_model::usage::parse_month(p).is_some()) else {
                    return error(StatusCode::BAD_REQUEST, "reconcile needs ?period=YYYY-MM");
                };
                let now = postern_model::disk::unix_now();
                self.usage_read(move |u| {
                    Ok(u.reconcile(&period, now)?
                        .map(|r| serde_json::to_value(r).unwrap_or_default())
                        .unwrap_or_default())
                })
                .await
            }
            (Method::GET, ["v1", "usage", "export"]) if role == "platform" => {
                let Some(period) = param("period") else {
                    return error(StatusCode::BAD_REQUEST, "export needs ?period=YYYY-MM");
                };
                self.usage_export(period).await
            }
            (Method::GET, ["v1", "usage", "events"]) if role == "platform" => {
                let after = param("after").and_then(|v| v.parse().ok()).unwrap_or(0u64);
                self.usage_read(move |u| u.events(after, 1000, None).map(|e| serde_json::json!({ "events": e }))).await
            }
            (Method::GET, ["v1", "usage", "flags"]) if role == "platform" => {
                let now = postern_model::disk::unix_now();
                self.usage_read(move |u| u.live_flags(now).map(|f| serde_json::json!({ "over_quota": f }))).await
            }
            (Method::GET, ["v1", "usage", "stream"]) if role == "platform" => {
                json(StatusCode::OK, &self.stream.to_json())
            }
            (Method::GET, ["v1", "usage", "nodes"]) if role == "platform" => {
                self.usage_read(|u| u.nodes().map(|n| serde_json::json!({ "nodes": n }))).await
            }
            (Method::GET, ["v1", "status"]) if !is_node => self.status(role.strip_prefix("team:")).await,
            (Method::GET, ["v1", "audit"]) if !is_node => match self.store.audit().await {
                Ok(mut a) => {
                    // A team reads only what its own tokens did.
                    if role.starts_with("team:") {
                        let ours: Vec<&str> =
                            self.tokens.iter().filter(|t| t.role == role).map(|t| t.name.as_str()).collect();
                        a.retain(|e| ours.contains(&e.who.as_str()));
                    }
                    json(StatusCode::OK, &serde_json::to_value(a).unwrap_or_default())
                }
                Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
            },
            (Method::POST, ["v1", "publish"]) if role == "platform" || role.starts_with("team:") => {
                let secs = |name| {
                    Duration::from_secs(param(name).and_then(|v| v.parse().ok()).unwrap_or(0u64).min(MAX_WAIT_S))
                };
                self.publish(&who.name, role.strip_prefix("team:"), secs("wait_acks"), secs("wait")).await
            }
            (Method::POST, ["v1", "rollback"]) if role == "platform" => {
                let Some(to) = param("to").and_then(|v| v.parse::<u64>().ok()) else {
                    return error(StatusCode::BAD_REQUEST, "rollback needs ?to=<version>");
                };
                let wait = param("wait").and_then(|v| v.parse().ok()).unwrap_or(0u64).min(MAX_WAIT_S);
                self.rollback(&who.name, to, Duration::from_secs(wait)).await
            }
            (_, ["v1", ..]) => error(StatusCode::FORBIDDEN, format!("role {role} may not {} {path}", req.method())),
            _ => error(StatusCode::NOT_FOUND, "no such endpoint"),
        }
    }

    /// `POST /v1/usage`: a node's closed windows, applied exactly once. Every window must
    /// be well formed and the token's own node's; otherwise nothing is applied.
    async fn usage_intake(&self, role: &str, req: Request<Incoming>) -> Response<Body> {
        let Some(store) = self.usage.clone() else {
            return error(StatusCode::SERVICE_UNAVAILABLE, "this control plane keeps no usage store (--usage-db)");
        };
        let body = match Limited::new(req.into_body(), USAGE_BODY_LIMIT).collect().await {
            Ok(b) => b.to_bytes(),
            Err(e) => return error(StatusCode::BAD_REQUEST, format!("body: {e} (at most {USAGE_BODY_LIMIT} bytes)")),
        };
        let batch: protocol::UsageBatch = match serde_json::from_slice(&body) {
            Ok(b) => b,
            Err(e) => return error(StatusCode::BAD_REQUEST, format!("body: {e}")),
        };
        for w in &batch.windows {
            if let Err(e) = w.check() {
                return error(StatusCode::BAD_REQUEST, e.to_string());
            }
            if !speaks_for(role, &w.node) {
                return error(StatusCode::FORBIDDEN, format!("this token speaks for another node, not {}", w.node));
            }
        }
        match self.apply_usage(store, batch.windows).await {
            Ok(ack) => json(StatusCode::OK, &serde_json::to_value(ack).unwrap_or_default()),
            Err(e @ ApplyError::Conflict { .. }) => {
                eprintln!("posternctl serve: {e}");
                error(StatusCode::CONFLICT, e.to_string())
            }
            Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        }
    }

    /// `PUT /v1/nodes/<node>/usage/counters`: the node's own counts of a period complete
    /// on it, for the reconciler; 204 once stored.
    async fn usage_counters(&self, node: String, req: Request<Incoming>) -> Response<Body> {
        let Some(store) = self.usage.clone() else {
            return error(StatusCode::SERVICE_UNAVAILABLE, "this control plane keeps no usage store (--usage-db)");
        };
        let counters: postern_model::usage::NodeCounters = match read_json(req, USAGE_BODY_LIMIT).await {
            Ok(c) => c,
            Err(r) => return r,
        };
        if counters.node != node {
            return error(StatusCode::BAD_REQUEST, format!("counters of node {} sent for node {node}", counters.node));
        }
        if let Err(e) = counters.check() {
            return error(StatusCode::BAD_REQUEST, e);
        }
        let now = postern_model::disk::unix_now();
        match tokio::task::spawn_blocking(move || store.put_counters(&counters, now)).await {
            Ok(Ok(())) => {
                let mut r = Response::new(Full::new(Bytes::new()));
                *r.status_mut() = StatusCode::NO_CONTENT;
                r
            }
            Ok(Err(e)) => error(StatusCode::SERVICE_UNAVAILABLE, format!("usage store: {e}")),
            Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        }
    }

    /// Applies checked windows (from the intake or the Kafka stream) in one transaction,
    /// with the quotas as published now, and wakes the flag publisher.
    async fn apply_usage(&self, store: Arc<UsageStore>, windows: Vec<Window>) -> Result<UsageAck, ApplyError> {
        let quotas = self.quotas().await.map_err(|e| ApplyError::Unavailable(format!("quotas: {e}")))?;
        let now = postern_model::disk::unix_now();
        let ack = tokio::task::spawn_blocking(move || store.apply(&windows, now, &quotas))
            .await
            .map_err(|e| ApplyError::Unavailable(e.to_string()))??;
        self.quota.wake.notify_one();
        Ok(ack)
    }

    /// Runs `f` on the usage store off the async workers.
    async fn usage_read(
        &self,
        f: impl FnOnce(&UsageStore) -> rusqlite::Result<serde_json::Value> + Send + 'static,
    ) -> Response<Body> {
        let Some(store) = self.usage.clone() else {
            return error(StatusCode::SERVICE_UNAVAILABLE, "this control plane keeps no usage store (--usage-db)");
        };
        match tokio::task::spawn_blocking(move || f(&store)).await {
            Ok(Ok(v)) => json(StatusCode::OK, &v),
            Ok(Err(e)) => error(StatusCode::SERVICE_UNAVAILABLE, format!("usage store: {e}")),
            Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        }
    }

    /// `GET /v1/usage?key=&product=&from=&to=&by=route|minute|day`; a team reads only
    /// its own routes' rows.
    async fn usage_query(&self, team: Option<&str>, query: &str) -> Response<Body> {
        let params = match usage_params(query) {
            Ok(p) => p,
            Err(e) => return error(StatusCode::BAD_REQUEST, e),
        };
        let get = |name: &str| params.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
        let Some(by) = By::parse(get("by").as_deref().unwrap_or("route")) else {
            return error(StatusCode::BAD_REQUEST, "by is route, minute or day");
        };
        let now = postern_model::disk::unix_now();
        let time = |name: &str, default: u64| match get(name) {
            None => Ok(default),
            Some(v) => crate::usage::parse_time(&v)
                .ok_or_else(|| format!("{name}: {v:?} is not Unix seconds, YYYY-MM-DD or RFC 3339")),
        };
        let (from, to) = match (time("from", postern_model::usage::month_period(now).1), time("to", now + 60)) {
            (Ok(f), Ok(t)) if f < t => (f, t),
            (Ok(_), Ok(_)) => return error(StatusCode::BAD_REQUEST, "from must be before to"),
            (Err(e), _) | (_, Err(e)) => return error(StatusCode::BAD_REQUEST, e),
        };
        let q = Query { caller: get("key"), product: get("product"), team: team.map(str::to_owned), from, to, by };
        let by_name = get("by").unwrap_or_else(|| "route".into());
        self.usage_read(move |u| {
            let rows = u.query(&q)?;
            Ok(serde_json::json!({
                "from": crate::usage::rfc3339(from),
                "to": crate::usage::rfc3339(to),
                "by": by_name,
                "truncated": rows.len() == crate::usage::MAX_ROWS,
                "rows": rows,
            }))
        })
        .await
    }

    /// `GET /v1/usage/export?period=YYYY-MM`: a final period's billing export, one JSON
    /// line per caller and product; 409 while the period is not final.
    async fn usage_export(&self, period: String) -> Response<Body> {
        let Some(store) = self.usage.clone() else {
            return error(StatusCode::SERVICE_UNAVAILABLE, "this control plane keeps no usage store (--usage-db)");
        };
        match tokio::task::spawn_blocking(move || store.export(&period)).await {
            Ok(Ok(Ok(totals))) => {
                let mut body = String::new();
                for t in totals {
                    body.push_str(&serde_json::to_string(&t).unwrap_or_default());
                    body.push('\n');
                }
                let mut r = Response::new(Full::new(Bytes::from(body)));
                r.headers_mut()
                    .insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/x-ndjson"));
                r
            }
            Ok(Ok(Err(why))) => error(StatusCode::CONFLICT, why),
            Ok(Err(e)) => error(StatusCode::SERVICE_UNAVAILABLE, format!("usage store: {e}")),
            Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        }
    }

    /// `GET /v1/usage/totals?period=YYYY-MM&key=`: billing totals (platform only).
    async fn usage_totals(&self, query: &str) -> Response<Body> {
        let params = match usage_params(query) {
            Ok(p) => p,
            Err(e) => return error(StatusCode::BAD_REQUEST, e),
        };
        let get = |name: &str| params.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
        let period =
            get("period").unwrap_or_else(|| postern_model::usage::month_period(postern_model::disk::unix_now()).0);
        if postern_model::usage::parse_month(&period).is_none() {
            return error(StatusCode::BAD_REQUEST, "period is YYYY-MM");
        }
        let caller = get("key");
        self.usage_read(move |u| {
            let totals = u.totals(&period, caller.as_deref())?;
            Ok(serde_json::json!({ "period": period, "totals": totals }))
        })
        .await
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

    fn set_canary(&self, node: &str) {
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

    async fn poll(&self, node: &str, kind: Lane, have: u64, wait: Duration, full: bool) -> Response<Body> {
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

    fn record(&self, node: &str, kind: Lane, f: impl FnOnce(&mut LaneState)) {
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

    fn ack(&self, node: &str, kind: Lane, ack: Ack) -> Response<Body> {
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
            eprintln!("posternctl serve: node {node} refused {} v{}", kind.as_str(), ack.version);
        }
        json(StatusCode::OK, &serde_json::json!({"ok": true}))
    }

    fn live_nodes(&self) -> Vec<(String, NodeState)> {
        let Ok(nodes) = self.nodes.lock() else { return Vec::new() };
        nodes.iter().filter(|(_, n)| n.seen.elapsed() < LIVE_FOR).map(|(k, n)| (k.clone(), n.clone())).collect()
    }

    fn node_views(&self) -> Vec<NodeView> {
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
    fn report(&self, node: &str, report: Report) -> Watch {
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

    /// Moves the rollout in progress on, ten times a second.
    async fn drive_rollouts(&self) {
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
                        eprintln!("posternctl serve: v{} is on every node", r.to);
                        self.set_last(serde_json::json!({"to": r.to, "from": r.from, "outcome": "done"}));
                    }
                    self.heads.send_modify(|h| h.2 += 1);
                }
                Step::Revert(why) => self.revert(why).await,
            }
        }
    }

    fn take_rollout(&self) -> Option<Rollout> {
        self.rollout.lock().ok().and_then(|mut r| r.take())
    }

    fn set_last(&self, v: serde_json::Value) {
        if let Ok(mut last) = self.last_rollout.lock() {
            *last = Some(v);
        }
    }

    /// Publishes the contents the rollout started from as a new version, on every node.
    async fn revert(&self, why: String) {
        let _one = self.publishing.lock().await;
        let Some(r) = self.take_rollout() else { return };
        eprintln!("posternctl serve: reverting v{}: {why}", r.to);
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
                eprintln!("posternctl serve: cannot publish the revert of v{}: {e}", r.to);
                self.set_last(serde_json::json!({
                    "to": r.to, "from": r.from, "outcome": "revert_failed", "reason": why, "error": e,
                }));
                if let Ok(mut slot) = self.rollout.lock() {
                    *slot = Some(r);
                }
            }
        }
    }

    /// The fleet's versions and the rollout in progress; a team sees the rollout's routes
    /// and their comparisons only for its own routes.
    async fn status(&self, team: Option<&str>) -> Response<Body> {
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

    /// Compiles the repository and publishes whatever changed; a team may publish only
    /// when everything that changed is its own.
    async fn publish(&self, who: &str, team: Option<&str>, wait_acks: Duration, wait: Duration) -> Response<Body> {
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

    /// A key-service request: its JSON body made into `op`, waiting for ACKs up to
    /// `?wait_acks=S` (5 s by default).
    async fn key_request<T: serde::de::DeserializeOwned>(
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

    async fn wait_acks(&self, version: u64, limit: Duration) -> (Vec<String>, Vec<String>) {
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

    async fn rollback(&self, who: &str, to: u64, wait: Duration) -> Response<Body> {
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

fn version_response(v: &Version) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::copy_from_slice(&v.bytes)));
    r.headers_mut().insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/json"));
    if let Ok(h) = http::HeaderValue::from_str(&v.number.to_string()) {
        r.headers_mut().insert("x-postern-version", h);
    }
    r
}

/// What a JSON request body of the API weighs at most (usage intake aside).
const JSON_BODY_LIMIT: usize = 64 * 1024;

/// A request body of at most `limit` bytes, as JSON; a 400 naming what is wrong otherwise.
async fn read_json<T: serde::de::DeserializeOwned>(req: Request<Incoming>, limit: usize) -> Result<T, Response<Body>> {
    let body = Limited::new(req.into_body(), limit)
        .collect()
        .await
        .map_err(|e| error(StatusCode::BAD_REQUEST, format!("body: {e} (at most {limit} bytes)")))?
        .to_bytes();
    serde_json::from_slice(&body).map_err(|e| error(StatusCode::BAD_REQUEST, format!("body: {e}")))
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

/// One request to a control plane, as the CLI makes it, with an optional JSON body.
pub async fn request_with(
    method: &str,
    url: &str,
    token: &str,
    ca: Option<&std::path::Path>,
    body: Option<serde_json::Value>,
) -> anyhow::Result<(StatusCode, Bytes)> {
    let client = postern_model::tls::client(ca)?;
    let body = body.map(|b| Bytes::from(b.to_string())).unwrap_or_default();
    let req = Request::builder()
        .method(method)
        .uri(url)
        .header(http::header::AUTHORIZATION, format!("Bearer {token}"))
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(body))?;
    let resp = tokio::time::timeout(Duration::from_secs(MAX_WAIT_S + 10), client.request(req))
        .await
        .map_err(|_| anyhow::anyhow!("{url}: no answer"))?
        .map_err(|e| anyhow::anyhow!("{url}: {e}"))?;
    let status = resp.status();
    let body = resp.into_body().collect().await.map_err(|e| anyhow::anyhow!("{url}: {e}"))?.to_bytes();
    Ok((status, body))
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

    #[test]
    fn node_tokens_speak_for_their_node() {
        assert!(speaks_for("node:a", "a"));
        assert!(!speaks_for("node:a", "b"));
        assert!(speaks_for("node", "b"));
        assert!(!speaks_for("platform", "a"));
    }
}
