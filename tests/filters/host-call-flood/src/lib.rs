//! `host-call-flood`: calls `log::info` and `counter_add` 10 million times each in
//! `on_request`. The gateway must bound what that costs it (fuel, log rate limits,
//! counter batching) and not let one request flood its logs or metrics.
#![no_std]

use postern_filter_sdk::prelude::*;

/// The filter.
pub struct HostCallFlood;

/// How many calls of each.
pub const CALLS: u32 = 10_000_000;

/// Calls `log::info` and `counter_add("flood", 1)` `n` times each.
pub fn flood(n: u32) {
    for _ in 0..n {
        log::info("flood");
        counter_add("flood", 1);
    }
}

impl Filter for HostCallFlood {
    fn on_request(_req: &Request, _cx: &Context) -> Decision {
        flood(CALLS);
        Decision::forward().set_header("x-flood", "done")
    }
}

export_filter!(HostCallFlood);

#[cfg(test)]
mod tests {
    use super::*;
    use postern_filter_sdk::testing;

    // The full 10 million would keep 10 million log lines in the native harness.
    #[test]
    fn each_round_is_one_log_and_one_count() {
        flood(1000);
        assert_eq!(testing::logs().len(), 1000);
        assert_eq!(testing::counter("flood"), 1000);
    }
}
