//! What a filter may answer, on the WIT types: the rules of `postern_filter_rules` (shared
//! with the filter SDK's testing module), applied by the node (the runtime checks sizes
//! on the thread that ran the call; the adapter the rest, turning names and values into
//! `http` types, before it applies anything), by `posternctl filter run` and by the
//! manifest's sample cases at compile ([`check_decision`], [`check_response`]). A refusal
//! names the [`Rule`] it broke: in the node's log, in `postern_filter_refusals_total{rule=..}`,
//! and in the 503's detail.

use http::{HeaderName, HeaderValue, StatusCode, uri::PathAndQuery};
use postern_filter_rules::output as rules;
use postern_model::path::PathPolicy;
use postern_model::wasm::Limits;

pub use postern_filter_rules::{Bounds, MAX_PATH_BYTES, Rule};

use crate::runtime::types;

/// The sizes an attachment's limits allow a decision.
pub fn bounds(limits: &Limits) -> Bounds {
    Bounds {
        max_headers: limits.max_headers,
        max_header_bytes: limits.max_header_bytes,
        max_body_bytes: limits.max_body_bytes,
    }
}

/// A header name a filter may set or remove.
pub fn header_name(name: &str) -> Result<HeaderName, Rule> {
    rules::header_name(name.as_bytes())?;
    HeaderName::from_bytes(name.as_bytes()).map_err(|_| Rule::HeaderName)
}

/// A header value a filter may set.
pub fn header_value(value: &[u8]) -> Result<HeaderValue, Rule> {
    rules::header_value(value)?;
    HeaderValue::from_bytes(value).map_err(|_| Rule::HeaderValue)
}

/// A reply status a filter may answer with.
pub fn status(code: u16) -> Result<StatusCode, Rule> {
    rules::status(code)?;
    StatusCode::from_u16(code).map_err(|_| Rule::Status)
}

/// A path (with its query) a filter may set: its syntax, and its canonical form under the
/// platform's policy.
pub fn path(p: &str, policy: &PathPolicy) -> Result<PathAndQuery, Rule> {
    rules::path(p, Some(policy))?;
    PathAndQuery::from_maybe_shared(bytes::Bytes::copy_from_slice(p.as_bytes())).map_err(|_| Rule::PathSyntax)
}

/// The counts and bytes of header changes against `limits`.
pub fn sizes(
    set: &[(String, Vec<u8>)],
    append: &[(String, Vec<u8>)],
    remove: &[String],
    limits: &Limits,
) -> Result<(), Rule> {
    rules::sizes(set, append, remove, &bounds(limits))
}

/// Every rule for a request-phase (or body-phase) decision; the path's canonical form
/// under `paths`, when given.
pub fn check_decision(d: &types::Decision, limits: &Limits, paths: Option<&PathPolicy>) -> Result<(), Rule> {
    let bounds = bounds(limits);
    match d {
        types::Decision::Continue(e) => {
            rules::edits(&e.set_headers, &e.append_headers, &e.remove_headers, e.path.as_deref(), &bounds, paths)
        }
        types::Decision::Respond(r) => rules::reply(r.status, &r.headers, r.body.len(), &bounds),
    }
}

/// Every rule for response-phase edits.
pub fn check_response(e: &types::ResponseEdits, limits: &Limits) -> Result<(), Rule> {
    rules::headers(&e.set_headers, &e.append_headers, &e.remove_headers, &bounds(limits))
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
