//! The walk: steps made one by one where no earlier path holds, earlier paths taken where
//! they do, and the walk's own steps linked into the paths. Hot.

use super::follow::{Left, follow, taken_bps};
use super::framehop::Framehop;
use super::node::{FIRST, Kind, NONE, Node, State};
use super::paths::{NODES, Paths};
use super::rules::{Ran, Rules, rule_key, run_rule};
use super::take::take_whole;
use super::thread::Bounds;
use crate::capture::count;
use crate::channel::event::{NATIVE_CHAIN_SEED, StackSlot, native_chain, native_chain_step};
use crate::config::FRAME_CAPACITY;
use crate::process::modules;

/// Upper bound on unwinder steps, own frames included: bounded work whatever the stack.
pub(super) const MAX_STEPS: usize = FRAME_CAPACITY + 64;

/// The steps a walk made itself, innermost first, before it met a path it could take to
/// the end: nodes to be (their `caller` and `chain` are set when they are linked).
pub(super) struct Pending {
    steps: [Node; MAX_STEPS],
    n: usize,
    /// `bp` as it was on reaching each node a walk took from an earlier path, in order
    /// (a node keeps the `bp` of the walk that made it, which may differ where the path
    /// does not depend on it).
    taken_bp: [u64; MAX_STEPS],
}

impl Pending {
    #[inline(always)]
    fn push(&mut self, step: Node) {
        if let Some(slot) = self.steps.get_mut(self.n) {
            *slot = step;
            self.n += 1;
        }
    }
}

/// Copies the frames `deferred` names into `slot`.
#[inline]
pub(super) fn copy_deferred(paths: &Paths, deferred: Deferred, slot: &mut StackSlot) {
    let (from, at, len) = (
        deferred.from as usize,
        deferred.at as usize,
        deferred.len as usize,
    );
    if let (Some(frames), Some(dst)) = (
        paths.frames.get(from..from + len),
        slot.native.get_mut(at..at + len),
    ) {
        dst.copy_from_slice(frames);
    }
}

/// One walk into `slot`. Wherever it reaches a state in which an earlier walk on this
/// thread made a node, it takes that walk's path for as long as the path still holds
/// ([`follow`]); elsewhere it makes the steps itself. Its own steps, and those of a
/// path it took only part of, become nodes linked to the path it took to the end.
/// Returns the native chain of the slot's frames when the walk reached the end of the
/// stack within the frame limit (else the caller computes it).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn walk(
    framehop: &mut Framehop,
    rules: &mut Rules,
    paths: &mut Paths,
    pending: &mut Pending,
    bounds: Bounds,
    from: super::StartRegs,
    slot: &mut StackSlot,
    out: &mut Out,
) -> Option<u64> {
    let table = framehop.table;
    let table_id = table as *const modules::ModuleTable as usize;
    rules.use_table(table_id);
    paths.use_table(table_id);
    pending.n = 0;
    out.n = 0;
    let mut state = State {
        pc: from.ip | FIRST,
        sp: from.sp,
        bp: from.bp,
    };
    let mut steps = 0usize;
    let mut hint = usize::MAX;
    // The node of an earlier path the walk took to its end (NONE: none), and whether
    // the walk reached the end of the stack.
    let (tail, complete) = 'walk: loop {
        // The paths made from this state, newest first: the first whose piece still holds
        // is taken whole (where a call site changed, a piece fails in its first words).
        // If none does, the newest is followed to where it changed.
        let mut newest = None;
        for id in paths.find_all(state) {
            newest = newest.or(Some(id));
            if let Some(complete) = take_whole(paths, id, bounds, &mut steps, slot, out) {
                break 'walk (id, complete);
            }
            count!(PathsNotHolding, 1);
        }
        if let Some(start) = newest {
            let (taken, next, unwind_next) = match follow(
                paths, start, state.bp, framehop, bounds, &mut steps, slot, out,
            ) {
                Left::AtItsEnd { complete } => break (start, complete),
                Left::Elsewhere { taken, next } => (taken, next, false),
                Left::Unwind { taken, state } => (taken, Some(state), true),
            };
            count!(PathsLeft, 1);
            // The nodes taken are this walk's steps; they are linked to where it goes
            // now.
            taken_bps(
                paths,
                start,
                state.bp,
                taken,
                framehop,
                bounds,
                &mut pending.taken_bp,
            );
            let mut id = start;
            for i in 0..taken {
                let node = paths.node(id);
                pending.push(Node {
                    state: State {
                        bp: pending.taken_bp[i % MAX_STEPS],
                        ..node.state
                    },
                    ..*node
                });
                id = node.caller;
            }
            match next {
                Some(next) => {
                    state = next;
                    if !unwind_next {
                        continue; // perhaps onto another path
                    }
                }
                None => break (NONE, true),
            }
        }
        if steps == MAX_STEPS {
            count!(WalksAtStepLimit, 1);
            break (NONE, false);
        }
        steps += 1;
        count!(StepsUnwound, 1);
        let mut step = Node {
            state,
            ..Node::default()
        };
        if state.pc & FIRST == 0 {
            let Some(module) = table.find_near(state.pc, hint) else {
                // JIT code, or a module loaded after the table was built.
                modules::mark_stale();
                step.kind = Kind::UnknownModule;
                pending.push(step);
                break (NONE, true);
            };
            hint = module;
            if !table.is_own(module) {
                step.emits = true;
                out.push(state.pc, slot);
            }
        }
        let Some(address) = state.address() else {
            step.kind = Kind::End;
            pending.push(step);
            break (NONE, true);
        };
        let key = rule_key(address);
        let rule = match rules.get(key) {
            Some(rule) => rule,
            None => {
                count!(RuleMisses, 1);
                count!(RuleMissesConflict, rules.full(key));
                count!(RuleMissesCold, !rules.full(key));
                count!(RuleMissesFirstFrame, state.pc & FIRST != 0);
                #[cfg(feature = "capture-stats")]
                crate::capture::stats::note_miss(key);
                let rule = framehop.rule(address);
                rules.insert(key, rule);
                rule
            }
        };
        match run_rule(&rule, state, bounds) {
            Ran::Next {
                next,
                bp_read_at,
                lowest_read,
            } => {
                step.next_sp = next.sp;
                step.bp_read_at = bp_read_at;
                step.lowest_read = lowest_read;
                step.reads_bp = rule.cfa_from_bp || rule.bp_from == 2;
                pending.push(step);
                state = next;
            }
            Ran::End => {
                step.kind = Kind::End;
                pending.push(step);
                break (NONE, true);
            }
            Ran::Framehop => {
                step.kind = Kind::Framehop;
                step.reads_bp = true;
                pending.push(step);
                match framehop.step(address, state, bounds) {
                    Some(next) => state = next,
                    None => break (NONE, true),
                }
            }
        }
    };
    slot.n_native = out.n as u16;
    if tail != NONE {
        count!(WalksReused, 1);
        #[cfg(test)]
        super::WALKS_REUSED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    // A walk cut at the step limit before it met a path gives no nodes: its last step
    // leads nowhere known.
    if tail == NONE && !complete {
        return None;
    }
    let innermost = paths.link(&pending.steps[..pending.n], tail)?;
    if slot.truncated && tail != NONE {
        // The walk's own frames (those of its steps before `tail`), then as many of the
        // path's as the slot had room for.
        let own = pending.steps[..pending.n]
            .iter()
            .filter(|s| s.emits)
            .count();
        return cut_chain(paths, tail, own.min(out.n), out.n, slot);
    }
    if !complete || slot.truncated {
        return None;
    }
    Some(match innermost {
        NONE => NATIVE_CHAIN_SEED,
        id => paths.node(id).chain,
    })
}

/// The native chain of a slot cut at the frame limit whose frames are `own` frames of
/// the walk's own, then the first `n - own` frames of `tail`'s path: the chain of those
/// (made once per path and cut, and kept in its view: a path's frames never change)
/// with the own frames added on top. `None` when the slot has none of the path's frames
/// or the path has no piece (then the caller hashes the slot).
#[inline(never)]
fn cut_chain(paths: &mut Paths, tail: u32, own: usize, n: usize, slot: &StackSlot) -> Option<u64> {
    let take = n.checked_sub(own).filter(|&take| take > 0)?;
    let view = &mut paths.views[tail as usize % NODES];
    // Only a path in one piece (the slot may not have its frames yet: see `Deferred`).
    if !view.whole {
        return None;
    }
    if usize::from(view.cut_len) != take {
        let from = view.frames_from as usize;
        view.cut_chain = native_chain(paths.frames.get(from..from + take)?);
        view.cut_len = take as u16;
    }
    Some(
        slot.native
            .get(..own)?
            .iter()
            .rev()
            .fold(view.cut_chain, |chain, &pc| native_chain_step(chain, pc)),
    )
}

/// The frames written to the slot so far, at most `max`.
pub(super) struct Out {
    pub(super) n: usize,
    pub(super) max: usize,
    /// The walk may leave the frames of a whole path taken at its end in their piece
    /// ([`Deferred`]) instead of copying them.
    pub(super) defer: bool,
    pub(super) deferred: Deferred,
}

/// Frames of a walk that are still in a piece: `len` frames from `from` in the pool
/// belong at `at` in the slot. `len` 0: none. [`finish`] copies them.
///
/// [`finish`]: super::entry::finish
#[derive(Clone, Copy, Default)]
pub(super) struct Deferred {
    pub(super) from: u32,
    pub(super) at: u16,
    pub(super) len: u16,
}

impl Out {
    #[inline(always)]
    fn push(&mut self, pc: u64, slot: &mut StackSlot) {
        if self.n >= self.max {
            slot.truncated = true;
        } else if let Some(dst) = slot.native.get_mut(self.n) {
            *dst = pc;
            self.n += 1;
        }
    }
}
