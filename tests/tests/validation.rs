//! Request validation compiled from a team's OpenAPI spec, through a real node on the
//! demo config (`examples/config`: the orders team's `create-order` and `get-order`
//! routes validate against `teams/orders/openapi/orders.yaml`): a valid order passes, a
//! body with several bad fields gets one 400 naming every pointer, a media type the
//! operation does not declare gets 415, bad JSON and bad parameters get 400, a gzip
//! body is decoded under the route's limit and a gzip bomb gets 413; nothing invalid
//! reaches the backend.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::io::Write;

use http::{Method, StatusCode};
use postern_e2e::{Echo, Node, Repo, get, send};

const ORDER: &str = r#"{
  "customerId": "cus_8f3kQ2xZ91ab",
  "currency": "GBP",
  "items": [
    {"sku": "ABC-1001", "quantity": 2, "unitPrice": 19.99, "bundle": [{"sku": "ABC-1002", "quantity": 1, "unitPrice": 1}]},
    {"sku": "XYZ-2002", "quantity": 1, "unitPrice": 5, "giftWrap": true}
  ],
  "shipping": {"name": "Ada Lovelace", "line1": "12 St James's Square", "line2": null, "city": "London",
               "postalCode": "SW1Y 4JH", "country": "GB", "email": "ada@example.com"},
  "billing": null,
  "coupon": null,
  "requestedDelivery": "2026-12-20"
}"#;

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

fn pointers(r: &postern_e2e::Resp) -> Vec<String> {
    let mut p: Vec<String> = r.json()["errors"]
        .as_array()
        .unwrap_or_else(|| panic!("no errors: {:?}", r.body))
        .iter()
        .map(|e| format!("{}:{}", e["in"].as_str().unwrap(), e["pointer"].as_str().unwrap()))
        .collect();
    p.sort();
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_are_validated_against_the_teams_openapi_spec() {
    let echos = [Echo::start("echo"), Echo::start("orders-v1"), Echo::start("orders-v2")];
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config");
    postern_e2e::prepare_example_config(&config, &echos.iter().map(Echo::addr).collect::<Vec<_>>());
    let key = postern_e2e::new_key(&config, "w-1", "writer", "acme", "partner", &["orders:write", "orders:read"]);
    let snap = dir.path().join("snapshot.json");
    postern_e2e::ConfigDir(&config).compile_ok(&snap);
    let node = Node::start(&snap, &[]);
    let url = node.url("/v1/orders");
    let json = [("x-api-key", key.as_str()), ("content-type", "application/json")];
    let backend = &echos[1];

    // A valid order passes, whole.
    let r = send(Method::POST, &url, &json, ORDER).await;
    assert_eq!(r.status, StatusCode::OK, "{:?}\n{}", r.body, node.log());
    assert_eq!(r.json()["body_bytes"], ORDER.len());
    let passed = backend.count().await;

    // Two bad fields (and a missing one): one 400 naming every pointer.
    let mut bad: serde_json::Value = serde_json::from_str(ORDER).unwrap();
    bad["items"][1]["quantity"] = 0.into();
    bad["shipping"]["country"] = "gb".into();
    bad.as_object_mut().unwrap().remove("currency");
    let r = send(Method::POST, &url, &json, serde_json::to_vec(&bad).unwrap()).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{:?}", r.body);
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    assert_eq!(r.json()["code"], "validation_failed");
    assert_eq!(pointers(&r), ["body:/currency", "body:/items/1/quantity", "body:/shipping/country"]);
    // A recursive schema: a bundle inside an item is checked as an item.
    let mut nested: serde_json::Value = serde_json::from_str(ORDER).unwrap();
    nested["items"][0]["bundle"][0]["sku"] = "nope".into();
    let r = send(Method::POST, &url, &json, serde_json::to_vec(&nested).unwrap()).await;
    assert_eq!(pointers(&r), ["body:/items/0/bundle/0/sku"]);
    // OpenAPI 3.0's `nullable` admits null where it says so, and only there.
    let mut null: serde_json::Value = serde_json::from_str(ORDER).unwrap();
    null["notes"] = serde_json::Value::Null;
    let r = send(Method::POST, &url, &json, serde_json::to_vec(&null).unwrap()).await;
    assert_eq!(pointers(&r), ["body:/notes"]);

    // A media type the operation does not declare: 415, whatever its spelling.
    for ct in ["text/plain", "application/json; charset=latin1", "application/x-www-form-urlencoded"] {
        let r = send(Method::POST, &url, &[("x-api-key", &key), ("content-type", ct)], ORDER).await;
        assert_eq!(r.status, StatusCode::UNSUPPORTED_MEDIA_TYPE, "{ct}: {:?}", r.body);
        assert_eq!(r.json()["code"], "unsupported_media_type");
    }
    // Media types compare without regard to case: still validated.
    let r = send(Method::POST, &url, &[("x-api-key", &key), ("content-type", "Application/JSON")], "{}").await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);

    // JSON the reader refuses: a duplicate key, a lone surrogate, too deep.
    for body in [
        r#"{"currency":"GBP","currency":"EUR"}"#.to_owned(),
        r#"{"notes":"\ud800"}"#.to_owned(),
        format!("{}{}", "[".repeat(100), "]".repeat(100)),
    ] {
        let r = send(Method::POST, &url, &json, body).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST);
        assert_eq!(r.json()["code"], "invalid_json", "{:?}", r.body);
    }
    // Parameters: a query flag of the wrong type, a header too short.
    let r =
        send(Method::POST, &node.url("/v1/orders?dryRun=maybe"), &[json[0], json[1], ("x-tenant", "a")], ORDER).await;
    assert_eq!(pointers(&r), ["header:/x-tenant", "query:/dryRun"]);
    // A path parameter off its pattern (get-order validates too).
    let r = get(&node.url("/v1/orders/abc"), &[("x-api-key", &key)]).await;
    assert_eq!(pointers(&r), ["path:/id"]);
    let r = get(&node.url("/v1/orders/42"), &[("x-api-key", &key)]).await;
    assert_eq!(r.status, StatusCode::OK);
    let passed = passed + 1;

    // A gzip body is decoded, validated and forwarded decoded.
    let gz = [json[0], json[1], ("content-encoding", "gzip")];
    let r = send(Method::POST, &url, &gz, gzip(ORDER.as_bytes())).await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    assert_eq!(r.json()["body_bytes"], ORDER.len());
    assert!(r.echoed("content-encoding").is_none());
    // A gzip bomb (10 MiB of spaces in 10 KiB) is refused once past the route's 64 KiB.
    let bomb = gzip(&vec![b' '; 10 << 20]);
    assert!(bomb.len() < 64 * 1024);
    let r = send(Method::POST, &url, &gz, bomb).await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE, "{:?}", r.body);
    assert_eq!(r.json()["code"], "payload_too_large");
    // A coding the gateway does not decode.
    let r = send(Method::POST, &url, &[json[0], json[1], ("content-encoding", "compress")], ORDER).await;
    assert_eq!(r.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    assert_eq!(r.json()["code"], "unsupported_encoding");

    // Nothing invalid reached the backend: only the two valid requests after the first.
    assert_eq!(backend.count().await, passed + 1);
}

/// Reads a response's frames: (the body, when the first data frame arrived, when the
/// body ended).
async fn frames(
    resp: http::Response<hyper::body::Incoming>,
    t: std::time::Instant,
) -> (Vec<u8>, std::time::Duration, std::time::Duration) {
    use http_body_util::BodyExt;
    let mut body = resp.into_body();
    let mut out = Vec::new();
    let mut first = None;
    while let Some(f) = body.frame().await {
        if let Some(d) = f.unwrap().data_ref() {
            first.get_or_insert_with(|| t.elapsed());
            out.extend_from_slice(d);
        }
    }
    (out, first.unwrap_or_default(), t.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_are_compressed_as_they_stream() {
    use std::io::Read;
    let echo = Echo::start("e");
    let repo = Repo::new();
    postern_e2e::platform(&repo, &[("e", &echo.addr())]);
    repo.write(
        "teams/t/routes.yaml",
        "routes:
  - name: c
    public: true
    match: { path: { value: /c } }
    backendRefs: [{ name: e }]
    timeouts: { connect: 1s, response: 2s }
    compress: { minBytes: 2048 }
  - name: plain
    public: true
    match: { path: { value: /plain } }
    backendRefs: [{ name: e }]
    timeouts: { connect: 1s, response: 2s }
",
    );
    let snap = repo.path().join("snapshot.json");
    repo.compile_ok(&snap);
    let node = Node::start(&snap, &[]);
    let client = postern_e2e::client();
    let fetch = |path: &str, accept: &str| {
        let mut req = http::Request::get(node.url(path));
        if !accept.is_empty() {
            req = req.header("accept-encoding", accept);
        }
        client.request(req.body(http_body_util::Full::new(bytes::Bytes::new())).unwrap())
    };

    // Four 64 KiB chunks of text 400 ms apart: compressed, and streamed (the first bytes
    // arrive long before the last).
    for (accept, coding) in [("gzip", "gzip"), ("gzip, br", "br"), ("br, zstd, gzip", "zstd")] {
        let t = std::time::Instant::now();
        let resp = fetch("/c?bytes=262144&type=text/plain&pace_ms=400", accept).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        let h = resp.headers().clone();
        assert_eq!(h["content-encoding"], coding);
        assert_eq!(h["vary"], "accept-encoding");
        assert!(!h.contains_key("content-length"));
        let (body, first, all) = frames(resp, t).await;
        assert!(body.len() < 10_000, "{coding}: {} bytes", body.len());
        assert!(all >= std::time::Duration::from_millis(1100), "{all:?}");
        assert!(first + std::time::Duration::from_millis(800) < all, "streamed: first {first:?}, all {all:?}");
        let mut plain = Vec::new();
        match coding {
            "gzip" => flate2::read::GzDecoder::new(&body[..]).read_to_end(&mut plain).unwrap(),
            "br" => brotli::Decompressor::new(&body[..], 4096).read_to_end(&mut plain).unwrap(),
            _ => zstd::stream::read::Decoder::new(&body[..]).unwrap().read_to_end(&mut plain).unwrap(),
        };
        assert_eq!(plain, vec![b'x'; 262_144], "{coding}");
    }
    // Not compressed: a client that accepts none, media already compressed, an answer
    // under the route's threshold, a route that did not opt in.
    for (path, accept) in [
        ("/c?bytes=65536&type=text/plain", ""),
        ("/c?bytes=65536&type=image/png", "gzip"),
        ("/c?x=1", "gzip"),
        ("/plain?bytes=65536&type=text/plain", "gzip"),
    ] {
        let resp = fetch(path, accept).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        assert!(!resp.headers().contains_key("content-encoding"), "{path} {accept}");
    }
}
