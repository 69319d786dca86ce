//! The running CPython, found at run time: whether there is one, its version, the layout
//! memsnap reads it with, and the two interpreter functions a capture calls.
//!
//! Process-wide state both sides read. The hook side resolves it on its first Python capture
//! (`dlsym` of `Py_IsInitialized`, `PyGILState_GetThisThreadState`, the version:
//! `Py_Version`, or `Py_GetVersion()` on 3.10) and then only loads it ([`runtime`]: hot, a
//! few relaxed atomic loads); the writer reads [`interpreter`] to warn about an unsupported
//! Python and [`lookup`]s `PyCode_Type`, and calls [`retry_if_absent`] after the module table
//! changed (CPython may have been loaded since).

use super::cpython::Layout;
use super::hook_line::HOOK_LINE;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};

/// Resolution state, in [`STATE`].
const UNRESOLVED: u8 = 0;
/// No CPython in the process (yet): no Python frames.
const ABSENT: u8 = 1;
/// A CPython whose version memsnap has no layout for (the writer warns once).
const UNSUPPORTED: u8 = 2;
/// Resolved: [`LAYOUT`], [`GET_TSTATE`] and [`IS_INITIALIZED`] are set.
const READY: u8 = 3;

// What a capture reads, on the line every hooked call reads (`process::hook_line`).
const STATE: &AtomicU8 = &HOOK_LINE.python_state;
const _: () = assert!(UNRESOLVED == 0); // the line's initial value
const LAYOUT: &AtomicU8 = &HOOK_LINE.python_layout;
const FRAME_BACK: &AtomicU8 = &HOOK_LINE.python_frame_back;
const GET_TSTATE: &AtomicUsize = &HOOK_LINE.python_get_tstate;
const IS_INITIALIZED: &AtomicUsize = &HOOK_LINE.python_is_initialized;
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
pub fn lookup(name: &std::ffi::CStr) -> usize {
    // SAFETY: RTLD_DEFAULT is always a valid pseudo-handle; `name` is a C string.
    unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) as usize }
}

fn resolve(on_found: impl FnOnce(Layout)) {
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
            FRAME_BACK.store(frame_back_of(layout), Ordering::Relaxed);
            GET_TSTATE.store(get, Ordering::Relaxed);
            IS_INITIALIZED.store(init, Ordering::Relaxed);
            // Before the first capture reads a frame.
            on_found(layout);
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

/// Whether the interpreter's symbols were looked up already (or found absent): a capture
/// then needs no `dlsym`, which is what a signal handler may rely on.
pub fn resolved() -> bool {
    STATE.load(Ordering::Acquire) != UNRESOLVED
}

/// `layout`'s offset of a frame's pointer to the next frame, as the hook line keeps it
/// (every supported layout's fits a byte: `every_layouts_frame_back_fits_the_hook_line`).
fn frame_back_of(layout: Layout) -> u8 {
    u8::try_from(layout.table().frame.back).unwrap_or(0)
}

/// For the prefetch before a walk: the offset of a frame's pointer to the next one in the
/// resolved interpreter's layout, or `None` before the interpreter is resolved (the first
/// capture resolves it) and where there is none. Two loads of the hook line.
#[inline(always)]
pub fn frame_back() -> Option<u64> {
    if STATE.load(Ordering::Acquire) != READY {
        return None;
    }
    Some(u64::from(FRAME_BACK.load(Ordering::Relaxed)))
}

/// What a capture needs of a resolved interpreter: its layout and the addresses of
/// `Py_IsInitialized` and `PyGILState_GetThisThreadState`.
#[derive(Clone, Copy)]
pub struct Runtime {
    pub layout: Layout,
    pub is_initialized: usize,
    pub get_tstate: usize,
}

/// The interpreter for a capture, resolving it on the first call in the process (then
/// `on_found` is given its layout, before any frame is read); `None` when there is no
/// supported CPython. Hot: after the first call, four atomic loads.
#[inline(always)]
pub fn runtime(on_found: impl FnOnce(Layout)) -> Option<Runtime> {
    let mut state = STATE.load(Ordering::Acquire);
    if state == UNRESOLVED {
        resolve(on_found);
        state = STATE.load(Ordering::Acquire);
    }
    if state != READY {
        return None;
    }
    let layout = Layout::from_u8(LAYOUT.load(Ordering::Relaxed))?;
    Some(Runtime {
        layout,
        is_initialized: IS_INITIALIZED.load(Ordering::Relaxed),
        get_tstate: GET_TSTATE.load(Ordering::Relaxed),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_layouts_frame_back_fits_the_hook_line() {
        for layout in Layout::ALL {
            let back = layout.table().frame.back;
            assert_eq!(u64::from(frame_back_of(layout)), back, "{layout:?}");
        }
    }
}
