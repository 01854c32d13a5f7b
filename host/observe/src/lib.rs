//! Observability off a Postern node's request path.
//!
//! A request only decides whether it is observed and hands over a record; everything
//! else — formatting, writing, rotating, shipping, exporting — happens on this crate's
//! own threads, behind bounded queues. A full queue drops the record and counts it: a
//! log storm never blocks a request and never grows memory.
//!
//! - [`log`]: JSON access logs, every error and a sampled share of successes, to a
//!   rotated file and optionally a stream ([`log::LineSink`], e.g. a Kafka topic).
//! - [`trace`]: OpenTelemetry traces of the same sampled requests, every server error
//!   and every request of a caller under a debug flag, exported as OTLP/HTTP.

mod drain;
pub mod log;
pub mod trace;

pub use log::{AccessLog, FractionError, LineRefused, LineSink, LogSettings, LogStats, Record};
pub use trace::{EndpointError, TraceError, TraceSettings, TraceStats, Tracer};
