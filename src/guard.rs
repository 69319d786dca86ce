//! Thread-local nesting guard: one allocation is one record, whichever route it took.
//!
//! Hot. `cudaMalloc` reaches `cuMemAlloc_v2` through a pointer we also hooked; only the
//! outermost hooked call records. A `const` thread-local `Cell` has no destructor, so it
//! stays usable during thread teardown, allocates nothing, and can never fail.

use std::cell::Cell;

thread_local! {
    /// The nesting depth. [`Scope`] keeps its address, so that leaving a hooked call costs
    /// no second thread-local lookup (in a shared library each lookup is a call to
    /// `__tls_get_addr`, about 11 instructions).
    static DEPTH: Cell<u32> = const { Cell::new(0) };
    /// Set by [`set_pass_through`]: this thread's depth holds one extra level.
    static PASSING_THROUGH: Cell<bool> = const { Cell::new(false) };
}

/// Depth that marks a thread as memsnap's own (the writer): it never records.
const INTERNAL: u32 = 1 << 30;

/// Held for the duration of a hooked call.
pub struct Scope {
    /// This thread's [`DEPTH`]: a `const` thread-local without destructor, valid for the
    /// whole life of the thread, which outlives the scope.
    depth: *const Cell<u32>,
    outermost: bool,
}

impl Scope {
    #[inline(always)]
    pub fn enter() -> Scope {
        let depth = DEPTH.with(|d| d as *const Cell<u32>);
        // SAFETY: this thread's own thread-local (see the field), read on this thread.
        let v = unsafe { (*depth).get() };
        // SAFETY: as above.
        unsafe { (*depth).set(v.wrapping_add(1)) };
        Scope {
            depth,
            outermost: v == 0,
        }
    }

    /// Whether this call is the outermost hooked call on this thread (it records).
    #[inline(always)]
    pub fn outermost(&self) -> bool {
        self.outermost
    }
}

impl Drop for Scope {
    #[inline(always)]
    fn drop(&mut self) {
        // SAFETY: `Scope` is not `Send` (it holds a raw pointer), so this runs on the thread
        // whose thread-local `depth` points to, which is still alive.
        let d = unsafe { &*self.depth };
        d.set(d.get().wrapping_sub(1));
    }
}

/// Whether this thread is inside a hooked call or is memsnap's own: a signal handler then
/// must not capture a stack (it may have interrupted a capture).
pub fn inside_hook_or_internal() -> bool {
    DEPTH.with(|d| d.get() != 0)
}

/// Benchmarks only: while on, the calling thread's hooked calls pass straight through
/// unrecorded, exactly as nested calls do (one extra depth level), so that a benchmark can
/// time the same loop recorded and not recorded in one process. Costs the hooks nothing:
/// they check the depth anyway.
pub fn set_pass_through(on: bool) {
    if PASSING_THROUGH.with(|p| p.replace(on)) == on {
        return;
    }
    DEPTH.with(|d| {
        let v = d.get();
        d.set(if on {
            v.wrapping_add(1)
        } else {
            v.wrapping_sub(1)
        });
    });
}

/// Marks the current thread as internal for its whole life (the writer thread).
pub fn mark_thread_internal() {
    DEPTH.with(|d| d.set(INTERNAL));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_outermost_scope_records() {
        let a = Scope::enter();
        assert!(a.outermost());
        {
            let b = Scope::enter();
            assert!(!b.outermost());
        }
        drop(a);
        assert!(Scope::enter().outermost());
    }

    #[test]
    fn passing_through_records_nothing_until_turned_off() {
        set_pass_through(true);
        set_pass_through(true); // twice on is still one level
        assert!(!Scope::enter().outermost());
        set_pass_through(false);
        set_pass_through(false);
        assert!(Scope::enter().outermost());
    }

    #[test]
    fn internal_threads_never_record() {
        std::thread::spawn(|| {
            mark_thread_internal();
            assert!(!Scope::enter().outermost());
        })
        .join()
        .unwrap();
    }
}
