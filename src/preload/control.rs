//! Lifecycle and triggers: lazy start on the first CUDA event, the dump signal, the
//! out-of-memory wait, exit, fork, and the `memsnap_*` C API.
//!
//! Mostly cold; [`recorder`] and [`settings`] are on the hot path (one atomic load each).
//! State machine: `UNINIT` → (first allocation hook) `STARTING` → `ACTIVE`, or `OFF`
//! (disabled, failed to start, forked child of a recording parent, or after exit).
//! A process that never makes an allocation call never leaves `UNINIT`: no thread, no
//! file, no output (JAX starts such children).

use crate::config::{Config, Context, Stacks};
use crate::preload::event::{Api, Control, Event, Kind};
use crate::preload::guard::Scope;
use crate::preload::queue::Recorder;
use crate::preload::{hooks, record};
use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicPtr, AtomicU8, AtomicU64, Ordering::*};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

const UNINIT: u8 = 0;
const STARTING: u8 = 1;
const ACTIVE: u8 = 2;
const OFF: u8 = 3;

static STATE: AtomicU8 = AtomicU8::new(UNINIT);
static RECORDER: AtomicPtr<Recorder> = AtomicPtr::new(std::ptr::null_mut());
static CONFIG: OnceLock<Config> = OnceLock::new();
/// eventfd that wakes the writer (signal handler, OOM, control calls, exit).
static WAKE_FD: AtomicI32 = AtomicI32::new(-1);

/// Set by the signal handler, consumed by the writer.
pub static SIGNAL_PENDING: AtomicBool = AtomicBool::new(false);

/// The settings a hook needs, copied out of [`Config`] once.
#[derive(Clone, Copy)]
pub struct Hot {
    pub stacks: Stacks,
    pub context: Context,
    pub max_frames: usize,
}
static HOT: OnceLock<Hot> = OnceLock::new();
const HOT_OFF: Hot = Hot {
    stacks: Stacks::None,
    context: Context::Alloc,
    max_frames: 0,
};

#[inline(always)]
pub fn settings() -> Hot {
    *HOT.get().unwrap_or(&HOT_OFF)
}

pub fn config() -> Option<&'static Config> {
    CONFIG.get()
}

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
    let _ = HOT.set(Hot {
        stacks: cfg.stacks,
        context: cfg.context,
        max_frames: cfg.max_frames,
    });
    let rec: &'static Recorder = Box::leak(Box::new(Recorder::new(cfg.queue_capacity)));
    RECORDER.store(rec as *const Recorder as *mut Recorder, Release);
    // SAFETY: eventfd has no memory preconditions.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    WAKE_FD.store(fd, Release);
    let _ = CONFIG.set(cfg.clone());
    if let Err(e) = crate::writer::start(rec, cfg.clone(), fd) {
        eprintln!("memsnap: could not start the writer thread ({e}); recording is off");
        STATE.store(OFF, Release);
        return;
    }
    if let Some(sig) = cfg.signal {
        install_signal_handler(sig);
    }
    // SAFETY: registering a plain extern "C" fn with no captured state.
    unsafe { libc::atexit(at_exit) };
    STATE.store(ACTIVE, Release);
}

/// Wakes the writer now instead of at its next poll. Async-signal-safe.
pub fn wake_writer() {
    let fd = WAKE_FD.load(Acquire);
    if fd >= 0 {
        let one: u64 = 1;
        // SAFETY: writing 8 bytes from a valid buffer to our eventfd; errors are ignored
        // (EAGAIN means a wake-up is already pending).
        unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
    }
}

/// Recording stops for good (writer gone, exit done).
pub fn turn_off() {
    STATE.store(OFF, Release);
}

// ---------------------------------------------------------------------------------------
// Signal.

static PREVIOUS_ACTION: OnceLock<libc::sigaction> = OnceLock::new();

fn install_signal_handler(sig: c_int) {
    // SAFETY: a zeroed sigaction is a valid starting value; the fields are set below.
    let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
    let handler: extern "C" fn(c_int, *mut libc::siginfo_t, *mut c_void) = on_signal;
    action.sa_sigaction = handler as usize;
    action.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART | libc::SA_ONSTACK;
    // SAFETY: valid sigset pointer.
    unsafe { libc::sigemptyset(&mut action.sa_mask) };
    // SAFETY: as above; zeroed output struct.
    let mut previous: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointers to initialized structs.
    if unsafe { libc::sigaction(sig, &action, &mut previous) } == 0 {
        let _ = PREVIOUS_ACTION.set(previous);
    }
}

/// Sets a flag and wakes the writer (async-signal-safe), then chains to the handler the
/// program had installed before us, so the program's own handler keeps working.
extern "C" fn on_signal(sig: c_int, info: *mut libc::siginfo_t, ctx: *mut c_void) {
    // SAFETY: errno is thread-local; saved and restored so the interrupted code sees no change.
    let saved_errno = unsafe { *libc::__errno_location() };
    if STATE.load(Relaxed) == ACTIVE {
        SIGNAL_PENDING.store(true, Release);
        wake_writer();
    }
    if let Some(prev) = PREVIOUS_ACTION.get() {
        let handler = prev.sa_sigaction;
        if handler != libc::SIG_DFL && handler != libc::SIG_IGN {
            if prev.sa_flags & libc::SA_SIGINFO != 0 {
                // SAFETY: the previous handler was installed with SA_SIGINFO, so it has
                // this three-argument signature.
                let f: extern "C" fn(c_int, *mut libc::siginfo_t, *mut c_void) =
                    unsafe { std::mem::transmute(handler) };
                f(sig, info, ctx);
            } else {
                // SAFETY: a plain `void (*)(int)` handler.
                let f: extern "C" fn(c_int) = unsafe { std::mem::transmute(handler) };
                f(sig);
            }
        }
    }
    // SAFETY: restoring the thread's errno.
    unsafe { *libc::__errno_location() = saved_errno };
}

// ---------------------------------------------------------------------------------------
// Out of memory: a synchronous dump, debounced.

/// PyTorch frees its cache and retries after an OOM: the retry's failure within this
/// window belongs to the same episode and does not dump again.
const OOM_DEBOUNCE_US: u64 = 2_000_000;
/// A program that OOMs in a loop gets at most this many OOM snapshots.
const MAX_OOM_DUMPS: u64 = 16;
/// Longest an OOM-ing call waits for its snapshot.
const OOM_WAIT: Duration = Duration::from_secs(30);

static OOM_TICKETS: AtomicU64 = AtomicU64::new(0);
pub static OOM_DONE: AtomicU64 = AtomicU64::new(0);
static OOM_LAST_US: AtomicU64 = AtomicU64::new(0);

/// A non-zero ticket when this OOM should be dumped (first of an episode), else 0.
pub fn oom_dump_ticket() -> u64 {
    if !config().is_some_and(|c| c.on_oom) {
        return 0;
    }
    let now = record::now_us();
    let last = OOM_LAST_US.load(Acquire);
    if last != 0 && now.saturating_sub(last) < OOM_DEBOUNCE_US {
        return 0;
    }
    if OOM_LAST_US
        .compare_exchange(last, now, AcqRel, Acquire)
        .is_err()
    {
        return 0; // another thread's OOM opened this episode
    }
    let ticket = OOM_TICKETS.fetch_add(1, AcqRel) + 1;
    if ticket > MAX_OOM_DUMPS { 0 } else { ticket }
}

/// Blocks (bounded) until the writer has written the snapshot for `ticket`.
pub fn wait_for_oom_dump(ticket: u64) {
    wake_writer();
    wait_until(|| OOM_DONE.load(Acquire) >= ticket, OOM_WAIT);
    // The episode ends when the caller gets its error back, not when it asked.
    OOM_LAST_US.store(record::now_us(), Release);
}

/// Polls `done` every millisecond until it holds, the writer is gone, or `limit` passes.
fn wait_until(done: impl Fn() -> bool, limit: Duration) -> bool {
    let start = std::time::Instant::now();
    loop {
        if done() {
            return true;
        }
        let alive = recorder_if_active().is_some_and(|r| r.writer_alive.load(Acquire));
        if !alive || start.elapsed() > limit {
            return done();
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn recorder_if_active() -> Option<&'static Recorder> {
    // SAFETY: RECORDER is either null or a leaked, never-freed Recorder.
    unsafe { RECORDER.load(Acquire).as_ref() }
}

// ---------------------------------------------------------------------------------------
// Exit and fork.

pub static EXIT_DONE: AtomicBool = AtomicBool::new(false);
const EXIT_WAIT: Duration = Duration::from_secs(60);

extern "C" fn at_exit() {
    if STATE.load(Acquire) != ACTIVE {
        return;
    }
    let Some(rec) = recorder_if_active() else {
        return;
    };
    let _scope = Scope::enter(); // CUDA calls made by other atexit code are not ours
    let mut ev = Event::new(Kind::Control, Api::Memsnap);
    ev.aux = Control::Exit as u64;
    ev.time_us = record::now_us();
    rec.push(ev);
    wake_writer();
    wait_until(|| EXIT_DONE.load(Acquire), EXIT_WAIT);
    turn_off();
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
    let _ = hooks::init_real_dlsym();
    // SAFETY: registering a plain extern "C" fn with no captured state.
    unsafe { libc::pthread_atfork(None, None, Some(in_forked_child)) };
}

#[used]
#[unsafe(link_section = ".init_array")]
static ON_LOAD: extern "C" fn() = on_load;

// ---------------------------------------------------------------------------------------
// The C API: memsnap_step() and memsnap_dump(tag).

/// Tags passed to `memsnap_dump`, looked up by the writer by index.
pub static TAGS: Mutex<Vec<String>> = Mutex::new(Vec::new());
/// Number of explicit dumps the writer has completed.
pub static API_DUMPS_DONE: AtomicU64 = AtomicU64::new(0);
static API_DUMPS_ASKED: AtomicU64 = AtomicU64::new(0);

fn push_control(rec: &Recorder, control: Control, arg: u64) {
    let mut ev = Event::new(Kind::Control, Api::Memsnap);
    ev.aux = control as u64;
    ev.aux2 = arg;
    ev.time_us = record::now_us();
    rec.push(ev);
}

/// Marks the end of a training step. Cheap: one event on the queue.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn memsnap_step() -> c_int {
    let _scope = Scope::enter();
    // A step in a process that has not made a CUDA allocation yet starts nothing.
    if STATE.load(Acquire) != ACTIVE {
        return -1;
    }
    let Some(rec) = recorder_if_active() else {
        return -1;
    };
    push_control(rec, Control::Step, 0);
    0
}

/// Writes a snapshot now, named with `tag` (`{tag}` in MEMSNAP_FILENAME; may be NULL),
/// and returns once it is on disk: 0 on success, -1 if memsnap is off or it timed out.
///
/// # Safety
/// `tag` is NULL or a NUL-terminated string.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn memsnap_dump(tag: *const c_char) -> c_int {
    let _scope = Scope::enter();
    let Some(rec) = recorder() else { return -1 };
    let tag = if tag.is_null() {
        String::new()
    } else {
        // SAFETY: the caller passes a NUL-terminated string (documented contract).
        unsafe { CStr::from_ptr(tag) }
            .to_string_lossy()
            .into_owned()
    };
    let index = match TAGS.lock() {
        Ok(mut tags) => {
            tags.push(tag);
            tags.len() as u64 - 1
        }
        Err(_) => return -1,
    };
    let ticket = API_DUMPS_ASKED.fetch_add(1, AcqRel) + 1;
    push_control(rec, Control::Dump, index);
    wake_writer();
    if wait_until(|| API_DUMPS_DONE.load(Acquire) >= ticket, EXIT_WAIT) {
        0
    } else {
        -1
    }
}

/// Whether memsnap is recording in this process (1) or not (0).
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn memsnap_active() -> c_int {
    (STATE.load(Acquire) == ACTIVE) as c_int
}
