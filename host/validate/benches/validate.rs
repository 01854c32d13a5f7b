//! Validating a realistic 2 KB order body (12 items, two addresses) against its compiled
//! OpenAPI schema: the hardened JSON read alone, the schema alone, and both, as a request
//! pays them.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use criterion::{Criterion, criterion_group, criterion_main};
use postern_model::validate::{JsonLimits, Media, RequestBody, Validation};
use postern_validate::Validator;
use std::hint::black_box;

/// The node's allocator, so the figures match what a request pays in the node.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const ORDER_SCHEMA: &str = include_str!("../fixtures/order.schema.json");
const ORDER: &str = include_str!("../fixtures/order.json");

fn bench(c: &mut Criterion) {
    let schema: serde_json::Value = serde_json::from_str(ORDER_SCHEMA).unwrap();
    let v = Validation {
        source: "bench".into(),
        parameters: vec![],
        body: Some(RequestBody {
            required: true,
            media: vec![Media { range: "application/json".into(), schema: Some(schema.clone()) }],
        }),
        json: JsonLimits::default(),
    };
    let validator = Validator::build(&v, "/orders").unwrap();
    let body = ORDER.as_bytes();
    let limits = JsonLimits::default();
    let compiled = jsonschema::options().with_draft(jsonschema::Draft::Draft202012).build(&schema).unwrap();
    let value: serde_json::Value = serde_json::from_slice(body).unwrap();

    let mut g = c.benchmark_group("validate_2kb_order");
    g.bench_function("json_read_hardened", |b| b.iter(|| postern_validate::json::parse(black_box(body), &limits)));
    g.bench_function("json_read_serde_json", |b| {
        b.iter(|| serde_json::from_slice::<serde_json::Value>(black_box(body)))
    });
    g.bench_function("schema_only", |b| b.iter(|| compiled.is_valid(black_box(&value))));
    g.bench_function("read_and_validate", |b| {
        b.iter(|| {
            let a = validator.admit(Some("application/json"), true).unwrap();
            validator.check_body(a, black_box(body))
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
