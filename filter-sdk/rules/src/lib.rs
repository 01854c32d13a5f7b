//! What a Postern filter may answer, and the one canonical form of a request path.
//!
//! One set of rules, applied by the node to every decision a filter returns, by
//! `posternctl filter run` and the manifest's sample cases at compile, and by the filter
//! SDK's testing module (`postern_filter_sdk::testing::check`), so a filter's unit test,
//! its sample cases and the node cannot disagree on what is refused. `no_std` and free of
//! dependencies, so the SDK links it unchanged.

#![no_std]

extern crate alloc;
#[cfg(test)]
#[macro_use]
extern crate std;

pub mod output;
pub mod path;

pub use output::{Bounds, MAX_PATH_BYTES, Rule};
