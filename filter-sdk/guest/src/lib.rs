//! # Postern filter SDK
//!
//! Write a Postern request filter in plain Rust, unit-test it natively with
//! `cargo test`, and build it into a WebAssembly component with
//! `cargo build --release --target wasm32-wasip2`.
//!
//! A filter is a type that implements [`Filter`] and is exported with
//! [`export_filter!`]. The gateway runs every request in a fresh instance, so a
//! filter keeps no state between requests: its functions take no `self`.
//!
//! ## A complete filter
//!
//! `Cargo.toml`:
//!
//! ```toml
//! [package]
//! name = "require-version"
//! version = "0.1.0"
//! edition = "2024"
//!
//! [lib]
//! crate-type = ["cdylib", "rlib"]
//!
//! [dependencies]
//! postern-filter-sdk = { path = "../../filter-sdk/guest" }
//! serde = { version = "1", default-features = false, features = ["derive", "alloc"] }
//! ```
//!
//! `src/lib.rs`, which starts with `#![no_std]` (see [`prelude`]; left out here so
//! that the example runs as a test):
//!
//! ```
//! use postern_filter_sdk::prelude::*;
//! use postern_filter_sdk::serde_json::json;
//!
//! /// Refuses requests without an `x-api-version` this route supports.
//! pub struct RequireVersion;
//!
//! #[derive(serde::Deserialize)]
//! struct Config {
//!     supported: Vec<String>,
//! }
//!
//! impl Filter for RequireVersion {
//!     fn on_request(req: &Request, cx: &Context) -> Decision {
//!         let cfg: Config = match config_json() {
//!             Ok(cfg) => cfg,
//!             Err(e) => {
//!                 log::error(e);
//!                 return Decision::respond(500).json(json!({"code": "filter_misconfigured"}));
//!             }
//!         };
//!         match req.header_str("x-api-version") {
//!             Some(v) if cfg.supported.iter().any(|s| s == v) => {
//!                 counter_add(&format!("version_{v}"), 1);
//!                 Decision::forward().set_header("x-api-version", v)
//!             }
//!             _ => {
//!                 log::info(format!("{}: unsupported version", cx.route_id));
//!                 Decision::respond(400).json(json!({"code": "unsupported_version"}))
//!             }
//!         }
//!     }
//! }
//!
//! export_filter!(RequireVersion);
//!
//! // Its unit tests (in the crate: `#[cfg(test)] mod tests { ... }`).
//! use postern_filter_sdk::testing;
//!
//! testing::set_config(r#"{"supported": ["2024-06-01"]}"#);
//!
//! let ok = testing::request("GET", "/orders").header("x-api-version", "2024-06-01");
//! let d = RequireVersion::on_request(&ok, &testing::context());
//! assert!(d.is_forward());
//! assert_eq!(testing::counter("version_2024-06-01"), 1);
//!
//! let old = testing::request("GET", "/orders").header("x-api-version", "2019-01-01");
//! let d = RequireVersion::on_request(&old, &testing::context());
//! assert_eq!(d.status(), Some(400));
//! assert_eq!(d.reply().unwrap().body_json(), Some(json!({"code": "unsupported_version"})));
//! ```
//!
//! ## What a filter can do
//!
//! - Read the request head ([`Request`]), the verified caller ([`Identity`], in
//!   [`Context`]) and, on routes that buffer small bodies, the body
//!   ([`Filter::on_request_body`]).
//! - Forward the request with edits ([`Decision::forward`]: set, append or remove
//!   headers, change the path) or answer it itself ([`Decision::respond`], or
//!   [`Decision::problem`] for the gateway's own `application/problem+json` format).
//! - Edit the backend's response head ([`Filter::on_response`], [`ResponseEdits`]).
//! - Call the gateway: [`log`], [`counter_add`], [`now_nanos`] (monotonic, not wall
//!   time), [`config`] / [`config_json`].
//!
//! Nothing else is granted: no network, files, environment, wall clock or
//! randomness. A filter that panics or exceeds its fuel, memory or time limit fails
//! the request; a panic's message is logged at error level first.
//!
//! ## Testing natively
//!
//! On non-`wasm32` targets the host functions use the thread-local harness in
//! [`testing`]: set the config, build requests and contexts, call your filter's
//! functions, and read back the logs and counters. No gateway or Wasm runtime is
//! involved. To run a filter in the real sandbox, see `docs/filters.md` (the quick
//! start) and `docs/filters-reference.md`.

#![deny(missing_docs)]
// On wasm32 a filter links no `std` unless it asks for it (see [`prelude`]).
#![cfg_attr(all(target_arch = "wasm32", not(feature = "std")), no_std)]

extern crate alloc;

mod arena;
mod convert;
mod decision;
mod host;
#[cfg(all(target_arch = "wasm32", not(feature = "std")))]
mod rt;
#[cfg(not(target_arch = "wasm32"))]
pub mod testing;
mod types;

pub use decision::{Decision, Reply, RequestEdits, ResponseEdits};
pub use host::{Level, ParsedConfig, config, config_json, counter_add, log, now_nanos, parse_config_json};
/// The rules the gateway applies to every answer (header names, values and sizes, reply
/// status and body, path syntax and canonical form): the same code the node runs, for a
/// filter that checks its config in `init`. [`testing::check`] applies them in tests.
pub use postern_filter_rules as rules;
pub use types::{Context, Fields, Identity, Request, ResponseHead};

/// `serde_json`, re-exported for [`Decision::json`] and config parsing.
pub use serde_json;

/// What a filter uses, in one import: the SDK's types and functions, and the `alloc`
/// types and macros that a `#![no_std]` crate does not have in scope (`String`, `Vec`,
/// `Box`, `ToOwned`, `ToString`, `format!`, `vec!`).
///
/// A filter crate starts with `#![no_std]` and `use postern_filter_sdk::prelude::*;`.
/// Its dependencies must not link `std` either (e.g. `serde` with
/// `default-features = false, features = ["derive", "alloc"]`): on wasm32 the SDK
/// supplies what `std` would (the panic handler, the allocator), and a filter built
/// that way imports nothing but the gateway's host functions, which makes its fresh
/// sandbox per request ~25 % cheaper (`BENCHMARKS.md`). A filter that needs `std` (or a
/// dependency that does) enables the SDK's `std` feature and drops `#![no_std]`.
pub mod prelude {
    pub use crate::{
        Context, Decision, Fields, Filter, Identity, Level, ParsedConfig, Reply, Request, RequestEdits, ResponseEdits,
        ResponseHead, config, config_json, counter_add, export_filter, log, now_nanos, parse_config_json,
    };
    pub use alloc::borrow::ToOwned;
    pub use alloc::boxed::Box;
    pub use alloc::string::{String, ToString};
    pub use alloc::vec::Vec;
    pub use alloc::{format, vec};
}

/// The raw bindings generated from `wit/filter.wit` (world `filter`).
///
/// Filters normally never touch these: [`export_filter!`] converts between them and
/// the SDK's types, and exports the generated `_export_*_cabi` functions itself.
///
/// The world's description (the `component-type` custom section, exports included)
/// is emitted here, in the SDK, rather than by the generated export macro: the SDK's
/// own exports leave out the `cabi_post_*` functions that macro would add.
#[allow(missing_docs)]
pub mod bindings {
    wit_bindgen::generate!({
        path: "../../wit",
        world: "filter",
    });
}

#[doc(hidden)]
pub mod __private {
    pub use crate::convert::{init, on_request, on_request_body, on_response};
    pub use alloc::string::String;
    pub use alloc::vec::Vec;
}

/// A request filter.
///
/// Implement [`Filter::on_request`]; the other two phases default to "change
/// nothing". There is no `self`: every request runs in a fresh instance, so there is
/// no state to keep. Export the type with [`export_filter!`].
pub trait Filter {
    /// Runs once per attachment when the gateway builds its snapshot, with the
    /// attachment's [`config`]: checks it, and prepares what every request needs from it
    /// with [`ParsedConfig::prepare`]. The gateway then pre-initialises the module for
    /// that attachment: each request's fresh instance starts with those values made. An
    /// error refuses the attachment, and with it the snapshot (`posternctl compile`
    /// says why), instead of failing every request. By default, nothing to check.
    fn init() -> Result<(), alloc::string::String> {
        Ok(())
    }

    /// Request phase: runs on every request of the routes the filter is attached to.
    fn on_request(req: &Request, cx: &Context) -> Decision;

    /// Request body phase: runs only on routes that buffer small bodies, after
    /// [`Filter::on_request`] forwarded the request.
    fn on_request_body(req: &Request, body: &[u8], cx: &Context) -> Decision {
        let _ = (req, body, cx);
        Decision::forward()
    }

    /// Response phase: runs on the backend's response head.
    fn on_response(resp: &ResponseHead, cx: &Context) -> ResponseEdits {
        let _ = (resp, cx);
        ResponseEdits::default()
    }
}

/// Exports a [`Filter`] as the component's `init`, `on-request`, `on-request-body`
/// and `on-response`.
///
/// `export_filter!(MyFilter);` implements the generated `bindings::Guest` trait for
/// `MyFilter` (converting between the WIT types and the SDK's) and, on `wasm32`,
/// exports it. Use it once per crate, with a type name (not a path) defined in the
/// crate.
#[macro_export]
macro_rules! export_filter {
    ($ty:ident) => {
        impl $crate::bindings::Guest for $ty {
            fn init(config: $crate::__private::Vec<u8>) -> ::core::result::Result<bool, $crate::__private::String> {
                $crate::__private::init::<$ty>(config)
            }

            fn on_request(req: $crate::bindings::Request, cx: $crate::bindings::Context) -> $crate::bindings::Decision {
                $crate::__private::on_request::<$ty>(req, cx)
            }

            fn on_request_body(
                req: $crate::bindings::Request,
                body: $crate::__private::Vec<u8>,
                cx: $crate::bindings::Context,
            ) -> $crate::bindings::Decision {
                $crate::__private::on_request_body::<$ty>(req, body, cx)
            }

            fn on_response(
                resp: $crate::bindings::ResponseHead,
                cx: $crate::bindings::Context,
            ) -> $crate::bindings::ResponseEdits {
                $crate::__private::on_response::<$ty>(resp, cx)
            }
        }

        // The world's exports, as the generated export macro would write them but
        // without its `cabi_post_*` functions: those free a call's results after the
        // host has read them, and an instance here serves one call and is then thrown
        // away whole. Without them the component's exports carry no `post-return`, so
        // a fresh instance has four functions fewer to look up and each call one
        // guest call fewer.
        #[cfg(target_arch = "wasm32")]
        const _: () = {
            #[unsafe(export_name = "init")]
            unsafe extern "C" fn __postern_init(config: *mut u8, len: usize) -> *mut u8 {
                // SAFETY: called by the canonical ABI with the lowered arguments.
                unsafe { $crate::bindings::_export_init_cabi::<$ty>(config, len) }
            }

            #[unsafe(export_name = "on-request")]
            unsafe extern "C" fn __postern_on_request(args: *mut u8) -> *mut u8 {
                // SAFETY: as above.
                unsafe { $crate::bindings::_export_on_request_cabi::<$ty>(args) }
            }

            #[unsafe(export_name = "on-request-body")]
            unsafe extern "C" fn __postern_on_request_body(args: *mut u8) -> *mut u8 {
                // SAFETY: as above.
                unsafe { $crate::bindings::_export_on_request_body_cabi::<$ty>(args) }
            }

            #[unsafe(export_name = "on-response")]
            unsafe extern "C" fn __postern_on_response(args: *mut u8) -> *mut u8 {
                // SAFETY: as above.
                unsafe { $crate::bindings::_export_on_response_cabi::<$ty>(args) }
            }
        };
    };
}

// The tests use the native harness, so they run natively only.
#[cfg(all(test, not(target_arch = "wasm32")))]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn header_lookup_is_case_insensitive_and_first_wins() {
        let req = testing::request("GET", "/").header("X-Key", "one").header("x-key", "two").build();
        assert_eq!(req.header("x-key"), Some(&b"one"[..]));
        assert_eq!(req.header_str("X-KEY"), Some("one"));
        assert_eq!(req.header_all("x-key").count(), 2);
        assert!(req.header("missing").is_none());
    }

    #[test]
    fn header_str_rejects_invalid_utf8() {
        let req = testing::request("GET", "/").header("x-bin", [0xff, 0xfe]).build();
        assert_eq!(req.header("x-bin"), Some(&[0xff, 0xfe][..]));
        assert_eq!(req.header_str("x-bin"), None);
    }

    #[test]
    fn forward_edits_follow_the_chain() {
        let d = Decision::forward()
            .set_header("X-A", "1")
            .set_header("x-a", "2")
            .append_header("x-b", "3")
            .remove_header("x-b")
            .remove_header("x-c")
            .append_header("x-c", "4")
            .path("/new?x=1");
        let e = d.edits().unwrap();
        assert_eq!(e.set_headers, vec![("x-a".into(), b"2".to_vec()), ("x-c".into(), b"4".to_vec())]);
        assert!(e.append_headers.is_empty());
        assert_eq!(e.remove_headers, vec!["x-b".to_owned()]);
        assert_eq!(e.path.as_deref(), Some("/new?x=1"));
    }

    #[test]
    fn respond_builds_a_reply() {
        let d =
            Decision::respond(401).header("www-authenticate", "Signature").json(json!({"code": "invalid_signature"}));
        let r = d.reply().unwrap();
        assert_eq!(r.status, 401);
        assert_eq!(r.header_str("content-type"), Some("application/json"));
        assert_eq!(r.header_str("www-authenticate"), Some("Signature"));
        assert_eq!(r.body, br#"{"code":"invalid_signature"}"#);
        assert!(!d.is_forward());
    }

    #[test]
    fn a_problem_reply_is_problem_json_with_the_request_id() {
        let d = Decision::problem(426, "client_too_old", "upgrade to 2.0", &testing::context());
        let r = d.reply().unwrap();
        assert_eq!(r.status, 426);
        assert_eq!(r.header_str("content-type"), Some("application/problem+json"));
        assert_eq!(
            r.body_json(),
            Some(json!({
                "type": "https://postern.dev/problems/client_too_old",
                "title": "Upgrade Required",
                "status": 426,
                "code": "client_too_old",
                "detail": "upgrade to 2.0",
                "request_id": "test-request",
            }))
        );
        assert_eq!(testing::check(&d), Ok(()));
        // A 426 may not name the protocol in an `upgrade` header: the gateway owns it.
        let d = d.header("upgrade", "HTTP/2");
        assert_eq!(testing::check(&d), Err(testing::Rule::ReservedHeader));
    }

    #[test]
    fn reply_set_header_replaces() {
        let d = Decision::respond(200)
            .header("x-a", "1")
            .header("x-a", "2")
            .set_header("X-A", "3")
            .remove_header("x-none")
            .body("hi");
        let r = d.reply().unwrap();
        assert_eq!(r.headers, vec![("x-a".into(), b"3".to_vec())]);
        assert_eq!(r.body, b"hi");
    }

    #[test]
    fn response_edits_builders() {
        let e =
            ResponseEdits::new().set_header("X-Filter", "a").append_header("vary", "x-tenant").remove_header("Server");
        assert_eq!(e.set_value_str("x-filter"), Some("a"));
        assert_eq!(e.append_headers, vec![("vary".into(), b"x-tenant".to_vec())]);
        assert!(e.is_removed("server"));
        assert!(ResponseEdits::default().is_empty());
    }

    #[test]
    fn host_functions_use_the_harness() {
        testing::set_config(r#"{"n": 3}"#);
        log::info("hello");
        log::error("bad");
        counter_add("hits", 2);
        counter_add("hits", 3);
        testing::set_now_nanos(42);

        #[derive(serde::Deserialize)]
        struct Cfg {
            n: u32,
        }
        let cfg: Cfg = config_json().unwrap();
        assert_eq!(cfg.n, 3);
        assert_eq!(testing::logs(), vec![(Level::Info, "hello".to_owned()), (Level::Error, "bad".to_owned())]);
        assert!(testing::logged(Level::Error, "ba"));
        assert_eq!(testing::counter("hits"), 5);
        assert_eq!(testing::counters().len(), 1);
        assert_eq!(now_nanos(), 42);

        testing::reset();
        assert!(testing::logs().is_empty());
        assert!(config().is_empty());
        assert_eq!(config_json::<serde_json::Value>(), Err("no config".to_owned()));
    }

    #[test]
    fn bad_config_says_why() {
        testing::set_config("{");
        let err = config_json::<serde_json::Value>().unwrap_err();
        assert!(err.starts_with("invalid config"), "{err}");
    }

    struct Echo;
    impl Filter for Echo {
        fn on_request(req: &Request, cx: &Context) -> Decision {
            Decision::forward().set_header("x-path", &req.path).set_header("x-tenant", cx.tenant().unwrap_or("-"))
        }
    }
    export_filter!(Echo);

    #[test]
    fn export_filter_converts_wit_types() {
        use crate::bindings::postern::filter::types as wit;
        let req = wit::Request {
            method: "GET".into(),
            path: "/p".into(),
            query: None,
            authority: Some("api.example".into()),
            headers: vec![("x-a".into(), b"1".to_vec())],
        };
        let cx = wit::Context {
            route_id: "t/r".into(),
            request_id: "id".into(),
            identity: Some(wit::Identity {
                subject: None,
                client_id: None,
                tenant: Some("acme".into()),
                key_id: None,
                plan: None,
                scopes: vec![],
            }),
            config: br#"{"n": 1}"#.to_vec(),
        };
        let d = <Echo as bindings::Guest>::on_request(req.clone(), cx.clone());
        let wit::Decision::Continue(e) = d else {
            panic!("expected continue");
        };
        assert!(e.set_headers.contains(&("x-path".into(), b"/p".to_vec())));
        assert!(e.set_headers.contains(&("x-tenant".into(), b"acme".to_vec())));
        assert_eq!(config(), br#"{"n": 1}"#, "the context's config is the call's config");

        let d = <Echo as bindings::Guest>::on_request_body(req, b"body".to_vec(), cx.clone());
        assert!(matches!(d, wit::Decision::Continue(e) if e.set_headers.is_empty()));
        let e = <Echo as bindings::Guest>::on_response(wit::ResponseHead { status: 200, headers: vec![] }, cx);
        assert!(e.set_headers.is_empty() && e.remove_headers.is_empty());
    }
}
