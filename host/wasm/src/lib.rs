//! Postern's Wasm filter runtime. Teams' filters are WebAssembly components (the
//! `postern:filter` world in `wit/`) that run in a fresh sandbox for every request under
//! hard limits — fuel, linear memory, a deadline of CPU time, host calls and output size —
//! and attach to routes as ordinary filters on the filter contract.
//!
//! * [`runtime`]: the engine (pooling allocator, fuel, epochs, on-disk code cache),
//!   module loading and validation (imports allowlist, world check), one sandboxed call
//!   on a worker or the idle pool, and the WASI stubs a filter gets.
//! * [`filter`]: the contract adapter, failure policy and quarantine.
//! * [`stats`]: what each filter costs (its limits and policies are the snapshot model's,
//!   `postern_model::wasm`).
//! * `clock`: the runtime's monotonic clock and its coarse copy.

mod clock;
pub mod filter;
pub mod output;
pub mod runtime;
pub mod stats;

pub use filter::WasmFilter;
// The attachment schema is the snapshot model's; the runtime reads it.
pub use postern_model::wasm::{Attachment, FailurePolicy, Limits, QuarantinePolicy, config_bytes};
pub use runtime::{Binding, LoadError, Module, Reset, Runtime, RuntimeConfig, UnknownReset, digest};
pub use stats::{FilterStats, Outcome};
