//! Backend protection through a real node: a failing cluster trips its circuit breaker,
//! which answers at once while open, probes after its open time and closes on a probe's
//! success, while another cluster's routes are untouched; bad breaker settings are
//! refused at compile.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::time::{Duration, Instant};

use http::Method;
use http::StatusCode;
use postern_e2e::{Echo, Node, Repo, get, send};

fn clusters(flaky: &Echo, ok: &Echo, breaker: &str) -> String {
    format!(
        "clusters:\n  flaky:\n    endpoints: [\"{}\"]\n    breaker: {breaker}\n  ok:\n    endpoints: [\"{}\"]\n",
        flaky.addr(),
        ok.addr()
    )
}

const ROUTES: &str = "routes:
  - name: flaky
    public: true
    match: { path: { value: /flaky } }
    backendRefs: [{ name: flaky }]
    timeouts: { connect: 1s, response: 2s }
  - name: ok
    public: true
    match: { path: { value: /ok } }
    backendRefs: [{ name: ok }]
    timeouts: { connect: 1s, response: 2s }
";

async fn readyz(node: &Node) -> serde_json::Value {
    get(&node.admin_url("/readyz"), &[]).await.json()
}

/// Guards against a hang only: far longer than any wait here.
const HANG: Duration = Duration::from_secs(30);

/// Polls `/readyz` until `check` holds; fails naming `what` after [`HANG`].
async fn wait_state(node: &Node, what: &str, check: impl Fn(&serde_json::Value) -> bool) -> serde_json::Value {
    let end = Instant::now() + HANG;
    loop {
        let state = readyz(node).await;
        if check(&state) {
            return state;
        }
        assert!(Instant::now() < end, "never happened in {HANG:?}: {what}\n{state}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the `flaky` cluster's breaker has been open its time and probes.
async fn half_open(node: &Node) {
    wait_state(node, "the breaker of flaky half-open", |s| s["clusters"]["flaky"]["breaker"]["state"] == "half_open")
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_cluster_trips_its_breaker_and_no_other_cluster_notices() {
    let flaky = Echo::start("flaky");
    let ok = Echo::start("ok");
    let repo = Repo::new();
    // Judged over 300 s (so however slowly the requests below are sent, they all count):
    // more than half of at least 20 failing opens it for 10 s (longer than the checks made
    // while it is open take on a slow machine); then every request probes.
    let breaker = "{ window: 300s, minRequests: 20, failurePercent: 50, openFor: 10s, probePercent: 100 }";
    repo.write("platform/clusters.yaml", &clusters(&flaky, &ok, breaker));
    repo.write("platform/ownership.yaml", "owners:\n  - { host: \"*\", pathPrefix: /, team: t }\n");
    repo.write("teams/t/routes.yaml", ROUTES);
    let snap = repo.path().join("snapshot.json");
    repo.compile_ok(&snap);
    let node = Node::start(&snap, &[]);
    assert_eq!(readyz(&node).await["clusters"]["flaky"]["breaker"]["state"], "closed");

    // Ten successes, then 503s from the backend: the eleventh failure makes 11 of 21,
    // more than half of at least 20, and opens it. Each of them reached the backend and
    // was relayed as it answered.
    for _ in 0..10 {
        assert_eq!(get(&node.url("/flaky"), &[]).await.status, StatusCode::OK);
    }
    for i in 0..11 {
        let r = get(&node.url("/flaky?status=503"), &[]).await;
        assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "request {i}");
        assert!(
            r.header("content-type").is_none_or(|c| !c.contains("problem")),
            "the backend's own 503: {i} {:?}",
            r.body
        );
    }
    let state = readyz(&node).await;
    assert_eq!(state["clusters"]["flaky"]["breaker"]["state"], "open", "{state}");
    assert_eq!(state["clusters"]["flaky"]["breaker"]["opened"], 1, "{state}");

    // Open: answered by the gateway itself, nothing reaches the backend.
    let reached = flaky.count().await;
    let t = Instant::now();
    let r = get(&node.url("/flaky"), &[]).await;
    let took = t.elapsed();
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.json()["code"], "circuit_open", "{:?}", r.body);
    // When to come back: what is left of the 10 s it stays open (less by however long the
    // requests since it opened took).
    let retry: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=10).contains(&retry), "Retry-After {retry}");
    for _ in 0..5 {
        assert_eq!(get(&node.url("/flaky"), &[]).await.json()["code"], "circuit_open");
    }
    assert_eq!(flaky.count().await, reached, "no request reached the backend while open");
    println!("circuit_open answered in {took:?} (client round trip)");
    // The other cluster is untouched.
    for _ in 0..10 {
        assert_eq!(get(&node.url("/ok"), &[]).await.status, StatusCode::OK);
    }
    assert_eq!(readyz(&node).await["clusters"]["ok"]["breaker"]["state"], "closed");

    // After its 10 s it probes: a failed probe reaches the backend and opens it again.
    half_open(&node).await;
    let r = get(&node.url("/flaky?status=503"), &[]).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(r.header("content-type").is_none_or(|c| !c.contains("problem")), "the probe reached the backend");
    assert_eq!(flaky.count().await, reached + 1);
    assert_eq!(get(&node.url("/flaky"), &[]).await.json()["code"], "circuit_open");
    let metrics = get(&node.admin_url("/metrics"), &[]).await;
    let metrics = String::from_utf8_lossy(&metrics.body);
    assert!(metrics.contains("postern_upstream_breaker_open{cluster=\"flaky\"} 1"), "{metrics}");
    assert!(metrics.contains("postern_upstream_breaker_open{cluster=\"ok\"} 0"), "{metrics}");
    assert!(metrics.contains("postern_upstream_breaker_opened_total{cluster=\"flaky\"} 2"), "{metrics}");
    assert!(metrics.contains("postern_upstream_breaker_refused_total{cluster=\"flaky\"} 7"), "{metrics}");

    // A successful probe closes it; the backend is served again.
    half_open(&node).await;
    assert_eq!(get(&node.url("/flaky"), &[]).await.status, StatusCode::OK);
    assert_eq!(readyz(&node).await["clusters"]["flaky"]["breaker"]["state"], "closed");
    for _ in 0..5 {
        assert_eq!(get(&node.url("/flaky"), &[]).await.status, StatusCode::OK);
    }

    // A new snapshot with the same settings keeps the breaker; new settings start anew.
    let opened = |v: serde_json::Value| v["clusters"]["flaky"]["breaker"]["opened"].as_u64();
    repo.write("teams/t/routes.yaml", &ROUTES.replace("response: 2s", "response: 3s"));
    repo.compile_ok(&snap);
    node.wait_version(2).await;
    assert_eq!(opened(readyz(&node).await), Some(2));
    let breaker = "{ window: 300s, minRequests: 20, failurePercent: 50, openFor: 20s, probePercent: 100 }";
    repo.write("platform/clusters.yaml", &clusters(&flaky, &ok, breaker));
    repo.compile_ok(&snap);
    node.wait_version(3).await;
    assert_eq!(opened(readyz(&node).await), Some(0));

    // Bad settings are refused at compile, naming the field.
    for (bad, field) in [
        ("{ failurePercent: 100 }", "clusters.flaky.breaker.failurePercent"),
        ("{ window: 10ms }", "clusters.flaky.breaker.window"),
        ("{ openFor: soon }", "clusters.flaky.breaker.openFor"),
        ("{ minRequests: 0 }", "clusters.flaky.breaker.minRequests"),
        ("{ probePercent: 0 }", "clusters.flaky.breaker.probePercent"),
        ("{ threshold: 3 }", "threshold"),
    ] {
        repo.write("platform/clusters.yaml", &clusters(&flaky, &ok, bad));
        let out = repo.compile(&repo.path().join("bad.json"));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(field), "{bad}: {stderr}");
        assert!(stderr.contains("platform/clusters.yaml"), "{stderr}");
    }
}

/// A cluster of two backends with `retryBudget` settings, and routes with retry policies
/// (no host is ever ejected here, so the dead one keeps being met).
fn retry_repo(a: &Echo, b: &Echo, dead: u16) -> (Repo, std::path::PathBuf) {
    let repo = Repo::new();
    repo.write(
        "platform/clusters.yaml",
        &format!(
            "clusters:
  pair:
    endpoints: [\"{a}\", \"127.0.0.1:{dead}\"]
    outlier: {{ maxEjectedPercent: 0 }}
    retryBudget: {{ minRetries: 1000 }}
  two:
    endpoints: [\"{a}\", \"{b}\"]
    outlier: {{ maxEjectedPercent: 0 }}
    retryBudget: {{ minRetries: 1000 }}
  tight:
    endpoints: [\"{a}\", \"127.0.0.1:{dead}\"]
    retryBudget: {{ window: 300s, percent: 0, minRetries: 3 }}
    outlier: {{ maxEjectedPercent: 0 }}
  single:
    endpoints: [\"127.0.0.1:{dead}\"]
  ejecting:
    endpoints: [\"{a}\", \"127.0.0.1:{dead}\"]
    outlier: {{ ejectFor: 10s }}
",
            a = a.addr(),
            b = b.addr(),
        ),
    );
    repo.write("platform/ownership.yaml", "owners:\n  - { host: \"*\", pathPrefix: /, team: t }\n");
    let route = |name: &str, cluster: &str, extra: &str| {
        format!(
            "  - name: {name}\n    public: true\n    match: {{ path: {{ value: /{name} }} }}\n    backendRefs: [{{ name: {cluster} }}]\n    timeouts: {{ connect: 1s, response: 2s }}\n{extra}"
        )
    };
    let routes = [
        route("pair", "pair", ""),
        route("keyed", "pair", "    retry: { methods: [GET, POST], idempotencyKey: true }\n"),
        route("two", "two", ""),
        route("two-keyed", "two", "    retry: { methods: [POST], idempotencyKey: true }\n"),
        route("tight", "tight", ""),
        route("single", "single", ""),
        route("never", "pair", "    retry: { methods: [] }\n"),
        route("ejecting", "ejecting", "    retry: { methods: [] }\n"),
    ];
    repo.write("teams/t/routes.yaml", &format!("routes:\n{}", routes.concat()));
    let snap = repo.path().join("snapshot.json");
    repo.compile_ok(&snap);
    (repo, snap)
}

fn dead_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_is_retried_once_on_another_host_only_when_safe_and_within_the_budget() {
    let a = Echo::start("a");
    let b = Echo::start("b");
    let dead = dead_port();
    let (repo, snap) = retry_repo(&a, &b, dead);
    let node = Node::start(&snap, &[]);
    let count = async || a.count().await + b.count().await;

    // GETs to a cluster whose second host refuses connections: every one is answered by
    // the live host; those that went to the dead one first (each request draws its host:
    // about half of them) were sent once more, marked.
    let mut retried = 0;
    for _ in 0..20 {
        let r = get(&node.url("/pair"), &[]).await;
        assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
        retried += usize::from(r.echoed("x-postern-retry").as_deref() == Some("1"));
    }
    assert!((1..20).contains(&retried), "some met the dead host first: {retried}");
    assert_eq!(a.count().await, 20);

    // A POST without Idempotency-Key is never retried, even where POSTs may be: those that
    // met the dead host are answered 502.
    let post =
        async |path: &str, headers: &[(&str, &str)]| send(Method::POST, &node.url(path), headers, "").await.status;
    let mut failed = 0;
    for _ in 0..20 {
        failed += usize::from(post("/keyed", &[]).await == StatusCode::BAD_GATEWAY);
    }
    assert!((1..20).contains(&failed), "some met the dead host and were answered 502: {failed}");
    // With one, on a route whose service honours it, it is.
    for _ in 0..10 {
        assert_eq!(post("/keyed", &[("idempotency-key", "k-1")]).await, StatusCode::OK);
    }
    // A POST on a route with the default policy is never retried, key or not.
    let mut failed = 0;
    for _ in 0..20 {
        failed += usize::from(post("/pair", &[("idempotency-key", "k-2")]).await == StatusCode::BAD_GATEWAY);
    }
    assert!((1..20).contains(&failed), "{failed}");
    // A route that retries nothing.
    let mut failed = 0;
    for _ in 0..20 {
        failed += usize::from(get(&node.url("/never"), &[]).await.status == StatusCode::BAD_GATEWAY);
    }
    assert!((1..20).contains(&failed), "{failed}");

    // A reset before any response byte: retried once on the other host, which resets too.
    let before = count().await;
    let r = get(&node.url("/two?reset=1"), &[]).await;
    assert_eq!((r.status, r.json()["code"].as_str()), (StatusCode::BAD_GATEWAY, Some("upstream_unavailable")));
    assert_eq!(count().await, before + 2, "at most once more");
    // A 503 marked as not processed: retried once; an unmarked one is relayed as it is.
    let before = count().await;
    let r = get(&node.url("/two?status=503&not_processed=1"), &[]).await;
    assert_eq!((r.status, r.header("x-postern-not-processed")), (StatusCode::SERVICE_UNAVAILABLE, Some("1")));
    assert_eq!(count().await, before + 2);
    let before = count().await;
    assert_eq!(get(&node.url("/two?status=503"), &[]).await.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(count().await, before + 1);
    // A reset after the response head: the head was relayed, so it is never retried.
    let before = count().await;
    let r = postern_e2e::send_with(
        &postern_e2e::client(),
        Method::GET,
        &node.url("/two?bytes=100000&cut=1"),
        &[],
        bytes::Bytes::new(),
    )
    .await;
    assert!(r.as_ref().is_err() || r.as_ref().is_ok_and(|r| r.body.len() < 100_001), "the cut body is not complete");
    assert_eq!(count().await, before + 1, "{:?}: {:?}", r.map(|r| (r.status, r.headers)), node.log());
    // A POST without the key that the backend resets is not retried.
    let before = (a.count().await, b.count().await);
    assert_eq!(post("/two-keyed?reset=1", &[]).await, StatusCode::BAD_GATEWAY);
    let after = (a.count().await, b.count().await);
    assert_eq!(after.0 + after.1, before.0 + before.1 + 1, "{before:?} {after:?}\n{}", node.log());
    // A cluster with one host has no other to retry on.
    assert_eq!(get(&node.url("/single"), &[]).await.status, StatusCode::BAD_GATEWAY);

    // The budget: 0 % of requests and a floor of 3 in its 300 s window (however slowly the
    // requests go), so three retries and no more.
    let mut ok = 0;
    for _ in 0..40 {
        ok += usize::from(get(&node.url("/tight"), &[]).await.status == StatusCode::OK);
    }
    let state = get(&node.admin_url("/readyz"), &[]).await.json();
    let budget = &state["clusters"]["tight"]["retry_budget"];
    let denied = budget["denied"].as_u64().unwrap();
    assert_eq!(budget["retried"].as_u64(), Some(3), "{state}");
    assert_eq!(ok as u64, 40 - denied, "only those the spent budget could not retry failed: {state}");
    let metrics = get(&node.admin_url("/metrics"), &[]).await;
    let metrics = String::from_utf8_lossy(&metrics.body);
    assert!(metrics.contains("postern_upstream_retries_total{cluster=\"tight\"} 3"), "{metrics}");
    let denied_series = format!("postern_upstream_retries_denied_total{{cluster=\"tight\"}} {denied}");
    assert!(metrics.contains(&denied_series), "{metrics}");

    // Outlier ejection: the dead host fails five times in a row and is sent nothing
    // more for its ejection time, 10 s, longer than the forty requests take on a slow
    // machine (the route retries nothing, so each of the five is a 502).
    let mut failed = 0;
    for _ in 0..40 {
        failed += usize::from(get(&node.url("/ejecting"), &[]).await.status == StatusCode::BAD_GATEWAY);
    }
    assert_eq!(failed, 5, "exactly five failures in a row, then it is out");
    let state = get(&node.admin_url("/readyz"), &[]).await.json();
    let hosts = &state["clusters"]["ejecting"]["hosts"];
    assert!(hosts[1]["ejected_for_ms"].as_u64().is_some_and(|ms| ms > 0 && ms <= 10_000), "{state}");
    assert_eq!(hosts[1]["ejections"], 1, "{state}");
    assert!(hosts[0].get("ejected_for_ms").is_none(), "a lone live host is never ejected too: {state}");
    let metrics = String::from_utf8_lossy(&get(&node.admin_url("/metrics"), &[]).await.body).into_owned();
    assert!(metrics.contains("postern_upstream_hosts_ejected{cluster=\"ejecting\"} 1"), "{metrics}");
    assert!(metrics.contains("postern_upstream_ejections_total{cluster=\"ejecting\"} 1"), "{metrics}");
    // Back after its 10 s, met again, and ejected again after five more (for twice as long).
    wait_state(&node, "the dead host back from its ejection", |s| {
        s["clusters"]["ejecting"]["hosts"][1].get("ejected_for_ms").is_none()
    })
    .await;
    let mut failed = 0;
    for _ in 0..40 {
        failed += usize::from(get(&node.url("/ejecting"), &[]).await.status == StatusCode::BAD_GATEWAY);
    }
    assert_eq!(failed, 5);
    let state = get(&node.admin_url("/readyz"), &[]).await.json();
    let hosts = &state["clusters"]["ejecting"]["hosts"];
    assert!(hosts[1]["ejected_for_ms"].as_u64().is_some_and(|ms| ms > 10_000 && ms <= 20_000), "{state}");

    // Policies that are unsafe or unknown are refused at compile, naming the field.
    for (bad, field) in [
        ("    retry: { methods: [POST] }\n", "routes[0].retry.methods[0]"),
        ("    retry: { methods: [PATCH] }\n", "routes[0].retry.methods[0]"),
        ("    retry: { tries: 3 }\n", "tries"),
    ] {
        repo.write(
            "teams/t/routes.yaml",
            &format!("routes:\n  - name: r\n    public: true\n    match: {{ path: {{ value: /r }} }}\n    backendRefs: [{{ name: pair }}]\n    timeouts: {{ connect: 1s, response: 2s }}\n{bad}"),
        );
        let out = repo.compile(&repo.path().join("bad.json"));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(field), "{bad}: {stderr}");
    }
    repo.write(
        "platform/clusters.yaml",
        "clusters:\n  pair:\n    endpoints: [\"127.0.0.1:1\"]\n    retryBudget: { percent: 101 }\n",
    );
    let out = repo.compile(&repo.path().join("bad.json"));
    assert!(String::from_utf8_lossy(&out.stderr).contains("clusters.pair.retryBudget.percent"));
}
