//! What a `memsnap top` request costs the recording process's writer thread (not a timed
//! test; figures go to docs/BENCHMARKS.md).
//!
//! `cargo bench --bench live` builds the release `libmemsnap.so` and calls its
//! `memsnap_debug_bench_live` entry point: a writer holding N live allocations (stacks of
//! native frames from a set of distinct stacks) answers sample requests from a client
//! thread over the real socket, asking as `memsnap top` does (only the frames it does not
//! hold yet); each request's cost is the writer time of the drain-loop
//! passes that served it (accept, read, build the sample, encode, send). See
//! benches/in_library/writer_drain.rs.

mod support;

fn main() {
    if !support::benchmarking("live") {
        return;
    }
    type Bench = unsafe extern "C" fn(u64, u32, u32, u32, *mut u64) -> u64;
    let b = support::entry_point(c"memsnap_debug_bench_live");
    // SAFETY: the symbol has this C signature.
    let bench = unsafe { std::mem::transmute::<*mut libc::c_void, Bench>(b) };
    let requests = 50u32;
    println!(
        "| live allocations | distinct stacks | frames per stack | requests | writer time per request (median) | slowest | answer size | first request (all frames) | its answer |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for (live, distinct) in [(100_000u64, 100u32), (100_000, 2_000), (100_000, 20_000)] {
        let mut out = [0u64; 4];
        // SAFETY: a valid function pointer and a four-element output array.
        let median = unsafe { bench(live, distinct, 32, requests, out.as_mut_ptr()) };
        println!(
            "| {live} | {distinct} | 32 | {requests} | {:.2} ms | {:.2} ms | {:.1} KiB | {:.1} ms | {:.0} KiB |",
            median as f64 / 1e6,
            out[0] as f64 / 1e6,
            out[1] as f64 / 1024.0,
            out[2] as f64 / 1e6,
            out[3] as f64 / 1024.0
        );
    }
}
