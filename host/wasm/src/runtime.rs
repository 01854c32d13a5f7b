//! The engine, compiled modules, and one sandboxed call.
//!
//! One [`Runtime`] per process: a wasmtime engine with the pooling allocator, fuel and
//! epoch interruption, an on-disk cache of compiled code keyed by content and engine
//! version, and a thread that advances the epoch every millisecond. A [`Module`] is
//! compiled once per digest (when a snapshot is built, never on the request path) and
//! pre-instantiated. Each call gets a fresh `Store` and instance, so nothing survives
//! between requests.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use wasmtime::component::{
    Component, ComponentExportIndex, ComponentNamedList, HasSelf, InstancePre, Lift, Linker, Lower, ResourceTable,
    TypedFunc,
};
use wasmtime::{Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig, Store, Trap, UpdateDeadline};

use crate::limits::Limits;
use crate::stats::{FilterStats, Outcome};

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

use bindings::postern::filter::host::{self, Level};
pub use bindings::postern::filter::types;

/// The same bindings with owned arguments, for calls handed to the idle pool's threads.
pub mod owned_bindings {
    wasmtime::component::bindgen!({
        path: "../../wit",
        world: "filter",
        imports: { default: trappable },
    });
}

use owned_bindings::postern::filter as owned;

/// How much fuel a call may burn on the worker before it is stopped and run again on the
/// idle pool: ~0.5 ms of guest code here (10 M fuel ≈ 0.65 ms). Fuel, not wall time, so
/// a worker preempted mid-call does not send a quick filter to the pool.
const SLICE_FUEL: u64 = 7_000_000;

/// How far a call may grow its memory on the worker before it is stopped and run again
/// on the idle pool: faulting in fresh pages is time that burns no fuel.
const SLICE_MEMORY: usize = 2 << 20;

/// Once a filter outruns its slice or fails costly on a route, its calls there go
/// straight to the idle pool for this long.
pub(crate) const POOL_FOR_MS: u64 = 10_000;

/// Calls waiting for the idle pool at most; beyond, a call is `overloaded`.
const POOL_QUEUE: usize = 256;

/// How long past its deadline a request waits for its call on the idle pool (which is
/// interrupted at the first epoch tick past the deadline) before answering
/// `deadline_exceeded` without it.
const POOL_GRACE: Duration = Duration::from_millis(20);

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
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        RuntimeConfig { cache_dir: None, max_instances: 1000, maxima: Limits::MAXIMA, metering: true, pool_threads: 2 }
    }
}

/// Per-call store state.
pub struct State {
    table: ResourceTable,
    /// What the guest wrote to stdout and stderr (capped).
    output: Vec<u8>,
    memory_max: usize,
    /// How far the memory may grow past its size at instantiation before the call is
    /// stopped to run on the idle pool.
    memory_slice: usize,
    /// The memory's size at instantiation.
    memory_base: usize,
    memory_denied: bool,
    /// Stopped at the end of its slice on the worker (not a failure of its own).
    out_of_slice: bool,
    host_calls: u32,
    host_calls_max: u32,
    host_calls_exceeded: bool,
    stats: Arc<FilterStats>,
    /// The log line being received, chunk by chunk (cut at `MAX_LOG_LINE`).
    line: Vec<u8>,
    log_budget: usize,
    tag: Arc<str>,
    /// The guest reported a panic (the SDK's panic hook logs it before aborting).
    panicked: bool,
    /// Fuel the store was given.
    fuel: u64,
    /// Log lines and counter additions, applied once the call is final, so that a call
    /// run again after its slice is not counted twice.
    logs: Vec<(Level, String)>,
    counters: Vec<(String, u64)>,
}

impl wasmtime::ResourceLimiter for State {
    fn memory_growing(&mut self, current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        if desired > self.memory_max {
            self.memory_denied = true;
            return Ok(false);
        }
        if current == 0 {
            self.memory_base = self.memory_base.max(desired);
        } else if desired.saturating_sub(self.memory_base) > self.memory_slice {
            self.out_of_slice = true;
            return Err(wasmtime::Error::new(OutOfSlice));
        }
        Ok(true)
    }

    fn table_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        if desired > 100_000 {
            self.memory_denied = true;
            return Ok(false);
        }
        Ok(true)
    }

    fn instances(&self) -> usize {
        16
    }

    fn tables(&self) -> usize {
        16
    }

    fn memories(&self) -> usize {
        4
    }
}

/// Trap raised when a call on the worker grows its memory past the slice.
#[derive(Debug, thiserror::Error)]
#[error("memory growth past the worker's slice")]
struct OutOfSlice;

/// Trap raised when a filter calls the host too often.
#[derive(Debug, thiserror::Error)]
#[error("host call limit exceeded")]
struct HostCallLimit;

impl State {
    /// Emits the call's log lines and adds its counters: the call is final.
    fn commit(&mut self) {
        let tag = &*self.tag;
        for (level, msg) in self.logs.drain(..) {
            match level {
                Level::Debug => tracing::debug!(filter = tag, "{msg}"),
                Level::Info => tracing::info!(filter = tag, "{msg}"),
                Level::Warn => tracing::warn!(filter = tag, "{msg}"),
                Level::Error => tracing::error!(filter = tag, "{msg}"),
            }
        }
        for (name, delta) in self.counters.drain(..) {
            self.stats.counter_add(&name, delta);
        }
    }

    /// The resource table and the output buffer, for the WASI stubs.
    pub(crate) fn stubs(&mut self) -> (&mut ResourceTable, &mut Vec<u8>) {
        (&mut self.table, &mut self.output)
    }

    fn host_call(&mut self) -> wasmtime::Result<()> {
        self.host_calls += 1;
        if self.host_calls > self.host_calls_max {
            self.host_calls_exceeded = true;
            return Err(wasmtime::Error::new(HostCallLimit));
        }
        Ok(())
    }
}

impl host::Host for State {
    fn log(&mut self, level: Level, text: host::Chunk, len: u8, end: bool) -> wasmtime::Result<()> {
        self.host_call()?;
        let room = MAX_LOG_LINE.saturating_sub(self.line.len());
        self.line.extend(chunk_bytes(text, len).take(room));
        if !end {
            return Ok(());
        }
        let message = String::from_utf8_lossy(&self.line).into_owned();
        self.line.clear();
        if matches!(level, Level::Error) && message.starts_with("filter panicked") {
            self.panicked = true;
        }
        if self.log_budget == 0 {
            return Ok(());
        }
        let msg: String = message.chars().take(self.log_budget).collect();
        self.log_budget = self.log_budget.saturating_sub(msg.len().max(1));
        self.logs.push((level, msg));
        Ok(())
    }

    fn counter_add(&mut self, name: host::Chunk, len: u8, delta: u64) -> wasmtime::Result<()> {
        self.host_call()?;
        let Ok(name) = String::from_utf8(chunk_bytes(name, len).collect()) else {
            return Ok(());
        };
        match self.counters.iter_mut().find(|(n, _)| *n == name) {
            Some((_, v)) => *v = v.saturating_add(delta),
            None => self.counters.push((name, delta)),
        }
        Ok(())
    }

    fn monotonic_now(&mut self) -> wasmtime::Result<u64> {
        self.host_call()?;
        Ok(u64::try_from(clock_origin().elapsed().as_nanos()).unwrap_or(u64::MAX))
    }
}

/// A log line is cut at this many bytes.
const MAX_LOG_LINE: usize = 1024;

/// The first `len` bytes (at most 64) of a chunk of text: byte `i` is byte `i % 8` of
/// word `i / 8`, little-endian.
fn chunk_bytes(c: host::Chunk, len: u8) -> impl Iterator<Item = u8> {
    [c.0, c.1, c.2, c.3, c.4, c.5, c.6, c.7].into_iter().flat_map(u64::to_le_bytes).take(usize::from(len))
}

impl types::Host for State {}

fn clock_origin() -> Instant {
    static ORIGIN: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *ORIGIN.get_or_init(Instant::now)
}

/// Milliseconds of the runtime's monotonic clock.
fn clock_ms() -> u64 {
    u64::try_from(clock_origin().elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// [`clock_ms`] as of the epoch thread's last tick, at most about a millisecond old.
static COARSE_MS: AtomicU64 = AtomicU64::new(0);

/// Milliseconds of the runtime's monotonic clock, as of the last epoch tick: what the
/// per-call bookkeeping (quarantine windows, the idle pool's lane) reads instead of asking
/// the system for the time on every request.
pub(crate) fn coarse_ms() -> u64 {
    COARSE_MS.load(Ordering::Relaxed)
}

/// A compiled, validated, pre-instantiated filter module.
pub struct Module {
    /// `sha256:<hex>` of the component bytes.
    pub digest: String,
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

/// The signatures the gateway calls the exports with. `bindings::FilterPre::new`
/// typechecks a module's exports against the WIT when it is loaded, and the test
/// `the_call_signatures_are_the_wits` checks that these types are the WIT's, so each
/// call can take its export without checking its type again.
type Init<'a> = (&'a [u8],);
type InitResult = (Result<bool, String>,);
type OnRequest<'a> = (types::Request<'a>, types::Context<'a>);
type OnRequestBody<'a> = (types::Request<'a>, &'a [u8], types::Context<'a>);
type OnResponse<'a> = (types::ResponseHead<'a>, types::Context<'a>);
type OnRequestOwned = (owned::types::Request, owned::types::Context);
type OnRequestBodyOwned = (owned::types::Request, Vec<u8>, owned::types::Context);
type OnResponseOwned = (owned::types::ResponseHead, owned::types::Context);

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
    stop: Arc<AtomicBool>,
    /// The idle pool's queue ([`start_pool`]).
    pool: std::sync::mpsc::SyncSender<Job>,
    /// Platform maxima.
    pub maxima: Limits,
    metering: bool,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime").finish_non_exhaustive()
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
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

/// What one call produced, with its cost.
#[derive(Debug)]
pub struct Call<T> {
    /// The guest's answer, or why there is none.
    pub result: Result<T, Outcome>,
    /// Fuel consumed.
    pub fuel: u64,
    /// Wall time, instantiation included.
    pub took: Duration,
}

impl<T> Call<T> {
    fn map<U>(self, f: impl FnOnce(T) -> U) -> Call<U> {
        Call { result: self.result.map(f), fuel: self.fuel, took: self.took }
    }
}

impl Runtime {
    /// Builds the engine and starts the epoch thread.
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
        // small (docs/filters.md), so this restores 64 KiB. Asking the kernel which
        // pages were dirtied (`PAGEMAP_SCAN`) and restoring only those costs more here:
        // the ioctl alone took ~2 µs per call against ~1 µs to restore 64 KiB
        // (BENCHMARKS.md, Wasm filters).
        pool.linear_memory_keep_resident(128 << 10);
        pool.table_keep_resident(64 << 10);
        pool.pagemap_scan(wasmtime::Enabled::No);
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
        crate::wasi_stubs::add_to_linker(&mut linker)?;

        let stop = Arc::new(AtomicBool::new(false));
        let (e, s) = (engine.clone(), stop.clone());
        COARSE_MS.fetch_max(clock_ms(), Ordering::Relaxed);
        std::thread::Builder::new().name("postern-epoch".into()).spawn(move || {
            while !s.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(1));
                e.increment_epoch();
                COARSE_MS.fetch_max(clock_ms(), Ordering::Relaxed);
            }
        })?;
        Ok(Arc::new(Runtime {
            engine,
            linker,
            modules: Mutex::new(HashMap::new()),
            prepared: Mutex::new(HashMap::new()),
            stop,
            pool: start_pool(cfg.pool_threads)?,
            maxima: cfg.maxima,
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
        check_imports(component.component_type().imports(&self.engine).map(|(name, _)| name))?;
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
            pre,
            exports,
            bytes: Arc::from(bytes),
            instrumented: OnceLock::new(),
        });
        self.modules.lock().unwrap_or_else(|p| p.into_inner()).insert(d, module.clone());
        Ok(module)
    }

    /// `module` ready for an attachment with `config` and `limits`: runs the filter's
    /// `init` with the config, which may refuse it ([`LoadError::Config`]). When `init`
    /// left state worth keeping (e.g. the config parsed), the module is pre-initialised:
    /// its memory and globals as `init` left them become the starting state of every
    /// instance (a new component, compiled and cached like any module), so no request
    /// pays for that work again. A module that cannot be snapshotted (it mutates tables)
    /// is used as it is. Runs `init` under the platform's fuel and time maxima and the
    /// attachment's memory limit; results are kept by module and config. Never call on
    /// the request path.
    pub fn prepare(&self, module: &Arc<Module>, config: &[u8], limits: &Limits) -> Result<Arc<Module>, LoadError> {
        let key = (module.digest.clone(), <[u8; 32]>::from(Sha256::digest(config)));
        if let Some(m) = self.prepared.lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
            return Ok(m.clone());
        }
        let binding = self.init_binding(module, config, limits);
        let prepared = match self.init(&binding)? {
            false => module.clone(),
            true => match self.snapshot(&binding) {
                Ok(bytes) => self.load(&bytes, None)?,
                Err(e) => {
                    tracing::warn!(module = %module.digest, "filter not pre-initialised, used as it is: {e}");
                    module.clone()
                }
            },
        };
        self.prepared.lock().unwrap_or_else(|p| p.into_inner()).insert(key, prepared.clone());
        Ok(prepared)
    }

    /// Runs the filter's `init` on `config`, as [`Self::prepare`] does, without keeping
    /// anything: `Ok(true)` if it would be pre-initialised. For the control plane's
    /// checks.
    pub fn check_config(&self, module: &Arc<Module>, config: &[u8], limits: &Limits) -> Result<bool, LoadError> {
        self.init(&self.init_binding(module, config, limits))
    }

    /// The binding `init` runs with: the platform's fuel and time maxima (it does not
    /// run on the request path) and the attachment's memory limit (its state must fit
    /// the requests' memory).
    fn init_binding(&self, module: &Arc<Module>, config: &[u8], limits: &Limits) -> Binding {
        Binding {
            module: module.clone(),
            limits: Limits { fuel: self.maxima.fuel, deadline_ms: self.maxima.deadline_ms, ..*limits },
            config: Arc::from(config),
            stats: Arc::new(FilterStats::default()),
            tag: Arc::from(format!("init of {}", module.digest)),
        }
    }

    /// Runs `init` with the binding's config in a fresh instance of the module: whether
    /// it left state worth keeping.
    fn init(&self, b: &Binding) -> Result<bool, LoadError> {
        let mut store = self.init_store(b);
        let (_, answer) =
            self.call_init(&mut store, b, &b.module.pre, &b.module.exports.init).map_err(LoadError::Init)?;
        store.data_mut().commit();
        answer.map_err(LoadError::Config)
    }

    /// A store for `init`: the binding's limits, but all of its fuel at once (not a
    /// slice), since it does not run on a worker.
    fn init_store(&self, b: &Binding) -> Store<State> {
        new_store(&self.engine, self.metering, Lane::Pool, b, Instant::now())
    }

    /// Instantiates `pre` in `store` and calls its `init` (at `init`) with the binding's
    /// config: the instance and the filter's answer, or why the call failed.
    fn call_init(
        &self,
        store: &mut Store<State>,
        b: &Binding,
        pre: &InstancePre<State>,
        init: &ComponentExportIndex,
    ) -> Result<(wasmtime::component::Instance, Result<bool, String>), String> {
        // How it failed, with the guest's panic message if it panicked.
        let failed = |e: wasmtime::Error, store: &Store<State>, fallback| {
            let outcome = classify(&e, store.data(), fallback).as_str();
            match store.data().logs.iter().find(|(_, m)| m.starts_with("filter panicked")) {
                Some((_, m)) => format!("{outcome} ({m})"),
                None => outcome.to_owned(),
            }
        };
        let instance = pre.instantiate(&mut *store).map_err(|e| failed(e, store, Outcome::Instantiate))?;
        // Checked (not the hot path), as the instrumented component's `init` was not.
        let (answer,) = instance
            .get_typed_func::<Init<'_>, InitResult>(&mut *store, init)
            .and_then(|f| f.call(&mut *store, (&b.config,)))
            .map_err(|e| failed(e, store, Outcome::Trap))?;
        Ok((instance, answer))
    }

    /// The binding's module pre-initialised by its `init` with the binding's config: the
    /// bytes of the new component.
    fn snapshot(&self, b: &Binding) -> Result<Vec<u8>, String> {
        let module = &b.module;
        let mut wizer = wasmtime_wizer::Wizer::new();
        // The typecheck of a loaded module wants every export of the world.
        wizer.init_func("init").keep_init_func(true);
        let (cx, instrumented) = wizer.instrument_component(&module.bytes).map_err(|e| format!("{e:#}"))?;
        let pre = module
            .instrumented
            .get_or_init(|| {
                let c = Component::new(&self.engine, &instrumented).map_err(|e| format!("{e:#}"))?;
                let init = c.get_export_index(None, "init").ok_or("the instrumented component has no `init`")?;
                let pre = self.linker.instantiate_pre(&c).map_err(|e| format!("{e:#}"))?;
                Ok((pre, init))
            })
            .clone()?;
        let mut store = self.init_store(b);
        let (instance, _) = self.call_init(&mut store, b, &pre.0, &pre.1)?;
        let mut state = Snapshot { store: &mut store, instance, failed: None };
        let bytes = poll_once(wizer.snapshot_component(&cx, &mut state))
            .ok_or("the snapshot did not finish at once")?
            .map_err(|e| format!("{e:#}"))?;
        match state.failed {
            Some(e) => Err(e),
            None => Ok(bytes),
        }
    }

    /// One call of the export at `export` in a fresh instance, on the worker itself:
    /// most filters answer in microseconds. An answer that does not `fit` the limits is
    /// `bad_output`. `None` when the call belongs on the idle pool
    /// ([`Self::run_on_pool`]): the filter was demoted on this route (it outran its slice
    /// or failed costly recently), or this call just outran its slice (it was stopped;
    /// its log lines and counters are kept back until a run is final, so nothing counts
    /// twice).
    fn run_on_worker<P, R>(
        &self,
        b: &Binding,
        export: fn(&Exports) -> &ComponentExportIndex,
        params: P,
        fits: fn(&R, &Limits) -> Result<(), Outcome>,
        start: Instant,
    ) -> Option<Call<R>>
    where
        P: ComponentNamedList + Lower,
        R: ComponentNamedList + Lift,
    {
        if self.metering && b.stats.pool_until_ms.load(Ordering::Relaxed) > coarse_ms() {
            return None;
        }
        let (store, result) =
            call_in_fresh_instance(&self.engine, self.metering, Lane::Worker, b, export, params, start);
        // Out of the slice's fuel (not the filter's own) or memory: the filter needs more
        // than a slice, so it runs again on the idle pool, as its next calls will.
        let state = store.data();
        let out_of_slice = state.out_of_slice || (matches!(result, Err(Outcome::Fuel)) && state.fuel < b.limits.fuel);
        if !out_of_slice {
            let result = result.and_then(|r| fits(&r, &b.limits).map(|()| r));
            return Some(finish(self.metering, store, result, start));
        }
        b.stats.reruns.fetch_add(1, Ordering::Relaxed);
        b.stats.demote();
        None
    }

    /// One call of the export at `export` in a fresh instance on the idle pool, under the
    /// deadline of a call that started at `start`; an answer that does not `fit` the
    /// limits is `bad_output` there. The answer comes by the deadline (and a little
    /// grace) even if the pool is busy: then it is `deadline_exceeded`, and the queued
    /// call is dropped unrun.
    fn run_on_pool<P, R>(
        &self,
        b: &Binding,
        export: fn(&Exports) -> &ComponentExportIndex,
        params: P,
        fits: fn(&R, &Limits) -> Result<(), Outcome>,
        start: Instant,
    ) -> impl Future<Output = Call<R>> + Send + 'static
    where
        P: ComponentNamedList + Lower + Send + 'static,
        R: ComponentNamedList + Lift + Send + 'static,
    {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (engine, metering, b) = (self.engine.clone(), self.metering, b.clone());
        let deadline = start + b.limits.deadline();
        let job: Job = Box::new(move || {
            if tx.is_closed() {
                return; // the request is gone
            }
            if Instant::now() >= deadline {
                let _ = tx.send(Call { result: Err(Outcome::Deadline), fuel: 0, took: start.elapsed() });
                return;
            }
            let (store, result) = call_in_fresh_instance(&engine, metering, Lane::Pool, &b, export, params, start);
            let result = result.and_then(|r| fits(&r, &b.limits).map(|()| r));
            let _ = tx.send(finish(metering, store, result, start));
        });
        let queued = self.pool.try_send(job).is_ok();
        async move {
            if !queued {
                return Call { result: Err(Outcome::Overloaded), fuel: 0, took: start.elapsed() };
            }
            match tokio::time::timeout_at((deadline + POOL_GRACE).into(), rx).await {
                Ok(Ok(call)) => call,
                _ => Call { result: Err(Outcome::Deadline), fuel: 0, took: start.elapsed() },
            }
        }
    }

    /// Runs the request phase in a fresh instance on the worker, or says (`Err`, with
    /// the call's start) that it must run on the idle pool: then call
    /// [`Self::on_request_on_pool`] with the same arguments and that start.
    pub fn on_request_now(
        &self,
        b: &Binding,
        req: types::Request<'_>,
        cx: types::Context<'_>,
    ) -> Result<Call<types::Decision>, Instant> {
        let start = Instant::now();
        let call = self.run_on_worker::<OnRequest<'_>, _>(b, |e| &e.on_request, (req, cx), decision_fits, start);
        call.map(|c| c.map(|(d,)| d)).ok_or(start)
    }

    /// Runs the request phase in a fresh instance on the idle pool, under the deadline of
    /// a call that started at `start`. The arguments are copied for the pool's thread.
    pub fn on_request_on_pool(
        &self,
        b: &Binding,
        req: &types::Request<'_>,
        cx: &types::Context<'_>,
        start: Instant,
    ) -> impl Future<Output = Call<types::Decision>> + Send + 'static {
        let params = (owned_request(req), owned_context(cx));
        let call = self.run_on_pool::<OnRequestOwned, _>(b, |e| &e.on_request, params, decision_fits, start);
        async move { call.await.map(|(d,)| d) }
    }

    /// Runs the request body phase in a fresh instance on the worker, or says (`Err`)
    /// that it must run on the idle pool, as [`Self::on_request_now`].
    pub fn on_request_body_now(
        &self,
        b: &Binding,
        req: types::Request<'_>,
        body: &[u8],
        cx: types::Context<'_>,
    ) -> Result<Call<types::Decision>, Instant> {
        let start = Instant::now();
        let call = self.run_on_worker::<OnRequestBody<'_>, _>(
            b,
            |e| &e.on_request_body,
            (req, body, cx),
            decision_fits,
            start,
        );
        call.map(|c| c.map(|(d,)| d)).ok_or(start)
    }

    /// Runs the request body phase in a fresh instance on the idle pool, as
    /// [`Self::on_request_on_pool`].
    pub fn on_request_body_on_pool(
        &self,
        b: &Binding,
        req: &types::Request<'_>,
        body: &[u8],
        cx: &types::Context<'_>,
        start: Instant,
    ) -> impl Future<Output = Call<types::Decision>> + Send + 'static {
        let params = (owned_request(req), body.to_vec(), owned_context(cx));
        let call = self.run_on_pool::<OnRequestBodyOwned, _>(b, |e| &e.on_request_body, params, decision_fits, start);
        async move { call.await.map(|(d,)| d) }
    }

    /// Runs the request phase in a fresh instance, on the worker if it can, else on the
    /// idle pool.
    pub async fn on_request(
        &self,
        b: &Binding,
        req: types::Request<'_>,
        cx: types::Context<'_>,
    ) -> Call<types::Decision> {
        match self.on_request_now(b, req.clone(), cx.clone()) {
            Ok(call) => call,
            Err(start) => self.on_request_on_pool(b, &req, &cx, start).await,
        }
    }

    /// Runs the request body phase in a fresh instance, on the worker if it can, else on
    /// the idle pool.
    pub async fn on_request_body(
        &self,
        b: &Binding,
        req: types::Request<'_>,
        body: &[u8],
        cx: types::Context<'_>,
    ) -> Call<types::Decision> {
        match self.on_request_body_now(b, req.clone(), body, cx.clone()) {
            Ok(call) => call,
            Err(start) => self.on_request_body_on_pool(b, &req, body, &cx, start).await,
        }
    }

    /// Runs the response phase in a fresh instance, on the worker if it can, else on the
    /// idle pool.
    pub async fn on_response(
        &self,
        b: &Binding,
        resp: types::ResponseHead<'_>,
        cx: types::Context<'_>,
    ) -> Call<types::ResponseEdits> {
        let start = Instant::now();
        let params = (resp.clone(), cx.clone());
        let call = match self.run_on_worker::<OnResponse<'_>, _>(b, |e| &e.on_response, params, response_fits, start) {
            Some(call) => call,
            None => {
                let head = owned::types::ResponseHead { status: resp.status, headers: owned_fields(resp.headers) };
                let params = (head, owned_context(&cx));
                self.run_on_pool::<OnResponseOwned, _>(b, |e| &e.on_response, params, response_fits, start).await
            }
        };
        call.map(|(r,)| r)
    }
}

/// Where a call runs, which decides its store's limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lane {
    /// On a worker: at most a slice of fuel and memory growth ([`SLICE_FUEL`],
    /// [`SLICE_MEMORY`]), then it is stopped to run again on the idle pool.
    Worker,
    /// On the idle pool (or at snapshot build, for `init`): the filter's own limits.
    Pool,
}

/// A fresh store for one call that started at `start`, on `lane`. Past the deadline the
/// call is interrupted, at the first epoch tick (1 ms) after it.
fn new_store(engine: &Engine, metering: bool, lane: Lane, b: &Binding, start: Instant) -> Store<State> {
    let (limits, stats, tag) = (&b.limits, b.stats.clone(), b.tag.clone());
    let state = State {
        table: ResourceTable::new(),
        output: Vec::new(),
        memory_max: usize::try_from(limits.memory_bytes).unwrap_or(usize::MAX),
        memory_slice: if lane == Lane::Worker && metering { SLICE_MEMORY } else { usize::MAX },
        memory_base: 0,
        memory_denied: false,
        out_of_slice: false,
        host_calls: 0,
        host_calls_max: limits.host_calls,
        host_calls_exceeded: false,
        stats,
        line: Vec::new(),
        log_budget: 4096,
        tag,
        panicked: false,
        fuel: 0,
        logs: Vec::new(),
        counters: Vec::new(),
    };
    let mut store = Store::new(engine, state);
    store.limiter(|s| s);
    if !metering {
        return store;
    }
    let fuel = if lane == Lane::Worker { limits.fuel.min(SLICE_FUEL) } else { limits.fuel };
    let _ = store.set_fuel(fuel);
    store.data_mut().fuel = fuel;
    let deadline = start + limits.deadline();
    store.epoch_deadline_callback(move |_| {
        Ok(if Instant::now() >= deadline { UpdateDeadline::Interrupt } else { UpdateDeadline::Continue(1) })
    });
    store.set_epoch_deadline(1);
    store
}

/// Instantiates the binding's module in a fresh store on `lane` and calls the export at
/// `export` with `params`: the store (for its records) and the answer or why there is
/// none.
fn call_in_fresh_instance<P, R>(
    engine: &Engine,
    metering: bool,
    lane: Lane,
    b: &Binding,
    export: fn(&Exports) -> &ComponentExportIndex,
    params: P,
    start: Instant,
) -> (Store<State>, Result<R, Outcome>)
where
    P: ComponentNamedList + Lower,
    R: ComponentNamedList + Lift,
{
    let mut store = new_store(engine, metering, lane, b, start);
    let result = match b.module.pre.instantiate(&mut store) {
        Err(e) => Err(classify(&e, store.data(), Outcome::Instantiate)),
        Ok(instance) => typed::<P, R>(&instance, &mut store, export(&b.module.exports))
            .and_then(|f| f.call(&mut store, params))
            .map_err(|e| classify(&e, store.data(), Outcome::Trap)),
    };
    (store, result)
}

/// [`crate::filter::decision_fits`] for a call's result.
fn decision_fits((d,): &(types::Decision,), limits: &Limits) -> Result<(), Outcome> {
    crate::filter::decision_fits(d, limits)
}

/// [`crate::filter::response_edits_fit`] for a call's result.
fn response_fits((e,): &(types::ResponseEdits,), limits: &Limits) -> Result<(), Outcome> {
    crate::filter::response_edits_fit(e, limits)
}

/// The call is final: its log lines and counters go out, and the store is dropped.
fn finish<T>(metering: bool, mut store: Store<State>, result: Result<T, Outcome>, start: Instant) -> Call<T> {
    let fuel = if metering { store.data().fuel.saturating_sub(store.get_fuel().unwrap_or(0)) } else { 0 };
    store.data_mut().commit();
    drop(store);
    Call { result, fuel, took: start.elapsed() }
}

/// A call for the idle pool.
type Job = Box<dyn FnOnce() + Send>;

/// Starts the idle pool: `threads` threads at the lowest CPU priority (nice 19), taking
/// calls from a queue of [`POOL_QUEUE`]; returns once each has set its priority. They end
/// when the sender is dropped.
fn start_pool(threads: usize) -> std::io::Result<std::sync::mpsc::SyncSender<Job>> {
    let (tx, rx) = std::sync::mpsc::sync_channel::<Job>(POOL_QUEUE);
    let rx = Arc::new(Mutex::new(rx));
    let (ready_tx, ready) = std::sync::mpsc::channel();
    let threads = threads.max(1);
    for i in 0..threads {
        let (rx, ready_tx) = (rx.clone(), ready_tx.clone());
        std::thread::Builder::new().name(format!("postern-wasm-idle-{i}")).spawn(move || {
            // This thread only: on Linux, a thread id names one thread.
            if let Err(e) = rustix::process::setpriority_process(Some(rustix::thread::gettid()), 19) {
                tracing::warn!("the idle pool's thread keeps its priority: {e}");
            }
            let _ = ready_tx.send(());
            drop(ready_tx);
            loop {
                let job = rx.lock().unwrap_or_else(|p| p.into_inner()).recv();
                match job {
                    Ok(job) => job(),
                    Err(_) => return,
                }
            }
        })?;
    }
    for _ in 0..threads {
        let _ = ready.recv();
    }
    Ok(tx)
}

/// Owned copies of the arguments, for a call on the idle pool.
fn owned_fields(fields: &[(&str, &[u8])]) -> Vec<(String, Vec<u8>)> {
    fields.iter().map(|(k, v)| ((*k).to_owned(), v.to_vec())).collect()
}

fn owned_request(r: &types::Request<'_>) -> owned::types::Request {
    owned::types::Request {
        method: r.method.to_owned(),
        path: r.path.to_owned(),
        query: r.query.map(str::to_owned),
        authority: r.authority.map(str::to_owned),
        headers: owned_fields(r.headers),
    }
}

fn owned_context(cx: &types::Context<'_>) -> owned::types::Context {
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

/// The export at `index` of a fresh instance of a loaded module, with the signature the
/// gateway calls it with.
#[allow(unsafe_code)]
fn typed<P, R>(
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

/// Tells the ways a call can fail apart, from the trap and the store's own records.
fn classify(e: &wasmtime::Error, state: &State, fallback: Outcome) -> Outcome {
    if state.host_calls_exceeded || e.downcast_ref::<HostCallLimit>().is_some() {
        return Outcome::HostCalls;
    }
    if state.memory_denied {
        return Outcome::Memory;
    }
    match e.downcast_ref::<Trap>() {
        Some(Trap::OutOfFuel) => Outcome::Fuel,
        Some(Trap::Interrupt) => Outcome::Deadline,
        Some(Trap::StackOverflow) | Some(Trap::MemoryOutOfBounds) => Outcome::Stack,
        Some(Trap::UnreachableCodeReached) => {
            let panicked = state.panicked || state.output.windows(8).any(|w| w == b"panicked");
            if panicked { Outcome::Panic } else { Outcome::Trap }
        }
        Some(_) => Outcome::Trap,
        None => {
            let msg = format!("{e:#}");
            if msg.contains("memory") && msg.contains("grow") { Outcome::Memory } else { fallback }
        }
    }
}

/// An instrumented instance after `init`, as the snapshot reads it: each read calls an
/// export that the instrumentation added. A read that fails is kept in `failed` (the
/// trait has no error path) and fails the snapshot.
struct Snapshot<'a> {
    store: &'a mut Store<State>,
    instance: wasmtime::component::Instance,
    failed: Option<String>,
}

impl Snapshot<'_> {
    /// Calls `func` of the exported `interface`; `None` (and `failed` set) if that fails.
    fn call<R: wasmtime::component::ComponentType + Lift + Send + Sync + 'static>(
        &mut self,
        interface: &str,
        func: &str,
    ) -> Option<R> {
        let store = &mut *self.store;
        let result = (|| {
            let (_, i) = self.instance.get_export(&mut *store, None, interface)?;
            let (_, f) = self.instance.get_export(&mut *store, Some(&i), func)?;
            let f = self.instance.get_typed_func::<(), (R,)>(&mut *store, f).ok()?;
            f.call(&mut *store, ()).ok().map(|(r,)| r)
        })();
        if result.is_none() {
            self.failed.get_or_insert_with(|| format!("reading {interface}#{func} failed"));
        }
        result
    }

    /// [`Self::call`] for a number, zero if it failed.
    fn read<R: wasmtime::component::ComponentType + Lift + Default + Send + Sync + 'static>(
        &mut self,
        interface: &str,
        func: &str,
    ) -> R {
        self.call(interface, func).unwrap_or_default()
    }
}

impl wasmtime_wizer::ComponentInstanceState for Snapshot<'_> {
    async fn call_func_ret_list_u8(&mut self, instance: &str, func: &str, contents: impl FnOnce(&[u8]) + Send) {
        match self.call::<wasmtime::component::WasmList<u8>>(instance, func) {
            Some(list) => contents(list.as_le_slice(&*self.store)),
            None => contents(&[]),
        }
    }

    async fn call_func_ret_s32(&mut self, instance: &str, func: &str) -> i32 {
        self.read(instance, func)
    }

    async fn call_func_ret_s64(&mut self, instance: &str, func: &str) -> i64 {
        self.read(instance, func)
    }

    async fn call_func_ret_f32(&mut self, instance: &str, func: &str) -> u32 {
        self.read::<f32>(instance, func).to_bits()
    }

    async fn call_func_ret_f64(&mut self, instance: &str, func: &str) -> u64 {
        self.read::<f64>(instance, func).to_bits()
    }
}

/// Polls `f` once: `None` if it is not ready. The snapshot's future never waits (every
/// call it makes is synchronous), so one poll finishes it.
fn poll_once<F: std::future::Future>(f: F) -> Option<F::Output> {
    let mut f = std::pin::pin!(f);
    match f.as_mut().poll(&mut std::task::Context::from_waker(std::task::Waker::noop())) {
        std::task::Poll::Ready(v) => Some(v),
        std::task::Poll::Pending => None,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    #![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

    use super::*;

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
        let wit = include_str!("../../../wit/filter.wit");
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
        let mut store = new_store(&rt.engine, true, Lane::Pool, &b, Instant::now());
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
    fn the_coarse_clock_follows_the_epoch_thread() {
        let _rt = Runtime::new(&RuntimeConfig { max_instances: 8, ..Default::default() }).unwrap();
        let (before, start) = (coarse_ms(), Instant::now());
        // It advances with the ticks (waiting up to 2 s: a busy host may delay the thread).
        while coarse_ms() < before + 25 && start.elapsed() < Duration::from_secs(2) {
            std::thread::sleep(Duration::from_millis(5));
        }
        let after = coarse_ms();
        assert!(after >= before + 25, "{before} -> {after} in {:?}", start.elapsed());
        assert!(after <= clock_ms(), "never ahead of the clock it follows");
    }

    #[test]
    fn a_call_that_outruns_its_slice_runs_again_on_the_idle_pool_and_counts_once() {
        let rt = Runtime::new(&RuntimeConfig { max_instances: 8, ..Default::default() }).unwrap();
        let limits = Limits { fuel: 10_000_000_000, deadline_ms: 2_000, host_calls: 100_000, ..Limits::default() };
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
        let limits = Limits { memory_bytes: 8 << 20, fuel: 100_000_000, deadline_ms: 2_000, ..Limits::default() };
        let b = binding(&rt, "memory_bomb", "", limits);
        let c = call(&rt, &b);
        assert_eq!(c.result.unwrap_err(), Outcome::Memory, "its own limit, on the pool");
        assert_eq!(b.stats.reruns.load(Ordering::Relaxed), 1, "stopped at 2 MiB on the worker");
    }

    #[test]
    fn an_oversized_answer_is_refused_on_the_idle_pool_itself() {
        let rt = Runtime::new(&RuntimeConfig { max_instances: 8, ..Default::default() }).unwrap();
        let limits = Limits { memory_bytes: 64 << 20, fuel: 100_000_000, deadline_ms: 2_000, ..Limits::default() };
        let b = binding(&rt, "huge_header", "", limits);
        b.stats.pool_until_ms.store(u64::MAX, Ordering::Relaxed);
        let c = call(&rt, &b);
        assert_eq!(c.result.unwrap_err(), Outcome::BadOutput, "1,000 headers of 1 KiB never reach the worker");
        // Within the limits, the same path answers.
        let b = binding(&rt, "well_behaved", "", Limits::default());
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
    fn a_rerun_keeps_the_deadline_of_the_first_start() {
        let rt = Runtime::new(&RuntimeConfig { max_instances: 8, ..Default::default() }).unwrap();
        let limits = Limits { fuel: 10_000_000_000, deadline_ms: 30, host_calls: 100_000, ..Limits::default() };
        let b = binding(&rt, "slow_counter", r#"{"spin_us": 1000000}"#, limits);
        let c = call(&rt, &b);
        assert_eq!(c.result.unwrap_err(), Outcome::Deadline);
        assert!(c.took < Duration::from_millis(500), "{:?}", c.took);
        assert_eq!(b.stats.reruns.load(Ordering::Relaxed), 1);
        assert_eq!(counter(&b.stats, "calls"), Some(1));
    }
}
