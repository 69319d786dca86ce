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
//!
//! One room a job: `entry` (the capture entry points), `thread` (per-thread state, stack
//! bounds), `walk` (the walk), `take` and `follow` (an earlier path taken whole, or node by
//! node), `paths` and `node` (the paths of frames), `rules` (the rule cache), `framehop`
//! (the framehop adapter). A room's tests are in tests/, each a child of its room.

#[cfg(target_arch = "x86_64")]
mod entry;
#[cfg(target_arch = "x86_64")]
mod follow;
#[cfg(target_arch = "x86_64")]
mod framehop;
#[cfg(target_arch = "x86_64")]
mod node;
#[cfg(target_arch = "x86_64")]
mod paths;
#[cfg(target_arch = "x86_64")]
mod rules;
#[cfg(target_arch = "x86_64")]
mod take;
#[cfg(target_arch = "x86_64")]
mod thread;
#[cfg(target_arch = "x86_64")]
mod walk;

#[cfg(target_arch = "x86_64")]
pub use entry::{capture, capture_interrupted, finish};

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
