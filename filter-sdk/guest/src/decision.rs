//! What a filter answers: forward the request (with edits) or respond itself, and
//! edits to the backend's response head.

use crate::prelude::*;
use crate::types::{Fields, find, find_all};

/// Header names travel lowercase, as in the WIT contract.
fn lower(name: &str) -> String {
    name.to_ascii_lowercase()
}

/// Records header edits so that the result means what the chain of calls said,
/// whatever order the host applies the lists in, as long as it adds `append`
/// values after applying `set` (a name is never both set and removed).
struct HeaderEdits<'a> {
    set: &'a mut Fields,
    append: &'a mut Fields,
    remove: &'a mut Vec<String>,
}

impl HeaderEdits<'_> {
    fn set(self, name: String, value: Vec<u8>) {
        self.set.retain(|(n, _)| *n != name);
        self.append.retain(|(n, _)| *n != name);
        self.remove.retain(|n| *n != name);
        self.set.push((name, value));
    }

    fn append(self, name: String, value: Vec<u8>) {
        if self.remove.contains(&name) {
            // Removed earlier in the chain, then added: the value replaces the header.
            self.set(name, value);
        } else {
            self.append.push((name, value));
        }
    }

    fn remove(self, name: String) {
        self.set.retain(|(n, _)| *n != name);
        self.append.retain(|(n, _)| *n != name);
        if !self.remove.contains(&name) {
            self.remove.push(name);
        }
    }
}

/// Changes to the request before it is forwarded.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestEdits {
    /// Replace these headers (every earlier value of the name goes).
    pub set_headers: Fields,
    /// Add these header values.
    pub append_headers: Fields,
    /// Remove these headers.
    pub remove_headers: Vec<String>,
    /// A new path, optionally with `?query`.
    pub path: Option<String>,
}

impl RequestEdits {
    fn header_edits(&mut self) -> HeaderEdits<'_> {
        HeaderEdits { set: &mut self.set_headers, append: &mut self.append_headers, remove: &mut self.remove_headers }
    }

    /// Whether nothing is changed.
    pub fn is_empty(&self) -> bool {
        self.set_headers.is_empty()
            && self.append_headers.is_empty()
            && self.remove_headers.is_empty()
            && self.path.is_none()
    }

    /// The last value set for header `name`, if any (case-insensitive).
    pub fn set_value(&self, name: &str) -> Option<&[u8]> {
        self.set_headers.iter().rev().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_slice())
    }

    /// The last value set for header `name`, if any and valid UTF-8.
    pub fn set_value_str(&self, name: &str) -> Option<&str> {
        self.set_value(name).and_then(|v| core::str::from_utf8(v).ok())
    }

    /// Every value appended for header `name`, in order (case-insensitive).
    pub fn appended_values<'a>(&'a self, name: &'a str) -> Vec<&'a [u8]> {
        find_all(&self.append_headers, name).collect()
    }

    /// Whether header `name` is removed (case-insensitive).
    pub fn is_removed(&self, name: &str) -> bool {
        self.remove_headers.iter().any(|n| n.eq_ignore_ascii_case(name))
    }
}

/// A response the filter makes itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    /// Status, 200 to 599.
    pub status: u16,
    /// Response headers.
    pub headers: Fields,
    /// A small body.
    pub body: Vec<u8>,
}

impl Reply {
    /// The first value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        find(&self.headers, name)
    }

    /// The first value of header `name` (case-insensitive), if valid UTF-8.
    pub fn header_str(&self, name: &str) -> Option<&str> {
        self.header(name).and_then(|v| core::str::from_utf8(v).ok())
    }

    /// The body parsed as JSON, if it is JSON.
    pub fn body_json(&self) -> Option<serde_json::Value> {
        serde_json::from_slice(&self.body).ok()
    }
}

/// What to do with the request: forward it (with edits) or answer it.
///
/// Build one with [`Decision::forward`] or [`Decision::respond`] and chain edits:
///
/// ```
/// use postern_filter_sdk::Decision;
///
/// let fwd = Decision::forward()
///     .set_header("x-team", "payments")
///     .remove_header("x-debug")
///     .path("/v2/charges");
/// assert_eq!(fwd.edits().unwrap().set_value_str("x-team"), Some("payments"));
///
/// let deny = Decision::respond(403)
///     .json(postern_filter_sdk::serde_json::json!({"code": "forbidden"}));
/// assert_eq!(deny.status(), Some(403));
/// ```
///
/// Header names are lowercased. The header methods work on both kinds: on a
/// forwarded request they edit the request, on a reply they edit the reply's headers.
/// [`Decision::path`] only makes sense when forwarding and [`Decision::body`] /
/// [`Decision::json`] only when responding; called on the other kind they are ignored
/// (and fail a `debug_assert!`, so a native `cargo test` catches the mistake).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Forward the request, with these edits.
    Continue(RequestEdits),
    /// Answer it; nothing is forwarded.
    Respond(Reply),
}

impl Default for Decision {
    fn default() -> Self {
        Self::forward()
    }
}

impl Decision {
    /// Forward the request unchanged (add edits by chaining).
    pub fn forward() -> Self {
        Decision::Continue(RequestEdits::default())
    }

    /// Answer the request with `status` (200 to 599), no headers and an empty body.
    pub fn respond(status: u16) -> Self {
        debug_assert!((200..=599).contains(&status), "a filter's reply status must be 200 to 599, not {status}");
        Decision::Respond(Reply { status, headers: Vec::new(), body: Vec::new() })
    }

    /// Replaces header `name` (every earlier value goes) on the forwarded request,
    /// or on the reply.
    pub fn set_header(mut self, name: &str, value: impl AsRef<[u8]>) -> Self {
        let name = lower(name);
        let value = value.as_ref().to_vec();
        match &mut self {
            Decision::Continue(e) => e.header_edits().set(name, value),
            Decision::Respond(r) => {
                r.headers.retain(|(n, _)| *n != name);
                r.headers.push((name, value));
            }
        }
        self
    }

    /// Adds a value of header `name` to the forwarded request, or to the reply.
    pub fn append_header(mut self, name: &str, value: impl AsRef<[u8]>) -> Self {
        let name = lower(name);
        let value = value.as_ref().to_vec();
        match &mut self {
            Decision::Continue(e) => e.header_edits().append(name, value),
            Decision::Respond(r) => r.headers.push((name, value)),
        }
        self
    }

    /// Removes header `name` from the forwarded request, or from the reply.
    pub fn remove_header(mut self, name: &str) -> Self {
        let name = lower(name);
        match &mut self {
            Decision::Continue(e) => e.header_edits().remove(name),
            Decision::Respond(r) => r.headers.retain(|(n, _)| *n != name),
        }
        self
    }

    /// Forwards to a new path, optionally with `?query`. Ignored on a reply.
    pub fn path(mut self, path: impl Into<String>) -> Self {
        match &mut self {
            Decision::Continue(e) => e.path = Some(path.into()),
            Decision::Respond(_) => debug_assert!(false, "Decision::path on a reply"),
        }
        self
    }

    /// Adds a reply header (same as [`Decision::append_header`]).
    pub fn header(self, name: &str, value: impl AsRef<[u8]>) -> Self {
        self.append_header(name, value)
    }

    /// Sets the reply body. Ignored when forwarding.
    pub fn body(mut self, body: impl Into<Vec<u8>>) -> Self {
        match &mut self {
            Decision::Respond(r) => r.body = body.into(),
            Decision::Continue(_) => debug_assert!(false, "Decision::body when forwarding"),
        }
        self
    }

    /// Sets a JSON reply body and `content-type: application/json`. Ignored when
    /// forwarding.
    pub fn json(self, value: serde_json::Value) -> Self {
        // Serializing a `Value` cannot fail: its map keys are strings.
        let body = serde_json::to_vec(&value).unwrap_or_default();
        self.set_header("content-type", "application/json").body(body)
    }

    /// Answers with an `application/problem+json` body (RFC 9457), the format every
    /// answer of the gateway itself has: `type`, `title` (the status's reason phrase),
    /// `status`, your stable `code`, a `detail` for people, and the request's id, so a
    /// caller (or whoever reads their bug report) can find the request in the logs.
    ///
    /// ```
    /// use postern_filter_sdk::{Decision, testing};
    ///
    /// let cx = testing::context();
    /// let d = Decision::problem(426, "client_too_old", "upgrade to 2.0 or later", &cx);
    /// let body = d.reply().unwrap().body_json().unwrap();
    /// assert_eq!(body["code"], "client_too_old");
    /// assert_eq!(body["request_id"], "test-request");
    /// assert_eq!(d.reply().unwrap().header_str("content-type"), Some("application/problem+json"));
    /// ```
    ///
    /// Chain [`Decision::header`] to add headers (a `retry-after`, a `www-authenticate`),
    /// but not `upgrade`, `connection` or any other header the gateway owns: a reply
    /// carrying one is refused (rule `reserved_header`) and fails the request. A 426
    /// says what to upgrade to in its `detail`.
    pub fn problem(status: u16, code: &str, detail: impl Into<String>, cx: &crate::Context) -> Self {
        let body = serde_json::json!({
            "type": format!("https://postern.dev/problems/{code}"),
            "title": reason(status),
            "status": status,
            "code": code,
            "detail": detail.into(),
            "request_id": cx.request_id,
        });
        let body = serde_json::to_vec(&body).unwrap_or_default();
        Self::respond(status).set_header("content-type", "application/problem+json").body(body)
    }

    /// Whether the request is forwarded.
    pub fn is_forward(&self) -> bool {
        matches!(self, Decision::Continue(_))
    }

    /// The request edits, when forwarding.
    pub fn edits(&self) -> Option<&RequestEdits> {
        match self {
            Decision::Continue(e) => Some(e),
            Decision::Respond(_) => None,
        }
    }

    /// The reply, when responding.
    pub fn reply(&self) -> Option<&Reply> {
        match self {
            Decision::Respond(r) => Some(r),
            Decision::Continue(_) => None,
        }
    }

    /// The reply's status, when responding.
    pub fn status(&self) -> Option<u16> {
        self.reply().map(|r| r.status)
    }
}

/// Changes to the backend's response head.
///
/// ```
/// use postern_filter_sdk::ResponseEdits;
///
/// let edits = ResponseEdits::new()
///     .set_header("cache-control", "no-store")
///     .remove_header("server");
/// assert!(edits.is_removed("server"));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResponseEdits {
    /// Replace these headers.
    pub set_headers: Fields,
    /// Add these header values.
    pub append_headers: Fields,
    /// Remove these headers.
    pub remove_headers: Vec<String>,
}

impl ResponseEdits {
    /// No changes (add some by chaining).
    pub fn new() -> Self {
        Self::default()
    }

    fn header_edits(&mut self) -> HeaderEdits<'_> {
        HeaderEdits { set: &mut self.set_headers, append: &mut self.append_headers, remove: &mut self.remove_headers }
    }

    /// Replaces header `name` (every earlier value goes). The name is lowercased.
    pub fn set_header(mut self, name: &str, value: impl AsRef<[u8]>) -> Self {
        self.header_edits().set(lower(name), value.as_ref().to_vec());
        self
    }

    /// Adds a value of header `name`. The name is lowercased.
    pub fn append_header(mut self, name: &str, value: impl AsRef<[u8]>) -> Self {
        self.header_edits().append(lower(name), value.as_ref().to_vec());
        self
    }

    /// Removes header `name`. The name is lowercased.
    pub fn remove_header(mut self, name: &str) -> Self {
        self.header_edits().remove(lower(name));
        self
    }

    /// Whether nothing is changed.
    pub fn is_empty(&self) -> bool {
        self.set_headers.is_empty() && self.append_headers.is_empty() && self.remove_headers.is_empty()
    }

    /// The last value set for header `name`, if any (case-insensitive).
    pub fn set_value(&self, name: &str) -> Option<&[u8]> {
        self.set_headers.iter().rev().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_slice())
    }

    /// The last value set for header `name`, if any and valid UTF-8.
    pub fn set_value_str(&self, name: &str) -> Option<&str> {
        self.set_value(name).and_then(|v| core::str::from_utf8(v).ok())
    }

    /// Whether header `name` is removed (case-insensitive).
    pub fn is_removed(&self, name: &str) -> bool {
        self.remove_headers.iter().any(|n| n.eq_ignore_ascii_case(name))
    }
}

/// The reason phrase of `status` (RFC 9110), for a problem's `title`.
fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        402 => "Payment Required",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        406 => "Not Acceptable",
        409 => "Conflict",
        410 => "Gone",
        412 => "Precondition Failed",
        413 => "Content Too Large",
        415 => "Unsupported Media Type",
        422 => "Unprocessable Content",
        426 => "Upgrade Required",
        428 => "Precondition Required",
        429 => "Too Many Requests",
        451 => "Unavailable For Legal Reasons",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        400..=499 => "Client Error",
        500..=599 => "Server Error",
        _ => "Answer",
    }
}
