//! The bodies of the test, debug and benchmark entry points (`memsnap_debug_*`, declared in
//! `exports.rs`): capture the caller's stack as a hook would, and resolve it as the writer
//! would, in one call. They compose capture and the writer's stack table, which is why they
//! live in the composition root (the timing loops' code in benches/in_library/capture.rs).
//! Compiled only with the `bench-hooks` feature, which the shipped library and the wheel
//! leave off. Cold: they allocate and lock; never called by a hook.

use crate::capture::{Trail, capture};
use crate::channel::event::StackSlot;
use crate::config::{FRAME_CAPACITY, Stacks};

/// The debug entry points' C arguments: stacks 0 none, 1 python, 2 native, else all;
/// a frame limit of 0 or less means the most there is.
fn debug_args(stacks: libc::c_int, max_frames: libc::c_int) -> (Stacks, usize) {
    let stacks = match stacks {
        0 => Stacks::None,
        1 => Stacks::Python,
        2 => Stacks::Native,
        _ => Stacks::All,
    };
    let max = if max_frames <= 0 {
        FRAME_CAPACITY
    } else {
        (max_frames as usize).min(FRAME_CAPACITY)
    };
    (stacks, max)
}

/// Benchmark entry point: with `on` non-zero, the calling thread's CUDA calls pass through
/// memsnap unrecorded until it is called again with 0 (see `guard::set_pass_through`).
/// The record then misses what the thread did meanwhile, so a benchmark must free in each
/// phase what it allocated there; `benches/gpu/hook_cost_torch.py` times the same loop
/// both ways in one process with it.
#[inline(always)]
pub fn pass_through(on: libc::c_int) {
    crate::guard::set_pass_through(on != 0);
}

/// Benchmark entry point: [`pass_through`] for every thread of the process at once
/// (`guard::set_pass_through_every_thread`), with the same warning: a benchmark must free
/// in each phase what it allocated there. `benches/gpu/step_time.py` times a training step
/// both ways in one process with it.
#[inline(always)]
pub fn pass_through_every_thread(on: libc::c_int) {
    crate::guard::set_pass_through_every_thread(on != 0);
}

/// Debug and test entry point: captures the caller's stack (`stacks`: 0 none, 1 python,
/// 2 native, 3 all; `max_frames` 0 = the maximum), resolves it at once the way the writer
/// does, and writes `{"frames": [{"name","filename","line"}, ...] (innermost first),
/// "truncated": bool, "warnings": [str]}` as JSON into `buf`. Returns the JSON's length in
/// bytes (written only if it fits in `len`), or -1.
///
/// # Safety
/// `buf` must be null or point to `len` writable bytes.
///
/// Not for hooks: it allocates and takes a lock. `ctypes.CDLL("libmemsnap.so")` can call it
/// from Python (ctypes releases the GIL around the call, as PyTorch's CUDA calls do).
#[inline(always)]
pub unsafe fn capture_json(
    stacks: libc::c_int,
    max_frames: libc::c_int,
    buf: *mut u8,
    len: usize,
) -> isize {
    let (stacks, max) = debug_args(stacks, max_frames);
    let (mut slot, mut trail) = (StackSlot::EMPTY, Trail::EMPTY);
    capture(&mut slot, &mut trail, stacks, max);
    let result = std::panic::catch_unwind(move || {
        let json = debug_resolve_json(&slot, stacks, max);
        let bytes = json.as_bytes();
        if !buf.is_null() && bytes.len() <= len {
            // SAFETY: the caller gave `len` writable bytes at `buf`.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf, bytes.len()) };
        }
        bytes.len() as isize
    });
    result.unwrap_or(-1)
}

/// Writes an entry point's figures to the caller's `out`, unless it is null.
///
/// # Safety
/// `out` must be null or point to `N` writable `u64`.
#[inline(always)]
unsafe fn write_figures<const N: usize>(out: *mut u64, figures: [u64; N]) {
    if !out.is_null() {
        // SAFETY: `out` points to `N` writable `u64` (this function's contract).
        unsafe { std::ptr::copy_nonoverlapping(figures.as_ptr(), out, N) };
    }
}

/// The capture's timing loops. Their code lives with the other benchmarks, in
/// benches/in_library/; it is compiled here, beside the entry points that call it.
#[path = "../../benches/in_library/capture.rs"]
mod capture_bench;
pub use capture_bench::{bench_capture, bench_capture_cold};

/// Test entry point: one warm-up capture, then `iterations` captures between two calls of
/// `counter` (a caller-supplied reading, e.g. of a malloc counter); returns the difference
/// of the readings, so a test can prove the steady-state hot path allocates nothing.
///
/// # Safety
/// `frames_out` must be null or point to two writable `u64`.
#[inline(always)]
pub unsafe fn capture_counted(
    stacks: libc::c_int,
    iterations: u64,
    counter: Option<extern "C" fn() -> u64>,
    frames_out: *mut u64,
) -> u64 {
    let stacks = match stacks {
        0 => Stacks::None,
        1 => Stacks::Python,
        2 => Stacks::Native,
        _ => Stacks::All,
    };
    let Some(counter) = counter else {
        return u64::MAX;
    };
    let mut slot = StackSlot::EMPTY;
    let mut trail = Trail::EMPTY;
    capture(&mut slot, &mut trail, stacks, FRAME_CAPACITY);
    let before = counter();
    for _ in 0..iterations {
        capture(
            std::hint::black_box(&mut slot),
            &mut trail,
            stacks,
            FRAME_CAPACITY,
        );
    }
    let after = counter();
    let frames = [slot.n_native as u64, slot.n_python as u64];
    // SAFETY: the caller passes null or room for two u64.
    unsafe { write_figures(frames_out, frames) };
    after.wrapping_sub(before)
}

/// Resolves one captured slot with a process-wide debug [`StackTable`] (created on first use).
///
/// [`StackTable`]: crate::writer::stacks::StackTable
pub fn debug_resolve_json(slot: &StackSlot, stacks: Stacks, max: usize) -> String {
    use crate::writer::stacks::StackTable;
    use std::sync::Mutex;
    static TABLE: Mutex<Option<StackTable>> = Mutex::new(None);
    let mut guard = TABLE.lock().unwrap_or_else(|e| e.into_inner());
    let table = guard.get_or_insert_with(|| {
        let cfg = crate::config::Config {
            stacks,
            max_frames: max,
            ..Default::default()
        };
        StackTable::new(&cfg)
    });
    table.refresh_modules();
    let frames: Vec<serde_json::Value> = match table.intern(slot) {
        Some(id) => table
            .frames(id)
            .iter()
            .map(|f| serde_json::json!({"name": f.name, "filename": f.filename, "line": f.line}))
            .collect(),
        None => Vec::new(),
    };
    let warnings = table.take_warnings();
    serde_json::json!({"frames": frames, "truncated": slot.truncated, "warnings": warnings})
        .to_string()
}

/// Benchmark entry point: the writer's drain rate (see `writer::drain_bench`). Sends
/// `events` synthetic events of `route` with stacks of `depth` native frames drawn from
/// `distinct_stacks` stacks through a real channel and applies them as the writer does;
/// returns the nanoseconds spent applying them, or 0 when the run failed (the writer
/// misapplied its events: the figures would be its repair paths'). `out[0]` receives the
/// stacks interned, `out[1]` the growth of resident memory in bytes, `out[2]` the stacks
/// that came in full (the rest came by reference), `out[3]` the nanoseconds the writer
/// took for the same events drained in bursts from a filled queue (its rate alone).
///
/// # Safety
/// `out` must be null or point to four writable `u64`.
#[inline(always)]
pub unsafe fn bench_writer(
    route: crate::writer::drain_bench::Route,
    events: u64,
    distinct_stacks: u32,
    depth: u32,
    out: *mut u64,
) -> u64 {
    let figures = std::panic::catch_unwind(|| {
        crate::writer::drain_bench::run(events, distinct_stacks, depth as usize, route)
    });
    let Ok(f) = figures else { return 0 };
    let figures = [f.interned, f.rss_growth_bytes, f.sent_in_full, f.burst_ns];
    // SAFETY: the caller passes null or room for four u64.
    unsafe { write_figures(out, figures) };
    f.nanoseconds
}

/// Benchmark entry point: what a `memsnap top` request costs the writer (see
/// `writer::drain_bench::live_requests`) with `live` live allocations whose stacks of
/// `depth` native frames are drawn from `distinct_stacks`. Returns the median writer
/// nanoseconds per request after the first; `out` receives the slowest of those, the last
/// answer's bytes, the first request's nanoseconds and the first answer's bytes.
///
/// # Safety
/// `out` must be null or point to four writable `u64`.
#[inline(always)]
pub unsafe fn bench_live(
    live: u64,
    distinct_stacks: u32,
    depth: u32,
    requests: u32,
    out: *mut u64,
) -> u64 {
    let figures = std::panic::catch_unwind(|| {
        crate::writer::drain_bench::live_requests(live, distinct_stacks, depth as usize, requests)
    });
    let Ok(f) = figures else { return 0 };
    let slowest = f.per_request_ns.last().copied().unwrap_or(0);
    let figures = [
        slowest,
        f.answer_bytes,
        f.first_request_ns,
        f.first_answer_bytes,
    ];
    // SAFETY: the caller passes null or room for four u64.
    unsafe { write_figures(out, figures) };
    f.per_request_ns
        .get(f.per_request_ns.len() / 2)
        .copied()
        .unwrap_or(0)
}
