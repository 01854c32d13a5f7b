//! Validates the 2 KB order fixture `N` times (first argument, default 1000), for
//! instruction counts under callgrind: the difference between two runs of different `N`,
//! divided by the difference in `N`, is the cost of one validation, free of start-up.
//!
//! `valgrind --tool=callgrind --callgrind-out-file=/dev/null target/release/examples/validate_count 2000`
#![allow(clippy::unwrap_used, clippy::expect_used)]

use postern_model::validate::{JsonLimits, Media, RequestBody, Validation};
use postern_validate::Validator;

/// The node's allocator, so the count is what a request pays in the node.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    let n: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(1000);
    let schema: serde_json::Value = serde_json::from_str(include_str!("../fixtures/order.schema.json")).unwrap();
    let v = Validation {
        source: "count".into(),
        parameters: vec![],
        body: Some(RequestBody {
            required: true,
            media: vec![Media { range: "application/json".into(), schema: Some(schema) }],
        }),
        json: JsonLimits::default(),
    };
    let validator = Validator::build(&v, "/orders").unwrap();
    let body = include_bytes!("../fixtures/order.json");
    let mut ok = 0;
    for _ in 0..n {
        let a = validator.admit(Some("application/json"), true).unwrap();
        ok += usize::from(validator.check_body(a, std::hint::black_box(body)).is_ok());
    }
    println!("{ok} of {n} valid");
}
