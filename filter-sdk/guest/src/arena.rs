//! The guest's allocator. Every instance serves one call and is then thrown away, so
//! small allocations come from an arena by bumping a pointer, and freeing one gives its
//! space back only when it is the most recent (`Vec` growth, temporaries). An
//! allocation that does not fit goes to a general allocator (dlmalloc, or the system's
//! when the filter links `std`), which reuses memory, so a filter that churns through
//! more than the arena still runs within its limit.
//!
//! Without `std` the arena is the free end of the module's first memory page(s): the
//! bytes between `__heap_base` (the end of the shadow stack, the data and the statics)
//! and the end of the initial memory, which dlmalloc never uses (it takes new pages
//! with `memory.grow`). A filter whose stack, data and allocations fit in one 64 KiB
//! page then runs in a one-page memory, and the gateway restores half as many bytes
//! after each call as for two pages. With `std`, the C library's allocator owns that
//! space, so the arena is a static block.

#![cfg_attr(not(target_arch = "wasm32"), allow(dead_code))]

use core::alloc::{GlobalAlloc, Layout};
use core::cell::Cell;

/// The arena's size when it is a static block (`std`) and in the native tests.
#[cfg(any(feature = "std", not(target_arch = "wasm32")))]
const SIZE: usize = 32 * 1024;

/// A bump arena in front of a general allocator `A`. Its bytes, `lo..hi`, are claimed
/// by `region` on the first allocation.
pub struct Arena<A> {
    region: fn() -> (usize, usize),
    lo: Cell<usize>,
    hi: Cell<usize>,
    /// The first free byte; `lo <= top <= hi`.
    top: Cell<usize>,
    fallback: A,
}

// SAFETY: a wasm32 filter instance is single-threaded.
unsafe impl<A> Sync for Arena<A> {}

impl<A> Arena<A> {
    const fn new(region: fn() -> (usize, usize), fallback: A) -> Arena<A> {
        Arena { region, lo: Cell::new(0), hi: Cell::new(0), top: Cell::new(0), fallback }
    }

    fn owns(&self, ptr: *mut u8) -> bool {
        let p = ptr as usize;
        p >= self.lo.get() && p < self.hi.get()
    }

    /// The arena's bytes, claimed on first use.
    fn claim(&self) {
        if self.hi.get() == 0 {
            let (lo, hi) = (self.region)();
            let lo = (lo + 15) & !15;
            let hi = hi.max(lo);
            self.lo.set(lo);
            self.hi.set(hi);
            self.top.set(lo);
        }
    }
}

// SAFETY: blocks handed out do not overlap: the arena's are below `top`, the system's
// come from the fallback; each is returned to where it came from.
unsafe impl<A: GlobalAlloc> GlobalAlloc for Arena<A> {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        self.claim();
        let start = (self.top.get() + layout.align() - 1) & !(layout.align() - 1);
        match start.checked_add(layout.size()) {
            Some(end) if end <= self.hi.get() => {
                self.top.set(end);
                start as *mut u8
            }
            // SAFETY: same contract as ours.
            _ => unsafe { self.fallback.alloc(layout) },
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if self.owns(ptr) {
            if ptr as usize + layout.size() == self.top.get() {
                self.top.set(ptr as usize);
            }
            return;
        }
        // SAFETY: not the arena's, so the fallback's.
        unsafe { self.fallback.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // The most recent block grows or shrinks in place.
        if self.owns(ptr) && ptr as usize + layout.size() == self.top.get() {
            let end = ptr as usize + new_size;
            if end <= self.hi.get() {
                self.top.set(end);
                return ptr;
            }
        }
        if !self.owns(ptr) {
            // SAFETY: the fallback's block, same contract.
            return unsafe { self.fallback.realloc(ptr, layout, new_size) };
        }
        // SAFETY: `new_size` with the old alignment is a valid layout (GlobalAlloc's contract).
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        // SAFETY: as `alloc`.
        let new = unsafe { self.alloc(new_layout) };
        if !new.is_null() {
            // SAFETY: both blocks are valid for the smaller size and do not overlap.
            unsafe {
                core::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
                self.dealloc(ptr, layout);
            }
        }
        new
    }
}

/// The free end of the initial memory, `__heap_base..` the end of its last page; one
/// more page is taken when that leaves less than `MIN_TAIL` (nothing has grown the
/// memory before the first allocation, so the new page follows on).
#[cfg(all(target_arch = "wasm32", not(feature = "std")))]
fn heap_tail() -> (usize, usize) {
    const PAGE: usize = 64 * 1024;
    const MIN_TAIL: usize = 8 * 1024;
    unsafe extern "C" {
        /// Set by the linker: the first byte after the stack, the data and the statics.
        static __heap_base: u8;
    }
    let lo = (&raw const __heap_base) as usize;
    let mut hi = core::arch::wasm32::memory_size(0) * PAGE;
    if hi.saturating_sub(lo) < MIN_TAIL && core::arch::wasm32::memory_grow(0, 1) == hi / PAGE {
        hi += PAGE;
    }
    (lo, hi)
}

#[cfg(all(target_arch = "wasm32", not(feature = "std")))]
#[global_allocator]
pub(crate) static ARENA: Arena<dlmalloc::GlobalDlmalloc> = Arena::new(heap_tail, dlmalloc::GlobalDlmalloc);

/// A static block, for a filter that links `std`: `std`'s allocator owns the free end
/// of the initial memory.
#[cfg(all(target_arch = "wasm32", feature = "std"))]
fn static_block() -> (usize, usize) {
    #[repr(C, align(16))]
    struct Space(core::cell::UnsafeCell<[u8; SIZE]>);
    // SAFETY: only the arena takes its address, once.
    unsafe impl Sync for Space {}
    static SPACE: Space = Space(core::cell::UnsafeCell::new([0; SIZE]));
    let lo = SPACE.0.get() as usize;
    (lo, lo + SIZE)
}

#[cfg(all(target_arch = "wasm32", feature = "std"))]
#[global_allocator]
static ARENA: Arena<std::alloc::System> = Arena::new(static_block, std::alloc::System);

#[cfg(test)]
mod tests {
    use super::*;
    use std::alloc::System;
    use std::boxed::Box;

    /// A fresh block of `SIZE` bytes (leaked: one per test arena).
    fn block() -> (usize, usize) {
        let lo = Box::leak(vec![0u8; SIZE + 16].into_boxed_slice()).as_mut_ptr() as usize;
        (lo, lo + SIZE)
    }

    fn arena() -> Arena<System> {
        Arena::new(block, System)
    }

    fn layout(size: usize, align: usize) -> Layout {
        Layout::from_size_align(size, align).unwrap()
    }

    #[test]
    fn blocks_are_aligned_apart_and_the_latest_is_given_back() {
        let a = arena();
        unsafe {
            let p = a.alloc(layout(3, 1));
            let q = a.alloc(layout(8, 8));
            assert!(a.owns(p) && a.owns(q));
            assert_eq!(q as usize % 8, 0);
            assert!(q as usize >= p as usize + 3);
            q.write_bytes(7, 8);
            p.write_bytes(1, 3);
            assert_eq!(*q, 7);
            // Freeing the latest block gives its space back; an older one does not.
            a.dealloc(q, layout(8, 8));
            let r = a.alloc(layout(8, 8));
            assert_eq!(r, q);
            a.dealloc(p, layout(3, 1));
            assert_ne!(a.alloc(layout(1, 1)), p);
        }
    }

    #[test]
    fn the_latest_block_grows_in_place_and_others_move_with_their_bytes() {
        let a = arena();
        unsafe {
            let p = a.alloc(layout(4, 1));
            p.copy_from_nonoverlapping(b"abcd".as_ptr(), 4);
            let p2 = a.realloc(p, layout(4, 1), 100);
            assert_eq!(p2, p, "the latest block grows in place");
            let q = a.alloc(layout(4, 1));
            let p3 = a.realloc(p2, layout(100, 1), 200);
            assert_ne!(p3, p2, "an older block moves");
            assert_eq!(std::slice::from_raw_parts(p3, 4), b"abcd");
            assert!(a.owns(q) && a.owns(p3));
        }
    }

    #[test]
    fn what_does_not_fit_goes_to_the_fallback_and_comes_back_from_it() {
        let a = arena();
        unsafe {
            let big = a.alloc(layout(SIZE + 1, 8));
            assert!(!big.is_null() && !a.owns(big));
            big.write_bytes(1, SIZE + 1);
            let small = a.alloc(layout(16, 8));
            assert!(a.owns(small), "the arena is still there for small blocks");
            // A block in the arena grown past it moves to the system, bytes kept.
            small.write_bytes(9, 16);
            let moved = a.realloc(small, layout(16, 8), SIZE * 2);
            assert!(!a.owns(moved));
            assert_eq!(*moved.add(15), 9);
            a.dealloc(moved, layout(SIZE * 2, 8));
            a.dealloc(big, layout(SIZE + 1, 8));
            // Filling the arena exactly, then one byte more.
            let rest = a.hi.get() - a.top.get();
            let fill = a.alloc(layout(rest, 1));
            assert!(a.owns(fill));
            let over = a.alloc(layout(1, 1));
            assert!(!a.owns(over));
            a.dealloc(over, layout(1, 1));
        }
    }

    #[test]
    fn the_region_is_claimed_on_first_use_and_an_empty_one_sends_all_to_the_fallback() {
        let a = arena();
        assert_eq!(a.hi.get(), 0, "nothing claimed before the first allocation");
        unsafe {
            let p = a.alloc(layout(1, 1));
            let (lo, hi) = (a.lo.get(), a.hi.get());
            assert!(a.owns(p) && lo % 16 == 0 && hi - lo <= SIZE && hi - lo >= SIZE - 15);
            a.alloc(layout(1, 1));
            assert_eq!((a.lo.get(), a.hi.get()), (lo, hi), "claimed once");
        }
        let none: Arena<System> = Arena::new(|| (4096, 4096), System);
        unsafe {
            let p = none.alloc(layout(8, 8));
            assert!(!p.is_null() && !none.owns(p));
            none.dealloc(p, layout(8, 8));
        }
    }
}
