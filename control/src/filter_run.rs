//! `posternctl filter run`: runs a filter component on one request in the gateway's real
//! sandbox (same runtime, limits and outcome classification as a node) and prints the
//! decision and its cost, so an author can test a build before shipping it.

use std::path::Path;
use std::sync::Arc;

use postern_model::path::PathPolicy;
use postern_model::wasm::Limits;
use postern_wasm::output::{self, Rule};
use postern_wasm::runtime::types;
use postern_wasm::{Binding, FilterStats, LoadError, Module, Outcome, Runtime, RuntimeConfig};

/// One request to run a filter on.
#[derive(Debug, Clone)]
pub struct RunRequest {
    /// Method.
    pub method: String,
    /// Path, optionally with `?query`.
    pub path: String,
    /// `name: value` headers.
    pub headers: Vec<(String, String)>,
    /// Body; when given, the body phase runs after the request phase.
    pub body: Option<Vec<u8>>,
}

fn fields(list: &[(String, Vec<u8>)]) -> serde_json::Value {
    list.iter().map(|(k, v)| serde_json::json!([k, String::from_utf8_lossy(v)])).collect()
}

fn decision_json(d: &types::Decision) -> serde_json::Value {
    match d {
        types::Decision::Continue(e) => serde_json::json!({
            "decision": "continue",
            "set_headers": fields(&e.set_headers),
            "append_headers": fields(&e.append_headers),
            "remove_headers": e.remove_headers,
            "path": e.path,
        }),
        types::Decision::Respond(r) => serde_json::json!({
            "decision": "respond",
            "status": r.status,
            "headers": fields(&r.headers),
            "body": String::from_utf8_lossy(&r.body),
        }),
    }
}

/// The report of an answer the node would refuse: the rule it broke, with the answer.
fn refused(rule: Rule, answer: Option<serde_json::Value>) -> serde_json::Value {
    let mut v = serde_json::json!({
        "decision": "failed",
        "outcome": "bad_output",
        "rule": rule.as_str(),
        "error": rule.describe(),
    });
    if let Some(a) = answer {
        v["answer"] = a;
    }
    v
}

/// Runs `module` on `req` with `config` under `limits`; returns a JSON report per phase.
/// Its answers are checked by the node's rules ([`postern_wasm::output`]), path edits
/// under the default path policy.
pub fn run(
    module: &Path,
    config: &serde_json::Value,
    limits: Limits,
    req: &RunRequest,
) -> anyhow::Result<serde_json::Value> {
    let over = limits.over(&Limits::MAXIMA);
    anyhow::ensure!(over.is_empty(), "limits: {}", over.join("; "));
    let runtime = Runtime::new(&RuntimeConfig { max_instances: 4, ..Default::default() })?;
    let bytes = std::fs::read(module).map_err(|e| anyhow::anyhow!("cannot read {}: {e}", module.display()))?;
    let m = runtime.load(&bytes, None)?;
    run_loaded(&runtime, &m, config, limits, req, &PathPolicy::default())
}

/// Runs a module already loaded in `runtime` (as [`run`] does), checking path edits
/// under `paths`.
pub fn run_loaded(
    runtime: &Runtime,
    m: &Arc<Module>,
    config: &serde_json::Value,
    limits: Limits,
    req: &RunRequest,
    paths: &PathPolicy,
) -> anyhow::Result<serde_json::Value> {
    let (path, query) = match req.path.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (req.path.as_str(), None),
    };
    let names: Vec<String> = req.headers.iter().map(|(k, _)| k.to_ascii_lowercase()).collect();
    let headers: Vec<(&str, &[u8])> =
        names.iter().zip(&req.headers).map(|(k, (_, v))| (k.as_str(), v.as_bytes())).collect();
    let wit_req = types::Request { method: &req.method, path, query, authority: Some("localhost"), headers: &headers };
    let request_id = "0".repeat(32);
    let config = postern_model::wasm::config_bytes(config);
    // As the gateway does: the filter's `init` checks the config and may pre-initialise it.
    let prepared = match runtime.prepare(m, &config, &limits) {
        Ok(p) => p,
        Err(e @ (LoadError::Config(_) | LoadError::Init(_))) => {
            let outcome = if matches!(e, LoadError::Config(_)) { "config_refused" } else { "init_failed" };
            let phase =
                serde_json::json!({"phase": "init", "decision": "failed", "outcome": outcome, "error": e.to_string()});
            return Ok(serde_json::json!({"module": m.digest, "limits": limits, "phases": [phase], "ok": false}));
        }
        Err(e) => return Err(e.into()),
    };
    let cx = types::Context { route_id: "local/run", request_id: &request_id, identity: None, config: &config };
    let stats = Arc::new(FilterStats::default());
    let tag: Arc<str> = Arc::from("local");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    // As the node does: the runtime checks sizes, the rest of the rules follow.
    let report = |phase: &str, call: &postern_wasm::runtime::Call<types::Decision>| {
        let mut v = match &call.result {
            Ok(d) => match output::check_decision(d, &limits, Some(paths)) {
                Ok(()) => decision_json(d),
                Err(rule) => refused(rule, Some(decision_json(d))),
            },
            Err(Outcome::BadOutput(rule)) => refused(*rule, None),
            Err(o) => serde_json::json!({"decision": "failed", "outcome": o.as_str()}),
        };
        v["phase"] = phase.into();
        v["fuel"] = call.fuel.into();
        v["micros"] = u64::try_from(call.took.as_micros()).unwrap_or(u64::MAX).into();
        v
    };
    let binding = Binding { module: prepared.clone(), limits, config: config.clone(), stats, tag };
    let first = rt.block_on(runtime.on_request(&binding, wit_req.clone(), cx.clone()));
    let first = report("request", &first);
    let forwarded = first["decision"] == "continue";
    let mut phases = vec![first];
    if let (true, Some(body)) = (forwarded, &req.body) {
        let call = rt.block_on(runtime.on_request_body(&binding, wit_req, body, cx));
        phases.push(report("request_body", &call));
    }
    let failed = phases.iter().any(|p| p["decision"] == "failed");
    let pre_initialised = !Arc::ptr_eq(&prepared, m);
    Ok(
        serde_json::json!({"module": m.digest, "pre_initialised": pre_initialised, "limits": limits, "phases": phases, "ok": !failed}),
    )
}
