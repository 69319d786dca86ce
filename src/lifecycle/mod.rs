//! The composition root: starts recording on the first CUDA event (configuration, the
//! channel, the writer thread, the borrowed signals, the exit hook), and owns the `memsnap_*`
//! C API, exit and fork.
//!
//! Mostly cold; [`recorder`] is on the hot path (one atomic load). State machine:
//! `UNINIT` → (first allocation hook) `STARTING` → `ACTIVE`, or `OFF` (disabled, failed to
//! start, forked child of a recording parent, or after exit). A process that never makes
//! an allocation call never leaves `UNINIT`: no thread, no file, no output (JAX starts such
//! children).

use crate::channel::event::{Api, Event, Kind};
use crate::channel::handshake::{
    self, API_DUMP_LOG, API_DUMPS, ApiDump, EXIT_DONE, EXIT_REQUESTED,
};
use crate::channel::queue::{HookSettings, Recorder};
use crate::config::Config;
use crate::guard::{self, Scope};
use crate::signals::{self, CRASH_SIGNALS, Role};
use crate::writer;

pub mod debug;
use std::ffi::{CStr, c_char, c_int};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU8, Ordering::*};
use std::time::Duration;

const UNINIT: u8 = 0;
const STARTING: u8 = 1;
const ACTIVE: u8 = 2;
const OFF: u8 = 3;

static STATE: AtomicU8 = AtomicU8::new(UNINIT);
static RECORDER: AtomicPtr<Recorder> = AtomicPtr::new(std::ptr::null_mut());
/// The recorder if recording is on, starting it on first use.
#[inline(always)]
pub fn recorder() -> Option<&'static Recorder> {
    if STATE.load(Acquire) == ACTIVE {
        // SAFETY: set (to a leaked, never-freed Recorder) before STATE became ACTIVE.
        return unsafe { RECORDER.load(Acquire).as_ref() };
    }
    recorder_slow()
}

#[cold]
#[inline(never)]
fn recorder_slow() -> Option<&'static Recorder> {
    match STATE.compare_exchange(UNINIT, STARTING, AcqRel, Acquire) {
        Ok(_) => start(),
        Err(STARTING) => {
            // Another thread is starting the writer: wait for it (milliseconds at most).
            for _ in 0..200_000 {
                match STATE.load(Acquire) {
                    STARTING => std::thread::yield_now(),
                    ACTIVE => break,
                    _ => return None,
                }
            }
        }
        Err(_) => {}
    }
    if STATE.load(Acquire) != ACTIVE {
        return None;
    }
    // SAFETY: as in `recorder`.
    unsafe { RECORDER.load(Acquire).as_ref() }
}

/// One-time start, on the first recorded event. Allocates, spawns the writer, installs
/// the signal handler and the exit hook.
fn start() {
    let (cfg, errors) = Config::from_env();
    for e in &errors {
        eprintln!("{e}");
    }
    if cfg.disabled {
        STATE.store(OFF, Release);
        return;
    }
    let settings = HookSettings {
        stacks: cfg.stacks,
        context: cfg.context,
        max_frames: cfg.max_frames,
        dump_on_oom: cfg.on_oom,
    };
    // SAFETY: eventfd has no memory preconditions.
    let wake_fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    let rec: &'static Recorder = Box::leak(Box::new(Recorder::new(
        cfg.queue_capacity,
        settings,
        wake_fd,
    )));
    RECORDER.store(rec as *const Recorder as *mut Recorder, Release);
    let signal = cfg.signal;
    let (at_crash, crash_wait) = (cfg.at_crash, cfg.crash_wait);
    let spawned = std::thread::Builder::new()
        .name("memsnap-writer".to_string())
        .spawn(move || {
            block_signals();
            // Anything this thread might call is memsnap's own work, never the program's.
            guard::mark_thread_internal();
            writer::run(rec, cfg);
            // The writer is gone (exit, or a panic it caught): hooks stop recording.
            if !EXIT_REQUESTED.load(Acquire) {
                WRITER_ENDED_EARLY.store(true, Release);
            }
            STATE.store(OFF, Release);
        });
    if let Err(e) = spawned {
        eprintln!("memsnap: could not start the writer thread ({e}); recording is off");
        rec.writer_alive.store(false, Release);
        STATE.store(OFF, Release);
        return;
    }
    if let Some(sig) = signal
        && !signals::borrow(sig, Role::Dump, rec)
    {
        eprintln!("memsnap: could not install the handler for signal {sig}; no dumps on signal");
    }
    if at_crash {
        signals::set_crash_wait(crash_wait);
        for sig in CRASH_SIGNALS {
            signals::borrow(sig, Role::Crash, rec);
        }
    }
    // SAFETY: registering a plain extern "C" fn with no captured state.
    unsafe { libc::atexit(at_exit) };
    STATE.store(ACTIVE, Release);
}

/// The dump signal must reach a thread of the program, never the writer (heaptrack learned
/// this the hard way), and no other signal should land there either.
fn block_signals() {
    // SAFETY: plain sigset manipulation on a local set; pthread_sigmask affects only this
    // thread.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_BLOCK, &all, std::ptr::null_mut());
    }
}

fn recorder_if_started() -> Option<&'static Recorder> {
    // SAFETY: RECORDER is either null or a leaked, never-freed Recorder.
    unsafe { RECORDER.load(Acquire).as_ref() }
}

// ---------------------------------------------------------------------------------------
// Exit and fork.

const EXIT_WAIT: Duration = Duration::from_secs(60);

/// Set when the writer thread ended before the program's exit (an internal error it
/// caught): the exit handler then reports what went unrecorded.
static WRITER_ENDED_EARLY: AtomicBool = AtomicBool::new(false);

extern "C" fn at_exit() {
    let Some(rec) = recorder_if_started() else {
        return;
    };
    if STATE.load(Acquire) == ACTIVE {
        EXIT_REQUESTED.store(true, Release);
        rec.wake_writer();
        rec.wait_for(|| EXIT_DONE.load(Acquire), EXIT_WAIT);
        STATE.store(OFF, Release);
    } else if !WRITER_ENDED_EARLY.load(Acquire) {
        return; // never started, or a forked child of a recording parent
    }
    report_losses(rec);
}

extern "C" fn in_forked_child() {
    // The writer thread does not exist in the child. A child of a recording parent stays
    // silent (CUDA is unusable after fork anyway, and DataLoader workers must leave no
    // files); a child forked before any CUDA call may start its own recording later.
    if STATE.load(Relaxed) != UNINIT {
        STATE.store(OFF, Relaxed);
    }
}

/// Runs when the library is loaded: only cheap, silent set-up (no thread, no output).
extern "C" fn on_load() {
    // SAFETY: registering a plain extern "C" fn with no captured state.
    unsafe { libc::pthread_atfork(None, None, Some(in_forked_child)) };
}

#[used]
#[unsafe(link_section = ".init_array")]
static ON_LOAD: extern "C" fn() = on_load;

// ---------------------------------------------------------------------------------------
// The C API: memsnap_step(), memsnap_dump(tag), memsnap_dump_path(tag, path, size).

/// The one place a person learns that events went unrecorded: only possible when the
/// writer stopped early (it caught an internal error), since hooks otherwise wait.
fn report_losses(rec: &Recorder) {
    let c = &rec.counters;
    let lost = c.lost_total();
    if lost > 0 || c.lost_stacks.load(Relaxed) > 0 {
        eprintln!(
            "memsnap: the writer stopped early: {lost} events ({} allocations, {} frees) were \
             not recorded after the last snapshot",
            c.lost_allocs.load(Relaxed),
            c.lost_frees.load(Relaxed),
        );
    }
}

/// Marks the end of a training step. Cheap: one event on the queue.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn memsnap_step() -> c_int {
    let _scope = Scope::enter();
    // A step in a process that has not made a CUDA allocation yet starts nothing.
    if STATE.load(Acquire) != ACTIVE {
        return -1;
    }
    let Some(rec) = recorder_if_started() else {
        return -1;
    };
    let mut ev = Event::new(Kind::Step, Api::Memsnap);
    ev.time_us = handshake::now_us();
    rec.push(ev);
    0
}

/// Writes a snapshot now, named with `tag` (`{tag}` in MEMSNAP_FILENAME; may be NULL),
/// and returns once it is on disk: 0 on success, -1 if memsnap is off or it timed out.
///
/// # Safety
/// `tag` is NULL or a NUL-terminated string.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn memsnap_dump(tag: *const c_char) -> c_int {
    // SAFETY: the caller's contract on `tag` is this function's.
    match unsafe { request_api_dump(tag) } {
        Some(_) => 0,
        None => -1,
    }
}

/// As `memsnap_dump`, and tells which file it wrote: copies the file's absolute path into
/// `path` (`size` bytes, NUL-terminated, cut to fit as `snprintf` does) and returns the
/// path's full length in bytes without the NUL (a value >= `size` means it was cut).
/// Returns -1 when memsnap is off, the write failed or it timed out.
///
/// # Safety
/// `tag` is NULL or a NUL-terminated string; `path` is NULL or points to `size` writable
/// bytes.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn memsnap_dump_path(
    tag: *const c_char,
    path: *mut c_char,
    size: usize,
) -> c_int {
    // SAFETY: the caller's contract on `tag` is this function's.
    let Some(ticket) = (unsafe { request_api_dump(tag) }) else {
        return -1;
    };
    let written = match API_DUMP_LOG.lock() {
        Ok(log) => log
            .get(ticket as usize - 1)
            .and_then(|d| d.path.as_ref())
            .map(|p| p.as_os_str().as_encoded_bytes().to_vec()),
        Err(_) => None,
    };
    let Some(bytes) = written else { return -1 };
    if !path.is_null() && size > 0 {
        let n = bytes.len().min(size - 1);
        // SAFETY: the caller gives `size` writable bytes at `path`; n + 1 <= size.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), path.cast::<u8>(), n);
            *path.add(n) = 0;
        }
    }
    c_int::try_from(bytes.len()).unwrap_or(c_int::MAX)
}

/// Asks the writer for an `api` snapshot tagged `tag` and waits until it is on disk:
/// the request's ticket, or `None` when memsnap is off or the wait timed out.
///
/// # Safety
/// `tag` is NULL or a NUL-terminated string.
unsafe fn request_api_dump(tag: *const c_char) -> Option<u64> {
    let _scope = Scope::enter();
    let rec = recorder()?;
    let tag = if tag.is_null() {
        String::new()
    } else {
        // SAFETY: the caller passes a NUL-terminated string (documented contract).
        unsafe { CStr::from_ptr(tag) }
            .to_string_lossy()
            .into_owned()
    };
    let ticket = {
        let mut log = API_DUMP_LOG.lock().ok()?;
        log.push(ApiDump { tag, path: None });
        API_DUMPS.ask()
    };
    rec.wake_writer();
    rec.wait_for(|| API_DUMPS.is_done(ticket), EXIT_WAIT)
        .then_some(ticket)
}

/// Whether memsnap is recording in this process (1) or not (0).
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn memsnap_active() -> c_int {
    (STATE.load(Acquire) == ACTIVE) as c_int
}
