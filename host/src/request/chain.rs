//! The chain: a route's filters run in order on the request (and on its body, when
//! buffered); the first that answers ends the request.

use std::sync::Arc;
use std::time::Instant;

use postern_filter_contract::{Context, Flow, RequestHead};

use crate::request::exchange::{Ending, Marks, since};
use crate::snapshot::CompiledRoute;

/// Runs the filters' request phase in order; the first that answers ends the request.
/// On a node that traces, each filter's start and end are marked.
pub(crate) async fn run_request_filters(
    filters: &[Arc<dyn postern_filter_contract::Filter>],
    parts: &mut RequestHead,
    cx: &Context,
    passed: &mut u8,
    marks: &mut Option<Marks<'_>>,
    start: Instant,
) -> Result<(), Ending> {
    for f in filters {
        let began = marks.as_ref().map(|_| since(start));
        let flow = match f.on_request(parts, cx) {
            Flow::Continue => Ok(()),
            Flow::Respond(r) => Err(Ending::Reply(r)),
            Flow::Wait(fut) => fut.await.map_err(Ending::Reply),
        };
        if let (Some(m), Some(began)) = (marks.as_mut(), began)
            && let Some(slot) = m.filters.get_mut(usize::from(*passed))
        {
            *slot = (began, since(start));
        }
        flow?;
        *passed = passed.saturating_add(1);
    }
    Ok(())
}

/// Runs the filters' request-body phase in order; the first that answers ends the request.
pub(crate) async fn run_body_filters(
    route: &CompiledRoute,
    parts: &mut RequestHead,
    body: &[u8],
    cx: &Context,
) -> Result<(), Ending> {
    for f in route.chain() {
        match f.on_request_body(parts, body, cx) {
            Flow::Continue => {}
            Flow::Respond(r) => return Err(Ending::Reply(r)),
            Flow::Wait(fut) => fut.await.map_err(Ending::Reply)?,
        }
    }
    Ok(())
}
