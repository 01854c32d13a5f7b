//! The rules of what a filter may answer ([`Rule`]), checked on the parts of a decision:
//! header changes ([`headers`]), a new path ([`path`]), a reply ([`reply`]). A refusal
//! names the rule it broke: in the node's log, in `postern_filter_refusals_total{rule=..}`
//! and in the 503's detail.

use crate::path::{PathPolicy, canonical};
use alloc::borrow::Cow;

/// The longest path a filter may set.
pub const MAX_PATH_BYTES: usize = 8192;

/// The sizes an attachment allows a decision (`limits:` in the route's filter list).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// Header changes (set, appended, removed) a decision may carry.
    pub max_headers: usize,
    /// Bytes of header names and values a decision may carry.
    pub max_header_bytes: usize,
    /// Bytes of a reply body.
    pub max_body_bytes: usize,
}

impl Default for Bounds {
    /// The platform's defaults.
    fn default() -> Self {
        Bounds { max_headers: 64, max_header_bytes: 16 * 1024, max_body_bytes: 64 * 1024 }
    }
}

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

impl core::fmt::Display for Rule {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "{}: {}", self.as_str(), self.describe())
    }
}

impl core::error::Error for Rule {}

/// RFC 9110 `tchar`: the bytes of a header name.
fn tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric()
        || matches!(
            b,
            b'!' | b'#' | b'$' | b'%' | b'&' | b'\'' | b'*' | b'+' | b'-' | b'.' | b'^' | b'_' | b'`' | b'|' | b'~'
        )
}

/// A name byte as a backend folds it: lowercase, and `_` and `.` read as `-` (CGI/WSGI).
fn fold(b: u8) -> u8 {
    match b {
        b'_' | b'.' => b'-',
        b => b.to_ascii_lowercase(),
    }
}

fn folds_to(name: &[u8], owned: &[u8]) -> bool {
    name.len() == owned.len() && name.iter().zip(owned).all(|(a, b)| fold(*a) == *b)
}

/// Headers the gateway owns, besides every `x-auth-*`.
const OWNED: [&[u8]; 11] = [
    b"host",
    b"content-length",
    b"transfer-encoding",
    b"connection",
    b"keep-alive",
    b"proxy-connection",
    b"proxy-authorization",
    b"te",
    b"trailer",
    b"upgrade",
    b"x-request-id",
];

/// Whether `name` is one the gateway owns, in any case and in every spelling a backend
/// folds to it.
fn reserved(name: &[u8]) -> bool {
    let prefix = b"x-auth-";
    (name.len() >= prefix.len() && folds_to(&name[..prefix.len()], prefix)) || OWNED.iter().any(|o| folds_to(name, o))
}

/// A header name a filter may set or remove: an HTTP token the gateway does not own.
pub fn header_name(name: &[u8]) -> Result<(), Rule> {
    if name.is_empty() || name.len() > usize::from(u16::MAX) || !name.iter().copied().all(tchar) {
        return Err(Rule::HeaderName);
    }
    if reserved(name) {
        return Err(Rule::ReservedHeader);
    }
    Ok(())
}

/// A header value a filter may set: visible bytes, space and tab.
pub fn header_value(value: &[u8]) -> Result<(), Rule> {
    if value.iter().all(|&b| (b >= 0x20 && b != 0x7f) || b == b'\t') { Ok(()) } else { Err(Rule::HeaderValue) }
}

/// A reply status a filter may answer with: 200–599 (a 1xx is the gateway's to send).
pub fn status(code: u16) -> Result<(), Rule> {
    if (200..=599).contains(&code) { Ok(()) } else { Err(Rule::Status) }
}

/// A byte a request target's path may carry (as `http` parses one), `#` excluded.
fn path_byte(b: u8) -> bool {
    matches!(b, 0x21 | 0x24..=0x3B | 0x3D | 0x40..=0x5F | 0x61..=0x7A | 0x7C | 0x7E | b'"' | b'{' | b'}')
}

/// A byte a query may carry, `#` excluded.
fn query_byte(b: u8) -> bool {
    matches!(b, 0x21 | 0x24..=0x3B | 0x3D | 0x3F..=0x7E)
}

/// A path (with its optional `?query`) a filter may set: an absolute path of at most
/// [`MAX_PATH_BYTES`] with no fragment, and canonical under `policy` when given (the node
/// checks canonical form once every filter of the chain has run).
pub fn path(p: &str, policy: Option<&PathPolicy>) -> Result<(), Rule> {
    if p.len() > MAX_PATH_BYTES {
        return Err(Rule::PathLength);
    }
    let (path, query) = match p.split_once('?') {
        Some((path, query)) => (path, Some(query)),
        None => (p, None),
    };
    if !path.starts_with('/') || !path.bytes().all(path_byte) || !query.is_none_or(|q| q.bytes().all(query_byte)) {
        return Err(Rule::PathSyntax);
    }
    match policy.map(|policy| canonical(path, policy)) {
        None | Some(Ok(Cow::Borrowed(_))) => Ok(()),
        Some(_) => Err(Rule::PathCanonical),
    }
}

/// The count and weight of header changes against `bounds` (what the node checks on the
/// thread that ran the call, before the rest).
pub fn sizes<N, V>(set: &[(N, V)], append: &[(N, V)], remove: &[N], bounds: &Bounds) -> Result<(), Rule>
where
    N: AsRef<str>,
    V: AsRef<[u8]>,
{
    if set.len() + append.len() + remove.len() > bounds.max_headers {
        return Err(Rule::HeaderCount);
    }
    let weight = |(k, v): &(N, V)| k.as_ref().len() + v.as_ref().len();
    let bytes =
        set.iter().chain(append).map(weight).sum::<usize>() + remove.iter().map(|k| k.as_ref().len()).sum::<usize>();
    if bytes > bounds.max_header_bytes {
        return Err(Rule::HeaderBytes);
    }
    Ok(())
}

/// Header changes: their [`sizes`], then every name and value.
pub fn headers<N, V>(set: &[(N, V)], append: &[(N, V)], remove: &[N], bounds: &Bounds) -> Result<(), Rule>
where
    N: AsRef<str>,
    V: AsRef<[u8]>,
{
    sizes(set, append, remove, bounds)?;
    for k in remove {
        header_name(k.as_ref().as_bytes())?;
    }
    for (k, v) in set.iter().chain(append) {
        header_name(k.as_ref().as_bytes())?;
        header_value(v.as_ref())?;
    }
    Ok(())
}

/// Request edits: header changes, then the new path (see [`path`] for `policy`).
pub fn edits<N, V>(
    set: &[(N, V)],
    append: &[(N, V)],
    remove: &[N],
    new_path: Option<&str>,
    bounds: &Bounds,
    policy: Option<&PathPolicy>,
) -> Result<(), Rule>
where
    N: AsRef<str>,
    V: AsRef<[u8]>,
{
    headers(set, append, remove, bounds)?;
    new_path.map_or(Ok(()), |p| path(p, policy))
}

/// A reply the filter answers with instead of the backend.
pub fn reply<N, V>(code: u16, reply_headers: &[(N, V)], body_len: usize, bounds: &Bounds) -> Result<(), Rule>
where
    N: AsRef<str>,
    V: AsRef<[u8]>,
{
    status(code)?;
    if body_len > bounds.max_body_bytes {
        return Err(Rule::BodySize);
    }
    headers(&[], reply_headers, &[], bounds)
}

#[cfg(test)]
mod tests {
    use alloc::format;
    use alloc::string::String;
    use alloc::vec::Vec;

    use super::*;

    type Fields = Vec<(String, Vec<u8>)>;

    fn set(pairs: &[(&str, &str)]) -> Fields {
        pairs.iter().map(|(k, v)| ((*k).into(), v.as_bytes().to_vec())).collect()
    }

    fn edit(pairs: &[(&str, &str)], p: Option<&str>) -> Result<(), Rule> {
        edits(&set(pairs), &[], &[], p, &Bounds::default(), Some(&PathPolicy::default()))
    }

    #[test]
    fn every_rule_is_named() {
        let bounds = Bounds::default();
        assert_eq!(edit(&[("x-ok", "1"), ("X-Mixed", "a\tb")], Some("/a?b=c")), Ok(()));
        assert_eq!(edit(&[("bad name", "1")], None), Err(Rule::HeaderName));
        assert_eq!(edit(&[("", "1")], None), Err(Rule::HeaderName));
        assert_eq!(edit(&[("x-ok", "a\nb")], None), Err(Rule::HeaderValue));
        assert_eq!(edit(&[("x-ok", "a\u{7f}")], None), Err(Rule::HeaderValue));
        for name in
            ["x-auth-subject", "X_Auth_Subject", "x.auth.tenant", "content-length", "Keep-Alive", "x_request.id"]
        {
            assert_eq!(edit(&[(name, "1")], None), Err(Rule::ReservedHeader), "{name}");
        }
        assert_eq!(edit(&[("x-authz", "1"), ("hosts", "1")], None), Ok(()));
        assert_eq!(edit(&[], Some("a")), Err(Rule::PathSyntax));
        assert_eq!(edit(&[], Some("/a#frag")), Err(Rule::PathSyntax));
        assert_eq!(edit(&[], Some("/a b")), Err(Rule::PathSyntax));
        assert_eq!(edit(&[], Some("/a?b c")), Err(Rule::PathSyntax));
        assert_eq!(edit(&[], Some(&format!("/{}", "a".repeat(9000)))), Err(Rule::PathLength));
        assert_eq!(edit(&[], Some("/a/%74")), Err(Rule::PathCanonical));
        assert_eq!(edit(&[], Some("/a/../b?x=/../")), Err(Rule::PathCanonical));
        assert_eq!(
            edits::<String, Vec<u8>>(&[], &[], &[], Some("/a/%74"), &bounds, None),
            Ok(()),
            "no policy: syntax only"
        );
        let none: Fields = Vec::new();
        assert_eq!(reply(101, &none, 0, &bounds), Err(Rule::Status));
        assert_eq!(reply(600, &none, 0, &bounds), Err(Rule::Status));
        assert_eq!(reply(204, &none, 0, &bounds), Ok(()));
        assert_eq!(reply(200, &none, bounds.max_body_bytes + 1, &bounds), Err(Rule::BodySize));
        assert_eq!(reply(200, &set(&[("transfer-encoding", "chunked")]), 0, &bounds), Err(Rule::ReservedHeader));
        let many: Fields = (0..=bounds.max_headers).map(|i| (format!("x-{i}"), Vec::new())).collect();
        assert_eq!(headers(&many, &[], &[], &bounds), Err(Rule::HeaderCount));
        let heavy = set(&[("x-big", &"v".repeat(bounds.max_header_bytes))]);
        assert_eq!(headers(&heavy, &[], &[], &bounds), Err(Rule::HeaderBytes));
        assert_eq!(headers::<&str, &[u8]>(&[], &[], &["x-auth-scopes"], &bounds), Err(Rule::ReservedHeader));
        assert!(Rule::ALL.iter().enumerate().all(|(i, r)| r.index() == i));
    }
}
