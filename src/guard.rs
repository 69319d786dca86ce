//! Thread-local nesting guard: one allocation is one record, whichever route it took.
//!
//! Hot. `cudaMalloc` reaches `cuMemAlloc_v2` through a pointer we also hooked; only the
//! outermost hooked call records. A `const` thread-local `Cell` has no destructor, so it
//! stays usable during thread teardown, allocates nothing, and can never fail.

use std::cell::Cell;

thread_local! {
    static DEPTH: Cell<u32> = const { Cell::new(0) };
    /// Set by [`set_pass_through`]: this thread's depth holds one extra level.
    static PASSING_THROUGH: Cell<bool> = const { Cell::new(false) };
}

/// Depth that marks a thread as memsnap's own (the writer): it never records.
const INTERNAL: u32 = 1 << 30;

/// Held for the duration of a hooked call.
pub struct Scope {
    outermost: bool,
}

impl Scope {
    #[inline(always)]
    pub fn enter() -> Scope {
        let depth = DEPTH.with(|d| {
            let v = d.get();
            d.set(v.wrapping_add(1));
            v
        });
        Scope {
            outermost: depth == 0,
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
        DEPTH.with(|d| d.set(d.get().wrapping_sub(1)));
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
