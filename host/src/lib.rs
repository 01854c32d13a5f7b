//! Postern's data plane. A stateless proxy that serves every request from one immutable
//! snapshot held in memory; the only network hop it adds is the one to the backend.
//!
//! Three rooms, named for what lives there:
//!
//! - [`node`]: the process — listeners and connection caps, the admin listener and the
//!   node's metrics exposition, the file watcher and the control plane's client that
//!   bring versions to its [`node::live`] state, the rate sync, the shedding tick.
//! - [`request`]: one request, phase by phase — framing, the canonical request, routing
//!   over the [`snapshot`] and the chain of filters, forwarding, compression, and the one
//!   ending where errors become responses ([`request::respond`]).
//! - [`cluster`]: a backend cluster on this node — its hosts' pools and connectors, the
//!   choice of host, its breaker, retry budget and cap, and the shedding inputs.
//!
//! Beside them: the [`gateway`] every request reads, the compiled [`snapshot`], and the
//! counters in [`metrics`].

pub mod cluster;
pub mod gateway;
pub mod metrics;
pub mod node;
pub mod request;
pub mod snapshot;
