//! Preparing a module for one attachment, at snapshot build: the filter's `init` runs
//! once with the attachment's config (and may refuse it); when it leaves state worth
//! keeping, the module is pre-initialised with `wasmtime-wizer` — its memory and globals
//! as `init` left them become every instance's starting state.

use std::sync::Arc;
use std::time::Instant;

use sha2::{Digest, Sha256};
use wasmtime::Store;
use wasmtime::component::{Component, ComponentExportIndex, InstancePre, Lift};

use postern_model::wasm::Limits;

use super::lanes::{Lane, new_store};
use super::state::{State, classify};
use super::wit::{Init, InitResult};
use super::{Binding, LoadError, Module, Runtime};
use crate::stats::{FilterStats, Outcome};

impl Runtime {
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
            true => match self.pre_initialise(&binding) {
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
    /// run on the request path; the time as configured, [`super::RuntimeConfig`]) and the
    /// attachment's memory limit (its state must fit the requests' memory).
    fn init_binding(&self, module: &Arc<Module>, config: &[u8], limits: &Limits) -> Binding {
        Binding {
            module: module.clone(),
            limits: Limits { fuel: self.maxima.fuel, deadline_ms: self.init_deadline_ms, ..*limits },
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
        store.data().commit("-");
        answer.map_err(LoadError::Config)
    }

    /// A store for `init`: the binding's limits, but all of its fuel at once (not a
    /// slice), since it does not run on a worker.
    fn init_store(&self, b: &Binding) -> Store<State> {
        new_store(self.sandbox(), Lane::Init, b, Instant::now())
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
    fn pre_initialise(&self, b: &Binding) -> Result<Vec<u8>, String> {
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
        let mut state = MemoryImage { store: &mut store, instance, failed: None };
        let bytes = poll_once(wizer.snapshot_component(&cx, &mut state))
            .ok_or("the snapshot did not finish at once")?
            .map_err(|e| format!("{e:#}"))?;
        match state.failed {
            Some(e) => Err(e),
            None => Ok(bytes),
        }
    }
}

/// An instrumented instance after `init`, as wizer reads its memory image: each read calls an
/// export that the instrumentation added. A read that fails is kept in `failed` (the
/// trait has no error path) and fails the snapshot.
struct MemoryImage<'a> {
    store: &'a mut Store<State>,
    instance: wasmtime::component::Instance,
    failed: Option<String>,
}

impl MemoryImage<'_> {
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

impl wasmtime_wizer::ComponentInstanceState for MemoryImage<'_> {
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
