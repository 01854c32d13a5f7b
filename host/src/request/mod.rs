//! One request, phase by phase: strict framing, the canonical request, routing and
//! the chain of filters, forwarding to the backend, compression, and the one ending
//! where every answer is made (`respond`).

pub mod body;
pub mod canon;
pub mod chain;
pub mod compress;
pub mod conn;
pub mod error;
pub mod exchange;
pub mod forwarded;
pub mod framing;
pub mod grpc;
pub mod headers;
pub mod proxy;
pub mod respond;
pub mod retry;
pub mod shed;
