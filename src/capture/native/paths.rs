//! The paths of frames a thread's walks took: the tree of nodes, its two indices, and each
//! node's path in one piece. Hot (looked up on every walk; nodes and pieces are made only
//! where a walk went somewhere new).

use super::node::{Kind, NONE, Node, State};
use crate::capture::count;
use crate::channel::event::{NATIVE_CHAIN_SEED, native_chain_step};

/// Nodes a thread keeps: 2 MiB, and 1 MiB of their [`View`]s (address space: only the
/// pages a thread's walks touch are ever resident). docs/HOT-PATH.md, "Paths of frames",
/// has what real and made-up steps need.
pub(super) const NODES: usize = 1 << 15;

/// Ways of a set of an [`Index`]: one cache line of (tag, node) pairs.
const WAYS: usize = 8;
/// Sets of an [`Index`]: as many entries as nodes, 256 KiB.
const SETS: usize = NODES / WAYS;

/// Nodes by a hash of a key, in sets of [`WAYS`], the newest first. A tag (other bits of
/// the hash, never 0) spares loading nodes whose key differs. Sets rather than one slot
/// per hash: with direct-mapped slots, two nodes of one step's paths evicted each other
/// and each walk made copies of the nodes it could no longer find (about one a walk
/// inside a real training step).
struct Index {
    /// (tag, node); tag 0: empty.
    sets: [[(u32, u32); WAYS]; SETS],
}

impl Index {
    #[inline(always)]
    fn set_and_tag(hash: u64) -> (usize, u32) {
        ((hash >> 48) as usize % SETS, (hash >> 16) as u32 | 1)
    }

    /// The nodes filed under `hash`, newest first (their keys still to be compared).
    #[inline(always)]
    fn candidates(&self, hash: u64) -> impl Iterator<Item = u32> + '_ {
        let (set, tag) = Self::set_and_tag(hash);
        self.sets[set]
            .iter()
            .filter(move |&&(t, _)| t == tag)
            .map(|&(_, id)| id)
    }

    /// Files `id` under `hash`, first in its set, in place of the entry `replaces` names
    /// (a node of the same key) or else of the oldest.
    #[inline(always)]
    fn insert(&mut self, hash: u64, id: u32, replaces: impl Fn(u32) -> bool) {
        let (set, tag) = Self::set_and_tag(hash);
        let ways = &mut self.sets[set];
        let at = ways
            .iter()
            .position(|&(t, old)| t == tag && replaces(old))
            .unwrap_or(WAYS - 1);
        ways.copy_within(..at, 1);
        ways[0] = (tag, id);
    }

    fn clear(&mut self) {
        self.sets = [[(0, NONE); WAYS]; SETS];
    }
}

/// A node's path in one piece: the stack words its steps read, with the values they must
/// still hold, and the frames it gives, each from this node to the path's end and
/// contiguous, so that a walk that meets the node checks the path in one branch-free
/// pass and copies its frames at once ([`take_whole`]). The nodes made by one walk share
/// one piece: each node's part is the piece from its own entries on, and the path they
/// hang on is copied after them.
///
/// [`take_whole`]: super::take::take_whole
#[derive(Clone, Copy, Default)]
pub(super) struct View {
    /// The path has a piece: every step in it is a rule memsnap executes (a framehop step
    /// is made again only by [`follow`]).
    ///
    /// [`follow`]: super::follow::follow
    pub(super) whole: bool,
    /// The path ends at a frame in no known module.
    pub(super) ends_unknown: bool,
    /// Nodes from this one to the path's end.
    pub(super) steps: u16,
    pub(super) checks_from: u32,
    pub(super) checks_end: u32,
    pub(super) frames_from: u32,
    pub(super) frames_end: u32,
    /// The lowest address the checks read.
    pub(super) lowest_read: u64,
    /// The native chain of the path's first `cut_len` frames (0: none yet): a stack cut
    /// at the frame limit is hashed over the frames it keeps, which no node's chain is
    /// (`cut_chain`, walk.rs).
    pub(super) cut_chain: u64,
    pub(super) cut_len: u16,
}

/// A stack word a path's step read, as an offset from the thread's anchor
/// ([`Paths::anchor`]), and what it must still hold for the path to be taken: twelve
/// bytes rather than sixteen, so that a walk checking a path of 85 words reads 16 lines
/// of the pool, not 21 (docs/HOT-PATH.md, "The recording floor"). The words are in this
/// thread's stack, far less than 2 GiB from one another on any stack seen; a piece with
/// a read beyond that reach of the anchor is made without checks (its nodes are
/// followed step by step, giving the same frames).
#[derive(Clone, Copy, Default)]
#[repr(C, packed(4))]
pub(super) struct Check {
    pub(super) at: i32,
    pub(super) value: u64,
}

/// Stack words checked, over all pieces: 3 MiB of address space.
const CHECKS: usize = 1 << 18;
/// Frames, over all pieces: 1 MiB of address space.
pub(super) const PIECE_FRAMES: usize = 1 << 17;

/// The paths of frames this thread's walks took, as a tree of [`Node`]s from the
/// innermost frame outwards, and two indices over them: the newest node of each state
/// (where a walk meets an earlier path) and the node of each state and caller (so that
/// a path taken again finds its nodes instead of making new ones).
pub(super) struct Paths {
    /// The module table the nodes were made with (rules differ in another): a walk with
    /// another table starts over. 0: none yet.
    table: usize,
    /// Nodes in use: `nodes[1..used]`; when a walk's new nodes do not fit, all are
    /// forgotten and the next walks make them again.
    used: u32,
    nodes: [Node; NODES],
    /// The newest nodes of a state, by [`state_hash`].
    by_state: Index,
    /// The node of a state with a given caller, by [`caller_hash`].
    by_caller: Index,
    /// Each node's path in one piece, by node id.
    pub(super) views: [View; NODES],
    pub(super) checks: [Check; CHECKS],
    /// The address the checks' offsets count from: the first word checked since the
    /// nodes were last forgotten (0: none yet).
    pub(super) anchor: u64,
    checks_used: usize,
    pub(super) frames: [u64; PIECE_FRAMES],
    /// For each frame of `frames`, where in `checks` the steps from its node begin: a
    /// stack cut at the frame limit checks its path only that far ([`take_whole`]).
    ///
    /// [`take_whole`]: super::take::take_whole
    pub(super) frame_checks: [u32; PIECE_FRAMES],
    frames_used: usize,
}

#[inline(always)]
fn state_hash(state: State) -> u64 {
    (state.pc ^ state.sp.rotate_left(32)).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

#[inline(always)]
fn caller_hash(state: State, caller: u32) -> u64 {
    (state.pc ^ state.sp.rotate_left(32) ^ (u64::from(caller) << 40))
        .wrapping_mul(0xD6E8_FEB8_6659_FD93)
}

impl Paths {
    /// Forgets every node if they were made with another module table.
    #[inline(always)]
    pub(super) fn use_table(&mut self, table: usize) {
        if self.table != table {
            self.reset(table);
        }
    }

    #[cold]
    #[inline(never)]
    fn reset(&mut self, table: usize) {
        count!(PathResets, 1);
        // Table 0: the zeroed pages of a thread's first capture, empty already (and
        // not resident until written).
        if self.table != 0 {
            self.by_state.clear();
            self.by_caller.clear();
        }
        self.used = 1;
        self.checks_used = 0;
        self.anchor = 0;
        self.frames_used = 0;
        self.table = table;
    }

    #[inline(always)]
    pub(super) fn node(&self, id: u32) -> &Node {
        &self.nodes[id as usize % NODES]
    }

    /// The nodes made in `state` (one per path from there), newest first.
    #[inline(always)]
    pub(super) fn find_all(&self, state: State) -> impl Iterator<Item = u32> + '_ {
        self.by_state
            .candidates(state_hash(state))
            .filter(move |&id| self.node(id).holds(state))
    }

    /// The node of `state` whose step leads to `caller`.
    #[inline(always)]
    fn find_child(&self, state: State, caller: u32) -> Option<u32> {
        self.by_caller
            .candidates(caller_hash(state, caller))
            .find(|&id| self.node(id).caller == caller && self.node(id).holds(state))
    }

    /// Makes `steps` (innermost first) a path ending in `tail` ([`NONE`]: the last step
    /// ended the walk), reusing the nodes that already make it. Returns the innermost
    /// node, or `None` when the new nodes did not fit: then every node is forgotten.
    #[inline(always)]
    pub(super) fn link(&mut self, steps: &[Node], tail: u32) -> Option<u32> {
        if self.used as usize + steps.len() > NODES {
            self.reset(self.table);
            return None;
        }
        let made_from = self.used;
        let mut caller = tail;
        for step in steps.iter().rev() {
            let id = match self.find_child(step.state, caller) {
                Some(id) => id,
                None => {
                    count!(NodesMade, 1);
                    let (after, bp_matters_after) = match caller {
                        NONE => (NATIVE_CHAIN_SEED, false),
                        id => (self.node(id).chain, self.node(id).bp_matters),
                    };
                    let keeps_bp = step.kind == Kind::Rule && step.bp_read_at == 0;
                    let id = self.used;
                    self.used += 1;
                    // (The view of an id used before the last reset keeps its old chain
                    // of a cut path.)
                    self.views[id as usize % NODES].cut_len = 0;
                    self.nodes[id as usize % NODES] = Node {
                        caller,
                        chain: if step.emits {
                            native_chain_step(after, step.state.pc)
                        } else {
                            after
                        },
                        bp_matters: step.reads_bp || (keeps_bp && bp_matters_after),
                        ..*step
                    };
                    self.by_caller
                        .insert(caller_hash(step.state, caller), id, |_| false);
                    id
                }
            };
            // Nodes of one state with other callers stay filed beside it: a walk tries
            // each one's piece.
            self.by_state
                .insert(state_hash(step.state), id, |old| old == id);
            caller = id;
        }
        if self.used > made_from && !self.make_piece(made_from) {
            self.reset(self.table);
            return None;
        }
        Some(caller)
    }

    /// Gives the nodes `from..used`, just made by one walk (each the caller of the next:
    /// `from` is the outermost), their piece ([`View`]). Returns false when the pieces
    /// are full.
    fn make_piece(&mut self, from: u32) -> bool {
        let (from, to) = (from as usize, self.used as usize);
        let tail = match self.nodes[from % NODES].caller {
            NONE => View {
                whole: true,
                lowest_read: u64::MAX,
                ..View::default()
            },
            id => self.views[id as usize % NODES],
        };
        let new = &self.nodes[from..to];
        if !tail.whole || new.iter().any(|node| node.kind == Kind::Framehop) {
            for view in &mut self.views[from..to] {
                view.whole = false;
            }
            return true;
        }
        let mut n_checks = (tail.checks_end - tail.checks_from) as usize;
        let mut n_frames = (tail.frames_end - tail.frames_from) as usize;
        for node in new {
            if node.kind == Kind::Rule {
                n_checks += 1 + usize::from(self.checks_bp(node));
            }
            n_frames += usize::from(node.emits);
        }
        if self.checks_used + n_checks > CHECKS || self.frames_used + n_frames > PIECE_FRAMES {
            return false;
        }
        // Every word the new nodes' steps read, as an offset from the anchor (the first
        // such word since the nodes were last forgotten).
        let mut rules = new.iter().filter(|node| node.kind == Kind::Rule);
        let anchor = match self.anchor {
            0 => rules.clone().next().map_or(0, |node| node.next_sp - 8),
            anchor => anchor,
        };
        let fits = |addr: u64| i32::try_from(addr.wrapping_sub(anchor) as i64).is_ok();
        if !rules
            .all(|node| fits(node.next_sp - 8) && (!self.checks_bp(node) || fits(node.bp_read_at)))
        {
            for view in &mut self.views[from..to] {
                view.whole = false;
            }
            return true;
        }
        self.anchor = anchor;
        let at = |addr: u64| addr.wrapping_sub(anchor) as i64 as i32;
        // Innermost first: each node's own entries, then the path it hangs on.
        let (mut c, mut f) = (self.checks_used, self.frames_used);
        for id in (from..to).rev() {
            let node = self.nodes[id];
            self.views[id].checks_from = c as u32;
            self.views[id].frames_from = f as u32;
            if node.emits {
                self.frames[f] = node.state.pc;
                self.frame_checks[f] = c as u32;
                f += 1;
            }
            if node.kind == Kind::Rule {
                let caller = self.nodes[node.caller as usize % NODES].state;
                self.checks[c] = Check {
                    at: at(node.next_sp - 8),
                    value: caller.pc,
                };
                c += 1;
                if self.checks_bp(&node) {
                    self.checks[c] = Check {
                        at: at(node.bp_read_at),
                        value: caller.bp,
                    };
                    c += 1;
                }
            }
        }
        let (tc, tf) = (tail.checks_from as usize, tail.frames_from as usize);
        let (tc_end, tf_end) = (tail.checks_end as usize, tail.frames_end as usize);
        self.checks.copy_within(tc..tc_end, c);
        self.frames.copy_within(tf..tf_end, f);
        // The tail's frames are after the pool's used part: no overlap.
        for i in 0..tf_end - tf {
            self.frame_checks[f + i] = self.frame_checks[tf + i] - tc as u32 + c as u32;
        }
        let (c_end, f_end) = (c + tc_end - tc, f + tf_end - tf);
        let (mut lowest, mut steps) = (tail.lowest_read, tail.steps);
        let mut unknown = tail.ends_unknown;
        for id in from..to {
            let node = &self.nodes[id];
            if node.kind == Kind::Rule {
                lowest = lowest.min(node.lowest_read);
            }
            unknown |= node.kind == Kind::UnknownModule;
            steps += 1;
            let view = &mut self.views[id];
            view.whole = true;
            view.ends_unknown = unknown;
            view.steps = steps;
            view.checks_end = c_end as u32;
            view.frames_end = f_end as u32;
            view.lowest_read = lowest;
        }
        self.checks_used = c_end;
        self.frames_used = f_end;
        true
    }

    /// Whether the piece checks the `bp` that a rule's step loads: only where the path
    /// after it depends on `bp`.
    #[inline(always)]
    fn checks_bp(&self, node: &Node) -> bool {
        node.bp_read_at != 0 && self.nodes[node.caller as usize % NODES].bp_matters
    }
}

#[cfg(test)]
#[path = "tests/paths.rs"]
mod tests;
