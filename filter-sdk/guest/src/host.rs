//! What the gateway offers a filter: logging, counters, a monotonic clock and the
//! attachment's config. Nothing else is granted.
//!
//! On `wasm32` these call the gateway. Natively (in `cargo test`) they go to the
//! thread-local harness in [`crate::testing`]; the generated imports are never
//! called there.

#[cfg(target_arch = "wasm32")]
use crate::bindings::postern::filter::host as wit;
use crate::prelude::*;

/// Log severity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Level {
    /// Detail for debugging a filter.
    Debug,
    /// Normal events.
    Info,
    /// Something unexpected that the filter handled.
    Warn,
    /// Something the filter could not handle.
    Error,
}

/// Log lines, tagged by the gateway with the filter, route and request id.
///
/// ```
/// use postern_filter_sdk::log;
///
/// log::info("tenant allowed");
/// log::warn(format!("bad signature from {}", "acme"));
/// ```
pub mod log {
    pub use super::Level;

    /// Logs `message` at `level`.
    pub fn log(level: Level, message: impl AsRef<str>) {
        let message = message.as_ref();
        #[cfg(target_arch = "wasm32")]
        {
            use super::wit::Level as L;
            let level = match level {
                Level::Debug => L::Debug,
                Level::Info => L::Info,
                Level::Warn => L::Warn,
                Level::Error => L::Error,
            };
            super::wit::log(level, message);
        }
        #[cfg(not(target_arch = "wasm32"))]
        crate::testing::record_log(level, message);
    }

    /// Logs `message` at debug level.
    pub fn debug(message: impl AsRef<str>) {
        log(Level::Debug, message);
    }

    /// Logs `message` at info level.
    pub fn info(message: impl AsRef<str>) {
        log(Level::Info, message);
    }

    /// Logs `message` at warn level.
    pub fn warn(message: impl AsRef<str>) {
        log(Level::Warn, message);
    }

    /// Logs `message` at error level.
    pub fn error(message: impl AsRef<str>) {
        log(Level::Error, message);
    }
}

/// Logs a panic as `filter panicked at <file:line:col>: <message>` at error level: the
/// line the gateway records as a guest panic (it matches the prefix). Used by the SDK's
/// own panic handler and, with `std`, by its panic hook.
#[cfg(target_arch = "wasm32")]
pub(crate) fn log_panic(at: Option<&core::panic::Location<'_>>, what: &dyn core::fmt::Display) {
    use core::fmt::Write;
    let mut line = String::from("filter panicked");
    // Formatting into a `String` fails only when allocation does, which aborts anyway.
    if let Some(at) = at {
        let _ = write!(line, " at {at}");
    }
    let _ = write!(line, ": {what}");
    log::error(&line);
}

/// Adds `delta` to the counter `name`, which the gateway exports as a metric
/// labelled with the filter.
pub fn counter_add(name: &str, delta: u64) {
    #[cfg(target_arch = "wasm32")]
    wit::counter_add(name, delta);
    #[cfg(not(target_arch = "wasm32"))]
    crate::testing::record_counter(name, delta);
}

/// A monotonic clock, in nanoseconds: for measuring durations, not wall time.
///
/// There is no wall clock: a filter cannot tell the date.
pub fn now_nanos() -> u64 {
    #[cfg(target_arch = "wasm32")]
    return wit::monotonic_now();
    #[cfg(not(target_arch = "wasm32"))]
    return crate::testing::now_nanos();
}

/// This attachment's config as written in the route: JSON bytes, or empty.
pub fn config() -> Vec<u8> {
    #[cfg(target_arch = "wasm32")]
    return wit::config();
    #[cfg(not(target_arch = "wasm32"))]
    return crate::testing::config_bytes();
}

/// This attachment's config, parsed from JSON into `T`.
///
/// An empty config is an error (`"no config"`), as is JSON that does not fit `T`;
/// the message says where it failed.
///
/// ```
/// use postern_filter_sdk::{config_json, testing};
///
/// #[derive(serde::Deserialize)]
/// struct Config { tenants: Vec<String> }
///
/// testing::set_config(r#"{"tenants": ["acme"]}"#);
/// let cfg: Config = config_json().unwrap();
/// assert_eq!(cfg.tenants, ["acme"]);
/// ```
pub fn config_json<T: serde::de::DeserializeOwned>() -> Result<T, String> {
    let bytes = config();
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err("no config".to_owned());
    }
    serde_json::from_slice(&bytes).map_err(|e| format!("invalid config: {e}"))
}
