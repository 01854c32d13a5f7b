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
/// or the caller's own (its key's or app's), or its plan's, or `standard`.
pub fn class(route: &CompiledRoute, live: &Live, cx: Option<&Context>, headers: &HeaderMap) -> Priority {
    class_of(route.priority, cx.and_then(Context::identity), |plan| live.priorities.get(plan).copied(), headers)
}

/// [`class`] from its parts: the route's class, the caller, and its plan's class.
fn class_of(
    route: Option<Priority>,
    caller: Option<&Identity>,
    plan_class: impl FnOnce(&str) -> Option<Priority>,
    headers: &HeaderMap,
) -> Priority {
    if headers.get(X_RETRY_ATTEMPT).is_some_and(|v| !matches!(v.as_bytes(), b"0" | b"")) {
        return Priority::Sheddable;
    }
    if let Some(p) = route {
        return p;
    }
    let Some(id) = caller else { return Priority::default() };
    if let Some(own) = id.priority.and_then(Priority::of_rank) {
        return own;
    }
    id.plan.as_ref().and_then(|plan| std::str::from_utf8(plan).ok()).and_then(plan_class).unwrap_or_default()
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

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use postern_filter_contract::CredentialKind;

    fn caller(plan: &str, own: Option<Priority>) -> Identity {
        Identity {
            kind: CredentialKind::ApiKey,
            subject: None,
            client_id: None,
            tenant: None,
            key_id: Some(Bytes::from_static(b"k")),
            plan: Some(Bytes::copy_from_slice(plan.as_bytes())),
            scopes: Bytes::new(),
            priority: own.map(Priority::rank_u8),
        }
    }

    #[test]
    fn a_callers_own_class_is_above_its_plans_and_below_the_routes() {
        let plans = |plan: &str| (plan == "free").then_some(Priority::Free);
        let none = HeaderMap::new();
        let free = caller("free", None);
        let free_but_critical = caller("free", Some(Priority::Critical));
        assert_eq!(class_of(None, Some(&free), plans, &none), Priority::Free);
        assert_eq!(class_of(None, Some(&free_but_critical), plans, &none), Priority::Critical);
        assert_eq!(class_of(Some(Priority::Sheddable), Some(&free_but_critical), plans, &none), Priority::Sheddable);
        assert_eq!(class_of(None, Some(&caller("gold", None)), plans, &none), Priority::Standard);
        assert_eq!(class_of(None, None, plans, &none), Priority::Standard);
        let mut retry = HeaderMap::new();
        retry.insert(X_RETRY_ATTEMPT, http::HeaderValue::from_static("2"));
        assert_eq!(class_of(None, Some(&free_but_critical), plans, &retry), Priority::Sheddable);
    }
}
