//! Native return addresses of the calling thread, unwound in-process with framehop, with
//! the outer frames of the thread's previous capture reused when they provably still hold.
//!
//! Hot. Steady state: one atomic load (module table), two const-TLS reads (the thread's
//! unwind state, stack bounds), then the rules memsnap keeps per address (derived once from
//! framehop's, executed inline); every stack read is checked against `[sp at capture, top
//! of the thread's stack)`.
//!
//! Frame reuse (docs/HOT-PATH.md, "Checked frame reuse"): each walk records, per frame, the
//! unwinder's whole state (frame address, sp, bp: all that framehop's x86-64 rules read)
//! and every stack read with its value. When a new walk reaches a state that the previous
//! walk also passed through, the rest of the walk is a pure function of that state, the
//! rules (same module table) and the memory it read: if every one of those reads still
//! returns the same value, the previous walk's outer frames are taken instead of unwound
//! (one load and compare per read, about two per frame). Nothing is assumed: a changed
//! caller at the same depth changes a read return address, and the walk goes on unwinding.
//! The previous walk lies at the ends of its arrays, so taking its outer frames moves
//! nothing: the new walk's own inner part is written before them (`Record`).
//!
//! First capture on a thread: one allocation (the thread's unwind state, leaked until the
//! thread exits) and `pthread_getattr_np` (may read /proc on the main thread). The walk ends cleanly at an address in no known module (JIT code, a module
//! loaded since the table was built: the table is marked stale for the writer), at a failed
//! stack read, or at the frame limit. x86_64 only; elsewhere nothing is captured.

#[cfg(target_arch = "x86_64")]
pub use imp::{capture, capture_interrupted};

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

/// Walks that reused the previous one's outer frames (tests look at it).
#[cfg(test)]
pub static WALKS_REUSED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

#[cfg(not(target_arch = "x86_64"))]
#[inline]
pub fn capture(
    slot: &mut crate::channel::event::StackSlot,
    max_frames: usize,
    from: StartRegs,
) -> Option<u64> {
    let _ = (max_frames, from);
    slot.n_native = 0;
    None
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
    use crate::channel::event::{NATIVE_CHAIN_SEED, StackSlot, native_chain_step};
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
    /// Stack reads one walk records (framehop's rules read one to three words a frame).
    const MAX_READS: usize = MAX_STEPS * 4;

    /// One frame of a walk as the walk makes it: the unwinder's state on reaching it, and
    /// what it gave. Its indices are into the arrays of the walk that holds it.
    #[derive(Clone, Copy, Default)]
    struct Unwound {
        /// Frame address: the instruction pointer for the first step, else a return address.
        pc: u64,
        first: bool,
        sp: u64,
        bp: u64,
        /// Index in the walk's `reads` of the first read made while unwinding past this frame.
        reads_from: u32,
        /// Index in the walk's `frames` of the first frame this step or a later one added.
        frames_from: u32,
    }

    /// A step of the record: the step as it was made, with the summaries of its tail, which
    /// it gets when it is placed in the record ([`place`]).
    #[derive(Clone, Copy, Default)]
    struct Step {
        made: Unwound,
        /// Lowest address read by this step or a later one.
        tail_lowest_read: u64,
        /// Every read of this step and the later ones succeeded.
        tail_reads_ok: bool,
    }

    /// A stack read and its result (`ok` false: out of bounds).
    #[derive(Clone, Copy, Default)]
    struct Read {
        addr: u64,
        value: u64,
        ok: bool,
    }

    /// How a walk ended after its last step. (All-zero is `Stopped`: see [`thread_unwind`].)
    #[derive(Clone, Copy, PartialEq, Eq)]
    #[repr(u8)]
    enum End {
        /// The unwinder found the root, or could go no further (failed read, bad rule).
        Stopped = 0,
        /// A return address in no known module (JIT code, a library loaded since).
        UnknownModule,
        /// [`MAX_STEPS`] reached.
        StepLimit,
    }

    /// The walk being made, innermost first from index 0: the steps it unwinds itself, the
    /// stack reads they make and the frames they give.
    struct Scratch {
        steps: [Unwound; MAX_STEPS],
        n_steps: usize,
        reads: [Read; MAX_READS],
        n_reads: usize,
        frames: [u64; MAX_STEPS],
        n_frames: usize,
        /// Some read was not recorded (more than [`MAX_READS`]): the walk cannot be reused.
        reads_overflowed: bool,
        end: End,
    }

    /// The previous walk, kept for the next one to reuse. Its steps, reads and frames lie
    /// at the ends of their arrays (`steps[steps_from..]`, and so on; every index in a
    /// [`Step`] is into these arrays). A new walk that meets it at a step writes its own
    /// inner part just before that step, and the shared outer part, usually the longer one,
    /// stays where it lies with its summaries (see [`place`]) and hash (`chain`): the work of
    /// reuse grows with the part that differs, not with the part that is reused.
    struct Record {
        /// The module table the walk used (rules may differ in another); 0: no walk.
        table: usize,
        steps: [Step; MAX_STEPS],
        steps_from: usize,
        reads: [Read; MAX_READS],
        reads_from: usize,
        /// The return addresses the walk put on the stack, innermost first (memsnap's own
        /// frames are not there).
        frames: [u64; MAX_STEPS],
        frames_from: usize,
        /// `chain[i]`: the native chain (`channel::event::native_chain`) of `frames[i..]`,
        /// so that a reused tail brings its part of the stack's hash along.
        chain: [u64; MAX_STEPS],
        /// Some read was not recorded: the walk cannot be reused.
        reads_overflowed: bool,
        end: End,
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

    /// A thread's unwinder caches, its previous walk and room for the next one.
    struct ThreadUnwind {
        caches: [Cache; RULE_CACHES],
        /// The rules memsnap executes itself (see [`Rule`]).
        rules: Rules,
        record: Record,
        scratch: Scratch,
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
            self.keys = [[0; RULE_WAYS]; RULE_SETS];
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

    /// The registers an x86-64 walk tracks, kept in locals: framehop's register set (an
    /// array indexed by register, each access bounds-checked) is built only for the steps
    /// framehop unwinds.
    #[derive(Clone, Copy)]
    struct Regs {
        ip: u64,
        sp: u64,
        bp: u64,
    }

    /// What [`run_rule`] did.
    enum Ran {
        Next(u64),
        End,
        /// Not handled here: framehop unwinds this step.
        Framehop,
    }

    /// Executes `rule` on `regs` in the clean case (see [`Rule`]), recording its reads in
    /// `cur`; [`Ran::Framehop`] with nothing changed otherwise.
    #[inline(always)]
    fn run_rule(rule: &Rule, regs: &mut Regs, bounds: Bounds, cur: &mut Scratch) -> Ran {
        match rule.form {
            Form::Framehop => return Ran::Framehop,
            Form::End => return Ran::End,
            Form::Step => {}
        }
        let Regs { sp, bp, .. } = *regs;
        if rule.cfa_from_bp && bp == 0 {
            return Ran::Framehop;
        }
        let base = if rule.cfa_from_bp { bp } else { sp };
        let new_sp = base.wrapping_add(rule.cfa_offset as i64 as u64);
        if new_sp <= sp {
            return Ran::Framehop;
        }
        let bp_at = match rule.bp_from {
            0 => None,
            1 => Some(sp.wrapping_add(rule.bp_offset as i64 as u64)),
            _ => Some(bp.wrapping_add(rule.bp_offset as i64 as u64)),
        };
        let new_bp = match bp_at {
            None => bp,
            Some(at) => match bounds.read(at) {
                Ok(v) => v,
                Err(()) => return Ran::Framehop,
            },
        };
        let ra_at = new_sp - 8;
        let Ok(ra) = bounds.read(ra_at) else {
            return Ran::Framehop;
        };
        if ra == 0 {
            return Ran::Framehop;
        }
        // The reads, in the order made: straight-line stores (an iterator over the optional
        // `bp` read and the return address cost 27 instructions a step; callgrind).
        let n = cur.n_reads;
        if let Some(reads) = cur.reads.get_mut(n..n + 2) {
            let mut k = 0;
            if let Some(addr) = bp_at {
                reads[0] = Read {
                    addr,
                    value: new_bp,
                    ok: true,
                };
                k = 1;
            }
            reads[k] = Read {
                addr: ra_at,
                value: ra,
                ok: true,
            };
            cur.n_reads = n + k + 1;
        } else {
            cur.reads_overflowed = true;
        }
        *regs = Regs {
            ip: ra,
            sp: new_sp,
            bp: new_bp,
        };
        Ran::Next(ra)
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

    thread_local! {
        static UNWIND: Cell<*mut ThreadUnwind> = const { Cell::new(std::ptr::null_mut()) };
        /// This thread's stack `[bottom, top)`; top 0 = not looked up yet, MAX = unknown.
        static STACK: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
    }

    static UNWIND_KEY: crate::thread_state::ExitKey = crate::thread_state::ExitKey::new();

    unsafe extern "C" fn free_unwind(p: *mut libc::c_void) {
        UNWIND.with(|c| c.set(STATE_GONE));
        if !p.is_null() {
            // SAFETY: `p` is the state allocated for this thread; the thread is exiting and
            // its TLS now says "gone", so no later capture on it can use the pointer.
            unsafe { drop(Box::from_raw(p as *mut ThreadUnwind)) };
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
        // About 120 KiB (the caches allocate their own ~300 KiB).
        // SAFETY: all-zero bytes are a valid record (no walk yet: `table` 0, which no
        // module table has, so nothing is reused from it; `End::Stopped`), a valid scratch
        // walk and valid rules (no module table yet: `table` 0, every key 0 an empty
        // entry); the caches are written in place below, before any use. `free_unwind`
        // frees a `ThreadUnwind`.
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
    #[inline(never)]
    pub fn capture(slot: &mut StackSlot, max_frames: usize, from: super::StartRegs) -> Option<u64> {
        slot.n_native = 0;
        let state = thread_unwind()?;
        let bounds = stack_bounds()?;
        capture_from(slot, max_frames, modules::ensure(), state, bounds, from)
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
        let _ = capture_from(slot, max - 1, table, state, (bottom, top), regs);
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
        let recorded = walk(
            table,
            &mut state.caches,
            &mut state.rules,
            &mut state.scratch,
            &mut state.record,
            Bounds { lo: from.sp, top },
            from,
            slot,
            max,
        );
        let record = &state.record;
        count!(Walks, 1);
        count!(WalksAtStepLimit, record.end == End::StepLimit);
        count!(NativeFrames, slot.n_native);
        count!(NativeTruncated, slot.truncated);
        // The record's frames are the slot's unless the walk could not be recorded or the
        // slot was cut at `max`.
        if !recorded || slot.truncated || MAX_STEPS - record.frames_from != slot.n_native as usize {
            return None;
        }
        Some(if record.frames_from < MAX_STEPS {
            record.chain[record.frames_from]
        } else {
            NATIVE_CHAIN_SEED
        })
    }

    /// Computes `record.chain[lo..hi]`, innermost last to first; the entries from `hi` on are
    /// already right (the reused outer part) or there are none.
    #[inline(always)]
    fn fill_chain(record: &mut Record, lo: usize, hi: usize) {
        let mut chain = if hi < MAX_STEPS {
            record.chain[hi]
        } else {
            NATIVE_CHAIN_SEED
        };
        for i in (lo..hi).rev() {
            chain = native_chain_step(chain, record.frames[i]);
            record.chain[i] = chain;
        }
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

    /// Whether every read `record` made from step `at` on would return the same result now.
    ///
    /// The usual case needs no bounds check per read: the reads all succeeded last time, so
    /// each lay in `[sp then, top)`; `top` is the same (one thread, one stack), and if the
    /// lowest of them is at or above this capture's `sp`, all lie in bounds now. Then the
    /// check is one load, one xor and one or per read.
    #[inline(always)]
    fn tail_still_holds(record: &Record, at: usize, bounds: Bounds) -> bool {
        let step = &record.steps[at];
        let reads = &record.reads[step.made.reads_from as usize..];
        if step.tail_reads_ok && step.tail_lowest_read >= bounds.lo {
            // This step's own reads come first: a changed caller shows in its return address
            // there, so a check that fails usually ends after one or two reads instead of
            // reading the whole tail.
            let (head, rest) = reads.split_at(reads.len().min(2));
            for r in head {
                // SAFETY: as below.
                if unsafe { std::ptr::read_unaligned(r.addr as *const u64) } != r.value {
                    return false;
                }
            }
            let mut differs = 0u64;
            for r in rest {
                // SAFETY: `r.addr` is in `[bounds.lo, top - 8]` (see above): this thread's
                // live stack, mapped and readable while the capture runs.
                differs |= unsafe { std::ptr::read_unaligned(r.addr as *const u64) } ^ r.value;
            }
            return differs == 0;
        }
        reads.iter().all(|r| match bounds.read(r.addr) {
            Ok(v) => r.ok && v == r.value,
            Err(()) => !r.ok,
        })
    }

    /// One walk into `cur`, reusing the outer frames of the previous walk (`record`) where
    /// they provably still hold, then kept in `record` for the next one. Returns whether
    /// `record` now describes this walk (false only when a long new inner part did not fit
    /// before the reused steps: the slot is right, the record stays the previous walk's).
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn walk(
        table: &modules::ModuleTable,
        caches: &mut [Cache; RULE_CACHES],
        rules: &mut Rules,
        cur: &mut Scratch,
        record: &mut Record,
        bounds: Bounds,
        from: super::StartRegs,
        slot: &mut StackSlot,
        max: usize,
    ) -> bool {
        let table_id = table as *const modules::ModuleTable as usize;
        rules.use_table(table_id);
        cur.n_steps = 0;
        cur.n_reads = 0;
        cur.n_frames = 0;
        cur.reads_overflowed = false;
        cur.end = End::StepLimit;
        let reusable = record.table == table_id && !record.reads_overflowed;
        let mut prev_at = record.steps_from;

        let mut out = Out { n: 0, max };
        let mut regs = Regs {
            ip: from.ip,
            sp: from.sp,
            bp: from.bp,
        };
        let mut address = FrameAddress::InstructionPointer(from.ip);
        let mut hint = usize::MAX;
        while cur.n_steps < MAX_STEPS {
            let (pc, first) = match address {
                FrameAddress::InstructionPointer(p) => (p, true),
                FrameAddress::ReturnAddress(ra) => (ra.get(), false),
            };
            // Frames lie at increasing stack addresses: move through the previous walk in
            // step with this one and look for the same unwinder state.
            if reusable {
                let sp = regs.sp;
                while prev_at < MAX_STEPS && record.steps[prev_at].made.sp < sp {
                    prev_at += 1;
                }
                if let Some(Step { made: p, .. }) = record.steps.get(prev_at)
                    && p.sp == sp
                    && p.pc == pc
                    && p.first == first
                    && p.bp == regs.bp
                    && tail_still_holds(record, prev_at, bounds)
                {
                    count!(WalksReused, 1);
                    count!(StepsUnwound, cur.n_steps);
                    count!(StepsReused, MAX_STEPS - prev_at);
                    count!(ReadsChecked, MAX_READS - p.reads_from as usize);
                    let recorded = splice(cur, record, prev_at, slot, &mut out);
                    slot.n_native = out.n as u16;
                    return recorded;
                }
            }
            let step = Unwound {
                pc,
                first,
                sp: regs.sp,
                bp: regs.bp,
                reads_from: cur.n_reads as u32,
                frames_from: cur.n_frames as u32,
            };
            if !first {
                let Some(module) = table.find_near(pc, hint) else {
                    // JIT code, or a module loaded after the table was built.
                    modules::mark_stale();
                    cur.end = End::UnknownModule;
                    break;
                };
                hint = module;
                if !table.is_own(module) {
                    cur.frames[cur.n_frames] = pc;
                    cur.n_frames += 1;
                    out.push(pc, slot);
                }
            }
            // The step is recorded before its reads are: they belong to it.
            cur.steps[cur.n_steps] = step;
            cur.n_steps += 1;
            let key = rule_key(address);
            let rule = match rules.get(key) {
                Some(rule) => rule,
                None => {
                    count!(RuleMisses, 1);
                    count!(RuleMissesConflict, rules.full(key));
                    count!(RuleMissesCold, !rules.full(key));
                    count!(RuleMissesFirstFrame, first);
                    #[cfg(feature = "capture-stats")]
                    crate::capture::stats::note_miss(key);
                    let rule = derive_rule(table, &mut caches[rule_cache_index(address)], address);
                    rules.insert(key, rule);
                    rule
                }
            };
            match run_rule(&rule, &mut regs, bounds, cur) {
                Ran::Next(ra) => match FrameAddress::from_return_address(ra) {
                    Some(a) => {
                        address = a;
                        continue;
                    }
                    None => {
                        cur.end = End::Stopped;
                        break;
                    }
                },
                Ran::End => {
                    cur.end = End::Stopped;
                    break;
                }
                Ran::Framehop => {
                    count!(FramehopSteps, 1);
                }
            }
            let mut read_stack = |addr: u64| -> Result<u64, ()> {
                let result = bounds.read(addr);
                match cur.reads.get_mut(cur.n_reads) {
                    Some(r) => {
                        *r = Read {
                            addr,
                            value: result.unwrap_or(0),
                            ok: result.is_ok(),
                        };
                        cur.n_reads += 1;
                    }
                    None => cur.reads_overflowed = true,
                }
                result
            };
            let mut framehop_regs = UnwindRegsX86_64::new(regs.ip, regs.sp, regs.bp);
            let next = table.unwinder.unwind_frame(
                address,
                &mut framehop_regs,
                &mut caches[rule_cache_index(address)],
                &mut read_stack,
            );
            regs = Regs {
                ip: framehop_regs.ip(),
                sp: framehop_regs.sp(),
                bp: framehop_regs.bp(),
            };
            match next
                .ok()
                .flatten()
                .and_then(FrameAddress::from_return_address)
            {
                Some(a) => address = a,
                None => {
                    cur.end = End::Stopped;
                    break;
                }
            }
        }
        slot.n_native = out.n as u16;
        count!(StepsUnwound, cur.n_steps);
        adopt(cur, record, table_id);
        true
    }

    /// The frames written to the slot so far, at most `max`.
    struct Out {
        n: usize,
        max: usize,
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

        #[inline(always)]
        fn extend(&mut self, pcs: &[u64], slot: &mut StackSlot) {
            let room = self.max.min(slot.native.len()).saturating_sub(self.n);
            let take = pcs.len().min(room);
            slot.native[self.n..self.n + take].copy_from_slice(&pcs[..take]);
            self.n += take;
            if take < pcs.len() {
                slot.truncated = true;
            }
        }
    }

    /// Ends the walk with `record`'s steps from `at` on (their reads still hold), emitting
    /// the frames they gave, and writes the new inner part (`cur`) just before step `at`,
    /// where the record's own inner part was: the record then describes this walk, and its
    /// outer part was neither moved nor summarised again. Returns false, leaving the record
    /// as it was, when the inner part does not fit there (it is longer than the room before
    /// step `at`: a walk deeper than [`MAX_STEPS`] in all, or reads past [`MAX_READS`]).
    #[inline(never)]
    fn splice(
        cur: &Scratch,
        record: &mut Record,
        at: usize,
        slot: &mut StackSlot,
        out: &mut Out,
    ) -> bool {
        #[cfg(test)]
        super::WALKS_REUSED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tail = record.steps[at];
        let (reads_at, frames_at) = (
            tail.made.reads_from as usize,
            tail.made.frames_from as usize,
        );
        out.extend(&record.frames[frames_at..], slot);
        if record.end == End::UnknownModule {
            modules::mark_stale();
        }
        if cur.reads_overflowed
            || cur.n_steps > at
            || cur.n_reads > reads_at
            || cur.n_frames > frames_at
        {
            return false;
        }
        place(cur, record, (at, reads_at, frames_at));
        true
    }

    /// Writes `cur`'s steps, reads and frames into `record` so that they end just before
    /// `ends` (a step, read and frame index; the arrays' lengths for a whole walk), makes
    /// them the start of the record, and gives them their tail summaries (the lowest address
    /// that this step's reads and all later ones touch, and whether they all succeeded) and
    /// their chain, innermost last to first from what follows them: the reused part keeps
    /// its own.
    #[inline(always)]
    fn place(cur: &Scratch, record: &mut Record, ends: (usize, usize, usize)) {
        let (steps_end, reads_end, frames_end) = ends;
        let (steps_from, reads_from, frames_from) = (
            steps_end - cur.n_steps,
            reads_end - cur.n_reads,
            frames_end - cur.n_frames,
        );
        let (mut lowest, mut ok) = match record.steps.get(steps_end) {
            Some(next) => (next.tail_lowest_read, next.tail_reads_ok),
            None => (u64::MAX, true),
        };
        let mut step_reads_end = cur.n_reads;
        for (dst, s) in record.steps[steps_from..steps_end]
            .iter_mut()
            .zip(&cur.steps[..cur.n_steps])
            .rev()
        {
            for r in &cur.reads[s.reads_from as usize..step_reads_end] {
                lowest = lowest.min(r.addr);
                ok &= r.ok;
            }
            step_reads_end = s.reads_from as usize;
            *dst = Step {
                made: Unwound {
                    reads_from: s.reads_from + reads_from as u32,
                    frames_from: s.frames_from + frames_from as u32,
                    ..*s
                },
                tail_lowest_read: lowest,
                tail_reads_ok: ok,
            };
        }
        record.reads[reads_from..reads_end].copy_from_slice(&cur.reads[..cur.n_reads]);
        record.frames[frames_from..frames_end].copy_from_slice(&cur.frames[..cur.n_frames]);
        record.steps_from = steps_from;
        record.reads_from = reads_from;
        record.frames_from = frames_from;
        fill_chain(record, frames_from, frames_end);
    }

    /// Makes a walk that reused nothing the record: its steps, reads and frames move to the
    /// ends of the record's arrays (the first walk of a thread, or one that shares no frame
    /// with the previous walk).
    #[inline(never)]
    fn adopt(cur: &Scratch, record: &mut Record, table: usize) {
        record.table = table;
        record.reads_overflowed = cur.reads_overflowed;
        record.end = cur.end;
        place(cur, record, (MAX_STEPS, MAX_READS, MAX_STEPS));
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
