//! Symbol lookup: glibc's own `dlsym`, and our exported `dlsym`, which routes lookups of
//! hooked driver symbols to their wrappers.
//!
//! Hot only for programs that look driver functions up by name in a loop (rare); the
//! `RTLD_NEXT` path is a tail jump that adds two instructions.

use super::ffi::FnDlsym;
use super::routing;
use crate::channel::handshake::ROUTED;
use std::ffi::{CStr, c_char, c_void};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicPtr, Ordering::*};

/// glibc's `dlsym`, found with `dlvsym` (never through the public `dlsym`, which is ours).
static REAL_DLSYM: AtomicPtr<c_void> = AtomicPtr::new(null_mut());

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

/// Runs when the library is loaded: finds glibc's dlsym before anyone asks for a symbol.
extern "C" fn on_load() {
    let _ = init_real_dlsym();
}

#[used]
#[unsafe(link_section = ".init_array")]
static ON_LOAD: extern "C" fn() = on_load;

/// Our exported `dlsym`. `RTLD_NEXT` lookups are a tail jump to glibc so that glibc sees
/// the original caller's return address (RTLD_NEXT is relative to the caller); every
/// other lookup goes through [`dlsym_route`].
#[cfg(target_arch = "x86_64")]
#[unsafe(naked)]
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    core::arch::naked_asm!(
        "cmp rdi, -1",
        "jne {route}",
        "mov rax, qword ptr [rip + {real}]",
        "test rax, rax",
        "je {route}",
        "jmp rax",
        route = sym dlsym_route,
        real = sym REAL_DLSYM,
    )
}

/// Non-x86-64 targets: same routing, without the caller-preserving tail jump.
#[cfg(not(target_arch = "x86_64"))]
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    // SAFETY: forwarding the caller's own arguments.
    unsafe { dlsym_route(handle, symbol) }
}

unsafe extern "C" fn dlsym_route(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    let Some(real) = init_real_dlsym() else {
        return null_mut();
    };
    // SAFETY: the caller's arguments, forwarded unchanged.
    let p = unsafe { real(handle, symbol) };
    if p.is_null() || symbol.is_null() {
        return p;
    }
    // SAFETY: `symbol` is the caller's NUL-terminated name (glibc just read it too).
    let name = unsafe { CStr::from_ptr(symbol) }.to_bytes();
    // Cheap filter first: every driver symbol we route starts with "cu" but not "cuda".
    if name.len() < 3 || &name[..2] != b"cu" || name.starts_with(b"cuda") {
        return p;
    }
    if routing::driver_hook_by_name(name).is_none() {
        return p;
    }
    // The pointer came from the library that defines a hooked driver symbol: that is the
    // driver, whatever its file is called (or our own export, for RTLD_DEFAULT lookups).
    // Learn the driver's real pointers from it.
    routing::ensure_driver_table(p);
    let routed = routing::route_driver_pointer(p);
    if routed != p {
        ROUTED.dlsym.fetch_add(1, Relaxed);
    }
    routed
}
