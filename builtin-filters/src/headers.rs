//! `request-headers` and `response-headers`: set, add and remove headers (the Gateway
//! API's `RequestHeaderModifier` / `ResponseHeaderModifier`).
//!
//! Config: `{"set": [{"name": .., "value": ..}], "add": [..], "remove": [names]}`.
//! Identity (`x-auth-*`), hop-by-hop and framing headers cannot be touched: the gateway
//! owns them.

use std::sync::Arc;

use postern_filter_contract::http::{HeaderMap, HeaderName, HeaderValue};
use postern_filter_contract::{
    ConfigError, Context, Filter, FilterFactory, Flow, RequestHead, ResponseFlow, ResponseHead,
};
use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct HeaderPair {
    name: String,
    value: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    #[serde(default)]
    set: Vec<HeaderPair>,
    #[serde(default)]
    add: Vec<HeaderPair>,
    #[serde(default)]
    remove: Vec<String>,
}

/// Headers only the gateway may set or remove.
const RESERVED: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "content-length",
    "host",
    "x-request-id",
];

fn header_name(field: &str, name: &str) -> Result<HeaderName, ConfigError> {
    let n = HeaderName::from_bytes(name.as_bytes())
        .map_err(|_| ConfigError::new(format!("{field}: {name:?} is not a valid header name")))?;
    if n.as_str().starts_with("x-auth-") || RESERVED.contains(&n.as_str()) {
        return Err(ConfigError::new(format!("{field}: header {name:?} is reserved for the gateway")));
    }
    Ok(n)
}

/// A compiled header modification.
#[derive(Debug, Default)]
pub struct HeaderEdit {
    set: Vec<(HeaderName, HeaderValue)>,
    add: Vec<(HeaderName, HeaderValue)>,
    remove: Vec<HeaderName>,
}

impl HeaderEdit {
    fn parse(config: &serde_json::Value) -> Result<HeaderEdit, ConfigError> {
        let c: Config = serde_json::from_value(config.clone()).map_err(|e| ConfigError::new(e.to_string()))?;
        let pairs = |field: &str, list: &[HeaderPair]| -> Result<Vec<(HeaderName, HeaderValue)>, ConfigError> {
            list.iter()
                .map(|p| {
                    let v = HeaderValue::from_str(&p.value).map_err(|_| {
                        ConfigError::new(format!("{field}: value of {:?} is not a valid header value", p.name))
                    })?;
                    Ok((header_name(field, &p.name)?, v))
                })
                .collect()
        };
        Ok(HeaderEdit {
            set: pairs("set", &c.set)?,
            add: pairs("add", &c.add)?,
            remove: c.remove.iter().map(|n| header_name("remove", n)).collect::<Result<_, _>>()?,
        })
    }

    /// Applies the edit: remove, then set, then add.
    pub fn apply(&self, headers: &mut HeaderMap) {
        for n in &self.remove {
            headers.remove(n);
        }
        for (n, v) in &self.set {
            headers.insert(n.clone(), v.clone());
        }
        for (n, v) in &self.add {
            headers.append(n.clone(), v.clone());
        }
    }
}

struct RequestHeaders(HeaderEdit);

impl Filter for RequestHeaders {
    fn on_request<'a>(&'a self, req: &'a mut RequestHead, _cx: &'a Context) -> Flow<'a> {
        self.0.apply(&mut req.headers);
        Flow::Continue
    }
}

struct ResponseHeaders(HeaderEdit);

impl Filter for ResponseHeaders {
    fn on_response<'a>(&'a self, resp: &'a mut ResponseHead, _cx: &'a Context) -> ResponseFlow<'a> {
        self.0.apply(&mut resp.headers);
        ResponseFlow::Done
    }
}

/// Factory for `request-headers`.
pub struct RequestHeadersFactory;

impl FilterFactory for RequestHeadersFactory {
    fn kind(&self) -> &'static str {
        "request-headers"
    }

    fn build(&self, config: &serde_json::Value) -> Result<Arc<dyn Filter>, ConfigError> {
        Ok(Arc::new(RequestHeaders(HeaderEdit::parse(config)?)))
    }
}

/// Factory for `response-headers`.
pub struct ResponseHeadersFactory;

impl FilterFactory for ResponseHeadersFactory {
    fn kind(&self) -> &'static str {
        "response-headers"
    }

    fn build(&self, config: &serde_json::Value) -> Result<Arc<dyn Filter>, ConfigError> {
        Ok(Arc::new(ResponseHeaders(HeaderEdit::parse(config)?)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn edits_apply_in_order() {
        let e = HeaderEdit::parse(&json!({
            "set": [{"name": "x-a", "value": "1"}],
            "add": [{"name": "x-b", "value": "2"}],
            "remove": ["x-c"]
        }))
        .unwrap();
        let mut h = HeaderMap::new();
        h.insert("x-a", HeaderValue::from_static("0"));
        h.insert("x-b", HeaderValue::from_static("1"));
        h.insert("x-c", HeaderValue::from_static("gone"));
        e.apply(&mut h);
        assert_eq!(h.get("x-a").unwrap(), "1");
        assert_eq!(h.get_all("x-b").iter().count(), 2);
        assert!(h.get("x-c").is_none());
    }

    #[test]
    fn reserved_and_invalid_headers_are_refused() {
        for cfg in [
            json!({"set": [{"name": "x-auth-subject", "value": "admin"}]}),
            json!({"remove": ["connection"]}),
            json!({"set": [{"name": "bad name", "value": "1"}]}),
            json!({"set": [{"name": "x-ok", "value": "line\nbreak"}]}),
            json!({"sett": []}),
        ] {
            assert!(HeaderEdit::parse(&cfg).is_err(), "{cfg} accepted");
        }
    }

    #[test]
    fn registry_finds_kinds() {
        assert!(crate::build("request-headers", &json!({})).is_ok());
        assert!(crate::build("response-headers", &json!({})).is_ok());
        assert!(crate::build("nope", &json!({})).is_err());
    }
}
