//! The filter contract: what a Postern filter is, independent of the proxy that runs it.
//!
//! A filter is built once per snapshot from its declarative config by a
//! [`FilterFactory`] (bad config is refused then, never per request), and then runs per
//! request in the phases it implements:
//!
//! * [`Filter::on_request`] sees the request head and may mutate it, answer the request
//!   itself ([`Flow::Respond`]), or — for filters that need to await, like a Wasm sandbox
//!   that yields on its deadline — return a future ([`Flow::Wait`]). Native filters answer
//!   synchronously and allocate nothing.
//! * [`Filter::on_response`] sees the response head before it streams to the client
//!   (and may also await, through [`ResponseFlow::Wait`]).
//!
//! This crate is a leaf: built-in filters and the Wasm adapter depend on it, the proxy
//! composes them, and neither side depends on the other.
#![deny(missing_docs)]

use std::borrow::Cow;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
pub use http;
use http::{HeaderMap, HeaderValue, StatusCode};

/// The request head a filter sees and may change (method, URI, headers).
pub type RequestHead = http::request::Parts;
/// The response head a filter sees and may change (status, headers).
pub type ResponseHead = http::response::Parts;

/// Per-request facts shared by the filters of one route.
#[derive(Debug, Clone)]
pub struct Context {
    /// The route's id, `team/name`.
    pub route_id: Arc<str>,
    /// The request id returned to the client as `x-request-id`.
    pub request_id: HeaderValue,
    /// The verified caller, set once by the route's authentication filter (which runs
    /// first); filters after it read it.
    pub identity: OnceLock<Arc<Identity>>,
    /// `RateLimit-Policy` and `RateLimit` values, set by the route's rate-limit filter
    /// when it admits the request; the proxy stamps them on every answer the request
    /// gets, whoever makes it.
    pub rate_limit: OnceLock<(HeaderValue, HeaderValue)>,
    /// Set by the authentication filter when the caller is under a debug-trace flag:
    /// every request of that caller is traced until the flag's expiry.
    pub debug_trace: OnceLock<()>,
}

impl Context {
    /// A context with no caller yet.
    pub fn new(route_id: Arc<str>, request_id: HeaderValue) -> Context {
        Context {
            route_id,
            request_id,
            identity: OnceLock::new(),
            rate_limit: OnceLock::new(),
            debug_trace: OnceLock::new(),
        }
    }

    /// The verified caller, if the route authenticated one.
    pub fn identity(&self) -> Option<&Identity> {
        self.identity.get().map(|i| &**i)
    }
}

/// How a caller proved who it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CredentialKind {
    /// An API key.
    ApiKey,
    /// An OAuth access token (JWT).
    Jwt,
}

/// A verified caller. Values are shared byte strings, checked once to be valid header
/// values when the credential state was loaded: forwarding one copies nothing, and a
/// key's identity made once at load is small (the key table holds one per API key).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// How the caller authenticated.
    pub kind: CredentialKind,
    /// The end user (`sub`), for access tokens.
    pub subject: Option<Bytes>,
    /// The OAuth client, or the app an API key belongs to.
    pub client_id: Option<Bytes>,
    /// The tenant.
    pub tenant: Option<Bytes>,
    /// The API key's id.
    pub key_id: Option<Bytes>,
    /// The caller's plan.
    pub plan: Option<Bytes>,
    /// Granted scopes, space-separated.
    pub scopes: Bytes,
    /// The caller's own priority class (its key's or its app's), when it sets one: the
    /// class's rank, 0 the most important.
    pub priority: Option<u8>,
}

/// Who a call counts against: its API key, or for an access token its OAuth app.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Payer {
    /// An API key, by id.
    Key,
    /// An OAuth app, by `client_id`.
    App,
}

impl Identity {
    /// Who the call counts against (usage, quotas, a traffic split): the key's id, else
    /// the app's `client_id`.
    pub fn caller(&self) -> Option<(Payer, &Bytes)> {
        match (&self.key_id, &self.client_id) {
            (Some(key), _) => Some((Payer::Key, key)),
            (None, Some(app)) => Some((Payer::App, app)),
            (None, None) => None,
        }
    }

    /// Whether the caller holds `scope`.
    pub fn has_scope(&self, scope: &str) -> bool {
        self.scopes.split(|&b| b == b' ').any(|s| s == scope.as_bytes())
    }

    /// Granted scopes.
    pub fn scope_list(&self) -> impl Iterator<Item = &str> {
        std::str::from_utf8(&self.scopes).unwrap_or_default().split(' ').filter(|s| !s.is_empty())
    }

    /// A value as a header value (every value was checked when it was loaded).
    pub fn header(value: &Bytes) -> Option<HeaderValue> {
        HeaderValue::from_maybe_shared(value.clone()).ok()
    }

    /// A value as text.
    pub fn text(value: &Option<Bytes>) -> Option<&str> {
        value.as_ref().and_then(|v| std::str::from_utf8(v).ok())
    }
}

/// A response the gateway makes itself in the `application/problem+json` format
/// (RFC 9457) with a stable machine-readable `code`.
#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    /// HTTP status.
    pub status: StatusCode,
    /// Stable code, e.g. `route_not_found`.
    pub code: &'static str,
    /// Human-readable explanation for this occurrence.
    pub detail: Cow<'static, str>,
    /// Extra response headers (`Allow`, `Retry-After`, `WWW-Authenticate`, ...).
    pub headers: HeaderMap,
    /// Extension members of the body (RFC 9457 §3.2), e.g. `errors` naming every bad
    /// field of a request that failed validation.
    pub extensions: serde_json::Map<String, serde_json::Value>,
}

impl Problem {
    /// A problem with no extra headers.
    pub fn new(status: StatusCode, code: &'static str, detail: impl Into<Cow<'static, str>>) -> Problem {
        Problem { status, code, detail: detail.into(), headers: HeaderMap::new(), extensions: serde_json::Map::new() }
    }

    /// Adds an extension member to the body.
    pub fn with_extension(mut self, name: &str, value: serde_json::Value) -> Problem {
        self.extensions.insert(name.to_owned(), value);
        self
    }

    /// Adds a response header.
    pub fn with_header(mut self, name: http::HeaderName, value: HeaderValue) -> Problem {
        self.headers.append(name, value);
        self
    }
}

/// How a filter answers a request instead of forwarding it.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    /// A gateway error in the common problem format.
    Problem(Problem),
    /// A response of the filter's own making.
    Custom {
        /// HTTP status.
        status: StatusCode,
        /// Response headers.
        headers: HeaderMap,
        /// A small body.
        body: Bytes,
    },
}

impl From<Problem> for Reply {
    fn from(p: Problem) -> Reply {
        Reply::Problem(p)
    }
}

/// A boxed future returned by filters that must await.
pub type FilterFuture<'a> = Pin<Box<dyn Future<Output = Result<(), Reply>> + Send + 'a>>;

/// What a filter decided about a request.
pub enum Flow<'a> {
    /// Go on to the next filter, with any changes made to the head.
    Continue,
    /// Stop and answer with this.
    Respond(Reply),
    /// Await this future, then go on (`Ok`) or answer (`Err`).
    Wait(FilterFuture<'a>),
}

impl std::fmt::Debug for Flow<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Flow::Continue => f.write_str("Continue"),
            Flow::Respond(r) => f.debug_tuple("Respond").field(r).finish(),
            Flow::Wait(_) => f.write_str("Wait(..)"),
        }
    }
}

/// What a filter did with a response head.
pub enum ResponseFlow<'a> {
    /// Done (any changes are already made).
    Done,
    /// Await this future, which makes its changes; an `Err` replaces the backend's
    /// response with this answer (a fail-closed filter whose response phase failed).
    Wait(Pin<Box<dyn Future<Output = Result<(), Reply>> + Send + 'a>>),
}

impl std::fmt::Debug for ResponseFlow<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ResponseFlow::Done => f.write_str("Done"),
            ResponseFlow::Wait(_) => f.write_str("Wait(..)"),
        }
    }
}

/// A filter instance, built once per snapshot and shared by every request on its route.
pub trait Filter: Send + Sync + 'static {
    /// Request phase: runs before the request is forwarded.
    fn on_request<'a>(&'a self, req: &'a mut RequestHead, cx: &'a Context) -> Flow<'a> {
        let _ = (req, cx);
        Flow::Continue
    }

    /// Request body phase: runs after the request phase, only on routes that buffer
    /// the (small) request body.
    fn on_request_body<'a>(&'a self, req: &'a mut RequestHead, body: &'a [u8], cx: &'a Context) -> Flow<'a> {
        let _ = (req, body, cx);
        Flow::Continue
    }

    /// Response phase: runs on the response head before it streams to the client.
    fn on_response<'a>(&'a self, resp: &'a mut ResponseHead, cx: &'a Context) -> ResponseFlow<'a> {
        let _ = (resp, cx);
        ResponseFlow::Done
    }
}

/// Refused filter configuration; the message names the offending field.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

impl From<String> for ConfigError {
    fn from(msg: String) -> ConfigError {
        ConfigError(msg)
    }
}

impl From<&str> for ConfigError {
    fn from(msg: &str) -> ConfigError {
        ConfigError(msg.to_owned())
    }
}

impl ConfigError {
    /// A config error with this message.
    pub fn new(msg: impl Into<String>) -> ConfigError {
        ConfigError(msg.into())
    }
}

/// Builds filters of one kind from their declarative config.
pub trait FilterFactory: Send + Sync {
    /// The kind name used in route config, e.g. `request-headers`.
    fn kind(&self) -> &'static str;

    /// Validates `config` and builds the filter.
    fn build(&self, config: &serde_json::Value) -> Result<Arc<dyn Filter>, ConfigError>;
}
