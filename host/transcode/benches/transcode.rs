//! JSON→protobuf→JSON for a 2 KB order on the demo's orders service: the request a
//! `POST /v1/shops/acme/orders` becomes, and the answer's protobuf read back as JSON.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use criterion::{Criterion, criterion_group, criterion_main};
use http::Method;
use postern_model::transcode::Transcode;
use postern_model::validate::JsonLimits;
use postern_transcode::Transcoder;
use std::hint::black_box;

/// The node's allocator, so the figures match what a request pays in the node.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn bench(c: &mut Criterion) {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut comp = protox::Compiler::new([root.join("../../examples/config/teams/orders/proto")]).unwrap();
    comp.include_imports(true);
    comp.open_file("orders.proto").unwrap();
    let t = Transcode {
        source: "orders.proto".into(),
        descriptors: comp.encode_file_descriptor_set(),
        service: "orders.v1.Orders".into(),
    };
    let t = Transcoder::build(&t).unwrap();
    // A 2 KB order: 14 items, labels, a note.
    let items: Vec<serde_json::Value> = (0..14)
        .map(|i| serde_json::json!({"sku": format!("ABC-{:04}", 1000 + i), "quantity": i + 1, "unitPrice": {"currencyCode": "GBP", "units": 19, "nanos": 990000000}}))
        .collect();
    let body = serde_json::to_vec(&serde_json::json!({
        "customerId": "cus_8f3kQ2xZ91ab", "items": items, "status": "PENDING",
        "total": {"currencyCode": "GBP", "units": 279, "nanos": 860000000},
        "createdAt": "2026-12-06T10:00:00Z", "labels": {"channel": "web", "campaign": "winter-sale"},
        "note": "Leave the parcel with the concierge; ring twice. Fragile items inside.", "version": "3"
    }))
    .unwrap();
    assert!(body.len() > 1500 && body.len() < 2600, "{}", body.len());
    let limits = JsonLimits::default();
    let m = t.find(&Method::POST, "/v3/shops/acme/orders").unwrap();
    let framed = m.request(None, &body, &limits).unwrap();
    // The answer: the order itself, as the service would send it back.
    let get = t.find(&Method::GET, "/v3/orders/42").unwrap();
    let order_only = framed.slice(5..);
    let _ = order_only;
    let mut g = c.benchmark_group("transcode_2kb_order");
    g.bench_function("json_to_protobuf", |b| b.iter(|| m.request(None, black_box(&body), &limits).unwrap()));
    // CreateOrderRequest { order = 2 } → the order's bytes are field 2's payload; a
    // GetOrder answer is an Order, so re-frame the order alone.
    let req = prost_reflect_order(&framed);
    g.bench_function("protobuf_to_json", |b| b.iter(|| get.response(black_box(&req)).unwrap()));
    g.bench_function("round_trip", |b| {
        b.iter(|| {
            let f = m.request(None, black_box(&body), &limits).unwrap();
            get.response(&prost_reflect_order(&f)).unwrap()
        })
    });
    g.finish();
}

/// The `order` field (2) of a framed CreateOrderRequest, framed as an Order answer.
fn prost_reflect_order(framed: &[u8]) -> Vec<u8> {
    let mut rest = &framed[5..];
    while !rest.is_empty() {
        let (key, n) = varint(rest);
        rest = &rest[n..];
        match key & 7 {
            2 => {
                let (len, n) = varint(rest);
                let (val, after) = rest[n..].split_at(len as usize);
                if key >> 3 == 2 {
                    let mut out = vec![0];
                    out.extend_from_slice(&(val.len() as u32).to_be_bytes());
                    out.extend_from_slice(val);
                    return out;
                }
                rest = after;
            }
            0 => rest = &rest[varint(rest).1..],
            _ => unreachable!(),
        }
    }
    unreachable!()
}

fn varint(b: &[u8]) -> (u64, usize) {
    let mut v = 0u64;
    for (i, byte) in b.iter().enumerate() {
        v |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return (v, i + 1);
        }
    }
    (v, b.len())
}

criterion_group!(benches, bench);
criterion_main!(benches);
