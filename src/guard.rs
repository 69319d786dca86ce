//! The nesting guard: one allocation is one record, whichever route it took. `cudaMalloc`
//! reaches `cuMemAlloc_v2` through a pointer we also hooked; only the outermost hooked call
//! records. Also the benchmarks' pass-through switches and the mark of memsnap's own
//! threads. The depth lives in the thread's hook state (`channel::thread`).
//!
//! Hot: [`Scope::enter`] and its drop run in every hooked call.

use crate::channel::thread::{HookThread, with_thread};
#[cfg(feature = "bench-hooks")]
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

/// Depth that marks a thread as memsnap's own (the writer): it never records.
const INTERNAL: u32 = 1 << 30;

/// Held for the duration of a hooked call.
pub struct Scope {
    /// This thread's [`HookThread`]: a `const` thread-local without destructor, valid for
    /// the whole life of the thread, which outlives the scope.
    thread: *const HookThread,
    outermost: bool,
}

impl Scope {
    #[inline(always)]
    pub fn enter() -> Scope {
        let thread = HookThread::current();
        // SAFETY: this thread's own thread-local (see the field), used on this thread.
        let depth = unsafe { (*thread).depth() };
        let v = depth.get();
        depth.set(v.wrapping_add(1));
        Scope {
            thread,
            outermost: v == 0 && !every_thread_passing_through(),
        }
    }

    /// Whether this call is the outermost hooked call on this thread (it records).
    #[inline(always)]
    pub fn outermost(&self) -> bool {
        self.outermost
    }

    /// The calling thread's hook state.
    #[inline(always)]
    pub fn thread(&self) -> &HookThread {
        // SAFETY: `Scope` is not `Send` (it holds a raw pointer): this is the thread whose
        // thread-local `thread` points to, alive for at least as long as the scope.
        unsafe { &*self.thread }
    }
}

impl Drop for Scope {
    #[inline(always)]
    fn drop(&mut self) {
        let d = self.thread().depth();
        d.set(d.get().wrapping_sub(1));
    }
}

/// Whether this thread is inside a hooked call or is memsnap's own: a signal handler then
/// must not capture a stack (it may have interrupted a capture).
pub fn inside_hook_or_internal() -> bool {
    with_thread(|t| t.depth().get() != 0)
}

/// Benchmarks only: while on, the calling thread's hooked calls pass straight through
/// unrecorded, exactly as nested calls do (one extra depth level), so that a benchmark can
/// time the same loop recorded and not recorded in one process. Costs the hooks nothing:
/// they check the depth anyway.
pub fn set_pass_through(on: bool) {
    with_thread(|t| {
        if t.passing_through().replace(on) == on {
            return;
        }
        let v = t.depth().get();
        t.depth().set(if on {
            v.wrapping_add(1)
        } else {
            v.wrapping_sub(1)
        });
    });
}

/// Benchmarks only: set by [`set_pass_through_every_thread`]; on the line every hooked
/// call reads (`process::hook_line`).
#[cfg(feature = "bench-hooks")]
const EVERY_THREAD_PASSING_THROUGH: &AtomicBool =
    &crate::process::hook_line::HOOK_LINE.every_thread_passing_through;

/// Whether a benchmark asked every thread's hooked calls to pass through. Builds without
/// the `bench-hooks` feature (the shipped library) fold this to `false`; with it, one
/// relaxed load of a line only the switch writes.
#[inline(always)]
fn every_thread_passing_through() -> bool {
    #[cfg(feature = "bench-hooks")]
    return EVERY_THREAD_PASSING_THROUGH.load(Relaxed);
    #[cfg(not(feature = "bench-hooks"))]
    false
}

/// Benchmarks only: [`set_pass_through`] for every thread of the process at once, so that
/// a training step, whose backward pass allocates on autograd's own threads, can be timed
/// recorded and not recorded in one process (`benches/gpu/step_time.py`). Calls already
/// inside a hook finish as they started.
#[cfg(feature = "bench-hooks")]
pub fn set_pass_through_every_thread(on: bool) {
    EVERY_THREAD_PASSING_THROUGH.store(on, Relaxed);
}

/// Marks the current thread as internal for its whole life (the writer thread).
pub fn mark_thread_internal() {
    with_thread(|t| t.depth().set(INTERNAL));
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

    /// The switch is process-wide and the other tests of this binary expect to record: the
    /// body runs in a child process of its own (this test binary, asked for this test only).
    #[cfg(feature = "bench-hooks")]
    #[test]
    fn every_thread_passes_through_until_turned_off() {
        const CHILD: &str = "GUARD_TEST_CHILD_PROCESS";
        if std::env::var_os(CHILD).is_none() {
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "guard::tests::every_thread_passes_through_until_turned_off",
                ])
                .args(["--test-threads", "1", "--nocapture"])
                .env(CHILD, "1")
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success(),
                "child: {text}{}",
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(text.contains("1 passed"), "the child ran no test: {text}");
            return;
        }
        set_pass_through_every_thread(true);
        let other = || {
            std::thread::spawn(|| Scope::enter().outermost())
                .join()
                .unwrap()
        };
        assert!(!Scope::enter().outermost());
        assert!(
            !other(),
            "another thread recorded while every thread passes through"
        );
        set_pass_through_every_thread(false);
        assert!(Scope::enter().outermost());
        assert!(other());
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
