//! A client that reads nothing of the answers it asked for cannot take a cluster from the
//! other clients: its connections are closed after the send bound, with every backend
//! request of their streams cancelled, and while they last it holds at most its share of
//! the busy cluster (`--client-share-percent`, `--address-share-percent`).

#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::net::IpAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::StatusCode;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use postern_e2e::{Echo, Node, Repo};

/// The cluster's cap: busy (shares apply) from 50 in flight on.
const CAP: u32 = 100;
const ATTACK_CONNECTIONS: usize = 5;
const STREAMS: usize = 30;

/// A client whose connections leave from `from` (any address of 127.0.0.0/8 reaches the
/// node's loopback listener, so each stands for another client).
fn connector(from: &str) -> HttpConnector {
    let mut c = HttpConnector::new();
    c.set_local_address(Some(from.parse::<IpAddr>().unwrap()));
    c
}

/// An HTTP/2 client that grants the node no window: the node can send it answer heads,
/// never a byte of their bodies.
fn reads_nothing(from: &str) -> Client<HttpConnector, Empty<Bytes>> {
    Client::builder(TokioExecutor::new())
        .http2_only(true)
        .http2_initial_stream_window_size(0)
        .http2_adaptive_window(false)
        .build(connector(from))
}

async fn metric(node: &Node, series: &str) -> u64 {
    node.metric(series).await
}

/// Waits (a hang guard, not a timing claim) until `check` holds.
async fn wait_until(what: &str, mut check: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !check().await {
        assert!(Instant::now() < deadline, "{what}: not within 60 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_reads_nothing_is_cut_off_and_never_holds_more_than_its_share() {
    let echo = Echo::start("e");
    let repo = Repo::new();
    repo.write(
        "platform/clusters.yaml",
        &format!("clusters:\n  e:\n    endpoints: [\"{}\"]\n    maxConnections: {CAP}\n", echo.addr()),
    );
    repo.write("platform/ownership.yaml", "owners:\n  - { host: \"*\", pathPrefix: /, team: t }\n");
    repo.write(
        "teams/t/routes.yaml",
        "routes:\n  - name: e\n    public: true\n    match: { path: { value: /e } }\n    backendRefs: [{ name: e }]\n    timeouts: { connect: 1s, response: 5s }\n",
    );
    let snap = repo.path().join("out/snapshot.json");
    std::fs::create_dir_all(snap.parent().unwrap()).unwrap();
    repo.compile_ok(&snap);
    let node = Node::start(&snap, &["--downstream-idle-timeout-s", "2"]);
    let in_flight = "postern_upstream_in_flight{cluster=\"e\"}";

    // A well-behaved client from another address: one call at a time.
    let polite = Client::builder(TokioExecutor::new()).build::<_, Empty<Bytes>>(connector("127.0.0.2"));
    let call = async |client: &Client<HttpConnector, Empty<Bytes>>| {
        let t = Instant::now();
        let resp = client.get(node.url("/e").parse().unwrap()).await.expect("the polite client's call");
        let status = resp.status();
        let _ = resp.into_body().collect().await;
        (status, t.elapsed())
    };
    let mut baseline = Vec::new();
    for _ in 0..20 {
        let (status, took) = call(&polite).await;
        assert_eq!(status, StatusCode::OK);
        baseline.push(took);
    }
    let connections_before = metric(&node, "postern_upstream_connections{cluster=\"e\"}").await;

    // The attack: from 127.0.0.1, connections that ask for 10 MiB answers and take none.
    let mut attackers = Vec::new();
    for _ in 0..ATTACK_CONNECTIONS {
        attackers.push(reads_nothing("127.0.0.1"));
    }
    let mut asked = Vec::new();
    for a in &attackers {
        for _ in 0..STREAMS {
            asked.push(a.get(node.url("/e?bytes=10485760").parse().unwrap()));
        }
    }
    let answers = futures_util::future::join_all(asked).await;
    let (mut held, mut refused) = (Vec::new(), 0);
    let mut holding = std::collections::BTreeSet::new();
    for (i, a) in answers.into_iter().enumerate() {
        let resp = a.expect("an answer head");
        match resp.status() {
            StatusCode::OK => {
                holding.insert(i / STREAMS);
                held.push(resp);
            }
            // Its body cannot reach a client that grants no window: the code is counted.
            StatusCode::SERVICE_UNAVAILABLE => {
                assert_eq!(resp.headers()["retry-after"], "1");
                refused += 1;
            }
            other => panic!("the attacker got {other}"),
        }
    }
    eprintln!("attacker: {} answers held on {} connections, {refused} refused its share", held.len(), holding.len());
    // Past half the cap the address holds its 25 % and more: everything it asks is refused,
    // so it holds no more than half the cluster.
    assert!(held.len() <= (CAP / 2) as usize, "the attacker holds {} places of {CAP}", held.len());
    assert_eq!(held.len() + refused, ATTACK_CONNECTIONS * STREAMS);
    assert!(refused > 0, "the share never applied");
    assert_eq!(metric(&node, "postern_gateway_errors_total{code=\"client_share_exceeded\"}").await, refused as u64);

    // An HTTP/1 client that stops reading: its socket fills, then its answer waits on it.
    let h1 = {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.3:0".parse().unwrap()).unwrap();
        let mut s = socket.connect(format!("127.0.0.1:{}", node.public).parse().unwrap()).await.unwrap();
        tokio::io::AsyncWriteExt::write_all(&mut s, b"GET /e?bytes=268435456 HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        s
    };

    // Meanwhile the polite client is served, every call.
    let mut during = Vec::new();
    for _ in 0..20 {
        let (status, took) = call(&polite).await;
        assert_eq!(status, StatusCode::OK, "the polite client during the attack");
        during.push(took);
    }
    baseline.sort();
    during.sort();
    eprintln!("polite client: slowest of 20 {:?} before, {:?} during the attack", baseline[19], during[19]);

    // Past the send bound every connection holding an answer its client takes nothing
    // of is closed (the HTTP/1 one too): each held answer ends in an error, its backend
    // request is cancelled and the cluster's places come back.
    wait_until("the attacking connections closed", async || {
        metric(&node, "postern_connections_stalled_total").await == holding.len() as u64 + 1
    })
    .await;
    for resp in held {
        let read = tokio::time::timeout(Duration::from_secs(30), resp.into_body().collect()).await;
        assert!(matches!(read, Ok(Err(_))), "a held answer did not end in an error: {read:?}");
    }
    wait_until("the cluster's places back", async || metric(&node, in_flight).await == 0).await;
    wait_until("the backend connections back to their number before", async || {
        metric(&node, "postern_upstream_connections{cluster=\"e\"}").await <= connections_before
    })
    .await;
    drop(h1);
    let (status, _) = call(&polite).await;
    assert_eq!(status, StatusCode::OK);
}
