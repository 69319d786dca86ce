//! The routing table: the real address behind every hook, the driver table learned from
//! the driver library, and the swap of a real driver pointer for its wrapper.
//!
//! Lookups are routed by the *returned pointer*, never by name (docs/CUDA.md, "Routing by
//! pointer"): the driver's answer is compared with the real address of every hooked ABI
//! variant (`_v2`, `_ptsz`, ...), and only an exact match is replaced by its wrapper.
//! Unknown pointers pass through untouched.
//!
//! Hot: [`real`] is one atomic load per hooked call once resolved; the rest runs when a
//! program looks symbols up.

use super::{HOOK_COUNT, HOOKS, HookId, Layer, device};
use crate::process::dlsym::real_dlsym;
use std::ffi::{CStr, c_void};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicPtr, AtomicU8, AtomicU64, Ordering::*};

/// The real function behind each hook, found once; hook `id`'s at `SLOT[id]`.
#[repr(C, align(64))]
struct RealTable([AtomicPtr<c_void>; HOOK_COUNT]);

static REAL: RealTable = RealTable([const { AtomicPtr::new(null_mut()) }; HOOK_COUNT]);

/// The hooks a recorded allocation or free of the common routes passes through, each of
/// which reads its real function on every call: their slots fill the table's first cache
/// line, so that an event waits for one line of it, not three (PyTorch's
/// `cudaMallocAsync` mode calls the runtime's pair, which calls the driver's; programs on
/// the driver or on plain `cudaMalloc` call the other four).
const FIRST_LINE: [HookId; 8] = [
    HookId::cudaMallocAsync,
    HookId::cudaFreeAsync,
    HookId::cuMemAllocAsync,
    HookId::cuMemFreeAsync,
    HookId::cudaMalloc,
    HookId::cudaFree,
    HookId::cuMemAlloc_v2,
    HookId::cuMemFree_v2,
];

/// Each hook's place in [`REAL`]: those of [`FIRST_LINE`] first, the others after them in
/// the hook table's order. (A hook named twice in `FIRST_LINE` would leave a place empty
/// and push the last past the end: the build fails.)
const SLOT: [usize; HOOK_COUNT] = {
    let mut slot = [usize::MAX; HOOK_COUNT];
    let mut i = 0;
    while i < FIRST_LINE.len() {
        slot[FIRST_LINE[i] as usize] = i;
        i += 1;
    }
    let mut next = FIRST_LINE.len();
    let mut id = 0;
    while id < HOOK_COUNT {
        if slot[id] == usize::MAX {
            slot[id] = next;
            next += 1;
        }
        id += 1;
    }
    assert!(next == HOOK_COUNT);
    slot
};

/// Where the real function of hook `id` is kept.
#[inline(always)]
fn real_slot(id: HookId) -> &'static AtomicPtr<c_void> {
    &REAL.0[SLOT[id as usize]]
}

/// The real function for `id` as the function-pointer type `F`, found on first use: the
/// driver table if built, else the next definition after us in the global scope.
///
/// # Safety
/// `F` must be the function-pointer type of the symbol named by `id`. The hook table
/// derives both from one written signature, so its wrappers always pass the right one.
#[inline(always)]
pub unsafe fn real<F: Copy>(id: HookId) -> Option<F> {
    let p = real_ptr(id);
    if p.is_null() {
        return None;
    }
    const { assert!(size_of::<F>() == size_of::<*mut c_void>()) };
    // SAFETY: `p` is the symbol's address in the real library and `F` its type (caller's
    // contract); both are pointer-sized (checked above at compile time).
    Some(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) })
}

/// The real address for `id` (null when it cannot be found).
#[inline(always)]
pub fn real_ptr(id: HookId) -> *mut c_void {
    let p = real_slot(id).load(Acquire);
    if p.is_null() { resolve_next(id) } else { p }
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
    let mut p = unsafe { real_dlsym(libc::RTLD_NEXT, name) };
    if p.is_null() {
        // RTLD_NEXT searches the global scope only: a runtime or driver that its user loaded
        // with RTLD_LOCAL is not there, though that user's calls still reach our export.
        p = in_local_library(row.layer, name);
    }
    if p.is_null() || is_our_hook(p) {
        return null_mut();
    }
    let slot = real_slot(id);
    let _ = slot.compare_exchange(null_mut(), p, AcqRel, Acquire);
    if row.layer == Layer::Driver {
        ensure_driver_table(p);
    }
    slot.load(Acquire)
}

/// `name` in a CUDA runtime or driver that is loaded but not in the global scope (opened
/// with `RTLD_LOCAL`), found by its soname; null when none is loaded.
fn in_local_library(layer: Layer, name: &CStr) -> *mut c_void {
    let sonames: &[&CStr] = match layer {
        Layer::Runtime => &[
            c"libcudart.so.13",
            c"libcudart.so.12",
            c"libcudart.so.11.0",
            c"libcudart.so",
        ],
        Layer::Driver => &[c"libcuda.so.1", c"libcuda.so"],
    };
    for soname in sonames {
        // SAFETY: NOLOAD only looks the name up among loaded libraries.
        let handle = unsafe { libc::dlopen(soname.as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_LAZY) };
        if handle.is_null() {
            continue;
        }
        // SAFETY: `handle` is live until the dlclose below.
        let p = unsafe { real_dlsym(handle, name) };
        // SAFETY: balances the NOLOAD dlopen; the library stays loaded (its user holds it).
        unsafe { crate::process::dlsym::real_dlclose(handle) };
        if !p.is_null() {
            return p;
        }
    }
    null_mut()
}

/// Test support: installs a stand-in "real" function behind a hook.
#[cfg(test)]
pub fn set_real_for_test(id: HookId, f: *mut c_void) {
    real_slot(id).store(f, Release);
}

pub fn driver_hook_by_name(name: &[u8]) -> Option<HookId> {
    HOOKS
        .iter()
        .find(|row| {
            row.layer == Layer::Driver && row.name.as_bytes().strip_suffix(b"\0") == Some(name)
        })
        .map(|row| row.id)
}

const TABLE_EMPTY: u8 = 0;
const TABLE_BUILDING: u8 = 1;
const TABLE_READY: u8 = 2;
static DRIVER_TABLE: AtomicU8 = AtomicU8::new(TABLE_EMPTY);

/// Resolves every hooked driver symbol in the library containing `sample` (a pointer into
/// the driver). Once per process; concurrent callers wait for the first.
pub fn ensure_driver_table(sample: *mut c_void) {
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
            for (row, slot) in HOOKS.iter().map(|row| (row, real_slot(row.id))) {
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
            // SAFETY: as above.
            unsafe { device::find_in_driver(handle) };
            // SAFETY: balances the reference the NOLOAD dlopen took.
            unsafe { crate::process::dlsym::real_dlclose(handle) };
        }
    }
    DRIVER_TABLE.store(TABLE_READY, Release);
}

fn is_our_hook(p: *mut c_void) -> bool {
    HOOKS.iter().any(|row| row.hook as *mut c_void == p)
}

/// Replaces a real driver pointer by its wrapper; anything else is returned unchanged.
pub fn route_driver_pointer(p: *mut c_void) -> *mut c_void {
    if p.is_null() {
        return p;
    }
    for (row, slot) in HOOKS.iter().map(|row| (row, real_slot(row.id))) {
        if row.layer == Layer::Driver && slot.load(Acquire) == p {
            return row.hook as *mut c_void;
        }
    }
    p
}

/// After a successful lookup, swaps a hooked driver pointer in `*pfn` for its wrapper.
///
/// # Safety
/// `pfn` is null or the out-parameter the successful lookup wrote.
pub unsafe fn route_out_param(
    pfn: *mut *mut c_void,
    driver_sample: *mut c_void,
    counter: &AtomicU64,
) {
    if pfn.is_null() {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn our_own_wrapper_never_stands_for_the_driver() {
        ensure_driver_table(HOOKS[HookId::cuMemAlloc_v2 as usize].hook as *mut c_void);
        assert_ne!(
            DRIVER_TABLE.load(Acquire),
            TABLE_READY,
            "table built from libmemsnap itself"
        );
    }

    #[test]
    fn every_hook_has_a_place_of_its_own_and_the_common_ones_share_a_line() {
        let mut places: Vec<usize> = HOOKS.iter().map(|row| SLOT[row.id as usize]).collect();
        places.sort_unstable();
        assert_eq!(places, (0..HOOK_COUNT).collect::<Vec<_>>());
        let line = |id: HookId| real_slot(id) as *const AtomicPtr<c_void> as usize / 64;
        for id in FIRST_LINE {
            assert_eq!(line(id), line(FIRST_LINE[0]), "{id:?}");
        }
        // A stand-in installed for one hook is that hook's alone.
        set_real_for_test(HookId::cuMemAllocManaged, 0x5150usize as *mut c_void);
        for row in HOOKS.iter() {
            let p = real_slot(row.id).load(Acquire) as usize;
            assert_eq!(
                p == 0x5150,
                row.id == HookId::cuMemAllocManaged,
                "{:?}",
                row.id
            );
        }
        set_real_for_test(HookId::cuMemAllocManaged, null_mut());
    }

    #[test]
    fn unknown_pointers_pass_through_routing() {
        let p = 0x1234usize as *mut c_void;
        assert_eq!(route_driver_pointer(p), p);
        assert_eq!(route_driver_pointer(null_mut()), null_mut());
    }
}
