//! The epoch thread: it advances the engine's epoch (the deadlines' clock) and the coarse
//! clock every millisecond while a call is running, and sleeps, woken by nothing, while
//! none is: an idle node wakes no thread.
//!
//! A store holds an [`Awake`] for its life ([`Epoch::awake`]); the first one wakes the
//! thread. A deadline counts epoch ticks from when its call's store was made, so ticks
//! that did not happen while nothing ran change no deadline.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::Thread;
use std::time::Duration;

use wasmtime::Engine;

/// The epoch thread of one engine.
#[derive(Debug)]
pub(crate) struct Epoch {
    /// Stores alive (calls running, or being set up or freed).
    active: AtomicUsize,
    stop: AtomicBool,
    thread: OnceLock<Thread>,
    /// Ticks so far.
    ticks: AtomicU64,
}

/// Keeps the epoch thread ticking while it lives.
#[derive(Debug)]
pub(crate) struct Awake(Arc<Epoch>);

impl Drop for Awake {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::Release);
    }
}

impl Epoch {
    /// Starts the thread for `engine`; it sleeps until the first [`Epoch::awake`].
    pub(crate) fn start(engine: Engine) -> std::io::Result<Arc<Epoch>> {
        let epoch = Arc::new(Epoch {
            active: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            thread: OnceLock::new(),
            ticks: AtomicU64::new(0),
        });
        let e = epoch.clone();
        let handle = std::thread::Builder::new().name("postern-epoch".into()).spawn(move || {
            while !e.stop.load(Ordering::Relaxed) {
                if e.active.load(Ordering::Acquire) == 0 {
                    // Nothing runs: sleep until a call starts (an `unpark` that came
                    // first makes this return at once).
                    std::thread::park();
                    continue;
                }
                crate::clock::ticking(true);
                while e.active.load(Ordering::Acquire) > 0 && !e.stop.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(1));
                    engine.increment_epoch();
                    crate::clock::tick();
                    e.ticks.fetch_add(1, Ordering::Relaxed);
                }
                crate::clock::ticking(false);
            }
        })?;
        let _ = epoch.thread.set(handle.thread().clone());
        Ok(epoch)
    }

    /// Keeps the thread ticking until the guard drops: for each store, from before its
    /// call starts until it is freed.
    pub(crate) fn awake(self: &Arc<Self>) -> Awake {
        if self.active.fetch_add(1, Ordering::AcqRel) == 0
            && let Some(t) = self.thread.get()
        {
            t.unpark();
        }
        Awake(self.clone())
    }

    /// Ends the thread (the runtime is dropped).
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.get() {
            t.unpark();
        }
    }

    /// Ticks so far.
    #[cfg(test)]
    pub(crate) fn ticks(&self) -> u64 {
        self.ticks.load(Ordering::Relaxed)
    }
}
