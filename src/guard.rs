//! The calling thread's hook state, in one thread-local: the nesting guard (one allocation
//! is one record, whichever route it took), the thread's kernel id, and where its stack
//! state lives.
//!
//! Its event lane (`channel::lanes`) is kept here too, with the channel it belongs to.
//!
//! Hot. `cudaMalloc` reaches `cuMemAlloc_v2` through a pointer we also hooked; only the
//! outermost hooked call records. A `const` thread-local without destructor stays usable
//! during thread teardown, allocates nothing, and can never fail. One thread-local for all
//! of it, found from the thread pointer and its offset, which the hook line keeps
//! ([`crate::initial_exec`], `process::hook_line`); a hook looks it up once, in
//! [`Scope::enter`], and the scope keeps the address.

use crate::channel::lanes::Cursor;
use crate::channel::sent::ThreadStacks;
use std::cell::Cell;
#[cfg(feature = "bench-hooks")]
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

/// One thread's hook state, on one cache line: everything a hooked call reads of its
/// thread until a stack is captured (the nesting depth, the thread id, its hold on its
/// lane) comes with one line.
#[repr(C, align(64))]
pub struct HookThread {
    /// The nesting depth.
    depth: Cell<u32>,
    /// The kernel thread id, asked once (0: not yet).
    tid: Cell<u32>,
    /// Set by [`set_pass_through`]: the depth holds one extra level.
    passing_through: Cell<bool>,
    /// The address of the channel `lane` belongs to (a forked child's channel is another:
    /// its first event claims a lane there).
    lane_channel: Cell<usize>,
    /// This thread's stack state (`channel::sent`): null until its first stack, then the
    /// state, or `sent`'s "gone" mark once the thread-exit destructor freed it.
    pub(crate) stacks: Cell<*mut ThreadStacks>,
    /// This thread's hold on its event lane (where it writes next), valid while
    /// `lane_channel` is the channel's address; [`Cursor::NONE`] until the first event,
    /// [`Cursor::NO_LANE`] once given back at thread exit or when there was none to claim.
    lane: Cell<Cursor>,
}

const _: () = assert!(size_of::<HookThread>() == 64);

// SAFETY: every field is zero at a thread's start: depth 0, no thread id yet, not passing
// through, no channel, no stack state (null), and `Cursor::NONE` (all zero, checked below).
unsafe impl crate::initial_exec::ZeroIsValid for HookThread {}
const _: () = assert!(Cursor::NONE.is_all_zero());

crate::initial_exec::initial_exec_thread_local! {
    static THREAD: HookThread, symbol "memsnap_hook_thread";
}

/// The hook state's offset from the thread pointer, kept on the line every hooked call reads
/// (`process::hook_line`), so that finding the hook state reads no line of the global
/// offset table.
const THREAD_OFFSET: &std::sync::atomic::AtomicIsize =
    &crate::process::hook_line::HOOK_LINE.hook_thread_offset;

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
        // SAFETY: THREAD_OFFSET keeps THREAD's offset and nothing else's.
        let thread = unsafe { THREAD.as_ptr_through(THREAD_OFFSET) };
        // SAFETY: this thread's own thread-local (see the field), used on this thread.
        let depth = unsafe { &(*thread).depth };
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

impl HookThread {
    /// Kernel thread id, asked once per thread.
    #[inline(always)]
    pub fn tid(&self) -> u32 {
        let v = self.tid.get();
        if v != 0 {
            return v;
        }
        self.tid_first()
    }

    /// This thread's hold on its lane of the channel at address `channel`, if it has one
    /// there.
    #[inline(always)]
    pub fn lane(&self, channel: usize) -> Option<&Cell<Cursor>> {
        (self.lane_channel.get() == channel).then_some(&self.lane)
    }

    /// Whether the thread sends through the shared queue for the rest of its life.
    pub fn without_lane(&self) -> bool {
        self.lane.get().is_no_lane()
    }

    /// Notes the lane this thread claimed on the channel at address `channel`.
    pub fn set_lane(&self, cursor: Cursor, channel: usize) {
        self.lane.set(cursor);
        self.lane_channel.set(channel);
    }

    /// From now on this thread's events go to the shared queue. Returns its hold on the
    /// lane it had (for the count its next owner goes on from).
    pub fn go_without_lane(&self) -> Cursor {
        self.lane_channel.set(0);
        self.lane.replace(Cursor::NO_LANE)
    }

    #[cold]
    #[inline(never)]
    fn tid_first(&self) -> u32 {
        // SAFETY: gettid has no preconditions.
        let v = unsafe { libc::gettid() } as u32;
        self.tid.set(v);
        v
    }
}

impl Drop for Scope {
    #[inline(always)]
    fn drop(&mut self) {
        let d = &self.thread().depth;
        d.set(d.get().wrapping_sub(1));
    }
}

/// Runs `f` with the calling thread's hook state, outside any hooked call (its stack
/// state's first use and thread-exit destructor, tests).
pub fn with_thread<R>(f: impl FnOnce(&HookThread) -> R) -> R {
    THREAD.with(f)
}

/// Whether this thread is inside a hooked call or is memsnap's own: a signal handler then
/// must not capture a stack (it may have interrupted a capture).
pub fn inside_hook_or_internal() -> bool {
    THREAD.with(|t| t.depth.get() != 0)
}

/// Benchmarks only: while on, the calling thread's hooked calls pass straight through
/// unrecorded, exactly as nested calls do (one extra depth level), so that a benchmark can
/// time the same loop recorded and not recorded in one process. Costs the hooks nothing:
/// they check the depth anyway.
pub fn set_pass_through(on: bool) {
    THREAD.with(|t| {
        if t.passing_through.replace(on) == on {
            return;
        }
        let v = t.depth.get();
        t.depth.set(if on {
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
/// recorded and not recorded in one process (`scripts/gpu/step_time.py`). Calls already
/// inside a hook finish as they started.
#[cfg(feature = "bench-hooks")]
pub fn set_pass_through_every_thread(on: bool) {
    EVERY_THREAD_PASSING_THROUGH.store(on, Relaxed);
}

/// Marks the current thread as internal for its whole life (the writer thread).
pub fn mark_thread_internal() {
    THREAD.with(|t| t.depth.set(INTERNAL));
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
