//! The conformance cases of google/api/http.proto's documentation, and the orders
//! service of the demo.

use super::*;
use serde_json::json;

fn descriptors(dir: &str, file: &str) -> Vec<u8> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let google = root.join("../../examples/config/teams/orders/proto");
    let mut c = protox::Compiler::new([root.join(dir), google]).unwrap();
    c.include_imports(true);
    c.open_file(file).unwrap();
    c.encode_file_descriptor_set()
}

fn messaging() -> Transcoder {
    let t = Transcode {
        source: "messaging.proto".into(),
        descriptors: descriptors("tests/proto", "messaging.proto"),
        service: "messaging.v1.Messaging".into(),
    };
    Transcoder::build(&t).unwrap()
}

/// The request a call maps to, as proto3 JSON (every field shown).
fn call(
    t: &Transcoder,
    method: Method,
    path_and_query: &str,
    body: &str,
) -> Result<(String, serde_json::Value), Refusal> {
    let (path, query) = path_and_query.split_once('?').map_or((path_and_query, None), |(p, q)| (p, Some(q)));
    let m = t.find(&method, path).unwrap_or_else(|| panic!("no binding for {method} {path}"));
    let framed = m.request(query, body.as_bytes(), &JsonLimits::default())?;
    assert_eq!(framed[0], 0);
    let len = u32::from_be_bytes([framed[1], framed[2], framed[3], framed[4]]) as usize;
    assert_eq!(len, framed.len() - 5);
    let msg = DynamicMessage::decode(m.binding.rpc.input(), &framed[5..]).unwrap();
    let v = serde_json::to_value(&msg).unwrap();
    Ok((m.binding.grpc_path().to_owned(), v))
}

#[test]
fn the_documentations_bindings_map_as_it_says() {
    let t = messaging();
    assert_eq!(
        call(&t, Method::GET, "/v1/messages/123456", "").unwrap(),
        ("/messaging.v1.Messaging/GetMessage".into(), json!({"messageId": "123456"}))
    );
    // `{name=messages/*}` binds two segments.
    assert_eq!(call(&t, Method::GET, "/v2/messages/123456", "").unwrap().1, json!({"name": "messages/123456"}));
    assert_eq!(
        call(&t, Method::GET, "/v1/messages/123456?revision=2&sub.subfield=foo", "").unwrap().1,
        json!({"messageId": "123456", "revision": "2", "sub": {"subfield": "foo"}})
    );
    assert_eq!(
        call(&t, Method::GET, "/v1/users/me/messages/123456", "").unwrap(),
        ("/messaging.v1.Messaging/GetMessage".into(), json!({"messageId": "123456", "userId": "me"}))
    );
    assert_eq!(
        call(&t, Method::PATCH, "/v1/messages/123456", r#"{"text": "Hi!"}"#).unwrap().1,
        json!({"messageId": "123456", "message": {"text": "Hi!"}})
    );
    assert_eq!(
        call(&t, Method::PATCH, "/v1/all/123456", r#"{"text": "Hi!"}"#).unwrap().1,
        json!({"messageId": "123456", "text": "Hi!"})
    );
    assert_eq!(
        call(&t, Method::POST, "/v1/operations/a/b:cancel", r#"{"reason": "late"}"#).unwrap().1,
        json!({"name": "operations/a/b", "reason": "late"})
    );
    // Repeated fields take every value; enums their names; HEAD is GET.
    assert_eq!(
        call(&t, Method::HEAD, "/v1/messages/1?tags=a&tags=b&kind=NOTE", "").unwrap().1,
        json!({"messageId": "1", "tags": ["a", "b"], "kind": "NOTE"})
    );
    assert!(t.find(&Method::DELETE, "/v1/messages/1").is_none());
    assert_eq!(t.other_methods("/v1/messages/1"), [Method::GET, Method::PATCH]);
}

fn refused(r: Result<(String, serde_json::Value), Refusal>) -> Vec<(&'static str, String)> {
    match r {
        Err(Refusal::Invalid(e)) => e.into_iter().map(|e| (e.location, e.pointer)).collect(),
        other => panic!("not refused: {other:?}"),
    }
}

#[test]
fn unknown_fields_and_parameters_are_refused_by_name() {
    let t = messaging();
    assert_eq!(
        refused(call(&t, Method::PATCH, "/v1/messages/1", r#"{"text": "x", "colour": "red"}"#)),
        [("body", "/colour".into())]
    );
    assert_eq!(
        refused(call(&t, Method::GET, "/v1/messages/1?colour=red&revision=x", "")),
        [("query", "/colour".into()), ("query", "/revision".into())]
    );
    // What the path binds may not be given again; `*` takes no query.
    assert_eq!(refused(call(&t, Method::GET, "/v1/messages/1?message_id=2", "")), [("query", "/message_id".into())]);
    assert_eq!(refused(call(&t, Method::PATCH, "/v1/all/1?likes=2", "{}")), [("query", "/likes".into())]);
    // A GET takes no body; a body must be JSON the hardened reader accepts.
    assert_eq!(refused(call(&t, Method::GET, "/v1/messages/1", "{}")), [("body", String::new())]);
    assert!(matches!(call(&t, Method::PATCH, "/v1/messages/1", r#"{"text":"a","text":"b"}"#), Err(Refusal::Json(_))));
    assert_eq!(refused(call(&t, Method::PATCH, "/v1/messages/1", r#"{"likes": "many"}"#)), [("body", "/likes".into())]);
}

#[test]
fn answers_become_json() {
    let t = messaging();
    let m = t.find(&Method::GET, "/v1/texts/7").unwrap();
    let out = m.binding.rpc.output();
    let mut env = DynamicMessage::new(out.clone());
    let mut inner = DynamicMessage::new(out.get_field_by_name("message").unwrap().kind().as_message().unwrap().clone());
    inner.set_field_by_name("text", Value::String("hello".into()));
    env.set_field_by_name("message", Value::Message(inner));
    env.set_field_by_name("trace", Value::String("t".into()));
    let bytes = env.encode_to_vec();
    let mut framed = vec![0, 0, 0, 0, bytes.len() as u8];
    framed.extend_from_slice(&bytes);
    let json: serde_json::Value = serde_json::from_slice(&m.response(&framed).unwrap()).unwrap();
    // response_body: the field only; fields at their default left out.
    assert_eq!(json, json!({"text": "hello"}));
    assert_eq!(m.response(&framed[..4]).unwrap_err(), "a gRPC frame is cut short");
    assert_eq!(status(5), (StatusCode::NOT_FOUND, "not_found"));
    assert_eq!(status(14), (StatusCode::SERVICE_UNAVAILABLE, "unavailable"));
    let mut h = HeaderMap::new();
    h.insert("grpc-status", "5".parse().unwrap());
    h.insert("grpc-message", "order%2042%20not%20found".parse().unwrap());
    assert_eq!(outcome(&HeaderMap::new(), Some(&h)), Some((5, "order 42 not found".into())));
    assert_eq!(outcome(&h, None), Some((5, "order 42 not found".into())));
    assert_eq!(timeout_header(std::time::Duration::from_millis(1500)), "1500m");
}

#[test]
fn bad_bindings_are_refused_at_build() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = std::env::temp_dir().join(format!("postern-transcode-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cases = [
        ("get: \"/v1/{nope}\"", "orders.T.Get (get /v1/{nope}): x.M has no field \"nope\""),
        ("get: \"/v1/{m}\"", "orders.T.Get (get /v1/{m}): {m} must name a singular scalar field"),
        ("get: \"/v1/x\" body: \"*\"", "orders.T.Get (get /v1/x): a GET or DELETE binding takes no body"),
        ("post: \"/v1/x\" body: \"nope\"", "orders.T.Get (post /v1/x): body: x.M has no field \"nope\""),
        ("get: \"/v1/**/x\"", "orders.T.Get (get /v1/**/x): bad template: ** may only be the last segment"),
    ];
    for (rule, want) in cases {
        let proto = format!(
            "syntax = \"proto3\";\npackage x;\nimport \"google/api/annotations.proto\";\nmessage M {{ string id = 1; M m = 2; }}\n\
             service T {{ rpc Get(M) returns (M) {{ option (google.api.http) = {{ {rule} }}; }} }}\n"
        );
        std::fs::write(dir.join("t.proto"), proto).unwrap();
        let mut c =
            protox::Compiler::new([dir.clone(), root.join("../../examples/config/teams/orders/proto")]).unwrap();
        c.include_imports(true);
        c.open_file("t.proto").unwrap();
        let t =
            Transcode { source: "t.proto".into(), descriptors: c.encode_file_descriptor_set(), service: "x.T".into() };
        assert_eq!(Transcoder::build(&t).unwrap_err().to_string(), want.replace("orders.T", "x.T"));
    }
    // Two bindings of one method with the same shape collide.
    let proto = "syntax = \"proto3\";\npackage x;\nimport \"google/api/annotations.proto\";\nmessage M { string id = 1; string other = 2; }\n\
                 service T { rpc A(M) returns (M) { option (google.api.http) = { get: \"/v1/{id}\" }; }\n\
                 rpc B(M) returns (M) { option (google.api.http) = { get: \"/v1/{other}\" }; } }\n";
    std::fs::write(dir.join("t.proto"), proto).unwrap();
    let mut c = protox::Compiler::new([dir.clone(), root.join("../../examples/config/teams/orders/proto")]).unwrap();
    c.include_imports(true);
    c.open_file("t.proto").unwrap();
    let t = Transcode { source: "t.proto".into(), descriptors: c.encode_file_descriptor_set(), service: "x.T".into() };
    assert_eq!(
        Transcoder::build(&t).unwrap_err().to_string(),
        "x.T.B (GET /v1/*): collides with a binding of A of the same method and shape"
    );
    let missing = Transcode { service: "x.Nope".into(), ..t };
    assert_eq!(Transcoder::build(&missing).unwrap_err().to_string(), "x.Nope: no such service in the descriptors");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_demo_orders_service_builds() {
    let t = Transcode {
        source: "orders.proto".into(),
        descriptors: descriptors("../../examples/config/teams/orders/proto", "orders.proto"),
        service: "orders.v1.Orders".into(),
    };
    let t = Transcoder::build(&t).unwrap();
    let paths: Vec<String> = t.bindings().iter().map(|b| format!("{} {}", b.method, b.template.shape())).collect();
    assert_eq!(paths.len(), 5, "{paths:?}");
    let (path, v) = call(
        &t,
        Method::POST,
        "/v3/shops/acme/orders?request_id=r1",
        r#"{"customerId": "cus_1", "items": [{"sku": "ABC-1", "quantity": 2}]}"#,
    )
    .unwrap();
    assert_eq!(path, "/orders.v1.Orders/CreateOrder");
    assert_eq!(v["shop"], "acme");
    assert_eq!(v["requestId"], "r1");
    assert_eq!(v["order"]["items"][0]["quantity"], 2);
    assert!(t.bindings().iter().any(Binding::server_streaming));
}
