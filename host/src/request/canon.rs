//! The canonical request, settled before routing: one authority and one path. The router
//! matches them, filters see them, and the backend receives exactly them.

use std::borrow::Cow;

use http::HeaderValue;
use http::header::HOST;
use http::uri::PathAndQuery;
use postern_model::path::{PathPolicy, canonical};

use crate::request::error::ProxyError;

/// The authority a request is routed on.
#[derive(Debug)]
pub struct Routed<'a> {
    /// Host, lowercase, without a trailing dot or a port.
    pub host: Cow<'a, str>,
    /// The `Host` the backend is told: the routed host and the client's port, if any.
    pub header: HeaderValue,
}

/// `host[:port]` of a `Host` header, checked: a reg-name or IPv4 (letters, digits, `-`,
/// `.`, `_`) or a bracketed IPv6 literal, and an optional decimal port. No user info.
fn split_host_port(v: &str) -> Option<(&str, Option<&str>)> {
    let (host, port) = if let Some(rest) = v.strip_prefix('[') {
        let end = rest.find(']')?;
        let (lit, after) = (&v[..end + 2], &rest[end + 1..]);
        if !rest[..end].bytes().all(|b| b.is_ascii_hexdigit() || b == b':' || b == b'.') {
            return None;
        }
        match after {
            "" => (lit, None),
            p => (lit, Some(p.strip_prefix(':')?)),
        }
    } else {
        match v.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (v, None),
        }
    };
    if host.is_empty()
        || !host.starts_with('[') && !host.bytes().all(|b| b.is_ascii_alphanumeric() || b"-._".contains(&b))
    {
        return None;
    }
    if let Some(p) = port
        && (p.is_empty() || p.len() > 5 || !p.bytes().all(|b| b.is_ascii_digit()))
    {
        return None;
    }
    Some((host, port))
}

/// The host as routed: one trailing dot dropped (a fully qualified name is the same
/// host), lowercase; an empty label is refused.
fn routed_host(raw: &str) -> Result<Cow<'_, str>, ProxyError> {
    let h = raw.strip_suffix('.').unwrap_or(raw);
    if h.is_empty() || h.starts_with('.') || h.ends_with('.') || h.contains("..") {
        return Err(ProxyError::BadRequest("the host is not a valid name"));
    }
    if h.bytes().any(|b| b.is_ascii_uppercase()) {
        Ok(Cow::Owned(h.to_ascii_lowercase()))
    } else {
        Ok(Cow::Borrowed(h))
    }
}

/// Settles the one authority of a request (RFC 9112 §3.2, RFC 9113 §8.3.1): at most one
/// `Host`; a request target's authority (absolute form, or HTTP/2's `:authority`) that
/// disagrees with `Host` is refused; user info is refused.
pub fn authority(parts: &http::request::Parts) -> Result<Routed<'_>, ProxyError> {
    let mut all = parts.headers.get_all(HOST).iter();
    let header = all.next();
    if all.next().is_some() {
        return Err(ProxyError::BadRequest("the request has more than one Host header"));
    }
    let from_header = match header {
        None => None,
        Some(v) => Some(
            v.to_str()
                .ok()
                .and_then(split_host_port)
                .ok_or(ProxyError::BadRequest("the Host header is not a valid host[:port]"))?,
        ),
    };
    let from_target = match parts.uri.authority() {
        None => None,
        Some(a) if a.as_str().contains('@') => {
            return Err(ProxyError::BadRequest("the request target's authority has user information"));
        }
        Some(a) => Some((a.host(), a.port().map(|p| &a.as_str()[a.as_str().len() - p.as_str().len()..]))),
    };
    let host_from_header = from_target.is_none();
    let (host, port) = match (from_target, from_header) {
        (Some(t), Some(h)) => {
            let same_host =
                t.0.strip_suffix('.').unwrap_or(t.0).eq_ignore_ascii_case(h.0.strip_suffix('.').unwrap_or(h.0));
            let same_port = match (t.1, h.1) {
                (Some(a), Some(b)) => a == b,
                _ => true,
            };
            if !(same_host && same_port) {
                return Err(ProxyError::BadRequest("the request target's authority and the Host header disagree"));
            }
            t
        }
        (Some(t), None) => t,
        (None, Some(h)) => h,
        (None, None) => return Err(ProxyError::BadRequest("the request has no host")),
    };
    let routed = routed_host(host)?;
    let unchanged = matches!(routed, Cow::Borrowed(r) if r.len() == host.len());
    let header = match (header, unchanged && host_from_header) {
        (Some(v), true) => v.clone(),
        _ => {
            let text = match port {
                Some(p) => format!("{routed}:{p}"),
                None => routed.clone().into_owned(),
            };
            HeaderValue::from_str(&text).map_err(|_| ProxyError::BadRequest("the host is not a valid name"))?
        }
    };
    Ok(Routed { host: routed, header })
}

/// The canonical path of a request under the snapshot's policy; the request's target is
/// rewritten to it (keeping the query) when it differs.
pub fn path(parts: &mut http::request::Parts, policy: &PathPolicy) -> Result<(), ProxyError> {
    let new = match canonical(parts.uri.path(), policy) {
        Ok(Cow::Borrowed(_)) => return Ok(()),
        Ok(Cow::Owned(p)) => p,
        Err(e) => return Err(ProxyError::InvalidPath(e.as_str())),
    };
    let pq = match parts.uri.query() {
        Some(q) => format!("{new}?{q}"),
        None => new,
    };
    let mut up = std::mem::take(&mut parts.uri).into_parts();
    up.path_and_query =
        Some(PathAndQuery::from_maybe_shared(pq).map_err(|_| ProxyError::Internal("the canonical path is not a URI"))?);
    parts.uri = http::Uri::from_parts(up).map_err(|_| ProxyError::Internal("the canonical path is not a URI"))?;
    Ok(())
}

/// After filters ran: a path they edited must already be canonical.
pub fn check_edited_path(parts: &http::request::Parts, policy: &PathPolicy) -> Result<(), ProxyError> {
    match canonical(parts.uri.path(), policy) {
        Ok(Cow::Borrowed(_)) => Ok(()),
        Ok(Cow::Owned(_)) => Err(ProxyError::FilterPath("the path is not in canonical form")),
        Err(e) => Err(ProxyError::FilterPath(e.as_str())),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn parts(uri: &str, hosts: &[&str]) -> http::request::Parts {
        let mut b = http::Request::get(uri);
        for h in hosts {
            b = b.header(HOST, *h);
        }
        b.body(()).unwrap().into_parts().0
    }

    fn routed(uri: &str, hosts: &[&str]) -> Result<(String, String), String> {
        let p = parts(uri, hosts);
        authority(&p).map(|r| (r.host.into_owned(), r.header.to_str().unwrap().to_owned())).map_err(|e| e.to_string())
    }

    #[test]
    fn one_host_is_settled() {
        assert_eq!(routed("/a", &["Api.Example.com"]).unwrap(), ("api.example.com".into(), "api.example.com".into()));
        assert_eq!(
            routed("/a", &["api.example.com.:8443"]).unwrap(),
            ("api.example.com".into(), "api.example.com:8443".into())
        );
        assert_eq!(routed("/a", &["a.example"]).unwrap(), ("a.example".into(), "a.example".into()));
        assert_eq!(routed("http://A.example/a", &[]).unwrap(), ("a.example".into(), "a.example".into()));
        assert_eq!(routed("http://a.example:80/a", &["a.example"]).unwrap().0, "a.example");
        assert_eq!(routed("/a", &["[::1]:8080"]).unwrap().1, "[::1]:8080");
    }

    #[test]
    fn conflicting_or_bad_hosts_are_refused() {
        assert!(routed("/a", &["a.example", "b.example"]).unwrap_err().contains("more than one Host"));
        assert!(routed("http://a.example/x", &["b.example"]).unwrap_err().contains("disagree"));
        assert!(routed("http://a.example:81/x", &["a.example:82"]).unwrap_err().contains("disagree"));
        assert!(routed("/a", &[]).unwrap_err().contains("no host"));
        for bad in ["a b", "evil@a.example", "a.example:x", "a..example", ".", "", "a.example:123456", "[zz]"] {
            assert!(routed("/a", &[bad]).is_err(), "{bad:?}");
        }
        assert!(routed("http://u@a.example/x", &[]).unwrap_err().contains("user information"));
    }

    #[test]
    fn the_target_is_rewritten_to_its_canonical_path() {
        let mut p = parts("/a/%2e%2e/b/%74?x=%2e", &["h"]);
        path(&mut p, &PathPolicy::default()).unwrap();
        assert_eq!(p.uri.path_and_query().unwrap().as_str(), "/b/t?x=%2e");
        let mut p = parts("/a//b", &["h"]);
        assert!(matches!(path(&mut p, &PathPolicy::default()), Err(ProxyError::InvalidPath(_))));
        let p = parts("/a/%74", &["h"]);
        assert!(matches!(check_edited_path(&p, &PathPolicy::default()), Err(ProxyError::FilterPath(_))));
    }
}
