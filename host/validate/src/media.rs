//! A request's `Content-Type` against the media ranges an operation declares (RFC 9110
//! §8.3: type, subtype and parameter names compare without regard to case).

/// A parsed media type: lowercase `type/subtype` and its `charset`, if any.
#[derive(Debug, PartialEq, Eq)]
pub struct MediaType {
    /// `type/subtype`, lowercase.
    pub essence: String,
    /// The `charset` parameter, lowercase, unquoted.
    pub charset: Option<String>,
}

/// Parses a `Content-Type` value; `None` when it is not `type/subtype[; params]`.
pub fn parse(v: &str) -> Option<MediaType> {
    let mut parts = v.split(';');
    let essence = parts.next()?.trim().to_ascii_lowercase();
    let (ty, sub) = essence.split_once('/')?;
    if !token(ty) || !token(sub) {
        return None;
    }
    let mut charset = None;
    for p in parts {
        let p = p.trim();
        if p.is_empty() {
            continue;
        }
        let (k, v) = p.split_once('=')?;
        if !token(k.trim()) {
            return None;
        }
        if k.trim().eq_ignore_ascii_case("charset") {
            let v = v.trim();
            let v = v.strip_prefix('"').and_then(|v| v.strip_suffix('"')).unwrap_or(v);
            charset = Some(v.to_ascii_lowercase());
        }
    }
    Some(MediaType { essence, charset })
}

fn token(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// Whether a declared range (lowercase, no parameters) admits a media type.
pub fn admits(range: &str, essence: &str) -> bool {
    if range == "*/*" || range == essence {
        return true;
    }
    match (range.strip_suffix("/*"), essence.split_once('/')) {
        (Some(ty), Some((t, _))) => ty == t,
        _ => false,
    }
}

/// Whether a media type is JSON: `application/json` or any `+json` structured syntax.
pub fn is_json(essence: &str) -> bool {
    essence == "application/json" || essence.ends_with("+json")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_case_and_parameters() {
        let m = parse("Application/JSON ; Charset=\"UTF-8\"").unwrap();
        assert_eq!(m, MediaType { essence: "application/json".into(), charset: Some("utf-8".into()) });
        assert_eq!(parse("text/plain").unwrap().charset, None);
        assert_eq!(parse("application/json;"), Some(MediaType { essence: "application/json".into(), charset: None }));
        for bad in ["json", "application/", "/json", "application/json; charset", "a b/c", ""] {
            assert_eq!(parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn ranges_admit() {
        assert!(admits("application/json", "application/json"));
        assert!(admits("application/*", "application/merge-patch+json"));
        assert!(admits("*/*", "text/plain"));
        assert!(!admits("application/json", "text/plain"));
        assert!(!admits("application/*", "text/plain"));
        assert!(is_json("application/json") && is_json("application/problem+json"));
        assert!(!is_json("application/jsonx") && !is_json("text/json5"));
    }
}
