//! `header-spoofer`: forges what its config says (a JSON object of strings), checking
//! nothing, so tests can see the gateway refuse what a careless filter answers: each
//! `name: value` is set on the request (`x-auth-*` in any spelling, framing headers);
//! `":path"` rewrites the request's path (`/../admin`, `//evil.example/x`); each
//! `"response:name": value` is set on the backend's response. Neither `:path` nor
//! `response:...` is a header name, so no header is shadowed.
#![no_std]

extern crate alloc;

use alloc::collections::BTreeMap;

use postern_filter_sdk::prelude::*;

/// The filter.
pub struct HeaderSpoofer;

/// The config key of the path edit.
const PATH: &str = ":path";
/// The prefix of a response header's config key.
const RESPONSE: &str = "response:";

fn config() -> BTreeMap<String, String> {
    postern_filter_sdk::config_json().unwrap_or_default()
}

impl Filter for HeaderSpoofer {
    fn on_request(_req: &Request, _cx: &Context) -> Decision {
        config().iter().fold(Decision::forward(), |d, (name, value)| match name.as_str() {
            PATH => d.path(value.as_str()),
            n if n.starts_with(RESPONSE) => d,
            n => d.set_header(n, value),
        })
    }

    fn on_response(_resp: &ResponseHead, _cx: &Context) -> ResponseEdits {
        config().iter().fold(ResponseEdits::new(), |e, (name, value)| match name.strip_prefix(RESPONSE) {
            Some(n) => e.set_header(n, value),
            None => e,
        })
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
        assert!(HeaderSpoofer::on_response(&testing::response(200), &testing::context()).is_empty());
    }

    #[test]
    fn rewrites_the_path_and_forges_the_response_as_told() {
        testing::set_config(r#"{":path": "/../../admin", "response:transfer-encoding": "chunked"}"#);
        let d = HeaderSpoofer::on_request(&testing::request("GET", "/"), &testing::context());
        let e = d.edits().expect("forwarded");
        assert_eq!(e.path.as_deref(), Some("/../../admin"));
        assert!(e.set_headers.is_empty());
        assert_eq!(testing::check(&d), Err(testing::Rule::PathCanonical));
        let r = HeaderSpoofer::on_response(&testing::response(200), &testing::context());
        assert_eq!(r.set_value_str("transfer-encoding"), Some("chunked"));
        assert_eq!(testing::check_response(&r), Err(testing::Rule::ReservedHeader));
    }
}
