//! Stack capture in the hook: the walkers that fill a stack slot with native return
//! addresses and raw Python frames.
//!
//! Hot. [`capture`] fills a [`StackSlot`] in place; it never locks, never panics, and after
//! the first capture on a thread it never allocates or makes a syscall (the first one builds
//! the module table once per process, and the thread's unwinder cache and stack bounds once
//! per thread). What the walkers read that outlives a capture (the loaded-module table, the
//! CPython layouts and the interpreter found) is process-wide state in `process/`; turning
//! the raw records into frames is the writer's job (`writer::stacks`).

pub mod native;
pub mod python;
#[cfg(feature = "capture-stats")]
pub mod stats;

/// Adds to a capture statistic ([`stats::Stat`]) in a `capture-stats` build; nothing in any
/// other build, where the counted expression is not evaluated either.
macro_rules! count {
    ($stat:ident, $n:expr) => {
        #[cfg(feature = "capture-stats")]
        $crate::capture::stats::add($crate::capture::stats::Stat::$stat, ($n) as u64);
    };
}
pub(crate) use count;

/// The value of `$e`; in a `capture-stats` build, the time-stamp-counter ticks it took are
/// added to `$stat` too.
macro_rules! timed {
    ($stat:ident, $e:expr) => {{
        #[cfg(feature = "capture-stats")]
        let start = $crate::capture::stats::ticks();
        let value = $e;
        #[cfg(feature = "capture-stats")]
        $crate::capture::stats::add(
            $crate::capture::stats::Stat::$stat,
            $crate::capture::stats::ticks().wrapping_sub(start),
        );
        value
    }};
}
pub(crate) use timed;

/// The recording of one event, `$e`: in a `capture-stats` build its ticks go to
/// `EventTicks`, the event to `Events`, and an empty timed region beside it to `TimerTicks`
/// (what the counter reads add to each timed part).
macro_rules! timed_event {
    ($e:expr) => {{
        let value = $crate::capture::timed!(EventTicks, $e);
        $crate::capture::count!(Events, 1);
        $crate::capture::timed!(TimerTicks, ());
        value
    }};
}
pub(crate) use timed_event;

use crate::channel::event::{StackSlot, native_chain};
pub use crate::channel::sent::Trail;
use crate::config::{FRAME_CAPACITY, Stacks};
use crate::process::modules;

/// One-time setup the hooks may run at initialisation instead of on the first capture:
/// builds the module table (`dl_iterate_phdr`, allocates) and looks up the CPython symbols
/// (`dlsym`). Calling it is optional; `capture` does the same lazily.
pub fn prepare(stacks: Stacks) {
    if stacks.native() {
        modules::ensure();
    }
    if stacks.python() {
        let (mut scratch, mut trail) = (StackSlot::EMPTY, Trail::EMPTY);
        let _ = python::capture(&mut scratch, &mut trail, 1);
    }
}

/// Captures the calling thread's stack into `slot`, at most `max_frames` of each kind.
/// Native frames: innermost first, memsnap's own frames removed. Python frames: innermost
/// first, from the calling thread's own frame chain (no GIL).
///
/// The native walk starts from the registers here, in the caller's frame (this function
/// is always inlined): see [`native::here`]. `trail` is the thread's: where its previous
/// Python walk read ([`Trail`]).
///
/// Returns the stack's [`StackSlot::identity_hash`], most of whose native part the walk
/// carried over from the previous capture.
#[inline(always)]
pub fn capture(slot: &mut StackSlot, trail: &mut Trail, stacks: Stacks, max_frames: usize) -> u64 {
    let hash = capture_from(slot, trail, stacks, max_frames, native::here(), false);
    native::finish(slot);
    hash
}

/// [`capture`] for a stack that is sent by its hash when this thread sent it before: the
/// native frames of an earlier path the walk took whole may stay where the walk found them
/// (a copy of 400 bytes or more an event, to a slot nobody reads) until [`finish`] puts
/// them in `slot`. The caller must call [`finish`] before it reads `slot.native`, and
/// before the thread captures again.
#[inline(always)]
pub fn capture_unfinished(
    slot: &mut StackSlot,
    trail: &mut Trail,
    stacks: Stacks,
    max_frames: usize,
) -> u64 {
    capture_from(slot, trail, stacks, max_frames, native::here(), true)
}

/// Completes the slot of this thread's last [`capture_unfinished`] (see there).
#[inline]
pub fn finish(slot: &mut StackSlot) {
    native::finish(slot);
}

#[inline(never)]
fn capture_from(
    slot: &mut StackSlot,
    trail: &mut Trail,
    stacks: Stacks,
    max_frames: usize,
    from: native::StartRegs,
    defer: bool,
) -> u64 {
    let max = max_frames.min(FRAME_CAPACITY);
    slot.n_native = 0;
    slot.n_python = 0;
    slot.truncated = false;
    let (mut chain, mut python_sum) = (None, 0);
    if stacks.python() {
        // First, so that the Python walk's lines arrive while the native walk runs.
        python::prefetch(trail);
    }
    if stacks.native() {
        chain = timed!(NativeTicks, native::capture(slot, max, from, defer));
    }
    if stacks.python() {
        python_sum = timed!(PythonTicks, python::capture(slot, trail, max));
    }
    let chain = chain.unwrap_or_else(|| native_chain(slot.native()));
    slot.identity_hash_from(chain, python_sum)
}

/// The stack of the code a synchronous signal (a fault, `abort`) interrupted on this thread,
/// from the registers the kernel saved. Async-signal-safe: it uses only what
/// earlier captures on this process and thread set up, and captures nothing otherwise. The
/// caller makes sure the signal did not interrupt a capture (the hooks' nesting guard).
pub fn capture_interrupted(
    slot: &mut StackSlot,
    stacks: Stacks,
    max_frames: usize,
    regs: native::StartRegs,
) {
    let max = max_frames.min(FRAME_CAPACITY);
    slot.n_native = 0;
    slot.n_python = 0;
    slot.truncated = false;
    if stacks.native() {
        native::capture_interrupted(slot, max, regs);
    }
    if stacks.python() && crate::process::python::resolved() {
        // A trail of its own: the thread's may be the one the interrupted capture was
        // writing, and a crash's stack is captured once.
        let mut trail = Trail::EMPTY;
        let _ = python::capture(slot, &mut trail, max);
    }
}
