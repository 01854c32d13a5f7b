//! `loop-forever`: spins forever in `on_request`. The gateway must stop it with its
//! fuel or time limit and fail the request, without stalling other requests.
#![no_std]

use core::hint::black_box;

use postern_filter_sdk::prelude::*;

/// The filter.
pub struct LoopForever;

impl Filter for LoopForever {
    fn on_request(_req: &Request, _cx: &Context) -> Decision {
        // `black_box` hides the counter from the optimiser, so the loop stays a loop
        // that does work on every iteration.
        let mut n: u64 = 0;
        loop {
            n = black_box(n.wrapping_add(1));
        }
    }
}

export_filter!(LoopForever);

#[cfg(test)]
mod tests {
    use super::*;
    use postern_filter_sdk::testing;

    // `on_request` never returns, so only the other phases run natively.
    #[test]
    fn other_phases_are_harmless() {
        let req = testing::request("GET", "/");
        assert!(LoopForever::on_request_body(&req, b"", &testing::context()).is_forward());
        assert!(LoopForever::on_response(&testing::response(200), &testing::context()).is_empty());
    }
}
