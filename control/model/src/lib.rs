//! The snapshot: everything a Postern node needs to serve traffic, compiled by the
//! control plane from the config repository, numbered, content-hashed and immutable.
//!
//! On disk a snapshot is a JSON envelope ([`SnapshotFile`]) whose `content` is kept as
//! the exact bytes that were hashed, so a node checks the hash over what it read and a
//! corrupted or truncated file is never loaded.
#![deny(missing_docs)]

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use sha2::{Digest, Sha256};

pub mod apikey;
pub mod credentials;
pub mod disk;
#[cfg(feature = "tls")]
pub mod net;
/// The one canonical form of a request path (shared with the filter SDK).
pub use postern_filter_rules::path;
pub mod protocol;
pub mod report;
pub mod secrets;
pub mod sign;
#[cfg(feature = "tls")]
pub mod tls;
pub mod transcode;
pub mod usage;
pub mod validate;
pub mod wasm;

/// Version of the snapshot format; a node refuses a snapshot with another one.
pub const SCHEMA_VERSION: u32 = 1;

/// Platform maximum for any route timeout, in milliseconds.
pub const MAX_TIMEOUT_MS: u64 = 30_000;

/// Default per-route request body limit (64 KiB, as for most JSON routes).
pub const DEFAULT_MAX_BODY_BYTES: u64 = 64 * 1024;

/// The on-disk envelope.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotFile {
    /// Snapshot number; each accepted snapshot gets a higher one, never reused.
    pub version: u64,
    /// `sha256:<hex>` of the exact bytes of `content`.
    pub hash: String,
    /// The control plane's signature over lane, version and hash ([`sign`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sig: Option<String>,
    /// The [`Snapshot`], as the bytes that were hashed.
    pub content: Box<RawValue>,
}

/// Why a snapshot file was refused.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// The envelope or content is not valid JSON of the expected shape.
    #[error("malformed snapshot: {0}")]
    Malformed(#[from] serde_json::Error),
    /// The content does not hash to the recorded value.
    #[error("snapshot hash mismatch: file says {expected}, content hashes to {actual}")]
    HashMismatch {
        /// Hash recorded in the envelope.
        expected: String,
        /// Hash of the content as read.
        actual: String,
    },
    /// Unsigned or mis-signed, on a node that pins the control plane's key.
    #[error(transparent)]
    Signature(#[from] sign::SignatureError),
    /// Written by an incompatible control plane.
    #[error("snapshot schema {0} is not supported (this node reads schema {SCHEMA_VERSION})")]
    Schema(u32),
}

/// `sha256:<hex>` of `bytes`.
pub fn content_hash(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

impl SnapshotFile {
    /// Wraps `snapshot` into an envelope numbered `version`.
    pub fn seal(version: u64, snapshot: &Snapshot) -> Result<SnapshotFile, serde_json::Error> {
        SnapshotFile::seal_value(version, snapshot)
    }

    /// Parses an envelope and checks its hash, leaving the content unparsed.
    pub fn open_envelope(bytes: &[u8]) -> Result<SnapshotFile, SnapshotError> {
        let file: SnapshotFile = serde_json::from_slice(bytes)?;
        let actual = content_hash(file.content.get().as_bytes());
        if actual != file.hash {
            return Err(SnapshotError::HashMismatch { expected: file.hash, actual });
        }
        Ok(file)
    }

    /// Wraps any serialisable content into an envelope numbered `version`.
    pub fn seal_value<T: Serialize>(version: u64, content: &T) -> Result<SnapshotFile, serde_json::Error> {
        let content = serde_json::value::to_raw_value(content)?;
        Ok(SnapshotFile { version, hash: content_hash(content.get().as_bytes()), sig: None, content })
    }

    /// What this envelope's signature vouches for, as a version of `lane`.
    pub fn subject(&self, lane: protocol::Lane) -> sign::Subject<'_> {
        sign::Subject::Whole { lane, version: self.version, hash: &self.hash }
    }

    /// Signs this envelope as a version of `lane`.
    pub fn sign(&mut self, lane: protocol::Lane, signer: &sign::Signer) {
        self.sig = Some(signer.sign(&self.subject(lane)));
    }

    /// Checks the signature as a version of `lane` when `key` is pinned.
    pub fn verify(&self, lane: protocol::Lane, key: Option<&sign::Trust>) -> Result<(), SnapshotError> {
        Ok(sign::check(key, &self.subject(lane), self.sig.as_deref())?)
    }

    /// Parses an envelope, checks its hash and schema, and returns it with its content.
    pub fn open(bytes: &[u8]) -> Result<(SnapshotFile, Snapshot), SnapshotError> {
        let file = SnapshotFile::open_envelope(bytes)?;
        let snapshot: Snapshot = serde_json::from_str(file.content.get())?;
        if snapshot.schema != SCHEMA_VERSION {
            return Err(SnapshotError::Schema(snapshot.schema));
        }
        Ok((file, snapshot))
    }
}

/// A URL fit for a log line: a password in its user information is replaced by `***`
/// (`redis://:secret@host:6379` is `redis://:***@host:6379`).
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else { return url.to_owned() };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => {
            let user = userinfo.split_once(':').map_or(userinfo, |(u, _)| u);
            let hidden = if userinfo.contains(':') { format!("{user}:***") } else { "***".to_owned() };
            format!("{scheme}://{hidden}@{host}{tail}")
        }
        None => url.to_owned(),
    }
}

/// Text from outside the process fit for one log line: a line feed, a carriage return, a
/// tab, every other control character (C0, DEL, C1) and the Unicode line and paragraph
/// separators are written as escapes (`\n`, `\r`, `\t`, `\u{1b}`), so a line cannot be
/// split or a forged one appended. Text with none of them is returned as it is.
pub fn log_safe(text: &str) -> std::borrow::Cow<'_, str> {
    fn escaped(c: char) -> bool {
        c.is_control() || c == '\u{2028}' || c == '\u{2029}'
    }
    if !text.chars().any(escaped) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if escaped(c) => out.extend(c.escape_unicode()),
            c => out.push(c),
        }
    }
    std::borrow::Cow::Owned(out)
}

/// Everything a node serves from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Snapshot {
    /// Format version, [`SCHEMA_VERSION`].
    pub schema: u32,
    /// Upstream clusters by name.
    pub clusters: BTreeMap<String, Cluster>,
    /// Routes, in a stable order (team, then file, then position).
    pub routes: Vec<Route>,
    /// Plans by name: which API products each includes.
    #[serde(default)]
    pub plans: BTreeMap<String, Plan>,
    /// How request paths are made canonical before routing (`platform/gateway.yaml`).
    #[serde(default)]
    pub paths: path::PathPolicy,
    /// Callers that never join a canary: on a weighted split they always get the route's
    /// stable backend, its first (`platform/gateway.yaml` `neverCanary`).
    #[serde(default, skip_serializing_if = "NeverCanary::is_empty")]
    pub never_canary: NeverCanary,
}

/// Callers kept off every canary, by API key id, app (`client_id`) or plan.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NeverCanary {
    /// API key ids.
    #[serde(default)]
    pub keys: Vec<String>,
    /// Apps.
    #[serde(default)]
    pub apps: Vec<String>,
    /// Plans.
    #[serde(default)]
    pub plans: Vec<String>,
}

impl NeverCanary {
    /// Whether it names nobody.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty() && self.apps.is_empty() && self.plans.is_empty()
    }
}

/// A plan: the API products its callers may use.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    /// Product names.
    pub products: Vec<String>,
    /// Per-caller limit (an API key, or one user of an OAuth app) on each route class.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit: Option<Rate>,
    /// Ceiling per OAuth app (`client_id`) across all its users and routes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub app_rate_limit: Option<Rate>,
    /// When the fleet-wide sync of rate limits is lost: refuse this plan's callers (503)
    /// instead of going on with each node's last share.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fail_closed: bool,
    /// Calls a caller may make per billing period, per product.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quota: Option<Quota>,
    /// The class of its callers' requests under overload ([`Priority::Standard`] if unset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<Priority>,
}

/// A request's priority class: under overload the lowest is shed first (`sheddable`,
/// then `free`, then `standard`), and `critical` only once nothing else is left.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Priority {
    /// Partner and enterprise traffic that must not notice an overload.
    Critical,
    /// Paid traffic.
    #[default]
    Standard,
    /// Free-tier traffic.
    Free,
    /// Bulk exports, analytics, client retries: the first to go.
    Sheddable,
}

impl Priority {
    /// Every class, most important first (a class's index is its rank).
    pub const ALL: [Priority; 4] = [Priority::Critical, Priority::Standard, Priority::Free, Priority::Sheddable];

    /// Lowercase name.
    pub fn as_str(self) -> &'static str {
        match self {
            Priority::Critical => "critical",
            Priority::Standard => "standard",
            Priority::Free => "free",
            Priority::Sheddable => "sheddable",
        }
    }

    /// The class named `s`.
    pub fn parse(s: &str) -> Option<Priority> {
        Priority::ALL.into_iter().find(|p| p.as_str() == s)
    }

    /// 0 for the most important class, 3 for the least.
    pub fn rank(self) -> usize {
        self as usize
    }

    /// The rank as a byte (there are four classes).
    pub fn rank_u8(self) -> u8 {
        self as u8
    }

    /// The class of a rank, if there is one.
    pub fn of_rank(rank: u8) -> Option<Priority> {
        Priority::ALL.get(usize::from(rank)).copied()
    }
}

impl Plan {
    /// A plan of these products with no limits, quota or fail-closed sync.
    pub fn of_products(products: &[&str]) -> Plan {
        Plan {
            products: products.iter().map(|p| (*p).to_owned()).collect(),
            rate_limit: None,
            app_rate_limit: None,
            fail_closed: false,
            quota: None,
            priority: None,
        }
    }
}

/// A plan's quota: `calls` billable calls per caller (API key or OAuth app) and product
/// in each period.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Quota {
    /// Calls per period.
    pub calls: u64,
    /// What happens past it.
    pub mode: QuotaMode,
    /// Where periods start.
    pub anchor: usage::Anchor,
}

/// What a quota does once it is used up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QuotaMode {
    /// Refuse the caller's calls (429 `quota_exceeded`) until the period ends.
    Hard,
    /// Never refuse: calls past the quota are billed as overage.
    Overage,
}

/// A token-bucket rate: `rps` tokens a second, at most `burst` saved up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rate {
    /// Sustained requests (tokens) a second.
    pub rps: u64,
    /// Largest burst.
    pub burst: u64,
}

/// How a route counts against its callers' rate limits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteRate {
    /// Route class: routes of one class share a caller's bucket.
    pub class: String,
    /// Tokens one request takes (an expensive search takes several).
    pub cost: u32,
}

/// How a route authenticates and authorises its callers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteAuth {
    /// Accepted credentials, at least one.
    pub methods: Vec<AuthMethod>,
    /// Scopes the caller must hold, all of them.
    #[serde(default)]
    pub scopes: Vec<String>,
    /// The API product the route belongs to; the caller's plan must include it.
    pub product: String,
}

/// A kind of credential.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AuthMethod {
    /// `x-api-key: ak_live_...`.
    ApiKey,
    /// `Authorization: Bearer <JWT access token>`.
    Jwt,
}

/// A set of interchangeable backend endpoints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cluster {
    /// `host:port` endpoints (a host named twice is drawn twice as often).
    pub endpoints: Vec<String>,
    /// Team that owns the cluster (platform-owned if `None`).
    #[serde(default)]
    pub owner: Option<String>,
    /// Requests in flight to the cluster at most, each on its own pooled connection; a
    /// request over the cap is refused with 503 `upstream_overloaded`.
    #[serde(default = "default_max_connections")]
    pub max_connections: u32,
    /// The cluster's circuit breaker on each node.
    #[serde(default)]
    pub breaker: BreakerSpec,
    /// How much each node may retry to the cluster.
    #[serde(default)]
    pub retry_budget: RetryBudgetSpec,
    /// The cluster counts as overloaded (and its routes shed by priority) while its
    /// requests in flight are at least this percentage of `max_connections`.
    #[serde(default = "default_shed_at_percent")]
    pub shed_at_percent: u8,
    /// Speak HTTP/2 to the cluster's hosts (over TLS when `tls` is set, else h2c with
    /// prior knowledge); HTTP/1.1 otherwise.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub http2: bool,
    /// TLS to the cluster's hosts, with the node's client certificate when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<ClusterTls>,
    /// When a single host is ejected for failing in a row (per node).
    #[serde(default)]
    pub outlier: OutlierSpec,
}

/// A cluster's passive outlier ejection on each node: a host that failed `consecutive`
/// times in a row is sent nothing for `eject_ms` × the times it was ejected (at most
/// `max_eject_ms`); never more than `max_percent` of the hosts are out (0: never).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutlierSpec {
    /// Failures in a row that eject a host.
    pub consecutive: u32,
    /// The first ejection's length, in ms.
    pub eject_ms: u32,
    /// The longest ejection, in ms.
    pub max_eject_ms: u32,
    /// The most of the hosts out at once, in percent.
    pub max_percent: u8,
}

impl Default for OutlierSpec {
    /// 5 in a row; 30 s, then 60 s... up to 5 min; at most half the hosts.
    fn default() -> OutlierSpec {
        OutlierSpec { consecutive: 5, eject_ms: 30_000, max_eject_ms: 300_000, max_percent: 50 }
    }
}

/// TLS to a cluster: the CA its hosts' certificates must chain to, and the name they
/// must carry.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterTls {
    /// The CA certificates, PEM (embedded at compile: nodes read no repository files).
    pub ca_pem: String,
    /// The name the hosts' certificates are checked against; the endpoint's host when
    /// `None`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_name: Option<String>,
}

/// [`Cluster::shed_at_percent`] when a cluster does not set it.
pub const DEFAULT_SHED_AT_PERCENT: u8 = 80;

fn default_shed_at_percent() -> u8 {
    DEFAULT_SHED_AT_PERCENT
}

/// A cluster's retry budget on each node: retries in `window_ms` may be `percent` of the
/// requests first sent in it, or `min_retries`, whichever is more.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetryBudgetSpec {
    /// The sliding window, in ms.
    pub window_ms: u32,
    /// The share of requests that may be retried, in percent.
    pub percent: u8,
    /// Retries allowed in the window whatever the traffic.
    pub min_retries: u32,
}

impl Default for RetryBudgetSpec {
    /// 10 % of the last 10 s's requests, at least 10.
    fn default() -> RetryBudgetSpec {
        RetryBudgetSpec { window_ms: 10_000, percent: 10, min_retries: 10 }
    }
}

/// When a cluster's circuit breaker opens and how it probes (per node): it opens when
/// more than `failure_percent` of at least `min_requests` requests in `window_ms` failed
/// (a connect failure, a timeout, a reset, a 5xx from the backend), refuses with 503
/// `circuit_open` for `open_ms`, then lets `probe_percent` through as probes and closes
/// on a probe's success.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BreakerSpec {
    /// The sliding window outcomes are judged over, in ms.
    pub window_ms: u32,
    /// Requests in the window before it may open.
    pub min_requests: u32,
    /// It opens when more than this percentage of them failed.
    pub failure_percent: u8,
    /// How long it stays open before probing, in ms.
    pub open_ms: u32,
    /// The percentage of requests let through as probes while half-open.
    pub probe_percent: u8,
}

impl Default for BreakerSpec {
    /// More than half of at least 100 requests in 10 s; open 10 s; 5 % probes.
    fn default() -> BreakerSpec {
        BreakerSpec { window_ms: 10_000, min_requests: 100, failure_percent: 50, open_ms: 10_000, probe_percent: 5 }
    }
}

/// [`Cluster::max_connections`] when a cluster does not set it.
pub const DEFAULT_MAX_CONNECTIONS: u32 = 1024;
/// The platform's ceiling on [`Cluster::max_connections`].
pub const MAX_CONNECTIONS_LIMIT: u32 = 65_536;

fn default_max_connections() -> u32 {
    DEFAULT_MAX_CONNECTIONS
}

/// Listener pool: each pool has its own listener, so one pool's spike never reaches the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Pool {
    /// Public APIs (apps, mobile).
    Public,
    /// Partner APIs (partner servers with API keys).
    Partner,
}

impl Pool {
    /// Every pool, in a fixed order.
    pub const ALL: [Pool; 2] = [Pool::Public, Pool::Partner];

    /// Lowercase name.
    pub fn as_str(self) -> &'static str {
        match self {
            Pool::Public => "public",
            Pool::Partner => "partner",
        }
    }
}

/// How a path pattern matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PathMatchKind {
    /// The whole path.
    Exact,
    /// Whole leading segments.
    Prefix,
}

/// One compiled route.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Route {
    /// Stable id, `team/name`.
    pub id: String,
    /// Owning team.
    pub team: String,
    /// Listener pool.
    pub pool: Pool,
    /// Lowercase hostnames, `*.suffix` wildcards; empty means any host.
    pub hosts: Vec<String>,
    /// Methods; empty means any.
    pub methods: Vec<String>,
    /// Path pattern, e.g. `/v1/orders/{id}`.
    pub path: String,
    /// Exact or prefix.
    pub path_kind: PathMatchKind,
    /// Optional version header condition.
    pub version: Option<VersionMatch>,
    /// Weighted backends; a caller's share is chosen by a stable hash (see `split_header`).
    pub backends: Vec<WeightedBackend>,
    /// Request header whose value keys the weighted split (e.g. the API key); without it
    /// the split is per request.
    pub split_header: Option<String>,
    /// Timeouts.
    pub timeouts: Timeouts,
    /// Request body limit in bytes, enforced by counting.
    pub max_body_bytes: u64,
    /// Path rewrite before forwarding.
    pub rewrite: Option<PathRewrite>,
    /// Filters run in order, built once per snapshot.
    pub filters: Vec<FilterSpec>,
    /// Deprecation and sunset headers added to responses.
    pub deprecation: Option<Deprecation>,
    /// Marked public: served without credentials.
    pub public: bool,
    /// Buffer the request body (at most [`MAX_BUFFERED_BODY_BYTES`]) so filters can run
    /// their body phase; otherwise bodies stream.
    #[serde(default)]
    pub buffer_body: bool,
    /// Authentication and authorisation; `None` only on routes marked public.
    #[serde(default)]
    pub auth: Option<RouteAuth>,
    /// Rate-limit class and cost (authenticated routes; class `default`, cost 1 if unset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit: Option<RouteRate>,
    /// Which requests the gateway may send once more, to another host of the cluster.
    #[serde(default)]
    pub retry: RetryPolicy,
    /// The class of every request on the route under overload, whatever the caller's
    /// plan says (bulk exports: `sheddable`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<Priority>,
    /// Request validation compiled from the team's OpenAPI operation (the route buffers
    /// its body when the operation has one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub validate: Option<validate::Validation>,
    /// Compress answers as they stream, by the client's `Accept-Encoding`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compress: Option<Compress>,
    /// REST→gRPC transcoding to the route's (HTTP/2) backend: JSON in, protobuf to the
    /// service, JSON back; the route buffers its body.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grpc: Option<transcode::Transcode>,
}

/// A route's response compression: zstd, brotli or gzip by the client's
/// `Accept-Encoding`, on text and structured-text answers of at least `min_bytes` (or of
/// unknown length), streamed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Compress {
    /// Answers declaring a smaller `Content-Length` are sent as they are.
    pub min_bytes: u64,
}

/// The smallest answer compressed when a route does not say.
pub const DEFAULT_COMPRESS_MIN_BYTES: u64 = 1024;

/// Which requests of a route may be retried: once, on another host, after a connect
/// failure, a reset before any response byte or a 503 the backend marks as not
/// processed, and only within the cluster's retry budget.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetryPolicy {
    /// Methods that may be retried (upper case; of GET, HEAD, OPTIONS, PUT, DELETE, POST).
    pub methods: Vec<String>,
    /// The service honours `Idempotency-Key`: a POST may be retried when it carries one
    /// (and POST is in `methods`).
    #[serde(default)]
    pub idempotency_key: bool,
}

impl Default for RetryPolicy {
    /// GET, HEAD, OPTIONS, PUT and DELETE; no POST.
    fn default() -> RetryPolicy {
        RetryPolicy {
            methods: ["GET", "HEAD", "OPTIONS", "PUT", "DELETE"].map(str::to_owned).to_vec(),
            idempotency_key: false,
        }
    }
}

/// Request bodies larger than this are never retried (the gateway keeps no bigger copy).
pub const RETRY_BODY_BYTES: u64 = 64 * 1024;

/// Largest body a route may buffer for filters' body phase (1 MiB).
pub const MAX_BUFFERED_BODY_BYTES: u64 = 1 << 20;

/// A request header a route requires.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VersionMatch {
    /// Header name (lowercase).
    pub header: String,
    /// Required value.
    pub value: String,
}

/// A backend cluster with a weight.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WeightedBackend {
    /// Cluster name.
    pub cluster: String,
    /// Relative weight; weights of a route sum to 100.
    pub weight: u32,
}

/// Route timeouts (milliseconds), each at most [`MAX_TIMEOUT_MS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Timeouts {
    /// TCP connect to the backend.
    pub connect_ms: u64,
    /// From sending the request to the backend's response headers; also the deadline
    /// sent to the backend.
    pub response_ms: u64,
    /// The longest a body (the client's upload, the backend's answer) may send nothing;
    /// the node's idle timeout when `None`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body_idle_ms: Option<u64>,
    /// The longest a body may take in all, from the request's start.
    #[serde(default = "default_body_total_ms")]
    pub body_total_ms: u64,
}

/// [`Timeouts::body_total_ms`] when a route does not set it: 5 minutes.
pub const DEFAULT_BODY_TOTAL_MS: u64 = 300_000;

fn default_body_total_ms() -> u64 {
    DEFAULT_BODY_TOTAL_MS
}

/// How the path is rewritten before forwarding.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum PathRewrite {
    /// Replace the matched prefix (the route's literal leading segments) with this.
    ReplacePrefix(String),
    /// Replace the whole path with this.
    ReplaceFull(String),
}

/// A filter attached to a route.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FilterSpec {
    /// Filter kind, e.g. `request-headers`.
    pub kind: String,
    /// Its configuration, validated when the snapshot is built.
    pub config: serde_json::Value,
}

/// Deprecation metadata (RFC 9745 `Deprecation`, RFC 8594 `Sunset`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Deprecation {
    /// When the route was deprecated, Unix seconds.
    pub since: Option<i64>,
    /// When it stops working, Unix seconds.
    pub sunset: Option<i64>,
    /// Documentation link sent as `Link: <..>; rel="deprecation"`.
    pub link: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_lines_cannot_be_split_or_forged() {
        assert!(matches!(log_safe("plain text, ünïcode"), std::borrow::Cow::Borrowed(_)));
        assert_eq!(
            log_safe("ok\nERROR forged\r\n\tx\u{1b}[31m\u{7f}\u{85}\u{2028}"),
            "ok\\nERROR forged\\r\\n\\tx\\u{1b}[31m\\u{7f}\\u{85}\\u{2028}"
        );
    }

    #[test]
    fn urls_in_logs_hide_their_passwords() {
        assert_eq!(redact_url("redis://:s3cret@127.0.0.1:6379/0"), "redis://:***@127.0.0.1:6379/0");
        assert_eq!(redact_url("postgres://app:pw@db/x?sslmode=require"), "postgres://app:***@db/x?sslmode=require");
        assert_eq!(redact_url("redis://tokenonly@h"), "redis://***@h");
        assert_eq!(redact_url("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
        assert_eq!(redact_url("not a url"), "not a url");
    }

    fn sample() -> Snapshot {
        Snapshot {
            schema: SCHEMA_VERSION,
            clusters: BTreeMap::new(),
            routes: Vec::new(),
            plans: BTreeMap::new(),
            paths: Default::default(),
            never_canary: Default::default(),
        }
    }

    #[test]
    fn seal_and_open_round_trip() {
        let file = SnapshotFile::seal(7, &sample()).unwrap();
        let bytes = serde_json::to_vec(&file).unwrap();
        let (back, snap) = SnapshotFile::open(&bytes).unwrap();
        assert_eq!(back.version, 7);
        assert_eq!(back.hash, file.hash);
        assert_eq!(snap, sample());
    }

    #[test]
    fn tampered_or_truncated_content_is_refused() {
        let file = SnapshotFile::seal(1, &sample()).unwrap();
        let text = serde_json::to_string(&file).unwrap();
        let tampered = text.replace("\"routes\":[]", "\"routes\": []");
        assert!(matches!(SnapshotFile::open(tampered.as_bytes()), Err(SnapshotError::HashMismatch { .. })));
        let truncated = &text.as_bytes()[..text.len() / 2];
        assert!(matches!(SnapshotFile::open(truncated), Err(SnapshotError::Malformed(_))));
    }

    #[test]
    fn other_schema_is_refused() {
        let mut s = sample();
        s.schema = 99;
        let file = SnapshotFile::seal(1, &s).unwrap();
        let bytes = serde_json::to_vec(&file).unwrap();
        assert!(matches!(SnapshotFile::open(&bytes), Err(SnapshotError::Schema(99))));
    }
}
