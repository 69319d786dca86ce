//! Native return addresses of the calling thread, unwound in-process with framehop, with
//! the paths of frames that earlier captures on the thread took reused where they provably
//! still hold.
//!
//! Hot. Steady state: one atomic load (module table), two const-TLS reads (the thread's
//! unwind state, stack bounds), one index lookup, then one pass over the stack words the
//! path met there read, and the copy of its frames. Every stack read is of an address in
//! `[sp at capture, top of the thread's stack)`.
//!
//! Paths of frames (docs/HOT-PATH.md, "Paths of frames"): every step a walk makes becomes a
//! node of a per-thread tree, keyed by the unwinder's whole state on reaching the frame
//! (frame address, sp, and bp where the path depends on it: all that the rules read besides
//! the stack) and linked to the node of the frame its step led to. When a walk reaches a
//! state an earlier walk also reached, the rest of the walk is a pure function of that state,
//! the rules (same module table) and the stack words the steps read: if each of those words
//! still holds what it held, the earlier path's frames are taken instead of unwound. Each
//! node has its path in one contiguous piece (the words to check with their values, and the
//! frames), checked in one pass; where a word changed, the walk follows the path node by
//! node to the frame that changed and goes on from there, onto another path or unwinding.
//! Nothing is assumed: a changed caller at the same depth changes a return address read.
//!
//! First capture on a thread: one allocation (the thread's unwind state and its paths,
//! leaked until the thread exits; address space of which only what the walks touch becomes
//! resident) and `pthread_getattr_np` (may read /proc on the main thread). The walk ends
//! cleanly at an address in no known module (JIT code, a module loaded since the table was
//! built: the table is marked stale for the writer), at a failed stack read, or at the
//! frame limit. x86_64 only; elsewhere nothing is captured.

#[cfg(target_arch = "x86_64")]
pub use imp::{capture, capture_interrupted, finish};

/// Where a walk starts: the instruction pointer, stack pointer and frame pointer of the code
/// that asked for the stack (see [`here`]), or of the code a signal interrupted.
#[derive(Clone, Copy, Debug)]
pub struct StartRegs {
    pub ip: u64,
    pub sp: u64,
    pub bp: u64,
}

/// The registers at this point of the calling function. Inlined into the hook, so the walk
/// starts in the hook's own frame: memsnap's capture functions below it are never unwound
/// (each was a full unwinder step per event, always the same), and their stack is never
/// read (everything below `sp` here is out of bounds for the walk).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub fn here() -> StartRegs {
    let (ip, sp, bp): (u64, u64, u64);
    // SAFETY: reads three registers, touches no memory. `lea [rip]` gives the address of
    // the next instruction, where `rsp` and `rbp` hold the values read here (`nostack`:
    // nothing moves the stack pointer in between), so the unwind rule for that address
    // applies to exactly these registers.
    unsafe {
        std::arch::asm!(
            "lea {ip}, [rip]",
            "mov {sp}, rsp",
            "mov {bp}, rbp",
            ip = out(reg) ip,
            sp = out(reg) sp,
            bp = out(reg) bp,
            options(nomem, nostack, preserves_flags),
        );
    }
    StartRegs { ip, sp, bp }
}

#[cfg(not(target_arch = "x86_64"))]
#[inline(always)]
pub fn here() -> StartRegs {
    StartRegs {
        ip: 0,
        sp: 0,
        bp: 0,
    }
}

/// Walks that took an earlier walk's path of frames to its end (tests look at it).
#[cfg(test)]
pub static WALKS_REUSED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

#[cfg(not(target_arch = "x86_64"))]
#[inline]
pub fn capture(
    slot: &mut crate::channel::event::StackSlot,
    max_frames: usize,
    from: StartRegs,
    defer: bool,
) -> Option<u64> {
    let _ = (max_frames, from, defer);
    slot.n_native = 0;
    None
}

#[cfg(not(target_arch = "x86_64"))]
#[inline]
pub fn finish(slot: &mut crate::channel::event::StackSlot) {
    let _ = slot;
}

#[cfg(not(target_arch = "x86_64"))]
pub fn capture_interrupted(
    slot: &mut crate::channel::event::StackSlot,
    max_frames: usize,
    regs: StartRegs,
) {
    let _ = (max_frames, regs);
    slot.n_native = 0;
}

#[cfg(target_arch = "x86_64")]
mod imp {
    use crate::capture::count;
    use crate::channel::event::{NATIVE_CHAIN_SEED, StackSlot, native_chain, native_chain_step};
    use crate::config::FRAME_CAPACITY;
    use crate::process::modules;
    use framehop::x86_64::{CacheX86_64, UnwindRegsX86_64};
    use framehop::{FrameAddress, MustNotAllocateDuringUnwind, Unwinder as _};
    use std::cell::Cell;

    type Cache = CacheX86_64<MustNotAllocateDuringUnwind>;

    /// Marks a thread whose unwind state was given back by the thread-exit destructor.
    const STATE_GONE: *mut ThreadUnwind = std::ptr::without_provenance_mut(1);

    /// Upper bound on unwinder steps, own frames included: bounded work whatever the stack.
    const MAX_STEPS: usize = FRAME_CAPACITY + 64;

    /// The bit that marks a walk's first frame in a [`State`]'s `pc` (its frame address is
    /// the instruction pointer, not a return address: framehop treats it apart, and its rule
    /// may differ). Code addresses never have it.
    const FIRST: u64 = 1 << 63;

    /// The unwinder's whole state on reaching a frame: all that framehop's x86-64 rules read
    /// besides the stack itself.
    #[derive(Clone, Copy, Default, PartialEq, Eq)]
    struct State {
        /// Frame address (a return address; the instruction pointer, with [`FIRST`], for the
        /// walk's first frame).
        pc: u64,
        sp: u64,
        bp: u64,
    }

    impl State {
        #[inline(always)]
        fn address(self) -> Option<FrameAddress> {
            if self.pc & FIRST != 0 {
                Some(FrameAddress::InstructionPointer(self.pc & !FIRST))
            } else {
                FrameAddress::from_return_address(self.pc)
            }
        }
    }

    /// How a [`Node`]'s step is made again by a later walk.
    #[derive(Clone, Copy, Default, PartialEq, Eq)]
    #[repr(u8)]
    enum Kind {
        /// A rule memsnap executes ([`Rule`]), clean when the node was made: the next `sp`
        /// is `next_sp`, the return address lies at `next_sp - 8`, the next `bp` at
        /// `bp_read_at` (0: `bp` unchanged).
        #[default]
        Rule = 0,
        /// framehop makes this step (a rule of another shape, or a read that failed or
        /// returned 0 when the node was made).
        Framehop,
        /// The stack ends here (the rule says there is no caller).
        End,
        /// The frame address is in no known module (JIT code, a library loaded since the
        /// module table was built): the walk ends here, this frame left out.
        UnknownModule,
    }

    /// No node: node 0 is never used.
    const NONE: u32 = 0;

    /// One frame of a path that a walk took: the unwinder's state on reaching it, how to make
    /// the step from it again, and the node of the frame the step led to. Nodes never change
    /// once made (a frame reached by another path gets a node of its own), so a node's
    /// `chain` is the hash of its whole path. One cache line each.
    #[derive(Clone, Copy, Default)]
    #[repr(C, align(64))]
    struct Node {
        state: State,
        /// [`Kind::Rule`]: the stack pointer the step gives (its return address lies just
        /// below), where it reads the next `bp` (0: unchanged), and the lowest of those two
        /// addresses.
        next_sp: u64,
        bp_read_at: u64,
        lowest_read: u64,
        /// The native chain (`channel::event::native_chain`) of the frames this node and the
        /// nodes after it give.
        chain: u64,
        /// The node the step led to: [`NONE`] when the walk ended with this node.
        caller: u32,
        kind: Kind,
        /// The frame goes into stacks (not the walk's first frame, not memsnap's own).
        emits: bool,
        /// The step reads `bp` as it was on reaching the frame (a CFA or a saved `bp` found
        /// from it; framehop's steps are taken to).
        reads_bp: bool,
        /// The path from here depends on `bp`: this step or a later one reads it before a
        /// step loads it from the stack. Where it does not (code built without frame
        /// pointers keeps data in `bp`), a state with any `bp` is this node's state.
        bp_matters: bool,
    }

    impl Node {
        /// Whether `state` is this node's state.
        #[inline(always)]
        fn holds(&self, state: State) -> bool {
            self.state.pc == state.pc
                && self.state.sp == state.sp
                && (self.state.bp == state.bp || !self.bp_matters)
        }
    }

    /// Nodes a thread keeps: 2 MiB, and 1 MiB of their [`View`]s (address space: only the
    /// pages a thread's walks touch are ever resident). docs/HOT-PATH.md, "Paths of frames",
    /// has what real and made-up steps need.
    const NODES: usize = 1 << 15;

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
    #[derive(Clone, Copy, Default)]
    struct View {
        /// The path has a piece: every step in it is a rule memsnap executes (a framehop step
        /// is made again only by [`follow`]).
        whole: bool,
        /// The path ends at a frame in no known module.
        ends_unknown: bool,
        /// Nodes from this one to the path's end.
        steps: u16,
        checks_from: u32,
        checks_end: u32,
        frames_from: u32,
        frames_end: u32,
        /// The lowest address the checks read.
        lowest_read: u64,
        /// The native chain of the path's first `cut_len` frames (0: none yet): a stack cut
        /// at the frame limit is hashed over the frames it keeps, which no node's chain is
        /// ([`cut_chain`]).
        cut_chain: u64,
        cut_len: u16,
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
    struct Check {
        at: i32,
        value: u64,
    }

    /// Stack words checked, over all pieces: 3 MiB of address space.
    const CHECKS: usize = 1 << 18;
    /// Frames, over all pieces: 1 MiB of address space.
    const PIECE_FRAMES: usize = 1 << 17;

    /// The paths of frames this thread's walks took, as a tree of [`Node`]s from the
    /// innermost frame outwards, and two indices over them: the newest node of each state
    /// (where a walk meets an earlier path) and the node of each state and caller (so that
    /// a path taken again finds its nodes instead of making new ones).
    struct Paths {
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
        views: [View; NODES],
        checks: [Check; CHECKS],
        /// The address the checks' offsets count from: the first word checked since the
        /// nodes were last forgotten (0: none yet).
        anchor: u64,
        checks_used: usize,
        frames: [u64; PIECE_FRAMES],
        /// For each frame of `frames`, where in `checks` the steps from its node begin: a
        /// stack cut at the frame limit checks its path only that far ([`take_whole`]).
        frame_checks: [u32; PIECE_FRAMES],
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
        fn use_table(&mut self, table: usize) {
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
        fn node(&self, id: u32) -> &Node {
            &self.nodes[id as usize % NODES]
        }

        /// The nodes made in `state` (one per path from there), newest first.
        #[inline(always)]
        fn find_all(&self, state: State) -> impl Iterator<Item = u32> + '_ {
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
        fn link(&mut self, steps: &[Node], tail: u32) -> Option<u32> {
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
            if !rules.all(|node| {
                fits(node.next_sp - 8) && (!self.checks_bp(node) || fits(node.bp_read_at))
            }) {
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

    /// The steps a walk made itself, innermost first, before it met a path it could take to
    /// the end: nodes to be (their `caller` and `chain` are set when they are linked).
    struct Pending {
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

    /// framehop's rule caches per thread. One cache is direct-mapped: 509 slots indexed by
    /// `address % 509`, so two addresses a walk meets every time that fall in the same slot
    /// evict each other, and each then costs a CFI lookup and parse on every capture (about
    /// 4,500 instructions; seen in a release build of this library where the hook's own
    /// address collided with a caller's: two misses per capture, 2.5x the instructions).
    /// Spreading addresses over eight caches by their higher bits makes the whole a
    /// direct-mapped cache of 4,072 slots: about 37 KiB a cache (slots and framehop's CFI
    /// evaluation context), allocated on a thread's first capture.
    const RULE_CACHES: usize = 8;

    /// The cache for `address`: a hash of the bits above the slot index framehop uses.
    #[inline(always)]
    fn rule_cache_index(address: FrameAddress) -> usize {
        let lookup = address.address_for_lookup();
        ((lookup / 509).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 61) as usize % RULE_CACHES
    }

    /// A thread's unwinder caches, the paths its walks took and room for a walk's own steps.
    struct ThreadUnwind {
        caches: [Cache; RULE_CACHES],
        /// The rules memsnap executes itself (see [`Rule`]).
        rules: Rules,
        paths: Paths,
        pending: Pending,
        /// Frames the last capture left in their piece ([`finish`]).
        deferred: Deferred,
    }

    /// What a step does in the common case, found once per address by asking framehop
    /// ([`derive_rule`]) and then executed here without framehop: the new stack pointer
    /// (the CFA) is `sp` or `bp` plus a constant, the return address lies at `CFA - 8`, and
    /// `bp` is either unchanged or loaded from `sp` or `bp` plus a constant. Every rule
    /// framehop caches for x86-64 has this form (`UnwindRuleX86_64`), and so do the DWARF
    /// rules it evaluates each time that are only a CFA on `rbp` (libffi's `rbp + 32`).
    /// framehop's own cache lookup and rule interpretation cost about 170 instructions a
    /// step; this costs about 30.
    ///
    /// Only the clean case is executed here: every read in bounds, the walk moving up the
    /// stack, a non-zero return address. Anything else (a failed read, `bp` of 0, a frame
    /// that does not advance) goes to framehop for that step, so the walk ends or goes on
    /// exactly as framehop decides.
    #[derive(Clone, Copy, Default)]
    struct Rule {
        form: Form,
        cfa_from_bp: bool,
        cfa_offset: i32,
        /// 0: `bp` unchanged; 1: loaded from `sp + bp_offset`; 2: from `bp + bp_offset`.
        bp_from: u8,
        bp_offset: i32,
    }

    #[derive(Clone, Copy, Default, PartialEq, Eq)]
    #[repr(u8)]
    enum Form {
        /// Not of the form above: framehop unwinds this address every time. (All-zero
        /// bytes are this form: an empty cache entry, if ever taken for a rule, only sends
        /// the step to framehop.)
        #[default]
        Framehop = 0,
        /// The end of the stack (no return address): the walk stops.
        End,
        Step,
    }

    /// Entries per set of the rule cache: one cache line of keys.
    const RULE_WAYS: usize = 8;
    /// Sets of the rule cache: 4,096 rules in all, about 80 KiB a thread.
    ///
    /// A direct-mapped cache of 1,024 rules was enough for loops that allocate from a few
    /// call sites, but in a real training step (scripts/gpu/step_stacks.py: a transformer's
    /// forward, backward and optimizer step, about 450 stacks a step) the addresses of the
    /// frames a walk unwinds evicted each other: 0.8-1.1 misses per walk, each one deriving
    /// the rule with framehop again (docs/HOT-PATH.md, "Rule cache").
    const RULE_SETS: usize = 512;

    /// The rules memsnap executes itself, by [`rule_key`]: sets of [`RULE_WAYS`] entries,
    /// the keys apart from the rules so that a lookup reads one line of keys; in each set
    /// the newest first (a full set forgets its oldest).
    struct Rules {
        /// The module table the rules were derived with (rules may differ in another): a
        /// walk with another table empties the cache first. 0: none yet.
        table: usize,
        /// 0: an empty entry (no frame address has key 0: it would be in no module).
        keys: [[u64; RULE_WAYS]; RULE_SETS],
        rules: [[Rule; RULE_WAYS]; RULE_SETS],
    }

    impl Rules {
        /// Empties the cache if its rules were derived with another module table.
        #[inline(always)]
        fn use_table(&mut self, table: usize) {
            if self.table != table {
                self.reset(table);
            }
        }

        #[cold]
        #[inline(never)]
        fn reset(&mut self, table: usize) {
            if self.table != 0 {
                self.keys = [[0; RULE_WAYS]; RULE_SETS];
            }
            self.table = table;
        }

        /// The cached rule for `key`.
        #[inline(always)]
        fn get(&self, key: u64) -> Option<Rule> {
            let set = rule_set(key);
            let way = self.keys[set].iter().position(|&k| k == key)?;
            Some(self.rules[set][way])
        }

        /// Whether caching `key` would evict another key's rule.
        #[cfg(feature = "capture-stats")]
        fn full(&self, key: u64) -> bool {
            self.keys[rule_set(key)][RULE_WAYS - 1] != 0
        }

        /// Caches `rule` for `key`, first in its set.
        #[inline(always)]
        fn insert(&mut self, key: u64, rule: Rule) {
            let set = rule_set(key);
            self.keys[set].copy_within(..RULE_WAYS - 1, 1);
            self.keys[set][0] = key;
            self.rules[set].copy_within(..RULE_WAYS - 1, 1);
            self.rules[set][0] = rule;
        }
    }

    /// The cache key of a frame address: the lookup address (a return address minus one),
    /// with the top bit set for the first frame (its rule may differ: framehop treats the
    /// first frame apart).
    #[inline(always)]
    fn rule_key(address: FrameAddress) -> u64 {
        let first = u64::from(!address.is_return_address());
        address.address_for_lookup() | (first << 63)
    }

    #[inline(always)]
    fn rule_set(key: u64) -> usize {
        (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 55) as usize % RULE_SETS
    }

    /// What [`run_rule`] did.
    enum Ran {
        /// The next frame's state, where the step read the next `bp` (0: it did not) and the
        /// lowest address it read.
        Next {
            next: State,
            bp_read_at: u64,
            lowest_read: u64,
        },
        End,
        /// Not handled here: framehop makes this step.
        Framehop,
    }

    /// Executes `rule` from `state` in the clean case (see [`Rule`]); [`Ran::Framehop`]
    /// otherwise.
    #[inline(always)]
    fn run_rule(rule: &Rule, state: State, bounds: Bounds) -> Ran {
        match rule.form {
            Form::Framehop => return Ran::Framehop,
            Form::End => return Ran::End,
            Form::Step => {}
        }
        let State { sp, bp, .. } = state;
        if rule.cfa_from_bp && bp == 0 {
            return Ran::Framehop;
        }
        let base = if rule.cfa_from_bp { bp } else { sp };
        let new_sp = base.wrapping_add(rule.cfa_offset as i64 as u64);
        if new_sp <= sp {
            return Ran::Framehop;
        }
        let (new_bp, bp_read_at) = match rule.bp_from {
            0 => (bp, 0),
            from => {
                let at = if from == 1 { sp } else { bp }.wrapping_add(rule.bp_offset as i64 as u64);
                match bounds.read(at) {
                    // (0 is never in bounds: a read there fails.)
                    Ok(v) => (v, at),
                    Err(()) => return Ran::Framehop,
                }
            }
        };
        let ra_at = new_sp - 8;
        let Ok(ra) = bounds.read(ra_at) else {
            return Ran::Framehop;
        };
        // 0 ends the stack; an address with the top bit is in the kernel's half, never a
        // return into user code: framehop decides both.
        if ra == 0 || ra & FIRST != 0 {
            return Ran::Framehop;
        }
        Ran::Next {
            next: State {
                pc: ra,
                sp: new_sp,
                bp: new_bp,
            },
            bp_read_at,
            lowest_read: if bp_read_at == 0 {
                ra_at
            } else {
                ra_at.min(bp_read_at)
            },
        }
    }

    /// framehop, for what memsnap does not do itself: the module table (its unwinder) and
    /// this thread's rule caches.
    struct Framehop<'a> {
        table: &'a modules::ModuleTable,
        caches: &'a mut [Cache; RULE_CACHES],
    }

    impl Framehop<'_> {
        /// framehop's step from `state` (its reads bounded): the next frame's state, or
        /// `None` where the walk ends (no caller, a failed read, or a return address of 0 or
        /// in the kernel's half, which no user code has).
        #[inline(never)]
        fn step(&mut self, address: FrameAddress, state: State, bounds: Bounds) -> Option<State> {
            count!(FramehopSteps, 1);
            let mut read_stack = |addr: u64| bounds.read(addr);
            let mut regs = UnwindRegsX86_64::new(state.pc & !FIRST, state.sp, state.bp);
            let ra = self
                .table
                .unwinder
                .unwind_frame(
                    address,
                    &mut regs,
                    &mut self.caches[rule_cache_index(address)],
                    &mut read_stack,
                )
                .ok()
                .flatten()?;
            (ra != 0 && ra & FIRST == 0).then_some(State {
                pc: ra,
                sp: regs.sp(),
                bp: regs.bp(),
            })
        }

        /// The rule framehop applies at `address` ([`derive_rule`]).
        fn rule(&mut self, address: FrameAddress) -> Rule {
            derive_rule(
                self.table,
                &mut self.caches[rule_cache_index(address)],
                address,
            )
        }
    }

    /// The rule framehop applies at `address`, found by letting it unwind two made-up
    /// register sets over a made-up stack whose every word tells its own address: where
    /// the new `sp` and `bp` came from shows in the results. The two sets differ in
    /// `bp - sp`, so a CFA on `sp` and one on `bp` cannot be mistaken for each other. A
    /// rule of any other shape (return address elsewhere than `CFA - 8`, a CFA on another
    /// register, an expression) is [`Form::Framehop`].
    #[cold]
    #[inline(never)]
    fn derive_rule(table: &modules::ModuleTable, cache: &mut Cache, address: FrameAddress) -> Rule {
        const PROBES: [(u64, u64); 2] = [
            (0x0000_1000_0000_0000, 0x0000_1000_0001_0000),
            (0x0000_2000_0000_0000, 0x0000_2000_0003_0000),
        ];
        let marker = |addr: u64| (addr ^ 0x00A5_0000_0000_0000) | 1;
        let pc = match address {
            FrameAddress::InstructionPointer(p) => p,
            FrameAddress::ReturnAddress(ra) => ra.get(),
        };
        let mut seen = [(0u64, 0u64, 0u64, [0u64; 8], 0usize); 2];
        let mut ends = 0;
        for (i, &(sp, bp)) in PROBES.iter().enumerate() {
            let mut reads = [0u64; 8];
            let mut n = 0usize;
            let mut read = |addr: u64| -> Result<u64, ()> {
                if let Some(r) = reads.get_mut(n) {
                    *r = addr;
                }
                n += 1;
                Ok(marker(addr))
            };
            let mut regs = UnwindRegsX86_64::new(pc, sp, bp);
            match table
                .unwinder
                .unwind_frame(address, &mut regs, cache, &mut read)
            {
                Ok(Some(ra)) => seen[i] = (ra, regs.sp(), regs.bp(), reads, n),
                Ok(None) if n == 0 => ends += 1,
                _ => break,
            }
        }
        let mut rule = Rule::default();
        if ends == 2 {
            rule.form = Form::End;
            return rule;
        }
        let (a, b) = (&seen[0], &seen[1]);
        if a.4 == 0 || b.4 == 0 || a.4 > 8 || b.4 > 8 {
            return rule;
        }
        let (p, q) = (PROBES[0], PROBES[1]);
        // The same offset from the same register in both probes.
        let offset = |from_a: u64, from_b: u64, x: u64, y: u64| -> Option<i32> {
            let d = x.wrapping_sub(from_a);
            (d == y.wrapping_sub(from_b)).then(|| i32::try_from(d as i64).ok())?
        };
        let (cfa_from_bp, cfa_offset) =
            match (offset(p.0, q.0, a.1, b.1), offset(p.1, q.1, a.1, b.1)) {
                (Some(o), None) => (false, o),
                (None, Some(o)) => (true, o),
                _ => return rule,
            };
        // The return address is the word at CFA - 8, read by both probes.
        let read_at = |s: &(u64, u64, u64, [u64; 8], usize), at: u64| s.3[..s.4].contains(&at);
        if a.0 != marker(a.1 - 8)
            || b.0 != marker(b.1 - 8)
            || !read_at(a, a.1 - 8)
            || !read_at(b, b.1 - 8)
        {
            return rule;
        }
        let (bp_from, bp_offset) = if a.2 == p.1 && b.2 == q.1 {
            (0, 0)
        } else {
            let Some(&at_a) = a.3[..a.4].iter().find(|&&r| marker(r) == a.2) else {
                return rule;
            };
            let Some(&at_b) = b.3[..b.4].iter().find(|&&r| marker(r) == b.2) else {
                return rule;
            };
            match (offset(p.0, q.0, at_a, at_b), offset(p.1, q.1, at_a, at_b)) {
                (Some(o), None) => (1, o),
                (None, Some(o)) => (2, o),
                _ => return rule,
            }
        };
        rule.form = Form::Step;
        rule.cfa_from_bp = cfa_from_bp;
        rule.cfa_offset = cfa_offset;
        rule.bp_from = bp_from;
        rule.bp_offset = bp_offset;
        rule
    }

    crate::initial_exec::initial_exec_thread_local! {
        /// This thread's unwind state: null until its first capture, then the state, or
        /// `STATE_GONE` once its thread-exit destructor freed it.
        static UNWIND: Cell<*mut ThreadUnwind>, symbol "memsnap_native_unwind";
    }

    crate::initial_exec::initial_exec_thread_local! {
        /// This thread's stack `[bottom, top)`; top 0 = not looked up yet, MAX = unknown.
        static STACK: Cell<(u64, u64)>, symbol "memsnap_native_stack";
    }

    static UNWIND_KEY: crate::thread_state::ExitKey = crate::thread_state::ExitKey::new();

    unsafe extern "C" fn free_unwind(p: *mut libc::c_void) {
        UNWIND.with(|c| c.set(STATE_GONE));
        if !p.is_null() {
            // SAFETY: `p` is the state mapped for this thread; the thread is exiting and
            // its TLS now says "gone", so no later capture on it can use the pointer.
            unsafe { crate::thread_state::free(p as *mut ThreadUnwind) };
        }
    }

    /// The thread's unwind state, created on its first capture.
    #[inline]
    fn thread_unwind() -> Option<&'static mut ThreadUnwind> {
        let p = UNWIND.with(|c| c.get());
        if p == STATE_GONE {
            return None;
        }
        if !p.is_null() {
            // SAFETY: `p` is this thread's leaked state; only this thread uses it, and
            // `capture` is not re-entered on one thread (the hooks' nesting guard).
            return Some(unsafe { &mut *p });
        }
        // About 8.3 MiB of address space, nearly all of it the paths' pools, whose pages
        // become resident only as walks fill them (the caches allocate their own ~300 KiB).
        // SAFETY: all-zero bytes are valid paths and rules (no module table yet: `table`
        // 0, which no module table has, so nothing is taken from them; every index entry
        // and key 0 an empty one) and an empty list of pending nodes; the caches are
        // written in place below, before any use. `free_unwind` frees a `ThreadUnwind`.
        let fresh: *mut ThreadUnwind = unsafe { UNWIND_KEY.alloc_zeroed(free_unwind) };
        if fresh.is_null() {
            return None;
        }
        // SAFETY: just allocated for this thread; the caches are written before any use.
        unsafe {
            let caches = std::ptr::addr_of_mut!((*fresh).caches) as *mut Cache;
            for i in 0..RULE_CACHES {
                caches.add(i).write(Cache::new_in());
            }
        }
        UNWIND.with(|c| c.set(fresh));
        // SAFETY: just allocated, owned by this thread.
        Some(unsafe { &mut *fresh })
    }

    /// The calling thread's stack `[bottom, top)`, looked up once per thread; `None` when
    /// unknown (then no native frames: reads could not be bounded).
    #[inline]
    fn stack_bounds() -> Option<(u64, u64)> {
        let (bottom, top) = STACK.with(|c| c.get());
        if top != 0 {
            return (top != u64::MAX).then_some((bottom, top));
        }
        let mut bounds = (0u64, u64::MAX);
        // SAFETY: attr is initialised by pthread_getattr_np before use and destroyed after.
        unsafe {
            let mut attr: libc::pthread_attr_t = std::mem::zeroed();
            if libc::pthread_getattr_np(libc::pthread_self(), &mut attr) == 0 {
                let mut addr: *mut libc::c_void = std::ptr::null_mut();
                let mut size: libc::size_t = 0;
                if libc::pthread_attr_getstack(&attr, &mut addr, &mut size) == 0 && size > 0 {
                    bounds = (addr as u64, (addr as u64).saturating_add(size as u64));
                }
                libc::pthread_attr_destroy(&mut attr);
            }
        }
        STACK.with(|c| c.set(bounds));
        (bounds.1 != u64::MAX).then_some(bounds)
    }

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

    /// The readable part of the thread's stack: `[sp at capture, top)`.
    #[derive(Clone, Copy)]
    struct Bounds {
        lo: u64,
        top: u64,
    }

    impl Bounds {
        #[inline(always)]
        fn read(self, addr: u64) -> Result<u64, ()> {
            if addr < self.lo || addr > self.top.saturating_sub(8) {
                return Err(());
            }
            // SAFETY: `[lo, top)` is this thread's live stack: everything above the
            // capture's own stack pointer up to the top of the mapping is mapped and
            // readable, and stays so while the capture runs.
            Ok(unsafe { std::ptr::read_unaligned(addr as *const u64) })
        }
    }

    /// How a walk that met an earlier path left it.
    enum Left {
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

    /// Takes the whole path of node `start` (which holds this walk's state) at once when
    /// every stack word its steps read still holds what it held (for a stack cut at the
    /// frame limit, the steps to the cut): one pass over those checks, the path's frames
    /// copied in one piece. Returns whether the walk reached the end of
    /// the stack within the frame limit, or `None` when the path has no piece, would pass
    /// the step limit or no longer holds (then [`follow`] takes it node by node and finds
    /// where it changed).
    #[inline(always)]
    fn take_whole(
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
            differs |=
                differs_at(&q[0]) | differs_at(&q[1]) | differs_at(&q[2]) | differs_at(&q[3]);
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
    fn word_at(anchor: u64, offset: i32) -> *const u64 {
        anchor.wrapping_add(offset as i64 as u64) as *const u64
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
    fn follow(
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
    fn taken_bps(
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
    fn redo_other(
        node: &Node,
        here: State,
        framehop: &mut Framehop,
        bounds: Bounds,
    ) -> Option<State> {
        match node.kind {
            Kind::Framehop => framehop.step(here.address()?, here, bounds),
            Kind::UnknownModule => {
                modules::mark_stale();
                None
            }
            Kind::Rule | Kind::End => None,
        }
    }

    /// Copies the frames `deferred` names into `slot`.
    #[inline]
    fn copy_deferred(paths: &Paths, deferred: Deferred, slot: &mut StackSlot) {
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
    fn walk(
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
    fn cut_chain(
        paths: &mut Paths,
        tail: u32,
        own: usize,
        n: usize,
        slot: &StackSlot,
    ) -> Option<u64> {
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
    struct Out {
        n: usize,
        max: usize,
        /// The walk may leave the frames of a whole path taken at its end in their piece
        /// ([`Deferred`]) instead of copying them.
        defer: bool,
        deferred: Deferred,
    }

    /// Frames of a walk that are still in a piece: `len` frames from `from` in the pool
    /// belong at `at` in the slot. `len` 0: none. [`finish`] copies them.
    #[derive(Clone, Copy, Default)]
    struct Deferred {
        from: u32,
        at: u16,
        len: u16,
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

    #[cfg(test)]
    mod tests {
        use super::*;

        fn empty_rules() -> Box<Rules> {
            Box::new(Rules {
                table: 0,
                keys: [[0; RULE_WAYS]; RULE_SETS],
                rules: [[Rule::default(); RULE_WAYS]; RULE_SETS],
            })
        }

        fn rule(offset: i32) -> Rule {
            Rule {
                form: Form::Step,
                cfa_offset: offset,
                ..Rule::default()
            }
        }

        /// `n` distinct keys that all fall in one set.
        fn keys_of_one_set(n: usize) -> Vec<u64> {
            let want = rule_set(0x7f00_0000_1000);
            (0x7f00_0000_1000u64..)
                .filter(|&k| rule_set(k) == want)
                .take(n)
                .collect()
        }

        fn empty_paths() -> Box<Paths> {
            // SAFETY: all-zero bytes are valid `Paths` (no table yet, no nodes; see
            // `thread_unwind`).
            let mut paths = unsafe { Box::<Paths>::new_zeroed().assume_init() };
            paths.use_table(1);
            paths
        }

        /// A node to be of a clean rule's step from (pc, sp, bp) to a caller at `next_sp`.
        fn rule_step(pc: u64, sp: u64, bp: u64, next_sp: u64, reads_bp: bool) -> Node {
            Node {
                state: State { pc, sp, bp },
                next_sp,
                lowest_read: next_sp - 8,
                emits: true,
                reads_bp,
                ..Node::default()
            }
        }

        fn end_step(pc: u64, sp: u64, bp: u64) -> Node {
            Node {
                state: State { pc, sp, bp },
                kind: Kind::End,
                emits: true,
                ..Node::default()
            }
        }

        /// Checks are kept as 32-bit offsets from the first word checked: a piece with a
        /// read beyond their reach gets none (its nodes are followed step by step, the
        /// stack they give the same), one just within it gets its checks.
        #[test]
        fn a_piece_reading_beyond_the_offsets_reach_is_made_without_checks() {
            let mut paths = empty_paths();
            let first = [
                rule_step(0x1000, 0x100, 0xdead, 0x120, false),
                end_step(0x3000, 0x120, 0x300),
            ];
            let id = paths.link(&first, NONE).expect("room");
            assert!(paths.views[id as usize].whole);
            assert_eq!(paths.anchor, 0x118, "the first word checked");
            // A path whose step reads the return address at `anchor + offset`.
            let path_reading_at = |offset: u64, pc: u64| {
                let next_sp = 0x118 + offset + 8;
                [
                    rule_step(pc, next_sp - 0x20, 0xdead, next_sp, false),
                    end_step(pc + 0x10, next_sp, 0x300),
                ]
            };
            let within = path_reading_at(i32::MAX as u64 - 7, 0x5000);
            let id = paths.link(&within, NONE).expect("room");
            let view = paths.views[id as usize];
            assert!(view.whole, "just within reach: checked");
            assert_eq!(
                word_at(paths.anchor, paths.checks[view.checks_from as usize].at) as u64,
                within[0].next_sp - 8
            );
            let beyond = path_reading_at(i32::MAX as u64 + 1, 0x6000);
            let id = paths.link(&beyond, NONE).expect("room");
            assert!(!paths.views[id as usize].whole, "beyond reach: no checks");
            assert!(!paths.views[paths.node(id).caller as usize].whole);
        }

        #[test]
        fn a_path_taken_again_finds_its_nodes_and_its_chain_is_that_of_its_frames() {
            let mut paths = empty_paths();
            // Innermost first: a frame without frame pointer (bp is data), one whose rule
            // reads bp, the root.
            let walk = [
                rule_step(0x1000, 0x100, 0xdead, 0x120, false),
                rule_step(0x2000, 0x120, 0x300, 0x140, true),
                end_step(0x3000, 0x140, 0x300),
            ];
            let inner = paths.link(&walk, NONE).expect("room");
            assert_eq!(paths.used, 4, "three nodes made");
            assert_eq!(
                paths.node(inner).chain,
                crate::channel::event::native_chain(&[0x1000, 0x2000, 0x3000]),
                "the innermost node's chain is the chain of the path's frames"
            );
            // Its piece: the return addresses each step read, with the frames' addresses,
            // and the frames, innermost first.
            let piece = |paths: &Paths, id: u32| {
                let view = paths.views[id as usize];
                let range = view.checks_from as usize..view.checks_end as usize;
                let checks: Vec<(u64, u64)> = paths.checks[range]
                    .iter()
                    .map(|c| (word_at(paths.anchor, c.at) as u64, c.value))
                    .collect();
                let frames =
                    paths.frames[view.frames_from as usize..view.frames_end as usize].to_vec();
                (view.whole, view.steps, view.lowest_read, checks, frames)
            };
            assert_eq!(
                piece(&paths, inner),
                (
                    true,
                    3,
                    0x118,
                    vec![(0x118, 0x2000), (0x138, 0x3000)],
                    vec![0x1000, 0x2000, 0x3000]
                )
            );
            assert_eq!(paths.link(&walk, NONE), Some(inner), "the same path again");
            assert_eq!(paths.used, 4, "no node made for a path already made");
            // The innermost frame's step leaves bp as it was and the next step reads it: its
            // bp matters, the root's does not.
            assert_eq!(paths.find_all(walk[0].state).next(), Some(inner));
            assert_eq!(
                paths
                    .find_all(State {
                        bp: 0x1234,
                        ..walk[0].state
                    })
                    .next(),
                None,
                "the next step reads bp, so this frame's bp matters"
            );
            let outer = paths.node(inner).caller;
            assert!(!paths.node(paths.node(outer).caller).bp_matters);
            // Another inner frame under the same outer part: one node more, linked to it.
            let other = [rule_step(0x1100, 0x100, 0x300, 0x120, false)];
            let id = paths.link(&other, outer).expect("room");
            assert_eq!(paths.used, 5);
            assert_eq!(
                paths.node(id).chain,
                crate::channel::event::native_chain(&[0x1100, 0x2000, 0x3000])
            );
            // An inner frame whose own step loads bp from the stack: its path does not
            // depend on the bp it was reached with.
            let loads_bp = [Node {
                bp_read_at: 0x110,
                lowest_read: 0x110,
                ..rule_step(0x1200, 0x100, 0x5555, 0x120, false)
            }];
            let id = paths.link(&loads_bp, outer).expect("room");
            assert_eq!(
                piece(&paths, id),
                (
                    true,
                    3,
                    0x110,
                    // The next frame's step reads bp: the bp loaded is checked too. The
                    // outer part is copied from the path this one hangs on.
                    vec![(0x118, 0x2000), (0x110, 0x300), (0x138, 0x3000)],
                    vec![0x1200, 0x2000, 0x3000]
                )
            );
            assert_eq!(
                paths
                    .find_all(State {
                        bp: 0x7777,
                        ..loads_bp[0].state
                    })
                    .next(),
                Some(id)
            );
        }

        #[test]
        fn a_state_keeps_the_nodes_of_each_of_its_paths_newest_first() {
            let mut paths = empty_paths();
            // One frame (same state) called from two places: two paths from one state.
            let root_a = paths
                .link(&[end_step(0x3000, 0x140, 0)], NONE)
                .expect("room");
            let root_b = paths
                .link(&[end_step(0x3100, 0x140, 0)], NONE)
                .expect("room");
            let inner = rule_step(0x1000, 0x100, 0, 0x140, false);
            let via_a = paths.link(&[inner], root_a).expect("room");
            let via_b = paths.link(&[inner], root_b).expect("room");
            assert_ne!(via_a, via_b);
            let found: Vec<u32> = paths.find_all(inner.state).collect();
            assert_eq!(found, [via_b, via_a], "both paths, the newest first");
            // Taking path a again makes it the newest, and makes no node.
            let used = paths.used;
            assert_eq!(paths.link(&[inner], root_a), Some(via_a));
            assert_eq!(paths.used, used);
            let found: Vec<u32> = paths.find_all(inner.state).collect();
            assert_eq!(found, [via_a, via_b]);
        }

        #[test]
        fn paths_that_do_not_fit_are_forgotten_and_so_is_every_node_of_another_table() {
            let mut paths = empty_paths();
            let walk = [end_step(0x3000, 0x140, 0)];
            let id = paths.link(&walk, NONE).expect("room");
            paths.use_table(1);
            assert_eq!(
                paths.find_all(walk[0].state).next(),
                Some(id),
                "the same table keeps them"
            );
            paths.use_table(2);
            assert_eq!(
                paths.find_all(walk[0].state).next(),
                None,
                "another table forgets them"
            );
            let id = paths.link(&walk, NONE).expect("room");
            paths.used = NODES as u32;
            assert_eq!(
                paths.link(&[rule_step(0x1000, 0x100, 0, 0x140, false)], id),
                None
            );
            assert_eq!(paths.used, 1, "all forgotten");
            assert_eq!(paths.find_all(walk[0].state).next(), None);
        }

        /// Bytes of `[start, start + len)` resident in memory (`mincore`).
        fn resident_bytes(start: usize, len: usize) -> usize {
            let page = 4096;
            let (first, end) = (start / page * page, (start + len).div_ceil(page) * page);
            let mut flags = vec![0u8; (end - first) / page];
            // SAFETY: `first` is page-aligned, the range is one live mapping (the thread's
            // state), and `flags` has a byte for each of its pages.
            let rc = unsafe {
                libc::mincore(first as *mut libc::c_void, end - first, flags.as_mut_ptr())
            };
            assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
            flags.iter().filter(|&&f| f & 1 != 0).count() * page
        }

        #[test]
        fn a_threads_first_walk_makes_resident_only_the_pages_it_writes() {
            let (size, resident) = std::thread::spawn(|| {
                let (mut slot, mut trail) = (StackSlot::EMPTY, crate::capture::Trail::EMPTY);
                let stacks = crate::config::Stacks::Native;
                crate::capture::capture(&mut slot, &mut trail, stacks, 64);
                assert!(slot.n_native > 0, "the walk found frames");
                let state = UNWIND.with(|c| c.get());
                assert!(
                    !state.is_null() && state != STATE_GONE,
                    "the thread has its state"
                );
                let size = std::mem::size_of::<ThreadUnwind>();
                (size, resident_bytes(state as usize, size))
            })
            .join()
            .expect("the capturing thread");
            assert!(
                size > 8 << 20,
                "the state is {size} bytes: the tables changed size"
            );
            // Zeroing the state at allocation (what the allocator does for a type aligned
            // above 16 bytes) would make all of it resident.
            assert!(
                resident < 1 << 20,
                "{resident} of {size} bytes resident after one walk"
            );
        }

        #[test]
        fn a_set_keeps_its_eight_newest_rules_and_a_new_table_empties_the_cache() {
            let mut rules = empty_rules();
            rules.use_table(1);
            let keys = keys_of_one_set(RULE_WAYS + 1);
            for (i, &k) in keys[..RULE_WAYS].iter().enumerate() {
                rules.insert(k, rule(i as i32 * 16));
            }
            for (i, &k) in keys[..RULE_WAYS].iter().enumerate() {
                let got = rules.get(k).expect("eight keys of one set are all kept");
                assert_eq!(got.cfa_offset, i as i32 * 16, "key {k:#x} has its own rule");
            }
            rules.insert(keys[RULE_WAYS], rule(999));
            assert!(
                rules.get(keys[0]).is_none(),
                "a ninth key forgets the oldest"
            );
            assert_eq!(rules.get(keys[RULE_WAYS]).map(|r| r.cfa_offset), Some(999));
            assert_eq!(rules.get(keys[1]).map(|r| r.cfa_offset), Some(16));
            rules.use_table(1);
            assert!(
                rules.get(keys[1]).is_some(),
                "the same table keeps the rules"
            );
            rules.use_table(2);
            assert!(
                keys.iter().all(|&k| rules.get(k).is_none()),
                "rules found with another module table are not used"
            );
        }
    }
}
