//! Backend protection on a node, one state machine per concern: the per-cluster
//! [`breaker`]. Each takes the time from its caller (tests drive the clock) and keeps its
//! state in atomics, so the request path never locks.
#![deny(missing_docs)]

pub mod breaker;

pub use breaker::{Breaker, BreakerConfig, State, Ticket};
