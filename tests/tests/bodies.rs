//! Time bounds on bodies, through a real node: a backend body that stops moving is cut
//! after the route's `bodyIdle`, one that moves but too slowly after its `bodyTotal`, and
//! a client upload that stalls is answered 400 after `bodyIdle`; a body that keeps
//! moving within both is relayed whole.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::time::{Duration, Instant};

use http::{Method, StatusCode};
use postern_e2e::{Echo, Node, Repo, platform, raw, send_with};

const ROUTES: &str = "routes:
  - name: idle
    public: true
    match: { path: { value: /idle } }
    backendRefs: [{ name: e }]
    timeouts: { connect: 1s, response: 2s, bodyIdle: 1s, bodyTotal: 20s }
  - name: total
    public: true
    match: { path: { value: /total } }
    backendRefs: [{ name: e }]
    timeouts: { connect: 1s, response: 1s, bodyIdle: 5s, bodyTotal: 2s }
";

/// Guards against a hang only: far longer than any bound here.
const HANG: Duration = Duration::from_secs(30);

/// Fetches `path` and returns (bytes received, whether the body ended in an error, time).
async fn fetch(node: &Node, path: &str) -> (usize, bool, Duration) {
    tokio::time::timeout(HANG, fetch_once(node, path)).await.unwrap_or_else(|_| panic!("{path} never ended"))
}

async fn fetch_once(node: &Node, path: &str) -> (usize, bool, Duration) {
    use http_body_util::BodyExt;
    let client = postern_e2e::client();
    let t = Instant::now();
    let req = http::Request::get(node.url(path)).body(http_body_util::Full::new(bytes::Bytes::new())).unwrap();
    let resp = client.request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();
    let mut n = 0;
    loop {
        match body.frame().await {
            None => return (n, false, t.elapsed()),
            Some(Err(_)) => return (n, true, t.elapsed()),
            Some(Ok(f)) => n += f.data_ref().map_or(0, |d| d.len()),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_that_stall_or_drag_are_cut_by_the_routes_bounds() {
    let echo = Echo::start("e");
    let repo = Repo::new();
    platform(&repo, &[("e", &echo.addr())]);
    repo.write("teams/t/routes.yaml", ROUTES);
    let snap = repo.path().join("snapshot.json");
    repo.compile_ok(&snap);
    let node = Node::start(&snap, &[]);

    // Four 64 KiB chunks 300 ms apart: within both bounds, relayed whole.
    let (n, broken, _) = fetch(&node, "/idle?bytes=262144&pace_ms=300").await;
    assert_eq!((n, broken), (262_144, false));
    // 5 s between chunks: cut at the 1 s idle bound, after the first chunk and before the
    // second (the total bound, 20 s, would have let all four through), and no sooner than
    // the idle bound.
    let (n, broken, took) = fetch(&node, "/idle?bytes=262144&pace_ms=5000").await;
    assert!(broken && n <= 65_536, "cut after the first chunk: {n} bytes");
    assert!(took >= Duration::from_secs(1), "cut before the idle bound: {took:?}");
    // Moving every 400 ms (never idle for 5 s), but ten chunks take 3.6 s: cut at the 2 s
    // total, before the last chunk, and no sooner.
    let (n, broken, took) = fetch(&node, "/total?bytes=655360&pace_ms=400").await;
    assert!(broken && n < 655_360, "cut: {n} bytes");
    assert!(took >= Duration::from_secs(2), "cut before the total bound: {took:?}");

    // An upload that sends 10 of its 100 bytes and stops: 400 after the idle bound, saying
    // the body did not arrive in time (the answer is read until the node closes).
    let t = Instant::now();
    let head = b"POST /idle HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n0123456789";
    let answer = raw(node.public, head, HANG).await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("did not arrive in time"), "{answer}");
    assert!(t.elapsed() >= Duration::from_secs(1), "answered before the idle bound: {:?}", t.elapsed());
    // A whole upload is fine.
    let r = send_with(&postern_e2e::client(), Method::POST, &node.url("/idle"), &[], bytes::Bytes::from_static(b"x"))
        .await
        .unwrap();
    assert_eq!(r.status, StatusCode::OK);

    // Bounds out of range are refused at compile, naming the field.
    repo.write("teams/t/routes.yaml", &ROUTES.replace("bodyTotal: 2s", "bodyTotal: 2h"));
    let out = repo.compile(&repo.path().join("bad.json"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("routes[1].timeouts.bodyTotal"), "{stderr}");
    // A total no longer than the wait for the answer's head would cut every late answer.
    repo.write("teams/t/routes.yaml", &ROUTES.replace("response: 1s, bodyIdle: 5s", "response: 3s, bodyIdle: 5s"));
    let out = repo.compile(&repo.path().join("bad.json"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("routes[1].timeouts.bodyTotal") && stderr.contains("longer than"), "{stderr}");
}
