//! `trap`: executes the wasm `unreachable` instruction in `on_request`. The gateway
//! must turn the trap into a failed request and keep serving.
#![no_std]

use postern_filter_sdk::prelude::*;

/// The filter.
pub struct Trap;

impl Filter for Trap {
    fn on_request(_req: &Request, _cx: &Context) -> Decision {
        #[cfg(target_arch = "wasm32")]
        core::arch::wasm32::unreachable();
        #[cfg(not(target_arch = "wasm32"))]
        panic!("trap: the wasm32 build executes `unreachable` here");
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
}
