//! The calling thread's hook state, in one thread-local of one cache line: the nesting
//! depth (`guard`'s), the thread's kernel id, where its stack state lives (`sent`) and its
//! hold on its event lane (`lanes`), with the channel that lane belongs to.
//!
//! Hot. One thread-local for all of it, found from the thread pointer and its offset, which
//! the hook line keeps ([`crate::initial_exec`], `process::hook_line`); a hook looks it up
//! once, in `guard::Scope::enter`, and keeps the address. A `const` thread-local without
//! destructor stays usable during thread teardown, allocates nothing, and can never fail.
//! The channel owns it because two of its three parts are the channel's (the lane and the
//! sent stacks); the nesting guard reads and writes the depth through [`HookThread::depth`].

use crate::channel::lanes::Cursor;
use crate::channel::sent::ThreadStacks;
use std::cell::Cell;

/// One thread's hook state, on one cache line: everything a hooked call reads of its
/// thread until a stack is captured (the nesting depth, the thread id, its hold on its
/// lane) comes with one line.
#[repr(C, align(64))]
pub struct HookThread {
    /// The nesting depth.
    depth: Cell<u32>,
    /// The kernel thread id, asked once (0: not yet).
    tid: Cell<u32>,
    /// Set by `guard::set_pass_through`: the depth holds one extra level.
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
    pub(crate) static THREAD: HookThread, symbol "memsnap_hook_thread";
}

/// The hook state's offset from the thread pointer, kept on the line every hooked call reads
/// (`process::hook_line`), so that finding the hook state reads no line of the global
/// offset table.
pub(crate) const THREAD_OFFSET: &std::sync::atomic::AtomicIsize =
    &crate::process::hook_line::HOOK_LINE.hook_thread_offset;

impl HookThread {
    /// The calling thread's hook state, found from the thread pointer (the hooks' way in).
    #[inline(always)]
    pub fn current() -> *const HookThread {
        // SAFETY: THREAD_OFFSET keeps THREAD's offset and nothing else's.
        unsafe { THREAD.as_ptr_through(THREAD_OFFSET) }
    }

    /// The nesting depth (`guard`'s: only the outermost hooked call records).
    #[inline(always)]
    pub fn depth(&self) -> &Cell<u32> {
        &self.depth
    }

    /// Whether the thread passes its hooked calls through (`guard::set_pass_through`).
    pub fn passing_through(&self) -> &Cell<bool> {
        &self.passing_through
    }

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

/// Runs `f` with the calling thread's hook state, outside any hooked call (its stack
/// state's first use and thread-exit destructor, tests).
pub fn with_thread<R>(f: impl FnOnce(&HookThread) -> R) -> R {
    THREAD.with(f)
}
