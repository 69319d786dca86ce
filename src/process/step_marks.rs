//! Where step boundaries come from (`MEMSNAP_STEPS`; docs/PYTORCH.md, "Steps without
//! code"): the setting, whether the program marks its steps itself, the state of the hook
//! memsnap attaches to PyTorch's optimizer steps (`pytorch::optimizer`), and which of several
//! optimizers' steps are boundaries.
//!
//! Process-wide state. Hot only in [`attach_due`]: one byte of the hook line, loaded by
//! every recorded event; it is set only while an attempt to attach is due (a few times in a
//! process), so a hook takes the attach path at most that often. The rest is cold: set at
//! the start of recording ([`start`]), by the writer every 100 ms ([`maintain`]), by the
//! attach path, by the program's marks and by the optimizer's step hook; read by the writer
//! for each snapshot's metadata.

use super::clock;
use super::hook_line::HOOK_LINE;
use super::python::{self, Interpreter};
use crate::config::StepMarks;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, AtomicUsize, Ordering::*};

/// What became of the optimizer step hook.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Hook {
    /// No attempt yet.
    NotTried = 0,
    /// The last attempt did not attach, for [`Hook`]'s reason in [`why_not`]; another one
    /// is made a while later.
    Waiting = 1,
    /// An attempt is under way: a hooked call took it, and queued the attach for the
    /// interpreter's main thread (`Py_AddPendingCall`).
    Scheduled = 2,
    /// Attached: each optimizer step of the program calls memsnap's hook.
    Attached = 3,
    /// Registering raised a Python error (cleared, counted): not tried again.
    Failed = 4,
}

/// Why the last attempt did not attach.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum NotAttached {
    /// No supported CPython (3.10–3.14 with the GIL) in the process, or not initialized.
    NoPython = 0,
    /// The event that took the attempt came from a thread other than the interpreter's main
    /// one.
    NotMainThread = 1,
    /// `torch.optim` is not imported (yet).
    NoTorchOptim = 2,
    /// `torch.optim.optimizer` has no global step hooks memsnap knows
    /// (`register_optimizer_step_post_hook` and its table: PyTorch before 2.0, or the module
    /// not fully imported yet).
    NoHookFunction = 3,
    /// The interpreter's queue of pending calls was full, or an exception was being raised
    /// when the pending call ran.
    Busy = 4,
    /// The program registered global optimizer step hooks of its own before memsnap could:
    /// memsnap adds none to a table a step may be iterating.
    ProgramHooks = 5,
}

/// How long after an attempt that did not attach the next one is made.
const RETRY_US: u64 = 1_000_000;

/// `MEMSNAP_STEPS` as read when recording started (0 before).
static SETTING: AtomicU8 = AtomicU8::new(0);
/// The program marked a step itself: the optimizer's steps are no boundaries from then on.
static PROGRAM_MARKS: AtomicBool = AtomicBool::new(false);
static HOOK: AtomicU8 = AtomicU8::new(Hook::NotTried as u8);
static WHY_NOT: AtomicU8 = AtomicU8::new(NotAttached::NoPython as u8);
/// When the next attempt may be armed (wall-clock microseconds; 0: now).
static NEXT_TRY_US: AtomicU64 = AtomicU64::new(0);
/// Python errors memsnap's own calls raised (each cleared before the program could see it).
static PYTHON_ERRORS: AtomicU64 = AtomicU64::new(0);
/// The optimizer whose steps are the boundaries (its object's address; 0: none yet), and
/// another one that stepped since its last step.
static CLOCK: AtomicUsize = AtomicUsize::new(0);
static OTHER: AtomicUsize = AtomicUsize::new(0);

/// The process's id when recording started: its first thread's kernel id.
static PID: AtomicU32 = AtomicU32::new(0);

/// On the line every hooked call reads (`process::hook_line`).
const DUE: &AtomicBool = &HOOK_LINE.optimizer_hook_due;

/// Whether a hooked call should try to attach now (`pytorch::optimizer::schedule`). Hot:
/// one load.
#[inline(always)]
pub fn attach_due() -> bool {
    DUE.load(Relaxed)
}

/// Takes the due attempt: true for exactly one caller per arming, and the attempt is under
/// way ([`Hook::Scheduled`]) until its outcome is set: none is armed meanwhile.
pub fn take_due() -> bool {
    let taken = DUE.swap(false, AcqRel);
    if taken {
        set_hook(Hook::Scheduled);
    }
    taken
}

/// At the start of recording: remembers the setting and the process, and arms the first
/// attempt.
pub fn start(setting: StepMarks) {
    SETTING.store(setting as u8, Relaxed);
    PID.store(std::process::id(), Relaxed);
    maintain();
}

/// The kernel id of the process's first thread, where `python script.py` runs the
/// interpreter's main thread (recorded at the start of recording: in a forked child, the
/// child's).
pub fn main_thread() -> u32 {
    PID.load(Relaxed)
}

/// The setting (`Auto` before recording started).
pub fn setting() -> StepMarks {
    StepMarks::from_u8(SETTING.load(Relaxed)).unwrap_or(StepMarks::Auto)
}

/// Arms an attempt when one is due: `MEMSNAP_STEPS=auto`, the program marks no steps
/// itself, nothing attached or under way, a supported interpreter in the process, and the
/// last attempt long enough ago. Cold: the start of recording and the writer, every 100 ms.
pub fn maintain() {
    if setting() != StepMarks::Auto || PROGRAM_MARKS.load(Relaxed) || DUE.load(Relaxed) {
        return;
    }
    if !matches!(hook(), Hook::NotTried | Hook::Waiting) {
        return;
    }
    if clock::wall_micros() < NEXT_TRY_US.load(Relaxed) {
        return;
    }
    // Resolves the interpreter if no capture did yet (a process without Python frames).
    let _ = python::runtime();
    if !matches!(python::interpreter(), Interpreter::Supported(..)) {
        not_attached(NotAttached::NoPython, RETRY_US);
        return;
    }
    DUE.store(true, Release);
}

/// The attempt did not attach, because `why`; the next one is armed `retry_us` from now.
pub fn not_attached(why: NotAttached, retry_us: u64) {
    WHY_NOT.store(why as u8, Relaxed);
    let next = match retry_us {
        0 => 0,
        _ => clock::wall_micros().saturating_add(retry_us),
    };
    NEXT_TRY_US.store(next, Relaxed);
    HOOK.store(Hook::Waiting as u8, Release);
}

/// [`not_attached`] with the usual wait before the next attempt.
pub fn try_later(why: NotAttached) {
    not_attached(why, RETRY_US);
}

pub fn set_hook(state: Hook) {
    HOOK.store(state as u8, Release);
}

pub fn hook() -> Hook {
    match HOOK.load(Acquire) {
        1 => Hook::Waiting,
        2 => Hook::Scheduled,
        3 => Hook::Attached,
        4 => Hook::Failed,
        _ => Hook::NotTried,
    }
}

pub fn why_not() -> NotAttached {
    match WHY_NOT.load(Relaxed) {
        1 => NotAttached::NotMainThread,
        2 => NotAttached::NoTorchOptim,
        3 => NotAttached::NoHookFunction,
        4 => NotAttached::Busy,
        5 => NotAttached::ProgramHooks,
        _ => NotAttached::NoPython,
    }
}

/// Whether an attach that is about to run is still wanted (the program may have marked a
/// step since it was queued).
pub fn attach_wanted() -> bool {
    setting() == StepMarks::Auto && !PROGRAM_MARKS.load(Relaxed)
}

/// A Python error memsnap caused and cleared.
pub fn count_python_error() {
    PYTHON_ERRORS.fetch_add(1, Relaxed);
}

pub fn python_errors() -> u64 {
    PYTHON_ERRORS.load(Relaxed)
}

/// The program marks a step (`memsnap_step()`): whether it counts (not under
/// `MEMSNAP_STEPS=off`). From the first one on, the optimizer's steps are no boundaries.
pub fn program_mark() -> bool {
    if setting() == StepMarks::Off {
        return false;
    }
    PROGRAM_MARKS.store(true, Relaxed);
    true
}

/// Whether the program marked a step itself.
pub fn program_marks() -> bool {
    PROGRAM_MARKS.load(Relaxed)
}

/// The optimizer at `optimizer` (its object's address) finished a step: whether that step
/// is a boundary. Not once the program marks steps itself. With several optimizers, the
/// steps of one of them are: the first that steps, until another steps twice with no step
/// of it between (the first was dropped, or steps less often), which takes its place.
pub fn optimizer_step_is_boundary(optimizer: usize) -> bool {
    if !attach_wanted() {
        return false;
    }
    let clock = CLOCK.load(Relaxed);
    if clock == 0 || clock == optimizer || OTHER.load(Relaxed) == optimizer {
        CLOCK.store(optimizer, Relaxed);
        OTHER.store(0, Relaxed);
        return true;
    }
    OTHER.store(optimizer, Relaxed);
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_of_several_optimizers_keeps_the_steps() {
        // (This test owns the clock: no other test of this process steps an optimizer.)
        let boundaries = |steps: &[usize]| -> Vec<bool> {
            CLOCK.store(0, Relaxed);
            OTHER.store(0, Relaxed);
            steps
                .iter()
                .map(|&o| optimizer_step_is_boundary(o))
                .collect()
        };
        // One optimizer: every step.
        assert_eq!(boundaries(&[1, 1, 1]), [true, true, true]);
        // A generator and a discriminator, one step each an iteration: the first one's.
        assert_eq!(
            boundaries(&[1, 2, 1, 2, 1, 2]),
            [true, false, true, false, true, false]
        );
        // A new optimizer replaces the first: its second step takes over.
        assert_eq!(
            boundaries(&[1, 1, 2, 2, 2]),
            [true, true, false, true, true]
        );
        // One that steps twice for each step of the first: its steps, from its second.
        assert_eq!(
            boundaries(&[1, 2, 2, 1, 2, 2]),
            [true, false, true, false, true, true]
        );
    }
}
