//! Backend protection through a real node: a failing cluster trips its circuit breaker,
//! which answers at once while open, probes after its open time and closes on a probe's
//! success, while another cluster's routes are untouched; bad breaker settings are
//! refused at compile.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::time::{Duration, Instant};

use http::StatusCode;
use postern_e2e::{Echo, Node, Repo, get};

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_cluster_trips_its_breaker_and_no_other_cluster_notices() {
    let flaky = Echo::start("flaky");
    let ok = Echo::start("ok");
    let repo = Repo::new();
    // Judged over 5 s: more than half of at least 20 failing opens it for 1 s; then every
    // request probes.
    let breaker = "{ window: 5s, minRequests: 20, failurePercent: 50, openFor: 1s, probePercent: 100 }";
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

    // Open: answered by the gateway at once, nothing reaches the backend.
    let reached = flaky.count().await;
    let t = Instant::now();
    let r = get(&node.url("/flaky"), &[]).await;
    let took = t.elapsed();
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.json()["code"], "circuit_open", "{:?}", r.body);
    assert_eq!(r.header("retry-after"), Some("1"));
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

    // After 1 s it probes: a failed probe reaches the backend and opens it again.
    tokio::time::sleep(Duration::from_millis(1100)).await;
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
    tokio::time::sleep(Duration::from_millis(1100)).await;
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
    let breaker = "{ window: 5s, minRequests: 20, failurePercent: 50, openFor: 2s, probePercent: 100 }";
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
