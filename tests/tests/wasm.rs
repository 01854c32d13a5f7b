//! Wasm filters through the real gateway: hostile filters on real routes, each failure a
//! defined answer within its deadline, nothing forwarded on fail-closed, the process up
//! with bounded memory, an unrelated route unaffected, and modules that import WASI
//! files or sockets refused when the snapshot is built.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::time::{Duration, Instant};

use http::{Method, StatusCode};
use postern_e2e::wasm_fixture::{HOSTILE, fixture, route};
use postern_e2e::{Echo, Node, Repo, add_filter, filter_wasm, get, platform};

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
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut content: serde_json::Value = serde_json::from_str(v["content"].to_string().as_str()).unwrap();
    for r in content["routes"].as_array_mut().unwrap() {
        if let Some(fl) = r["filters"].as_array_mut() {
            for f in fl {
                if f["config"]["module"] == good.as_str() {
                    f["config"]["module"] = serde_json::Value::String(digest.clone());
                }
            }
        }
    }
    let body = serde_json::to_string(&content).unwrap();
    use sha2::Digest;
    v["hash"] = serde_json::Value::String(format!("sha256:{}", hex::encode(sha2::Sha256::digest(body.as_bytes()))));
    v["version"] = serde_json::json!(2);
    v["content"] = serde_json::from_str(&body).unwrap();
    let out = format!("{{\"version\":2,\"hash\":{},\"content\":{body}}}", v["hash"]);
    std::fs::write(&snap, out).unwrap();
    f.node.proc.signal(1);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f.node.log().contains("wasi:filesystem/types") {
        assert!(Instant::now() < deadline, "not refused:\n{}", f.node.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(f.node.version().await, 1);
    assert_eq!(get(&f.node.url("/good"), &[]).await.status, StatusCode::OK);
}

fn hmac_sha256(key: &[u8], msg: &[u8]) -> String {
    use sha2::Digest;
    let mut k = [0u8; 64];
    k[..key.len()].copy_from_slice(key);
    let inner: Vec<u8> = k.iter().map(|b| b ^ 0x36).chain(msg.iter().copied()).collect();
    let ih = sha2::Sha256::digest(&inner);
    let outer: Vec<u8> = k.iter().map(|b| b ^ 0x5c).chain(ih.iter().copied()).collect();
    hex::encode(sha2::Sha256::digest(&outer))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn example_filters_on_the_demo_routes() {
    let echos = [Echo::start("echo"), Echo::start("orders-v1"), Echo::start("orders-v2")];
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config");
    postern_e2e::prepare_example_config(&config, &echos.iter().map(Echo::addr).collect::<Vec<_>>());
    let repo = Repo { dir: tempfile::tempdir().unwrap() };
    let snap = repo.path().join("snapshot.json");
    let out = std::process::Command::new(postern_e2e::bin("posternctl"))
        .arg("compile")
        .arg(&config)
        .arg("-o")
        .arg(&snap)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let node = Node::start(&snap, &[]);

    // header-injector: request header set, client header removed, response tagged.
    let r = get(&node.url("/v1/echo/hi"), &[("x-debug", "1")]).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.echoed("x-demo").as_deref(), Some("injected-by-wasm"));
    assert!(r.echoed("x-debug").is_none());
    assert_eq!(r.header("x-filter"), Some("header-injector"));

    // tenant-allowlist: no verified identity yet on this route, so 403 and nothing forwarded.
    let before = echos[0].count().await;
    let r = get(&node.url("/v1/echo/tenants/x"), &[]).await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    assert_eq!(r.json()["code"], "tenant_not_allowed");
    assert_eq!(echos[0].count().await, before);

    // hmac-verifier on the partner pool: unsigned 401, signed 200.
    let url = node.partner_url("/partner/v1/webhooks");
    let r = postern_e2e::send(Method::POST, &url, &[], "{}").await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    assert_eq!(r.json()["code"], "invalid_signature");
    let sig = format!("sha256={}", hmac_sha256(b"demo-webhook-secret", b"1767225600.POST./partner/v1/webhooks"));
    let r = postern_e2e::send(Method::POST, &url, &[("x-timestamp", "1767225600"), ("x-signature", &sig)], "{}").await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    let bad = format!("sha256={}", hmac_sha256(b"wrong-secret", b"1767225600.POST./partner/v1/webhooks"));
    let r = postern_e2e::send(Method::POST, &url, &[("x-timestamp", "1767225600"), ("x-signature", &bad)], "{}").await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);

    // The route buffers small bodies, so the verifier's body phase checks the body too.
    let body = r#"{"event":"paid"}"#;
    let body_sig = format!("sha256={}", hmac_sha256(b"demo-webhook-secret", format!("1767225600.{body}").as_bytes()));
    let headers =
        [("x-timestamp", "1767225600"), ("x-signature", sig.as_str()), ("x-signature-body", body_sig.as_str())];
    let r = postern_e2e::send(Method::POST, &url, &headers, body).await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    assert_eq!(r.json()["body"], body, "the buffered body is forwarded whole");
    let tampered =
        [("x-timestamp", "1767225600"), ("x-signature", sig.as_str()), ("x-signature-body", body_sig.as_str())];
    let r = postern_e2e::send(Method::POST, &url, &tampered, r#"{"event":"refunded"}"#).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);

    // ab-tagger: a stable arm per caller key.
    let mut arms = std::collections::BTreeSet::new();
    for i in 0..20 {
        let key = format!("caller-{i}");
        let a = get(&node.url("/v2/orders/1"), &[("x-api-key", &key)]).await.echoed("x-experiment");
        let b = get(&node.url("/v2/orders/1"), &[("x-api-key", &key)]).await.echoed("x-experiment");
        assert_eq!(a, b, "{key} changed arm");
        arms.insert(a.expect("tagged"));
    }
    assert_eq!(arms.into_iter().collect::<Vec<_>>(), vec!["checkout=a".to_owned(), "checkout=b".to_owned()]);
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
