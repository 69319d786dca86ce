//! Taking an earlier path whole: one pass over the stack words its steps read, then its
//! frames copied at once. Hot (the common case of a capture).

use super::paths::{Check, NODES, PIECE_FRAMES, Paths};
use super::thread::Bounds;
use super::walk::{Deferred, MAX_STEPS, Out};
use crate::capture::count;
use crate::channel::event::StackSlot;
use crate::process::modules;

/// Takes the whole path of node `start` (which holds this walk's state) at once when
/// every stack word its steps read still holds what it held (for a stack cut at the
/// frame limit, the steps to the cut): one pass over those checks, the path's frames
/// copied in one piece. Returns whether the walk reached the end of
/// the stack within the frame limit, or `None` when the path has no piece, would pass
/// the step limit or no longer holds (then [`follow`] takes it node by node and finds
/// where it changed).
///
/// [`follow`]: super::follow::follow
#[inline(always)]
pub(super) fn take_whole(
    paths: &Paths,
    start: u32,
    bounds: Bounds,
    steps: &mut usize,
    slot: &mut StackSlot,
    out: &mut Out,
) -> Option<bool> {
    let view = &paths.views[start as usize % NODES];
    if *steps + view.steps as usize > MAX_STEPS || !head_holds(paths, start, bounds) {
        return None;
    }
    // A stack cut at the frame limit keeps the path's first `room` frames: only the
    // steps up to the frame after them (which says that the stack goes on) must still
    // hold, not the outer ones, whose stack words are the coldest of the walk.
    let (frames_from, frames_end) = (view.frames_from as usize, view.frames_end as usize);
    let room = out.max.min(slot.native.len()).saturating_sub(out.n);
    // (Both are below `PIECE_FRAMES` and a stack's frames: no overflow.)
    let cut = frames_from + room;
    let checks_end = if cut < frames_end {
        paths.frame_checks[cut % PIECE_FRAMES] as usize
    } else {
        view.checks_end as usize
    };
    // (`head_holds` found the piece whole and in bounds.)
    let checks = paths.checks.get(view.checks_from as usize..checks_end)?;
    let rest = &checks[checks.len().min(HEAD)..];
    let anchor = paths.anchor;
    let differs_at = |check: &Check| {
        let (offset, value) = (check.at, check.value);
        // SAFETY: as in `head_holds`: a read a walk on this thread made in bounds, at or
        // above `lowest_read`, which is at or above this capture's stack pointer.
        let word = unsafe { std::ptr::read_unaligned(word_at(anchor, offset)) };
        word ^ value
    };
    // Four words a round: the loop's own three instructions once per four words
    // (callgrind, C loop of 34 frames: 7 instructions a word before, about 5 after).
    let mut quads = rest.chunks_exact(4);
    let mut differs = 0u64;
    for q in &mut quads {
        differs |= differs_at(&q[0]) | differs_at(&q[1]) | differs_at(&q[2]) | differs_at(&q[3]);
    }
    for check in quads.remainder() {
        differs |= differs_at(check);
    }
    if differs != 0 {
        return None;
    }
    count!(WholePaths, 1);
    count!(StepsReused, view.steps);
    count!(ReadsChecked, checks.len());
    if view.ends_unknown {
        modules::mark_stale();
    }
    *steps += view.steps as usize;
    let frames = paths.frames.get(frames_from..frames_end)?;
    let take = frames.len().min(room);
    if out.defer {
        out.deferred = Deferred {
            from: view.frames_from,
            at: out.n as u16,
            len: take as u16,
        };
    } else {
        slot.native[out.n..out.n + take].copy_from_slice(&frames[..take]);
    }
    out.n += take;
    if take < frames.len() {
        slot.truncated = true;
        return Some(false);
    }
    Some(true)
}

/// Words of a piece checked one by one before the rest ([`head_holds`]).
const HEAD: usize = 4;

/// Whether node `start`'s path has a piece whose first [`HEAD`] words still hold. They
/// are the innermost frames' return addresses: where a path changed (another call site),
/// it is usually there.
#[inline(always)]
fn head_holds(paths: &Paths, start: u32, bounds: Bounds) -> bool {
    let view = &paths.views[start as usize % NODES];
    if !view.whole || view.lowest_read < bounds.lo {
        return false;
    }
    let end = (view.checks_end as usize).min(view.checks_from as usize + HEAD);
    let Some(head) = paths.checks.get(view.checks_from as usize..end) else {
        return false;
    };
    head.iter().all(|check| {
        let (offset, value) = (check.at, check.value);
        // SAFETY: every check is a read that a walk on this thread made in bounds (so
        // below the same top of stack), at or above `lowest_read`, which is at or above
        // this capture's stack pointer: this thread's live stack, mapped and readable.
        let word = unsafe { std::ptr::read_unaligned(word_at(paths.anchor, offset)) };
        word == value
    })
}

/// The stack word a check reads: `offset` bytes from `anchor` ([`Check`]).
#[inline(always)]
pub(super) fn word_at(anchor: u64, offset: i32) -> *const u64 {
    anchor.wrapping_add(offset as i64 as u64) as *const u64
}
