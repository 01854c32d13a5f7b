//! Compiles a config repository into one [`Snapshot`], collecting every error with the
//! file, field and owning team it concerns.
//!
//! ```text
//! mod.rs         the compile: platform files, clusters, ownership, team files; `compile_repo`
//! context.rs     the compile's state and its problems (`Diagnostic`); the team directories
//! parse.rs       values in the documents: durations and ranges, names, dates
//! clusters.rs    a cluster's breaker, retry budget, outlier ejection and TLS
//! routes.rs      a route: match, ownership, backends, timeouts, auth, retry; saved requests
//! validation.rs  a route's `validate:` against its OpenAPI operation
//! grpc.rs        a route's `grpc:`: descriptors and bindings
//! filters.rs     a route's Wasm filters: manifest, review, sandbox checks, sample cases
//! ```

mod clusters;
mod context;
mod filters;
mod grpc;
mod parse;
mod routes;
#[cfg(test)]
mod tests;
mod validation;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

use postern_model::credentials::Credentials;
use postern_model::path::PathPolicy;
use postern_model::{Cluster, PathMatchKind, Plan, Pool, Priority, Route, SCHEMA_VERSION, Snapshot};
use postern_router::{PathKind, RouteError, RouteSpec, RouterBuilder};

pub use self::context::YAML_FILE_CAP;
pub use self::context::{Diagnostic, Rejected};
pub use self::grpc::{DESCRIPTOR_SET_CAP, PROTO_FILE_CAP, PROTO_FILES_CAP};
pub use self::routes::MAX_BODY_LIMIT;

use self::clusters::{cluster_tls, compile_breaker, compile_budget, compile_outlier};
use self::context::{Ctx, Owner, team_dirs, yaml_files};
use self::parse::{priority, ranged, segments, valid_host_port, valid_name};
use self::routes::{check_route_samples, compile_route};
use crate::config::{ClusterDoc, ClustersDoc, OwnershipDoc, PlansDoc, RoutesDoc};

/// A compiled repository: the snapshot and the filter modules it references.
#[derive(Debug)]
pub struct Compiled {
    /// The snapshot.
    pub snapshot: Snapshot,
    /// Module digest (`sha256:<hex>`) → source file.
    pub modules: BTreeMap<String, PathBuf>,
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
    let never_canary = load_platform(&mut cx, root);
    let clusters = compile_clusters(&mut cx, root);
    let owners = load_owners(&mut cx, root);
    let files = team_files(&mut cx, root);
    let (routes, builders) = compile_routes(&mut cx, root, files, &clusters, &owners);

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
                clusters,
                routes,
                plans: snapshot_plans(&cx.plans),
                paths: cx.paths,
                never_canary,
            },
            modules: cx.modules,
        })
    } else {
        Err(Rejected(cx.diags))
    }
}

/// The platform files but clusters and ownership: `gateway.yaml` (path policy, plans
/// never on a canary), `plans.yaml` and `filters.yaml` (the reviewed modules), into `cx`.
fn load_platform(cx: &mut Ctx, root: &Path) -> postern_model::NeverCanary {
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
        check_plans(cx, &plans_path, &doc);
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
    never_canary
}

/// Every plan of `plans.yaml`: its rates, quota, priority and known products.
fn check_plans(cx: &mut Ctx, plans_path: &Path, doc: &PlansDoc) {
    for (name, plan) in &doc.plans {
        for (sub, r) in [("rateLimit", &plan.rate_limit), ("appRateLimit", &plan.app_rate_limit)] {
            if let Some(r) = r
                && (r.rps == 0 || r.rps > 1_000_000_000 || r.burst.is_some_and(|b| b == 0 || b > 1_000_000_000))
            {
                cx.error(plans_path, format!("plans.{name}.{sub}"), "rps and burst are 1 to 1e9", None);
            }
        }
        if let Some(q) = &plan.quota {
            if q.monthly == 0 {
                cx.error(plans_path, format!("plans.{name}.quota.monthly"), "give at least 1 call", None);
            }
            if let Err(e) = q.anchor() {
                cx.error(plans_path, format!("plans.{name}.quota.anchor"), e.to_string(), None);
            }
        }
        if let Some(p) = &plan.priority {
            priority(cx, plans_path, format!("plans.{name}.priority"), p, None);
        }
        for (i, p) in plan.products.iter().enumerate() {
            if !doc.products.contains(p) {
                let msg = format!("unknown product {p:?} (products are listed under products:)");
                cx.error(plans_path, format!("plans.{name}.products[{i}]"), msg, None);
            }
        }
    }
}

/// Every cluster of `platform/clusters.yaml`, by name.
fn compile_clusters(cx: &mut Ctx, root: &Path) -> BTreeMap<String, Cluster> {
    let clusters_path = root.join("platform/clusters.yaml");
    let clusters: ClustersDoc = cx.load(&clusters_path, None).unwrap_or(ClustersDoc { clusters: BTreeMap::new() });
    let mut out_clusters = BTreeMap::new();
    for (name, c) in clusters.clusters {
        let cluster = compile_cluster(cx, root, &clusters_path, &name, c);
        out_clusters.insert(name, cluster);
    }
    out_clusters
}

/// One cluster: its name, endpoints, connection cap, breaker, retry budget, shedding,
/// protocol, TLS and outlier ejection.
fn compile_cluster(cx: &mut Ctx, root: &Path, clusters_path: &Path, name: &str, c: ClusterDoc) -> Cluster {
    let field = format!("clusters.{name}");
    if !valid_name(name) {
        cx.error(clusters_path, &field, "cluster names are lowercase letters, digits and '-'", None);
    }
    if c.endpoints.is_empty() {
        cx.error(clusters_path, format!("{field}.endpoints"), "a cluster needs at least one endpoint", None);
    }
    for (i, e) in c.endpoints.iter().enumerate() {
        if e.parse::<std::net::SocketAddr>().is_err() && !valid_host_port(e) {
            cx.error(clusters_path, format!("{field}.endpoints[{i}]"), format!("{e:?} is not host:port"), None);
        }
    }
    let max_connections = c.max_connections.unwrap_or(postern_model::DEFAULT_MAX_CONNECTIONS);
    if max_connections == 0 || max_connections > postern_model::MAX_CONNECTIONS_LIMIT {
        cx.error(clusters_path, format!("{field}.maxConnections"), "must be 1 to 65536", None);
    }
    let breaker = compile_breaker(cx, clusters_path, &field, &c.breaker, c.owner.as_deref());
    let retry_budget = compile_budget(cx, clusters_path, &field, &c.retry_budget, c.owner.as_deref());
    let shed_at_percent = c
        .shed_at_percent
        .and_then(|p| {
            ranged(cx, clusters_path, format!("{field}.shedAtPercent"), p.into(), (10, 100), c.owner.as_deref())
        })
        .and_then(|p| u8::try_from(p).ok())
        .unwrap_or(postern_model::DEFAULT_SHED_AT_PERCENT);
    let http2 = match c.protocol.as_deref() {
        None | Some("http1") => false,
        Some("http2") => true,
        Some(p) => {
            let msg = format!("unknown protocol {p:?} (http1 or http2)");
            cx.error(clusters_path, format!("{field}.protocol"), msg, c.owner.as_deref());
            false
        }
    };
    let tls = c.tls.as_ref().and_then(|t| cluster_tls(cx, root, clusters_path, &field, t, c.owner.as_deref()));
    let outlier = compile_outlier(cx, clusters_path, &field, &c.outlier, c.owner.as_deref());
    Cluster {
        endpoints: c.endpoints,
        owner: c.owner,
        max_connections,
        breaker,
        retry_budget,
        shed_at_percent,
        http2,
        tls,
        outlier,
    }
}

/// The claims of `platform/ownership.yaml`: host and path prefix to team, each claimed once.
fn load_owners(cx: &mut Ctx, root: &Path) -> Vec<Owner> {
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
    owners
}

/// Team files, in a stable order: each with its team.
fn team_files(cx: &mut Ctx, root: &Path) -> Vec<(String, PathBuf)> {
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
    files
}

/// Every route of the team files, each defined once and placed in its pool's router
/// without an equally specific rival; with the routers' builders (values index the routes).
fn compile_routes(
    cx: &mut Ctx,
    root: &Path,
    files: Vec<(String, PathBuf)>,
    clusters: &BTreeMap<String, Cluster>,
    owners: &[Owner],
) -> (Vec<Route>, HashMap<Pool, RouterBuilder<usize>>) {
    let mut routes: Vec<Route> = Vec::new();
    let mut origin: Vec<(PathBuf, String)> = Vec::new(); // file and field of each route
    let mut builders: HashMap<Pool, RouterBuilder<usize>> = HashMap::new();
    let mut names: HashMap<String, (PathBuf, String)> = HashMap::new();

    for (team, file) in files {
        let Some(doc) = cx.load::<RoutesDoc>(&file, Some(&team)) else { continue };
        for (i, r) in doc.routes.into_iter().enumerate() {
            let field = format!("routes[{i}]");
            if let Some(route) = compile_route(cx, &file, &field, &team, r, clusters, owners) {
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
    (routes, builders)
}

/// The snapshot's plans, from the checked `plans.yaml`.
fn snapshot_plans(plans: &PlansDoc) -> BTreeMap<String, Plan> {
    plans
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
        .collect()
}

/// Why a repository did not compile: every problem of its snapshot, or of its credential
/// state.
#[derive(Debug)]
pub enum RepoError {
    /// The snapshot's problems.
    Rejected(Rejected),
    /// The credential state's problems, each naming its file and line or field.
    Credentials(Vec<String>),
}

/// Compiles the whole repository: the snapshot with the modules it names, then the
/// credential state against the snapshot's plans. `posternctl compile`, `validate` and
/// `serve`'s publish compile a repository through it.
pub fn compile_repo(root: &Path) -> Result<(Compiled, Credentials), RepoError> {
    let compiled = compile(root).map_err(RepoError::Rejected)?;
    let creds =
        crate::credentials::compile_credentials(root, &compiled.snapshot.plans).map_err(RepoError::Credentials)?;
    Ok((compiled, creds))
}
