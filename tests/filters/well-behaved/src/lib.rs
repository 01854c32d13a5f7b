//! `well-behaved`: forwards the request with `x-well-behaved: yes`. The baseline the
//! hostile filters are compared with.
#![no_std]

use postern_filter_sdk::prelude::*;

/// The filter.
pub struct WellBehaved;

impl Filter for WellBehaved {
    fn on_request(_req: &Request, _cx: &Context) -> Decision {
        Decision::forward().set_header("x-well-behaved", "yes")
    }
}

export_filter!(WellBehaved);

#[cfg(test)]
mod tests {
    use super::*;
    use postern_filter_sdk::testing;

    #[test]
    fn sets_the_header_and_nothing_else() {
        let d = WellBehaved::on_request(&testing::request("GET", "/"), &testing::context());
        let e = d.edits().expect("forwarded");
        assert_eq!(e.set_headers, vec![("x-well-behaved".to_owned(), b"yes".to_vec())]);
        assert!(e.append_headers.is_empty() && e.remove_headers.is_empty() && e.path.is_none());
        assert!(testing::logs().is_empty());
    }
}
