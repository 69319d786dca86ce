//! The calling thread's Python frames, read without the GIL (docs/DESIGN.md, decision 2).
//!
//! Hot. The thread sits in our hook, so its own frame chain cannot change under us; we read
//! it with the frame layout of the running CPython (3.10–3.13; the offsets are in
//! [`super::cpython`]), chosen once from the interpreter's version. Each frame becomes a
//! [`PyFrameRaw`]: the code object's address, the raw instruction position (3.10:
//! `f_lasti`; 3.11+: the instruction pointer) and `co_firstlineno` as a check value; the
//! writer turns them into file, function and line.
//!
//! One-time resolution (first capture in the process): `dlsym` of `Py_IsInitialized`,
//! `PyGILState_GetThisThreadState` and the version (`Py_Version`, or `Py_GetVersion()` on
//! 3.10). Steady state: two calls into CPython that only read globals / a TSS key, then plain
//! loads along the chain. No Python API that needs the GIL is ever called.

use super::cpython::FRAME_OWNED_BY_CSTACK;
pub use super::cpython::Layout;
use crate::channel::event::{PyFrameRaw, StackSlot, python_term};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};

/// `PyFrameRaw::flags` bit: the first frame its `_PyEval_EvalFrameDefault` call ran.
pub const FLAG_ENTRY: u32 = 1;

/// Resolution state, in [`STATE`].
const UNRESOLVED: u8 = 0;
/// No CPython in the process (yet): no Python frames.
const ABSENT: u8 = 1;
/// A CPython whose version memsnap has no layout for (the writer warns once).
const UNSUPPORTED: u8 = 2;
/// Resolved: [`LAYOUT`], [`GET_TSTATE`] and [`IS_INITIALIZED`] are set.
const READY: u8 = 3;

static STATE: AtomicU8 = AtomicU8::new(UNRESOLVED);
static LAYOUT: AtomicU8 = AtomicU8::new(0);
static GET_TSTATE: AtomicUsize = AtomicUsize::new(0);
static IS_INITIALIZED: AtomicUsize = AtomicUsize::new(0);
/// `major << 8 | minor` of the interpreter found, for the writer's messages.
static VERSION: AtomicUsize = AtomicUsize::new(0);
static FREE_THREADED: AtomicBool = AtomicBool::new(false);

/// What the hook found out about the interpreter (for the writer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Interpreter {
    /// Not resolved yet, or no CPython in the process.
    None,
    /// Python frames are captured with this layout.
    Supported(Layout, u32, u32),
    /// Python frames are off: no layout for this version (or a free-threaded build: true).
    Unsupported(u32, u32, bool),
}

pub fn interpreter() -> Interpreter {
    let v = VERSION.load(Ordering::Relaxed) as u32;
    let (major, minor) = (v >> 8, v & 0xff);
    match STATE.load(Ordering::Acquire) {
        READY => match Layout::from_u8(LAYOUT.load(Ordering::Relaxed)) {
            Some(l) => Interpreter::Supported(l, major, minor),
            None => Interpreter::None,
        },
        UNSUPPORTED => {
            Interpreter::Unsupported(major, minor, FREE_THREADED.load(Ordering::Relaxed))
        }
        _ => Interpreter::None,
    }
}

/// Forget a failed lookup so the next capture looks again (the writer calls this after the
/// module table changed: CPython may have been loaded since).
pub fn retry_if_absent() {
    let _ = STATE.compare_exchange(ABSENT, UNRESOLVED, Ordering::AcqRel, Ordering::Relaxed);
}

/// Looks a symbol up in the global scope. In the preloaded library `dlsym` is memsnap's
/// own export, which hands names that are not CUDA driver functions straight to glibc.
pub(crate) fn lookup(name: &std::ffi::CStr) -> usize {
    // SAFETY: RTLD_DEFAULT is always a valid pseudo-handle; `name` is a C string.
    unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) as usize }
}

fn resolve() {
    let get = lookup(c"PyGILState_GetThisThreadState");
    let init = lookup(c"Py_IsInitialized");
    // `_PyRuntime` is CPython's own (PyPy's cpyext exports the API functions but not it).
    let cpython = lookup(c"_PyRuntime") != 0;
    if get == 0 || init == 0 || !cpython {
        STATE.store(ABSENT, Ordering::Release);
        return;
    }
    let Some((major, minor)) = version() else {
        STATE.store(ABSENT, Ordering::Release);
        return;
    };
    VERSION.store(
        ((major as usize) << 8) | (minor as usize & 0xff),
        Ordering::Relaxed,
    );
    // Free-threaded builds (3.13t+) have other object layouts; these functions exist only
    // there. No Python frames rather than reads at wrong offsets.
    let free_threaded =
        lookup(c"_Py_DecRefShared") != 0 || lookup(c"_Py_MergeZeroLocalRefcount") != 0;
    FREE_THREADED.store(free_threaded, Ordering::Relaxed);
    match Layout::from_version(major, minor).filter(|_| !free_threaded) {
        Some(layout) => {
            LAYOUT.store(layout as u8, Ordering::Relaxed);
            GET_TSTATE.store(get, Ordering::Relaxed);
            IS_INITIALIZED.store(init, Ordering::Relaxed);
            STATE.store(READY, Ordering::Release);
        }
        None => STATE.store(UNSUPPORTED, Ordering::Release),
    }
}

/// The interpreter's (major, minor) version.
fn version() -> Option<(u32, u32)> {
    let v = lookup(c"Py_Version");
    if v != 0 {
        // SAFETY: `Py_Version` (3.11+) is a `const unsigned long` in the interpreter.
        let hex: u64 = unsafe { *(v as *const libc::c_ulong) };
        return Some((((hex >> 24) & 0xff) as u32, ((hex >> 16) & 0xff) as u32));
    }
    let f = lookup(c"Py_GetVersion");
    if f == 0 {
        return None;
    }
    // SAFETY: `const char *Py_GetVersion(void)` formats into a static buffer; no GIL needed.
    let s = unsafe {
        let f: extern "C" fn() -> *const libc::c_char = std::mem::transmute(f);
        let p = f();
        if p.is_null() {
            return None;
        }
        std::ffi::CStr::from_ptr(p)
    };
    let s = s.to_bytes();
    let mut parts = s.split(|&b| b == b'.' || b == b' ');
    let num = |b: Option<&[u8]>| -> Option<u32> { std::str::from_utf8(b?).ok()?.parse().ok() };
    Some((num(parts.next())?, num(parts.next())?))
}

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

/// The check value of a code object: its first line mixed with the addresses of its
/// `co_filename` and `co_name` and a serial: `co_version` on 3.12+, the name's cached
/// hash on 3.10/3.11. Another code object that reuses a freed one's address (its strings
/// may be recycled too) is then told apart. The writer recomputes it from the object.
#[inline(always)]
pub fn check_value(firstlineno: i32, filename: u64, name: u64, serial: u32) -> u32 {
    let h = (name ^ filename.rotate_left(32)) >> 4;
    (firstlineno as u32) ^ (h as u32) ^ ((h >> 32) as u32) ^ serial.wrapping_mul(0x9e37_79b1)
}

#[inline(always)]
pub fn fold(v: u64) -> u32 {
    (v as u32) ^ ((v >> 32) as u32)
}

/// Upper bound on frames visited (shim frames included): bounded work on any chain.
const MAX_VISITS: usize = 1024;

/// Whether the interpreter's symbols were looked up already (or found absent): a capture
/// then needs no `dlsym`, which is what a signal handler may rely on.
pub fn resolved() -> bool {
    STATE.load(Ordering::Acquire) != UNRESOLVED
}

/// Fills `slot.python`, innermost first. Sets `slot.truncated` when frames were left out.
/// Returns the records' [`python_sum`](crate::channel::event::python_sum), added up as they
/// were written.
#[inline]
pub fn capture(slot: &mut StackSlot, max_frames: usize) -> u64 {
    slot.n_python = 0;
    let mut state = STATE.load(Ordering::Acquire);
    if state == UNRESOLVED {
        resolve();
        state = STATE.load(Ordering::Acquire);
    }
    if state != READY {
        return 0;
    }
    let Some(layout) = Layout::from_u8(LAYOUT.load(Ordering::Relaxed)) else {
        return 0;
    };
    let init = IS_INITIALIZED.load(Ordering::Relaxed);
    let get = GET_TSTATE.load(Ordering::Relaxed);
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
    // Python frames: 1,112 per walk before, 850 now with the walk's prologue included).
    let out = &mut slot.python[..max];
    // SAFETY: `tstate` is this thread's live PyThreadState and the frames along its chain
    // belong to this thread, which is inside our hook: nothing frees or moves them while
    // we read. Offsets are those of the interpreter's version (checked against its headers).
    let (n, more, sum) = unsafe {
        match layout {
            Layout::Py310 => walk(Layout::Py310, tstate, out),
            Layout::Py311 => walk(Layout::Py311, tstate, out),
            Layout::Py312 => walk(Layout::Py312, tstate, out),
            Layout::Py313 => walk(Layout::Py313, tstate, out),
        }
    };
    slot.n_python = n as u16;
    if more {
        slot.truncated = true;
    }
    sum
}

/// Sets the entry mark of the record at `position`, keeping `sum` (the records' Python hash
/// so far) in step.
#[inline(always)]
fn mark_entry(record: &mut PyFrameRaw, position: usize, sum: &mut u64) {
    if record.flags & FLAG_ENTRY == 0 {
        *sum = sum.wrapping_sub(python_term(record, position));
        record.flags |= FLAG_ENTRY;
        *sum = sum.wrapping_add(python_term(record, position));
    }
}

/// Walks the chain from `tstate` into `out`. Returns (frames written, more frames left out,
/// the records' Python hash).
///
/// # Safety
/// `tstate` must be the calling thread's live `PyThreadState` of an interpreter with `layout`.
#[inline(always)]
unsafe fn walk(layout: Layout, tstate: u64, out: &mut [PyFrameRaw]) -> (usize, bool, u64) {
    let o = layout.table();
    // SAFETY (whole body): every address read is a field of a live structure of this thread
    // at an offset of this version's layout (caller's contract).
    unsafe {
        let mut frame: u64 = match layout {
            Layout::Py310 | Layout::Py313 => rd(tstate.wrapping_add(o.thread.frame)).unwrap_or(0),
            Layout::Py311 | Layout::Py312 => {
                let cframe: u64 = rd(tstate.wrapping_add(o.thread.frame)).unwrap_or(0);
                rd(cframe.wrapping_add(o.thread.cframe_current))
                    .filter(|_| cframe != 0)
                    .unwrap_or(0)
            }
        };
        let mut n = 0usize;
        let mut sum = 0u64;
        let mut visits = 0usize;
        while frame != 0 && visits < MAX_VISITS {
            visits += 1;
            let back: u64 = rd(frame.wrapping_add(o.frame.back)).unwrap_or(0);
            let owner: u8 = match layout {
                Layout::Py310 => 0,
                _ => rd(frame.wrapping_add(o.frame.owner)).unwrap_or(0),
            };
            if matches!(layout, Layout::Py312 | Layout::Py313) && owner == FRAME_OWNED_BY_CSTACK {
                // The frame written just before is the first one that eval call ran.
                if let Some(i) = n.checked_sub(1)
                    && let Some(prev) = out.get_mut(i)
                {
                    mark_entry(prev, i, &mut sum);
                }
                frame = back;
                continue;
            }
            let code: u64 = rd(frame.wrapping_add(o.frame.code)).unwrap_or(0);
            if code == 0 {
                frame = back;
                continue;
            }
            if n >= out.len() {
                return (n, true, sum);
            }
            let instr: u64 = match layout {
                Layout::Py310 => {
                    rd::<i32>(frame.wrapping_add(o.frame.instr)).unwrap_or(-1) as i64 as u64
                }
                _ => rd(frame.wrapping_add(o.frame.instr)).unwrap_or(0),
            };
            let entry = match layout {
                Layout::Py310 => true,
                Layout::Py311 => rd::<u8>(frame.wrapping_add(o.frame.is_entry)).unwrap_or(0) != 0,
                _ => false,
            };
            let firstlineno: i32 = rd(code.wrapping_add(o.code.firstlineno)).unwrap_or(0);
            let filename: u64 = rd(code.wrapping_add(o.code.filename)).unwrap_or(0);
            let name: u64 = rd(code.wrapping_add(o.code.name)).unwrap_or(0);
            let serial: u32 = match o.code.version {
                // 3.10/3.11 have no serial: use the cached hash of the name string
                // (`PyASCIIObject.hash`), which differs for different names even when
                // a freed name's address is recycled.
                0 => fold(rd::<u64>(name.wrapping_add(o.str_.hash)).unwrap_or(0)),
                off => rd(code.wrapping_add(off)).unwrap_or(0),
            };
            if let Some(slot) = out.get_mut(n) {
                *slot = PyFrameRaw {
                    code,
                    instr,
                    check: check_value(firstlineno, filename, name, serial),
                    flags: if entry { FLAG_ENTRY } else { 0 },
                };
                sum = sum.wrapping_add(python_term(slot, n));
                n += 1;
            }
            frame = back;
        }
        // The outermost frame was entered from C whatever the version says.
        if let Some(i) = n.checked_sub(1)
            && let Some(last) = out.get_mut(i)
        {
            mark_entry(last, i, &mut sum);
        }
        (n, frame != 0, sum)
    }
}
