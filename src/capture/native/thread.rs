//! Per-thread state: the unwind state a thread's first capture allocates (given back at
//! thread exit) and the thread's stack bounds, which bound every stack read. Hot (read on
//! every capture).

use super::framehop::{Cache, RULE_CACHES};
use super::paths::Paths;
use super::rules::Rules;
use super::walk::{Deferred, Pending};
use std::cell::Cell;

/// Marks a thread whose unwind state was given back by the thread-exit destructor.
pub(super) const STATE_GONE: *mut ThreadUnwind = std::ptr::without_provenance_mut(1);

/// A thread's unwinder caches, the paths its walks took and room for a walk's own steps.
pub(super) struct ThreadUnwind {
    pub(super) caches: [Cache; RULE_CACHES],
    /// The rules memsnap executes itself (see [`Rule`]).
    ///
    /// [`Rule`]: super::rules::Rule
    pub(super) rules: Rules,
    pub(super) paths: Paths,
    pub(super) pending: Pending,
    /// Frames the last capture left in their piece ([`finish`]).
    ///
    /// [`finish`]: super::entry::finish
    pub(super) deferred: Deferred,
}

crate::initial_exec::initial_exec_thread_local! {
    /// This thread's unwind state: null until its first capture, then the state, or
    /// `STATE_GONE` once its thread-exit destructor freed it.
    pub(super) static UNWIND: Cell<*mut ThreadUnwind>, symbol "memsnap_native_unwind";
}

crate::initial_exec::initial_exec_thread_local! {
    /// This thread's stack `[bottom, top)`; top 0 = not looked up yet, MAX = unknown.
    pub(super) static STACK: Cell<(u64, u64)>, symbol "memsnap_native_stack";
}

static UNWIND_KEY: crate::thread_state::ExitKey = crate::thread_state::ExitKey::new();

unsafe extern "C" fn free_unwind(p: *mut libc::c_void) {
    UNWIND.with(|c| c.set(STATE_GONE));
    if !p.is_null() {
        // SAFETY: `p` is the state mapped for this thread; the thread is exiting and
        // its TLS now says "gone", so no later capture on it can use the pointer.
        unsafe { crate::thread_state::free(p as *mut ThreadUnwind) };
    }
}

/// The thread's unwind state, created on its first capture.
#[inline]
pub(super) fn thread_unwind() -> Option<&'static mut ThreadUnwind> {
    let p = UNWIND.with(|c| c.get());
    if p == STATE_GONE {
        return None;
    }
    if !p.is_null() {
        // SAFETY: `p` is this thread's leaked state; only this thread uses it, and
        // `capture` is not re-entered on one thread (the hooks' nesting guard).
        return Some(unsafe { &mut *p });
    }
    // About 8.3 MiB of address space, nearly all of it the paths' pools, whose pages
    // become resident only as walks fill them (the caches allocate their own ~300 KiB).
    // SAFETY: all-zero bytes are valid paths and rules (no module table yet: `table`
    // 0, which no module table has, so nothing is taken from them; every index entry
    // and key 0 an empty one) and an empty list of pending nodes; the caches are
    // written in place below, before any use. `free_unwind` frees a `ThreadUnwind`.
    let fresh: *mut ThreadUnwind = unsafe { UNWIND_KEY.alloc_zeroed(free_unwind) };
    if fresh.is_null() {
        return None;
    }
    // SAFETY: just allocated for this thread; the caches are written before any use.
    unsafe {
        let caches = std::ptr::addr_of_mut!((*fresh).caches) as *mut Cache;
        for i in 0..RULE_CACHES {
            caches.add(i).write(Cache::new_in());
        }
    }
    UNWIND.with(|c| c.set(fresh));
    // SAFETY: just allocated, owned by this thread.
    Some(unsafe { &mut *fresh })
}

/// The calling thread's stack `[bottom, top)`, looked up once per thread; `None` when
/// unknown (then no native frames: reads could not be bounded).
#[inline]
pub(super) fn stack_bounds() -> Option<(u64, u64)> {
    let (bottom, top) = STACK.with(|c| c.get());
    if top != 0 {
        return (top != u64::MAX).then_some((bottom, top));
    }
    let mut bounds = (0u64, u64::MAX);
    // SAFETY: attr is initialised by pthread_getattr_np before use and destroyed after.
    unsafe {
        let mut attr: libc::pthread_attr_t = std::mem::zeroed();
        if libc::pthread_getattr_np(libc::pthread_self(), &mut attr) == 0 {
            let mut addr: *mut libc::c_void = std::ptr::null_mut();
            let mut size: libc::size_t = 0;
            if libc::pthread_attr_getstack(&attr, &mut addr, &mut size) == 0 && size > 0 {
                bounds = (addr as u64, (addr as u64).saturating_add(size as u64));
            }
            libc::pthread_attr_destroy(&mut attr);
        }
    }
    STACK.with(|c| c.set(bounds));
    (bounds.1 != u64::MAX).then_some(bounds)
}

/// The readable part of the thread's stack: `[sp at capture, top)`.
#[derive(Clone, Copy)]
pub(super) struct Bounds {
    pub(super) lo: u64,
    pub(super) top: u64,
}

impl Bounds {
    #[inline(always)]
    pub(super) fn read(self, addr: u64) -> Result<u64, ()> {
        if addr < self.lo || addr > self.top.saturating_sub(8) {
            return Err(());
        }
        // SAFETY: `[lo, top)` is this thread's live stack: everything above the
        // capture's own stack pointer up to the top of the mapping is mapped and
        // readable, and stays so while the capture runs.
        Ok(unsafe { std::ptr::read_unaligned(addr as *const u64) })
    }
}

#[cfg(test)]
#[path = "tests/thread.rs"]
mod tests;
