//! The node as a process: its listeners and connection caps, the admin listener and
//! its metrics, the file watcher and the control plane's client that bring versions to
//! its live state, the rate sync and the shedding tick.

pub mod admin;
pub mod args;
pub mod control_client;
pub mod exposition;
pub mod listen;
pub mod live;
pub mod ratesync;
pub mod server;
pub mod shed;
pub mod watch;
