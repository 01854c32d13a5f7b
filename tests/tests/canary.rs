//! Canaries through a real node: callers on the exclusion list (`neverCanary` in
//! `platform/gateway.yaml`, by key, app or plan) always get the route's stable backend,
//! everyone else follows the split, and metrics are tagged with the backend.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use http::StatusCode;
use postern_e2e::{Echo, Node, Repo, get, new_key};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_on_the_exclusion_list_never_join_a_canary() {
    let stable = Echo::start("v2");
    let next = Echo::start("v2-next");
    let repo = Repo::new();
    repo.write(
        "platform/clusters.yaml",
        &format!(
            "clusters:\n  orders-v2:\n    endpoints: [\"{}\"]\n  orders-v2-next:\n    endpoints: [\"{}\"]\n",
            stable.addr(),
            next.addr()
        ),
    );
    repo.write("platform/ownership.yaml", "owners:\n  - { host: \"*\", pathPrefix: /, team: t }\n");
    repo.write(
        "platform/plans.yaml",
        "scopes: []\nproducts: [orders]\nplans:\n  gold: { products: [orders] }\n  bank: { products: [orders] }\n",
    );
    repo.write("platform/gateway.yaml", "neverCanary:\n  keys: [k-listed]\n  apps: [app-listed]\n  plans: [bank]\n");
    // Every caller not excluded goes to the canary (weight 100 of 100).
    repo.write(
        "teams/t/routes.yaml",
        "routes:\n  - name: orders\n    match: { path: { value: /orders } }\n    auth: { methods: [apiKey], product: orders }\n    backendRefs: [{ name: orders-v2, weight: 0 }, { name: orders-v2-next, weight: 100 }]\n    timeouts: { connect: 1s, response: 2s }\n",
    );
    let keys = [
        ("k-plain", "app-1", "gold", "v2-next"),
        ("k-listed", "app-2", "gold", "v2"),
        ("k-app", "app-listed", "gold", "v2"),
        ("k-bank", "app-3", "bank", "v2"),
    ];
    let raw: Vec<String> =
        keys.iter().map(|(id, app, plan, _)| new_key(repo.path(), id, app, "acme", plan, &[])).collect();
    let snap = repo.path().join("snapshot.json");
    repo.compile_ok(&snap);
    let node = Node::start(&snap, &[]);
    for ((id, _, _, want), key) in keys.iter().zip(&raw) {
        for _ in 0..3 {
            let r = get(&node.url("/orders"), &[("x-api-key", key)]).await;
            assert_eq!(r.status, StatusCode::OK);
            assert_eq!(r.backend(), *want, "{id}");
        }
    }
    let metrics = String::from_utf8_lossy(&get(&node.admin_url("/metrics"), &[]).await.body).into_owned();
    let series = |backend: &str| {
        format!("postern_backend_requests_total{{route=\"t/orders\",backend=\"{backend}\",status=\"2xx\"}}")
    };
    assert!(metrics.contains(&format!("{} 3\n", series("orders-v2-next"))), "{metrics}");
    assert!(metrics.contains(&format!("{} 9\n", series("orders-v2"))), "{metrics}");
    assert!(
        metrics.contains("postern_backend_request_duration_seconds_count{route=\"t/orders\",backend=\"orders-v2\"} 9")
    );

    // An unknown plan on the list is refused at compile.
    repo.write("platform/gateway.yaml", "neverCanary:\n  plans: [platinum]\n");
    let out = repo.compile(&repo.path().join("bad.json"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("neverCanary.plans[0]"), "{stderr}");
}
