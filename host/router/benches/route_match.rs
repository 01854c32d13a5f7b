//! Route match at 5,000 routes (300 teams): the per-request lookup.
//! Run: `cargo bench -p postern-router`.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use criterion::{Criterion, criterion_group, criterion_main};
use http::{HeaderMap, HeaderValue, Method};
use postern_router::{Match, PathKind, RouteSpec, Router, RouterBuilder};
use std::hint::black_box;

/// 300 teams x ~17 routes: exact routes with parameters, prefixes, methods, a version
/// header variant and a few host-specific routes.
pub fn table() -> Router<usize> {
    let mut b = RouterBuilder::new();
    let none: Vec<String> = Vec::new();
    let get = vec!["GET".to_owned()];
    let post = vec!["POST".to_owned()];
    let mut n = 0;
    'outer: for team in 0..300 {
        let hosts = if team % 10 == 0 { vec![format!("team{team}.api.example.com")] } else { Vec::new() };
        for res in 0..4 {
            let base = format!("/v1/team{team}/res{res}");
            let specs = [
                (format!("{base}/{{id}}"), PathKind::Exact, &get, None),
                (base.clone(), PathKind::Exact, &post, None),
                (base.clone(), PathKind::Prefix, &none, None),
                (format!("/v2/team{team}/res{res}"), PathKind::Prefix, &none, Some(("api-version", "2"))),
            ];
            for (path, kind, methods, version) in &specs {
                let spec = RouteSpec { hosts: &hosts, methods, path, kind: *kind, version: *version };
                b.add(&spec, n).expect("route");
                n += 1;
                if n == 5000 {
                    break 'outer;
                }
            }
        }
        let spec = RouteSpec {
            hosts: &hosts,
            methods: &none,
            path: &format!("/v1/team{team}"),
            kind: PathKind::Prefix,
            version: None,
        };
        b.add(&spec, n).expect("route");
        n += 1;
    }
    b.build()
}

fn bench(c: &mut Criterion) {
    let router = table();
    assert!(router.len() >= 5000, "{} routes", router.len());
    let empty = HeaderMap::new();
    let mut v2 = HeaderMap::new();
    v2.insert("api-version", HeaderValue::from_static("2"));
    let mut g = c.benchmark_group("route_match_5000");
    g.bench_function("exact_with_param", |b| {
        b.iter(|| {
            let m =
                router.find(black_box("api.example.com"), &Method::GET, black_box("/v1/team151/res2/12345"), &empty);
            assert!(matches!(m, Match::Found(_)));
        })
    });
    g.bench_function("longest_prefix", |b| {
        b.iter(|| {
            let m = router.find(
                black_box("api.example.com"),
                &Method::DELETE,
                black_box("/v1/team271/res3/9/items/4"),
                &empty,
            );
            assert!(matches!(m, Match::Found(_)));
        })
    });
    g.bench_function("version_header", |b| {
        b.iter(|| {
            let m = router.find(black_box("api.example.com"), &Method::GET, black_box("/v2/team42/res1/abc"), &v2);
            assert!(matches!(m, Match::Found(_)));
        })
    });
    g.bench_function("host_specific", |b| {
        b.iter(|| {
            let m = router.find(
                black_box("team120.api.example.com"),
                &Method::GET,
                black_box("/v1/team120/res0/1"),
                &empty,
            );
            assert!(matches!(m, Match::Found(_)));
        })
    });
    g.bench_function("not_found", |b| {
        b.iter(|| {
            let m = router.find(black_box("api.example.com"), &Method::GET, black_box("/v9/nothing/here"), &empty);
            assert!(matches!(m, Match::NotFound));
        })
    });
    g.finish();
    c.bench_function("router_build_5000", |b| b.iter(|| black_box(table())));
}

criterion_group!(benches, bench);
criterion_main!(benches);
