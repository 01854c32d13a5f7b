//! Rate-limit bucket checks: one bucket alone, through the node's bucket cache, and with
//! a second thread hammering the same bucket.
//!
//! `cargo bench -p postern-builtin-filters --bench ratelimit`
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use criterion::{Criterion, criterion_group, criterion_main};
use postern_builtin_filters::ratelimit::{Bucket, Limiter};

fn bench(c: &mut Criterion) {
    // A huge rate so every take succeeds: the common case measured.
    let (interval, burst) = (1, u64::MAX / 4);
    let b = Bucket::default();
    let epoch = Instant::now();
    c.bench_function("bucket take (one atomic CAS)", |bn| {
        bn.iter(|| {
            let now = epoch.elapsed().as_nanos() as u64;
            black_box(b.take(black_box(now), 1, interval, burst))
        })
    });

    let limiter = Limiter::new(1 << 20);
    let lim = limit();
    for k in 0..100_000u64 {
        let _ = limiter.take(k, &lim, 1, 0);
    }
    let mut k = 0u64;
    c.bench_function("limiter take (bucket cache lookup among 100k + CAS)", |bn| {
        bn.iter(|| {
            k = (k + 7919) % 100_000;
            black_box(limiter.take(black_box(k), &lim, 1, limiter.now()))
        })
    });

    let shared = Arc::new(Bucket::default());
    let stop = Arc::new(AtomicBool::new(false));
    let other = {
        let (shared, stop) = (shared.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let now = epoch.elapsed().as_nanos() as u64;
                black_box(shared.take(now, 1, interval, burst));
            }
        })
    };
    c.bench_function("bucket take, a second thread taking from the same bucket", |bn| {
        bn.iter(|| {
            let now = epoch.elapsed().as_nanos() as u64;
            black_box(shared.take(black_box(now), 1, interval, burst))
        })
    });
    stop.store(true, Ordering::Relaxed);
    let _ = other.join();

    // In a fleet: every take also counts what was asked and admitted, and the first take
    // of a sync period queues the bucket.
    let fleet = Arc::new(Limiter::fleet(1 << 20));
    for k in 0..100_000u64 {
        let _ = fleet.take(k, &lim, 1, 0);
    }
    c.bench_function("fleet limiter take (lookup among 100k + CAS + count)", |bn| {
        bn.iter(|| {
            k = (k + 7919) % 100_000;
            black_box(fleet.take(black_box(k), &lim, 1, fleet.now()))
        })
    });
    let stop = Arc::new(AtomicBool::new(false));
    let other = {
        let (fleet, stop, lim) = (fleet.clone(), stop.clone(), lim.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                black_box(fleet.take(42, &lim, 1, fleet.now()));
            }
        })
    };
    c.bench_function("fleet limiter take, a second thread taking from the same key", |bn| {
        bn.iter(|| black_box(fleet.take(black_box(42), &lim, 1, fleet.now())))
    });
    stop.store(true, Ordering::Relaxed);
    let _ = other.join();
}

fn limit() -> postern_builtin_filters::ratelimit::Limit {
    postern_builtin_filters::ratelimit::Limit::from_rate(
        "bench",
        &postern_model::Rate { rps: 1_000_000_000, burst: 1 << 40 },
    )
    .unwrap()
}

criterion_group!(benches, bench);
criterion_main!(benches);
