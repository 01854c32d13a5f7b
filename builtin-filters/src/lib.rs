//! Postern's built-in policies. Each is a [`FilterFactory`] on the filter contract; the
//! proxy finds them by kind through [`factory`] when it builds a snapshot.

use std::sync::Arc;

use postern_filter_contract::{ConfigError, Filter, FilterFactory};

pub mod auth;
pub mod headers;
pub mod ratelimit;

static FACTORIES: &[&dyn FilterFactory] = &[&headers::RequestHeadersFactory, &headers::ResponseHeadersFactory];

/// Every built-in filter factory.
pub fn factories() -> &'static [&'static dyn FilterFactory] {
    FACTORIES
}

/// The factory for `kind`, if it is a built-in.
pub fn factory(kind: &str) -> Option<&'static dyn FilterFactory> {
    FACTORIES.iter().copied().find(|f| f.kind() == kind)
}

/// Builds a built-in filter of `kind` from `config`.
pub fn build(kind: &str, config: &serde_json::Value) -> Result<Arc<dyn Filter>, ConfigError> {
    factory(kind).ok_or_else(|| ConfigError::new(format!("unknown filter kind {kind:?}")))?.build(config)
}
