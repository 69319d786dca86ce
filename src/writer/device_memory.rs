//! The driver's free memory per device when a snapshot is written: with the device's
//! capacity, what CUDA contexts and other processes hold beyond what memsnap recorded.
//!
//! Cold (writer thread, once per snapshot and device). Asks the real driver directly (glibc's
//! `dlsym` on the loaded `libcuda.so.1`: no hook is involved), through the device's primary
//! context, and only when the program already made that context active: memsnap never
//! creates a context, and at exit, once the program's contexts are gone, it asks nothing.

use crate::process::dlsym::real_dlsym;
use std::ffi::{CStr, c_int, c_uint, c_void};

type CuDeviceGet = unsafe extern "C" fn(*mut c_int, c_int) -> c_int;
type CuPrimaryCtxGetState = unsafe extern "C" fn(c_int, *mut c_uint, *mut c_int) -> c_int;
type CuPrimaryCtxRetain = unsafe extern "C" fn(*mut *mut c_void, c_int) -> c_int;
type CuPrimaryCtxRelease = unsafe extern "C" fn(c_int) -> c_int;
type CuCtxSetCurrent = unsafe extern "C" fn(*mut c_void) -> c_int;
type CuMemGetInfo = unsafe extern "C" fn(*mut usize, *mut usize) -> c_int;

/// Free bytes on device `ordinal` now, if the driver is loaded and the program's context on
/// that device is active.
pub fn free_bytes(ordinal: i32) -> Option<u64> {
    // SAFETY: NOLOAD only looks the driver up among loaded libraries.
    let handle = unsafe {
        libc::dlopen(
            c"libcuda.so.1".as_ptr(),
            libc::RTLD_NOLOAD | libc::RTLD_LAZY,
        )
    };
    if handle.is_null() {
        return None;
    }
    let free = query(handle, ordinal);
    // SAFETY: balances the NOLOAD dlopen; the program keeps the driver loaded.
    unsafe { crate::process::dlsym::real_dlclose(handle) };
    free
}

fn query(handle: *mut c_void, ordinal: i32) -> Option<u64> {
    let find = |name: &CStr| {
        // SAFETY: `handle` is live (the caller's NOLOAD dlopen).
        let p = unsafe { real_dlsym(handle, name) };
        (!p.is_null()).then_some(p)
    };
    let (get, state, retain, release, set_current, info) =
        // SAFETY: each transmute gives a driver function of that name its signature
        // (cuda.h); all are pointer-sized.
        unsafe {
        (
            std::mem::transmute::<*mut c_void, CuDeviceGet>(find(c"cuDeviceGet")?),
            std::mem::transmute::<*mut c_void, CuPrimaryCtxGetState>(find(
                c"cuDevicePrimaryCtxGetState",
            )?),
            std::mem::transmute::<*mut c_void, CuPrimaryCtxRetain>(find(
                c"cuDevicePrimaryCtxRetain",
            )?),
            std::mem::transmute::<*mut c_void, CuPrimaryCtxRelease>(
                find(c"cuDevicePrimaryCtxRelease_v2")
                    .or_else(|| find(c"cuDevicePrimaryCtxRelease"))?,
            ),
            std::mem::transmute::<*mut c_void, CuCtxSetCurrent>(find(c"cuCtxSetCurrent")?),
            std::mem::transmute::<*mut c_void, CuMemGetInfo>(find(c"cuMemGetInfo_v2")?),
        )
    };
    let (mut device, mut flags, mut active) = (0, 0, 0);
    let mut ctx: *mut c_void = std::ptr::null_mut();
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: the driver's functions with valid out-pointers; the context made current is
    // this (writer) thread's own setting, undone before returning.
    unsafe {
        if get(&mut device, ordinal) != 0
            || state(device, &mut flags, &mut active) != 0
            || active == 0
        {
            return None;
        }
        if retain(&mut ctx, device) != 0 {
            return None;
        }
        let ok = set_current(ctx) == 0 && info(&mut free, &mut total) == 0;
        set_current(std::ptr::null_mut());
        release(device);
        ok.then_some(free as u64)
    }
}
