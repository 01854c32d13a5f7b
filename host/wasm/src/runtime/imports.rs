//! The host functions a filter may import (`postern:filter/host`): `log`, `counter-add`
//! and `monotonic-now`, each counted against the call's host-call budget. They take and
//! return numbers only (text comes as 64-byte chunks), so a `#![no_std]` filter is one
//! core instance.

use super::state::State;
use super::wit::bindings::postern::filter::host::{self, Level};
use super::wit::types;

impl host::Host for State {
    fn log(&mut self, level: Level, text: host::Chunk, len: u8, end: bool) -> wasmtime::Result<()> {
        self.host_call()?;
        let room = MAX_LOG_LINE.saturating_sub(self.line.len());
        self.line.extend(chunk_bytes(text, len).take(room));
        if !end {
            return Ok(());
        }
        let message = log_line(&self.line);
        self.line.clear();
        if matches!(level, Level::Error) && message.starts_with("filter panicked") {
            self.panicked = true;
        }
        if self.log_budget == 0 {
            return Ok(());
        }
        let msg: String = message.chars().take(self.log_budget).collect();
        self.log_budget = self.log_budget.saturating_sub(msg.len().max(1));
        self.logs.push((level, msg));
        Ok(())
    }

    fn counter_add(&mut self, name: host::Chunk, len: u8, delta: u64) -> wasmtime::Result<()> {
        self.host_call()?;
        let Ok(name) = String::from_utf8(chunk_bytes(name, len).collect()) else {
            return Ok(());
        };
        match self.counters.iter_mut().find(|(n, _)| *n == name) {
            Some((_, v)) => *v = v.saturating_add(delta),
            None => self.counters.push((name, delta)),
        }
        Ok(())
    }

    fn monotonic_now(&mut self) -> wasmtime::Result<u64> {
        self.host_call()?;
        Ok(crate::clock::monotonic_ns())
    }
}

/// A log line is cut at this many bytes.
const MAX_LOG_LINE: usize = 1024;

/// A filter's log line as it is logged: invalid UTF-8 replaced, control characters
/// escaped ([`postern_model::log_safe`]), so a filter cannot split a line or forge another.
fn log_line(bytes: &[u8]) -> String {
    postern_model::log_safe(&String::from_utf8_lossy(bytes)).into_owned()
}

/// The first `len` bytes (at most 64) of a chunk of text: byte `i` is byte `i % 8` of
/// word `i / 8`, little-endian.
fn chunk_bytes(c: host::Chunk, len: u8) -> impl Iterator<Item = u8> {
    [c.0, c.1, c.2, c.3, c.4, c.5, c.6, c.7].into_iter().flat_map(u64::to_le_bytes).take(usize::from(len))
}

impl types::Host for State {}

#[cfg(test)]
mod tests {
    #[test]
    fn a_filter_log_line_is_one_line() {
        assert_eq!(
            super::log_line(b"denied\nINFO forged line\r\x1b[2J\xff"),
            "denied\\nINFO forged line\\r\\u{1b}[2J\u{fffd}"
        );
        assert_eq!(super::log_line(b"filter panicked at x"), "filter panicked at x");
    }
}
