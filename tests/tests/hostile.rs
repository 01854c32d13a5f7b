//! Hostile Wasm filters through the real gateway, each on its own fail-closed route: every
//! failure a defined answer within its deadline, nothing forwarded, the process up with
//! bounded memory; then fail-open, a well-behaved filter, and no state kept between requests.
//!
//! This test has a binary of its own: cargo runs test binaries one at a time, so no module
//! compilation in a neighbouring test takes the CPU that its 50 ms deadlines count on.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::time::{Duration, Instant};

use http::StatusCode;
use postern_e2e::get;
use postern_e2e::wasm_fixture::{HOSTILE, fixture};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_filters_fail_closed_with_defined_outcomes() {
    let mut f = fixture();
    for (name, limits, outcome) in HOSTILE {
        let before = f.echo.count().await;
        let t = Instant::now();
        // Every one is stopped by one of its limits, which the answer names: none runs on
        // until the client gives up (the timeout only guards against a hang; how long a
        // call takes is measured by the benchmarks, not asserted here).
        let r = tokio::time::timeout(Duration::from_secs(30), get(&f.node.url(&format!("/h/{name}")), &[]))
            .await
            .unwrap_or_else(|_| panic!("{name} ({limits}) was never stopped: no answer in 30 s"));
        eprintln!("{name}: {outcome} in {:?}", t.elapsed());
        assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{name}: {:?}", r.body);
        assert_eq!(r.json()["code"], "filter_failed", "{name}");
        let detail = r.json()["detail"].as_str().unwrap_or_default().to_owned();
        assert!(detail.contains(outcome), "{name}: expected {outcome}, got {detail:?}");
        assert_eq!(f.echo.count().await, before, "{name}: fail-closed must forward nothing");
        assert!(f.node.proc.alive(), "{name} brought the node down");
    }
    // Both panic paths, the SDK's `#![no_std]` handler and `std`'s with the SDK's hook,
    // log the message with where it was raised.
    let log = f.node.log();
    for name in ["guest-panic", "std-panic"] {
        let line = log.lines().find(|l| l.contains(&format!("{name}@t/"))).unwrap_or_default();
        assert!(
            line.contains(&format!("filter panicked at {name}/src/lib.rs:")) && line.contains(": boom"),
            "{name}: {line:?}"
        );
    }
    let (rss, _) = f.node.proc.rss_kib();
    assert!(rss < 512 * 1024, "RSS {rss} KiB");

    // Fail-open: the trapping filter is skipped and the request goes through.
    let r = get(&f.node.url("/open/trap"), &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.backend(), "e");

    // A failing response phase follows the attachment's policy too: fail-closed answers
    // 503 instead of the backend's response unedited; fail-open lets it through.
    let r = get(&f.node.url("/resp/closed"), &[]).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{:?}", r.body);
    assert_eq!(r.json()["code"], "filter_failed");
    assert_eq!(r.json()["detail"], "filter trap failed: trap");
    let r = get(&f.node.url("/resp/open"), &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.backend(), "e");

    // A well-behaved filter edits the request and the response.
    let r = get(&f.node.url("/good"), &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.echoed("x-well-behaved").as_deref(), Some("yes"));

    // Nothing survives between requests: every request sees a fresh instance.
    for _ in 0..5 {
        let r = get(&f.node.url("/state"), &[]).await;
        assert_eq!(r.echoed("x-count").as_deref(), Some("1"), "state leaked between requests");
    }

    let m = String::from_utf8(get(&f.node.admin_url("/metrics"), &[]).await.body.to_vec()).unwrap();
    assert!(
        m.contains(
            "postern_filter_calls_total{route=\"t/loop-forever\",filter=\"loop-forever\",outcome=\"fuel_exhausted\"} 1"
        ),
        "{m}"
    );
    assert!(m.contains("postern_filter_calls_total{route=\"t/open-trap\",filter=\"trap\",outcome=\"trap\"} 1"), "{m}");
    assert!(m.contains("postern_filter_fuel_bucket{route=\"t/good\",filter=\"well-behaved\""), "{m}");
}
