//! Snapshot reloads: a swap under steady load loses no request; SIGHUP reloads; a bad or
//! older snapshot is refused and the live one keeps serving.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

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

/// Waits until the clients have had `n` more answers than they had when called: each
/// version serves a good share of the load before the next one comes.
async fn answers(ok: &AtomicU64, n: u64) {
    let want = ok.load(Ordering::Relaxed) + n;
    let end = Instant::now() + Duration::from_secs(30);
    while ok.load(Ordering::Relaxed) < want {
        assert!(Instant::now() < end, "the clients had {} of {want} answers after 30 s", ok.load(Ordering::Relaxed));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The node's count of refused snapshots.
async fn refusals(node: &Node) -> u64 {
    node.metric("postern_snapshot_reload_failures_total").await
}

/// Sends SIGHUP and waits for the node's answer to it: its `n`th refusal, counted and
/// logged (the count goes up before the line is written).
async fn sighup_refused(node: &Node, n: u64) {
    node.proc.signal(1);
    let end = Instant::now() + Duration::from_secs(30);
    while refusals(node).await < n || node.log().matches("snapshot refused").count() < n as usize {
        assert!(Instant::now() < end, "refusal {n} not counted and logged in 30 s:\n{}", node.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
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

    // A hundred answers on each version (at most 8 of them begun on the one before).
    for (v, (backend, tag)) in [("b", "two"), ("a", "three"), ("b", "four")].into_iter().enumerate() {
        answers(&ok, 100).await;
        repo.write("teams/t/routes.yaml", &route(backend, tag));
        repo.compile_ok(&snap);
        node.wait_version(v as u64 + 2).await;
    }
    answers(&ok, 100).await;
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
    // The node reads the snapshot through a link in a folder of its own: the system tells
    // it of changes in that folder only, and the file changes in the repository's. With
    // polling effectively off, only SIGHUP reloads, and each SIGHUP is one reload.
    let link_dir = tempfile::tempdir().unwrap();
    let link = link_dir.path().join("snapshot.json");
    std::os::unix::fs::symlink(&snap, &link).unwrap();
    let node = Node::start(&link, &["--watch-interval-ms", "3600000"]);
    assert_eq!(get(&node.url("/r"), &[]).await.header("x-tag"), Some("one"));

    // New content, then SIGHUP.
    repo.write("teams/t/routes.yaml", &route("a", "two"));
    repo.compile_ok(&snap);
    node.proc.signal(1);
    node.wait_version(2).await;
    assert_eq!(get(&node.url("/r"), &[]).await.header("x-tag"), Some("two"));

    // Corrupted (content changed, hash not) and truncated files are refused: after each
    // SIGHUP, the node's refusal of that file is counted and logged before the checks.
    assert_eq!(refusals(&node).await, 0);
    let text = String::from_utf8(std::fs::read(&snap).unwrap()).unwrap();
    std::fs::write(&snap, text.replace("\"two\"", "\"evil\"")).unwrap();
    sighup_refused(&node, 1).await;
    assert!(node.log().contains("hash mismatch"), "tampered snapshot not refused for its hash:\n{}", node.log());
    assert_eq!(node.version().await, 2);
    std::fs::write(&snap, &text.as_bytes()[..text.len() / 2]).unwrap();
    sighup_refused(&node, 2).await;
    assert_eq!(node.version().await, 2);
    // An older version (v1 again) is refused too.
    std::fs::write(&snap, &good).unwrap();
    sighup_refused(&node, 3).await;
    assert!(node.log().contains("not newer"), "{}", node.log());

    assert_eq!(node.version().await, 2);
    assert_eq!(get(&node.url("/r"), &[]).await.header("x-tag"), Some("two"));
    // One refusal per bad file, and nothing else refused or applied.
    assert_eq!(refusals(&node).await, 3, "{}", node.log());
    assert_eq!(node.metric("postern_snapshot_reloads_total").await, 1, "only the SIGHUP to v2 applied");

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
