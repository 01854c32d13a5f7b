//! The usage stream on a real Kafka-protocol broker (`tansu`): nodes started with
//! `--usage-kafka` write their windows there, split by caller; `posternctl serve
//! --usage-kafka` consumes them into the usage store. Under load, with a node killed
//! with `kill -9` and restarted, the broker frozen for over 30 s, a spool filled up and
//! windows delivered twice, every key is billed exactly the calls its clients saw
//! answered, exactly, and the store and the nodes report each fault.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use http::StatusCode;
use postern_e2e::control_plane::*;
use postern_e2e::kafka::Broker;
use postern_e2e::usage::{billed, load, numbered, spool_state, store_node, wait_mid_window, wait_store_has};
use postern_e2e::{Node, Repo, get, new_key, platform};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer as _};

const ROUTES: &str = "routes:\n  - name: search\n    match: { path: { value: /search } }\n    auth: { methods: [apiKey], product: search }\n    backendRefs: [{ name: e }]\n    timeouts: { connect: 1s, response: 5s }\n";

async fn platform_get(cp: &ControlPlane, path: &str) -> serde_json::Value {
    let auth = format!("Bearer {PLATFORM_TOKEN}");
    get(&format!("{}{path}", cp.url), &[("authorization", &auth)]).await.json()
}

struct Loads {
    stop: Arc<AtomicBool>,
    tasks: Vec<(String, tokio::task::JoinHandle<Vec<Instant>>)>,
}

impl Loads {
    fn start(port: u16, keys: &[(&str, &str)]) -> Loads {
        let stop = Arc::new(AtomicBool::new(false));
        // A steady, modest rate: six clients on a two-core machine.
        let pause = Duration::from_millis(5);
        let tasks = keys
            .iter()
            .map(|(id, k)| ((*id).to_owned(), load(port, (*k).to_owned(), stop.clone(), 1, pause)))
            .collect();
        Loads { stop, tasks }
    }

    /// Stops the clients; their successful calls by key.
    async fn stop(self) -> BTreeMap<String, Vec<Instant>> {
        self.stop.store(true, Ordering::Relaxed);
        let mut out = BTreeMap::new();
        for (id, t) in self.tasks {
            out.insert(id, t.await.unwrap());
        }
        out
    }
}

/// A broker, a backend, a config repository with route `t/search` on product `search`,
/// and the work directory with its tokens (`tokens.json`) and store folder (`store`).
struct Setup {
    broker: Broker,
    echo: postern_e2e::Echo,
    repo: Repo,
    work: tempfile::TempDir,
    tokens: std::path::PathBuf,
    store: std::path::PathBuf,
}

fn setup() -> Setup {
    let broker = Broker::start();
    let echo = postern_e2e::Echo::start("e");
    let repo = Repo::new();
    platform(&repo, &[("e", &echo.addr())]);
    repo.write("platform/plans.yaml", "scopes: []\nproducts: [search]\nplans:\n  gold: { products: [search] }\n");
    repo.write("teams/t/routes.yaml", ROUTES);
    let work = tempfile::tempdir().unwrap();
    let tokens = write_tokens(work.path());
    let store = work.path().join("store");
    Setup { broker, echo, repo, work, tokens, store }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_through_kafka_is_billed_exactly_through_a_kill_a_frozen_broker_a_full_spool_and_duplicates() {
    let Setup { broker, echo, repo, work, tokens, store } = setup();
    // Each node signs its parts with its own key, which the control plane knows.
    let signers: Vec<std::sync::Arc<postern_model::sign::Signer>> =
        (0..2).map(|_| std::sync::Arc::new(postern_model::sign::Signer::generate().unwrap())).collect();
    let key_files: Vec<String> = (0..2)
        .map(|i| {
            let f = work.path().join(format!("node-{i}.key"));
            std::fs::write(&f, signers[i].to_text()).unwrap();
            f.to_str().unwrap().to_owned()
        })
        .collect();
    let node_keys = work.path().join("node-keys.json");
    let keys =
        serde_json::json!({"node-0": signers[0].public().to_string(), "node-1": signers[1].public().to_string()});
    std::fs::write(&node_keys, keys.to_string()).unwrap();
    let cp = serve(
        repo.path(),
        store.to_str().unwrap(),
        &tokens,
        &[
            "--dwell",
            "0s",
            "--usage-kafka",
            &broker.addr,
            "--usage-kafka-partitions",
            "4",
            "--usage-node-keys",
            node_keys.to_str().unwrap(),
        ],
    );
    let k: Vec<String> = (1..=3).map(|i| new_key(repo.path(), &format!("k{i}"), "app", "acme", "gold", &[])).collect();
    ctl(&cp, &["publish"]);
    let kafka = ["--usage-kafka", broker.addr.as_str(), "--drain-seconds", "2"];
    let n0_dir = work.path().join("n0");
    let mut n0_args = kafka.to_vec();
    n0_args.extend(["--usage-signing-key", key_files[0].as_str()]);
    let n0 = start_node_with(&cp.url, &n0_dir, "node-0", &n0_args);
    // node-1's spool holds about two windows: the frozen broker fills it.
    let mut n1_args = kafka.to_vec();
    n1_args.extend(["--usage-spool-max", "1KiB", "--usage-signing-key", key_files[1].as_str()]);
    let n1 = start_node_with(&cp.url, &work.path().join("n1"), "node-1", &n1_args);
    let mut seen: BTreeMap<String, u64> = BTreeMap::new();
    for node in [&n0, &n1] {
        wait_for("the node to take the keys", Duration::from_secs(15), async || {
            get(&node.url("/search"), &[("x-api-key", &k[2])]).await.status == StatusCode::OK
        })
        .await;
        *seen.entry("k3".into()).or_default() += 1;
    }
    let add = |seen: &mut BTreeMap<String, u64>, calls: &BTreeMap<String, Vec<Instant>>| {
        for (id, c) in calls {
            *seen.entry(id.clone()).or_default() += c.len() as u64;
        }
    };
    // k1 and k2 call both nodes; k3 only node-1, which never crashes: its count is exact.
    let n0_keys = [("k1", k[0].as_str()), ("k2", k[1].as_str())];
    let n1_keys = [("k1", k[0].as_str()), ("k2", k[1].as_str()), ("k3", k[2].as_str())];
    let n1_load = Loads::start(n1.public, &n1_keys);
    let n0_load = Loads::start(n0.public, &n0_keys);

    // After 3 s of load (the scenario's length, not a wait for anything), kill -9 node-0
    // mid-window (3 to 8 s into it), its clients stopped just before (no call in flight
    // whose answer nobody saw); restart it. Its open window's calls are in its counts file.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let n0_spool = n0_dir.join("usage-spool");
    wait_mid_window(&n0_spool).await;
    let before_kill = n0_load.stop().await;
    n0.proc.signal(9);
    add(&mut seen, &before_kill);
    drop(n0);
    let pubkey = work.path().join("control.pub");
    let mut restart: Vec<&str> =
        vec!["--control", &cp.url, "--control-token", NODE_TOKEN, "--control-key", pubkey.to_str().unwrap()];
    restart.extend(kafka);
    restart.extend(["--usage-signing-key", key_files[0].as_str()]);
    let n0 = Node::start(&n0_dir.join("snapshot.json"), &restart);
    assert_eq!(spool_state(&n0).await["node"], "node-0");
    let n0_load = Loads::start(n0.public, &n0_keys);

    // Freeze the broker for 32 s under load: nothing is delivered, node-1's spool fills
    // and its windows wait in memory; both nodes keep serving. (3 s of load first, and the
    // 32 s, are the scenario's lengths: the claim is about a broker away for over 30 s.)
    tokio::time::sleep(Duration::from_secs(3)).await;
    broker.freeze();
    let frozen = Instant::now();
    let mut full = serde_json::Value::Null;
    let mut last = serde_json::Value::Null;
    while frozen.elapsed() < Duration::from_secs(32) {
        last = spool_state(&n1).await;
        if full.is_null() && last["spool"] == "degraded" {
            full = last.clone();
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    broker.thaw();
    eprintln!("broker frozen {} ms; node-1's spool while it was: {full}", frozen.elapsed().as_millis());
    assert!(
        full["spool_error"].as_str().unwrap_or_default().contains("full"),
        "the spool never filled: {last}\n{}",
        n1.log()
    );
    assert!(full["ship_error"].is_string() || last["ship_error"].is_string(), "{full}\n{last}\n{}", n1.log());

    // Load on a little (3 s of it), then stop every client.
    tokio::time::sleep(Duration::from_secs(3)).await;
    add(&mut seen, &n0_load.stop().await);
    add(&mut seen, &n1_load.stop().await);

    // Every window node-1 has had acknowledged so far, delivered again, as a node that
    // restarted before its acknowledgement was recorded would.
    let t = Instant::now();
    let end = Instant::now() + Duration::from_secs(60);
    let mut state;
    loop {
        state = spool_state(&n1).await;
        if state["acked"].as_u64() >= Some(2) && state["pending"].as_u64() == Some(0) {
            break;
        }
        assert!(Instant::now() < end, "node-1 did not drain after the broker came back: {state}\n{}", n1.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!("node-1 drained {} ms after the load stopped: {state}", t.elapsed().as_millis());
    let acked = state["acked"].as_u64().unwrap();
    let windows = get(&n1.admin_url(&format!("/usage/windows?from=1&to={acked}")), &[]).await;
    let windows: serde_json::Value = serde_json::from_slice(&windows.body).unwrap();
    let spooled: Vec<(u64, Vec<u8>)> = windows["windows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| (w["seq"].as_u64().unwrap(), serde_json::to_vec(w).unwrap()))
        .collect();
    let settings = postern_usage::kafka::KafkaSettings {
        brokers: broker.addr.clone(),
        topic: postern_model::usage::KAFKA_TOPIC.into(),
        options: Vec::new(),
        missing_poll: Duration::from_secs(30),
    };
    let resent = spooled.len() as u64;
    let signer = signers[1].clone();
    tokio::task::spawn_blocking(move || {
        let mut sink = postern_usage::kafka::KafkaSink::new(&settings, "node-1", None).unwrap().signed(Some(signer));
        postern_usage::Sink::send(&mut sink, &spooled).unwrap();
    })
    .await
    .unwrap();

    // Bad input on the stream: not a window, and a window whose ce_id names another.
    let producer: BaseProducer = rdkafka::ClientConfig::new().set("bootstrap.servers", &broker.addr).create().unwrap();
    producer
        .send(BaseRecord::<str, str>::to(postern_model::usage::KAFKA_TOPIC).key("key:k1").payload("{\"rows\":"))
        .unwrap();
    let mut forged = serde_json::json!({
        "node": "node-1", "seq": 9999, "start": 10,
        "rows": [{"caller": "k1", "kind": "key", "product": "search", "route": "t/search",
                  "status": [0, 1000, 0, 0, 0], "latency": vec![0u64; postern_model::usage::LATENCY_BUCKETS],
                  "latency_us": 0}],
    });
    forged["rows"][0]["latency"][0] = serde_json::json!(1000);
    let forged = forged.to_string();
    let send_forged = |headers: &[(&str, &str)]| {
        let headers = headers.iter().fold(rdkafka::message::OwnedHeaders::new(), |h, (key, value)| {
            h.insert(rdkafka::message::Header { key, value: Some(*value) })
        });
        producer
            .send(
                BaseRecord::<str, str>::to(postern_model::usage::KAFKA_TOPIC)
                    .key("key:k1")
                    .payload(&forged)
                    .headers(headers),
            )
            .unwrap();
    };
    send_forged(&[("ce_id", "node-1/1/0")]);
    // And one whose ce_id is its body's, but not signed by node-1's key: any writer of
    // the topic could have written it.
    send_forged(&[("ce_id", "node-1/9999/0"), (postern_model::usage::STREAM_SIGNATURE_HEADER, "ed25519:00")]);
    producer.flush(Duration::from_secs(10)).unwrap();

    // node-1 after the outage: its spool is writable again, and it counted failed sends.
    let state = spool_state(&n1).await;
    assert_eq!(state["spool"], "ok", "{state}");
    assert!(state["ship_errors"].as_u64() >= Some(1), "{state}");

    // Both nodes stop gracefully: every window, the open ones too, closes and ships, and
    // each spool then says how many windows its node numbered. Once the store holds all
    // of them, whole, and has consumed the bad and the repeated messages, nothing more
    // can change a total: billed == seen, exactly, for every key.
    let t = Instant::now();
    let (mut n0, mut n1) = (n0, n1);
    for node in [&n0, &n1] {
        node.proc.signal(15);
    }
    let end = Instant::now() + Duration::from_secs(60);
    while n0.proc.alive() || n1.proc.alive() {
        assert!(Instant::now() < end, "the nodes did not stop:\n{}\n{}", n0.log(), n1.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    wait_store_has(&cp, "node-0", numbered(&n0_spool)).await;
    wait_store_has(&cp, "node-1", numbered(&work.path().join("n1/usage-spool"))).await;
    wait_for("the stream's bad and repeated messages consumed", Duration::from_secs(60), async || {
        let stream = platform_get(&cp, "/v1/usage/stream").await;
        stream["rejected"].as_u64() >= Some(3) && stream["duplicates"].as_u64() >= Some(resent)
    })
    .await;
    let got = billed(&cp);
    eprintln!("seen {seen:?}; billed {got:?}; settled {} ms after the load", t.elapsed().as_millis());
    assert_eq!(got, seen, "billed == seen, exactly, for every key");

    // The report: node-0's crash (a recovered window), the duplicates dropped, no window
    // missing, the bad messages skipped.
    let nodes = platform_get(&cp, "/v1/usage/nodes").await;
    let (r0, r1) = (store_node(&cp, "node-0").await, store_node(&cp, "node-1").await);
    eprintln!("{nodes}");
    assert!(r0["recovered"].as_u64() >= Some(1), "{nodes}");
    assert_eq!((r0["missing"].as_u64(), r1["missing"].as_u64()), (Some(0), Some(0)), "{nodes}");
    assert!(r1["duplicates"].as_u64() >= Some(resent), "{nodes}");
    let stream = platform_get(&cp, "/v1/usage/stream").await;
    eprintln!("stream: {stream}");
    assert_eq!(stream["kafka"], true, "{stream}");
    assert_eq!(stream["rejected"].as_u64(), Some(3), "{stream}");
    let refusals = platform_get(&cp, "/v1/usage/refusals").await;
    let signature = refusals["refusals"].as_array().unwrap().iter().find(|r| r["rule"] == "usage_signature").cloned();
    assert_eq!(
        signature.as_ref().map(|r| (&r["node"], r["count"].as_u64())),
        Some((&"node-1".into(), Some(1))),
        "{refusals}"
    );
    assert!(stream["duplicates"].as_u64() >= Some(resent), "{stream}");
    drop((n0, n1, cp, echo, broker));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn windows_the_stream_no_longer_holds_are_asked_for_and_sent_again() {
    let Setup { broker, echo, repo, work, tokens, store } = setup();
    // The killed control plane's consumer leaves the group only when its session ends:
    // a short one, so its successor takes the partitions in seconds.
    let cp_args = [
        "--dwell",
        "0s",
        "--usage-kafka",
        broker.addr.as_str(),
        "--usage-kafka-option",
        "session.timeout.ms=6000",
        "--usage-kafka-option",
        "heartbeat.interval.ms=1000",
    ];
    let cp = serve(repo.path(), store.to_str().unwrap(), &tokens, &cp_args);
    let key = new_key(repo.path(), "k1", "app", "acme", "gold", &[]);
    ctl(&cp, &["publish"]);
    let node = start_node_with(
        &cp.url,
        &work.path().join("n0"),
        "node-0",
        &["--usage-kafka", &broker.addr, "--usage-kafka-missing-poll-s", "1"],
    );
    let call = async || get(&node.url("/search"), &[("x-api-key", &key)]).await.status == StatusCode::OK;
    wait_for("the node to take the key", Duration::from_secs(15), call).await;
    let mut seen = 1;
    for _ in 0..30 {
        assert!(call().await);
        seen += 1;
    }
    wait_for("the first calls billed", Duration::from_secs(30), async || billed(&cp).get("k1") == Some(&seen)).await;

    // The usage store is lost, and the stream has moved past those windows (the consumer
    // group committed them): the next window's number shows the gap, the node hears of
    // it from the control plane and sends the windows again from its spool, through Kafka.
    let listen = cp.url.trim_start_matches("http://").to_owned();
    drop(cp);
    for f in ["usage.db", "usage.db-wal", "usage.db-shm"] {
        let _ = std::fs::remove_file(store.join(f));
    }
    let mut args = cp_args.to_vec();
    args.extend(["--listen", &listen]);
    let cp = serve(repo.path(), store.to_str().unwrap(), &tokens, &args);
    assert_eq!(billed(&cp).get("k1"), None);
    for _ in 0..20 {
        assert!(call().await);
        seen += 1;
    }
    let t = Instant::now();
    let end = Instant::now() + Duration::from_secs(45);
    while billed(&cp).get("k1") != Some(&seen) {
        if Instant::now() > end {
            let nodes = platform_get(&cp, "/v1/usage/nodes").await;
            panic!("billed {:?} of {seen}; {nodes}; {}\n{}", billed(&cp), spool_state(&node).await, node.log());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("{seen} calls billed again {} ms after the last call", t.elapsed().as_millis());
    let nodes = platform_get(&cp, "/v1/usage/nodes").await;
    assert_eq!(nodes["nodes"][0]["missing"].as_u64(), Some(0), "{nodes}");
    let state = spool_state(&node).await;
    assert!(state["resent"].as_u64() >= Some(1), "{state}");
    assert_eq!(state["resend_unavailable"].as_u64(), Some(0), "{state}");
    assert!(node.log().contains("the usage store lacks windows"), "{}", node.log());
    drop((node, cp, echo, broker));
}
