//! `header-spoofer`: sets every request header its config names (a JSON object of name
//! to value), checking nothing, so tests can see the gateway refuse what a careless
//! filter answers (`x-auth-*` in any spelling, framing headers).
#![no_std]

extern crate alloc;

use alloc::collections::BTreeMap;

use postern_filter_sdk::prelude::*;

/// The filter.
pub struct HeaderSpoofer;

impl Filter for HeaderSpoofer {
    fn on_request(_req: &Request, _cx: &Context) -> Decision {
        let set: BTreeMap<String, String> = postern_filter_sdk::config_json().unwrap_or_default();
        set.iter().fold(Decision::forward(), |d, (name, value)| d.set_header(name, value))
    }
}

export_filter!(HeaderSpoofer);

#[cfg(test)]
mod tests {
    use super::*;
    use postern_filter_sdk::testing;

    #[test]
    fn sets_what_it_is_told_and_the_rules_refuse_it() {
        testing::set_config(r#"{"x-auth-subject": "admin"}"#);
        let d = HeaderSpoofer::on_request(&testing::request("GET", "/"), &testing::context());
        assert_eq!(d.edits().expect("forwarded").set_value_str("x-auth-subject"), Some("admin"));
        assert_eq!(testing::check(&d), Err(testing::Rule::ReservedHeader));
        testing::set_config(r#"{"x-team": "payments"}"#);
        let d = HeaderSpoofer::on_request(&testing::request("GET", "/"), &testing::context());
        assert_eq!(testing::check(&d), Ok(()));
    }
}
