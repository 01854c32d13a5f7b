//! `guest-panic`: panics with `boom` in `on_request`. The SDK logs
//! `filter panicked at ...: boom` at error level, then the instance traps; the
//! gateway must fail the request and keep serving.
#![no_std]

use postern_filter_sdk::prelude::*;

/// The filter.
pub struct GuestPanic;

impl Filter for GuestPanic {
    fn on_request(_req: &Request, _cx: &Context) -> Decision {
        panic!("boom");
    }
}

export_filter!(GuestPanic);

#[cfg(test)]
mod tests {
    use super::*;
    use postern_filter_sdk::testing;

    #[test]
    #[should_panic(expected = "boom")]
    fn on_request_panics() {
        GuestPanic::on_request(&testing::request("GET", "/"), &testing::context());
    }
}
