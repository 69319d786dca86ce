//! What recorded events name stays readable until the writer has read it: a thread about to
//! free a Python code object or to unload a library first waits until the writer has read
//! every event published so far (`Recorder::wait_until_read`, at most `READ_WAIT`).
//!
//! Cold: never on a CUDA hook's path. CPython frees every code object through its type's
//! `tp_dealloc`, which [`keep_code_objects`] wraps once, when memsnap first finds the
//! interpreter (one pointer stored into `PyCode_Type`; CPython reads it at each free); libraries are unloaded through `dlclose`, whose export waits with
//! [`wait_until_read`] (`interpose::symbols`). Both pass straight through when the writer has
//! read everything, the usual case: a mark per recording thread's lane and two counters read
//! (docs/CPYTHON.md, "Code freed after an event").

use crate::channel::recording;
use crate::process::cpython::Layout;
use crate::process::python;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::*};

/// The interpreter's own `PyCode_Type.tp_dealloc`, once wrapped.
static CODE_DEALLOC: AtomicUsize = AtomicUsize::new(0);
/// Code objects freed since the wrapper was installed, on a line of its own (written at each
/// free, read by captures on 3.10/3.11).
static CODE_FREES: CodeFrees = CodeFrees(AtomicU64::new(0));

#[repr(align(64))]
struct CodeFrees(AtomicU64);

/// Code objects freed so far. Read before a code object, a count that has not moved since
/// says the object is still the one read then.
#[inline]
pub fn code_frees() -> u64 {
    CODE_FREES.0.load(Acquire)
}

/// [`code_frees`] as the hook marks a stack's innermost Python record with it on 3.10/3.11
/// (bits 1-31 of `PyFrameRaw::flags`): two stacks alike but for code objects freed between
/// them and others made at the same addresses then differ (3.12+ code objects carry a
/// serial of their own instead).
#[inline(always)]
pub fn code_frees_mark() -> u32 {
    (CODE_FREES.0.load(Relaxed) as u32) << 1
}

/// Waits, if recording, until the writer has read every event published so far.
pub fn wait_until_read() {
    if !recording::is_active() {
        return;
    }
    if let Some(rec) = recording::recorder_if_started() {
        rec.wait_until_read();
    }
}

/// Wraps `PyCode_Type.tp_dealloc` of the interpreter `layout` describes with
/// [`code_dealloc`] (once per process; a slot already wrapped is left alone). Given to
/// `python::runtime` by whoever may find the interpreter first (a capture, the step marks'
/// look for it), so that it runs before any frame is read. The wrapper passes straight
/// through while nothing records.
pub fn keep_code_objects(layout: Layout) {
    let code_type = python::lookup(c"PyCode_Type");
    if code_type == 0 {
        return;
    }
    let at = code_type.wrapping_add(layout.table().object.type_dealloc as usize);
    if !at.is_multiple_of(align_of::<AtomicUsize>()) {
        return;
    }
    // SAFETY: `at` is `PyCode_Type.tp_dealloc` (the offset is checked against every supported
    // version's headers), an aligned function pointer in the interpreter's writable data that
    // lives as long as the process. CPython reads it with a plain load when it frees a code
    // object; an aligned 8-byte store is seen whole, the old pointer or the new.
    let slot = unsafe { AtomicUsize::from_ptr(at as *mut usize) };
    let own = code_dealloc as unsafe extern "C" fn(*mut c_void) as usize;
    let current = slot.load(Acquire);
    if current == 0 || current == own {
        return;
    }
    CODE_DEALLOC.store(current, Release);
    let _ = slot.compare_exchange(current, own, AcqRel, Acquire);
}

/// `PyCode_Type.tp_dealloc` while memsnap is loaded: the interpreter's own, once the writer
/// has read the events that may name `code`.
///
/// # Safety
/// As CPython's `tp_dealloc`: `code` is a code object whose last reference just went.
unsafe extern "C" fn code_dealloc(code: *mut c_void) {
    wait_until_read();
    // Before the memory can hold another code object.
    CODE_FREES.0.fetch_add(1, Release);
    // Stored before this function was: found at once (the loop guards weakly ordered
    // processors, where the slot's new value could be seen first).
    let mut real = CODE_DEALLOC.load(Acquire);
    while real == 0 {
        std::hint::spin_loop();
        real = CODE_DEALLOC.load(Acquire);
    }
    // SAFETY: `real` is the interpreter's `tp_dealloc` for code objects, called as CPython
    // would have called it.
    unsafe {
        let real: unsafe extern "C" fn(*mut c_void) = std::mem::transmute(real);
        real(code)
    }
}
