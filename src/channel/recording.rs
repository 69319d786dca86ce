//! The recording switch: whether this process records, and the channel its hooks send on.
//!
//! Process-wide state. Hot: [`recorder`] is one atomic load and one pointer load once
//! recording is on. State machine: `UNINIT` → (first allocation hook) `STARTING` →
//! `ACTIVE`, or `OFF` (disabled, failed to start, or after exit). A process that never
//! makes an allocation call never leaves `UNINIT`: no thread, no file, no output (JAX
//! starts such children). A forked child goes back to `UNINIT` with no recorder: the
//! parent's writer thread does not exist there.
//!
//! Starting is the composition root's job (`lifecycle`: settings, the channel, the writer
//! thread, the signals, the exit hook). This room never names it: `lifecycle` implements
//! [`Start`] for [`Switch`], and the first hook calls it through that trait (resolved at
//! compile time: no function pointer, nothing registered at run time, so a hook that runs
//! before any library constructor still starts recording).

use crate::channel::queue::Recorder;
use crate::config::{Context, FRAME_CAPACITY, Stacks};
use crate::process::hook_line::HOOK_LINE;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU8, Ordering::*};

const UNINIT: u8 = 0;
const STARTING: u8 = 1;
const ACTIVE: u8 = 2;
const OFF: u8 = 3;

/// The switch's state (`HOOK_LINE.recording`) and the recorder (`HOOK_LINE.recorder`) live
/// on the line every hooked call reads (`process::hook_line`).
const STATE: &AtomicU8 = &HOOK_LINE.recording;
const _: () = assert!(UNINIT == 0); // the line's initial value
/// The line holds the pointer untyped (the process room is below the channel); it is only
/// ever a `Recorder` this module stored.
const RECORDER: &AtomicPtr<c_void> = &HOOK_LINE.recorder;
/// The recorder's settings the hooks read, beside it on the hook line (its own copy,
/// `Recorder::settings`, is on a line of its own: one more line for every event to wait
/// for; docs/HOT-PATH.md, "The lines of a stackless event"). A byte each: a hook reads the
/// one it tests.
const STACKS: &AtomicU8 = &HOOK_LINE.recorder_stacks;
const MAX_FRAMES: &AtomicU8 = &HOOK_LINE.recorder_max_frames;
const CONTEXT_ALL: &AtomicBool = &HOOK_LINE.recorder_context_all;
// The frame limit is kept in a byte, at most the slots' capacity.
const _: () = assert!(FRAME_CAPACITY <= u8::MAX as usize);

/// The recording switch, which the composition root knows how to turn on.
pub struct Switch;

/// Turning recording on, once per process: implemented by `lifecycle` for [`Switch`].
/// `start` runs on the thread of the first allocation hook, with the switch at `STARTING`;
/// it ends with [`activate`] (after [`publish`]) or [`turn_off`].
pub trait Start {
    fn start();
}

/// The recorder if recording is on, starting it on first use.
#[inline(always)]
pub fn recorder() -> Option<&'static Recorder> {
    if STATE.load(Acquire) == ACTIVE {
        // SAFETY: set (to a leaked, never-freed Recorder) before STATE became ACTIVE.
        return unsafe { RECORDER.load(Acquire).cast::<Recorder>().as_ref() };
    }
    recorder_slow()
}

#[cold]
#[inline(never)]
fn recorder_slow() -> Option<&'static Recorder> {
    match STATE.compare_exchange(UNINIT, STARTING, AcqRel, Acquire) {
        Ok(_) => <Switch as Start>::start(),
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
    unsafe { RECORDER.load(Acquire).cast::<Recorder>().as_ref() }
}

/// The recorder once [`publish`]ed, whatever the switch says now (the exit handler, the
/// C API, the signal handler). Never starts anything.
pub fn recorder_if_started() -> Option<&'static Recorder> {
    // SAFETY: RECORDER is either null or a leaked, never-freed Recorder.
    unsafe { RECORDER.load(Acquire).cast::<Recorder>().as_ref() }
}

/// Whether recording is on.
pub fn is_active() -> bool {
    STATE.load(Acquire) == ACTIVE
}

/// Whether recording has never been asked for in this process.
pub fn never_started() -> bool {
    STATE.load(Relaxed) == UNINIT
}

/// [`Start::start`]: the recorder hooks will send on; published before [`activate`], the
/// settings hooks read before it.
pub fn publish(rec: &'static Recorder) {
    let settings = rec.settings;
    STACKS.store(settings.stacks as u8, Relaxed);
    // A limit above the slots' capacity is what a capture takes of it: the capacity.
    MAX_FRAMES.store(settings.max_frames.min(FRAME_CAPACITY) as u8, Relaxed);
    CONTEXT_ALL.store(settings.context == Context::All, Relaxed);
    RECORDER.store(rec as *const Recorder as *mut c_void, Release);
}

// The settings of the recorder that [`recorder`] returned, each read after it (the release
// that published the recorder covers them).

/// The recorder's stack mode.
#[inline(always)]
pub fn stacks() -> Stacks {
    Stacks::from_bits(STACKS.load(Relaxed))
}

/// The recorder's frame limit (at most the slots' capacity).
#[inline(always)]
pub fn max_frames() -> usize {
    usize::from(MAX_FRAMES.load(Relaxed))
}

/// The recorder's context: whether frees carry stacks of their own.
#[inline(always)]
pub fn context() -> Context {
    if CONTEXT_ALL.load(Relaxed) {
        Context::All
    } else {
        Context::Alloc
    }
}

/// [`Start::start`] succeeded: hooks record from now on.
pub fn activate() {
    STATE.store(ACTIVE, Release);
}

/// Recording is off for good: disabled, failed to start, the writer is gone, or exit.
pub fn turn_off() {
    STATE.store(OFF, Release);
}

/// In a forked child (the parent's writer thread does not exist there): back to a process
/// that never recorded, with no recorder, so a child that never allocates is left exactly
/// as it would be without memsnap (its signal handlers find nothing to wait for) and one
/// that allocates starts recording of its own (its own writer, files and socket).
/// Async-signal-safe: atomic stores only.
pub fn forget_in_forked_child() {
    RECORDER.store(std::ptr::null_mut(), Relaxed);
    STATE.store(UNINIT, Relaxed);
}
