//! `__NAME__`: answers 426 (problem+json) to clients older than a minimum version, and
//! marks the requests it lets through.
//!
//! Config: `{"header": "x-client-version", "minimum": "2.1"}`. The client's version is
//! read from `header` as dotted numbers (`2.0.7`); a missing or unreadable version is
//! too old. A bad config (an unknown field, a minimum that is not a version) is refused
//! when the gateway builds its snapshot (`init`).
#![no_std]

use postern_filter_sdk::prelude::*;
use serde::Deserialize;

/// The filter.
pub struct __TYPE__;

/// The attachment's config.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The request header that carries the client's version.
    pub header: String,
    /// The oldest version let through.
    pub minimum: String,
}

/// A parsed config: the minimum as numbers.
pub struct Parsed {
    header: String,
    minimum: Vec<u32>,
    shown: String,
}

/// `2.0.7` as `[2, 0, 7]`; `None` unless it is dotted numbers.
fn version(s: &str) -> Option<Vec<u32>> {
    s.trim().split('.').map(|p| p.parse().ok()).collect()
}

/// Parses and checks a config: what `init` runs once per attachment.
pub fn parse_config(bytes: &[u8]) -> Result<Parsed, String> {
    let cfg: Config = parse_config_json(bytes)?;
    let minimum = version(&cfg.minimum)
        .ok_or_else(|| format!("minimum: {:?} is not a version like 2.1", cfg.minimum))?;
    Ok(Parsed {
        header: cfg.header.to_ascii_lowercase(),
        minimum,
        shown: cfg.minimum,
    })
}

/// The config, parsed once per attachment: each request starts with it parsed.
static CONFIG: ParsedConfig<Parsed> = ParsedConfig::new(parse_config);

impl Filter for __TYPE__ {
    fn init() -> Result<(), String> {
        CONFIG.prepare()
    }

    fn on_request(req: &Request, cx: &Context) -> Decision {
        CONFIG.with(|cfg| match cfg {
            Ok(cfg) => check(cfg, req, cx),
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

fn check(cfg: &Parsed, req: &Request, cx: &Context) -> Decision {
    let sent = req.header_str(&cfg.header);
    match sent.and_then(version) {
        Some(v) if v >= cfg.minimum => {
            counter_add("current", 1);
            Decision::forward().set_header("x-client-version-checked", "ok")
        }
        _ => {
            log::info(format!(
                "client version {} is below {}",
                sent.unwrap_or("(none)"),
                cfg.shown
            ));
            counter_add("too_old", 1);
            // No `upgrade` header: the gateway owns it (a reply naming it is refused).
            let detail = format!("this API needs {} {} or later", cfg.header, cfg.shown);
            Decision::problem(426, "client_too_old", detail, cx)
        }
    }
}

export_filter!(__TYPE__);

#[cfg(test)]
mod tests {
    use super::*;
    use postern_filter_sdk::{Level, testing};

    const CONFIG_JSON: &str = r#"{"header": "x-client-version", "minimum": "2.1"}"#;

    fn run(version: Option<&str>) -> Decision {
        testing::set_config(CONFIG_JSON);
        let mut req = testing::request("GET", "/orders");
        if let Some(v) = version {
            req = req.header("x-client-version", v);
        }
        __TYPE__::on_request(&req, &testing::context())
    }

    #[test]
    fn a_current_client_is_forwarded_and_marked() {
        for v in ["2.1", "2.1.0", "2.10", "3"] {
            let d = run(Some(v));
            assert_eq!(
                d.edits()
                    .expect("forwarded")
                    .set_value_str("x-client-version-checked"),
                Some("ok"),
                "{v}"
            );
            assert_eq!(testing::check(&d), Ok(()));
        }
    }

    #[test]
    fn an_old_client_gets_a_426_problem() {
        let d = run(Some("2.0.9"));
        assert_eq!(d.status(), Some(426));
        let reply = d.reply().expect("answered");
        assert_eq!(
            reply.header_str("content-type"),
            Some("application/problem+json")
        );
        let body = reply.body_json().expect("JSON");
        assert_eq!(body["code"], "client_too_old");
        assert_eq!(body["request_id"], "test-request");
        assert_eq!(testing::check(&d), Ok(()), "the gateway takes this answer");
        assert!(testing::logged(
            Level::Info,
            "client version 2.0.9 is below 2.1"
        ));
        assert_eq!(testing::counter("too_old"), 1);
    }

    #[test]
    fn no_version_is_too_old() {
        assert_eq!(run(None).status(), Some(426));
        assert_eq!(run(Some("latest")).status(), Some(426));
    }

    #[test]
    fn a_bad_config_is_refused() {
        assert!(parse_config(br#"{"header": "x-client-version", "minimum": "two"}"#).is_err());
        assert!(parse_config(br#"{"header": "x-v", "minimum": "2", "max": "3"}"#).is_err());
        testing::set_config(r#"{"minimum": "2"}"#);
        assert_eq!(
            __TYPE__::on_request(&testing::request("GET", "/"), &testing::context())
                .status(),
            Some(500)
        );
    }
}
