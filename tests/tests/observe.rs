//! Observing every call per key, end to end: a control plane (usage store) and a node
//! with an access log, on ephemeral ports. After a mix of calls from two keys
//! (successes, 4xx, 5xx), refused credentials and ten thousand further keys:
//! `posternctl usage` shows each key's calls per route and minute; the JSON log holds
//! every error and about 1 % of successes and no credential; `/metrics` stays bounded
//! (no key is a label, the busiest callers are at most ten series).
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

use bytes::Bytes;
use http::Method;
use postern_e2e::control_plane::*;
use postern_e2e::{Echo, Node, Repo, bin, client, get, new_key, platform, send_with};

const ROUTES: &str = "routes:\n  - name: search\n    match: { path: { value: /search } }\n    auth: { methods: [apiKey], product: search }\n    backendRefs: [{ name: e }]\n    timeouts: { connect: 1s, response: 5s }\n  - name: open\n    public: true\n    match: { path: { value: /open } }\n    backendRefs: [{ name: e }]\n    timeouts: { connect: 1s, response: 5s }\n";

/// Ten thousand key records (hashes only, as `posternctl key new` writes them) and
/// their raw keys.
fn bulk_keys(n: usize) -> (String, Vec<String>) {
    let mut lines = String::new();
    let mut raws = Vec::with_capacity(n);
    for i in 0..n {
        let raw = postern_model::apikey::generate(postern_model::apikey::KeyEnv::Live).unwrap();
        let sha = hex::encode(postern_model::apikey::hash(raw.as_bytes()));
        let rec = serde_json::json!({
            "id": format!("bulk-{i:05}"), "sha256": sha, "app": format!("bulk-app-{i}"),
            "tenant": "acme", "plan": "gold",
        });
        lines.push_str(&rec.to_string());
        lines.push('\n');
        raws.push(raw);
    }
    (lines, raws)
}

/// The node's series (sample lines) by metric family.
async fn series(node: &Node) -> (String, usize) {
    let text = String::from_utf8_lossy(&get(&node.admin_url("/metrics"), &[]).await.body).into_owned();
    let n = text.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()).count();
    (text, n)
}

/// The value of one exact series.
fn value(metrics: &str, series: &str) -> u64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series).and_then(|r| r.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no series {series}"))
}

fn log_lines(path: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON line ({e}): {l}")))
        .collect()
}

/// The lines written whole so far (the writer may be in the middle of the last one).
fn whole_lines(path: &std::path::Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let whole = text.rfind('\n').map_or("", |end| &text[..=end]);
    whole.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON line ({e}): {l}"))).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_key_usage_access_logs_and_bounded_metrics() {
    let echo = Echo::start("e");
    let repo = Repo::new();
    platform(&repo, &[("e", &echo.addr())]);
    repo.write("platform/plans.yaml", "scopes: []\nproducts: [search]\nplans:\n  gold: { products: [search] }\n");
    repo.write("teams/t/routes.yaml", ROUTES);
    let (bulk, bulk_raw) = bulk_keys(10_000);
    repo.write("platform/keys.jsonl", &bulk);
    let k1 = new_key(repo.path(), "k1", "app1", "acme", "gold", &[]);
    let k2 = new_key(repo.path(), "k2", "app2", "acme", "gold", &[]);
    let work = tempfile::tempdir().unwrap();
    let tokens = write_tokens(work.path());
    let store = work.path().join("store");
    let cp = serve(repo.path(), store.to_str().unwrap(), &tokens, &["--dwell", "0s"]);
    ctl(&cp, &["publish"]);
    let log = work.path().join("logs/access.log");
    // Every error is counted here, the anonymous 401s too: no budget for those (it has
    // its own test, `anonymous_client_errors_cannot_roll_the_access_log`).
    let node = start_node_with(
        &cp.url,
        &work.path().join("n0"),
        "node-0",
        &["--access-log", log.to_str().unwrap(), "--access-log-anonymous-errors-per-s", "1000000"],
    );
    // Until the keys arrive, the node refuses k2: those 401s are logged too.
    let early = std::cell::Cell::new(0);
    wait_for("the node to take the keys", Duration::from_secs(20), async || {
        let status = get(&node.url("/search"), &[("x-api-key", &k2)]).await.status.as_u16();
        if status != 200 {
            early.set(early.get() + 1);
        }
        status == 200
    })
    .await;
    let (_, series_before) = series(&node).await;

    // Two keys: successes, their own 4xx and the backend's 5xx.
    let c = client();
    let call = async |key: &str, status: u16| {
        let url = node.url(&format!("/search?status={status}"));
        send_with(&c, Method::GET, &url, &[("x-api-key", key)], Bytes::new()).await.unwrap().status.as_u16()
    };
    let mut errors: BTreeMap<u16, usize> = BTreeMap::new();
    for (key, n) in [(&k1, 100), (&k2, 50)] {
        for i in 0..n {
            let want = match i % 10 {
                0 => 503,
                1 => 404,
                _ => 200,
            };
            assert_eq!(call(key, want).await, want);
            if want >= 400 {
                *errors.entry(want).or_default() += 1;
            }
        }
    }
    // Twenty callers with credentials that are not keys: the gateway's own 401s.
    let bad: Vec<String> = (0..20).map(|i| format!("ak_live_{i:032}xx")).collect();
    for b in &bad {
        assert_eq!(call(b, 200).await, 401);
    }
    *errors.entry(401).or_default() += 20 + early.get();
    // Ten thousand more keys, one success each, 32 at a time.
    for chunk in bulk_raw.chunks(32) {
        for got in futures_util::future::join_all(chunk.iter().map(|raw| call(raw, 200))).await {
            assert_eq!(got, 200);
        }
    }
    let successes = 90 + 45 + 1 + bulk_raw.len();

    // Per key, per route and minute, from the usage store.
    wait_for("k1's calls in the usage store", Duration::from_secs(30), async || {
        let v = ctl(&cp, &["usage", "--json", "--key", "k1", "--by", "minute", "--last", "1h"]);
        v["rows"].as_array().map_or(0, |r| r.iter().map(|r| r["calls"].as_u64().unwrap_or(0)).sum::<u64>()) == 100
    })
    .await;
    for (key, calls) in [("k1", 100), ("k2", 51)] {
        let v = ctl(&cp, &["usage", "--json", "--key", key, "--by", "minute", "--last", "1h"]);
        let rows = v["rows"].as_array().unwrap();
        assert!(rows.iter().all(|r| r["route"] == "t/search" && r["caller"] == key), "{v}");
        let sum = |f: &dyn Fn(&serde_json::Value) -> u64| rows.iter().map(f).sum::<u64>();
        assert_eq!(sum(&|r| r["calls"].as_u64().unwrap()), calls, "{v}");
        assert_eq!(sum(&|r| r["status"]["5xx"].as_u64().unwrap()), calls / 10, "{v}");
        assert_eq!(sum(&|r| r["status"]["4xx"].as_u64().unwrap()), calls / 10, "{v}");
        assert!(rows.iter().all(|r| r["at"].as_str().is_some_and(|t| t.ends_with(":00Z"))), "per minute: {v}");
    }
    let out = Command::new(bin("posternctl"))
        .args(["usage", "--key", "k1", "--by", "route", "--last", "1h", "--chart"])
        .args(["--control", &cp.url, "--token", PLATFORM_TOKEN])
        .output()
        .unwrap();
    let chart = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{chart}{}", String::from_utf8_lossy(&out.stderr));
    assert!(chart.contains("k1 (key)") && chart.contains("t/search"), "{chart}");
    assert!(chart.chars().any(|c| ('▁'..='█').contains(&c)), "a sparkline: {chart}");
    eprintln!("{chart}");

    // The access log: every error (under a budget of anonymous client errors larger
    // than this test sends), about 1 % of successes, never a credential. A
    // request's line is queued when its response ends, before its connection closes: once
    // the client's connections are closed (the node counts none open), every line is
    // queued. Then one more error, the marker, queues last; the queue is written in
    // order, so once the marker's line is in the file, every line is.
    drop(c);
    let end = std::time::Instant::now() + Duration::from_secs(30);
    while node.metric("postern_open_connections").await > 0 {
        assert!(std::time::Instant::now() < end, "client connections still open after 30 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(get(&node.url("/observe-marker"), &[]).await.status.as_u16(), 404);
    *errors.entry(404).or_default() += 1;
    wait_for("the marker's line in the access log", Duration::from_secs(30), async || {
        whole_lines(&log).iter().any(|l| l["path"] == "/observe-marker")
    })
    .await;
    let lines = log_lines(&log);
    assert_eq!(lines.last().map(|l| &l["path"]), Some(&serde_json::json!("/observe-marker")), "the marker is last");
    let mut logged_errors: BTreeMap<u16, usize> = BTreeMap::new();
    for l in lines.iter().filter(|l| l["status"].as_u64() >= Some(400)) {
        *logged_errors.entry(l["status"].as_u64().unwrap() as u16).or_default() += 1;
    }
    assert_eq!(logged_errors, errors, "every error is logged");
    let sampled = lines.iter().filter(|l| l["status"] == 200).count();
    // 1 % of ~10,136 successes: ~101, five standard deviations either way.
    assert!((50..=155).contains(&sampled), "{sampled} of {successes} successes logged");
    eprintln!("access log: {} lines, {sampled} of {successes} successes", lines.len());
    for l in &lines {
        for field in ["ts", "request_id", "trace_id", "method", "path", "origin", "body"] {
            assert!(l[field].is_string(), "{field} in {l}");
        }
        assert!(l["duration_ms"].as_f64().is_some() && l["gateway_ms"].as_f64().is_some(), "{l}");
        assert_eq!(l["pool"], "public", "{l}");
    }
    let upstream_503 = lines.iter().find(|l| l["status"] == 503 && l["caller"] == "k1").expect("k1's 503");
    assert_eq!(upstream_503["route"], "t/search");
    assert_eq!(upstream_503["caller_kind"], "key");
    assert_eq!(upstream_503["plan"], "gold");
    assert_eq!(upstream_503["origin"], "upstream");
    assert!(upstream_503.get("code").is_none(), "{upstream_503}");
    assert_eq!(upstream_503["filters"], serde_json::json!([{"name": "auth", "outcome": "continue"}]));
    assert_eq!(upstream_503["path"], "/search", "no query: {upstream_503}");
    let refused = lines.iter().find(|l| l["status"] == 401).expect("a 401");
    assert_eq!(refused["code"], "invalid_credentials");
    assert_eq!(refused["origin"], "gateway");
    assert!(refused.get("caller").is_none(), "{refused}");
    assert_eq!(refused["filters"], serde_json::json!([{"name": "auth", "outcome": "answered"}]));
    let text = std::fs::read_to_string(&log).unwrap();
    for secret in [&k1, &k2].into_iter().chain(&bad).chain(bulk_raw.iter().take(500)) {
        assert!(!text.contains(secret.as_str()), "a credential in the access log");
    }
    assert!(!text.to_ascii_lowercase().contains("x-api-key"), "a credential header in the access log");

    // Metrics: bounded whatever the number of keys; who made each 5xx; refusals.
    let (metrics, series_after) = series(&node).await;
    assert!(
        series_after <= series_before + 40,
        "{series_before} series before 10,002 keys called, {series_after} after"
    );
    let keyed = metrics.lines().filter(|l| !l.starts_with('#') && l.contains("bulk-")).count();
    assert!(keyed <= 20, "at most the ten busiest callers: {keyed} series name a bulk key");
    assert!(!metrics.contains(&k1) && !metrics.contains("bulk-app-"), "no credential or app in metrics");
    assert_eq!(value(&metrics, "postern_responses_5xx_total{route=\"t/search\",origin=\"upstream\"}"), 15);
    assert_eq!(value(&metrics, "postern_responses_5xx_total{route=\"t/search\",origin=\"gateway\"}"), 0);
    assert_eq!(
        value(&metrics, "postern_responses_denied_total{route=\"t/search\",status=\"401\"}"),
        20 + early.get() as u64
    );
    assert_eq!(value(&metrics, "postern_access_log_lines_total{outcome=\"written\"}"), lines.len() as u64);
    assert_eq!(value(&metrics, "postern_access_log_lines_total{outcome=\"dropped\"}"), 0);
    assert!(value(&metrics, "postern_plan_requests_total{plan=\"gold\",status=\"2xx\"}") >= 10_000);
    assert!(value(&metrics, "postern_upstream_connections{cluster=\"e\"}") >= 1, "pooled connections to e");
    assert!(metrics.contains("postern_top_caller_calls{rank=\"1\","), "{metrics}");
}

/// With `--access-log-kafka-topic`, each line also goes to its own topic on the usage
/// stream's brokers (a real Kafka-protocol broker), keyed by the caller, and the file
/// keeps it too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn access_log_lines_reach_their_own_kafka_topic() {
    use rdkafka::Message;
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::consumer::{BaseConsumer, Consumer};

    let broker = postern_e2e::kafka::Broker::start();
    let admin: AdminClient<rdkafka::client::DefaultClientContext> =
        rdkafka::ClientConfig::new().set("bootstrap.servers", &broker.addr).create().unwrap();
    let topic = NewTopic::new("postern.access", 1, TopicReplication::Fixed(1));
    admin.create_topics([&topic], &AdminOptions::new()).await.unwrap();

    let echo = Echo::start("e");
    let repo = Repo::new();
    platform(&repo, &[("e", &echo.addr())]);
    repo.write(
        "teams/t/routes.yaml",
        "routes:\n  - name: open\n    public: true\n    match: { path: { value: /open } }\n    backendRefs: [{ name: e }]\n    timeouts: { connect: 1s, response: 5s }\n",
    );
    let work = tempfile::tempdir().unwrap();
    let snapshot = work.path().join("snapshot.json");
    repo.compile_ok(&snapshot);
    let log = work.path().join("access.log");
    let spool = work.path().join("spool");
    let node = Node::start(
        &snapshot,
        &[
            "--usage-spool",
            spool.to_str().unwrap(),
            "--usage-kafka",
            &broker.addr,
            "--access-log",
            log.to_str().unwrap(),
            "--access-log-kafka-topic",
            "postern.access",
        ],
    );
    let mut ids = Vec::new();
    for status in [500, 404, 503] {
        let r = get(&node.url(&format!("/open?status={status}")), &[]).await;
        assert_eq!(r.status.as_u16(), status);
        ids.push(r.header("x-request-id").unwrap().to_owned());
    }
    assert_eq!(get(&node.url("/nope"), &[]).await.status.as_u16(), 404);

    let addr = broker.addr.clone();
    let got = tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &addr)
            .set("group.id", "observe-test")
            .set("auto.offset.reset", "earliest")
            .create()
            .unwrap();
        consumer.subscribe(&["postern.access"]).unwrap();
        let mut got = Vec::new();
        let end = std::time::Instant::now() + Duration::from_secs(30);
        while got.len() < 4 && std::time::Instant::now() < end {
            if let Some(Ok(m)) = consumer.poll(Duration::from_millis(200)) {
                let key = String::from_utf8_lossy(m.key().unwrap_or_default()).into_owned();
                let v: serde_json::Value = serde_json::from_slice(m.payload().unwrap_or_default()).unwrap();
                got.push((key, v));
            }
        }
        got
    })
    .await
    .unwrap();
    assert_eq!(got.len(), 4, "{got:?}");
    for (id, (key, line)) in ids.iter().zip(&got) {
        assert_eq!(key, id, "a line without a caller is keyed by its request id");
        assert_eq!(&line["request_id"], id.as_str());
        assert_eq!(line["route"], "t/open");
        assert_eq!(line["origin"], "upstream");
    }
    assert_eq!(got[3].1["code"], "route_not_found");
    // Each line is written to the file before it is handed to the stream, and the file is
    // flushed once the batch is: wait for that flush, then count.
    wait_for("the file's lines", Duration::from_secs(30), async || whole_lines(&log).len() >= 4).await;
    assert_eq!(log_lines(&log).len(), 4, "the file keeps every line too");
    let metrics = String::from_utf8_lossy(&get(&node.admin_url("/metrics"), &[]).await.body).into_owned();
    assert_eq!(value(&metrics, "postern_access_log_stream_total{outcome=\"sent\"}"), 4);
}
