//! Conversions between the generated WIT types and the SDK's plain types, and the
//! glue that `export_filter!` expands to.

use crate::Filter;
use crate::bindings::postern::filter::types as wit;
use crate::decision::{Decision, Reply, RequestEdits, ResponseEdits};
use crate::prelude::*;
use crate::types::{Context, Identity, Request, ResponseHead};

impl From<wit::Request> for Request {
    fn from(r: wit::Request) -> Self {
        Request { method: r.method, path: r.path, query: r.query, authority: r.authority, headers: r.headers }
    }
}

impl From<wit::Identity> for Identity {
    fn from(i: wit::Identity) -> Self {
        Identity {
            subject: i.subject,
            client_id: i.client_id,
            tenant: i.tenant,
            key_id: i.key_id,
            plan: i.plan,
            scopes: i.scopes,
        }
    }
}

/// The SDK's context, and the attachment's config that came with it, kept for
/// [`crate::config`] (natively, in the test harness).
fn context(c: wit::Context) -> Context {
    #[cfg(target_arch = "wasm32")]
    crate::host::call_config::set(c.config);
    #[cfg(not(target_arch = "wasm32"))]
    crate::testing::set_config(c.config);
    Context { route_id: c.route_id, request_id: c.request_id, identity: c.identity.map(Identity::from) }
}

impl From<wit::ResponseHead> for ResponseHead {
    fn from(r: wit::ResponseHead) -> Self {
        ResponseHead { status: r.status, headers: r.headers }
    }
}

impl From<Decision> for wit::Decision {
    fn from(d: Decision) -> Self {
        match d {
            Decision::Continue(RequestEdits { set_headers, append_headers, remove_headers, path }) => {
                wit::Decision::Continue(wit::RequestEdits { set_headers, append_headers, remove_headers, path })
            }
            Decision::Respond(Reply { status, headers, body }) => {
                wit::Decision::Respond(wit::Reply { status, headers, body })
            }
        }
    }
}

impl From<ResponseEdits> for wit::ResponseEdits {
    fn from(e: ResponseEdits) -> Self {
        wit::ResponseEdits {
            set_headers: e.set_headers,
            append_headers: e.append_headers,
            remove_headers: e.remove_headers,
        }
    }
}

/// With `std`, sends a panic's message to the gateway's log before the instance traps
/// (without it, the SDK's panic handler does).
fn panic_hook() {
    #[cfg(all(target_arch = "wasm32", feature = "std"))]
    {
        static HOOK: std::sync::Once = std::sync::Once::new();
        HOOK.call_once(|| {
            std::panic::set_hook(Box::new(|info| {
                crate::host::log_panic(info.location(), &info.payload_as_str().unwrap_or("Box<dyn Any>"));
            }));
        });
    }
}

/// `init`, for [`Filter::init`]: `Ok(true)` when it left state worth keeping (a
/// [`crate::ParsedConfig`] made its value), so the gateway pre-initialises the module.
pub fn init<F: Filter>(config: Vec<u8>) -> Result<bool, String> {
    panic_hook();
    #[cfg(target_arch = "wasm32")]
    crate::host::call_config::set(config);
    #[cfg(not(target_arch = "wasm32"))]
    crate::testing::set_config(config);
    F::init()?;
    #[cfg(target_arch = "wasm32")]
    return Ok(crate::host::call_config::prepared());
    #[cfg(not(target_arch = "wasm32"))]
    return Ok(false);
}

/// `on-request`, for [`Filter::on_request`].
pub fn on_request<F: Filter>(req: wit::Request, cx: wit::Context) -> wit::Decision {
    panic_hook();
    F::on_request(&req.into(), &context(cx)).into()
}

/// `on-request-body`, for [`Filter::on_request_body`].
pub fn on_request_body<F: Filter>(req: wit::Request, body: Vec<u8>, cx: wit::Context) -> wit::Decision {
    panic_hook();
    F::on_request_body(&req.into(), &body, &context(cx)).into()
}

/// `on-response`, for [`Filter::on_response`].
pub fn on_response<F: Filter>(resp: wit::ResponseHead, cx: wit::Context) -> wit::ResponseEdits {
    panic_hook();
    F::on_response(&resp.into(), &context(cx)).into()
}
