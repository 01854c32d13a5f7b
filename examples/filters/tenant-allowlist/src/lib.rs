//! `tenant-allowlist`: lets a request through only if the verified caller's tenant is
//! listed.
//!
//! Config:
//!
//! ```json
//! {"tenants": ["acme", "globex"]}
//! ```
//!
//! The tenant comes from the identity the gateway verified (attach this filter to a
//! route that authenticates); headers are never trusted for it. Tenants match
//! exactly (case-sensitive). A request without an identity, or whose identity has no
//! tenant, or whose tenant is not listed, is answered with 403
//! `{"code":"tenant_not_allowed"}` and counted in `denied`; an allowed one is counted
//! in `allowed`. The config is parsed once per attachment, in `init`: an invalid one
//! is refused when the gateway builds its snapshot, and where `init` did not run it
//! fails every request with 500 `{"code":"filter_misconfigured"}` (an allowlist must
//! never fail open); an empty list denies everyone.
#![no_std]

use postern_filter_sdk::prelude::*;
use postern_filter_sdk::serde_json::json;
use serde::Deserialize;

/// The filter.
pub struct TenantAllowlist;

/// The attachment's config.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The tenants let through.
    pub tenants: Vec<String>,
}

fn deny(why: &str) -> Decision {
    log::info(format!("tenant not allowed: {why}"));
    counter_add("denied", 1);
    Decision::respond(403).json(json!({"code": "tenant_not_allowed"}))
}

/// The config, parsed once per attachment (in `init`, when the gateway builds its
/// snapshot).
static CONFIG: ParsedConfig<Config> = ParsedConfig::new(parse_config_json);

impl Filter for TenantAllowlist {
    fn init() -> Result<(), String> {
        CONFIG.prepare()
    }

    fn on_request(_req: &Request, cx: &Context) -> Decision {
        CONFIG.with(|cfg| match cfg {
            Ok(cfg) => check(cfg, cx),
            Err(e) => {
                log::error(e);
                Decision::respond(500).json(json!({"code": "filter_misconfigured"}))
            }
        })
    }
}

/// Lets the caller through if its verified tenant is listed.
fn check(cfg: &Config, cx: &Context) -> Decision {
    let Some(identity) = &cx.identity else {
        return deny("no verified caller");
    };
    let Some(tenant) = identity.tenant.as_deref() else {
        return deny("the caller has no tenant");
    };
    if !cfg.tenants.iter().any(|t| t == tenant) {
        return deny(&format!("{tenant:?} is not listed"));
    }
    counter_add("allowed", 1);
    Decision::forward()
}

export_filter!(TenantAllowlist);

#[cfg(test)]
mod tests {
    use super::*;
    use postern_filter_sdk::{Level, testing};

    fn check(cx: &Context) -> Decision {
        let req = testing::request("GET", "/invoices").header("x-tenant", "acme");
        TenantAllowlist::on_request(&req, cx)
    }

    fn assert_denied(d: &Decision) {
        assert_eq!(d.status(), Some(403));
        assert_eq!(d.reply().and_then(|r| r.body_json()), Some(json!({"code": "tenant_not_allowed"})));
    }

    fn as_tenant(tenant: &str) -> Context {
        testing::context().with_identity(testing::identity().with_subject("u1").with_tenant(tenant))
    }

    #[test]
    fn listed_tenant_is_forwarded_unchanged() {
        testing::set_config(r#"{"tenants": ["acme", "globex"]}"#);
        let d = check(&as_tenant("globex"));
        assert!(d.edits().expect("forwarded").is_empty());
        assert_eq!(testing::counter("allowed"), 1);
    }

    #[test]
    fn unlisted_tenant_is_denied() {
        testing::set_config(r#"{"tenants": ["acme"]}"#);
        assert_denied(&check(&as_tenant("initech")));
        // Exact match: no case folding, no prefixes.
        assert_denied(&check(&as_tenant("ACME")));
        assert_denied(&check(&as_tenant("acme2")));
        assert_eq!(testing::counter("denied"), 3);
        assert!(testing::logged(Level::Info, "\"initech\" is not listed"));
    }

    #[test]
    fn no_identity_is_denied_even_with_a_tenant_header() {
        testing::set_config(r#"{"tenants": ["acme"]}"#);
        assert_denied(&check(&testing::context()));
    }

    #[test]
    fn identity_without_tenant_is_denied() {
        testing::set_config(r#"{"tenants": ["acme"]}"#);
        let cx = testing::context().with_identity(testing::identity().with_client_id("app"));
        assert_denied(&check(&cx));
    }

    #[test]
    fn empty_list_denies_everyone() {
        testing::set_config(r#"{"tenants": []}"#);
        assert_denied(&check(&as_tenant("acme")));
    }

    #[test]
    fn invalid_config_fails_closed() {
        for bad in ["", r#"{"tenants": "acme"}"#, r#"{"tenant": ["acme"]}"#] {
            testing::reset();
            testing::set_config(bad);
            let d = check(&as_tenant("acme"));
            assert_eq!(d.status(), Some(500), "{bad:?}");
            assert!(testing::logged(Level::Error, "config"), "{bad:?}");
        }
    }
}
