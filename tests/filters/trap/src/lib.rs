//! `trap`: executes the wasm `unreachable` instruction in `on_request` (or, with the
//! config `"response"`, only in `on_response`). The gateway must turn the trap into a
//! failed request under the attachment's failure policy and keep serving.
#![no_std]

use postern_filter_sdk::prelude::*;

/// The filter.
pub struct Trap;

fn unreachable() -> ! {
    #[cfg(target_arch = "wasm32")]
    core::arch::wasm32::unreachable();
    #[cfg(not(target_arch = "wasm32"))]
    panic!("trap: the wasm32 build executes `unreachable` here");
}

fn in_response_only() -> bool {
    config() == b"\"response\""
}

impl Filter for Trap {
    fn on_request(_req: &Request, _cx: &Context) -> Decision {
        if in_response_only() {
            return Decision::forward();
        }
        unreachable()
    }

    fn on_response(_resp: &ResponseHead, _cx: &Context) -> ResponseEdits {
        unreachable()
    }
}

export_filter!(Trap);

#[cfg(test)]
mod tests {
    use super::*;
    use postern_filter_sdk::testing;

    #[test]
    #[should_panic(expected = "unreachable")]
    fn on_request_traps() {
        Trap::on_request(&testing::request("GET", "/"), &testing::context());
    }

    #[test]
    #[should_panic(expected = "unreachable")]
    fn on_response_traps() {
        Trap::on_response(&testing::response(200), &testing::context());
    }
}
