//! The routing table through a real node: host, method, exact/prefix/params, version
//! header, pools, rewrites, and canary stickiness.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::collections::HashMap;

use bytes::Bytes;
use http::{Method, StatusCode};
use postern_e2e::{Echo, Node, Repo, client, get, platform, send, send_with};

const ROUTES: &str = r#"
routes:
  - name: order-by-id
    public: true
    match: { path: { type: Exact, value: "/v1/orders/{id}" }, methods: [GET] }
    backendRefs: [{ name: a }]
    timeouts: { connect: 1s, response: 5s }
  - name: order-search
    public: true
    match: { path: { type: Exact, value: /v1/orders/search }, methods: [GET] }
    backendRefs: [{ name: b }]
    timeouts: { connect: 1s, response: 5s }
  - name: orders-prefix
    public: true
    match: { path: { type: PathPrefix, value: /v1/orders } }
    backendRefs: [{ name: c }]
    timeouts: { connect: 1s, response: 5s }
  - name: orders-dated
    public: true
    match:
      path: { type: PathPrefix, value: /v1/orders }
      version: { header: api-version, value: "2026-06-01" }
    backendRefs: [{ name: b }]
    timeouts: { connect: 1s, response: 5s }
  - name: orders-on-host
    public: true
    hostnames: [api.example.com]
    match: { path: { type: PathPrefix, value: /v1/orders } }
    backendRefs: [{ name: b }]
    timeouts: { connect: 1s, response: 5s }
  - name: things-post
    public: true
    match: { path: { type: Exact, value: /v1/things }, methods: [POST] }
    backendRefs: [{ name: a }]
    timeouts: { connect: 1s, response: 5s }
  - name: things-get
    public: true
    match: { path: { type: Exact, value: /v1/things }, methods: [GET] }
    backendRefs: [{ name: b }]
    timeouts: { connect: 1s, response: 5s }
  - name: items-v1
    public: true
    match: { path: { value: /v1/items } }
    backendRefs: [{ name: a }]
    timeouts: { connect: 1s, response: 5s }
  - name: items-v2
    public: true
    match: { path: { value: /v2/items } }
    backendRefs: [{ name: b }]
    timeouts: { connect: 1s, response: 5s }
    rewrite: { replacePrefixMatch: /items }
  - name: full-rewrite
    public: true
    match: { path: { type: Exact, value: /health } }
    backendRefs: [{ name: c }]
    timeouts: { connect: 1s, response: 5s }
    rewrite: { replaceFullPath: /internal/health }
  - name: canary
    public: true
    match: { path: { value: /v1/canary } }
    backendRefs: [{ name: a, weight: 90 }, { name: b, weight: 10 }]
    stickyHeader: x-api-key
    timeouts: { connect: 1s, response: 5s }
  - name: partner-only
    pool: partner
    public: true
    match: { path: { value: /partner } }
    backendRefs: [{ name: c }]
    timeouts: { connect: 1s, response: 5s }
"#;

struct Fixture {
    node: Node,
    _echos: Vec<Echo>,
    _repo: Repo,
}

fn fixture() -> Fixture {
    let echos = vec![Echo::start("a"), Echo::start("b"), Echo::start("c")];
    let repo = Repo::new();
    platform(&repo, &[("a", &echos[0].addr()), ("b", &echos[1].addr()), ("c", &echos[2].addr())]);
    repo.write("teams/t/routes.yaml", ROUTES);
    let snap = repo.path().join("snapshot.json");
    repo.compile_ok(&snap);
    Fixture { node: Node::start(&snap, &[]), _echos: echos, _repo: repo }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routing_table() {
    let f = fixture();
    let n = &f.node;
    // (method, path, headers) -> (backend, path the backend saw)
    type Case<'a> = (Method, &'a str, &'a [(&'a str, &'a str)], &'a str, &'a str);
    let cases: &[Case<'_>] = &[
        (Method::GET, "/v1/orders/42", &[], "a", "/v1/orders/42"),
        (Method::GET, "/v1/orders/search", &[], "b", "/v1/orders/search"),
        (Method::GET, "/v1/orders/42/lines", &[], "c", "/v1/orders/42/lines"),
        (Method::DELETE, "/v1/orders/42", &[], "c", "/v1/orders/42"),
        (Method::GET, "/v1/orders", &[], "c", "/v1/orders"),
        (Method::GET, "/v1/orders/42/lines", &[("api-version", "2026-06-01")], "b", "/v1/orders/42/lines"),
        (Method::GET, "/v1/orders/42/lines", &[("api-version", "1999-01-01")], "c", "/v1/orders/42/lines"),
        (Method::GET, "/v1/orders/42/lines", &[("host", "api.example.com")], "b", "/v1/orders/42/lines"),
        (Method::GET, "/v1/orders/42/lines", &[("host", "API.Example.com:443")], "b", "/v1/orders/42/lines"),
        (Method::POST, "/v1/things", &[], "a", "/v1/things"),
        (Method::GET, "/v1/things", &[], "b", "/v1/things"),
        (Method::GET, "/v1/items/9?q=1", &[], "a", "/v1/items/9"),
        (Method::GET, "/v2/items/9?q=1", &[], "b", "/items/9"),
        (Method::GET, "/health", &[], "c", "/internal/health"),
    ];
    for (method, path, headers, backend, seen) in cases {
        let r = send(method.clone(), &n.url(path), headers, Bytes::new()).await;
        assert_eq!(r.status, StatusCode::OK, "{method} {path}: {:?}", r.body);
        assert_eq!(r.backend(), *backend, "{method} {path} {headers:?}");
        assert_eq!(r.json()["path"], *seen, "{method} {path}");
        if path.contains('?') {
            assert_eq!(r.json()["query"], "q=1");
        }
        assert_eq!(r.header("x-request-id").map(str::len), Some(32));
    }

    // Not found, wrong method, prefix on whole segments, wrong pool.
    let r = get(&n.url("/v1/ordersX"), &[]).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(r.json()["code"], "route_not_found");
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    assert_eq!(r.json()["request_id"].as_str(), r.header("x-request-id"));
    let r = send(Method::PUT, &n.url("/v1/things"), &[], Bytes::new()).await;
    assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(r.json()["code"], "method_not_allowed");
    assert_eq!(r.header("allow"), Some("GET, POST"));
    assert_eq!(get(&n.url("/partner/x"), &[]).await.status, StatusCode::NOT_FOUND);
    let r = get(&n.partner_url("/partner/x"), &[]).await;
    assert_eq!(r.backend(), "c");
    assert_eq!(get(&n.partner_url("/v1/items"), &[]).await.status, StatusCode::NOT_FOUND);

    // Dot segments are resolved, in every encoding, before the router decides; what
    // backends read differently is refused.
    let r = get(&n.url("/v1/items/%2e%2e/admin"), &[]).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND, "routed as /v1/admin");
    assert_eq!(r.json()["code"], "route_not_found");
    let r = get(&n.url("/v1//items"), &[]).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.json()["code"], "invalid_path");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn canary_split_is_sticky_per_key_and_follows_the_weight() {
    let f = fixture();
    let c = client();
    let mut seen: HashMap<String, String> = HashMap::new();
    for round in 0..2 {
        for i in 0..1000 {
            let key = format!("ak_test_caller_{i}");
            let r = send_with(&c, Method::GET, &f.node.url("/v1/canary"), &[("x-api-key", &key)], Bytes::new())
                .await
                .expect("request");
            let backend = r.backend();
            if round == 0 {
                seen.insert(key, backend);
            } else {
                assert_eq!(seen.get(&key), Some(&backend), "{key} moved between versions");
            }
        }
    }
    let on_b = seen.values().filter(|b| *b == "b").count();
    // Weight 10 of 100: within ±2 % of the 1,000 callers.
    assert!((80..=120).contains(&on_b), "{on_b} of 1000 callers on the canary");
}
