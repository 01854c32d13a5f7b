//! Backend protection on a node, one state machine per concern: the per-cluster
//! [`breaker`] and [`budget`] (retries), the choice of host and [`outlier`] ejection,
//! a cluster's [`latency`] against its normal, the node's and each cluster's priority
//! [`shed`] ramp, and a request's [`permit`] under a cluster's cap. Each takes the time
//! from its caller (tests drive the clock) and keeps its state in atomics, so the
//! request path never locks.
#![deny(missing_docs)]

pub mod breaker;
pub mod budget;
pub mod latency;
pub mod outlier;
pub mod permit;
pub mod shed;
mod window;

pub use breaker::{Breaker, BreakerConfig, State, Ticket};
pub use budget::{BudgetConfig, RetryBudget};
pub use latency::Latency;
pub use outlier::{EjectConfig, Hosts};
pub use permit::Permit;
pub use shed::{Ramp, Shedder};
