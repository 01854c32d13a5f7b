//! Header hygiene on the way in and out: hop-by-hop headers (and every name listed in
//! `Connection`) and client-sent identity headers (`x-auth-*`) are deleted; request ids
//! and W3C trace context are made here.

use http::header::{CONNECTION, HeaderName};
use http::{HeaderMap, HeaderValue};

/// Hop-by-hop headers (RFC 9110 §7.6.1 and the legacy ones proxies still see).
const HOP_BY_HOP: [HeaderName; 8] = [
    CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    http::header::TE,
    http::header::TRAILER,
    http::header::TRANSFER_ENCODING,
    http::header::UPGRADE,
    http::header::PROXY_AUTHORIZATION,
];

/// Removes hop-by-hop headers, including every name listed in `Connection`.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Most heads carry none: one pass over the names present (a standard name compares
    // as a tag) instead of a hashed removal of each of the eight.
    if !headers.keys().any(|n| HOP_BY_HOP.contains(n)) {
        return;
    }
    // Names listed in Connection first (they may only be known from there).
    if headers.contains_key(CONNECTION) {
        let listed: Vec<HeaderName> = headers
            .get_all(CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
            .collect();
        for n in listed {
            // The request's framing and authority are the gateway's to set, not the
            // client's to remove.
            if n != http::header::HOST && n != http::header::CONTENT_LENGTH {
                headers.remove(n);
            }
        }
    }
    for h in &HOP_BY_HOP {
        headers.remove(h);
    }
}

/// Names (folded: see [`fold`]) of headers a backend may trust and a client must never
/// set: the gateway's own, method and URL overrides, and client-address headers. The
/// gateway sets its own afresh; the rest are dropped.
const PROTECTED: [&[u8]; 27] = [
    b"x-request-id",
    b"x-deadline-ms",
    b"x-http-method-override",
    b"x-http-method",
    b"x-method-override",
    b"x-original-method",
    b"x-original-url",
    b"x-rewrite-url",
    b"x-original-uri",
    b"x-real-ip",
    b"true-client-ip",
    b"x-client-ip",
    b"client-ip",
    b"cf-connecting-ip",
    b"fastly-client-ip",
    b"x-cluster-client-ip",
    b"x-originating-ip",
    b"x-forwarded",
    b"forwarded-for",
    b"x-forwarded-for",
    b"x-forwarded-host",
    b"x-forwarded-proto",
    b"x-forwarded-port",
    b"x-forwarded-server",
    b"x-forwarded-prefix",
    b"x-forwarded-scheme",
    b"forwarded",
];

/// A header name as CGI/WSGI-style servers read it: `_` and `.` are `-` (names are
/// lowercase already).
fn fold(b: u8) -> u8 {
    if b == b'_' || b == b'.' { b'-' } else { b }
}

fn folds_to(name: &[u8], want: &[u8]) -> bool {
    name.len() == want.len() && name.iter().zip(want).all(|(&a, &b)| fold(a) == b)
}

/// Prefixes no client may send: identity headers (`x-auth-*`) and the gateway's own
/// (`x-postern-*`: retry and overload marks between nodes and backends, versions).
const PROTECTED_PREFIXES: [&[u8]; 2] = [b"x-auth-", b"x-postern-"];

/// Whether a client must not send this header: one of the [`PROTECTED_PREFIXES`] or a
/// [`PROTECTED`] one, in every spelling that folds to it.
fn is_protected(name: &str) -> bool {
    let n = name.as_bytes();
    if PROTECTED_PREFIXES.iter().any(|p| n.get(..p.len()).is_some_and(|head| folds_to(head, p))) {
        return true;
    }
    PROTECTED.iter().any(|p| folds_to(n, p))
}

/// Removes every header a client must never set: identity headers (`x-auth-*`), the
/// gateway's own headers (`x-postern-*`), its request id and deadline, method and URL override headers and
/// client-address headers — each also in the spellings (`_`, `.`) that backends fold to
/// it. The gateway then sets its own forwarding headers (`x-forwarded-*`, `forwarded`,
/// `x-real-ip`) from the connection.
pub fn strip_client_identity(headers: &mut HeaderMap) {
    if !headers.keys().any(|k| is_protected(k.as_str())) {
        return;
    }
    let names: Vec<HeaderName> = headers.keys().filter(|k| is_protected(k.as_str())).cloned().collect();
    for n in names {
        headers.remove(n);
    }
}

/// `x-request-id`.
pub const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
/// `x-deadline-ms`: the time the backend has left, in milliseconds.
pub const X_DEADLINE_MS: HeaderName = HeaderName::from_static("x-deadline-ms");
/// W3C `traceparent`.
pub const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");

const HEX: &[u8; 16] = b"0123456789abcdef";

fn hex_into(out: &mut [u8], mut v: u128, digits: usize) {
    for i in (0..digits).rev() {
        if let Some(b) = out.get_mut(i) {
            *b = HEX[(v & 0xf) as usize];
        }
        v >>= 4;
    }
}

/// A new request id (32 lowercase hex digits) that also serves as the trace id of a
/// trace this request starts.
pub fn new_request_id() -> (u128, HeaderValue) {
    let id = fastrand::u128(1..);
    let mut buf = [0u8; 32];
    hex_into(&mut buf, id, 32);
    (id, HeaderValue::from_bytes(&buf).unwrap_or(HeaderValue::from_static("0")))
}

/// A valid W3C `traceparent` (version 00) as the client sent it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    /// The trace id the request continues.
    pub trace_id: u128,
    /// The client's span: the parent of the node's server span.
    pub parent: u64,
    /// The trace flags (bit 0: sampled).
    pub flags: u8,
}

impl TraceParent {
    /// The client's trace context, if it sent a valid one; junk is ignored.
    pub fn parse(incoming: Option<&HeaderValue>) -> Option<TraceParent> {
        let b = incoming.map(HeaderValue::as_bytes).filter(|b| valid_traceparent(b))?;
        let hex = |s: &[u8]| std::str::from_utf8(s).ok().and_then(|s| u128::from_str_radix(s, 16).ok());
        Some(TraceParent {
            trace_id: hex(&b[3..35])?,
            parent: u64::try_from(hex(&b[36..52])?).ok()?,
            flags: u8::try_from(hex(&b[53..55])?).ok()?,
        })
    }
}

/// The `traceparent` to send upstream: `trace_id` (the client's, else the request's
/// own), the node's upstream span as the parent, and `flags`.
pub fn traceparent(trace_id: u128, span: u64, flags: u8) -> HeaderValue {
    // 00-<32 hex trace>-<16 hex parent>-<2 hex flags>
    let mut buf = *b"00-00000000000000000000000000000000-0000000000000000-00";
    hex_into(&mut buf[3..35], trace_id, 32);
    hex_into(&mut buf[36..52], u128::from(span), 16);
    hex_into(&mut buf[53..55], u128::from(flags), 2);
    HeaderValue::from_bytes(&buf).unwrap_or(HeaderValue::from_static("00-0-0-00"))
}

fn valid_traceparent(b: &[u8]) -> bool {
    let lower_hex = |s: &[u8]| s.iter().all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c));
    b.len() == 55
        && &b[0..3] == b"00-"
        && b[35] == b'-'
        && b[52] == b'-'
        && lower_hex(&b[3..35])
        && lower_hex(&b[36..52])
        && lower_hex(&b[53..55])
        && b[3..35].iter().any(|&c| c != b'0')
        && b[36..52].iter().any(|&c| c != b'0')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_listed_and_hop_by_hop_headers_go() {
        let mut h = HeaderMap::new();
        h.insert(CONNECTION, HeaderValue::from_static("keep-alive, x-auth-subject, X-Secret"));
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("x-auth-subject", HeaderValue::from_static("admin"));
        h.insert("transfer-encoding", HeaderValue::from_static("chunked"));
        h.insert("upgrade", HeaderValue::from_static("websocket"));
        h.insert("x-keep", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1, "{h:?}");
        assert!(h.contains_key("x-keep"));
        // Each on its own goes too; a head with none is left as it is.
        for name in &HOP_BY_HOP {
            let mut h = HeaderMap::new();
            h.insert(name.clone(), HeaderValue::from_static("x"));
            h.insert("x-keep", HeaderValue::from_static("1"));
            strip_hop_by_hop(&mut h);
            assert_eq!(h.keys().collect::<Vec<_>>(), ["x-keep"], "{name}");
        }
        let mut h = HeaderMap::new();
        h.insert("x-keep", HeaderValue::from_static("1"));
        h.insert(http::header::HOST, HeaderValue::from_static("a"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 2);
    }

    #[test]
    fn identity_headers_go() {
        let mut h = HeaderMap::new();
        h.insert("x-auth-subject", HeaderValue::from_static("admin"));
        h.append("x-auth-scopes", HeaderValue::from_static("all"));
        h.insert("x-request-id", HeaderValue::from_static("mine"));
        h.insert("x-authz", HeaderValue::from_static("kept"));
        h.insert("x-posternx", HeaderValue::from_static("kept"));
        for name in [
            "x_auth_subject",
            "x.auth.scopes",
            "x-auth_tenant",
            "x-http-method-override",
            "x_http_method_override",
            "x-original-url",
            "x-rewrite-url",
            "x-real-ip",
            "true-client-ip",
            "x_forwarded_for",
            "x-forwarded-port",
            "x-postern-retry",
            "x-postern-overloaded",
            "x_postern_not_processed",
            "x.postern.anything",
        ] {
            h.insert(HeaderName::from_bytes(name.as_bytes()).unwrap(), HeaderValue::from_static("forged"));
        }
        strip_client_identity(&mut h);
        assert_eq!(h.len(), 2, "{h:?}");
        assert!(h.contains_key("x-authz") && h.contains_key("x-posternx"));
    }

    #[test]
    fn request_ids_are_hex_and_distinct() {
        let (_, a) = new_request_id();
        let (_, b) = new_request_id();
        assert_eq!(a.len(), 32);
        assert_ne!(a, b);
        assert!(a.as_bytes().iter().all(u8::is_ascii_hexdigit));
    }

    #[test]
    fn traceparent_keeps_a_valid_trace_and_replaces_junk() {
        let incoming = HeaderValue::from_static("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
        let tp = TraceParent::parse(Some(&incoming)).unwrap();
        assert_eq!(tp.trace_id, 0x4bf92f3577b34da6a3ce929d0e0e4736);
        assert_eq!(tp.parent, 0x00f067aa0ba902b7);
        assert_eq!(tp.flags, 1);
        let out = traceparent(tp.trace_id, 0x1234, tp.flags);
        assert_eq!(out.to_str().unwrap(), "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000001234-01");
        for junk in [
            "garbage",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert_eq!(TraceParent::parse(Some(&HeaderValue::from_static(junk))), None, "{junk}");
        }
        let out = traceparent(0xabc, 0xdef, 0);
        assert_eq!(out.to_str().unwrap(), "00-00000000000000000000000000000abc-0000000000000def-00");
        assert!(valid_traceparent(out.as_bytes()));
    }
}
