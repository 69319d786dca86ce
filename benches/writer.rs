//! The writer's drain rate with whole stacks (not a timed test; figures go to
//! docs/BENCHMARKS.md).
//!
//! `cargo bench --bench writer` builds the release `libmemsnap.so` and calls its
//! `memsnap_debug_bench_writer` and `memsnap_debug_bench_writer_blocks` entry points: a
//! producer thread sends synthetic events with native stacks through the real channel
//! while the calling thread applies them as the writer thread does (stack interning and
//! the per-device state; see benches/in_library/writer_drain.rs), on each of memsnap's routes: the
//! CUDA calls' allocations and frees, and PyTorch's caching allocator's trace entries
//! (blocks handed out, frees requested, frees completed). Prints events per second on one
//! core and the growth of resident memory, for 10M events at 45 and 57 frames, 2,000 and
//! 20,000 distinct stacks, and the writer's rate alone: the same events drained in bursts
//! from a filled queue (one producer thread is slower than the writer). `BENCH_EVENTS=N`
//! (the bench's own variable, not the library's) sends N events a run instead.

mod support;

fn main() {
    if !support::benchmarking("writer") {
        return;
    }
    type Bench = unsafe extern "C" fn(u64, u32, u32, *mut u64) -> u64;
    let events: u64 = support::setting("BENCH_EVENTS", 10_000_000);
    println!(
        "| route | events | native frames per stack | distinct stacks | stacks interned | stacks sent in full | events/s applied (one core) | ns per event | writer alone: events/s drained in bursts from a filled queue | resident memory growth |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for (route, symbol) in [
        ("CUDA calls", c"memsnap_debug_bench_writer"),
        ("caching allocator", c"memsnap_debug_bench_writer_blocks"),
    ] {
        let b = support::entry_point(symbol);
        // SAFETY: the symbol has this C signature.
        let bench = unsafe { std::mem::transmute::<*mut libc::c_void, Bench>(b) };
        for (depth, distinct) in [(45u32, 2_000u32), (45, 20_000), (57, 2_000), (57, 20_000)] {
            let mut out = [0u64; 4];
            // SAFETY: a valid function pointer and a four-element output array.
            let ns = unsafe { bench(events, distinct, depth, out.as_mut_ptr()) };
            if ns == 0 {
                println!(
                    "| {route} | {events} | {depth} | {distinct} | the run failed (its message above): no figure |"
                );
                continue;
            }
            let per_s = events as f64 / (ns as f64 / 1e9);
            let writer_ns = out[3].max(1);
            println!(
                "| {route} | {events} | {depth} | {distinct} | {} | {} | {:.2}M | {:.0} | {:.2}M | {:.1} MiB |",
                out[0],
                out[2],
                per_s / 1e6,
                ns as f64 / events as f64,
                events as f64 / (writer_ns as f64 / 1e9) / 1e6,
                out[1] as f64 / (1 << 20) as f64
            );
        }
    }
}
