//! CPU per filter call, fresh instance included: runs one module's `on-request` N times
//! on one thread (after 1,000 warm-up calls) and prints wall and CPU time per call.
//!
//! Run: `make filters && cargo run --release -p postern-wasm --example call_cost -- \
//!       target/filters/wasm32-wasip2/release/well_behaved.wasm 200000 [config]`
//!
//! The module is prepared for the config as a node prepares it (pre-initialised when
//! its `init` keeps state); with `NO_PREPARE=1` it is used as it is.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic, clippy::print_stdout)]

use std::sync::Arc;
use std::time::Instant;

use postern_wasm::runtime::types;
use postern_wasm::{Binding, FilterStats, Limits, Runtime, RuntimeConfig};

// The gateway's allocator, so the figures are the gateway's.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// This thread's CPU time in seconds (`/proc/thread-self/schedstat`, in nanoseconds).
fn cpu_time() -> f64 {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat").expect("schedstat");
    let ns: u64 = stat.split_whitespace().next().and_then(|v| v.parse().ok()).expect("schedstat format");
    ns as f64 * 1e-9
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (Some(path), Some(n)) = (args.get(1), args.get(2).and_then(|n| n.parse::<u32>().ok())) else {
        panic!("usage: call_cost <module.wasm> <calls>");
    };
    let config = args.get(3).map(String::as_bytes).unwrap_or_default();
    let tokio = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let runtime = Runtime::new(&RuntimeConfig { metering: true, max_instances: 64, ..Default::default() }).unwrap();
    let limits = Limits { fuel: 50_000_000, deadline_ms: 50, ..Limits::default() };
    let loaded = runtime.load(&std::fs::read(path).unwrap(), None).unwrap();
    // Prepared for its config as a node does (pre-initialised if its `init` keeps state),
    // unless NO_PREPARE is set.
    let module = match std::env::var_os("NO_PREPARE") {
        Some(_) => loaded.clone(),
        None => runtime.prepare(&loaded, config, &limits).unwrap(),
    };
    let pre_initialised = !Arc::ptr_eq(&module, &loaded);
    if let Some(out) = std::env::var_os("DUMP") {
        std::fs::write(out, module.bytes()).unwrap();
    }
    let b = Binding {
        module,
        limits,
        config: Arc::from(config),
        stats: Arc::new(FilterStats::default()),
        tag: Arc::from("cost@t/r"),
    };
    let call = || {
        let req = types::Request {
            method: "GET",
            path: "/v1/orders/1",
            query: None,
            authority: Some("api.example.com"),
            headers: &[],
        };
        let cx = types::Context {
            route_id: "t/r",
            request_id: "0123456789abcdef0123456789abcdef",
            identity: None,
            config: &b.config,
        };
        let c = tokio.block_on(runtime.on_request(&b, req, cx));
        assert!(c.result.is_ok(), "{:?}", c.result);
    };
    for _ in 0..1000 {
        call();
    }
    let (wall, cpu) = (Instant::now(), cpu_time());
    for _ in 0..n {
        call();
    }
    let per = |s: f64| s * 1e6 / f64::from(n);
    println!(
        "{path}{}: {:.2} µs wall, {:.2} µs CPU per call on the calling thread ({n} calls)",
        if pre_initialised { " (pre-initialised)" } else { "" },
        per(wall.elapsed().as_secs_f64()),
        per(cpu_time() - cpu)
    );
}
