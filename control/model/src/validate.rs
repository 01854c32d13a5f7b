//! A route's request validation, compiled by `posternctl` from its team's OpenAPI
//! operation: self-contained JSON Schema 2020-12 documents (every `$ref` local to the
//! document, OpenAPI 3.0's dialect rewritten), built into validators once per snapshot
//! by the node. Nothing here is resolved, fetched or parsed per request.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// What a route checks of each request before it reaches the backend.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Validation {
    /// Where it came from, for messages: `teams/orders/openapi/orders.yaml#createOrder`.
    pub source: String,
    /// Path, query and header parameters (path-level ones merged with the operation's).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub parameters: Vec<Parameter>,
    /// The request body the operation declares, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body: Option<RequestBody>,
    /// Caps applied while a JSON body is read, before any schema runs.
    #[serde(default)]
    pub json: JsonLimits,
}

/// Where a parameter travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ParamIn {
    /// A `{name}` segment of the route's path.
    Path,
    /// The query string.
    Query,
    /// A request header (its name is matched without regard to case).
    Header,
}

impl ParamIn {
    /// Lowercase name, as OpenAPI spells it and as errors report it.
    pub fn as_str(self) -> &'static str {
        match self {
            ParamIn::Path => "path",
            ParamIn::Query => "query",
            ParamIn::Header => "header",
        }
    }
}

/// The JSON type a parameter's text is read as before its schema runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scalar {
    /// Kept as text.
    String,
    /// A JSON integer.
    Integer,
    /// A JSON number.
    Number,
    /// `true` or `false`.
    Boolean,
}

/// How a parameter's text becomes a JSON value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", tag = "kind")]
pub enum ParamShape {
    /// One value.
    Scalar {
        /// Its type.
        of: Scalar,
    },
    /// A list: comma-separated (style `simple`, or `form` without explode), or one query
    /// pair per item (`form` with explode, OpenAPI's default for queries).
    Array {
        /// The items' type.
        of: Scalar,
        /// One query pair per item.
        explode: bool,
    },
}

/// One parameter of the operation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Parameter {
    /// Its name (lowercase for headers).
    pub name: String,
    /// Where it travels.
    #[serde(rename = "in")]
    pub location: ParamIn,
    /// Refused when absent.
    pub required: bool,
    /// How its text is read.
    pub shape: ParamShape,
    /// Its schema, self-contained.
    pub schema: Value,
}

/// The operation's request body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestBody {
    /// Refused when absent or empty.
    pub required: bool,
    /// The media types it may have, most specific first.
    pub media: Vec<Media>,
}

/// One media type of a request body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Media {
    /// The media range as the spec declares it, lowercase, without parameters:
    /// `application/json`, `application/*`, `*/*`.
    pub range: String,
    /// The body's schema, self-contained; only JSON media types (`.../json`,
    /// `...+json`) are validated, the rest are only admitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schema: Option<Value>,
}

/// Caps on a JSON body, checked as it is read (each breach is a 400 naming it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct JsonLimits {
    /// Arrays and objects nested deeper than this are refused.
    pub max_depth: u32,
    /// A string (a value or a key) longer than this, in bytes once unescaped.
    pub max_string_bytes: u32,
    /// A number written with more characters than this.
    pub max_number_chars: u32,
}

impl Default for JsonLimits {
    fn default() -> Self {
        JsonLimits { max_depth: 32, max_string_bytes: 64 * 1024, max_number_chars: 32 }
    }
}

/// Platform bounds on [`JsonLimits`].
pub const MAX_JSON_DEPTH: u32 = 128;
/// Platform bound on a route's number length cap.
pub const MAX_JSON_NUMBER_CHARS: u32 = 1024;

/// How much larger than its encoded form a request body may decode to (a gzip, brotli
/// or zstd bomb is refused once it passes this or the route's limit).
pub const MAX_DECODE_RATIO: u64 = 100;

/// At most this many field errors are reported in one answer.
pub const MAX_FIELD_ERRORS: usize = 20;
