//! `slow-counter`: adds 1 to its `calls` counter, then computes for `spin_us`
//! microseconds of the gateway's clock (config `{"spin_us": N}`), or a fixed amount of
//! work, `rounds` blocks of 10,000 multiplications (config `{"rounds": N}`), and
//! forwards with `x-slow: done`. A filter that outruns its first time slice on the
//! worker but finishes: the gateway must run it again on the idle pool and count it
//! once. With `rounds`, the same CPU time however busy the machine is.
#![no_std]

use postern_filter_sdk::prelude::*;
use serde::Deserialize;

/// The filter.
pub struct SlowCounter;

#[derive(Deserialize, Default)]
struct Config {
    #[serde(default)]
    spin_us: u64,
    #[serde(default)]
    rounds: u64,
}

/// Computes `blocks` blocks of 10,000 rounds, whatever the clock says.
pub fn work(blocks: u64) -> u64 {
    let mut x: u64 = 1;
    for _ in 0..blocks {
        for _ in 0..10_000 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        }
    }
    x | 1
}

/// Computes until `micros` have passed, reading the clock every 10,000 rounds.
pub fn spin(micros: u64) -> u64 {
    let end = now_nanos().saturating_add(micros.saturating_mul(1000));
    let mut x: u64 = 1;
    loop {
        for _ in 0..10_000 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        }
        if now_nanos() >= end {
            return x;
        }
    }
}

impl Filter for SlowCounter {
    fn on_request(_req: &Request, _cx: &Context) -> Decision {
        counter_add("calls", 1);
        let cfg: Config = config_json().unwrap_or_default();
        let x = if cfg.rounds > 0 { work(cfg.rounds) } else { spin(cfg.spin_us) };
        Decision::forward().set_header("x-slow", if x == 0 { "zero" } else { "done" })
    }
}

export_filter!(SlowCounter);

#[cfg(test)]
mod tests {
    use super::*;
    use postern_filter_sdk::testing;

    #[test]
    fn counts_once_and_forwards() {
        let d = SlowCounter::on_request(&testing::request("GET", "/"), &testing::context());
        assert!(d.edits().expect("forwarded").set_headers.iter().any(|(k, _)| k == "x-slow"));
        assert_eq!(testing::counter("calls"), 1);
    }
}
