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
//! ([`borrow`]) is here, called by `lifecycle` when recording starts.

pub mod handler;
pub mod hooks;
pub mod table;

pub use handler::{forget_in_forked_child, set_crash_wait};
pub use table::{CRASH_SIGNALS, Role};

use crate::channel::handshake::SIGNAL_DUMPS;
use std::ffi::c_int;
use std::ptr::null;

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

/// Counts for the exit line and the snapshot metadata.
pub fn signal_dumps_asked() -> u64 {
    SIGNAL_DUMPS.asked()
}
