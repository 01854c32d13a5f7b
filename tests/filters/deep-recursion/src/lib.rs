//! `deep-recursion`: recurses without bound in `on_request`. The gateway's stack
//! limit must stop it (a trap) and fail the request, without crashing the gateway.
#![no_std]

use core::hint::black_box;

use postern_filter_sdk::prelude::*;

/// The filter.
pub struct DeepRecursion;

/// Recurses until the stack runs out. The frame is used after the recursive call
/// and the result goes through `black_box`, so the optimiser can turn this into
/// neither a tail call nor an accumulator loop.
#[inline(never)]
pub fn recurse(depth: u64) -> u64 {
    let frame = [depth; 8];
    // Never true, but the optimiser cannot know: keeps the recursion conditional.
    if black_box(depth) == u64::MAX {
        return 0;
    }
    let below = recurse(black_box(depth.wrapping_add(1)));
    black_box(&frame);
    black_box(below.wrapping_add(frame[(depth % 8) as usize]))
}

impl Filter for DeepRecursion {
    fn on_request(_req: &Request, _cx: &Context) -> Decision {
        let depth = recurse(0);
        Decision::forward().set_header("x-depth", depth.to_string())
    }
}

export_filter!(DeepRecursion);

#[cfg(test)]
mod tests {
    use super::*;
    use postern_filter_sdk::testing;

    // `on_request` would overflow the test thread's stack (aborting the test
    // process), so only the other phases run natively.
    #[test]
    fn other_phases_are_harmless() {
        let req = testing::request("GET", "/");
        assert!(DeepRecursion::on_request_body(&req, b"", &testing::context()).is_forward());
        assert!(DeepRecursion::on_response(&testing::response(200), &testing::context()).is_empty());
    }
}
