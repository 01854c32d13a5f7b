//! `std-panic`: `guest-panic` built with the SDK's `std` feature, so `std`'s panic
//! machinery runs (the SDK's panic hook logs `filter panicked at ...: boom`) instead of
//! the SDK's own `#![no_std]` panic handler. The gateway must tell it apart the same way.

use postern_filter_sdk::{Context, Decision, Filter, Request, export_filter};

/// The filter.
pub struct StdPanic;

impl Filter for StdPanic {
    fn on_request(_req: &Request, _cx: &Context) -> Decision {
        panic!("boom");
    }
}

export_filter!(StdPanic);

#[cfg(test)]
mod tests {
    use super::*;
    use postern_filter_sdk::testing;

    #[test]
    #[should_panic(expected = "boom")]
    fn on_request_panics() {
        StdPanic::on_request(&testing::request("GET", "/"), &testing::context());
    }
}
