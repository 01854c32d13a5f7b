//! The quota service's intake: `UsageStore::apply` of one window of 3 000 rows (a busy
//! node's 10 s) in one SQLite transaction (WAL, `synchronous=FULL`): (node, seq, part)
//! for each caller's part, totals, minute rows and quota use. A fleet of 90 such nodes
//! needs 9 windows (27 000 rows) a second.
#![allow(clippy::expect_used)]

use criterion::{Criterion, criterion_group, criterion_main};
use postern_model::usage::{CallerKind, LATENCY_BUCKETS, Row, Window};
use posternctl::usage::{Quotas, UsageStore};

fn window(seq: u64, rows: usize) -> Window {
    let rows = (0..rows)
        .map(|i| {
            let mut latency = vec![0; LATENCY_BUCKETS];
            latency[3] = 7;
            Row {
                caller: format!("key_{i:012}"),
                kind: CallerKind::Key,
                product: "search".into(),
                route: "search/query".into(),
                status: [0, 6, 0, 1, 0],
                latency,
                latency_us: 7_000,
            }
        })
        .collect();
    // Ten seconds apart, in December 2026.
    Window::new("node-1".into(), seq, 1_796_083_200 + (seq % 200_000) * 10, false, rows)
}

fn apply(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = UsageStore::open(&dir.path().join("usage.db")).expect("store");
    // No caller on a quota: the quota use is one more upsert per row for those on one.
    let quotas = Quotas::default();
    for rows in [30, 3_000] {
        let mut seq = 0;
        c.bench_function(&format!("apply: a window of {rows} rows"), |b| {
            b.iter(|| {
                seq += 1;
                let w = window(seq + rows as u64 * 1_000_000, rows);
                store.apply(std::slice::from_ref(&w), 1_796_083_200, &quotas).expect("apply")
            })
        });
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10);
    targets = apply
}
criterion_main!(benches);
