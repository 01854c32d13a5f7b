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
            super::chunks(message.as_bytes(), |text, len, end| super::wit::log(level, text, len, end));
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

/// Text as the gateway's imports take it: 64-byte chunks, each as eight little-endian
/// words, passed to `send` with its length and whether it is the last (an empty text
/// is one empty chunk). Imports that take only numbers keep the sandbox small (see
/// `wit/filter.wit`).
#[cfg(any(target_arch = "wasm32", test))]
fn chunks(text: &[u8], mut send: impl FnMut(crate::bindings::postern::filter::host::Chunk, u8, bool)) {
    let mut parts = text.chunks(64).peekable();
    if parts.peek().is_none() {
        send((0, 0, 0, 0, 0, 0, 0, 0), 0, true);
    }
    while let Some(part) = parts.next() {
        let mut w = [0u64; 8];
        for (i, b) in part.iter().enumerate() {
            w[i / 8] |= u64::from(*b) << (8 * (i % 8));
        }
        // A part is at most 64 bytes long.
        let len = part.len() as u8;
        send((w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]), len, parts.peek().is_none());
    }
}

/// Adds `delta` to the counter `name`, which the gateway exports as a metric
/// labelled with the filter. A name longer than 64 bytes is ignored.
pub fn counter_add(name: &str, delta: u64) {
    #[cfg(target_arch = "wasm32")]
    if name.len() <= 64 {
        chunks(name.as_bytes(), |text, len, _| wit::counter_add(text, len, delta));
    }
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
    return call_config::get();
    #[cfg(not(target_arch = "wasm32"))]
    return crate::testing::config_bytes();
}

/// The config that came with this instance's one call (in its context), for
/// [`config`].
#[cfg(target_arch = "wasm32")]
pub(crate) mod call_config {
    use crate::prelude::*;
    use core::cell::RefCell;

    struct Slot(RefCell<Vec<u8>>);

    // SAFETY: a filter instance has one thread (wasm32 without the threads proposal),
    // so the cell is never reached from two threads.
    unsafe impl Sync for Slot {}

    static CONFIG: Slot = Slot(RefCell::new(Vec::new()));

    /// Keeps `bytes` as this call's config.
    pub(crate) fn set(bytes: Vec<u8>) {
        if let Ok(mut c) = CONFIG.0.try_borrow_mut() {
            *c = bytes;
        }
    }

    /// This call's config.
    pub(crate) fn get() -> Vec<u8> {
        CONFIG.0.try_borrow().map(|c| c.clone()).unwrap_or_default()
    }

    /// Whether a [`crate::ParsedConfig`] made its value in this instance (an atomic only
    /// to be a safe `static`: on wasm32 without threads it is a plain load and store).
    static PREPARED: core::sync::atomic::AtomicBool = core::sync::atomic::AtomicBool::new(false);

    /// A [`crate::ParsedConfig`] made its value in this instance.
    pub(crate) fn mark_prepared() {
        PREPARED.store(true, core::sync::atomic::Ordering::Relaxed);
    }

    /// Whether a [`crate::ParsedConfig`] made its value in this instance.
    pub(crate) fn prepared() -> bool {
        PREPARED.load(core::sync::atomic::Ordering::Relaxed)
    }
}

/// State a filter derives from its config once per attachment, e.g. the config parsed:
/// in a `static`, filled by [`Filter::init`](crate::Filter::init) when the gateway
/// builds its snapshot. The gateway then pre-initialises the module for that
/// attachment, so every request's fresh instance starts with the value already made
/// and the per-request cost of parsing is gone. Without `init` (or where it did not
/// run) the value is made on first use in each instance.
///
/// ```
/// use postern_filter_sdk::{ParsedConfig, testing};
///
/// static TENANTS: ParsedConfig<Vec<String>> =
///     ParsedConfig::new(|bytes| serde_json::from_slice(bytes).map_err(|e| e.to_string()));
///
/// testing::set_config(r#"["acme", "globex"]"#);
/// assert_eq!(TENANTS.with(|t| t.map(Vec::len).map_err(str::len)), Ok(2));
/// ```
///
/// Natively (in a filter's unit tests) nothing is kept: each use parses the config
/// that [`testing::set_config`](crate::testing::set_config) set, so tests may change it.
pub struct ParsedConfig<T: 'static> {
    parse: fn(&[u8]) -> Result<T, String>,
    #[cfg(target_arch = "wasm32")]
    value: core::cell::OnceCell<Result<T, String>>,
}

// SAFETY: a filter instance has one thread (wasm32 without the threads proposal), so
// the cell is never reached from two threads. (Natively there is no cell.)
#[cfg(target_arch = "wasm32")]
unsafe impl<T> Sync for ParsedConfig<T> {}

impl<T> ParsedConfig<T> {
    /// A value that `parse` makes from the attachment's config bytes.
    pub const fn new(parse: fn(&[u8]) -> Result<T, String>) -> Self {
        ParsedConfig {
            parse,
            #[cfg(target_arch = "wasm32")]
            value: core::cell::OnceCell::new(),
        }
    }

    /// Runs `f` with the value, or with why the config was refused.
    pub fn with<R>(&self, f: impl FnOnce(Result<&T, &str>) -> R) -> R {
        #[cfg(target_arch = "wasm32")]
        let v = self.value.get_or_init(|| {
            call_config::mark_prepared();
            (self.parse)(&config())
        });
        #[cfg(not(target_arch = "wasm32"))]
        let v = &(self.parse)(&config());
        f(v.as_ref().map_err(String::as_str))
    }

    /// Makes the value now, for [`Filter::init`](crate::Filter::init), which calls this
    /// for each of its values: the error says why the config was refused.
    pub fn prepare(&self) -> Result<(), String> {
        self.with(|v| v.map(drop).map_err(ToOwned::to_owned))
    }
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
    parse_config_json(&config())
}

/// Config `bytes` parsed from JSON into `T`, as [`config_json`] does: for the parse
/// function of a [`ParsedConfig`].
pub fn parse_config_json<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, String> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err("no config".to_owned());
    }
    serde_json::from_slice(bytes).map_err(|e| format!("invalid config: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the gateway does with the chunks (`chunk_bytes` in `host/wasm`).
    fn receive(text: &str) -> (Vec<u8>, usize) {
        let (mut out, mut calls) = (Vec::new(), 0);
        chunks(text.as_bytes(), |c, len, end| {
            calls += 1;
            assert_eq!(end, out.len() + usize::from(len) == text.len());
            let words = [c.0, c.1, c.2, c.3, c.4, c.5, c.6, c.7];
            out.extend(words.into_iter().flat_map(u64::to_le_bytes).take(usize::from(len)));
        });
        (out, calls)
    }

    #[test]
    fn text_goes_out_in_64_byte_chunks_and_comes_back_whole() {
        assert_eq!(receive(""), (vec![], 1));
        assert_eq!(receive("boom"), (b"boom".to_vec(), 1));
        // 63 ASCII bytes, then a two-byte character split between the chunks.
        let text = format!("{}é and more", "x".repeat(63));
        assert_eq!(receive(&text), (text.as_bytes().to_vec(), 2));
        let long = "ab".repeat(64);
        assert_eq!(receive(&long), (long.as_bytes().to_vec(), 2));
    }
}
