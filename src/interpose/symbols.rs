//! Symbol lookup by name: the body of our exported `dlsym` (declared in `exports.rs`),
//! which routes lookups of hooked driver symbols to their wrappers.
//!
//! Hot only for programs that look driver functions up by name in a loop (rare); the
//! `RTLD_NEXT` path never gets here (the export tail-jumps to glibc, two instructions).

use super::routing;
use crate::channel::handshake::ROUTED;
use crate::process::dlsym::init_real_dlsym;
use std::ffi::{CStr, c_char, c_void};
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
