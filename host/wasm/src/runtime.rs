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
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use wasmtime::component::{Component, HasSelf, Linker, ResourceTable};
use wasmtime::{Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig, Store, Trap, UpdateDeadline};
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::{WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

use crate::limits::Limits;
use crate::stats::{FilterStats, Outcome};

/// Generated bindings of `wit/filter.wit`.
pub mod bindings {
    wasmtime::component::bindgen!({
        path: "../../wit",
        world: "filter",
        imports: { default: trappable },
        exports: { default: async },
    });
}

use bindings::postern::filter::host::{self, Level};
pub use bindings::postern::filter::types;

/// Interfaces a filter may import; anything else (filesystem, sockets, random, http,
/// clocks) refuses the module when it is loaded.
const ALLOWED_IMPORT_PREFIXES: &[&str] = &[
    "postern:filter/host@0.1.",
    "postern:filter/types@0.1.",
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
    /// Does not implement the `postern:filter/filter` world.
    #[error("does not implement the postern:filter world: {0}")]
    World(String),
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
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        RuntimeConfig { cache_dir: None, max_instances: 1000, maxima: Limits::MAXIMA, metering: true }
    }
}

/// Per-call store state.
pub struct State {
    table: ResourceTable,
    wasi: Option<WasiCtx>,
    stderr: Option<MemoryOutputPipe>,
    memory_max: usize,
    memory_denied: bool,
    host_calls: u32,
    host_calls_max: u32,
    host_calls_exceeded: bool,
    config: Arc<[u8]>,
    stats: Arc<FilterStats>,
    log_budget: usize,
    tag: Arc<str>,
    /// The guest reported a panic (the SDK's panic hook logs it before aborting).
    panicked: bool,
}

impl WasiView for State {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        // Built only when the guest touches WASI (e.g. a panic message on stderr), so an
        // ordinary call pays nothing for it. Nothing is granted: no args, env, files or
        // network; stdout and stderr go to a small in-memory pipe.
        let wasi = self.wasi.get_or_insert_with(|| {
            let pipe = MemoryOutputPipe::new(4096);
            self.stderr = Some(pipe.clone());
            WasiCtxBuilder::new().stdout(pipe.clone()).stderr(pipe).build()
        });
        WasiCtxView { ctx: wasi, table: &mut self.table }
    }
}

impl wasmtime::ResourceLimiter for State {
    fn memory_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        if desired > self.memory_max {
            self.memory_denied = true;
            return Ok(false);
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

/// Trap raised when a filter calls the host too often.
#[derive(Debug, thiserror::Error)]
#[error("host call limit exceeded")]
struct HostCallLimit;

impl State {
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
    fn log(&mut self, level: Level, message: String) -> wasmtime::Result<()> {
        self.host_call()?;
        if matches!(level, Level::Error) && message.starts_with("filter panicked") {
            self.panicked = true;
        }
        if self.log_budget == 0 {
            return Ok(());
        }
        let msg: String = message.chars().take(self.log_budget.min(1024)).collect();
        self.log_budget = self.log_budget.saturating_sub(msg.len().max(1));
        let tag = &*self.tag;
        match level {
            Level::Debug => tracing::debug!(filter = tag, "{msg}"),
            Level::Info => tracing::info!(filter = tag, "{msg}"),
            Level::Warn => tracing::warn!(filter = tag, "{msg}"),
            Level::Error => tracing::error!(filter = tag, "{msg}"),
        }
        Ok(())
    }

    fn counter_add(&mut self, name: String, delta: u64) -> wasmtime::Result<()> {
        self.host_call()?;
        if name.len() <= 64 {
            self.stats.counter_add(&name, delta);
        }
        Ok(())
    }

    fn monotonic_now(&mut self) -> wasmtime::Result<u64> {
        self.host_call()?;
        Ok(u64::try_from(clock_origin().elapsed().as_nanos()).unwrap_or(u64::MAX))
    }

    fn config(&mut self) -> wasmtime::Result<Vec<u8>> {
        self.host_call()?;
        Ok(self.config.to_vec())
    }
}

impl types::Host for State {}

fn clock_origin() -> Instant {
    static ORIGIN: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *ORIGIN.get_or_init(Instant::now)
}

/// A compiled, validated, pre-instantiated filter module.
pub struct Module {
    /// `sha256:<hex>` of the component bytes.
    pub digest: String,
    pre: bindings::FilterPre<State>,
}

impl std::fmt::Debug for Module {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Module").field("digest", &self.digest).finish_non_exhaustive()
    }
}

/// The process's Wasm runtime.
pub struct Runtime {
    engine: Engine,
    linker: Linker<State>,
    modules: Mutex<HashMap<String, Arc<Module>>>,
    stop: Arc<AtomicBool>,
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
    /// The attachment's config, returned by the `config` import.
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
        // Reset a freed slot's first 128 KiB of memory (and its tables) by memset instead of
        // madvise, so the next instance starts on resident pages instead of faulting
        // them in again: this is most of the cost of a fresh instance per request.
        pool.linear_memory_keep_resident(128 << 10);
        pool.table_keep_resident(64 << 10);
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
        add_minimal_wasi(&mut linker)?;

        let stop = Arc::new(AtomicBool::new(false));
        let (e, s) = (engine.clone(), stop.clone());
        std::thread::Builder::new().name("postern-epoch".into()).spawn(move || {
            while !s.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(1));
                e.increment_epoch();
            }
        })?;
        Ok(Arc::new(Runtime {
            engine,
            linker,
            modules: Mutex::new(HashMap::new()),
            stop,
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
        let ty = component.component_type();
        let forbidden: Vec<&str> = ty
            .imports(&self.engine)
            .map(|(name, _)| name)
            .filter(|name| !ALLOWED_IMPORT_PREFIXES.iter().any(|p| name.starts_with(p)))
            .collect();
        if !forbidden.is_empty() {
            return Err(LoadError::ForbiddenImport(forbidden.join(", ")));
        }
        let pre = self.linker.instantiate_pre(&component).map_err(|e| LoadError::World(format!("{e:#}")))?;
        let pre = bindings::FilterPre::new(pre).map_err(|e| LoadError::World(format!("{e:#}")))?;
        let module = Arc::new(Module { digest: d.clone(), pre });
        self.modules.lock().unwrap_or_else(|p| p.into_inner()).insert(d, module.clone());
        Ok(module)
    }

    fn store(&self, b: &Binding) -> Store<State> {
        let (limits, config, stats, tag) = (&b.limits, b.config.clone(), b.stats.clone(), b.tag.clone());
        let state = State {
            table: ResourceTable::new(),
            wasi: None,
            stderr: None,
            memory_max: usize::try_from(limits.memory_bytes).unwrap_or(usize::MAX),
            memory_denied: false,
            host_calls: 0,
            host_calls_max: limits.host_calls,
            host_calls_exceeded: false,
            config,
            stats,
            log_budget: 4096,
            tag,
            panicked: false,
        };
        let mut store = Store::new(&self.engine, state);
        store.limiter(|s| s);
        if !self.metering {
            return store;
        }
        let _ = store.set_fuel(limits.fuel);
        // Yield to the executor every tick (1 ms) so a busy filter never holds a worker;
        // past the deadline, interrupt it.
        let deadline = Instant::now() + limits.deadline();
        store.epoch_deadline_callback(move |_| {
            if Instant::now() >= deadline { Ok(UpdateDeadline::Interrupt) } else { Ok(UpdateDeadline::Yield(1)) }
        });
        store.set_epoch_deadline(1);
        store
    }

    async fn run<T, F>(&self, b: &Binding, f: F) -> Call<T>
    where
        F: AsyncFnOnce(&bindings::Filter, &mut Store<State>) -> wasmtime::Result<T>,
    {
        let start = Instant::now();
        let mut store = self.store(b);
        let result = match b.module.pre.instantiate_async(&mut store).await {
            Err(e) => Err(classify(&e, store.data(), Outcome::Instantiate)),
            Ok(instance) => f(&instance, &mut store).await.map_err(|e| classify(&e, store.data(), Outcome::Trap)),
        };
        let fuel = if self.metering { b.limits.fuel.saturating_sub(store.get_fuel().unwrap_or(0)) } else { 0 };
        Call { result, fuel, took: start.elapsed() }
    }

    /// Runs the request phase in a fresh instance.
    pub async fn on_request(&self, b: &Binding, req: types::Request, cx: types::Context) -> Call<types::Decision> {
        self.run(b, async |inst, store| inst.call_on_request(store, &req, &cx).await).await
    }

    /// Runs the request body phase in a fresh instance.
    pub async fn on_request_body(
        &self,
        b: &Binding,
        req: types::Request,
        body: &[u8],
        cx: types::Context,
    ) -> Call<types::Decision> {
        self.run(b, async |inst, store| inst.call_on_request_body(store, &req, body, &cx).await).await
    }

    /// Runs the response phase in a fresh instance.
    pub async fn on_response(
        &self,
        b: &Binding,
        resp: types::ResponseHead,
        cx: types::Context,
    ) -> Call<types::ResponseEdits> {
        self.run(b, async |inst, store| inst.call_on_response(store, &resp, &cx).await).await
    }
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
            let panicked = state.panicked
                || state.stderr.as_ref().is_some_and(|p| {
                    let b = p.contents();
                    b.windows(8).any(|w| w == b"panicked")
                });
            if panicked { Outcome::Panic } else { Outcome::Trap }
        }
        Some(_) => Outcome::Trap,
        None => {
            let msg = format!("{e:#}");
            if msg.contains("memory") && msg.contains("grow") { Outcome::Memory } else { fallback }
        }
    }
}

/// Links only the WASI interfaces a Rust `std` guest imports even when it does not use
/// them (io, cli): no filesystem, sockets, clocks or randomness.
fn add_minimal_wasi(linker: &mut Linker<State>) -> anyhow::Result<()> {
    struct Io;
    impl wasmtime::component::HasData for Io {
        type Data<'a> = &'a mut ResourceTable;
    }
    use wasmtime_wasi::cli::WasiCli;
    use wasmtime_wasi::p2::bindings::cli;
    wasmtime_wasi_io::bindings::wasi::io::error::add_to_linker::<State, Io>(linker, |s| &mut s.table)?;
    wasmtime_wasi_io::bindings::wasi::io::poll::add_to_linker::<State, Io>(linker, |s| &mut s.table)?;
    wasmtime_wasi_io::bindings::wasi::io::streams::add_to_linker::<State, Io>(linker, |s| &mut s.table)?;
    cli::exit::add_to_linker::<State, WasiCli>(linker, <State as wasmtime_wasi::cli::WasiCliView>::cli)?;
    cli::environment::add_to_linker::<State, WasiCli>(linker, <State as wasmtime_wasi::cli::WasiCliView>::cli)?;
    cli::stdin::add_to_linker::<State, WasiCli>(linker, <State as wasmtime_wasi::cli::WasiCliView>::cli)?;
    cli::stdout::add_to_linker::<State, WasiCli>(linker, <State as wasmtime_wasi::cli::WasiCliView>::cli)?;
    cli::stderr::add_to_linker::<State, WasiCli>(linker, <State as wasmtime_wasi::cli::WasiCliView>::cli)?;
    cli::terminal_input::add_to_linker::<State, WasiCli>(linker, <State as wasmtime_wasi::cli::WasiCliView>::cli)?;
    cli::terminal_output::add_to_linker::<State, WasiCli>(linker, <State as wasmtime_wasi::cli::WasiCliView>::cli)?;
    cli::terminal_stdin::add_to_linker::<State, WasiCli>(linker, <State as wasmtime_wasi::cli::WasiCliView>::cli)?;
    cli::terminal_stdout::add_to_linker::<State, WasiCli>(linker, <State as wasmtime_wasi::cli::WasiCliView>::cli)?;
    cli::terminal_stderr::add_to_linker::<State, WasiCli>(linker, <State as wasmtime_wasi::cli::WasiCliView>::cli)?;
    Ok(())
}
