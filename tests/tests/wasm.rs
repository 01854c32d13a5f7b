//! Wasm filters through the real gateway: hostile filters on real routes, each failure a
//! defined answer within its deadline, nothing forwarded on fail-closed, the process up
//! with bounded memory, an unrelated route unaffected, and modules that import WASI
//! files or sockets refused when the snapshot is built.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::time::{Duration, Instant};

use http::StatusCode;
use postern_e2e::wasm_fixture::{HOSTILE, fixture, route};
use postern_e2e::{Repo, add_filter, filter_wasm, get, platform};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_filters_fail_closed_with_defined_outcomes() {
    let mut f = fixture();
    for (name, _, outcome) in HOSTILE {
        let before = f.echo.count().await;
        let t = Instant::now();
        let r = get(&f.node.url(&format!("/h/{name}")), &[]).await;
        let took = t.elapsed();
        assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{name}: {:?}", r.body);
        assert_eq!(r.json()["code"], "filter_failed", "{name}");
        let detail = r.json()["detail"].as_str().unwrap_or_default().to_owned();
        assert!(detail.ends_with(outcome), "{name}: expected {outcome}, got {detail:?}");
        assert!(took < Duration::from_secs(2), "{name} took {took:?}");
        assert_eq!(f.echo.count().await, before, "{name}: fail-closed must forward nothing");
        assert!(f.node.proc.alive(), "{name} brought the node down");
    }
    let (rss, _) = f.node.proc.rss_kib();
    assert!(rss < 512 * 1024, "RSS {rss} KiB");

    // Fail-open: the trapping filter is skipped and the request goes through.
    let r = get(&f.node.url("/open/trap"), &[]).await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn modules_importing_files_or_sockets_are_refused() {
    // At compile time, with the file and field named.
    for name in ["wasi-fs", "wasi-sockets"] {
        let repo = Repo::new();
        platform(&repo, &[("e", "127.0.0.1:9")]);
        add_filter(&repo, "t", name, &filter_wasm(name), "{}");
        repo.write("teams/t/routes.yaml", &format!("routes:\n{}", route("r", "/r", name, "")));
        let out = repo.compile(&repo.path().join("snapshot.json"));
        assert_eq!(out.status.code(), Some(1));
        let err = String::from_utf8_lossy(&out.stderr);
        let iface = if name == "wasi-fs" { "wasi:filesystem" } else { "wasi:sockets" };
        assert!(err.contains(&format!("teams/t/filters/{name}.yaml: module: module sha256:")), "{err}");
        assert!(err.contains("imports ") && err.contains(iface), "{err}");
    }

    // At the node, when a snapshot that got past the compiler references one: refused,
    // the old snapshot keeps serving.
    let f = fixture();
    let snap = f.repo.path().join("out/snapshot.json");
    let text = std::fs::read_to_string(&snap).unwrap();
    let fs = filter_wasm("wasi-fs");
    let digest = postern_e2e::file_digest(&fs);
    std::fs::copy(&fs, f.repo.path().join(format!("out/modules/{}.wasm", digest.trim_start_matches("sha256:"))))
        .unwrap();
    let good = postern_e2e::file_digest(&filter_wasm("well-behaved"));
    let (file, mut snapshot) = postern_model::SnapshotFile::open(text.as_bytes()).unwrap();
    for r in &mut snapshot.routes {
        for f in &mut r.filters {
            if f.config["module"] == good.as_str() {
                f.config["module"] = serde_json::Value::String(digest.clone());
            }
        }
    }
    let sealed = postern_model::SnapshotFile::seal(file.version + 1, &snapshot).unwrap();
    std::fs::write(&snap, serde_json::to_vec(&sealed).unwrap()).unwrap();
    f.node.proc.signal(1);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f.node.log().contains("wasi:filesystem/types") {
        assert!(Instant::now() < deadline, "not refused:\n{}", f.node.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(f.node.version().await, 1);
    assert_eq!(get(&f.node.url("/good"), &[]).await.status, StatusCode::OK);
}

#[test]
fn posternctl_filter_run_tests_a_build_in_the_real_sandbox() {
    let run = |name: &str, extra: &[&str]| {
        std::process::Command::new(postern_e2e::bin("posternctl"))
            .args(["filter", "run"])
            .arg(filter_wasm(name))
            .args(extra)
            .output()
            .unwrap()
    };
    let out = run("well-behaved", &["--path", "/x?y=1", "-H", "x-in: 1"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["phases"][0]["decision"], "continue");
    assert_eq!(v["phases"][0]["set_headers"][0], serde_json::json!(["x-well-behaved", "yes"]));
    assert!(v["phases"][0]["fuel"].as_u64().unwrap() > 0);

    let out = run("loop-forever", &["--limits", r#"{"fuel": 1000000, "deadline_ms": 50}"#]);
    assert_eq!(out.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["phases"][0]["outcome"], "fuel_exhausted");

    let cfg = r#"{"secret":"s"}"#;
    let out = run("hmac-verifier", &["--config", cfg, "--method", "POST", "--path", "/hook"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["phases"][0]["decision"], "respond");
    assert_eq!(v["phases"][0]["status"], 401);

    let out = run("well-behaved", &["--limits", r#"{"fuel": 1000000000000}"#]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("over the platform maximum"));
}
