//! The guest's allocator. Every instance serves one call and is then thrown away, so
//! small allocations come from a fixed arena by bumping a pointer, and freeing one
//! gives its space back only when it is the most recent (`Vec` growth, temporaries).
//! An allocation that does not fit goes to a general allocator (dlmalloc, or the
//! system's when the filter links `std`), which reuses memory, so a filter that churns
//! through more than the arena still runs within its limit.

#![cfg_attr(not(target_arch = "wasm32"), allow(dead_code))]

use core::alloc::{GlobalAlloc, Layout};
use core::cell::{Cell, UnsafeCell};

const SIZE: usize = 32 * 1024;

#[repr(C, align(16))]
struct Space(UnsafeCell<[u8; SIZE]>);

/// A bump arena in front of a general allocator `A`.
pub struct Arena<A> {
    space: Space,
    used: Cell<usize>,
    fallback: A,
}

// SAFETY: a wasm32 filter instance is single-threaded.
unsafe impl<A> Sync for Arena<A> {}

impl<A> Arena<A> {
    const fn new(fallback: A) -> Arena<A> {
        Arena { space: Space(UnsafeCell::new([0; SIZE])), used: Cell::new(0), fallback }
    }

    fn base(&self) -> usize {
        self.space.0.get() as usize
    }

    fn owns(&self, ptr: *mut u8) -> bool {
        let p = ptr as usize;
        p >= self.base() && p < self.base() + SIZE
    }
}

// SAFETY: blocks handed out do not overlap: the arena's are below `used`, the system's
// come from the fallback; each is returned to where it came from.
unsafe impl<A: GlobalAlloc> GlobalAlloc for Arena<A> {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let base = self.base();
        let start = (base + self.used.get() + layout.align() - 1) & !(layout.align() - 1);
        match start.checked_add(layout.size()) {
            Some(end) if end <= base + SIZE => {
                self.used.set(end - base);
                start as *mut u8
            }
            // SAFETY: same contract as ours.
            _ => unsafe { self.fallback.alloc(layout) },
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if self.owns(ptr) {
            if ptr as usize + layout.size() == self.base() + self.used.get() {
                self.used.set(ptr as usize - self.base());
            }
            return;
        }
        // SAFETY: not the arena's, so the fallback's.
        unsafe { self.fallback.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let base = self.base();
        // The most recent block grows or shrinks in place.
        if self.owns(ptr) && ptr as usize + layout.size() == base + self.used.get() {
            let end = ptr as usize + new_size;
            if end <= base + SIZE {
                self.used.set(end - base);
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

#[cfg(all(target_arch = "wasm32", not(feature = "std")))]
#[global_allocator]
pub(crate) static ARENA: Arena<dlmalloc::GlobalDlmalloc> = Arena::new(dlmalloc::GlobalDlmalloc);

#[cfg(all(target_arch = "wasm32", feature = "std"))]
#[global_allocator]
static ARENA: Arena<std::alloc::System> = Arena::new(std::alloc::System);

#[cfg(test)]
mod tests {
    use super::*;
    use std::alloc::System;
    use std::boxed::Box;

    fn layout(size: usize, align: usize) -> Layout {
        Layout::from_size_align(size, align).unwrap()
    }

    #[test]
    fn blocks_are_aligned_apart_and_the_latest_is_given_back() {
        let a = Box::new(Arena::new(System));
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
        let a = Box::new(Arena::new(System));
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
        let a = Box::new(Arena::new(System));
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
            let rest = SIZE - a.used.get();
            let fill = a.alloc(layout(rest, 1));
            assert!(a.owns(fill));
            let over = a.alloc(layout(1, 1));
            assert!(!a.owns(over));
            a.dealloc(over, layout(1, 1));
        }
    }
}
