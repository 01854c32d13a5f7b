//! `keeps-state`: counts its requests in a `static` and forwards the count as
//! `x-count: <n>`. The gateway runs every request in a fresh instance, so the
//! backend must always see `x-count: 1`; anything else means instances (and so
//! data) leak between requests.
#![no_std]

use core::sync::atomic::{AtomicU64, Ordering};

use postern_filter_sdk::prelude::*;

/// The filter.
pub struct KeepsState;

/// Requests seen by this instance.
pub static COUNTER: AtomicU64 = AtomicU64::new(0);

/// Something made in `init`, so that the gateway pre-initialises this filter: the
/// snapshot of `init`'s state must not carry request state along either.
static PREPARED: ParsedConfig<()> = ParsedConfig::new(|_| Ok(()));

impl Filter for KeepsState {
    fn init() -> Result<(), String> {
        PREPARED.prepare()
    }

    fn on_request(_req: &Request, _cx: &Context) -> Decision {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed) + 1;
        Decision::forward().set_header("x-count", n.to_string())
    }
}

export_filter!(KeepsState);

#[cfg(test)]
mod tests {
    use super::*;
    use postern_filter_sdk::testing;

    // Natively there is one "instance" (this process), so the count does grow: that
    // is exactly what the sandbox must prevent.
    #[test]
    fn counts_within_one_instance() {
        let count = || {
            let d = KeepsState::on_request(&testing::request("GET", "/"), &testing::context());
            d.edits().and_then(|e| e.set_value_str("x-count")).expect("header").to_owned()
        };
        assert_eq!(count(), "1");
        assert_eq!(count(), "2");
    }
}
