//! Proof that the hot path never allocates: the crate's counting global allocator (per
//! thread, so the writer thread's own allocations do not count) around the real exported wrappers,
//! with stand-in "real" CUDA functions behind them.

use crate::interpose::ffi::*;
use crate::interpose::{self as hooks, HookId};
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering::*};

use crate::counting_alloc::thread_allocations as allocations_on_this_thread;

static NEXT: AtomicU64 = AtomicU64::new(0x7f00_0000_0000);

unsafe extern "C" fn fake_mem_alloc(dptr: *mut CuDevicePtr, size: usize) -> CuResult {
    // SAFETY: the test passes a valid out-pointer.
    unsafe { *dptr = NEXT.fetch_add((size as u64 + 511) & !511, Relaxed) };
    CUDA_SUCCESS
}
unsafe extern "C" fn fake_mem_free(_: CuDevicePtr) -> CuResult {
    CUDA_SUCCESS
}
unsafe extern "C" fn fake_alloc_async(
    dptr: *mut CuDevicePtr,
    size: usize,
    _: CuStream,
) -> CuResult {
    // SAFETY: as above.
    unsafe { fake_mem_alloc(dptr, size) }
}
unsafe extern "C" fn fake_free_async(_: CuDevicePtr, _: CuStream) -> CuResult {
    CUDA_SUCCESS
}
/// A runtime whose cudaMalloc calls the driver through our (hooked) cuMemAlloc_v2.
unsafe extern "C" fn fake_cuda_malloc(p: *mut *mut c_void, size: usize) -> CuResult {
    let mut d: CuDevicePtr = 0;
    // SAFETY: calling our own wrapper with a valid out-pointer.
    let r = unsafe { hooks::cuMemAlloc_v2(&mut d, size) };
    // SAFETY: valid out-pointer from the test.
    unsafe { *p = d as *mut c_void };
    r
}
unsafe extern "C" fn fake_oom(_: *mut CuDevicePtr, _: usize) -> CuResult {
    CUDA_ERROR_OUT_OF_MEMORY
}

/// The writer's count of events applied, once it has taken every queued event (it counts
/// an event when it takes it off the queue).
fn applied_when_drained(rec: &crate::channel::queue::Recorder) -> u64 {
    let start = std::time::Instant::now();
    while rec.queued() > 0 && start.elapsed() < std::time::Duration::from_secs(10) {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    rec.counters.applied.load(Relaxed)
}

/// Events the writer applied since `before`, once it has applied `expected` of them (or
/// after 10 s, to fail with the count): the hooks count nothing per event, the writer does.
fn applied_since(rec: &crate::channel::queue::Recorder, before: u64, expected: u64) -> u64 {
    let start = std::time::Instant::now();
    loop {
        let n = rec.counters.applied.load(Relaxed) - before + rec.counters.lost_total();
        if n >= expected || start.elapsed() > std::time::Duration::from_secs(10) {
            return n;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

#[test]
fn hooks_do_not_allocate_in_steady_state() {
    let dir = tempfile::tempdir().unwrap();
    // SAFETY: set before any other thread of this test binary reads these variables
    // (recording starts lazily below, in this thread).
    unsafe {
        std::env::set_var("MEMSNAP_FOLDER", dir.path());
        std::env::set_var("MEMSNAP_AT_EXIT", "0");
        std::env::set_var("MEMSNAP_SIGNAL", "none");
        std::env::set_var("MEMSNAP_STACKS", "all");
        std::env::set_var("MEMSNAP_QUIET", "1");
    }
    hooks::routing::set_real_for_test(HookId::cuMemAlloc_v2, fake_mem_alloc as *mut c_void);
    hooks::routing::set_real_for_test(HookId::cuMemFree_v2, fake_mem_free as *mut c_void);
    hooks::routing::set_real_for_test(HookId::cuMemAllocAsync, fake_alloc_async as *mut c_void);
    hooks::routing::set_real_for_test(HookId::cuMemFreeAsync, fake_free_async as *mut c_void);
    hooks::routing::set_real_for_test(HookId::cudaMalloc, fake_cuda_malloc as *mut c_void);
    hooks::routing::set_real_for_test(HookId::cudaFree, fake_mem_free as *mut c_void);

    let round = || {
        let mut d: CuDevicePtr = 0;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: our wrappers over the stand-ins above, with valid out-pointers.
        unsafe {
            assert_eq!(hooks::cuMemAlloc_v2(&mut d, 4096), CUDA_SUCCESS);
            assert_eq!(hooks::cuMemFree_v2(d), CUDA_SUCCESS);
            assert_eq!(
                hooks::cuMemAllocAsync(&mut d, 1 << 20, std::ptr::null_mut()),
                CUDA_SUCCESS
            );
            assert_eq!(hooks::cuMemFreeAsync(d, std::ptr::null_mut()), CUDA_SUCCESS);
            assert_eq!(hooks::cudaMalloc(&mut p, 512), CUDA_SUCCESS);
            assert_eq!(hooks::cudaFree(p), CUDA_SUCCESS);
        }
    };
    round(); // first event: starts the writer (allowed to allocate once)
    let rec = crate::channel::recording::recorder().expect("recording started");
    let applied_before = applied_when_drained(rec);
    let by_reference_before = crate::channel::sent::this_thread().map_or(0, |t| t.by_reference);
    let reused_before = crate::capture::native::WALKS_REUSED.load(Relaxed);
    let before = allocations_on_this_thread();
    for _ in 0..1000 {
        round();
    }
    assert_eq!(
        allocations_on_this_thread() - before,
        0,
        "the hot path allocated"
    );
    // The path proven is the steady state's: walks that take earlier walks' paths of
    // frames, and stacks sent by reference (three allocations a round, same call sites).
    let by_reference =
        crate::channel::sent::this_thread().map_or(0, |t| t.by_reference) - by_reference_before;
    assert_eq!(by_reference, 3000, "repeated stacks went by reference");
    assert!(
        crate::capture::native::WALKS_REUSED.load(Relaxed) - reused_before >= 2000,
        "walks took earlier walks' paths"
    );
    // Exactly once per allocation and free, whichever route (cudaMalloc nests cuMemAlloc).
    assert_eq!(applied_since(rec, applied_before, 6000), 6000);

    // PyTorch's caching-allocator tracker: a block handed out, freed and completed, as
    // PyTorch calls it (an entry of its 2.11 layout on the stack), with stacks.
    let number = crate::pytorch::layout::number_for_version("2.11.0").expect("2.11 is known");
    crate::pytorch::set_layout_for_test(number);
    let layout = crate::pytorch::layout::by_number(number).expect("its layout");
    let entry = |action: u32, addr: u64| {
        let mut e = [0u8; 136];
        e[layout.action..layout.action + 4].copy_from_slice(&action.to_ne_bytes());
        e[layout.addr..layout.addr + 8].copy_from_slice(&addr.to_ne_bytes());
        e[layout.size..layout.size + 8].copy_from_slice(&4096u64.to_ne_bytes());
        e
    };
    let (alloc, free_requested, free_completed) = (
        entry(0, 0x7e00_0000),
        entry(1, 0x7e00_0000),
        entry(2, 0x7e00_0000),
    );
    let track = |e: &[u8; 136]| {
        // SAFETY: the tracker reads the entry's fields within its 136 bytes.
        unsafe { crate::pytorch::on_trace_entry(std::ptr::null(), e.as_ptr()) }
    };
    track(&alloc); // the first stack goes in full
    track(&free_requested);
    track(&free_completed);
    let applied_before = applied_when_drained(rec);
    let before = allocations_on_this_thread();
    for _ in 0..1000 {
        track(&alloc);
        track(&free_requested);
        track(&free_completed);
    }
    assert_eq!(
        allocations_on_this_thread() - before,
        0,
        "the tracker allocated"
    );
    assert_eq!(
        applied_since(rec, applied_before, 3000),
        3000,
        "one event per entry"
    );

    // The OOM path (cold) is allowed to block, but it must not allocate either.
    hooks::routing::set_real_for_test(HookId::cuMemAlloc_v2, fake_oom as *mut c_void);
    let before = allocations_on_this_thread();
    let mut d: CuDevicePtr = 0;
    assert_eq!(
        // SAFETY: as above.
        unsafe { hooks::cuMemAlloc_v2(&mut d, 1 << 40) },
        CUDA_ERROR_OUT_OF_MEMORY
    );
    assert_eq!(d, 0, "out-parameter untouched on failure");
    assert_eq!(
        allocations_on_this_thread() - before,
        0,
        "the OOM path allocated"
    );

    // A segment of a CUDA graph's private pool (cold, once per segment): the segment's
    // event and its pool's, without allocating.
    hooks::routing::set_real_for_test(HookId::cuMemAlloc_v2, fake_mem_alloc as *mut c_void);
    const SEGMENT: u64 = 2 << 20;
    let private_segment = || {
        let mut d: CuDevicePtr = 0;
        // SAFETY: our wrapper over the stand-in above, with a valid out-pointer.
        let allocated = unsafe { hooks::cuMemAlloc_v2(&mut d, SEGMENT as usize) };
        assert_eq!(allocated, CUDA_SUCCESS);
        let mut e = [0u8; 136];
        e[layout.action..layout.action + 4].copy_from_slice(&3u32.to_ne_bytes());
        e[layout.addr..layout.addr + 8].copy_from_slice(&d.to_ne_bytes());
        e[layout.size..layout.size + 8].copy_from_slice(&SEGMENT.to_ne_bytes());
        let pool = layout.mempool.expect("2.11's entry has a pool");
        e[pool + 8..pool + 16].copy_from_slice(&1u64.to_ne_bytes());
        track(&e);
    };
    private_segment();
    let applied_before = applied_when_drained(rec);
    let before = allocations_on_this_thread();
    for _ in 0..100 {
        private_segment();
    }
    assert_eq!(
        allocations_on_this_thread() - before,
        0,
        "a private pool's segment allocated"
    );
    assert_eq!(
        applied_since(rec, applied_before, 300),
        300,
        "the allocation, the segment and its pool, each once"
    );
}
