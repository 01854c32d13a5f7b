//! Postern's Wasm filter runtime. Teams' filters are WebAssembly components (the
//! `postern:filter` world in `wit/`) that run in a fresh sandbox for every request under
//! hard limits — fuel, linear memory, a wall-clock deadline, host calls and output size —
//! and attach to routes as ordinary filters on the filter contract.
//!
//! * [`runtime`]: the engine (pooling allocator, fuel, epochs, on-disk code cache),
//!   module loading and validation (imports allowlist, world check), one sandboxed call.
//! * [`filter`]: the contract adapter, failure policy and quarantine.
//! * [`limits`], [`stats`]: limits with platform maxima; what each filter costs.
//! * [`wasi_stubs`]: the WASI a filter gets, as stubs that grant nothing.

pub mod filter;
pub mod limits;
pub mod runtime;
pub mod stats;
pub mod wasi_stubs;

pub use filter::{Attachment, FailurePolicy, QuarantinePolicy, WasmFilter, config_bytes};
pub use limits::Limits;
pub use runtime::{Binding, LoadError, Module, Runtime, RuntimeConfig, digest};
pub use stats::{FilterStats, Outcome};
