//! The capture entry points (`capture`, `finish`, `capture_interrupted`) and the set-up
//! each walk shares. Hot.

use super::framehop::Framehop;
use super::thread::{Bounds, STACK, STATE_GONE, ThreadUnwind, UNWIND, stack_bounds, thread_unwind};
use super::walk::{Deferred, Out, copy_deferred, walk};
use crate::capture::count;
use crate::channel::event::StackSlot;
use crate::config::FRAME_CAPACITY;
use crate::process::modules;

/// Fills `slot.native` with return addresses, innermost first, memsnap's own frames
/// removed, walking from `from` ([`super::here`] in a caller whose frame is still live).
/// Sets `slot.truncated` if the stack had more than `max_frames` frames. Returns the
/// native chain of what it wrote (`channel::event::native_chain`), kept up by the walk
/// so that reused frames are not hashed again; `None` when the walk cannot tell (then
/// the caller computes it).
///
/// With `defer`, the frames of a whole earlier path the walk took may be left out of
/// `slot` (its count and chain include them) until [`finish`] copies them: the caller
/// must call it before it reads `slot.native`, and before this thread's next capture.
#[inline(never)]
pub fn capture(
    slot: &mut StackSlot,
    max_frames: usize,
    from: super::StartRegs,
    defer: bool,
) -> Option<u64> {
    slot.n_native = 0;
    let state = thread_unwind()?;
    let bounds = stack_bounds()?;
    capture_from(
        slot,
        max_frames,
        modules::ensure(),
        state,
        bounds,
        from,
        defer,
    )
}

/// Copies into `slot` the frames that this thread's last [`capture`] into it left in
/// their piece, if any.
#[inline]
pub fn finish(slot: &mut StackSlot) {
    let p = UNWIND.with(|c| c.get());
    if p.is_null() || p == STATE_GONE {
        return;
    }
    // SAFETY: this thread's leaked state (see `thread_unwind`); `finish` runs inside
    // the hook that captured (the nesting guard), never during another capture.
    let state = unsafe { &mut *p };
    if state.deferred.len != 0 {
        copy_deferred(&state.paths, state.deferred, slot);
        state.deferred = Deferred::default();
    }
}

/// The stack of the code a signal interrupted, from the registers the kernel saved
/// (`ip` is the interrupted instruction). Async-signal-safe: it uses only what this
/// thread's earlier captures set up (unwind state, stack bounds, the module table)
/// and captures nothing on a thread that never captured.
pub fn capture_interrupted(slot: &mut StackSlot, max_frames: usize, regs: super::StartRegs) {
    slot.n_native = 0;
    let p = UNWIND.with(|c| c.get());
    if p.is_null() || p == STATE_GONE {
        return;
    }
    // SAFETY: this thread's leaked state (see `thread_unwind`). The signal may have
    // interrupted a capture on this thread, so the caller makes sure it did not (the
    // hooks' nesting guard is not held).
    let state = unsafe { &mut *p };
    let (bottom, top) = STACK.with(|c| c.get());
    if top == 0 || top == u64::MAX {
        return;
    }
    let Some(table) = modules::current() else {
        return;
    };
    let max = max_frames.min(FRAME_CAPACITY);
    if max == 0 {
        return;
    }
    // The walk yields return addresses; the interrupted instruction itself (the fault)
    // goes first.
    let _ = capture_from(slot, max - 1, table, state, (bottom, top), regs, false);
    let n = slot.n_native as usize;
    slot.native.copy_within(0..n, 1);
    slot.native[0] = regs.ip;
    slot.n_native = (n + 1) as u16;
}

#[inline(always)]
fn capture_from(
    slot: &mut StackSlot,
    max_frames: usize,
    table: &modules::ModuleTable,
    state: &mut ThreadUnwind,
    (bottom, top): (u64, u64),
    from: super::StartRegs,
    defer: bool,
) -> Option<u64> {
    let max = max_frames.min(FRAME_CAPACITY);
    if max == 0 {
        return None;
    }
    if from.sp < bottom || from.sp >= top {
        // Running on another stack (a signal's alternate stack, a coroutine's): the
        // reads could not be bounded, so no native frames.
        return None;
    }
    let mut out = Out {
        n: 0,
        max,
        defer,
        deferred: Deferred::default(),
    };
    let chain = walk(
        &mut Framehop {
            table,
            caches: &mut state.caches,
        },
        &mut state.rules,
        &mut state.paths,
        &mut state.pending,
        Bounds { lo: from.sp, top },
        from,
        slot,
        &mut out,
    );
    // With `defer`, the frames of a whole path the walk took at its end may stay in
    // their piece for `finish`: only where the walk's chain is known (else the caller
    // hashes the frames in the slot). The piece stays as it is until the thread's next
    // walk (`link` may forget every node at the walk's end, but not overwrite pieces).
    if chain.is_some() {
        state.deferred = out.deferred;
    } else {
        state.deferred = Deferred::default();
        copy_deferred(&state.paths, out.deferred, slot);
    }
    count!(Walks, 1);
    count!(NativeFrames, slot.n_native);
    count!(NativeTruncated, slot.truncated);
    chain
}
