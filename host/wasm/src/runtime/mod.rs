//! The engine, compiled modules, and one sandboxed call.
//!
//! * this module: the engine, loading and validating modules ([`Runtime::load`]);
//! * `wit`: the filter world's bindings and the signatures calls use;
//! * `state`, `imports`, [`wasi_stubs`]: a call's store state and limiter, and what a
//!   filter may import;
//! * `prepare`: `init` and pre-initialisation for an attachment's config;
//! * `lanes`: the worker's slice and the idle pool;
//! * `fit`: the size limits of an answer;
//! * `epoch`: the thread that advances the epoch while a call runs.
//!
//! One [`Runtime`] per process: a wasmtime engine with the pooling allocator, fuel and
//! epoch interruption, an on-disk cache of compiled code keyed by content and engine
//! version, and a thread that advances the epoch every millisecond while a call runs (and
//! sleeps while none does). A [`Module`] is
//! compiled once per digest (when a snapshot is built, never on the request path) and
//! pre-instantiated. Each call gets a fresh `Store` and instance, so nothing survives
//! between requests.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use sha2::{Digest, Sha256};
use wasmtime::component::{Component, ComponentExportIndex, HasSelf, InstancePre, Linker};
use wasmtime::{Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig};

use postern_model::wasm::Limits;

use crate::stats::{FilterStats, Outcome};

mod epoch;
mod fit;
mod imports;
mod lanes;
mod prepare;
mod state;
pub mod wasi_stubs;
mod wit;

pub use state::State;
pub use wit::bindings::postern::filter::host::Level;
pub use wit::{bindings, owned_bindings, types};

use lanes::{Job, start_pool};
pub use lanes::{SLICE_FUEL, SLICE_MEMORY};

/// The filter world this gateway runs (`wit/filter.wit`).
pub const WORLD: &str = "postern:filter@0.3.0";

/// Interfaces a filter may import; anything else (filesystem, sockets, random, http,
/// clocks) refuses the module when it is loaded.
const ALLOWED_IMPORT_PREFIXES: &[&str] = &[
    "postern:filter/host@0.3.",
    "postern:filter/types@0.3.",
    "wasi:io/error@0.2.",
    "wasi:io/streams@0.2.",
    "wasi:io/poll@0.2.",
    "wasi:cli/environment@0.2.",
    "wasi:cli/exit@0.2.",
    "wasi:cli/stdin@0.2.",
    "wasi:cli/stdout@0.2.",
    "wasi:cli/stderr@0.2.",
    "wasi:cli/terminal-input@0.2.",
    "wasi:cli/terminal-output@0.2.",
    "wasi:cli/terminal-stdin@0.2.",
    "wasi:cli/terminal-stdout@0.2.",
    "wasi:cli/terminal-stderr@0.2.",
];

/// Why a module cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// Not a valid component.
    #[error("not a valid Wasm component: {0}")]
    Invalid(String),
    /// Imports something the sandbox does not grant.
    #[error("imports {0}, which filters are not granted (allowed: postern:filter/host, wasi:io, wasi:cli)")]
    ForbiddenImport(String),
    /// Built for another version of the filter world.
    #[error("built for {0}, but this gateway runs {WORLD}: rebuild it with the current filter SDK")]
    WorldVersion(String),
    /// Does not implement the `postern:filter/filter` world.
    #[error("does not implement the postern:filter world: {0}")]
    World(String),
    /// The filter's `init` refused the attachment's config.
    #[error("the filter refused its config: {0}")]
    Config(String),
    /// The filter's `init` failed (trapped, ran out of fuel or time).
    #[error("the filter's init failed: {0}")]
    Init(String),
    /// The bytes do not hash to the expected digest.
    #[error("digest mismatch: expected {expected}, got {actual}")]
    Digest {
        /// Expected `sha256:<hex>`.
        expected: String,
        /// Actual.
        actual: String,
    },
}

/// Settings of the runtime.
#[derive(Debug, Clone)]
pub struct RuntimeConfig {
    /// Directory for compiled code (keyed by module content and engine version).
    pub cache_dir: Option<PathBuf>,
    /// Instances that can exist at once (pool size).
    pub max_instances: u32,
    /// Platform maxima; the pool's memory slots are this large.
    pub maxima: Limits,
    /// Meter fuel and wall time. Always on in the gateway; off only to measure what
    /// metering costs.
    pub metering: bool,
    /// Threads of the idle pool, where calls that outran their slice on a worker run at
    /// the lowest CPU priority.
    pub pool_threads: usize,
    /// CPU time a filter's `init` may take at snapshot build (default: the maxima's
    /// deadline). Longer only where everything runs slower, as under a profiler.
    pub init_deadline_ms: Option<u64>,
    /// How a freed sandbox's memory is made fresh for the next call.
    pub reset: Reset,
}

/// How the pooling allocator makes a freed instance's memory fresh again. Every way gives
/// the next call the module's initial memory and nothing of the last call's; they differ
/// in who finds the bytes to restore and what it costs on a given host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reset {
    /// Restore the first 128 KiB in place (the image's bytes, zeros elsewhere) whatever
    /// the call touched, and decommit the rest: user-space `memcpy`/`memset` of a small
    /// filter's whole 64 KiB page, no system call.
    #[default]
    Copy,
    /// Ask the kernel which pages of the first 128 KiB are dirty (`PAGEMAP_SCAN`, Linux
    /// ≥ 6.7; elsewhere as `Copy`) and restore only those: pages a call never wrote (the
    /// unused stack, read-only data, the arena's free end) are left alone, for one
    /// `ioctl` per call.
    Scan,
    /// Restore nothing by hand: the kernel drops the slot's pages (`madvise`) and the
    /// next call faults in what it touches, from the module's image or as zeros.
    Decommit,
}

/// A name that is not a [`Reset`], as given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a reset: copy, scan or decommit")]
pub struct UnknownReset(pub String);

/// Compares with the message, as tests read it.
impl PartialEq<&str> for UnknownReset {
    fn eq(&self, other: &&str) -> bool {
        let message = self.to_string();
        message == *other
    }
}

impl std::str::FromStr for Reset {
    type Err = UnknownReset;
    fn from_str(s: &str) -> Result<Self, UnknownReset> {
        match s {
            "copy" => Ok(Reset::Copy),
            "scan" => Ok(Reset::Scan),
            "decommit" => Ok(Reset::Decommit),
            _ => Err(UnknownReset(s.to_owned())),
        }
    }
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        RuntimeConfig {
            cache_dir: None,
            max_instances: 1000,
            maxima: Limits::MAXIMA,
            metering: true,
            pool_threads: 2,
            init_deadline_ms: None,
            reset: Reset::Copy,
        }
    }
}

/// A compiled, validated, pre-instantiated filter module.
pub struct Module {
    /// `sha256:<hex>` of the component bytes.
    pub digest: String,
    /// The interfaces the component imports (`postern:filter/host@0.3.0`, ...), as it
    /// names them.
    pub imports: Vec<String>,
    pre: InstancePre<State>,
    exports: Exports,
    /// The component, for pre-initialising it ([`Runtime::prepare`]).
    bytes: Arc<[u8]>,
    /// The component instrumented for a snapshot of its state, compiled on first need,
    /// and where its `init` is.
    instrumented: OnceLock<Result<(InstancePre<State>, ComponentExportIndex), String>>,
}

/// Where the world's exports are in a module's instances: looked up and typechecked
/// against the WIT once, when the module is loaded.
#[derive(Debug, Clone)]
struct Exports {
    init: ComponentExportIndex,
    on_request: ComponentExportIndex,
    on_request_body: ComponentExportIndex,
    on_response: ComponentExportIndex,
}

impl Module {
    /// The component's bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}

impl std::fmt::Debug for Module {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Module").field("digest", &self.digest).finish_non_exhaustive()
    }
}

/// A module's digest and its config's SHA-256.
type PreparedKey = (String, [u8; 32]);

/// The process's Wasm runtime.
pub struct Runtime {
    engine: Engine,
    linker: Linker<State>,
    modules: Mutex<HashMap<String, Arc<Module>>>,
    /// Modules prepared for a config ([`Runtime::prepare`]).
    prepared: Mutex<HashMap<PreparedKey, Arc<Module>>>,
    /// Advances the epoch while a call runs.
    epoch: Arc<epoch::Epoch>,
    /// The idle pool's queue ([`start_pool`]).
    pool: std::sync::mpsc::SyncSender<Job>,
    /// Platform maxima.
    pub maxima: Limits,
    /// CPU time of a filter's `init` ([`RuntimeConfig::init_deadline_ms`]).
    init_deadline_ms: u64,
    metering: bool,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime").finish_non_exhaustive()
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        self.epoch.stop();
    }
}

/// `sha256:<hex>` of `bytes`.
/// One attachment's side of every call: the module, its limits, its config bytes, its
/// counters and its log tag. Made once per attachment; each call borrows it.
#[derive(Debug, Clone)]
pub struct Binding {
    /// The loaded module.
    pub module: Arc<Module>,
    /// Fuel, memory, deadline and output limits.
    pub limits: Limits,
    /// The attachment's config, handed to each call in its context.
    pub config: Arc<[u8]>,
    /// Counters fed by the `counter-add` import and the outcomes.
    pub stats: Arc<FilterStats>,
    /// `filter@route`, for logs.
    pub tag: Arc<str>,
}

pub fn digest(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

/// What one call produced, with its cost, and what the filter logged and counted (already
/// emitted and added to its stats; kept here for whoever ran the call to show).
#[derive(Debug)]
pub struct Call<T> {
    /// The guest's answer, or why there is none.
    pub result: Result<T, Outcome>,
    /// Fuel consumed.
    pub fuel: u64,
    /// Wall time, instantiation included.
    pub took: Duration,
    /// The linear memory's high-water mark, in bytes (0 when the call did not run).
    pub memory: usize,
    /// The filter's log lines, in order.
    pub logs: Vec<(Level, String)>,
    /// The filter's counter additions, by name.
    pub counters: Vec<(String, u64)>,
}

impl<T> Call<T> {
    fn map<U>(self, f: impl FnOnce(T) -> U) -> Call<U> {
        let Call { result, fuel, took, memory, logs, counters } = self;
        Call { result: result.map(f), fuel, took, memory, logs, counters }
    }

    /// A call that did not run (the node was too busy): no cost, no records.
    fn unrun(outcome: Outcome, took: Duration) -> Call<T> {
        Call { result: Err(outcome), fuel: 0, took, memory: 0, logs: Vec::new(), counters: Vec::new() }
    }
}

/// A log line's level as the node's logs name it: `debug`, `info`, `warn` or `error`.
pub fn level_str(level: Level) -> &'static str {
    match level {
        Level::Debug => "debug",
        Level::Info => "info",
        Level::Warn => "warn",
        Level::Error => "error",
    }
}

impl Runtime {
    /// Builds the engine and starts the epoch thread (asleep until a call runs).
    pub fn new(cfg: &RuntimeConfig) -> anyhow::Result<Arc<Runtime>> {
        let mut config = Config::new();
        config.consume_fuel(cfg.metering);
        config.epoch_interruption(cfg.metering);
        config.max_wasm_stack(512 * 1024);
        config.async_stack_size(2 << 20);
        let mut pool = PoolingAllocationConfig::default();
        pool.total_component_instances(cfg.max_instances);
        pool.total_core_instances(cfg.max_instances * 4);
        pool.total_memories(cfg.max_instances * 2);
        pool.total_tables(cfg.max_instances * 2);
        pool.total_stacks(cfg.max_instances);
        pool.max_memory_size(usize::try_from(cfg.maxima.memory_bytes).unwrap_or(usize::MAX));
        pool.max_unused_warm_slots(cfg.max_instances.min(100));
        // A freed slot's memory is reset by restoring its first 128 KiB (the image's
        // bytes, zeros elsewhere) in place instead of unmapping it, so the next instance
        // starts on resident pages instead of faulting them in again; beyond that it is
        // decommitted. A filter built with the SDK fits in one 64 KiB page when it is
        // small (docs/filters-reference.md), so this restores 64 KiB. Which of the ways costs least
        // depends on the host's memory and system calls (`Reset`; BENCHMARKS.md,
        // "Instructions per request beside nginx, and the fresh sandbox's reset").
        let keep = if cfg.reset == Reset::Decommit { 0 } else { 128 << 10 };
        pool.linear_memory_keep_resident(keep);
        pool.table_keep_resident(keep.min(64 << 10));
        pool.pagemap_scan(if cfg.reset == Reset::Scan { wasmtime::Enabled::Auto } else { wasmtime::Enabled::No });
        config.allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
        if let Some(dir) = &cfg.cache_dir {
            std::fs::create_dir_all(dir)?;
            let mut cc = wasmtime::CacheConfig::new();
            cc.with_directory(dir);
            config.cache(Some(wasmtime::Cache::new(cc)?));
        }
        let engine = Engine::new(&config)?;

        let mut linker: Linker<State> = Linker::new(&engine);
        bindings::Filter::add_to_linker::<State, HasSelf<State>>(&mut linker, |s| s)?;
        wasi_stubs::add_to_linker(&mut linker)?;

        let epoch = epoch::Epoch::start(engine.clone())?;
        Ok(Arc::new(Runtime {
            engine,
            linker,
            modules: Mutex::new(HashMap::new()),
            prepared: Mutex::new(HashMap::new()),
            epoch,
            pool: start_pool(cfg.pool_threads)?,
            maxima: cfg.maxima,
            init_deadline_ms: cfg.init_deadline_ms.unwrap_or(cfg.maxima.deadline_ms),
            metering: cfg.metering,
        }))
    }

    /// Compiles (or takes from cache), validates and pre-instantiates a module. If
    /// `expected` is given the bytes must hash to it. Never call on the request path.
    pub fn load(&self, bytes: &[u8], expected: Option<&str>) -> Result<Arc<Module>, LoadError> {
        let d = digest(bytes);
        if let Some(e) = expected
            && e != d
        {
            return Err(LoadError::Digest { expected: e.to_owned(), actual: d });
        }
        if let Some(m) = self.modules.lock().unwrap_or_else(|p| p.into_inner()).get(&d) {
            return Ok(m.clone());
        }
        let component = Component::new(&self.engine, bytes).map_err(|e| LoadError::Invalid(format!("{e:#}")))?;
        let imports: Vec<String> =
            component.component_type().imports(&self.engine).map(|(name, _)| name.to_owned()).collect();
        check_imports(imports.iter().map(String::as_str))?;
        let world = |e: wasmtime::Error| LoadError::World(format!("{e:#}"));
        let pre = self.linker.instantiate_pre(&component).map_err(world)?;
        // The typecheck of every export; the calls then take them by index.
        bindings::FilterPre::new(pre.clone()).map_err(world)?;
        let index = |name: &str| {
            component.get_export_index(None, name).ok_or_else(|| LoadError::World(format!("no export `{name}`")))
        };
        let exports = Exports {
            init: index("init")?,
            on_request: index("on-request")?,
            on_request_body: index("on-request-body")?,
            on_response: index("on-response")?,
        };
        let module = Arc::new(Module {
            digest: d.clone(),
            imports,
            pre,
            exports,
            bytes: Arc::from(bytes),
            instrumented: OnceLock::new(),
        });
        self.modules.lock().unwrap_or_else(|p| p.into_inner()).insert(d, module.clone());
        Ok(module)
    }
}

/// Refuses a module whose imports go beyond what filters are granted, saying so
/// plainly when it was built for another version of the filter world.
fn check_imports<'a>(names: impl Iterator<Item = &'a str>) -> Result<(), LoadError> {
    let forbidden: Vec<&str> =
        names.filter(|name| !ALLOWED_IMPORT_PREFIXES.iter().any(|p| name.starts_with(p))).collect();
    if let Some(other) = forbidden.iter().find_map(|n| n.strip_prefix("postern:filter/")) {
        let version = other.split_once('@').map_or("an unversioned world", |(_, v)| v);
        return Err(LoadError::WorldVersion(format!("postern:filter@{version}")));
    }
    if !forbidden.is_empty() {
        return Err(LoadError::ForbiddenImport(forbidden.join(", ")));
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    #![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

    use std::sync::atomic::Ordering;
    use std::time::Instant;

    use super::lanes::{Lane, new_store};
    use super::wit::{
        Init, InitResult, OnRequest, OnRequestBody, OnRequestBodyOwned, OnRequestOwned, OnResponse, OnResponseOwned,
    };
    use super::*;
    use crate::clock::{clock_ms, coarse_ms};

    /// The bytes of a filter built by `make filters`.
    pub(crate) fn module_bytes(name: &str) -> Vec<u8> {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| root.join("target"));
        let p = target.join("filters/wasm32-wasip2/release").join(format!("{name}.wasm"));
        std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}: run `make filters` first (make test does)", p.display()))
    }

    fn binding(rt: &Runtime, name: &str, config: &str, limits: Limits) -> Binding {
        Binding {
            module: rt.load(&module_bytes(name), None).expect("load"),
            limits,
            config: Arc::from(config.as_bytes()),
            stats: Arc::new(FilterStats::default()),
            tag: Arc::from(format!("{name}@t/r")),
        }
    }

    fn call(rt: &Runtime, b: &Binding) -> Call<types::Decision> {
        let req = types::Request { method: "GET", path: "/", query: None, authority: Some("a"), headers: &[] };
        let cx = types::Context { route_id: "t/r", request_id: "0", identity: None, config: &b.config };
        let tokio = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        tokio.block_on(rt.on_request(b, req, cx))
    }

    /// Waits until no instance of `rt` is alive: a call answered `overloaded` at the
    /// backstop may still be running on the idle pool (at nice 19, behind a busy
    /// machine), holding its slot. A 30 s guard against a hang only.
    fn drained(rt: &Runtime) {
        let end = Instant::now() + Duration::from_secs(30);
        while rt.engine.pooling_allocator_metrics().is_some_and(|m| m.component_instances() > 0) {
            assert!(Instant::now() < end, "an instance stayed alive for 30 s");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn set_header(d: &types::Decision, name: &str) -> Option<String> {
        let types::Decision::Continue(e) = d else { return None };
        e.set_headers.iter().find(|(k, _)| k == name).map(|(_, v)| String::from_utf8_lossy(v).into_owned())
    }

    fn counter(stats: &FilterStats, name: &str) -> Option<u64> {
        let mut out = String::new();
        stats.render(&mut out, "f=\"x\"");
        let prefix = format!("postern_filter_counter_total{{f=\"x\",name=\"{name}\"}} ");
        out.lines().find_map(|l| l.strip_prefix(&prefix)).map(|v| v.parse().unwrap())
    }

    #[test]
    fn a_quick_filter_runs_on_the_worker_without_a_rerun() {
        let rt = Runtime::new(&RuntimeConfig { max_instances: 8, ..Default::default() }).unwrap();
        let b = binding(&rt, "well_behaved", "", Limits::default());
        for _ in 0..3 {
            let c = call(&rt, &b);
            assert_eq!(set_header(c.result.as_ref().unwrap(), "x-well-behaved").as_deref(), Some("yes"));
            assert!(c.fuel > 0);
        }
        assert_eq!(b.stats.reruns.load(Ordering::Relaxed), 0);
    }

    /// The SDK exports a filter without the `cabi_post_*` functions wit-bindgen would add
    /// (an instance serves one call, so its results are never freed): a fresh instance
    /// has no post-return functions to look up and a call no second guest call.
    #[test]
    fn filters_built_with_the_sdk_have_no_post_return() {
        let has = |bytes: &[u8], s: &str| bytes.windows(s.len()).any(|w| w == s.as_bytes());
        for name in ["well_behaved", "header_injector", "hmac_verifier", "tenant_allowlist", "ab_tagger", "std_panic"] {
            let bytes = module_bytes(name);
            assert!(has(&bytes, "on-request-body") && has(&bytes, "cabi_realloc"), "{name}: exports not found");
            assert!(!has(&bytes, "cabi_post_"), "{name} exports a post-return function");
        }
        let rt = Runtime::new(&RuntimeConfig { max_instances: 8, ..Default::default() }).unwrap();
        let c = call(&rt, &binding(&rt, "header_injector", r#"{"set":{"x-team":"a"}}"#, Limits::default()));
        assert_eq!(set_header(c.result.as_ref().unwrap(), "x-team").as_deref(), Some("a"));
    }

    #[test]
    fn a_panic_is_told_apart_from_a_trap_with_or_without_std() {
        let rt = Runtime::new(&RuntimeConfig { max_instances: 8, ..Default::default() }).unwrap();
        for (module, outcome) in
            [("guest_panic", Outcome::Panic), ("std_panic", Outcome::Panic), ("trap", Outcome::Trap)]
        {
            let c = call(&rt, &binding(&rt, module, "", Limits::default()));
            assert_eq!(c.result.unwrap_err(), outcome, "{module}");
        }
    }

    #[test]
    fn imports_beyond_the_grant_are_refused_and_an_old_world_is_named() {
        let ok = ["postern:filter/host@0.3.0", "wasi:cli/stdout@0.2.6", "wasi:io/streams@0.2.6"];
        assert!(check_imports(ok.into_iter()).is_ok());
        let err = check_imports(["wasi:io/error@0.2.6", "postern:filter/host@0.2.0"].into_iter()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "built for postern:filter@0.2.0, but this gateway runs postern:filter@0.3.0: \
             rebuild it with the current filter SDK"
        );
        let err = check_imports(["wasi:filesystem/types@0.2.6", "wasi:io/error@0.2.6"].into_iter()).unwrap_err();
        assert!(matches!(&err, LoadError::ForbiddenImport(i) if i == "wasi:filesystem/types@0.2.6"), "{err}");
        // The world this file names is the WIT's.
        let wit = include_str!("../../../../wit/filter.wit");
        assert!(wit.contains(&format!("package {WORLD};")));
        // And the imports granted are that world's: `postern:filter/host@0.3.` for 0.3.0.
        let version = WORLD.trim_start_matches("postern:filter@");
        let minor = &version[..=version.rfind('.').unwrap()];
        for interface in ["host", "types"] {
            assert!(ALLOWED_IMPORT_PREFIXES.contains(&format!("postern:filter/{interface}@{minor}").as_str()));
        }
    }

    /// The calls take each export unchecked (`typed`) with these signatures: they must be
    /// the ones the WIT gives, which `get_typed_func` checks.
    #[test]
    fn the_call_signatures_are_the_wits() {
        let rt = Runtime::new(&RuntimeConfig { max_instances: 8, ..Default::default() }).unwrap();
        let b = binding(&rt, "well_behaved", "", Limits::default());
        let mut store = new_store(rt.sandbox(), Lane::Pool, &b, Instant::now());
        let instance = b.module.pre.instantiate(&mut store).unwrap();
        let exports = &b.module.exports;
        instance.get_typed_func::<Init<'_>, InitResult>(&mut store, &exports.init).unwrap();
        instance.get_typed_func::<OnRequest<'_>, (types::Decision,)>(&mut store, &exports.on_request).unwrap();
        instance.get_typed_func::<OnRequestBody<'_>, (types::Decision,)>(&mut store, &exports.on_request_body).unwrap();
        instance.get_typed_func::<OnResponse<'_>, (types::ResponseEdits,)>(&mut store, &exports.on_response).unwrap();
        instance.get_typed_func::<OnRequestOwned, (types::Decision,)>(&mut store, &exports.on_request).unwrap();
        instance
            .get_typed_func::<OnRequestBodyOwned, (types::Decision,)>(&mut store, &exports.on_request_body)
            .unwrap();
        instance.get_typed_func::<OnResponseOwned, (types::ResponseEdits,)>(&mut store, &exports.on_response).unwrap();
        // And a wrong signature is refused, so the check above means something.
        assert!(
            instance.get_typed_func::<OnResponse<'_>, (types::Decision,)>(&mut store, &exports.on_response).is_err()
        );
    }

    #[test]
    fn a_filter_that_parses_its_config_in_init_is_pre_initialised_and_does_less_per_call() {
        let rt = Runtime::new(&RuntimeConfig { max_instances: 8, ..Default::default() }).unwrap();
        let config = r#"{"set": {"x-team": "payments"}}"#;
        let plain = binding(&rt, "header_injector", config, Limits::default());
        let prepared = rt.prepare(&plain.module, config.as_bytes(), &plain.limits).unwrap();
        assert_ne!(prepared.digest, plain.module.digest, "a new component, with the config parsed in its memory");
        let pre = Binding { module: prepared.clone(), ..plain.clone() };
        let (a, b) = (call(&rt, &plain), call(&rt, &pre));
        assert_eq!(set_header(a.result.as_ref().unwrap(), "x-team").as_deref(), Some("payments"));
        assert_eq!(set_header(b.result.as_ref().unwrap(), "x-team").as_deref(), Some("payments"));
        assert!(b.fuel * 2 < a.fuel, "no parse per call: {} fuel pre-initialised, {} not", b.fuel, a.fuel);
        // Kept by module and config: the second time costs nothing.
        assert!(Arc::ptr_eq(&rt.prepare(&plain.module, config.as_bytes(), &plain.limits).unwrap(), &prepared));
        // Each instance still starts fresh: the state a call leaves is not seen by the next.
        let ks = binding(&rt, "keeps_state", "", Limits::default());
        let prepared = rt.prepare(&ks.module, b"", &ks.limits).unwrap();
        assert!(!Arc::ptr_eq(&prepared, &ks.module), "keeps_state prepares a value in init");
        let ks = Binding { module: prepared, ..ks };
        for _ in 0..3 {
            assert_eq!(set_header(call(&rt, &ks).result.as_ref().unwrap(), "x-count").as_deref(), Some("1"));
        }
    }

    /// Whichever way a freed slot is reset, each call starts on the module's initial
    /// memory: one slot of each kind (so every call reuses it), a filter that counts its
    /// calls in a static, pre-initialised, and between its calls others that write their
    /// memory (a header set from a parsed config, a memory bomb up to its limit).
    #[test]
    fn every_reset_gives_each_call_a_fresh_memory() {
        for reset in [Reset::Copy, Reset::Scan, Reset::Decommit] {
            let rt = Runtime::new(&RuntimeConfig { max_instances: 1, reset, ..Default::default() }).unwrap();
            let ks = binding(&rt, "keeps_state", "", Limits::default());
            let ks = Binding { module: rt.prepare(&ks.module, b"", &ks.limits).unwrap(), ..ks };
            let config = r#"{"set":{"x-team":"payments"}}"#;
            let hi = binding(&rt, "header_injector", config, Limits::default());
            let hi = Binding { module: rt.prepare(&hi.module, config.as_bytes(), &hi.limits).unwrap(), ..hi };
            let bomb = binding(&rt, "memory_bomb", "", Limits::default());
            for i in 0..4 {
                let c = call(&rt, &ks);
                assert_eq!(set_header(c.result.as_ref().unwrap(), "x-count").as_deref(), Some("1"), "{reset:?} {i}");
                let c = call(&rt, &hi);
                assert_eq!(set_header(c.result.as_ref().unwrap(), "x-team").as_deref(), Some("payments"), "{reset:?}");
                let _ = call(&rt, &bomb);
                // The bomb runs again on the idle pool: its slot is free once it is over.
                drained(&rt);
            }
        }
        assert_eq!("scan".parse::<Reset>(), Ok(Reset::Scan));
        assert_eq!("zero".parse::<Reset>().unwrap_err(), "`zero` is not a reset: copy, scan or decommit");
    }

    #[test]
    fn init_refuses_a_bad_config_and_a_filter_without_state_is_used_as_it_is() {
        let rt = Runtime::new(&RuntimeConfig { max_instances: 8, ..Default::default() }).unwrap();
        let b = binding(&rt, "header_injector", "", Limits::default());
        let err = rt.prepare(&b.module, br#"{"set": {"X-Upper": "v"}}"#, &b.limits).unwrap_err();
        assert_eq!(
            err.to_string(),
            r#"the filter refused its config: invalid config: set: "X-Upper" is not a lowercase header name"#
        );
        assert!(matches!(rt.check_config(&b.module, b"not json", &b.limits), Err(LoadError::Config(_))));
        assert!(rt.check_config(&b.module, br#"{"remove": ["x-debug"]}"#, &b.limits).unwrap());
        // An `init` that fails (a panic here) refuses the attachment, saying how it failed.
        let gp = binding(&rt, "guest_panic", "", Limits::default());
        let err = rt.prepare(&gp.module, br#""init""#, &gp.limits).unwrap_err();
        let err = err.to_string();
        assert!(
            err.starts_with("the filter's init failed: guest_panic (filter panicked at guest-panic/src/lib.rs:"),
            "{err}"
        );
        assert!(err.ends_with(": boom in init)"), "{err}");
        assert!(Arc::ptr_eq(&rt.prepare(&gp.module, b"", &gp.limits).unwrap(), &gp.module));
        // A filter with no `init` of its own keeps nothing: the module is used as it is.
        let wb = binding(&rt, "well_behaved", "", Limits::default());
        assert!(Arc::ptr_eq(&rt.prepare(&wb.module, b"{}", &wb.limits).unwrap(), &wb.module));
    }

    #[test]
    fn the_epoch_thread_ticks_only_while_a_call_runs_and_the_coarse_clock_follows() {
        let rt = Runtime::new(&RuntimeConfig { max_instances: 8, ..Default::default() }).unwrap();
        let b = binding(&rt, "well_behaved", "", Limits::default());
        // Idle: no tick, and the coarse clock reads the clock itself.
        let (idle, start) = (rt.epoch.ticks(), Instant::now());
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(rt.epoch.ticks(), idle, "an idle runtime wakes no thread");
        // Idle, the coarse clock is the clock: read between two readings of the clock,
        // unless another test's runtime ticks meanwhile (the coarse clock is the
        // process's), when it may lag a tick behind; never ahead.
        let (others, before_read, coarse, after_read) =
            (crate::clock::ticking_threads(), clock_ms(), coarse_ms(), clock_ms());
        assert!(coarse <= after_read, "never ahead of the clock");
        if others == 0 && crate::clock::ticking_threads() == 0 {
            assert!(before_read <= coarse, "idle, the coarse clock is the clock");
        }
        // A live store (a call running) keeps it ticking, every millisecond.
        let store = new_store(rt.sandbox(), Lane::Pool, &b, Instant::now());
        let before = coarse_ms();
        while (rt.epoch.ticks() < idle + 20 || coarse_ms() < before + 20) && start.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(5));
        }
        let after = coarse_ms();
        assert!(rt.epoch.ticks() >= idle + 20, "ticks while a store lives");
        assert!(after >= before + 20, "{before} -> {after} in {:?}", start.elapsed());
        assert!(after <= clock_ms(), "never ahead of the clock it follows");
        drop(store);
        // Asleep again once no store lives: the count stops moving (a 30 s guard).
        let end = Instant::now() + Duration::from_secs(30);
        loop {
            let stopped = rt.epoch.ticks();
            std::thread::sleep(Duration::from_millis(30));
            if rt.epoch.ticks() == stopped {
                break;
            }
            assert!(Instant::now() < end, "the epoch thread kept ticking with no store alive");
        }
        // And a deadline still ends a call after the idle spell (or, with the other
        // tests loading both cores, the idle pool's wall-clock backstop).
        let lf = binding(&rt, "loop_forever", "", Limits { fuel: u64::MAX / 2, deadline_ms: 50, ..Limits::default() });
        let c = call(&rt, &lf);
        assert!(matches!(c.result, Err(Outcome::Deadline | Outcome::Overloaded)), "{:?}", c.result.err());
        assert!(c.took < HANG, "{:?}", c.took);
    }

    #[test]
    fn a_call_that_outruns_its_slice_runs_again_on_the_idle_pool_and_counts_once() {
        let rt = Runtime::new(&RuntimeConfig { max_instances: 8, ..Default::default() }).unwrap();
        // A deadline (and so a backstop) far past anything a busy machine delays the idle
        // pool (nice 19) by: this test is about the rerun, not the deadline.
        let limits = Limits { fuel: 10_000_000_000, deadline_ms: 30_000, host_calls: 100_000, ..Limits::default() };
        // 20 ms of work: far past the slice (0.5 ms, checked at 1 ms ticks).
        let b = binding(&rt, "slow_counter", r#"{"spin_us": 20000}"#, limits);
        let c = call(&rt, &b);
        assert_eq!(set_header(c.result.as_ref().unwrap(), "x-slow").as_deref(), Some("done"));
        assert!(c.took >= Duration::from_millis(20), "{:?}", c.took);
        assert_eq!(b.stats.reruns.load(Ordering::Relaxed), 1, "stopped on the worker, run again on the pool");
        assert_eq!(counter(&b.stats, "calls"), Some(1), "the stopped run's counter must not count");

        // The next call starts on the pool: no second rerun.
        let c = call(&rt, &b);
        assert!(c.result.is_ok());
        assert_eq!(b.stats.reruns.load(Ordering::Relaxed), 1);
        assert_eq!(counter(&b.stats, "calls"), Some(2));
    }

    #[test]
    fn a_call_that_grows_its_memory_past_the_slice_runs_again_on_the_idle_pool() {
        let rt = Runtime::new(&RuntimeConfig { max_instances: 8, ..Default::default() }).unwrap();
        let limits = Limits { memory_bytes: 8 << 20, fuel: 100_000_000, deadline_ms: 30_000, ..Limits::default() };
        let b = binding(&rt, "memory_bomb", "", limits);
        let c = call(&rt, &b);
        assert_eq!(c.result.unwrap_err(), Outcome::Memory, "its own limit, on the pool");
        assert_eq!(b.stats.reruns.load(Ordering::Relaxed), 1, "stopped at 2 MiB on the worker");
    }

    #[test]
    fn an_oversized_answer_is_refused_on_the_idle_pool_itself() {
        let rt = Runtime::new(&RuntimeConfig { max_instances: 8, ..Default::default() }).unwrap();
        // The pool runs it whatever the machine's load: a backstop minutes away.
        let limits = Limits { memory_bytes: 64 << 20, fuel: 100_000_000, deadline_ms: 30_000, ..Limits::default() };
        let b = binding(&rt, "huge_header", "", limits);
        b.stats.pool_until_ms.store(u64::MAX, Ordering::Relaxed);
        let c = call(&rt, &b);
        assert_eq!(
            c.result.unwrap_err(),
            Outcome::BadOutput(crate::output::Rule::HeaderCount),
            "1,000 headers of 1 KiB never reach the worker"
        );
        // Within the limits, the same path answers.
        let b = binding(&rt, "well_behaved", "", Limits { deadline_ms: 30_000, ..Limits::default() });
        b.stats.pool_until_ms.store(u64::MAX, Ordering::Relaxed);
        assert!(call(&rt, &b).result.is_ok());
    }

    #[test]
    fn the_idle_pool_runs_at_the_lowest_priority() {
        let _rt = Runtime::new(&RuntimeConfig { max_instances: 8, pool_threads: 2, ..Default::default() }).unwrap();
        let mut nice = Vec::new();
        for task in std::fs::read_dir("/proc/self/task").unwrap() {
            let dir = task.unwrap().path();
            let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
            // Another test's runtime may be ending, its threads with it.
            if comm.starts_with("postern-wasm-id")
                && let Ok(stat) = std::fs::read_to_string(dir.join("stat"))
            {
                // Fields after the command's closing parenthesis; nice is the 19th field.
                let rest = &stat[stat.rfind(')').unwrap() + 2..];
                nice.push(rest.split(' ').nth(16).unwrap().to_owned());
            }
        }
        // Other tests' runtimes have pools too: at least this one's two threads.
        assert!(nice.len() >= 2, "{nice:?}");
        assert!(nice.iter().all(|n| n == "19"), "{nice:?}");
    }

    #[test]
    fn a_rerun_keeps_the_wall_clock_backstop_of_the_first_start() {
        let rt = Runtime::new(&RuntimeConfig { max_instances: 8, ..Default::default() }).unwrap();
        // The filter wants a second of CPU: its 50 ms deadline of CPU ends it, or on two
        // cores loaded by other tests (the idle pool is at nice 19) the 250 ms backstop.
        let limits = Limits { fuel: 10_000_000_000, deadline_ms: 50, host_calls: 100_000, ..Limits::default() };
        let b = binding(&rt, "slow_counter", r#"{"spin_us": 1000000}"#, limits);
        let c = call(&rt, &b);
        assert!(matches!(c.result, Err(Outcome::Deadline | Outcome::Overloaded)), "{:?}", c.result.err());
        assert!(c.took < HANG, "{:?}", c.took);
        assert_eq!(b.stats.reruns.load(Ordering::Relaxed), 1);
        // Started once, never again (on two loaded cores the idle pool may not have got
        // the CPU to start it at all before the backstop).
        assert!(matches!(counter(&b.stats, "calls"), None | Some(1)), "{:?}", counter(&b.stats, "calls"));
    }

    /// A guard against a hang only: how long a call answers within belongs to the
    /// benchmarks (`bench/wasm_cost.sh`), not to a test sharing two cores.
    const HANG: Duration = Duration::from_secs(30);

    /// Threads enough to keep every core busy several times over.
    fn crowd() -> usize {
        4 * std::thread::available_parallelism().map_or(2, |n| n.get())
    }

    /// `calls` calls of `b` on each of [`crowd`] threads at once, each made by `one`:
    /// every result, with its wall time.
    fn crowded(
        b: &Binding,
        calls: usize,
        one: impl Fn(&Binding) -> Call<types::Decision> + Sync,
    ) -> Vec<Call<types::Decision>> {
        std::thread::scope(|s| {
            let one = &one;
            let threads: Vec<_> =
                (0..crowd()).map(|_| s.spawn(move || (0..calls).map(|_| one(b)).collect::<Vec<_>>())).collect();
            threads.into_iter().flat_map(|t| t.join().unwrap()).collect()
        })
    }

    #[test]
    fn a_call_whose_thread_is_descheduled_is_not_past_its_deadline() {
        let rt = Runtime::new(&RuntimeConfig { max_instances: 64, ..Default::default() }).unwrap();
        // A fixed amount of work (~0.1-0.3 ms of CPU, within the worker's slice) under a
        // 1 ms deadline, on four threads per core: many calls take longer than 1 ms of
        // wall time, none uses 1 ms of CPU.
        let limits = Limits { deadline_ms: 1, ..Limits::default() };
        let b = binding(&rt, "slow_counter", r#"{"rounds": 30}"#, limits);
        let calls = crowded(&b, 150, |b| {
            let req = types::Request { method: "GET", path: "/", query: None, authority: Some("a"), headers: &[] };
            let cx = types::Context { route_id: "t/r", request_id: "0", identity: None, config: &b.config };
            rt.on_request_now(b, req, cx).expect("within the worker's slice")
        });
        let late = calls.iter().filter(|c| c.took > limits.deadline()).count();
        let failed: Vec<_> = calls.iter().filter_map(|c| c.result.as_ref().err()).collect();
        eprintln!(
            "{} calls, {late} took more than their 1 ms deadline in wall time, {} failed",
            calls.len(),
            failed.len()
        );
        assert!(failed.is_empty(), "{failed:?}");
        assert!(late > 0, "the threads were never descheduled mid-call: the test proves nothing here");
    }

    #[test]
    fn on_the_idle_pool_a_crowded_call_is_never_past_its_deadline_and_at_worst_overloaded() {
        let threads = crowd();
        let rt =
            Runtime::new(&RuntimeConfig { max_instances: 64, pool_threads: threads, ..Default::default() }).unwrap();
        // ~1-2 ms of CPU each, past the worker's slice, under a 5 ms deadline: on the
        // idle pool (nice 19), crowded and behind the other tests' threads.
        let limits = Limits { fuel: 100_000_000, deadline_ms: 5, ..Limits::default() };
        let b = binding(&rt, "slow_counter", r#"{"rounds": 200}"#, limits);
        b.stats.pool_until_ms.store(u64::MAX, Ordering::Relaxed);
        let calls = crowded(&b, 10, |b| call(&rt, b));
        let ok = calls.iter().filter(|c| c.result.is_ok()).count();
        let late = calls.iter().filter(|c| c.result.is_ok() && c.took > limits.deadline()).count();
        let overloaded = calls.iter().filter(|c| matches!(c.result, Err(Outcome::Overloaded))).count();
        eprintln!("{} calls: {ok} ok ({late} of them past 5 ms of wall time), {overloaded} overloaded", calls.len());
        for c in &calls {
            assert!(matches!(c.result, Ok(_) | Err(Outcome::Overloaded)), "{:?}", c.result.as_ref().err());
            assert!(c.took < HANG, "{:?}", c.took);
        }
    }
}
