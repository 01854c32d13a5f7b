//! A team's OpenAPI 3.0 or 3.1 document (`teams/<team>/openapi/*`) turned into one
//! route's [`Validation`]: an operation's parameters and request body, each schema made a
//! self-contained JSON Schema 2020-12 document. Every schema reachable through a local
//! `$ref` is gathered under `$defs` (keyed by its JSON pointer in the document) and each
//! `$ref` rewritten to it; OpenAPI 3.0's dialect (`nullable`, boolean
//! `exclusiveMaximum`, ignored `$ref` siblings) is rewritten. Nothing is fetched: a
//! `$ref` to another file or URL is refused.
//!
//! Every error names its place as an RFC 6901 JSON pointer into the document.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::Path;

use postern_model::validate::{JsonLimits, Media, ParamIn, ParamShape, Parameter, RequestBody, Scalar, Validation};
use serde_json::{Map, Value};

/// The dialect every converted schema declares at its root.
pub const SCHEMA_DIALECT: &str = "https://json-schema.org/draft/2020-12/schema";

/// At most this many schemas may be reachable through `$ref` from one schema.
pub const MAX_DEFS: usize = 10_000;

/// The largest OpenAPI document a compile reads: 16 MiB.
pub const SPEC_FILE_CAP: u64 = 16 << 20;

/// The operations of a path item, as OpenAPI names them.
const METHODS: [&str; 8] = ["get", "put", "post", "delete", "options", "head", "patch", "trace"];

/// Schema keywords the gateway's validator refuses (they re-root or re-scope references).
const UNSUPPORTED: [&str; 5] = ["$id", "$anchor", "$dynamicRef", "$dynamicAnchor", "$recursiveRef"];

/// Keywords OpenAPI 3.0 adds to its schemas that JSON Schema does not know.
const OPENAPI_30_ONLY: [&str; 6] = ["nullable", "example", "discriminator", "xml", "externalDocs", "deprecated"];

/// Unknown operations are reported here (see [`Spec::operation`]).
pub const OPERATIONS_POINTER: &str = "/paths";

/// A problem in an OpenAPI document, at its place.
#[derive(Debug, Clone, PartialEq, Eq, Hash, thiserror::Error)]
#[error("{pointer}: {message}")]
pub struct SpecError {
    /// RFC 6901 JSON pointer into the document; empty for the document itself.
    pub pointer: String,
    /// What is wrong.
    pub message: String,
}

fn err(pointer: impl Into<String>, message: impl Into<String>) -> SpecError {
    SpecError { pointer: pointer.into(), message: message.into() }
}

/// One operation, as a route needs it.
#[derive(Debug, Clone, PartialEq)]
pub struct Op {
    /// The operation's method, upper case (`POST`).
    pub method: String,
    /// The OpenAPI path template it sits under (`/orders/{id}`).
    pub path: String,
    /// What a request must satisfy.
    pub validation: Validation,
}

/// Which OpenAPI the document is written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dialect {
    /// 3.0.x: its own schema dialect, rewritten to 2020-12.
    V30,
    /// 3.1.x: schemas are JSON Schema 2020-12 already.
    V31,
}

/// A parsed OpenAPI document.
#[derive(Debug, Clone)]
pub struct Spec {
    doc: Value,
    dialect: Dialect,
}

/// An operation found in the document.
struct Found<'a> {
    method: &'a str,
    template: &'a str,
    item: &'a Value,
    item_ptr: String,
    op: &'a Value,
    op_ptr: String,
}

/// Where a parameter travels, cookies included (they are ignored).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Loc {
    In(ParamIn),
    Cookie,
}

/// A parameter as listed, its `$ref` followed.
struct RawParam<'a> {
    /// Its name (lowercase for headers).
    name: String,
    loc: Loc,
    value: &'a Value,
    ptr: String,
}

impl Spec {
    /// Parses a document, YAML or JSON; `openapi:` must be `3.0.x` or `3.1.x`.
    pub fn parse(text: &str) -> Result<Spec, SpecError> {
        // JSON is read as JSON: YAML's reader refuses some valid JSON (a surrogate pair
        // escape such as `\ud83c\udf6b`).
        let doc: Value = if text.trim_start().starts_with('{') {
            serde_json::from_str(text).map_err(|e| err("", e.to_string()))?
        } else {
            serde_yaml_ng::from_str(text).map_err(|e| err("", e.to_string()))?
        };
        let dialect = match doc.get("openapi") {
            Some(Value::String(v)) if release_of(v, "3.0.") => Dialect::V30,
            Some(Value::String(v)) if release_of(v, "3.1.") => Dialect::V31,
            Some(Value::String(v)) => {
                return Err(err("/openapi", format!("OpenAPI {v} is not supported: give 3.0.x or 3.1.x")));
            }
            Some(_) => return Err(err("/openapi", "give the version as a string, 3.0.x or 3.1.x (quote it)")),
            None => return Err(err("/openapi", "not an OpenAPI document: give openapi: 3.0.x or 3.1.x")),
        };
        Ok(Spec { doc, dialect })
    }

    /// Reads and parses the document at `path` (a regular file, at most
    /// [`SPEC_FILE_CAP`] bytes: a symbolic link, a FIFO or a device is refused).
    pub fn load(path: &Path) -> Result<Spec, SpecError> {
        let bytes = postern_model::disk::read_untrusted(path, SPEC_FILE_CAP)
            .map_err(|e| err("", format!("cannot read: {e}")))?;
        let text = String::from_utf8(bytes).map_err(|_| err("", "cannot read: not UTF-8 text"))?;
        Spec::parse(&text)
    }

    /// The operation with `operation_id`, converted. An id no operation has is one error
    /// at [`OPERATIONS_POINTER`] that lists up to 10 known ids; an id two operations
    /// share is an error at the second. Every other error is where the document has it.
    pub fn operation(&self, operation_id: &str, limits: JsonLimits, source: &str) -> Result<Op, Vec<SpecError>> {
        let found = self.find(operation_id)?;
        let mut errors = Vec::new();
        let parameters = self.parameters(&found, &mut errors);
        let body = self.body(found.op, &found.op_ptr, &mut errors);
        if !errors.is_empty() {
            // A schema shared by a parameter and the body is reported once.
            let mut seen = HashSet::new();
            errors.retain(|e| seen.insert(e.clone()));
            return Err(errors);
        }
        Ok(Op {
            method: found.method.to_ascii_uppercase(),
            path: found.template.to_owned(),
            validation: Validation { source: source.to_owned(), parameters, body, json: limits },
        })
    }

    /// Finds the one operation with `id` under `paths`.
    fn find(&self, id: &str) -> Result<Found<'_>, Vec<SpecError>> {
        let mut known = BTreeSet::new();
        let mut found = Vec::new();
        let mut unreadable = Vec::new();
        if let Some(paths) = self.doc.get("paths").and_then(Value::as_object) {
            for (template, item) in paths {
                let ptr = format!("/paths/{}", escape(template));
                let (item, item_ptr) = match self.resolve(item, &ptr) {
                    Ok(x) => x,
                    Err(e) => {
                        // Only a problem if the operation is not found elsewhere.
                        unreadable.push(e);
                        continue;
                    }
                };
                for method in METHODS {
                    let Some(op) = item.get(method) else { continue };
                    let Some(op_id) = op.get("operationId").and_then(Value::as_str) else { continue };
                    known.insert(op_id);
                    if op_id == id {
                        let op_ptr = format!("{item_ptr}/{method}");
                        found.push(Found { method, template, item, item_ptr: item_ptr.clone(), op, op_ptr });
                    }
                }
            }
        }
        let mut found = found.into_iter();
        match (found.next(), found.next()) {
            (Some(one), None) => Ok(one),
            (Some(first), Some(second)) => Err(vec![err(
                format!("{}/operationId", second.op_ptr),
                format!("operationId {id:?} is also used at {}", first.op_ptr),
            )]),
            (None, _) => {
                let list = if known.is_empty() {
                    "the document has none".to_owned()
                } else {
                    let shown: Vec<&str> = known.iter().take(10).copied().collect();
                    let more = known.len().saturating_sub(shown.len());
                    let tail = if more > 0 { format!(" and {more} more") } else { String::new() };
                    format!("known: {}{tail}", shown.join(", "))
                };
                let mut errors = vec![err(OPERATIONS_POINTER, format!("no operation has operationId {id:?} ({list})"))];
                errors.extend(unreadable);
                Err(errors)
            }
        }
    }

    /// Follows `$ref`s (local only) from `v` at `ptr`: the value they end at and its pointer.
    fn resolve<'a>(&'a self, mut v: &'a Value, ptr: &str) -> Result<(&'a Value, String), SpecError> {
        let mut ptr = ptr.to_owned();
        let mut seen = HashSet::new();
        while let Some(r) = v.get("$ref") {
            let at = format!("{ptr}/$ref");
            let r = r.as_str().ok_or_else(|| err(&at, "$ref must be a string"))?;
            let key = local_pointer(r).map_err(|m| err(&at, m.to_string()))?;
            if !seen.insert(key.clone()) {
                return Err(err(at, format!("$ref cycle through {r}")));
            }
            v = self.doc.pointer(&key).ok_or_else(|| err(&at, unresolved(r)))?;
            ptr = key;
        }
        Ok((v, ptr))
    }

    /// The path item's parameters merged with the operation's (the operation's win on
    /// name and location), cookies and the headers OpenAPI ignores left out.
    fn parameters(&self, found: &Found<'_>, errors: &mut Vec<SpecError>) -> Vec<Parameter> {
        let mut merged = self.listed(found.item, &found.item_ptr, errors);
        for p in self.listed(found.op, &found.op_ptr, errors) {
            match merged.iter_mut().find(|m| m.name == p.name && m.loc == p.loc) {
                Some(m) => *m = p,
                None => merged.push(p),
            }
        }
        merged
            .iter()
            .filter(|p| p.loc != Loc::Cookie)
            .filter(|p| {
                p.loc != Loc::In(ParamIn::Header)
                    || !matches!(p.name.as_str(), "accept" | "content-type" | "authorization")
            })
            .filter_map(|p| self.parameter(p, errors))
            .collect()
    }

    /// The `parameters` list of a path item or operation.
    fn listed<'a>(&'a self, owner: &'a Value, owner_ptr: &str, errors: &mut Vec<SpecError>) -> Vec<RawParam<'a>> {
        let Some(list) = owner.get("parameters") else { return Vec::new() };
        let ptr = format!("{owner_ptr}/parameters");
        let Some(list) = list.as_array() else {
            errors.push(err(ptr, "parameters must be a list"));
            return Vec::new();
        };
        let mut out: Vec<RawParam<'a>> = Vec::new();
        for (i, p) in list.iter().enumerate() {
            let (value, ptr) = match self.resolve(p, &format!("{ptr}/{i}")) {
                Ok(x) => x,
                Err(e) => {
                    errors.push(e);
                    continue;
                }
            };
            let Some(name) = value.get("name").and_then(Value::as_str) else {
                errors.push(err(ptr, "a parameter needs a name"));
                continue;
            };
            let loc = match value.get("in").and_then(Value::as_str) {
                Some("path") => Loc::In(ParamIn::Path),
                Some("query") => Loc::In(ParamIn::Query),
                Some("header") => Loc::In(ParamIn::Header),
                Some("cookie") => Loc::Cookie,
                _ => {
                    errors.push(err(format!("{ptr}/in"), "in must be path, query, header or cookie"));
                    continue;
                }
            };
            // Header names are matched without regard to case.
            let name = if loc == Loc::In(ParamIn::Header) { name.to_ascii_lowercase() } else { name.to_owned() };
            if out.iter().any(|o| o.name == name && o.loc == loc) {
                errors.push(err(&ptr, format!("parameter {name:?} is listed twice at this level")));
                continue;
            }
            out.push(RawParam { name, loc, value, ptr });
        }
        out
    }

    /// One parameter: its style checked, its shape read, its schema converted.
    fn parameter(&self, raw: &RawParam<'_>, errors: &mut Vec<SpecError>) -> Option<Parameter> {
        let Loc::In(location) = raw.loc else { return None };
        let (p, ptr) = (raw.value, raw.ptr.as_str());
        let required = p.get("required").and_then(Value::as_bool).unwrap_or(false);
        if location == ParamIn::Path && !required {
            errors.push(err(ptr, "a path parameter must be required: true"));
        }
        let allowed = if location == ParamIn::Query { "form" } else { "simple" };
        if let Some(style) = p.get("style")
            && style.as_str() != Some(allowed)
        {
            let msg = format!(
                "style {style} is not supported by the gateway's validator (a {} parameter may be {allowed})",
                location.as_str()
            );
            errors.push(err(format!("{ptr}/style"), msg));
            return None;
        }
        if p.get("content").is_some() {
            let msg = "a parameter with content (instead of schema) is not supported by the gateway's validator";
            errors.push(err(format!("{ptr}/content"), msg));
            return None;
        }
        let Some(schema) = p.get("schema") else {
            errors.push(err(ptr, "a parameter needs a schema"));
            return None;
        };
        let schema_ptr = format!("{ptr}/schema");
        let explode = location == ParamIn::Query && p.get("explode").and_then(Value::as_bool).unwrap_or(true);
        let shape = match self.shape(schema, &schema_ptr, explode) {
            Ok(s) => s,
            Err(e) => {
                errors.push(e);
                return None;
            }
        };
        let schema = self.convert(schema, &schema_ptr, errors)?;
        Some(Parameter { name: raw.name.clone(), location, required, shape, schema })
    }

    /// How a parameter's text is read, from its schema's `type` (and its items').
    fn shape(&self, schema: &Value, ptr: &str, explode: bool) -> Result<ParamShape, SpecError> {
        const HINT: &str = "give a string, integer, number or boolean, or an array of them";
        let (s, ptr) = self.resolve(schema, ptr)?;
        match type_of(s, &ptr)? {
            None => Ok(ParamShape::Scalar { of: Scalar::String }),
            Some("array") => {
                let of = match s.get("items") {
                    None => Scalar::String,
                    Some(items) => {
                        let (items, items_ptr) = self.resolve(items, &format!("{ptr}/items"))?;
                        match type_of(items, &items_ptr)? {
                            None => Scalar::String,
                            Some(t) => scalar(t).ok_or_else(|| {
                                let msg =
                                    format!("arrays of {t} are not supported by the gateway's validator ({HINT})");
                                err(format!("{items_ptr}/type"), msg)
                            })?,
                        }
                    }
                };
                Ok(ParamShape::Array { of, explode })
            }
            Some(t) => scalar(t).map(|of| ParamShape::Scalar { of }).ok_or_else(|| {
                let msg = format!("{t} parameters are not supported by the gateway's validator ({HINT})");
                err(format!("{ptr}/type"), msg)
            }),
        }
    }

    /// The operation's request body, if it declares one.
    fn body(&self, op: &Value, op_ptr: &str, errors: &mut Vec<SpecError>) -> Option<RequestBody> {
        let rb = op.get("requestBody")?;
        let (rb, ptr) = match self.resolve(rb, &format!("{op_ptr}/requestBody")) {
            Ok(x) => x,
            Err(e) => {
                errors.push(e);
                return None;
            }
        };
        let required = rb.get("required").and_then(Value::as_bool).unwrap_or(false);
        let content = match rb.get("content").and_then(Value::as_object) {
            Some(c) if !c.is_empty() => c,
            _ => {
                errors.push(err(ptr, "a request body needs at least one media type under content"));
                return None;
            }
        };
        let mut media: Vec<(u8, Media)> = Vec::new();
        let mut failed = false;
        for (declared, m) in content {
            let m_ptr = format!("{ptr}/content/{}", escape(declared));
            let range = declared.split(';').next().unwrap_or_default().trim().to_ascii_lowercase();
            let rank = match range.split_once('/') {
                Some(("*", "*")) => 2,
                Some((t, "*")) if token(t) => 1,
                Some((t, s)) if token(t) && token(s) => 0,
                _ => {
                    errors.push(err(m_ptr, format!("{declared:?} is not a media type like application/json")));
                    failed = true;
                    continue;
                }
            };
            if media.iter().any(|(_, x)| x.range == range) {
                let msg = format!("{range} is declared twice (media type parameters are not told apart)");
                errors.push(err(m_ptr, msg));
                failed = true;
                continue;
            }
            let schema = match m.get("schema") {
                None => None,
                Some(s) => match self.convert(s, &format!("{m_ptr}/schema"), errors) {
                    Some(s) => Some(s),
                    None => {
                        failed = true;
                        continue;
                    }
                },
            };
            media.push((rank, Media { range, schema }));
        }
        if failed {
            return None;
        }
        // Most specific first; the sort is stable, so ties keep the document's order.
        media.sort_by_key(|(rank, _)| *rank);
        Some(RequestBody { required, media: media.into_iter().map(|(_, m)| m).collect() })
    }

    /// `schema` (at `ptr`) as a self-contained JSON Schema 2020-12 document; `None`
    /// when it has errors, which are added to `errors`.
    fn convert(&self, schema: &Value, ptr: &str, errors: &mut Vec<SpecError>) -> Option<Value> {
        let mut cv = Converter {
            spec: self,
            defs: BTreeMap::new(),
            known: HashSet::new(),
            queue: Vec::new(),
            edges: Vec::new(),
            errors: Vec::new(),
            full: false,
        };
        let root = cv.schema(schema, ptr, &Site { def: None, same: true });
        while let Some(key) = cv.queue.pop() {
            // Registered only once it resolved.
            let Some(target) = self.doc.pointer(&key) else { continue };
            let site = Site { def: Some(key.clone()), same: true };
            let def = cv.schema(target, &key, &site);
            cv.defs.insert(key, def);
        }
        cv.check_cycles();
        if !cv.errors.is_empty() {
            errors.append(&mut cv.errors);
            return None;
        }
        let mut out = match root {
            Value::Object(m) => m,
            Value::Bool(false) => Map::from_iter([("not".to_owned(), Value::Object(Map::new()))]),
            _ => Map::new(),
        };
        out.insert("$schema".to_owned(), Value::String(SCHEMA_DIALECT.to_owned()));
        if !cv.defs.is_empty() {
            out.insert("$defs".to_owned(), Value::Object(cv.defs.into_iter().collect()));
        }
        Some(Value::Object(out))
    }
}

/// Where a subschema is being converted from.
struct Site {
    /// The `$defs` key of the def it belongs to; `None` for the root.
    def: Option<String>,
    /// It applies to the same instance as its def (no `properties`, `items` or the
    /// like on the way from the def to it).
    same: bool,
}

/// One schema's conversion: the defs gathered so far and the errors.
struct Converter<'a> {
    spec: &'a Spec,
    /// Converted defs by JSON pointer.
    defs: BTreeMap<String, Value>,
    /// Every pointer registered as a def (converted or queued).
    known: HashSet<String>,
    /// Defs still to convert.
    queue: Vec<String>,
    /// `$ref`s that apply to the same instance as their def: (from, to, the `$ref`'s pointer).
    edges: Vec<(Option<String>, String, String)>,
    errors: Vec<SpecError>,
    /// The [`MAX_DEFS`] error was reported.
    full: bool,
}

impl Converter<'_> {
    fn error(&mut self, pointer: impl Into<String>, message: impl Into<String>) {
        self.errors.push(err(pointer, message));
    }

    /// One schema object (or boolean schema), converted.
    fn schema(&mut self, v: &Value, ptr: &str, site: &Site) -> Value {
        let obj = match v {
            Value::Object(o) => o,
            Value::Bool(_) => return v.clone(),
            _ => {
                self.error(ptr, "a schema must be an object");
                return v.clone();
            }
        };
        let v30 = self.spec.dialect == Dialect::V30;
        let mut out = Map::new();
        if let Some(r) = obj.get("$ref") {
            let r = self.reference(r, &format!("{ptr}/$ref"), site);
            out.insert("$ref".to_owned(), r);
            if v30 {
                // OpenAPI 3.0 ignores a $ref's siblings.
                return Value::Object(out);
            }
        }
        let same = Site { def: site.def.clone(), same: site.same };
        let inner = Site { def: site.def.clone(), same: false };
        for (k, val) in obj {
            let k_ptr = format!("{ptr}/{}", escape(k));
            let kw = k.as_str();
            let converted = match kw {
                "$ref" | "$schema" | "$defs" | "definitions" => continue,
                _ if k.starts_with("x-") => continue,
                _ if v30 && OPENAPI_30_ONLY.contains(&kw) => continue,
                _ if UNSUPPORTED.contains(&kw) => {
                    self.error(k_ptr, format!("{k} is not supported by the gateway's validator"));
                    continue;
                }
                "properties" | "patternProperties" => self.schema_map(val, &k_ptr, &inner),
                "dependentSchemas" => self.schema_map(val, &k_ptr, &same),
                "allOf" | "anyOf" | "oneOf" => self.schema_list(val, &k_ptr, &same),
                "prefixItems" => self.schema_list(val, &k_ptr, &inner),
                "items" if val.is_array() => self.schema_list(val, &k_ptr, &inner),
                "not" | "if" | "then" | "else" => self.schema(val, &k_ptr, &same),
                "items"
                | "additionalProperties"
                | "additionalItems"
                | "contains"
                | "propertyNames"
                | "unevaluatedItems"
                | "unevaluatedProperties"
                | "contentSchema" => self.schema(val, &k_ptr, &inner),
                _ => val.clone(),
            };
            out.insert(k.clone(), converted);
        }
        // A request need not send what the server sets.
        let read_only: HashSet<&str> = obj
            .get("properties")
            .and_then(Value::as_object)
            .map(|props| props.iter().filter(|(_, p)| self.read_only(p)).map(|(n, _)| n.as_str()).collect())
            .unwrap_or_default();
        if !read_only.is_empty()
            && let Some(Value::Array(required)) = out.get_mut("required")
        {
            required.retain(|n| n.as_str().is_none_or(|n| !read_only.contains(n)));
            if required.is_empty() {
                out.remove("required");
            }
        }
        integer_format_bounds(&mut out);
        if v30 {
            rewrite_exclusive(&mut out);
            if obj.get("nullable") == Some(&Value::Bool(true)) {
                return nullable(out);
            }
        }
        Value::Object(out)
    }

    /// A map of schemas (`properties`): the names kept, each schema converted.
    fn schema_map(&mut self, v: &Value, ptr: &str, site: &Site) -> Value {
        let Some(m) = v.as_object() else {
            self.error(ptr, "must be a map of schemas");
            return v.clone();
        };
        Value::Object(
            m.iter().map(|(k, s)| (k.clone(), self.schema(s, &format!("{ptr}/{}", escape(k)), site))).collect(),
        )
    }

    /// A list of schemas (`allOf`).
    fn schema_list(&mut self, v: &Value, ptr: &str, site: &Site) -> Value {
        let Some(list) = v.as_array() else {
            self.error(ptr, "must be a list of schemas");
            return v.clone();
        };
        Value::Array(list.iter().enumerate().map(|(i, s)| self.schema(s, &format!("{ptr}/{i}"), site)).collect())
    }

    /// A `$ref` (at `ptr`) registered as a def and rewritten to point at it.
    fn reference(&mut self, r: &Value, ptr: &str, site: &Site) -> Value {
        let Some(text) = r.as_str() else {
            self.error(ptr, "$ref must be a string");
            return r.clone();
        };
        let key = match local_pointer(text) {
            Ok(k) => k,
            Err(m) => {
                self.error(ptr, m.to_string());
                return r.clone();
            }
        };
        if self.spec.doc.pointer(&key).is_none() {
            self.error(ptr, unresolved(text));
            return r.clone();
        }
        if !self.known.contains(&key) {
            if self.known.len() >= MAX_DEFS {
                if !self.full {
                    self.full = true;
                    self.error(ptr, format!("more than {MAX_DEFS} schemas are reachable through $ref"));
                }
                return r.clone();
            }
            self.known.insert(key.clone());
            self.queue.push(key.clone());
        }
        if site.same {
            self.edges.push((site.def.clone(), key.clone(), ptr.to_owned()));
        }
        Value::String(format!("#/$defs/{}", fragment_encode(&escape(&key))))
    }

    /// The property schema `p` is `readOnly: true`, itself or where its `$ref` leads.
    fn read_only(&self, p: &Value) -> bool {
        let v30 = self.spec.dialect == Dialect::V30;
        let mut p = p;
        for _ in 0..64 {
            let r = p.get("$ref").and_then(Value::as_str);
            if (r.is_none() || !v30) && p.get("readOnly") == Some(&Value::Bool(true)) {
                return true;
            }
            match r.and_then(|r| local_pointer(r).ok()).and_then(|k| self.spec.doc.pointer(&k)) {
                Some(next) => p = next,
                None => return false,
            }
        }
        false
    }

    /// Refuses a cycle of `$ref`s that never descends into the instance (`A: {$ref: B}`,
    /// `B: {allOf: [{$ref: A}]}`): validating against it would never end.
    fn check_cycles(&mut self) {
        let mut preds: HashMap<&str, Vec<&str>> = HashMap::new();
        let mut outdeg: HashMap<&str, usize> = HashMap::new();
        for (from, to, _) in &self.edges {
            // An edge from the root cannot be on a cycle: nothing points at the root.
            let Some(from) = from.as_deref() else { continue };
            preds.entry(to.as_str()).or_default().push(from);
            *outdeg.entry(from).or_default() += 1;
            outdeg.entry(to.as_str()).or_default();
        }
        // Peel off nodes with no same-instance $ref out; what is left holds a cycle.
        let mut left = outdeg.clone();
        let mut ready: Vec<&str> = left.iter().filter(|(_, d)| **d == 0).map(|(n, _)| *n).collect();
        while let Some(n) = ready.pop() {
            left.remove(n);
            for p in preds.get(n).into_iter().flatten() {
                if let Some(d) = left.get_mut(p) {
                    *d -= 1;
                    if *d == 0 {
                        ready.push(*p);
                    }
                }
            }
        }
        let Some(start) = left.keys().min().copied() else { return };
        // Every node left has a same-instance $ref to another node left: follow them.
        let succ = |n: &str| {
            self.edges
                .iter()
                .filter(|(f, t, _)| f.as_deref() == Some(n) && left.contains_key(t.as_str()))
                .min_by(|a, b| a.1.cmp(&b.1))
                .map(|(_, t, at)| (t.as_str(), at.as_str()))
        };
        let mut path: Vec<(&str, &str)> = Vec::new();
        let mut n = start;
        while let Some((next, at)) = succ(n) {
            path.push((n, at));
            if let Some(i) = path.iter().position(|(p, _)| *p == next) {
                let mut names: Vec<&str> = path[i..].iter().map(|(p, _)| *p).collect();
                names.push(next);
                let msg = format!("$ref cycle that never descends into the value: {}", names.join(" → "));
                let at = at.to_owned();
                self.error(at, msg);
                return;
            }
            n = next;
        }
    }
}

/// OpenAPI 3.0's boolean `exclusiveMaximum`/`exclusiveMinimum` as 2020-12's numbers.
/// OpenAPI's `format: int32` and `int64` as bounds (JSON Schema formats constrain only
/// strings): the stricter of the format's range and any bound the schema gives.
fn integer_format_bounds(out: &mut Map<String, Value>) {
    let (lo, hi) = match out.get("format").and_then(Value::as_str) {
        Some("int32") => (i64::from(i32::MIN), i64::from(i32::MAX)),
        Some("int64") => (i64::MIN, i64::MAX),
        _ => return,
    };
    let tighter = |v: Option<&Value>, bound: i64, keep: fn(f64, f64) -> bool| match v.and_then(Value::as_f64) {
        Some(given) if keep(given, bound as f64) => None,
        _ => Some(Value::from(bound)),
    };
    if let Some(v) = tighter(out.get("minimum"), lo, |given, bound| given >= bound) {
        out.insert("minimum".to_owned(), v);
    }
    if let Some(v) = tighter(out.get("maximum"), hi, |given, bound| given <= bound) {
        out.insert("maximum".to_owned(), v);
    }
}

fn rewrite_exclusive(out: &mut Map<String, Value>) {
    for (bound, exclusive) in [("maximum", "exclusiveMaximum"), ("minimum", "exclusiveMinimum")] {
        match out.get(exclusive) {
            Some(Value::Bool(true)) => {
                out.remove(exclusive);
                if let Some(m) = out.remove(bound) {
                    out.insert(exclusive.to_owned(), m);
                }
            }
            Some(Value::Bool(false)) => {
                out.remove(exclusive);
            }
            _ => {}
        }
    }
}

/// OpenAPI 3.0's `nullable: true` (already removed from `out`) as 2020-12 says it.
fn nullable(mut out: Map<String, Value>) -> Value {
    let null = Value::String("null".to_owned());
    match out.get_mut("type") {
        Some(Value::String(t)) => {
            let t = Value::String(std::mem::take(t));
            out.insert("type".to_owned(), Value::Array(vec![t, null]));
        }
        Some(Value::Array(types)) => {
            if !types.contains(&null) {
                types.push(null);
            }
        }
        _ => {
            let alone = Map::from_iter([("type".to_owned(), null)]);
            return Value::Object(Map::from_iter([(
                "anyOf".to_owned(),
                Value::Array(vec![Value::Object(out), Value::Object(alone)]),
            )]));
        }
    }
    if let Some(Value::Array(values)) = out.get_mut("enum")
        && !values.contains(&Value::Null)
    {
        values.push(Value::Null);
    }
    Value::Object(out)
}

/// A schema's one type besides `null` (3.1 lists them: `[integer, "null"]`).
fn type_of<'a>(s: &'a Value, ptr: &str) -> Result<Option<&'a str>, SpecError> {
    let at = || format!("{ptr}/type");
    match s.get("type") {
        None => Ok(None),
        Some(Value::String(t)) => Ok(Some(t)),
        Some(Value::Array(types)) => {
            let named: Vec<&str> = types.iter().filter_map(Value::as_str).filter(|t| *t != "null").collect();
            match named.as_slice() {
                [one] => Ok(Some(*one)),
                _ => Err(err(at(), "a parameter's schema must name one type (besides null)")),
            }
        }
        Some(_) => Err(err(at(), "type must be a string or a list of strings")),
    }
}

fn scalar(t: &str) -> Option<Scalar> {
    match t {
        "string" => Some(Scalar::String),
        "integer" => Some(Scalar::Integer),
        "number" => Some(Scalar::Number),
        "boolean" => Some(Scalar::Boolean),
        _ => None,
    }
}

/// `3.0.` or `3.1.` followed by a patch number.
fn release_of(v: &str, minor: &str) -> bool {
    v.strip_prefix(minor).is_some_and(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
}

/// An RFC 7230 token (a media type's type or subtype).
fn token(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"!#$&-^_.+".contains(&b))
}

fn unresolved(r: &str) -> String {
    format!("$ref {r} points at nothing in the document")
}

/// The JSON pointer of a local `$ref` (`#/components/schemas/Order`), percent-decoded
/// as RFC 6901 says of URI fragments; why not, for any other.
fn local_pointer(r: &str) -> Result<String, RefError> {
    let Some(fragment) = r.strip_prefix('#') else {
        return Err(RefError::Remote(r.to_owned()));
    };
    let pointer = crate::usage::percent_unescape(fragment).ok_or_else(|| RefError::Fragment(r.to_owned()))?;
    if pointer.is_empty() {
        return Err(RefError::Whole(r.to_owned()));
    }
    if !pointer.starts_with('/') {
        return Err(RefError::Anchor(r.to_owned()));
    }
    Ok(pointer)
}

/// Why a `$ref` is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum RefError {
    #[error("remote $ref is refused: {0}")]
    Remote(String),
    #[error("$ref {0} is not a valid URI fragment")]
    Fragment(String),
    #[error("$ref {0} points at the whole document, not a schema")]
    Whole(String),
    #[error(
        "$ref {0}: anchors are not supported by the gateway's validator (give a JSON pointer like #/components/schemas/Order)"
    )]
    Anchor(String),
}

/// One RFC 6901 reference token.
fn escape(token: &str) -> String {
    token.replace('~', "~0").replace('/', "~1")
}

/// What a URI fragment holds as it is (RFC 3986's `fragment`): the rest is escaped.
const FRAGMENT: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~')
    .remove(b'!')
    .remove(b'$')
    .remove(b'&')
    .remove(b'\'')
    .remove(b'(')
    .remove(b')')
    .remove(b'*')
    .remove(b'+')
    .remove(b',')
    .remove(b';')
    .remove(b'=')
    .remove(b':')
    .remove(b'@')
    .remove(b'/')
    .remove(b'?');

/// A JSON pointer written into a URI fragment: what a fragment may not hold (and `%`)
/// percent-encoded (RFC 6901, section 6).
fn fragment_encode(pointer: &str) -> String {
    percent_encoding::utf8_percent_encode(pointer, FRAGMENT).to_string()
}

#[cfg(test)]
mod tests;
