//! What the closer pays to spool a closed window: `Spool::append` of a window of 3 000
//! rows (a busy node's 10 s: 3 000 callers × route) and of 30 rows, each written and
//! `sync_data`ed before it counts as spooled. On the spool's own thread, never a
//! request worker; the figure bounds windows per second per node.
#![allow(clippy::expect_used)]

use criterion::{Criterion, criterion_group, criterion_main};
use postern_model::usage::{CallerKind, LATENCY_BUCKETS, Row, Window};
use postern_usage::spool::{Spool, SpoolLimits};

fn window(rows: usize) -> Window {
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
    Window::new("node-1".into(), 0, 1_796_083_200, false, rows)
}

fn append(c: &mut Criterion) {
    for rows in [30, 3_000] {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut spool, _) = Spool::open(dir.path(), "node-1", SpoolLimits::with_cap(16 << 30)).expect("spool");
        let mut w = window(rows);
        let bytes = serde_json::to_vec(&w).map(|b| b.len()).unwrap_or(0);
        c.bench_function(&format!("append + fsync: a window of {rows} rows ({bytes} bytes)"), |b| {
            b.iter(|| {
                spool
                    .append(|seq| {
                        w.seq = seq;
                        serde_json::to_vec(&w).unwrap_or_default()
                    })
                    .expect("append")
            })
        });
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = append
}
criterion_main!(benches);
