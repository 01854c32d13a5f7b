//! OpenTelemetry traces end to end: a control plane, a node exporting OTLP/HTTP to a
//! real receiver on 127.0.0.1 that decodes each export with the OpenTelemetry proto
//! types, and an echo backend. A server error is traced with the client's trace id and
//! parent, with auth, rate-limit and upstream spans as its children (the upstream span
//! is the parent the backend was sent); `posternctl trace --key` traces every request of
//! that key, and none after the flag's expiry; no credential reaches a span; a collector
//! that is down costs counted spans, never a request.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use postern_e2e::control_plane::*;
use postern_e2e::{Echo, Node, Repo, get, new_key, platform};
use prost::Message;

const PLANS: &str = "scopes: []\nproducts: [search]\nplans:\n  gold:\n    products: [search]\n    rateLimit: { rps: 1000, burst: 1000 }\n";
const ROUTES: &str = "routes:\n  - name: search\n    match: { path: { value: /search } }\n    auth: { methods: [apiKey], product: search }\n    backendRefs: [{ name: e }]\n    timeouts: { connect: 1s, response: 5s }\n";

/// What the receiver got: every export's raw bytes, and its spans.
#[derive(Default)]
struct Received {
    raw: Vec<Bytes>,
    spans: Vec<Span>,
}

/// One `POST` as the receiver took it: its path, content type and body.
struct Export {
    path: String,
    content_type: Option<String>,
    body: Bytes,
}

/// The test's side of the receiver: the exports it handed over, checked and decoded here,
/// in the test (a panic in the receiver's own task would only drop its connection).
struct Collector {
    exports: Mutex<tokio::sync::mpsc::UnboundedReceiver<Export>>,
    got: Mutex<Received>,
}

impl Collector {
    /// Everything received so far: each export handed over since the last look is checked
    /// (path, content type, an `ExportTraceServiceRequest` from `service.name` postern)
    /// and its spans kept.
    fn received(&self) -> std::sync::MutexGuard<'_, Received> {
        let mut got = self.got.lock().unwrap();
        let mut exports = self.exports.lock().unwrap();
        while let Ok(e) = exports.try_recv() {
            assert_eq!(e.path, "/v1/traces");
            assert_eq!(e.content_type.as_deref(), Some("application/x-protobuf"));
            let export = ExportTraceServiceRequest::decode(e.body.clone()).expect("an OTLP export");
            got.raw.push(e.body);
            for rs in export.resource_spans {
                let resource = rs.resource.expect("a resource");
                assert!(
                    resource.attributes.iter().any(|kv| kv.key == "service.name"
                        && text(kv.value.as_ref().and_then(|v| v.value.as_ref())) == "postern"),
                    "service.name is postern"
                );
                got.spans.extend(rs.scope_spans.into_iter().flat_map(|s| s.spans));
            }
        }
        got
    }
}

/// An OTLP/HTTP traces receiver on 127.0.0.1: answers every `POST` as an accepted
/// export and hands what it got to the test ([`Collector::received`] checks it).
async fn receiver() -> (String, Arc<Collector>) {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let collector = Arc::new(Collector { exports: Mutex::new(rx), got: Mutex::new(Received::default()) });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { return };
            let tx = tx.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req: http::Request<hyper::body::Incoming>| {
                    let tx = tx.clone();
                    async move {
                        let path = req.uri().path().to_owned();
                        let content_type =
                            req.headers().get("content-type").and_then(|v| v.to_str().ok()).map(str::to_owned);
                        let body = req.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
                        let _ = tx.send(Export { path, content_type, body });
                        let answer = ExportTraceServiceResponse::default().encode_to_vec();
                        Ok::<_, std::convert::Infallible>(
                            http::Response::builder()
                                .header("content-type", "application/x-protobuf")
                                .body(Full::new(Bytes::from(answer)))
                                .unwrap(),
                        )
                    }
                });
                let io = hyper_util::rt::TokioIo::new(stream);
                let _ = hyper::server::conn::http1::Builder::new().serve_connection(io, svc).await;
            });
        }
    });
    (format!("http://{addr}"), collector)
}

fn text(v: Option<&Value>) -> String {
    match v {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        _ => String::new(),
    }
}

fn attr(span: &Span, key: &str) -> Option<String> {
    span.attributes.iter().find(|kv| kv.key == key).map(|kv| text(kv.value.as_ref().and_then(|v| v.value.as_ref())))
}

/// Server spans received so far, by request id.
fn server_spans(got: &Collector) -> HashMap<String, Span> {
    let got = got.received();
    got.spans
        .iter()
        .filter(|s| s.kind == SpanKind::Server as i32)
        .filter_map(|s| Some((attr(s, "postern.request_id")?, s.clone())))
        .collect()
}

fn children<'a>(got: &'a Received, parent: &[u8]) -> Vec<&'a Span> {
    got.spans.iter().filter(|s| s.parent_span_id == parent).collect()
}

async fn call(node: &Node, key: &str, status: u16, traceparent: Option<&str>) -> postern_e2e::Resp {
    let url = node.url(&format!("/search?status={status}"));
    let mut headers = vec![("x-api-key", key)];
    if let Some(tp) = traceparent {
        headers.push(("traceparent", tp));
    }
    let r = get(&url, &headers).await;
    assert_eq!(r.status.as_u16(), status, "{}", String::from_utf8_lossy(&r.body));
    r
}

fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_reach_a_real_collector_and_debug_tracing_turns_itself_off() {
    let (collector, got) = receiver().await;
    let echo = Echo::start("e");
    let repo = Repo::new();
    platform(&repo, &[("e", &echo.addr())]);
    repo.write("platform/plans.yaml", PLANS);
    repo.write("teams/t/routes.yaml", ROUTES);
    let k1 = new_key(repo.path(), "k1", "app1", "acme", "gold", &[]);
    let k2 = new_key(repo.path(), "k2", "app2", "acme", "gold", &[]);
    let work = tempfile::tempdir().unwrap();
    let tokens = write_tokens(work.path());
    let cp = serve(repo.path(), work.path().join("store").to_str().unwrap(), &tokens, &["--dwell", "0s"]);
    ctl(&cp, &["publish"]);
    // Nothing is sampled: what is traced is a server error or a debug caller.
    let node = start_node_with(
        &cp.url,
        &work.path().join("n0"),
        "node-0",
        &["--otlp-endpoint", &collector, "--trace-sample", "0"],
    );
    wait_for("the node to take the keys", Duration::from_secs(20), async || {
        get(&node.url("/search"), &[("x-api-key", &k1)]).await.status.as_u16() == 200
    })
    .await;

    // A server error from the backend continues the client's trace.
    let client_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let client_span = "00f067aa0ba902b7";
    let tp = format!("00-{client_trace}-{client_span}-00");
    let failed = call(&node, &k1, 503, Some(&tp)).await;
    let rid = failed.header("x-request-id").unwrap().to_owned();
    let sent_upstream = failed.echoed("traceparent").expect("the backend got a traceparent");
    assert!(sent_upstream.starts_with(&format!("00-{client_trace}-")), "{sent_upstream}");
    wait_for("the 503's spans", Duration::from_secs(30), async || server_spans(&got).contains_key(&rid)).await;
    {
        let server = server_spans(&got).remove(&rid).unwrap();
        assert_eq!(hex::encode(&server.trace_id), client_trace, "the client's trace id is kept");
        assert_eq!(hex::encode(&server.parent_span_id), client_span, "the client's span is the parent");
        assert_eq!(server.name, "GET t/search");
        assert_eq!(attr(&server, "http.response.status_code").as_deref(), Some("503"));
        assert_eq!(attr(&server, "postern.key_id").as_deref(), Some("k1"));
        assert_eq!(attr(&server, "postern.origin").as_deref(), Some("upstream"));
        assert_eq!(server.status.as_ref().map(|s| s.code), Some(2), "a 5xx is an error span");
        let got = got.received();
        let kids = children(&got, &server.span_id);
        let names: Vec<&str> = kids.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["auth", "filter rate-limit", "GET upstream"], "{names:?}");
        for k in &kids {
            assert_eq!(k.trace_id, server.trace_id);
            assert!(k.start_time_unix_nano >= server.start_time_unix_nano, "{}", k.name);
            assert!(k.end_time_unix_nano <= server.end_time_unix_nano, "{}", k.name);
            assert!(k.start_time_unix_nano <= k.end_time_unix_nano, "{}", k.name);
        }
        let up = kids[2];
        assert_eq!(up.kind, SpanKind::Client as i32);
        assert_eq!(&sent_upstream[36..52], hex::encode(&up.span_id), "the backend's parent is the upstream span");
        assert_eq!(attr(up, "postern.cluster").as_deref(), Some("e"));
        assert_eq!(attr(up, "server.address"), Some(echo.addr()));
        assert!(kids[0].start_time_unix_nano <= kids[1].start_time_unix_nano);
        assert!(kids[1].end_time_unix_nano <= up.start_time_unix_nano, "filters run before the call");
    }

    // Successes of both keys are not traced (nothing sampled, no flag).
    for _ in 0..20 {
        call(&node, &k1, 200, None).await;
        call(&node, &k2, 200, None).await;
    }

    // Debug tracing for k1: every request of k1 traced, none of k2.
    let out = std::process::Command::new(postern_e2e::bin("posternctl"))
        .args(["trace", "--key", "k1", "--for", "10s", "--control", &cp.url, "--token", PLATFORM_TOKEN])
        .output()
        .unwrap();
    let printed = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{printed}{}", String::from_utf8_lossy(&out.stderr));
    assert!(printed.starts_with("tracing every request of key k1 until "), "{printed}");
    let answer: serde_json::Value = serde_json::from_str(&printed[printed.find('{').unwrap()..]).unwrap();
    assert_eq!(answer["credentials"]["acked"], serde_json::json!(["node-0"]), "{answer}");
    let until = answer["until"].as_u64().unwrap();
    // Ten calls of each key (fewer if the flag's time runs short): a call of k1 counts as
    // made under the flag only if it was answered over a second before the flag's end,
    // so however long a call takes it cannot straddle the expiry.
    let mut traced_ids = Vec::new();
    let mut untraced_ids = Vec::new();
    while traced_ids.len() < 10 && unix_now() + 1 < until {
        let a = call(&node, &k1, 200, None).await;
        if unix_now() + 1 < until {
            traced_ids.push(a.header("x-request-id").unwrap().to_owned());
        }
        let b = call(&node, &k2, 200, None).await;
        untraced_ids.push(b.header("x-request-id").unwrap().to_owned());
    }
    assert!(traced_ids.len() >= 5, "{} calls in the flag's time", traced_ids.len());
    wait_for("every debug request's spans", Duration::from_secs(30), async || {
        let seen = server_spans(&got);
        traced_ids.iter().all(|id| seen.contains_key(id))
    })
    .await;
    let seen = server_spans(&got);
    for id in &traced_ids {
        assert_eq!(attr(&seen[id], "postern.debug_trace").as_deref(), Some("true"));
        assert_eq!(attr(&seen[id], "postern.key_id").as_deref(), Some("k1"));
    }
    assert!(untraced_ids.iter().all(|id| !seen.contains_key(id)), "k2 is not traced");

    // The flag turns itself off at its expiry, without another message.
    while unix_now() < until {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut after = Vec::new();
    for _ in 0..20 {
        after.push(call(&node, &k1, 200, None).await.header("x-request-id").unwrap().to_owned());
    }
    // A later error is exported after anything queued before it.
    let marker = call(&node, &k2, 500, None).await.header("x-request-id").unwrap().to_owned();
    wait_for("the marker's spans", Duration::from_secs(30), async || server_spans(&got).contains_key(&marker)).await;
    let seen = server_spans(&got);
    assert!(after.iter().all(|id| !seen.contains_key(id)), "k1 is not traced after the expiry");

    // `--off` ends a flag early; an unknown key is refused.
    let trace_cmd = |args: &[&str]| {
        std::process::Command::new(postern_e2e::bin("posternctl"))
            .arg("trace")
            .args(args)
            .args(["--control", &cp.url, "--token", PLATFORM_TOKEN])
            .output()
            .unwrap()
    };
    assert!(trace_cmd(&["--key", "k2", "--for", "1h"]).status.success());
    let on = call(&node, &k2, 200, None).await.header("x-request-id").unwrap().to_owned();
    let off = trace_cmd(&["--key", "k2", "--off"]);
    assert!(String::from_utf8_lossy(&off.stdout).starts_with("tracing of key k2 is off"));
    let after_off = call(&node, &k2, 200, None).await.header("x-request-id").unwrap().to_owned();
    let unknown = trace_cmd(&["--key", "nobody"]);
    assert!(!unknown.status.success());
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("no key \"nobody\""), "{unknown:?}");
    let marker = call(&node, &k1, 502, None).await.header("x-request-id").unwrap().to_owned();
    wait_for("the second marker's spans", Duration::from_secs(30), async || server_spans(&got).contains_key(&marker))
        .await;
    let seen = server_spans(&got);
    assert!(seen.contains_key(&on), "k2 traced under its flag");
    assert!(!seen.contains_key(&after_off), "k2 not traced once the flag is off");

    // No credential reaches a span.
    {
        let got = got.received();
        for raw in &got.raw {
            for secret in [&k1, &k2] {
                assert!(!raw.windows(secret.len()).any(|w| w == secret.as_bytes()), "a raw key in a span");
            }
        }
    }
    let metrics = String::from_utf8_lossy(&get(&node.admin_url("/metrics"), &[]).await.body).into_owned();
    assert!(metrics.contains("postern_trace_spans_total{outcome=\"failed\"} 0"), "{metrics}");
    assert!(metrics.contains("postern_traces_total{outcome=\"dropped\"} 0"), "{metrics}");

    // A collector that is down: requests are answered, the lost spans are counted.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_url = format!("http://{}", dead.local_addr().unwrap());
    drop(dead);
    let lost = start_node_with(
        &cp.url,
        &work.path().join("n1"),
        "node-1",
        &["--otlp-endpoint", &dead_url, "--trace-sample", "1"],
    );
    wait_for("node-1 to take the keys", Duration::from_secs(20), async || {
        get(&lost.url("/search"), &[("x-api-key", &k1)]).await.status.as_u16() == 200
    })
    .await;
    for _ in 0..10 {
        call(&lost, &k2, 200, None).await;
    }
    wait_for("failed exports to be counted", Duration::from_secs(30), async || {
        let m = String::from_utf8_lossy(&get(&lost.admin_url("/metrics"), &[]).await.body).into_owned();
        m.lines()
            .find_map(|l| l.strip_prefix("postern_trace_spans_total{outcome=\"failed\"} "))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .is_some_and(|n| n > 0)
    })
    .await;
}
