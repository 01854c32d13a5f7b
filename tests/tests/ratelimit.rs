//! Rate limits on one node (the embedded mode): a key's burst then its rate, route costs,
//! the app ceiling, 429 with `Retry-After`, the RateLimit headers, and one key's flood
//! leaving another key alone.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::time::{Duration, Instant};

use http::StatusCode;
use postern_e2e::{Echo, Node, Repo, get, new_key, platform};

struct Setup {
    _echo: Echo,
    repo: Repo,
    node: Node,
}

/// A node with one plan, `small`, limited by `limits` (YAML, indented for the plan's block).
fn setup_with(keys: &[(&str, &str)], limits: &str) -> (Setup, Vec<String>) {
    let echo = Echo::start("e");
    let repo = Repo::new();
    // `down`: a port nobody listens on, so the gateway answers 502 itself.
    let down = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    platform(&repo, &[("e", &echo.addr()), ("down", &down.to_string())]);
    repo.write(
        "platform/plans.yaml",
        &format!("scopes: []\nproducts: [orders]\nplans:\n  small:\n    products: [orders]\n    {limits}\n"),
    );
    repo.write(
        "teams/t/routes.yaml",
        "routes:\n  - name: orders\n    match: { path: { value: /orders } }\n    auth: { methods: [apiKey], product: orders }\n    backendRefs: [{ name: e }]\n    timeouts: { connect: 1s, response: 5s }\n  - name: search\n    match: { path: { value: /search } }\n    auth: { methods: [apiKey], product: orders }\n    rateLimit: { class: search, cost: 5 }\n    backendRefs: [{ name: e }]\n    timeouts: { connect: 1s, response: 5s }\n  - name: down\n    match: { path: { value: /down } }\n    auth: { methods: [apiKey], product: orders }\n    backendRefs: [{ name: down }]\n    timeouts: { connect: 1s, response: 5s }\n  - name: open\n    public: true\n    match: { path: { value: /open } }\n    backendRefs: [{ name: e }]\n    timeouts: { connect: 1s, response: 5s }\n",
    );
    let made: Vec<String> = keys.iter().map(|(id, app)| new_key(repo.path(), id, app, "acme", "small", &[])).collect();
    let snap = repo.path().join("out/snapshot.json");
    std::fs::create_dir_all(snap.parent().unwrap()).unwrap();
    repo.compile_ok(&snap);
    let node = Node::start(&snap, &[]);
    (Setup { _echo: echo, repo, node }, made)
}

/// Sends requests as fast as one client can until one is refused: how many were
/// admitted before it, and the refusal. Fails after `cap` admitted.
async fn until_limited(url: &str, key: &str, cap: usize) -> (usize, postern_e2e::Resp) {
    for ok in 0..=cap {
        let r = get(url, &[("x-api-key", key)]).await;
        match r.status {
            StatusCode::OK => {}
            StatusCode::TOO_MANY_REQUESTS => return (ok, r),
            s => panic!("unexpected {s}: {:?}", r.body),
        }
    }
    panic!("{cap} requests admitted and none refused")
}

/// Sends `n` requests as fast as one client can and counts the statuses.
async fn burst(url: &str, key: &str, n: usize) -> (usize, usize, Vec<postern_e2e::Resp>) {
    let mut ok = 0;
    let mut limited = Vec::new();
    for _ in 0..n {
        let r = get(url, &[("x-api-key", key)]).await;
        match r.status {
            StatusCode::OK => ok += 1,
            StatusCode::TOO_MANY_REQUESTS => limited.push(r),
            s => panic!("unexpected {s}: {:?}", r.body),
        }
    }
    let refused = limited.len();
    (ok, refused, limited)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_gets_its_burst_then_429_with_headers() {
    // 5/s with bursts of 10 per key; the apps' ceiling so high that a key's own bucket
    // is always the one that refuses here, however long the requests take.
    let (s, keys) = setup_with(
        &[("k-a", "app-a"), ("k-b", "app-b")],
        "rateLimit: { rps: 5, burst: 10 }\n    appRateLimit: { rps: 2, burst: 1000 }",
    );
    let url = s.node.url("/orders");
    let _ = &s.repo;

    // The key's bucket is made full by its first request, after `t`.
    let t = Instant::now();
    let first = get(&url, &[("x-api-key", &keys[0])]).await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(first.header("ratelimit-policy"), Some("\"default\";q=10;w=2"));
    assert_eq!(first.header("ratelimit"), Some("\"default\";r=9;t=1"));

    // As fast as one client can until the first 429 (the cap only guards against a
    // machine so slow that 5/s keeps up with it).
    let (ok, limited) = until_limited(&url, &keys[0], 200).await;
    let elapsed = t.elapsed().as_secs_f64();
    // 9 left in the burst, plus at most what 5/s refilled since the bucket was made (the
    // bound grows with the time measured, so a slow machine only widens it).
    let refill = (elapsed * 5.0).floor() as usize;
    assert!(ok >= 9 && ok <= 9 + refill, "admitted {ok} in {elapsed:.2} s");
    let r = &limited;
    assert_eq!(r.json()["code"], "rate_limited");
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(r.header("ratelimit-policy"), Some("\"default\";q=10;w=2"));
    assert!(r.header("ratelimit").is_some_and(|v| v.starts_with("\"default\";r=0;")));

    // Another key of another app is untouched by that flood.
    let (ok_b, refused_b, _) = burst(&url, &keys[1], 5).await;
    assert_eq!((ok_b, refused_b), (5, 0));

    // After a second, the first key has tokens again.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(get(&url, &[("x-api-key", &keys[0])]).await.status, StatusCode::OK);

    // Every answer after the limiter admitted the request carries its state, whoever
    // made it: here the gateway itself, for a backend that refuses the connection.
    let r = get(&s.node.url("/down"), &[("x-api-key", &keys[1])]).await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY);
    assert_eq!(r.json()["code"], "upstream_unavailable");
    // The tightest of the key's and its app's buckets.
    let policy = r.header("ratelimit-policy").unwrap_or_default();
    assert!(["\"default\";q=10;w=2", "\"app\";q=1000;w=500"].contains(&policy), "{:?}", r.headers);
    let name = policy.split(';').next().unwrap_or_default();
    assert!(r.header("ratelimit").is_some_and(|v| v.starts_with(&format!("{name};r="))), "{:?}", r.headers);

    // Every answer is counted once in both latency histograms, the limiter's 429s too.
    let m = String::from_utf8(get(&s.node.admin_url("/metrics"), &[]).await.body.to_vec()).unwrap();
    let count = |name: &str| -> u64 {
        let line = format!("{name}_count{{route=\"t/orders\"}} ");
        m.lines().find_map(|l| l.strip_prefix(&line)).and_then(|v| v.parse().ok()).unwrap_or(0)
    };
    let total = count("postern_request_duration_seconds");
    // The first, those admitted before the 429 and it, the other key's five and the one
    // after the refill.
    assert!(total >= (1 + ok + 1 + 5 + 1) as u64, "{m}");
    assert_eq!(count("postern_added_latency_seconds"), total, "{m}");

    // Public routes are not limited (no caller to key on).
    for _ in 0..30 {
        assert_eq!(get(&s.node.url("/open"), &[]).await.status, StatusCode::OK);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expensive_routes_cost_more_and_apps_have_a_ceiling() {
    // The slowest refill there is, one token a second for keys and apps, so that the
    // counts below hold exactly on any machine that makes these requests in well under a
    // second each; each bound also grows with the time measured, so a slower one only
    // widens it.
    let (s, keys) = setup_with(
        &[("k-1", "shared"), ("k-2", "shared"), ("k-3", "shared")],
        "rateLimit: { rps: 1, burst: 10 }\n    appRateLimit: { rps: 1, burst: 15 }",
    );
    // A search costs 5 of the 10-token burst: two go through, in its own class (a third
    // only if five tokens came back meanwhile).
    let t = Instant::now();
    let (searches, refused, _) = burst(&s.node.url("/search"), &keys[0], 4).await;
    let refill = t.elapsed().as_secs_f64().floor() as usize;
    assert!(searches >= 2 && searches <= 2 + refill / 5, "{searches} searches admitted");
    assert_eq!(refused, 4 - searches);
    let r = get(&s.node.url("/orders"), &[("x-api-key", &keys[0])]).await;
    assert_eq!(r.status, StatusCode::OK, "the default class has its own bucket");

    // Three keys of one app: each has 10, but the app's ceiling is 15 in a burst, of which
    // two searches (cost 5 each) and one order took 11; refused searches took nothing.
    let mut ok = 0;
    for k in &keys {
        ok += burst(&s.node.url("/orders"), k, 10).await.0;
    }
    let refill = t.elapsed().as_secs_f64().floor() as usize;
    let taken = 5 * searches + 1;
    assert!(ok + taken <= 15 + refill, "the app ceiling held: {ok} orders after {taken} tokens");
    // Then the next request of the third key, which has tokens of its own left, is
    // refused by the app's ceiling (once the app's tokens that came back are spent).
    let r = loop {
        let r = get(&s.node.url("/orders"), &[("x-api-key", &keys[2])]).await;
        if r.status != StatusCode::OK {
            break r;
        }
        ok += 1;
        let refill = t.elapsed().as_secs_f64().floor() as usize;
        assert!(ok + taken <= 15 + refill, "the app ceiling held: {ok} orders after {taken} tokens");
    };
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(r.header("ratelimit-policy").is_some_and(|p| p.starts_with("\"app\"")), "{:?}", r.headers);
}
