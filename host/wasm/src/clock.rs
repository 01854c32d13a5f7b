//! The runtime's monotonic clock, and its coarse copy the epoch thread keeps: what the
//! per-call bookkeeping (quarantine windows, the idle pool's lane) reads instead of asking
//! the system for the time on every request. While no epoch thread ticks (nothing runs),
//! the coarse clock reads the real one.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

fn clock_origin() -> Instant {
    static ORIGIN: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *ORIGIN.get_or_init(Instant::now)
}

/// Milliseconds of the runtime's monotonic clock.
pub(crate) fn clock_ms() -> u64 {
    u64::try_from(clock_origin().elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// [`clock_ms`] as of the epoch thread's last tick, at most about a millisecond old.
static COARSE_MS: AtomicU64 = AtomicU64::new(0);

/// Epoch threads ticking now.
static TICKING: AtomicUsize = AtomicUsize::new(0);

/// Milliseconds of the runtime's monotonic clock, as of the last epoch tick: what the
/// per-call bookkeeping (quarantine windows, the idle pool's lane) reads instead of asking
/// the system for the time on every request. With no epoch thread ticking (an idle node,
/// or the first call after idleness), the clock itself.
pub(crate) fn coarse_ms() -> u64 {
    if TICKING.load(Ordering::Acquire) == 0 {
        return clock_ms();
    }
    COARSE_MS.load(Ordering::Relaxed)
}

/// Epoch threads ticking now, in this process (tests: another test's runtime may tick).
#[cfg(test)]
pub(crate) fn ticking_threads() -> usize {
    TICKING.load(Ordering::Acquire)
}

/// An epoch thread starts (`true`) or stops (`false`) ticking; starting brings the
/// coarse clock up to date first.
pub(crate) fn ticking(on: bool) {
    if on {
        tick();
        TICKING.fetch_add(1, Ordering::AcqRel);
    } else {
        TICKING.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Nanoseconds of the runtime's monotonic clock (the `monotonic-now` import).
pub(crate) fn monotonic_ns() -> u64 {
    u64::try_from(clock_origin().elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// Brings [`coarse_ms`] up to date: the epoch thread does this on every tick.
pub(crate) fn tick() {
    COARSE_MS.fetch_max(clock_ms(), Ordering::Relaxed);
}

/// CPU time the calling thread has used (user and system): what a filter's deadline
/// measures on the idle pool. A system call (~0.3 µs here, against ~30 ns for the
/// monotonic clock), so a call on a worker reads it only when sampled.
///
/// Through the C library rather than rustix: rustix finds and checks the vDSO itself,
/// which crashes a node run under valgrind (bytecodealliance/rustix#1559), and for a
/// thread's CPU clock both end in the same system call.
#[allow(unsafe_code)]
pub(crate) fn thread_cpu() -> std::time::Duration {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `t` is a valid `timespec` the call may write, and lives through it.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) } != 0 {
        return std::time::Duration::ZERO;
    }
    std::time::Duration::new(u64::try_from(t.tv_sec).unwrap_or(0), u32::try_from(t.tv_nsec).unwrap_or(0))
}
