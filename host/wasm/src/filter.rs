//! A Wasm filter attached to a route, as a [`Filter`] on the filter contract: each
//! request runs in a fresh sandbox; failures follow the attachment's policy; a filter that
//! keeps failing is quarantined on its route.

// `Reply` is the contract's answer type; boxing it would only move the allocation.
#![allow(clippy::result_large_err)]

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use http::header::HOST;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode, Uri};
use postern_filter_contract::{
    Context, Filter, Flow, Identity, Problem, Reply, RequestHead, ResponseFlow, ResponseHead,
};
use smallvec::SmallVec;

use postern_model::path::PathPolicy;
use postern_model::wasm::{Attachment, FailurePolicy, config_bytes};
// The quarantine's windows are seconds long: the epoch thread's millisecond clock will do.
use crate::clock::coarse_ms;
use crate::output::{self, Rule};
use crate::runtime::{Binding, Call, Module, Runtime, types};
use crate::stats::{FilterStats, Outcome};

#[derive(Debug, Default)]
struct Quarantine {
    window: AtomicU64,
    calls: AtomicU64,
    failures: AtomicU64,
    until_ms: AtomicU64,
}

/// A built Wasm filter for one route.
pub struct WasmFilter {
    runtime: Arc<Runtime>,
    binding: Binding,
    attachment: Attachment,
    quarantine: Quarantine,
    /// The snapshot's path policy: a path edit must be canonical under it.
    paths: PathPolicy,
}

impl std::fmt::Debug for WasmFilter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WasmFilter").field("tag", &self.binding.tag).finish_non_exhaustive()
    }
}

impl WasmFilter {
    /// Builds the filter of `attachment` on `route_id`, whose path edits must be canonical
    /// under `paths` (the snapshot's policy).
    pub fn new(
        runtime: Arc<Runtime>,
        module: Arc<Module>,
        attachment: Attachment,
        route_id: &str,
        stats: Arc<FilterStats>,
        paths: PathPolicy,
    ) -> WasmFilter {
        let config = config_bytes(&attachment.config);
        let tag: Arc<str> = Arc::from(format!("{}@{}", attachment.name, route_id));
        let binding = Binding { module, limits: attachment.limits, config, stats, tag };
        WasmFilter { runtime, binding, attachment, quarantine: Quarantine::default(), paths }
    }

    fn quarantined(&self) -> bool {
        self.quarantine.until_ms.load(Ordering::Relaxed) > coarse_ms()
    }

    fn judge(&self, failed: bool) {
        let p = &self.attachment.quarantine;
        let window = coarse_ms() / (p.window_secs.max(1) * 1000);
        if self.quarantine.window.swap(window, Ordering::Relaxed) != window {
            self.quarantine.calls.store(0, Ordering::Relaxed);
            self.quarantine.failures.store(0, Ordering::Relaxed);
        }
        let calls = self.quarantine.calls.fetch_add(1, Ordering::Relaxed) + 1;
        let failures = self.quarantine.failures.fetch_add(u64::from(failed), Ordering::Relaxed) + u64::from(failed);
        if failed && calls >= p.min_calls && failures * 100 >= calls * p.failure_percent {
            self.quarantine.until_ms.store(coarse_ms() + p.quarantine_secs * 1000, Ordering::Relaxed);
            self.quarantine.calls.store(0, Ordering::Relaxed);
            self.quarantine.failures.store(0, Ordering::Relaxed);
            self.binding.stats.quarantines.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                filter = &*self.binding.tag,
                failures,
                calls,
                quarantine_secs = p.quarantine_secs,
                "filter quarantined on this route: it failed too often"
            );
        }
    }

    /// The failure answer under this attachment's policy.
    fn fail(&self, outcome: Outcome) -> Result<(), Reply> {
        match self.attachment.failure {
            FailurePolicy::FailOpen => Ok(()),
            FailurePolicy::FailClosed => Err(Reply::Problem(Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "filter_failed",
                match outcome {
                    Outcome::BadOutput(rule) => {
                        format!("filter {} failed: bad_output: its answer broke the rule {rule}", self.attachment.name)
                    }
                    other => format!("filter {} failed: {}", self.attachment.name, other.as_str()),
                },
            ))),
        }
    }

    /// Logs a failed call of request `cx`: a refused answer at warn, naming the rule (the
    /// 1st, 2nd, 4th, 8th... refusal on this route, so a filter refused on every request
    /// does not flood the log; the metric counts each), any other failure at debug.
    fn log_failure(&self, phase: &'static str, kind: Outcome, cx: &Context) {
        let request_id = cx.request_id.to_str().unwrap_or_default();
        match kind {
            Outcome::BadOutput(rule) => {
                let n = self.binding.stats.refused(rule);
                if n.is_power_of_two() {
                    tracing::warn!(
                        filter = &*self.binding.tag,
                        phase,
                        request_id,
                        rule = rule.as_str(),
                        refusals = n,
                        "filter answer refused: {}",
                        rule.describe()
                    );
                }
            }
            other => tracing::debug!(
                filter = &*self.binding.tag,
                phase,
                request_id,
                outcome = other.as_str(),
                "filter failed"
            ),
        }
    }

    /// The caller's scopes, for [`Self::context`].
    fn scopes(cx: &Context) -> Vec<&str> {
        cx.identity().map(|id| id.scope_list().collect()).unwrap_or_default()
    }

    /// The WIT context of `cx` and this attachment's config, borrowed from them.
    fn context<'a>(&'a self, cx: &'a Context, scopes: &'a [&'a str]) -> types::Context<'a> {
        types::Context {
            config: &self.binding.config,
            route_id: &cx.route_id,
            request_id: cx.request_id.to_str().unwrap_or_default(),
            identity: cx.identity().map(|id| types::Identity {
                subject: Identity::text(&id.subject),
                client_id: Identity::text(&id.client_id),
                tenant: Identity::text(&id.tenant),
                key_id: Identity::text(&id.key_id),
                plan: Identity::text(&id.plan),
                scopes,
            }),
        }
    }

    /// Runs the request phase, or with `body` the body phase, and applies the decision:
    /// on the worker at once when it can, so a quick filter needs no future; else a
    /// future that waits for it on the idle pool.
    fn request<'a>(&'a self, req: &'a mut RequestHead, body: Option<&'a [u8]>, cx: &'a Context) -> Flow<'a> {
        if self.quarantined() {
            self.binding.stats.record(Outcome::Quarantined, 0, std::time::Duration::ZERO);
            return flow(self.fail(Outcome::Quarantined));
        }
        let call = {
            let headers = fields(&req.headers);
            let scopes = Self::scopes(cx);
            let (wit_req, wcx) = (wit_request(req, &headers), self.context(cx, &scopes));
            match body {
                None => self.runtime.on_request_now(&self.binding, wit_req, wcx),
                Some(b) => self.runtime.on_request_body_now(&self.binding, wit_req, b, wcx),
            }
        };
        match call {
            Ok(call) => flow(self.conclude(req, cx, call)),
            Err(start) => {
                let call = {
                    let headers = fields(&req.headers);
                    let scopes = Self::scopes(cx);
                    let (wit_req, wcx) = (wit_request(req, &headers), self.context(cx, &scopes));
                    match body {
                        None => Box::pin(self.runtime.on_request_on_pool(&self.binding, &wit_req, &wcx, start))
                            as Pin<Box<dyn Future<Output = Call<types::Decision>> + Send>>,
                        Some(b) => {
                            Box::pin(self.runtime.on_request_body_on_pool(&self.binding, &wit_req, b, &wcx, start))
                        }
                    }
                };
                Flow::Wait(Box::pin(async move { self.conclude(req, cx, call.await) }))
            }
        }
    }

    /// Records a failed call: its outcome, towards quarantine when the filter caused it
    /// (not when the node was overloaded), and after a costly failure the route's next
    /// calls go to the idle pool, off the workers.
    fn failed(&self, kind: Outcome, fuel: u64, took: std::time::Duration) {
        self.binding.stats.record(kind, fuel, took);
        if kind.is_node_failure() {
            return;
        }
        self.judge(true);
        if kind.is_costly() {
            self.binding.stats.demote();
        }
    }

    /// Applies a request-phase call's decision to `req`, records its outcome, and answers
    /// under the failure policy when it failed.
    fn conclude(&self, req: &mut RequestHead, cx: &Context, call: Call<types::Decision>) -> Result<(), Reply> {
        let outcome = match call.result {
            Err(o) => Err(o),
            Ok(types::Decision::Continue(edits)) => apply_request_edits(req, edits, &self.paths).map(|()| None),
            Ok(types::Decision::Respond(reply)) => make_reply(reply).map(Some),
        };
        match outcome {
            Ok(reply) => {
                self.binding.stats.record(Outcome::Ok, call.fuel, call.took);
                self.judge(false);
                match reply {
                    Some(r) => Err(r),
                    None => Ok(()),
                }
            }
            Err(kind) => {
                self.failed(kind, call.fuel, call.took);
                self.log_failure("request", kind, cx);
                self.fail(kind)
            }
        }
    }

    async fn response(&self, resp: &mut ResponseHead, cx: &Context) -> Result<(), Reply> {
        if self.quarantined() {
            return Ok(());
        }
        let call = {
            let headers = fields(&resp.headers);
            let head = types::ResponseHead { status: resp.status.as_u16(), headers: &headers };
            let scopes = Self::scopes(cx);
            self.runtime.on_response(&self.binding, head, self.context(cx, &scopes)).await
        };
        let (fuel, took) = (call.fuel, call.took);
        let result = call.result.and_then(|edits| {
            apply_headers(
                &mut resp.headers,
                header_edits(&edits.set_headers, &edits.append_headers, &edits.remove_headers)?,
            );
            Ok(())
        });
        match result {
            Ok(()) => {
                self.binding.stats.record(Outcome::Ok, fuel, took);
                Ok(())
            }
            // Under the attachment's failure policy, as in the request phase: fail-closed
            // answers 503 instead of the backend's response unedited.
            Err(kind) => {
                self.failed(kind, fuel, took);
                self.log_failure("response", kind, cx);
                self.fail(kind)
            }
        }
    }
}

/// Header fields as the guest receives them, borrowed from the map (on the stack for up
/// to 16 fields).
fn fields(h: &HeaderMap) -> SmallVec<[(&str, &[u8]); 16]> {
    h.iter().map(|(k, v)| (k.as_str(), v.as_bytes())).collect()
}

/// The WIT request head of `req`, with its `headers` taken from [`fields`].
fn wit_request<'a>(req: &'a RequestHead, headers: &'a [(&'a str, &'a [u8])]) -> types::Request<'a> {
    types::Request {
        method: req.method.as_str(),
        path: req.uri.path(),
        query: req.uri.query(),
        // The Host header first: by the body phase the URI already names the backend.
        authority: req
            .headers
            .get(HOST)
            .and_then(|h| h.to_str().ok())
            .or_else(|| req.uri.authority().map(|a| a.as_str())),
        headers,
    }
}

/// A request-phase answer as a flow.
fn flow<'a>(r: Result<(), Reply>) -> Flow<'a> {
    match r {
        Ok(()) => Flow::Continue,
        Err(reply) => Flow::Respond(reply),
    }
}

/// One header change a filter asked for, validated.
enum Edit {
    Remove(HeaderName),
    Set(HeaderName, HeaderValue),
    Append(HeaderName, HeaderValue),
}

/// Validates every header change (names, values, gateway-owned headers) before any is
/// made, so a bad one leaves the message as it was: removals, then sets, then appends.
fn header_edits(
    set: &[(String, Vec<u8>)],
    append: &[(String, Vec<u8>)],
    remove: &[String],
) -> Result<SmallVec<[Edit; 8]>, Outcome> {
    let name = |k: &str| output::header_name(k).map_err(Outcome::BadOutput);
    let value = |v: &[u8]| output::header_value(v).map_err(Outcome::BadOutput);
    let mut edits = SmallVec::with_capacity(set.len() + append.len() + remove.len());
    for k in remove {
        edits.push(Edit::Remove(name(k)?));
    }
    for (k, v) in set {
        edits.push(Edit::Set(name(k)?, value(v)?));
    }
    for (k, v) in append {
        edits.push(Edit::Append(name(k)?, value(v)?));
    }
    Ok(edits)
}

fn apply_headers(h: &mut HeaderMap, edits: SmallVec<[Edit; 8]>) {
    for e in edits {
        match e {
            Edit::Remove(n) => {
                h.remove(n);
            }
            Edit::Set(n, v) => {
                h.insert(n, v);
            }
            Edit::Append(n, v) => {
                h.append(n, v);
            }
        }
    }
}

/// Applies edits whose sizes were checked (by the runtime, on the thread that ran the call);
/// a new path must be canonical under `paths`, so a filter that answers another is refused
/// like any other bad output (and the path the router matched is the one forwarded).
fn apply_request_edits(req: &mut RequestHead, edits: types::RequestEdits, paths: &PathPolicy) -> Result<(), Outcome> {
    // Validate everything before changing anything.
    let header_edits = header_edits(&edits.set_headers, &edits.append_headers, &edits.remove_headers)?;
    let uri = match edits.path {
        None => None,
        Some(p) => {
            let pq = output::path(&p, paths).map_err(Outcome::BadOutput)?;
            let mut parts = req.uri.clone().into_parts();
            parts.path_and_query = Some(pq);
            Some(Uri::from_parts(parts).map_err(|_| Outcome::BadOutput(Rule::PathSyntax))?)
        }
    };
    apply_headers(&mut req.headers, header_edits);
    if let Some(uri) = uri {
        req.uri = uri;
    }
    Ok(())
}

/// The reply of a decision whose sizes were checked (by the runtime, on the thread that ran the call).
fn make_reply(reply: types::Reply) -> Result<Reply, Outcome> {
    let status = output::status(reply.status).map_err(Outcome::BadOutput)?;
    let mut headers = HeaderMap::with_capacity(reply.headers.len());
    apply_headers(&mut headers, header_edits(&[], &reply.headers, &[])?);
    Ok(Reply::Custom { status, headers, body: Bytes::from(reply.body) })
}

impl Filter for WasmFilter {
    fn on_request<'a>(&'a self, req: &'a mut RequestHead, cx: &'a Context) -> Flow<'a> {
        self.request(req, None, cx)
    }

    fn on_request_body<'a>(&'a self, req: &'a mut RequestHead, body: &'a [u8], cx: &'a Context) -> Flow<'a> {
        self.request(req, Some(body), cx)
    }

    fn on_response<'a>(&'a self, resp: &'a mut ResponseHead, cx: &'a Context) -> ResponseFlow<'a> {
        if !self.attachment.response_phase {
            return ResponseFlow::Done;
        }
        ResponseFlow::Wait(Box::pin(self.response(resp, cx)))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

    use super::*;
    use crate::runtime::RuntimeConfig;
    use crate::runtime::tests::module_bytes;
    use postern_model::wasm::{Limits, QuarantinePolicy};

    fn filter(name: &str, config: serde_json::Value, limits: Limits) -> WasmFilter {
        filter_under(name, config, limits, PathPolicy::default())
    }

    fn filter_under(name: &str, config: serde_json::Value, limits: Limits, paths: PathPolicy) -> WasmFilter {
        let runtime = Runtime::new(&RuntimeConfig { max_instances: 8, ..Default::default() }).unwrap();
        let module = runtime.load(&module_bytes(name), None).unwrap();
        let attachment = Attachment {
            name: name.to_owned(),
            module: module.digest.clone(),
            limits,
            failure: FailurePolicy::FailClosed,
            response_phase: false,
            config,
            quarantine: QuarantinePolicy::default(),
        };
        WasmFilter::new(runtime, module, attachment, "t/r", Arc::new(FilterStats::default()), paths)
    }

    fn head() -> RequestHead {
        http::Request::get("http://api.example.com/v1/orders").body(()).unwrap().into_parts().0
    }

    #[test]
    fn a_quick_filter_answers_at_once_without_a_future() {
        let f = filter("well_behaved", serde_json::Value::Null, Limits::default());
        let (mut req, cx) = (head(), Context::new(Arc::from("t/r"), HeaderValue::from_static("1")));
        assert!(matches!(f.on_request(&mut req, &cx), Flow::Continue));
        assert_eq!(req.headers.get("x-well-behaved").map(HeaderValue::as_bytes), Some(&b"yes"[..]));
    }

    #[test]
    fn a_path_edit_the_snapshots_path_policy_refuses_is_a_refused_answer() {
        let limits = Limits { deadline_ms: 50, ..Limits::default() };
        let cx = Context::new(Arc::from("t/r"), HeaderValue::from_static("1"));
        let run = |f: &WasmFilter| {
            let mut req = head();
            let flow = match f.on_request(&mut req, &cx) {
                Flow::Continue => Ok(()),
                Flow::Respond(r) => Err(r),
                Flow::Wait(fut) => {
                    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(fut)
                }
            };
            (flow, req.uri.to_string())
        };
        let f = filter_under("header_spoofer", serde_json::json!({":path": "/a%2Fb"}), limits, PathPolicy::default());
        let (flow, uri) = run(&f);
        let Err(Reply::Problem(p)) = flow else { panic!("expected a problem, got {flow:?}") };
        assert_eq!(
            p.detail,
            "filter header_spoofer failed: bad_output: its answer broke the rule path_canonical: \
             a path not in canonical form under the platform's path policy"
        );
        assert_eq!(uri, "http://api.example.com/v1/orders", "a refused answer changes nothing");
        assert_eq!(f.binding.stats.count(Outcome::BadOutput(Rule::PathCanonical)), 1);
        assert_eq!(f.binding.stats.refused(Rule::PathCanonical), 1);
        assert_eq!(f.binding.stats.count(Outcome::Ok), 0);
        // The snapshot's policy decides: one that keeps `%2F` lets the same edit through.
        let keep = PathPolicy { encoded_slash: postern_model::path::EncodedSlash::Keep, ..PathPolicy::default() };
        let f = filter_under("header_spoofer", serde_json::json!({":path": "/a%2Fb"}), limits, keep);
        let (flow, uri) = run(&f);
        assert!(flow.is_ok(), "{flow:?}");
        assert_eq!(uri, "http://api.example.com/a%2Fb");
        assert_eq!(f.binding.stats.count(Outcome::Ok), 1);
    }

    #[test]
    fn a_filter_that_outruns_its_slice_finishes_on_the_idle_pool_and_edits_the_request() {
        let limits = Limits { fuel: 10_000_000_000, deadline_ms: 2_000, host_calls: 100_000, ..Limits::default() };
        let f = filter("slow_counter", serde_json::json!({"spin_us": 20000}), limits);
        let (mut req, cx) = (head(), Context::new(Arc::from("t/r"), HeaderValue::from_static("1")));
        let Flow::Wait(fut) = f.on_request(&mut req, &cx) else { panic!("expected a future for the pool") };
        let tokio = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        assert!(tokio.block_on(fut).is_ok());
        assert_eq!(req.headers.get("x-slow").map(HeaderValue::as_bytes), Some(&b"done"[..]));
        assert_eq!(f.binding.stats.reruns.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn after_a_costly_failure_the_routes_calls_run_on_the_idle_pool() {
        let limits = Limits { fuel: 1_000_000, deadline_ms: 2_000, ..Limits::default() };
        let f = filter("loop_forever", serde_json::Value::Null, limits);
        let cx = Context::new(Arc::from("t/r"), HeaderValue::from_static("1"));
        // Out of its own fuel (within the slice) on the worker: answered at once...
        let mut req = head();
        let Flow::Respond(_) = f.on_request(&mut req, &cx) else { panic!("expected an answer at once") };
        assert_eq!(f.binding.stats.reruns.load(Ordering::Relaxed), 0, "its own limit, not the slice");
        // ...and the next call goes to the pool, where it fails the same way.
        let Flow::Wait(fut) = f.on_request(&mut req, &cx) else { panic!("expected a future for the pool") };
        let tokio = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        assert!(tokio.block_on(fut).is_err());
        let mut out = String::new();
        f.binding.stats.render(&mut out, "f=\"x\"");
        assert!(out.contains("postern_filter_calls_total{f=\"x\",outcome=\"fuel_exhausted\"} 2"), "{out}");
    }

    #[test]
    fn calls_the_busy_node_could_not_run_are_overloaded_and_never_quarantine_the_filter() {
        // 10 ms of work per call, 300 calls at once on the idle pool's two threads: the
        // queue (256) overflows and most queued calls pass the 130 ms backstop unrun.
        let limits = Limits { fuel: 10_000_000_000, deadline_ms: 20, host_calls: 100_000, ..Limits::default() };
        let f = filter("slow_counter", serde_json::json!({"spin_us": 10000}), limits);
        let cx = Context::new(Arc::from("t/r"), HeaderValue::from_static("1"));
        let mut reqs: Vec<RequestHead> = (0..300).map(|_| head()).collect();
        let mut waits: Vec<_> = reqs
            .iter_mut()
            .map(|r| match f.on_request(r, &cx) {
                Flow::Wait(fut) => Some(fut),
                _ => panic!("expected a future for the pool"),
            })
            .collect();
        let tokio = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        tokio.block_on(std::future::poll_fn(|task| {
            for w in waits.iter_mut() {
                if let Some(fut) = w
                    && fut.as_mut().poll(task).is_ready()
                {
                    *w = None;
                }
            }
            if waits.iter().all(Option::is_none) { std::task::Poll::Ready(()) } else { std::task::Poll::Pending }
        }));
        // How many the pool runs before the backstop depends on the CPU its nice-19
        // threads get, which a test sharing two cores cannot promise: every call is one or
        // the other, and at least the queue's overflow is overloaded.
        let (ok, overloaded) = (f.binding.stats.count(Outcome::Ok), f.binding.stats.count(Outcome::Overloaded));
        eprintln!("ok {ok}, overloaded {overloaded}");
        assert!(overloaded >= 200, "ok {ok}, overloaded {overloaded}");
        assert_eq!(ok + overloaded, 300);
        assert_eq!(f.binding.stats.quarantines.load(Ordering::Relaxed), 0);
        assert!(!f.quarantined(), "the node's overload is not the filter's failure");
    }
}
