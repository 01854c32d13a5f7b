//! Snapshot compile + swap of 5,000 routes on a node: read the file's bytes, check the
//! hash, build every route (filters, clients, route table) and swap the pointer.
//! Run: `cargo bench -p postern`.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::collections::BTreeMap;
use std::hint::black_box;
use std::sync::Arc;

use arc_swap::ArcSwap;
use criterion::{Criterion, criterion_group, criterion_main};
use postern::metrics::Metrics;
use postern::snapshot::Builder;
use postern_model::{
    AuthMethod, Cluster, FilterSpec, PathMatchKind, Plan, Pool, Route, RouteAuth, SCHEMA_VERSION, Snapshot,
    SnapshotFile, Timeouts, WeightedBackend,
};

fn snapshot(routes: usize) -> Snapshot {
    let mut clusters = BTreeMap::new();
    for c in 0..300 {
        clusters.insert(
            format!("svc{c}"),
            Cluster {
                endpoints: vec![format!("10.0.{}.{}:8080", c / 250, c % 250 + 1)],
                owner: None,
                max_connections: 1024,
                breaker: Default::default(),
                retry_budget: Default::default(),
                shed_at_percent: 80,
                http2: false,
                tls: None,
                outlier: Default::default(),
            },
        );
    }
    let mut out = Vec::with_capacity(routes);
    for i in 0..routes {
        let team = i % 300;
        let filters = if i % 4 == 0 {
            vec![FilterSpec {
                kind: "request-headers".into(),
                config: serde_json::json!({"set": [{"name": "x-team", "value": format!("team{team}")}]}),
            }]
        } else {
            Vec::new()
        };
        out.push(Route {
            id: format!("team{team}/route{i}"),
            team: format!("team{team}"),
            pool: if i % 3 == 0 { Pool::Partner } else { Pool::Public },
            hosts: Vec::new(),
            methods: vec!["GET".into()],
            path: format!("/v1/team{team}/r{i}/{{id}}"),
            path_kind: if i % 2 == 0 { PathMatchKind::Exact } else { PathMatchKind::Prefix },
            version: None,
            backends: vec![WeightedBackend { cluster: format!("svc{team}"), weight: 100 }],
            split_header: None,
            timeouts: Timeouts { connect_ms: 250, response_ms: 2000, body_idle_ms: None, body_total_ms: 300_000 },
            max_body_bytes: 65536,
            rewrite: None,
            filters,
            deprecation: None,
            // Most routes authenticate, as in production.
            public: i % 4 == 0,
            buffer_body: false,
            auth: (i % 4 != 0).then(|| RouteAuth {
                methods: vec![AuthMethod::ApiKey, AuthMethod::Jwt],
                scopes: vec!["orders:read".into()],
                product: "orders".into(),
            }),
            rate_limit: None,
            retry: Default::default(),
            priority: None,
            validate: None,
            compress: None,
            grpc: None,
        });
    }
    let plans = [("partner".to_owned(), Plan::of_products(&["orders"]))].into_iter().collect();
    Snapshot {
        schema: SCHEMA_VERSION,
        clusters,
        routes: out,
        plans,
        paths: Default::default(),
        never_canary: Default::default(),
    }
}

fn bench(c: &mut Criterion) {
    let file = SnapshotFile::seal(1, &snapshot(5000)).expect("seal");
    let bytes = serde_json::to_vec(&file).expect("json");
    eprintln!("snapshot of 5,000 routes: {} bytes", bytes.len());
    let metrics = Arc::new(Metrics::default());
    let builder = Builder::new(metrics);
    let live = ArcSwap::from_pointee(builder.build_bytes(&bytes).expect("build"));
    c.bench_function("snapshot_build_and_swap_5000", |b| {
        b.iter(|| {
            let next = builder.build_bytes(black_box(&bytes)).expect("build");
            live.store(Arc::new(next));
        })
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = bench
}
criterion_main!(benches);
