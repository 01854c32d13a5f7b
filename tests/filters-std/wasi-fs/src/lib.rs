//! `wasi-fs`: reads `/etc/passwd` with `std::fs`, so the component imports
//! `wasi:filesystem`. The gateway must refuse to load it (a filter is granted no
//! files) or, if it loads, grant no preopened directory so the read fails.
//!
//! It forwards the request with `x-wasi-fs: read <n> bytes` or
//! `x-wasi-fs: denied: <error kind>`, so a test can see which happened; it never
//! forwards the file's contents.

use postern_filter_sdk::{Context, Decision, Filter, Request, export_filter};

/// The filter.
pub struct WasiFs;

impl Filter for WasiFs {
    fn on_request(_req: &Request, _cx: &Context) -> Decision {
        let outcome = match std::fs::read_to_string("/etc/passwd") {
            Ok(text) => format!("read {} bytes", text.len()),
            Err(e) => format!("denied: {:?}", e.kind()),
        };
        Decision::forward().set_header("x-wasi-fs", outcome)
    }
}

export_filter!(WasiFs);

#[cfg(test)]
mod tests {
    use super::*;
    use postern_filter_sdk::testing;

    #[test]
    fn reports_the_outcome_in_a_header() {
        let d = WasiFs::on_request(&testing::request("GET", "/"), &testing::context());
        let v = d.edits().and_then(|e| e.set_value_str("x-wasi-fs")).expect("header");
        assert!(v.starts_with("read ") || v.starts_with("denied: "), "{v}");
    }
}
