//! The size limits of a filter's answer (headers, body, path), checked by the runtime on
//! the thread that ran the call, on either lane: an oversized answer from the idle pool
//! is refused and freed there, never on a worker. The adapter ([`crate::filter`]) applies
//! the other rules ([`crate::output`]) as it makes the changes.

use postern_model::wasm::Limits;

use super::wit::types;
use crate::output::{self, MAX_PATH_BYTES, Rule};
use crate::stats::Outcome;

/// Whether a decision's sizes fit `limits`: checked by the runtime on the thread that ran
/// the call (so an oversized answer from the idle pool is refused and freed there, never
/// on a worker), before the adapter applies it.
pub(crate) fn decision_fits(d: &types::Decision, limits: &Limits) -> Result<(), Outcome> {
    match d {
        types::Decision::Continue(e) => {
            if e.path.as_ref().is_some_and(|p| p.len() > MAX_PATH_BYTES) {
                return Err(Outcome::BadOutput(Rule::PathLength));
            }
            output::sizes(&e.set_headers, &e.append_headers, &e.remove_headers, limits).map_err(Outcome::BadOutput)
        }
        types::Decision::Respond(r) => {
            if r.body.len() > limits.max_body_bytes {
                return Err(Outcome::BadOutput(Rule::BodySize));
            }
            output::sizes(&[], &r.headers, &[], limits).map_err(Outcome::BadOutput)
        }
    }
}

/// Whether response edits fit `limits`, as [`decision_fits`].
pub(crate) fn response_edits_fit(e: &types::ResponseEdits, limits: &Limits) -> Result<(), Outcome> {
    output::sizes(&e.set_headers, &e.append_headers, &e.remove_headers, limits).map_err(Outcome::BadOutput)
}
/// [`decision_fits`] for a call's result.
pub(super) fn call_decision_fits((d,): &(types::Decision,), limits: &Limits) -> Result<(), Outcome> {
    decision_fits(d, limits)
}

/// [`response_edits_fit`] for a call's result.
pub(super) fn call_response_fits((e,): &(types::ResponseEdits,), limits: &Limits) -> Result<(), Outcome> {
    response_edits_fit(e, limits)
}
