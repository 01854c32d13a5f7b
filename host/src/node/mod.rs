//! The node as a process: its listeners and connection caps, the admin listener and
//! its metrics, the file watcher and the control plane's client that bring versions to
//! its live state, the rate sync, usage metering, the access log and traces, and the
//! shedding tick. [`server`] assembles them; each subsystem builds itself from its own
//! settings.

pub mod admin;
pub mod args;
pub mod control;
pub mod control_client;
pub mod exposition;
pub mod listen;
pub mod live;
pub mod observability;
pub mod ratesync;
pub mod server;
pub mod shed;
pub mod usage;
pub mod watch;
