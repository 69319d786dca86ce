//! Device queries answered by the real driver: the calling thread's device, the device's
//! free and total memory, and how many devices the process sees.
//!
//! Hot: [`DRIVER`]'s `current()` runs once per recorded allocation: `cuCtxGetDevice`, a
//! thread-local read inside the driver, 30-95 ns in a real training step (docs/HOT-PATH.md,
//! "One device, no device query"), unless the driver said the process sees one device,
//! whose number is 0 in every call. The functions are found with the driver table
//! (routing), never hooked.

use super::ffi::{CUDA_SUCCESS, CuDevice, FnCuCtxGetDevice, FnCuDeviceGetCount, FnCuMemGetInfo};
use crate::process::dlsym::real_dlsym;
use crate::process::hook_line::HOOK_LINE;
use crate::record::Devices;
use std::ffi::{c_int, c_void};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering::*};

/// On the line every hooked call reads (`process::hook_line`): the query runs on every
/// recorded allocation, unless [`ONE_DEVICE`] says it need not.
const REAL_CTX_GET_DEVICE: &AtomicPtr<c_void> = &HOOK_LINE.device_query;
/// On the same line: set once the driver said the process sees exactly one device. The
/// devices a process sees are fixed when the driver initializes (`CUDA_VISIBLE_DEVICES`
/// is read then) and numbered from 0, so with one the answer to every later query is 0.
const ONE_DEVICE: &AtomicBool = &HOOK_LINE.one_device;
static REAL_MEM_GET_INFO: AtomicPtr<c_void> = AtomicPtr::new(null_mut());
static REAL_DEVICE_GET_COUNT: AtomicPtr<c_void> = AtomicPtr::new(null_mut());

/// Looks the query functions up in the driver library behind `handle`.
///
/// # Safety
/// `handle` is a live handle returned by `dlopen`.
pub unsafe fn find_in_driver(handle: *mut c_void) {
    for (slot, name) in [
        (REAL_CTX_GET_DEVICE, c"cuCtxGetDevice"),
        (&REAL_MEM_GET_INFO, c"cuMemGetInfo_v2"),
        (&REAL_DEVICE_GET_COUNT, c"cuDeviceGetCount"),
    ] {
        // SAFETY: the caller's live handle and a C string.
        let p = unsafe { real_dlsym(handle, name) };
        if !p.is_null() {
            slot.store(p, Release);
        }
    }
}

/// The real driver, as [`Devices`] for recording.
pub struct Driver;
pub static DRIVER: Driver = Driver;

impl Devices for Driver {
    #[inline]
    fn current(&self) -> i32 {
        if ONE_DEVICE.load(Relaxed) {
            return 0;
        }
        let p = REAL_CTX_GET_DEVICE.load(Acquire);
        if p.is_null() {
            return 0;
        }
        // SAFETY: `p` is the driver's cuCtxGetDevice.
        let f = unsafe { std::mem::transmute::<*mut c_void, FnCuCtxGetDevice>(p) };
        let mut dev: CuDevice = 0;
        // SAFETY: valid out-pointer; the driver only writes it on success.
        if unsafe { f(&mut dev) } == CUDA_SUCCESS {
            dev
        } else {
            0
        }
    }

    fn memory(&self) -> Option<(u64, u64)> {
        let p = REAL_MEM_GET_INFO.load(Acquire);
        if p.is_null() {
            return None;
        }
        // SAFETY: `p` is the driver's cuMemGetInfo_v2.
        let f = unsafe { std::mem::transmute::<*mut c_void, FnCuMemGetInfo>(p) };
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out-pointers.
        let ok = unsafe { f(&mut free, &mut total) } == CUDA_SUCCESS;
        ok.then_some((free as u64, total as u64))
    }

    #[cold]
    fn count_devices(&self) {
        let p = REAL_DEVICE_GET_COUNT.load(Acquire);
        if p.is_null() {
            return;
        }
        // SAFETY: `p` is the driver's cuDeviceGetCount.
        let f = unsafe { std::mem::transmute::<*mut c_void, FnCuDeviceGetCount>(p) };
        let mut count: c_int = 0;
        // SAFETY: a valid out-pointer.
        if unsafe { f(&mut count) } == CUDA_SUCCESS && count == 1 {
            ONE_DEVICE.store(true, Relaxed);
        }
    }
}
