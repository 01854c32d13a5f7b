//! A filter that rewrites the path to one the platform's path policy refuses, through the
//! real gateway: refused as a bad output like any other forged answer (rule
//! `path_canonical`), with nothing forwarded on a fail-closed route: the 503 names the
//! filter and the rule, the node logs the refusal with the request id, counts it in
//! `postern_filter_calls_total` and `postern_filter_refusals_total{rule}` (so `posternctl
//! filter cost` shows it), and quarantines a filter refused too often.
//!
//! This test has a binary of its own: cargo runs test binaries one at a time, so no module
//! compilation in a neighbouring test takes the CPU that its deadlines count on.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::time::{Duration, Instant};

use http::StatusCode;
use postern_e2e::wasm_fixture::{plain_route, route, start_node};
use postern_e2e::{Echo, Repo, add_filter, filter_wasm, get, platform};

/// Paths a hostile filter answers, each refused by the default path policy: dot segments
/// (plain, encoded), empty segments, an encoded slash, backslashes, `;` parameters and an
/// encoded unreserved character.
const PATHS: [&str; 8] = [
    "/../../admin",
    "//evil.example/x",
    "/%2e%2e/%2e%2e/admin",
    "/a/./b",
    "/a%2Fb",
    "/a\\..\\admin",
    "/a/..;/admin",
    "/%61dmin",
];

const DETAIL: &str = "filter header-spoofer failed: bad_output: its answer broke the rule path_canonical: \
     a path not in canonical form under the platform's path policy";

/// The route's config making the filter answer `path` (a single-quoted YAML scalar: the
/// paths hold no `'`).
fn rewrite(path: &str, extra: &str) -> String {
    format!(", config: {{ ':path': '{path}' }}{extra}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_filters_non_canonical_path_edit_is_a_refused_answer() {
    let echo = Echo::start("e");
    let repo = Repo::new();
    platform(&repo, &[("e", &echo.addr())]);
    add_filter(&repo, "t", "header-spoofer", &filter_wasm("header-spoofer"), "{ deadline_ms: 50 }");
    let mut routes = String::from("routes:\n");
    for (i, p) in PATHS.iter().enumerate() {
        routes.push_str(&route(&format!("p{i}"), &format!("/p/{i}"), "header-spoofer", &rewrite(p, "")));
    }
    routes.push_str(&route("open", "/open/p", "header-spoofer", &rewrite(PATHS[0], ", failure: fail_open")));
    routes.push_str(&route("q", "/q", "header-spoofer", &rewrite(PATHS[0], "")));
    // The canonical path the filter may answer, for contrast.
    routes.push_str(&route("fine", "/fine", "header-spoofer", &rewrite("/admin/x", "")));
    routes.push_str(&plain_route("plain", "/plain"));
    let mut node = start_node(&repo, &routes);

    for (i, p) in PATHS.iter().enumerate() {
        let before = echo.count().await;
        let r = get(&node.url(&format!("/p/{i}")), &[]).await;
        assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{p}: {:?}", r.body);
        assert_eq!(r.json()["code"], "filter_failed", "{p}");
        assert_eq!(r.json()["detail"], DETAIL, "{p}");
        assert_eq!(echo.count().await, before, "{p}: nothing may be forwarded");
        let labels = format!("route=\"t/p{i}\",filter=\"header-spoofer\"");
        assert_eq!(node.metric(&format!("postern_filter_calls_total{{{labels},outcome=\"bad_output\"}}")).await, 1);
        assert_eq!(node.metric(&format!("postern_filter_calls_total{{{labels},outcome=\"ok\"}}")).await, 0, "{p}");
        assert_eq!(
            node.metric(&format!("postern_filter_refusals_total{{{labels},rule=\"path_canonical\"}}")).await,
            1,
            "{p}"
        );
        // The first refusal on a route is logged, naming the filter, the rule and the request.
        let rid = r.json()["request_id"].as_str().unwrap().to_owned();
        let tag = format!("header-spoofer@t/p{i}");
        let log = node.log();
        let line = log.lines().find(|l| l.contains(&tag) && l.contains("filter answer refused")).unwrap_or_default();
        assert!(line.contains("path_canonical") && line.contains(&rid), "{p}: {line:?}\n{log}");
    }

    // `posternctl filter cost` reads the refusal from the node, by rule.
    let out = std::process::Command::new(postern_e2e::bin("posternctl"))
        .args(["filter", "cost", "--route", "t/p0", "--json", "--admin", &node.admin_url("")])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let cost: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let f = &cost["filters"]["header-spoofer"];
    assert_eq!(f["outcomes"]["bad_output"], 1, "{cost}");
    assert_eq!(f["outcomes"]["ok"].as_u64().unwrap_or(0), 0, "{cost}");
    assert_eq!(f["refusals"]["path_canonical"], 1, "{cost}");

    // Fail-open: the refused edit is dropped and the request goes on unedited.
    let r = get(&node.url("/open/p"), &[]).await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    assert_eq!(r.json()["path"], "/open/p");
    // A canonical path edit is applied.
    let r = get(&node.url("/fine"), &[]).await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    assert_eq!(r.json()["path"], "/admin/x");

    // Refused on every call, the filter is quarantined on its route under the default
    // thresholds (20 calls, half of them failed, within 10 s): one request at a time
    // until the node says so; the count only guards against a hang.
    let quarantines = "postern_filter_quarantines_total{route=\"t/q\",filter=\"header-spoofer\"}";
    let end = Instant::now() + Duration::from_secs(60);
    let mut sent = 0;
    while node.metric(quarantines).await == 0 {
        assert!(Instant::now() < end && sent < 1000, "never quarantined after {sent} refused calls");
        let r = get(&node.url("/q"), &[]).await;
        assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{:?}", r.body);
        assert_eq!(r.json()["detail"], DETAIL);
        sent += 1;
    }
    assert!(sent >= 20, "quarantined after {sent} calls, fewer than the policy's 20");
    assert_eq!(node.metric(quarantines).await, 1);
    let r = get(&node.url("/q"), &[]).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{:?}", r.body);
    assert_eq!(r.json()["detail"], "filter header-spoofer failed: quarantined");
    assert!(node.log().contains("filter quarantined on this route"), "{}", node.log());
    assert!(node.proc.alive());
}
