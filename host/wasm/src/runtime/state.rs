//! A call's store state: the resource limiter (memory, tables, the worker's slice), the
//! host-call budget, what the guest logged and counted (kept back until the call is final)
//! and how a failed call is classified from the trap and these records.

use std::sync::Arc;
use std::time::Duration;

use wasmtime::Trap;
use wasmtime::component::ResourceTable;

use super::wit::bindings::postern::filter::host::Level;
use crate::stats::{FilterStats, Outcome};

/// Per-call store state.
pub struct State {
    pub(super) table: ResourceTable,
    /// What the guest wrote to stdout and stderr (capped).
    pub(super) output: Vec<u8>,
    pub(super) memory_max: usize,
    /// How far the memory may grow past its size at instantiation before the call is
    /// stopped to run on the idle pool.
    pub(super) memory_slice: usize,
    /// The memory's size at instantiation.
    pub(super) memory_base: usize,
    pub(super) memory_denied: bool,
    /// The largest size the memory was allowed to grow to (its high-water mark).
    pub(super) memory_peak: usize,
    /// Stopped at the end of its slice on the worker (not a failure of its own).
    pub(super) out_of_slice: bool,
    pub(super) host_calls: u32,
    pub(super) host_calls_max: u32,
    pub(super) host_calls_exceeded: bool,
    pub(super) stats: Arc<FilterStats>,
    /// The log line being received, chunk by chunk (cut at `MAX_LOG_LINE`).
    pub(super) line: Vec<u8>,
    pub(super) log_budget: usize,
    pub(super) tag: Arc<str>,
    /// The guest reported a panic (the SDK's panic hook logs it before aborting).
    pub(super) panicked: bool,
    /// Fuel the store was given.
    pub(super) fuel: u64,
    /// The thread's CPU clock ([`crate::clock::thread_cpu`]) when the call started: read
    /// for a sampled call, and for every call on the idle pool or for `init` (where the
    /// deadline is judged).
    pub(super) cpu_base: Option<Duration>,
    /// This call's CPU time goes into the filter's CPU histogram.
    pub(super) cpu_sampled: bool,
    /// Interrupted by the wall-clock backstop, not by its own CPU time: the node was
    /// too busy to run it, which is `overloaded`, not the filter's failure.
    pub(super) over_wall: bool,
    /// Log lines and counter additions, applied once the call is final, so that a call
    /// run again after its slice is not counted twice.
    pub(super) logs: Vec<(Level, String)>,
    pub(super) counters: Vec<(String, u64)>,
    /// Keeps the epoch thread ticking while the store lives (when metering).
    pub(super) _awake: Option<super::epoch::Awake>,
}

impl wasmtime::ResourceLimiter for State {
    fn memory_growing(&mut self, current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        if desired > self.memory_max {
            self.memory_denied = true;
            return Ok(false);
        }
        if current == 0 {
            self.memory_base = self.memory_base.max(desired);
        } else if desired.saturating_sub(self.memory_base) > self.memory_slice {
            self.out_of_slice = true;
            return Err(wasmtime::Error::new(OutOfSlice));
        }
        self.memory_peak = self.memory_peak.max(desired);
        Ok(true)
    }

    fn table_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        if desired > 100_000 {
            self.memory_denied = true;
            return Ok(false);
        }
        Ok(true)
    }

    fn instances(&self) -> usize {
        16
    }

    fn tables(&self) -> usize {
        16
    }

    fn memories(&self) -> usize {
        4
    }
}

/// Trap raised when a call on the worker grows its memory past the slice.
#[derive(Debug, thiserror::Error)]
#[error("memory growth past the worker's slice")]
pub(super) struct OutOfSlice;

/// Trap raised when a filter calls the host too often.
#[derive(Debug, thiserror::Error)]
#[error("host call limit exceeded")]
pub(super) struct HostCallLimit;

impl State {
    /// Emits the call's log lines, tagged with the filter and the request's id, and adds
    /// its counters: the call is final. The lines and counters stay in the state for
    /// whoever reads them next (`posternctl filter run` prints them).
    pub(super) fn commit(&self, request_id: &str) {
        let tag = &*self.tag;
        for (level, msg) in &self.logs {
            match level {
                Level::Debug => tracing::debug!(filter = tag, request_id, "{msg}"),
                Level::Info => tracing::info!(filter = tag, request_id, "{msg}"),
                Level::Warn => tracing::warn!(filter = tag, request_id, "{msg}"),
                Level::Error => tracing::error!(filter = tag, request_id, "{msg}"),
            }
        }
        for (name, delta) in &self.counters {
            self.stats.counter_add(name, *delta);
        }
    }

    /// The resource table and the output buffer, for the WASI stubs.
    pub(crate) fn stubs(&mut self) -> (&mut ResourceTable, &mut Vec<u8>) {
        (&mut self.table, &mut self.output)
    }

    pub(super) fn host_call(&mut self) -> wasmtime::Result<()> {
        self.host_calls += 1;
        if self.host_calls > self.host_calls_max {
            self.host_calls_exceeded = true;
            return Err(wasmtime::Error::new(HostCallLimit));
        }
        Ok(())
    }
}

/// Tells the ways a call can fail apart, from the trap and the store's own records.
pub(super) fn classify(e: &wasmtime::Error, state: &State, fallback: Outcome) -> Outcome {
    if state.host_calls_exceeded || e.downcast_ref::<HostCallLimit>().is_some() {
        return Outcome::HostCalls;
    }
    if state.memory_denied {
        return Outcome::Memory;
    }
    match e.downcast_ref::<Trap>() {
        Some(Trap::OutOfFuel) => Outcome::Fuel,
        Some(Trap::Interrupt) if state.over_wall => Outcome::Overloaded,
        Some(Trap::Interrupt) => Outcome::Deadline,
        Some(Trap::StackOverflow) | Some(Trap::MemoryOutOfBounds) => Outcome::Stack,
        Some(Trap::UnreachableCodeReached) => {
            let panicked = state.panicked || state.output.windows(8).any(|w| w == b"panicked");
            if panicked { Outcome::Panic } else { Outcome::Trap }
        }
        Some(_) => Outcome::Trap,
        None => {
            let msg = format!("{e:#}");
            if msg.contains("memory") && msg.contains("grow") { Outcome::Memory } else { fallback }
        }
    }
}
