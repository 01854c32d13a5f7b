//! One filter per request: fresh store, instantiate from the pre-instance, call, drop.
//! And what fuel + epoch metering cost on a compute-heavy filter (HMAC verification).
//! Run: `make filters && cargo bench -p postern-wasm`.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::hint::black_box;
use std::path::PathBuf;
use std::sync::Arc;

use criterion::{Criterion, criterion_group, criterion_main};
use postern_wasm::Binding;
use postern_wasm::runtime::types;
use postern_wasm::{FilterStats, Limits, Runtime, RuntimeConfig};

fn module_path(name: &str) -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| root.join("target"));
    let p = target.join("filters/wasm32-wasip2/release").join(format!("{name}.wasm"));
    assert!(p.exists(), "{} missing: run `make filters`", p.display());
    p
}

fn request(headers: Vec<(String, Vec<u8>)>) -> types::Request {
    types::Request {
        method: "GET".into(),
        path: "/v1/orders/1".into(),
        query: None,
        authority: Some("api.example.com".into()),
        headers,
    }
}

fn context() -> types::Context {
    types::Context { route_id: "t/r".into(), request_id: "0123456789abcdef0123456789abcdef".into(), identity: None }
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let stats = Arc::new(FilterStats::default());
    let tag: Arc<str> = Arc::from("bench@t/r");
    let limits = Limits { fuel: 50_000_000, deadline_ms: 50, ..Limits::default() };

    for metering in [true, false] {
        let runtime = Runtime::new(&RuntimeConfig { metering, max_instances: 64, ..Default::default() }).unwrap();
        let bind = |module: &str, config: &'static [u8]| Binding {
            module: runtime.load(&std::fs::read(module_path(module)).unwrap(), None).unwrap(),
            limits,
            config: Arc::from(config),
            stats: stats.clone(),
            tag: tag.clone(),
        };
        let trivial = bind("well_behaved", b"");
        let hmac = bind("hmac_verifier", br#"{"secret":"bench-secret"}"#);
        let suffix = if metering { "metered" } else { "unmetered" };

        c.bench_function(&format!("trivial_filter_fresh_instance_call_drop/{suffix}"), |b| {
            b.iter(|| {
                let call = rt.block_on(runtime.on_request(&trivial, request(Vec::new()), context()));
                assert!(call.result.is_ok());
                black_box(call.fuel)
            })
        });
        let signed =
            vec![("x-timestamp".to_owned(), b"1767225600".to_vec()), ("x-signature".to_owned(), b"sha256=00".to_vec())];
        c.bench_function(&format!("hmac_filter_fresh_instance_call_drop/{suffix}"), |b| {
            b.iter(|| {
                let call = rt.block_on(runtime.on_request(&hmac, request(signed.clone()), context()));
                assert!(call.result.is_ok());
                black_box(call.fuel)
            })
        });
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
