//! Whether a request goes on while its node or its cluster sheds: the request's class
//! and, only when a ramp is above zero, one random draw.

use http::{HeaderMap, HeaderName};
use postern_filter_contract::{Context, Identity};
use postern_model::Priority;

use crate::cluster::Upstream;
use crate::cluster::shedding::NodeShed;
use crate::snapshot::{CompiledRoute, Live};

/// The mark of a client's retry (`x-retry-attempt: N`, N ≥ 1): such requests are
/// sheddable whatever their plan.
const X_RETRY_ATTEMPT: HeaderName = HeaderName::from_static("x-retry-attempt");

/// The class of a request: a client's retry is sheddable; otherwise the route's class,
/// or the caller's plan's, or `standard`.
pub fn class(route: &CompiledRoute, live: &Live, cx: Option<&Context>, headers: &HeaderMap) -> Priority {
    if headers.get(X_RETRY_ATTEMPT).is_some_and(|v| !matches!(v.as_bytes(), b"0" | b"")) {
        return Priority::Sheddable;
    }
    if let Some(p) = route.priority {
        return p;
    }
    cx.and_then(Context::identity)
        .and_then(|id: &Identity| id.plan.as_ref())
        .and_then(|plan| std::str::from_utf8(plan).ok())
        .and_then(|plan| live.priorities.get(plan).copied())
        .unwrap_or_default()
}

/// Whether a request of `class` may go on to `upstream`, or the class it was shed as; the
/// class is worked out only while something sheds.
pub fn admit(node: &NodeShed, upstream: &Upstream, class: impl FnOnce() -> Priority) -> Result<(), Priority> {
    if node.cpu.level() == 0 && upstream.shed.level() == 0 {
        return Ok(());
    }
    let class = class();
    let draw = fastrand::u32(..100);
    if node.cpu.admits(class.rank(), draw) && upstream.shed.admits(class.rank(), draw) { Ok(()) } else { Err(class) }
}
