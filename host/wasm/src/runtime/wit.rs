//! The filter world's bindings, as the runtime calls them: generated from `wit/filter.wit`
//! twice (borrowed arguments for calls on a worker, owned ones for calls handed to the
//! idle pool), the signatures each export is called with, the owned copies of a call's
//! arguments, and the one audited `unsafe` block that takes a typechecked export without
//! checking it again.

use wasmtime::Store;
use wasmtime::component::{ComponentExportIndex, ComponentNamedList, Lift, Lower, TypedFunc};

use super::state::State;

/// Generated bindings of `wit/filter.wit`: its types, the host interface, and the
/// exports' typecheck, run once when a module is loaded.
pub mod bindings {
    wasmtime::component::bindgen!({
        path: "../../wit",
        world: "filter",
        imports: { default: trappable },
        // Arguments borrow the gateway's own request: nothing is copied before it is
        // lowered into the guest's memory.
        ownership: Borrowing { duplicate_if_necessary: true },
    });
}

pub use bindings::postern::filter::types;

/// The same bindings with owned arguments, for calls handed to the idle pool's threads.
pub mod owned_bindings {
    wasmtime::component::bindgen!({
        path: "../../wit",
        world: "filter",
        imports: { default: trappable },
    });
}

pub(super) use owned_bindings::postern::filter as owned;

/// The signatures the gateway calls the exports with. `bindings::FilterPre::new`
/// typechecks a module's exports against the WIT when it is loaded, and the test
/// `the_call_signatures_are_the_wits` checks that these types are the WIT's, so each
/// call can take its export without checking its pub(super) type again.
pub(super) type Init<'a> = (&'a [u8],);
pub(super) type InitResult = (Result<bool, String>,);
pub(super) type OnRequest<'a> = (types::Request<'a>, types::Context<'a>);
pub(super) type OnRequestBody<'a> = (types::Request<'a>, &'a [u8], types::Context<'a>);
pub(super) type OnResponse<'a> = (types::ResponseHead<'a>, types::Context<'a>);
pub(super) type OnRequestOwned = (owned::types::Request, owned::types::Context);
pub(super) type OnRequestBodyOwned = (owned::types::Request, Vec<u8>, owned::types::Context);
pub(super) type OnResponseOwned = (owned::types::ResponseHead, owned::types::Context);

/// Owned copies of the arguments, for a call on the idle pool.
pub(super) fn owned_fields(fields: &[(&str, &[u8])]) -> Vec<(String, Vec<u8>)> {
    fields.iter().map(|(k, v)| ((*k).to_owned(), v.to_vec())).collect()
}

pub(super) fn owned_request(r: &types::Request<'_>) -> owned::types::Request {
    owned::types::Request {
        method: r.method.to_owned(),
        path: r.path.to_owned(),
        query: r.query.map(str::to_owned),
        authority: r.authority.map(str::to_owned),
        headers: owned_fields(r.headers),
    }
}

pub(super) fn owned_context(cx: &types::Context<'_>) -> owned::types::Context {
    owned::types::Context {
        route_id: cx.route_id.to_owned(),
        request_id: cx.request_id.to_owned(),
        identity: cx.identity.as_ref().map(|id| owned::types::Identity {
            subject: id.subject.map(str::to_owned),
            client_id: id.client_id.map(str::to_owned),
            tenant: id.tenant.map(str::to_owned),
            key_id: id.key_id.map(str::to_owned),
            plan: id.plan.map(str::to_owned),
            scopes: id.scopes.iter().map(|s| (*s).to_owned()).collect(),
        }),
        config: cx.config.to_vec(),
    }
}

/// The export at `index` of a fresh instance of a loaded module, with the signature the
/// gateway calls it with.
#[allow(unsafe_code)]
pub(super) fn typed<P, R>(
    instance: &wasmtime::component::Instance,
    store: &mut Store<State>,
    index: &ComponentExportIndex,
) -> wasmtime::Result<TypedFunc<P, R>>
where
    P: ComponentNamedList + Lower,
    R: ComponentNamedList + Lift,
{
    let func = instance.get_func(store, index).ok_or_else(|| wasmtime::format_err!("the export is missing"))?;
    // SAFETY: the module's exports were typechecked against the WIT when it was loaded
    // (`Runtime::load`), and `P` and `R` are the WIT's types (`OnRequest`, `OnRequestBody`,
    // `OnResponse` and their owned twins; checked by `the_call_signatures_are_the_wits`).
    Ok(unsafe { TypedFunc::new_unchecked(func) })
}
