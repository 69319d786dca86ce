//! Waiting on a word of memsnap's own memory (`futex`), not on a descriptor: the program owns
//! every descriptor number (docs/SIGNALS.md, "Descriptors"). Used by the writer's wake-up
//! word (`queue::WakeWord`) and by the threads the writer holds (`lanes::Lanes::hold`).
//!
//! Cold: called only by a thread that waits, or that wakes one. Both calls are
//! async-signal-safe (system calls on memory).

use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// Waits while `word` holds `expected`, `timeout` at most. Returns at once if it holds
/// another value; a spurious return is possible (callers look again).
pub fn wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: FUTEX_WAIT on a word that outlives the call, with a valid relative timeout;
    // the kernel reads the word and nothing else.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
            expected,
            &ts as *const libc::timespec,
        )
    };
}

/// Wakes at most `waiters` threads waiting on `word`.
pub fn wake(word: &AtomicU32, waiters: i32) {
    // SAFETY: FUTEX_WAKE on a word that outlives the call; it reads no memory beyond the
    // address.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
            waiters,
        )
    };
}
