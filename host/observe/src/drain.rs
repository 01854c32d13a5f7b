//! The shape both the access log and the tracer have: a bounded lock-free queue that a
//! request pushes into (a full queue refuses, the caller counts the drop; nothing
//! blocks), drained by one thread of its own, which drains once more at shutdown.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

use crossbeam_queue::ArrayQueue;

/// A bounded queue and the thread that drains it.
pub(crate) struct Drain<T> {
    queue: ArrayQueue<Box<T>>,
    stop: AtomicBool,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl<T> Drain<T> {
    /// A queue of `capacity` items (at least one), no thread yet.
    pub(crate) fn new(capacity: usize) -> Drain<T> {
        Drain { queue: ArrayQueue::new(capacity.max(1)), stop: AtomicBool::new(false), thread: Mutex::new(None) }
    }

    /// Starts the draining thread, named `name`, running `run` until it returns.
    pub(crate) fn spawn(&self, name: &str, run: impl FnOnce() + Send + 'static) -> std::io::Result<()> {
        let handle = std::thread::Builder::new().name(name.into()).spawn(run)?;
        *self.thread.lock().unwrap_or_else(|p| p.into_inner()) = Some(handle);
        Ok(())
    }

    /// Queues an item; `false` when the queue is full (the item is dropped). Never blocks.
    pub(crate) fn push(&self, item: Box<T>) -> bool {
        self.queue.push(item).is_ok()
    }

    /// The next queued item.
    pub(crate) fn pop(&self) -> Option<Box<T>> {
        self.queue.pop()
    }

    /// Items queued now.
    pub(crate) fn len(&self) -> usize {
        self.queue.len()
    }

    /// Whether shutdown was asked: read before a pass, the thread returns after it.
    pub(crate) fn stopping(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    /// Asks the thread to make its last pass and waits for it.
    pub(crate) fn shutdown(&self) {
        self.stop.store(true, Ordering::Release);
        let handle = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(h) = handle {
            h.thread().unpark();
            let _ = h.join();
        }
    }
}

/// Whether the request with random id `id` is in a sample of `per_10k` parts per
/// 10,000: the access log and the traces pick the same requests.
pub(crate) fn sampled(id: u128, per_10k: u32) -> bool {
    id % 10_000 < u128::from(per_10k)
}
