//! The process-wide values that hooked calls read on every event, gathered on one cache
//! line: the recording switch, the recorder and its settings, the event clock's source,
//! the driver's device query, whether the process sees one device only, the devices whose
//! total memory is known, whether PyTorch's block events are recorded and where its trace
//! entries hold what the tracker reads, whether stream-ordered allocations still look for
//! PyTorch's allocator, the interpreter's resolved functions and frame layout, where each
//! thread's hook state lies from its thread pointer, whether attaching the optimizer step
//! hook is due, and the benchmarks' pass-through switch.
//!
//! Hot: read (relaxed or acquire loads) by every hooked call. Each value belongs to the
//! module that gives it a meaning (`channel::recording`, `clock`, `interpose::device`,
//! `record`, `allocator_route`, `python`, `channel::thread`, `guard`, `pytorch`,
//! `step_marks`), which reads and writes it only through its own functions; this room only
//! decides where they live. Why one line: in a
//! real program the work between two events pushes memsnap's lines out of the nearer
//! caches, and each line an event reads is one more wait; as separate statics these values
//! sat on three to five lines, and the recorder's settings, the device query and the
//! device totals on three more (docs/HOT-PATH.md, "The recording floor", "The lines of a
//! stackless event").

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicIsize, AtomicPtr, AtomicU8, AtomicU64, AtomicUsize};

/// The values; see the module's text. Written rarely (once per process, or at a switch),
/// so the line stays shared in every core's cache.
#[repr(C, align(64))]
pub struct HookLine {
    /// `channel::recording`: the recorder hooks send on (null until published), a
    /// `channel::queue::Recorder` (untyped here: this room imports nothing above it).
    pub recorder: AtomicPtr<c_void>,
    /// `python`: `PyGILState_GetThisThreadState`, once resolved.
    pub python_get_tstate: AtomicUsize,
    /// `python`: `Py_IsInitialized`, once resolved.
    pub python_is_initialized: AtomicUsize,
    /// `channel::thread`: the hook state's offset from the thread pointer (0 until the first hooked
    /// call reads it from the global offset table: `initial_exec`).
    pub hook_thread_offset: AtomicIsize,
    /// `interpose::device`: the driver's `cuCtxGetDevice`, once found (the device query
    /// every recorded CUDA allocation makes).
    pub device_query: AtomicPtr<c_void>,
    /// `record`: bit `d` set once device `d`'s total memory is remembered (for devices
    /// 0-63: the handshake's slots).
    pub devices_with_total: AtomicU64,
    /// `interpose::device`: the driver said the process sees one device (so every
    /// allocation is on device 0, and the device query is not made).
    pub one_device: AtomicBool,
    /// `channel::recording`: the recorder's stack mode, frame limit and context, stored before the
    /// recorder is published (its own copy is on a line of its own).
    pub recorder_stacks: AtomicU8,
    pub recorder_max_frames: AtomicU8,
    pub recorder_context_all: AtomicBool,
    /// `channel::recording`: the switch's state.
    pub recording: AtomicU8,
    /// `clock`: what a stamp counts.
    pub clock_source: AtomicU8,
    /// `python`: whether the interpreter was looked up and found.
    pub python_state: AtomicU8,
    /// `python`: the frame layout it is read with.
    pub python_layout: AtomicU8,
    /// `python`: where that layout's frames keep their pointer to the next frame (the
    /// prefetch before a walk reads no table of offsets for it).
    pub python_frame_back: AtomicU8,
    /// `allocator_route`: whether the tracker records PyTorch's block events.
    pub block_events: AtomicBool,
    /// `allocator_route`: stream-ordered allocations stopped looking for PyTorch's
    /// allocator (found and decided on, or not there when they last looked).
    pub stream_allocations_done_looking: AtomicBool,
    /// `pytorch`: the number of the trace entries' layout the tracker reads them with
    /// (`pytorch::layout::by_number`; 0 until the tracker is attached).
    pub trace_entry_layout: AtomicU8,
    /// `guard` (benchmarks only): every thread's hooked calls pass through unrecorded.
    pub every_thread_passing_through: AtomicBool,
    /// `step_marks`: an attempt to attach the optimizer step hook is due.
    pub optimizer_hook_due: AtomicBool,
}

const _: () = assert!(size_of::<HookLine>() == 64);

/// The one line. Every value starts at its module's "nothing yet" (zero), except block
/// events, recorded until the writer finds them inconsistent.
pub static HOOK_LINE: HookLine = HookLine {
    recorder: AtomicPtr::new(std::ptr::null_mut()),
    python_get_tstate: AtomicUsize::new(0),
    python_is_initialized: AtomicUsize::new(0),
    hook_thread_offset: AtomicIsize::new(0),
    device_query: AtomicPtr::new(std::ptr::null_mut()),
    devices_with_total: AtomicU64::new(0),
    one_device: AtomicBool::new(false),
    recorder_stacks: AtomicU8::new(0),
    recorder_max_frames: AtomicU8::new(0),
    recorder_context_all: AtomicBool::new(false),
    recording: AtomicU8::new(0),
    clock_source: AtomicU8::new(0),
    python_state: AtomicU8::new(0),
    python_layout: AtomicU8::new(0),
    python_frame_back: AtomicU8::new(0),
    block_events: AtomicBool::new(true),
    stream_allocations_done_looking: AtomicBool::new(false),
    trace_entry_layout: AtomicU8::new(0),
    every_thread_passing_through: AtomicBool::new(false),
    optimizer_hook_due: AtomicBool::new(false),
};
