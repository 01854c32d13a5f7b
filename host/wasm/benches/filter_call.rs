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

// The gateway's allocator, so the figures are the gateway's.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn module_path(name: &str) -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| root.join("target"));
    let p = target.join("filters/wasm32-wasip2/release").join(format!("{name}.wasm"));
    assert!(p.exists(), "{} missing: run `make filters`", p.display());
    p
}

fn request<'a>(headers: &'a [(&'a str, &'a [u8])]) -> types::Request<'a> {
    types::Request { method: "GET", path: "/v1/orders/1", query: None, authority: Some("api.example.com"), headers }
}

fn context(b: &Binding) -> types::Context<'_> {
    types::Context {
        route_id: "t/r",
        request_id: "0123456789abcdef0123456789abcdef",
        identity: None,
        config: &b.config,
    }
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let stats = Arc::new(FilterStats::default());
    let tag: Arc<str> = Arc::from("bench@t/r");
    let limits = Limits { fuel: 50_000_000, deadline_ms: 50, ..Limits::default() };

    for metering in [true, false] {
        let runtime = Runtime::new(&RuntimeConfig { metering, max_instances: 64, ..Default::default() }).unwrap();
        // Each module prepared for its config as a node does: the HMAC verifier is
        // pre-initialised with its config parsed and its MAC keyed.
        let bind = |module: &str, config: &'static [u8]| Binding {
            module: runtime
                .prepare(&runtime.load(&std::fs::read(module_path(module)).unwrap(), None).unwrap(), config, &limits)
                .unwrap(),
            limits,
            config: Arc::from(config),
            stats: stats.clone(),
            tag: tag.clone(),
        };
        let trivial = bind("well_behaved", b"");
        let hmac = bind("hmac_verifier", br#"{"secret":"bench-secret"}"#);
        let suffix = if metering { "metered" } else { "unmetered" };
        if metering {
            let fstats = Arc::new(FilterStats::default());
            fstats.pool_until_ms.store(u64::MAX, std::sync::atomic::Ordering::Relaxed);
            let fib = Binding { stats: fstats, ..bind("well_behaved", b"") };
            c.bench_function("trivial_filter_fresh_instance_call_drop/idle_pool", |b| {
                b.iter(|| {
                    let call = rt.block_on(runtime.on_request(&fib, request(&[]), context(&fib)));
                    assert!(call.result.is_ok());
                    black_box(call.fuel)
                })
            });
        }

        c.bench_function(&format!("trivial_filter_fresh_instance_call_drop/{suffix}"), |b| {
            b.iter(|| {
                let call = rt.block_on(runtime.on_request(&trivial, request(&[]), context(&trivial)));
                assert!(call.result.is_ok(), "{:?}", call.result);
                black_box(call.fuel)
            })
        });
        let signed: [(&str, &[u8]); 2] = [("x-timestamp", b"1767225600"), ("x-signature", b"sha256=00")];
        c.bench_function(&format!("hmac_filter_fresh_instance_call_drop/{suffix}"), |b| {
            b.iter(|| {
                let call = rt.block_on(runtime.on_request(&hmac, request(&signed), context(&hmac)));
                assert!(call.result.is_ok());
                black_box(call.fuel)
            })
        });
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
