//! `__NAME__`: sets request headers from its config, and counts what it forwarded.
//!
//! Config: `{"set": {"x-team": "payments"}}`. A header the gateway owns (`x-auth-*`,
//! `host`, `upgrade`, ...) or a name that is not a lowercase HTTP token is refused when
//! the gateway builds its snapshot (`init`).
#![no_std]

extern crate alloc;

use alloc::collections::BTreeMap;

use postern_filter_sdk::prelude::*;
use postern_filter_sdk::rules;
use serde::Deserialize;

/// The filter.
pub struct __TYPE__;

/// The attachment's config.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Headers to set on the request (replacing what the client sent).
    pub set: BTreeMap<String, String>,
}

/// Parses and checks a config: what `init` runs once per attachment.
pub fn parse_config(bytes: &[u8]) -> Result<Config, String> {
    let cfg: Config = parse_config_json(bytes)?;
    for (name, value) in &cfg.set {
        if name.bytes().any(|b| b.is_ascii_uppercase())
            || rules::output::header_name(name.as_bytes()).is_err()
        {
            return Err(format!("set: {name:?} is not a header this filter may set"));
        }
        if rules::output::header_value(value.as_bytes()).is_err() {
            return Err(format!("set: the value of {name:?} has control characters"));
        }
    }
    Ok(cfg)
}

/// The config, parsed once per attachment: each request starts with it parsed.
static CONFIG: ParsedConfig<Config> = ParsedConfig::new(parse_config);

impl Filter for __TYPE__ {
    fn init() -> Result<(), String> {
        CONFIG.prepare()
    }

    fn on_request(_req: &Request, cx: &Context) -> Decision {
        CONFIG.with(|cfg| match cfg {
            Ok(cfg) => {
                counter_add("forwarded", 1);
                cfg.set
                    .iter()
                    .fold(Decision::forward(), |d, (name, value)| {
                        d.set_header(name, value)
                    })
            }
            Err(e) => {
                log::error(format!("config: {e}"));
                Decision::problem(
                    500,
                    "filter_misconfigured",
                    "the filter's config is invalid",
                    cx,
                )
            }
        })
    }
}

export_filter!(__TYPE__);

#[cfg(test)]
mod tests {
    use super::*;
    use postern_filter_sdk::testing;

    #[test]
    fn sets_the_configured_headers() {
        testing::set_config(r#"{"set": {"x-team": "payments"}}"#);
        let d =
            __TYPE__::on_request(&testing::request("GET", "/orders"), &testing::context());
        assert_eq!(
            d.edits().expect("forwarded").set_value_str("x-team"),
            Some("payments")
        );
        assert_eq!(testing::check(&d), Ok(()), "the gateway takes this answer");
        assert_eq!(testing::counter("forwarded"), 1);
    }

    #[test]
    fn a_header_the_gateway_owns_is_refused() {
        assert!(parse_config(br#"{"set": {"x-auth-subject": "admin"}}"#).is_err());
        assert!(parse_config(br#"{"set": {"X-Team": "a"}}"#).is_err());
        assert!(
            parse_config(br#"{"sett": {}}"#).is_err(),
            "unknown fields are refused"
        );
    }

    #[test]
    fn a_bad_config_fails_closed() {
        testing::set_config(r#"{"set": "x"}"#);
        let d = __TYPE__::on_request(&testing::request("GET", "/"), &testing::context());
        assert_eq!(d.status(), Some(500));
    }
}
