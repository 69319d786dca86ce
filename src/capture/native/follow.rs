//! Following an earlier path node by node to where it changed, and the `bp` values a walk
//! that leaves it needs. Hot.

use super::framehop::Framehop;
use super::node::{FIRST, Kind, NONE, Node, State};
use super::paths::Paths;
use super::thread::Bounds;
use super::walk::{MAX_STEPS, Out};
use crate::capture::count;
use crate::channel::event::StackSlot;
use crate::process::modules;

/// How a walk that met an earlier path left it.
pub(super) enum Left {
    /// The path held to its end (`complete`), or to the step or frame limit.
    AtItsEnd { complete: bool },
    /// The first `taken` nodes of the path were this walk's frames too, but the last
    /// one's step now gives `next` (`None`: the stack ends there) instead of the path's
    /// next node.
    Elsewhere { taken: usize, next: Option<State> },
    /// The first `taken` nodes were this walk's frames; the next node's step cannot be
    /// made again by its node (a read now out of bounds, or one that would hand the
    /// step to framehop): the walk makes it itself from `state`.
    Unwind { taken: usize, state: State },
}

/// Why [`follow`]'s inner loop stopped.
enum Stop {
    /// At a node that is not a rule's in bounds, or at the step limit.
    Unusual,
    /// The node's step cannot be made by its node now (see [`Left::Unwind`]).
    Unwind,
    /// The slot is full and the node has a frame for it.
    Full,
    /// The node's step gave this state, not the next node's.
    Elsewhere(State),
}

/// Takes the path that starts at node `start` (which holds this walk's state, with `bp`
/// its actual `bp`) as far as it still holds: each node's step is made again from the
/// stack as it is now (one or two reads) and must give the state of the node that
/// follows. Every read is of an address that an earlier walk on this thread read in
/// bounds; it is in bounds now if it is not below this capture's stack pointer (the top
/// is the thread's).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn follow(
    paths: &Paths,
    start: u32,
    mut bp: u64,
    framehop: &mut Framehop,
    bounds: Bounds,
    steps: &mut usize,
    slot: &mut StackSlot,
    out: &mut Out,
) -> Left {
    let mut id = start;
    let mut taken = 0usize;
    let mut done = *steps;
    let mut n = out.n;
    let room = out.max.min(slot.native.len());
    let left = loop {
        // The usual nodes, in a loop of their own: a rule's step, its reads in bounds.
        let stop = loop {
            let node = paths.node(id);
            if node.kind != Kind::Rule || node.lowest_read < bounds.lo || done == MAX_STEPS {
                break Stop::Unusual;
            }
            // SAFETY: both addresses were read in bounds by the walk that made the node
            // (this thread, so the same top of stack) and neither is below
            // `lowest_read`, which is at or above this capture's stack pointer: they lie
            // in this thread's live stack, mapped and readable.
            let (ra, next_bp) = unsafe {
                (
                    std::ptr::read_unaligned((node.next_sp - 8) as *const u64),
                    match node.bp_read_at {
                        0 => bp,
                        at => std::ptr::read_unaligned(at as *const u64),
                    },
                )
            };
            // 0, or an address in the kernel's half: framehop decides (see `run_rule`).
            if ra.wrapping_sub(1) >= FIRST - 1 {
                break Stop::Unwind;
            }
            if node.emits {
                if n >= room {
                    break Stop::Full;
                }
                slot.native[n] = node.state.pc;
                n += 1;
            }
            done += 1;
            taken += 1;
            // A rule's node leads to the node of the state its step gives, so the
            // caller's `sp` is `next_sp`.
            let caller = paths.node(node.caller);
            if caller.state.pc != ra || (caller.bp_matters && caller.state.bp != next_bp) {
                break Stop::Elsewhere(State {
                    pc: ra,
                    sp: node.next_sp,
                    bp: next_bp,
                });
            }
            id = node.caller;
            bp = next_bp;
        };
        let node = paths.node(id);
        let here = State { bp, ..node.state };
        match stop {
            Stop::Elsewhere(next) => {
                break Left::Elsewhere {
                    taken,
                    next: Some(next),
                };
            }
            Stop::Full => {
                slot.truncated = true;
                break Left::AtItsEnd { complete: false };
            }
            Stop::Unwind => break Left::Unwind { taken, state: here },
            Stop::Unusual => {}
        }
        if done == MAX_STEPS {
            count!(WalksAtStepLimit, 1);
            break Left::AtItsEnd { complete: false };
        }
        if node.kind == Kind::Rule {
            break Left::Unwind { taken, state: here };
        }
        let next = redo_other(node, here, framehop, bounds);
        if node.emits {
            if n >= room {
                slot.truncated = true;
                break Left::AtItsEnd { complete: false };
            }
            slot.native[n] = node.state.pc;
            n += 1;
        }
        done += 1;
        taken += 1;
        match (next, node.caller) {
            (None, NONE) => break Left::AtItsEnd { complete: true },
            (Some(next), caller) if caller != NONE && paths.node(caller).holds(next) => {
                id = caller;
                bp = next.bp;
            }
            (next, _) => break Left::Elsewhere { taken, next },
        }
    };
    count!(StepsReused, taken);
    *steps = done;
    out.n = n;
    left
}

/// The `bp` on reaching each of the first `taken` nodes of the path from `start`, the
/// first being `bp`: what [`follow`] saw as it took them, found again (a node keeps the
/// `bp` of the walk that made it, which may differ where the path does not depend on
/// it). Only a walk that leaves a path needs them.
#[inline(never)]
pub(super) fn taken_bps(
    paths: &Paths,
    start: u32,
    mut bp: u64,
    taken: usize,
    framehop: &mut Framehop,
    bounds: Bounds,
    into: &mut [u64; MAX_STEPS],
) {
    let mut id = start;
    for slot in into.iter_mut().take(taken) {
        *slot = bp;
        let node = paths.node(id);
        bp = match node.kind {
            // SAFETY: as in `follow`, which just read this address for this node.
            Kind::Rule if node.bp_read_at != 0 => unsafe {
                std::ptr::read_unaligned(node.bp_read_at as *const u64)
            },
            Kind::Rule => bp,
            _ => redo_other(node, State { bp, ..node.state }, framehop, bounds)
                .map_or(0, |next| next.bp),
        };
        id = node.caller;
    }
}

/// The step of a node that is not a rule memsnap executes, made again from `here`.
#[inline(never)]
fn redo_other(node: &Node, here: State, framehop: &mut Framehop, bounds: Bounds) -> Option<State> {
    match node.kind {
        Kind::Framehop => framehop.step(here.address()?, here, bounds),
        Kind::UnknownModule => {
            modules::mark_stale();
            None
        }
        Kind::Rule | Kind::End => None,
    }
}
