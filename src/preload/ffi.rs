//! CUDA driver and runtime types and function-pointer types, written by hand.
//!
//! Hot (types only). No CUDA crate: their error codes are Rust enums, and a code a newer
//! driver returns would be undefined behaviour to read (reference/crates.md §2.1). Here
//! results are plain `i32` newtypes passed through untouched. Signatures follow
//! NVIDIA's `cuda.h` / `cuda_runtime_api.h` (CUDA 13.0), checked against cudarc 0.19.

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void};

/// `CUresult` / `cudaError_t`: whatever the real call returned, never reinterpreted.
pub type CuResult = c_int;
pub const CUDA_SUCCESS: CuResult = 0;
/// `CUDA_ERROR_OUT_OF_MEMORY` and `cudaErrorMemoryAllocation` are both 2.
pub const CUDA_ERROR_OUT_OF_MEMORY: CuResult = 2;
/// Returned by a hook whose real function could not be found at all.
pub const CUDA_ERROR_NOT_FOUND: CuResult = 500;

pub type CuDevicePtr = c_ulonglong;
pub type CuStream = *mut c_void;
pub type CuMemPool = *mut c_void;
pub type CuMemHandle = c_ulonglong;
pub type CuDevice = c_int;

/// `CUmemLocationType`: only `DEVICE` memory belongs in a device trace.
pub const CU_MEM_LOCATION_TYPE_DEVICE: c_int = 1;

/// `CUmemLocation` (cuda.h).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CuMemLocation {
    pub kind: c_int,
    pub id: c_int,
}

/// `CUmemAllocationProp` (cuda.h): only `location` is read.
#[repr(C)]
pub struct CuMemAllocationProp {
    pub alloc_type: c_int,
    pub requested_handle_types: c_int,
    pub location: CuMemLocation,
    pub win32_handle_meta_data: *mut c_void,
    pub alloc_flags: [u8; 8],
}

/// `struct cudaPitchedPtr` (driver_types.h).
#[repr(C)]
pub struct CudaPitchedPtr {
    pub ptr: *mut c_void,
    pub pitch: usize,
    pub xsize: usize,
    pub ysize: usize,
}

/// `struct cudaExtent` (driver_types.h), passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CudaExtent {
    pub width: usize,
    pub height: usize,
    pub depth: usize,
}

// Driver entry points.
pub type FnCuMemAlloc = unsafe extern "C" fn(*mut CuDevicePtr, usize) -> CuResult;
pub type FnCuMemFree = unsafe extern "C" fn(CuDevicePtr) -> CuResult;
pub type FnCuMemAllocPitch =
    unsafe extern "C" fn(*mut CuDevicePtr, *mut usize, usize, usize, c_uint) -> CuResult;
pub type FnCuMemAllocManaged = unsafe extern "C" fn(*mut CuDevicePtr, usize, c_uint) -> CuResult;
pub type FnCuMemAllocAsync = unsafe extern "C" fn(*mut CuDevicePtr, usize, CuStream) -> CuResult;
pub type FnCuMemAllocFromPoolAsync =
    unsafe extern "C" fn(*mut CuDevicePtr, usize, CuMemPool, CuStream) -> CuResult;
pub type FnCuMemFreeAsync = unsafe extern "C" fn(CuDevicePtr, CuStream) -> CuResult;
pub type FnCuMemCreate = unsafe extern "C" fn(
    *mut CuMemHandle,
    usize,
    *const CuMemAllocationProp,
    c_ulonglong,
) -> CuResult;
pub type FnCuMemRelease = unsafe extern "C" fn(CuMemHandle) -> CuResult;
pub type FnCuMemAddressReserve =
    unsafe extern "C" fn(*mut CuDevicePtr, usize, usize, CuDevicePtr, c_ulonglong) -> CuResult;
pub type FnCuMemAddressFree = unsafe extern "C" fn(CuDevicePtr, usize) -> CuResult;
pub type FnCuMemMap =
    unsafe extern "C" fn(CuDevicePtr, usize, usize, CuMemHandle, c_ulonglong) -> CuResult;
pub type FnCuMemUnmap = unsafe extern "C" fn(CuDevicePtr, usize) -> CuResult;
/// `cuGetProcAddress` (CUDA 11.3–11.8 ABI, still exported).
pub type FnCuGetProcAddress =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, c_ulonglong) -> CuResult;
/// `cuGetProcAddress_v2` (CUDA 12.0+): adds `CUdriverProcAddressQueryResult *symbolStatus`.
pub type FnCuGetProcAddressV2 = unsafe extern "C" fn(
    *const c_char,
    *mut *mut c_void,
    c_int,
    c_ulonglong,
    *mut c_int,
) -> CuResult;
pub type FnCuCtxGetDevice = unsafe extern "C" fn(*mut CuDevice) -> CuResult;
pub type FnCuMemGetInfo = unsafe extern "C" fn(*mut usize, *mut usize) -> CuResult;

// Runtime entry points.
pub type FnCudaMalloc = unsafe extern "C" fn(*mut *mut c_void, usize) -> CuResult;
pub type FnCudaFree = unsafe extern "C" fn(*mut c_void) -> CuResult;
pub type FnCudaMallocAsync = unsafe extern "C" fn(*mut *mut c_void, usize, CuStream) -> CuResult;
pub type FnCudaFreeAsync = unsafe extern "C" fn(*mut c_void, CuStream) -> CuResult;
pub type FnCudaMallocFromPoolAsync =
    unsafe extern "C" fn(*mut *mut c_void, usize, CuMemPool, CuStream) -> CuResult;
pub type FnCudaMallocManaged = unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> CuResult;
pub type FnCudaMallocPitch =
    unsafe extern "C" fn(*mut *mut c_void, *mut usize, usize, usize) -> CuResult;
pub type FnCudaMalloc3D = unsafe extern "C" fn(*mut CudaPitchedPtr, CudaExtent) -> CuResult;
/// `cudaGetDriverEntryPoint` (CUDA 12.0+ ABI with the query-result pointer; 11.x callers
/// pass three arguments and the fourth register is ignored by an 11.x runtime).
pub type FnCudaGetDriverEntryPoint =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_ulonglong, *mut c_int) -> CuResult;
pub type FnCudaGetDriverEntryPointByVersion = unsafe extern "C" fn(
    *const c_char,
    *mut *mut c_void,
    c_uint,
    c_ulonglong,
    *mut c_int,
) -> CuResult;

pub type FnDlsym = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;
