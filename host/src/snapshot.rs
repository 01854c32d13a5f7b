//! The live snapshot: the model compiled into what requests read — one route table per
//! pool, each route with its filters built, its backends resolved and its metrics bound.
//!
//! A new snapshot is built beside the live one (filters validated, clients ready) and
//! swapped in with one pointer store; requests that already hold the old `Arc` finish
//! on it.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::AtomicU32;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use http::uri::Authority;
use http::{HeaderName, HeaderValue};
use postern_builtin_filters::auth::Authenticator;
use postern_builtin_filters::chain::{self, Node, Step};
use postern_builtin_filters::ratelimit::Limiter;
use postern_filter_contract::Filter;
use postern_model::{Pool, Snapshot, SnapshotFile};
use postern_router::{PathKind, Router, RouterBuilder};

use crate::cluster::connect::{Client, Clients};
use crate::cluster::{CAP_SHARE, Upstream};
use crate::metrics::{Metrics, RouteMetrics};

/// Why a snapshot was refused by this node.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// The file could not be read or failed its hash or schema check.
    #[error(transparent)]
    File(#[from] postern_model::SnapshotError),
    /// A route cannot be built.
    #[error("route {route}: {reason}")]
    Route {
        /// Route id.
        route: String,
        /// What is wrong.
        reason: String,
    },
}

/// A path rewrite, ready to apply.
#[derive(Debug)]
pub enum Rewrite {
    /// Replace the first `segments` path segments with `with`.
    Prefix {
        /// How many leading segments the route's pattern has.
        segments: usize,
        /// Replacement, without a trailing `/`.
        with: String,
    },
    /// Replace the whole path.
    Full(String),
}

/// One of a route's backends: its cluster, and the client that speaks the cluster's
/// transport with the route's connect timeout.
#[derive(Debug)]
pub struct Backend {
    /// The cluster.
    pub upstream: Arc<Upstream>,
    /// Its client.
    pub client: Client,
    /// Its own counters, on a route split across backends (metrics by version).
    pub metrics: Option<Arc<RouteMetrics>>,
}

/// One route, ready for requests.
pub struct CompiledRoute {
    /// `team/name`.
    pub id: Arc<str>,
    /// Backends, indexed by [`CompiledRoute::pick`]; the first is the stable one.
    pub backends: Vec<Backend>,
    /// Bucket (0..100) → index into `backends`.
    pub buckets: [u8; 100],
    /// Per-route hash seed, so routes split independently.
    pub seed: u64,
    /// Header keying the split.
    pub split_header: Option<HeaderName>,
    /// Until the backend's response head.
    pub response_timeout: Duration,
    /// The longest a body may send nothing (the node's idle timeout when `None`).
    pub body_idle: Option<Duration>,
    /// The longest a body may take in all, from the request's start.
    pub body_total: Duration,
    /// Body limit.
    pub max_body_bytes: u64,
    /// Buffer the body for filters' body phase.
    pub buffer_body: bool,
    /// The API product of an authenticated route, whose callers' calls are metered;
    /// `None`: a public route (credentials are dropped before any filter sees them).
    pub product: Option<Arc<str>>,
    /// Path rewrite.
    pub rewrite: Option<Rewrite>,
    /// Authentication, on an authenticated route: the caller, known before anything
    /// else runs.
    pub auth: Option<Arc<dyn Filter>>,
    /// The caller's plan's rate limits and quota, on an authenticated route whose plans
    /// set any.
    pub limit: Option<Arc<dyn Filter>>,
    /// The route's configured filters (native and Wasm), in order.
    pub filters: Vec<Arc<dyn Filter>>,
    /// The names of the whole chain (`auth`, `rate-limit`, then the route's filters), for
    /// access logs and spans.
    pub filter_names: Vec<Arc<str>>,
    /// Headers added to every response (deprecation, sunset, link).
    pub response_headers: Vec<(HeaderName, HeaderValue)>,
    /// Counters.
    pub metrics: Arc<RouteMetrics>,
    /// Which of its requests may be retried.
    pub retry: RetryRule,
    /// The class of all its requests under overload, whatever the caller's plan.
    pub priority: Option<postern_model::Priority>,
    /// Its OpenAPI operation's validator, on routes that opt in.
    pub validator: Option<Box<postern_validate::Validator>>,
    /// Compress answers of at least this many bytes (or of unknown length).
    pub compress: Option<u64>,
    /// REST→gRPC transcoding to its backend, on routes that opt in.
    pub grpc: Option<Box<postern_transcode::Transcoder>>,
}

/// Which of a route's requests may be retried: a bit per method (POST's only where the
/// service honours `Idempotency-Key`, and then only for a request carrying one).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RetryRule {
    methods: u8,
}

const POST_BIT: u8 = 1 << 5;

fn method_bit(m: &http::Method) -> u8 {
    match *m {
        http::Method::GET => 1,
        http::Method::HEAD => 1 << 1,
        http::Method::OPTIONS => 1 << 2,
        http::Method::PUT => 1 << 3,
        http::Method::DELETE => 1 << 4,
        http::Method::POST => POST_BIT,
        _ => 0,
    }
}

impl RetryRule {
    /// The rule of a route's policy (a POST only where the service honours
    /// `Idempotency-Key`; the compiler refuses any other).
    pub fn new(p: &postern_model::RetryPolicy) -> RetryRule {
        let mut methods = 0u8;
        for m in &p.methods {
            if let Ok(m) = http::Method::from_bytes(m.as_bytes()) {
                methods |= method_bit(&m);
            }
        }
        if !p.idempotency_key {
            methods &= !POST_BIT;
        }
        RetryRule { methods }
    }

    /// Whether a request with this method and these headers may be retried.
    pub fn allows(&self, method: &http::Method, headers: &http::HeaderMap) -> bool {
        let bit = method_bit(method);
        bit != 0 && self.methods & bit != 0 && (bit != POST_BIT || headers.contains_key("idempotency-key"))
    }
}

impl std::fmt::Debug for CompiledRoute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompiledRoute").field("id", &self.id).finish_non_exhaustive()
    }
}

impl CompiledRoute {
    /// The backend index for a caller: a stable hash of `key` into 100 buckets, so one
    /// caller always sees one backend; a random bucket without a key.
    pub fn pick(&self, key: Option<&[u8]>) -> usize {
        if self.backends.len() == 1 {
            return 0;
        }
        let bucket = match key {
            Some(k) => (xxhash_rust::xxh3::xxh3_64_with_seed(k, self.seed) % 100) as usize,
            None => fastrand::usize(..100),
        };
        usize::from(self.buckets.get(bucket).copied().unwrap_or(0))
    }

    /// The backend at index `i` (0: the stable one).
    pub fn backend(&self, i: usize) -> Option<&Backend> {
        self.backends.get(i)
    }

    /// Whether any filter runs on its requests (they then get a filter context).
    pub fn has_filters(&self) -> bool {
        self.auth.is_some() || self.limit.is_some() || !self.filters.is_empty()
    }

    /// The whole chain in order: authentication, limits, the route's filters.
    pub fn chain(&self) -> impl Iterator<Item = &Arc<dyn Filter>> {
        self.auth.iter().chain(self.limit.iter()).chain(self.filters.iter())
    }
}

/// Callers kept off every canary, as sets of the identity's bytes.
#[derive(Debug, Default)]
pub struct NeverCanary {
    keys: std::collections::HashSet<Box<[u8]>>,
    apps: std::collections::HashSet<Box<[u8]>>,
    plans: std::collections::HashSet<Box<[u8]>>,
}

impl NeverCanary {
    fn new(n: &postern_model::NeverCanary) -> NeverCanary {
        let set = |v: &[String]| v.iter().map(|s| Box::from(s.as_bytes())).collect();
        NeverCanary { keys: set(&n.keys), apps: set(&n.apps), plans: set(&n.plans) }
    }

    /// Whether the caller is kept off canaries: its key, its app or its plan is listed.
    pub fn holds(&self, id: &postern_filter_contract::Identity) -> bool {
        let has = |set: &std::collections::HashSet<Box<[u8]>>, v: &Option<bytes::Bytes>| {
            !set.is_empty() && v.as_ref().is_some_and(|v| set.contains(&v[..]))
        };
        has(&self.keys, &id.key_id) || has(&self.apps, &id.client_id) || has(&self.plans, &id.plan)
    }
}

/// Everything a request reads, immutable once built.
pub struct Live {
    /// Snapshot number.
    pub version: u64,
    /// Content hash.
    pub hash: String,
    /// When this node loaded it.
    pub loaded_at: SystemTime,
    /// Route count.
    pub route_count: usize,
    /// How request paths are made canonical before routing.
    pub paths: postern_model::path::PathPolicy,
    /// The clusters, by name.
    pub upstreams: Vec<Arc<Upstream>>,
    /// Each plan's priority class (plans that set none are `standard`).
    pub priorities: HashMap<String, postern_model::Priority>,
    /// Callers that never join a canary.
    pub never_canary: NeverCanary,
    public: Router<CompiledRoute>,
    partner: Router<CompiledRoute>,
}

impl std::fmt::Debug for Live {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Live").field("version", &self.version).field("hash", &self.hash).finish_non_exhaustive()
    }
}

impl Live {
    /// The route table of a pool.
    pub fn router(&self, pool: Pool) -> &Router<CompiledRoute> {
        match pool {
            Pool::Public => &self.public,
            Pool::Partner => &self.partner,
        }
    }
}

/// Builds [`Live`] snapshots, reusing HTTP clients (and so their pooled connections)
/// and route metrics across reloads.
#[derive(Debug)]
pub struct Builder {
    clients: Mutex<Clients>,
    /// Per cluster name, what every snapshot's upstreams share: requests in flight, the
    /// breaker and the retry budget.
    gates: Mutex<HashMap<String, Guards>>,
    metrics: Arc<Metrics>,
    node: Node,
    wasm: Option<Arc<postern_wasm::Runtime>>,
    modules_dir: PathBuf,
    /// The control plane keys snapshots must be signed by (none: any snapshot file).
    trust: Option<Arc<postern_model::sign::Trust>>,
}

/// A cluster's state that outlives snapshots.
#[derive(Debug)]
struct Guards {
    inflight: Arc<AtomicU32>,
    breaker: Arc<postern_protect::Breaker>,
    budget: Arc<postern_protect::RetryBudget>,
    shed: Arc<postern_protect::Shedder>,
    latency: Arc<postern_protect::Latency>,
    /// The endpoint list the hosts' state belongs to.
    endpoints: Vec<String>,
    hosts: Arc<postern_protect::Hosts>,
}

/// The retry budget's settings from the snapshot's.
fn budget_config(b: &postern_model::RetryBudgetSpec) -> postern_protect::BudgetConfig {
    postern_protect::BudgetConfig {
        window: Duration::from_millis(u64::from(b.window_ms)),
        percent: b.percent,
        min_retries: b.min_retries,
    }
}

/// The breaker's settings from the snapshot's.
fn breaker_config(b: &postern_model::BreakerSpec) -> postern_protect::BreakerConfig {
    postern_protect::BreakerConfig {
        window: Duration::from_millis(u64::from(b.window_ms)),
        min_requests: b.min_requests,
        failure_percent: b.failure_percent,
        open_for: Duration::from_millis(u64::from(b.open_ms)),
        probe_percent: b.probe_percent,
    }
}

/// Verified access tokens kept per node.
const TOKEN_CACHE_ENTRIES: usize = 65_536;
/// ... and the bytes they may weigh (tokens and their verified claims).
const TOKEN_CACHE_BYTES: u64 = 64 << 20;
/// Rate-limit buckets kept per node (idle ones beyond this are evicted).
pub const RATE_BUCKETS: usize = 1 << 20;

fn bucket_table(weights: &[u32]) -> [u8; 100] {
    let total: u64 = weights.iter().map(|&w| u64::from(w)).sum::<u64>().max(1);
    let mut table = [0u8; 100];
    let mut cum = 0u64;
    let mut start = 0usize;
    for (i, &w) in weights.iter().enumerate() {
        cum += u64::from(w);
        let end = ((cum * 100 + total / 2) / total).min(100) as usize;
        for slot in table.iter_mut().take(end).skip(start) {
            *slot = u8::try_from(i).unwrap_or(0);
        }
        start = end.max(start);
    }
    table
}

fn http_date(unix: i64) -> Option<HeaderValue> {
    let t = SystemTime::UNIX_EPOCH + Duration::from_secs(u64::try_from(unix).ok()?);
    HeaderValue::from_str(&httpdate::fmt_http_date(t)).ok()
}

/// A node's built-in policy state before any snapshot: a fresh authenticator and a
/// limiter that enforces whole limits (a fleet node swaps in its own, [`Builder::use_limiter`]).
fn new_node() -> Node {
    Node {
        auth: Arc::new(Authenticator::new(TOKEN_CACHE_ENTRIES, TOKEN_CACHE_BYTES)),
        limiter: Arc::new(Limiter::new(RATE_BUCKETS)),
    }
}

impl Builder {
    /// A builder that registers route metrics in `metrics`, without Wasm filters.
    pub fn new(metrics: Arc<Metrics>) -> Builder {
        Builder {
            clients: Mutex::new(Clients::default()),
            gates: Mutex::default(),
            metrics,
            node: new_node(),
            wasm: None,
            modules_dir: PathBuf::new(),
            trust: None,
        }
    }

    /// A builder that also builds Wasm filters, reading their modules by digest from
    /// `modules_dir` (`<hex>.wasm`, as `posternctl compile` writes them).
    pub fn with_wasm(metrics: Arc<Metrics>, runtime: Arc<postern_wasm::Runtime>, modules_dir: PathBuf) -> Builder {
        Builder {
            clients: Mutex::new(Clients::default()),
            gates: Mutex::default(),
            metrics,
            node: new_node(),
            wasm: Some(runtime),
            modules_dir,
            trust: None,
        }
    }

    /// Closes backend connections idle for longer than the idle timeout; skipped while
    /// a snapshot is being built (the next sweep does it).
    pub fn close_idle_connections(&self) {
        if let Ok(clients) = self.clients.try_lock() {
            clients.close_idle();
        }
    }

    /// Presents `identity` (the node's client certificate) to every TLS cluster, from
    /// the next snapshot on (call before the first).
    pub fn use_upstream_identity(&mut self, identity: Arc<crate::cluster::connect::Identity>) {
        *self.clients.get_mut().unwrap_or_else(|p| p.into_inner()) = Clients::with_identity(Some(identity));
    }

    /// Refuses, from now on, every snapshot not signed by one of `trust`'s keys.
    pub fn require_signed(&mut self, trust: Arc<postern_model::sign::Trust>) {
        self.trust = Some(trust);
    }

    /// Replaces the node's rate limiter (before any snapshot is built), e.g. with one in
    /// fleet mode.
    pub fn use_limiter(&mut self, limiter: Arc<Limiter>) {
        self.node.limiter = limiter;
    }

    /// The node's authentication state, shared by every snapshot's routes.
    pub fn authenticator(&self) -> &Arc<Authenticator> {
        &self.node.auth
    }

    fn wasm_filter(
        &self,
        route_id: &Arc<str>,
        config: &serde_json::Value,
        paths: postern_model::path::PathPolicy,
    ) -> Result<Arc<dyn Filter>, String> {
        let runtime = self.wasm.as_ref().ok_or("this node runs no Wasm runtime")?;
        let attachment: postern_model::wasm::Attachment =
            serde_json::from_value(config.clone()).map_err(|e| format!("wasm filter attachment: {e}"))?;
        let over = attachment.limits.over(&runtime.maxima);
        if !over.is_empty() {
            return Err(format!("filter {}: {}", attachment.name, over.join("; ")));
        }
        let hex = attachment
            .module
            .strip_prefix("sha256:")
            .filter(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
            .ok_or_else(|| {
                format!("filter {}: module {:?} is not a sha256 digest", attachment.name, attachment.module)
            })?;
        let path = self.modules_dir.join(format!("{hex}.wasm"));
        // The node's modules folder, filled from the control plane: a regular file within
        // the module cap, whatever else was put there.
        let bytes = postern_model::disk::read_regular(&path, postern_model::disk::MODULE_FILE_CAP)
            .map_err(|e| format!("filter {}: cannot read {}: {e}", attachment.name, path.display()))?;
        let module = runtime
            .load(&bytes, Some(&attachment.module))
            .map_err(|e| format!("filter {}: module {}: {e}", attachment.name, attachment.module))?;
        // Checked and, when the filter keeps state from its config, pre-initialised for it.
        let module = runtime
            .prepare(&module, &postern_model::wasm::config_bytes(&attachment.config), &attachment.limits)
            .map_err(|e| format!("filter {}: {e}", attachment.name))?;
        let stats = self.metrics.filter(route_id, &attachment.name);
        Ok(Arc::new(postern_wasm::WasmFilter::new(runtime.clone(), module, attachment, route_id, stats, paths)))
    }

    /// Reads, checks and builds a snapshot file's bytes.
    pub fn build_bytes(&self, bytes: &[u8]) -> Result<Live, BuildError> {
        let (file, snapshot) = SnapshotFile::open(bytes)?;
        file.verify(postern_model::protocol::Lane::Snapshot, self.trust.as_deref())?;
        self.build(file.version, file.hash, &snapshot)
    }

    /// Builds a snapshot; refuses it whole if any route cannot be built.
    pub fn build(&self, version: u64, hash: String, snapshot: &Snapshot) -> Result<Live, BuildError> {
        let mut clients = self.clients.lock().unwrap_or_else(|p| p.into_inner());
        clients.forget_unused_pools();
        let gates = self.gates.lock().unwrap_or_else(|p| p.into_inner());
        let mut upstreams: HashMap<&str, Arc<Upstream>> = HashMap::with_capacity(snapshot.clusters.len());
        let mut staged: Vec<(String, Guards)> = Vec::with_capacity(snapshot.clusters.len());
        for (name, c) in &snapshot.clusters {
            let (u, guards) = upstream(name, c, gates.get(name.as_str()), &mut clients)?;
            upstreams.insert(name, u);
            staged.push((name.clone(), guards));
        }
        drop(gates);

        let mut public = RouterBuilder::new();
        let mut partner = RouterBuilder::new();
        for r in &snapshot.routes {
            let compiled = self.route(r, snapshot, &upstreams, &mut clients)?;
            let kind = match r.path_kind {
                postern_model::PathMatchKind::Exact => PathKind::Exact,
                postern_model::PathMatchKind::Prefix => PathKind::Prefix,
            };
            let version = r.version.as_ref().map(|v| (v.header.as_str(), v.value.as_str()));
            let spec = postern_router::RouteSpec { hosts: &r.hosts, methods: &r.methods, path: &r.path, kind, version };
            let table = match r.pool {
                Pool::Public => &mut public,
                Pool::Partner => &mut partner,
            };
            table.add(&spec, compiled).map_err(|e| BuildError::Route { route: r.id.clone(), reason: e.to_string() })?;
        }
        // Built: its clusters' state is the one later snapshots keep.
        let mut gates = self.gates.lock().unwrap_or_else(|p| p.into_inner());
        gates.extend(staged);
        drop(gates);
        let mut upstreams: Vec<Arc<Upstream>> = upstreams.into_values().collect();
        upstreams.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(Live {
            version,
            hash,
            loaded_at: SystemTime::now(),
            route_count: snapshot.routes.len(),
            upstreams,
            priorities: snapshot.plans.iter().filter_map(|(name, p)| Some((name.clone(), p.priority?))).collect(),
            never_canary: NeverCanary::new(&snapshot.never_canary),
            paths: snapshot.paths,
            public: public.build(),
            partner: partner.build(),
        })
    }

    /// One route, ready for requests: its backends, its chain and its checks.
    fn route(
        &self,
        r: &postern_model::Route,
        snapshot: &Snapshot,
        upstreams: &HashMap<&str, Arc<Upstream>>,
        clients: &mut Clients,
    ) -> Result<CompiledRoute, BuildError> {
        let err = |reason: String| BuildError::Route { route: r.id.clone(), reason };
        let id: Arc<str> = Arc::from(r.id.as_str());
        let mut backends = Vec::with_capacity(r.backends.len());
        for b in &r.backends {
            let u = upstreams.get(b.cluster.as_str()).ok_or_else(|| err(format!("unknown cluster {:?}", b.cluster)))?;
            let client = clients
                .get(Duration::from_millis(r.timeouts.connect_ms), &u.transport)
                .map_err(|e| err(format!("cluster {}: {e}", b.cluster)))?;
            let metrics = (r.backends.len() > 1).then(|| self.metrics.backend(&id, &u.name));
            backends.push(Backend { upstream: u.clone(), client, metrics });
        }
        if backends.is_empty() || backends.len() > 255 {
            return Err(err("a route needs 1 to 255 backends".into()));
        }
        let weights: Vec<u32> = r.backends.iter().map(|b| b.weight).collect();
        let split_header = match &r.split_header {
            None => None,
            Some(h) => Some(HeaderName::from_bytes(h.as_bytes()).map_err(|e| err(format!("split header: {e}")))?),
        };
        let (auth, limit, filters, filter_names) = self.chain(&id, r, &snapshot.plans, snapshot.paths).map_err(err)?;
        let rewrite = match &r.rewrite {
            None => None,
            Some(postern_model::PathRewrite::ReplacePrefix(p)) => Some(Rewrite::Prefix {
                segments: r.path.trim_matches('/').split('/').filter(|s| !s.is_empty()).count(),
                with: p.trim_end_matches('/').to_owned(),
            }),
            Some(postern_model::PathRewrite::ReplaceFull(p)) => Some(Rewrite::Full(p.clone())),
        };
        let validator = match &r.validate {
            None => None,
            Some(v) => Some(Box::new(
                postern_validate::Validator::build(v, &r.path).map_err(|e| err(format!("validate: {e}")))?,
            )),
        };
        let grpc = match &r.grpc {
            None => None,
            Some(t) => Some(Box::new(postern_transcode::Transcoder::build(t).map_err(|e| err(format!("grpc: {e}")))?)),
        };
        // A validated or transcoded body is read whole, so it must fit the buffer.
        let validates_body = validator.as_ref().is_some_and(|v| v.has_body()) || grpc.is_some();
        if validates_body && r.max_body_bytes > postern_model::MAX_BUFFERED_BODY_BYTES {
            return Err(err("validating a body needs max_body_bytes of at most 1 MiB".into()));
        }
        Ok(CompiledRoute {
            metrics: self.metrics.route(&id),
            seed: xxhash_rust::xxh3::xxh3_64(r.id.as_bytes()),
            id,
            backends,
            buckets: bucket_table(&weights),
            split_header,
            response_timeout: Duration::from_millis(r.timeouts.response_ms),
            // Within the compiler's ranges whatever the file says (a deadline far off
            // would overflow the clock).
            body_idle: r.timeouts.body_idle_ms.map(|ms| Duration::from_millis(ms.min(300_000))),
            body_total: Duration::from_millis(r.timeouts.body_total_ms.min(3_600_000)),
            max_body_bytes: r.max_body_bytes,
            buffer_body: (r.buffer_body || validates_body)
                && r.max_body_bytes <= postern_model::MAX_BUFFERED_BODY_BYTES,
            product: r.auth.as_ref().map(|a| Arc::from(a.product.as_str())),
            rewrite,
            auth,
            limit,
            filters,
            filter_names,
            response_headers: deprecation_headers(r).map_err(err)?,
            retry: RetryRule::new(&r.retry),
            priority: r.priority,
            validator,
            compress: r.compress.map(|c| c.min_bytes),
            grpc,
        })
    }

    /// A route's chain, built in the order `chain::chain` decides: its authentication,
    /// its limits, its configured filters, and the names of all of them in that order
    /// (a Wasm filter's path edits must be canonical under `paths`).
    #[allow(clippy::type_complexity)]
    fn chain(
        &self,
        id: &Arc<str>,
        r: &postern_model::Route,
        plans: &std::collections::BTreeMap<String, postern_model::Plan>,
        paths: postern_model::path::PathPolicy,
    ) -> Result<(Option<Arc<dyn Filter>>, Option<Arc<dyn Filter>>, Vec<Arc<dyn Filter>>, Vec<Arc<str>>), String> {
        let steps = chain::chain(r, plans).map_err(|e| e.to_string())?;
        let (mut auth, mut limit) = (None, None);
        let mut filters: Vec<Arc<dyn Filter>> = Vec::with_capacity(steps.len());
        let mut names: Vec<Arc<str>> = Vec::with_capacity(steps.len());
        for step in &steps {
            match step {
                Step::Authenticate(_) => {
                    names.push(Arc::from("auth"));
                    auth = Some(step.build(&self.node, id, plans).map_err(|e| e.to_string())?);
                }
                Step::RateLimit(_) => {
                    names.push(Arc::from("rate-limit"));
                    limit = Some(step.build(&self.node, id, plans).map_err(|e| e.to_string())?);
                }
                Step::Configured(f) if f.kind == "wasm" => {
                    names.push(match f.config.get("name").and_then(|n| n.as_str()) {
                        Some(name) => Arc::from(name),
                        None => Arc::from(f.kind.as_str()),
                    });
                    filters.push(self.wasm_filter(id, &f.config, paths)?);
                }
                Step::Configured(f) => {
                    names.push(Arc::from(f.kind.as_str()));
                    filters.push(step.build(&self.node, id, plans).map_err(|e| e.to_string())?);
                }
            }
        }
        Ok((auth, limit, filters, names))
    }
}

/// One cluster on this node: its distinct hosts and their pools, and its live state
/// (requests in flight, breaker, retry budget, shedding, ejections) — the `kept` state
/// where its settings stayed, new state where they changed.
fn upstream(
    name: &str,
    c: &postern_model::Cluster,
    kept: Option<&Guards>,
    clients: &mut Clients,
) -> Result<(Arc<Upstream>, Guards), BuildError> {
    let err = |reason: String| BuildError::Route { route: format!("(cluster {name})"), reason };
    // Distinct hosts, and a weighted slot per listed endpoint.
    let mut endpoints: Vec<Authority> = Vec::with_capacity(c.endpoints.len());
    let mut slots = Vec::with_capacity(c.endpoints.len());
    for e in &c.endpoints {
        let a = e.parse::<Authority>().map_err(|x| err(format!("endpoint {e:?}: {x}")))?;
        let at = endpoints.iter().position(|x| *x == a).unwrap_or_else(|| {
            endpoints.push(a);
            endpoints.len() - 1
        });
        slots.push(u16::try_from(at).map_err(|_| err("more than 65535 endpoints".into()))?);
    }
    let config = breaker_config(&c.breaker);
    let budget = budget_config(&c.retry_budget);
    let eject = postern_protect::EjectConfig {
        consecutive: c.outlier.consecutive,
        base: Duration::from_millis(u64::from(c.outlier.eject_ms)),
        max: Duration::from_millis(u64::from(c.outlier.max_eject_ms)),
        max_percent: c.outlier.max_percent,
    };
    let now = std::time::Instant::now();
    // The live state is kept while its settings stay; new settings start anew (a closed
    // breaker, an empty window), recorded only once this snapshot builds.
    let guards = Guards {
        inflight: kept.map_or_else(Arc::default, |g| g.inflight.clone()),
        breaker: match kept {
            Some(g) if *g.breaker.config() == config => g.breaker.clone(),
            _ => Arc::new(postern_protect::Breaker::new(config, now)),
        },
        budget: match kept {
            Some(g) if *g.budget.config() == budget => g.budget.clone(),
            _ => Arc::new(postern_protect::RetryBudget::new(budget, now)),
        },
        shed: kept.map_or_else(Arc::default, |g| g.shed.clone()),
        latency: kept.map_or_else(Arc::default, |g| g.latency.clone()),
        hosts: match kept {
            Some(g) if g.endpoints == c.endpoints && *g.hosts.config() == eject => g.hosts.clone(),
            _ => Arc::new(postern_protect::Hosts::new(endpoints.len(), slots, eject, now)),
        },
        endpoints: c.endpoints.clone(),
    };
    let max_inflight = c.max_connections.max(1);
    let transport = crate::cluster::connect::Transport { http2: c.http2, tls: c.tls.clone() };
    let pools = endpoints.iter().map(|a| clients.pool(&transport, a)).collect();
    let upstream = Upstream {
        name: Arc::from(name),
        endpoints,
        hosts: guards.hosts.clone(),
        inflight: guards.inflight.clone(),
        max_inflight,
        breaker: guards.breaker.clone(),
        budget: guards.budget.clone(),
        shed: guards.shed.clone(),
        latency: guards.latency.clone(),
        shed_at: (u64::from(max_inflight) * u64::from(c.shed_at_percent)).div_ceil(100).max(1) as u32,
        reserved_from: (u64::from(max_inflight) * CAP_SHARE[3] / 100) as u32,
        transport,
        conns: clients.conns.clone(),
        pools,
    };
    Ok((Arc::new(upstream), guards))
}

/// The headers a deprecated route adds to every answer: `Deprecation`, `Sunset`, `Link`.
fn deprecation_headers(r: &postern_model::Route) -> Result<Vec<(HeaderName, HeaderValue)>, String> {
    let mut headers = Vec::new();
    let Some(d) = &r.deprecation else {
        return Ok(headers);
    };
    let deprecation = match d.since {
        Some(t) => HeaderValue::from_str(&format!("@{t}")).ok(),
        None => Some(HeaderValue::from_static("true")),
    };
    headers.extend(deprecation.map(|v| (HeaderName::from_static("deprecation"), v)));
    if let Some(v) = d.sunset.and_then(http_date) {
        headers.push((HeaderName::from_static("sunset"), v));
    }
    if let Some(l) = &d.link {
        let v = HeaderValue::from_str(&format!("<{l}>; rel=\"deprecation\"")).map_err(|e| format!("link: {e}"))?;
        headers.push((http::header::LINK, v));
    }
    Ok(headers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_retry_goes_to_another_host_even_when_one_is_named_twice() {
        let metrics = Arc::new(Metrics::default());
        let build = |endpoints: &str| {
            let snapshot: Snapshot = serde_json::from_value(serde_json::json!({
                "schema": postern_model::SCHEMA_VERSION,
                "clusters": {"c": {"endpoints": serde_json::from_str::<serde_json::Value>(endpoints).unwrap()}},
                "routes": [], "plans": {},
            }))
            .unwrap();
            let live = Builder::new(metrics.clone()).build(1, "h".into(), &snapshot).unwrap();
            live.upstreams[0].clone()
        };
        let now = std::time::Instant::now();
        let u = build(r#"["a:1", "a:1", "b:1"]"#);
        assert_eq!(u.endpoints.len(), 2, "one host named twice is one host");
        assert!(u.has_other());
        for _ in 0..20 {
            let (i, first) = u.pick(now).unwrap();
            let (_, other) = u.pick_other(i, now).unwrap();
            assert_ne!(first, other);
        }
        let twice = build(r#"["a:1", "a:1"]"#);
        assert!(!twice.has_other());
        assert_eq!(twice.pick_other(0, now), None, "no other host");
        assert_eq!(build(r#"["a:1"]"#).pick_other(0, now), None);
    }

    #[test]
    fn retry_rules_follow_the_policy_and_a_post_needs_its_key() {
        let none = http::HeaderMap::new();
        let mut keyed = http::HeaderMap::new();
        keyed.insert("idempotency-key", HeaderValue::from_static("k1"));
        let default = RetryRule::new(&postern_model::RetryPolicy::default());
        assert!(default.allows(&http::Method::GET, &none) && default.allows(&http::Method::DELETE, &none));
        assert!(!default.allows(&http::Method::POST, &keyed) && !default.allows(&http::Method::PATCH, &none));
        let post = RetryRule::new(&postern_model::RetryPolicy { methods: vec!["POST".into()], idempotency_key: true });
        assert!(post.allows(&http::Method::POST, &keyed));
        assert!(!post.allows(&http::Method::POST, &none), "a POST without Idempotency-Key");
        assert!(!post.allows(&http::Method::GET, &none));
        // A policy naming POST without the key's promise never retries a POST.
        let sloppy =
            RetryRule::new(&postern_model::RetryPolicy { methods: vec!["POST".into()], idempotency_key: false });
        assert!(!sloppy.allows(&http::Method::POST, &keyed));
    }

    #[test]
    fn bucket_table_follows_weights() {
        let t = bucket_table(&[95, 5]);
        assert_eq!(t.iter().filter(|&&i| i == 0).count(), 95);
        assert_eq!(t.iter().filter(|&&i| i == 1).count(), 5);
        let t = bucket_table(&[1, 1, 1]);
        let counts: Vec<usize> = (0..3).map(|k| t.iter().filter(|&&i| i == k).count()).collect();
        assert_eq!(counts.iter().sum::<usize>(), 100);
        assert!(counts.iter().all(|&c| (33..=34).contains(&c)), "{counts:?}");
        let t = bucket_table(&[0, 10]);
        assert!(t.iter().all(|&i| i == 1));
    }
}
