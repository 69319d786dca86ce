//! The record before an `exec`: the bodies of memsnap's exec-family hooks (`execve`,
//! `execv`, `execvp`, `execvpe`, `fexecve`, `execveat`; the symbols are declared in
//! `exports.rs`). An image replaced by exec runs no exit handler, so without them everything
//! recorded so far would be lost (Python's `os.execv*`, job wrappers that re-exec
//! themselves). In the process that records, each hook asks the writer for an `exec`
//! snapshot and waits until it is on disk (at most the exit wait; never once the writer is
//! gone), then calls glibc's function of the same name. Recording stays on: an exec that
//! fails returns -1 with the errno glibc set, to a program that is still recorded. Every
//! caller, just before glibc's function, has the signals the program ignores ignored in the
//! kernel too (`signals::before_exec`): the new image inherits them ignored, as without
//! memsnap, where memsnap's handler would have become the default action.
//!
//! Cold. Every other caller goes to glibc at once, past atomic loads, `getpid` and a
//! thread-local: no allocation, no lock, no wait. That is a forked child that never
//! recorded (its state went back to "never started" in the fork handler); a child that
//! shares the recording process's memory without being it (`vfork`, `clone(CLONE_VM)`: its
//! pid is not the recording process's); and a signal handler that execs from inside one of
//! memsnap's hooks on its thread (the writer could be waiting for what that hook holds).
//!
//! The variadic `execl`, `execlp` and `execle` cannot be defined in stable Rust, and
//! glibc's own build their argument array and call its internal `__execve`, never the
//! `execve` symbol, so the hooks above never see them. On x86-64 `exports.rs` defines them
//! in assembly: the entry lays the arguments out as the array glibc would build (the
//! registers' arguments pushed in front of those the caller left on the stack) and calls
//! [`execl_array`], [`execlp_array`] or [`execle_array`], which go on as `execv`, `execvp`
//! and `execve`. On other architectures they are not hooked: a program that ends with one
//! of them loses its record, as without these hooks. `posix_spawn` replaces no image of the
//! calling process (its child, made with `clone(CLONE_VFORK)`, calls `__execve` too).

use super::EXIT_WAIT;
use crate::channel::handshake::EXEC_DUMPS;
use crate::channel::recording;
use crate::process::dlsym::real_dlsym;
use crate::signals;
use std::ffi::{CStr, c_char, c_int};
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering::*};

/// The pid of the process whose writer records, set when recording starts (a forked child
/// that records sets its own).
static RECORDING_PID: AtomicI32 = AtomicI32::new(0);

/// When recording starts: this process is the one whose writer serves exec snapshots.
pub(super) fn set_recording_pid() {
    // SAFETY: getpid has no preconditions.
    RECORDING_PID.store(unsafe { libc::getpid() }, Release);
}

/// Before the image is replaced: the `exec` snapshot, if this process records.
fn before_exec() {
    if !recording::is_active() {
        return;
    }
    // SAFETY: getpid has no preconditions (a system call, never a cached value).
    if unsafe { libc::getpid() } != RECORDING_PID.load(Acquire) {
        // The child of a vfork (or a clone sharing memory): the writer is not its own, and
        // the parent is suspended until it execs.
        return;
    }
    if crate::guard::inside_hook_or_internal() {
        // A signal handler that interrupted one of memsnap's hooks on this thread (or
        // memsnap's own thread): the writer may need what the interrupted hook holds.
        return;
    }
    let Some(rec) = recording::recorder_if_started() else {
        return;
    };
    let ticket = EXEC_DUMPS.ask();
    rec.wake_writer();
    rec.wait_for(|| EXEC_DUMPS.is_done(ticket), EXIT_WAIT);
}

/// glibc's functions, found once (`resolve`, when the library is loaded) so that the path
/// of a forked or vforked child looks nothing up (only a function this glibc lacks is
/// looked for again, at its call).
static REAL: [AtomicUsize; 6] = [const { AtomicUsize::new(0) }; 6];
const NAMES: [&CStr; 6] = [
    c"execve",
    c"execv",
    c"execvp",
    c"execvpe",
    c"fexecve",
    c"execveat",
];
const EXECVE: usize = 0;
const EXECV: usize = 1;
const EXECVP: usize = 2;
const EXECVPE: usize = 3;
const FEXECVE: usize = 4;
const EXECVEAT: usize = 5;

/// Finds glibc's exec functions (`execveat` is missing before glibc 2.34).
pub(super) fn resolve() {
    for (slot, name) in REAL.iter().zip(NAMES) {
        if slot.load(Relaxed) == 0 {
            // SAFETY: RTLD_NEXT with a NUL-terminated name.
            slot.store(
                unsafe { real_dlsym(libc::RTLD_NEXT, name) } as usize,
                Release,
            );
        }
    }
}

/// glibc's function `which`, or `None` (errno ENOSYS set) when glibc has none.
fn real(which: usize) -> Option<usize> {
    let mut p = REAL[which].load(Acquire);
    if p == 0 {
        // SAFETY: RTLD_NEXT with a NUL-terminated name.
        p = unsafe { real_dlsym(libc::RTLD_NEXT, NAMES[which]) } as usize;
        REAL[which].store(p, Release);
    }
    if p == 0 {
        // SAFETY: errno is thread-local.
        unsafe { *libc::__errno_location() = libc::ENOSYS };
        return None;
    }
    Some(p)
}

/// `char *const argv[]`, `char *const envp[]`.
pub type Argv = *const *const c_char;

/// Declares each hook body: the `exec` snapshot, then glibc's function with the caller's
/// arguments.
macro_rules! exec_family {
    ($($(#[$doc:meta])* $name:ident = $index:ident($($arg:ident: $ty:ty),*);)*) => {$(
        $(#[$doc])*
        ///
        /// # Safety
        /// As glibc's function of the same name.
        pub unsafe fn $name($($arg: $ty),*) -> c_int {
            before_exec();
            let Some(p) = real($index) else { return -1 };
            type Real = unsafe extern "C" fn($($ty),*) -> c_int;
            let ignored = signals::before_exec();
            // SAFETY: glibc's function of this name (its signature is `Real`), with the
            // caller's arguments.
            let rc = unsafe { std::mem::transmute::<usize, Real>(p)($($arg),*) };
            if ignored {
                // Failed: the program goes on, memsnap's handler with it (errno kept).
                // SAFETY: errno is thread-local.
                let errno = unsafe { *libc::__errno_location() };
                signals::after_failed_exec();
                // SAFETY: as above.
                unsafe { *libc::__errno_location() = errno };
            }
            rc
        }
    )*};
}

exec_family! {
    /// `execve(2)`.
    execve = EXECVE(path: *const c_char, argv: Argv, envp: Argv);
    /// `execv(3)`.
    execv = EXECV(path: *const c_char, argv: Argv);
    /// `execvp(3)`.
    execvp = EXECVP(file: *const c_char, argv: Argv);
    /// `execvpe(3)`.
    execvpe = EXECVPE(file: *const c_char, argv: Argv, envp: Argv);
    /// `fexecve(3)`.
    fexecve = FEXECVE(fd: c_int, argv: Argv, envp: Argv);
    /// `execveat(2)`.
    execveat = EXECVEAT(dirfd: c_int, path: *const c_char, argv: Argv, envp: Argv, flags: c_int);
}

/// `execl(path, arg0, ..., NULL)`, its arguments laid out as an array by the exported entry
/// (`exports.rs`).
///
/// # Safety
/// `argv` is a NULL-terminated array of C strings, as `execv(3)`'s.
#[cfg(target_arch = "x86_64")]
pub unsafe extern "C" fn execl_array(path: *const c_char, argv: Argv) -> c_int {
    // SAFETY: the caller's arguments, as execv's.
    unsafe { execv(path, argv) }
}

/// `execlp(file, arg0, ..., NULL)`, as [`execl_array`].
///
/// # Safety
/// As [`execl_array`].
#[cfg(target_arch = "x86_64")]
pub unsafe extern "C" fn execlp_array(file: *const c_char, argv: Argv) -> c_int {
    // SAFETY: the caller's arguments, as execvp's.
    unsafe { execvp(file, argv) }
}

/// `execle(path, arg0, ..., NULL, envp)`, as [`execl_array`]: the environment is the
/// pointer after the NULL that ends the arguments.
///
/// # Safety
/// `argv` is a NULL-terminated array of C strings followed by the environment array.
#[cfg(target_arch = "x86_64")]
pub unsafe extern "C" fn execle_array(path: *const c_char, argv: Argv) -> c_int {
    let mut n = 0;
    // SAFETY: the caller passed the arguments up to a NULL, then the environment: every
    // slot read here was passed.
    let envp = unsafe {
        while !(*argv.add(n)).is_null() {
            n += 1;
        }
        *argv.add(n + 1)
    };
    // SAFETY: the caller's arguments, as execve's.
    unsafe { execve(path, argv, envp.cast()) }
}
