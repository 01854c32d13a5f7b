//! Request validation and body decoding for routes that opt in: the validators a node
//! builds once per snapshot from a route's [`Validation`] (compiled by `posternctl` from
//! the team's OpenAPI operation), run per request on the request head and on the body
//! read whole.
//!
//! Schemas are JSON Schema 2020-12, checked by the `jsonschema` crate (no remote
//! resolution: its network and file features are off, and every `$ref` the compiler
//! leaves is local to its document). Patterns use the linear-time `regex` engine, since
//! the patterns come from 300 teams and run on every request.
//!
//! `posternctl` builds the same validators to check a snapshot before it is published,
//! so a schema that cannot compile is a compile error, never a node's surprise.

pub mod decode;
pub mod json;
pub mod media;
pub mod params;

use std::fmt::Write as _;

use http::{HeaderMap, HeaderName};
use postern_model::validate::{JsonLimits, MAX_FIELD_ERRORS, ParamIn, ParamShape, Validation};
use serde_json::Value;

pub use decode::{Coding, DecodeError, UnknownCoding};
pub use json::JsonError;

/// The longest message one field error carries.
const MAX_MESSAGE: usize = 200;

/// Bodies of at most this many JSON values have every error named; larger ones only
/// their first (the validator builds its whole list before the first comes out).
const MAX_VALUES_LISTED: usize = 2048;

/// One thing wrong with a request, as the caller sees it in the problem's `errors`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// Where: `body`, `path`, `query` or `header`.
    pub location: &'static str,
    /// An RFC 6901 pointer into the body, or `/<name>` for a parameter.
    pub pointer: String,
    /// What is wrong (without echoing the value).
    pub message: String,
}

/// Why a request was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// Fields that break the operation's schemas (400 `validation_failed`).
    #[error("the request does not match the API's schema ({} problems)", .0.len())]
    Invalid(Vec<FieldError>),
    /// The body is not acceptable JSON (400 `invalid_json`).
    #[error("the request body is not acceptable JSON: {0}")]
    Json(#[from] JsonError),
    /// A media type the operation does not declare (415).
    #[error("this operation does not take {0}")]
    MediaType(String),
}

/// Why a validator cannot be built from a route's [`Validation`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what}: {pointer}: {message}")]
pub struct BuildError {
    /// Which schema: `request body application/json`, `query parameter limit`.
    pub what: String,
    /// Where in that schema; a `$defs` entry is named by its pointer in the spec
    /// (`#/components/schemas/Order/properties/sku/pattern`).
    pub pointer: String,
    /// The validator's complaint.
    pub message: String,
}

struct Param {
    name: String,
    header: Option<HeaderName>,
    location: ParamIn,
    required: bool,
    shape: ParamShape,
    /// The path segment it is, on path parameters.
    segment: usize,
    schema: jsonschema::Validator,
}

struct Media {
    range: String,
    json: bool,
    schema: Option<jsonschema::Validator>,
}

/// A route's validator, built once per snapshot.
pub struct Validator {
    params: Vec<Param>,
    has_query: bool,
    body: Option<(bool, Vec<Media>)>,
    limits: JsonLimits,
}

impl std::fmt::Debug for Validator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Validator").field("params", &self.params.len()).field("body", &self.body.is_some()).finish()
    }
}

/// The media type a request's body was admitted under.
#[derive(Debug, Clone, Copy)]
pub struct Admitted {
    media: Option<usize>,
}

fn compile(schema: &Value, what: impl Fn() -> String) -> Result<jsonschema::Validator, BuildError> {
    let mut o = jsonschema::options()
        .with_draft(jsonschema::Draft::Draft202012)
        .with_pattern_options(jsonschema::PatternOptions::regex())
        .should_validate_formats(true);
    for (name, check) in FORMATS {
        o = o.with_format(*name, *check);
    }
    o.build(schema).map_err(|e| BuildError {
        what: what(),
        pointer: spec_pointer(e.instance_path().as_str()),
        message: truncate(e.masked().to_string()),
    })
}

/// A pointer into a compiled schema, named by its place in the spec where it is in one of
/// the compiler's `$defs` (keyed by their pointer in the spec).
fn spec_pointer(p: &str) -> String {
    let Some(rest) = p.strip_prefix("/$defs/") else {
        return p.to_owned();
    };
    let (key, tail) = rest.split_once('/').map_or((rest, ""), |(k, t)| (k, t));
    let key = key.replace("~1", "/").replace("~0", "~");
    if tail.is_empty() { format!("#{key}") } else { format!("#{key}/{tail}") }
}

type FormatCheck = fn(&str) -> bool;

/// OpenAPI's own formats on strings (`int32` and the like on numbers are bounds the
/// compiler writes as `minimum`/`maximum`).
const FORMATS: &[(&str, FormatCheck)] = &[("byte", is_base64), ("binary", |_| true), ("password", |_| true)];

fn is_base64(s: &str) -> bool {
    let b = s.as_bytes();
    if !b.len().is_multiple_of(4) {
        return false;
    }
    let pad = b.iter().rev().take_while(|&&c| c == b'=').count();
    pad <= 2 && b[..b.len() - pad].iter().all(|c| c.is_ascii_alphanumeric() || *c == b'+' || *c == b'/')
}

fn truncate(mut s: String) -> String {
    if s.len() > MAX_MESSAGE {
        let mut end = MAX_MESSAGE;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push('…');
    }
    s
}

impl Validator {
    /// Builds a route's validator; `route_path` is its match pattern, whose `{name}`
    /// segments the path parameters are.
    pub fn build(v: &Validation, route_path: &str) -> Result<Validator, BuildError> {
        let segments: Vec<&str> = route_path.split('/').collect();
        let mut params = Vec::with_capacity(v.parameters.len());
        for p in &v.parameters {
            let what = || format!("{} parameter {}", p.location.as_str(), p.name);
            let segment = match p.location {
                ParamIn::Path => {
                    let want = format!("{{{}}}", p.name);
                    segments.iter().position(|s| *s == want).ok_or_else(|| BuildError {
                        what: what(),
                        pointer: String::new(),
                        message: format!("the route's path {route_path} has no segment {want}"),
                    })?
                }
                _ => 0,
            };
            let header = match p.location {
                ParamIn::Header => Some(HeaderName::from_bytes(p.name.as_bytes()).map_err(|_| BuildError {
                    what: what(),
                    pointer: String::new(),
                    message: "not a header name".into(),
                })?),
                _ => None,
            };
            params.push(Param {
                name: p.name.clone(),
                header,
                location: p.location,
                required: p.required,
                shape: p.shape,
                segment,
                schema: compile(&p.schema, what)?,
            });
        }
        let body = match &v.body {
            None => None,
            Some(b) => {
                let mut media = Vec::with_capacity(b.media.len());
                for m in &b.media {
                    let json = media::is_json(&m.range) || m.range.ends_with("/*");
                    let schema = match &m.schema {
                        Some(s) if json => Some(compile(s, || format!("request body {}", m.range))?),
                        _ => None,
                    };
                    media.push(Media { range: m.range.clone(), json, schema });
                }
                Some((b.required, media))
            }
        };
        let has_query = params.iter().any(|p| p.location == ParamIn::Query);
        Ok(Validator { params, has_query, body, limits: v.json })
    }

    /// Whether the operation declares a request body (the route then reads it whole).
    pub fn has_body(&self) -> bool {
        self.body.is_some()
    }

    /// Checks the path, query and header parameters.
    pub fn check_head(&self, path: &str, query: Option<&str>, headers: &HeaderMap) -> Result<(), Refusal> {
        if self.params.is_empty() {
            return Ok(());
        }
        let mut errors = Vec::new();
        let pairs: Vec<(std::borrow::Cow<'_, str>, std::borrow::Cow<'_, str>)> = match query {
            Some(q) if self.has_query => form_urlencoded::parse(q.as_bytes()).collect(),
            _ => Vec::new(),
        };
        for p in &self.params {
            let value = match p.location {
                ParamIn::Path => path
                    .split('/')
                    .nth(p.segment)
                    .map(|s| percent_encoding::percent_decode_str(s).decode_utf8_lossy())
                    .map(|s| params::simple(&s, p.shape)),
                ParamIn::Query => {
                    let values: Vec<&str> =
                        pairs.iter().filter(|(k, _)| *k == p.name).map(|(_, v)| v.as_ref()).collect();
                    // Backends disagree on which of two values wins: a scalar is given once.
                    if values.len() > 1 && matches!(p.shape, ParamShape::Scalar { .. }) {
                        let msg = format!("the query parameter {} is given {} times", p.name, values.len());
                        push(&mut errors, "query", format!("/{}", p.name), msg);
                        continue;
                    }
                    (!values.is_empty()).then(|| params::form(&values, p.shape))
                }
                ParamIn::Header => {
                    let name = p.header.as_ref();
                    let raw: Vec<&http::HeaderValue> =
                        name.map(|n| headers.get_all(n).iter().collect()).unwrap_or_default();
                    let values: Vec<&str> = raw.iter().filter_map(|v| v.to_str().ok()).collect();
                    if values.len() != raw.len() {
                        let msg = format!("the header {} is not visible ASCII", p.name);
                        push(&mut errors, "header", format!("/{}", p.name), msg);
                        continue;
                    }
                    (!values.is_empty()).then(|| params::simple(&values.join(","), p.shape))
                }
            };
            match value {
                None if p.required => push(
                    &mut errors,
                    p.location.as_str(),
                    format!("/{}", p.name),
                    format!("the {} parameter {} is required", p.location.as_str(), p.name),
                ),
                None => {}
                Some(v) => {
                    for e in p.schema.iter_errors(&v) {
                        let mut pointer = format!("/{}", p.name);
                        pointer.push_str(e.instance_path().as_str());
                        push(&mut errors, p.location.as_str(), pointer, e.masked().to_string());
                    }
                }
            }
        }
        if errors.is_empty() { Ok(()) } else { Err(Refusal::Invalid(errors)) }
    }

    /// Admits a request's `Content-Type` (and whether it has a body) before the body is
    /// read: a media type the operation does not declare, a JSON one in a charset other
    /// than UTF-8, or a body on an operation that takes none, is refused.
    pub fn admit(&self, content_type: Option<&str>, has_body: bool) -> Result<Admitted, Refusal> {
        let Some((_, media)) = &self.body else {
            return if has_body {
                Err(Refusal::Invalid(vec![FieldError {
                    location: "body",
                    pointer: String::new(),
                    message: "this operation takes no request body".into(),
                }]))
            } else {
                Ok(Admitted { media: None })
            };
        };
        let Some(ct) = content_type else {
            return if has_body {
                Err(Refusal::MediaType("a body without a Content-Type".into()))
            } else {
                Ok(Admitted { media: None })
            };
        };
        let shown = || truncate(ct.to_owned());
        let parsed = media::parse(ct).ok_or_else(|| Refusal::MediaType(shown()))?;
        let i = media
            .iter()
            .position(|m| media::admits(&m.range, &parsed.essence))
            .ok_or_else(|| Refusal::MediaType(shown()))?;
        let json = media::is_json(&parsed.essence);
        if json && parsed.charset.as_deref().is_some_and(|c| c != "utf-8") {
            return Err(Refusal::MediaType(shown()));
        }
        // A wildcard range validates only what is JSON.
        Ok(Admitted { media: (media[i].json && json).then_some(i) })
    }

    /// Checks a body read whole (decoded), admitted by [`Validator::admit`].
    pub fn check_body(&self, admitted: Admitted, body: &[u8]) -> Result<(), Refusal> {
        let Some((required, media)) = &self.body else {
            return Ok(());
        };
        if body.is_empty() {
            return if *required {
                Err(Refusal::Invalid(vec![FieldError {
                    location: "body",
                    pointer: String::new(),
                    message: "a request body is required".into(),
                }]))
            } else {
                Ok(())
            };
        }
        let Some(m) = admitted.media.and_then(|i| media.get(i)) else {
            return Ok(());
        };
        let (value, values) = json::parse_counted(body, &self.limits)?;
        let Some(schema) = &m.schema else {
            return Ok(());
        };
        if schema.is_valid(&value) {
            return Ok(());
        }
        // The validator lists every error before handing out the first, so a large
        // invalid body (many items each missing a field) could cost as many errors as it
        // has values: past `MAX_VALUES_LISTED` only the first problem is named.
        let mut errors = Vec::new();
        let found: Vec<jsonschema::ValidationError<'_>> = if values <= MAX_VALUES_LISTED {
            schema.iter_errors(&value).collect()
        } else {
            schema.validate(&value).err().into_iter().collect()
        };
        for e in found {
            let at = e.instance_path().as_str();
            match e.kind() {
                // Name the missing or unexpected field itself.
                jsonschema::error::ValidationErrorKind::Required { property } => {
                    let name = property.as_str().unwrap_or_default();
                    push(&mut errors, "body", child(at, name), format!("{name:?} is required"));
                }
                jsonschema::error::ValidationErrorKind::AdditionalProperties { unexpected }
                | jsonschema::error::ValidationErrorKind::UnevaluatedProperties { unexpected } => {
                    for name in unexpected {
                        push(&mut errors, "body", child(at, name), "is not a field of this object".into());
                    }
                }
                _ => push(&mut errors, "body", at.to_owned(), e.masked().to_string()),
            }
            if errors.len() >= MAX_FIELD_ERRORS {
                break;
            }
        }
        Err(Refusal::Invalid(errors))
    }
}

fn child(at: &str, name: &str) -> String {
    let mut p = String::with_capacity(at.len() + name.len() + 1);
    p.push_str(at);
    p.push('/');
    for c in name.chars() {
        match c {
            '~' => p.push_str("~0"),
            '/' => p.push_str("~1"),
            c => {
                let _ = p.write_char(c);
            }
        }
    }
    p
}

fn push(errors: &mut Vec<FieldError>, location: &'static str, pointer: String, message: String) {
    if errors.len() < MAX_FIELD_ERRORS {
        errors.push(FieldError { location, pointer: truncate(pointer), message: truncate(message) });
    }
}

#[cfg(test)]
mod tests;
