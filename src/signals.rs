//! The signals memsnap borrows from the program: the dump signal (`MEMSNAP_SIGNAL`) and,
//! unless `MEMSNAP_AT_CRASH=0`, the signals that end a job (SIGTERM, SIGABRT, SIGSEGV,
//! SIGBUS). memsnap's handler stays installed in the kernel for good; whatever the program
//! asks for afterwards through `sigaction`, `signal`, `bsd_signal`, `sysv_signal` or
//! `ssignal` is kept here as *the program's action* and carried out by chaining, with the
//! semantics it asked for (docs/SIGNALS.md has the rules and why).
//!
//! Cold: the interposed functions run when the program changes a disposition, the handler
//! once per signal. The handler is async-signal-safe: atomics, an eventfd write, clock
//! reads, `nanosleep`, `sigaction`/`pthread_sigmask`/`tgkill`; no allocation, no lock.
//!
//! The program's action of each borrowed signal lives in a [`Borrowed`] entry guarded by a
//! sequence lock: the handler may read it on any thread at any moment, and a writer blocks
//! all signals on its own thread while it writes, so a reader never waits on a writer it
//! interrupted.

use crate::capture;
use crate::channel::handshake::{CRASH, SIGNAL_DUMPS};
use crate::channel::queue::Recorder;
use crate::interpose::symbols::real_dlsym;
use std::ffi::{CStr, c_int, c_void};
use std::mem::{MaybeUninit, size_of};
use std::ptr::{null, null_mut};
use std::sync::atomic::{
    AtomicBool, AtomicI32, AtomicPtr, AtomicU8, AtomicU32, AtomicU64, AtomicUsize, Ordering::*,
    fence,
};
use std::time::Duration;

/// What memsnap does with a borrowed signal before the program's action.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
pub enum Role {
    /// Ask the writer for a snapshot (`signal` reason) and carry on at once.
    Dump = 1,
    /// The job is ending: write a `term` or `crash` snapshot, bounded by the crash wait.
    Crash = 2,
}

/// The signals that end a job, borrowed when `MEMSNAP_AT_CRASH` is on.
pub const CRASH_SIGNALS: [c_int; 4] = [libc::SIGTERM, libc::SIGABRT, libc::SIGSEGV, libc::SIGBUS];

/// The dump signal and the four crash signals.
const MAX_BORROWED: usize = 1 + CRASH_SIGNALS.len();
const MASK_WORDS: usize = size_of::<libc::sigset_t>() / 8;

/// One borrowed signal and the action the program asked for.
struct Borrowed {
    /// 0 while the entry is free. Set last, once the program's action is stored.
    signal: AtomicI32,
    role: AtomicU8,
    /// Sequence lock over the fields below: odd while a writer is inside.
    seq: AtomicU32,
    handler: AtomicUsize,
    flags: AtomicI32,
    restorer: AtomicUsize,
    mask: [AtomicU64; MASK_WORDS],
    /// The program set this action itself after memsnap borrowed the signal (as opposed
    /// to the action that was in place then). An explicit SIG_DFL asks for the default
    /// action; the initial SIG_DFL of the dump signal is memsnap's to use.
    explicit: AtomicBool,
}

impl Borrowed {
    const fn new() -> Borrowed {
        Borrowed {
            signal: AtomicI32::new(0),
            role: AtomicU8::new(0),
            seq: AtomicU32::new(0),
            handler: AtomicUsize::new(0),
            flags: AtomicI32::new(0),
            restorer: AtomicUsize::new(0),
            mask: [const { AtomicU64::new(0) }; MASK_WORDS],
            explicit: AtomicBool::new(false),
        }
    }

    fn role(&self) -> Role {
        if self.role.load(Acquire) == Role::Crash as u8 {
            Role::Crash
        } else {
            Role::Dump
        }
    }

    /// The program's current action (a consistent copy).
    fn program(&self) -> ProgramAction {
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
                explicit: self.explicit.load(Relaxed),
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
    fn set_program(&self, action: &ProgramAction) {
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
        self.explicit.store(action.explicit, Relaxed);
        self.seq.store(start + 2, Release);
    }
}

static BORROWED: [Borrowed; MAX_BORROWED] = [const { Borrowed::new() }; MAX_BORROWED];
/// Set once recording starts; the handler asks it for snapshots.
static RECORDER: AtomicPtr<Recorder> = AtomicPtr::new(null_mut());
/// How long a crash handler waits for its snapshot, in milliseconds.
static CRASH_WAIT_MS: AtomicU64 = AtomicU64::new(5_000);
/// Set by the first crash signal: a later one (a nested fault, another thread, a fault
/// inside the snapshot itself) never tries again, it goes straight on.
static CRASH_SEEN: AtomicBool = AtomicBool::new(false);

fn borrowed(sig: c_int) -> Option<&'static Borrowed> {
    if sig <= 0 {
        return None;
    }
    BORROWED.iter().find(|b| b.signal.load(Acquire) == sig)
}

/// A `struct sigaction` as the program gave it, in a form atomics can hold.
#[derive(Clone, Copy)]
struct ProgramAction {
    handler: usize,
    flags: c_int,
    restorer: usize,
    mask: [u64; MASK_WORDS],
    explicit: bool,
}

impl ProgramAction {
    fn from_sigaction(sa: &libc::sigaction, explicit: bool) -> ProgramAction {
        ProgramAction {
            handler: sa.sa_sigaction,
            flags: sa.sa_flags,
            restorer: sa.sa_restorer.map_or(0, |f| f as usize),
            mask: mask_words(&sa.sa_mask),
            explicit,
        }
    }

    /// `signal()`-style: a handler with the given flags, masking `mask_self`'s signal.
    fn simple(handler: usize, flags: c_int, mask_signal: Option<c_int>) -> ProgramAction {
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
            explicit: true,
        }
    }

    fn to_sigaction(self) -> libc::sigaction {
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
    fn is_function(&self) -> bool {
        !matches!(self.handler, libc::SIG_DFL | libc::SIG_IGN | libc::SIG_ERR)
    }
}

fn zeroed_sigaction() -> libc::sigaction {
    // SAFETY: all-zero is a valid `struct sigaction` (SIG_DFL, no flags, empty mask).
    unsafe { MaybeUninit::zeroed().assume_init() }
}

fn empty_set() -> libc::sigset_t {
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

fn set_from_words(words: &[u64; MASK_WORDS]) -> libc::sigset_t {
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
type FnSignal = unsafe extern "C" fn(c_int, libc::sighandler_t) -> libc::sighandler_t;

static REAL_SIGACTION: AtomicUsize = AtomicUsize::new(0);

fn real_fn(cache: &AtomicUsize, name: &CStr) -> usize {
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
unsafe fn real_sigaction(
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

/// Puts memsnap's handler in the kernel for `b`, with the program's mask and the flags a
/// chained call cannot emulate (restart, alternate stack, no-defer).
fn install(b: &Borrowed) -> bool {
    let sig = b.signal.load(Acquire);
    let program = b.program();
    let mut act = zeroed_sigaction();
    let handler: extern "C" fn(c_int, *mut libc::siginfo_t, *mut c_void) = on_borrowed_signal;
    act.sa_sigaction = handler as usize;
    let crash_stack = if b.role() == Role::Crash {
        libc::SA_ONSTACK
    } else {
        0
    };
    if program.is_function() {
        act.sa_flags = libc::SA_SIGINFO
            | crash_stack
            | (program.flags & (libc::SA_RESTART | libc::SA_ONSTACK | libc::SA_NODEFER));
        act.sa_mask = set_from_words(&program.mask);
    } else {
        act.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART | libc::SA_ONSTACK;
        act.sa_mask = empty_set();
    }
    // SAFETY: a valid action; no old action wanted.
    unsafe { real_sigaction(sig, &act, null_mut()) == 0 }
}

// ---------------------------------------------------------------------------------------
// Taking signals over (cold, once, when recording starts).

/// Takes `sig` over: the action in place now becomes the program's action, memsnap's
/// handler goes in. Returns false (and changes nothing) when the signal cannot be had.
pub fn borrow(sig: c_int, role: Role, rec: &'static Recorder) -> bool {
    RECORDER.store(rec as *const Recorder as *mut Recorder, Release);
    if borrowed(sig).is_some() {
        return true;
    }
    let mut current = zeroed_sigaction();
    // SAFETY: querying only; valid out-pointer.
    if unsafe { real_sigaction(sig, null(), &mut current) } != 0 {
        return false;
    }
    let Some(entry) = BORROWED
        .iter()
        .find(|b| b.signal.compare_exchange(0, -1, AcqRel, Acquire).is_ok())
    else {
        return false;
    };
    entry.role.store(role as u8, Release);
    entry.set_program(&ProgramAction::from_sigaction(&current, false));
    entry.signal.store(sig, Release);
    if !install(entry) {
        entry.signal.store(0, Release);
        return false;
    }
    true
}

/// `MEMSNAP_CRASH_WAIT`.
pub fn set_crash_wait(wait: Duration) {
    CRASH_WAIT_MS.store(wait.as_millis().min(u64::MAX as u128) as u64, Relaxed);
}

// ---------------------------------------------------------------------------------------
// The interposed functions. Signals memsnap has not borrowed go straight to glibc.

/// `sigaction(2)`: for a borrowed signal, records the program's new action (and reports
/// its previous one) without touching memsnap's handler.
///
/// # Safety
/// As `sigaction(2)`.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn sigaction(
    sig: c_int,
    act: *const libc::sigaction,
    old: *mut libc::sigaction,
) -> c_int {
    let Some(b) = borrowed(sig) else {
        // SAFETY: the caller's arguments, forwarded.
        return unsafe { real_sigaction(sig, act, old) };
    };
    // Read the new action before writing the old one: the two may be the same struct.
    // SAFETY: the caller passes a valid action or null.
    let new = unsafe { act.as_ref() }.map(|a| ProgramAction::from_sigaction(a, true));
    let previous = b.program();
    if let Some(new) = new {
        b.set_program(&new);
        install(b);
    }
    if !old.is_null() {
        // SAFETY: the caller passes a valid out-pointer or null.
        unsafe { *old = previous.to_sigaction() };
    }
    0
}

/// The `signal()` family on a borrowed signal: `flags` and `mask_self` are what glibc's
/// own function would have used. Returns the previous handler, like them.
fn set_simple(
    sig: c_int,
    handler: libc::sighandler_t,
    flags: c_int,
    mask_self: bool,
) -> libc::sighandler_t {
    let Some(b) = borrowed(sig) else {
        return libc::SIG_ERR;
    };
    if handler == libc::SIG_ERR {
        // SAFETY: errno is thread-local.
        unsafe { *libc::__errno_location() = libc::EINVAL };
        return libc::SIG_ERR;
    }
    let previous = b.program();
    b.set_program(&ProgramAction::simple(
        handler,
        flags,
        mask_self.then_some(sig),
    ));
    install(b);
    previous.handler
}

macro_rules! signal_family {
    ($($(#[$doc:meta])* $name:ident = $cname:literal, flags: $flags:expr, mask_self: $mask:expr;)*) => {$(
        $(#[$doc])*
        /// # Safety
        /// As the glibc function of the same name.
        #[cfg_attr(not(test), unsafe(no_mangle))]
        pub unsafe extern "C" fn $name(sig: c_int, handler: libc::sighandler_t) -> libc::sighandler_t {
            if borrowed(sig).is_some() {
                return set_simple(sig, handler, $flags, $mask);
            }
            static REAL: AtomicUsize = AtomicUsize::new(0);
            let p = real_fn(&REAL, $cname);
            if p == 0 {
                // SAFETY: errno is thread-local.
                unsafe { *libc::__errno_location() = libc::ENOSYS };
                return libc::SIG_ERR;
            }
            // SAFETY: glibc's function of this name, with the caller's arguments.
            unsafe { std::mem::transmute::<usize, FnSignal>(p)(sig, handler) }
        }
    )*};
}

signal_family! {
    /// `signal()`: BSD semantics, as glibc's (restart, the signal masked while it runs).
    signal = c"signal", flags: libc::SA_RESTART, mask_self: true;
    /// `bsd_signal()`: the same as glibc's `signal()`.
    bsd_signal = c"bsd_signal", flags: libc::SA_RESTART, mask_self: true;
    /// `ssignal()`: glibc's other name for `signal()`.
    ssignal = c"ssignal", flags: libc::SA_RESTART, mask_self: true;
    /// `sysv_signal()`: one-shot, not masked while it runs.
    sysv_signal = c"sysv_signal", flags: libc::SA_RESETHAND | libc::SA_NODEFER, mask_self: false;
    /// `__sysv_signal()`: what `signal()` becomes under `_XOPEN_SOURCE` in old headers.
    __sysv_signal = c"__sysv_signal", flags: libc::SA_RESETHAND | libc::SA_NODEFER, mask_self: false;
}

// ---------------------------------------------------------------------------------------
// The handler.

extern "C" fn on_borrowed_signal(sig: c_int, info: *mut libc::siginfo_t, ctx: *mut c_void) {
    // SAFETY: errno is thread-local; saved and restored so the interrupted code sees no
    // change.
    let saved_errno = unsafe { *libc::__errno_location() };
    if let Some(b) = borrowed(sig) {
        handle(b, sig, info, ctx);
    }
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = saved_errno };
}

fn handle(b: &Borrowed, sig: c_int, info: *mut libc::siginfo_t, ctx: *mut c_void) {
    let program = b.program();
    if program.is_function() && program.flags & libc::SA_RESETHAND != 0 {
        // One-shot: the kernel would have reset it to the default before the call.
        b.set_program(&ProgramAction::simple(libc::SIG_DFL, 0, None));
        install(b);
    }
    let role = b.role();
    match role {
        Role::Dump => ask_for_signal_dump(),
        // SIGTERM and SIGABRT always end the job (abort() kills after its handler
        // returns): snapshot first, as the program's handler may not return. A fault
        // handler may repair and return (runtimes use SIGSEGV that way), so a fault gets
        // its snapshot only when its default action is reached below.
        Role::Crash if !is_fault(sig) => crash_snapshot(sig, info, ctx),
        Role::Crash => {}
    }
    match program.handler {
        libc::SIG_IGN => {}
        libc::SIG_DFL => {
            if role == Role::Crash {
                crash_snapshot(sig, info, ctx);
                default_action(b, sig, info);
            } else if program.explicit {
                // The program asked for the default action (terminate): let the snapshot
                // it asked for land first, then do what the kernel would have done.
                wait_for_signal_dump();
                default_action(b, sig, info);
            }
        }
        handler if program.flags & libc::SA_SIGINFO != 0 => {
            // SAFETY: installed with SA_SIGINFO, so it takes (int, siginfo_t *, void *);
            // called with the kernel's own arguments.
            let f: extern "C" fn(c_int, *mut libc::siginfo_t, *mut c_void) =
                unsafe { std::mem::transmute(handler) };
            f(sig, info, ctx);
        }
        handler => {
            // SAFETY: a plain `void (*)(int)` handler.
            let f: extern "C" fn(c_int) = unsafe { std::mem::transmute(handler) };
            f(sig);
        }
    }
}

fn recorder() -> Option<&'static Recorder> {
    // SAFETY: null or a leaked, never-freed Recorder.
    unsafe { RECORDER.load(Acquire).as_ref() }
}

/// Async-signal-safe: a ticket and an eventfd write. Many signals before the writer looks
/// become one snapshot; one that arrives while a snapshot is being written gets another.
fn ask_for_signal_dump() {
    if let Some(rec) = recorder()
        && rec.writer_alive.load(Acquire)
    {
        SIGNAL_DUMPS.ask();
        rec.wake_writer();
    }
}

fn wait_for_signal_dump() {
    if let Some(rec) = recorder() {
        let ticket = SIGNAL_DUMPS.asked();
        rec.wait_for(|| SIGNAL_DUMPS.is_done(ticket), crash_wait());
    }
}

fn crash_wait() -> Duration {
    Duration::from_millis(CRASH_WAIT_MS.load(Relaxed))
}

/// A signal the kernel raises for the faulting instruction itself.
fn is_fault(sig: c_int) -> bool {
    matches!(
        sig,
        libc::SIGSEGV | libc::SIGBUS | libc::SIGFPE | libc::SIGILL
    )
}

/// The first crash signal asks for a snapshot with the signal and, for a synchronous
/// signal (a fault, `abort`), the signalled thread's stack, and waits for it, bounded by
/// `MEMSNAP_CRASH_WAIT`. SIGTERM is sent to the process and lands on whichever thread the
/// kernel picks, so its stack would say nothing: it has none.
fn crash_snapshot(sig: c_int, info: *mut libc::siginfo_t, ctx: *mut c_void) {
    if CRASH_SEEN.swap(true, AcqRel) {
        return;
    }
    let Some(rec) = recorder() else { return };
    if !rec.writer_alive.load(Acquire) {
        return;
    }
    // SAFETY: the kernel passes a valid siginfo_t to an SA_SIGINFO handler (or null).
    let (code, sender) = match unsafe { info.as_ref() } {
        // SAFETY: si_pid is meaningful for signals sent by a process (code <= 0).
        Some(i) if i.si_code <= 0 => (i.si_code, unsafe { i.si_pid() }),
        Some(i) => (i.si_code, 0),
        None => (0, 0),
    };
    let synchronous = sig != libc::SIGTERM;
    let mut with_stack = false;
    if synchronous
        && rec.settings.stacks != crate::config::Stacks::None
        && !crate::guard::inside_hook_or_internal()
        && let Some(regs) = interrupted_registers(ctx)
    {
        // SAFETY: CRASH_SEEN lets exactly one handler get here.
        let slot = unsafe { rec.crash_slot_to_fill() };
        capture::capture_interrupted(slot, rec.settings.stacks, rec.settings.max_frames, regs);
        with_stack = true;
    }
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::gettid() } as u32;
    let ticket = CRASH.ask(sig, code, sender, tid, with_stack);
    rec.wake_writer();
    rec.wait_for(|| CRASH.dumps.is_done(ticket), crash_wait());
}

/// The instruction, stack and frame pointers of the interrupted code, from the kernel's
/// saved context.
#[cfg(target_arch = "x86_64")]
fn interrupted_registers(ctx: *mut c_void) -> Option<capture::native::StartRegs> {
    // SAFETY: an SA_SIGINFO handler's third argument is the interrupted ucontext_t.
    let uc = unsafe { (ctx as *const libc::ucontext_t).as_ref() }?;
    let g = &uc.uc_mcontext.gregs;
    let reg = |r: c_int| g.get(r as usize).map(|&v| v as u64);
    Some(capture::native::StartRegs {
        ip: reg(libc::REG_RIP)?,
        sp: reg(libc::REG_RSP)?,
        bp: reg(libc::REG_RBP)?,
    })
}

#[cfg(not(target_arch = "x86_64"))]
fn interrupted_registers(_ctx: *mut c_void) -> Option<capture::native::StartRegs> {
    None
}

/// Does what the kernel's default action for `sig` would have done (terminate, with a
/// core where it dumps one), so the exit status is the one the program would have had.
fn default_action(b: &Borrowed, sig: c_int, info: *mut libc::siginfo_t) {
    let mut dfl = zeroed_sigaction();
    dfl.sa_sigaction = libc::SIG_DFL;
    // SAFETY: a valid default action.
    unsafe { real_sigaction(sig, &dfl, null_mut()) };
    // SAFETY: as in `crash_snapshot`.
    let kernel_fault = unsafe { info.as_ref() }.is_some_and(|i| i.si_code > 0) && is_fault(sig);
    if kernel_fault {
        // Returning re-executes the faulting instruction, which faults again, now with the
        // default action: the core shows the real fault.
        return;
    }
    // SAFETY: sending a signal to this very thread, then letting it through.
    unsafe {
        libc::syscall(libc::SYS_tgkill, libc::getpid(), libc::gettid(), sig);
        let mut set = empty_set();
        libc::sigaddset(&mut set, sig);
        libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, null_mut());
    }
    // Only reached if the default action does not end the process: keep memsnap's handler.
    install(b);
}

/// Counts for the exit line and the snapshot metadata.
pub fn signal_dumps_asked() -> u64 {
    SIGNAL_DUMPS.asked()
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
        b.set_program(&ProgramAction::from_sigaction(&sa, true));
        let back = b.program().to_sigaction();
        assert_eq!(back.sa_sigaction, 0x1234);
        assert_eq!(back.sa_flags, libc::SA_SIGINFO | libc::SA_NODEFER);
        // SAFETY: valid set.
        assert_eq!(unsafe { libc::sigismember(&back.sa_mask, libc::SIGINT) }, 1);
        // SAFETY: valid set.
        assert_eq!(
            unsafe { libc::sigismember(&back.sa_mask, libc::SIGTERM) },
            0
        );
        assert!(b.program().explicit);
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
