//! How long a large OpenAPI document takes to compile into validators, as a snapshot
//! build pays it: the document read once, then every operation converted (the compiler's
//! part) and its validators built (what posternctl and every node do), one route per
//! operation. Operations the gateway refuses are counted by reason.
//!
//! `cargo run --profile demo -p posternctl --example openapi_compile -- SPEC.(yaml|json)`
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use postern_model::validate::JsonLimits;
use posternctl::openapi::Spec;

fn main() {
    let path = std::env::args().nth(1).expect("usage: openapi_compile SPEC");
    let t = Instant::now();
    let spec = Spec::load(std::path::Path::new(&path)).expect("the document loads");
    let loaded = t.elapsed();
    let doc: serde_json::Value = {
        let text = std::fs::read_to_string(&path).expect("read");
        serde_json::from_str(&text).or_else(|_| serde_yaml_ng::from_str(&text)).expect("parse")
    };
    let methods = ["get", "put", "post", "delete", "options", "head", "patch", "trace"];
    let mut ids = Vec::new();
    for (p, item) in doc["paths"].as_object().into_iter().flatten() {
        for m in methods {
            if let Some(id) = item.get(m).and_then(|o| o["operationId"].as_str()) {
                ids.push((p.clone(), id.to_owned()));
            }
        }
    }
    let (mut converted, mut built) = (Duration::ZERO, Duration::ZERO);
    let (mut ok, mut schemas, mut bytes) = (0usize, 0usize, 0usize);
    let mut refused: BTreeMap<String, usize> = BTreeMap::new();
    for (p, id) in &ids {
        let t = Instant::now();
        let op = spec.operation(id, JsonLimits::default(), id);
        converted += t.elapsed();
        let op = match op {
            Ok(op) => op,
            Err(errors) => {
                for e in errors {
                    // The reason without the names that vary.
                    let reason: String =
                        e.message.split(['"', ':']).next().unwrap_or_default().chars().take(70).collect();
                    *refused.entry(reason).or_default() += 1;
                }
                continue;
            }
        };
        // The route's path: the spec's template (its parameters are its segments).
        let t = Instant::now();
        let v = postern_validate::Validator::build(&op.validation, p);
        built += t.elapsed();
        match v {
            Ok(_) => ok += 1,
            Err(e) => {
                *refused.entry(format!("validator: {}", e.message.chars().take(60).collect::<String>())).or_default() +=
                    1
            }
        }
        schemas += op.validation.parameters.len() + op.validation.body.as_ref().map_or(0, |b| b.media.len());
        bytes += serde_json::to_vec(&op.validation).map(|v| v.len()).unwrap_or(0);
    }
    println!("{path}: {} operations; document read in {:.0} ms", ids.len(), loaded.as_secs_f64() * 1e3);
    println!(
        "compiled {ok} ({schemas} schemas, {:.1} MB in the snapshot): converted in {:.0} ms, validators built in {:.0} ms ({:.2} ms per operation)",
        bytes as f64 / 1e6,
        converted.as_secs_f64() * 1e3,
        built.as_secs_f64() * 1e3,
        (converted + built).as_secs_f64() * 1e3 / ids.len().max(1) as f64
    );
    for (reason, n) in &refused {
        println!("refused {n}: {reason}");
    }
}
