//! The borrowed-signal table: each signal memsnap took over, with the action the program
//! asked for since (or had in place before), and glibc's own `sigaction`.
//!
//! Cold to write (the program changes a disposition), read by the handler on any thread at
//! any moment: each entry is guarded by a sequence lock, and a writer blocks all signals on
//! its own thread while it writes, so a reader never waits on a writer it interrupted.
//! Async-signal-safe to read: atomics only.

use crate::process::dlsym::real_dlsym;
use std::ffi::{CStr, c_int};
use std::mem::{MaybeUninit, size_of};
use std::ptr::null_mut;
use std::sync::atomic::{
    AtomicI32, AtomicU8, AtomicU32, AtomicU64, AtomicUsize, Ordering::*, fence,
};

/// What memsnap does with a borrowed signal before the program's action.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
pub enum Role {
    /// Ask the writer for a snapshot (`signal` reason) and carry on at once.
    Dump = 1,
    /// The job is ending: write a `term` or `crash` snapshot, bounded by the crash wait.
    Crash = 2,
}

/// The signals that end a job, borrowed when `MEMSNAP_AT_CRASH` is on: those a scheduler
/// or a crash sends (SIGTERM, SIGABRT, SIGSEGV, SIGBUS) and those a person sends from a
/// terminal (SIGINT: Ctrl-C; SIGHUP: the terminal closed; SIGQUIT: Ctrl-\).
pub const CRASH_SIGNALS: [c_int; 7] = [
    libc::SIGTERM,
    libc::SIGABRT,
    libc::SIGSEGV,
    libc::SIGBUS,
    libc::SIGINT,
    libc::SIGHUP,
    libc::SIGQUIT,
];

/// The dump signal and the crash signals.
const MAX_BORROWED: usize = 1 + CRASH_SIGNALS.len();
const MASK_WORDS: usize = size_of::<libc::sigset_t>() / 8;

/// One borrowed signal and the action the program asked for.
pub struct Borrowed {
    /// 0 while the entry is free. Set last, once the program's action is stored.
    pub(super) signal: AtomicI32,
    role: AtomicU8,
    /// Sequence lock over the fields below: odd while a writer is inside.
    seq: AtomicU32,
    handler: AtomicUsize,
    flags: AtomicI32,
    restorer: AtomicUsize,
    mask: [AtomicU64; MASK_WORDS],
}

impl Borrowed {
    pub(super) const fn new() -> Borrowed {
        Borrowed {
            signal: AtomicI32::new(0),
            role: AtomicU8::new(0),
            seq: AtomicU32::new(0),
            handler: AtomicUsize::new(0),
            flags: AtomicI32::new(0),
            restorer: AtomicUsize::new(0),
            mask: [const { AtomicU64::new(0) }; MASK_WORDS],
        }
    }

    pub(super) fn role(&self) -> Role {
        if self.role.load(Acquire) == Role::Crash as u8 {
            Role::Crash
        } else {
            Role::Dump
        }
    }

    /// The program's current action (a consistent copy).
    pub(super) fn program(&self) -> ProgramAction {
        let mut tries = 0u32;
        loop {
            let before = self.seq.load(Acquire);
            let mut mask = [0u64; MASK_WORDS];
            for (m, a) in mask.iter_mut().zip(&self.mask) {
                *m = a.load(Relaxed);
            }
            let action = ProgramAction {
                handler: self.handler.load(Relaxed),
                flags: self.flags.load(Relaxed),
                restorer: self.restorer.load(Relaxed),
                mask,
            };
            fence(Acquire);
            // A writer on another thread finishes in microseconds; after a million tries
            // (one that never finishes: a thread killed mid-write) take what is there.
            tries += 1;
            if (before & 1 == 0 && self.seq.load(Relaxed) == before) || tries > 1_000_000 {
                return action;
            }
            std::hint::spin_loop();
        }
    }

    /// Replaces the program's action. Signals are blocked on this thread meanwhile, so
    /// the handler never reads a half-written action on the thread that writes it.
    pub(super) fn set_program(&self, action: &ProgramAction) {
        let _blocked = AllSignalsBlocked::new();
        let mut spins = 0u32;
        let start = loop {
            let s = self.seq.load(Relaxed);
            if s & 1 == 0
                && self
                    .seq
                    .compare_exchange(s, s + 1, Acquire, Relaxed)
                    .is_ok()
            {
                break s;
            }
            spins += 1;
            if spins.is_multiple_of(1024) {
                std::thread::yield_now();
            }
        };
        fence(Release);
        self.handler.store(action.handler, Relaxed);
        self.flags.store(action.flags, Relaxed);
        self.restorer.store(action.restorer, Relaxed);
        for (a, m) in self.mask.iter().zip(action.mask) {
            a.store(m, Relaxed);
        }
        self.seq.store(start + 2, Release);
    }
}

static BORROWED: [Borrowed; MAX_BORROWED] = [const { Borrowed::new() }; MAX_BORROWED];

/// Takes a free entry for `sig`, with `program` (the action in place now) as the program's
/// action; the entry is visible to the handler once this returns. `None` when all are taken.
pub(super) fn claim(sig: c_int, role: Role, program: &ProgramAction) -> Option<&'static Borrowed> {
    let entry = BORROWED
        .iter()
        .find(|b| b.signal.compare_exchange(0, -1, AcqRel, Acquire).is_ok())?;
    entry.role.store(role as u8, Release);
    entry.set_program(program);
    entry.signal.store(sig, Release);
    Some(entry)
}

/// The entry of a borrowed signal (`None`: memsnap never took `sig` over).
pub(super) fn borrowed(sig: c_int) -> Option<&'static Borrowed> {
    if sig <= 0 {
        return None;
    }
    BORROWED.iter().find(|b| b.signal.load(Acquire) == sig)
}

/// Every borrowed signal's entry.
pub(super) fn all_borrowed() -> impl Iterator<Item = &'static Borrowed> {
    BORROWED.iter().filter(|b| b.signal.load(Acquire) > 0)
}

/// A `struct sigaction` as the program gave it, in a form atomics can hold.
#[derive(Clone, Copy)]
pub(super) struct ProgramAction {
    pub(super) handler: usize,
    pub(super) flags: c_int,
    restorer: usize,
    pub(super) mask: [u64; MASK_WORDS],
}

impl ProgramAction {
    pub(super) fn from_sigaction(sa: &libc::sigaction) -> ProgramAction {
        ProgramAction {
            handler: sa.sa_sigaction,
            flags: sa.sa_flags,
            restorer: sa.sa_restorer.map_or(0, |f| f as usize),
            mask: mask_words(&sa.sa_mask),
        }
    }

    /// `signal()`-style: a handler with the given flags, masking `mask_self`'s signal.
    pub(super) fn simple(
        handler: usize,
        flags: c_int,
        mask_signal: Option<c_int>,
    ) -> ProgramAction {
        let mut set = empty_set();
        if let Some(sig) = mask_signal {
            // SAFETY: valid set; an out-of-range signal only makes sigaddset fail.
            unsafe { libc::sigaddset(&mut set, sig) };
        }
        ProgramAction {
            handler,
            flags,
            restorer: 0,
            mask: mask_words(&set),
        }
    }

    pub(super) fn to_sigaction(self) -> libc::sigaction {
        let mut sa = zeroed_sigaction();
        sa.sa_sigaction = self.handler;
        sa.sa_flags = self.flags;
        sa.sa_restorer = if self.restorer == 0 {
            None
        } else {
            // SAFETY: the value came from a `sa_restorer` of the same type.
            Some(unsafe { std::mem::transmute::<usize, extern "C" fn()>(self.restorer) })
        };
        sa.sa_mask = set_from_words(&self.mask);
        sa
    }

    /// A function to call (not SIG_DFL, SIG_IGN or SIG_ERR).
    pub(super) fn is_function(&self) -> bool {
        !matches!(self.handler, libc::SIG_DFL | libc::SIG_IGN | libc::SIG_ERR)
    }
}

pub(super) fn zeroed_sigaction() -> libc::sigaction {
    // SAFETY: all-zero is a valid `struct sigaction` (SIG_DFL, no flags, empty mask).
    unsafe { MaybeUninit::zeroed().assume_init() }
}

pub(super) fn empty_set() -> libc::sigset_t {
    // SAFETY: all-zero is a valid sigset_t; sigemptyset makes it empty by definition.
    unsafe {
        let mut set: libc::sigset_t = MaybeUninit::zeroed().assume_init();
        libc::sigemptyset(&mut set);
        set
    }
}

fn mask_words(set: &libc::sigset_t) -> [u64; MASK_WORDS] {
    // SAFETY: sigset_t is plain data of exactly MASK_WORDS * 8 bytes.
    unsafe { std::ptr::read_unaligned((set as *const libc::sigset_t).cast()) }
}

pub(super) fn set_from_words(words: &[u64; MASK_WORDS]) -> libc::sigset_t {
    // SAFETY: as in `mask_words`, the other way round.
    unsafe { std::ptr::read_unaligned((words as *const [u64; MASK_WORDS]).cast()) }
}

/// Blocks every signal on this thread until dropped.
struct AllSignalsBlocked {
    previous: libc::sigset_t,
}

impl AllSignalsBlocked {
    fn new() -> AllSignalsBlocked {
        let mut all = empty_set();
        let mut previous = empty_set();
        // SAFETY: valid sets; pthread_sigmask only affects this thread.
        unsafe {
            libc::sigfillset(&mut all);
            libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut previous);
        }
        AllSignalsBlocked { previous }
    }
}

impl Drop for AllSignalsBlocked {
    fn drop(&mut self) {
        // SAFETY: restores the mask saved in `new`.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &self.previous, null_mut()) };
    }
}

// ---------------------------------------------------------------------------------------
// glibc's own functions. Our exported names shadow them for the whole process, memsnap's
// own calls included, so memsnap reaches them through RTLD_NEXT.

type FnSigaction =
    unsafe extern "C" fn(c_int, *const libc::sigaction, *mut libc::sigaction) -> c_int;
pub(super) type FnSignal = unsafe extern "C" fn(c_int, libc::sighandler_t) -> libc::sighandler_t;

static REAL_SIGACTION: AtomicUsize = AtomicUsize::new(0);

pub(super) fn real_fn(cache: &AtomicUsize, name: &CStr) -> usize {
    let mut p = cache.load(Acquire);
    if p == 0 {
        // SAFETY: RTLD_NEXT with a NUL-terminated name.
        p = unsafe { real_dlsym(libc::RTLD_NEXT, name) } as usize;
        cache.store(p, Release);
    }
    p
}

/// glibc's `sigaction`. Fails with -1 (EINVAL-like) only if glibc has none, which cannot
/// happen in a process that has libc.
///
/// # Safety
/// As `sigaction(2)`: `act` and `old` are null or valid.
pub(super) unsafe fn real_sigaction(
    sig: c_int,
    act: *const libc::sigaction,
    old: *mut libc::sigaction,
) -> c_int {
    let p = real_fn(&REAL_SIGACTION, c"sigaction");
    if p == 0 {
        return -1;
    }
    // SAFETY: `p` is glibc's sigaction; the caller's pointers are forwarded.
    unsafe { std::mem::transmute::<usize, FnSigaction>(p)(sig, act, old) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_program_action_survives_the_round_trip() {
        let mut sa = zeroed_sigaction();
        sa.sa_sigaction = 0x1234;
        sa.sa_flags = libc::SA_SIGINFO | libc::SA_NODEFER;
        // SAFETY: valid set.
        unsafe { libc::sigaddset(&mut sa.sa_mask, libc::SIGINT) };
        let b = Borrowed::new();
        b.set_program(&ProgramAction::from_sigaction(&sa));
        let back = b.program().to_sigaction();
        assert_eq!(back.sa_sigaction, 0x1234);
        assert_eq!(back.sa_flags, libc::SA_SIGINFO | libc::SA_NODEFER);
        // SAFETY: valid set.
        assert_eq!(unsafe { libc::sigismember(&back.sa_mask, libc::SIGINT) }, 1);
        assert_eq!(
            // SAFETY: valid set.
            unsafe { libc::sigismember(&back.sa_mask, libc::SIGTERM) },
            0
        );
    }

    #[test]
    fn signal_style_actions_mask_their_own_signal_when_asked() {
        let a = ProgramAction::simple(0x10, libc::SA_RESTART, Some(libc::SIGUSR2));
        let sa = a.to_sigaction();
        // SAFETY: valid set.
        assert_eq!(unsafe { libc::sigismember(&sa.sa_mask, libc::SIGUSR2) }, 1);
        assert!(a.is_function());
        assert!(!ProgramAction::simple(libc::SIG_IGN, 0, None).is_function());
    }
}
