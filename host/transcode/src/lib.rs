//! REST→gRPC transcoding for routes whose backend is a gRPC service: a request's JSON
//! body, path variables and query parameters become the method's protobuf input (the
//! proto3 JSON mapping, by `prost-reflect`), and the answer's protobuf becomes JSON; a
//! gRPC status becomes an HTTP status through one fixed table.
//!
//! The bindings are the methods' `google.api.http` annotations, read from the route's
//! descriptor set when the snapshot is built and checked then (every field a template
//! or a body names exists; no two bindings of one HTTP method have the same shape).
//! Strict by default: an unknown JSON field or query parameter is a 400 naming it, never
//! dropped.
//!
//! `posternctl` builds the same [`Transcoder`] to refuse a route whose bindings are bad.

pub mod template;

use std::fmt::Write as _;

use bytes::{BufMut, Bytes, BytesMut};
use http::{HeaderMap, Method, StatusCode};
use postern_model::transcode::Transcode;
use postern_model::validate::JsonLimits;
use postern_validate::{FieldError, Refusal};
use prost::Message as _;
use prost_reflect::{
    DescriptorPool, DeserializeOptions, DynamicMessage, FieldDescriptor, Kind, MessageDescriptor, MethodDescriptor,
    SerializeOptions, Value,
};

use template::Template;

/// The largest JSON answer a call may become.
const MAX_JSON_ANSWER: usize = 16 << 20;

/// The annotation the bindings are read from.
const HTTP_RULE: &str = "google.api.http";

/// Why a route's transcoding cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{at}: {message}")]
pub struct BuildError {
    /// Where: `orders.v1.Orders.GetOrder (get /v1/orders/{id})`, or the service.
    pub at: String,
    /// What is wrong.
    pub message: String,
}

/// Why a backend's gRPC answer cannot become JSON.
#[derive(Debug, thiserror::Error)]
pub enum ResponseError {
    /// A frame shorter than its header says.
    #[error("a gRPC frame is cut short")]
    CutShort,
    /// A compressed frame.
    #[error("a gRPC frame is compressed (none was asked for)")]
    Compressed,
    /// A message that does not decode as the method's output.
    #[error("the answer does not decode: {0}")]
    Decode(#[source] prost::DecodeError),
    /// A message that cannot be written as JSON.
    #[error("{0}")]
    Json(#[source] serde_json::Error),
    /// JSON over the largest answer.
    #[error("the answer is too large as JSON")]
    TooLarge,
    /// No message in a unary answer.
    #[error("the answer has no message")]
    Empty,
}

/// Compares with the message, as tests read it.
impl PartialEq<&str> for ResponseError {
    fn eq(&self, other: &&str) -> bool {
        let message = self.to_string();
        message == *other
    }
}

/// Why a dotted field path does not resolve in a message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum FieldPathError {
    /// The message has no such field.
    #[error("{message} has no field {field:?}")]
    NoField { message: String, field: String },
    /// A step before the last is not a singular message.
    #[error("{message}.{field} is not a message, so it has no fields")]
    NotMessage { message: String, field: String },
}

/// Why a text is not a field's value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum ValueError {
    /// Not a value of the field's scalar kind.
    #[error("{text:?} is not a {kind}")]
    Kind { text: String, kind: String },
    /// Not a name or number of the enum.
    #[error("{text:?} is not a value of {name}")]
    Enum { text: String, name: String },
    /// The field is a message.
    #[error("{0} is a message, not a scalar")]
    Message(String),
}

/// One HTTP binding of a method.
#[derive(Debug)]
pub struct Binding {
    method: Method,
    /// The template as the annotation writes it.
    text: String,
    template: Template,
    rpc: MethodDescriptor,
    /// `/orders.v1.Orders/GetOrder`.
    grpc_path: String,
    /// `None`: no body; `Some(None)`: the whole message (`*`); `Some(Some(f))`: a field.
    body: Option<Option<FieldDescriptor>>,
    /// The output's field sent as the answer, if not the whole message.
    response_body: Option<FieldDescriptor>,
    /// The fields the template binds (not to be given again in the query).
    bound: Vec<Vec<FieldDescriptor>>,
}

impl Binding {
    /// The gRPC path it calls: `/package.Service/Method`.
    pub fn grpc_path(&self) -> &str {
        &self.grpc_path
    }

    /// Its HTTP method.
    pub fn http_method(&self) -> &Method {
        &self.method
    }

    /// Its path template, as written.
    pub fn template_text(&self) -> &str {
        &self.text
    }

    /// The literal prefix every path it takes starts with (`/v1/orders/`).
    pub fn literal_prefix(&self) -> String {
        self.template.literal_prefix()
    }

    /// Whether the method streams its answers (sent as newline-delimited JSON).
    pub fn server_streaming(&self) -> bool {
        self.rpc.is_server_streaming()
    }
}

/// A route's transcoder, built once per snapshot.
#[derive(Debug)]
pub struct Transcoder {
    bindings: Vec<Binding>,
}

/// A request matched to a binding: the binding and its variables' text.
#[derive(Debug)]
pub struct Matched<'t> {
    /// The binding.
    pub binding: &'t Binding,
    vars: Vec<String>,
}

fn http_method(rule: &DynamicMessage) -> Option<(Method, String)> {
    for (field, method) in [
        ("get", Method::GET),
        ("put", Method::PUT),
        ("post", Method::POST),
        ("delete", Method::DELETE),
        ("patch", Method::PATCH),
    ] {
        if rule.has_field_by_name(field)
            && let Some(Value::String(t)) = rule.get_field_by_name(field).as_deref()
        {
            return Some((method, t.clone()));
        }
    }
    if rule.has_field_by_name("custom")
        && let Some(Value::Message(c)) = rule.get_field_by_name("custom").as_deref()
    {
        let kind = c.get_field_by_name("kind").and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default();
        let path = c.get_field_by_name("path").and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default();
        return Method::from_bytes(kind.to_ascii_uppercase().as_bytes()).ok().map(|m| (m, path));
    }
    None
}

fn text_field(rule: &DynamicMessage, name: &str) -> String {
    rule.get_field_by_name(name).and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default()
}

/// Resolves a dotted field path in a message: each step but the last a singular message.
fn field_path(msg: &MessageDescriptor, path: &[String]) -> Result<Vec<FieldDescriptor>, FieldPathError> {
    let mut out = Vec::with_capacity(path.len());
    let mut at = msg.clone();
    for (i, name) in path.iter().enumerate() {
        let f = at
            .get_field_by_name(name)
            .ok_or_else(|| FieldPathError::NoField { message: at.full_name().to_owned(), field: name.clone() })?;
        if i + 1 < path.len() {
            match f.kind() {
                Kind::Message(m) if !f.is_list() && !f.is_map() => at = m,
                _ => {
                    return Err(FieldPathError::NotMessage { message: at.full_name().to_owned(), field: name.clone() });
                }
            }
        }
        out.push(f);
    }
    Ok(out)
}

fn scalar(f: &FieldDescriptor) -> bool {
    !f.is_map() && !matches!(f.kind(), Kind::Message(_))
}

impl Transcoder {
    /// Builds a route's transcoder from its descriptors: every annotated method of the
    /// service, with its additional bindings.
    pub fn build(t: &Transcode) -> Result<Transcoder, BuildError> {
        let svc_err = |message: String| BuildError { at: t.service.clone(), message };
        let pool = DescriptorPool::decode(t.descriptors.as_slice())
            .map_err(|e| svc_err(format!("the descriptor set does not decode: {e}")))?;
        let service =
            pool.get_service_by_name(&t.service).ok_or_else(|| svc_err("no such service in the descriptors".into()))?;
        let ext = pool.get_extension_by_name(HTTP_RULE).ok_or_else(|| {
            svc_err("the descriptors do not define google.api.http (import google/api/annotations.proto)".into())
        })?;
        let mut bindings = Vec::new();
        let mut shapes = std::collections::HashMap::new();
        for rpc in service.methods() {
            if rpc.is_client_streaming() {
                continue;
            }
            let opts = rpc.options();
            if !opts.has_extension(&ext) {
                continue;
            }
            let Value::Message(rule) = opts.get_extension(&ext).into_owned() else { continue };
            let mut rules = vec![rule.clone()];
            if let Some(Value::List(extra)) = rule.get_field_by_name("additional_bindings").as_deref() {
                rules.extend(extra.iter().filter_map(|v| v.as_message().cloned()));
            }
            for (i, r) in rules.iter().enumerate() {
                let b = Self::binding(&rpc, r, i > 0)?;
                let key = (b.method.clone(), b.template.shape());
                if let Some(other) = shapes.insert(key, rpc.name().to_owned()) {
                    return Err(BuildError {
                        at: format!("{} ({} {})", rpc.full_name(), b.method, b.template.shape()),
                        message: format!("collides with a binding of {other} of the same method and shape"),
                    });
                }
                bindings.push(b);
            }
        }
        if bindings.is_empty() {
            return Err(svc_err("no method has a google.api.http binding".into()));
        }
        Ok(Transcoder { bindings })
    }

    fn binding(rpc: &MethodDescriptor, rule: &DynamicMessage, additional: bool) -> Result<Binding, BuildError> {
        let mut at = rpc.full_name().to_owned();
        let err = |at: &str, message: String| BuildError { at: at.to_owned(), message };
        let (method, path) = http_method(rule).ok_or_else(|| err(&at, "a binding without a pattern".into()))?;
        let _ = write!(at, " ({} {path})", method.as_str().to_ascii_lowercase());
        if additional
            && rule.get_field_by_name("additional_bindings").is_some_and(|v| v.as_list().is_some_and(|l| !l.is_empty()))
        {
            return Err(err(&at, "an additional binding may not have its own".into()));
        }
        let template = Template::parse(&path).map_err(|e| err(&at, format!("bad template: {e}")))?;
        let input = rpc.input();
        let mut bound = Vec::new();
        for v in &template.variables {
            let fields = field_path(&input, &v.field).map_err(|e| err(&at, e.to_string()))?;
            if fields.last().is_some_and(|f| !scalar(f) || f.is_list()) {
                return Err(err(&at, format!("{{{}}} must name a singular scalar field", v.field.join("."))));
            }
            bound.push(fields);
        }
        let body = match text_field(rule, "body").as_str() {
            "" => None,
            "*" => Some(None),
            name => {
                let f = input
                    .get_field_by_name(name)
                    .ok_or_else(|| err(&at, format!("body: {} has no field {name:?}", input.full_name())))?;
                if !matches!(f.kind(), Kind::Message(_)) || f.is_list() || f.is_map() {
                    return Err(err(&at, format!("body: {name} must be a singular message field")));
                }
                if bound.iter().any(|b| b.first().is_some_and(|b0| b0.number() == f.number()) && b.len() == 1) {
                    return Err(err(&at, format!("body: {name} is also a path variable")));
                }
                Some(Some(f))
            }
        };
        if matches!(method, Method::GET | Method::DELETE) && body.is_some() {
            return Err(err(&at, "a GET or DELETE binding takes no body".into()));
        }
        let response_body = match text_field(rule, "response_body").as_str() {
            "" => None,
            name => {
                let out = rpc.output();
                let f = out
                    .get_field_by_name(name)
                    .ok_or_else(|| err(&at, format!("response_body: {} has no field {name:?}", out.full_name())))?;
                if !matches!(f.kind(), Kind::Message(_)) || f.is_list() || f.is_map() {
                    return Err(err(&at, format!("response_body: {name} must be a singular message field")));
                }
                Some(f)
            }
        };
        let grpc_path = format!("/{}/{}", rpc.parent_service().full_name(), rpc.name());
        Ok(Binding { method, text: path, template, rpc: rpc.clone(), grpc_path, body, response_body, bound })
    }

    /// The bindings, in the order they were read.
    pub fn bindings(&self) -> &[Binding] {
        &self.bindings
    }

    /// The binding a request takes: its method (HEAD as GET) and path.
    pub fn find(&self, method: &Method, path: &str) -> Option<Matched<'_>> {
        let method = if *method == Method::HEAD { &Method::GET } else { method };
        self.bindings
            .iter()
            .filter(|b| b.method == *method)
            .find_map(|b| b.template.matches(path).map(|vars| Matched { binding: b, vars }))
    }

    /// Whether any binding takes this path with another method (a 405 rather than 404).
    pub fn other_methods(&self, path: &str) -> Vec<Method> {
        self.bindings.iter().filter(|b| b.template.matches(path).is_some()).map(|b| b.method.clone()).collect()
    }
}

fn invalid(location: &'static str, pointer: String, message: String) -> Refusal {
    Refusal::Invalid(vec![FieldError { location, pointer, message }])
}

/// A text (a path variable or query value) as a field's value.
fn parse_value(f: &FieldDescriptor, text: &str) -> Result<Value, ValueError> {
    let bad = || ValueError::Kind { text: text.to_owned(), kind: format!("{:?}", f.kind()) };
    Ok(match f.kind() {
        Kind::String => Value::String(text.to_owned()),
        Kind::Bool => match text {
            "true" => Value::Bool(true),
            "false" => Value::Bool(false),
            _ => return Err(bad()),
        },
        Kind::Int32 | Kind::Sint32 | Kind::Sfixed32 => Value::I32(text.parse().map_err(|_| bad())?),
        Kind::Int64 | Kind::Sint64 | Kind::Sfixed64 => Value::I64(text.parse().map_err(|_| bad())?),
        Kind::Uint32 | Kind::Fixed32 => Value::U32(text.parse().map_err(|_| bad())?),
        Kind::Uint64 | Kind::Fixed64 => Value::U64(text.parse().map_err(|_| bad())?),
        Kind::Float => Value::F32(text.parse().map_err(|_| bad())?),
        Kind::Double => Value::F64(text.parse().map_err(|_| bad())?),
        Kind::Bytes => {
            use base64::Engine;
            let b = base64::engine::general_purpose::STANDARD
                .decode(text)
                .or_else(|_| base64::engine::general_purpose::URL_SAFE.decode(text))
                .map_err(|_| bad())?;
            Value::Bytes(Bytes::from(b))
        }
        Kind::Enum(e) => match e.get_value_by_name(text) {
            Some(v) => Value::EnumNumber(v.number()),
            None => Value::EnumNumber(
                text.parse::<i32>()
                    .ok()
                    .filter(|n| e.get_value(*n).is_some())
                    .ok_or_else(|| ValueError::Enum { text: text.to_owned(), name: e.full_name().to_owned() })?,
            ),
        },
        Kind::Message(m) => return Err(ValueError::Message(m.full_name().to_owned())),
    })
}

/// Sets `fields` (a resolved path) in `msg` to `value`, appending where the last is
/// repeated.
fn set(msg: &mut DynamicMessage, fields: &[FieldDescriptor], value: Value) {
    let Some((last, parents)) = fields.split_last() else { return };
    let mut at = msg;
    for f in parents {
        let slot = at.get_field_mut(f);
        if !matches!(slot, Value::Message(_))
            && let Kind::Message(m) = f.kind()
        {
            *slot = Value::Message(DynamicMessage::new(m));
        }
        match slot {
            Value::Message(m) => at = m,
            _ => return,
        }
    }
    if last.is_list() {
        if let Value::List(l) = at.get_field_mut(last) {
            l.push(value);
        }
    } else {
        at.set_field(last, value);
    }
}

/// A JSON pointer from serde's path (`order.items[0].sku` → `/order/items/0/sku`).
fn pointer(path: &serde_path_to_error::Path) -> String {
    let mut p = String::new();
    for seg in path.iter() {
        match seg {
            serde_path_to_error::Segment::Seq { index } => {
                let _ = write!(p, "/{index}");
            }
            serde_path_to_error::Segment::Map { key } => {
                p.push('/');
                p.push_str(&key.replace('~', "~0").replace('/', "~1"));
            }
            serde_path_to_error::Segment::Enum { variant } => {
                p.push('/');
                p.push_str(variant);
            }
            serde_path_to_error::Segment::Unknown => p.push_str("/?"),
        }
    }
    p
}

impl Matched<'_> {
    /// The gRPC request for this call: the message built from the body, the path
    /// variables and the query, framed (`0`, length, bytes). Unknown JSON fields and
    /// query parameters are refused by name.
    pub fn request(&self, query: Option<&str>, body: &[u8], limits: &JsonLimits) -> Result<Bytes, Refusal> {
        let b = self.binding;
        let input = b.rpc.input();
        let strict = DeserializeOptions::new().deny_unknown_fields(true);
        let mut msg = match &b.body {
            None if !body.is_empty() => {
                return Err(invalid("body", String::new(), "this call takes no body".into()));
            }
            None => DynamicMessage::new(input.clone()),
            Some(field) => {
                let json = if body.is_empty() {
                    serde_json::Value::Object(serde_json::Map::new())
                } else {
                    postern_validate::json::parse(body, limits)?
                };
                let desc = match field {
                    None => input.clone(),
                    Some(f) => match f.kind() {
                        Kind::Message(m) => m,
                        _ => input.clone(),
                    },
                };
                // Read once without keeping the path; a body that fails is read again
                // with it, to name where.
                let part = match DynamicMessage::deserialize_with_options(desc.clone(), &json, &strict) {
                    Ok(m) => Ok(m),
                    Err(_) => {
                        let mut track = serde_path_to_error::Track::new();
                        let de = serde_path_to_error::Deserializer::new(json, &mut track);
                        DynamicMessage::deserialize_with_options(desc, de, &strict).map_err(|e| (e, track))
                    }
                };
                let part = part.map_err(|(e, track)| {
                    let mut at = pointer(&track.path());
                    let text = e.to_string();
                    // An unknown field is reported on its object: name the field itself.
                    if let Some(name) =
                        text.strip_prefix("unrecognized field name '").and_then(|r| r.split('\'').next())
                    {
                        at.push('/');
                        at.push_str(&name.replace('~', "~0").replace('/', "~1"));
                    }
                    invalid("body", at, text.chars().take(200).collect())
                })?;
                match field {
                    None => part,
                    Some(f) => {
                        let mut m = DynamicMessage::new(input.clone());
                        m.set_field(f, Value::Message(part));
                        m
                    }
                }
            }
        };
        let mut errors = Vec::new();
        for (fields, text) in b.bound.iter().zip(&self.vars) {
            let Some(last) = fields.last() else { continue };
            match parse_value(last, text) {
                Ok(v) => set(&mut msg, fields, v),
                Err(e) => {
                    let (pointer, message) = (format!("/{}", last.name()), e.to_string());
                    errors.push(FieldError { location: "path", pointer, message })
                }
            }
        }
        // The query fills what neither the path nor the body (`*` takes it all) bound.
        if let Some(q) = query {
            for (k, v) in form_urlencoded::parse(q.as_bytes()) {
                let path: Vec<String> = k.split('.').map(str::to_owned).collect();
                let at = format!("/{k}");
                let fields = match field_path(&input, &path) {
                    Ok(f) => f,
                    Err(_) => {
                        errors.push(FieldError {
                            location: "query",
                            pointer: at,
                            message: format!("is not a field of {}", input.full_name()),
                        });
                        continue;
                    }
                };
                let taken = matches!(b.body, Some(None))
                    || matches!(&b.body, Some(Some(bf)) if fields[0].number() == bf.number())
                    || b.bound.iter().any(|bf| {
                        bf.iter().map(FieldDescriptor::number).eq(fields.iter().map(FieldDescriptor::number))
                    });
                let Some(last) = fields.last() else { continue };
                if taken {
                    errors.push(FieldError {
                        location: "query",
                        pointer: at,
                        message: "is already given by the path or the body".into(),
                    });
                    continue;
                }
                if !scalar(last) {
                    errors.push(FieldError { location: "query", pointer: at, message: "is not a scalar field".into() });
                    continue;
                }
                match parse_value(last, &v) {
                    Ok(val) => set(&mut msg, &fields, val),
                    Err(e) => errors.push(FieldError { location: "query", pointer: at, message: e.to_string() }),
                }
            }
        }
        if !errors.is_empty() {
            errors.truncate(postern_model::validate::MAX_FIELD_ERRORS);
            return Err(Refusal::Invalid(errors));
        }
        // The frame's length is patched in after: measuring the message first would walk
        // it once more (nested messages are measured as they are written anyway).
        let mut out = BytesMut::with_capacity(5 + body.len());
        out.put_bytes(0, 5);
        msg.encode_raw(&mut out);
        let len = u32::try_from(out.len() - 5).map_err(|_| invalid("body", String::new(), "too large".into()))?;
        out[1..5].copy_from_slice(&len.to_be_bytes());
        Ok(out.freeze())
    }

    /// The JSON answer to a call that ended with status OK: the output message (or its
    /// `response_body` field), one line per message for a streaming method.
    pub fn response(&self, body: &[u8]) -> Result<Vec<u8>, ResponseError> {
        let b = self.binding;
        let out_desc = b.rpc.output();
        // Fields at their default are left out, as the proto3 JSON mapping does by
        // default (a backend echoing empty messages cannot make the answer balloon).
        let opts = SerializeOptions::new().skip_default_fields(true);
        let mut json = Vec::new();
        let mut rest = body;
        let mut count = 0;
        while !rest.is_empty() {
            if rest.len() < 5 {
                return Err(ResponseError::CutShort);
            }
            if rest[0] != 0 {
                return Err(ResponseError::Compressed);
            }
            let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
            let payload = rest.get(5..5 + len).ok_or(ResponseError::CutShort)?;
            rest = &rest[5 + len..];
            let msg = DynamicMessage::decode(out_desc.clone(), payload).map_err(ResponseError::Decode)?;
            let shown = match &b.response_body {
                None => msg,
                Some(f) => match msg.get_field(f).into_owned() {
                    Value::Message(m) => m,
                    _ => msg,
                },
            };
            if count > 0 {
                json.push(b'\n');
            }
            let mut ser = serde_json::Serializer::new(&mut json);
            shown.serialize_with_options(&mut ser, &opts).map_err(ResponseError::Json)?;
            count += 1;
            if json.len() > MAX_JSON_ANSWER {
                return Err(ResponseError::TooLarge);
            }
        }
        if count == 0 && !b.server_streaming() {
            return Err(ResponseError::Empty);
        }
        if b.server_streaming() && count > 0 {
            json.push(b'\n');
        }
        Ok(json)
    }
}

/// A gRPC status code's name (lowercase), HTTP status and problem code: one fixed table
/// (google/rpc/code.proto's mapping).
pub fn status(code: u32) -> (StatusCode, &'static str) {
    match code {
        1 => (StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST), "cancelled"),
        2 => (StatusCode::INTERNAL_SERVER_ERROR, "unknown"),
        3 => (StatusCode::BAD_REQUEST, "invalid_argument"),
        4 => (StatusCode::GATEWAY_TIMEOUT, "deadline_exceeded"),
        5 => (StatusCode::NOT_FOUND, "not_found"),
        6 => (StatusCode::CONFLICT, "already_exists"),
        7 => (StatusCode::FORBIDDEN, "permission_denied"),
        8 => (StatusCode::TOO_MANY_REQUESTS, "resource_exhausted"),
        9 => (StatusCode::BAD_REQUEST, "failed_precondition"),
        10 => (StatusCode::CONFLICT, "aborted"),
        11 => (StatusCode::BAD_REQUEST, "out_of_range"),
        12 => (StatusCode::NOT_IMPLEMENTED, "unimplemented"),
        13 => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        14 => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
        15 => (StatusCode::INTERNAL_SERVER_ERROR, "data_loss"),
        16 => (StatusCode::UNAUTHORIZED, "unauthenticated"),
        _ => (StatusCode::INTERNAL_SERVER_ERROR, "unknown"),
    }
}

/// The call's status and message from its trailers (or, for a trailers-only answer,
/// its headers): `None` when neither carries `grpc-status`.
pub fn outcome(headers: &HeaderMap, trailers: Option<&HeaderMap>) -> Option<(u32, String)> {
    let from = |h: &HeaderMap| {
        let code = h.get("grpc-status")?.to_str().ok()?.trim().parse::<u32>().ok()?;
        let message = h
            .get("grpc-message")
            .and_then(|v| v.to_str().ok())
            .map(|m| percent_encoding::percent_decode_str(m).decode_utf8_lossy().into_owned())
            .unwrap_or_default();
        Some((code, message))
    };
    trailers.and_then(from).or_else(|| from(headers))
}

/// Removes every `grpc-*` header: a call's gRPC headers are the gateway's alone on the
/// way in, and gRPC's own headers are not the JSON caller's on the way out.
pub fn strip_grpc_headers(h: &mut http::HeaderMap) {
    let grpc: Vec<http::HeaderName> = h.keys().filter(|k| k.as_str().starts_with("grpc-")).cloned().collect();
    for k in grpc {
        h.remove(k);
    }
}

/// `grpc-timeout` for what is left of a deadline (at most 8 digits, in milliseconds).
pub fn timeout_header(left: std::time::Duration) -> String {
    format!("{}m", left.as_millis().clamp(1, 99_999_999))
}

#[cfg(test)]
mod tests;
