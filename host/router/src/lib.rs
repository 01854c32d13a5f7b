//! Postern's route table, compiled once per snapshot and read by every request.
//!
//! Lookup order is host → path (a segment trie) → method → optional version header:
//!
//! * **host**: an exact hostname beats the longest matching wildcard (`*.example.com`),
//!   which beats routes that accept any host. A host table that has no route for the
//!   request falls through to the next, less specific one.
//! * **path**: patterns are split on `/` into literal segments and `{param}` segments (a
//!   parameter matches exactly one non-empty segment). An `Exact` route beats every
//!   `Prefix` route; among prefixes the longest (deepest) wins; at equal depth a literal
//!   segment beats a parameter. Prefixes match whole segments: `/v1/orders` matches
//!   `/v1/orders` and `/v1/orders/7`, never `/v1/ordersX`.
//! * **method**: a route lists its methods or takes any; a listed method beats "any".
//! * **version**: a route may also require one header value (e.g. `api-version: 2`); a
//!   route with a version condition beats the same route without one.
//!
//! Two routes that are equally specific for some request are refused when the table is
//! built ([`RouteError::Conflict`]), so the outcome never depends on file order.
//!
//! A lookup allocates nothing: it walks `&str` segments of the request path.

use std::collections::HashMap;

use http::{HeaderMap, HeaderName, HeaderValue, Method};

/// Longest path pattern accepted, in bytes.
pub const MAX_PATTERN_LEN: usize = 1024;
/// Most segments a path pattern may have.
pub const MAX_PATTERN_SEGMENTS: usize = 32;

/// How a route's path pattern matches a request path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PathKind {
    /// The request path has exactly the pattern's segments.
    Exact,
    /// The request path starts with the pattern's segments.
    Prefix,
}

/// Why a route cannot enter the table.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RouteError {
    /// The path pattern is malformed.
    #[error("invalid path pattern {pattern:?}: {reason}")]
    Pattern {
        /// The offending pattern.
        pattern: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The hostname is malformed.
    #[error("invalid hostname {host:?}: {reason}")]
    Host {
        /// The offending hostname.
        host: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A method is not one of the standard HTTP methods.
    #[error("unsupported method {0:?} (use GET, HEAD, POST, PUT, DELETE, PATCH, OPTIONS, TRACE or CONNECT)")]
    Method(String),
    /// The version header name or value is not a valid header.
    #[error("invalid version header {0:?}")]
    Version(String),
    /// Another route is equally specific for some request.
    #[error("equally specific as route #{existing} for the same host, path, method and version")]
    Conflict {
        /// Index (insertion order) of the route already in the table.
        existing: usize,
    },
}

/// One route's match conditions, as given to [`RouterBuilder::add`].
#[derive(Clone, Copy, Debug)]
pub struct RouteSpec<'a> {
    /// Hostnames (lowercase, no port); `*.example.com` for a wildcard; empty means any host.
    pub hosts: &'a [String],
    /// Methods; empty means any method.
    pub methods: &'a [String],
    /// The path pattern, e.g. `/v1/orders/{id}`.
    pub path: &'a str,
    /// Exact or prefix match.
    pub kind: PathKind,
    /// Optional `(header name, value)` the request must carry.
    pub version: Option<(&'a str, &'a str)>,
}

/// The outcome of a lookup.
#[derive(Debug, PartialEq, Eq)]
pub enum Match<'r, T> {
    /// The most specific route.
    Found(&'r T),
    /// Some route matches host and path but none takes this method; the set of methods
    /// that would have matched is given for the `Allow` header.
    MethodNotAllowed(MethodSet),
    /// Nothing matches.
    NotFound,
}

/// A set of standard HTTP methods, as a bit mask.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MethodSet(u16);

const METHODS: [Method; 9] = [
    Method::GET,
    Method::HEAD,
    Method::POST,
    Method::PUT,
    Method::DELETE,
    Method::PATCH,
    Method::OPTIONS,
    Method::TRACE,
    Method::CONNECT,
];

impl MethodSet {
    /// Every method.
    pub const ANY: MethodSet = MethodSet((1 << METHODS.len()) - 1);

    fn bit(method: &Method) -> u16 {
        // Ordered by frequency so the common case is the first comparison.
        match METHODS.iter().position(|m| m == method) {
            Some(i) => 1 << i,
            None => 0,
        }
    }

    fn parse(methods: &[String]) -> Result<MethodSet, RouteError> {
        if methods.is_empty() {
            return Ok(MethodSet::ANY);
        }
        let mut set = 0;
        for m in methods {
            let i =
                METHODS.iter().position(|k| k.as_str() == m.as_str()).ok_or_else(|| RouteError::Method(m.clone()))?;
            set |= 1 << i;
        }
        Ok(MethodSet(set))
    }

    /// Whether the set holds `method`.
    pub fn contains(self, method: &Method) -> bool {
        self.0 & Self::bit(method) != 0
    }

    /// Whether the set is empty.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The methods in the set, in a fixed order.
    pub fn iter(self) -> impl Iterator<Item = &'static Method> {
        METHODS.iter().enumerate().filter(move |(i, _)| self.0 & (1 << i) != 0).map(|(_, m)| m)
    }

    /// The set as an `Allow` header value, e.g. `GET, HEAD`.
    pub fn to_allow_header(self) -> String {
        let mut out = String::new();
        for m in self.iter() {
            if !out.is_empty() {
                out.push_str(", ");
            }
            out.push_str(m.as_str());
        }
        out
    }
}

#[derive(Debug)]
struct Entry {
    methods: MethodSet,
    version: Option<(HeaderName, HeaderValue)>,
    route: usize,
}

impl Entry {
    fn version_matches(&self, headers: &HeaderMap) -> bool {
        match &self.version {
            None => true,
            Some((name, value)) => headers.get(name) == Some(value),
        }
    }

    /// Sort key: version-specific first, then method-specific, then fewer methods.
    fn rank(&self) -> (bool, bool, u32) {
        (self.version.is_none(), self.methods == MethodSet::ANY, self.methods.0.count_ones())
    }

    fn overlaps(&self, other: &Entry) -> bool {
        self.methods.0 & other.methods.0 != 0 && self.version == other.version
    }
}

#[derive(Debug)]
struct Node {
    literal: HashMap<Box<str>, Node>,
    param: Option<Box<Node>>,
    exact: Vec<Entry>,
    prefix: Vec<Entry>,
}

impl Node {
    fn new() -> Node {
        Node { literal: HashMap::new(), param: None, exact: Vec::new(), prefix: Vec::new() }
    }

    fn sort(&mut self) {
        self.exact.sort_by_key(Entry::rank);
        self.prefix.sort_by_key(Entry::rank);
        for child in self.literal.values_mut() {
            child.sort();
        }
        if let Some(p) = &mut self.param {
            p.sort();
        }
    }
}

/// Picks the first entry (they are sorted by specificity) that takes `method` and whose
/// version condition holds; otherwise records which methods would have matched.
fn pick(entries: &[Entry], method: &Method, headers: &HeaderMap, allowed: &mut MethodSet) -> Option<usize> {
    for e in entries {
        if e.version_matches(headers) {
            if e.methods.contains(method) {
                return Some(e.route);
            }
            allowed.0 |= e.methods.0;
        }
    }
    None
}

#[derive(Clone, Copy)]
struct Best {
    route: usize,
    depth: usize,
    exact: bool,
}

fn visit(
    node: &Node,
    segs: &[&str],
    depth: usize,
    method: &Method,
    headers: &HeaderMap,
    best: &mut Option<Best>,
    allowed: &mut MethodSet,
) {
    if segs.len() == depth
        && let Some(route) = pick(&node.exact, method, headers, allowed)
    {
        *best = Some(Best { route, depth, exact: true });
        return;
    }
    if !node.prefix.is_empty()
        && best.is_none_or(|b| !b.exact && b.depth < depth)
        && let Some(route) = pick(&node.prefix, method, headers, allowed)
    {
        *best = Some(Best { route, depth, exact: false });
    }
    let Some(seg) = segs.get(depth) else { return };
    if let Some(child) = node.literal.get(*seg) {
        visit(child, segs, depth + 1, method, headers, best, allowed);
        if best.is_some_and(|b| b.exact) {
            return;
        }
    }
    if let Some(child) = &node.param
        && !seg.is_empty()
    {
        visit(child, segs, depth + 1, method, headers, best, allowed);
    }
}

#[derive(Debug)]
struct Table {
    root: Node,
}

impl Table {
    fn find(&self, segs: &[&str], method: &Method, headers: &HeaderMap, allowed: &mut MethodSet) -> Option<usize> {
        let mut best = None;
        visit(&self.root, segs, 0, method, headers, &mut best, allowed);
        best.map(|b| b.route)
    }
}

/// Builds a [`Router`]; refuses malformed and equally specific routes.
#[derive(Debug)]
pub struct RouterBuilder<T> {
    exact_hosts: HashMap<Box<str>, Table>,
    wildcard_hosts: Vec<(Box<str>, Table)>,
    any_host: Table,
    values: Vec<T>,
}

impl<T> Default for RouterBuilder<T> {
    fn default() -> Self {
        RouterBuilder {
            exact_hosts: HashMap::new(),
            wildcard_hosts: Vec::new(),
            any_host: Table { root: Node::new() },
            values: Vec::new(),
        }
    }
}

/// A parsed path-pattern segment.
#[derive(Debug, PartialEq, Eq)]
enum Segment<'a> {
    Literal(&'a str),
    Param,
}

fn parse_pattern(pattern: &str) -> Result<Vec<Segment<'_>>, RouteError> {
    let err = |reason| RouteError::Pattern { pattern: pattern.to_owned(), reason };
    if pattern.len() > MAX_PATTERN_LEN {
        return Err(err("longer than 1024 bytes"));
    }
    let Some(rest) = pattern.strip_prefix('/') else {
        return Err(err("must start with '/'"));
    };
    if rest.is_empty() {
        return Ok(Vec::new());
    }
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    let mut out = Vec::new();
    for seg in rest.split('/') {
        if seg.is_empty() {
            return Err(err("empty segment ('//')"));
        }
        if seg == "." || seg == ".." {
            return Err(err("dot segments are not allowed"));
        }
        if let Some(name) = seg.strip_prefix('{').and_then(|s| s.strip_suffix('}')) {
            if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
                return Err(err("a parameter is {name} with letters, digits and '_'"));
            }
            out.push(Segment::Param);
        } else if seg.contains(['{', '}', '*', '?', '#']) {
            return Err(err("'{', '}', '*', '?' and '#' are only allowed as a whole {param} segment"));
        } else if !seg.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(err("segments must be visible ASCII (percent-encode the rest)"));
        } else {
            out.push(Segment::Literal(seg));
        }
        if out.len() > MAX_PATTERN_SEGMENTS {
            return Err(err("more than 32 segments"));
        }
    }
    Ok(out)
}

enum HostKey<'a> {
    Exact(&'a str),
    Wildcard(&'a str),
}

fn parse_host(host: &str) -> Result<HostKey<'_>, RouteError> {
    let err = |reason| RouteError::Host { host: host.to_owned(), reason };
    if host.is_empty() || host.len() > 253 {
        return Err(err("must be 1 to 253 bytes"));
    }
    let (wild, name) = match host.strip_prefix("*.") {
        Some(rest) => (true, rest),
        None => (false, host),
    };
    let valid = !name.is_empty()
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        });
    if !valid {
        return Err(err("lowercase letters, digits, '-' and '.', optionally starting with '*.'"));
    }
    Ok(if wild { HostKey::Wildcard(&host[1..]) } else { HostKey::Exact(name) })
}

impl<T> RouterBuilder<T> {
    /// An empty builder.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of routes added so far.
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// Whether no route was added.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// The value of the route added at `index`.
    pub fn get(&self, index: usize) -> Option<&T> {
        self.values.get(index)
    }

    /// Checks a route's conditions without adding it.
    pub fn check(spec: &RouteSpec<'_>) -> Result<(), RouteError> {
        parse_pattern(spec.path)?;
        MethodSet::parse(spec.methods)?;
        for h in spec.hosts {
            parse_host(h)?;
        }
        version_header(spec.version)?;
        Ok(())
    }

    /// Adds a route; its index (insertion order) is what [`RouteError::Conflict`] reports.
    /// Nothing is added when an error is returned.
    pub fn add(&mut self, spec: &RouteSpec<'_>, value: T) -> Result<usize, RouteError> {
        let segments = parse_pattern(spec.path)?;
        let methods = MethodSet::parse(spec.methods)?;
        let version = version_header(spec.version)?;
        let mut hosts = Vec::with_capacity(spec.hosts.len());
        for h in spec.hosts {
            hosts.push(parse_host(h)?);
        }
        let route = self.values.len();
        let entry = || Entry { methods, version: version.clone(), route };

        // Check every table first so a conflict leaves the builder untouched.
        let mut tables: Vec<&Table> = Vec::new();
        if hosts.is_empty() {
            tables.push(&self.any_host);
        }
        for h in &hosts {
            let t = match h {
                HostKey::Exact(name) => self.exact_hosts.get(*name),
                HostKey::Wildcard(suffix) => self.wildcard_hosts.iter().find(|(s, _)| &**s == *suffix).map(|(_, t)| t),
            };
            tables.extend(t);
        }
        let candidate = entry();
        for t in tables {
            if let Some(node) = walk(&t.root, &segments) {
                let list = match spec.kind {
                    PathKind::Exact => &node.exact,
                    PathKind::Prefix => &node.prefix,
                };
                if let Some(e) = list.iter().find(|e| e.overlaps(&candidate)) {
                    return Err(RouteError::Conflict { existing: e.route });
                }
            }
        }

        let mut targets: Vec<&mut Table> = Vec::new();
        if hosts.is_empty() {
            targets.push(&mut self.any_host);
        }
        for h in &hosts {
            match h {
                HostKey::Exact(name) => {
                    self.exact_hosts.entry((*name).into()).or_insert_with(|| Table { root: Node::new() });
                }
                HostKey::Wildcard(suffix) => {
                    if !self.wildcard_hosts.iter().any(|(s, _)| &**s == *suffix) {
                        self.wildcard_hosts.push(((*suffix).into(), Table { root: Node::new() }));
                    }
                }
            }
        }
        for (name, table) in self.exact_hosts.iter_mut() {
            if hosts.iter().any(|h| matches!(h, HostKey::Exact(n) if **name == **n)) {
                targets.push(table);
            }
        }
        for (suffix, table) in self.wildcard_hosts.iter_mut() {
            if hosts.iter().any(|h| matches!(h, HostKey::Wildcard(s) if **suffix == **s)) {
                targets.push(table);
            }
        }
        for t in targets {
            let node = walk_mut(&mut t.root, &segments);
            match spec.kind {
                PathKind::Exact => node.exact.push(entry()),
                PathKind::Prefix => node.prefix.push(entry()),
            }
        }
        self.values.push(value);
        Ok(route)
    }

    /// Freezes the table.
    pub fn build(mut self) -> Router<T> {
        self.any_host.root.sort();
        for t in self.exact_hosts.values_mut() {
            t.root.sort();
        }
        for (_, t) in self.wildcard_hosts.iter_mut() {
            t.root.sort();
        }
        // Longest suffix first, so the most specific wildcard is tried first.
        self.wildcard_hosts.sort_by_key(|w| std::cmp::Reverse(w.0.len()));
        Router {
            exact_hosts: self.exact_hosts,
            wildcard_hosts: self.wildcard_hosts,
            any_host: self.any_host,
            values: self.values,
        }
    }
}

fn version_header(version: Option<(&str, &str)>) -> Result<Option<(HeaderName, HeaderValue)>, RouteError> {
    match version {
        None => Ok(None),
        Some((name, value)) => {
            let n = HeaderName::from_bytes(name.as_bytes()).map_err(|_| RouteError::Version(name.to_owned()))?;
            let v = HeaderValue::from_str(value).map_err(|_| RouteError::Version(value.to_owned()))?;
            Ok(Some((n, v)))
        }
    }
}

fn walk<'n>(mut node: &'n Node, segments: &[Segment<'_>]) -> Option<&'n Node> {
    for s in segments {
        node = match s {
            Segment::Literal(l) => node.literal.get(*l)?,
            Segment::Param => node.param.as_deref()?,
        };
    }
    Some(node)
}

fn walk_mut<'n>(mut node: &'n mut Node, segments: &[Segment<'_>]) -> &'n mut Node {
    for s in segments {
        node = match s {
            Segment::Literal(l) => node.literal.entry((*l).into()).or_insert_with(Node::new),
            Segment::Param => node.param.get_or_insert_with(|| Box::new(Node::new())),
        };
    }
    node
}

/// An immutable route table; see the crate docs for the matching rules.
#[derive(Debug)]
pub struct Router<T> {
    exact_hosts: HashMap<Box<str>, Table>,
    wildcard_hosts: Vec<(Box<str>, Table)>,
    any_host: Table,
    values: Vec<T>,
}

/// Most path segments a request may have to be routed (longer paths are not found).
pub const MAX_REQUEST_SEGMENTS: usize = 64;

impl<T> Router<T> {
    /// Number of routes.
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// The routes, in insertion order.
    pub fn values(&self) -> &[T] {
        &self.values
    }

    /// Finds the most specific route. `host` must be lowercase without a port; `path`
    /// is the request path without the query.
    pub fn find(&self, host: &str, method: &Method, path: &str, headers: &HeaderMap) -> Match<'_, T> {
        let mut buf: [&str; MAX_REQUEST_SEGMENTS] = [""; MAX_REQUEST_SEGMENTS];
        let rest = path.strip_prefix('/').unwrap_or(path);
        let mut n = 0;
        if !rest.is_empty() {
            for seg in rest.split('/') {
                if n == MAX_REQUEST_SEGMENTS {
                    return Match::NotFound;
                }
                buf[n] = seg;
                n += 1;
            }
        }
        let segs = &buf[..n];
        let mut allowed = MethodSet::default();
        let found = self
            .exact_hosts
            .get(host)
            .and_then(|t| t.find(segs, method, headers, &mut allowed))
            .or_else(|| {
                self.wildcard_hosts
                    .iter()
                    .filter(|(suffix, _)| host.len() > suffix.len() && host.ends_with(&**suffix))
                    .find_map(|(_, t)| t.find(segs, method, headers, &mut allowed))
            })
            .or_else(|| self.any_host.find(segs, method, headers, &mut allowed));
        match found.and_then(|i| self.values.get(i)) {
            Some(v) => Match::Found(v),
            None if !allowed.is_empty() => Match::MethodNotAllowed(allowed),
            None => Match::NotFound,
        }
    }
}

/// A `Host` value without its port (`[::1]:8080` keeps its brackets): with lowercase,
/// the form [`Router::find`] takes.
#[inline]
pub fn strip_port(h: &str) -> &str {
    if h.starts_with('[') {
        return h.find(']').map_or(h, |i| &h[..=i]);
    }
    match h.rsplit_once(':') {
        Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) => host,
        _ => h,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_stripped() {
        assert_eq!(strip_port("api.example.com:8080"), "api.example.com");
        assert_eq!(strip_port("api.example.com"), "api.example.com");
        assert_eq!(strip_port("[::1]:8080"), "[::1]");
    }

    fn spec<'a>(hosts: &'a [String], methods: &'a [String], path: &'a str, kind: PathKind) -> RouteSpec<'a> {
        RouteSpec { hosts, methods, path, kind, version: None }
    }

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    fn find<'r>(r: &'r Router<&'static str>, host: &str, method: Method, path: &str) -> Match<'r, &'static str> {
        r.find(host, &method, path, &HeaderMap::new())
    }

    fn table() -> Router<&'static str> {
        let none = s(&[]);
        let mut b = RouterBuilder::new();
        b.add(&spec(&none, &none, "/", PathKind::Prefix), "root").unwrap();
        b.add(&spec(&none, &none, "/v1/orders", PathKind::Prefix), "orders-prefix").unwrap();
        b.add(&spec(&none, &s(&["GET"]), "/v1/orders/{id}", PathKind::Exact), "order-get").unwrap();
        b.add(&spec(&none, &s(&["GET"]), "/v1/orders/search", PathKind::Exact), "order-search").unwrap();
        b.add(&spec(&none, &s(&["POST"]), "/v1/orders", PathKind::Exact), "order-create").unwrap();
        b.add(&spec(&none, &none, "/v1/orders/{id}/items", PathKind::Prefix), "items").unwrap();
        b.add(&spec(&none, &s(&["GET"]), "/v2/only-get", PathKind::Exact), "only-get").unwrap();
        b.add(&spec(&s(&["api.example.com"]), &none, "/v1/orders", PathKind::Prefix), "host-orders").unwrap();
        b.add(&spec(&s(&["*.partners.example.com"]), &none, "/", PathKind::Prefix), "partners").unwrap();
        b.build()
    }

    #[test]
    fn exact_beats_prefix_and_literal_beats_param() {
        let r = table();
        assert_eq!(find(&r, "x", Method::GET, "/v1/orders/7"), Match::Found(&"order-get"));
        assert_eq!(find(&r, "x", Method::GET, "/v1/orders/search"), Match::Found(&"order-search"));
        assert_eq!(find(&r, "x", Method::POST, "/v1/orders"), Match::Found(&"order-create"));
        // DELETE on an exact path falls back to the longest prefix that takes any method.
        assert_eq!(find(&r, "x", Method::DELETE, "/v1/orders/7"), Match::Found(&"orders-prefix"));
    }

    #[test]
    fn longest_prefix_wins_and_segments_are_whole() {
        let r = table();
        assert_eq!(find(&r, "x", Method::GET, "/v1/orders/7/items/3"), Match::Found(&"items"));
        assert_eq!(find(&r, "x", Method::GET, "/v1/orders/7/other"), Match::Found(&"orders-prefix"));
        assert_eq!(find(&r, "x", Method::GET, "/v1/ordersX"), Match::Found(&"root"));
        assert_eq!(find(&r, "x", Method::GET, "/"), Match::Found(&"root"));
        assert_eq!(find(&r, "x", Method::GET, "/v1/orders/"), Match::Found(&"orders-prefix"));
    }

    #[test]
    fn empty_segment_does_not_match_a_param() {
        let r = table();
        assert_eq!(find(&r, "x", Method::GET, "/v1/orders//items"), Match::Found(&"orders-prefix"));
    }

    #[test]
    fn hosts_exact_then_wildcard_then_any() {
        let r = table();
        assert_eq!(find(&r, "api.example.com", Method::GET, "/v1/orders/7"), Match::Found(&"host-orders"));
        // Nothing for this path in the host table: falls through to any-host routes.
        assert_eq!(find(&r, "api.example.com", Method::GET, "/v2/x"), Match::Found(&"root"));
        assert_eq!(find(&r, "acme.partners.example.com", Method::GET, "/v1/orders/7"), Match::Found(&"partners"));
        assert_eq!(find(&r, "partners.example.com", Method::GET, "/v1/orders/7"), Match::Found(&"order-get"));
    }

    #[test]
    fn method_not_allowed_lists_methods() {
        let none = s(&[]);
        let mut b = RouterBuilder::new();
        b.add(&spec(&none, &s(&["GET", "HEAD"]), "/a", PathKind::Exact), "a").unwrap();
        let r = b.build();
        match find(&r, "x", Method::POST, "/a") {
            Match::MethodNotAllowed(m) => assert_eq!(m.to_allow_header(), "GET, HEAD"),
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(find(&r, "x", Method::POST, "/b"), Match::NotFound);
    }

    #[test]
    fn version_header_selects_route() {
        let none = s(&[]);
        let mut b = RouterBuilder::new();
        b.add(&spec(&none, &none, "/orders", PathKind::Prefix), "default").unwrap();
        let mut v2 = spec(&none, &none, "/orders", PathKind::Prefix);
        v2.version = Some(("api-version", "2"));
        b.add(&v2, "v2").unwrap();
        let r = b.build();
        let mut h = HeaderMap::new();
        assert_eq!(r.find("x", &Method::GET, "/orders/1", &h), Match::Found(&"default"));
        h.insert("api-version", HeaderValue::from_static("2"));
        assert_eq!(r.find("x", &Method::GET, "/orders/1", &h), Match::Found(&"v2"));
        h.insert("api-version", HeaderValue::from_static("3"));
        assert_eq!(r.find("x", &Method::GET, "/orders/1", &h), Match::Found(&"default"));
    }

    #[test]
    fn equally_specific_routes_conflict() {
        let none = s(&[]);
        let mut b = RouterBuilder::new();
        b.add(&spec(&none, &s(&["GET"]), "/o/{id}", PathKind::Exact), "a").unwrap();
        assert_eq!(
            b.add(&spec(&none, &s(&["GET", "PUT"]), "/o/{other}", PathKind::Exact), "b"),
            Err(RouteError::Conflict { existing: 0 })
        );
        // Different methods or kinds do not conflict.
        b.add(&spec(&none, &s(&["PUT"]), "/o/{id}", PathKind::Exact), "c").unwrap();
        b.add(&spec(&none, &s(&["GET"]), "/o/{id}", PathKind::Prefix), "d").unwrap();
        let h = s(&["a.example.com"]);
        b.add(&spec(&h, &s(&["GET"]), "/o/{id}", PathKind::Exact), "e").unwrap();
        assert!(matches!(
            b.add(&spec(&h, &none, "/o/{id}", PathKind::Exact), "f"),
            Err(RouteError::Conflict { existing: 3 })
        ));
        assert_eq!(b.len(), 4);
    }

    #[test]
    fn bad_patterns_are_refused() {
        for p in ["", "v1", "/a//b", "/a/../b", "/a/{", "/a/{x-y}", "/a/b*", "/a b"] {
            assert!(parse_pattern(p).is_err(), "{p:?} accepted");
        }
        let long = "/a".repeat(40);
        assert!(parse_pattern(&long).is_err());
        assert!(parse_host("Api.example.com").is_err());
        assert!(parse_host("*.").is_err());
        assert!(MethodSet::parse(&s(&["FETCH"])).is_err());
    }

    #[test]
    fn very_long_request_paths_are_not_found() {
        let r = table();
        let path = "/x".repeat(MAX_REQUEST_SEGMENTS + 1);
        assert_eq!(find(&r, "x", Method::GET, &path), Match::NotFound);
    }
}
