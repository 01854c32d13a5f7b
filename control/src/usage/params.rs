//! The usage API's parameters as the CLI writes them and the server reads them: times
//! and percent-encoded query values.

use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, percent_decode_str, utf8_percent_encode};

/// `YYYY-MM-DDTHH:MM:SSZ`.
///
/// Total: a time past the end of year 9999 (which RFC 3339 cannot write) is written as
/// that end, `9999-12-31T23:59:59Z`; nothing the store holds is that late (the intake
/// refuses windows from the future).
pub fn rfc3339(t: u64) -> String {
    const LAST: u64 = 253_402_300_799; // 9999-12-31T23:59:59Z
    humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + std::time::Duration::from_secs(t.min(LAST))).to_string()
}

/// A time as the usage API takes it: Unix seconds, `YYYY-MM-DD` (UTC midnight) or RFC 3339
/// in UTC.
pub fn parse_time(s: &str) -> Option<u64> {
    if let Ok(n) = s.parse::<u64>() {
        return Some(n);
    }
    let s = if s.len() == 10 { format!("{s}T00:00:00Z") } else { s.to_owned() };
    let t = humantime::parse_rfc3339_weak(&s).ok()?;
    t.duration_since(std::time::UNIX_EPOCH).ok().map(|d| d.as_secs())
}

/// What a query value keeps as it is: letters, digits and `-._~:`; the rest is escaped.
const QUERY_VALUE: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~').remove(b':');

/// Percent-encodes a query parameter's value.
pub fn query_escape(v: &str) -> String {
    utf8_percent_encode(v, QUERY_VALUE).to_string()
}

/// Decodes a percent-encoded query parameter's value (`+` is a space); `None` for a `%`
/// not followed by two hex digits (`percent-encoding` would keep it as it is) or for a
/// value that is not UTF-8.
pub fn query_unescape(v: &str) -> Option<String> {
    percent_unescape(&v.replace('+', " "))
}

/// Decodes percent-encoded text strictly: `None` for a `%` not followed by two hex digits
/// (`percent-encoding` would keep it as it is) or for text that is not UTF-8.
pub fn percent_unescape(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let malformed = b
        .iter()
        .enumerate()
        .any(|(i, &c)| c == b'%' && !b.get(i + 1..i + 3).is_some_and(|h| h.iter().all(u8::is_ascii_hexdigit)));
    if malformed {
        return None;
    }
    percent_decode_str(s).decode_utf8().ok().map(std::borrow::Cow::into_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    // 2026-12-01T00:00:00Z.
    const DEC: u64 = 1_796_083_200;

    #[test]
    fn times_parse_as_the_api_takes_them() {
        assert_eq!(parse_time("1796083200"), Some(DEC));
        assert_eq!(parse_time("2026-12-01"), Some(DEC));
        assert_eq!(parse_time("2026-12-01T00:01:00Z"), Some(DEC + 60));
        assert_eq!(parse_time("yesterday"), None);
        assert_eq!(rfc3339(DEC), "2026-12-01T00:00:00Z");
        assert_eq!(
            query_unescape(&query_escape("2026-12-01T00:00:00+01:00 a")).as_deref(),
            Some("2026-12-01T00:00:00+01:00 a")
        );
        assert_eq!(query_unescape("%zz"), None);
    }
}
