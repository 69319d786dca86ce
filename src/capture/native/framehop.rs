//! The framehop adapter: framehop's own step, where memsnap does not make it, its rule
//! caches, and a rule derived from framehop once per address. Warm: only on a rule miss or
//! a step of an unusual shape.

use super::node::{FIRST, State};
use super::rules::{Form, Rule};
use super::thread::Bounds;
use crate::capture::count;
use crate::process::modules;
use framehop::x86_64::{CacheX86_64, UnwindRegsX86_64};
use framehop::{FrameAddress, MustNotAllocateDuringUnwind, Unwinder as _};

pub(super) type Cache = CacheX86_64<MustNotAllocateDuringUnwind>;

/// framehop's rule caches per thread. One cache is direct-mapped: 509 slots indexed by
/// `address % 509`, so two addresses a walk meets every time that fall in the same slot
/// evict each other, and each then costs a CFI lookup and parse on every capture (about
/// 4,500 instructions; seen in a release build of this library where the hook's own
/// address collided with a caller's: two misses per capture, 2.5x the instructions).
/// Spreading addresses over eight caches by their higher bits makes the whole a
/// direct-mapped cache of 4,072 slots: about 37 KiB a cache (slots and framehop's CFI
/// evaluation context), allocated on a thread's first capture.
pub(super) const RULE_CACHES: usize = 8;

/// The cache for `address`: a hash of the bits above the slot index framehop uses.
#[inline(always)]
fn rule_cache_index(address: FrameAddress) -> usize {
    let lookup = address.address_for_lookup();
    ((lookup / 509).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 61) as usize % RULE_CACHES
}

/// framehop, for what memsnap does not do itself: the module table (its unwinder) and
/// this thread's rule caches.
pub(super) struct Framehop<'a> {
    pub(super) table: &'a modules::ModuleTable,
    pub(super) caches: &'a mut [Cache; RULE_CACHES],
}

impl Framehop<'_> {
    /// framehop's step from `state` (its reads bounded): the next frame's state, or
    /// `None` where the walk ends (no caller, a failed read, or a return address of 0 or
    /// in the kernel's half, which no user code has).
    #[inline(never)]
    pub(super) fn step(
        &mut self,
        address: FrameAddress,
        state: State,
        bounds: Bounds,
    ) -> Option<State> {
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
    pub(super) fn rule(&mut self, address: FrameAddress) -> Rule {
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
    let (cfa_from_bp, cfa_offset) = match (offset(p.0, q.0, a.1, b.1), offset(p.1, q.1, a.1, b.1)) {
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
