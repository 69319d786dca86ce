//! Interposition: the ONE table of hooked symbols, with each wrapper's signature, route and
//! recording written once; symbol lookup, routing and device queries in the submodules.
//!
//! Hot. Every CUDA allocation route ends in a wrapper defined here:
//! - exported symbols (PLT calls into libcuda / libcudart);
//! - `dlsym(handle, name)` on libcuda (JAX, statically linked runtimes): [`symbols`];
//! - `cuGetProcAddress{,_v2}`, including the nested lookup of `"cuGetProcAddress"` itself
//!   (how nvcc's static cudart, CuPy and NCCL reach the driver: docs/CUDA.md);
//! - `cudaGetDriverEntryPoint{,ByVersion}` (PyTorch's expandable segments, NCCL).
//!
//! Lookups are routed by the returned pointer ([`routing`]). Return codes and
//! out-parameters are never changed. A wrapper finds the real function, enters the nesting
//! guard, calls it, and records only in the outermost hooked call: frees before the real
//! call, allocations after it returns (docs/FORMAT.md, "Event order": an address can then
//! never be seen allocated twice).
// The exported names must be CUDA's own; the wrappers have exactly the contracts of the
// CUDA functions they stand for (cuda.h / cuda_runtime_api.h) and forward their callers'
// arguments unchanged.
#![allow(non_snake_case, clippy::missing_safety_doc)]

pub mod device;
pub mod ffi;
pub mod routing;
pub mod symbols;

use crate::channel::event::{Api, Kind};
use crate::channel::handshake::ROUTED;
use crate::channel::recording;
use crate::guard::Scope;
use crate::record::{self, Outcome, Sender};
use device::DRIVER;
use ffi::*;
use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void};

/// Driver or runtime: driver pointers are routed through the lookup hooks, runtime
/// wrappers are reached through their exported symbols only.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Layer {
    Driver,
    Runtime,
}

pub struct HookRow {
    pub id: HookId,
    /// NUL-terminated exported name.
    pub name: &'static str,
    pub layer: Layer,
    /// Our wrapper's address.
    pub hook: *const (),
}

// SAFETY: the table is immutable and holds only function addresses and static strings.
unsafe impl Sync for HookRow {}

/// Writes, from one list, the [`HookId`] of each hooked symbol, the [`HOOKS`] table, the
/// real function's type (`real_fn::NAME`, the wrapper's own signature) and the exported
/// wrapper, whose body gets a closure `|real|` that calls the real function with the
/// caller's arguments.
macro_rules! hook_table {
    ($(
        $(#[$doc:meta])*
        $layer:ident fn $sym:ident($($arg:ident : $ty:ty),* $(,)?) |$real:ident| $body:block
    )*) => {
        /// Index of each hooked symbol in [`HOOKS`] and the real-pointer slots.
        #[allow(non_camel_case_types, clippy::upper_case_acronyms)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        #[repr(usize)]
        pub enum HookId { $($sym),* }

        pub const HOOK_COUNT: usize = [$(stringify!($sym)),*].len();

        pub static HOOKS: [HookRow; HOOK_COUNT] = [
            $(HookRow {
                id: HookId::$sym,
                name: concat!(stringify!($sym), "\0"),
                layer: Layer::$layer,
                hook: $sym as *const (),
            }),*
        ];

        /// The real function's type of each hook, taken from its wrapper's signature.
        #[allow(non_camel_case_types)]
        pub mod real_fn {
            use super::*;
            $(pub type $sym = unsafe extern "C" fn($($ty),*) -> CuResult;)*
        }

        $(
            $(#[$doc])*
            #[cfg_attr(not(test), unsafe(no_mangle))]
            pub unsafe extern "C" fn $sym($($arg: $ty),*) -> CuResult {
                #[allow(unused_variables)]
                let $real = || -> CuResult {
                    // SAFETY: `real_fn::$sym` is this symbol's own signature.
                    match unsafe { routing::real::<real_fn::$sym>(HookId::$sym) } {
                        // SAFETY: the caller's arguments, forwarded unchanged to the real
                        // function of the same signature.
                        Some(f) => unsafe { f($($arg),*) },
                        None => CUDA_ERROR_NOT_FOUND,
                    }
                };
                $body
            }
        )*
    };
}

/// Calls the real function, then records through `record` in the outermost hooked call.
#[inline(always)]
fn record_after(
    real: impl FnOnce() -> CuResult,
    record: impl FnOnce(Sender, CuResult),
) -> CuResult {
    let scope = Scope::enter();
    let r = real();
    if scope.outermost()
        && let Some(rec) = recording::recorder()
    {
        let thread = scope.thread();
        record(Sender { rec, thread }, r);
        crate::pytorch::optimizer::attach_if_due(thread);
    }
    r
}

/// Records through `record` in the outermost hooked call, then calls the real function
/// (frees: the address is still ours while the event is sent).
#[inline(always)]
fn record_before(real: impl FnOnce() -> CuResult, record: impl FnOnce(Sender)) -> CuResult {
    let scope = Scope::enter();
    if scope.outermost()
        && let Some(rec) = recording::recorder()
    {
        let thread = scope.thread();
        record(Sender { rec, thread });
    }
    real()
}

/// An allocating call: records `(addr, size, stream)` as `describe` reads them from the
/// out-parameters after the call.
#[inline(always)]
fn allocating(
    real: impl FnOnce() -> CuResult,
    kind: Kind,
    api: Api,
    describe: impl FnOnce(CuResult) -> (u64, u64, u64),
) -> CuResult {
    record_after(real, |by, r| {
        let (addr, size, stream) = describe(r);
        record::allocation(by, &DRIVER, outcome(r), kind, api, addr, size, stream);
    })
}

/// A stream-ordered allocating call (`cudaMallocAsync`, `cuMemAllocAsync` and their pool
/// forms): as [`allocating`], and while stream-ordered allocations still look for
/// PyTorch's allocator, the outermost one looks (`pytorch::after_stream_allocation`).
#[inline(always)]
fn allocating_on_stream(
    real: impl FnOnce() -> CuResult,
    api: Api,
    describe: impl FnOnce(CuResult) -> (u64, u64, u64),
) -> CuResult {
    record_after(real, |by, r| {
        crate::pytorch::after_stream_allocation();
        let (addr, size, stream) = describe(r);
        record::allocation(
            by,
            &DRIVER,
            outcome(r),
            Kind::Alloc,
            api,
            addr,
            size,
            stream,
        );
    })
}

/// A freeing call: records the free of `addr` (none for a null address).
#[inline(always)]
fn freeing(real: impl FnOnce() -> CuResult, api: Api, addr: u64, stream: u64) -> CuResult {
    if addr == 0 {
        return real();
    }
    record_before(real, |by| {
        record::release(by, Kind::Free, api, addr, 0, stream)
    })
}

#[inline(always)]
fn outcome(r: CuResult) -> Outcome {
    match r {
        CUDA_SUCCESS => Outcome::Success,
        CUDA_ERROR_OUT_OF_MEMORY => Outcome::OutOfMemory,
        _ => Outcome::Failed,
    }
}

/// Reads a device pointer an out-parameter received (0 if the caller passed NULL or the
/// call failed).
#[inline(always)]
fn out_ptr(r: CuResult, p: *const CuDevicePtr) -> u64 {
    if p.is_null() || r != CUDA_SUCCESS {
        0
    } else {
        // SAFETY: the real call succeeded and wrote through this caller-provided pointer.
        unsafe { *p }
    }
}

/// As [`out_ptr`], for runtime `void**` out-parameters.
#[inline(always)]
fn out_host_ptr(r: CuResult, p: *const *mut c_void) -> u64 {
    if p.is_null() || r != CUDA_SUCCESS {
        0
    } else {
        // SAFETY: as `out_ptr`.
        unsafe { *p as u64 }
    }
}

/// Bytes of a pitched allocation: the row pitch the driver chose times the rows (the
/// requested width when the call failed or the caller passed no pitch pointer).
#[inline(always)]
fn pitched_bytes(r: CuResult, pitch: *const usize, width: usize, height: usize) -> u64 {
    let row = if pitch.is_null() || r != CUDA_SUCCESS {
        width
    } else {
        // SAFETY: the successful real call wrote the caller's pitch out-parameter.
        unsafe { *pitch }
    };
    (row as u64).saturating_mul(height as u64)
}

/// A successful driver lookup: swap a hooked driver pointer in `*pfn` for its wrapper.
#[inline]
fn route_lookup(r: CuResult, pfn: *mut *mut c_void, driver_sample: *mut c_void) {
    if r == CUDA_SUCCESS {
        // SAFETY: `pfn` is the out-parameter the successful lookup wrote.
        unsafe { routing::route_out_param(pfn, driver_sample, &ROUTED.get_proc_address) };
    }
}

/// The runtime answered from the driver; usually its own lookup already went through our
/// cuGetProcAddress (then `*pfn` is a wrapper and stays as it is).
#[inline]
fn route_entry_point(r: CuResult, pfn: *mut *mut c_void) {
    if r != CUDA_SUCCESS || pfn.is_null() {
        return;
    }
    // SAFETY: the lookup succeeded, so `*pfn` holds the pointer it wrote; the runtime got
    // it from the driver, so it lies inside the driver (or is already our wrapper).
    unsafe {
        let p = *pfn;
        routing::route_out_param(pfn, p, &ROUTED.driver_entry_point);
    }
}

hook_table! {
    // Lookup: driver pointers handed out are swapped for wrappers.
    Driver fn cuGetProcAddress(
        symbol: *const c_char, pfn: *mut *mut c_void, cuda_version: c_int, flags: c_ulonglong
    ) |real| {
        let r = real();
        route_lookup(r, pfn, routing::real_ptr(HookId::cuGetProcAddress));
        r
    }
    Driver fn cuGetProcAddress_v2(
        symbol: *const c_char, pfn: *mut *mut c_void, cuda_version: c_int, flags: c_ulonglong,
        status: *mut c_int
    ) |real| {
        let r = real();
        route_lookup(r, pfn, routing::real_ptr(HookId::cuGetProcAddress_v2));
        r
    }

    // Driver allocations and frees.
    Driver fn cuMemAlloc_v2(dptr: *mut CuDevicePtr, bytesize: usize) |real| {
        crate::pytorch::before_segment_allocation();
        allocating(real, Kind::Alloc, Api::CuMemAlloc, |r| (out_ptr(r, dptr), bytesize as u64, 0))
    }
    Driver fn cuMemFree_v2(dptr: CuDevicePtr) |real| {
        freeing(real, Api::CuMemFree, dptr, 0)
    }
    Driver fn cuMemAllocPitch_v2(
        dptr: *mut CuDevicePtr, pitch: *mut usize, width: usize, height: usize,
        element_size: c_uint
    ) |real| {
        allocating(real, Kind::Alloc, Api::CuMemAllocPitch, |r| {
            (out_ptr(r, dptr), pitched_bytes(r, pitch, width, height), 0)
        })
    }
    Driver fn cuMemAllocManaged(dptr: *mut CuDevicePtr, bytesize: usize, flags: c_uint) |real| {
        allocating(real, Kind::AllocManaged, Api::CuMemAllocManaged, |r| {
            (out_ptr(r, dptr), bytesize as u64, 0)
        })
    }
    Driver fn cuMemAllocAsync(dptr: *mut CuDevicePtr, bytesize: usize, stream: CuStream) |real| {
        allocating_on_stream(real, Api::CuMemAllocAsync, |r| {
            (out_ptr(r, dptr), bytesize as u64, stream as u64)
        })
    }
    Driver fn cuMemAllocAsync_ptsz(dptr: *mut CuDevicePtr, bytesize: usize, stream: CuStream) |real| {
        allocating_on_stream(real, Api::CuMemAllocAsync, |r| {
            (out_ptr(r, dptr), bytesize as u64, stream as u64)
        })
    }
    Driver fn cuMemAllocFromPoolAsync(
        dptr: *mut CuDevicePtr, bytesize: usize, pool: CuMemPool, stream: CuStream
    ) |real| {
        allocating_on_stream(real, Api::CuMemAllocFromPoolAsync, |r| {
            (out_ptr(r, dptr), bytesize as u64, stream as u64)
        })
    }
    Driver fn cuMemAllocFromPoolAsync_ptsz(
        dptr: *mut CuDevicePtr, bytesize: usize, pool: CuMemPool, stream: CuStream
    ) |real| {
        allocating_on_stream(real, Api::CuMemAllocFromPoolAsync, |r| {
            (out_ptr(r, dptr), bytesize as u64, stream as u64)
        })
    }
    Driver fn cuMemFreeAsync(dptr: CuDevicePtr, stream: CuStream) |real| {
        freeing(real, Api::CuMemFreeAsync, dptr, stream as u64)
    }
    Driver fn cuMemFreeAsync_ptsz(dptr: CuDevicePtr, stream: CuStream) |real| {
        freeing(real, Api::CuMemFreeAsync, dptr, stream as u64)
    }

    // Virtual memory management (PyTorch's expandable segments, NCCL).
    Driver fn cuMemCreate(
        handle: *mut CuMemHandle, size: usize, prop: *const CuMemAllocationProp,
        flags: c_ulonglong
    ) |real| {
        crate::pytorch::before_segment_allocation();
        record_after(real, |by, r| {
            if r == CUDA_SUCCESS && !handle.is_null() {
                // Host (NUMA) locations are not device memory: NCCL allocates those this
                // way (docs/CUDA.md#never-change-what-the-driver-says), so classify by the
                // location type, not its id.
                // SAFETY: the caller's property struct, which the driver just read
                // successfully, and the handle the successful call wrote.
                let (device, h) = unsafe {
                    let device = match prop.as_ref() {
                        Some(p) if p.location.kind == CU_MEM_LOCATION_TYPE_DEVICE => p.location.id,
                        _ => -1,
                    };
                    (device, *handle)
                };
                record::vmm(by, Kind::MemCreate, Api::CuMemCreate, device, 0, size as u64, h);
            } else if r == CUDA_ERROR_OUT_OF_MEMORY {
                let o = Outcome::OutOfMemory;
                record::allocation(by, &DRIVER, o, Kind::MemCreate, Api::CuMemCreate, 0, size as u64, 0);
            }
        })
    }
    Driver fn cuMemRelease(handle: CuMemHandle) |real| {
        record_before(real, |by| record::vmm(by, Kind::MemRelease, Api::CuMemRelease, -1, 0, 0, handle))
    }
    Driver fn cuMemAddressReserve(
        ptr: *mut CuDevicePtr, size: usize, alignment: usize, addr: CuDevicePtr,
        flags: c_ulonglong
    ) |real| {
        crate::pytorch::before_segment_allocation();
        record_after(real, |by, r| {
            if r == CUDA_SUCCESS {
                let at = out_ptr(r, ptr);
                record::vmm(by, Kind::Reserve, Api::CuMemAddressReserve, -1, at, size as u64, 0);
            }
        })
    }
    Driver fn cuMemAddressFree(ptr: CuDevicePtr, size: usize) |real| {
        record_before(real, |by| {
            record::vmm(by, Kind::ReserveFree, Api::CuMemAddressFree, -1, ptr, size as u64, 0)
        })
    }
    Driver fn cuMemMap(
        ptr: CuDevicePtr, size: usize, offset: usize, handle: CuMemHandle, flags: c_ulonglong
    ) |real| {
        record_after(real, |by, r| {
            if r == CUDA_SUCCESS {
                record::mapping(by, Kind::Map, ptr, size as u64, handle);
            }
        })
    }
    Driver fn cuMemUnmap(ptr: CuDevicePtr, size: usize) |real| {
        record_before(real, |by| record::mapping(by, Kind::Unmap, ptr, size as u64, 0))
    }

    // Runtime twins: reached through their exported symbols (programs linked against the
    // shared libcudart). The driver call underneath hits the guard and is not recorded
    // again.
    Runtime fn cudaMalloc(dev_ptr: *mut *mut c_void, size: usize) |real| {
        crate::pytorch::before_segment_allocation();
        allocating(real, Kind::Alloc, Api::CudaMalloc, |r| (out_host_ptr(r, dev_ptr), size as u64, 0))
    }
    Runtime fn cudaFree(dev_ptr: *mut c_void) |real| {
        freeing(real, Api::CudaFree, dev_ptr as u64, 0)
    }
    Runtime fn cudaMallocAsync(dev_ptr: *mut *mut c_void, size: usize, stream: CuStream) |real| {
        allocating_on_stream(real, Api::CudaMallocAsync, |r| {
            (out_host_ptr(r, dev_ptr), size as u64, stream as u64)
        })
    }
    Runtime fn cudaMallocAsync_ptsz(dev_ptr: *mut *mut c_void, size: usize, stream: CuStream) |real| {
        allocating_on_stream(real, Api::CudaMallocAsync, |r| {
            (out_host_ptr(r, dev_ptr), size as u64, stream as u64)
        })
    }
    Runtime fn cudaFreeAsync(dev_ptr: *mut c_void, stream: CuStream) |real| {
        freeing(real, Api::CudaFreeAsync, dev_ptr as u64, stream as u64)
    }
    Runtime fn cudaFreeAsync_ptsz(dev_ptr: *mut c_void, stream: CuStream) |real| {
        freeing(real, Api::CudaFreeAsync, dev_ptr as u64, stream as u64)
    }
    Runtime fn cudaMallocFromPoolAsync(
        dev_ptr: *mut *mut c_void, size: usize, pool: CuMemPool, stream: CuStream
    ) |real| {
        allocating_on_stream(real, Api::CudaMallocFromPoolAsync, |r| {
            (out_host_ptr(r, dev_ptr), size as u64, stream as u64)
        })
    }
    Runtime fn cudaMallocFromPoolAsync_ptsz(
        dev_ptr: *mut *mut c_void, size: usize, pool: CuMemPool, stream: CuStream
    ) |real| {
        allocating_on_stream(real, Api::CudaMallocFromPoolAsync, |r| {
            (out_host_ptr(r, dev_ptr), size as u64, stream as u64)
        })
    }
    Runtime fn cudaMallocManaged(dev_ptr: *mut *mut c_void, size: usize, flags: c_uint) |real| {
        allocating(real, Kind::AllocManaged, Api::CudaMallocManaged, |r| {
            (out_host_ptr(r, dev_ptr), size as u64, 0)
        })
    }
    Runtime fn cudaMallocPitch(
        dev_ptr: *mut *mut c_void, pitch: *mut usize, width: usize, height: usize
    ) |real| {
        allocating(real, Kind::Alloc, Api::CudaMallocPitch, |r| {
            (out_host_ptr(r, dev_ptr), pitched_bytes(r, pitch, width, height), 0)
        })
    }
    Runtime fn cudaMalloc3D(pitched: *mut CudaPitchedPtr, extent: CudaExtent) |real| {
        allocating(real, Kind::Alloc, Api::CudaMalloc3D, |r| {
            let (ptr, pitch) = if pitched.is_null() || r != CUDA_SUCCESS {
                (0, extent.width)
            } else {
                // SAFETY: written by the successful real call.
                unsafe { ((*pitched).ptr as u64, (*pitched).pitch) }
            };
            let size = (pitch as u64)
                .saturating_mul(extent.height as u64)
                .saturating_mul(extent.depth as u64);
            (ptr, size, 0)
        })
    }

    // Runtime lookups of driver functions.
    Runtime fn cudaGetDriverEntryPoint(
        symbol: *const c_char, pfn: *mut *mut c_void, flags: c_ulonglong, status: *mut c_int
    ) |real| {
        let r = real();
        route_entry_point(r, pfn);
        r
    }
    Runtime fn cudaGetDriverEntryPointByVersion(
        symbol: *const c_char, pfn: *mut *mut c_void, cuda_version: c_uint, flags: c_ulonglong,
        status: *mut c_int
    ) |real| {
        let r = real();
        route_entry_point(r, pfn);
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names_match_exports_and_are_unique() {
        let mut names: Vec<&str> = HOOKS.iter().map(|r| r.name).collect();
        for n in &names {
            assert!(n.ends_with('\0') && n.starts_with("cu"), "{n}");
        }
        names.sort();
        names.dedup();
        assert_eq!(names.len(), HOOK_COUNT);
        for (i, row) in HOOKS.iter().enumerate() {
            assert_eq!(row.id as usize, i, "{}", row.name);
        }
        assert_eq!(
            HOOKS[HookId::cuMemAlloc_v2 as usize].name,
            "cuMemAlloc_v2\0"
        );
        assert_eq!(
            HOOKS[HookId::cuMemAlloc_v2 as usize].hook,
            cuMemAlloc_v2 as *const ()
        );
        assert_eq!(
            routing::driver_hook_by_name(b"cuMemMap"),
            Some(HookId::cuMemMap)
        );
        assert_eq!(
            routing::driver_hook_by_name(b"cudaMalloc"),
            None,
            "runtime names are not routed"
        );
    }
}
