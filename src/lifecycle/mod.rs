//! The composition root: starts recording on the first CUDA event (configuration, the
//! channel, the writer thread, the borrowed signals, the exit hook), and owns exit, fork,
//! exec (the snapshot before the image is replaced, [`exec`]) and the bodies of the
//! `memsnap_*` C API ([`api`]; the symbols are declared in `exports.rs`).
//!
//! Cold. The switch it turns on and the recorder it publishes are `channel::recording`'s,
//! which the hooks read; it implements that room's [`Start`] for the first hook to call. No
//! other room imports this one.

use crate::channel::handshake::{
    API_DUMPS, CRASH, EXEC_DUMPS, EXIT_DONE, EXIT_REQUESTED, OOM_DUMPS, SIGNAL_DUMPS,
};
use crate::channel::queue::{HookSettings, Recorder};
use crate::channel::recording::{self, Start, Switch};
use crate::config::Config;
use crate::guard;
use crate::process::clock;
use crate::process::step_marks;
use crate::signals::{self, CRASH_SIGNALS, Role};
use crate::writer;

pub mod api;
#[cfg(feature = "bench-hooks")]
pub mod debug;
pub mod exec;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::*};
use std::time::Duration;

impl Start for Switch {
    fn start() {
        start();
    }
}

/// One-time start, on the first recorded event. Allocates, spawns the writer, installs
/// the signal handler and the exit hook.
fn start() {
    let (cfg, errors) = Config::from_env();
    for e in &errors {
        eprintln!("{e}");
    }
    if cfg.disabled {
        recording::turn_off();
        return;
    }
    let settings = HookSettings {
        stacks: cfg.stacks,
        context: cfg.context,
        max_frames: cfg.max_frames,
        dump_on_oom: cfg.on_oom,
    };
    // Before the first event is stamped: the writer converts with the same source.
    clock::choose_source();
    // Lanes where stamps order events across cores (`channel::lanes`).
    let lanes = clock::source() == clock::Source::TimeStampCounter;
    let rec: &'static Recorder =
        Box::leak(Box::new(Recorder::new(cfg.queue_capacity, settings, lanes)));
    recording::publish(rec);
    let signal = cfg.signal;
    let steps = cfg.steps;
    let (at_crash, crash_wait) = (cfg.at_crash, cfg.crash_wait);
    if cfg.remote.is_some() {
        UPLOAD_WAIT_MS.store(cfg.remote_wait.as_millis() as u64, Relaxed);
    }
    // The writer must never take a signal meant for the program (its handler would wait for
    // the writer: itself). A thread that blocked them as its first action still had a moment
    // at its start with them open, and the kernel gave a process-directed SIGTERM to it there
    // (a forked child under load: 5 of 30 runs of a debug build waited 5 s for nothing). So
    // it is born with every signal blocked: this thread blocks them around the spawn, the new
    // one inherits that mask, and this one gets its own back (a signal that arrived meanwhile
    // is delivered then).
    let program_mask = block_signals();
    let spawned = std::thread::Builder::new()
        .name("memsnap-writer".to_string())
        .spawn(move || {
            // Anything this thread might call is memsnap's own work, never the program's.
            guard::mark_thread_internal();
            writer::run(rec, cfg);
            // The writer is gone (exit, or a panic it caught): hooks stop recording.
            if !EXIT_REQUESTED.load(Acquire) {
                WRITER_ENDED_EARLY.store(true, Release);
            }
            recording::turn_off();
        });
    restore_signals(&program_mask);
    if let Err(e) = spawned {
        eprintln!("memsnap: could not start the writer thread ({e}); recording is off");
        rec.writer_alive.store(false, Release);
        recording::turn_off();
        return;
    }
    if let Some(sig) = signal
        && !signals::borrow(sig, Role::Dump)
    {
        eprintln!("memsnap: could not install the handler for signal {sig}; no dumps on signal");
    }
    if at_crash {
        signals::set_crash_wait(crash_wait);
        for sig in CRASH_SIGNALS {
            signals::borrow(sig, Role::Crash);
        }
    }
    // Once per process image: a forked child that starts recording of its own inherits
    // the parent's registration.
    if !AT_EXIT_REGISTERED.swap(true, AcqRel) {
        // SAFETY: registering a plain extern "C" fn with no captured state.
        unsafe { libc::atexit(at_exit) };
    }
    exec::set_recording_pid();
    // The first attempt to attach the optimizer step hook: this very event may take it.
    step_marks::start(steps);
    recording::activate();
}

/// Blocks every signal in the calling thread; returns the mask it had. Used around the
/// writer's spawn: the dump signal must reach a thread of the program, never the writer
/// (heaptrack learned this the hard way), and no other signal should land there either.
fn block_signals() -> libc::sigset_t {
    // SAFETY: plain sigset manipulation on local sets; pthread_sigmask affects only this
    // thread.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut before: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut before);
        before
    }
}

/// Gives the calling thread back the mask [`block_signals`] returned.
fn restore_signals(mask: &libc::sigset_t) {
    // SAFETY: a mask pthread_sigmask itself filled; affects only this thread.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, mask, std::ptr::null_mut()) };
}

// ---------------------------------------------------------------------------------------
// Exit and fork.

pub(crate) const EXIT_WAIT: Duration = Duration::from_secs(60);
/// `MEMSNAP_REMOTE_WAIT` when `MEMSNAP_REMOTE` is set: the writer waits that long for
/// uploads at exit, inside the exit wait, which is lengthened by as much so that the exit
/// report (the exit line, the files that never left the node) is always printed.
static UPLOAD_WAIT_MS: AtomicU64 = AtomicU64::new(0);

/// Set when the writer thread ended before the program's exit (an internal error it
/// caught): the exit handler then reports what went unrecorded.
static WRITER_ENDED_EARLY: AtomicBool = AtomicBool::new(false);
/// `at_exit` is registered (inherited by a forked child, which must not register it twice).
static AT_EXIT_REGISTERED: AtomicBool = AtomicBool::new(false);

extern "C" fn at_exit() {
    let Some(rec) = recording::recorder_if_started() else {
        return;
    };
    if recording::is_active() {
        EXIT_REQUESTED.store(true, Release);
        rec.wake_writer();
        let uploads = Duration::from_millis(UPLOAD_WAIT_MS.load(Relaxed));
        rec.wait_for(|| EXIT_DONE.load(Acquire), EXIT_WAIT + uploads);
        recording::turn_off();
        // What other threads allocate after the exit snapshot (the program is ending) is
        // not the record's to lose: the writer ended because it was asked to.
        return;
    } else if !WRITER_ENDED_EARLY.load(Acquire) {
        return; // never started
    }
    report_losses(rec);
}

extern "C" fn in_forked_child() {
    // The parent's writer thread does not exist in the child (DataLoader workers,
    // multiprocessing.Pool): nothing may wait for it. The child starts as a process that
    // never recorded: one that never allocates stays silent and dies exactly as it would
    // without memsnap; one that allocates gets a writer (and crash snapshots) of its own.
    // Atomic stores only: this runs in the child of a possibly multi-threaded fork.
    recording::forget_in_forked_child();
    signals::forget_in_forked_child();
    for requests in [
        &CRASH.dumps,
        &SIGNAL_DUMPS,
        &API_DUMPS,
        &OOM_DUMPS,
        &EXEC_DUMPS,
    ] {
        requests.forget_pending();
    }
    EXIT_REQUESTED.store(false, Relaxed);
    EXIT_DONE.store(false, Relaxed);
    WRITER_ENDED_EARLY.store(false, Relaxed);
}

/// Runs when the library is loaded: only cheap, silent set-up (no thread, no output).
extern "C" fn on_load() {
    // SAFETY: registering a plain extern "C" fn with no captured state.
    unsafe { libc::pthread_atfork(None, None, Some(in_forked_child)) };
    // Here, so that a forked or vforked child that execs never looks a symbol up.
    exec::resolve();
}

#[used]
#[unsafe(link_section = ".init_array")]
static ON_LOAD: extern "C" fn() = on_load;

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
