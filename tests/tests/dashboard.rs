//! The Grafana dashboard in `docs/grafana/postern-node.json`: it is a valid dashboard
//! (against the essentials of Grafana's JSON model in `docs/grafana/dashboard.schema.json`,
//! with no overlapping panels and unique ids and refIds), and every metric its queries
//! name is one a real node exports on `/metrics`.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use http::StatusCode;
use postern_e2e::{Echo, Node, Repo, get, platform};
use serde_json::Value;

const ROUTES: &str = "routes:\n  - name: echo\n    public: true\n    match: { path: { value: /echo } }\n    backendRefs: [{ name: e }]\n    timeouts: { connect: 1s, response: 5s }\n";

fn docs() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/grafana")
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn dashboard() -> Value {
    read_json(&docs().join("postern-node.json"))
}

/// Every panel, those nested in collapsed rows included.
fn panels(dash: &Value) -> Vec<&Value> {
    let mut out = Vec::new();
    for p in dash["panels"].as_array().expect("panels") {
        out.push(p);
        out.extend(p["panels"].as_array().into_iter().flatten());
    }
    out
}

/// Every `expr` in the dashboard (panel targets) and every variable's query.
fn queries(dash: &Value) -> Vec<String> {
    fn walk(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(map) => {
                for (k, x) in map {
                    match (k.as_str(), x) {
                        ("expr" | "definition", Value::String(s)) => out.push(s.clone()),
                        _ => walk(x, out),
                    }
                }
            }
            Value::Array(items) => items.iter().for_each(|x| walk(x, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(&dash["panels"], &mut out);
    walk(&dash["templating"], &mut out);
    out
}

/// The `postern_[a-z0-9_]+` tokens of a query (not inside a longer identifier).
fn metric_names(expr: &str) -> Vec<String> {
    let bytes = expr.as_bytes();
    let ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b':';
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(at) = expr[i..].find("postern_").map(|j| i + j) {
        let mut end = at + "postern_".len();
        while end < bytes.len()
            && (bytes[end].is_ascii_lowercase() || bytes[end].is_ascii_digit() || bytes[end] == b'_')
        {
            end += 1;
        }
        if at == 0 || !ident(bytes[at - 1]) {
            out.push(expr[at..end].to_owned());
        }
        i = end;
    }
    out
}

#[test]
fn dashboard_is_valid_grafana_json() {
    let dash = dashboard();
    let schema = read_json(&docs().join("dashboard.schema.json"));
    let validator = jsonschema::validator_for(&schema).expect("the schema compiles");
    let errors: Vec<String> =
        validator.iter_errors(&dash).map(|e| format!("  at {}: {e}", e.instance_path())).collect();
    assert!(errors.is_empty(), "postern-node.json does not match dashboard.schema.json:\n{}", errors.join("\n"));

    assert_eq!(dash["uid"], "postern-node");
    assert_eq!(dash["title"], "Postern node");
    assert_eq!(dash["schemaVersion"], 39);
    let vars: BTreeMap<&str, &Value> = dash["templating"]["list"]
        .as_array()
        .expect("templating variables")
        .iter()
        .map(|v| (v["name"].as_str().expect("variable name"), v))
        .collect();
    assert_eq!(vars["datasource"]["type"], "datasource");
    assert_eq!(vars["datasource"]["query"], "prometheus");
    for (name, query) in [
        ("instance", "label_values(postern_snapshot_version, instance)"),
        ("route", "label_values(postern_requests_total, route)"),
    ] {
        let v = vars.get(name).unwrap_or_else(|| panic!("no variable `{name}`"));
        assert_eq!(v["definition"], query, "variable `{name}`");
        assert!(v["multi"] == true && v["includeAll"] == true, "variable `{name}` is multi-value with All");
    }

    let panels = panels(&dash);
    let mut problems = Vec::new();
    let mut ids = BTreeSet::new();
    let mut boxes: Vec<(&str, [i64; 4])> = Vec::new();
    for p in &panels {
        let title = p["title"].as_str().unwrap_or("?");
        if !ids.insert(p["id"].as_i64().unwrap_or(-1)) {
            problems.push(format!("panel id {} is used twice (`{title}`)", p["id"]));
        }
        let g = &p["gridPos"];
        let [x, y, w, h] = ["x", "y", "w", "h"].map(|k| g[k].as_i64().unwrap_or(-1));
        if x + w > 24 {
            problems.push(format!("`{title}` passes the grid's right edge: x {x} + w {w} > 24"));
        }
        for &(other, [ox, oy, ow, oh]) in &boxes {
            if x < ox + ow && ox < x + w && y < oy + oh && oy < y + h {
                problems.push(format!("`{title}` overlaps `{other}`"));
            }
        }
        boxes.push((title, [x, y, w, h]));
        let mut refs = BTreeSet::new();
        for t in p["targets"].as_array().into_iter().flatten() {
            let r = t["refId"].as_str().unwrap_or_default();
            if !refs.insert(r) {
                problems.push(format!("`{title}` has two targets with refId {r}"));
            }
            if p["type"] != "row" && t["datasource"].is_object() && t["datasource"] != p["datasource"] {
                problems.push(format!("`{title}` target {r} uses another data source than its panel"));
            }
        }
    }
    assert!(problems.is_empty(), "postern-node.json:\n  {}", problems.join("\n  "));
    let kinds: BTreeSet<&str> = panels.iter().filter_map(|p| p["type"].as_str()).collect();
    assert!(kinds.contains("row") && kinds.contains("timeseries"), "{kinds:?}");
    eprintln!("{} panels ({kinds:?}), {} queries", panels.len(), queries(&dash).len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_query_names_an_exported_metric() {
    let echo = Echo::start("e");
    let repo = Repo::new();
    platform(&repo, &[("e", &echo.addr())]);
    repo.write("teams/t/routes.yaml", ROUTES);
    let snap = repo.path().join("out/snapshot.json");
    std::fs::create_dir_all(snap.parent().unwrap()).unwrap();
    repo.compile_ok(&snap);
    // Usage metering (a spool), an access log and a fleet rate sync, so their families are
    // rendered. The sync points at a port nobody listens on: it renders, lost.
    let work = tempfile::tempdir().unwrap();
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_port = dead.local_addr().unwrap().port();
    let redis = format!("redis://127.0.0.1:{dead_port}");
    drop(dead);
    let access_log = work.path().join("access.log");
    let spool = work.path().join("spool");
    let node = Node::start(
        &snap,
        &[
            "--access-log",
            access_log.to_str().unwrap(),
            "--usage-spool",
            spool.to_str().unwrap(),
            "--ratelimit-redis",
            &redis,
            "--node-id",
            "dashboard-0",
            // A collector that is not there: the traces' health series are exported.
            "--otlp-endpoint",
            &format!("http://127.0.0.1:{dead_port}"),
        ],
    );
    assert_eq!(get(&node.url("/echo"), &[]).await.status, StatusCode::OK, "log:\n{}", node.log());
    assert_eq!(get(&node.url("/echo?again=1"), &[]).await.status, StatusCode::OK);
    assert_eq!(get(&node.url("/nowhere"), &[]).await.status, StatusCode::NOT_FOUND);

    let metrics = get(&node.admin_url("/metrics"), &[]).await;
    assert_eq!(metrics.status, StatusCode::OK);
    let text = String::from_utf8_lossy(&metrics.body).into_owned();
    // Family name -> type, from the `# TYPE` lines.
    let families: BTreeMap<&str, &str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| {
            let mut parts = l.split_whitespace();
            Some((parts.next()?, parts.next()?))
        })
        .collect();
    assert!(families.contains_key("postern_requests_total"), "/metrics:\n{text}");

    let dash = dashboard();
    let mut used = BTreeMap::<String, String>::new();
    for expr in queries(&dash) {
        for name in metric_names(&expr) {
            used.entry(name).or_insert_with(|| expr.clone());
        }
    }
    assert!(used.len() > 10, "the dashboard's queries name only {:?}", used.keys());
    let exported = |name: &str| {
        families.contains_key(name)
            || ["_bucket", "_sum", "_count"].iter().any(|suffix| {
                name.strip_suffix(suffix).is_some_and(|family| families.get(family) == Some(&"histogram"))
            })
    };
    let missing: Vec<String> =
        used.iter().filter(|(name, _)| !exported(name)).map(|(name, expr)| format!("{name}  (in `{expr}`)")).collect();
    assert!(
        missing.is_empty(),
        "the dashboard names metrics this node does not export:\n  {}\nexported families: {:?}",
        missing.join("\n  "),
        families.keys().collect::<Vec<_>>()
    );
    eprintln!("the dashboard's {} metric names are all exported: {:?}", used.len(), used.keys());
}
