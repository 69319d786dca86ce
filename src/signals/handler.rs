//! The handler memsnap keeps in the kernel for every borrowed signal: the dump signal asks
//! the writer for a snapshot and never ends the program; a signal that ends the job (the
//! crash handler) writes a `term` or `crash` snapshot, bounded by `MEMSNAP_CRASH_WAIT`, with
//! the signalled thread's stack for a fault; then the program's own action is carried out
//! with the semantics it asked for.
//!
//! Cold: once per signal. Async-signal-safe: atomics, a futex wake-up, clock reads,
//! `nanosleep`, `sigaction`/`pthread_sigmask`/`tgkill`, `unlink`; no allocation, no lock.
//!
//! One crash snapshot per process, and while it is being written every further signal that
//! ends the job (another thread faulting, a second SIGTERM) is held in its handler until
//! the snapshot is on disk or the wait expired: the first signal then ends the process,
//! with the status it would have had without memsnap.

use super::table::{
    Borrowed, ProgramAction, Role, borrowed, empty_set, real_sigaction, set_from_words,
    zeroed_sigaction,
};
use crate::capture;
use crate::channel::handshake::{CRASH, SIGNAL_DUMPS};
use crate::channel::queue::Recorder;
use crate::channel::recording;
use std::ffi::{c_int, c_void};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU8, AtomicU64, Ordering::*};
use std::time::Duration;

/// How long a crash handler waits for its snapshot, in milliseconds.
static CRASH_WAIT_MS: AtomicU64 = AtomicU64::new(5_000);
/// Where the process's one crash snapshot stands: [`NO_CRASH`] until the first crash
/// signal, then [`CAPTURING`] (its handler takes the stack), [`WRITING`] (the writer has
/// the request), [`ENDED`] (on disk, or given up on). A later crash signal never asks again:
/// it waits for [`ENDED`] (see [`hold_while_the_first_ends_the_job`]).
static CRASH_PHASE: AtomicU8 = AtomicU8::new(NO_CRASH);
const NO_CRASH: u8 = 0;
const CAPTURING: u8 = 1;
const WRITING: u8 = 2;
const ENDED: u8 = 3;
/// The thread whose signal asked for the crash snapshot: a signal nested on that same
/// thread while it captures (a fault inside the capture) must not wait for itself.
static CRASH_TID: AtomicI32 = AtomicI32::new(0);
/// Set once the first crash signal's handler returned from the program's action (the
/// program handled it and lives on): a held signal then goes on with its own action.
static FIRST_RETURNED: AtomicBool = AtomicBool::new(false);
/// How long a held signal waits, once the snapshot ended, for the first signal to end the
/// process before it carries out its own action.
const FIRST_ENDS_WITHIN: Duration = Duration::from_millis(200);

/// In a forked child: the parent's crash snapshot (if one was under way) is not the
/// child's; a crash signal in the child starts afresh. Async-signal-safe (atomic stores).
pub fn forget_in_forked_child() {
    CRASH_PHASE.store(NO_CRASH, Relaxed);
    CRASH_TID.store(0, Relaxed);
    FIRST_RETURNED.store(false, Relaxed);
}

/// Puts memsnap's handler in the kernel for `b`, with the program's mask and the flags a
/// chained call cannot emulate (restart, alternate stack, no-defer).
pub(super) fn install(b: &Borrowed) -> bool {
    let sig = b.signal.load(Acquire);
    let program = b.program();
    let mut act = zeroed_sigaction();
    if b.role() == Role::Crash && program.handler == libc::SIG_IGN {
        // The program ignores a signal that would end it (`nohup` ignores SIGHUP): memsnap
        // would do nothing with it either, so the kernel ignores it, as without memsnap. A
        // handler in its place would interrupt the program's sleeps and waits (EINTR) for
        // a signal it asked never to see.
        act.sa_sigaction = libc::SIG_IGN;
        // SAFETY: a valid action; no old action wanted.
        return unsafe { real_sigaction(sig, &act, null_mut()) == 0 };
    }
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

/// `MEMSNAP_CRASH_WAIT`.
pub fn set_crash_wait(wait: Duration) {
    CRASH_WAIT_MS.store(wait.as_millis().min(u64::MAX as u128) as u64, Relaxed);
}

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
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::gettid() };
    match role {
        Role::Dump => ask_for_signal_dump(),
        Role::Crash if snapshot_before_the_program(sig) => crash_snapshot(sig, info, ctx),
        Role::Crash => {}
    }
    match program.handler {
        libc::SIG_IGN => {}
        libc::SIG_DFL => {
            if role == Role::Crash {
                crash_snapshot(sig, info, ctx);
                default_action(b, sig, info);
            }
            // The dump signal never ends the program: SIG_DFL there means "no handler of
            // the program's own", whoever set it. Libraries restore the action they were
            // told was there before them (LLVM's signal handlers, which Triton's compiler
            // installs and later removes, put back SIG_DFL), and the dump signal was
            // memsnap's alone when it was borrowed with SIG_DFL in place.
        }
        handler if program.flags & libc::SA_SIGINFO != 0 => {
            let f: extern "C" fn(c_int, *mut libc::siginfo_t, *mut c_void) =
                // SAFETY: installed with SA_SIGINFO, so it takes (int, siginfo_t *, void *);
                // called with the kernel's own arguments.
                unsafe { std::mem::transmute(handler) };
            f(sig, info, ctx);
        }
        handler => {
            // SAFETY: a plain `void (*)(int)` handler.
            let f: extern "C" fn(c_int) = unsafe { std::mem::transmute(handler) };
            f(sig);
        }
    }
    if role == Role::Crash && CRASH_TID.load(Acquire) == tid {
        // The program's action returned: the job goes on, signals held behind this one
        // carry out their own actions.
        FIRST_RETURNED.store(true, Release);
    }
}

/// The recorder the handler asks for snapshots: set before any signal is borrowed.
fn recorder() -> Option<&'static Recorder> {
    recording::recorder_if_started()
}

/// Async-signal-safe: a ticket and a futex wake-up. Many signals before the writer looks
/// become one snapshot; one that arrives while a snapshot is being written gets another.
fn ask_for_signal_dump() {
    if let Some(rec) = recorder()
        && rec.writer_alive.load(Acquire)
    {
        SIGNAL_DUMPS.ask();
        rec.wake_writer();
    }
}

fn crash_wait() -> Duration {
    Duration::from_millis(CRASH_WAIT_MS.load(Relaxed))
}

/// Whether a signal that ends the job gets its snapshot before the program's handler
/// runs. SIGTERM and SIGABRT always end the job (`abort()` kills after its handler
/// returns), and the program's handler may never return, so the snapshot comes first. The
/// others may be handled for good: a fault repaired by a runtime that uses SIGSEGV, Ctrl-C
/// turned into Python's `KeyboardInterrupt` and caught, SIGHUP that reloads a
/// configuration. They get their snapshot only when their default action is reached:
/// directly, or after the program's handler restored it and raised the signal again (as
/// `faulthandler` does, and as Python does when a `KeyboardInterrupt` ends it).
fn snapshot_before_the_program(sig: c_int) -> bool {
    matches!(sig, libc::SIGTERM | libc::SIGABRT)
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
/// kernel picks, so its stack would say nothing: it has none. A later one is held (see
/// [`hold_while_the_first_ends_the_job`]).
fn crash_snapshot(sig: c_int, info: *mut libc::siginfo_t, ctx: *mut c_void) {
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::gettid() };
    if CRASH_PHASE
        .compare_exchange(NO_CRASH, CAPTURING, AcqRel, Acquire)
        .is_err()
    {
        hold_while_the_first_ends_the_job(tid);
        return;
    }
    CRASH_TID.store(tid, Release);
    write_crash_snapshot(sig, info, ctx, tid);
    CRASH_PHASE.store(ENDED, Release);
}

fn write_crash_snapshot(sig: c_int, info: *mut libc::siginfo_t, ctx: *mut c_void, tid: i32) {
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
    // A signal sent to the process (SIGTERM, Ctrl-C's SIGINT, SIGHUP, SIGQUIT) lands on
    // whichever thread the kernel picks: that thread's stack says nothing about the job.
    let synchronous = matches!(sig, libc::SIGABRT | libc::SIGSEGV | libc::SIGBUS);
    let mut with_stack = false;
    if synchronous
        && rec.settings.stacks != crate::config::Stacks::None
        && !crate::guard::inside_hook_or_internal()
        && let Some(regs) = interrupted_registers(ctx)
    {
        // SAFETY: CRASH_PHASE lets exactly one handler get here.
        let slot = unsafe { rec.crash_slot_to_fill() };
        capture::capture_interrupted(slot, rec.settings.stacks, rec.settings.max_frames, regs);
        with_stack = true;
    }
    let ticket = CRASH.ask(sig, code, sender, tid as u32, with_stack);
    CRASH_PHASE.store(WRITING, Release);
    rec.wake_writer();
    rec.wait_for(|| CRASH.dumps.is_done(ticket), crash_wait());
}

/// A crash signal while the first one's snapshot is being written (two threads faulting
/// within milliseconds, SIGTERM twice): carrying out its action now would end the process
/// before the snapshot is on disk. It waits until the snapshot ended (or the crash wait
/// expired), then a moment for the first signal to end the process with its own status;
/// only if the first one's handler returned (the program lives on) does it go on with its
/// own action. A signal nested on the first one's own thread cannot let the first go on
/// before it returns: it waits for the snapshot only, and not at all while that thread
/// still captures its stack (a fault inside the capture would wait for itself).
fn hold_while_the_first_ends_the_job(tid: i32) {
    let same_thread = CRASH_TID.load(Acquire) == tid;
    if same_thread && CRASH_PHASE.load(Acquire) == CAPTURING {
        return;
    }
    let start = std::time::Instant::now();
    let limit = crash_wait() + Duration::from_millis(100);
    while CRASH_PHASE.load(Acquire) != ENDED && start.elapsed() < limit {
        std::thread::sleep(Duration::from_millis(1));
    }
    if same_thread {
        return;
    }
    let ended = std::time::Instant::now();
    while !FIRST_RETURNED.load(Acquire) && ended.elapsed() < FIRST_ENDS_WITHIN {
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The process is about to end by a signal: its live socket and acknowledgement file go
/// with it (the exit path removes them otherwise). Paths built on the stack, no allocation.
fn forget_own_files() {
    if recorder().is_none() {
        return; // never recorded: nothing of ours to remove
    }
    // SAFETY: getuid and getpid have no preconditions.
    let (uid, pid) = unsafe { (libc::getuid(), libc::getpid()) };
    for suffix in [&b".sock"[..], b".ack", b".ack.tmp"] {
        let mut path = PathBuf64::new();
        path.push(b"/tmp/memsnap-");
        path.push_number(u64::from(uid));
        path.push(b"/");
        path.push_number(pid as u64);
        path.push(suffix);
        if let Some(c) = path.as_c_str() {
            // SAFETY: a NUL-terminated path in a local buffer.
            unsafe { libc::unlink(c) };
        }
    }
}

/// A short path built without allocation (async-signal-safe).
struct PathBuf64 {
    bytes: [u8; 64],
    len: usize,
    overflow: bool,
}

impl PathBuf64 {
    fn new() -> PathBuf64 {
        PathBuf64 {
            bytes: [0; 64],
            len: 0,
            overflow: false,
        }
    }

    fn push(&mut self, part: &[u8]) {
        for &b in part {
            // One byte kept for the terminating NUL.
            if self.len + 1 >= self.bytes.len() {
                self.overflow = true;
                return;
            }
            self.bytes[self.len] = b;
            self.len += 1;
        }
    }

    fn push_number(&mut self, mut n: u64) {
        let mut digits = [0u8; 20];
        let mut at = digits.len();
        loop {
            at -= 1;
            digits[at] = b'0' + (n % 10) as u8;
            n /= 10;
            if n == 0 {
                break;
            }
        }
        self.push(&digits[at..]);
    }

    fn as_c_str(&self) -> Option<*const libc::c_char> {
        (!self.overflow).then_some(self.bytes.as_ptr().cast())
    }
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
    forget_own_files();
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
