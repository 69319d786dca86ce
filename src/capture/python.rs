//! The calling thread's Python frames, read without the GIL (docs/DESIGN.md, decision 2).
//!
//! Hot. The thread sits in our hook, so its own frame chain cannot change under us; we read
//! it with the frame layout of the running CPython (3.10–3.14; the offsets are in
//! [`crate::process::cpython`]), which `process::python` chose once from the interpreter's
//! version. Each frame becomes a [`PyFrameRaw`]: the code object's address, the raw
//! instruction position (3.10: `f_lasti`; 3.11+: the instruction pointer) and a check value
//! ([`check_value`]); the writer turns them into file, function and line.
//!
//! Steady state: two calls into CPython that only read globals / a TSS key, then plain
//! loads along the chain. No Python API that needs the GIL is ever called. The one-time
//! lookup of the interpreter is `process::python`'s.

use crate::channel::event::{PyFrameRaw, StackSlot, python_sum};
use crate::process::cpython::{
    FLAG_ENTRY, FRAME_OWNED_BY_CSTACK, FRAME_OWNED_BY_INTERPRETER_314, Layout,
    STACKREF_TAG_BITS_314, check_value, fold,
};
use crate::process::python;

/// Reads a `T` at `addr`. Returns `None` for null.
///
/// # Safety
/// `addr` must be null or point to readable memory holding a `T`.
#[inline(always)]
unsafe fn rd<T: Copy>(addr: u64) -> Option<T> {
    if addr == 0 {
        return None;
    }
    // SAFETY: caller's contract.
    Some(unsafe { std::ptr::read_unaligned(addr as *const T) })
}

/// Reads the `T` at `base + offset`, for a field of a structure known to be there (`base`
/// is not null): no null test, unlike [`rd`] (callgrind: ten instructions a frame less).
///
/// # Safety
/// `base + offset` must point to readable memory holding a `T`.
#[inline(always)]
unsafe fn field<T: Copy>(base: u64, offset: u64) -> T {
    // SAFETY: caller's contract.
    unsafe { std::ptr::read_unaligned(base.wrapping_add(offset) as *const T) }
}

/// Upper bound on frames skipped (those that are no Python function): with the records'
/// bound, bounded work on any chain.
const MAX_VISITS: usize = 1024;

/// Fills `slot.python`, innermost first. Sets `slot.truncated` when frames were left out.
/// Returns the records' [`python_sum`].
#[inline]
pub fn capture(slot: &mut StackSlot, max_frames: usize) -> u64 {
    slot.n_python = 0;
    let Some(python::Runtime {
        layout,
        is_initialized: init,
        get_tstate: get,
    }) = python::runtime()
    else {
        return 0;
    };
    // SAFETY: both were resolved from the interpreter with these C signatures. Neither
    // needs the GIL: one reads a runtime flag, the other this thread's TSS slot.
    let tstate = unsafe {
        let is_init: extern "C" fn() -> libc::c_int = std::mem::transmute(init);
        if is_init() == 0 {
            return 0;
        }
        let get_ts: extern "C" fn() -> usize = std::mem::transmute(get);
        get_ts() as u64
    };
    if tstate == 0 {
        return 0; // a thread CPython never saw (CUDA's, NCCL's, autograd's): no Python frames
    }
    let max = max_frames.min(slot.python.len());
    // One copy of the walk per layout, each with its offsets and version tests folded into
    // constants: a quarter fewer instructions than one walk reading them (callgrind, 12
    // Python frames: 1,112 per walk before, 850 with the walk's prologue included).
    let out = &mut slot.python[..max];
    // SAFETY: `tstate` is this thread's live PyThreadState and the frames along its chain
    // belong to this thread, which is inside our hook: nothing frees or moves them while
    // we read. Offsets are those of the interpreter's version (checked against its headers).
    let (n, more) = unsafe {
        match layout {
            Layout::Py310 => walk(Layout::Py310, tstate, out),
            Layout::Py311 => walk(Layout::Py311, tstate, out),
            Layout::Py312 => walk(Layout::Py312, tstate, out),
            Layout::Py313 => walk(Layout::Py313, tstate, out),
            Layout::Py314 => walk(Layout::Py314, tstate, out),
        }
    };
    slot.n_python = n as u16;
    super::count!(PythonWalks, 1);
    super::count!(PythonFrames, n);
    if more {
        slot.truncated = true;
    }
    // Hashed in a pass of its own over the records, not term by term in the walk: the
    // walk's loop then keeps its state in registers (callgrind, 12 frames on 3.12: about
    // 300 instructions a walk less), and an entry mark set after its frame was written
    // needs no correction of the sum.
    python_sum(slot.python.get(..n).unwrap_or_default())
}

/// Walks the chain from `tstate` into `out`. Returns (frames written, more frames left out).
///
/// # Safety
/// `tstate` must be the calling thread's live `PyThreadState` of an interpreter with `layout`.
#[inline(always)]
unsafe fn walk(layout: Layout, tstate: u64, out: &mut [PyFrameRaw]) -> (usize, bool) {
    let o = layout.table();
    // SAFETY: for the whole body: every address read is a field of a live structure of this thread
    // at an offset of this version's layout (caller's contract).
    unsafe {
        let mut frame: u64 = match layout {
            Layout::Py310 | Layout::Py313 | Layout::Py314 => {
                rd(tstate.wrapping_add(o.thread.frame)).unwrap_or(0)
            }
            Layout::Py311 | Layout::Py312 => {
                let cframe: u64 = rd(tstate.wrapping_add(o.thread.frame)).unwrap_or(0);
                rd(cframe.wrapping_add(o.thread.cframe_current))
                    .filter(|_| cframe != 0)
                    .unwrap_or(0)
            }
        };
        let mut n = 0usize;
        // Frames that are no Python function, skipped: only they are counted against
        // MAX_VISITS (a chain of them could loop; the records written are bounded by `out`).
        let mut skipped = 0usize;
        // Bit i: record i was the first frame its eval call ran (a shim follows it). Set
        // on the records after the walk, so that the loop keeps no pointer to the record
        // before (callgrind: 8 instructions a frame less).
        let mut entries: u64 = 0;
        let mut more = false;
        while frame != 0 {
            let back: u64 = field(frame, o.frame.back);
            let owner: u8 = match layout {
                Layout::Py310 => 0,
                _ => field(frame, o.frame.owner),
            };
            // 3.14 renumbered the shim (`FRAME_OWNED_BY_INTERPRETER`) and added another
            // frame that is no Python function (`FRAME_OWNED_BY_CSTACK`, one above).
            let shim = match layout {
                Layout::Py312 | Layout::Py313 => owner == FRAME_OWNED_BY_CSTACK,
                Layout::Py314 => owner >= FRAME_OWNED_BY_INTERPRETER_314,
                _ => false,
            };
            let mut code: u64 = field(frame, o.frame.code);
            if layout == Layout::Py314 {
                code &= !STACKREF_TAG_BITS_314; // a `_PyStackRef`: a tagged pointer
            }
            if shim || code == 0 {
                if shim && n > 0 {
                    // The frame written just before is the first one that eval call ran
                    // (`out` holds at most 64 records: FRAME_CAPACITY).
                    entries |= 1u64.wrapping_shl((n - 1) as u32);
                }
                skipped += 1;
                if skipped >= MAX_VISITS {
                    break;
                }
                frame = back;
                continue;
            }
            let Some(record) = out.get_mut(n) else {
                more = true;
                break;
            };
            let instr: u64 = match layout {
                Layout::Py310 => field::<i32>(frame, o.frame.instr) as i64 as u64,
                _ => field(frame, o.frame.instr),
            };
            let entry = match layout {
                Layout::Py310 => true,
                Layout::Py311 => field::<u8>(frame, o.frame.is_entry) != 0,
                _ => false,
            };
            let firstlineno: i32 = field(code, o.code.firstlineno);
            let serial: u32 = match o.code.version {
                0 => 0, // 3.10/3.11: none
                off => field(code, off),
            };
            let check = check_value(firstlineno, serial, || {
                let filename: u64 = field(code, o.code.filename);
                let name: u64 = field(code, o.code.name);
                let name_serial = match o.code.version {
                    0 => fold(rd::<u64>(name.wrapping_add(o.str_.hash)).unwrap_or(0)),
                    _ => 0,
                };
                Some((filename, name, name_serial))
            })
            .unwrap_or(0);
            *record = PyFrameRaw {
                code,
                instr,
                check,
                flags: if entry { FLAG_ENTRY } else { 0 },
            };
            n += 1;
            frame = back;
        }
        // The outermost frame was entered from C whatever the version says.
        if n > 0 && !more {
            entries |= 1u64.wrapping_shl((n - 1) as u32);
        }
        while entries != 0 {
            if let Some(record) = out.get_mut(entries.trailing_zeros() as usize) {
                record.flags |= FLAG_ENTRY;
            }
            entries &= entries - 1;
        }
        (n, more || frame != 0)
    }
}
