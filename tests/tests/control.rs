//! The control plane with a fleet: `posternctl serve` and three `postern` nodes on
//! ephemeral ports. Nodes boot from the control plane, follow every published version,
//! ACK it (status says who is on what), apply a rollback, get a new API key before the
//! publish returns, stop honouring a revoked key within a second, keep serving when the
//! control plane dies, and boot from disk without it. A staged rollout gives a change
//! to the canary first and reverts one that makes its route fail. The same store
//! behaviour runs on PostgreSQL.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use http::StatusCode;
use postern_e2e::control_plane::*;
use postern_e2e::{Echo, Node, Repo, bin, get, new_key, platform};

fn routes(tag: &str, extra_route: bool) -> String {
    let mut s = format!(
        "routes:\n  - name: r\n    public: true\n    match: {{ path: {{ value: /r }} }}\n    backendRefs: [{{ name: e }}]\n    timeouts: {{ connect: 1s, response: 5s }}\n    responseHeaders:\n      set: [{{ name: x-tag, value: \"{tag}\" }}]\n  - name: keyed\n    match: {{ path: {{ value: /keyed }} }}\n    auth: {{ methods: [apiKey], product: orders }}\n    backendRefs: [{{ name: e }}]\n    timeouts: {{ connect: 1s, response: 5s }}\n"
    );
    if extra_route {
        s.push_str("  - name: extra\n    public: true\n    match: { path: { value: /extra } }\n    backendRefs: [{ name: e }]\n    timeouts: { connect: 1s, response: 5s }\n");
    }
    s
}

struct Setup {
    _echo: Echo,
    repo: Repo,
    work: tempfile::TempDir,
    tokens: std::path::PathBuf,
}

/// A repository with one public and one keyed route, and a token list.
fn setup() -> Setup {
    let echo = Echo::start("e");
    let repo = Repo::new();
    platform(&repo, &[("e", &echo.addr())]);
    plans(&repo);
    repo.write("teams/t/routes.yaml", &routes("one", false));
    let work = tempfile::tempdir().unwrap();
    let tokens = write_tokens(work.path());
    Setup { _echo: echo, repo, work, tokens }
}

fn plans(repo: &Repo) {
    repo.write("platform/plans.yaml", "scopes: []\nproducts: [orders]\nplans:\n  gold: { products: [orders] }\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_follows_publishes_rollbacks_and_the_fast_lane_and_outlives_its_control_plane() {
    let Setup { _echo, repo, work, tokens } = setup();
    let store = work.path().join("store");
    // Unstaged: every version goes to every node at once (staging has its own test).
    let cp = serve(repo.path(), store.to_str().unwrap(), &tokens, &["--dwell", "0s"]);

    let v = ctl(&cp, &["publish"]);
    assert_eq!(v["snapshot"]["version"], 1);

    // Three nodes boot from the control plane (nothing on disk).
    let mut nodes: Vec<Node> =
        (0..3).map(|i| start_node(&cp.url, &work.path().join(format!("n{i}")), &format!("node-{i}"))).collect();
    for n in &nodes {
        let r = get(&n.url("/r"), &[]).await;
        assert_eq!(r.header("x-tag"), Some("one"));
    }
    wait_for("every node ACKing v1", Duration::from_secs(10), async || ctl(&cp, &["status"])["nodes_on_snapshot"] == 3)
        .await;

    // A change reaches every node; the publish answers once they serve it, status says so.
    repo.write("teams/t/routes.yaml", &routes("two", true));
    let v = ctl(&cp, &["publish"]);
    assert_eq!((v["snapshot"]["version"].as_u64(), v["snapshot"]["changed"].as_bool()), (Some(2), Some(true)));
    assert_eq!(v["snapshot"]["served"]["serving"], serde_json::json!(["node-0", "node-1", "node-2"]), "{v}");
    assert_eq!(v["summary"], "v2 published: served by every live node (node-0, node-1, node-2)");
    for n in &nodes {
        n.wait_version(2).await;
        assert_eq!(get(&n.url("/extra"), &[]).await.status, StatusCode::OK);
    }
    wait_for("status to show 3 of 3 on v2", Duration::from_secs(10), async || {
        ctl(&cp, &["status"])["summary"].as_str().is_some_and(|s| s.starts_with("3 of 3 nodes on v2"))
    })
    .await;
    // Publishing the same contents makes no version.
    assert_eq!(ctl(&cp, &["publish"])["snapshot"]["changed"], false);
    // A change that fails validation is refused, and v2 stays published.
    repo.write("teams/t/broken.yaml", "routes:\n  - name: nope\n    match: { path: { value: /nope } }\n");
    let out = Command::new(bin("posternctl"))
        .args(["publish", "--control", &cp.url, "--token", PLATFORM_TOKEN])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("teams/t/broken.yaml"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    std::fs::remove_file(repo.path().join("teams/t/broken.yaml")).unwrap();

    // Rollback: v1's contents as v3, on every node at once; it answers once they serve it.
    let v = ctl(&cp, &["rollback", "--to", "1"]);
    assert_eq!(v["snapshot"]["version"], 3);
    assert_eq!(v["snapshot"]["served"]["complete"], true, "{v}");
    for n in &nodes {
        assert_eq!(n.version().await, 3);
        assert_eq!(get(&n.url("/r"), &[]).await.header("x-tag"), Some("one"));
        assert_eq!(get(&n.url("/extra"), &[]).await.status, StatusCode::NOT_FOUND);
    }

    // Fast lane: a new key is usable on every node once the publish returns.
    let key = new_key(repo.path(), "k1", "app", "acme", "gold", &[]);
    // The repository now holds the v2 routes again; publish them with the key.
    let v = ctl(&cp, &["publish", "--wait-acks", "5"]);
    assert_eq!(v["credentials"]["stale"].as_array().map(Vec::len), Some(0), "{v}");
    assert_eq!(v["credentials"]["acked"].as_array().map(Vec::len), Some(3), "{v}");
    for n in &nodes {
        let r = get(&n.url("/keyed"), &[("x-api-key", &key)]).await;
        assert_eq!(r.status, StatusCode::OK, "first request with the new key");
    }
    // Revocation: once the publish has every node's ACK, every node refuses the key.
    let revoke =
        Command::new(bin("posternctl")).args(["key", "revoke"]).arg(repo.path()).args(["--id", "k1"]).output().unwrap();
    assert!(revoke.status.success(), "{}", String::from_utf8_lossy(&revoke.stderr));
    let t = Instant::now();
    let v = ctl(&cp, &["publish", "--wait-acks", "30"]);
    assert_eq!(v["credentials"]["acked"].as_array().map(Vec::len), Some(3), "{v}");
    for n in &nodes {
        assert_eq!(get(&n.url("/keyed"), &[("x-api-key", &key)]).await.status, StatusCode::UNAUTHORIZED);
    }
    eprintln!("revocation applied on 3 nodes {} ms after publishing began", t.elapsed().as_millis());

    // Every ACK is in: the status names no laggard.
    let status = ctl(&cp, &["status"]);
    assert_eq!(status["live_nodes"], 3);
    assert_eq!(status["laggards"].as_array().map(Vec::len), Some(0), "{status}");

    // The key service: a key created through the control plane is returned once every
    // live node has it, so its first request works everywhere; revoking it by its raw
    // value (a reported leak) takes effect on every node before the command returns.
    let remote = ["--control", cp.url.as_str(), "--token", PLATFORM_TOKEN];
    let out = Command::new(bin("posternctl"))
        .args(["key", "new", "--id", "k2", "--app", "app2", "--tenant", "acme", "--plan", "gold"])
        .args(remote)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let k2 = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    assert!(k2.starts_with("ak_live_"), "{k2}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("applied on 3 node(s)"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for n in &nodes {
        assert_eq!(get(&n.url("/keyed"), &[("x-api-key", &k2)]).await.status, StatusCode::OK);
    }
    let keys_file = std::fs::read_to_string(repo.path().join("platform/keys.jsonl")).unwrap();
    assert!(!keys_file.contains(&k2), "only the key's hash is stored");
    let t = Instant::now();
    let out = Command::new(bin("posternctl")).args(["key", "revoke", "--key", &k2]).args(remote).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let took = t.elapsed();
    for n in &nodes {
        assert_eq!(get(&n.url("/keyed"), &[("x-api-key", &k2)]).await.status, StatusCode::UNAUTHORIZED);
    }
    eprintln!("key revoked on 3 nodes {} ms after the command started", took.as_millis());
    // A refused change (unknown plan) says why and changes nothing.
    let out = Command::new(bin("posternctl"))
        .args(["key", "new", "--id", "k3", "--app", "a", "--tenant", "acme", "--plan", "platinum"])
        .args(remote)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("platinum"), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!std::fs::read_to_string(repo.path().join("platform/keys.jsonl")).unwrap().contains("\"k3\""));
    // Token revocations: a user's tokens issued before now, on every node.
    let out =
        Command::new(bin("posternctl")).args(["token", "revoke", "--sub", "alice"]).args(remote).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let entry: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(entry["sub"], "alice");
    assert!(String::from_utf8_lossy(&out.stderr).contains("applied on 3 node(s)"));
    let platform_auth = format!("Bearer {PLATFORM_TOKEN}");
    let audit = get(&format!("{}/v1/audit", cp.url), &[("authorization", &platform_auth)]).await.json();
    let actions: Vec<&str> = audit.as_array().unwrap().iter().filter_map(|e| e["action"].as_str()).collect();
    assert!(actions.ends_with(&["key-create", "key-revoke", "token-revoke"]), "{actions:?}");
    let audit_text = audit.to_string();
    assert!(!audit_text.contains(&k2), "the audit trail never holds a key");
    // Those changes travelled as deltas (a copy of the key index, not a reload); one more
    // key, kept active, shows below that a restarted node replays them from disk.
    let out = Command::new(bin("posternctl"))
        .args(["key", "new", "--id", "k4", "--app", "app4", "--tenant", "acme", "--plan", "gold"])
        .args(remote)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let k4 = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    for n in &nodes {
        assert!(n.log().contains("credentials live (delta)"), "{}", n.log());
        assert_eq!(get(&n.url("/keyed"), &[("x-api-key", &k4)]).await.status, StatusCode::OK);
    }
    let creds_version = get(&nodes[0].admin_url("/readyz"), &[]).await.json()["credentials"]["version"].clone();

    // The control plane dies: traffic is unaffected.
    drop(cp);
    for n in &nodes {
        for _ in 0..20 {
            assert_eq!(get(&n.url("/r"), &[]).await.status, StatusCode::OK);
        }
    }
    // A node restarted without it serves what it last accepted, from disk.
    let version = nodes[0].version().await;
    drop(nodes.remove(0));
    let n = start_node("http://127.0.0.1:9", &work.path().join("n0"), "node-0");
    assert_eq!(n.version().await, version);
    assert_eq!(get(&n.url("/extra"), &[]).await.status, StatusCode::OK);
    assert_eq!(get(&n.url("/keyed"), &[("x-api-key", &key)]).await.status, StatusCode::UNAUTHORIZED);
    // The credentials file plus the delta log on disk: the same state as before.
    assert_eq!(get(&n.admin_url("/readyz"), &[]).await.json()["credentials"]["version"], creds_version);
    assert_eq!(get(&n.url("/keyed"), &[("x-api-key", &k4)]).await.status, StatusCode::OK);
    assert_eq!(get(&n.url("/keyed"), &[("x-api-key", &k2)]).await.status, StatusCode::UNAUTHORIZED);
    assert!(!n.log().contains("stopped replaying"), "{}", n.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_and_roles_guard_the_api() {
    let Setup { _echo, repo, work, tokens } = setup();
    let cp = serve(repo.path(), work.path().join("store").to_str().unwrap(), &tokens, &[]);
    let url = |p: &str| format!("{}{p}", cp.url);
    assert_eq!(
        postern_e2e::send(http::Method::POST, &url("/v1/publish"), &[], "").await.status,
        StatusCode::UNAUTHORIZED
    );
    let bad = format!("Bearer {}", "wrong");
    assert_eq!(
        postern_e2e::send(http::Method::POST, &url("/v1/publish"), &[("authorization", &bad)], "").await.status,
        StatusCode::UNAUTHORIZED
    );
    let node = format!("Bearer {NODE_TOKEN}");
    let r = postern_e2e::send(http::Method::POST, &url("/v1/publish"), &[("authorization", &node)], "").await;
    assert_eq!(r.status, StatusCode::FORBIDDEN, "a node may not publish");
    let platform_auth = format!("Bearer {PLATFORM_TOKEN}");
    let r = postern_e2e::send(http::Method::POST, &url("/v1/publish"), &[("authorization", &platform_auth)], "").await;
    assert_eq!(r.status, StatusCode::OK);
    let audit = get(&url("/v1/audit"), &[("authorization", &platform_auth)]).await.json();
    let entries = audit.as_array().unwrap();
    assert_eq!(entries.len(), 2, "{audit}");
    assert_eq!(entries[0]["who"], "alice");
    assert_eq!(entries[0]["action"], "publish");

    // A team publishes its own routes, and nothing else.
    let publish_as = async |token: &str| {
        let auth = format!("Bearer {token}");
        postern_e2e::send(http::Method::POST, &url("/v1/publish"), &[("authorization", &auth)], "").await
    };
    repo.write("teams/t/routes.yaml", &routes("two", true));
    let r = publish_as(TEAM_X_TOKEN).await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    let errors = r.json()["errors"].to_string();
    assert!(errors.contains("added t/extra belongs to t") && errors.contains("changed t/r belongs to t"), "{errors}");
    let r = publish_as(TEAM_T_TOKEN).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json());
    assert_eq!(r.json()["snapshot"]["version"], 2);
    // A platform file changed in the repository: the team may not publish it.
    repo.write(
        "platform/plans.yaml",
        "scopes: []\nproducts: [orders]\nplans:\n  gold: { products: [orders] }\n  silver: { products: [orders] }\n",
    );
    let r = publish_as(TEAM_T_TOKEN).await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    assert!(r.json()["errors"].to_string().contains("plan silver belongs to platform"), "{}", r.json());
    let audit = get(&url("/v1/audit"), &[("authorization", &platform_auth)]).await.json();
    assert_eq!(audit.as_array().unwrap().last().unwrap()["who"], "bob");
    // A team reads only its own tokens' part of the audit trail.
    let auth = format!("Bearer {TEAM_T_TOKEN}");
    let ours = get(&url("/v1/audit"), &[("authorization", &auth)]).await.json();
    let whos: Vec<&str> = ours.as_array().unwrap().iter().filter_map(|e| e["who"].as_str()).collect();
    assert!(!whos.is_empty() && whos.iter().all(|w| *w == "bob"), "{ours}");
    let theirs = get(&url("/v1/audit"), &[("authorization", &format!("Bearer {TEAM_X_TOKEN}"))]).await.json();
    assert_eq!(theirs.as_array().map(Vec::len), Some(0), "{theirs}");
    // Teams never roll back or manage keys.
    let r = postern_e2e::send(http::Method::POST, &url("/v1/rollback?to=1"), &[("authorization", &auth)], "").await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    let r = postern_e2e::send(http::Method::POST, &url("/v1/keys/revoke"), &[("authorization", &auth)], "{}").await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_postgres_store_numbers_versions_and_never_reuses_them() {
    // A database of the test's own on the PostgreSQL at 127.0.0.1:5432.
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
    let db = format!("postern_test_{}_{nanos}", std::process::id());
    let psql = |sql: &str| {
        let out =
            Command::new("psql").args(["-h", "127.0.0.1", "-U", "postgres", "-d", "postgres", "-c", sql]).output();
        assert!(out.as_ref().is_ok_and(|o| o.status.success()), "psql {sql}: {out:?}");
    };
    psql(&format!("CREATE DATABASE {db}"));
    let store = format!("postgres://postgres@127.0.0.1:5432/{db}");

    let Setup { _echo, repo, work, tokens } = setup();
    {
        let cp = serve(repo.path(), &store, &tokens, &[]);
        assert_eq!(ctl(&cp, &["publish"])["snapshot"]["version"], 1);
        repo.write("teams/t/routes.yaml", &routes("two", false));
        assert_eq!(ctl(&cp, &["publish"])["snapshot"]["version"], 2);
        let n = start_node(&cp.url, &work.path().join("n"), "pg-node");
        assert_eq!(get(&n.url("/r"), &[]).await.header("x-tag"), Some("two"));
        assert_eq!(ctl(&cp, &["rollback", "--to", "1"])["snapshot"]["version"], 3);
        n.wait_version(3).await;
        assert_eq!(get(&n.url("/r"), &[]).await.header("x-tag"), Some("one"));
    }
    // A second instance on the same database continues the numbering.
    let cp = serve(repo.path(), &store, &tokens, &[]);
    assert_eq!(ctl(&cp, &["publish"])["snapshot"]["version"], 4, "the repository's v2 contents, as v4");
    drop(cp);
    psql(&format!("DROP DATABASE {db} WITH (FORCE)"));
}

/// Every node's snapshot version, as the control plane's status sees it, sampled until
/// `until` holds; returns each sample.
async fn watch_rollout(
    cp: &ControlPlane,
    deadline: Duration,
    until: impl Fn(&serde_json::Value) -> bool,
) -> Vec<std::collections::BTreeMap<String, u64>> {
    let mut samples = Vec::new();
    let end = Instant::now() + deadline;
    loop {
        let status = ctl(cp, &["status"]);
        let versions = status["nodes"]
            .as_object()
            .map(|m| m.iter().map(|(k, v)| (k.clone(), v["snapshot"]["version"].as_u64().unwrap_or(0))).collect())
            .unwrap_or_default();
        samples.push(versions);
        if until(&status) {
            return samples;
        }
        assert!(Instant::now() < end, "rollout did not finish: {status}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_staged_rollout_goes_canary_first_and_a_change_that_fails_is_reverted() {
    let Setup { _echo, repo, work, tokens } = setup();
    // A cluster whose only endpoint refuses connections: routes sent there answer 502.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let echo_addr = _echo.addr();
    platform(&repo, &[("e", &echo_addr), ("dead", &dead)]);
    let store = work.path().join("store");
    // p99 is not what this test is about: one slow request on a loaded CI machine must not
    // revert the harmless change.
    let flags = ["--dwell", "2s", "--rollout-min-requests", "20", "--rollout-p99-slack", "10s"];
    let cp = serve(repo.path(), store.to_str().unwrap(), &tokens, &flags);
    assert_eq!(ctl(&cp, &["publish"])["snapshot"]["version"], 1);
    let nodes: Vec<Node> =
        (0..3).map(|i| start_node(&cp.url, &work.path().join(format!("n{i}")), &format!("node-{i}"))).collect();
    wait_for("every node on v1", Duration::from_secs(10), async || ctl(&cp, &["status"])["nodes_on_snapshot"] == 3)
        .await;

    // Steady traffic on /r through every node for the rest of the test.
    let urls: Vec<String> = nodes.iter().map(|n| n.url("/r")).collect();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let traffic = {
        let stop = stop.clone();
        tokio::spawn(async move {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for u in &urls {
                    get(u, &[]).await;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };

    // A harmless change: the canary (node-0) first, alone for the dwell, then everyone.
    repo.write("teams/t/routes.yaml", &routes("two", false));
    let t = Instant::now();
    let v = ctl(&cp, &["publish"]);
    assert_eq!(v["snapshot"]["version"], 2);
    assert_eq!(v["rollout"]["stage"], "canary", "{v}");
    assert_eq!(v["rollout"]["stage_nodes"], serde_json::json!([1, 3]));
    assert_eq!(v["rollout"]["routes"], serde_json::json!(["t/r"]), "only the changed route is compared");
    // The publish answers once the canary serves v2, and only the canary.
    assert_eq!(v["snapshot"]["served"]["serving"], serde_json::json!(["node-0"]), "{v}");
    assert!(v["summary"].as_str().unwrap().starts_with("v2 published: served by node-0 (the first stage)"), "{v}");
    let samples = watch_rollout(&cp, Duration::from_secs(30), |s| s["last_rollout"]["outcome"] == "done").await;
    let canary_alone = samples.iter().filter(|s| s["node-0"] == 2 && s["node-1"] == 1 && s["node-2"] == 1).count();
    assert!(canary_alone > 0, "node-0 never ran v2 alone: {samples:?}");
    assert!(
        !samples.iter().any(|s| s["node-0"] == 1 && (s["node-1"] == 2 || s["node-2"] == 2)),
        "a node got v2 before the canary"
    );
    assert!(t.elapsed() >= Duration::from_secs(4), "two dwells of 2 s took {:?}", t.elapsed());
    for n in &nodes {
        assert_eq!(get(&n.url("/r"), &[]).await.header("x-tag"), Some("two"));
    }
    let status = ctl(&cp, &["status"]);
    assert!(status["summary"].as_str().unwrap().starts_with("3 of 3 nodes on v2"), "{status}");

    // A change that breaks /r (its cluster refuses connections): the canary's 5xx rate
    // on /r is compared with the others', and the old contents come back as v4.
    repo.write(
        "teams/t/routes.yaml",
        &routes("two", false).replacen("backendRefs: [{ name: e }]", "backendRefs: [{ name: dead }]", 1),
    );
    let v = ctl(&cp, &["publish"]);
    assert_eq!(v["snapshot"]["version"], 3);
    let samples = watch_rollout(&cp, Duration::from_secs(30), |s| s["last_rollout"]["outcome"] == "reverted").await;
    let status = ctl(&cp, &["status"]);
    let reason = status["last_rollout"]["reason"].as_str().unwrap().to_owned();
    assert!(reason.starts_with("route t/r: 5xx 100.0 % on v3"), "{reason}");
    assert_eq!(status["last_rollout"]["revert_version"], 4);
    assert!(samples.iter().any(|s| s["node-0"] == 3), "the canary ran v3");
    assert!(!samples.iter().any(|s| s["node-1"] == 3 || s["node-2"] == 3), "only the canary ran v3: {samples:?}");
    for n in &nodes {
        n.wait_version(4).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    traffic.await.unwrap();
    for n in &nodes {
        let r = get(&n.url("/r"), &[]).await;
        assert_eq!((r.status, r.header("x-tag")), (StatusCode::OK, Some("two")));
    }
    // The audit trail says who did what.
    let platform_auth = format!("Bearer {PLATFORM_TOKEN}");
    let audit = get(&format!("{}/v1/audit", cp.url), &[("authorization", &platform_auth)]).await.json();
    let last = audit.as_array().unwrap().last().unwrap().clone();
    assert_eq!((last["action"].as_str(), last["who"].as_str()), (Some("auto-revert"), Some("rollout")), "{last}");
    assert!(last["note"].as_str().unwrap().contains("v3 reverted to the contents of v2"), "{last}");

    // A publish while a rollout runs is refused; a rollback ends the rollout at once.
    repo.write("teams/t/routes.yaml", &routes("three", false));
    assert_eq!(ctl(&cp, &["publish"])["snapshot"]["version"], 5);
    repo.write("teams/t/routes.yaml", &routes("four", false));
    let out = Command::new(bin("posternctl"))
        .args(["publish", "--control", &cp.url, "--token", PLATFORM_TOKEN])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("v5 is rolling out"), "{text}");
    assert_eq!(ctl(&cp, &["rollback", "--to", "2"])["snapshot"]["version"], 6);
    for n in &nodes {
        n.wait_version(6).await;
    }
    assert_eq!(ctl(&cp, &["status"])["last_rollout"]["outcome"], "rolled_back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_client_cannot_hold_the_control_plane() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Setup { _echo, repo, work, tokens } = setup();
    let cp = serve(repo.path(), work.path().join("store").to_str().unwrap(), &tokens, &[]);
    let addr = cp.url.trim_start_matches("http://").to_owned();
    // Half a request head, then nothing: closed by the header timeout (10 s).
    let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
    s.write_all(b"GET /v1/status HTTP/1.1\r\nhost: x\r\n").await.unwrap();
    let mut buf = Vec::new();
    let t = std::time::Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(15), s.read_to_end(&mut buf)).await;
    assert!(r.is_ok(), "the half-sent request held its connection for 15 s");
    assert!(t.elapsed() >= Duration::from_secs(9), "closed after {:?}", t.elapsed());
    // A body over 64 KiB is refused.
    let auth = format!("Bearer {PLATFORM_TOKEN}");
    let big = "x".repeat(100 * 1024);
    let r =
        postern_e2e::send(http::Method::POST, &format!("{}/v1/keys", cp.url), &[("authorization", &auth)], big).await;
    assert!(r.status.is_client_error(), "{}", r.status);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_token_bound_to_a_node_speaks_only_for_it() {
    let Setup { _echo, repo, work, tokens } = setup();
    let cp = serve(repo.path(), work.path().join("store").to_str().unwrap(), &tokens, &[]);
    let platform_auth = format!("Bearer {PLATFORM_TOKEN}");
    let r = postern_e2e::send(
        http::Method::POST,
        &format!("{}/v1/publish", cp.url),
        &[("authorization", &platform_auth)],
        "",
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    let auth = format!("Bearer {NODE_A_TOKEN}");
    let ack = r#"{"version": 1, "ok": false, "error": "forged", "running": 0}"#;
    // For itself: polls and ACKs are taken.
    let r = get(&format!("{}/v1/nodes/node-a/snapshot?have=0&wait=0", cp.url), &[("authorization", &auth)]).await;
    assert_eq!(r.status, StatusCode::OK);
    let r = postern_e2e::send(
        http::Method::POST,
        &format!("{}/v1/nodes/node-a/snapshot/ack", cp.url),
        &[("authorization", &auth)],
        ack,
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    // For another node: refused, and nothing is recorded for it.
    for (method, path, body) in [
        (http::Method::GET, "/v1/nodes/node-b/snapshot?have=0&wait=0", ""),
        (http::Method::POST, "/v1/nodes/node-b/snapshot/ack", ack),
        (http::Method::POST, "/v1/nodes/node-b/report", r#"{"snapshot": 1, "routes": {}}"#),
    ] {
        let r = postern_e2e::send(method, &format!("{}{path}", cp.url), &[("authorization", &auth)], body).await;
        assert_eq!(r.status, StatusCode::FORBIDDEN, "{path}");
    }
    let status = get(&format!("{}/v1/status", cp.url), &[("authorization", &platform_auth)]).await.json();
    assert!(status["nodes"].get("node-a").is_some() && status["nodes"].get("node-b").is_none(), "{status}");
}

/// The credential lines a node logged for `version`: `(delta, apps=N)` of each.
fn credentials_lines(node: &Node, version: u64) -> Vec<(bool, String)> {
    node.log()
        .lines()
        .filter(|l| l.contains("credentials live") && l.contains(&format!("version={version}")))
        .map(|l| {
            (l.contains("(delta)"), l.split_whitespace().find(|w| w.starts_with("apps=")).unwrap_or("").to_owned())
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delta_never_leaves_a_node_unlike_the_whole_version() {
    let Setup { _echo, repo, work, tokens } = setup();
    let cp = serve(repo.path(), work.path().join("store").to_str().unwrap(), &tokens, &["--dwell", "0s"]);
    let platform_auth = format!("Bearer {PLATFORM_TOKEN}");
    let r = postern_e2e::send(
        http::Method::POST,
        &format!("{}/v1/publish", cp.url),
        &[("authorization", &platform_auth)],
        "",
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    let node = start_node(&cp.url, &work.path().join("n0"), "node-0");
    let remote = ["--control", cp.url.as_str(), "--token", PLATFORM_TOKEN];
    let new_key = |id: &str| {
        let out = Command::new(bin("posternctl"))
            .args(["key", "new", "--id", id, "--app", "app-k", "--tenant", "acme", "--plan", "gold"])
            .args(remote)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    };
    let version =
        async || get(&node.admin_url("/readyz"), &[]).await.json()["credentials"]["version"].as_u64().unwrap_or(0);

    // A key alone: the node takes it as a delta.
    new_key("k-delta");
    let v = version().await;
    wait_for("the delta", Duration::from_secs(10), async || !credentials_lines(&node, v).is_empty()).await;
    assert!(credentials_lines(&node, v).iter().all(|(delta, _)| *delta), "{}", node.log());

    // auth.yaml changed in the repository (an app added), then a key: the new version
    // holds both, so the node must get it whole, and run the app too.
    let auth = std::fs::read_to_string(repo.path().join("platform/auth.yaml")).unwrap_or_default();
    let auth = if auth.contains("apps:") {
        auth.replace("apps:", "apps:\n  app-new: { plan: gold, tenant: acme }")
    } else {
        format!("{auth}\napps:\n  app-new: {{ plan: gold, tenant: acme }}\n")
    };
    repo.write("platform/auth.yaml", &auth);
    new_key("k-whole");
    let v2 = version().await;
    assert!(v2 > v);
    wait_for("the whole version", Duration::from_secs(10), async || !credentials_lines(&node, v2).is_empty()).await;
    let lines = credentials_lines(&node, v2);
    assert!(lines.iter().all(|(delta, _)| !*delta), "the node took a delta: {lines:?}\n{}", node.log());
    let apps_before = credentials_lines(&node, v).first().map(|l| l.1.clone());
    assert!(lines.iter().all(|(_, apps)| Some(apps) != apps_before.as_ref() && !apps.is_empty()), "{lines:?}");
}

/// Starts `postern` with `args` and returns what it said on stderr when it stopped: it
/// must refuse to start (a node that keeps running fails the test after 20 s).
fn refused_at_start(args: &[&std::ffi::OsStr]) -> String {
    let mut child = Command::new(bin("postern"))
        .args(["--public", "127.0.0.1:0", "--partner", "127.0.0.1:0", "--admin", "127.0.0.1:0"])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let end = Instant::now() + Duration::from_secs(20);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > end {
            let _ = child.kill();
            panic!("postern {args:?} started; it should have refused");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success());
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The same envelope with another version number: its hash still matches its content,
/// only the signature can tell.
fn renumbered(text: &str, to: u64) -> String {
    let v: serde_json::Value = serde_json::from_str(text).unwrap();
    let from = v["version"].as_u64().unwrap();
    let out = text.replacen(&format!("\"version\":{from}"), &format!("\"version\":{to}"), 1);
    assert_ne!(out, text);
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_take_only_versions_the_control_plane_signed_over_tls_from_the_network_and_from_disk() {
    let Setup { _echo, repo, work, tokens } = setup();
    let store = work.path().join("store");
    let cp = serve_tls(repo.path(), store.to_str().unwrap(), &tokens, work.path(), &["--dwell", "0s"]);
    assert!(cp.url.starts_with("https://"));
    assert_eq!(ctl(&cp, &["publish"])["snapshot"]["version"], 1);
    let ca = cp.ca.clone().unwrap();
    let node = start_node_with(&cp.url, &work.path().join("n0"), "node-0", &["--control-ca", ca.to_str().unwrap()]);
    assert_eq!(get(&node.url("/r"), &[]).await.header("x-tag"), Some("one"));
    let snapshot = std::fs::read_to_string(work.path().join("n0/snapshot.json")).unwrap();
    assert!(snapshot.contains("\"sig\":\"ed25519:"), "{snapshot}");
    // The credentials come on their own lane, after the snapshot the node boots from.
    let on_disk = work.path().join("n0/credentials.json");
    wait_for("the node's credentials on disk", Duration::from_secs(10), async || on_disk.exists()).await;
    let credentials = std::fs::read_to_string(&on_disk).unwrap();
    assert!(credentials.contains("\"sig\":\"ed25519:"), "{credentials}");

    // The CLI without the CA cannot talk to it: the certificate is checked.
    let out = Command::new(bin("posternctl"))
        .args(["status", "--control", &cp.url, "--token", PLATFORM_TOKEN])
        .env_remove("POSTERN_CONTROL_CA")
        .output()
        .unwrap();
    assert!(!out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));

    // From disk: a node pinning the key refuses an unsigned snapshot (as `posternctl
    // compile` writes) and a signed one renumbered; a node of a control plane must pin.
    let key = work.path().join("control.pub");
    let unsigned = work.path().join("unsigned.json");
    repo.compile_ok(&unsigned);
    let why =
        refused_at_start(&["--snapshot".as_ref(), unsigned.as_os_str(), "--control-key".as_ref(), key.as_os_str()]);
    assert!(why.contains("unsigned"), "{why}");
    let forged = work.path().join("forged.json");
    std::fs::write(&forged, renumbered(&snapshot, 9)).unwrap();
    let why = refused_at_start(&["--snapshot".as_ref(), forged.as_os_str(), "--control-key".as_ref(), key.as_os_str()]);
    assert!(why.contains("bad signature"), "{why}");
    let why = refused_at_start(&["--snapshot".as_ref(), forged.as_os_str(), "--control".as_ref(), cp.url.as_ref()]);
    assert!(why.contains("--control-key"), "{why}");

    // A credentials file renumbered in the node's own folder is refused while it runs.
    let live = async || get(&node.admin_url("/readyz"), &[]).await.json()["credentials"]["version"].clone();
    let before = live().await;
    std::fs::write(work.path().join("n0/credentials.json"), renumbered(&credentials, 99)).unwrap();
    wait_for("the forged credentials to be refused", Duration::from_secs(10), async || {
        node.log().contains("credentials refused") && node.log().contains("bad signature")
    })
    .await;
    assert_eq!(live().await, before);

    // From the network: a node pinning this control plane's key, booted from its signed
    // snapshot, streaming from another control plane (its own key) refuses its versions
    // and says why in its NACK.
    let other = tempfile::tempdir().unwrap();
    let tokens2 = write_tokens(other.path());
    let cp2 = serve(repo.path(), other.path().join("store").to_str().unwrap(), &tokens2, &["--dwell", "0s"]);
    assert_eq!(ctl(&cp2, &["publish"])["snapshot"]["version"], 1);
    repo.write("teams/t/routes.yaml", &routes("two", false));
    assert_eq!(ctl(&cp2, &["publish"])["snapshot"]["version"], 2);
    std::fs::create_dir_all(work.path().join("n1")).unwrap();
    std::fs::write(work.path().join("n1/snapshot.json"), &snapshot).unwrap();
    let stranger = start_node(&cp2.url, &work.path().join("n1"), "node-1");
    wait_for("the NACK of a version signed by another key", Duration::from_secs(10), async || {
        ctl(&cp2, &["status"]).to_string().contains("bad signature")
    })
    .await;
    assert_eq!(stranger.version().await, 1);
    assert_eq!(get(&stranger.url("/r"), &[]).await.header("x-tag"), Some("one"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revocation_reaches_every_node_through_the_signed_directory_when_their_control_plane_is_gone() {
    let Setup { _echo, repo, work, tokens } = setup();
    let store = work.path().join("store");
    let drop_dir = work.path().join("drop");
    std::fs::create_dir_all(&drop_dir).unwrap();
    let flags = ["--dwell", "0s", "--publish-dir", drop_dir.to_str().unwrap()];
    let cp = serve(repo.path(), store.to_str().unwrap(), &tokens, &flags);
    ctl(&cp, &["publish"]);
    let new_key = |cp: &ControlPlane, id: &str| {
        let out = Command::new(bin("posternctl"))
            .args(["key", "new", "--id", id, "--app", "app-l", "--tenant", "acme", "--plan", "gold"])
            .args(["--control", cp.url.as_str(), "--token", PLATFORM_TOKEN])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    let leaked = new_key(&cp, "k-leaked");
    let poll = ["--credentials-dir", drop_dir.to_str().unwrap(), "--credentials-dir-poll-s", "1"];
    let nodes: Vec<Node> = (0..2)
        .map(|i| start_node_with(&cp.url, &work.path().join(format!("n{i}")), &format!("node-{i}"), &poll))
        .collect();
    // A node starts with the snapshot; the new key reaches it on its credentials stream.
    for n in &nodes {
        wait_for("the new key on every node", Duration::from_secs(10), async || {
            get(&n.url("/keyed"), &[("x-api-key", &leaked)]).await.status == StatusCode::OK
        })
        .await;
    }
    // The control plane the nodes stream from dies. The key service runs again elsewhere
    // (a second instance on the same store, same key) and the leaked key is revoked: the
    // nodes' streams still point at the dead one, so only the directory can carry it.
    let dead_url = cp.url.clone();
    drop(cp);
    let cp2 = serve(repo.path(), store.to_str().unwrap(), &tokens, &flags);
    assert_ne!(cp2.url, dead_url);
    let t = Instant::now();
    let out = Command::new(bin("posternctl"))
        .args(["key", "revoke", "--key", &leaked, "--control", cp2.url.as_str(), "--token", PLATFORM_TOKEN])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for n in &nodes {
        // The node logs where the version came from once it is live: wait for both.
        wait_for("the revocation from the directory", Duration::from_secs(30), async || {
            get(&n.url("/keyed"), &[("x-api-key", &leaked)]).await.status == StatusCode::UNAUTHORIZED
                && n.log().contains("credentials taken from the publish directory")
        })
        .await;
    }
    eprintln!("revocation on 2 nodes through the directory in {} ms (poll every 1 s)", t.elapsed().as_millis());

    // A file in the directory the control plane did not sign is refused, and changes nothing.
    let path = drop_dir.join("credentials.json");
    let text = std::fs::read_to_string(&path).unwrap();
    drop(cp2);
    std::fs::write(&path, renumbered(&text, 1000)).unwrap();
    for n in &nodes {
        wait_for("the forged file to be refused", Duration::from_secs(30), async || {
            n.log().lines().any(|l| l.contains("publish directory: credentials refused") && l.contains("bad signature"))
        })
        .await;
        assert!(!n.log().contains("cannot move"), "{}", n.log());
        assert_eq!(get(&n.url("/keyed"), &[("x-api-key", &leaked)]).await.status, StatusCode::UNAUTHORIZED);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_publish_directory_is_refused_and_the_node_keeps_serving_in_bounded_memory() {
    let Setup { _echo, repo, work, tokens } = setup();
    let store = work.path().join("store");
    let drop_dir = work.path().join("drop");
    std::fs::create_dir_all(&drop_dir).unwrap();
    let cp = serve(
        repo.path(),
        store.to_str().unwrap(),
        &tokens,
        &["--dwell", "0s", "--publish-dir", drop_dir.to_str().unwrap()],
    );
    ctl(&cp, &["publish"]);
    let poll = ["--credentials-dir", drop_dir.to_str().unwrap(), "--credentials-dir-poll-s", "1"];
    let node = start_node_with(&cp.url, &work.path().join("n0"), "node-0", &poll);
    assert_eq!(get(&node.url("/r"), &[]).await.status, StatusCode::OK);
    // The directory is the only thing changing from here on.
    drop(cp);
    for _ in 0..50 {
        assert_eq!(get(&node.url("/r"), &[]).await.status, StatusCode::OK);
    }
    let (baseline, _) = node.proc.rss_kib();
    node.proc.reset_peak_rss();
    assert_eq!(node.metric("postern_files_refused_total").await, 0);

    // Requests go on the whole time; every one is answered 200.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let traffic = tokio::spawn({
        let (url, stop) = (node.url("/r"), stop.clone());
        async move {
            let mut statuses = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                statuses.push(get(&url, &[]).await.status);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            statuses
        }
    });

    // Each hostile file is put in place whole (made beside it, renamed over it), as a
    // writer of the shared directory would.
    let path = drop_dir.join("credentials.json");
    let planted = drop_dir.join("planted");
    let hostile: [(&str, &dyn Fn()); 3] = [
        ("a symbolic link, refused", &|| std::os::unix::fs::symlink("/dev/zero", &planted).unwrap()),
        ("53687091200 bytes, over the limit of 1073741824", &|| {
            std::fs::File::create(&planted).unwrap().set_len(50 << 30).unwrap()
        }),
        ("not a regular file, refused", &|| assert!(Command::new("mkfifo").arg(&planted).status().unwrap().success())),
    ];
    for (n, (why, plant)) in hostile.iter().enumerate() {
        plant();
        std::fs::rename(&planted, &path).unwrap();
        let refusals = || {
            node.log()
                .lines()
                .filter(|l| l.contains("publish directory: credentials refused") && l.contains(why))
                .count()
        };
        wait_for(&format!("the refusal of {why}"), Duration::from_secs(30), async || refusals() == 1).await;
        wait_for("the refusal counted", Duration::from_secs(10), async || {
            node.metric("postern_files_refused_total").await == n as u64 + 1
        })
        .await;
        assert_eq!(get(&node.url("/r"), &[]).await.status, StatusCode::OK);
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let statuses = traffic.await.unwrap();
    assert!(!statuses.is_empty());
    assert_eq!(statuses.iter().filter(|s| **s != StatusCode::OK).count(), 0, "{statuses:?}");
    let (rss, peak) = node.proc.rss_kib();
    eprintln!("node RSS: baseline {baseline} KiB, now {rss} KiB, peak since {peak} KiB");
    assert!(peak < 2 * baseline, "peak RSS {peak} KiB over twice the baseline {baseline} KiB");
    assert!(rss < 2 * baseline, "RSS {rss} KiB over twice the baseline {baseline} KiB");
    // Each file refused once, not again at every poll (polled every second meanwhile),
    // each on one line.
    let log = node.log();
    let lines: Vec<&str> = log.lines().filter(|l| l.contains("publish directory: credentials refused")).collect();
    assert_eq!(lines.len(), 3, "{lines:#?}");
    assert_eq!(node.metric("postern_files_refused_total").await, 3);
}
