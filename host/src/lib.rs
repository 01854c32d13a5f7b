//! Postern's data plane. A stateless proxy that serves every request from one immutable
//! snapshot held in memory; the only network hop it adds is the one to the backend.
//!
//! Modules follow the request: [`server`] accepts connections per pool, [`proxy`] runs
//! the request path over the [`snapshot`] on the [`canon`]ical request (routes from `postern-router`, filters from the
//! filter contract), [`body`] streams bodies, [`error`] classifies failures by origin,
//! [`respond`] is the one place errors become responses, [`metrics`] and [`admin`] make it
//! observable. [`live`] holds the node's live state and its copies on disk; versions reach
//! it from files (the watcher in [`server`]) or from the control plane
//! ([`control_client`]).

pub mod admin;
pub mod body;
pub mod canon;
pub mod compress;
pub mod control_client;
pub mod error;
pub mod forwarded;
pub mod framing;
pub mod headers;
pub mod live;
pub mod metrics;
pub mod proxy;
pub mod ratesync;
pub mod respond;
pub mod server;
pub mod shedding;
pub mod snapshot;
pub mod upstream;
