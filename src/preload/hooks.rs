//! The ONE table of hooked symbols, their exported wrappers, and routing by pointer.
//!
//! Hot. Every CUDA allocation route ends in a wrapper defined here:
//! - exported symbols (PLT calls into libcuda / libcudart);
//! - `dlsym(handle, name)` on libcuda (JAX, statically linked runtimes);
//! - `cuGetProcAddress{,_v2}`, including the nested lookup of `"cuGetProcAddress"` itself
//!   (how nvcc's static cudart, CuPy and NCCL reach the driver: GPU-FACTS.md);
//! - `cudaGetDriverEntryPoint{,ByVersion}` (PyTorch's expandable segments, NCCL).
//!
//! Lookups are routed by the *returned pointer*, never by name (interposer-prior-art.md
//! A2): the driver's answer is compared with the real address of every hooked ABI variant
//! (`_v2`, `_ptsz`, ...), and only an exact match is replaced by its wrapper. Unknown
//! pointers, and everything that is not an allocation call, pass through untouched.
//! Return codes and out-parameters are never changed.

#![allow(non_snake_case)]
// exported names must be CUDA's own
// The exported wrappers have exactly the contracts of the CUDA functions they stand for
// (cuda.h / cuda_runtime_api.h); each forwards its caller's arguments unchanged.
#![allow(clippy::missing_safety_doc)]

use crate::preload::event::{Api, Kind};
use crate::preload::ffi::*;
use crate::preload::guard::Scope;
use crate::preload::record;
use std::ffi::{CStr, c_char, c_int, c_uint, c_ulonglong, c_void};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicPtr, AtomicU8, AtomicU64, Ordering::*};

/// Driver or runtime: driver pointers are routed through the lookup hooks, runtime
/// wrappers are reached through their exported symbols only.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Layer {
    Driver,
    Runtime,
}

pub struct HookRow {
    /// NUL-terminated exported name.
    pub name: &'static str,
    pub layer: Layer,
    /// Our wrapper's address.
    pub hook: *const (),
}

// SAFETY: the table is immutable and holds only function addresses and static strings.
unsafe impl Sync for HookRow {}

macro_rules! hook_table {
    ($( $sym:ident : $layer:ident ),* $(,)?) => {
        /// Index of each hooked symbol in [`HOOKS`] and the real-pointer slots.
        #[allow(non_camel_case_types, clippy::upper_case_acronyms)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        #[repr(usize)]
        pub enum HookId { $($sym),* }

        pub const HOOK_COUNT: usize = [$(stringify!($sym)),*].len();

        pub static HOOKS: [HookRow; HOOK_COUNT] = [
            $(HookRow {
                name: concat!(stringify!($sym), "\0"),
                layer: Layer::$layer,
                hook: $sym as *const (),
            }),*
        ];
    };
}

hook_table! {
    cuGetProcAddress: Driver,
    cuGetProcAddress_v2: Driver,
    cuMemAlloc_v2: Driver,
    cuMemFree_v2: Driver,
    cuMemAllocPitch_v2: Driver,
    cuMemAllocManaged: Driver,
    cuMemAllocAsync: Driver,
    cuMemAllocAsync_ptsz: Driver,
    cuMemAllocFromPoolAsync: Driver,
    cuMemAllocFromPoolAsync_ptsz: Driver,
    cuMemFreeAsync: Driver,
    cuMemFreeAsync_ptsz: Driver,
    cuMemCreate: Driver,
    cuMemRelease: Driver,
    cuMemAddressReserve: Driver,
    cuMemAddressFree: Driver,
    cuMemMap: Driver,
    cuMemUnmap: Driver,
    cudaMalloc: Runtime,
    cudaFree: Runtime,
    cudaMallocAsync: Runtime,
    cudaMallocAsync_ptsz: Runtime,
    cudaFreeAsync: Runtime,
    cudaFreeAsync_ptsz: Runtime,
    cudaMallocFromPoolAsync: Runtime,
    cudaMallocFromPoolAsync_ptsz: Runtime,
    cudaMallocManaged: Runtime,
    cudaMallocPitch: Runtime,
    cudaMalloc3D: Runtime,
    cudaGetDriverEntryPoint: Runtime,
    cudaGetDriverEntryPointByVersion: Runtime,
}

/// The real function behind each hook, found once.
static REAL: [AtomicPtr<c_void>; HOOK_COUNT] = [const { AtomicPtr::new(null_mut()) }; HOOK_COUNT];

/// Driver functions we call ourselves but do not hook.
static REAL_CTX_GET_DEVICE: AtomicPtr<c_void> = AtomicPtr::new(null_mut());
static REAL_MEM_GET_INFO: AtomicPtr<c_void> = AtomicPtr::new(null_mut());

/// Counters of the lookup routes (reported in every snapshot's `memsnap` metadata).
pub struct RouteCounters {
    pub dlsym: AtomicU64,
    pub get_proc_address: AtomicU64,
    pub driver_entry_point: AtomicU64,
}
pub static ROUTED: RouteCounters = RouteCounters {
    dlsym: AtomicU64::new(0),
    get_proc_address: AtomicU64::new(0),
    driver_entry_point: AtomicU64::new(0),
};

// ---------------------------------------------------------------------------------------
// Real dlsym, and the dlsym hook.

/// glibc's `dlsym`, found with `dlvsym` (never through the public `dlsym`, which is ours).
static REAL_DLSYM: AtomicPtr<c_void> = AtomicPtr::new(null_mut());

/// Finds glibc's `dlsym`. Called from the library constructor and lazily.
pub fn init_real_dlsym() -> Option<FnDlsym> {
    let mut p = REAL_DLSYM.load(Acquire);
    if p.is_null() {
        // GLIBC_2.34 is where libdl moved into libc; 2.2.5 is the x86-64 base version and
        // 2.17 the aarch64 one (interposer-prior-art.md A4).
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
    if driver_hook_by_name(name).is_none() {
        return p;
    }
    // The pointer came from the library that defines a hooked driver symbol: that is the
    // driver, whatever its file is called (or our own export, for RTLD_DEFAULT lookups).
    // Learn the driver's real pointers from it.
    ensure_driver_table(p);
    let routed = route_driver_pointer(p);
    if routed != p {
        ROUTED.dlsym.fetch_add(1, Relaxed);
    }
    routed
}

fn driver_hook_by_name(name: &[u8]) -> Option<HookId> {
    HOOKS
        .iter()
        .position(|row| {
            row.layer == Layer::Driver && row.name.as_bytes().strip_suffix(b"\0") == Some(name)
        })
        .map(
            // SAFETY: `position` over HOOKS returns an index < HOOK_COUNT, a valid discriminant.
            |i| unsafe { std::mem::transmute::<usize, HookId>(i) },
        )
}

// ---------------------------------------------------------------------------------------
// The driver table: the real address of every hooked driver symbol.

const TABLE_EMPTY: u8 = 0;
const TABLE_BUILDING: u8 = 1;
const TABLE_READY: u8 = 2;
static DRIVER_TABLE: AtomicU8 = AtomicU8::new(TABLE_EMPTY);

/// Resolves every hooked driver symbol in the library containing `sample` (a pointer into
/// the driver). Once per process; concurrent callers wait for the first.
fn ensure_driver_table(sample: *mut c_void) {
    // Our own wrapper (what `dlsym(RTLD_DEFAULT, "cuMemAlloc_v2")` finds first) says nothing
    // about where the driver is: building the table from our library would mark it ready
    // with no real pointer in it, and routing would silently stop.
    if DRIVER_TABLE.load(Acquire) == TABLE_READY || sample.is_null() || is_our_hook(sample) {
        return;
    }
    ensure_driver_table_slow(sample);
}

#[cold]
#[inline(never)]
fn ensure_driver_table_slow(sample: *mut c_void) {
    if DRIVER_TABLE
        .compare_exchange(TABLE_EMPTY, TABLE_BUILDING, AcqRel, Acquire)
        .is_err()
    {
        // Another thread builds it: it takes microseconds.
        for _ in 0..1_000_000 {
            if DRIVER_TABLE.load(Acquire) == TABLE_READY {
                return;
            }
            std::thread::yield_now();
        }
        return;
    }
    // SAFETY: `info` is a plain C struct that dladdr fills; `sample` is any address.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: see above.
    let found = unsafe { libc::dladdr(sample as *const c_void, &mut info) } != 0;
    if found && !info.dli_fname.is_null() {
        // SAFETY: dli_fname is the loaded module's path; RTLD_NOLOAD only returns a handle
        // to an already-loaded library (never loads, never runs constructors).
        let handle = unsafe { libc::dlopen(info.dli_fname, libc::RTLD_NOLOAD | libc::RTLD_LAZY) };
        if !handle.is_null() {
            for (row, slot) in HOOKS.iter().zip(&REAL) {
                if row.layer != Layer::Driver {
                    continue;
                }
                let name = CStr::from_bytes_with_nul(row.name.as_bytes()).unwrap_or(c"");
                // SAFETY: `handle` came from the NOLOAD dlopen above and is still open.
                let p = unsafe { real_dlsym(handle, name) };
                if !p.is_null() && !is_our_hook(p) {
                    let _ = slot.compare_exchange(null_mut(), p, AcqRel, Acquire);
                }
            }
            for (slot, name) in [
                (&REAL_CTX_GET_DEVICE, c"cuCtxGetDevice"),
                (&REAL_MEM_GET_INFO, c"cuMemGetInfo_v2"),
            ] {
                // SAFETY: as above.
                let p = unsafe { real_dlsym(handle, name) };
                if !p.is_null() {
                    slot.store(p, Release);
                }
            }
            // SAFETY: balances the reference the NOLOAD dlopen took.
            unsafe { libc::dlclose(handle) };
        }
    }
    DRIVER_TABLE.store(TABLE_READY, Release);
}

/// Test support: installs a stand-in "real" function behind a hook.
#[cfg(test)]
pub fn set_real_for_test(id: HookId, f: *mut c_void) {
    REAL[id as usize].store(f, Release);
}

fn is_our_hook(p: *mut c_void) -> bool {
    HOOKS.iter().any(|row| row.hook as *mut c_void == p)
}

/// Replaces a real driver pointer by its wrapper; anything else is returned unchanged.
fn route_driver_pointer(p: *mut c_void) -> *mut c_void {
    if p.is_null() {
        return p;
    }
    for (row, slot) in HOOKS.iter().zip(&REAL) {
        if row.layer == Layer::Driver && slot.load(Acquire) == p {
            return row.hook as *mut c_void;
        }
    }
    p
}

/// The real function for `id`, found on first use: the driver table if built, else the
/// next definition after us in the global scope.
#[inline(always)]
fn real<F: Copy>(id: HookId) -> Option<F> {
    let mut p = REAL
        .get(id as usize)
        .map_or(null_mut(), |slot| slot.load(Acquire));
    if p.is_null() {
        p = resolve_next(id);
        if p.is_null() {
            return None;
        }
    }
    debug_assert_eq!(size_of::<F>(), size_of::<*mut c_void>());
    // SAFETY: `F` is the function-pointer type of the symbol named by `id` (each wrapper
    // names its own type), and `p` is that symbol's address in the real library.
    Some(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) })
}

#[cold]
#[inline(never)]
fn resolve_next(id: HookId) -> *mut c_void {
    let Some(row) = HOOKS.get(id as usize) else {
        return null_mut();
    };
    let name = CStr::from_bytes_with_nul(row.name.as_bytes()).unwrap_or(c"");
    // RTLD_NEXT from our own code: the definition after libmemsnap, i.e. the real one.
    // SAFETY: RTLD_NEXT is always a valid pseudo-handle.
    let p = unsafe { real_dlsym(libc::RTLD_NEXT, name) };
    if p.is_null() || is_our_hook(p) {
        return null_mut();
    }
    let Some(slot) = REAL.get(id as usize) else {
        return null_mut();
    };
    let _ = slot.compare_exchange(null_mut(), p, AcqRel, Acquire);
    if row.layer == Layer::Driver {
        ensure_driver_table(p);
    }
    slot.load(Acquire)
}

/// The device of the calling thread's current context (0 when unknown).
#[inline]
pub fn current_device() -> i32 {
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

/// `(free, total)` bytes of the current device from the real cuMemGetInfo.
fn mem_info() -> Option<(u64, u64)> {
    let p = REAL_MEM_GET_INFO.load(Acquire);
    if p.is_null() {
        return None;
    }
    // SAFETY: `p` is the driver's cuMemGetInfo_v2.
    let f = unsafe { std::mem::transmute::<*mut c_void, FnCuMemGetInfo>(p) };
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: valid out-pointers.
    (unsafe { f(&mut free, &mut total) } == CUDA_SUCCESS).then_some((free as u64, total as u64))
}

/// Free bytes on the current device, or -1 when unknown.
pub fn device_free_bytes() -> i64 {
    mem_info().map_or(-1, |(free, _)| free as i64)
}

const TOTAL_SLOTS: usize = 64;
static DEVICE_TOTAL: [AtomicU64; TOTAL_SLOTS] = [const { AtomicU64::new(0) }; TOTAL_SLOTS];

/// Remembers the current device's total memory the first time it allocates (one extra
/// cuMemGetInfo per device per process), for the stats' utilization column.
#[inline]
pub fn note_device_total(device: i32) {
    let Some(slot) = usize::try_from(device)
        .ok()
        .and_then(|d| DEVICE_TOTAL.get(d))
    else {
        return;
    };
    if slot.load(Relaxed) == 0 {
        note_device_total_slow(slot);
    }
}

#[cold]
#[inline(never)]
fn note_device_total_slow(slot: &AtomicU64) {
    if let Some((_, total)) = mem_info() {
        slot.store(total, Relaxed);
    }
}

/// Total bytes of device `d` as seen by its first allocation, 0 if unknown.
pub fn device_total(d: usize) -> u64 {
    DEVICE_TOTAL.get(d).map_or(0, |t| t.load(Relaxed))
}

// ---------------------------------------------------------------------------------------
// Lookup hooks.

#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: c_ulonglong,
) -> CuResult {
    let Some(f) = real::<FnCuGetProcAddress>(HookId::cuGetProcAddress) else {
        return CUDA_ERROR_NOT_FOUND;
    };
    // SAFETY: the caller's arguments, forwarded unchanged.
    let r = unsafe { f(symbol, pfn, cuda_version, flags) };
    route_out_param(r, pfn, f as *mut c_void, &ROUTED.get_proc_address);
    r
}

#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: c_ulonglong,
    status: *mut c_int,
) -> CuResult {
    let Some(f) = real::<FnCuGetProcAddressV2>(HookId::cuGetProcAddress_v2) else {
        return CUDA_ERROR_NOT_FOUND;
    };
    // SAFETY: the caller's arguments, forwarded unchanged.
    let r = unsafe { f(symbol, pfn, cuda_version, flags, status) };
    route_out_param(r, pfn, f as *mut c_void, &ROUTED.get_proc_address);
    r
}

/// After a successful lookup, swaps a hooked driver pointer in `*pfn` for its wrapper.
fn route_out_param(
    r: CuResult,
    pfn: *mut *mut c_void,
    driver_sample: *mut c_void,
    counter: &AtomicU64,
) {
    if r != CUDA_SUCCESS || pfn.is_null() {
        return;
    }
    ensure_driver_table(driver_sample);
    // SAFETY: the lookup succeeded, so `*pfn` holds the pointer it wrote.
    let p = unsafe { *pfn };
    let routed = route_driver_pointer(p);
    if routed != p {
        // SAFETY: same out-parameter, now holding our wrapper for the same ABI.
        unsafe { *pfn = routed };
        counter.fetch_add(1, Relaxed);
    }
}

#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cudaGetDriverEntryPoint(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    flags: c_ulonglong,
    status: *mut c_int,
) -> CuResult {
    let Some(f) = real::<FnCudaGetDriverEntryPoint>(HookId::cudaGetDriverEntryPoint) else {
        return CUDA_ERROR_NOT_FOUND;
    };
    // SAFETY: the caller's arguments, forwarded unchanged.
    let r = unsafe { f(symbol, pfn, flags, status) };
    route_entry_point(r, pfn);
    r
}

#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cudaGetDriverEntryPointByVersion(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_uint,
    flags: c_ulonglong,
    status: *mut c_int,
) -> CuResult {
    let Some(f) =
        real::<FnCudaGetDriverEntryPointByVersion>(HookId::cudaGetDriverEntryPointByVersion)
    else {
        return CUDA_ERROR_NOT_FOUND;
    };
    // SAFETY: the caller's arguments, forwarded unchanged.
    let r = unsafe { f(symbol, pfn, cuda_version, flags, status) };
    route_entry_point(r, pfn);
    r
}

/// The runtime answered from the driver; usually its own lookup already went through our
/// cuGetProcAddress (then `*pfn` is a wrapper and stays as it is).
fn route_entry_point(r: CuResult, pfn: *mut *mut c_void) {
    if r != CUDA_SUCCESS || pfn.is_null() {
        return;
    }
    // SAFETY: the lookup succeeded, so `*pfn` holds the pointer it wrote.
    let p = unsafe { *pfn };
    // The runtime got `p` from the driver, so it lies inside the driver (or is already our
    // wrapper, when the runtime's own lookup went through our cuGetProcAddress).
    route_out_param(r, pfn, p, &ROUTED.driver_entry_point);
}

// ---------------------------------------------------------------------------------------
// Allocation hooks. Pattern: find the real function, enter the nesting guard, call it,
// and record only in the outermost hooked call. Frees are recorded *before* the real
// call, allocations after it returns (snapshot-format.md §8.3: an address can then never
// be seen allocated twice).

/// Reads a device pointer an out-parameter received (0 if the caller passed NULL).
#[inline(always)]
fn out_ptr(p: *const CuDevicePtr) -> u64 {
    if p.is_null() {
        0
    } else {
        // SAFETY: the real call succeeded and wrote through this caller-provided pointer.
        unsafe { *p }
    }
}

#[inline(always)]
fn out_host_ptr(p: *const *mut c_void) -> u64 {
    if p.is_null() {
        0
    } else {
        // SAFETY: as `out_ptr`, for runtime `void**` out-parameters.
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

macro_rules! call_real {
    ($id:ident, $ty:ty, ($($arg:expr),*)) => {{
        let Some(f) = real::<$ty>(HookId::$id) else { return CUDA_ERROR_NOT_FOUND };
        // SAFETY: the caller's arguments, forwarded unchanged to the real function.
        unsafe { f($($arg),*) }
    }};
}

#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CuDevicePtr, bytesize: usize) -> CuResult {
    let scope = Scope::enter();
    let r = call_real!(cuMemAlloc_v2, FnCuMemAlloc, (dptr, bytesize));
    if scope.outermost() {
        record::allocation(
            r,
            Kind::Alloc,
            Api::CuMemAlloc,
            out_ptr(dptr),
            bytesize as u64,
            0,
        );
    }
    r
}

#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMemAllocPitch_v2(
    dptr: *mut CuDevicePtr,
    pitch: *mut usize,
    width: usize,
    height: usize,
    element_size: c_uint,
) -> CuResult {
    let scope = Scope::enter();
    let r = call_real!(
        cuMemAllocPitch_v2,
        FnCuMemAllocPitch,
        (dptr, pitch, width, height, element_size)
    );
    if scope.outermost() {
        let size = pitched_bytes(r, pitch, width, height);
        record::allocation(r, Kind::Alloc, Api::CuMemAllocPitch, out_ptr(dptr), size, 0);
    }
    r
}

#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMemAllocManaged(
    dptr: *mut CuDevicePtr,
    bytesize: usize,
    flags: c_uint,
) -> CuResult {
    let scope = Scope::enter();
    let r = call_real!(
        cuMemAllocManaged,
        FnCuMemAllocManaged,
        (dptr, bytesize, flags)
    );
    if scope.outermost() {
        record::allocation(
            r,
            Kind::AllocManaged,
            Api::CuMemAllocManaged,
            out_ptr(dptr),
            bytesize as u64,
            0,
        );
    }
    r
}

macro_rules! cu_alloc_async {
    ($sym:ident) => {
        #[cfg_attr(not(test), unsafe(no_mangle))]
        pub unsafe extern "C" fn $sym(
            dptr: *mut CuDevicePtr,
            bytesize: usize,
            stream: CuStream,
        ) -> CuResult {
            let scope = Scope::enter();
            let r = call_real!($sym, FnCuMemAllocAsync, (dptr, bytesize, stream));
            if scope.outermost() {
                record::allocation(
                    r,
                    Kind::Alloc,
                    Api::CuMemAllocAsync,
                    out_ptr(dptr),
                    bytesize as u64,
                    stream as u64,
                );
            }
            r
        }
    };
}
cu_alloc_async!(cuMemAllocAsync);
cu_alloc_async!(cuMemAllocAsync_ptsz);

macro_rules! cu_alloc_from_pool_async {
    ($sym:ident) => {
        #[cfg_attr(not(test), unsafe(no_mangle))]
        pub unsafe extern "C" fn $sym(
            dptr: *mut CuDevicePtr,
            bytesize: usize,
            pool: CuMemPool,
            stream: CuStream,
        ) -> CuResult {
            let scope = Scope::enter();
            let r = call_real!(
                $sym,
                FnCuMemAllocFromPoolAsync,
                (dptr, bytesize, pool, stream)
            );
            if scope.outermost() {
                record::allocation(
                    r,
                    Kind::Alloc,
                    Api::CuMemAllocFromPoolAsync,
                    out_ptr(dptr),
                    bytesize as u64,
                    stream as u64,
                );
            }
            r
        }
    };
}
cu_alloc_from_pool_async!(cuMemAllocFromPoolAsync);
cu_alloc_from_pool_async!(cuMemAllocFromPoolAsync_ptsz);

#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMemFree_v2(dptr: CuDevicePtr) -> CuResult {
    let scope = Scope::enter();
    if scope.outermost() && dptr != 0 {
        record::release(Kind::Free, Api::CuMemFree, dptr, 0, 0);
    }
    call_real!(cuMemFree_v2, FnCuMemFree, (dptr))
}

macro_rules! cu_free_async {
    ($sym:ident) => {
        #[cfg_attr(not(test), unsafe(no_mangle))]
        pub unsafe extern "C" fn $sym(dptr: CuDevicePtr, stream: CuStream) -> CuResult {
            let scope = Scope::enter();
            if scope.outermost() && dptr != 0 {
                record::release(Kind::Free, Api::CuMemFreeAsync, dptr, 0, stream as u64);
            }
            call_real!($sym, FnCuMemFreeAsync, (dptr, stream))
        }
    };
}
cu_free_async!(cuMemFreeAsync);
cu_free_async!(cuMemFreeAsync_ptsz);

#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut CuMemHandle,
    size: usize,
    prop: *const CuMemAllocationProp,
    flags: c_ulonglong,
) -> CuResult {
    let scope = Scope::enter();
    let r = call_real!(cuMemCreate, FnCuMemCreate, (handle, size, prop, flags));
    if scope.outermost() && r == CUDA_SUCCESS && !handle.is_null() {
        // Host (NUMA) locations are not device memory: NCCL allocates those this way
        // (interposer-prior-art.md A8), so classify by the location type, not its id.
        let device = if prop.is_null() {
            -1
        } else {
            // SAFETY: the caller's property struct, which the driver just read successfully.
            let loc = unsafe { (*prop).location };
            if loc.kind == CU_MEM_LOCATION_TYPE_DEVICE {
                loc.id
            } else {
                -1
            }
        };
        // SAFETY: written by the successful call.
        let h = unsafe { *handle };
        record::vmm(Kind::MemCreate, Api::CuMemCreate, device, 0, size as u64, h);
    } else if scope.outermost() && r == CUDA_ERROR_OUT_OF_MEMORY {
        record::allocation(r, Kind::MemCreate, Api::CuMemCreate, 0, size as u64, 0);
    }
    r
}

#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMemRelease(handle: CuMemHandle) -> CuResult {
    let scope = Scope::enter();
    if scope.outermost() {
        record::vmm(Kind::MemRelease, Api::CuMemRelease, -1, 0, 0, handle);
    }
    call_real!(cuMemRelease, FnCuMemRelease, (handle))
}

#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMemAddressReserve(
    ptr: *mut CuDevicePtr,
    size: usize,
    alignment: usize,
    addr: CuDevicePtr,
    flags: c_ulonglong,
) -> CuResult {
    let scope = Scope::enter();
    let r = call_real!(
        cuMemAddressReserve,
        FnCuMemAddressReserve,
        (ptr, size, alignment, addr, flags)
    );
    if scope.outermost() && r == CUDA_SUCCESS {
        record::vmm(
            Kind::Reserve,
            Api::CuMemAddressReserve,
            -1,
            out_ptr(ptr),
            size as u64,
            0,
        );
    }
    r
}

#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMemAddressFree(ptr: CuDevicePtr, size: usize) -> CuResult {
    let scope = Scope::enter();
    if scope.outermost() {
        record::vmm(
            Kind::ReserveFree,
            Api::CuMemAddressFree,
            -1,
            ptr,
            size as u64,
            0,
        );
    }
    call_real!(cuMemAddressFree, FnCuMemAddressFree, (ptr, size))
}

#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMemMap(
    ptr: CuDevicePtr,
    size: usize,
    offset: usize,
    handle: CuMemHandle,
    flags: c_ulonglong,
) -> CuResult {
    let scope = Scope::enter();
    let r = call_real!(cuMemMap, FnCuMemMap, (ptr, size, offset, handle, flags));
    if scope.outermost() && r == CUDA_SUCCESS {
        record::mapping(Kind::Map, ptr, size as u64, handle);
    }
    r
}

#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cuMemUnmap(ptr: CuDevicePtr, size: usize) -> CuResult {
    let scope = Scope::enter();
    if scope.outermost() {
        record::mapping(Kind::Unmap, ptr, size as u64, 0);
    }
    call_real!(cuMemUnmap, FnCuMemUnmap, (ptr, size))
}

// Runtime twins: reached through their exported symbols (programs linked against the
// shared libcudart). The driver call underneath hits the guard and is not recorded again.

#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cudaMalloc(dev_ptr: *mut *mut c_void, size: usize) -> CuResult {
    let scope = Scope::enter();
    let r = call_real!(cudaMalloc, FnCudaMalloc, (dev_ptr, size));
    if scope.outermost() {
        record::allocation(
            r,
            Kind::Alloc,
            Api::CudaMalloc,
            out_host_ptr(dev_ptr),
            size as u64,
            0,
        );
    }
    r
}

#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cudaFree(dev_ptr: *mut c_void) -> CuResult {
    let scope = Scope::enter();
    if scope.outermost() && !dev_ptr.is_null() {
        record::release(Kind::Free, Api::CudaFree, dev_ptr as u64, 0, 0);
    }
    call_real!(cudaFree, FnCudaFree, (dev_ptr))
}

macro_rules! cuda_malloc_async {
    ($sym:ident) => {
        #[cfg_attr(not(test), unsafe(no_mangle))]
        pub unsafe extern "C" fn $sym(
            dev_ptr: *mut *mut c_void,
            size: usize,
            stream: CuStream,
        ) -> CuResult {
            let scope = Scope::enter();
            let r = call_real!($sym, FnCudaMallocAsync, (dev_ptr, size, stream));
            if scope.outermost() {
                record::allocation(
                    r,
                    Kind::Alloc,
                    Api::CudaMallocAsync,
                    out_host_ptr(dev_ptr),
                    size as u64,
                    stream as u64,
                );
            }
            r
        }
    };
}
cuda_malloc_async!(cudaMallocAsync);
cuda_malloc_async!(cudaMallocAsync_ptsz);

macro_rules! cuda_free_async {
    ($sym:ident) => {
        #[cfg_attr(not(test), unsafe(no_mangle))]
        pub unsafe extern "C" fn $sym(dev_ptr: *mut c_void, stream: CuStream) -> CuResult {
            let scope = Scope::enter();
            if scope.outermost() && !dev_ptr.is_null() {
                record::release(
                    Kind::Free,
                    Api::CudaFreeAsync,
                    dev_ptr as u64,
                    0,
                    stream as u64,
                );
            }
            call_real!($sym, FnCudaFreeAsync, (dev_ptr, stream))
        }
    };
}
cuda_free_async!(cudaFreeAsync);
cuda_free_async!(cudaFreeAsync_ptsz);

macro_rules! cuda_malloc_from_pool_async {
    ($sym:ident) => {
        #[cfg_attr(not(test), unsafe(no_mangle))]
        pub unsafe extern "C" fn $sym(
            dev_ptr: *mut *mut c_void,
            size: usize,
            pool: CuMemPool,
            stream: CuStream,
        ) -> CuResult {
            let scope = Scope::enter();
            let r = call_real!(
                $sym,
                FnCudaMallocFromPoolAsync,
                (dev_ptr, size, pool, stream)
            );
            if scope.outermost() {
                record::allocation(
                    r,
                    Kind::Alloc,
                    Api::CudaMallocFromPoolAsync,
                    out_host_ptr(dev_ptr),
                    size as u64,
                    stream as u64,
                );
            }
            r
        }
    };
}
cuda_malloc_from_pool_async!(cudaMallocFromPoolAsync);
cuda_malloc_from_pool_async!(cudaMallocFromPoolAsync_ptsz);

#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cudaMallocManaged(
    dev_ptr: *mut *mut c_void,
    size: usize,
    flags: c_uint,
) -> CuResult {
    let scope = Scope::enter();
    let r = call_real!(
        cudaMallocManaged,
        FnCudaMallocManaged,
        (dev_ptr, size, flags)
    );
    if scope.outermost() {
        record::allocation(
            r,
            Kind::AllocManaged,
            Api::CudaMallocManaged,
            out_host_ptr(dev_ptr),
            size as u64,
            0,
        );
    }
    r
}

#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cudaMallocPitch(
    dev_ptr: *mut *mut c_void,
    pitch: *mut usize,
    width: usize,
    height: usize,
) -> CuResult {
    let scope = Scope::enter();
    let r = call_real!(
        cudaMallocPitch,
        FnCudaMallocPitch,
        (dev_ptr, pitch, width, height)
    );
    if scope.outermost() {
        let size = pitched_bytes(r, pitch, width, height);
        record::allocation(
            r,
            Kind::Alloc,
            Api::CudaMallocPitch,
            out_host_ptr(dev_ptr),
            size,
            0,
        );
    }
    r
}

#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn cudaMalloc3D(
    pitched: *mut CudaPitchedPtr,
    extent: CudaExtent,
) -> CuResult {
    let scope = Scope::enter();
    let r = call_real!(cudaMalloc3D, FnCudaMalloc3D, (pitched, extent));
    if scope.outermost() {
        let (ptr, pitch) = if pitched.is_null() || r != CUDA_SUCCESS {
            (0, extent.width)
        } else {
            // SAFETY: written by the successful real call.
            unsafe { ((*pitched).ptr as u64, (*pitched).pitch) }
        };
        let size = (pitch as u64)
            .saturating_mul(extent.height as u64)
            .saturating_mul(extent.depth as u64);
        record::allocation(r, Kind::Alloc, Api::CudaMalloc3D, ptr, size, 0);
    }
    r
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
        assert_eq!(
            HOOKS[HookId::cuMemAlloc_v2 as usize].name,
            "cuMemAlloc_v2\0"
        );
        assert_eq!(
            HOOKS[HookId::cuMemAlloc_v2 as usize].hook,
            cuMemAlloc_v2 as *const ()
        );
        assert_eq!(driver_hook_by_name(b"cuMemMap"), Some(HookId::cuMemMap));
        assert_eq!(
            driver_hook_by_name(b"cudaMalloc"),
            None,
            "runtime names are not routed"
        );
    }

    #[test]
    fn our_own_wrapper_never_stands_for_the_driver() {
        ensure_driver_table(cuMemAlloc_v2 as *mut c_void);
        assert_ne!(
            DRIVER_TABLE.load(Acquire),
            TABLE_READY,
            "table built from libmemsnap itself"
        );
    }

    #[test]
    fn unknown_pointers_pass_through_routing() {
        let p = 0x1234usize as *mut c_void;
        assert_eq!(route_driver_pointer(p), p);
        assert_eq!(route_driver_pointer(null_mut()), null_mut());
    }
}
