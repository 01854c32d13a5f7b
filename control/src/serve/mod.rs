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
//!
//! ```text
//! mod.rs      starting the server, and each request routed by path and role
//! state.rs    the server's state; JSON answers, errors and bodies
//! role.rs     who a bearer token speaks for
//! nodes.rs    delivery: long polls, ACKs, reports, the published directory
//! publish.rs  publish, rollback, and the waits for ACKs and for serving nodes
//! rollout.rs  the staged rollout moved on, or reverted
//! status.rs   the fleet's versions and the rollout
//! keys.rs     the key service (keys, deny list) on the fast lane
//! trace.rs    per-caller debug tracing
//! usage.rs    the usage intake and queries
//! quota.rs    quotas: flags, the webhook, the reconciler's schedule
//! stream.rs   the usage stream on Kafka
//! client.rs   the CLI's request to a control plane
//! ```

/// Writes one line of the control plane's log (`posternctl serve: ...`), formatted as
/// `format!`; node names, node-supplied errors and anything else in it cannot split it
/// ([`log_line`]).
macro_rules! say {
    ($($arg:tt)*) => {
        eprintln!("{}", $crate::serve::log_line(&format!($($arg)*)))
    };
}

mod client;
mod keys;
mod nodes;
mod publish;
mod quota;
mod role;
mod rollout;
mod signed;
mod state;
mod status;
mod stream;
mod trace;
mod usage;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use tokio::sync::watch;

use postern_model::protocol::{self, Ack, MAX_WAIT_S, Poll};
use postern_model::report::Report;

pub use self::client::request_with;
pub use self::role::Role;
pub use self::state::{LaneState, TokenEntry};
pub use self::stream::UsageKafka;

use self::state::{Body, JSON_BODY_LIMIT, QuotaService, Server, StreamStats, error, json, read_json};
use crate::keyservice::Op;
use crate::rollout::RolloutSettings;
use crate::store::{Lane, Store};
use crate::usage::{Decision, UsageStore};

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
    /// The usage store nodes' windows are applied to: a SQLite file's path or a
    /// `postgres://` URL (none: the intake answers 503).
    pub usage_db: Option<String>,
    /// Where quota events (80 % and 100 % of a quota) are posted, and how.
    pub quota_webhook: Option<QuotaWebhook>,
    /// The usage stream on Kafka, consumed into the usage store beside the HTTP intake.
    pub usage_kafka: Option<UsageKafka>,
    /// The nodes' usage keys (JSON: node → `ed25519:<hex>` or a list): once given, usage
    /// is taken only signed by its node's key.
    pub usage_node_keys: Option<PathBuf>,
}

/// Open connections the control plane's HTTP server holds at most (two long polls per
/// node, plus operators).
const MAX_CONNECTIONS: usize = 4096;

/// The quota webhook: its URL, the certificates an `https://` one is trusted by, and the
/// secret its events are signed with.
#[derive(Debug, Clone)]
pub struct QuotaWebhook {
    /// `http://` or `https://`.
    pub url: String,
    /// PEM certificates to trust (required for `https://`: there is no implicit store).
    pub ca: Option<PathBuf>,
    /// The signing secret's file (`whsec_<base64>` or raw bytes).
    pub secret_file: Option<PathBuf>,
}

/// Runs the control plane until the process is stopped.
pub async fn serve(settings: ServeSettings, store: Store) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(&settings.tokens)
        .map_err(|e| anyhow::anyhow!("cannot read tokens {}: {e}", settings.tokens.display()))?;
    let tokens: Vec<TokenEntry> =
        serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("tokens {}: {e}", settings.tokens.display()))?;
    for t in &tokens {
        anyhow::ensure!(
            t.sha256.len() == 64 && hex::decode(&t.sha256).is_ok(),
            "token {}: sha256 must be 64 hex digits",
            t.name
        );
    }
    let usage_keys = signed::UsageKeys::load(settings.usage_node_keys.as_deref())?;
    let heads = (
        store.head(Lane::Snapshot).await?.map_or(0, |v| v.number),
        store.head(Lane::Credentials).await?.map_or(0, |v| v.number),
        0,
    );
    let usage = match &settings.usage_db {
        Some(spec) => {
            let spec = spec.clone();
            let store = tokio::task::spawn_blocking(move || UsageStore::open_spec(&spec)).await??;
            say!("usage store {}", store.location());
            Some(Arc::new(store))
        }
        None => None,
    };
    let intake = usage.clone().map(crate::usage::Coalescer::start);
    let webhook = settings.quota_webhook.as_ref().map(quota::Webhook::open).transpose()?.map(Arc::new);
    let server = Arc::new(Server {
        store,
        usage,
        intake,
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
        quota: QuotaService::new(webhook),
        stream: StreamStats::default(),
        usage_keys,
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
    say!("listening on {addr}");
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
        if let Some(hook) = server.quota.webhook.clone() {
            tokio::spawn(server.clone().webhook_loop(hook));
        }
        if let Some(kafka) = settings.usage_kafka {
            let consumer = stream::consumer(&kafka).await?;
            say!("consuming usage from Kafka topic {} at {}", kafka.topic, kafka.brokers);
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

/// One request's caller and query, as the endpoint groups read them.
struct Call<'a> {
    /// The caller's token.
    who: &'a TokenEntry,
    /// The request's path.
    path: &'a str,
    /// The request's query string (empty without one).
    query: &'a str,
}

impl Call<'_> {
    /// The caller's role.
    fn role(&self) -> &Role {
        &self.who.role
    }

    /// The first value of the query parameter `name`.
    fn param(&self, name: &str) -> Option<String> {
        self.query.split('&').find_map(|kv| kv.strip_prefix(name)?.strip_prefix('=').map(str::to_owned))
    }

    /// The seconds given in the query parameter `name` (else `default`), at most [`MAX_WAIT_S`].
    fn wait(&self, name: &str, default: u64) -> Duration {
        Duration::from_secs(self.param(name).and_then(|v| v.parse().ok()).unwrap_or(default).min(MAX_WAIT_S))
    }

    /// The answer when no endpoint of the path admits the caller's role: 403 under
    /// `/v1/`, else 404.
    fn refused(&self, method: &Method, parts: &[&str]) -> Response<Body> {
        match parts {
            ["v1", ..] => error(StatusCode::FORBIDDEN, format!("role {} may not {method} {}", self.role(), self.path)),
            _ => error(StatusCode::NOT_FOUND, "no such endpoint"),
        }
    }
}

impl Server {
    /// One request: the caller by its bearer token, then the endpoint by path, method and
    /// role, in groups: delivery to nodes, keys and tracing, usage, and the repository's
    /// versions.
    async fn handle(self: Arc<Self>, req: Request<Incoming>) -> Response<Body> {
        let Some(who) = self.who(&req).cloned() else {
            return error(StatusCode::UNAUTHORIZED, "a valid bearer token is required");
        };
        let path = req.uri().path().to_owned();
        let query = req.uri().query().unwrap_or_default().to_owned();
        let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        let call = Call { who: &who, path: &path, query: &query };
        if let ["v1", "nodes", node, ..] = parts.as_slice()
            && call.role().is_node()
            && !call.role().speaks_for(node)
        {
            return error(StatusCode::FORBIDDEN, format!("this token speaks for another node, not {node}"));
        }
        match parts.as_slice() {
            ["v1", "nodes" | "modules", ..] => self.delivery_endpoint(&call, &parts, req).await,
            ["v1", "keys" | "deny" | "trace", ..] => self.key_endpoint(&call, &parts, req).await,
            ["v1", "usage", ..] => self.usage_endpoint(&call, &parts, req).await,
            _ => self.version_endpoint(&call, &parts, req).await,
        }
    }

    /// `/v1/nodes/<node>/...` and `/v1/modules/<hex>`: long polls, ACKs, usage counters,
    /// reports, and the filter modules.
    async fn delivery_endpoint(&self, call: &Call<'_>, parts: &[&str], req: Request<Incoming>) -> Response<Body> {
        let role = call.role();
        let is_node = role.is_node();
        match (req.method().clone(), parts) {
            (Method::GET, ["v1", "nodes", node, lane]) if is_node => {
                let Some(kind) = Lane::parse(lane) else { return error(StatusCode::NOT_FOUND, "no such lane") };
                let poll = Poll::from_query(call.query);
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
            (Method::GET, ["v1", "modules", hex]) if is_node || *role == Role::Platform => {
                match self.store.module(hex).await {
                    Ok(Some(b)) => Response::new(Full::new(Bytes::from(b))),
                    Ok(None) => error(StatusCode::NOT_FOUND, "no such module"),
                    Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
                }
            }
            (method, _) => call.refused(&method, parts),
        }
    }

    /// `/v1/keys...`, `/v1/deny` and `/v1/trace`: the key service and per-caller tracing,
    /// for the platform.
    async fn key_endpoint(&self, call: &Call<'_>, parts: &[&str], req: Request<Incoming>) -> Response<Body> {
        let who = call.who;
        let platform = *call.role() == Role::Platform;
        match (req.method().clone(), parts) {
            (Method::POST, ["v1", "keys"]) if platform => {
                self.key_request(&who.name, req, call.param("wait_acks"), Op::Create).await
            }
            (Method::POST, ["v1", "keys", "revoke"]) if platform => {
                self.key_request(&who.name, req, call.param("wait_acks"), Op::Revoke).await
            }
            (Method::POST, ["v1", "keys", id, "rotate"]) if platform => {
                let id = (*id).to_owned();
                self.key_request(&who.name, req, call.param("wait_acks"), |b| Op::Rotate(id, b)).await
            }
            (Method::POST, ["v1", "deny"]) if platform => {
                self.key_request(&who.name, req, call.param("wait_acks"), Op::Deny).await
            }
            (Method::POST, ["v1", "trace"]) if platform => {
                let wait = call.wait("wait_acks", 5);
                match read_json::<trace::TraceBody>(req, JSON_BODY_LIMIT).await {
                    Ok(body) => self.debug_trace(&who.name, body, wait).await,
                    Err(e) => e,
                }
            }
            (method, _) => call.refused(&method, parts),
        }
    }

    /// `/v1/usage...`: the intake from nodes, queries, reconciliation, export, events,
    /// quota flags, the stream's state, refusals and the nodes heard from.
    async fn usage_endpoint(&self, call: &Call<'_>, parts: &[&str], req: Request<Incoming>) -> Response<Body> {
        let role = call.role();
        let platform = *role == Role::Platform;
        match (req.method().clone(), parts) {
            (Method::POST, ["v1", "usage"]) if role.is_node() => self.usage_intake(role, req).await,
            (Method::GET, ["v1", "usage"]) if !role.is_node() => self.usage_query(role.team(), call.query).await,
            (Method::GET, ["v1", "usage", "totals"]) if platform => self.usage_totals(call.query).await,
            (Method::POST, ["v1", "usage", "reconcile"]) if platform => {
                let Some(period) = call.param("period").filter(|p| postern_model::usage::parse_month(p).is_some())
                else {
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
            (Method::GET, ["v1", "usage", "export"]) if platform => {
                let Some(period) = call.param("period") else {
                    return error(StatusCode::BAD_REQUEST, "export needs ?period=YYYY-MM");
                };
                self.usage_export(period).await
            }
            (Method::GET, ["v1", "usage", "events"]) if platform => {
                let after = call.param("after").and_then(|v| v.parse().ok()).unwrap_or(0u64);
                self.usage_read(move |u| u.events(after, 1000, None).map(|e| serde_json::json!({ "events": e }))).await
            }
            (Method::GET, ["v1", "usage", "flags"]) if platform => {
                let now = postern_model::disk::unix_now();
                self.usage_read(move |u| u.live_flags(now).map(|f| serde_json::json!({ "over_quota": f }))).await
            }
            (Method::GET, ["v1", "usage", "stream"]) if platform => json(StatusCode::OK, &self.stream.to_json()),
            (Method::GET, ["v1", "usage", "advice"]) if !role.is_node() => {
                self.timeout_advice(role.team(), call.param("last").as_deref()).await
            }
            (Method::POST, ["v1", "usage", "flags", "lift"]) if platform => {
                let caller = match (call.param("key"), call.param("app")) {
                    (Some(k), None) => (k, postern_model::usage::CallerKind::Key),
                    (None, Some(a)) => (a, postern_model::usage::CallerKind::App),
                    _ => return error(StatusCode::BAD_REQUEST, "lift needs ?key=<key id> or ?app=<client_id>"),
                };
                self.lift_flags(&call.who.name, caller, call.param("product"), call.wait("wait_acks", 5)).await
            }
            (Method::GET, ["v1", "usage", "refusals"]) if platform => {
                self.usage_read(|u| u.refusals().map(|r| serde_json::json!({ "refusals": r }))).await
            }
            (Method::POST, ["v1", "usage", "nodes", "retire"]) if platform => {
                let node = call.param("node").and_then(|n| crate::usage::percent_unescape(&n));
                let Some(node) = node.filter(|n| !n.is_empty() && n.len() <= 128) else {
                    return error(StatusCode::BAD_REQUEST, "retire needs ?node=<node>[&after=<window number>]");
                };
                let after = match call.param("after").map(|a| a.parse::<u64>()) {
                    None => None,
                    Some(Ok(a)) => Some(a),
                    Some(Err(_)) => return error(StatusCode::BAD_REQUEST, "after is a window number"),
                };
                self.retire_node(&call.who.name, node, after).await
            }
            (Method::GET, ["v1", "usage", "nodes", "retired"]) if platform => {
                self.usage_read(|u| u.retired().map(|r| serde_json::json!({ "retired": r }))).await
            }
            (Method::GET, ["v1", "usage", "held"]) if platform => {
                self.usage_read(|u| u.held().map(|h| serde_json::json!({ "held": h }))).await
            }
            (Method::POST, ["v1", "usage", "held", verb @ ("apply" | "discard")]) if platform => {
                let Some(period) = call.param("period").filter(|p| postern_model::usage::parse_month(p).is_some())
                else {
                    return error(StatusCode::BAD_REQUEST, "held windows are decided per ?period=YYYY-MM");
                };
                let decision = if *verb == "apply" { Decision::Apply } else { Decision::Discard };
                self.decide_held(&call.who.name, period, decision).await
            }
            (Method::GET, ["v1", "usage", "nodes"]) if platform => {
                self.usage_read(|u| u.nodes().map(|n| serde_json::json!({ "nodes": n }))).await
            }
            (method, _) => call.refused(&method, parts),
        }
    }

    /// `/v1/status`, `/v1/audit`, `/v1/publish` and `/v1/rollback`: the repository's
    /// versions and who serves them; and the answer for every path of no endpoint.
    async fn version_endpoint(&self, call: &Call<'_>, parts: &[&str], req: Request<Incoming>) -> Response<Body> {
        let role = call.role();
        let is_node = role.is_node();
        match (req.method().clone(), parts) {
            (Method::GET, ["v1", "status"]) if !is_node => self.status(role.team()).await,
            (Method::GET, ["v1", "audit"]) if !is_node => match self.store.audit().await {
                Ok(mut a) => {
                    // A team reads only what its own tokens did.
                    if role.team().is_some() {
                        let ours: Vec<&str> =
                            self.tokens.iter().filter(|t| t.role == *role).map(|t| t.name.as_str()).collect();
                        a.retain(|e| ours.contains(&e.who.as_str()));
                    }
                    json(StatusCode::OK, &serde_json::to_value(a).unwrap_or_default())
                }
                Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
            },
            (Method::POST, ["v1", "publish"]) if matches!(role, Role::Platform | Role::Team(_)) => {
                self.publish(&call.who.name, role.team(), call.wait("wait_acks", 0), call.wait("wait", 0)).await
            }
            (Method::POST, ["v1", "rollback"]) if *role == Role::Platform => {
                let Some(to) = call.param("to").and_then(|v| v.parse::<u64>().ok()) else {
                    return error(StatusCode::BAD_REQUEST, "rollback needs ?to=<version>");
                };
                self.rollback(&call.who.name, to, call.wait("wait", 0)).await
            }
            (method, _) => call.refused(&method, parts),
        }
    }
}

/// One line of the control plane's log: `text`, with control characters escaped
/// ([`postern_model::log_safe`]), after `posternctl serve: `.
pub(crate) fn log_line(text: &str) -> String {
    format!("posternctl serve: {}", postern_model::log_safe(text))
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_node_supplied_name_or_error_stays_on_its_line() {
        let node = "node-1\nposternctl serve: node-2 refused snapshot v9";
        assert_eq!(
            super::log_line(&format!("node {node} refused snapshot v3: bad\r\u{1b}[2K")),
            "posternctl serve: node node-1\\nposternctl serve: node-2 refused snapshot v9 refused snapshot v3: bad\\r\\u{1b}[2K"
        );
        assert_eq!(super::log_line("listening on 127.0.0.1:1"), "posternctl serve: listening on 127.0.0.1:1");
    }
}
