//! A native stand-in for the gateway, for unit-testing filters with `cargo test`.
//!
//! Only on non-`wasm32` targets. The host functions ([`crate::log`],
//! [`crate::counter_add`], [`crate::now_nanos`], [`crate::config`]) read and write a
//! thread-local state here instead of calling the gateway. `cargo test` runs every
//! test on its own thread, so each test starts clean; call [`reset`] to start over
//! within one test.
//!
//! ```
//! use postern_filter_sdk::{testing, Context, Decision, Filter, Request};
//!
//! struct Tag;
//! impl Filter for Tag {
//!     fn on_request(req: &Request, _cx: &Context) -> Decision {
//!         postern_filter_sdk::counter_add("seen", 1);
//!         match req.header_str("x-tag") {
//!             Some(tag) => Decision::forward().set_header("x-tag-seen", tag),
//!             None => Decision::respond(400),
//!         }
//!     }
//! }
//!
//! let req = testing::request("GET", "/orders").header("x-tag", "blue");
//! let d = Tag::on_request(&req, &testing::context());
//! assert_eq!(d.edits().unwrap().set_value_str("x-tag-seen"), Some("blue"));
//! assert_eq!(testing::counter("seen"), 1);
//!
//! let d = Tag::on_request(&testing::request("GET", "/orders"), &testing::context());
//! assert_eq!(d.status(), Some(400));
//! ```
//!
//! [`check`] applies the rules the gateway applies to every answer (the same code, from
//! `postern-filter-rules`), so a test cannot pass on a decision the node would refuse
//! with a 503:
//!
//! ```
//! use postern_filter_sdk::{testing, Decision};
//!
//! assert_eq!(testing::check(&Decision::forward().set_header("x-team", "payments")), Ok(()));
//! let spoof = Decision::forward().set_header("x_auth_subject", "admin");
//! assert_eq!(testing::check(&spoof), Err(testing::Rule::ReservedHeader));
//! assert_eq!(testing::check(&Decision::forward().path("/a/../b")), Err(testing::Rule::PathCanonical));
//! ```

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ops::Deref;
use std::sync::OnceLock;
use std::time::Instant;

pub use postern_filter_rules::Bounds;
pub use postern_filter_rules::Rule;
use postern_filter_rules::output as rules;
pub use postern_filter_rules::path::PathPolicy;

use crate::decision::{Decision, ResponseEdits};
use crate::host::Level;
use crate::types::{Context, Identity, Request, ResponseHead};

#[derive(Default)]
struct State {
    config: Vec<u8>,
    logs: Vec<(Level, String)>,
    counters: BTreeMap<String, u64>,
    now: Option<u64>,
}

thread_local! {
    static STATE: RefCell<State> = RefCell::new(State::default());
}

pub(crate) fn record_log(level: Level, message: &str) {
    STATE.with(|s| s.borrow_mut().logs.push((level, message.to_owned())));
}

pub(crate) fn record_counter(name: &str, delta: u64) {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        let c = s.counters.entry(name.to_owned()).or_default();
        *c = c.wrapping_add(delta);
    });
}

pub(crate) fn config_bytes() -> Vec<u8> {
    STATE.with(|s| s.borrow().config.clone())
}

pub(crate) fn now_nanos() -> u64 {
    if let Some(now) = STATE.with(|s| s.borrow().now) {
        return now;
    }
    static START: OnceLock<Instant> = OnceLock::new();
    let nanos = START.get_or_init(Instant::now).elapsed().as_nanos();
    u64::try_from(nanos).unwrap_or(u64::MAX)
}

/// Clears the config, logs, counters and clock of this thread.
pub fn reset() {
    STATE.with(|s| *s.borrow_mut() = State::default());
}

/// Sets the config that [`crate::config`] returns (JSON bytes, or empty).
pub fn set_config(bytes: impl Into<Vec<u8>>) {
    let bytes = bytes.into();
    STATE.with(|s| s.borrow_mut().config = bytes);
}

/// Sets the config that [`crate::config`] returns to `value` as JSON.
pub fn set_config_json(value: &serde_json::Value) {
    set_config(value.to_string());
}

/// The lines logged so far, in order.
pub fn logs() -> Vec<(Level, String)> {
    STATE.with(|s| s.borrow().logs.clone())
}

/// Whether a line containing `needle` was logged at `level`.
pub fn logged(level: Level, needle: &str) -> bool {
    STATE.with(|s| s.borrow().logs.iter().any(|(l, m)| *l == level && m.contains(needle)))
}

/// Every counter and its total so far.
pub fn counters() -> BTreeMap<String, u64> {
    STATE.with(|s| s.borrow().counters.clone())
}

/// The total of counter `name` so far (0 if never added to).
pub fn counter(name: &str) -> u64 {
    STATE.with(|s| s.borrow().counters.get(name).copied().unwrap_or(0))
}

/// Fixes what [`crate::now_nanos`] returns. Unset, it is a real monotonic clock.
pub fn set_now_nanos(nanos: u64) {
    STATE.with(|s| s.borrow_mut().now = Some(nanos));
}

/// Whether the gateway would apply `d` under the platform's default limits and path
/// policy, or the rule it breaks (the node answers such a decision with a 503 naming the
/// rule, or with the attachment's failure policy).
pub fn check(d: &Decision) -> Result<(), Rule> {
    check_with(d, &Bounds::default(), &PathPolicy::default())
}

/// [`check`] under an attachment's `limits:` and the platform's `paths:` policy.
pub fn check_with(d: &Decision, bounds: &Bounds, paths: &PathPolicy) -> Result<(), Rule> {
    match d {
        Decision::Continue(e) => {
            rules::edits(&e.set_headers, &e.append_headers, &e.remove_headers, e.path.as_deref(), bounds, Some(paths))
        }
        Decision::Respond(r) => rules::reply(r.status, &r.headers, r.body.len(), bounds),
    }
}

/// Whether the gateway would apply response edits under the default limits.
pub fn check_response(e: &ResponseEdits) -> Result<(), Rule> {
    check_response_with(e, &Bounds::default())
}

/// [`check_response`] under an attachment's `limits:`.
pub fn check_response_with(e: &ResponseEdits, bounds: &Bounds) -> Result<(), Rule> {
    rules::headers(&e.set_headers, &e.append_headers, &e.remove_headers, bounds)
}

/// Starts a request head: `testing::request("POST", "/hooks").header("x-a", "1")`.
///
/// The builder dereferences to [`Request`], so `&builder` can be passed where a
/// `&Request` is expected; [`RequestBuilder::build`] returns the request itself.
pub fn request(method: &str, path: &str) -> RequestBuilder {
    RequestBuilder(Request { method: method.to_owned(), path: path.to_owned(), ..Request::default() })
}

/// A context like the gateway's: route `team/route`, request id `test-request`, no
/// verified caller. Add one with [`Context::with_identity`].
pub fn context() -> Context {
    Context { route_id: "team/route".to_owned(), request_id: "test-request".to_owned(), identity: None }
}

/// An empty identity, to fill with the `Identity::with_*` builders.
pub fn identity() -> Identity {
    Identity::default()
}

/// A backend response head with `status` and no headers; add some with
/// [`ResponseHead::with_header`].
pub fn response(status: u16) -> ResponseHead {
    ResponseHead::new(status)
}

/// Builds a [`Request`] for a test. See [`request`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestBuilder(Request);

impl RequestBuilder {
    /// Adds a header value; the name is lowercased, as the gateway does.
    pub fn header(mut self, name: &str, value: impl AsRef<[u8]>) -> Self {
        self.0.headers.push((name.to_ascii_lowercase(), value.as_ref().to_vec()));
        self
    }

    /// Sets the query string (without the `?`).
    pub fn query(mut self, query: &str) -> Self {
        self.0.query = Some(query.to_owned());
        self
    }

    /// Sets the authority (the `Host` the client addressed).
    pub fn authority(mut self, authority: &str) -> Self {
        self.0.authority = Some(authority.to_owned());
        self
    }

    /// The request.
    pub fn build(self) -> Request {
        self.0
    }
}

impl Deref for RequestBuilder {
    type Target = Request;

    fn deref(&self) -> &Request {
        &self.0
    }
}

impl From<RequestBuilder> for Request {
    fn from(b: RequestBuilder) -> Request {
        b.0
    }
}
