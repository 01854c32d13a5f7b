//! What `std` would give a filter, without linking it: a panic handler that reports the
//! message to the gateway, the canonical ABI's `cabi_realloc`, and the C library's
//! `memcmp`. (The global allocator is in `arena.rs`.)
//!
//! A filter that links `std` imports ~20 WASI functions (stdio, environment, exit) even
//! when it never uses them, and every fresh sandbox wires each of them up. Without them
//! a call costs ~25 % less CPU (see `BENCHMARKS.md`). The `std` feature puts `std`'s own
//! versions back.

use core::alloc::{GlobalAlloc, Layout};

/// Logs `filter panicked at src/lib.rs:12:5: boom` at error level, which the gateway
/// records as a guest panic next to the request id, then traps.
#[panic_handler]
fn panic(info: &core::panic::PanicInfo) -> ! {
    crate::host::log_panic(info.location(), &info.message());
    core::arch::wasm32::unreachable()
}

/// The canonical ABI's allocator, through which the gateway passes a call's arguments:
/// the global allocator (the arena first).
///
/// # Safety
///
/// Called by the component's glue only, with `old_len` either 0 or the size of `old`,
/// a block aligned to `align` that this allocator returned.
#[unsafe(export_name = "cabi_realloc")]
unsafe extern "C" fn cabi_realloc(old: *mut u8, old_len: usize, align: usize, new_len: usize) -> *mut u8 {
    let global = &crate::arena::ARENA;
    let ptr = if old_len == 0 {
        if new_len == 0 {
            return align as *mut u8;
        }
        // SAFETY: the canonical ABI passes a power-of-two alignment and a size that fits.
        unsafe { global.alloc(Layout::from_size_align_unchecked(new_len, align)) }
    } else {
        // SAFETY: `old` is this allocator's block of `old_len` bytes aligned to `align`
        // (the caller's contract).
        unsafe { global.realloc(old, Layout::from_size_align_unchecked(old_len, align), new_len) }
    };
    if ptr.is_null() {
        // Out of memory: trap, as `std`'s version does.
        core::arch::wasm32::unreachable()
    }
    ptr
}

/// `memcmp`, which `core`'s slice and string comparisons call and which `std` takes
/// from the C library (`compiler_builtins` has no exported one for this target).
///
/// # Safety
///
/// `a` and `b` are valid for reads of `n` bytes.
#[unsafe(no_mangle)]
unsafe extern "C" fn memcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    let mut i = 0;
    while i < n {
        // SAFETY: `i < n`, within both blocks (the caller's contract).
        let (x, y) = unsafe { (*a.add(i), *b.add(i)) };
        if x != y {
            return i32::from(x) - i32::from(y);
        }
        i += 1;
    }
    0
}

/// `bcmp`: `memcmp` when only equality matters, which LLVM may call instead.
///
/// # Safety
///
/// As [`memcmp`].
#[unsafe(no_mangle)]
unsafe extern "C" fn bcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    // SAFETY: the same contract.
    unsafe { memcmp(a, b, n) }
}
