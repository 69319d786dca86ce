//! glibc's own `dlsym`: how memsnap finds any real function, since the public `dlsym` of
//! the process is memsnap's own hook.
//!
//! Process-wide state (one pointer, found with `dlvsym` when the library is loaded, or on
//! first use). Hot only as one atomic load: the exported `dlsym` (`exports.rs`) tail-jumps
//! through [`REAL_DLSYM`], the routing table and the signal hooks call [`real_dlsym`]. Also
//! glibc's `dlclose` ([`real_dlclose`]), for memsnap's own calls.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicPtr, Ordering::*};

/// glibc's `dlsym`.
pub type FnDlsym = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

/// glibc's `dlsym`, found with `dlvsym` (never through the public `dlsym`, which is ours).
/// Public so that the exported `dlsym`'s assembly can read it.
pub static REAL_DLSYM: AtomicPtr<c_void> = AtomicPtr::new(null_mut());

/// Finds glibc's `dlsym`. Called from the library constructor and lazily.
pub fn init_real_dlsym() -> Option<FnDlsym> {
    let mut p = REAL_DLSYM.load(Acquire);
    if p.is_null() {
        // GLIBC_2.34 is where libdl moved into libc; 2.2.5 is the x86-64 base version and
        // 2.17 the aarch64 one (docs/CUDA.md, "Finding the real dlsym").
        for version in [c"GLIBC_2.34", c"GLIBC_2.2.5", c"GLIBC_2.17"] {
            // SAFETY: dlvsym with valid NUL-terminated strings; RTLD_NEXT is a valid handle.
            p = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), version.as_ptr()) };
            if !p.is_null() {
                break;
            }
        }
        if p.is_null() {
            return None;
        }
        REAL_DLSYM.store(p, Release);
    }
    // SAFETY: `p` is glibc's dlsym, whose signature is `FnDlsym`.
    Some(unsafe { std::mem::transmute::<*mut c_void, FnDlsym>(p) })
}

/// glibc's `dlsym`; memsnap never calls the public symbol (it is our own hook).
///
/// # Safety
/// `handle` is `RTLD_DEFAULT`, `RTLD_NEXT` or a live handle returned by `dlopen`.
pub unsafe fn real_dlsym(handle: *mut c_void, name: &CStr) -> *mut c_void {
    match init_real_dlsym() {
        // SAFETY: glibc's dlsym with a valid handle (caller's contract) and a C string.
        Some(f) => unsafe { f(handle, name.as_ptr()) },
        None => null_mut(),
    }
}

/// glibc's `dlclose`, found on first use.
static REAL_DLCLOSE: AtomicPtr<c_void> = AtomicPtr::new(null_mut());

/// glibc's `dlclose`: memsnap's own calls never go through its exported `dlclose`
/// (`interpose::symbols`), which may wait for the writer.
///
/// # Safety
/// As `dlclose(3)`.
pub unsafe fn real_dlclose(handle: *mut c_void) -> c_int {
    let mut p = REAL_DLCLOSE.load(Acquire);
    if p.is_null() {
        // SAFETY: RTLD_NEXT from memsnap's own code: the `dlclose` after memsnap's, glibc's.
        p = unsafe { real_dlsym(libc::RTLD_NEXT, c"dlclose") };
        if p.is_null() {
            return -1;
        }
        REAL_DLCLOSE.store(p, Release);
    }
    // SAFETY: `p` is glibc's dlclose; the handle is the caller's (caller's contract).
    unsafe {
        let f: unsafe extern "C" fn(*mut c_void) -> c_int = std::mem::transmute(p);
        f(handle)
    }
}

/// Runs when the library is loaded: finds glibc's dlsym before anyone asks for a symbol.
extern "C" fn on_load() {
    let _ = init_real_dlsym();
}

#[used]
#[unsafe(link_section = ".init_array")]
static ON_LOAD: extern "C" fn() = on_load;
