//! Per-filter limits, set in the filter's manifest and capped by platform maxima.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The limits one filter attachment runs under, per request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Fuel (roughly, Wasm instructions) per call.
    pub fuel: u64,
    /// Linear memory, in bytes.
    pub memory_bytes: u64,
    /// Wall-clock deadline per call, in milliseconds (epoch interruption).
    pub deadline_ms: u64,
    /// Host calls (log, counter, clock, config) per call.
    pub host_calls: u32,
    /// Headers a decision may set, append or remove.
    pub max_headers: usize,
    /// Bytes of header names and values a decision may carry.
    pub max_header_bytes: usize,
    /// Bytes of a reply body.
    pub max_body_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            fuel: 5_000_000,
            memory_bytes: 16 << 20,
            deadline_ms: 5,
            host_calls: 1_000,
            max_headers: 64,
            max_header_bytes: 16 * 1024,
            max_body_bytes: 64 * 1024,
        }
    }
}

impl Limits {
    /// The platform maxima: no manifest may ask for more.
    pub const MAXIMA: Limits = Limits {
        fuel: 100_000_000,
        memory_bytes: 64 << 20,
        deadline_ms: 50,
        host_calls: 10_000,
        max_headers: 256,
        max_header_bytes: 64 * 1024,
        max_body_bytes: 1 << 20,
    };

    /// Every limit that is over `maxima`, by name.
    pub fn over(&self, maxima: &Limits) -> Vec<String> {
        let mut out = Vec::new();
        let mut check = |name: &str, v: u64, max: u64| {
            if v > max {
                out.push(format!("{name} {v} is over the platform maximum of {max}"));
            }
            if v == 0 {
                out.push(format!("{name} must be more than 0"));
            }
        };
        check("fuel", self.fuel, maxima.fuel);
        check("memory_bytes", self.memory_bytes, maxima.memory_bytes);
        check("deadline_ms", self.deadline_ms, maxima.deadline_ms);
        check("host_calls", u64::from(self.host_calls), u64::from(maxima.host_calls));
        check("max_headers", self.max_headers as u64, maxima.max_headers as u64);
        check("max_header_bytes", self.max_header_bytes as u64, maxima.max_header_bytes as u64);
        check("max_body_bytes", self.max_body_bytes as u64, maxima.max_body_bytes as u64);
        out
    }

    /// The deadline as a duration.
    pub fn deadline(&self) -> Duration {
        Duration::from_millis(self.deadline_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_fit_the_maxima_and_excess_is_named() {
        assert!(Limits::default().over(&Limits::MAXIMA).is_empty());
        let l = Limits { fuel: 1 << 40, deadline_ms: 0, ..Limits::default() };
        let over = l.over(&Limits::MAXIMA);
        assert_eq!(over.len(), 2, "{over:?}");
        assert!(over[0].starts_with("fuel 1099511627776 is over"));
    }
}
