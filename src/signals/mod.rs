//! The signals memsnap borrows from the program: the dump signal (`MEMSNAP_SIGNAL`) and,
//! unless `MEMSNAP_AT_CRASH=0`, the signals that end a job (SIGTERM, SIGABRT, SIGSEGV,
//! SIGBUS, SIGINT, SIGHUP, SIGQUIT). memsnap's handler stays installed in the kernel for good; whatever the program
//! asks for afterwards through `sigaction`, `signal`, `bsd_signal`, `sysv_signal` or
//! `ssignal` is kept as *the program's action* and carried out by chaining, with the
//! semantics it asked for (docs/SIGNALS.md has the rules and why).
//!
//! Cold. Three jobs, one file each, in a line: [`hooks`] (the libc signal hooks' bodies)
//! → [`handler`] (the handler in the kernel: dump and crash snapshots) → [`table`] (the
//! borrowed signals and the program's actions, glibc's `sigaction`). Taking a signal over
//! ([`borrow`]) is here, called by `lifecycle` when recording starts, and so is handing the
//! kernel the program's `SIG_IGN` just before an exec ([`before_exec`]).

pub mod handler;
pub mod hooks;
pub mod table;

pub use handler::{forget_in_forked_child, set_crash_wait};
pub use table::{CRASH_SIGNALS, Role};

use crate::channel::handshake::SIGNAL_DUMPS;
use std::ffi::c_int;
use std::ptr::{null, null_mut};
use std::sync::atomic::Ordering::Acquire;

/// Takes `sig` over: the action in place now becomes the program's action, memsnap's
/// handler goes in. Returns false (and changes nothing) when the signal cannot be had.
pub fn borrow(sig: c_int, role: Role) -> bool {
    if table::borrowed(sig).is_some() {
        return true;
    }
    let mut current = table::zeroed_sigaction();
    // SAFETY: querying only; valid out-pointer.
    if unsafe { table::real_sigaction(sig, null(), &mut current) } != 0 {
        return false;
    }
    let program = table::ProgramAction::from_sigaction(&current);
    let Some(entry) = table::claim(sig, role, &program) else {
        return false;
    };
    if !handler::install(entry) {
        entry.signal.store(0, std::sync::atomic::Ordering::Release);
        return false;
    }
    true
}

/// The borrowed signals the program ignores while memsnap's handler is in the kernel: the
/// dump signal under `SIG_IGN` (a crash signal the program ignores is ignored in the kernel
/// already, `handler::install`).
fn ignored_behind_the_handler() -> impl Iterator<Item = &'static table::Borrowed> {
    table::all_borrowed().filter(|b| b.role() == Role::Dump && b.program().handler == libc::SIG_IGN)
}

/// Just before an exec: a signal the program ignores is ignored in the kernel, so the new
/// image inherits it ignored, as without memsnap (exec resets a caught signal to its
/// default, and memsnap's handler is what the kernel has). Returns whether any was changed
/// (then [`after_failed_exec`] puts the handler back). Async-signal-safe: table reads and
/// `sigaction`; usable in a forked or vforked child (its dispositions are its own).
pub fn before_exec() -> bool {
    let mut changed = false;
    for b in ignored_behind_the_handler() {
        let mut act = table::zeroed_sigaction();
        act.sa_sigaction = libc::SIG_IGN;
        // SAFETY: a valid action; no old action wanted.
        changed |= unsafe { table::real_sigaction(b.signal.load(Acquire), &act, null_mut()) } == 0;
    }
    changed
}

/// After an exec that failed: memsnap's handler back where [`before_exec`] set `SIG_IGN`.
pub fn after_failed_exec() {
    for b in ignored_behind_the_handler() {
        handler::install(b);
    }
}

/// Counts for the exit line and the snapshot metadata.
pub fn signal_dumps_asked() -> u64 {
    SIGNAL_DUMPS.asked()
}
