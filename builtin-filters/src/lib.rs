//! Postern's built-in policies, on the filter contract. [`chain`] decides a route's
//! filters and their order; the policies with node-wide state (authentication, rate
//! limits) are built from a [`chain::Node`], the configurable kinds through [`factory`].

use std::sync::Arc;

use postern_filter_contract::{ConfigError, Filter, FilterFactory};

pub mod auth;
pub mod chain;
pub mod headers;
pub mod ratelimit;

static FACTORIES: &[&dyn FilterFactory] = &[&headers::RequestHeadersFactory, &headers::ResponseHeadersFactory];

/// The factory for `kind`, if it is a built-in.
pub fn factory(kind: &str) -> Option<&'static dyn FilterFactory> {
    FACTORIES.iter().copied().find(|f| f.kind() == kind)
}

/// Builds a built-in filter of `kind` from `config`.
pub fn build(kind: &str, config: &serde_json::Value) -> Result<Arc<dyn Filter>, ConfigError> {
    factory(kind).ok_or_else(|| ConfigError::new(format!("unknown filter kind {kind:?}")))?.build(config)
}
