//! The two lanes a call runs on. First **on the worker**, synchronously, within a slice of
//! fuel and memory growth; a call that outruns its slice (or a filter demoted after a
//! costly failure) runs again from the start on the **idle pool**: threads at the lowest
//! CPU priority fed from a bounded queue, with the arguments copied for them. A fresh
//! store and instance per call on either lane.

use std::cell::Cell;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use wasmtime::component::{ComponentExportIndex, ComponentNamedList, Lift, Lower, ResourceTable};
use wasmtime::{Engine, Store, UpdateDeadline};

use super::epoch::Epoch;
use super::fit::{call_decision_fits, call_response_fits};
use super::state::{State, classify};
use super::wit::{
    OnRequest, OnRequestBody, OnRequestBodyOwned, OnRequestOwned, OnResponse, OnResponseOwned, owned, owned_context,
    owned_fields, owned_request, typed, types,
};
use super::{Binding, Call, Exports, Runtime};
use crate::clock::{coarse_ms, thread_cpu};
use crate::stats::Outcome;
use postern_model::wasm::Limits;

/// How much fuel a call may burn on the worker before it is stopped and run again on the
/// idle pool: ~0.5 ms of guest code here (10 M fuel ≈ 0.65 ms). Fuel, not wall time, so
/// a worker preempted mid-call does not send a quick filter to the pool.
pub const SLICE_FUEL: u64 = 7_000_000;

/// How far a call may grow its memory on the worker before it is stopped and run again
/// on the idle pool: faulting in fresh pages is time that burns no fuel.
pub const SLICE_MEMORY: usize = 2 << 20;

/// Calls waiting for the idle pool at most; beyond, a call is `overloaded`.
const POOL_QUEUE: usize = 256;

/// One call in this many on a thread has its CPU time read at its start and end, for the
/// filter's CPU histogram (each read is a system call).
const CPU_SAMPLE_EVERY: u32 = 64;

thread_local! {
    static CALLS: Cell<u32> = const { Cell::new(0) };
}

/// Whether this thread's next call is sampled for the CPU histogram.
fn sample_cpu() -> bool {
    CALLS.with(|c| {
        let n = c.get().wrapping_add(1);
        c.set(n);
        n % CPU_SAMPLE_EVERY == 0
    })
}

/// Epoch ticks to a worker call's deadline: never reached (about 35 years of ticks, and
/// far from overflowing the engine's epoch counter), as a worker call is bounded by its
/// slice, not by time.
const NO_DEADLINE: u64 = 1 << 40;

/// How long past the wall-clock backstop a request waits for its call on the idle pool
/// (which is interrupted at the first epoch tick past it) before answering `overloaded`
/// without it.
const POOL_GRACE: Duration = Duration::from_millis(20);

impl Runtime {
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
        request_id: &str,
    ) -> Option<Call<R>>
    where
        P: ComponentNamedList + Lower,
        R: ComponentNamedList + Lift,
    {
        if self.metering && b.stats.pool_until_ms.load(Ordering::Relaxed) > coarse_ms() {
            return None;
        }
        let (store, result) = call_in_fresh_instance(self.sandbox(), Lane::Worker, b, export, params, start);
        // Out of the slice's fuel (not the filter's own) or memory: the filter needs more
        // than a slice, so it runs again on the idle pool, as its next calls will.
        let state = store.data();
        let out_of_slice = state.out_of_slice || (matches!(result, Err(Outcome::Fuel)) && state.fuel < b.limits.fuel);
        if !out_of_slice {
            let result = result.and_then(|r| fits(&r, &b.limits).map(|()| r));
            return Some(finish(self.metering, store, result, start, request_id));
        }
        b.stats.reruns.fetch_add(1, Ordering::Relaxed);
        b.stats.demote();
        None
    }

    /// One call of the export at `export` in a fresh instance on the idle pool, for a
    /// request that started at `start`; an answer that does not `fit` the limits is
    /// `bad_output` there. The answer comes by the wall-clock backstop (and a little
    /// grace) even if the pool is busy: then it is `overloaded` (the node's doing, not
    /// the filter's), and the queued call is dropped unrun.
    fn run_on_pool<P, R>(
        &self,
        b: &Binding,
        export: fn(&Exports) -> &ComponentExportIndex,
        params: P,
        fits: fn(&R, &Limits) -> Result<(), Outcome>,
        start: Instant,
        request_id: String,
    ) -> impl Future<Output = Call<R>> + Send + 'static
    where
        P: ComponentNamedList + Lower + Send + 'static,
        R: ComponentNamedList + Lift + Send + 'static,
    {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (engine, epoch, metering, b) = (self.engine.clone(), self.epoch.clone(), self.metering, b.clone());
        let backstop = start.checked_add(b.limits.wall_backstop());
        let job: Job = Box::new(move || {
            if tx.is_closed() {
                return; // the request is gone
            }
            if backstop.is_some_and(|t| Instant::now() >= t) {
                let _ = tx.send(Call::unrun(Outcome::Overloaded, start.elapsed()));
                return;
            }
            let (store, result) = call_in_fresh_instance(
                Sandbox { engine: &engine, epoch: &epoch, metering },
                Lane::Pool,
                &b,
                export,
                params,
                start,
            );
            let result = result.and_then(|r| fits(&r, &b.limits).map(|()| r));
            let _ = tx.send(finish(metering, store, result, start, &request_id));
        });
        let queued = self.pool.try_send(job).is_ok();
        async move {
            if !queued {
                return Call::unrun(Outcome::Overloaded, start.elapsed());
            }
            let answer = match backstop.and_then(|t| t.checked_add(POOL_GRACE)) {
                Some(t) => tokio::time::timeout_at(t.into(), rx).await.ok(),
                None => Some(rx.await),
            };
            match answer {
                Some(Ok(call)) => call,
                _ => Call::unrun(Outcome::Overloaded, start.elapsed()),
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
        let request_id = cx.request_id;
        let call = self.run_on_worker::<OnRequest<'_>, _>(
            b,
            |e| &e.on_request,
            (req, cx),
            call_decision_fits,
            start,
            request_id,
        );
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
        let request_id = cx.request_id.to_owned();
        let call =
            self.run_on_pool::<OnRequestOwned, _>(b, |e| &e.on_request, params, call_decision_fits, start, request_id);
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
        let request_id = cx.request_id;
        let call = self.run_on_worker::<OnRequestBody<'_>, _>(
            b,
            |e| &e.on_request_body,
            (req, body, cx),
            call_decision_fits,
            start,
            request_id,
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
        let request_id = cx.request_id.to_owned();
        let call = self.run_on_pool::<OnRequestBodyOwned, _>(
            b,
            |e| &e.on_request_body,
            params,
            call_decision_fits,
            start,
            request_id,
        );
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
        let worker = self.run_on_worker::<OnResponse<'_>, _>(
            b,
            |e| &e.on_response,
            params,
            call_response_fits,
            start,
            cx.request_id,
        );
        let call = match worker {
            Some(call) => call,
            None => {
                let head = owned::types::ResponseHead { status: resp.status, headers: owned_fields(resp.headers) };
                let params = (head, owned_context(&cx));
                let request_id = cx.request_id.to_owned();
                self.run_on_pool::<OnResponseOwned, _>(
                    b,
                    |e| &e.on_response,
                    params,
                    call_response_fits,
                    start,
                    request_id,
                )
                .await
            }
        };
        call.map(|(r,)| r)
    }
}

/// Where a call runs, which decides its store's limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Lane {
    /// On a worker: at most a slice of fuel and memory growth ([`SLICE_FUEL`],
    /// [`SLICE_MEMORY`]), then it is stopped to run again on the idle pool.
    Worker,
    /// On the idle pool: the filter's own limits, and the wall-clock backstop.
    Pool,
    /// At snapshot build, for `init`: the limits it is given, and no wall clock (it
    /// delays no request).
    Init,
}

/// What a store is made in: the engine, its epoch thread, and whether calls are metered.
#[derive(Clone, Copy)]
pub(super) struct Sandbox<'a> {
    pub(super) engine: &'a Engine,
    pub(super) epoch: &'a Arc<Epoch>,
    pub(super) metering: bool,
}

impl Runtime {
    pub(super) fn sandbox(&self) -> Sandbox<'_> {
        Sandbox { engine: &self.engine, epoch: &self.epoch, metering: self.metering }
    }
}

/// A fresh store for one call of a request that started at `start`, on `lane`.
///
/// On the idle pool and for `init` the deadline is CPU time of the thread running the
/// call, read when the store is made and checked at each epoch tick (1 ms): the call is
/// interrupted at the first tick after it used its deadline, so a thread that was merely
/// descheduled loses nothing. On the idle pool a wall-clock backstop
/// ([`Limits::wall_backstop`], from `start`) bounds the call too: past it the call is
/// `overloaded`.
///
/// On a worker the slice bounds the call instead (at most [`SLICE_FUEL`] of guest code,
/// well under a millisecond, and [`SLICE_MEMORY`] of growth; host calls are few, cheap
/// and never block), and its CPU clock is not judged: the thread's clock also counts time
/// that is not the filter's (a vCPU the hypervisor took, the kernel's own work on a
/// fault), and one such spike must not fail a quick filter's call and send its route to
/// the idle pool. A call that outruns its slice runs again from the start on the pool,
/// where its whole deadline is judged. The store keeps the epoch thread ticking while it
/// lives (the pool's deadlines and the coarse clock).
pub(super) fn new_store(
    Sandbox { engine, epoch, metering }: Sandbox<'_>,
    lane: Lane,
    b: &Binding,
    start: Instant,
) -> Store<State> {
    let (limits, stats, tag) = (&b.limits, b.stats.clone(), b.tag.clone());
    let cpu_sampled = metering && sample_cpu();
    let state = State {
        table: ResourceTable::new(),
        output: Vec::new(),
        memory_max: usize::try_from(limits.memory_bytes).unwrap_or(usize::MAX),
        memory_slice: if lane == Lane::Worker && metering { SLICE_MEMORY } else { usize::MAX },
        memory_base: 0,
        memory_denied: false,
        memory_peak: 0,
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
        cpu_base: (cpu_sampled || (metering && lane != Lane::Worker)).then(thread_cpu),
        cpu_sampled,
        over_wall: false,
        logs: Vec::new(),
        counters: Vec::new(),
        _awake: metering.then(|| epoch.awake()),
    };
    let mut store = Store::new(engine, state);
    store.limiter(|s| s);
    if !metering {
        return store;
    }
    let fuel = if lane == Lane::Worker { limits.fuel.min(SLICE_FUEL) } else { limits.fuel };
    let _ = store.set_fuel(fuel);
    store.data_mut().fuel = fuel;
    if lane == Lane::Worker {
        store.set_epoch_deadline(NO_DEADLINE);
        return store;
    }
    let cpu_limit = limits.deadline();
    let backstop = if lane == Lane::Pool { start.checked_add(limits.wall_backstop()) } else { None };
    store.epoch_deadline_callback(move |mut cx| {
        let cpu = thread_cpu();
        let state = cx.data_mut();
        if cpu.saturating_sub(*state.cpu_base.get_or_insert(cpu)) >= cpu_limit {
            return Ok(UpdateDeadline::Interrupt);
        }
        if backstop.is_some_and(|t| Instant::now() >= t) {
            state.over_wall = true;
            return Ok(UpdateDeadline::Interrupt);
        }
        Ok(UpdateDeadline::Continue(1))
    });
    store.set_epoch_deadline(1);
    store
}

/// Instantiates the binding's module in a fresh store on `lane` and calls the export at
/// `export` with `params`: the store (for its records) and the answer or why there is
/// none.
fn call_in_fresh_instance<P, R>(
    sandbox: Sandbox<'_>,
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
    let mut store = new_store(sandbox, lane, b, start);
    let result = match b.module.pre.instantiate(&mut store) {
        Err(e) => Err(classify(&e, store.data(), Outcome::Instantiate)),
        Ok(instance) => typed::<P, R>(&instance, &mut store, export(&b.module.exports))
            .and_then(|f| f.call(&mut store, params))
            .map_err(|e| classify(&e, store.data(), Outcome::Trap)),
    };
    (store, result)
}

/// The call is final: its log lines (tagged with the request's id) and counters go out,
/// and the store is dropped.
pub(super) fn finish<T>(
    metering: bool,
    mut store: Store<State>,
    result: Result<T, Outcome>,
    start: Instant,
    request_id: &str,
) -> Call<T> {
    let fuel = if metering { store.data().fuel.saturating_sub(store.get_fuel().unwrap_or(0)) } else { 0 };
    let state = store.data();
    if state.cpu_sampled
        && let Some(base) = state.cpu_base
    {
        state.stats.record_cpu(thread_cpu().saturating_sub(base));
    }
    let state = store.data_mut();
    state.commit(request_id);
    let (memory, logs, counters) =
        (state.memory_peak, std::mem::take(&mut state.logs), std::mem::take(&mut state.counters));
    drop(store);
    Call { result, fuel, took: start.elapsed(), memory, logs, counters }
}

/// A call for the idle pool.
pub(super) type Job = Box<dyn FnOnce() + Send>;

/// Starts the idle pool: `threads` threads at the lowest CPU priority (nice 19), taking
/// calls from a queue of [`POOL_QUEUE`]; returns once each has set its priority. They end
/// when the sender is dropped.
pub(super) fn start_pool(threads: usize) -> std::io::Result<std::sync::mpsc::SyncSender<Job>> {
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
