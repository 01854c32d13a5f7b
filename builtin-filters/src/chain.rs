//! A route's filter chain: the one place that decides which filters a route runs and in
//! what order, and what the built-in policies are built from.
//!
//! Built-in policies are ordinary filter kinds. The ones that keep node-wide state (the
//! authenticator's credentials and token cache, the limiter's buckets) are built from a
//! [`Node`] the binary makes once and shares with every snapshot, so a reload keeps them.

use std::collections::BTreeMap;
use std::sync::Arc;

use postern_filter_contract::{ConfigError, Filter};
use postern_model::{FilterSpec, Plan, Route, RouteAuth, RouteRate};

use crate::auth::{AuthFilter, Authenticator};
use crate::ratelimit::{Limiter, RateLimitFilter};

/// Node-wide state that built-in policies are built with, one per process.
#[derive(Debug, Clone)]
pub struct Node {
    /// Credentials, verified tokens and outcome counters.
    pub auth: Arc<Authenticator>,
    /// Rate-limit buckets (and the fleet shares, in a fleet).
    pub limiter: Arc<Limiter>,
}

/// One step of a route's chain.
#[derive(Debug)]
pub enum Step<'r> {
    /// Authenticate the caller and authorise it by product and scope.
    Authenticate(&'r RouteAuth),
    /// Charge the caller's plan's rate limits (the route's class and cost).
    RateLimit(&'r RouteRate),
    /// One of the route's configured filters: a built-in kind, or `wasm`.
    Configured(&'r FilterSpec),
}

/// The class and cost of a route that names none.
static DEFAULT_RATE: std::sync::LazyLock<RouteRate> =
    std::sync::LazyLock::new(|| RouteRate { class: "default".into(), cost: 1 });

/// The chain of `route`, in the order requests run it:
///
/// 1. `Authenticate`, on every route that is not public;
/// 2. `RateLimit`, on authenticated routes when any plan has a limit;
/// 3. the route's configured filters (native and Wasm), in their configured order.
///
/// A route that is neither public nor authenticated is refused.
pub fn chain<'r>(route: &'r Route, plans: &BTreeMap<String, Plan>) -> Result<Vec<Step<'r>>, ConfigError> {
    let mut steps = Vec::with_capacity(route.filters.len() + 2);
    match &route.auth {
        Some(spec) => {
            steps.push(Step::Authenticate(spec));
            if plans.values().any(|p| p.rate_limit.is_some() || p.app_rate_limit.is_some()) {
                steps.push(Step::RateLimit(route.rate_limit.as_ref().unwrap_or(&DEFAULT_RATE)));
            }
        }
        None if route.public => {}
        None => return Err(ConfigError::new("the route is not public and has no auth")),
    }
    steps.extend(route.filters.iter().map(Step::Configured));
    Ok(steps)
}

impl Step<'_> {
    /// Builds this step's filter for route `route_id`. A `wasm` filter is the runtime's to
    /// build; here it is refused.
    pub fn build(
        &self,
        node: &Node,
        route_id: &Arc<str>,
        plans: &BTreeMap<String, Plan>,
    ) -> Result<Arc<dyn Filter>, ConfigError> {
        match self {
            Step::Authenticate(spec) => {
                Ok(Arc::new(AuthFilter::new(node.auth.clone(), route_id.clone(), spec, plans)?))
            }
            Step::RateLimit(rate) => Ok(Arc::new(RateLimitFilter::new(node.limiter.clone(), rate, plans)?)),
            Step::Configured(f) => {
                crate::build(&f.kind, &f.config).map_err(|e| ConfigError(format!("filter {}: {e}", f.kind)))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(auth: bool, public: bool) -> Route {
        let mut r: Route = serde_json::from_value(serde_json::json!({
            "id": "t/r", "team": "t", "pool": "public", "hosts": ["a"], "methods": [], "path": "/",
            "path_kind": "Prefix", "version": null,
            "backends": [{"cluster": "c", "weight": 1}], "split_header": null,
            "timeouts": {"connect_ms": 1, "response_ms": 1}, "max_body_bytes": 1, "rewrite": null,
            "filters": [{"kind": "request-headers", "config": {}}], "deprecation": null,
            "public": public, "buffer_body": false, "auth": null, "rate_limit": null
        }))
        .unwrap();
        if auth {
            r.auth = Some(RouteAuth {
                methods: vec![postern_model::AuthMethod::ApiKey],
                scopes: vec![],
                product: "p".into(),
            });
        }
        r
    }

    fn names(steps: &[Step<'_>]) -> Vec<&'static str> {
        steps
            .iter()
            .map(|s| match s {
                Step::Authenticate(_) => "authenticate",
                Step::RateLimit(_) => "rate-limit",
                Step::Configured(_) => "configured",
            })
            .collect()
    }

    #[test]
    fn the_chain_authenticates_then_limits_then_runs_the_routes_filters() {
        let limited: BTreeMap<String, Plan> = serde_json::from_value(serde_json::json!({
            "free": {"products": [], "rate_limit": {"rps": 1, "burst": 1}}
        }))
        .unwrap();
        let r = route(true, false);
        assert_eq!(names(&chain(&r, &limited).unwrap()), ["authenticate", "rate-limit", "configured"]);
        assert_eq!(names(&chain(&r, &BTreeMap::new()).unwrap()), ["authenticate", "configured"]);
        assert_eq!(names(&chain(&route(false, true), &limited).unwrap()), ["configured"]);
        let e = chain(&route(false, false), &limited).unwrap_err();
        assert_eq!(e.to_string(), "the route is not public and has no auth");
    }
}
