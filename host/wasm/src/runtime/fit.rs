//! The size limits of a filter's answer (headers, body, path), checked by the runtime on
//! the thread that ran the call, on either lane: an oversized answer from the idle pool
//! is refused and freed there, never on a worker. The adapter ([`crate::filter`]) keeps
//! the checks that need the request (path syntax, status range, header names).

use postern_model::wasm::Limits;

use super::wit::types;
use crate::stats::Outcome;

fn check_sizes(
    set: &[(String, Vec<u8>)],
    append: &[(String, Vec<u8>)],
    remove: &[String],
    limits: &Limits,
) -> Result<(), Outcome> {
    let count = set.len() + append.len() + remove.len();
    let bytes: usize = set.iter().chain(append).map(|(k, v)| k.len() + v.len()).sum::<usize>()
        + remove.iter().map(String::len).sum::<usize>();
    if count > limits.max_headers || bytes > limits.max_header_bytes {
        return Err(Outcome::BadOutput);
    }
    Ok(())
}

/// Whether a decision's sizes fit `limits`: checked by the runtime on the thread that ran
/// the call (so an oversized answer from the idle pool is refused and freed there, never
/// on a worker), before the adapter applies it.
pub(crate) fn decision_fits(d: &types::Decision, limits: &Limits) -> Result<(), Outcome> {
    match d {
        types::Decision::Continue(e) => {
            if e.path.as_ref().is_some_and(|p| p.len() > 8192) {
                return Err(Outcome::BadOutput);
            }
            check_sizes(&e.set_headers, &e.append_headers, &e.remove_headers, limits)
        }
        types::Decision::Respond(r) => {
            if r.body.len() > limits.max_body_bytes {
                return Err(Outcome::BadOutput);
            }
            check_sizes(&r.headers, &[], &[], limits)
        }
    }
}

/// Whether response edits fit `limits`, as [`decision_fits`].
pub(crate) fn response_edits_fit(e: &types::ResponseEdits, limits: &Limits) -> Result<(), Outcome> {
    check_sizes(&e.set_headers, &e.append_headers, &e.remove_headers, limits)
}

/// [`decision_fits`] for a call's result.
pub(super) fn call_decision_fits((d,): &(types::Decision,), limits: &Limits) -> Result<(), Outcome> {
    decision_fits(d, limits)
}

/// [`response_edits_fit`] for a call's result.
pub(super) fn call_response_fits((e,): &(types::ResponseEdits,), limits: &Limits) -> Result<(), Outcome> {
    response_edits_fit(e, limits)
}
