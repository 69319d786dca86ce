//! The stack capture's timing loops: the bodies of `memsnap_debug_bench_capture` (`cargo bench
//! --bench stacks`) and `memsnap_debug_bench_capture_cold` (benches/python/cold_capture.py).
//! Compiled into the library as a part of `lifecycle::debug`, only in `bench-hooks` builds:
//! they time the capture itself, which only the library can call. Cold.

use super::{debug_args, write_figures};
use crate::capture::{Trail, capture};
use crate::channel::event::StackSlot;

/// Benchmark entry point: captures the caller's stack `iterations` times (after one warm-up
/// capture) and returns the total nanoseconds; `out[0]`/`out[1]` receive the native/Python
/// frame counts of the last capture, `out[2]` the nanoseconds the writer then spends to
/// intern that stack `iterations` times, `out[3]` the nanoseconds of the first
/// symbolization and merge (cold caches, modules already parsed count too).
///
/// # Safety
/// `out` must be null or point to four writable `u64`.
#[inline(always)]
pub unsafe fn bench_capture(
    stacks: libc::c_int,
    max_frames: libc::c_int,
    iterations: u64,
    out: *mut u64,
) -> u64 {
    let (stacks, max) = debug_args(stacks, max_frames);
    let (mut slot, mut trail) = (StackSlot::EMPTY, Trail::EMPTY);
    capture(&mut slot, &mut trail, stacks, max);
    let start = std::time::Instant::now();
    for _ in 0..iterations {
        capture(std::hint::black_box(&mut slot), &mut trail, stacks, max);
    }
    let total = start.elapsed().as_nanos() as u64;
    let writer = std::panic::catch_unwind(|| {
        use crate::writer::stacks::StackTable;
        let mut table = StackTable::new(&crate::config::Config::default());
        let t0 = std::time::Instant::now();
        let mut id = None;
        for _ in 0..iterations.max(1) {
            id = std::hint::black_box(table.intern(&slot));
        }
        let intern_ns = t0.elapsed().as_nanos() as u64;
        let t1 = std::time::Instant::now();
        if let Some(id) = id {
            std::hint::black_box(table.frames(id));
        }
        (intern_ns, t1.elapsed().as_nanos() as u64)
    })
    .unwrap_or((0, 0));
    let figures = [
        slot.n_native as u64,
        slot.n_python as u64,
        writer.0,
        writer.1,
    ];
    // SAFETY: the caller passes null or room for four u64.
    unsafe { write_figures(out, figures) };
    total
}

/// Benchmark entry point: `iterations` captures of the caller's stack, each after
/// `evict_bytes` of a buffer were written, so that what the capture reads (the thread's
/// frames, the code objects, the walk's own tables) comes from farther out in the cache
/// hierarchy, as between two events of a real step. Returns the nanoseconds inside the
/// captures, less the cost of reading the clock around an empty interval.
#[inline(always)]
pub fn bench_capture_cold(
    stacks: libc::c_int,
    max_frames: libc::c_int,
    iterations: u64,
    evict_bytes: u64,
) -> u64 {
    let (stacks, max) = debug_args(stacks, max_frames);
    let (mut slot, mut trail) = (StackSlot::EMPTY, Trail::EMPTY);
    capture(&mut slot, &mut trail, stacks, max);
    let mut buffer = vec![0u64; (evict_bytes / 8).max(8) as usize];
    let (mut inside, mut empty) = (0u64, 0u64);
    for round in 0..iterations {
        for line in buffer.chunks_exact_mut(8) {
            line[0] = line[0].wrapping_add(round);
        }
        std::hint::black_box(&mut buffer);
        let start = std::time::Instant::now();
        capture(std::hint::black_box(&mut slot), &mut trail, stacks, max);
        inside += start.elapsed().as_nanos() as u64;
        let start = std::time::Instant::now();
        empty += std::hint::black_box(start).elapsed().as_nanos() as u64;
    }
    inside.saturating_sub(empty)
}
