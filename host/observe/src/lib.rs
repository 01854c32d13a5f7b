//! Observability off a Postern node's request path.
//!
//! A request only decides whether it is observed and hands over a record; everything
//! else — formatting, writing, rotating, shipping — happens on this crate's own thread,
//! behind a bounded queue. A full queue drops the record and counts it: a log storm
//! never blocks a request and never grows memory.
//!
//! - [`log`]: JSON access logs, every error and a sampled share of successes, to a
//!   rotated file and optionally a stream ([`log::LineSink`], e.g. a Kafka topic).

pub mod log;

pub use log::{AccessLog, LineSink, LogSettings, LogStats, Record};
