//! Compiles a config repository into one [`Snapshot`], collecting every error with the
//! file, field and owning team it concerns.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use postern_model::path::PathPolicy;
use postern_model::validate::{JsonLimits, MAX_JSON_DEPTH, MAX_JSON_NUMBER_CHARS, ParamIn, Validation};
use postern_model::{
    AuthMethod, Cluster, DEFAULT_MAX_BODY_BYTES, Deprecation, FilterSpec, MAX_TIMEOUT_MS, PathMatchKind, PathRewrite,
    Plan, Pool, Priority, Route, RouteAuth, SCHEMA_VERSION, Snapshot, Timeouts, VersionMatch, WeightedBackend,
};
use postern_router::{PathKind, RouteError, RouteSpec, RouterBuilder};
use serde::de::DeserializeOwned;

use crate::config::{
    AuthMethodDoc, ClustersDoc, CompressDoc, JsonLimitsDoc, OwnershipDoc, PathType, PlansDoc, RouteDoc, RoutesDoc,
    ValidateDoc, parse_duration, parse_yaml,
};
use crate::openapi::{Spec, SpecError};

/// Largest request body limit a route may declare (1 GiB).
pub const MAX_BODY_LIMIT: u64 = 1 << 30;

/// One problem found in the repository.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnostic {
    /// File, relative to the repository root.
    pub file: PathBuf,
    /// Field path inside the file, e.g. `routes[2].timeouts.response`.
    pub field: String,
    /// What is wrong.
    pub message: String,
    /// Team that owns the file or route, if any.
    pub owner: Option<String>,
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file.display())?;
        if !self.field.is_empty() {
            write!(f, ": {}", self.field)?;
        }
        write!(f, ": {}", self.message)?;
        if let Some(o) = &self.owner {
            write!(f, " (owner: {o})")?;
        }
        Ok(())
    }
}

/// Every problem that stopped a compile.
#[derive(Debug)]
pub struct Rejected(pub Vec<Diagnostic>);

impl fmt::Display for Rejected {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{} error(s) in the config repository:", self.0.len())?;
        for d in &self.0 {
            writeln!(f, "  {d}")?;
        }
        Ok(())
    }
}

impl std::error::Error for Rejected {}

struct Ctx {
    root: PathBuf,
    diags: Vec<Diagnostic>,
    review: Vec<crate::config::ApprovedDoc>,
    /// The real Wasm sandbox, for modules, their configs and their sample cases.
    sandbox: crate::engines::Sandbox,
    /// Module digest → file, for every module a route uses.
    modules: BTreeMap<String, PathBuf>,
    /// Filter manifests whose sample cases ran.
    sampled: HashSet<PathBuf>,
    /// `platform/plans.yaml`.
    plans: PlansDoc,
    /// `platform/gateway.yaml`'s path policy.
    paths: PathPolicy,
    /// OpenAPI documents by path, each loaded once (`None`: refused, already reported).
    specs: HashMap<PathBuf, Option<Arc<Spec>>>,
    /// Errors in OpenAPI documents already reported (file, pointer, message): routes
    /// sharing a document report each once.
    spec_errors: HashSet<(PathBuf, String, String)>,
}

/// A compiled repository: the snapshot and the filter modules it references.
#[derive(Debug)]
pub struct Compiled {
    /// The snapshot.
    pub snapshot: Snapshot,
    /// Module digest (`sha256:<hex>`) → source file.
    pub modules: BTreeMap<String, PathBuf>,
}

impl Ctx {
    fn error(&mut self, file: &Path, field: impl Into<String>, message: impl Into<String>, owner: Option<&str>) {
        let file = file.strip_prefix(&self.root).unwrap_or(file).to_path_buf();
        self.diags.push(Diagnostic {
            file,
            field: field.into(),
            message: message.into(),
            owner: owner.map(str::to_owned),
        });
    }

    fn load<T: DeserializeOwned>(&mut self, path: &Path, owner: Option<&str>) -> Option<T> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) => {
                self.error(path, "", format!("cannot read: {e}"), owner);
                return None;
            }
        };
        match parse_yaml::<T>(&text) {
            Ok(v) => Some(v),
            Err((field, msg)) => {
                self.error(path, field, msg, owner);
                None
            }
        }
    }
}

fn parse_ms(s: &str) -> Result<u64, String> {
    let d = parse_duration(s)?;
    let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    if ms == 0 {
        return Err("must be more than 0".into());
    }
    if ms > MAX_TIMEOUT_MS {
        return Err(format!("{s} is over the platform maximum of 30s"));
    }
    Ok(ms)
}

/// A duration setting in milliseconds within `min..=max`; `None` (and an error naming
/// `field`) for one that is not a duration or out of range.
fn ranged_ms(
    cx: &mut Ctx,
    file: &Path,
    field: String,
    v: &str,
    (min, max): (u64, u64),
    owner: Option<&str>,
) -> Option<u32> {
    match parse_duration(v).map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)) {
        Ok(ms) if (min..=max).contains(&ms) => u32::try_from(ms).ok(),
        Ok(_) => {
            let (lo, hi) = (Duration::from_millis(min), Duration::from_millis(max));
            let msg = format!(
                "{v} is out of range ({} to {})",
                humantime::format_duration(lo),
                humantime::format_duration(hi)
            );
            cx.error(file, field, msg, owner);
            None
        }
        Err(e) => {
            cx.error(file, field, e, owner);
            None
        }
    }
}

/// A number setting within `min..=max`; `None` (and an error naming `field`) otherwise.
fn ranged(
    cx: &mut Ctx,
    file: &Path,
    field: String,
    v: u32,
    (min, max): (u32, u32),
    owner: Option<&str>,
) -> Option<u32> {
    if (min..=max).contains(&v) {
        return Some(v);
    }
    cx.error(file, field, format!("{v} is out of range ({min} to {max})"), owner);
    None
}

/// A cluster's `outlier:`, each field checked against its range.
fn compile_outlier(
    cx: &mut Ctx,
    file: &Path,
    field: &str,
    doc: &crate::config::OutlierDoc,
    owner: Option<&str>,
) -> postern_model::OutlierSpec {
    let mut spec = postern_model::OutlierSpec::default();
    let at = |name: &str| format!("{field}.outlier.{name}");
    if let Some(n) =
        doc.consecutive_failures.and_then(|v| ranged(cx, file, at("consecutiveFailures"), v, (1, 1000), owner))
    {
        spec.consecutive = n;
    }
    if let Some(ms) =
        doc.eject_for.as_deref().and_then(|v| ranged_ms(cx, file, at("ejectFor"), v, (1_000, 3_600_000), owner))
    {
        spec.eject_ms = ms;
    }
    if let Some(ms) =
        doc.max_eject_for.as_deref().and_then(|v| ranged_ms(cx, file, at("maxEjectFor"), v, (1_000, 3_600_000), owner))
    {
        spec.max_eject_ms = ms;
    }
    if let Some(p) =
        doc.max_ejected_percent.and_then(|v| ranged(cx, file, at("maxEjectedPercent"), v.into(), (0, 100), owner))
    {
        spec.max_percent = u8::try_from(p).unwrap_or(50);
    }
    if spec.max_eject_ms < spec.eject_ms {
        cx.error(file, at("maxEjectFor"), "must be at least ejectFor", owner);
    }
    spec
}

/// A cluster's `tls:`: its CA file (inside the repository) read and checked, embedded.
fn cluster_tls(
    cx: &mut Ctx,
    root: &Path,
    file: &Path,
    field: &str,
    doc: &crate::config::ClusterTlsDoc,
    owner: Option<&str>,
) -> Option<postern_model::ClusterTls> {
    let at = format!("{field}.tls.ca");
    let rel = Path::new(&doc.ca);
    if rel.is_absolute() || rel.components().any(|c| matches!(c, std::path::Component::ParentDir)) {
        cx.error(file, at, "give a path inside the repository", owner);
        return None;
    }
    let pem = match std::fs::read(root.join(rel)) {
        Ok(pem) => pem,
        Err(e) => {
            cx.error(file, at, format!("cannot read {}: {e}", doc.ca), owner);
            return None;
        }
    };
    if let Err(e) = postern_model::tls::roots_pem(&pem, &doc.ca) {
        cx.error(file, at, format!("{e:#}"), owner);
        return None;
    }
    if let Some(name) = &doc.server_name
        && rustls_pki_types::ServerName::try_from(name.as_str()).is_err()
    {
        cx.error(file, format!("{field}.tls.serverName"), format!("{name:?} is not a DNS name or IP address"), owner);
        return None;
    }
    Some(postern_model::ClusterTls {
        ca_pem: String::from_utf8_lossy(&pem).into_owned(),
        server_name: doc.server_name.clone(),
    })
}

/// A priority class by name; `None` (and an error naming `field`) for an unknown one.
fn priority(cx: &mut Ctx, file: &Path, field: String, v: &str, owner: Option<&str>) -> Option<Priority> {
    let p = Priority::parse(v);
    if p.is_none() {
        let msg = format!("unknown priority class {v:?} (critical, standard, free or sheddable)");
        cx.error(file, field, msg, owner);
    }
    p
}

/// A cluster's `breaker:`, each field checked against its range (errors name the field);
/// what is absent or refused keeps its default.
fn compile_breaker(
    cx: &mut Ctx,
    file: &Path,
    field: &str,
    doc: &crate::config::BreakerDoc,
    owner: Option<&str>,
) -> postern_model::BreakerSpec {
    let mut spec = postern_model::BreakerSpec::default();
    let at = |name: &str| format!("{field}.breaker.{name}");
    if let Some(ms) = doc.window.as_deref().and_then(|v| ranged_ms(cx, file, at("window"), v, (1_000, 300_000), owner))
    {
        spec.window_ms = ms;
    }
    if let Some(ms) = doc.open_for.as_deref().and_then(|v| ranged_ms(cx, file, at("openFor"), v, (100, 300_000), owner))
    {
        spec.open_ms = ms;
    }
    if let Some(n) = doc.min_requests.and_then(|v| ranged(cx, file, at("minRequests"), v, (1, 1_000_000), owner)) {
        spec.min_requests = n;
    }
    let percent = |cx: &mut Ctx, name: &str, v: Option<u8>, min: u32, max: u32| {
        v.and_then(|v| ranged(cx, file, at(name), u32::from(v), (min, max), owner)).and_then(|n| u8::try_from(n).ok())
    };
    if let Some(p) = percent(cx, "failurePercent", doc.failure_percent, 1, 99) {
        spec.failure_percent = p;
    }
    if let Some(p) = percent(cx, "probePercent", doc.probe_percent, 1, 100) {
        spec.probe_percent = p;
    }
    spec
}

/// A cluster's `retryBudget:`, each field checked against its range.
fn compile_budget(
    cx: &mut Ctx,
    file: &Path,
    field: &str,
    doc: &crate::config::RetryBudgetDoc,
    owner: Option<&str>,
) -> postern_model::RetryBudgetSpec {
    let mut spec = postern_model::RetryBudgetSpec::default();
    let at = |name: &str| format!("{field}.retryBudget.{name}");
    if let Some(ms) = doc.window.as_deref().and_then(|v| ranged_ms(cx, file, at("window"), v, (1_000, 300_000), owner))
    {
        spec.window_ms = ms;
    }
    if let Some(p) = doc.percent.and_then(|v| ranged(cx, file, at("percent"), u32::from(v), (0, 100), owner)) {
        spec.percent = u8::try_from(p).unwrap_or(spec.percent);
    }
    if let Some(n) = doc.min_retries.and_then(|v| ranged(cx, file, at("minRetries"), v, (0, 100_000), owner)) {
        spec.min_retries = n;
    }
    spec
}

/// A route's `retry:`: known methods only, and a POST only where the service honours
/// `Idempotency-Key`.
fn compile_retry(
    cx: &mut Ctx,
    file: &Path,
    field: &str,
    doc: &crate::config::RetryDoc,
    owner: Option<&str>,
) -> postern_model::RetryPolicy {
    let mut policy = postern_model::RetryPolicy { idempotency_key: doc.idempotency_key, ..Default::default() };
    if let Some(methods) = &doc.methods {
        policy.methods.clear();
        for (i, m) in methods.iter().enumerate() {
            let upper = m.to_ascii_uppercase();
            match upper.as_str() {
                "GET" | "HEAD" | "OPTIONS" | "PUT" | "DELETE" => policy.methods.push(upper),
                "POST" if doc.idempotency_key => policy.methods.push(upper),
                "POST" => cx.error(
                    file,
                    format!("{field}.retry.methods[{i}]"),
                    "a POST is retried only on a route whose service honours Idempotency-Key: set retry.idempotencyKey: true",
                    owner,
                ),
                _ => cx.error(
                    file,
                    format!("{field}.retry.methods[{i}]"),
                    format!("{m:?} may not be retried (GET, HEAD, OPTIONS, PUT, DELETE, or POST with idempotencyKey)"),
                    owner,
                ),
            }
        }
    } else if doc.idempotency_key {
        policy.methods.push("POST".to_owned());
    }
    policy
}

fn parse_date(s: &str) -> Result<i64, String> {
    let t = humantime::parse_rfc3339_weak(s).map_err(|e| format!("{s:?} is not an RFC 3339 date: {e}"))?;
    let secs = t.duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO).as_secs();
    i64::try_from(secs).map_err(|_| format!("{s:?} is out of range"))
}

fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
}

/// Splits a path pattern into its segments (without validating them).
fn segments(p: &str) -> Vec<&str> {
    p.trim_matches('/').split('/').filter(|s| !s.is_empty()).collect()
}

struct Owner {
    host: String,
    prefix: Vec<String>,
    team: String,
}

/// Which team owns `host` + `path`: the longest matching prefix among claims for this
/// exact host, else among claims for every host (`*`).
fn owner_of<'o>(owners: &'o [Owner], host: &str, path: &str) -> Option<&'o Owner> {
    let segs = segments(path);
    let best = |h: &str| {
        owners
            .iter()
            .filter(|o| o.host == h && o.prefix.len() <= segs.len() && o.prefix.iter().zip(&segs).all(|(a, b)| a == b))
            .max_by_key(|o| o.prefix.len())
    };
    best(host).or_else(|| best("*"))
}

/// Compiles the repository at `root`.
pub fn compile(root: &Path) -> Result<Compiled, Rejected> {
    let mut cx = Ctx {
        root: root.to_path_buf(),
        diags: Vec::new(),
        review: Vec::new(),
        sandbox: crate::engines::Sandbox::default(),
        modules: BTreeMap::new(),
        sampled: HashSet::new(),
        plans: PlansDoc::default(),
        paths: PathPolicy::default(),
        specs: HashMap::new(),
        spec_errors: HashSet::new(),
    };
    let gateway_path = root.join("platform/gateway.yaml");
    let mut never_canary = postern_model::NeverCanary::default();
    if gateway_path.exists()
        && let Some(doc) = cx.load::<crate::config::GatewayDoc>(&gateway_path, None)
    {
        cx.paths = doc.paths;
        never_canary = doc.never_canary;
    }
    let plans_path = root.join("platform/plans.yaml");
    if plans_path.exists()
        && let Some(doc) = cx.load::<PlansDoc>(&plans_path, None)
    {
        for (name, plan) in &doc.plans {
            for (sub, r) in [("rateLimit", &plan.rate_limit), ("appRateLimit", &plan.app_rate_limit)] {
                if let Some(r) = r
                    && (r.rps == 0 || r.rps > 1_000_000_000 || r.burst.is_some_and(|b| b == 0 || b > 1_000_000_000))
                {
                    cx.error(&plans_path, format!("plans.{name}.{sub}"), "rps and burst are 1 to 1e9", None);
                }
            }
            if let Some(q) = &plan.quota {
                if q.monthly == 0 {
                    cx.error(&plans_path, format!("plans.{name}.quota.monthly"), "give at least 1 call", None);
                }
                if let Err(e) = q.anchor() {
                    cx.error(&plans_path, format!("plans.{name}.quota.anchor"), e, None);
                }
            }
            if let Some(p) = &plan.priority {
                priority(&mut cx, &plans_path, format!("plans.{name}.priority"), p, None);
            }
            for (i, p) in plan.products.iter().enumerate() {
                if !doc.products.contains(p) {
                    let msg = format!("unknown product {p:?} (products are listed under products:)");
                    cx.error(&plans_path, format!("plans.{name}.products[{i}]"), msg, None);
                }
            }
        }
        cx.plans = doc;
    }
    for (i, p) in never_canary.plans.iter().enumerate() {
        if !cx.plans.plans.contains_key(p) {
            let msg = format!("unknown plan {p:?}");
            cx.error(&gateway_path, format!("neverCanary.plans[{i}]"), msg, None);
        }
    }
    let review_path = root.join("platform/filters.yaml");
    if review_path.exists()
        && let Some(doc) = cx.load::<crate::config::ReviewDoc>(&review_path, None)
    {
        cx.review = doc.approved;
    }

    let clusters_path = root.join("platform/clusters.yaml");
    let clusters: ClustersDoc = cx.load(&clusters_path, None).unwrap_or(ClustersDoc { clusters: BTreeMap::new() });
    let mut out_clusters = BTreeMap::new();
    for (name, c) in clusters.clusters {
        let field = format!("clusters.{name}");
        if !valid_name(&name) {
            cx.error(&clusters_path, &field, "cluster names are lowercase letters, digits and '-'", None);
        }
        if c.endpoints.is_empty() {
            cx.error(&clusters_path, format!("{field}.endpoints"), "a cluster needs at least one endpoint", None);
        }
        for (i, e) in c.endpoints.iter().enumerate() {
            if e.parse::<std::net::SocketAddr>().is_err() && !valid_host_port(e) {
                cx.error(&clusters_path, format!("{field}.endpoints[{i}]"), format!("{e:?} is not host:port"), None);
            }
        }
        let max_connections = c.max_connections.unwrap_or(postern_model::DEFAULT_MAX_CONNECTIONS);
        if max_connections == 0 || max_connections > postern_model::MAX_CONNECTIONS_LIMIT {
            cx.error(&clusters_path, format!("{field}.maxConnections"), "must be 1 to 65536", None);
        }
        let breaker = compile_breaker(&mut cx, &clusters_path, &field, &c.breaker, c.owner.as_deref());
        let retry_budget = compile_budget(&mut cx, &clusters_path, &field, &c.retry_budget, c.owner.as_deref());
        let shed_at_percent = c
            .shed_at_percent
            .and_then(|p| {
                ranged(
                    &mut cx,
                    &clusters_path,
                    format!("{field}.shedAtPercent"),
                    p.into(),
                    (10, 100),
                    c.owner.as_deref(),
                )
            })
            .and_then(|p| u8::try_from(p).ok())
            .unwrap_or(postern_model::DEFAULT_SHED_AT_PERCENT);
        let http2 = match c.protocol.as_deref() {
            None | Some("http1") => false,
            Some("http2") => true,
            Some(p) => {
                let msg = format!("unknown protocol {p:?} (http1 or http2)");
                cx.error(&clusters_path, format!("{field}.protocol"), msg, c.owner.as_deref());
                false
            }
        };
        let tls =
            c.tls.as_ref().and_then(|t| cluster_tls(&mut cx, root, &clusters_path, &field, t, c.owner.as_deref()));
        let outlier = compile_outlier(&mut cx, &clusters_path, &field, &c.outlier, c.owner.as_deref());
        let cluster = Cluster {
            endpoints: c.endpoints,
            owner: c.owner,
            max_connections,
            breaker,
            retry_budget,
            shed_at_percent,
            http2,
            tls,
            outlier,
        };
        out_clusters.insert(name, cluster);
    }

    let ownership_path = root.join("platform/ownership.yaml");
    let ownership: OwnershipDoc = cx.load(&ownership_path, None).unwrap_or(OwnershipDoc { owners: Vec::new() });
    let mut owners = Vec::new();
    for (i, o) in ownership.owners.into_iter().enumerate() {
        if !o.path_prefix.starts_with('/') {
            cx.error(&ownership_path, format!("owners[{i}].pathPrefix"), "must start with '/'", Some(&o.team));
        }
        let prefix: Vec<String> = segments(&o.path_prefix).into_iter().map(str::to_owned).collect();
        if let Some(dup) = owners.iter().find(|x: &&Owner| x.host == o.host && x.prefix == prefix) {
            cx.error(
                &ownership_path,
                format!("owners[{i}]"),
                format!("{} {} is already claimed by team {}", o.host, o.path_prefix, dup.team),
                Some(&o.team),
            );
        }
        owners.push(Owner { host: o.host, prefix, team: o.team });
    }

    // Team files, in a stable order.
    let mut files: Vec<(String, PathBuf)> = Vec::new();
    let teams_dir = root.join("teams");
    match team_dirs(&teams_dir) {
        Err(e) => cx.error(&teams_dir, "", format!("cannot read the teams directory: {e}"), None),
        Ok(teams) => {
            for (team, dir) in teams {
                if !valid_name(&team) {
                    cx.error(&dir, "", "team directory names are lowercase letters, digits and '-'", Some(&team));
                    continue;
                }
                files.extend(yaml_files(&dir).into_iter().map(|p| (team.clone(), p)));
            }
        }
    }

    let mut routes: Vec<Route> = Vec::new();
    let mut origin: Vec<(PathBuf, String)> = Vec::new(); // file and field of each route
    let mut builders: HashMap<Pool, RouterBuilder<usize>> = HashMap::new();
    let mut names: HashMap<String, (PathBuf, String)> = HashMap::new();

    for (team, file) in files {
        let Some(doc) = cx.load::<RoutesDoc>(&file, Some(&team)) else { continue };
        for (i, r) in doc.routes.into_iter().enumerate() {
            let field = format!("routes[{i}]");
            if let Some(route) = compile_route(&mut cx, &file, &field, &team, r, &out_clusters, &owners) {
                if let Some((f, fld)) = names.get(&route.id) {
                    let msg = format!("route {} is already defined at {}: {fld}", route.id, f.display());
                    cx.error(&file, format!("{field}.name"), msg, Some(&team));
                    continue;
                }
                let spec = RouteSpec {
                    hosts: &route.hosts,
                    methods: &route.methods,
                    path: &route.path,
                    kind: match route.path_kind {
                        PathMatchKind::Exact => PathKind::Exact,
                        PathMatchKind::Prefix => PathKind::Prefix,
                    },
                    version: route.version.as_ref().map(|v| (v.header.as_str(), v.value.as_str())),
                };
                match builders.entry(route.pool).or_default().add(&spec, routes.len()) {
                    Ok(_) => {}
                    Err(RouteError::Conflict { existing }) => {
                        let j = builders.get(&route.pool).and_then(|b| b.get(existing)).copied().unwrap_or_default();
                        let (of, ofield) = origin.get(j).cloned().unwrap_or_default();
                        let who = routes.get(j).map(|r| r.id.as_str()).unwrap_or_default();
                        let msg = format!(
                            "equally specific as route {who} ({}: {ofield}) for the same host, path, method and version",
                            of.strip_prefix(root).unwrap_or(&of).display()
                        );
                        cx.error(&file, format!("{field}.match"), msg, Some(&team));
                        continue;
                    }
                    Err(e) => {
                        cx.error(&file, format!("{field}.match"), e.to_string(), Some(&team));
                        continue;
                    }
                }
                names.insert(route.id.clone(), (file.strip_prefix(root).unwrap_or(&file).to_path_buf(), field.clone()));
                origin.push((file.clone(), field));
                routes.push(route);
            }
        }
    }

    // Saved requests must still reach their routes (only judged on routes that compiled).
    if cx.diags.is_empty() {
        let routers: HashMap<Pool, postern_router::Router<usize>> =
            builders.into_iter().map(|(pool, b)| (pool, b.build())).collect();
        check_route_samples(&mut cx, &routers, &routes);
    }

    if cx.diags.is_empty() {
        Ok(Compiled {
            snapshot: Snapshot {
                schema: SCHEMA_VERSION,
                clusters: out_clusters,
                routes,
                plans: cx
                    .plans
                    .plans
                    .iter()
                    .map(|(k, p)| {
                        let rate = |r: &Option<crate::config::RateDoc>| {
                            r.map(|r| postern_model::Rate { rps: r.rps, burst: r.burst.unwrap_or(r.rps) })
                        };
                        let plan = Plan {
                            products: p.products.clone(),
                            rate_limit: rate(&p.rate_limit),
                            app_rate_limit: rate(&p.app_rate_limit),
                            fail_closed: p.on_sync_loss == crate::config::SyncLossDoc::Closed,
                            quota: p.quota.as_ref().and_then(|q| {
                                Some(postern_model::Quota { calls: q.monthly, mode: q.mode, anchor: q.anchor().ok()? })
                            }),
                            priority: p.priority.as_deref().and_then(Priority::parse),
                        };
                        (k.clone(), plan)
                    })
                    .collect(),
                paths: cx.paths,
                never_canary,
            },
            modules: cx.modules,
        })
    } else {
        Err(Rejected(cx.diags))
    }
}

/// The team directories under `teams`, by name, in a stable order.
fn team_dirs(teams: &Path) -> std::io::Result<Vec<(String, PathBuf)>> {
    let mut dirs: Vec<PathBuf> =
        std::fs::read_dir(teams)?.filter_map(|e| e.ok()).map(|e| e.path()).filter(|p| p.is_dir()).collect();
    dirs.sort();
    Ok(dirs
        .into_iter()
        .map(|d| (d.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(), d))
        .collect())
}

/// The `.yaml`/`.yml` files directly in `dir` (none if it is absent), in a stable order.
fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.path())
                .filter(|p| matches!(p.extension().and_then(|x| x.to_str()), Some("yaml" | "yml")))
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    files
}

fn valid_host_port(s: &str) -> bool {
    match s.rsplit_once(':') {
        Some((host, port)) => {
            port.parse::<u16>().is_ok_and(|p| p != 0)
                && !host.is_empty()
                && host.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
        }
        None => false,
    }
}

fn compile_route(
    cx: &mut Ctx,
    file: &Path,
    field: &str,
    team: &str,
    r: RouteDoc,
    clusters: &BTreeMap<String, Cluster>,
    owners: &[Owner],
) -> Option<Route> {
    let before = cx.diags.len();
    let owner = Some(team);
    if !valid_name(&r.name) {
        cx.error(file, format!("{field}.name"), "route names are lowercase letters, digits and '-'", owner);
    }

    let hosts: Vec<String> = r.hostnames.clone();
    let methods: Vec<String> = r.matches.methods.clone();
    let path = r.matches.path.value.clone();
    let kind = match r.matches.path.kind {
        PathType::Exact => PathKind::Exact,
        PathType::PathPrefix => PathKind::Prefix,
    };
    let version = r
        .matches
        .version
        .as_ref()
        .map(|v| VersionMatch { header: v.header.to_ascii_lowercase(), value: v.value.clone() });
    let spec = RouteSpec {
        hosts: &hosts,
        methods: &methods,
        path: &path,
        kind,
        version: version.as_ref().map(|v| (v.header.as_str(), v.value.as_str())),
    };
    // Requests are routed on their canonical path, so a literal segment that is not
    // canonical could never match.
    let literal: String =
        path.split('/').map(|seg| if seg.starts_with('{') { "p" } else { seg }).collect::<Vec<_>>().join("/");
    if path.starts_with('/')
        && let Err(e) = postern_model::path::check_canonical(&literal, &cx.paths)
    {
        cx.error(file, format!("{field}.match.path.value"), e, owner);
    }
    if let Err(e) = RouterBuilder::<()>::check(&spec) {
        let sub = match e {
            RouteError::Pattern { .. } => "match.path.value",
            RouteError::Host { .. } => "hostnames",
            RouteError::Method(_) => "match.methods",
            _ => "match.version",
        };
        cx.error(file, format!("{field}.{sub}"), e.to_string(), owner);
    }

    // Ownership: every host (or "*" for a route on any host) and the path prefix.
    let claim_hosts: Vec<&str> = if hosts.is_empty() { vec!["*"] } else { hosts.iter().map(String::as_str).collect() };
    for h in claim_hosts {
        match owner_of(owners, h, &path) {
            Some(o) if o.team == team => {}
            Some(o) => cx.error(
                file,
                format!("{field}.match.path.value"),
                format!("host {h} path {path} belongs to team {}, not {team}", o.team),
                owner,
            ),
            None => cx.error(
                file,
                format!("{field}.match.path.value"),
                format!("host {h} path {path} is not registered to any team in platform/ownership.yaml"),
                owner,
            ),
        }
    }

    // Backends.
    if r.backend_refs.is_empty() {
        cx.error(file, format!("{field}.backendRefs"), "a route needs at least one backend", owner);
    }
    let total: u64 = r.backend_refs.iter().map(|b| u64::from(b.weight)).sum();
    if !r.backend_refs.is_empty() && total == 0 {
        cx.error(file, format!("{field}.backendRefs"), "weights add up to 0", owner);
    }
    let mut backends = Vec::new();
    for (i, b) in r.backend_refs.iter().enumerate() {
        match clusters.get(&b.name) {
            None => {
                cx.error(file, format!("{field}.backendRefs[{i}].name"), format!("unknown cluster {:?}", b.name), owner)
            }
            Some(c) if c.owner.as_deref().is_some_and(|o| o != team) => cx.error(
                file,
                format!("{field}.backendRefs[{i}].name"),
                format!("cluster {:?} belongs to team {}", b.name, c.owner.as_deref().unwrap_or_default()),
                owner,
            ),
            Some(_) => {}
        }
        if b.weight > 10_000 {
            cx.error(file, format!("{field}.backendRefs[{i}].weight"), "weights are at most 10000", owner);
        }
        backends.push(WeightedBackend { cluster: b.name.clone(), weight: b.weight });
    }
    let split_header = r.sticky_header.as_ref().map(|h| h.to_ascii_lowercase());
    if let Some(h) = &split_header
        && postern_router_header_ok(h).is_err()
    {
        cx.error(file, format!("{field}.stickyHeader"), format!("{h:?} is not a header name"), owner);
    }

    // Timeouts.
    let ms = |sub: &str, v: &str, cx: &mut Ctx| match parse_ms(v) {
        Ok(ms) => ms,
        Err(e) => {
            cx.error(file, format!("{field}.timeouts.{sub}"), e, owner);
            0
        }
    };
    let bound = |sub: &str, v: &Option<String>, max: u64, cx: &mut Ctx| {
        v.as_deref().and_then(|v| ranged_ms(cx, file, format!("{field}.timeouts.{sub}"), v, (1_000, max), owner))
    };
    let timeouts = Timeouts {
        connect_ms: ms("connect", &r.timeouts.connect, cx),
        response_ms: ms("response", &r.timeouts.response, cx),
        body_idle_ms: bound("bodyIdle", &r.timeouts.body_idle, 300_000, cx).map(u64::from),
        body_total_ms: bound("bodyTotal", &r.timeouts.body_total, 3_600_000, cx)
            .map_or(postern_model::DEFAULT_BODY_TOTAL_MS, u64::from),
    };
    if timeouts.body_total_ms <= timeouts.response_ms {
        // Counted from the request's start, it would cut every answer that came late.
        cx.error(file, format!("{field}.timeouts.bodyTotal"), "must be longer than timeouts.response", owner);
    }

    let max_body_bytes = r.max_body_bytes.unwrap_or(DEFAULT_MAX_BODY_BYTES);
    if max_body_bytes > MAX_BODY_LIMIT {
        cx.error(file, format!("{field}.maxBodyBytes"), "over the platform maximum of 1 GiB", owner);
    }
    if r.buffer_body && max_body_bytes > postern_model::MAX_BUFFERED_BODY_BYTES {
        cx.error(file, format!("{field}.bufferBody"), "a buffered body needs maxBodyBytes of at most 1 MiB", owner);
    }
    let at = RouteAt { file, field, team, methods: &methods, path: &path, max_body_bytes };
    let compress = match &r.compress {
        None | Some(CompressDoc::On(false)) => None,
        Some(CompressDoc::On(true)) => {
            Some(postern_model::Compress { min_bytes: postern_model::DEFAULT_COMPRESS_MIN_BYTES })
        }
        Some(CompressDoc::With(o)) => {
            let min_bytes = o.min_bytes.unwrap_or(postern_model::DEFAULT_COMPRESS_MIN_BYTES);
            if min_bytes > 1 << 20 {
                cx.error(file, format!("{field}.compress.minBytes"), "is 0 to 1 MiB", owner);
            }
            Some(postern_model::Compress { min_bytes })
        }
    };
    let grpc = r.grpc.as_ref().and_then(|g| route_grpc(cx, &at, g, kind, &r, clusters));
    let validate = r.validate.as_ref().map(|v| route_validation(cx, &at, v));
    let refused = validate.as_ref().is_some_and(Option::is_none);
    let validate = validate.flatten();
    // A validated or transcoded body is read whole before the request goes on.
    let buffer_body = r.buffer_body || validate.as_ref().is_some_and(|v| v.body.is_some()) || grpc.is_some();
    if r.grpc.is_some() && r.validate.is_some() {
        cx.error(
            file,
            format!("{field}.grpc"),
            "a route validates against OpenAPI or transcodes to gRPC, not both",
            owner,
        );
    }

    let rewrite = match &r.rewrite {
        None => None,
        Some(rw) => match (&rw.replace_prefix_match, &rw.replace_full_path) {
            (Some(p), None) => Some(PathRewrite::ReplacePrefix(p.clone())),
            (None, Some(p)) => Some(PathRewrite::ReplaceFull(p.clone())),
            _ => {
                cx.error(
                    file,
                    format!("{field}.rewrite"),
                    "give exactly one of replacePrefixMatch, replaceFullPath",
                    owner,
                );
                None
            }
        },
    };
    // A rewrite's result is what the backend receives: it must be canonical, as every
    // forwarded path is (an empty prefix replacement keeps the rest of the path).
    if let Some(PathRewrite::ReplacePrefix(p) | PathRewrite::ReplaceFull(p)) = &rewrite
        && !(p.is_empty() && matches!(rewrite, Some(PathRewrite::ReplacePrefix(_))))
        && let Err(e) = postern_model::path::check_canonical(p, &cx.paths)
    {
        cx.error(file, format!("{field}.rewrite"), e, owner);
    }

    let mut filters = Vec::new();
    for (kind, sub, cfg) in [
        ("request-headers", "requestHeaders", &r.request_headers),
        ("response-headers", "responseHeaders", &r.response_headers),
    ] {
        if let Some(cfg) = cfg {
            if let Err(e) = crate::engines::check_filter_config(kind, cfg) {
                cx.error(file, format!("{field}.{sub}"), e.to_string(), owner);
            }
            filters.push(FilterSpec { kind: kind.to_owned(), config: cfg.clone() });
        }
    }

    for (i, w) in r.wasm_filters.iter().enumerate() {
        let field = format!("{field}.wasmFilters[{i}]");
        if let Some(spec) = wasm_filter(cx, file, &field, team, w) {
            filters.push(spec);
        }
    }

    let auth = route_auth(cx, file, field, team, &r);
    let rate_limit = r.rate_limit.as_ref().map(|rl| {
        if r.auth.is_none() {
            cx.error(file, format!("{field}.rateLimit"), "rate limits need an authenticated route (auth)", owner);
        }
        let class = rl.class.clone().unwrap_or_else(|| "default".into());
        if !valid_name(&class) {
            cx.error(file, format!("{field}.rateLimit.class"), "classes are lowercase letters, digits and '-'", owner);
        }
        let cost = rl.cost.unwrap_or(1);
        if cost == 0 || cost > 1000 {
            cx.error(file, format!("{field}.rateLimit.cost"), "cost is 1 to 1000", owner);
        }
        postern_model::RouteRate { class, cost }
    });

    let deprecation = r.deprecation.as_ref().map(|d| {
        let date = |sub: &str, v: &Option<String>, cx: &mut Ctx| {
            v.as_ref().and_then(|s| match parse_date(s) {
                Ok(t) => Some(t),
                Err(e) => {
                    cx.error(file, format!("{field}.deprecation.{sub}"), e, owner);
                    None
                }
            })
        };
        let since = date("since", &d.since, cx);
        let sunset = date("sunset", &d.sunset, cx);
        if let Some(l) = &d.link
            && (!(l.starts_with("https://") || l.starts_with("http://")) || l.contains(['<', '>', '"', ' ']))
        {
            cx.error(file, format!("{field}.deprecation.link"), "must be an http(s) URL", owner);
        }
        Deprecation { since, sunset, link: d.link.clone() }
    });

    let retry = compile_retry(cx, file, field, &r.retry, owner);
    let priority = r.priority.as_deref().and_then(|p| priority(cx, file, format!("{field}.priority"), p, owner));
    if refused || cx.diags.len() != before {
        return None;
    }
    Some(Route {
        id: format!("{team}/{}", r.name),
        team: team.to_owned(),
        pool: r.pool,
        hosts,
        methods,
        path,
        path_kind: match kind {
            PathKind::Exact => PathMatchKind::Exact,
            PathKind::Prefix => PathMatchKind::Prefix,
        },
        version,
        backends,
        split_header,
        timeouts,
        max_body_bytes,
        rewrite,
        filters,
        deprecation,
        public: r.public,
        buffer_body,
        auth,
        rate_limit,
        retry,
        priority,
        validate,
        compress,
        grpc,
    })
}

/// A route's `grpc:`: the service's descriptors (compiled from `.proto` sources with
/// protox, a pure-Rust protobuf compiler, or read as a descriptor set), checked by
/// building the node's own transcoder; every binding must fall under the route's prefix
/// and the route's backends must speak HTTP/2.
fn route_grpc(
    cx: &mut Ctx,
    route: &RouteAt<'_>,
    doc: &crate::config::GrpcDoc,
    kind: PathKind,
    r: &RouteDoc,
    clusters: &BTreeMap<String, Cluster>,
) -> Option<postern_model::transcode::Transcode> {
    let (file, field, team) = (route.file, route.field, route.team);
    let owner = Some(team);
    let at = format!("{field}.grpc");
    let name = doc.proto.as_str();
    if name.is_empty() || name.contains(['/', '\\']) || name.contains("..") {
        cx.error(file, format!("{at}.proto"), "a file name in teams/<team>/proto/ (no '/' nor '..')", owner);
        return None;
    }
    let dir = cx.root.join("teams").join(team).join("proto");
    let rel = format!("teams/{team}/proto/{name}");
    let path = dir.join(name);
    if !path.is_file() {
        cx.error(file, format!("{at}.proto"), format!("no file {rel}"), owner);
        return None;
    }
    let descriptors = if name.ends_with(".proto") {
        let compiled = protox::Compiler::new([&dir]).and_then(|mut c| {
            c.include_imports(true).include_source_info(false);
            c.open_file(name)?;
            Ok(c.encode_file_descriptor_set())
        });
        match compiled {
            Ok(d) => d,
            Err(e) => {
                cx.error(&path, "", format!("does not compile: {e}"), owner);
                return None;
            }
        }
    } else {
        match std::fs::read(&path) {
            Ok(d) => d,
            Err(e) => {
                cx.error(&path, "", format!("cannot be read: {e}"), owner);
                return None;
            }
        }
    };
    let t = postern_model::transcode::Transcode { source: rel.clone(), descriptors, service: doc.service.clone() };
    let built = match postern_transcode::Transcoder::build(&t) {
        Ok(b) => b,
        Err(e) => {
            cx.error(&path, "", e.to_string(), owner);
            return None;
        }
    };
    if kind != PathKind::Prefix {
        cx.error(
            file,
            format!("{field}.match.path"),
            "a transcoded route matches a PathPrefix its bindings fall under",
            owner,
        );
    }
    let prefix = route.path.trim_end_matches('/');
    for b in built.bindings() {
        let lit = b.literal_prefix();
        if !(lit == format!("{prefix}/") || lit.starts_with(&format!("{prefix}/")) || prefix.is_empty()) {
            cx.error(
                file,
                at.clone(),
                format!(
                    "{rel}: the binding {} {} is not under the route's path {}",
                    b.http_method(),
                    b.template_text(),
                    route.path
                ),
                owner,
            );
        }
    }
    for backend in &r.backend_refs {
        if let Some(c) = clusters.get(&backend.name)
            && !c.http2
        {
            cx.error(
                file,
                at.clone(),
                format!("cluster {} must set protocol: http2 to carry gRPC", backend.name),
                owner,
            );
        }
    }
    Some(t)
}

/// The route a `validate:` belongs to.
struct RouteAt<'a> {
    file: &'a Path,
    field: &'a str,
    team: &'a str,
    methods: &'a [String],
    path: &'a str,
    max_body_bytes: u64,
}

/// A route's `validate:`: its team's OpenAPI operation (each document loaded once per
/// compile) as the model's validation, checked against the route. `None` once refused
/// (the errors are reported; a document's own at its file and JSON pointer).
fn route_validation(cx: &mut Ctx, route: &RouteAt<'_>, doc: &ValidateDoc) -> Option<Validation> {
    let RouteAt { file, field, team, .. } = *route;
    let owner = Some(team);
    let at = |sub: &str| format!("{field}.validate{sub}");
    let limits = json_limits(cx, file, &at(".json"), doc.json.as_ref(), owner)?;
    let name = doc.openapi.as_str();
    let extension = Path::new(name).extension().and_then(|x| x.to_str());
    if name.contains(['/', '\\']) || name.contains("..") || !matches!(extension, Some("yaml" | "yml" | "json")) {
        let msg = format!("{name:?} is not a .yaml, .yml or .json file name in teams/{team}/openapi/");
        cx.error(file, at(".openapi"), msg, owner);
        return None;
    }
    let rel = format!("teams/{team}/openapi/{name}");
    let spec_path = cx.root.join(&rel);
    let spec = match cx.specs.get(&spec_path) {
        Some(cached) => cached.clone()?,
        None if !spec_path.is_file() => {
            cx.error(file, at(".openapi"), format!("no OpenAPI document {rel}"), owner);
            return None;
        }
        None => {
            let loaded = match Spec::load(&spec_path) {
                Ok(spec) => Some(Arc::new(spec)),
                Err(e) => {
                    spec_error(cx, &spec_path, e, owner);
                    None
                }
            };
            cx.specs.insert(spec_path.clone(), loaded.clone());
            loaded?
        }
    };
    let id = doc.operation_id.as_str();
    let op = match spec.operation(id, limits, &format!("{rel}#{id}")) {
        Ok(op) => op,
        Err(errors) => {
            for e in errors {
                if e.pointer == crate::openapi::OPERATIONS_POINTER {
                    cx.error(file, at(".operationId"), format!("{rel}: {}", e.message), owner);
                } else {
                    spec_error(cx, &spec_path, e, owner);
                }
            }
            return None;
        }
    };
    let before = cx.diags.len();
    let params: HashSet<&str> =
        segments(route.path).into_iter().filter_map(|s| s.strip_prefix('{')?.strip_suffix('}')).collect();
    for p in op.validation.parameters.iter().filter(|p| p.location == ParamIn::Path) {
        if !params.contains(p.name.as_str()) {
            let msg = format!(
                "path parameter {:?} of {rel}#{id} is not a {{{}}} segment of the route's path {}",
                p.name, p.name, route.path
            );
            cx.error(file, at(""), msg, owner);
        }
    }
    if !route.methods.is_empty() && !route.methods.iter().any(|m| m.eq_ignore_ascii_case(&op.method)) {
        let msg = format!(
            "operation {id} is {} {}, but the route matches only {}",
            op.method,
            op.path,
            route.methods.join(", ")
        );
        cx.error(file, at(""), msg, owner);
    }
    if op.validation.body.is_some() && route.max_body_bytes > postern_model::MAX_BUFFERED_BODY_BYTES {
        cx.error(file, at(""), "validating a body needs maxBodyBytes of at most 1 MiB", owner);
    }
    if cx.diags.len() != before {
        return None;
    }
    // The node's own validators, built now: a schema it could not compile (a pattern
    // the linear-time engine refuses, a bad keyword value) is refused here, at its
    // place in the spec.
    if let Err(e) = postern_validate::Validator::build(&op.validation, route.path) {
        let pointer = match e.pointer.strip_prefix('#') {
            Some(in_spec) => in_spec.to_owned(),
            None => format!("#{id} {}{}", e.what, e.pointer),
        };
        let msg = format!("{}: {}", e.what, e.message);
        if cx.spec_errors.insert((spec_path.clone(), pointer.clone(), msg.clone())) {
            cx.error(&spec_path, pointer, msg, owner);
        }
        return None;
    }
    Some(op.validation)
}

/// An error in an OpenAPI document, at its file and JSON pointer; once per compile.
fn spec_error(cx: &mut Ctx, spec_path: &Path, e: SpecError, owner: Option<&str>) {
    if cx.spec_errors.insert((spec_path.to_path_buf(), e.pointer.clone(), e.message.clone())) {
        cx.error(spec_path, e.pointer, e.message, owner);
    }
}

/// `validate.json:`, each field within its platform bound (errors name `field.<name>`).
fn json_limits(
    cx: &mut Ctx,
    file: &Path,
    field: &str,
    doc: Option<&JsonLimitsDoc>,
    owner: Option<&str>,
) -> Option<JsonLimits> {
    let mut limits = JsonLimits::default();
    let Some(doc) = doc else { return Some(limits) };
    let before = cx.diags.len();
    for (name, v, max, slot) in [
        ("maxDepth", doc.max_depth, MAX_JSON_DEPTH, &mut limits.max_depth),
        ("maxStringBytes", doc.max_string_bytes, 1 << 20, &mut limits.max_string_bytes),
        ("maxNumberChars", doc.max_number_chars, MAX_JSON_NUMBER_CHARS, &mut limits.max_number_chars),
    ] {
        if let Some(v) = v.and_then(|v| ranged(cx, file, format!("{field}.{name}"), v, (1, max), owner)) {
            *slot = v;
        }
    }
    (cx.diags.len() == before).then_some(limits)
}

/// A route is either explicitly public or authenticated, with scopes and a product the
/// platform knows.
fn route_auth(cx: &mut Ctx, file: &Path, field: &str, team: &str, r: &RouteDoc) -> Option<RouteAuth> {
    let owner = Some(team);
    let Some(a) = &r.auth else {
        if !r.public {
            cx.error(file, format!("{field}.auth"), "a route needs auth unless it is marked public: true", owner);
        }
        return None;
    };
    if r.public {
        cx.error(file, format!("{field}.public"), "a public route cannot also require auth", owner);
    }
    if r.sticky_header.is_some() {
        let msg = "an authenticated route splits by the caller's API key or app; stickyHeader is for public routes";
        cx.error(file, format!("{field}.stickyHeader"), msg, owner);
    }
    if a.methods.is_empty() {
        cx.error(file, format!("{field}.auth.methods"), "name apiKey, jwt or both", owner);
    }
    for (i, s) in a.scopes.iter().enumerate() {
        if !cx.plans.scopes.contains(s) {
            let msg = format!("unknown scope {s:?} (scopes are listed in platform/plans.yaml)");
            cx.error(file, format!("{field}.auth.scopes[{i}]"), msg, owner);
        }
    }
    if !cx.plans.products.contains(&a.product) {
        let msg = format!("unknown product {:?} (products are listed in platform/plans.yaml)", a.product);
        cx.error(file, format!("{field}.auth.product"), msg, owner);
    }
    let mut methods = Vec::new();
    for m in &a.methods {
        let m = match m {
            AuthMethodDoc::ApiKey => AuthMethod::ApiKey,
            AuthMethodDoc::Jwt => AuthMethod::Jwt,
        };
        if !methods.contains(&m) {
            methods.push(m);
        }
    }
    Some(RouteAuth { methods, scopes: a.scopes.clone(), product: a.product.clone() })
}

/// Resolves a Wasm filter attachment: manifest, module, review, limits, and a check of
/// the component itself in the real runtime (world, imports), and the filter's own
/// check of its config (its `init`).
fn wasm_filter(
    cx: &mut Ctx,
    file: &Path,
    field: &str,
    team: &str,
    w: &crate::config::WasmAttachDoc,
) -> Option<FilterSpec> {
    let owner = Some(team);
    if !valid_name(&w.name) {
        cx.error(file, format!("{field}.name"), "filter names are lowercase letters, digits and '-'", owner);
        return None;
    }
    let quarantine = match w.quarantine.policy() {
        Ok(q) => q,
        Err((name, why)) => {
            cx.error(file, format!("{field}.quarantine.{name}"), why, owner);
            return None;
        }
    };
    let manifest_path = cx.root.join("teams").join(team).join("filters").join(format!("{}.yaml", w.name));
    if !manifest_path.exists() {
        let rel = manifest_path.strip_prefix(&cx.root).unwrap_or(&manifest_path).display().to_string();
        cx.error(file, format!("{field}.name"), format!("no filter manifest {rel}"), owner);
        return None;
    }
    let manifest: crate::config::FilterManifestDoc = cx.load(&manifest_path, owner)?;
    let over = manifest.limits.over(&postern_model::wasm::Limits::MAXIMA);
    if !over.is_empty() {
        cx.error(&manifest_path, "limits", over.join("; "), owner);
        return None;
    }
    let module_path = manifest_path.parent().unwrap_or(&cx.root).join(&manifest.module);
    let bytes = match std::fs::read(&module_path) {
        Ok(b) => b,
        Err(e) => {
            cx.error(&manifest_path, "module", format!("cannot read {}: {e}", module_path.display()), owner);
            return None;
        }
    };
    let digest = postern_model::content_hash(&bytes);
    let approved = cx.review.iter().any(|a| a.digest == digest && a.team == team && a.filter == w.name);
    if !approved {
        cx.error(
            &manifest_path,
            "module",
            format!("module {digest} of filter {} is not approved for team {team} in platform/filters.yaml", w.name),
            owner,
        );
        return None;
    }
    let module = match cx.sandbox.load(&bytes, &digest) {
        Ok(m) => m,
        Err(e) => {
            cx.error(&manifest_path, "module", format!("module {digest}: {e}"), owner);
            return None;
        }
    };
    if cx.sampled.insert(manifest_path.clone()) {
        run_samples(cx, &manifest_path, team, &module, &manifest);
    }
    cx.modules.insert(digest.clone(), module_path);
    // The filter's own check of its config (`init`), as each node will run it.
    if let Err(e) = cx.sandbox.check_config(&module, &w.config, &manifest.limits) {
        cx.error(file, format!("{field}.config"), format!("filter {}: {e}", w.name), owner);
        return None;
    }
    let attachment = postern_model::wasm::Attachment {
        name: w.name.clone(),
        module: digest,
        limits: manifest.limits,
        failure: w.failure,
        response_phase: w.response_phase,
        config: w.config.clone(),
        quarantine,
    };
    match serde_json::to_value(&attachment) {
        Ok(config) => Some(FilterSpec { kind: "wasm".into(), config }),
        Err(e) => {
            cx.error(file, field, e.to_string(), owner);
            None
        }
    }
}

/// Checks every `teams/<team>/samples/*.yaml`: each saved request must route where it
/// says (a route, or 404/405).
fn check_route_samples(cx: &mut Ctx, routers: &HashMap<Pool, postern_router::Router<usize>>, routes: &[Route]) {
    for (team, dir) in team_dirs(&cx.root.join("teams")).unwrap_or_default() {
        for file in yaml_files(&dir.join("samples")) {
            let Some(doc) = cx.load::<crate::config::SamplesDoc>(&file, Some(&team)) else { continue };
            for (i, sample) in doc.samples.iter().enumerate() {
                let field = format!("samples[{i}]");
                match route_sample(sample, &team, routers, routes, &cx.paths) {
                    Ok(()) => {}
                    Err(why) => cx.error(&file, field, format!("{:?}: {why}", sample.name), Some(&team)),
                }
            }
        }
    }
}

fn route_sample(
    sample: &crate::config::RouteSampleDoc,
    team: &str,
    routers: &HashMap<Pool, postern_router::Router<usize>>,
    routes: &[Route],
    paths: &PathPolicy,
) -> Result<(), String> {
    let r = &sample.request;
    let method =
        http::Method::from_bytes(r.method.as_bytes()).map_err(|_| format!("{:?} is not a method", r.method))?;
    let mut headers = http::HeaderMap::new();
    for (k, v) in &r.headers {
        let name = http::HeaderName::from_bytes(k.as_bytes()).map_err(|_| format!("{k:?} is not a header name"))?;
        let value = http::HeaderValue::from_str(v).map_err(|_| format!("header {k}: {v:?} is not a header value"))?;
        headers.insert(name, value);
    }
    let host = postern_router::strip_port(r.host.as_deref().unwrap_or("sample.invalid")).to_ascii_lowercase();
    let raw = r.path.split_once('?').map_or(r.path.as_str(), |(p, _)| p);
    let pool = r.pool.unwrap_or(Pool::Public);
    // Routed as a node routes it: on its canonical path, or refused with 400.
    let path = postern_model::path::canonical(raw, paths);
    let found =
        path.as_ref().ok().and_then(|p| routers.get(&pool).map(|router| router.find(&host, &method, p, &headers)));
    let got = match found {
        _ if path.is_err() => Err(400u16),
        Some(postern_router::Match::Found(i)) => Ok(routes.get(*i).map(|r| r.id.clone()).unwrap_or_default()),
        Some(postern_router::Match::MethodNotAllowed(_)) => Err(405u16),
        Some(postern_router::Match::NotFound) | None => Err(404u16),
    };
    let describe = |g: &Result<String, u16>| match g {
        Ok(id) => format!("route {id}"),
        Err(s) => format!("no route ({s})"),
    };
    let want = match (&sample.expect.route, sample.expect.status) {
        (Some(route), None) => Ok(if route.contains('/') { route.clone() } else { format!("{team}/{route}") }),
        (None, Some(s @ (400 | 404 | 405))) => Err(s),
        _ => return Err("expect gives either route or status (400, 404 or 405)".to_owned()),
    };
    if got == want { Ok(()) } else { Err(format!("expected {}, got {}", describe(&want), describe(&got))) }
}

/// Runs a filter manifest's sample cases in the real sandbox, with the manifest's limits;
/// each case whose decision differs is an error naming it.
fn run_samples(
    cx: &mut Ctx,
    manifest_path: &Path,
    team: &str,
    module: &Arc<postern_wasm::Module>,
    manifest: &crate::config::FilterManifestDoc,
) {
    for (i, case) in manifest.samples.iter().enumerate() {
        let field = format!("samples[{i}]");
        let r = &case.request;
        let req = crate::filter_run::RunRequest {
            method: r.method.clone(),
            path: r.path.clone(),
            headers: r.headers.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            body: r.body.as_ref().map(|b| b.clone().into_bytes()),
        };
        let report = match cx.sandbox.run_sample(module, &case.config, manifest.limits, &req, &cx.paths) {
            Ok(r) => r,
            Err(e) => {
                cx.error(manifest_path, field, format!("{:?}: cannot run: {e:#}", case.name), Some(team));
                continue;
            }
        };
        // The last phase that ran decides.
        let got = report["phases"].as_array().and_then(|p| p.last()).cloned().unwrap_or_default();
        if let Some(why) = sample_mismatch(&case.expect, &got) {
            cx.error(manifest_path, field, format!("{:?}: {why}", case.name), Some(team));
        }
    }
}

/// How a filter's decision differs from what a sample expects, if it does.
fn sample_mismatch(expect: &crate::config::FilterExpectDoc, got: &serde_json::Value) -> Option<String> {
    let decision = got["decision"].as_str().unwrap_or("none");
    let describe = |v: &serde_json::Value| match v["decision"].as_str() {
        Some("respond") => format!("respond {}", v["status"]),
        Some("failed") => match v["rule"].as_str() {
            Some(rule) => format!("failed (bad_output: the answer breaks the rule {rule})"),
            None => format!("failed ({})", v["outcome"].as_str().unwrap_or("?")),
        },
        Some(d) => d.to_owned(),
        None => "nothing".to_owned(),
    };
    let wanted = match (expect.decision.as_str(), expect.status) {
        ("respond", Some(s)) => format!("respond {s}"),
        (d, _) => d.to_owned(),
    };
    if decision != expect.decision || (decision == "respond" && expect.status.is_some_and(|s| got["status"] != s)) {
        return Some(format!("expected {wanted}, got {}", describe(got)));
    }
    for (name, value) in &expect.set_headers {
        let set = got["set_headers"].as_array().and_then(|h| {
            h.iter().find(|kv| kv[0].as_str().is_some_and(|k| k.eq_ignore_ascii_case(name))).map(|kv| kv[1].clone())
        });
        if set.as_ref().and_then(|v| v.as_str()) != Some(value.as_str()) {
            let got = set.map_or("not set".to_owned(), |v| format!("set to {v}"));
            return Some(format!("expected header {name} set to {value:?}, it was {got}"));
        }
    }
    if let Some(p) = &expect.path
        && got["path"].as_str() != Some(p.as_str())
    {
        return Some(format!("expected path {p:?}, got {}", got["path"]));
    }
    None
}

fn postern_router_header_ok(h: &str) -> Result<(), ()> {
    if !h.is_empty() && h.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_') {
        Ok(())
    } else {
        Err(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PLATFORM_CLUSTERS: &str = "clusters:\n  a: { endpoints: [\"127.0.0.1:9001\"] }\n  mine: { endpoints: [\"127.0.0.1:9002\"], owner: t }\n  theirs: { endpoints: [\"127.0.0.1:9003\"], owner: u }\n";
    const OWNERS: &str = "owners:\n  - { host: \"*\", pathPrefix: /t, team: t }\n  - { host: \"*\", pathPrefix: /u, team: u }\n  - { host: api.example.com, pathPrefix: /t/special, team: u }\n";

    const PLANS: &str = "scopes: [orders:read, orders:write]\nproducts: [orders, search]\nplans:\n  free: { products: [search], rateLimit: { rps: 10, burst: 20 } }\n  partner: { products: [orders, search] }\n";

    #[test]
    fn routes_are_public_or_authenticated_with_known_scopes_and_products() {
        let authed = |auth: &str| {
            format!(
                "routes:\n  - name: r\n    timeouts: {{ connect: 1s, response: 2s }}\n    backendRefs: [{{ name: a }}]\n    match: {{ path: {{ value: /t/o }} }}\n{auth}"
            )
        };
        let s = compile_t(&authed("    auth: { methods: [apiKey, jwt], scopes: [orders:read], product: orders }\n"))
            .unwrap();
        let a = s.routes[0].auth.as_ref().unwrap();
        assert_eq!(a.methods, vec![AuthMethod::ApiKey, AuthMethod::Jwt]);
        assert_eq!(s.plans["partner"].products, vec!["orders", "search"]);

        let e = error_of(&authed(""));
        assert_eq!(
            e,
            "teams/t/routes.yaml: routes[0].auth: a route needs auth unless it is marked public: true (owner: t)"
        );
        let e = error_of(&authed("    auth: { methods: [jwt], scopes: [orders:delete], product: orders }\n"));
        assert!(e.contains("routes[0].auth.scopes[0]: unknown scope \"orders:delete\""), "{e}");
        let e = error_of(&authed("    auth: { methods: [jwt], product: billing }\n"));
        assert!(e.contains("routes[0].auth.product: unknown product \"billing\""), "{e}");
        let e = error_of(&authed("    auth: { methods: [], product: orders }\n"));
        assert!(e.contains("routes[0].auth.methods: name apiKey, jwt or both"), "{e}");
        let e =
            error_of(&route("    match: { path: { value: /t/o } }\n    auth: { methods: [jwt], product: orders }\n"));
        assert!(e.contains("routes[0].public: a public route cannot also require auth"), "{e}");
        let e = error_of(&authed("    auth: { methods: [password], product: orders }\n"));
        assert!(e.contains("routes[0].auth.methods[0]"), "{e}");

        let s = compile_t(&authed(
            "    auth: { methods: [apiKey], product: search }\n    rateLimit: { class: search, cost: 5 }\n",
        ))
        .unwrap();
        assert_eq!(s.routes[0].rate_limit, Some(postern_model::RouteRate { class: "search".into(), cost: 5 }));
        assert_eq!(s.plans["free"].rate_limit, Some(postern_model::Rate { rps: 10, burst: 20 }));
        let e = error_of(&route("    match: { path: { value: /t/o } }\n    rateLimit: { cost: 2 }\n"));
        assert!(e.contains("routes[0].rateLimit: rate limits need an authenticated route"), "{e}");
        let e = error_of(&authed("    auth: { methods: [jwt], product: orders }\n    rateLimit: { cost: 0 }\n"));
        assert!(e.contains("routes[0].rateLimit.cost: cost is 1 to 1000"), "{e}");
    }

    #[test]
    fn plan_quotas_are_parsed_and_bad_ones_named() {
        let with_plans = |plans: &str| {
            let dir = repo_t(&route("    match: { path: { value: /t/o } }\n"));
            std::fs::write(dir.path().join("platform/plans.yaml"), plans).unwrap();
            compile(dir.path()).map(|c| c.snapshot).map_err(|r| r.0.iter().map(ToString::to_string).collect::<Vec<_>>())
        };
        let plans = "products: [search]\nplans:\n  a: { products: [search], quota: { monthly: 1000, mode: hard } }\n  b: { products: [search], quota: { monthly: 5, mode: overage, anchor: day-15 } }\n  c: { products: [search], quota: { monthly: 5, mode: hard, anchor: every-60s } }\n";
        let s = with_plans(plans).unwrap();
        use postern_model::usage::Anchor;
        let q = |p: &str| s.plans[p].quota.unwrap();
        assert_eq!(
            (q("a").calls, q("a").mode, q("a").anchor),
            (1000, postern_model::QuotaMode::Hard, Anchor::UtcMonth)
        );
        assert_eq!((q("b").mode, q("b").anchor), (postern_model::QuotaMode::Overage, Anchor::BillingDay(15)));
        assert_eq!(q("c").anchor, Anchor::EverySeconds(60));
        let e = with_plans("products: [search]\nplans:\n  a: { products: [search], quota: { monthly: 0, mode: hard, anchor: day-31 } }\n").unwrap_err();
        assert!(e.iter().any(|e| e.contains("plans.a.quota.monthly")), "{e:?}");
        assert!(e.iter().any(|e| e.contains("plans.a.quota.anchor") && e.contains("1 to 28")), "{e:?}");
        let e =
            with_plans("products: [search]\nplans:\n  a: { products: [search], quota: { monthly: 9, mode: soft } }\n")
                .unwrap_err();
        assert!(e.iter().any(|e| e.contains("plans.a")), "{e:?}");
    }

    fn route(body: &str) -> String {
        format!(
            "routes:\n  - name: r\n    public: true\n    timeouts: {{ connect: 1s, response: 2s }}\n    backendRefs: [{{ name: a }}]\n{body}"
        )
    }

    fn write(root: &Path, rel: &str, text: &str) {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }

    /// A repo with the standard platform files plus `teams/t/routes.yaml`.
    fn repo_t(routes: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "platform/clusters.yaml", PLATFORM_CLUSTERS);
        write(dir.path(), "platform/ownership.yaml", OWNERS);
        write(dir.path(), "platform/plans.yaml", PLANS);
        write(dir.path(), "teams/t/routes.yaml", routes);
        dir
    }

    /// Compiles [`repo_t`].
    fn compile_t(routes: &str) -> Result<Snapshot, Vec<String>> {
        let dir = repo_t(routes);
        compile(dir.path()).map(|c| c.snapshot).map_err(|r| r.0.iter().map(ToString::to_string).collect())
    }

    fn error_of(routes: &str) -> String {
        let errs = compile_t(routes).expect_err("should be refused");
        assert_eq!(errs.len(), 1, "{errs:#?}");
        errs.into_iter().next().unwrap()
    }

    #[test]
    fn the_path_policy_comes_from_gateway_yaml_and_judges_routes_and_samples() {
        let dir = repo_t(&route("    match: { path: { type: PathPrefix, value: /t } }\n"));
        let s = compile(dir.path()).unwrap().snapshot;
        assert_eq!(s.paths, PathPolicy::default());
        write(dir.path(), "platform/gateway.yaml", "paths:\n  semicolon: strip\n  emptySegments: merge\n");
        // Saved requests route as a node routes them: on the canonical path, or 400.
        write(
            dir.path(),
            "teams/t/samples/s.yaml",
            "samples:\n  - name: merged\n    request: { method: GET, path: \"/t//x;v=1\" }\n    expect: { route: r }\n  - name: encoded-slash\n    request: { method: GET, path: \"/t/a%2Fb\" }\n    expect: { status: 400 }\n",
        );
        let s = compile(dir.path()).unwrap().snapshot;
        assert_eq!(s.paths.semicolon, postern_model::path::Semicolon::Strip);
        assert_eq!(s.paths.empty_segments, postern_model::path::EmptySegments::Merge);
        write(dir.path(), "platform/gateway.yaml", "paths:\n  semicolons: strip\n");
        let e = compile(dir.path()).unwrap_err().0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n");
        assert!(e.contains("platform/gateway.yaml"), "{e}");
    }

    #[test]
    fn a_valid_route_compiles() {
        let s = compile_t(&route("    match: { path: { type: Exact, value: \"/t/orders/{id}\" }, methods: [GET] }\n"))
            .unwrap();
        assert_eq!(s.routes.len(), 1);
        assert_eq!(s.routes[0].id, "t/r");
        assert_eq!(
            s.routes[0].timeouts,
            Timeouts { connect_ms: 1000, response_ms: 2000, body_idle_ms: None, body_total_ms: 300_000 }
        );
        assert_eq!(s.routes[0].max_body_bytes, DEFAULT_MAX_BODY_BYTES);
    }

    #[test]
    fn unknown_fields_are_named_with_their_path() {
        let e = error_of(&route("    match: { path: { value: /t }, method: GET }\n"));
        assert!(e.starts_with("teams/t/routes.yaml: routes[0].match.method: unknown field `method`"), "{e}");
    }

    #[test]
    fn prefixes_owned_by_another_team_are_refused() {
        let e = error_of(&route("    match: { path: { value: /u/orders } }\n"));
        assert_eq!(
            e,
            "teams/t/routes.yaml: routes[0].match.path.value: host * path /u/orders belongs to team u, not t (owner: t)"
        );
        // A host-specific claim beats the any-host claim.
        let e = error_of(&route("    hostnames: [api.example.com]\n    match: { path: { value: /t/special/x } }\n"));
        assert!(e.contains("host api.example.com path /t/special/x belongs to team u, not t"), "{e}");
        let e = error_of(&route("    match: { path: { value: /nobody } }\n"));
        assert!(e.contains("is not registered to any team"), "{e}");
    }

    #[test]
    fn equally_specific_routes_are_refused_naming_both() {
        let text = "routes:\n  - name: one\n    public: true\n    match: { path: { type: Exact, value: \"/t/o/{id}\" }, methods: [GET] }\n    backendRefs: [{ name: a }]\n    timeouts: { connect: 1s, response: 2s }\n  - name: two\n    public: true\n    match: { path: { type: Exact, value: \"/t/o/{key}\" }, methods: [GET, PUT] }\n    backendRefs: [{ name: a }]\n    timeouts: { connect: 1s, response: 2s }\n";
        let e = error_of(text);
        assert!(
            e.starts_with(
                "teams/t/routes.yaml: routes[1].match: equally specific as route t/one (teams/t/routes.yaml: routes[0])"
            ),
            "{e}"
        );
    }

    #[test]
    fn clusters_must_exist_and_belong_to_the_team() {
        let text = route("    match: { path: { value: /t } }\n").replace("[{ name: a }]", "[{ name: nope }]");
        assert!(error_of(&text).contains("routes[0].backendRefs[0].name: unknown cluster \"nope\""));
        let text = route("    match: { path: { value: /t } }\n").replace("[{ name: a }]", "[{ name: theirs }]");
        assert!(error_of(&text).contains("cluster \"theirs\" belongs to team u"));
        let text =
            route("    match: { path: { value: /t } }\n").replace("[{ name: a }]", "[{ name: mine, weight: 0 }]");
        assert!(error_of(&text).contains("routes[0].backendRefs: weights add up to 0"));
    }

    #[test]
    fn timeouts_are_required_and_capped() {
        let text = route("    match: { path: { value: /t } }\n").replace("response: 2s", "response: 31s");
        assert_eq!(
            error_of(&text),
            "teams/t/routes.yaml: routes[0].timeouts.response: 31s is over the platform maximum of 30s (owner: t)"
        );
        let text = route("    match: { path: { value: /t } }\n").replace("connect: 1s", "connect: soon");
        assert!(error_of(&text).contains("routes[0].timeouts.connect: \"soon\" is not a duration"));
        let text =
            route("    match: { path: { value: /t } }\n").replace("    timeouts: { connect: 1s, response: 2s }\n", "");
        assert!(error_of(&text).contains("missing field `timeouts`"));
    }

    #[test]
    fn unbounded_or_malformed_patterns_are_refused() {
        let long = format!("/t{}", "/x".repeat(40));
        let e = error_of(&route(&format!("    match: {{ path: {{ value: \"{long}\" }} }}\n")));
        assert!(e.contains("routes[0].match.path.value") && e.contains("more than 32 segments"), "{e}");
        let e = error_of(&route("    match: { path: { value: \"/t/*\" } }\n"));
        assert!(e.contains("only allowed as a whole {param} segment"), "{e}");
        let e = error_of(&route("    match: { path: { value: /t }, methods: [FETCH] }\n"));
        assert!(e.contains("routes[0].match.methods: unsupported method \"FETCH\""), "{e}");
        let e = error_of(&route("    hostnames: [\"Bad_Host\"]\n    match: { path: { value: /t } }\n"));
        assert!(e.contains("routes[0].hostnames: invalid hostname"), "{e}");
    }

    #[test]
    fn filters_rewrites_and_deprecations_are_checked() {
        let e = error_of(&route(
            "    match: { path: { value: /t } }\n    requestHeaders: { set: [{ name: x-auth-subject, value: root }] }\n",
        ));
        assert!(e.contains("routes[0].requestHeaders: set: header \"x-auth-subject\" is reserved"), "{e}");
        let e = error_of(&route(
            "    match: { path: { value: /t } }\n    rewrite: { replacePrefixMatch: /a, replaceFullPath: /b }\n",
        ));
        assert!(e.contains("routes[0].rewrite: give exactly one"), "{e}");
        let e = error_of(&route("    match: { path: { value: /t } }\n    rewrite: { replaceFullPath: \"/a/../b\" }\n"));
        assert!(
            e.contains("routes[0].rewrite: \"/a/../b\" is not a canonical path (its canonical form is \"/b\")"),
            "{e}"
        );
        let e = error_of(&route("    match: { path: { value: /t } }\n    rewrite: { replaceFullPath: \"/a//b\" }\n"));
        assert!(e.contains("routes[0].rewrite: \"/a//b\": the path has an empty segment"), "{e}");
        let e = error_of(&route("    match: { path: { value: \"/t/%6F/{id}\" } }\n"));
        assert!(e.contains("routes[0].match.path.value: \"/t/%6F/p\" is not a canonical path"), "{e}");
        let e = error_of(&route("    match: { path: { value: /t } }\n    deprecation: { sunset: next-year }\n"));
        assert!(e.contains("routes[0].deprecation.sunset: \"next-year\" is not an RFC 3339 date"), "{e}");
        let e = error_of(&route("    match: { path: { value: /t } }\n    maxBodyBytes: 2000000000\n"));
        assert!(e.contains("routes[0].maxBodyBytes: over the platform maximum"), "{e}");
        let e =
            error_of(&route("    match: { path: { value: /t } }\n    maxBodyBytes: 2000000\n    bufferBody: true\n"));
        assert!(e.contains("routes[0].bufferBody: a buffered body needs maxBodyBytes of at most 1 MiB"), "{e}");
        let e = error_of(&route("    match: { path: { value: /t } }\n    wasmFilters: [{ name: nothing-here }]\n"));
        assert!(
            e.contains("routes[0].wasmFilters[0].name: no filter manifest teams/t/filters/nothing-here.yaml"),
            "{e}"
        );
        let e = error_of(&route(
            "    match: { path: { value: /t } }\n    wasmFilters: [{ name: f, quarantine: { failurePercent: 0 } }]\n",
        ));
        assert!(e.contains("routes[0].wasmFilters[0].quarantine.failurePercent: 0 is out of range: 1 to 100"), "{e}");
        let e = error_of(&route(
            "    match: { path: { value: /t } }\n    wasmFilters: [{ name: f, quarantine: { forSecs: 7200 } }]\n",
        ));
        assert!(e.contains("routes[0].wasmFilters[0].quarantine.forSecs: 7200 is out of range: 1 to 3600"), "{e}");
        let e = error_of(&route(
            "    match: { path: { value: /t } }\n    wasmFilters: [{ name: f, quarantine: { minCall: 5 } }]\n",
        ));
        assert!(e.contains("unknown field `minCall`"), "{e}");
    }

    #[test]
    fn saved_requests_must_reach_their_routes() {
        let dir = repo_t(&route("    match: { path: { value: /t/orders }, methods: [GET] }\n"));
        let w = |rel: &str, text: &str| write(dir.path(), rel, text);
        let sample = |name: &str, req: &str, expect: &str| {
            format!("  - name: {name}\n    request: {req}\n    expect: {expect}\n")
        };
        let good = [
            sample("list", "{ path: /t/orders/7 }", "{ route: r }"),
            sample("by id", "{ path: \"/t/orders?x=1\", host: \"Any.Example:443\" }", "{ route: t/r }"),
            sample("delete", "{ method: DELETE, path: /t/orders }", "{ status: 405 }"),
            sample("elsewhere", "{ path: /u/x }", "{ status: 404 }"),
        ]
        .concat();
        w("teams/t/samples/orders.yaml", &format!("samples:\n{good}"));
        assert!(compile(dir.path()).is_ok());

        let bad = [
            sample("moved", "{ path: /t/elsewhere }", "{ route: r }"),
            sample("now routed", "{ path: /t/orders }", "{ status: 404 }"),
            sample("partner pool", "{ path: /t/orders, pool: partner }", "{ route: r }"),
        ]
        .concat();
        w("teams/t/samples/orders.yaml", &format!("samples:\n{bad}"));
        let errs: Vec<String> = compile(dir.path()).err().unwrap().0.iter().map(ToString::to_string).collect();
        assert_eq!(
            errs,
            vec![
                "teams/t/samples/orders.yaml: samples[0]: \"moved\": expected route t/r, got no route (404) (owner: t)",
                "teams/t/samples/orders.yaml: samples[1]: \"now routed\": expected no route (404), got route t/r (owner: t)",
                "teams/t/samples/orders.yaml: samples[2]: \"partner pool\": expected route t/r, got no route (404) (owner: t)",
            ]
        );
    }

    #[test]
    fn duplicate_names_are_refused() {
        let one = route("    match: { path: { value: /t/a } }\n");
        let two = one.replace("routes:\n", "").replace("/t/a", "/t/b");
        let e = error_of(&format!("{one}{two}"));
        assert!(e.contains("routes[1].name: route t/r is already defined at teams/t/routes.yaml: routes[0]"), "{e}");
    }

    const ORDERS_SPEC: &str = "openapi: 3.0.3\npaths:\n  /orders/{id}:\n    post:\n      operationId: createOrder\n      parameters:\n        - { name: id, in: path, required: true, schema: { type: integer } }\n      requestBody:\n        required: true\n        content:\n          application/json:\n            schema: { $ref: '#/components/schemas/Order' }\ncomponents:\n  schemas:\n    Order: { type: object, required: [qty], properties: { qty: { type: integer, minimum: 1 } } }\n";

    /// Compiles [`repo_t`] with `spec` as `teams/t/openapi/orders.yaml`.
    fn compile_spec(routes: &str, spec: &str) -> Result<Snapshot, Vec<String>> {
        let dir = repo_t(routes);
        write(dir.path(), "teams/t/openapi/orders.yaml", spec);
        compile(dir.path()).map(|c| c.snapshot).map_err(|r| r.0.iter().map(ToString::to_string).collect())
    }

    /// A route on `POST /t/orders/{id}` with `validate: <validate>` and `extra` lines.
    fn validated(validate: &str, extra: &str) -> String {
        route(&format!(
            "    match: {{ path: {{ type: Exact, value: \"/t/orders/{{id}}\" }}, methods: [POST] }}\n    validate: {validate}\n{extra}"
        ))
    }

    #[test]
    fn a_validated_route_carries_its_operation_and_buffers_its_body() {
        use postern_model::validate::{Media, ParamShape, Parameter, RequestBody, Scalar};
        use serde_json::json;
        let routes = validated("{ openapi: orders.yaml, operationId: createOrder, json: { maxDepth: 8 } }", "");
        let s = compile_spec(&routes, ORDERS_SPEC).unwrap();
        let dialect = crate::openapi::SCHEMA_DIALECT;
        let want = Validation {
            source: "teams/t/openapi/orders.yaml#createOrder".into(),
            parameters: vec![Parameter {
                name: "id".into(),
                location: ParamIn::Path,
                required: true,
                shape: ParamShape::Scalar { of: Scalar::Integer },
                schema: json!({ "$schema": dialect, "type": "integer" }),
            }],
            body: Some(RequestBody {
                required: true,
                media: vec![Media {
                    range: "application/json".into(),
                    schema: Some(json!({
                        "$schema": dialect,
                        "$ref": "#/$defs/~1components~1schemas~1Order",
                        "$defs": { "/components/schemas/Order": { "type": "object", "required": ["qty"],
                            "properties": { "qty": { "type": "integer", "minimum": 1 } } } },
                    })),
                }],
            }),
            json: JsonLimits { max_depth: 8, ..JsonLimits::default() },
        };
        assert_eq!(s.routes[0].validate, Some(want));
        assert!(s.routes[0].buffer_body);
    }

    #[test]
    fn validate_is_checked_against_its_document_and_the_route() {
        let e = |validate: &str, extra: &str| compile_spec(&validated(validate, extra), ORDERS_SPEC).unwrap_err();
        assert_eq!(
            e("{ openapi: orders.yaml, operationId: create }", ""),
            vec![
                "teams/t/routes.yaml: routes[0].validate.operationId: teams/t/openapi/orders.yaml: no operation has operationId \"create\" (known: createOrder) (owner: t)"
            ]
        );
        let e1 = e("{ openapi: ../u/openapi/orders.yaml, operationId: createOrder }", "");
        assert!(e1[0].contains("routes[0].validate.openapi: \"../u/openapi/orders.yaml\" is not a .yaml"), "{e1:?}");
        let e1 = e("{ openapi: other.yaml, operationId: createOrder }", "");
        assert!(e1[0].contains("routes[0].validate.openapi: no OpenAPI document teams/t/openapi/other.yaml"), "{e1:?}");
        let e1 = e("{ openapi: orders.yaml, operationId: createOrder, json: { maxDepth: 0 } }", "");
        assert!(e1[0].contains("routes[0].validate.json.maxDepth: 0 is out of range (1 to 128)"), "{e1:?}");
        let e1 = e("{ openapi: orders.yaml, operationId: createOrder }", "    maxBodyBytes: 2000000\n");
        assert!(e1[0].contains("routes[0].validate: validating a body needs maxBodyBytes of at most 1 MiB"), "{e1:?}");
        let routes = validated("{ openapi: orders.yaml, operationId: createOrder }", "")
            .replace("{id}", "{key}")
            .replace("methods: [POST]", "methods: [GET]");
        let e1 = compile_spec(&routes, ORDERS_SPEC).unwrap_err();
        assert_eq!(e1.len(), 2, "{e1:?}");
        assert!(e1[0].contains("routes[0].validate: path parameter \"id\" of teams/t/openapi/orders.yaml#createOrder is not a {id} segment of the route's path /t/orders/{key}"), "{e1:?}");
        assert!(
            e1[1].contains(
                "routes[0].validate: operation createOrder is POST /orders/{id}, but the route matches only GET"
            ),
            "{e1:?}"
        );
    }

    #[test]
    fn errors_in_a_document_name_its_file_and_pointer_once() {
        let spec = ORDERS_SPEC.replace("minimum: 1", "$ref: 'common.yaml#/Qty'");
        let one = validated("{ openapi: orders.yaml, operationId: createOrder }", "");
        let two = one.replace("routes:\n", "").replace("name: r", "name: r2").replace("/t/orders/", "/t/orders2/");
        assert_eq!(
            compile_spec(&format!("{one}{two}"), &spec).unwrap_err(),
            vec![
                "teams/t/openapi/orders.yaml: /components/schemas/Order/properties/qty/$ref: remote $ref is refused: common.yaml#/Qty (owner: t)"
            ]
        );
        let e = compile_spec(&one, "openapi: 3.0.3\npaths: [\n").unwrap_err();
        assert!(e.len() == 1 && e[0].starts_with("teams/t/openapi/orders.yaml: "), "{e:?}");
    }

    #[test]
    fn a_schema_the_node_cannot_build_is_named_in_the_spec() {
        // Look-behind is not in the linear-time engine the node runs patterns with.
        let spec = ORDERS_SPEC.replace("minimum: 1", "pattern: '(?<=a)b'");
        let one = validated("{ openapi: orders.yaml, operationId: createOrder }", "");
        let e = compile_spec(&one, &spec).unwrap_err();
        assert_eq!(e.len(), 1, "{e:?}");
        assert!(
            e[0].starts_with(
                "teams/t/openapi/orders.yaml: /components/schemas/Order/properties/qty/pattern: request body application/json: "
            ) && e[0].ends_with("(owner: t)"),
            "{e:?}"
        );
    }

    #[test]
    fn compression_is_opt_in_with_a_threshold() {
        let s = compile_t(&route("    match: { path: { value: /t/c } }\n    compress: true\n")).unwrap();
        assert_eq!(s.routes[0].compress, Some(postern_model::Compress { min_bytes: 1024 }));
        let s = compile_t(&route("    match: { path: { value: /t/c } }\n    compress: { minBytes: 0 }\n")).unwrap();
        assert_eq!(s.routes[0].compress, Some(postern_model::Compress { min_bytes: 0 }));
        let s = compile_t(&route("    match: { path: { value: /t/c } }\n    compress: false\n")).unwrap();
        assert_eq!(s.routes[0].compress, None);
        let e = compile_t(&route("    match: { path: { value: /t/c } }\n    compress: { minBytes: 9999999 }\n"))
            .unwrap_err();
        assert!(e[0].contains("routes[0].compress.minBytes: is 0 to 1 MiB"), "{e:?}");
    }

    #[test]
    fn a_transcoded_route_carries_its_descriptors_and_is_checked() {
        const PROTO: &str = "syntax = \"proto3\";\npackage t.v1;\nimport \"google/api/annotations.proto\";\n\
            message Get { string id = 1; }\nmessage Thing { string id = 1; }\n\
            service Things { rpc GetThing(Get) returns (Thing) { option (google.api.http) = { get: \"/t/v1/things/{id}\" }; } }\n";
        let routes = route(
            "    match: { path: { type: PathPrefix, value: /t/v1 } }\n    grpc: { proto: things.proto, service: t.v1.Things }\n",
        );
        let dir = repo_t(&routes);
        write(dir.path(), "teams/t/proto/things.proto", PROTO);
        for f in ["annotations.proto", "http.proto"] {
            let from =
                Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/config/teams/orders/proto/google/api").join(f);
            write(dir.path(), &format!("teams/t/proto/google/api/{f}"), &std::fs::read_to_string(from).unwrap());
        }
        let errs = |dir: &Path| -> Vec<String> {
            compile(dir).map(|_| Vec::new()).unwrap_or_else(|r| r.0.iter().map(ToString::to_string).collect())
        };
        // An HTTP/1.1 cluster cannot carry gRPC.
        assert_eq!(
            errs(dir.path()),
            ["teams/t/routes.yaml: routes[0].grpc: cluster a must set protocol: http2 to carry gRPC (owner: t)"]
        );
        write(
            dir.path(),
            "platform/clusters.yaml",
            &PLATFORM_CLUSTERS.replace(
                "a: { endpoints: [\"127.0.0.1:9001\"] }",
                "a: { endpoints: [\"127.0.0.1:9001\"], protocol: http2 }",
            ),
        );
        let s = compile(dir.path()).unwrap().snapshot;
        let g = s.routes[0].grpc.as_ref().unwrap();
        assert_eq!((g.source.as_str(), g.service.as_str()), ("teams/t/proto/things.proto", "t.v1.Things"));
        assert!(s.routes[0].buffer_body);
        assert_eq!(postern_transcode::Transcoder::build(g).unwrap().bindings().len(), 1);
        // A binding outside the route's prefix; an unknown field in a template; no file.
        write(dir.path(), "teams/t/routes.yaml", &routes.replace("value: /t/v1 }", "value: /t/v2 }"));
        assert_eq!(
            errs(dir.path()),
            [
                "teams/t/routes.yaml: routes[0].grpc: teams/t/proto/things.proto: the binding GET /t/v1/things/{id} is not under the route's path /t/v2 (owner: t)"
            ]
        );
        write(dir.path(), "teams/t/routes.yaml", &routes);
        write(dir.path(), "teams/t/proto/things.proto", &PROTO.replace("{id}", "{nope}"));
        assert_eq!(
            errs(dir.path()),
            [
                "teams/t/proto/things.proto: t.v1.Things.GetThing (get /t/v1/things/{nope}): t.v1.Get has no field \"nope\" (owner: t)"
            ]
        );
        write(dir.path(), "teams/t/routes.yaml", &routes.replace("things.proto", "other.proto"));
        assert_eq!(
            errs(dir.path()),
            ["teams/t/routes.yaml: routes[0].grpc.proto: no file teams/t/proto/other.proto (owner: t)"]
        );
    }

    #[test]
    fn every_error_is_reported_at_once() {
        let text = route("    match: { path: { value: /u } }\n").replace("response: 2s", "response: 1h");
        let errs = compile_t(&text).unwrap_err();
        assert_eq!(errs.len(), 2, "{errs:#?}");
    }
}
