//! Fleet-wide rate limits: three `postern` nodes share one limit through Redis.
//!
//! - One key's traffic, spread unevenly over the nodes and then shifted, is admitted at
//!   the limit within ±10 % over 10 s, while another key alongside is untouched.
//! - With Redis stopped, nothing waits, nodes keep their last shares (admission stays
//!   bounded), `/readyz` and `/metrics` say the sync is lost and plans that fail closed
//!   refuse; with Redis back, the sync resumes by itself.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, StatusCode};
use postern_e2e::{Echo, Node, Repo, client, get, new_key, platform, send_with};

const ROUTES: &str = "routes:\n  - name: orders\n    match: { path: { value: /orders } }\n    auth: { methods: [apiKey], product: orders }\n    backendRefs: [{ name: e }]\n    timeouts: { connect: 1s, response: 5s }\n";
const PLANS: &str = "scopes: []\nproducts: [orders]\nplans:\n  metered:\n    products: [orders]\n    rateLimit: { rps: 100, burst: 20 }\n  strict:\n    products: [orders]\n    rateLimit: { rps: 100, burst: 20 }\n    onSyncLoss: closed\n";

struct Fleet {
    _echo: Echo,
    _repo: Repo,
    nodes: Vec<Node>,
    keys: Vec<String>,
}

fn unique_prefix(tag: &str) -> String {
    format!("postern-test:{tag}:{}:{}:", std::process::id(), fastrand_seed())
}

fn fastrand_seed() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
}

fn fleet(n: usize, redis: &str, prefix: &str, keys: &[(&str, &str, &str)]) -> Fleet {
    let echo = Echo::start("e");
    let repo = Repo::new();
    platform(&repo, &[("e", &echo.addr())]);
    repo.write("platform/plans.yaml", PLANS);
    repo.write("teams/t/routes.yaml", ROUTES);
    let made = keys.iter().map(|(id, app, plan)| new_key(repo.path(), id, app, "acme", plan, &[])).collect();
    let snap = repo.path().join("out/snapshot.json");
    std::fs::create_dir_all(snap.parent().unwrap()).unwrap();
    repo.compile_ok(&snap);
    let nodes = (0..n)
        .map(|i| {
            let id = format!("node-{i}");
            Node::start(&snap, &["--ratelimit-redis", redis, "--ratelimit-prefix", prefix, "--node-id", &id])
        })
        .collect();
    Fleet { _echo: echo, _repo: repo, nodes, keys: made }
}

async fn readyz(node: &Node) -> serde_json::Value {
    get(&node.admin_url("/readyz"), &[]).await.json()["ratelimit"].clone()
}

/// Waits until every node has synced and sees `n` nodes.
async fn wait_synced(f: &Fleet, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(15);
    for node in &f.nodes {
        loop {
            let r = readyz(node).await;
            if r["state"] == "synced" && r["nodes"].as_u64() == Some(n) {
                break;
            }
            assert!(Instant::now() < deadline, "node never synced: {r}\n{}", node.log());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    limited: AtomicU64,
    other: AtomicU64,
    /// Slowest answer, in µs.
    slowest_us: AtomicU64,
}

/// Sends `rate` requests a second with `key` to `url` for `secs`, without waiting for
/// answers before sending the next, and tallies the answers.
async fn paced(url: String, key: String, rate: f64, secs: f64, tally: Arc<Tally>) {
    if rate <= 0.0 {
        tokio::time::sleep(Duration::from_secs_f64(secs)).await;
        return;
    }
    let c = client();
    let start = Instant::now();
    let total = (rate * secs).round() as u64;
    let mut tasks = Vec::with_capacity(total as usize);
    for i in 0..total {
        let due = start + Duration::from_secs_f64(i as f64 / rate);
        tokio::time::sleep_until(due.into()).await;
        let (c, url, key, tally) = (c.clone(), url.clone(), key.clone(), tally.clone());
        tasks.push(tokio::spawn(async move {
            let t = Instant::now();
            let r = send_with(&c, Method::GET, &url, &[("x-api-key", &key)], Bytes::new()).await;
            let us = u64::try_from(t.elapsed().as_micros()).unwrap_or(u64::MAX);
            tally.slowest_us.fetch_max(us, Ordering::Relaxed);
            match r.map(|r| r.status) {
                Ok(StatusCode::OK) => tally.ok.fetch_add(1, Ordering::Relaxed),
                Ok(StatusCode::TOO_MANY_REQUESTS) => tally.limited.fetch_add(1, Ordering::Relaxed),
                _ => tally.other.fetch_add(1, Ordering::Relaxed),
            };
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
}

/// Sends one key's traffic over the nodes: `rate` a second in total, split by `weights`.
async fn spread(f: &Fleet, key: &str, rate: f64, weights: &[f64], secs: f64, tally: &Arc<Tally>) {
    let runs = f
        .nodes
        .iter()
        .zip(weights)
        .map(|(n, w)| tokio::spawn(paced(n.url("/orders"), key.to_owned(), rate * w, secs, tally.clone())));
    for r in runs.collect::<Vec<_>>() {
        r.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_hold_one_limit_within_ten_percent_as_traffic_shifts() {
    let prefix = unique_prefix("accuracy");
    let f = fleet(
        3,
        "redis://127.0.0.1:6379",
        &prefix,
        &[("k-hot", "app-hot", "metered"), ("k-calm", "app-calm", "metered")],
    );
    wait_synced(&f, 3).await;

    // The hot key asks for 2.5x its limit of 100/s: 70/20/10 over the nodes for 5 s, then
    // 10/20/70 for 5 s. The calm key asks for 20/s on the first node all along.
    let hot = Arc::new(Tally::default());
    let calm = Arc::new(Tally::default());
    let calm_run = tokio::spawn(paced(f.nodes[0].url("/orders"), f.keys[1].clone(), 20.0, 10.0, calm.clone()));
    spread(&f, &f.keys[0], 250.0, &[0.7, 0.2, 0.1], 5.0, &hot).await;
    spread(&f, &f.keys[0], 250.0, &[0.1, 0.2, 0.7], 5.0, &hot).await;
    calm_run.await.unwrap();

    let ok = hot.ok.load(Ordering::Relaxed) as f64;
    let limited = hot.limited.load(Ordering::Relaxed);
    // 10 s at 100/s, plus the burst of 20.
    let expected = 100.0 * 10.0 + 20.0;
    eprintln!(
        "hot key: admitted {ok} (expected {expected}), limited {limited}; calm key: admitted {} of 200, slowest {} µs",
        calm.ok.load(Ordering::Relaxed),
        calm.slowest_us.load(Ordering::Relaxed)
    );
    assert_eq!(hot.other.load(Ordering::Relaxed), 0);
    assert!((ok - expected).abs() <= 0.1 * expected, "admitted {ok}, expected {expected} ± 10 %");
    // The flood from one key leaves another key alone.
    assert_eq!(calm.ok.load(Ordering::Relaxed), 200, "the calm key was limited");
    assert!(calm.slowest_us.load(Ordering::Relaxed) < 1_000_000, "a calm request waited");

    for n in &f.nodes {
        let m = get(&n.admin_url("/metrics"), &[]).await;
        let text = String::from_utf8_lossy(&m.body);
        assert!(text.contains("postern_ratelimit_synced 1"), "{text}");
        assert!(text.contains("postern_ratelimit_fleet_nodes 3"), "{text}");
    }
}

/// A Redis server of the test's own, on an ephemeral port.
struct Redis {
    port: u16,
    child: Option<Child>,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

impl Redis {
    fn start_on(port: u16) -> Redis {
        Redis::start_with(port, &[])
    }

    fn start_with(port: u16, extra: &[&str]) -> Redis {
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server (apt-get install redis-server)");
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "redis-server did not start on {port}");
            std::thread::sleep(Duration::from_millis(20));
        }
        Redis { port, child: Some(child) }
    }

    fn start() -> Redis {
        Redis::start_on(free_port())
    }

    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.stop();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_redis_stopped_nodes_keep_their_shares_and_recover() {
    let mut redis = Redis::start();
    let url = format!("redis://127.0.0.1:{}", redis.port);
    let f = fleet(2, &url, "postern:rl:", &[("k-open", "app-open", "metered"), ("k-closed", "app-closed", "strict")]);
    wait_synced(&f, 2).await;

    // Even traffic at 2x the limit: each node holds about half.
    let before = Arc::new(Tally::default());
    spread(&f, &f.keys[0], 200.0, &[0.5, 0.5], 3.0, &before).await;
    let closed = get(&f.nodes[0].url("/orders"), &[("x-api-key", &f.keys[1])]).await;
    assert_eq!(closed.status, StatusCode::OK);

    redis.stop();
    let lost_at = Instant::now();
    let during = Arc::new(Tally::default());
    spread(&f, &f.keys[0], 200.0, &[0.5, 0.5], 4.0, &during).await;
    let ok = during.ok.load(Ordering::Relaxed) as f64;
    eprintln!(
        "before: admitted {} slowest {} µs; Redis down: admitted {ok} slowest {} µs",
        before.ok.load(Ordering::Relaxed),
        before.slowest_us.load(Ordering::Relaxed),
        during.slowest_us.load(Ordering::Relaxed)
    );
    // Bounded by the last shares: 4 s at 100/s fleet-wide, plus at most one burst.
    assert!(ok <= 4.0 * 100.0 * 1.1 + 20.0, "admitted {ok} with Redis down");
    assert!(ok >= 4.0 * 100.0 * 0.8, "admitted {ok} with Redis down: the nodes stopped serving");
    assert_eq!(during.other.load(Ordering::Relaxed), 0);
    // Nothing waits on Redis: the slowest answer is far below the sync's timeouts.
    assert!(during.slowest_us.load(Ordering::Relaxed) < 250_000, "a request waited on the sync");

    for n in &f.nodes {
        let r = readyz(n).await;
        assert_eq!(r["state"], "lost", "{r} after {:?}", lost_at.elapsed());
        let m = get(&n.admin_url("/metrics"), &[]).await;
        let text = String::from_utf8_lossy(&m.body);
        assert!(text.contains("postern_ratelimit_synced 0"), "{text}");
    }
    // A plan that fails closed refuses while the sync is lost.
    let r = get(&f.nodes[0].url("/orders"), &[("x-api-key", &f.keys[1])]).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.json()["code"], "rate_limit_unavailable");
    assert_eq!(r.header("retry-after"), Some("1"));

    // Redis back (empty, as after a restart): the sync resumes by itself.
    let port = redis.port;
    let _redis = Redis::start_on(port);
    wait_synced(&f, 2).await;
    let r = get(&f.nodes[0].url("/orders"), &[("x-api-key", &f.keys[1])]).await;
    assert_eq!(r.status, StatusCode::OK);
    let after = Arc::new(Tally::default());
    spread(&f, &f.keys[0], 200.0, &[0.5, 0.5], 3.0, &after).await;
    let ok = after.ok.load(Ordering::Relaxed) as f64;
    assert!((ok - 320.0).abs() <= 0.15 * 320.0, "admitted {ok} after recovery, expected about 3 s x 100 + 20");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_cluster_holds_the_limit_too() {
    // Three masters on ephemeral ports, slots spread by redis-cli.
    let dir = tempfile::tempdir().unwrap();
    let mut servers = Vec::new();
    for i in 0..3 {
        let (port, bus) = (free_port(), free_port());
        let conf = dir.path().join(format!("nodes-{i}.conf"));
        let args = ["--cluster-enabled", "yes", "--cluster-port", &bus.to_string(), "--cluster-config-file"];
        let mut all: Vec<&str> = args.to_vec();
        let conf = conf.display().to_string();
        all.push(&conf);
        servers.push(Redis::start_with(port, &all));
    }
    let addrs: Vec<String> = servers.iter().map(|r| format!("127.0.0.1:{}", r.port)).collect();
    let out = Command::new("redis-cli")
        .args(["--cluster", "create"])
        .args(&addrs)
        .args(["--cluster-replicas", "0", "--cluster-yes"])
        .output()
        .expect("redis-cli --cluster create");
    assert!(out.status.success(), "cluster create: {}", String::from_utf8_lossy(&out.stdout));
    // Wait for every slot to be served.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let info = Command::new("redis-cli").args(["-p", &servers[0].port.to_string(), "cluster", "info"]).output();
        if info.is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("cluster_state:ok")) {
            break;
        }
        assert!(Instant::now() < deadline, "the cluster never came up");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let echo = Echo::start("e");
    let repo = Repo::new();
    platform(&repo, &[("e", &echo.addr())]);
    repo.write("platform/plans.yaml", PLANS);
    repo.write("teams/t/routes.yaml", ROUTES);
    let key = new_key(repo.path(), "k-c", "app-c", "acme", "metered", &[]);
    let snap = repo.path().join("out/snapshot.json");
    std::fs::create_dir_all(snap.parent().unwrap()).unwrap();
    repo.compile_ok(&snap);
    let seed = format!("redis://{}", addrs[0]);
    let nodes: Vec<Node> = (0..2)
        .map(|i| {
            let id = format!("c-{i}");
            Node::start(&snap, &["--ratelimit-redis", &seed, "--ratelimit-cluster", "--node-id", &id])
        })
        .collect();
    let f = Fleet { _echo: echo, _repo: repo, nodes, keys: vec![key] };
    wait_synced(&f, 2).await;

    let t = Arc::new(Tally::default());
    spread(&f, &f.keys[0], 250.0, &[0.8, 0.2], 5.0, &t).await;
    let ok = t.ok.load(Ordering::Relaxed) as f64;
    let expected = 100.0 * 5.0 + 20.0;
    eprintln!("cluster: admitted {ok}, expected {expected}");
    assert!((ok - expected).abs() <= 0.1 * expected, "admitted {ok}, expected {expected} ± 10 %");
    // The keys landed on the cluster, spread over its slots by their hash tags.
    let mut held = 0;
    for r in &servers {
        let o = Command::new("redis-cli").args(["-p", &r.port.to_string(), "dbsize"]).output().unwrap();
        held += String::from_utf8_lossy(&o.stdout).trim().parse::<u64>().unwrap_or(0);
    }
    assert!(held >= 2, "one limit key and the node set: {held}");
    drop(dir);
}
