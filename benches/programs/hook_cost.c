/* hook_cost.c: what a recorded allocation costs, in a training-loop-like pattern, on the
 * simulated driver (runtime compiled in, like nvcc's default).
 *
 * Each iteration frees the oldest of WINDOW live allocations and allocates a new one
 * (cudaFreeAsync + cudaMallocAsync: two events), from one of SITES distinct call sites in
 * rotation, with a size drawn from a fixed table of 256 sizes (512 B .. 64 MiB, log-spread)
 * by a deterministic pseudo-random sequence. The call sites sit under DEPTH nested native
 * frames. Run with and without libmemsnap.so preloaded: the difference / 2 is memsnap's
 * cost per event.
 *
 *   hook_cost [iterations=200000] [depth=26] [evict_bytes=0]
 *
 * With evict_bytes > 0 the five timed runs write that many bytes (one store per 64-byte
 * line) before each iteration, outside the CUDA calls, so that what the calls read comes
 * from farther out in the cache hierarchy, as between two events of a real training step;
 * those runs go through cold_loop instead of timed_loop (the same frame depth), for a
 * profiler to collect them alone (benches/hook-instructions.sh, CACHE=1).
 *
 * Prints one line: "<best-of-5 ns per iteration> <CUDA calls made> <native frames>", where
 * CUDA calls made counts every successful cudaMallocAsync and cudaFreeAsync of the process
 * (warm-up and final drain included: what a preloaded memsnap must have recorded), and
 * native frames is the depth of the stack at cudaMallocAsync's entry (backtrace(3) at the
 * call site + 1), the stack memsnap walks in native mode.
 */
#include "../../tests/fake_cuda/cuda_fake.h"
#define BENCH_NAME "hook_cost"
#include "alloc_loop.h"
#include <execinfo.h>

#define SITES 6
#define WINDOW 16

static void *live[WINDOW];
static long head;  /* index of the oldest live allocation in the ring */
static long calls; /* successful CUDA calls */
static volatile long sink;

/* One training-loop step at a distinct call site: free the oldest, allocate a new one.
 * noinline + a distinct body each, so every site has its own return address. */
#define SITE(n)                                                                    \
    __attribute__((noinline)) static void site##n(size_t size) {                   \
        if (live[head] && cudaFreeAsync(live[head], 0) != cudaSuccess)             \
            fail("cudaFreeAsync");                                                 \
        calls += live[head] != NULL;                                               \
        if (cudaMallocAsync(&live[head], size, 0) != cudaSuccess)                  \
            fail("cudaMallocAsync");                                               \
        calls++;                                                                   \
        head = (head + 1) % WINDOW;                                                \
        sink += n;                                                                 \
    }
SITE(0)
SITE(1)
SITE(2)
SITE(3)
SITE(4)
SITE(5)
static void (*const site[SITES])(size_t) = {site0, site1, site2, site3, site4, site5};

__attribute__((noinline)) static double timed_loop(long iterations) {
    double start = now_ns();
    for (long i = 0; i < iterations; i++)
        site[i % SITES](sizes[next_random() % N_SIZES]);
    return (now_ns() - start) / iterations;
}

static volatile uint64_t *evict_buffer;
static long evict_words; /* 0: no eviction */

/* timed_loop with evict_words words written (one per line) before each iteration. */
__attribute__((noinline)) static double cold_loop(long iterations) {
    double start = now_ns();
    for (long i = 0; i < iterations; i++) {
        for (long w = 0; w < evict_words; w += 8) evict_buffer[w] += (uint64_t)i;
        site[i % SITES](sizes[next_random() % N_SIZES]);
    }
    return (now_ns() - start) / iterations;
}

/* Not a tail call (the add after it), so every level is a real frame on the stack. */
__attribute__((noinline)) static double nested(int depth, long iterations) {
    if (depth <= 0) return evict_buffer ? cold_loop(iterations) : timed_loop(iterations);
    double r = nested(depth - 1, iterations);
    sink += depth;
    return r;
}

__attribute__((noinline)) static int count_frames(void) {
    void *frames[256];
    return backtrace(frames, 256);
}

/* The same nesting as the timed path, to count frames: count_frames stands where
 * timed_loop stands, nested_count where nested does. */
__attribute__((noinline)) static int nested_count(int depth) {
    if (depth <= 0) {
        int r = count_frames();
        sink += r;
        return r;
    }
    int r = nested_count(depth - 1);
    sink += depth;
    return r;
}

int main(int argc, char **argv) {
    long iterations = argc > 1 ? atol(argv[1]) : 200000;
    int depth = argc > 2 ? atoi(argv[2]) : 26;
    fill_sizes();
    /* backtrace at timed_loop's level, + 1 for site<n>, + 1 for cudaMallocAsync (which
     * makes the driver call memsnap hooks). */
    int frames = nested_count(depth) + 1 + 1;
    nested(depth, 20000); /* warm-up: first-use set-up of the runtime and of memsnap */
    long evict_bytes = argc > 3 ? atol(argv[3]) : 0;
    if (evict_bytes > 0) {
        evict_words = evict_bytes / 8;
        evict_buffer = calloc((size_t)evict_words, 8);
        if (!evict_buffer) fail("calloc");
    }
    double best = 1e18;
    for (int run = 0; run < 5; run++) {
        double ns = nested(depth, iterations);
        if (ns < best) best = ns;
    }
    for (int i = 0; i < WINDOW; i++) {
        if (live[i]) {
            if (cudaFreeAsync(live[i], 0) != cudaSuccess) fail("cudaFreeAsync");
            calls++;
        }
    }
    printf("%.1f %ld %d\n", best, calls, frames);
    return 0;
}
