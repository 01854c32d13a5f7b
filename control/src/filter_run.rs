//! `posternctl filter run`: runs a filter component on one request (and, when given, on
//! the backend's response to it) in the gateway's real sandbox (same runtime, limits,
//! outcome classification and output rules as a node) and prints each phase's decision
//! and its cost (fuel, memory high-water mark, time), with what the filter logged and
//! counted, so an author can test a build before shipping it.

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
    /// The backend's response; when given, the response phase runs after the request
    /// phases if they forwarded the request.
    pub response: Option<RunResponse>,
}

/// The backend's response head the response phase runs on (the filter world's response
/// head has no body).
#[derive(Debug, Clone)]
pub struct RunResponse {
    /// Status.
    pub status: u16,
    /// `name: value` headers.
    pub headers: Vec<(String, String)>,
}

/// Lowercased names and the values of `headers`, for [`borrowed`].
fn lowered(headers: &[(String, String)]) -> Vec<(String, &[u8])> {
    headers.iter().map(|(k, v)| (k.to_ascii_lowercase(), v.as_bytes())).collect()
}

/// Header fields as the guest receives them, borrowed from [`lowered`].
fn borrowed<'a>(headers: &'a [(String, &'a [u8])]) -> Vec<(&'a str, &'a [u8])> {
    headers.iter().map(|(k, v)| (k.as_str(), *v)).collect()
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

fn response_json(e: &types::ResponseEdits) -> serde_json::Value {
    serde_json::json!({
        "decision": "continue",
        "set_headers": fields(&e.set_headers),
        "append_headers": fields(&e.append_headers),
        "remove_headers": e.remove_headers,
    })
}

/// A call's report: its answer, or the rule it broke, or how it failed; and its cost.
fn report<T>(
    phase: &str,
    call: &postern_wasm::runtime::Call<T>,
    check: impl Fn(&T) -> Result<(), Rule>,
    json: impl Fn(&T) -> serde_json::Value,
) -> serde_json::Value {
    let mut v = match &call.result {
        Ok(d) => match check(d) {
            Ok(()) => json(d),
            Err(rule) => refused(rule, Some(json(d))),
        },
        Err(Outcome::BadOutput(rule)) => refused(*rule, None),
        Err(o) => serde_json::json!({"decision": "failed", "outcome": o.as_str()}),
    };
    v["phase"] = phase.into();
    v["fuel"] = call.fuel.into();
    v["memory_bytes"] = call.memory.into();
    v["micros"] = u64::try_from(call.took.as_micros()).unwrap_or(u64::MAX).into();
    v["logs"] = call
        .logs
        .iter()
        .map(|(level, msg)| serde_json::json!({"level": postern_wasm::runtime::level_str(*level), "message": msg}))
        .collect();
    let mut counters = serde_json::Map::new();
    for (name, delta) in &call.counters {
        let n = counters.get(name).and_then(serde_json::Value::as_u64).unwrap_or(0);
        counters.insert(name.clone(), n.saturating_add(*delta).into());
    }
    v["counters"] = counters.into();
    v
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

/// Runs `module` on `req` with `config` under `limits`; returns a JSON report per phase
/// (`request`, `request_body`, `response`). Its answers are checked by the node's rules
/// ([`postern_wasm::output`]), path edits under the default path policy.
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
    if let Some(resp) = &req.response {
        anyhow::ensure!((100..=599).contains(&resp.status), "response status {} is not 100-599", resp.status);
    }
    let (path, query) = match req.path.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (req.path.as_str(), None),
    };
    let lowered_req = lowered(&req.headers);
    let headers = borrowed(&lowered_req);
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
    let check_request = |d: &types::Decision| output::check_decision(d, &limits, Some(paths));
    let check_response = |e: &types::ResponseEdits| output::check_response(e, &limits);
    let binding = Binding { module: prepared.clone(), limits, config: config.clone(), stats, tag };
    let first = rt.block_on(runtime.on_request(&binding, wit_req.clone(), cx.clone()));
    let mut phases = vec![report("request", &first, check_request, decision_json)];
    let forwarded = |phases: &[serde_json::Value]| phases.last().is_some_and(|p| p["decision"] == "continue");
    if let (true, Some(body)) = (forwarded(&phases), &req.body) {
        let call = rt.block_on(runtime.on_request_body(&binding, wit_req, body, cx.clone()));
        phases.push(report("request_body", &call, check_request, decision_json));
    }
    if let (true, Some(resp)) = (forwarded(&phases), &req.response) {
        let lowered_resp = lowered(&resp.headers);
        let head = types::ResponseHead { status: resp.status, headers: &borrowed(&lowered_resp) };
        let call = rt.block_on(runtime.on_response(&binding, head, cx));
        phases.push(report("response", &call, check_response, response_json));
    }
    let failed = phases.iter().any(|p| p["decision"] == "failed");
    let pre_initialised = !Arc::ptr_eq(&prepared, m);
    Ok(
        serde_json::json!({"module": m.digest, "pre_initialised": pre_initialised, "limits": limits, "request_id": request_id, "phases": phases, "ok": !failed}),
    )
}

/// A manifest's sample case as the request to run.
pub fn sample_request(case: &crate::config::FilterSampleDoc) -> RunRequest {
    let r = &case.request;
    RunRequest {
        method: r.method.clone(),
        path: r.path.clone(),
        headers: r.headers.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        body: r.body.as_ref().map(|b| b.clone().into_bytes()),
        response: case.response.as_ref().map(|resp| RunResponse {
            status: resp.status,
            headers: resp.headers.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        }),
    }
}

/// How a filter's decision (a [`run`] report) differs from what a sample expects, if it
/// does.
pub fn sample_mismatch(expect: &crate::config::FilterExpectDoc, report: &serde_json::Value) -> Option<String> {
    // The last phase that ran decides: the response phase's when the sample gives a
    // response and the request was forwarded.
    let got = &report["phases"].as_array().and_then(|p| p.last()).cloned().unwrap_or_default();
    let decision = got["decision"].as_str().unwrap_or("none");
    let describe = |v: &serde_json::Value| match v["decision"].as_str() {
        Some("respond") => format!("respond {}", v["status"]),
        Some("failed") => match v["rule"].as_str() {
            Some(rule) => format!("failed (bad_output: the answer breaks the rule {rule})"),
            None => format!("failed ({})", v["outcome"].as_str().unwrap_or("?")),
        },
        Some(d) => d.to_owned(),
        None => "nothing".to_owned(),
    };
    let wanted = match (expect.decision.as_str(), expect.status) {
        ("respond", Some(s)) => format!("respond {s}"),
        (d, _) => d.to_owned(),
    };
    let phase = if got["phase"] == "response" { " in the response phase" } else { "" };
    if decision != expect.decision || (decision == "respond" && expect.status.is_some_and(|s| got["status"] != s)) {
        return Some(format!("expected {wanted}, got {}{phase}", describe(got)));
    }
    for (name, value) in &expect.set_headers {
        let set = got["set_headers"].as_array().and_then(|h| {
            h.iter().find(|kv| kv[0].as_str().is_some_and(|k| k.eq_ignore_ascii_case(name))).map(|kv| kv[1].clone())
        });
        if set.as_ref().and_then(|v| v.as_str()) != Some(value.as_str()) {
            let got = set.map_or("not set".to_owned(), |v| format!("set to {v}"));
            return Some(format!("expected header {name} set to {value:?}, it was {got}{phase}"));
        }
    }
    if let Some(p) = &expect.path
        && got["path"].as_str() != Some(p.as_str())
    {
        return Some(format!("expected path {p:?}, got {}", got["path"]));
    }
    None
}
