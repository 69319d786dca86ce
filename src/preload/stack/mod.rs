//! Stack capture in the hook: native return addresses and raw Python frames.
//!
//! Hot. Fills a [`StackSlot`] in place; never allocates, locks or panics.
//! (Stub: capture is being written; it records no frames yet.)

use crate::config::Stacks;
use crate::preload::event::StackSlot;

/// Captures the calling thread's stack into `slot`, at most `max_frames` of each kind.
#[inline(never)]
pub fn capture(slot: &mut StackSlot, stacks: Stacks, max_frames: usize) {
    let _ = (stacks, max_frames);
    slot.n_native = 0;
    slot.n_python = 0;
    slot.truncated = false;
}
