//! `__NAME__`: lets a request through only if the verified caller's tenant is listed.
//!
//! Config: `{"tenants": ["acme", "globex"]}`. The tenant comes from the identity the
//! gateway verified (attach it to a route that authenticates), never from a header. An
//! empty list lets no one through.
#![no_std]

use postern_filter_sdk::prelude::*;
use serde::Deserialize;

/// The filter.
pub struct __TYPE__;

/// The attachment's config.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The tenants let through (exact, case-sensitive).
    pub tenants: Vec<String>,
}

/// The config, parsed once per attachment: each request starts with it parsed.
static CONFIG: ParsedConfig<Config> = ParsedConfig::new(parse_config_json);

impl Filter for __TYPE__ {
    fn init() -> Result<(), String> {
        CONFIG.prepare()
    }

    fn on_request(_req: &Request, cx: &Context) -> Decision {
        CONFIG.with(|cfg| match cfg {
            Ok(cfg) => check(cfg, cx),
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

fn check(cfg: &Config, cx: &Context) -> Decision {
    match cx.tenant() {
        Some(t) if cfg.tenants.iter().any(|allowed| allowed == t) => {
            counter_add("allowed", 1);
            Decision::forward()
        }
        tenant => {
            let who = tenant.map_or("a caller without a tenant".to_owned(), |t| {
                format!("tenant {t:?}")
            });
            log::info(format!("{who} is not allowed"));
            counter_add("denied", 1);
            Decision::problem(
                403,
                "tenant_not_allowed",
                "this API is not open to your tenant",
                cx,
            )
        }
    }
}

export_filter!(__TYPE__);

#[cfg(test)]
mod tests {
    use super::*;
    use postern_filter_sdk::{Level, testing};

    fn as_tenant(tenant: &str) -> Context {
        testing::context().with_identity(testing::identity().with_tenant(tenant))
    }

    #[test]
    fn a_listed_tenant_is_forwarded() {
        testing::set_config(r#"{"tenants": ["acme"]}"#);
        let d = __TYPE__::on_request(&testing::request("GET", "/"), &as_tenant("acme"));
        assert!(d.is_forward());
        assert_eq!(testing::counter("allowed"), 1);
    }

    #[test]
    fn others_get_a_403_problem() {
        testing::set_config(r#"{"tenants": ["acme"]}"#);
        for cx in [as_tenant("initech"), as_tenant("ACME"), testing::context()] {
            let d = __TYPE__::on_request(&testing::request("GET", "/"), &cx);
            assert_eq!(d.status(), Some(403));
            assert_eq!(
                d.reply().and_then(|r| r.body_json()).expect("JSON")["code"],
                "tenant_not_allowed"
            );
            assert_eq!(testing::check(&d), Ok(()));
        }
        assert!(testing::logged(Level::Info, "\"initech\" is not allowed"));
    }

    #[test]
    fn a_bad_config_fails_closed() {
        testing::set_config(r#"{"tenant": ["acme"]}"#);
        assert_eq!(
            __TYPE__::on_request(&testing::request("GET", "/"), &as_tenant("acme")).status(),
            Some(500)
        );
    }
}
