//! Snapshot reloads: a swap under steady load loses no request; SIGHUP reloads; a bad or
//! older snapshot is refused and the live one keeps serving.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::Method;
use postern_e2e::{Echo, Node, Repo, client, get, platform, send_with};

fn route(backend: &str, tag: &str) -> String {
    format!(
        r#"
routes:
  - name: r
    public: true
    match: {{ path: {{ value: /r }} }}
    backendRefs: [{{ name: {backend} }}]
    timeouts: {{ connect: 1s, response: 5s }}
    responseHeaders:
      set: [{{ name: x-tag, value: "{tag}" }}]
"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_under_load_loses_no_request() {
    let (a, b) = (Echo::start("a"), Echo::start("b"));
    let repo = Repo::new();
    platform(&repo, &[("a", &a.addr()), ("b", &b.addr())]);
    repo.write("teams/t/routes.yaml", &route("a", "one"));
    let snap = repo.path().join("snapshot.json");
    repo.compile_ok(&snap);
    let node = Arc::new(Node::start(&snap, &[]));

    let stop = Arc::new(AtomicBool::new(false));
    let ok = Arc::new(AtomicU64::new(0));
    let bad = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (node, stop, ok, bad) = (node.clone(), stop.clone(), ok.clone(), bad.clone());
        tasks.push(tokio::spawn(async move {
            let c = client();
            let mut seen = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                match send_with(&c, Method::GET, &node.url("/r"), &[], Bytes::new()).await {
                    Ok(r) if r.status == 200 => {
                        ok.fetch_add(1, Ordering::Relaxed);
                        let tag = r.header("x-tag").unwrap_or_default().to_owned();
                        if seen.last() != Some(&tag) {
                            seen.push(tag);
                        }
                    }
                    Ok(r) => {
                        eprintln!("status {} {:?}", r.status, r.body);
                        bad.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        eprintln!("error {e:?}");
                        bad.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            seen
        }));
    }

    for (v, (backend, tag)) in [("b", "two"), ("a", "three"), ("b", "four")].into_iter().enumerate() {
        tokio::time::sleep(Duration::from_millis(400)).await;
        repo.write("teams/t/routes.yaml", &route(backend, tag));
        repo.compile_ok(&snap);
        node.wait_version(v as u64 + 2).await;
    }
    tokio::time::sleep(Duration::from_millis(400)).await;
    stop.store(true, Ordering::Relaxed);
    let mut orders = Vec::new();
    for t in tasks {
        orders.push(t.await.expect("task"));
    }
    let (ok, bad) = (ok.load(Ordering::Relaxed), bad.load(Ordering::Relaxed));
    assert_eq!(bad, 0, "{bad} requests failed during reloads ({ok} ok)");
    assert!(ok > 200, "only {ok} requests ran");
    // Every client saw the versions in order, never going back.
    for seen in orders {
        let expected = ["one", "two", "three", "four"];
        let mut i = 0;
        for tag in &seen {
            let pos = expected.iter().position(|e| e == tag).expect("known tag");
            assert!(pos >= i, "went back: {seen:?}");
            i = pos;
        }
    }
    assert!(a.count().await > 0 && b.count().await > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_or_older_snapshots_are_refused_and_sighup_reloads() {
    let a = Echo::start("a");
    let repo = Repo::new();
    platform(&repo, &[("a", &a.addr())]);
    repo.write("teams/t/routes.yaml", &route("a", "one"));
    let snap = repo.path().join("snapshot.json");
    repo.compile_ok(&snap);
    let good = std::fs::read(&snap).unwrap();
    // Polling effectively off: only SIGHUP reloads.
    let node = Node::start(&snap, &["--watch-interval-ms", "3600000"]);
    assert_eq!(get(&node.url("/r"), &[]).await.header("x-tag"), Some("one"));

    // New content, then SIGHUP.
    repo.write("teams/t/routes.yaml", &route("a", "two"));
    repo.compile_ok(&snap);
    node.proc.signal(1);
    node.wait_version(2).await;
    assert_eq!(get(&node.url("/r"), &[]).await.header("x-tag"), Some("two"));

    // Corrupted (content changed, hash not) and truncated files are refused.
    let text = String::from_utf8(std::fs::read(&snap).unwrap()).unwrap();
    std::fs::write(&snap, text.replace("\"two\"", "\"evil\"")).unwrap();
    node.proc.signal(1);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !node.log().contains("hash mismatch") {
        assert!(std::time::Instant::now() < deadline, "tampered snapshot not refused:\n{}", node.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    std::fs::write(&snap, &text.as_bytes()[..text.len() / 2]).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    node.proc.signal(1);
    tokio::time::sleep(Duration::from_millis(300)).await;
    // An older version (v1 again) is refused too.
    std::fs::write(&snap, &good).unwrap();
    node.proc.signal(1);
    tokio::time::sleep(Duration::from_millis(300)).await;

    assert_eq!(node.version().await, 2);
    assert_eq!(get(&node.url("/r"), &[]).await.header("x-tag"), Some("two"));
    let log = node.log();
    assert!(log.contains("hash mismatch"), "{log}");
    assert!(log.contains("not newer"), "{log}");
    let m = String::from_utf8(get(&node.admin_url("/metrics"), &[]).await.body.to_vec()).unwrap();
    let failures: u64 = m
        .lines()
        .find_map(|l| l.strip_prefix("postern_snapshot_reload_failures_total "))
        .and_then(|v| v.parse().ok())
        .unwrap();
    assert!(failures >= 3, "{failures} failures counted\n{m}");

    // A node refuses to start on a bad snapshot, with a clear message.
    std::fs::write(&snap, b"{not json").unwrap();
    let out = std::process::Command::new(postern_e2e::bin("postern"))
        .arg("--snapshot")
        .arg(&snap)
        .args(["--public", "127.0.0.1:0", "--partner", "127.0.0.1:0", "--admin", "127.0.0.1:0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("refused"), "{}", String::from_utf8_lossy(&out.stderr));
}
