//! The demo config repository (`examples/config`) compiled and served with all four
//! example filters on their demo routes, with real credentials. Alone in its binary: it
//! starts many processes, which must not steal time from the hostile-filter tests' tight
//! deadlines.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::sync::Arc;

use http::{Method, StatusCode};
use postern_e2e::{Echo, Node, get};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Notify;

fn hmac_sha256(key: &[u8], msg: &[u8]) -> String {
    use sha2::Digest;
    let mut k = [0u8; 64];
    k[..key.len()].copy_from_slice(key);
    let inner: Vec<u8> = k.iter().map(|b| b ^ 0x36).chain(msg.iter().copied()).collect();
    let ih = sha2::Sha256::digest(&inner);
    let outer: Vec<u8> = k.iter().map(|b| b ^ 0x5c).chain(ih.iter().copied()).collect();
    hex::encode(sha2::Sha256::digest(&outer))
}

/// A stand-in for the node's admin listener, in front of it: it passes each request on
/// (one per connection) and answers with the node's answer. `first` is told once the
/// first request is answered; the second is held until `second` is told. So the two reads
/// of `posternctl filter cost --window` come in an order the test sets, whatever the clock.
async fn admin_gate(admin: u16) -> (u16, Arc<Notify>, Arc<Notify>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (first, second) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let (answered, held) = (first.clone(), second.clone());
    tokio::spawn(async move {
        for n in 0.. {
            let (mut conn, _) = listener.accept().await.unwrap();
            let mut head = Vec::new();
            let mut buf = [0u8; 1024];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                let got = conn.read(&mut buf).await.unwrap();
                assert!(got > 0, "the request ended before its head");
                head.extend_from_slice(&buf[..got]);
            }
            let head = String::from_utf8_lossy(&head).into_owned();
            let path = head.split_whitespace().nth(1).expect("a request line").to_owned();
            if n == 1 {
                held.notified().await;
            }
            let r = get(&format!("http://127.0.0.1:{admin}{path}"), &[]).await;
            let mut out = format!(
                "HTTP/1.1 {}\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                r.status,
                r.body.len()
            )
            .into_bytes();
            out.extend_from_slice(&r.body);
            conn.write_all(&out).await.unwrap();
            conn.shutdown().await.unwrap();
            if n == 0 {
                answered.notify_one();
            }
        }
    });
    (port, first, second)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn example_filters_on_the_demo_routes() {
    let echos = [Echo::start("echo"), Echo::start("orders-v1"), Echo::start("orders-v2")];
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config");
    postern_e2e::prepare_example_config(&config, &echos.iter().map(Echo::addr).collect::<Vec<_>>());
    // API keys: one per tenant for the allow-list, one per app for the A/B tagger.
    let acme = postern_e2e::new_key(&config, "acme-1", "demo-app", "acme", "partner", &[]);
    let initech = postern_e2e::new_key(&config, "initech-1", "free-app", "initech", "free", &[]);
    let callers: Vec<String> = (0..20)
        .map(|i| {
            postern_e2e::new_key(&config, &format!("c-{i}"), &format!("caller-{i}"), "t", "partner", &["orders:read"])
        })
        .collect();
    let snap = dir.path().join("snapshot.json");
    postern_e2e::ConfigDir(&config).compile_ok(&snap);
    let node = Node::start(&snap, &[]);

    // header-injector: request header set, client header removed, response tagged.
    let r = get(&node.url("/v1/echo/hi"), &[("x-debug", "1")]).await;
    assert_eq!(r.status, StatusCode::OK, "{:?}\n{}", r.body, node.log());
    assert_eq!(r.echoed("x-demo").as_deref(), Some("injected-by-wasm"));
    assert!(r.echoed("x-debug").is_none());
    assert_eq!(r.header("x-filter"), Some("header-injector"));

    // tenant-allowlist reads the verified identity: a tenant off the list gets 403 and
    // nothing is forwarded; one on it goes through; without credentials, 401 first.
    let before = echos[0].count().await;
    let r = get(&node.url("/v1/echo/tenants/x"), &[("x-api-key", &initech)]).await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    assert_eq!(r.json()["code"], "tenant_not_allowed");
    let r = get(&node.url("/v1/echo/tenants/x"), &[]).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    assert_eq!(echos[0].count().await, before);
    let r = get(&node.url("/v1/echo/tenants/x"), &[("x-api-key", &acme)]).await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    assert_eq!(r.echoed("x-auth-tenant").as_deref(), Some("acme"));

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

    // ab-tagger: a stable arm per calling app (the verified x-auth-client-id).
    let mut arms = std::collections::BTreeSet::new();
    for (i, key) in callers.iter().enumerate() {
        let first = get(&node.url("/v2/orders/1"), &[("x-api-key", key)]).await;
        let second = get(&node.url("/v2/orders/1"), &[("x-api-key", key)]).await;
        assert_eq!((first.status, second.status), (StatusCode::OK, StatusCode::OK), "{first:?} {second:?}");
        let (a, b) = (first.echoed("x-experiment"), second.echoed("x-experiment"));
        assert_eq!(a, b, "caller {i} changed arm");
        arms.insert(a.expect("tagged"));
    }
    assert_eq!(arms.into_iter().collect::<Vec<_>>(), vec!["checkout=a".to_owned(), "checkout=b".to_owned()]);

    // What the A/B tagger cost its team: 40 calls, all ok, with fuel and duration
    // percentiles, read from the node's admin endpoint; over a window, only that window.
    let cost_of = |route: &str, extra: &[&str]| {
        let out = std::process::Command::new(postern_e2e::bin("posternctl"))
            .args(["filter", "cost", "--route", route, "--admin", &node.admin_url("")])
            .args(extra)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let cost = |extra: &[&str]| cost_of("orders/orders-v2-canary", extra);
    let table = cost(&[]);
    assert!(table.contains("filter ab-tagger: 40 calls (ok 40)"), "{table}");
    assert!(table.contains("fuel      p50 ") && !table.contains("fuel      p50 -"), "{table}");
    assert!(table.contains("quarantines 0"), "{table}");
    let v: serde_json::Value = serde_json::from_str(&cost(&["--json"])).unwrap();
    let ab = &v["filters"]["ab-tagger"];
    assert_eq!((ab["calls"].as_u64(), ab["outcomes"]["ok"].as_u64()), (Some(40), Some(40)), "{v}");
    assert!(ab["fuel"]["p99"].as_f64().unwrap() > 0.0, "{v}");
    assert!(ab["duration_ms"]["p50"].as_f64().unwrap() > 0.0, "{v}");
    // Over a window: three calls between its two reads (held apart by the gate, so the
    // calls fall inside the window whatever the machine's speed).
    let (gate, first_read, second_read) = admin_gate(node.admin).await;
    let windowed = tokio::task::spawn_blocking(move || {
        std::process::Command::new(postern_e2e::bin("posternctl"))
            .args(["filter", "cost", "--route", "orders/orders-v2-canary", "--json", "--window", "2s"])
            .args(["--admin", &format!("http://127.0.0.1:{gate}")])
            .output()
            .unwrap()
    });
    first_read.notified().await;
    for key in callers.iter().take(3) {
        assert_eq!(get(&node.url("/v2/orders/1"), &[("x-api-key", key)]).await.status, StatusCode::OK);
    }
    second_read.notify_one();
    let out = windowed.await.unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["window_s"], 2);
    assert_eq!(v["filters"]["ab-tagger"]["calls"], 3, "only the window's calls: {v}");
    let none = cost_of("nope/none", &[]);
    assert!(none.contains("no Wasm filter calls on this route"), "{none}");
}
