//! Hostile input to a real node, and what the backend received: one canonical path, one
//! authority, strict HTTP/1 framing, headers a backend might trust, bounded connections,
//! and no secrets in the logs (docs/security.md lists each class and its test).
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::time::{Duration, Instant};

use http::StatusCode;
use postern_e2e::{Echo, Node, Repo, get, platform, raw};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const ROUTES: &str = r#"
routes:
  - name: public
    public: true
    match: { path: { value: /public, type: PathPrefix } }
    backendRefs: [{ name: e }]
    timeouts: { connect: 1s, response: 5s }
  - name: admin
    match: { path: { value: /admin, type: PathPrefix } }
    backendRefs: [{ name: e }]
    timeouts: { connect: 1s, response: 5s }
    auth: { methods: [apiKey], product: internal }
  - name: host
    public: true
    hostnames: [api.example.com]
    match: { path: { value: /host } }
    backendRefs: [{ name: e }]
    timeouts: { connect: 1s, response: 5s }
"#;

struct Fixture {
    node: Node,
    echo: Echo,
    _repo: Repo,
}

fn fixture(gateway: Option<&str>, routes_extra: &str, clusters: &[(&str, &str)], args: &[&str]) -> Fixture {
    let echo = Echo::start("e");
    let repo = Repo::new();
    let mut all = vec![("e", echo.addr())];
    all.extend(clusters.iter().map(|(n, a)| (*n, (*a).to_owned())));
    let all: Vec<(&str, &str)> = all.iter().map(|(n, a)| (*n, a.as_str())).collect();
    platform(&repo, &all);
    repo.write("platform/plans.yaml", "scopes: []\nproducts: [internal]\nplans:\n  p: { products: [internal] }\n");
    if let Some(g) = gateway {
        repo.write("platform/gateway.yaml", g);
    }
    repo.write("teams/t/routes.yaml", &format!("{ROUTES}{routes_extra}"));
    let snap = repo.path().join("snapshot.json");
    repo.compile_ok(&snap);
    Fixture { node: Node::start(&snap, args), echo, _repo: repo }
}

/// Guards against a hang only: far longer than anything here takes on a slow machine.
const HANG: Duration = Duration::from_secs(30);

/// Sends one raw HTTP/1.1 request and returns the whole answer, read until the node
/// closes the connection (each request here ends with the node closing it).
async fn raw_req(port: u16, req: &str) -> String {
    raw(port, req.as_bytes(), HANG).await
}

/// Sends one raw HTTP/1.1 request and returns its answer, read to the end of the body
/// its `Content-Length` gives (the node may keep the connection open after it), or until
/// the node closes the connection.
async fn raw_answer(port: u16, req: &str) -> String {
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let end = tokio::time::Instant::now() + HANG;
    loop {
        let text = String::from_utf8_lossy(&out).into_owned();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length = head
                .lines()
                .find_map(|l| l.split_once(':').filter(|(k, _)| k.eq_ignore_ascii_case("content-length")))
                .and_then(|(_, v)| v.trim().parse::<usize>().ok());
            if length.is_some_and(|n| body.len() >= n) {
                return text;
            }
        }
        match tokio::time::timeout_at(end, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return text,
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
            Err(_) => panic!("no whole answer in {HANG:?}: {text:?}"),
        }
    }
}

/// The value of the metric line `name` (no labels) on `node`.
async fn metric(node: &Node, name: &str) -> u64 {
    let text = String::from_utf8_lossy(&get(&node.admin_url("/metrics"), &[]).await.body).into_owned();
    text.lines()
        .find(|l| l.starts_with(&format!("{name} ")))
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or_else(|| panic!("no {name}:\n{text}"))
}

/// Polls `metric` until `check` holds on its value; fails naming `what` after [`HANG`].
async fn wait_metric(node: &Node, name: &str, what: &str, check: impl Fn(u64) -> bool) {
    let end = Instant::now() + HANG;
    loop {
        let v = metric(node, name).await;
        if check(v) {
            return;
        }
        assert!(Instant::now() < end, "never happened in {HANG:?}: {what} ({name} {v})");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn status_of(answer: &str) -> u16 {
    answer.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0)
}

fn body_json(answer: &str) -> Value {
    let body = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    serde_json::from_str(body).unwrap_or(Value::Null)
}

fn echoed<'a>(v: &'a Value, name: &str) -> Vec<&'a str> {
    v["headers"]
        .as_array()
        .map(|a| a.iter().filter(|h| h[0] == name).filter_map(|h| h[1].as_str()).collect())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_canonical_path_is_routed_and_forwarded() {
    let f = fixture(None, "", &[], &[]);
    let port = f.node.public;
    let get_path = |p: &str| format!("GET {p} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");

    // A public neighbour's prefix cannot carry a request to the authenticated backend:
    // every spelling of `..` is resolved first, so the request is routed to /admin and
    // refused there without credentials.
    let before = f.echo.count().await;
    for p in ["/public/../admin", "/public/%2e%2e/admin", "/public/.%2E/admin", "/%61dmin", "/public/./../admin/x"] {
        let a = raw_req(port, &get_path(p)).await;
        assert_eq!(status_of(&a), 401, "{p} -> {a}");
    }
    assert_eq!(f.echo.count().await, before, "the authenticated backend was reached without credentials");

    // What is ambiguous between backends is refused by default.
    for p in ["/public/..;/admin", "/public;x/y", "/public//admin", "/public/a%2Fb", "/public/a%5cb", "/public/%zz"] {
        let a = raw_req(port, &get_path(p)).await;
        assert_eq!(status_of(&a), 400, "{p} -> {a}");
        assert_eq!(body_json(&a)["code"], "invalid_path", "{p} -> {a}");
    }
    let a = raw_req(port, "GET /public\\..\\admin HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").await;
    assert_eq!(status_of(&a), 400, "{a}");
    assert_eq!(f.echo.count().await, before);

    // The backend receives exactly the canonical path (the query untouched).
    let a = raw_req(port, &get_path("/public/%74est/%7e/%3b/caf%c3%a9?q=%2e%2E")).await;
    assert_eq!(status_of(&a), 200, "{a}");
    let v = body_json(&a);
    assert_eq!(v["path"], "/public/test/~/%3B/caf%C3%A9");
    assert_eq!(v["query"], "q=%2e%2E");
    let a = raw_req(port, &get_path("/public/a/b/../c/.")).await;
    assert_eq!(body_json(&a)["path"], "/public/a/c/");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_platform_may_choose_to_normalise_what_is_ambiguous() {
    let gateway = "paths:\n  encodedSlash: keep\n  backslash: slash\n  semicolon: strip\n  emptySegments: merge\n";
    let f = fixture(Some(gateway), "", &[], &[]);
    let port = f.node.public;
    let path_of = |a: &str| body_json(a)["path"].as_str().unwrap_or_default().to_owned();
    let ask = |p: &str| format!("GET {p} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
    assert_eq!(path_of(&raw_req(port, &ask("/public//a///b")).await), "/public/a/b");
    assert_eq!(path_of(&raw_req(port, &ask("/public/a;jsessionid=1/b")).await), "/public/a/b");
    assert_eq!(path_of(&raw_req(port, &ask("/public/a%2fb")).await), "/public/a%2Fb");
    assert_eq!(path_of(&raw_req(port, &ask("/public\\a")).await), "/public/a");
    // Tomcat's `..;` is `..` once stripped, so it is resolved before routing.
    let before = f.echo.count().await;
    assert_eq!(status_of(&raw_req(port, &ask("/public/..;/admin")).await), 401);
    assert_eq!(f.echo.count().await, before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_authority_is_routed_and_sent() {
    let f = fixture(None, "", &[], &[]);
    let port = f.node.public;
    let before = f.echo.count().await;
    for (req, why) in [
        ("GET /public HTTP/1.1\r\nhost: a\r\nhost: b\r\n\r\n", "two Host headers"),
        ("GET http://api.example.com/host HTTP/1.1\r\nhost: evil.example\r\n\r\n", "target and Host disagree"),
        ("GET /public HTTP/1.1\r\nhost: a b\r\n\r\n", "a Host that is no host"),
        ("GET /public HTTP/1.1\r\nhost: user@api.example.com\r\n\r\n", "user information"),
        ("GET /public HTTP/1.1\r\n\r\n", "no Host"),
    ] {
        let a = raw_answer(port, req).await;
        assert_eq!(status_of(&a), 400, "{why}: {a}");
    }
    assert_eq!(f.echo.count().await, before);

    // Case and one trailing dot do not change the host; the backend is told the routed
    // host (with the client's port), and `Connection: host` cannot remove it.
    let a = raw_req(port, "GET /host HTTP/1.1\r\nhost: API.Example.COM.:8443\r\nconnection: close, host\r\n\r\n").await;
    assert_eq!(status_of(&a), 200, "{a}");
    let v = body_json(&a);
    assert_eq!(echoed(&v, "host"), ["api.example.com:8443"]);
    assert_eq!(echoed(&v, "x-forwarded-host"), ["api.example.com:8443"]);
    // An absolute-form target that agrees with Host routes on it.
    let a =
        raw_req(port, "GET http://api.example.com/host HTTP/1.1\r\nhost: api.example.com\r\nconnection: close\r\n\r\n")
            .await;
    assert_eq!(status_of(&a), 200, "{a}");
    assert_eq!(echoed(&body_json(&a), "host"), ["api.example.com"]);
}

/// A backend that answers every request with `answer` and closes.
async fn fixed_backend(answer: &'static str) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf).await;
                let _ = s.write_all(answer.as_bytes()).await;
                tokio::time::sleep(Duration::from_millis(200)).await;
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http1_framing_is_strict() {
    let upgrader =
        fixed_backend("HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n").await;
    let extra = "  - name: upgrader\n    public: true\n    match: { path: { value: /upgrader } }\n    backendRefs: [{ name: up }]\n    timeouts: { connect: 1s, response: 2s }\n";
    let f = fixture(None, extra, &[("up", &upgrader)], &[]);
    let port = f.node.public;
    let before = f.echo.count().await;

    // Content-Length with Transfer-Encoding, in either order: 400, and the connection
    // closes (the smuggled request after it is never read).
    for req in [
        "POST /public HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\nGET /public/smuggled HTTP/1.1\r\nhost: x\r\n\r\n",
        "POST /public HTTP/1.1\r\nhost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 40\r\n\r\n0\r\n\r\nGET /public/smuggled HTTP/1.1\r\nhost: x\r\n\r\n",
    ] {
        let a = raw_req(port, req).await;
        assert!(a.starts_with("HTTP/1.1 400"), "{a}");
        assert_eq!(a.matches("HTTP/1.1").count(), 1, "one answer, then close: {a}");
    }
    // Bare LF line endings are refused.
    let a = raw_req(port, "GET /public HTTP/1.1\nhost: x\n\n").await;
    assert!(a.starts_with("HTTP/1.1 400"), "{a}");
    assert_eq!(f.echo.count().await, before, "a refused request reached the backend");

    // Good requests pipelined on one connection, with fixed and chunked bodies, all pass.
    let a = raw_req(
        port,
        "POST /public/1 HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\nhelloPOST /public/2 HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\nGET /public/3 HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(a.matches("HTTP/1.1 200").count(), 3, "{a}");

    // A backend's unsolicited 101 is a 502, never relayed.
    let r = get(&f.node.url("/upgrader"), &[]).await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY);
    assert_eq!(r.json()["code"], "upstream_protocol_error");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_a_backend_might_trust_are_never_the_clients() {
    let f = fixture(None, "", &[], &[]);
    let a = raw_req(
        f.node.public,
        "GET /public HTTP/1.1\r\nhost: x\r\nconnection: close\r\nx-http-method-override: DELETE\r\nx-original-url: /admin\r\nx-rewrite-url: /admin\r\nx-real-ip: 10.0.0.1\r\ntrue-client-ip: 10.0.0.2\r\nx-forwarded-for: 10.0.0.3\r\nx_forwarded_for: 10.0.0.4\r\nx-auth-subject: admin\r\nx_auth_subject: admin\r\nx.auth.scopes: all\r\nX-Auth_Tenant: acme\r\nx-request-id: mine\r\nx-postern-retry: 1\r\nX-Postern-Overloaded: 1\r\nx_postern_not_processed: 1\r\nx-postern-anything: 1\r\nx-keep: yes\r\n\r\n",
    )
    .await;
    assert_eq!(status_of(&a), 200, "{a}");
    let v = body_json(&a);
    let names: Vec<&str> = v["headers"].as_array().unwrap().iter().filter_map(|h| h[0].as_str()).collect();
    for gone in [
        "x-http-method-override",
        "x-original-url",
        "x-rewrite-url",
        "true-client-ip",
        "x_forwarded_for",
        "x-auth-subject",
        "x_auth_subject",
        "x.auth.scopes",
        "x-auth_tenant",
        "x-postern-retry",
        "x-postern-overloaded",
        "x_postern_not_processed",
        "x-postern-anything",
    ] {
        assert!(!names.contains(&gone), "{gone} reached the backend: {names:?}");
    }
    assert_eq!(echoed(&v, "x-real-ip"), ["127.0.0.1"]);
    assert_eq!(echoed(&v, "x-forwarded-for"), ["127.0.0.1"]);
    assert_ne!(echoed(&v, "x-request-id"), ["mine"]);
    assert_eq!(echoed(&v, "x-keep"), ["yes"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trusted_hop_names_the_client_and_no_one_else_does() {
    // The test's connections come from 127.0.0.1: trusted here, as a load balancer would be.
    let f = fixture(None, "", &[], &["--trusted-hops", "127.0.0.0/8,10.0.0.0/8"]);
    let a = raw_req(
        f.node.public,
        "GET /public HTTP/1.1\r\nhost: x\r\nconnection: close\r\nx-forwarded-for: 198.51.100.9, 203.0.113.5\r\nx-forwarded-for: 10.1.2.3\r\nx-forwarded-proto: https\r\nx-real-ip: 192.0.2.1\r\ntrue-client-ip: 192.0.2.2\r\n\r\n",
    )
    .await;
    assert_eq!(status_of(&a), 200, "{a}");
    let v = body_json(&a);
    // The rightmost address that is not a trusted hop; what the client wrote left of it
    // (198.51.100.9) is its own claim. Other client-address headers are still replaced.
    assert_eq!(echoed(&v, "x-real-ip"), ["203.0.113.5"]);
    assert_eq!(echoed(&v, "x-forwarded-for"), ["198.51.100.9, 203.0.113.5, 10.1.2.3, 127.0.0.1"]);
    assert_eq!(echoed(&v, "forwarded"), ["for=203.0.113.5;proto=https"]);
    assert_eq!(echoed(&v, "x-forwarded-proto"), ["https"]);
    let names: Vec<&str> = v["headers"].as_array().unwrap().iter().filter_map(|h| h[0].as_str()).collect();
    assert!(!names.contains(&"true-client-ip"), "{names:?}");

    // A node that trusts other hops only: the peer's address, whatever the client says.
    let g = fixture(None, "", &[], &["--trusted-hops", "10.0.0.0/8"]);
    let b = raw_req(
        g.node.public,
        "GET /public HTTP/1.1\r\nhost: x\r\nconnection: close\r\nx-forwarded-for: 203.0.113.5\r\nx-forwarded-proto: https\r\n\r\n",
    )
    .await;
    let v = body_json(&b);
    assert_eq!(echoed(&v, "x-real-ip"), ["127.0.0.1"]);
    assert_eq!(echoed(&v, "x-forwarded-for"), ["127.0.0.1"]);
    assert_eq!(echoed(&v, "x-forwarded-proto"), ["http"]);
}

/// Sends `hello` on a new connection and reads until the node closes it: whether it did
/// before [`HANG`] (the guard against a connection left open for good).
async fn closed(port: u16, hello: &[u8]) -> bool {
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    s.write_all(hello).await.unwrap();
    let mut buf = Vec::new();
    matches!(tokio::time::timeout(HANG, s.read_to_end(&mut buf)).await, Ok(Ok(_)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_are_bounded() {
    // A node with a 1 s handshake timeout and an idle timeout far longer than any pause
    // between the requests below.
    let f = fixture(None, "", &[], &["--handshake-timeout-s", "1", "--idle-timeout-s", "60"]);
    let port = f.node.public;
    // A connection in use past the handshake timeout is not closed by it, over HTTP/1.1
    // and HTTP/2: six requests 300 ms apart keep it busy for over 1.5 s.
    for c in [postern_e2e::client(), postern_e2e::h2c_client()] {
        for _ in 0..6 {
            let url = f.node.url("/public");
            let r = postern_e2e::send_with(&c, http::Method::GET, &url, &[], bytes::Bytes::new()).await.unwrap();
            assert_eq!(r.status, StatusCode::OK);
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }
    assert_eq!(metric(&f.node, "postern_connections_timed_out_total").await, 0, "a busy connection was closed");

    // A connection that sends nothing (no sniff, no head) is closed by the handshake
    // timeout: no sooner than its 1 s, and counted as timed out.
    let t = Instant::now();
    assert!(closed(port, b"").await, "a silent connection stayed open");
    assert!(t.elapsed() >= Duration::from_secs(1), "closed before the handshake timeout: {:?}", t.elapsed());
    assert_eq!(metric(&f.node, "postern_connections_timed_out_total").await, 1, "closed by its timeout");

    // Per source address, on a node whose handshake timeout (30 s) outlasts the check:
    // four held connections, the fifth is closed at accept (counted as refused, not as
    // timed out).
    let extra = "  - name: capped\n    public: true\n    match: { path: { value: /capped } }\n    backendRefs: [{ name: one }]\n    timeouts: { connect: 1s, response: 5s }\n";
    let echo2 = Echo::start("one");
    let g = fixture(
        None,
        extra,
        &[("one", &echo2.addr())],
        &["--max-connections-per-ip", "4", "--handshake-timeout-s", "30", "--idle-timeout-s", "2"],
    );
    let port = g.node.public;
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap());
    }
    wait_metric(&g.node, "postern_open_connections", "four connections held", |n| n == 4).await;
    assert!(closed(port, b"").await, "the fifth connection was kept open");
    assert_eq!(metric(&g.node, "postern_connections_refused_total").await, 1, "the fifth was refused at accept");
    assert_eq!(metric(&g.node, "postern_connections_timed_out_total").await, 0, "nothing timed out");
    drop(held);
    wait_metric(&g.node, "postern_open_connections", "the held connections closed", |n| n == 0).await;

    // An HTTP/2 connection idle after its request is closed (GOAWAY) after the idle timeout.
    let c = postern_e2e::h2c_client();
    let r =
        postern_e2e::send_with(&c, http::Method::GET, &g.node.url("/public"), &[], bytes::Bytes::new()).await.unwrap();
    assert_eq!(r.status, StatusCode::OK);
    wait_metric(&g.node, "postern_connections_timed_out_total", "the idle HTTP/2 connection closed", |n| n == 1).await;
    wait_metric(&g.node, "postern_open_connections", "the idle HTTP/2 connection gone", |n| n == 0).await;
    assert_eq!(metric(&g.node, "postern_connections_refused_total").await, 1);
}

/// A backend that holds every request until released (then answers each at once): the
/// requests that arrived, as they arrive, and the switch that releases them.
async fn held_backend() -> (String, tokio::sync::mpsc::UnboundedReceiver<()>, tokio::sync::watch::Sender<bool>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (arrive, arrived) = tokio::sync::mpsc::unbounded_channel();
    let (release, released) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (arrive, released) = (arrive.clone(), released.clone());
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |_req: http::Request<hyper::body::Incoming>| {
                    let _ = arrive.send(());
                    let mut released = released.clone();
                    async move {
                        let _ = released.wait_for(|r| *r).await;
                        Ok::<_, std::convert::Infallible>(http::Response::new(http_body_util::Full::new(
                            bytes::Bytes::from_static(b"{}"),
                        )))
                    }
                });
                let io = hyper_util::rt::TokioIo::new(stream);
                let _ = hyper::server::conn::http1::Builder::new().serve_connection(io, svc).await;
            });
        }
    });
    (addr, arrived, release)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_holds_at_most_its_connection_cap() {
    let (slow, mut arrived, release) = held_backend().await;
    let echo = Echo::start("e");
    let repo = Repo::new();
    repo.write(
        "platform/clusters.yaml",
        &format!(
            "clusters:\n  e:\n    endpoints: [\"{}\"]\n  slow:\n    endpoints: [\"{}\"]\n    maxConnections: 1\n",
            echo.addr(),
            slow
        ),
    );
    repo.write("platform/ownership.yaml", "owners:\n  - { host: \"*\", pathPrefix: /, team: t }\n");
    repo.write(
        "teams/t/routes.yaml",
        "routes:\n  - name: slow\n    public: true\n    match: { path: { value: /slow } }\n    backendRefs: [{ name: slow }]\n    timeouts: { connect: 1s, response: 30s }\n",
    );
    let snap = repo.path().join("snapshot.json");
    repo.compile_ok(&snap);
    let node = Node::start(&snap, &[]);
    // The first request holds the cluster's one place until the backend is released.
    let url = node.url("/slow");
    let first = tokio::spawn(async move { get(&url, &[]).await });
    tokio::time::timeout(HANG, arrived.recv()).await.expect("the first request never reached the backend");
    let second = get(&node.url("/slow"), &[]).await;
    assert_eq!(second.status, StatusCode::SERVICE_UNAVAILABLE, "{:?}", second.body);
    assert_eq!(second.json()["code"], "upstream_overloaded");
    assert!(arrived.try_recv().is_err(), "the second request reached the backend");
    release.send(true).unwrap();
    let first = tokio::time::timeout(HANG, first).await.expect("the first request was never answered").unwrap();
    assert_eq!(first.status, StatusCode::OK);
    // The place is given back when the response ends.
    assert_eq!(get(&node.url("/slow"), &[]).await.status, StatusCode::OK);
    // A cap over the platform's ceiling is refused at compile.
    repo.write(
        "platform/clusters.yaml",
        &format!("clusters:\n  slow:\n    endpoints: [\"{slow}\"]\n    maxConnections: 0\n"),
    );
    let out = repo.compile(&repo.path().join("bad.json"));
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("maxConnections"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    drop(echo);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_stay_out_of_logs_and_process_lists() {
    let echo = Echo::start("e");
    let repo = Repo::new();
    platform(&repo, &[("e", &echo.addr())]);
    repo.write("teams/t/routes.yaml", "routes:\n  - name: p\n    public: true\n    match: { path: { value: /p } }\n    backendRefs: [{ name: e }]\n    timeouts: { connect: 1s, response: 5s }\n");
    let snap = repo.path().join("snapshot.json");
    repo.compile_ok(&snap);
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "node-token-very-secret\n").unwrap();
    let node = postern_e2e::Node::start_with_env(
        &snap,
        &["--control-token-file", token_file.to_str().unwrap(), "--ratelimit-sync-ms", "50"],
        &[("POSTERN_RATELIMIT_REDIS", "redis://:redis-password-very-secret@127.0.0.1:6379")],
    );
    assert_eq!(get(&node.url("/p"), &[]).await.status, StatusCode::OK);
    // The node names the Redis it syncs with (redacted) in its log.
    let end = Instant::now() + HANG;
    while !node.log().contains("redis://") {
        assert!(Instant::now() < end, "the node never named its Redis:\n{}", node.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let log = node.log();
    assert!(log.contains("redis://:***@127.0.0.1:6379"), "{log}");
    assert!(!log.contains("very-secret"), "{log}");
    let cmdline = std::fs::read_to_string(format!("/proc/{}/cmdline", node.proc.pid())).unwrap();
    assert!(!cmdline.contains("very-secret"), "{cmdline}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statuses_that_forbid_a_body_go_out_without_one() {
    let no_content =
        fixed_backend("HTTP/1.1 204 No Content\r\ncontent-length: 5\r\nconnection: close\r\n\r\nhello").await;
    let not_modified =
        fixed_backend("HTTP/1.1 304 Not Modified\r\ncontent-length: 10\r\netag: \"x\"\r\nconnection: close\r\n\r\n")
            .await;
    let route = |name: &str, cluster: &str| {
        format!(
            "  - name: {name}\n    public: true\n    match: {{ path: {{ value: /{name} }} }}\n    backendRefs: [{{ name: {cluster} }}]\n    timeouts: {{ connect: 1s, response: 2s }}\n"
        )
    };
    let extra = format!("{}{}", route("nc", "nc"), route("nm", "nm"));
    let f = fixture(None, &extra, &[("nc", &no_content), ("nm", &not_modified)], &[]);
    for path in ["/nc", "/nm"] {
        let a = raw_req(f.node.public, &format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")).await;
        let (head, body) = a.split_once("\r\n\r\n").unwrap_or((&a, ""));
        assert!(!head.to_ascii_lowercase().contains("content-length"), "{path}: {a}");
        assert!(body.is_empty(), "{path}: {a}");
        let c = postern_e2e::h2c_client();
        let r =
            postern_e2e::send_with(&c, http::Method::GET, &f.node.url(path), &[], bytes::Bytes::new()).await.unwrap();
        assert!(r.header("content-length").is_none() && r.body.is_empty(), "{path} over HTTP/2: {r:?}");
    }
}

/// An anonymous client sending bad requests as fast as the node answers them gets at
/// most `--access-log-anonymous-errors-per-s` access-log lines a second (the rest are
/// counted in `postern_access_log_dropped_total{reason="anonymous_client_error"}`);
/// server errors and an authenticated caller's client errors are all logged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anonymous_client_errors_cannot_roll_the_access_log() {
    let echo = Echo::start("e");
    let repo = Repo::new();
    platform(&repo, &[("e", &echo.addr())]);
    repo.write("platform/plans.yaml", "scopes: []\nproducts: [internal]\nplans:\n  p: { products: [internal] }\n");
    repo.write("teams/t/routes.yaml", ROUTES);
    let key = postern_e2e::new_key(repo.path(), "k1", "app", "acme", "p", &[]);
    let snap = repo.path().join("snapshot.json");
    repo.compile_ok(&snap);
    let logs = tempfile::tempdir().unwrap();
    let log = logs.path().join("access.log");
    let node = Node::start(
        &snap,
        &[
            "--access-log",
            log.to_str().unwrap(),
            "--access-log-anonymous-errors-per-s",
            "5",
            "--access-log-sample",
            "0",
        ],
    );
    const DROPPED: &str = "postern_access_log_dropped_total{reason=\"anonymous_client_error\"}";

    // The attack: 300 client errors of every kind an anonymous caller can cause (a
    // backend's 404, the gateway's 404 for no route, 401 for no credential).
    let started = Instant::now();
    for i in 0..300 {
        let (path, want) = match i % 3 {
            0 => ("/public/x?status=404", StatusCode::NOT_FOUND),
            1 => ("/nowhere", StatusCode::NOT_FOUND),
            _ => ("/admin/x", StatusCode::UNAUTHORIZED),
        };
        assert_eq!(get(&node.url(path), &[]).await.status, want, "{path}");
    }
    // An interval of t seconds touches at most ⌊t⌋ + 2 of the log's seconds.
    let seconds = started.elapsed().as_secs() + 2;
    let dropped = node.metric(DROPPED).await;
    let anonymous_logged = 300 - dropped;
    assert!(anonymous_logged <= 5 * seconds, "{anonymous_logged} anonymous client errors logged in {seconds} s");
    assert!(anonymous_logged >= 5, "the first of a second are logged: {anonymous_logged}");

    // What must stay whole: an authenticated caller's client errors, everyone's server
    // errors.
    for _ in 0..20 {
        let r = get(&node.url("/admin/x?status=404"), &[("x-api-key", &key)]).await;
        assert_eq!(r.status, StatusCode::NOT_FOUND);
        assert_eq!(get(&node.url("/public/x?status=500"), &[]).await.status, StatusCode::INTERNAL_SERVER_ERROR);
    }
    assert_eq!(node.metric(DROPPED).await, dropped, "only anonymous client errors are sampled");
    let expected = anonymous_logged + 40;
    postern_e2e::control_plane::wait_for("every wanted line written", HANG, async || {
        node.metric("postern_access_log_lines_total{outcome=\"written\"}").await >= expected
    })
    .await;
    assert_eq!(node.metric("postern_access_log_lines_total{outcome=\"written\"}").await, expected);
    let lines: Vec<Value> =
        std::fs::read_to_string(&log).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len() as u64, expected);
    let count = |f: &dyn Fn(&Value) -> bool| lines.iter().filter(|l| f(l)).count();
    assert_eq!(count(&|l| l["status"] == 500), 20, "every server error");
    assert_eq!(count(&|l| l["status"] == 404 && l["caller"] == "k1"), 20, "every authenticated client error");
    assert_eq!(
        count(&|l| l.get("caller").is_none() && l["status"].as_u64().is_some_and(|s| s < 500)) as u64,
        anonymous_logged
    );
}

/// The admin listener (metrics, `/readyz`, `/snapshot`, `/usage/windows`) has no
/// authentication: a node refuses to start with it on an address other hosts reach
/// unless `--admin-beyond-loopback` asks for it, and then serves it there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_listener_stays_on_loopback_unless_asked() {
    let echo = Echo::start("e");
    let repo = Repo::new();
    platform(&repo, &[("e", &echo.addr())]);
    repo.write("platform/plans.yaml", "scopes: []\nproducts: [internal]\nplans:\n  p: { products: [internal] }\n");
    repo.write("teams/t/routes.yaml", ROUTES);
    let snap = repo.path().join("snapshot.json");
    repo.compile_ok(&snap);
    let mut child = std::process::Command::new(postern_e2e::bin("postern"))
        .arg("--snapshot")
        .arg(&snap)
        .args(["--public", "127.0.0.1:0", "--partner", "127.0.0.1:0", "--admin", "0.0.0.0:0"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let end = Instant::now() + HANG;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > end {
            let _ = child.kill();
            panic!("started with its admin listener on 0.0.0.0");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--admin 0.0.0.0:0") && err.contains("--admin-beyond-loopback"), "{err}");

    let node = Node::start(&snap, &["--admin", "0.0.0.0:0", "--admin-beyond-loopback"]);
    assert_eq!(get(&node.admin_url("/healthz"), &[]).await.status, StatusCode::OK);
}
