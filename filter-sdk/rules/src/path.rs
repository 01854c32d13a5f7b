//! The one canonical form of a request path, decided before routing: the router matches
//! it, filters see it, and the backend receives exactly it.
//!
//! [`canonical`] normalises as RFC 3986 §6.2.2 says — percent-encoded unreserved
//! characters are decoded (so `%74` is `t` and `%2e` is `.`), every other escape is
//! uppercased, bytes a path may not carry literally are encoded — and removes dot
//! segments (§5.2.4) after decoding, so no encoding of `.` or `..` survives. What is
//! ambiguous between backends (an encoded `/`, a `\`, `;` parameters, empty segments) is
//! the platform's choice in [`PathPolicy`]; by default each is refused.
//!
//! The output is idempotent (`canonical(canonical(p)) == canonical(p)`) and never holds a
//! dot segment. A path already in canonical form is returned borrowed, after one scan.

use alloc::borrow::Cow;
use alloc::string::String;
use alloc::vec::Vec;

/// What the platform does with the parts of a path that backends read differently
/// (`platform/gateway.yaml`, `paths:`). Every default refuses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(deny_unknown_fields, rename_all = "camelCase"))]
pub struct PathPolicy {
    /// `%2F` inside a segment.
    #[cfg_attr(feature = "serde", serde(default))]
    pub encoded_slash: EncodedSlash,
    /// `\` and `%5C`.
    #[cfg_attr(feature = "serde", serde(default))]
    pub backslash: Backslash,
    /// `;` (path parameters, as in `/a;jsessionid=1/b`).
    #[cfg_attr(feature = "serde", serde(default))]
    pub semicolon: Semicolon,
    /// Empty segments (`//`) before the last segment.
    #[cfg_attr(feature = "serde", serde(default))]
    pub empty_segments: EmptySegments,
}

/// What to do with `%2F`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
pub enum EncodedSlash {
    /// 400: a backend that decodes it would see another path.
    #[default]
    Reject,
    /// Keep it encoded (uppercase) inside its segment, for backends that never decode it.
    Keep,
}

/// What to do with `\` and `%5C`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
pub enum Backslash {
    /// 400.
    #[default]
    Reject,
    /// Read it as `/`, as Windows servers and some frameworks do.
    Slash,
}

/// What to do with `;`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
pub enum Semicolon {
    /// 400.
    #[default]
    Reject,
    /// Cut each segment at its `;`, as Java servlet containers do (so `..;x` is `..`).
    Strip,
    /// Keep it as an ordinary character, for backends that never treat it specially.
    Keep,
}

/// What to do with an empty segment that is not the last (`/a//b`, `//a`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
pub enum EmptySegments {
    /// 400.
    #[default]
    Reject,
    /// Drop it (`/a//b` is `/a/b`).
    Merge,
}

/// Why a path has no canonical form under the policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathError {
    /// Not an absolute path (`*`, an empty path, a relative one).
    NotAbsolute,
    /// A `%` not followed by two hex digits.
    BadEscape,
    /// A NUL, plain or encoded (`%00`).
    Nul,
    /// `%2F`, refused by the policy.
    EncodedSlash,
    /// `\` or `%5C`, refused by the policy.
    Backslash,
    /// `;`, refused by the policy.
    Semicolon,
    /// An empty segment, refused by the policy.
    EmptySegment,
}

impl PathError {
    /// A stable label for metrics and the problem's detail.
    pub fn as_str(self) -> &'static str {
        match self {
            PathError::NotAbsolute => "the path must start with '/'",
            PathError::BadEscape => "the path has a '%' that is not followed by two hex digits",
            PathError::Nul => "the path has a NUL (%00)",
            PathError::EncodedSlash => "the path has an encoded '/' (%2F)",
            PathError::Backslash => "the path has a backslash",
            PathError::Semicolon => "the path has a ';'",
            PathError::EmptySegment => "the path has an empty segment ('//')",
        }
    }
}

impl core::fmt::Display for PathError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl core::error::Error for PathError {}

/// RFC 3986 unreserved: ALPHA / DIGIT / `-` / `.` / `_` / `~`.
fn unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

/// A byte a segment may carry literally in canonical form (pchar without `%`): unreserved,
/// sub-delims, `:` and `@`. `;` is decided by the policy.
fn literal(b: u8) -> bool {
    unreserved(b) || matches!(b, b'!' | b'$' | b'&' | b'\'' | b'(' | b')' | b'*' | b'+' | b',' | b'=' | b':' | b'@')
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// Whether `path` is already canonical under `policy`, in one scan: only literal bytes,
/// `;` where kept, uppercase escapes of reserved bytes, no empty or dot segment but a
/// trailing slash.
fn is_canonical(path: &[u8], policy: &PathPolicy) -> bool {
    if path.first() != Some(&b'/') {
        return false;
    }
    let mut seg_start = 1;
    let mut i = 1;
    while i <= path.len() {
        let b = path.get(i).copied();
        match b {
            None | Some(b'/') => {
                let seg = &path[seg_start..i];
                let last = b.is_none();
                if (seg.is_empty() && !last) || seg == b"." || seg == b".." {
                    return false;
                }
                seg_start = i + 1;
            }
            Some(b'%') => {
                let (Some(&h), Some(&l)) = (path.get(i + 1), path.get(i + 2)) else { return false };
                let (Some(hv), Some(lv)) = (hex(h), hex(l)) else { return false };
                let v = hv << 4 | lv;
                if h.is_ascii_lowercase() || l.is_ascii_lowercase() || unreserved(v) || v == 0 || v == b'\\' {
                    return false;
                }
                if v == b'/' && policy.encoded_slash == EncodedSlash::Reject {
                    return false;
                }
                i += 2;
            }
            Some(b';') if policy.semicolon == Semicolon::Keep => {}
            Some(b) if literal(b) => {}
            Some(_) => return false,
        }
        i += 1;
    }
    true
}

/// The canonical form of `path` (the path of a request target, without its query) under
/// `policy`, or why it has none.
pub fn canonical<'a>(path: &'a str, policy: &PathPolicy) -> Result<Cow<'a, str>, PathError> {
    let bytes = path.as_bytes();
    if is_canonical(bytes, policy) {
        return Ok(Cow::Borrowed(path));
    }
    if bytes.first() != Some(&b'/') && !(bytes.first() == Some(&b'\\') && policy.backslash == Backslash::Slash) {
        return Err(PathError::NotAbsolute);
    }
    // Segments of the output, as byte ranges of `out`; a trailing slash is remembered.
    let mut out: Vec<u8> = Vec::with_capacity(bytes.len() + 8);
    let mut segs: Vec<(usize, usize)> = Vec::new();
    let mut seg = Vec::with_capacity(32);
    let mut trailing;
    let mut i = 1;
    loop {
        // One raw segment, decoded into `seg`, up to a separator or the end.
        seg.clear();
        let mut cut = false; // past a stripped ';'
        let end = loop {
            let Some(&b) = bytes.get(i) else { break true };
            i += 1;
            let c = match b {
                b'/' => break false,
                b'\\' => match policy.backslash {
                    Backslash::Reject => return Err(PathError::Backslash),
                    Backslash::Slash => break false,
                },
                b'%' => {
                    let (Some(h), Some(l)) =
                        (bytes.get(i).copied().and_then(hex), bytes.get(i + 1).copied().and_then(hex))
                    else {
                        return Err(PathError::BadEscape);
                    };
                    i += 2;
                    let v = h << 4 | l;
                    match v {
                        0 => return Err(PathError::Nul),
                        b'/' if policy.encoded_slash == EncodedSlash::Reject => return Err(PathError::EncodedSlash),
                        b'\\' => match policy.backslash {
                            Backslash::Reject => return Err(PathError::Backslash),
                            Backslash::Slash => break false,
                        },
                        _ => {}
                    }
                    if unreserved(v) {
                        Some(v)
                    } else {
                        if !cut {
                            push_escape(&mut seg, v);
                        }
                        None
                    }
                }
                b';' => match policy.semicolon {
                    Semicolon::Reject => return Err(PathError::Semicolon),
                    Semicolon::Strip => {
                        cut = true;
                        None
                    }
                    Semicolon::Keep => Some(b';'),
                },
                0 => return Err(PathError::Nul),
                b => Some(b),
            };
            if let Some(c) = c
                && !cut
            {
                if literal(c) || c == b';' {
                    seg.push(c);
                } else {
                    push_escape(&mut seg, c);
                }
            }
        };
        match seg.as_slice() {
            b"." => trailing = true,
            b".." => {
                if let Some((start, _)) = segs.pop() {
                    out.truncate(start);
                }
                trailing = true;
            }
            b"" if end => trailing = true,
            b"" => match policy.empty_segments {
                EmptySegments::Reject => return Err(PathError::EmptySegment),
                EmptySegments::Merge => trailing = true,
            },
            s => {
                let start = out.len();
                out.push(b'/');
                out.extend_from_slice(s);
                segs.push((start, out.len()));
                trailing = false;
            }
        }
        if end {
            break;
        }
    }
    if out.is_empty() || trailing {
        out.push(b'/');
    }
    // Every byte pushed is ASCII (literal bytes and escapes).
    String::from_utf8(out).map(Cow::Owned).map_err(|_| PathError::BadEscape)
}

fn push_escape(out: &mut Vec<u8>, v: u8) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    out.extend_from_slice(&[b'%', HEX[usize::from(v >> 4)], HEX[usize::from(v & 0xf)]]);
}

/// Whether `path` is canonical under `policy`: what a static rewrite, a route's match and
/// a filter's path edit must be.
pub fn check_canonical(path: &str, policy: &PathPolicy) -> Result<(), NotCanonical> {
    match canonical(path, policy) {
        Ok(Cow::Borrowed(_)) => Ok(()),
        Ok(Cow::Owned(canonical)) => Err(NotCanonical::Differs { path: path.into(), canonical }),
        Err(error) => Err(NotCanonical::Invalid { path: path.into(), error }),
    }
}

/// Why a path is not canonical.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotCanonical {
    /// Its canonical form is another.
    Differs {
        /// The path.
        path: String,
        /// Its canonical form.
        canonical: String,
    },
    /// It has no canonical form under the policy.
    Invalid {
        /// The path.
        path: String,
        /// Why.
        error: PathError,
    },
}

impl core::fmt::Display for NotCanonical {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            NotCanonical::Differs { path, canonical } => {
                write!(f, "{path:?} is not a canonical path (its canonical form is {canonical:?})")
            }
            NotCanonical::Invalid { path, error } => write!(f, "{path:?}: {error}"),
        }
    }
}

impl core::error::Error for NotCanonical {}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn c(p: &str) -> Result<String, PathError> {
        canonical(p, &PathPolicy::default()).map(Cow::into_owned)
    }

    fn with(p: &str, policy: PathPolicy) -> Result<String, PathError> {
        canonical(p, &policy).map(Cow::into_owned)
    }

    #[test]
    fn canonical_paths_are_borrowed() {
        for p in ["/", "/a/b", "/a/b/", "/v1/orders/7", "/a:b@c!$&'()*+,=", "/%20x", "/%3B", "/a/.well-known", "/..."] {
            assert!(matches!(canonical(p, &PathPolicy::default()), Ok(Cow::Borrowed(_))), "{p}");
        }
    }

    #[test]
    fn unreserved_escapes_are_decoded_and_others_uppercased() {
        assert_eq!(c("/%74est").unwrap(), "/test");
        assert_eq!(c("/a%2Db%7e").unwrap(), "/a-b~");
        assert_eq!(c("/%3b%3f").unwrap(), "/%3B%3F");
        assert_eq!(c("/a b").unwrap(), "/a%20b");
        assert_eq!(c("/caf\u{e9}").unwrap(), "/caf%C3%A9");
        assert_eq!(c("/%252e").unwrap(), "/%252e");
        assert_eq!(c("/a\u{7f}\n").unwrap(), "/a%7F%0A");
        assert_eq!(c("/a\0"), Err(PathError::Nul));
    }

    #[test]
    fn dot_segments_go_in_every_encoding() {
        assert_eq!(c("/a/../b").unwrap(), "/b");
        assert_eq!(c("/a/./b").unwrap(), "/a/b");
        assert_eq!(c("/a/%2e%2E/b").unwrap(), "/b");
        assert_eq!(c("/a/.%2e").unwrap(), "/");
        assert_eq!(c("/a/b/.").unwrap(), "/a/b/");
        assert_eq!(c("/a/b/..").unwrap(), "/a/");
        assert_eq!(c("/..").unwrap(), "/");
        assert_eq!(c("/../../x").unwrap(), "/x");
        assert_eq!(c("/public/%2e%2e/admin").unwrap(), "/admin");
    }

    #[test]
    fn ambiguous_parts_are_refused_by_default() {
        assert_eq!(c("/a%2Fb"), Err(PathError::EncodedSlash));
        assert_eq!(c("/a%2fb"), Err(PathError::EncodedSlash));
        assert_eq!(c("/a\\b"), Err(PathError::Backslash));
        assert_eq!(c("/a%5cb"), Err(PathError::Backslash));
        assert_eq!(c("/a;x/b"), Err(PathError::Semicolon));
        assert_eq!(c("/public/..;/admin"), Err(PathError::Semicolon));
        assert_eq!(c("/a//b"), Err(PathError::EmptySegment));
        assert_eq!(c("//a"), Err(PathError::EmptySegment));
        assert_eq!(c("/a%zz"), Err(PathError::BadEscape));
        assert_eq!(c("/a%2"), Err(PathError::BadEscape));
        assert_eq!(c("/a%00"), Err(PathError::Nul));
        assert_eq!(c("*"), Err(PathError::NotAbsolute));
        assert_eq!(c(""), Err(PathError::NotAbsolute));
    }

    #[test]
    fn the_platform_may_normalise_instead() {
        let p = PathPolicy {
            encoded_slash: EncodedSlash::Keep,
            backslash: Backslash::Slash,
            semicolon: Semicolon::Strip,
            empty_segments: EmptySegments::Merge,
        };
        assert_eq!(with("/a%2fb", p).unwrap(), "/a%2Fb");
        assert_eq!(with("/a\\..\\b", p).unwrap(), "/b");
        assert_eq!(with("/a%5Cb", p).unwrap(), "/a/b");
        assert_eq!(with("/public/..;/admin", p).unwrap(), "/admin");
        assert_eq!(with("/a;jsessionid=1/b;v=2", p).unwrap(), "/a/b");
        assert_eq!(with("/a//b///", p).unwrap(), "/a/b/");
        assert_eq!(with("//", p).unwrap(), "/");
        let keep = PathPolicy { semicolon: Semicolon::Keep, ..PathPolicy::default() };
        assert_eq!(with("/a;x/b", keep).unwrap(), "/a;x/b");
        assert!(matches!(canonical("/a;x", &keep), Ok(Cow::Borrowed(_))));
    }

    #[test]
    fn check_canonical_names_the_canonical_form() {
        assert!(check_canonical("/a/b", &PathPolicy::default()).is_ok());
        let e = format!("{}", check_canonical("/a/%74", &PathPolicy::default()).unwrap_err());
        assert!(e.contains("\"/a/t\""), "{e}");
        assert!(check_canonical("/a//b", &PathPolicy::default()).is_err());
    }

    mod prop {
        use alloc::borrow::ToOwned;
        use alloc::string::String;

        use proptest::prelude::*;

        use super::super::*;

        fn policies() -> impl Strategy<Value = PathPolicy> {
            (0..2u8, 0..2u8, 0..3u8, 0..2u8).prop_map(|(s, b, c, e)| PathPolicy {
                encoded_slash: if s == 0 { EncodedSlash::Reject } else { EncodedSlash::Keep },
                backslash: if b == 0 { Backslash::Reject } else { Backslash::Slash },
                semicolon: [Semicolon::Reject, Semicolon::Strip, Semicolon::Keep][usize::from(c)],
                empty_segments: if e == 0 { EmptySegments::Reject } else { EmptySegments::Merge },
            })
        }

        /// Paths built from the pieces that matter: separators, dots in every encoding,
        /// escapes, `;`, backslashes, and arbitrary characters.
        fn paths() -> impl Strategy<Value = String> {
            let piece = prop_oneof![
                Just("/".to_owned()),
                Just(".".to_owned()),
                Just("..".to_owned()),
                Just("%2e".to_owned()),
                Just("%2E".to_owned()),
                Just("%2f".to_owned()),
                Just("%5c".to_owned()),
                Just("\\".to_owned()),
                Just(";".to_owned()),
                Just("%".to_owned()),
                Just("%00".to_owned()),
                "%[0-9a-fA-F]{2}",
                "[a-z0-9]{1,3}",
                any::<char>().prop_map(String::from),
            ];
            prop::collection::vec(piece, 0..16).prop_map(|v| format!("/{}", v.concat()))
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 4000, ..ProptestConfig::default() })]

            #[test]
            fn canonical_is_idempotent_and_has_no_dot_segment(p in paths(), policy in policies()) {
                if let Ok(once) = canonical(&p, &policy) {
                    let twice = canonical(&once, &policy);
                    prop_assert!(matches!(twice, Ok(Cow::Borrowed(_))), "{p:?} -> {once:?} -> {twice:?}");
                    prop_assert!(once.starts_with('/'));
                    for seg in once.split('/') {
                        prop_assert!(seg != "." && seg != "..", "{p:?} -> {once:?}");
                    }
                    prop_assert!(!once.contains("//"), "{p:?} -> {once:?}");
                }
            }

            #[test]
            fn canonical_never_panics(p in any::<String>(), policy in policies()) {
                let _ = canonical(&p, &policy);
            }
        }
    }
}
