//! The rule cache: the unwind rules memsnap executes itself, by frame address, and the
//! step that executes one. Hot.

use super::node::{FIRST, State};
use super::thread::Bounds;
use framehop::FrameAddress;

/// What a step does in the common case, found once per address by asking framehop
/// (`derive_rule`, framehop.rs) and then executed here without framehop: the new stack pointer
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
pub(super) struct Rule {
    pub(super) form: Form,
    pub(super) cfa_from_bp: bool,
    pub(super) cfa_offset: i32,
    /// 0: `bp` unchanged; 1: loaded from `sp + bp_offset`; 2: from `bp + bp_offset`.
    pub(super) bp_from: u8,
    pub(super) bp_offset: i32,
}

#[derive(Clone, Copy, Default, PartialEq, Eq)]
#[repr(u8)]
pub(super) enum Form {
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
/// call sites, but in a real training step (benches/gpu/step_stacks.py: a transformer's
/// forward, backward and optimizer step, about 450 stacks a step) the addresses of the
/// frames a walk unwinds evicted each other: 0.8-1.1 misses per walk, each one deriving
/// the rule with framehop again (docs/HOT-PATH.md, "Rule cache").
const RULE_SETS: usize = 512;

/// The rules memsnap executes itself, by [`rule_key`]: sets of [`RULE_WAYS`] entries,
/// the keys apart from the rules so that a lookup reads one line of keys; in each set
/// the newest first (a full set forgets its oldest).
pub(super) struct Rules {
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
    pub(super) fn use_table(&mut self, table: usize) {
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
    pub(super) fn get(&self, key: u64) -> Option<Rule> {
        let set = rule_set(key);
        let way = self.keys[set].iter().position(|&k| k == key)?;
        Some(self.rules[set][way])
    }

    /// Whether caching `key` would evict another key's rule.
    #[cfg(feature = "capture-stats")]
    pub(super) fn full(&self, key: u64) -> bool {
        self.keys[rule_set(key)][RULE_WAYS - 1] != 0
    }

    /// Caches `rule` for `key`, first in its set.
    #[inline(always)]
    pub(super) fn insert(&mut self, key: u64, rule: Rule) {
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
pub(super) fn rule_key(address: FrameAddress) -> u64 {
    let first = u64::from(!address.is_return_address());
    address.address_for_lookup() | (first << 63)
}

#[inline(always)]
fn rule_set(key: u64) -> usize {
    (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 55) as usize % RULE_SETS
}

/// What [`run_rule`] did.
pub(super) enum Ran {
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
pub(super) fn run_rule(rule: &Rule, state: State, bounds: Bounds) -> Ran {
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

#[cfg(test)]
#[path = "tests/rules.rs"]
mod tests;
