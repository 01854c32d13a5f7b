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

/// Guards against a hang only.
const HANG: std::time::Duration = std::time::Duration::from_secs(30);

/// A backend whose answers' bodies the test writes: each request hands the test the
/// sender of its body (`text/plain`, no length; the body ends when the sender is dropped).
async fn written_backend()
-> (String, tokio::sync::mpsc::UnboundedReceiver<tokio::sync::mpsc::UnboundedSender<bytes::Bytes>>) {
    use http_body_util::BodyExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (requests, arrived) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let requests = requests.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |_req: http::Request<hyper::body::Incoming>| {
                    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<bytes::Bytes>();
                    let _ = requests.send(tx);
                    let frames = futures_util::stream::unfold(rx, |mut rx| async move {
                        let chunk = rx.recv().await?;
                        Some((Ok::<_, std::convert::Infallible>(hyper::body::Frame::data(chunk)), rx))
                    });
                    let resp = http::Response::builder()
                        .header("content-type", "text/plain")
                        .body(http_body_util::StreamBody::new(frames).boxed())
                        .unwrap();
                    async move { Ok::<_, std::convert::Infallible>(resp) }
                });
                let io = hyper_util::rt::TokioIo::new(stream);
                let _ = hyper::server::conn::http1::Builder::new().serve_connection(io, svc).await;
            });
        }
    });
    (addr, arrived)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_are_compressed_as_they_stream() {
    use http_body_util::BodyExt;
    use std::io::Read;
    let echo = Echo::start("e");
    let (written, mut arrived) = written_backend().await;
    let repo = Repo::new();
    postern_e2e::platform(&repo, &[("e", &echo.addr()), ("w", &written)]);
    repo.write(
        "teams/t/routes.yaml",
        &[
            COMPRESSED_ROUTES,
            "  - name: plain
    public: true
    match: { path: { value: /plain } }
    backendRefs: [{ name: e }]
    timeouts: { connect: 1s, response: 2s }
",
        ]
        .concat(),
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

    // Four 64 KiB chunks of text, the backend sending the next only once the client has
    // had compressed bytes of the first: compressed, and streamed (were the body held
    // back until the backend's last chunk, the first bytes would never come).
    let chunk = bytes::Bytes::from(vec![b'x'; 65_536]);
    for (accept, coding) in [("gzip", "gzip"), ("gzip, br", "br"), ("br, zstd, gzip", "zstd")] {
        let pending = tokio::spawn(fetch("/stream", accept));
        // The request reaches the backend, which starts its answer with the first chunk.
        let sender = tokio::time::timeout(HANG, arrived.recv()).await.expect("the request never reached the backend");
        let sender = sender.unwrap();
        sender.send(chunk.clone()).unwrap();
        let resp = tokio::time::timeout(HANG, pending).await.expect("no answer's head").unwrap().unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        let h = resp.headers().clone();
        assert_eq!(h["content-encoding"], coding);
        assert_eq!(h["vary"], "accept-encoding");
        assert!(!h.contains_key("content-length"));
        let mut resp_body = resp.into_body();
        let mut body = Vec::new();
        while body.is_empty() {
            let frame = tokio::time::timeout(HANG, resp_body.frame())
                .await
                .unwrap_or_else(|_| panic!("{coding}: no compressed bytes while the backend held its other chunks"))
                .expect("the body ended before its first bytes")
                .unwrap();
            if let Some(d) = frame.data_ref() {
                body.extend_from_slice(d);
            }
        }
        // Only now the rest, and the end.
        for _ in 0..3 {
            sender.send(chunk.clone()).unwrap();
        }
        drop(sender);
        let rest = tokio::time::timeout(HANG, resp_body.collect())
            .await
            .unwrap_or_else(|_| panic!("{coding}: the body never ended"))
            .unwrap()
            .to_bytes();
        body.extend_from_slice(&rest);
        assert!(body.len() < 10_000, "{coding}: {} bytes", body.len());
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

/// Two compressed routes: `/c` on the echo backend `e`, `/stream` on the written
/// backend `w`.
const COMPRESSED_ROUTES: &str = "routes:
  - name: c
    public: true
    match: { path: { value: /c } }
    backendRefs: [{ name: e }]
    timeouts: { connect: 1s, response: 2s }
    compress: { minBytes: 2048 }
  - name: stream
    public: true
    match: { path: { value: /stream } }
    backendRefs: [{ name: w }]
    timeouts: { connect: 1s, response: 30s, bodyIdle: 30s, bodyTotal: 60s }
    compress: { minBytes: 2048 }
";

/// The node compresses at most `--max-compressing-streams` answers at once (each holds an
/// encoder's window for its stream's life): past it, an answer goes out whole and
/// uncompressed, counted; a place is given back when its stream ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_compresses_at_most_its_cap_of_streams_at_once() {
    use http_body_util::BodyExt;
    let echo = Echo::start("e");
    let (written, mut arrived) = written_backend().await;
    let repo = Repo::new();
    postern_e2e::platform(&repo, &[("e", &echo.addr()), ("w", &written)]);
    repo.write("teams/t/routes.yaml", COMPRESSED_ROUTES);
    let snap = repo.path().join("snapshot.json");
    repo.compile_ok(&snap);
    let node = Node::start(&snap, &["--max-compressing-streams", "2"]);
    let client = postern_e2e::client();
    let fetch = |path: &str| {
        let req = http::Request::get(node.url(path)).header("accept-encoding", "zstd, gzip");
        client.request(req.body(http_body_util::Full::new(bytes::Bytes::new())).unwrap())
    };
    const SKIPPED: &str = "postern_compression_skipped_total{reason=\"node_cap\"}";
    assert_eq!(node.metric("postern_compressing_streams_max").await, 2);

    // Two streams the backend holds open take both places.
    let mut held = Vec::new();
    for _ in 0..2 {
        let pending = tokio::spawn(fetch("/stream"));
        let sender = tokio::time::timeout(HANG, arrived.recv()).await.expect("never reached the backend").unwrap();
        sender.send(bytes::Bytes::from(vec![b'x'; 65_536])).unwrap();
        let resp = tokio::time::timeout(HANG, pending).await.expect("no answer's head").unwrap().unwrap();
        assert_eq!(resp.headers()["content-encoding"], "zstd");
        held.push((sender, resp));
    }
    assert_eq!(node.metric("postern_compressing_streams").await, 2);

    // A third answer worth compressing goes out as the backend sent it, whole.
    let resp = fetch("/c?bytes=65536&type=text/plain").await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert!(!resp.headers().contains_key("content-encoding"), "compressed past the cap");
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body.len(), 65_536);
    assert_eq!(node.metric(SKIPPED).await, 1);
    assert_eq!(node.metric("postern_compressing_streams").await, 2);

    // The held streams end; their places come back and the next answer is compressed.
    for (sender, resp) in held {
        drop(sender);
        tokio::time::timeout(HANG, resp.into_body().collect()).await.expect("the body never ended").unwrap();
    }
    postern_e2e::control_plane::wait_for("the places given back", HANG, async || {
        node.metric("postern_compressing_streams").await == 0
    })
    .await;
    let resp = fetch("/c?bytes=65536&type=text/plain").await.unwrap();
    assert_eq!(resp.headers()["content-encoding"], "zstd");
    assert_eq!(node.metric(SKIPPED).await, 1);
}

/// A number of 2^53 or more that is no double's exact value nor its shortest decimal
/// would be judged as the double next to it (`100000000000000000001` passes
/// `maximum: 1e20` as 1e20): it is refused, 400 `invalid_json`, and never reaches the
/// backend; a number that names a double is judged exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn big_integers_are_judged_as_sent_or_refused() {
    let echo = Echo::start("e");
    let repo = Repo::new();
    postern_e2e::platform(&repo, &[("e", &echo.addr())]);
    repo.write(
        "teams/t/openapi/ledger.yaml",
        r#"openapi: 3.0.3
info: { title: Ledger, version: "1" }
paths:
  /entries:
    post:
      operationId: postEntry
      requestBody:
        required: true
        content:
          application/json:
            schema:
              type: object
              properties:
                amount: { type: integer, maximum: 1.0e+20 }
                code: { enum: [9007199254740993] }
      responses:
        "201": { description: created }
"#,
    );
    repo.write(
        "teams/t/routes.yaml",
        "routes:
  - name: ledger
    public: true
    match: { path: { value: /entries } }
    backendRefs: [{ name: e }]
    timeouts: { connect: 1s, response: 2s }
    validate: { openapi: ledger.yaml, operationId: postEntry }
",
    );
    let snap = repo.path().join("snapshot.json");
    repo.compile_ok(&snap);
    let node = Node::start(&snap, &[]);
    let url = node.url("/entries");
    let post = |body: &'static str| send(Method::POST, &url, &[("content-type", "application/json")], body);
    // Past the bound, however it is spelt: refused by the reader or by the bound.
    for body in [
        r#"{"amount": 100000000000000000001}"#,
        r#"{"amount": 100000000000000000000.5}"#,
        r#"{"amount": 1.00000000000000000001e20}"#,
    ] {
        let r = post(body).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(r.json()["code"], "invalid_json", "{body}: {:?}", r.body);
        assert!(r.json()["detail"].as_str().unwrap().contains("does not name a double"), "{:?}", r.body);
    }
    let r = post(r#"{"amount": 100000000000000000002e1}"#).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{:?}", r.body);
    // Past the bound by a whole double: the bound refuses it.
    let r = post(r#"{"amount": 100000000000000016384}"#).await;
    assert_eq!(pointers(&r), ["body:/amount"]);
    // An enum of a 64-bit integer past 2^53: its neighbour is not it.
    let r = post(r#"{"code": 9007199254740992}"#).await;
    assert_eq!(pointers(&r), ["body:/code"]);
    let r = post(r#"{"code": 9007199254740992.0}"#).await;
    assert_eq!(pointers(&r), ["body:/code"]);
    let r = post(r#"{"code": 9007199254740993.0}"#).await;
    assert_eq!(r.json()["code"], "invalid_json", "{:?}", r.body);
    assert_eq!(echo.count().await, 0, "nothing refused reached the backend");
    // At the bound, in any spelling that names it; the enum's own value.
    for body in [r#"{"amount": 100000000000000000000}"#, r#"{"amount": 1e20}"#, r#"{"code": 9007199254740993}"#] {
        let r = post(body).await;
        assert_eq!(r.status, StatusCode::OK, "{body}: {:?}", r.body);
    }
    assert_eq!(echo.count().await, 3);
}
