//! REST→gRPC transcoding through a real node on the demo config, to the real gRPC
//! service of `examples/grpc` (postern-grpc-echo, tonic over h2c): the `orders-grpc`
//! route takes JSON on the paths the service's `google.api.http` annotations give
//! (teams/orders/proto/orders.proto, compiled by posternctl), answers with the JSON the
//! proto defines, refuses an unknown field or query parameter by name, and maps gRPC
//! statuses to HTTP problems (NOT_FOUND → 404).
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use http::{Method, StatusCode};
use postern_e2e::{Echo, Node, get, send};

/// The gRPC service on an ephemeral port, killed on drop.
struct Grpc {
    child: std::process::Child,
    addr: String,
}

impl Drop for Grpc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn grpc() -> Grpc {
    let mut child = Command::new(postern_e2e::bin("postern-grpc-echo"))
        .args(["--listen", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("postern-grpc-echo");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let addr = line.trim().strip_prefix("listening on ").unwrap_or_else(|| panic!("{line:?}")).to_owned();
    Grpc { child, addr }
}

fn errors(r: &postern_e2e::Resp) -> Vec<String> {
    r.json()["errors"]
        .as_array()
        .unwrap_or_else(|| panic!("no errors: {:?}", r.body))
        .iter()
        .map(|e| format!("{}:{}", e["in"].as_str().unwrap(), e["pointer"].as_str().unwrap()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_calls_reach_the_grpc_service_and_come_back_as_json() {
    let service = grpc();
    let echos = [Echo::start("echo"), Echo::start("orders-v1"), Echo::start("orders-v2")];
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config");
    let mut endpoints: Vec<String> = echos.iter().map(Echo::addr).collect();
    endpoints.push(service.addr.clone());
    postern_e2e::prepare_example_config(&config, &endpoints);
    let key = postern_e2e::new_key(&config, "g-1", "grpc-app", "acme", "partner", &["orders:read"]);
    let snap = dir.path().join("snapshot.json");
    postern_e2e::ConfigDir(&config).compile_ok(&snap);
    let node = Node::start(&snap, &[]);
    let auth = [("x-api-key", key.as_str())];

    // GetOrder: the JSON the proto defines (lowerCamelCase names, int64 as a string,
    // enums by name, Timestamp in RFC 3339).
    let r = get(&node.url("/v3/orders/42"), &auth).await;
    assert_eq!(r.status, StatusCode::OK, "{:?}\n{}", r.body, node.log());
    assert_eq!(r.header("content-type"), Some("application/json"));
    let o = r.json();
    assert_eq!(o["id"], "42");
    assert_eq!(o["customerId"], "cus_8f3kQ2xZ91ab");
    assert_eq!(o["status"], "PAID");
    assert_eq!(o["version"], "7");
    assert_eq!(o["createdAt"], "2026-01-01T00:00:00Z");
    assert_eq!(o["total"]["currencyCode"], "GBP");
    assert!(o.get("items").is_none(), "items only when asked (and empty fields are left out)");
    assert!(r.header("grpc-status").is_none());
    // A query parameter binds a field of the request message.
    let r = get(&node.url("/v3/orders/42?include_items=true"), &auth).await;
    assert_eq!(r.json()["items"].as_array().map(Vec::len), Some(2), "{:?}", r.body);

    // Strict: an unknown query parameter or JSON field is a 400 naming it.
    let r = get(&node.url("/v3/orders/42?colour=red"), &auth).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.json()["code"], "validation_failed");
    assert_eq!(errors(&r), ["query:/colour"]);
    let json = [auth[0], ("content-type", "application/json")];
    let r =
        send(Method::POST, &node.url("/v3/shops/acme/orders"), &json, r#"{"customerId":"cus_1","colour":"red"}"#).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(errors(&r), ["body:/colour"]);

    // CreateOrder with its body field and a query parameter; the service's answer.
    let order = r#"{"customerId":"cus_9Zx81Qa2","items":[{"sku":"ABC-1001","quantity":2,"unitPrice":{"currencyCode":"GBP","units":"5"}}]}"#;
    let r = send(Method::POST, &node.url("/v3/shops/acme/orders?request_id=req-1"), &json, order).await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    let created = r.json();
    assert_eq!(created["id"], "1000");
    assert_eq!(created["status"], "PENDING");
    assert_eq!(created["labels"]["request_id"], "req-1");

    // A gRPC status becomes an HTTP problem through the one table.
    let r = get(&node.url("/v3/orders/7"), &auth).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    assert_eq!(r.json()["code"], "not_found");
    assert_eq!(r.json()["grpc_status"], 5);
    assert_eq!(r.json()["detail"], "order 7 not found");
    let r = send(Method::POST, &node.url("/v3/shops/acme/orders"), &json, r#"{"customerId":"cus_1"}"#).await;
    assert_eq!((r.status, r.json()["code"].as_str()), (StatusCode::BAD_REQUEST, Some("invalid_argument")));
    let r = get(&node.url("/v3/orders/boom"), &auth).await;
    assert_eq!((r.status, r.json()["code"].as_str()), (StatusCode::INTERNAL_SERVER_ERROR, Some("internal")));

    // Server streaming: one JSON object per line.
    let r = get(&node.url("/v3/shops/acme/orders"), &auth).await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    assert_eq!(r.header("content-type"), Some("application/x-ndjson"));
    let ids: Vec<String> = std::str::from_utf8(&r.body)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(ids, ["42", "1000"]);

    // Paths the annotations do not bind: 405 with Allow, or 404.
    let r = send(Method::DELETE, &node.url("/v3/orders/42"), &auth, "").await;
    assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED);
    let r = get(&node.url("/v3/nothing"), &auth).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    // The route still authenticates first.
    assert_eq!(get(&node.url("/v3/orders/42"), &[]).await.status, StatusCode::UNAUTHORIZED);

    // A compressed body is decoded under the route's limit (64 KiB here, at most 1 MiB
    // on a transcoded route): a gzip order is taken, a gzip bomb is refused.
    let gzip = |data: &[u8]| {
        use std::io::Write as _;
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    };
    let gz = [auth[0], ("content-type", "application/json"), ("content-encoding", "gzip")];
    let r = send(Method::POST, &node.url("/v3/shops/acme/orders"), &gz, gzip(order.as_bytes())).await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    assert_eq!(r.json()["status"], "PENDING");
    // 10 MiB of spaces around the order in about 10 KiB.
    let mut bomb = vec![b' '; 10 << 20];
    bomb[..order.len()].copy_from_slice(order.as_bytes());
    let bomb = gzip(&bomb);
    assert!(bomb.len() < 64 * 1024 && bomb.len() as u64 * 100 > 64 * 1024, "{}", bomb.len());
    let r = send(Method::POST, &node.url("/v3/shops/acme/orders"), &gz, bomb).await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE, "{:?}", r.body);
    assert_eq!(r.json()["code"], "payload_too_large");
}
