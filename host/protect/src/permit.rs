//! A request's place in a cluster's cap on requests in flight: taken from a shared
//! counter under a maximum, given back when the request's answer ends.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

/// A request's place in its cluster's cap on requests in flight; given back on drop.
#[derive(Debug)]
pub struct Permit(Arc<AtomicU32>);

impl Permit {
    /// A place under `max` in `gate`, or `None` when the cluster is at its cap.
    pub fn take(gate: &Arc<AtomicU32>, max: u32) -> Option<Permit> {
        if gate.fetch_add(1, Ordering::Relaxed) >= max {
            gate.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        Some(Permit(gate.clone()))
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}
