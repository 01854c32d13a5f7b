use super::*;
use postern_model::validate::{Media as MediaSpec, Parameter, RequestBody, Scalar};
use serde_json::json;

const ORDER_SCHEMA: &str = include_str!("../fixtures/order.schema.json");
const ORDER: &str = include_str!("../fixtures/order.json");

fn orders() -> Validator {
    let schema: Value = serde_json::from_str(ORDER_SCHEMA).unwrap();
    let v = Validation {
        source: "teams/orders/openapi/orders.yaml#createOrder".into(),
        parameters: vec![
            Parameter {
                name: "shop".into(),
                location: ParamIn::Path,
                required: true,
                shape: ParamShape::Scalar { of: Scalar::String },
                schema: json!({"type": "string", "pattern": "^[a-z]{2,8}$"}),
            },
            Parameter {
                name: "dryRun".into(),
                location: ParamIn::Query,
                required: false,
                shape: ParamShape::Scalar { of: Scalar::Boolean },
                schema: json!({"type": "boolean"}),
            },
            Parameter {
                name: "tag".into(),
                location: ParamIn::Query,
                required: false,
                shape: ParamShape::Array { of: Scalar::Integer, explode: true },
                schema: json!({"type": "array", "items": {"type": "integer", "maximum": 9}}),
            },
            Parameter {
                name: "x-tenant".into(),
                location: ParamIn::Header,
                required: true,
                shape: ParamShape::Scalar { of: Scalar::String },
                schema: json!({"type": "string", "minLength": 3}),
            },
        ],
        body: Some(RequestBody {
            required: true,
            media: vec![
                MediaSpec { range: "application/json".into(), schema: Some(schema) },
                MediaSpec { range: "text/csv".into(), schema: None },
            ],
        }),
        json: JsonLimits::default(),
    };
    Validator::build(&v, "/v1/shops/{shop}/orders").unwrap()
}

fn headers(tenant: &str) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert("x-tenant", tenant.parse().unwrap());
    h
}

fn invalid(r: Result<(), Refusal>) -> Vec<(&'static str, String, String)> {
    match r {
        Err(Refusal::Invalid(e)) => e.into_iter().map(|e| (e.location, e.pointer, e.message)).collect(),
        other => panic!("not invalid: {other:?}"),
    }
}

#[test]
fn a_good_order_passes() {
    let v = orders();
    v.check_head("/v1/shops/acme/orders", Some("dryRun=true&tag=1&tag=2"), &headers("t-1")).unwrap();
    let a = v.admit(Some("application/json"), true).unwrap();
    v.check_body(a, ORDER.as_bytes()).unwrap();
}

#[test]
fn every_bad_field_is_named() {
    let v = orders();
    let mut order: Value = serde_json::from_str(ORDER).unwrap();
    order["items"][0]["quantity"] = json!(0);
    order["shipping"]["country"] = json!("gb");
    order["surprise"] = json!(1);
    order.as_object_mut().unwrap().remove("currency");
    let a = v.admit(Some("application/json"), true).unwrap();
    let mut got = invalid(v.check_body(a, &serde_json::to_vec(&order).unwrap()));
    got.sort();
    let pointers: Vec<&str> = got.iter().map(|(_, p, _)| p.as_str()).collect();
    assert_eq!(pointers, ["/currency", "/items/0/quantity", "/shipping/country", "/surprise"], "{got:?}");
    assert!(got.iter().all(|(at, _, _)| *at == "body"));
    assert_eq!(got[0].2, "\"currency\" is required");
    assert_eq!(got[3].2, "is not a field of this object");
    // The value itself is never echoed.
    assert!(!got[2].2.contains("gb"), "{}", got[2].2);
}

#[test]
fn parameters_are_read_as_their_types() {
    let v = orders();
    let got = invalid(v.check_head("/v1/shops/ACME/orders", Some("dryRun=maybe&tag=1&tag=12"), &HeaderMap::new()));
    let pointers: Vec<(&str, &str)> = got.iter().map(|(at, p, _)| (*at, p.as_str())).collect();
    assert_eq!(
        pointers,
        [("path", "/shop"), ("query", "/dryRun"), ("query", "/tag/1"), ("header", "/x-tenant")],
        "{got:?}"
    );
    assert_eq!(got[3].2, "the header parameter x-tenant is required");
    // Percent-encoded path segments and query values are decoded first.
    v.check_head("/v1/shops/%61cme/orders", Some("dryRun=%74rue"), &headers("abc")).unwrap();
}

#[test]
fn media_types_are_matched_strictly() {
    let v = orders();
    assert!(v.admit(Some("application/json; charset=utf-8"), true).is_ok());
    assert!(v.admit(Some("Application/JSON"), true).is_ok());
    assert!(v.admit(Some("text/csv"), true).is_ok());
    for bad in ["text/plain", "application/json; charset=latin1", "application/jsonx", "json"] {
        assert!(matches!(v.admit(Some(bad), true), Err(Refusal::MediaType(_))), "{bad}");
    }
    assert!(matches!(v.admit(None, true), Err(Refusal::MediaType(_))));
    // A required body that is missing names the body.
    let a = v.admit(None, false).unwrap();
    assert_eq!(invalid(v.check_body(a, b"")), [("body", String::new(), "a request body is required".into())]);
    // A declared media type with no schema is admitted unread.
    let csv = v.admit(Some("text/csv"), true).unwrap();
    v.check_body(csv, b"not json").unwrap();
}

#[test]
fn bad_json_is_refused_before_any_schema() {
    let v = orders();
    let a = v.admit(Some("application/json"), true).unwrap();
    let dup = br#"{"customerId":"cus_12345678","customerId":"cus_87654321"}"#;
    match v.check_body(a, dup) {
        Err(Refusal::Json(e)) => assert_eq!(e.reason, json::Reason::DuplicateKey),
        other => panic!("{other:?}"),
    }
    let deep = format!("{}{}", "[".repeat(40), "]".repeat(40));
    assert!(matches!(v.check_body(a, deep.as_bytes()), Err(Refusal::Json(_))));
}

#[test]
fn errors_are_capped() {
    let v = orders();
    let mut order: Value = serde_json::from_str(ORDER).unwrap();
    for item in order["items"].as_array_mut().unwrap() {
        item["quantity"] = json!(0);
        item["sku"] = json!("bad");
    }
    let a = v.admit(Some("application/json"), true).unwrap();
    assert_eq!(invalid(v.check_body(a, &serde_json::to_vec(&order).unwrap())).len(), MAX_FIELD_ERRORS);
}

/// An operation whose only check is an optional JSON body of `schema`.
fn json_body(schema: Value) -> Validation {
    Validation {
        source: "x".into(),
        parameters: vec![],
        body: Some(RequestBody {
            required: false,
            media: vec![MediaSpec { range: "application/json".into(), schema: Some(schema) }],
        }),
        json: JsonLimits::default(),
    }
}

#[test]
fn schemas_that_cannot_compile_are_named() {
    let bad = json_body(json!({
        "$ref": "#/$defs/~1components~1schemas~1A",
        "$defs": {"/components/schemas/A": {"type": "string", "pattern": "(?<=a)b"}}
    }));
    let e = Validator::build(&bad, "/a").unwrap_err();
    assert_eq!(e.what, "request body application/json");
    assert_eq!(e.pointer, "#/components/schemas/A/pattern");
    let missing = Validation {
        source: "x".into(),
        parameters: vec![Parameter {
            name: "id".into(),
            location: ParamIn::Path,
            required: true,
            shape: ParamShape::Scalar { of: Scalar::String },
            schema: json!({}),
        }],
        body: None,
        json: JsonLimits::default(),
    };
    assert_eq!(
        Validator::build(&missing, "/a/{other}").unwrap_err().message,
        "the route's path /a/{other} has no segment {id}"
    );
}

#[test]
fn openapi_formats() {
    let v = json_body(json!({"type": "object", "properties": {
        "b": {"type": "string", "format": "byte"},
        "d": {"type": "string", "format": "date-time"},
        "u": {"type": "string", "format": "uuid"}
    }}));
    let v = Validator::build(&v, "/").unwrap();
    let a = v.admit(Some("application/json"), true).unwrap();
    v.check_body(a, br#"{"b":"aGk=","d":"2026-12-06T10:00:00Z","u":"0b9f3c4e-3f9a-4c1e-9a51-2b1e6f0d7a11"}"#).unwrap();
    let got = invalid(v.check_body(a, br#"{"b":"a!","d":"yesterday","u":"x"}"#));
    assert_eq!(got.iter().map(|(_, p, _)| p.as_str()).collect::<Vec<_>>(), ["/b", "/d", "/u"]);
}

#[test]
fn the_review_s_cases() {
    let v = orders();
    // A scalar given twice, and a header that is not visible ASCII: refused, not guessed.
    let mut h = HeaderMap::new();
    h.insert("x-tenant", http::HeaderValue::from_bytes(b"t\xff\xfe").unwrap());
    let got = invalid(v.check_head("/v1/shops/acme/orders", Some("dryRun=true&dryRun=false"), &h));
    let pointers: Vec<(&str, &str)> = got.iter().map(|(at, p, _)| (*at, p.as_str())).collect();
    assert_eq!(pointers, [("query", "/dryRun"), ("header", "/x-tenant")], "{got:?}");
    // A body on an operation that takes none.
    let none = Validation { source: "x".into(), parameters: vec![], body: None, json: JsonLimits::default() };
    let none = Validator::build(&none, "/a").unwrap();
    assert!(none.admit(None, false).is_ok());
    assert!(matches!(none.admit(Some("application/json"), true), Err(Refusal::Invalid(_))));
    // A large body of many bad items: only the first problem is named (the validator
    // would otherwise build an error per item before the first came out).
    let items: Vec<String> = (0..3000).map(|_| "{}".to_owned()).collect();
    let body =
        format!(r#"{{"customerId":"cus_12345678","currency":"GBP","items":[{}],"shipping":{{}}}}"#, items.join(","));
    let a = v.admit(Some("application/json"), true).unwrap();
    assert_eq!(invalid(v.check_body(a, body.as_bytes())).len(), 1);
}
