//! What counting one answered call costs a request worker: a caller already in the window
//! (the steady state) and 10 000 callers in turn (a map larger than the caches). The
//! request path has read the clock already (for its latency), so `at` is taken once;
//! the clock read is measured on its own for comparison.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{Criterion, criterion_group, criterion_main};
use postern_model::usage::CallerKind;
use postern_usage::meter::{Call, Meter};

fn count(c: &mut Criterion) {
    let meter = Meter::new();
    let caller = Bytes::from_static(b"key_01HZX3Q9W8R7");
    let route: Arc<str> = Arc::from("search/query");
    let product: Arc<str> = Arc::from("search");
    c.bench_function("Instant::now (for comparison)", |b| b.iter(Instant::now));
    let at = Instant::now();
    c.bench_function("count: a caller already in the window", |b| {
        b.iter(|| {
            meter.count(&Call {
                kind: CallerKind::Key,
                caller: &caller,
                route: &route,
                product: &product,
                status: 200,
                at,
                latency: Duration::from_micros(850),
            })
        })
    });
    let callers: Vec<Bytes> = (0..10_000).map(|i| Bytes::from(format!("key_{i:012}"))).collect();
    c.bench_function("count: 10 000 callers in turn", |b| {
        let mut i = 0;
        b.iter(|| {
            i = (i + 1) % callers.len();
            meter.count(&Call {
                kind: CallerKind::Key,
                caller: &callers[i],
                route: &route,
                product: &product,
                status: 200,
                at,
                latency: Duration::from_micros(850),
            })
        })
    });
}

/// The same, with the open windows kept in the counts file (as a node with a spool runs):
/// a few more stores into the mapping per call, and a slot taken per new row.
fn count_durable(c: &mut Criterion) {
    let Ok(dir) = tempfile::tempdir() else { return };
    let meter = Meter::new();
    let Ok(slots) = postern_usage::durable::Durable::in_dir(dir.path()).create(1) else { return };
    meter.keep_in(slots);
    let caller = Bytes::from_static(b"key_01HZX3Q9W8R7");
    let route: Arc<str> = Arc::from("search/query");
    let product: Arc<str> = Arc::from("search");
    let at = Instant::now();
    c.bench_function("count (counts file): a caller already in the window", |b| {
        b.iter(|| {
            meter.count(&Call {
                kind: CallerKind::Key,
                caller: &caller,
                route: &route,
                product: &product,
                status: 200,
                at,
                latency: Duration::from_micros(850),
            })
        })
    });
}

criterion_group!(benches, count, count_durable);
criterion_main!(benches);
