//! Usage metering end to end: `posternctl serve` (intake and usage store) and `postern`
//! nodes (meter, spool, shipper) on ephemeral ports. What a key is billed is what its
//! clients saw answered 2xx/3xx; a re-sent window changes nothing; bad, foreign or
//! unsigned windows are refused and change nothing; a node killed with `kill -9`
//! mid-window loses no call and never counts one twice.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, StatusCode};
use postern_e2e::control_plane::*;
use postern_e2e::usage::{billed, load, numbered, spool_state, store_node, wait_mid_window, wait_store_has};
use postern_e2e::{Echo, Node, Repo, bin, get, new_key, platform, send};

const TEAM_T_ROUTES: &str = "routes:\n  - name: search\n    match: { path: { value: /search } }\n    auth: { methods: [apiKey], product: search }\n    backendRefs: [{ name: e }]\n    timeouts: { connect: 1s, response: 5s }\n  - name: open\n    public: true\n    match: { path: { value: /open } }\n    backendRefs: [{ name: e }]\n    timeouts: { connect: 1s, response: 5s }\n";

struct Fleet {
    /// The PostgreSQL database of a control plane on PostgreSQL (its snapshots and its
    /// usage store); dropped last.
    _pg: Option<PgDb>,
    _echo: Echo,
    repo: Repo,
    work: tempfile::TempDir,
    cp: ControlPlane,
}

fn fleet() -> Fleet {
    fleet_on(None)
}

/// A fleet whose control plane keeps everything in PostgreSQL database `pg` (usage in the
/// same database: no `--usage-db`), or in a directory store with `usage.db` beside it.
fn fleet_on(pg: Option<PgDb>) -> Fleet {
    fleet_with(pg, &[])
}

/// [`fleet_on`] with more flags for `posternctl serve`.
fn fleet_with(pg: Option<PgDb>, extra: &[&str]) -> Fleet {
    let echo = Echo::start("e");
    let repo = Repo::new();
    platform(&repo, &[("e", &echo.addr())]);
    repo.write("platform/plans.yaml", "scopes: []\nproducts: [search]\nplans:\n  gold: { products: [search] }\n");
    repo.write("teams/t/routes.yaml", TEAM_T_ROUTES);
    let work = tempfile::tempdir().unwrap();
    let tokens = write_tokens(work.path());
    let store = match &pg {
        Some(db) => db.url.clone(),
        None => work.path().join("store").to_str().unwrap().to_owned(),
    };
    let mut args = vec!["--dwell", "0s"];
    args.extend_from_slice(extra);
    let cp = serve(repo.path(), &store, &tokens, &args);
    Fleet { _pg: pg, _echo: echo, repo, work, cp }
}

/// Calls `/search` as `key` with `?status=`; the status the client saw.
async fn call(node: &Node, key: &str, status: u16) -> StatusCode {
    get(&node.url(&format!("/search?status={status}")), &[("x-api-key", key)]).await.status
}

async fn post_usage(cp: &ControlPlane, token: Option<&str>, body: impl Into<Bytes>) -> (StatusCode, serde_json::Value) {
    let auth = token.map(|t| format!("Bearer {t}"));
    let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", a.as_str())).collect();
    let r = send(Method::POST, &format!("{}/v1/usage", cp.url), &headers, body).await;
    (r.status, serde_json::from_slice(&r.body).unwrap_or(serde_json::Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_billable_call_is_billed_once_and_bad_windows_change_nothing() {
    billed_once_and_bad_windows_change_nothing(fleet()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_every_billable_call_is_billed_once_and_bad_windows_change_nothing() {
    billed_once_and_bad_windows_change_nothing(fleet_on(Some(PgDb::create()))).await;
}

async fn billed_once_and_bad_windows_change_nothing(fleet: Fleet) {
    let Fleet { _pg, _echo, repo, work, cp } = fleet;
    let k1 = new_key(repo.path(), "k1", "app1", "acme", "gold", &[]);
    let k2 = new_key(repo.path(), "k2", "app2", "acme", "gold", &[]);
    ctl(&cp, &["publish"]);
    let node = start_node(&cp.url, &work.path().join("n0"), "node-0");
    // The credentials lane follows the snapshot's: wait for the keys (one billable call).
    wait_for("the node to take the keys", Duration::from_secs(10), async || {
        call(&node, &k2, 200).await == StatusCode::OK
    })
    .await;

    // 2xx and 3xx are billable; 4xx and 5xx are counted, not billed; a refused key and
    // a public route are not metered at all.
    let mut seen: BTreeMap<&str, u64> = BTreeMap::from([("k2", 1)]);
    for (key, id, n) in [(&k1, "k1", 40), (&k2, "k2", 25)] {
        for i in 0..n {
            let want = match i % 10 {
                0 => 503,
                1 => 404,
                2 => 304,
                _ => 200,
            };
            let got = call(&node, key, want).await;
            assert_eq!(got.as_u16(), want);
            if got.is_success() || got.is_redirection() {
                *seen.entry(id).or_default() += 1;
            }
        }
    }
    assert_eq!(get(&node.url("/search"), &[("x-api-key", "ak_live_nope")]).await.status, StatusCode::UNAUTHORIZED);
    assert_eq!(get(&node.url("/open"), &[]).await.status, StatusCode::OK);
    let t = Instant::now();
    wait_for("the calls billed", Duration::from_secs(20), async || {
        billed(&cp) == seen.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect::<BTreeMap<_, _>>()
    })
    .await;
    eprintln!("billed {seen:?} {} ms after the last call (10 s windows)", t.elapsed().as_millis());
    let rows = ctl(&cp, &["usage", "--json", "--key", "k1"])["rows"].clone();
    assert_eq!(rows.as_array().map(Vec::len), Some(1), "{rows}");
    assert_eq!(rows[0]["route"], "t/search");
    assert_eq!(rows[0]["product"], "search");
    assert_eq!(rows[0]["calls"], 40);
    assert_eq!((rows[0]["status"]["4xx"].as_u64(), rows[0]["status"]["5xx"].as_u64()), (Some(4), Some(4)));
    assert!(rows[0]["latency_ms"]["p99"].as_f64().is_some(), "{rows}");

    // The table, as a user reads it.
    let out = Command::new(bin("posternctl"))
        .args(["usage", "--key", "k2", "--by", "minute", "--control", &cp.url, "--token", PLATFORM_TOKEN])
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{table}{}", String::from_utf8_lossy(&out.stderr));
    assert!(table.contains("CALLER") && table.contains("k2 (key)") && table.contains("t/search"), "{table}");
    eprintln!("{table}");

    // A team reads its own routes only.
    let team = |token: &str| {
        let out = Command::new(bin("posternctl"))
            .args(["usage", "--json", "--control", &cp.url, "--token", token])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["rows"].as_array().map_or(0, Vec::len)
    };
    assert_eq!(team(TEAM_T_TOKEN), 2);
    assert_eq!(team(TEAM_X_TOKEN), 0);
    // A team's range spans at most 31 days: a longer one is refused, naming the rule.
    let auth = format!("Bearer {TEAM_T_TOKEN}");
    let long = get(&format!("{}/v1/usage?from=2026-01-01&to=2026-03-01", cp.url), &[("authorization", &auth)]).await;
    let why = String::from_utf8_lossy(&long.body).into_owned();
    assert_eq!(long.status, StatusCode::BAD_REQUEST, "{why}");
    assert!(why.contains("team_range"), "{why}");

    // Every window was acknowledged (the store applied them before it answered; the node
    // records the answer just after); the node serves them again for re-sends.
    let mut state = serde_json::Value::Null;
    wait_for("the node to record every acknowledgement", Duration::from_secs(30), async || {
        state = spool_state(&node).await;
        state["next_seq"].as_u64().is_some_and(|next| next >= 2 && state["acked"].as_u64() == Some(next - 1))
    })
    .await;
    assert_eq!(state["spool"], "ok", "{state}");
    let last = state["next_seq"].as_u64().unwrap() - 1;
    assert!(last >= 1 && state["acked"].as_u64() == Some(last), "{state}");
    let resend = get(&node.admin_url(&format!("/usage/windows?from=1&to={last}")), &[]).await;
    assert_eq!(resend.status, StatusCode::OK);
    let before = billed(&cp);

    // A duplicate delivery adds nothing.
    let (status, ack) = post_usage(&cp, Some(NODE_TOKEN), resend.body.clone()).await;
    assert_eq!(status, StatusCode::OK, "{ack}");
    assert_eq!((ack["applied"].as_u64(), ack["duplicates"].as_u64()), (Some(0), Some(last)), "{ack}");

    // Bad input: unsigned, malformed, inconsistent, foreign or from the wrong role.
    let mut forged: serde_json::Value = serde_json::from_slice(&resend.body).unwrap();
    let w = &mut forged["windows"][0];
    w["seq"] = serde_json::json!(last + 100);
    let good = forged.to_string();
    assert_eq!(post_usage(&cp, None, good.clone()).await.0, StatusCode::UNAUTHORIZED);
    assert_eq!(post_usage(&cp, Some("not-a-token"), good.clone()).await.0, StatusCode::UNAUTHORIZED);
    assert_eq!(post_usage(&cp, Some(PLATFORM_TOKEN), good.clone()).await.0, StatusCode::FORBIDDEN);
    assert_eq!(post_usage(&cp, Some(NODE_A_TOKEN), good.clone()).await.0, StatusCode::FORBIDDEN);
    assert_eq!(post_usage(&cp, Some(NODE_TOKEN), "{\"windows\": [{\"node\": ").await.0, StatusCode::BAD_REQUEST);
    assert_eq!(post_usage(&cp, Some(NODE_TOKEN), "{\"rows\": []}").await.0, StatusCode::BAD_REQUEST);
    let mut lying = forged.clone();
    lying["windows"][0]["rows"][0]["status"][1] = serde_json::json!(1_000_000);
    let (status, body) = post_usage(&cp, Some(NODE_TOKEN), lying.to_string()).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(body["error"].as_str().unwrap_or_default().contains("disagree"), "{body}");
    // A known (node, seq) with other contents is refused whole (the node's spool was reset).
    let mut renumbered: serde_json::Value = serde_json::from_slice(&resend.body).unwrap();
    renumbered["windows"][0]["start"] = serde_json::json!(renumbered["windows"][0]["start"].as_u64().unwrap() + 10);
    assert_eq!(post_usage(&cp, Some(NODE_TOKEN), renumbered.to_string()).await.0, StatusCode::CONFLICT);
    assert_eq!(billed(&cp), before, "a refused window changed a total");
    // The store reports what it dropped.
    let auth = format!("Bearer {PLATFORM_TOKEN}");
    let nodes = get(&format!("{}/v1/usage/nodes", cp.url), &[("authorization", &auth)]).await.json();
    assert_eq!(nodes["nodes"][0]["duplicates"].as_u64(), Some(last), "{nodes}");
    assert_eq!(nodes["nodes"][0]["missing"].as_u64(), Some(0), "{nodes}");
    drop(node);
}

fn node_args<'a>(cp: &'a ControlPlane, key: &'a Path) -> Vec<&'a str> {
    vec![
        "--control",
        &cp.url,
        "--control-token",
        NODE_TOKEN,
        "--control-key",
        key.to_str().unwrap(),
        "--drain-seconds",
        "2",
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_mid_window_loses_no_call_and_counts_nothing_twice() {
    let Fleet { _pg, _echo, repo, work, cp } = fleet();
    let key = new_key(repo.path(), "k1", "app1", "acme", "gold", &[]);
    ctl(&cp, &["publish"]);
    let dir = work.path().join("n0");
    let node = start_node(&cp.url, &dir, "node-0");
    let pubkey = work.path().join("control.pub");

    // Load for a while (2.5 s: the scenario's length, not a wait for anything), then
    // kill -9 mid-window (3 to 8 s into it). The clients stop first and the kill follows
    // at once: every call they saw answered was counted, and no call is in flight whose
    // answer nobody saw (that call would be counted, and billed without being seen).
    let stop = Arc::new(AtomicBool::new(false));
    let first = load(node.public, key.clone(), stop.clone(), 4, Duration::ZERO);
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let spool = dir.join("usage-spool");
    wait_mid_window(&spool).await;
    stop.store(true, Ordering::Relaxed);
    let before_kill = first.await.unwrap();
    node.proc.signal(9);
    drop(node);

    // Restarted without --node-id, it takes the spool's and numbers on from it.
    let node = Node::start(&dir.join("snapshot.json"), &node_args(&cp, &pubkey));
    let state = spool_state(&node).await;
    assert_eq!(state["node"], "node-0", "{state}");
    let stop = Arc::new(AtomicBool::new(false));
    let second = load(node.public, key.clone(), stop.clone(), 4, Duration::ZERO);
    // The second run's length (3 s of load), not a wait for anything.
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::Relaxed);
    let after_restart = second.await.unwrap();
    // A graceful stop closes the open window and ships it.
    node.proc.signal(15);
    let mut node = node;
    let end = Instant::now() + Duration::from_secs(30);
    while node.proc.alive() {
        assert!(Instant::now() < end, "the node did not stop");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(node.log().contains("usage window recovered"), "{}", node.log());

    let seen = (before_kill.len() + after_restart.len()) as u64;
    // The stopped node numbered its last window; once the store holds every window up to
    // it, nothing more of node-0's usage can come: the total is final, and it is exactly
    // what the clients saw answered (the open window's calls at the kill came back from
    // the counts file).
    let t = Instant::now();
    wait_store_has(&cp, "node-0", numbered(&spool)).await;
    let got = billed(&cp).get("k1").copied().unwrap_or(0);
    eprintln!(
        "client saw {seen} (before kill {}, after {}); billed {got}; settled {} ms after stop",
        before_kill.len(),
        after_restart.len(),
        t.elapsed().as_millis()
    );
    assert_eq!(got, seen, "billed == seen, exactly, through a kill -9 mid-window");
    // The store saw the crash: a recovered window, and no sequence number missing.
    let n0 = store_node(&cp, "node-0").await;
    assert_eq!((n0["recovered"].as_u64(), n0["missing"].as_u64()), (Some(1), Some(0)), "{n0}");
    assert_eq!(n0["duplicates"].as_u64(), Some(0), "{n0}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_spool_and_an_absent_control_plane_delay_usage_and_lose_none_of_it() {
    let Fleet { _pg, _echo, repo, work, cp } = fleet();
    // Sixteen keys make a window of about 3 KiB: a 5 KiB spool holds one.
    let keys: Vec<(String, String)> = (0..16)
        .map(|i| (format!("k{i:02}"), new_key(repo.path(), &format!("k{i:02}"), "app", "acme", "gold", &[])))
        .collect();
    ctl(&cp, &["publish"]);
    let dir = work.path().join("n0");
    let node = start_node_with(&cp.url, &dir, "node-0", &["--usage-spool-max", "5KiB"]);
    // The node has the keys (the credentials lane follows the snapshot's) before the
    // control plane goes away; from then on windows wait in the spool, then in memory.
    let last_key = &keys[keys.len() - 1].1;
    wait_for("the node to take the keys", Duration::from_secs(10), async || {
        call(&node, last_key, 200).await == StatusCode::OK
    })
    .await;
    let listen = cp.url.trim_start_matches("http://").to_owned();
    drop(cp);

    // The successful call above is billed too.
    let mut seen: BTreeMap<String, u64> = BTreeMap::from([(keys[keys.len() - 1].0.clone(), 1)]);
    let t = Instant::now();
    let mut degraded = serde_json::Value::Null;
    while t.elapsed() < Duration::from_secs(40) {
        for (id, key) in &keys {
            // The node serves as ever while its spool is full.
            assert_eq!(call(&node, key, 200).await, StatusCode::OK);
            *seen.entry(id.clone()).or_default() += 1;
        }
        let state = spool_state(&node).await;
        if state["spool"] == "degraded" && state["pending"].as_u64() >= Some(1) {
            degraded = state;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(degraded.is_object(), "the spool never filled: {}", spool_state(&node).await);
    eprintln!("spool full after {} ms: {degraded}", t.elapsed().as_millis());
    assert!(degraded["spool_error"].as_str().unwrap_or_default().contains("full"), "{degraded}");
    assert!(degraded["ship_error"].is_string(), "{degraded}");
    let metrics = get(&node.admin_url("/metrics"), &[]).await;
    let text = String::from_utf8_lossy(&metrics.body);
    let errors = text.lines().find_map(|l| l.strip_prefix("postern_usage_spool_errors_total ")).unwrap_or("0");
    assert!(errors.parse::<u64>().unwrap_or(0) > 0, "{text}");

    // Back on the same address and store: the spool drains, the windows kept in memory
    // follow it, and every call is billed exactly once.
    let store = work.path().join("store");
    let cp = serve(repo.path(), store.to_str().unwrap(), &work.path().join("tokens.json"), &["--listen", &listen]);
    let t = Instant::now();
    wait_for("every call billed after the outage", Duration::from_secs(30), async || billed(&cp) == seen).await;
    eprintln!(
        "billed {} calls exactly, {} ms after the control plane came back",
        seen.values().sum::<u64>(),
        t.elapsed().as_millis()
    );
    wait_for("the spool to recover", Duration::from_secs(30), async || spool_state(&node).await["spool"] == "ok").await;
    drop(node);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_usage_store_is_refilled_from_the_nodes_spools() {
    let Fleet { _pg, _echo, repo, work, cp } = fleet();
    let key = new_key(repo.path(), "k1", "app1", "acme", "gold", &[]);
    ctl(&cp, &["publish"]);
    let node = start_node(&cp.url, &work.path().join("n0"), "node-0");
    wait_for("the node to take the key", Duration::from_secs(10), async || {
        call(&node, &key, 200).await == StatusCode::OK
    })
    .await;
    let mut seen = 1;
    for _ in 0..30 {
        assert_eq!(call(&node, &key, 200).await, StatusCode::OK);
        seen += 1;
    }
    wait_for("the first calls billed", Duration::from_secs(20), async || billed(&cp).get("k1") == Some(&seen)).await;

    // The usage store is lost (a restore from an old backup would look the same): the
    // next window's number shows the gap, and the node sends the windows again from its
    // spool, which keeps acknowledged windows for re-sends.
    let listen = cp.url.trim_start_matches("http://").to_owned();
    drop(cp);
    let store = work.path().join("store");
    for f in ["usage.db", "usage.db-wal", "usage.db-shm"] {
        let _ = std::fs::remove_file(store.join(f));
    }
    let cp = serve(repo.path(), store.to_str().unwrap(), &work.path().join("tokens.json"), &["--listen", &listen]);
    assert_eq!(billed(&cp).get("k1"), None);
    for _ in 0..20 {
        assert_eq!(call(&node, &key, 200).await, StatusCode::OK);
        seen += 1;
    }
    let t = Instant::now();
    wait_for("every call billed again", Duration::from_secs(30), async || billed(&cp).get("k1") == Some(&seen)).await;
    eprintln!("{seen} calls billed again {} ms after the last call", t.elapsed().as_millis());
    let auth = format!("Bearer {PLATFORM_TOKEN}");
    let nodes = get(&format!("{}/v1/usage/nodes", cp.url), &[("authorization", &auth)]).await.json();
    assert_eq!(nodes["nodes"][0]["missing"].as_u64(), Some(0), "{nodes}");
    let state = spool_state(&node).await;
    assert!(state["resent"].as_u64() >= Some(1), "{state}");
    assert_eq!(state["resend_unavailable"].as_u64(), Some(0), "{state}");
    drop(node);
}

/// A window of node `node-x` in JSON, as a node sends it: one row for key `k9`.
fn window_json(seq: u64, start: u64, ok: u64) -> serde_json::Value {
    let mut latency = vec![0u64; postern_model::usage::LATENCY_BUCKETS];
    latency[0] = ok + 1;
    serde_json::json!({
        "node": "node-x", "seq": seq, "start": start,
        "rows": [{"caller": "k9", "kind": "key", "product": "search", "route": "t/search",
                  "status": [0, ok, 0, 1, 0], "latency": latency, "latency_us": 500 * (ok + 1)}],
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_period_is_final_and_exported_only_once_every_window_is_in() {
    let Fleet { _pg, _echo, repo: _repo, work: _work, cp } = fleet();
    // 2026-12-01T00:00:00Z: the end of November.
    const DEC: u64 = 1_796_083_200;
    let batch = |windows: Vec<serde_json::Value>| serde_json::json!({ "windows": windows }).to_string();
    let (status, ack) =
        post_usage(&cp, Some(NODE_TOKEN), batch(vec![window_json(1, DEC - 20, 4), window_json(3, DEC + 10, 1)])).await;
    assert_eq!(status, StatusCode::OK, "{ack}");
    assert_eq!(ack["missing"], serde_json::json!([{"node": "node-x", "from": 2, "to": 2}]), "{ack}");

    let usage = |args: &[&str]| {
        Command::new(bin("posternctl"))
            .arg("usage")
            .args(args)
            .args(["--control", &cp.url, "--token", PLATFORM_TOKEN])
            .output()
            .unwrap()
    };
    let json_of = |out: &std::process::Output| -> serde_json::Value {
        let text = String::from_utf8_lossy(&out.stdout);
        serde_json::from_str(text.find('{').map_or("null", |i| &text[i..])).unwrap_or_default()
    };
    let out = usage(&["reconcile", "--period", "2026-11"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report = json_of(&out);
    assert_eq!(report["final"], false, "{report}");
    assert!(report["blocking"].to_string().contains("node node-x has not reported its own counts"), "{report}");

    // The node's own counts of November, as a node reports them once the month is
    // complete on it (every window up to number 2 is November's).
    let put_counters = async |path_node: &str, body: String| {
        let auth = format!("Bearer {NODE_TOKEN}");
        let url = format!("{}/v1/nodes/{path_node}/usage/counters", cp.url);
        send(Method::PUT, &url, &[("authorization", &auth)], body).await
    };
    let counts = |ok: u64, period: &str| {
        serde_json::json!({"node": "node-x", "period": period, "through": 2,
            "rows": [{"kind": "key", "caller": "k9", "product": "search", "status": [0, ok, 0, 2, 0]}]})
        .to_string()
    };
    let r = put_counters("node-x", counts(9, "2026-11")).await;
    assert_eq!(r.status, StatusCode::NO_CONTENT, "{}", String::from_utf8_lossy(&r.body));
    let report = json_of(&usage(&["reconcile", "--period", "2026-11"]));
    assert_eq!(report["final"], false, "{report}");
    assert!(report["blocking"].to_string().contains("node node-x lacks windows 2..2"), "{report}");
    let out = usage(&["export", "--period", "2026-11"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not final"), "{}", String::from_utf8_lossy(&out.stderr));

    // The missing window comes (a node sends it when asked): November is complete, and
    // the store's count agrees with the node's.
    let (status, ack) = post_usage(&cp, Some(NODE_TOKEN), batch(vec![window_json(2, DEC - 10, 5)])).await;
    assert_eq!((status, ack["applied"].as_u64()), (StatusCode::OK, Some(1)), "{ack}");
    let report = json_of(&usage(&["reconcile", "--period", "2026-11"]));
    assert_eq!(report["final"], true, "{report}");
    assert_eq!((report["billable"].as_u64(), report["nodes"][0]["windows"].as_u64()), (Some(9), Some(2)), "{report}");
    assert_eq!(
        (report["nodes"][0]["own_calls"].as_u64(), report["nodes"][0]["corrected"].as_u64()),
        (Some(11), Some(0))
    );
    let export = || {
        let out = usage(&["export", "--period", "2026-11"]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect::<Vec<serde_json::Value>>()
    };
    let lines = export();
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!((lines[0]["caller"].as_str(), lines[0]["product"].as_str()), (Some("k9"), Some("search")));
    assert_eq!((lines[0]["billable"].as_u64(), lines[0]["status"]["4xx"].as_u64()), (Some(9), Some(2)));

    // The node counted one call more than the store holds (a window it no longer had
    // when asked): November is final, so its report is held (202), the export stands,
    // and only the platform's decision reopens the period; then the reconcile bills the
    // node's count.
    let r = put_counters("node-x", counts(10, "2026-11")).await;
    assert_eq!(r.status, StatusCode::ACCEPTED, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(export()[0]["billable"].as_u64(), Some(9), "a changed report reopens nothing on its own");
    let held = json_of(&usage(&["held"]));
    assert_eq!((held["held"][0]["state"].as_str(), held["held"][0]["reports"].as_u64()), (Some("held"), Some(1)));
    let out = usage(&["held", "--apply", "2026-11"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!((json_of(&out)["decided"].as_u64(), json_of(&out)["reports"].as_u64()), (Some(0), Some(1)));
    assert!(!usage(&["export", "--period", "2026-11"]).status.success(), "the decision reopens the period");
    let report = json_of(&usage(&["reconcile", "--period", "2026-11"]));
    assert_eq!(report["final"], true, "{report}");
    assert_eq!(
        (report["billable"].as_u64(), report["nodes"][0]["corrected"].as_u64()),
        (Some(10), Some(1)),
        "{report}"
    );
    assert_eq!(export()[0]["billable"].as_u64(), Some(10));

    // Bad reports change nothing: a bad period, another node's counts, no token.
    let r = put_counters("node-x", counts(50, "2026-13")).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", String::from_utf8_lossy(&r.body));
    let r = put_counters("node-y", counts(50, "2026-11")).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", String::from_utf8_lossy(&r.body));
    let r = put_counters("node-x", "{\"node\": 1}".to_owned()).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    let url = format!("{}/v1/nodes/node-x/usage/counters", cp.url);
    assert_eq!(send(Method::PUT, &url, &[], counts(50, "2026-11")).await.status, StatusCode::UNAUTHORIZED);
    assert_eq!(export()[0]["billable"].as_u64(), Some(10));
    // December has not ended; a team may not close periods.
    assert_eq!(json_of(&usage(&["reconcile", "--period", "2026-12"]))["final"], false);
    let auth = format!("Bearer {TEAM_T_TOKEN}");
    let r =
        send(Method::POST, &format!("{}/v1/usage/reconcile?period=2026-11", cp.url), &[("authorization", &auth)], "")
            .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);

    // A window for November, final now, is held: acknowledged (the node ships on), never
    // added on its own; the export stands until the platform decides.
    let mut late = window_json(1, DEC - 10, 7);
    late["node"] = "node-w".into();
    let (status, ack) = post_usage(&cp, Some(NODE_TOKEN), batch(vec![late])).await;
    assert_eq!((status, ack["applied"].as_u64()), (StatusCode::OK, Some(1)), "{ack}");
    assert_eq!(export()[0]["billable"].as_u64(), Some(10), "the final period's bill stands");
    let held = json_of(&usage(&["held"]));
    let waiting = |held: &serde_json::Value, state: &str| {
        held["held"].as_array().unwrap().iter().find(|h| h["state"] == state).cloned().unwrap_or_default()
    };
    let w = waiting(&held, "held");
    assert_eq!(
        (w["parts"].as_u64(), w["calls"].as_u64(), w["reports"].as_u64()),
        (Some(1), Some(8), Some(0)),
        "{held}"
    );
    let out = usage(&["held", "--discard", "2026-11"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(json_of(&out)["decided"].as_u64(), Some(1));
    let held = json_of(&usage(&["held"]));
    assert_eq!(waiting(&held, "discarded")["decided_by"].as_str(), Some("alice"), "{held}");
    assert_eq!(waiting(&held, "applied")["reports"].as_u64(), Some(1), "{held}");
    assert_eq!(export()[0]["billable"].as_u64(), Some(10));

    // A node that sent a window and never reported its counts holds November up (node-w
    // too), until the platform retires it; past the window it was retired as of, it is
    // refused.
    assert!(usage(&["retire", "--node", "node-w"]).status.success());
    let mut q = window_json(1, DEC - 10, 3);
    q["node"] = "node-q".into();
    let (status, ack) = post_usage(&cp, Some(NODE_TOKEN), batch(vec![q.clone()])).await;
    assert_eq!(status, StatusCode::OK, "{ack}");
    let report = json_of(&usage(&["reconcile", "--period", "2026-11"]));
    assert_eq!(report["final"], false, "{report}");
    assert!(report["blocking"].to_string().contains("node node-q has not reported"), "{report}");
    let out = usage(&["retire", "--node", "node-q"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(json_of(&out)["retired"]["after"].as_u64(), Some(1));
    let report = json_of(&usage(&["reconcile", "--period", "2026-11"]));
    assert_eq!(report["final"], true, "{report}");
    assert!(report["waived"].to_string().contains("node node-q has not reported"), "{report}");
    assert_eq!(export()[0]["billable"].as_u64(), Some(10), "node-q's held window is not billed");
    q["seq"] = 2.into();
    q["start"] = (DEC + 60).into();
    let (status, body) = post_usage(&cp, Some(NODE_TOKEN), batch(vec![q])).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert!(body.to_string().contains("node_retired"), "{body}");
    assert_eq!(json_of(&usage(&["retire"]))["retired"][0]["node"], "node-q");
    assert_eq!(json_of(&usage(&["retire"]))["retired"][1]["node"], "node-w");
    assert!(!usage(&["retire", "--node", "node-q", "--after", "5"]).status.success(), "retired once");
    let (status, ack) = post_usage(&cp, Some(NODE_TOKEN), batch(vec![window_json(4, DEC + 60, 1)])).await;
    assert_eq!((status, ack["applied"].as_u64()), (StatusCode::OK, Some(1)), "other nodes ship on: {ack}");
}

/// A node that crashed before a month's end and starts again after it: the window it had
/// checkpointed is spooled and sent, the month is complete on the node, and it reports
/// its own counts, which let the reconciler close the month.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_reports_its_own_counts_of_a_month_once_it_is_complete() {
    let Fleet { _pg, _echo, repo: _repo, work, cp } = fleet();
    ctl(&cp, &["publish"]);
    // 2026-12-01T00:00:00Z: the end of November.
    const DEC: u64 = 1_796_083_200;
    let dir = work.path().join("nr");
    let spool = dir.join("usage-spool");
    std::fs::create_dir_all(&spool).unwrap();
    let mut w = window_json(0, DEC - 20, 4);
    w["node"] = "node-r".into();
    std::fs::write(spool.join("open.json"), serde_json::json!({"next": 1, "windows": [w]}).to_string()).unwrap();
    let node = start_node(&cp.url, &dir, "node-r");

    let auth = format!("Bearer {PLATFORM_TOKEN}");
    let url = format!("{}/v1/usage/reconcile?period=2026-11", cp.url);
    let mut report = serde_json::Value::Null;
    wait_for("November to be final", Duration::from_secs(30), async || {
        // Asked before the node's first send, the month is final with no node in it;
        // the recovered window is then held, and the platform applies it (reopening the
        // month until the next ask).
        let held = format!("{}/v1/usage/held/apply?period=2026-11", cp.url);
        send(Method::POST, &held, &[("authorization", &auth)], "").await;
        let r = send(Method::POST, &url, &[("authorization", &auth)], "").await;
        report = serde_json::from_slice(&r.body).unwrap_or_default();
        report["final"] == true && report["nodes"].as_array().is_some_and(|n| !n.is_empty())
    })
    .await;
    assert_eq!(report["billable"].as_u64(), Some(4), "{report}");
    assert_eq!(report["nodes"][0]["node"], "node-r", "{report}");
    assert_eq!((report["nodes"][0]["own_calls"].as_u64(), report["nodes"][0]["calls"].as_u64()), (Some(5), Some(5)));
    let state = spool_state(&node).await;
    assert!(state["counter_reports"].as_u64() >= Some(1), "{state}");
    assert_eq!(state["counters"]["periods"][0]["period"], "2026-11", "{state}");
    assert_eq!(state["counters"]["periods"][0]["reported"], true, "{state}");
    drop(node);
}

/// A window of `node` as a node sends it: `ok` billable calls of key `caller`.
fn forged_window(node: &str, seq: u64, start: u64, caller: &str, ok: u64) -> serde_json::Value {
    let mut latency = vec![0u64; postern_model::usage::LATENCY_BUCKETS];
    latency[0] = ok;
    serde_json::json!({
        "node": node, "seq": seq, "start": start,
        "rows": [{"caller": caller, "kind": "key", "product": "search", "route": "t/search",
                  "status": [0, ok, 0, 0, 0], "latency": latency, "latency_us": 500 * ok}],
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_token_cannot_report_calls_no_node_could_have_counted() {
    no_node_could_have_counted(fleet()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_a_node_token_cannot_report_calls_no_node_could_have_counted() {
    no_node_could_have_counted(fleet_on(Some(PgDb::create()))).await;
}

async fn no_node_could_have_counted(fleet: Fleet) {
    let Fleet { _pg, _echo, repo, work, cp } = fleet;
    repo.write(
        "platform/plans.yaml",
        "scopes: []\nproducts: [search]\nplans:\n  capped: { products: [search], quota: { monthly: 1000, mode: hard } }\n",
    );
    let victim = new_key(repo.path(), "victim", "app1", "acme", "capped", &[]);
    ctl(&cp, &["publish"]);
    let node = start_node(&cp.url, &work.path().join("n0"), "node-0");
    wait_for("the node to take the key", Duration::from_secs(30), async || {
        call(&node, &victim, 200).await == StatusCode::OK
    })
    .await;
    let platform_auth = format!("Bearer {PLATFORM_TOKEN}");
    let read = async |path: &str| get(&format!("{}{path}", cp.url), &[("authorization", &platform_auth)]).await.json();
    let batch = |w: serde_json::Value| serde_json::json!({ "windows": [w] }).to_string();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    let now = now - now % 10;

    // One honest window of a node the token speaks for, then the state to compare with.
    let (status, ack) =
        post_usage(&cp, Some(NODE_TOKEN), batch(forged_window("node-z", 1, now - 30, "victim", 2))).await;
    assert_eq!(status, StatusCode::OK, "{ack}");
    // node-0's own window with the one call above, too: nothing else is on its way.
    wait_for("the calls so far billed", Duration::from_secs(60), async || {
        billed(&cp).get("victim").copied() == Some(3)
    })
    .await;
    let before = (billed(&cp), read("/v1/usage/flags").await, ctl(&cp, &["status"])["credentials"].clone());
    assert_eq!(before.1["over_quota"], serde_json::json!([]), "{}", before.1);

    // The year 10000 with a million calls (what locked a customer out for 8,000 years), a
    // window back-dated behind the node's own, and one numbered far ahead: each refused
    // naming its rule, and none changes a total, a flag or the credentials nodes run.
    for (window, rule) in [
        (forged_window("node-z", 2, 253_402_300_800, "victim", 1_000_000), "future_window"),
        (forged_window("node-z", 2, now - 600, "victim", 1_000_000), "time_order"),
        (forged_window("node-z", 1_000_000, now - 20, "victim", 1_000_000), "seq_gap"),
    ] {
        let (status, body) = post_usage(&cp, Some(NODE_TOKEN), batch(window)).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
        assert!(body["error"].as_str().unwrap_or_default().contains(&format!("({rule})")), "{body}");
    }
    // A row counting more than a node can answer in a window is out of shape.
    let (status, body) =
        post_usage(&cp, Some(NODE_TOKEN), batch(forged_window("node-z", 2, now - 20, "victim", 1 << 40))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(body["error"].as_str().unwrap_or_default().contains("(row_calls)"), "{body}");
    let after = (billed(&cp), read("/v1/usage/flags").await, ctl(&cp, &["status"])["credentials"].clone());
    assert_eq!(after, before, "a refused window changed a total, a flag or the credentials");
    // The victim is served; the refusals are listed per node and rule.
    assert_eq!(call(&node, &victim, 200).await, StatusCode::OK);
    let refusals = read("/v1/usage/refusals").await;
    let counted: Vec<(String, String, u64)> = refusals["refusals"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["node"].as_str().unwrap().to_owned(),
                r["rule"].as_str().unwrap().to_owned(),
                r["count"].as_u64().unwrap(),
            )
        })
        .collect();
    let want: Vec<(String, String, u64)> = ["future_window", "row_calls", "seq_gap", "time_order"]
        .iter()
        .map(|rule| ("node-z".to_owned(), (*rule).to_owned(), 1))
        .collect();
    assert_eq!(counted, want, "{refusals}");
    // The node's own windows are still taken.
    wait_for("the node's windows billed", Duration::from_secs(60), async || {
        billed(&cp).get("victim").copied().unwrap_or(0) > before.0.get("victim").copied().unwrap_or(0)
    })
    .await;

    // Honest use past the hard quota flags the key on every node; the platform lifts
    // the flag (audited) and the key is served again once the lift answers.
    let (status, ack) =
        post_usage(&cp, Some(NODE_TOKEN), batch(forged_window("node-z", 2, now - 20, "victim", 1_000))).await;
    assert_eq!(status, StatusCode::OK, "{ack}");
    wait_for("the key refused over its quota", Duration::from_secs(60), async || {
        call(&node, &victim, 200).await == StatusCode::TOO_MANY_REQUESTS
    })
    .await;
    let flags = read("/v1/usage/flags").await;
    assert_eq!(flags["over_quota"][0]["caller"], "victim", "{flags}");
    let lift = ctl(&cp, &["usage", "lift", "--key", "victim"]);
    assert_eq!(lift["lifted"][0]["caller"], "victim", "{lift}");
    assert_eq!(lift["credentials"]["acked"], serde_json::json!(["node-0"]), "{lift}");
    assert_eq!(call(&node, &victim, 200).await, StatusCode::OK);
    assert_eq!(read("/v1/usage/flags").await["over_quota"], serde_json::json!([]));
    let audit = read("/v1/audit").await;
    let last = audit.as_array().unwrap().last().unwrap().clone();
    assert_eq!((last["action"].as_str(), last["who"].as_str()), (Some("quota-lift"), Some("alice")), "{last}");
    // Lifting what is not flagged says so.
    let out = Command::new(bin("posternctl"))
        .args(["usage", "lift", "--key", "victim", "--control", &cp.url, "--token", PLATFORM_TOKEN])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("no live over-quota flag"), "{out:?}");
}

/// A window the usage stream refuses for good (its number was applied before with other
/// contents: another process spoke as this node) is an alert, not an endless retry: the
/// node parks it beside its spool, counts it, and ships the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_refused_for_good_is_parked_and_the_rest_ships_on() {
    let Fleet { _pg, _echo, repo, work, cp } = fleet();
    let k1 = new_key(repo.path(), "k1", "app1", "acme", "gold", &[]);
    ctl(&cp, &["publish"]);
    // Number 1 of node-p is taken before the node sends anything.
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    let forged = serde_json::json!({ "windows": [forged_window("node-p", 1, now - now % 10 - 600, "k1", 5)] });
    assert_eq!(post_usage(&cp, Some(NODE_TOKEN), forged.to_string()).await.0, StatusCode::OK);

    let dir = work.path().join("np");
    let node = start_node(&cp.url, &dir, "node-p");
    wait_for("the node to take the keys", Duration::from_secs(10), async || {
        call(&node, &k1, 200).await == StatusCode::OK
    })
    .await;
    wait_for("window 1 to be parked", Duration::from_secs(40), async || {
        spool_state(&node).await["parked"].as_u64() == Some(1)
    })
    .await;
    let parked: Vec<_> =
        std::fs::read_dir(dir.join("usage-spool/parked")).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(parked.len(), 1, "{parked:?}");
    let w: serde_json::Value = serde_json::from_slice(&std::fs::read(&parked[0]).unwrap()).unwrap();
    assert_eq!((w["node"].as_str(), w["seq"].as_u64()), (Some("node-p"), Some(1)), "{w}");
    // The node's later windows ship on.
    let mut sent = 0u64;
    wait_for("window 2 to be shipped", Duration::from_secs(40), async || {
        if call(&node, &k1, 200).await == StatusCode::OK {
            sent += 1;
        }
        let state = spool_state(&node).await;
        state["acked"].as_u64() >= Some(2) && state["shipped"].as_u64() >= Some(1)
    })
    .await;
    assert!(sent > 0);
    assert!(store_node(&cp, "node-p").await["last_seq"].as_u64() >= Some(2));
    let m = String::from_utf8(get(&node.admin_url("/metrics"), &[]).await.body.to_vec()).unwrap();
    assert!(m.lines().any(|l| l == "postern_usage_windows_parked_total 1"), "{m}");
    drop(node);
}

/// Once the control plane knows the nodes' usage keys, a node's usage counts only signed
/// by its own key: a genuine node ships and is billed; a batch for it unsigned, signed by
/// another key or mixing nodes is refused 403 by rule `usage_signature`, counted for the
/// node it names, and changes no total.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_node_keys_only_a_nodes_own_signature_speaks_for_it() {
    use postern_model::sign::Signer;
    let keys_dir = tempfile::tempdir().unwrap();
    let (own, other) = (Signer::generate().unwrap(), Signer::generate().unwrap());
    let key_file = keys_dir.path().join("node-s.key");
    std::fs::write(&key_file, own.to_text()).unwrap();
    let keys = keys_dir.path().join("node-keys.json");
    std::fs::write(&keys, serde_json::json!({ "node-s": own.public().to_string() }).to_string()).unwrap();
    let Fleet { _pg, _echo, repo, work, cp } = fleet_with(None, &["--usage-node-keys", keys.to_str().unwrap()]);
    let k1 = new_key(repo.path(), "k1", "app1", "acme", "gold", &[]);
    ctl(&cp, &["publish"]);
    let mut node = start_node_with(
        &cp.url,
        &work.path().join("ns"),
        "node-s",
        &["--usage-signing-key", key_file.to_str().unwrap()],
    );
    wait_for("the node to take the keys", Duration::from_secs(10), async || {
        call(&node, &k1, 200).await == StatusCode::OK
    })
    .await;
    let mut seen = 1u64;
    for _ in 0..9 {
        assert_eq!(call(&node, &k1, 200).await, StatusCode::OK);
        seen += 1;
    }
    node.proc.signal(15);
    let end = Instant::now() + Duration::from_secs(30);
    while node.proc.alive() {
        assert!(Instant::now() < end, "the node did not stop:\n{}", node.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    wait_store_has(&cp, "node-s", numbered(&work.path().join("ns/usage-spool"))).await;
    assert_eq!(billed(&cp).get("k1"), Some(&seen), "the signed node is billed exactly");

    // Forged batches for node-s, with the fleet's node token: none is taken.
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    let body = |node: &str| {
        serde_json::json!({ "windows": [forged_window(node, 90, now - now % 10, "k1", 1000)] }).to_string()
    };
    let sign = |s: &Signer, node: &str, bytes: &str| postern_usage::sign_usage(s, node, bytes.as_bytes());
    let auth = format!("Bearer {NODE_TOKEN}");
    let url = format!("{}/v1/usage", cp.url);
    let forged = body("node-s");
    let mut mixed: serde_json::Value = serde_json::from_str(&body("node-s")).unwrap();
    mixed["windows"].as_array_mut().unwrap().push(forged_window("node-z", 1, now - now % 10, "k1", 1000));
    let mixed = mixed.to_string();
    for (what, bytes, sig) in [
        ("unsigned", forged.clone(), None),
        ("signed by another key", forged.clone(), Some(sign(&other, "node-s", &forged))),
        ("signed for other bytes", forged.clone(), Some(sign(&own, "node-s", &body("node-z")))),
        ("a node with no key", body("node-z"), Some(sign(&own, "node-z", &body("node-z")))),
        ("two nodes in one batch", mixed.clone(), Some(sign(&own, "node-s", &mixed))),
    ] {
        let mut headers = vec![("authorization", auth.as_str())];
        if let Some(sig) = &sig {
            headers.push((postern_model::usage::SIGNATURE_HEADER, sig.as_str()));
        }
        let r = send(Method::POST, &url, &headers, bytes).await;
        assert_eq!(r.status, StatusCode::FORBIDDEN, "{what}: {}", String::from_utf8_lossy(&r.body));
        assert!(String::from_utf8_lossy(&r.body).contains("usage_signature"), "{what}");
    }
    assert_eq!(billed(&cp).get("k1"), Some(&seen), "no forged call billed");
    let refusals =
        get(&format!("{}/v1/usage/refusals", cp.url), &[("authorization", &format!("Bearer {PLATFORM_TOKEN}"))])
            .await
            .json();
    let count = |node: &str| {
        refusals["refusals"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["node"] == node && r["rule"] == "usage_signature")
            .map(|r| r["count"].as_u64().unwrap())
    };
    assert_eq!((count("node-s"), count("node-z")), (Some(4), Some(1)), "{refusals}");
    drop((node, cp));
}

/// `posternctl routes --advice`: a route whose response timeout is far above what its
/// answers took is named with the p99.9 it was judged by; a route with no metered answers
/// gets none; a team's token reads its own routes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_far_above_the_observed_latency_is_advised_on() {
    let Fleet { _pg, _echo, repo: _repo, work: _work, cp } = fleet();
    ctl(&cp, &["publish"]);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    // 300 answers of t/search (5 s response timeout), every one under 1 ms, as a node
    // reports them.
    let batch = serde_json::json!({ "windows": [window_json(1, now / 10 * 10 - 20, 299)] }).to_string();
    let (status, ack) = post_usage(&cp, Some(NODE_TOKEN), batch).await;
    assert_eq!((status, ack["applied"].as_u64()), (StatusCode::OK, Some(1)), "{ack}");

    let routes = |token: &str, args: &[&str]| {
        let out = Command::new(bin("posternctl"))
            .arg("routes")
            .args(args)
            .args(["--control", &cp.url, "--token", token])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let answer: serde_json::Value = serde_json::from_str(&routes(PLATFORM_TOKEN, &["--json"])).unwrap();
    let route = |id: &str| answer["routes"].as_array().unwrap().iter().find(|r| r["route"] == id).cloned().unwrap();
    let search = route("t/search");
    assert_eq!(
        (search["timeout_ms"].as_u64(), search["calls"].as_u64(), search["p999_ms"].as_u64()),
        (Some(5000), Some(300), Some(1)),
        "{answer}"
    );
    assert!(search["advice"].as_str().unwrap().contains("5000x the p99.9 of 300 answers"), "{search}");
    let open = route("t/open");
    assert_eq!((open["calls"].as_u64(), open["advice"].is_null()), (Some(0), true), "{open}");
    // The table with --advice: the advised route only.
    let table = routes(PLATFORM_TOKEN, &["--advice"]);
    assert!(table.contains("t/search") && table.contains("<= 1 ms") && !table.contains("t/open"), "{table}");
    // A publish says it too, on stderr (its answer on stdout is unchanged).
    let out = Command::new(bin("posternctl"))
        .args(["publish", "--control", &cp.url, "--token", PLATFORM_TOKEN])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && err.contains("advice: t/search: the response timeout (5000 ms)"), "{err}");
    assert!(!err.contains("t/open"), "{err}");
    // Team t reads its routes; a bad range is refused.
    assert!(routes(TEAM_T_TOKEN, &["--advice"]).contains("t/search"));
    let out = Command::new(bin("posternctl"))
        .args(["routes", "--last", "a week", "--control", &cp.url, "--token", PLATFORM_TOKEN])
        .output()
        .unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stdout).contains("last:"), "{out:?}");
}
