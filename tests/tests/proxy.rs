//! Proxy behaviour through a real node: header hygiene, body limits, streaming,
//! upstream failures and timeouts, deprecation headers, malformed requests, admin.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::time::Duration;

use bytes::Bytes;
use http::{Method, StatusCode};
use postern_e2e::{Echo, Node, Repo, get, platform, raw, send};

const ROUTES: &str = r#"
routes:
  - name: echo
    public: true
    match: { path: { value: /echo } }
    backendRefs: [{ name: echo }]
    timeouts: { connect: 1s, response: 400ms }
    maxBodyBytes: 1024
    requestHeaders:
      set: [{ name: x-team-header, value: "on" }]
      remove: [x-drop-me]
    responseHeaders:
      add: [{ name: x-route, value: echo }]
  - name: big
    public: true
    match: { path: { value: /big } }
    backendRefs: [{ name: echo }]
    timeouts: { connect: 1s, response: 5s }
    maxBodyBytes: 10485760
  - name: dead
    public: true
    match: { path: { value: /dead } }
    backendRefs: [{ name: dead }]
    timeouts: { connect: 1s, response: 1s }
  - name: old
    public: true
    match: { path: { value: /old } }
    backendRefs: [{ name: echo }]
    timeouts: { connect: 1s, response: 1s }
    deprecation:
      since: 2026-01-01T00:00:00Z
      sunset: 2027-06-30T00:00:00Z
      link: https://developer.example.com/migrate
"#;

struct Fixture {
    node: Node,
    echo: Echo,
    _repo: Repo,
}

fn fixture() -> Fixture {
    fixture_with(&[])
}

/// [`fixture`] with extra flags for the node.
fn fixture_with(args: &[&str]) -> Fixture {
    let echo = Echo::start("echo");
    // A port nobody listens on: bind, note it, close.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let dead_port = dead.local_addr().expect("addr").port();
    drop(dead);
    let repo = Repo::new();
    platform(&repo, &[("echo", &echo.addr()), ("dead", &format!("127.0.0.1:{dead_port}"))]);
    repo.write("teams/t/routes.yaml", ROUTES);
    let snap = repo.path().join("snapshot.json");
    repo.compile_ok(&snap);
    Fixture { node: Node::start(&snap, args), echo, _repo: repo }
}

/// Guards against a hang only: far longer than anything here takes on a slow machine.
const HANG: Duration = Duration::from_secs(30);

/// `fut`'s output; fails the test, naming `what`, if it never comes.
async fn within<T>(fut: impl std::future::Future<Output = T>, what: &str) -> T {
    tokio::time::timeout(HANG, fut).await.unwrap_or_else(|_| panic!("{what} never came ({HANG:?})"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identity_and_hop_by_hop_headers_are_stripped() {
    let f = fixture();
    let r = get(
        &f.node.url("/echo"),
        &[
            ("x-auth-subject", "admin"),
            ("x-auth-scopes", "everything"),
            ("X-Auth-Tenant", "other-tenant"),
            ("connection", "keep-alive, x-auth-subject, x-auth-plan, x-secret-hop"),
            ("x-auth-plan", "enterprise"),
            ("x-secret-hop", "1"),
            ("x-forwarded-for", "6.6.6.6"),
            ("x-request-id", "client-chosen"),
            ("x-drop-me", "1"),
            ("x-keep-me", "1"),
        ],
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    let headers = r.json()["headers"].clone();
    let names: Vec<&str> = headers.as_array().unwrap().iter().filter_map(|h| h[0].as_str()).collect();
    for gone in ["x-auth-subject", "x-auth-scopes", "x-auth-tenant", "x-auth-plan", "x-secret-hop", "x-drop-me"] {
        assert!(!names.contains(&gone), "{gone} reached the backend: {names:?}");
    }
    assert!(!names.contains(&"connection") && !names.contains(&"keep-alive"), "{names:?}");
    assert_eq!(r.echoed("x-keep-me").as_deref(), Some("1"));
    assert_eq!(r.echoed("x-team-header").as_deref(), Some("on"));
    assert_eq!(r.echoed("x-forwarded-for").as_deref(), Some("127.0.0.1"));
    assert_eq!(r.echoed("x-forwarded-proto").as_deref(), Some("http"));
    assert_eq!(r.echoed("forwarded").as_deref(), Some("for=127.0.0.1;proto=http"));
    let rid = r.header("x-request-id").unwrap();
    assert_ne!(rid, "client-chosen");
    assert_eq!(r.echoed("x-request-id").as_deref(), Some(rid));
    // The time the backend has left of the route's response timeout: never more than the
    // route's 400 ms (less by however long the node took), and on a route with 5 s, more.
    let deadline: u64 = r.echoed("x-deadline-ms").unwrap().parse().unwrap();
    assert!(deadline <= 400, "deadline {deadline}");
    let longer: u64 = get(&f.node.url("/big"), &[]).await.echoed("x-deadline-ms").unwrap().parse().unwrap();
    assert!((401..=5000).contains(&longer), "deadline on a 5 s route {longer}");
    let tp = r.echoed("traceparent").unwrap();
    assert_eq!(&tp[3..35], rid, "a new trace uses the request id as trace id");
    assert_eq!(r.header("x-route"), Some("echo"));

    // A valid incoming trace is continued.
    let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let r = get(&f.node.url("/echo"), &[("traceparent", parent)]).await;
    assert!(r.echoed("traceparent").unwrap().starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn body_limits_count_bytes() {
    let f = fixture();
    let port = f.node.public;

    // Under the limit: forwarded whole.
    let r = send(Method::POST, &f.node.url("/echo"), &[], vec![b'a'; 1000]).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json()["body_bytes"], 1000);

    // Content-Length over the limit: refused before the backend is called.
    let before = f.echo.count().await;
    let r = send(Method::POST, &f.node.url("/echo"), &[], vec![b'a'; 5000]).await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(r.json()["code"], "payload_too_large");
    assert_eq!(f.echo.count().await, before, "an oversized Content-Length reached the backend");

    // Chunked upload over the limit, no Content-Length at all: cut off with 413.
    let mut req = b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
    for _ in 0..8 {
        req.extend_from_slice(b"200\r\n");
        req.extend_from_slice(&[b'z'; 0x200]);
        req.extend_from_slice(b"\r\n");
    }
    req.extend_from_slice(b"0\r\n\r\n");
    let out = raw(port, &req, HANG).await;
    assert!(out.starts_with("HTTP/1.1 413"), "{out}");
    assert!(out.contains("payload_too_large"), "{out}");

    // A Content-Length that lies (says 100, sends 20,000 bytes): only 100 bytes are the
    // body; the rest is not a valid request and gets a 400, never a larger body upstream.
    let mut req = b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n".to_vec();
    req.extend_from_slice(&[b'q'; 20_000]);
    req.extend_from_slice(b"\r\n\r\n");
    let out = raw(port, &req, HANG).await;
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    assert!(out.contains("\"body_bytes\": 100"), "{out}");
    assert!(out.contains("HTTP/1.1 400"), "the trailing bytes were not refused: {out}");

    // A Content-Length larger than what arrives, then the client goes away: no crash.
    let req = b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 900\r\n\r\nshort".to_vec();
    let _ = raw(port, &req, Duration::from_millis(200)).await;
    assert_eq!(get(&f.node.url("/echo"), &[]).await.status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_response_streams_with_bounded_memory() {
    let f = fixture();
    // The peak is measured over the transfer alone, not the node's start-up.
    f.node.proc.reset_peak_rss();
    let (rss_before, _) = f.node.proc.rss_kib();
    let size: u64 = 50 * 1024 * 1024;
    // Read it slowly-ish through a real socket and count.
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", f.node.public)).await.unwrap();
    s.write_all(format!("GET /big?bytes={size} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut buf = vec![0u8; 256 * 1024];
    let mut total: u64 = 0;
    let mut peak_rss = 0;
    let mut reads = 0u64;
    loop {
        let n = s.read(&mut buf).await.unwrap();
        if n == 0 {
            break;
        }
        total += n as u64;
        reads += 1;
        if reads.is_multiple_of(64) {
            peak_rss = peak_rss.max(f.node.proc.rss_kib().0);
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    assert!(total > size, "got {total} bytes");
    let (_, hwm) = f.node.proc.rss_kib();
    let grew = hwm.saturating_sub(rss_before);
    // 50 MiB went through; the gateway's resident memory grew by a few buffers at most.
    assert!(grew < 16 * 1024, "postern grew by {grew} KiB (before {rss_before} KiB, peak {hwm} KiB)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_failures_are_502_and_504_in_time() {
    let f = fixture();
    // A refused connect is answered as such: 502 naming the refusal, not a connect
    // timeout (that would be a 504 `upstream_timeout` after the route's 1 s).
    let r = within(get(&f.node.url("/dead"), &[]), "the 502 for a dead backend").await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY, "{:?}", r.body);
    assert_eq!(r.json()["code"], "upstream_unavailable");
    assert_eq!(r.json()["detail"], "the backend refused the connection", "{:?}", r.body);

    // A backend that would answer in a minute is cut by the route's 400 ms response
    // timeout: the 504 names that timeout, and comes long before the backend's answer
    // (the hang guard is half the backend's delay).
    let r = within(get(&f.node.url("/echo?delay_ms=60000"), &[]), "the 504 for a slow backend").await;
    assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT, "{:?}", r.body);
    assert_eq!(r.json()["code"], "upstream_timeout");
    assert_eq!(r.json()["detail"], "the backend did not answer within 400 ms", "{:?}", r.body);

    // Backend resets the connection mid-exchange.
    let r = get(&f.node.url("/echo?reset=1"), &[]).await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY);
    assert!(r.header("x-request-id").is_some());

    // Backend status codes pass through untouched.
    let r = get(&f.node.url("/echo?status=503"), &[]).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.backend(), "echo");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deprecated_routes_say_so() {
    let f = fixture();
    let r = get(&f.node.url("/old/thing"), &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("deprecation"), Some("@1767225600"));
    assert_eq!(r.header("sunset"), Some("Wed, 30 Jun 2027 00:00:00 GMT"));
    assert_eq!(r.header("link"), Some("<https://developer.example.com/migrate>; rel=\"deprecation\""));
    assert!(get(&f.node.url("/echo"), &[]).await.header("deprecation").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_get_400_and_the_node_stays_up() {
    // A connection that never completes a request head is closed after 1 s (not the
    // default 10 s), so each answer below is read to the connection's end.
    let mut f = fixture_with(&["--handshake-timeout-s", "1"]);
    let port = f.node.public;
    for junk in [
        &b"GARBAGE\r\n\r\n"[..],
        b"GET / HTTP/1.1\r\nhost: x\r\nbad header line\r\n\r\n",
        b"GET /echo HTTP/1.1\r\nhost: x\r\ncontent-length: abc\r\n\r\n",
        b"GET /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\nab",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",
    ] {
        let out = raw(port, junk, HANG).await;
        assert!(out.is_empty() || out.starts_with("HTTP/1.1 400"), "{junk:?} -> {out}");
    }
    // A request with no Host at all (HTTP/1.0) is a clear 400 problem.
    let out = raw(port, b"GET /echo HTTP/1.0\r\n\r\n", HANG).await;
    assert!(out.starts_with("HTTP/1.0 400") || out.starts_with("HTTP/1.1 400"), "{out}");
    assert!(f.node.proc.alive());
    assert_eq!(get(&f.node.url("/echo"), &[]).await.status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2c_requests_are_proxied() {
    let f = fixture();
    let c = postern_e2e::h2c_client();
    let r = postern_e2e::send_with(&c, Method::POST, &f.node.url("/echo?x=1"), &[], Bytes::from_static(b"hello"))
        .await
        .expect("h2c request");
    assert_eq!(r.version, http::Version::HTTP_2);
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json()["body_bytes"], 5);
    assert_eq!(r.json()["version"], "HTTP/1.1", "backends are spoken to over HTTP/1.1");
    assert_eq!(r.echoed("host").as_deref(), Some(format!("127.0.0.1:{}", f.node.public).as_str()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_endpoints_report_health_metrics_and_snapshot() {
    let f = fixture();
    get(&f.node.url("/echo"), &[]).await;
    get(&f.node.url("/nope"), &[]).await;
    assert_eq!(get(&f.node.admin_url("/healthz"), &[]).await.status, StatusCode::OK);
    let ready = get(&f.node.admin_url("/readyz"), &[]).await;
    assert_eq!(ready.status, StatusCode::OK);
    assert_eq!(ready.json()["ready"], true);
    let snap = get(&f.node.admin_url("/snapshot"), &[]).await.json();
    assert_eq!(snap["version"], 1);
    assert!(snap["hash"].as_str().unwrap().starts_with("sha256:"));
    let m = String::from_utf8(get(&f.node.admin_url("/metrics"), &[]).await.body.to_vec()).unwrap();
    assert!(m.contains("postern_requests_total{route=\"t/echo\",status=\"2xx\"} 1"), "{m}");
    assert!(m.contains("postern_requests_total{route=\"(none)\",status=\"4xx\"} 1"), "{m}");
    assert!(m.contains("postern_gateway_errors_total{code=\"route_not_found\"} 1"), "{m}");
    assert!(m.contains("postern_added_latency_seconds_bucket{route=\"t/echo\""), "{m}");
    assert!(m.contains("postern_snapshot_version 1"), "{m}");
}
