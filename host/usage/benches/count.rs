//! What counting one answered call costs a request worker: a caller already in the window
//! (the steady state) and a new caller (the first call of a window).

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
    c.bench_function("count: a caller already in the window", |b| {
        b.iter(|| {
            meter.count(&Call {
                kind: CallerKind::Key,
                caller: &caller,
                route: &route,
                product: &product,
                status: 200,
                at: Instant::now(),
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
                at: Instant::now(),
                latency: Duration::from_micros(850),
            })
        })
    });
}

criterion_group!(benches, count);
criterion_main!(benches);
