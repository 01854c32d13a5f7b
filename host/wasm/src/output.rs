//! What a filter may answer: one set of rules, applied by the node (the runtime checks
//! sizes on the thread that ran the call; the adapter the rest before it applies
//! anything), by `posternctl filter run` and by the manifest's sample cases at compile
//! ([`check_decision`], [`check_response`]). A refusal names the [`Rule`] it broke: in
//! the node's log, in `postern_filter_refusals_total{rule=..}`, and in the 503's detail.

use std::borrow::Cow;

use http::{HeaderName, HeaderValue, StatusCode, uri::PathAndQuery};
use postern_model::path::PathPolicy;
use postern_model::wasm::Limits;

use crate::runtime::types;

/// The longest path a filter may set.
pub const MAX_PATH_BYTES: usize = 8192;

/// A rule of what a filter may answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Rule {
    /// More header changes (set, appended, removed) than `max_headers`.
    HeaderCount,
    /// Header changes weigh more than `max_header_bytes`.
    HeaderBytes,
    /// A header name that is not an HTTP token.
    HeaderName,
    /// A header value with a control character.
    HeaderValue,
    /// A header the gateway owns.
    ReservedHeader,
    /// A reply status outside 200–599.
    Status,
    /// A reply body over `max_body_bytes`.
    BodySize,
    /// A path that is not an absolute path with an optional query.
    PathSyntax,
    /// A path over [`MAX_PATH_BYTES`].
    PathLength,
    /// A path not in canonical form under the platform's path policy.
    PathCanonical,
}

impl Rule {
    /// Every rule, in the order metrics list them.
    pub const ALL: [Rule; 10] = [
        Rule::HeaderCount,
        Rule::HeaderBytes,
        Rule::HeaderName,
        Rule::HeaderValue,
        Rule::ReservedHeader,
        Rule::Status,
        Rule::BodySize,
        Rule::PathSyntax,
        Rule::PathLength,
        Rule::PathCanonical,
    ];

    /// The rule's name, as logs, metrics and details show it.
    pub fn as_str(self) -> &'static str {
        match self {
            Rule::HeaderCount => "header_count",
            Rule::HeaderBytes => "header_bytes",
            Rule::HeaderName => "header_name",
            Rule::HeaderValue => "header_value",
            Rule::ReservedHeader => "reserved_header",
            Rule::Status => "status",
            Rule::BodySize => "body_size",
            Rule::PathSyntax => "path_syntax",
            Rule::PathLength => "path_length",
            Rule::PathCanonical => "path_canonical",
        }
    }

    /// What the rule asks, in a sentence.
    pub fn describe(self) -> &'static str {
        match self {
            Rule::HeaderCount => "more header changes than the attachment's maxHeaders",
            Rule::HeaderBytes => "header changes weigh more than the attachment's maxHeaderBytes",
            Rule::HeaderName => "a header name that is not an HTTP token",
            Rule::HeaderValue => "a header value with a control character",
            Rule::ReservedHeader => {
                "a header the gateway owns (x-auth-*, host, framing and hop-by-hop headers, x-request-id, in any spelling)"
            }
            Rule::Status => "a reply status outside 200-599",
            Rule::BodySize => "a reply body larger than the attachment's maxBodyBytes",
            Rule::PathSyntax => "a path that does not start with '/' or is not a valid path and query",
            Rule::PathLength => "a path longer than 8192 bytes",
            Rule::PathCanonical => "a path not in canonical form under the platform's path policy",
        }
    }

    /// Its position in [`Rule::ALL`].
    pub fn index(self) -> usize {
        Rule::ALL.iter().position(|r| *r == self).unwrap_or(0)
    }
}

impl std::fmt::Display for Rule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.as_str(), self.describe())
    }
}

/// Whether a folded, lowercased name is one the gateway owns. Backends built on CGI/WSGI
/// read `_` and `.` as `-`, so every spelling counts.
fn reserved(name: &str) -> bool {
    let folded: Cow<'_, str> = if name.bytes().any(|b| b == b'_' || b == b'.') {
        Cow::Owned(name.replace(['_', '.'], "-"))
    } else {
        Cow::Borrowed(name)
    };
    let n = folded.as_ref();
    n.starts_with("x-auth-")
        || matches!(
            n,
            "host"
                | "content-length"
                | "transfer-encoding"
                | "connection"
                | "keep-alive"
                | "proxy-connection"
                | "proxy-authorization"
                | "te"
                | "trailer"
                | "upgrade"
                | "x-request-id"
        )
}

/// A header name a filter may set or remove.
pub fn header_name(name: &str) -> Result<HeaderName, Rule> {
    let n = HeaderName::from_bytes(name.as_bytes()).map_err(|_| Rule::HeaderName)?;
    if reserved(n.as_str()) {
        return Err(Rule::ReservedHeader);
    }
    Ok(n)
}

/// A header value a filter may set.
pub fn header_value(value: &[u8]) -> Result<HeaderValue, Rule> {
    HeaderValue::from_bytes(value).map_err(|_| Rule::HeaderValue)
}

/// A reply status a filter may answer with.
pub fn status(code: u16) -> Result<StatusCode, Rule> {
    match StatusCode::from_u16(code) {
        Ok(s) if (200..=599).contains(&code) => Ok(s),
        _ => Err(Rule::Status),
    }
}

/// A path (with its query) a filter may set, as syntax: canonical form is checked
/// against the platform's policy with [`canonical_path`].
pub fn path(p: &str) -> Result<PathAndQuery, Rule> {
    if p.len() > MAX_PATH_BYTES {
        return Err(Rule::PathLength);
    }
    if !p.starts_with('/') {
        return Err(Rule::PathSyntax);
    }
    PathAndQuery::from_maybe_shared(bytes::Bytes::copy_from_slice(p.as_bytes())).map_err(|_| Rule::PathSyntax)
}

/// Whether a path (without its query) is canonical under `policy`, as the router and
/// static rewrites require.
pub fn canonical_path(p: &str, policy: &PathPolicy) -> Result<(), Rule> {
    match postern_model::path::canonical(p, policy) {
        Ok(Cow::Borrowed(_)) => Ok(()),
        _ => Err(Rule::PathCanonical),
    }
}

/// The counts and bytes of header changes against `limits`.
pub fn sizes(
    set: &[(String, Vec<u8>)],
    append: &[(String, Vec<u8>)],
    remove: &[String],
    limits: &Limits,
) -> Result<(), Rule> {
    if set.len() + append.len() + remove.len() > limits.max_headers {
        return Err(Rule::HeaderCount);
    }
    let bytes: usize = set.iter().chain(append).map(|(k, v)| k.len() + v.len()).sum::<usize>()
        + remove.iter().map(String::len).sum::<usize>();
    if bytes > limits.max_header_bytes {
        return Err(Rule::HeaderBytes);
    }
    Ok(())
}

/// Every header change, by name and value.
fn headers(set: &[(String, Vec<u8>)], append: &[(String, Vec<u8>)], remove: &[String]) -> Result<(), Rule> {
    for k in remove {
        header_name(k)?;
    }
    for (k, v) in set.iter().chain(append) {
        header_name(k)?;
        header_value(v)?;
    }
    Ok(())
}

/// Every rule for a request-phase (or body-phase) decision; the path's canonical form
/// under `paths`, when given (the node checks it once every filter has run).
pub fn check_decision(d: &types::Decision, limits: &Limits, paths: Option<&PathPolicy>) -> Result<(), Rule> {
    match d {
        types::Decision::Continue(e) => {
            sizes(&e.set_headers, &e.append_headers, &e.remove_headers, limits)?;
            headers(&e.set_headers, &e.append_headers, &e.remove_headers)?;
            if let Some(p) = &e.path {
                let pq = path(p)?;
                if let Some(policy) = paths {
                    canonical_path(pq.path(), policy)?;
                }
            }
            Ok(())
        }
        types::Decision::Respond(r) => {
            status(r.status)?;
            if r.body.len() > limits.max_body_bytes {
                return Err(Rule::BodySize);
            }
            sizes(&[], &r.headers, &[], limits)?;
            headers(&[], &r.headers, &[])
        }
    }
}

/// Every rule for response-phase edits.
pub fn check_response(e: &types::ResponseEdits, limits: &Limits) -> Result<(), Rule> {
    sizes(&e.set_headers, &e.append_headers, &e.remove_headers, limits)?;
    headers(&e.set_headers, &e.append_headers, &e.remove_headers)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn edits(set: &[(&str, &str)], path: Option<&str>) -> types::Decision {
        types::Decision::Continue(types::RequestEdits {
            set_headers: set.iter().map(|(k, v)| ((*k).to_owned(), v.as_bytes().to_vec())).collect(),
            append_headers: Vec::new(),
            remove_headers: Vec::new(),
            path: path.map(str::to_owned),
        })
    }

    fn reply(status: u16, body: usize) -> types::Decision {
        types::Decision::Respond(types::Reply { status, headers: Vec::new(), body: vec![b'x'; body] })
    }

    #[test]
    fn every_rule_is_named() {
        let limits = Limits::default();
        let policy = PathPolicy::default();
        let check = |d: &types::Decision| check_decision(d, &limits, Some(&policy));
        assert_eq!(check(&edits(&[("x-ok", "1")], Some("/a?b=c"))), Ok(()));
        assert_eq!(check(&edits(&[("bad name", "1")], None)), Err(Rule::HeaderName));
        assert_eq!(check(&edits(&[("x-ok", "a\nb")], None)), Err(Rule::HeaderValue));
        for name in ["x-auth-subject", "X_Auth_Subject", "x.auth.tenant", "content-length", "keep-alive"] {
            assert_eq!(check(&edits(&[(name, "1")], None)), Err(Rule::ReservedHeader), "{name}");
        }
        assert_eq!(check(&edits(&[], Some("a"))), Err(Rule::PathSyntax));
        assert_eq!(check(&edits(&[], Some(&format!("/{}", "a".repeat(9000))))), Err(Rule::PathLength));
        assert_eq!(check(&edits(&[], Some("/a/%74"))), Err(Rule::PathCanonical));
        assert_eq!(check_decision(&edits(&[], Some("/a/%74")), &limits, None), Ok(()), "no policy: syntax only");
        assert_eq!(check(&reply(101, 0)), Err(Rule::Status));
        assert_eq!(check(&reply(600, 0)), Err(Rule::Status));
        assert_eq!(check(&reply(204, 0)), Ok(()));
        assert_eq!(check(&reply(200, limits.max_body_bytes + 1)), Err(Rule::BodySize));
        let many: Vec<(String, Vec<u8>)> = (0..=limits.max_headers).map(|i| (format!("x-{i}"), Vec::new())).collect();
        let d = types::Decision::Continue(types::RequestEdits {
            set_headers: many,
            append_headers: Vec::new(),
            remove_headers: Vec::new(),
            path: None,
        });
        assert_eq!(check(&d), Err(Rule::HeaderCount));
        let r = types::ResponseEdits {
            set_headers: Vec::new(),
            append_headers: vec![("transfer-encoding".into(), b"chunked".to_vec())],
            remove_headers: Vec::new(),
        };
        assert_eq!(check_response(&r, &limits), Err(Rule::ReservedHeader));
        assert!(Rule::ALL.iter().enumerate().all(|(i, r)| r.index() == i));
    }
}
