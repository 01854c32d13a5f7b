//! `google.api.http` path templates (google/api/http.proto):
//!
//! ```text
//! Template = "/" Segments [ Verb ] ;
//! Segments = Segment { "/" Segment } ;
//! Segment  = "*" | "**" | LITERAL | Variable ;
//! Variable = "{" FieldPath [ "=" Segments ] "}" ;
//! FieldPath = IDENT { "." IDENT } ;
//! Verb     = ":" LITERAL ;
//! ```
//!
//! A variable without `=` is `{x=*}`; `**` matches the rest of the path and may only be
//! the last segment.

/// One segment of a template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    /// Matches itself.
    Literal(String),
    /// Matches one segment.
    Star,
    /// Matches the rest of the path (zero or more segments).
    DoubleStar,
}

/// A variable: a field path bound to a run of segments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Variable {
    /// `order.id` as `["order", "id"]`.
    pub field: Vec<String>,
    /// The first segment it covers.
    pub start: usize,
    /// One past its last segment (`usize::MAX` when it ends in `**`).
    pub end: usize,
}

/// A parsed template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    /// Its segments.
    pub segments: Vec<Segment>,
    /// Its variables, in order.
    pub variables: Vec<Variable>,
    /// The custom verb (`cancel` in `/v1/{name=operations/**}:cancel`).
    pub verb: Option<String>,
}

fn literal(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"-._~%!$&'()+,;=@".contains(&b))
}

fn ident(s: &str) -> bool {
    let mut b = s.bytes();
    b.next().is_some_and(|c| c.is_ascii_alphabetic() || c == b'_') && b.all(|c| c.is_ascii_alphanumeric() || c == b'_')
}

/// What is wrong with a path template.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    /// It does not start with `/`.
    #[error("a template starts with /")]
    NoSlash,
    /// The verb is not a literal.
    #[error("bad verb {0:?}")]
    Verb(String),
    /// A `{` without its `}`.
    #[error("a variable is not closed")]
    Unclosed,
    /// A variable's field path is not a dotted list of identifiers.
    #[error("bad field path {0:?}")]
    FieldPath(String),
    /// It ends with `/`.
    #[error("a template does not end with /")]
    TrailingSlash,
    /// Text after a variable that is not `/`.
    #[error("unexpected {0:?}")]
    Unexpected(String),
    /// It has no segment.
    #[error("a template has at least one segment")]
    Empty,
    /// `**` before the last segment.
    #[error("** may only be the last segment")]
    DoubleStar,
    /// A segment that is neither a literal nor a wildcard.
    #[error("bad segment {0:?}")]
    Segment(String),
}

/// Compares with the message, as tests and callers read it.
impl PartialEq<&str> for TemplateError {
    fn eq(&self, other: &&str) -> bool {
        let message = self.to_string();
        message == *other
    }
}

impl Template {
    /// Parses a template, or says what is wrong with it.
    pub fn parse(t: &str) -> Result<Template, TemplateError> {
        let rest = t.strip_prefix('/').ok_or(TemplateError::NoSlash)?;
        // The verb follows the last ':' outside braces.
        let mut depth = 0;
        let mut verb_at = None;
        for (i, c) in rest.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                ':' if depth == 0 => verb_at = Some(i),
                _ => {}
            }
        }
        let (path, verb) = match verb_at {
            Some(i) => {
                let v = &rest[i + 1..];
                if !literal(v) {
                    return Err(TemplateError::Verb(v.to_owned()));
                }
                (&rest[..i], Some(v.to_owned()))
            }
            None => (rest, None),
        };
        let mut segments = Vec::new();
        let mut variables = Vec::new();
        let mut chars = path;
        while !chars.is_empty() {
            if let Some(inner) = chars.strip_prefix('{') {
                let close = inner.find('}').ok_or(TemplateError::Unclosed)?;
                let body = &inner[..close];
                let (field, sub) = body.split_once('=').unwrap_or((body, "*"));
                let field: Vec<String> = field.split('.').map(str::to_owned).collect();
                if !field.iter().all(|f| ident(f)) {
                    return Err(TemplateError::FieldPath(body.to_owned()));
                }
                let start = segments.len();
                for s in sub.split('/') {
                    segments.push(Self::segment(s, true)?);
                }
                let end = if segments.last() == Some(&Segment::DoubleStar) { usize::MAX } else { segments.len() };
                variables.push(Variable { field, start, end });
                chars = &inner[close + 1..];
            } else {
                let end = chars.find('/').unwrap_or(chars.len());
                segments.push(Self::segment(&chars[..end], false)?);
                chars = &chars[end..];
            }
            match chars.strip_prefix('/') {
                Some(r) if !r.is_empty() => chars = r,
                Some(_) => return Err(TemplateError::TrailingSlash),
                None if chars.is_empty() => {}
                None => return Err(TemplateError::Unexpected(chars.to_owned())),
            }
        }
        if segments.is_empty() {
            return Err(TemplateError::Empty);
        }
        if segments.iter().rev().skip(1).any(|s| *s == Segment::DoubleStar) {
            return Err(TemplateError::DoubleStar);
        }
        Ok(Template { segments, variables, verb })
    }

    fn segment(s: &str, in_variable: bool) -> Result<Segment, TemplateError> {
        match s {
            "*" => Ok(Segment::Star),
            "**" => Ok(Segment::DoubleStar),
            s if s.contains(['{', '}']) && !in_variable => Err(TemplateError::Segment(s.to_owned())),
            s if literal(s) => Ok(Segment::Literal(s.to_owned())),
            s => Err(TemplateError::Segment(s.to_owned())),
        }
    }

    /// Matches a request path (already canonical): the text of each variable,
    /// percent-decoded (a multi-segment variable keeps its `/`s).
    pub fn matches(&self, path: &str) -> Option<Vec<String>> {
        let rest = path.strip_prefix('/')?;
        let rest = match &self.verb {
            Some(v) => rest.strip_suffix(v.as_str())?.strip_suffix(':')?,
            None => rest,
        };
        let parts: Vec<&str> = if rest.is_empty() { Vec::new() } else { rest.split('/').collect() };
        let double = self.segments.last() == Some(&Segment::DoubleStar);
        let fixed = self.segments.len() - usize::from(double);
        if parts.len() < fixed || (!double && parts.len() != fixed) {
            return None;
        }
        for (seg, part) in self.segments.iter().zip(&parts) {
            match seg {
                Segment::Literal(l) if l != part => return None,
                Segment::Star if part.is_empty() => return None,
                _ => {}
            }
        }
        let decode = |p: &str| percent_encoding::percent_decode_str(p).decode_utf8().ok().map(|s| s.into_owned());
        self.variables
            .iter()
            .map(|v| {
                let end = v.end.min(parts.len());
                let pieces: Option<Vec<String>> = parts[v.start.min(end)..end].iter().map(|p| decode(p)).collect();
                pieces.map(|p| p.join("/"))
            })
            .collect()
    }

    /// The template's shape with variables' names erased: two bindings of one method
    /// with the same shape collide.
    pub fn shape(&self) -> String {
        let mut s = String::new();
        for seg in &self.segments {
            s.push('/');
            match seg {
                Segment::Literal(l) => s.push_str(l),
                Segment::Star => s.push('*'),
                Segment::DoubleStar => s.push_str("**"),
            }
        }
        if let Some(v) = &self.verb {
            s.push(':');
            s.push_str(v);
        }
        s
    }

    /// The literal prefix every path it matches starts with (`/v1/orders/`).
    pub fn literal_prefix(&self) -> String {
        let mut s = String::new();
        for seg in &self.segments {
            match seg {
                Segment::Literal(l) => {
                    s.push('/');
                    s.push_str(l);
                }
                _ => {
                    s.push('/');
                    return s;
                }
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(t: &str, path: &str) -> Option<Vec<String>> {
        Template::parse(t).unwrap().matches(path)
    }

    #[test]
    fn the_documentation_examples_parse_and_match() {
        // google/api/http.proto: `get: "/v1/{name=messages/*}"`.
        assert_eq!(vars("/v1/{name=messages/*}", "/v1/messages/123456"), Some(vec!["messages/123456".into()]));
        assert_eq!(vars("/v1/messages/{message_id}", "/v1/messages/123456"), Some(vec!["123456".into()]));
        assert_eq!(
            vars("/v1/users/{user_id}/messages/{message_id}", "/v1/users/me/messages/123456"),
            Some(vec!["me".into(), "123456".into()])
        );
        assert_eq!(
            vars("/v1/{name=operations/**}:cancel", "/v1/operations/a/b/c:cancel"),
            Some(vec!["operations/a/b/c".into()])
        );
        assert_eq!(vars("/v1/{name=operations/**}:cancel", "/v1/operations/a:run"), None);
        assert_eq!(vars("/v1/messages/{message_id}", "/v1/messages"), None);
        assert_eq!(vars("/v1/messages/{message_id}", "/v1/messages/1/2"), None);
        assert_eq!(vars("/v1/**", "/v1"), Some(vec![]));
        assert_eq!(vars("/v1/{id}", "/v1/a%20b"), Some(vec!["a b".into()]));
        let t = Template::parse("/v1/{order.id}").unwrap();
        assert_eq!(t.variables[0].field, ["order", "id"]);
        assert_eq!(t.shape(), "/v1/*");
        assert_eq!(t.literal_prefix(), "/v1/");
    }

    #[test]
    fn bad_templates_are_named() {
        for (t, e) in [
            ("v1/x", "a template starts with /"),
            ("/v1/{id", "a variable is not closed"),
            ("/v1/**/x", "** may only be the last segment"),
            ("/v1/{1d}", "bad field path \"1d\""),
            ("/v1/", "a template does not end with /"),
            ("/v1/a b", "bad segment \"a b\""),
        ] {
            assert_eq!(Template::parse(t).unwrap_err(), e, "{t}");
        }
    }
}
