//! Symbol lookup by name: the body of our exported `dlsym` (declared in `exports.rs`),
//! which routes lookups of hooked driver symbols to their wrappers; and of our `dlclose`,
//! which unloads a library once the writer has read the events that may name it.
//!
//! Hot only for programs that look driver functions up by name in a loop (rare); the
//! `RTLD_NEXT` path never gets here (the export tail-jumps to glibc, two instructions).
//! `dlclose` is cold.

use super::routing;
use crate::channel::handshake::ROUTED;
use crate::process::dlsym::{init_real_dlsym, real_dlclose};
use std::ffi::{CStr, c_char, c_int, c_void};
use std::ptr::null_mut;
use std::sync::atomic::Ordering::*;

/// What the exported `dlsym` (`exports.rs`) calls for every lookup but the `RTLD_NEXT` ones
/// it hands straight to glibc: glibc's answer, with a hooked driver pointer swapped for
/// its wrapper.
///
/// # Safety
/// As `dlsym(3)`: `symbol` is null or a NUL-terminated string.
pub unsafe extern "C" fn dlsym_route(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
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

/// What the exported `dlclose` (`exports.rs`) calls: the library is unloaded once the writer
/// has read the events whose stacks may be in it (it notes each address's module as it
/// interns a stack), and the module table is rebuilt before the next stack is interned
/// (docs/CPYTHON.md, "Code freed after an event").
///
/// # Safety
/// As `dlclose(3)`.
pub unsafe fn dlclose_after_read(handle: *mut c_void) -> c_int {
    // A call the real CUDA functions make inside a hook does not wait.
    if !crate::guard::inside_hook_or_internal() {
        crate::channel::keep::wait_until_read();
    }
    // SAFETY: the caller's handle (caller's contract).
    let rc = unsafe { real_dlclose(handle) };
    if crate::channel::recording::is_active() {
        crate::process::modules::mark_stale();
    }
    rc
}
