//! Postern's data plane. A stateless proxy that serves every request from one immutable
//! snapshot held in memory; the only network hop it adds is the one to the backend.
//!
//! Modules follow the request: [`server`] accepts connections per pool, [`proxy`] runs
//! the request path over the [`snapshot`] (routes from `postern-router`, filters from the
//! filter contract), [`body`] streams bodies, [`respond`] is the one place errors become
//! responses, [`metrics`] and [`admin`] make it observable.

pub mod admin;
pub mod body;
pub mod control;
pub mod headers;
pub mod metrics;
pub mod proxy;
pub mod ratesync;
pub mod respond;
pub mod server;
pub mod snapshot;
pub mod upstream;
