//! `header-injector`: sets and removes request headers, as its config says, and tags
//! the response with `x-filter: header-injector`.
//!
//! Config (all keys optional; an empty config changes nothing but the tag):
//!
//! ```json
//! {"set": {"x-team": "payments", "x-env": "prod"}, "remove": ["x-debug"]}
//! ```
//!
//! A name may not be both set and removed. An invalid config is refused when the
//! gateway builds its snapshot (`init`); where `init` did not run, it fails every
//! request with 500 `{"code":"filter_misconfigured"}` and an error log line, so the
//! mistake is seen at once rather than half-applied.
#![no_std]

extern crate alloc;

use alloc::collections::BTreeMap;

use postern_filter_sdk::prelude::*;
use postern_filter_sdk::rules::{self, Rule};
use postern_filter_sdk::serde_json::json;
use serde::Deserialize;

/// The filter.
pub struct HeaderInjector;

/// The attachment's config.
#[derive(Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Headers to set on the request (replacing any the client sent).
    #[serde(default)]
    pub set: BTreeMap<String, String>,
    /// Headers to remove from the request.
    #[serde(default)]
    pub remove: Vec<String>,
}

/// A header name the filter may set or remove: lowercase, as the gateway's header names
/// are, and allowed by the gateway's rules (an HTTP token it does not own), checked by the
/// same code the node applies to the filter's answer.
fn check_name(name: &str) -> Result<(), String> {
    if name.bytes().any(|b| b.is_ascii_uppercase()) {
        return Err(format!("{name:?} is not a lowercase header name"));
    }
    match rules::output::header_name(name.as_bytes()) {
        Ok(()) => Ok(()),
        Err(Rule::ReservedHeader) => Err(format!("{name:?} is a header the gateway owns")),
        Err(_) => Err(format!("{name:?} is not a lowercase header name")),
    }
}

/// Parses and checks a config; empty means "nothing to change".
pub fn parse_config(bytes: &[u8]) -> Result<Config, String> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(Config::default());
    }
    let cfg: Config = postern_filter_sdk::serde_json::from_slice(bytes).map_err(|e| format!("invalid config: {e}"))?;
    for (name, value) in &cfg.set {
        check_name(name).map_err(|e| format!("invalid config: set: {e}"))?;
        if rules::output::header_value(value.as_bytes()).is_err() {
            return Err(format!("invalid config: set: the value of {name:?} has control characters"));
        }
    }
    for name in &cfg.remove {
        check_name(name).map_err(|e| format!("invalid config: remove: {e}"))?;
        if cfg.set.contains_key(name) {
            return Err(format!("invalid config: {name:?} is both set and removed"));
        }
    }
    Ok(cfg)
}

/// The config, parsed once per attachment (in `init`, when the gateway builds its
/// snapshot): each request starts with it parsed.
static CONFIG: ParsedConfig<Config> = ParsedConfig::new(parse_config);

impl Filter for HeaderInjector {
    fn init() -> Result<(), String> {
        CONFIG.prepare()
    }

    fn on_request(_req: &Request, _cx: &Context) -> Decision {
        CONFIG.with(|cfg| {
            let cfg = match cfg {
                Ok(cfg) => cfg,
                Err(e) => {
                    log::error(e);
                    return Decision::respond(500).json(json!({"code": "filter_misconfigured"}));
                }
            };
            let mut decision = Decision::forward();
            for name in &cfg.remove {
                decision = decision.remove_header(name);
            }
            for (name, value) in &cfg.set {
                decision = decision.set_header(name, value);
            }
            decision
        })
    }

    fn on_response(_resp: &ResponseHead, _cx: &Context) -> ResponseEdits {
        ResponseEdits::new().set_header("x-filter", "header-injector")
    }
}

export_filter!(HeaderInjector);

#[cfg(test)]
mod tests {
    use super::*;
    use postern_filter_sdk::{Level, testing};

    fn run() -> Decision {
        let req = testing::request("GET", "/orders").header("x-debug", "1").header("x-team", "spoofed");
        HeaderInjector::on_request(&req, &testing::context())
    }

    #[test]
    fn sets_and_removes_headers() {
        testing::set_config(r#"{"set": {"x-team": "payments", "x-env": "prod"}, "remove": ["x-debug"]}"#);
        let d = run();
        let e = d.edits().expect("forwarded");
        assert_eq!(e.set_value_str("x-team"), Some("payments"));
        assert_eq!(e.set_value_str("x-env"), Some("prod"));
        assert!(e.is_removed("x-debug"));
        assert!(e.append_headers.is_empty());
        assert!(e.path.is_none());
        assert_eq!(testing::check(&d), Ok(()), "the node applies it");
    }

    #[test]
    fn empty_config_changes_nothing() {
        let d = run();
        assert!(d.edits().expect("forwarded").is_empty());
        testing::set_config("{}");
        assert!(run().edits().expect("forwarded").is_empty());
    }

    #[test]
    fn init_checks_the_config() {
        testing::set_config(r#"{"set": {"x-team": "payments"}}"#);
        assert_eq!(HeaderInjector::init(), Ok(()));
        testing::set_config(r#"{"set": {"X-Upper": "v"}}"#);
        let err = HeaderInjector::init().unwrap_err();
        assert!(err.contains("\"X-Upper\" is not a lowercase header name"), "{err}");
        for owned in ["x-auth-subject", "x_auth_subject", "host", "content-length"] {
            testing::set_config(format!(r#"{{"set": {{"{owned}": "v"}}}}"#));
            let err = HeaderInjector::init().unwrap_err();
            assert!(err.contains("is a header the gateway owns"), "{owned}: {err}");
            // What the node would do with it, had init let it through.
            let d = Decision::forward().set_header(owned, "v");
            assert_eq!(testing::check(&d), Err(testing::Rule::ReservedHeader), "{owned}");
        }
    }

    #[test]
    fn tags_the_response() {
        let e = HeaderInjector::on_response(&testing::response(200), &testing::context());
        assert_eq!(e.set_value_str("x-filter"), Some("header-injector"));
        assert_eq!(testing::check_response(&e), Ok(()));
    }

    #[test]
    fn invalid_config_fails_closed_and_logs() {
        for bad in [
            r#"{"set": {"x-a": 1}}"#,
            r#"{"sett": {}}"#,
            r#"{"set": {"X-Upper": "v"}}"#,
            r#"{"set": {"bad name": "v"}}"#,
            r#"{"set": {"x-a": "line\r\nbreak"}}"#,
            r#"{"remove": [""]}"#,
            r#"{"set": {"x-a": "v"}, "remove": ["x-a"]}"#,
            "not json",
        ] {
            testing::reset();
            testing::set_config(bad);
            let d = run();
            assert_eq!(d.status(), Some(500), "{bad}");
            assert_eq!(d.reply().and_then(|r| r.body_json()), Some(json!({"code": "filter_misconfigured"})));
            assert!(testing::logged(Level::Error, "invalid config"), "{bad}");
        }
    }
}
