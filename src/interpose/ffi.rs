//! CUDA driver and runtime types, written by hand.
//!
//! Hot (types only). No CUDA crate: their error codes are Rust enums, and a code a newer
//! driver returns would be undefined behaviour to read (docs/DEPENDENCIES.md). Here results
//! are plain integers passed through untouched. Layouts follow NVIDIA's `cuda.h` /
//! `cuda_runtime_api.h` (CUDA 13.0). The hooked functions' pointer types are not written
//! here: the hook table derives each from its wrapper's own signature.

use std::ffi::{c_int, c_ulonglong, c_void};

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

/// `cuCtxGetDevice`, `cuMemGetInfo_v2` and `cuDeviceGetCount`: called by memsnap, never
/// hooked.
pub type FnCuCtxGetDevice = unsafe extern "C" fn(*mut CuDevice) -> CuResult;
pub type FnCuMemGetInfo = unsafe extern "C" fn(*mut usize, *mut usize) -> CuResult;
pub type FnCuDeviceGetCount = unsafe extern "C" fn(*mut c_int) -> CuResult;
