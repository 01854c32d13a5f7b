//! One route of a team file: its match, ownership, backends, timeouts, body, rewrite,
//! filters, auth, rate limit, deprecation and retry; and the saved requests that must
//! still reach their routes.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use postern_model::path::PathPolicy;
use postern_model::{
    AuthMethod, Cluster, DEFAULT_MAX_BODY_BYTES, Deprecation, FilterSpec, PathMatchKind, PathRewrite, Pool, Route,
    RouteAuth, Timeouts, VersionMatch, WeightedBackend,
};
use postern_router::{PathKind, RouteError, RouteSpec, RouterBuilder};

use super::context::{Ctx, Owner, RouteAt, team_dirs, yaml_files};
use super::filters::wasm_filter;
use super::grpc::route_grpc;
use super::parse::{parse_date, parse_ms, postern_router_header_ok, priority, ranged_ms, segments, valid_name};
use super::validation::route_validation;
use crate::config::{AuthMethodDoc, CompressDoc, PathType, RouteDoc};

/// Largest request body limit a route may declare (1 GiB).
pub const MAX_BODY_LIMIT: u64 = 1 << 30;

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

/// One route of a team file, checked field by field; `None` when any check failed (the
/// diagnostics say why).
pub(crate) fn compile_route(
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

    let RouteMatch { hosts, methods, path, kind, version } = route_match(cx, file, field, team, &r);
    check_ownership(cx, file, field, team, &hosts, &path, owners);
    let (backends, split_header) = route_backends(cx, file, field, team, &r, clusters);
    let timeouts = route_timeouts(cx, file, field, owner, &r);
    let max_body_bytes = route_body_limit(cx, file, field, owner, &r);
    let at = RouteAt { file, field, team, methods: &methods, path: &path, max_body_bytes };
    let compress = route_compress(cx, file, field, owner, &r);
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

    let rewrite = route_rewrite(cx, file, field, owner, &r);
    let filters = route_filters(cx, file, field, team, &r);
    let auth = route_auth(cx, file, field, team, &r);
    let rate_limit = route_rate_limit(cx, file, field, owner, &r);
    let deprecation = route_deprecation(cx, file, field, owner, &r);
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

/// What a route matches on: hosts, methods, path and its kind, version header.
struct RouteMatch {
    hosts: Vec<String>,
    methods: Vec<String>,
    path: String,
    kind: PathKind,
    version: Option<VersionMatch>,
}

/// A route's `match:` and `hostnames:`, checked as the router will read them.
fn route_match(cx: &mut Ctx, file: &Path, field: &str, team: &str, r: &RouteDoc) -> RouteMatch {
    let owner = Some(team);
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
        cx.error(file, format!("{field}.match.path.value"), e.to_string(), owner);
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
    RouteMatch { hosts, methods, path, kind, version }
}

/// Ownership: every host (or "*" for a route on any host) and the path prefix belong to
/// the route's team.
fn check_ownership(cx: &mut Ctx, file: &Path, field: &str, team: &str, hosts: &[String], path: &str, owners: &[Owner]) {
    let owner = Some(team);
    let claim_hosts: Vec<&str> = if hosts.is_empty() { vec!["*"] } else { hosts.iter().map(String::as_str).collect() };
    for h in claim_hosts {
        match owner_of(owners, h, path) {
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
}

/// A route's `backendRefs:` (known clusters the team may use, weights that add up) and
/// its `stickyHeader:`.
fn route_backends(
    cx: &mut Ctx,
    file: &Path,
    field: &str,
    team: &str,
    r: &RouteDoc,
    clusters: &BTreeMap<String, Cluster>,
) -> (Vec<WeightedBackend>, Option<String>) {
    let owner = Some(team);
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
    (backends, split_header)
}

/// A route's `timeouts:`; the body's whole time must outlast the wait for the answer.
fn route_timeouts(cx: &mut Ctx, file: &Path, field: &str, owner: Option<&str>, r: &RouteDoc) -> Timeouts {
    let ms = |sub: &str, v: &str, cx: &mut Ctx| match parse_ms(v) {
        Ok(ms) => ms,
        Err(e) => {
            cx.error(file, format!("{field}.timeouts.{sub}"), e.to_string(), owner);
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
    timeouts
}

/// A route's `maxBodyBytes:`, within the platform maximum and, for a buffered body, 1 MiB.
fn route_body_limit(cx: &mut Ctx, file: &Path, field: &str, owner: Option<&str>, r: &RouteDoc) -> u64 {
    let max_body_bytes = r.max_body_bytes.unwrap_or(DEFAULT_MAX_BODY_BYTES);
    if max_body_bytes > MAX_BODY_LIMIT {
        cx.error(file, format!("{field}.maxBodyBytes"), "over the platform maximum of 1 GiB", owner);
    }
    if r.buffer_body && max_body_bytes > postern_model::MAX_BUFFERED_BODY_BYTES {
        cx.error(file, format!("{field}.bufferBody"), "a buffered body needs maxBodyBytes of at most 1 MiB", owner);
    }
    max_body_bytes
}

/// A route's `compress:`: off, on with the default threshold, or on from `minBytes`.
fn route_compress(
    cx: &mut Ctx,
    file: &Path,
    field: &str,
    owner: Option<&str>,
    r: &RouteDoc,
) -> Option<postern_model::Compress> {
    match &r.compress {
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
    }
}

/// A route's `rewrite:`: exactly one kind, with a canonical result.
fn route_rewrite(cx: &mut Ctx, file: &Path, field: &str, owner: Option<&str>, r: &RouteDoc) -> Option<PathRewrite> {
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
        cx.error(file, format!("{field}.rewrite"), e.to_string(), owner);
    }
    rewrite
}

/// A route's filters in order: the header filters, then its Wasm filters.
fn route_filters(cx: &mut Ctx, file: &Path, field: &str, team: &str, r: &RouteDoc) -> Vec<FilterSpec> {
    let owner = Some(team);
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
    filters
}

/// A route's `rateLimit:`: on an authenticated route, a named class, a cost of 1 to 1000.
fn route_rate_limit(
    cx: &mut Ctx,
    file: &Path,
    field: &str,
    owner: Option<&str>,
    r: &RouteDoc,
) -> Option<postern_model::RouteRate> {
    r.rate_limit.as_ref().map(|rl| {
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
    })
}

/// A route's `deprecation:`: its dates and an http(s) link.
fn route_deprecation(cx: &mut Ctx, file: &Path, field: &str, owner: Option<&str>, r: &RouteDoc) -> Option<Deprecation> {
    r.deprecation.as_ref().map(|d| {
        let date = |sub: &str, v: &Option<String>, cx: &mut Ctx| {
            v.as_ref().and_then(|s| match parse_date(s) {
                Ok(t) => Some(t),
                Err(e) => {
                    cx.error(file, format!("{field}.deprecation.{sub}"), e.to_string(), owner);
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
    })
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

/// Checks every `teams/<team>/samples/*.yaml`: each saved request must route where it
/// says (a route, or 404/405).
pub(crate) fn check_route_samples(
    cx: &mut Ctx,
    routers: &HashMap<Pool, postern_router::Router<usize>>,
    routes: &[Route],
) {
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
) -> Result<(), SampleError> {
    let r = &sample.request;
    let method = http::Method::from_bytes(r.method.as_bytes()).map_err(|_| SampleError::Method(r.method.clone()))?;
    let mut headers = http::HeaderMap::new();
    for (k, v) in &r.headers {
        let name = http::HeaderName::from_bytes(k.as_bytes()).map_err(|_| SampleError::HeaderName(k.clone()))?;
        let value = http::HeaderValue::from_str(v)
            .map_err(|_| SampleError::HeaderValue { name: k.clone(), value: v.clone() })?;
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
        _ => return Err(SampleError::Expect),
    };
    if got == want { Ok(()) } else { Err(SampleError::Routed { want: describe(&want), got: describe(&got) }) }
}

/// Why a saved sample request fails.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum SampleError {
    #[error("{0:?} is not a method")]
    Method(String),
    #[error("{0:?} is not a header name")]
    HeaderName(String),
    #[error("header {name}: {value:?} is not a header value")]
    HeaderValue { name: String, value: String },
    #[error("expect gives either route or status (400, 404 or 405)")]
    Expect,
    /// It routes elsewhere than expected.
    #[error("expected {want}, got {got}")]
    Routed { want: String, got: String },
}
