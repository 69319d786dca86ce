//! The bodies of memsnap's libc signal hooks (`sigaction`, `signal`, `bsd_signal`,
//! `ssignal`, `sysv_signal`, `__sysv_signal`; the symbols are declared in `exports.rs`):
//! for a borrowed signal, the program's new action goes into the table and memsnap's handler
//! stays in the kernel; every other signal goes straight to glibc.
//!
//! Cold: they run when the program changes a disposition.

use super::handler::install;
use super::table::{FnSignal, ProgramAction, borrowed, real_fn, real_sigaction};
use std::ffi::c_int;
use std::sync::atomic::AtomicUsize;

/// `sigaction(2)`: for a borrowed signal, records the program's new action (and reports
/// its previous one) without touching memsnap's handler.
///
/// # Safety
/// As `sigaction(2)`.
pub unsafe fn sigaction(
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
    let new = unsafe { act.as_ref() }.map(ProgramAction::from_sigaction);
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
        pub unsafe fn $name(sig: c_int, handler: libc::sighandler_t) -> libc::sighandler_t {
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
