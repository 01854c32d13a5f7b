//! `guest-panic`: panics with `boom` in `on_request`. The SDK logs
//! `filter panicked at ...: boom` at error level, then the instance traps; the
//! gateway must fail the request and keep serving. With the config `"init"` it panics
//! in `init` instead: the gateway must refuse the attachment.
#![no_std]

use postern_filter_sdk::prelude::*;

/// The filter.
pub struct GuestPanic;

impl Filter for GuestPanic {
    fn init() -> Result<(), String> {
        if config() == b"\"init\"" {
            panic!("boom in init");
        }
        Ok(())
    }

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
    #[should_panic(expected = "boom in init")]
    fn init_panics_when_told_to() {
        testing::set_config(r#""init""#);
        let _ = GuestPanic::init();
    }

    #[test]
    #[should_panic(expected = "boom")]
    fn on_request_panics() {
        GuestPanic::on_request(&testing::request("GET", "/"), &testing::context());
    }
}
