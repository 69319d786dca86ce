//! The unwinder's state on reaching a frame, and the node of the paths that a walk's step
//! becomes. Hot.

use framehop::FrameAddress;

/// The bit that marks a walk's first frame in a [`State`]'s `pc` (its frame address is
/// the instruction pointer, not a return address: framehop treats it apart, and its rule
/// may differ). Code addresses never have it.
pub(super) const FIRST: u64 = 1 << 63;

/// The unwinder's whole state on reaching a frame: all that framehop's x86-64 rules read
/// besides the stack itself.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct State {
    /// Frame address (a return address; the instruction pointer, with [`FIRST`], for the
    /// walk's first frame).
    pub(super) pc: u64,
    pub(super) sp: u64,
    pub(super) bp: u64,
}

impl State {
    #[inline(always)]
    pub(super) fn address(self) -> Option<FrameAddress> {
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
pub(super) enum Kind {
    /// A rule memsnap executes ([`Rule`]), clean when the node was made: the next `sp`
    /// is `next_sp`, the return address lies at `next_sp - 8`, the next `bp` at
    /// `bp_read_at` (0: `bp` unchanged).
    ///
    /// [`Rule`]: super::rules::Rule
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
pub(super) const NONE: u32 = 0;

/// One frame of a path that a walk took: the unwinder's state on reaching it, how to make
/// the step from it again, and the node of the frame the step led to. Nodes never change
/// once made (a frame reached by another path gets a node of its own), so a node's
/// `chain` is the hash of its whole path. One cache line each.
#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
pub(super) struct Node {
    pub(super) state: State,
    /// [`Kind::Rule`]: the stack pointer the step gives (its return address lies just
    /// below), where it reads the next `bp` (0: unchanged), and the lowest of those two
    /// addresses.
    pub(super) next_sp: u64,
    pub(super) bp_read_at: u64,
    pub(super) lowest_read: u64,
    /// The native chain (`channel::event::native_chain`) of the frames this node and the
    /// nodes after it give.
    pub(super) chain: u64,
    /// The node the step led to: [`NONE`] when the walk ended with this node.
    pub(super) caller: u32,
    pub(super) kind: Kind,
    /// The frame goes into stacks (not the walk's first frame, not memsnap's own).
    pub(super) emits: bool,
    /// The step reads `bp` as it was on reaching the frame (a CFA or a saved `bp` found
    /// from it; framehop's steps are taken to).
    pub(super) reads_bp: bool,
    /// The path from here depends on `bp`: this step or a later one reads it before a
    /// step loads it from the stack. Where it does not (code built without frame
    /// pointers keeps data in `bp`), a state with any `bp` is this node's state.
    pub(super) bp_matters: bool,
}

impl Node {
    /// Whether `state` is this node's state.
    #[inline(always)]
    pub(super) fn holds(&self, state: State) -> bool {
        self.state.pc == state.pc
            && self.state.sp == state.sp
            && (self.state.bp == state.bp || !self.bp_matters)
    }
}
