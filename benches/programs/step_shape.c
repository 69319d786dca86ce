/* step_shape.c: what a recorded allocation costs when the stacks look like a training step's,
 * on the simulated driver (runtime compiled in, like nvcc's default).
 *
 * hook_cost.c allocates from 6 call sites under one fixed stack, so the native walk of each
 * allocation reuses all but the innermost frames of the previous one. In a real step
 * (benches/gpu/step_stacks.py on a transformer's training step) consecutive allocations come
 * from different operators: about 450 distinct stacks a step, 48-50 native frames each, and a
 * walk unwinds 17-19 frames before it meets the previous walk's (it reuses the outer 36).
 * This program gives its allocations that shape: an outer part of OUTER nested frames, the
 * same for every allocation, under an inner chain of 12-22 frames that differs from one
 * allocation to the next: each iteration picks one of PATHS paths by a deterministic
 * pseudo-random sequence; a path is a chain of calls through FUNCTIONS distinct functions
 * (each has its own return address), then frees the oldest of WINDOW live allocations and
 * allocates a new one (cudaFreeAsync + cudaMallocAsync: two events) with a size drawn from a
 * fixed table of 256 sizes (512 B .. 64 MiB).
 *
 *   step_shape [iterations=100000] [outer=30] [paths=450]
 *
 * Prints one line: "<best-of-5 ns per iteration> <CUDA calls made> <native frames at
 * cudaMallocAsync, averaged over the paths>".
 */
#include "../../tests/fake_cuda/cuda_fake.h"
#define BENCH_NAME "step_shape"
#include "alloc_loop.h"
#include <execinfo.h>

#define WINDOW 16
#define FUNCTIONS 256
#define MAX_PATHS 4096
#define MIN_INNER 12
#define INNER_SPREAD 11 /* inner depth: MIN_INNER .. MIN_INNER + INNER_SPREAD - 1 */

static void *live[WINDOW];
static long head;  /* index of the oldest live allocation in the ring */
static long calls; /* successful CUDA calls */
static volatile long sink;
static int counting; /* the chain ends in count_frames instead of the allocation */
static long frames_seen;

__attribute__((noinline)) static void count_frames(void) {
    void *frames[512];
    frames_seen += backtrace(frames, 512) + 1; /* + cudaMallocAsync */
}

/* The innermost frame: free the oldest, allocate a new one. */
__attribute__((noinline)) static void allocate(size_t size) {
    if (counting) {
        count_frames();
        return;
    }
    if (live[head] && cudaFreeAsync(live[head], 0) != cudaSuccess) fail("cudaFreeAsync");
    calls += live[head] != NULL;
    if (cudaMallocAsync(&live[head], size, 0) != cudaSuccess) fail("cudaMallocAsync");
    calls++;
    head = (head + 1) % WINDOW;
}

typedef void (*link_fn)(int level, unsigned path, size_t size);
static link_fn links[FUNCTIONS];

/* Which function a path calls at a level: a fixed mix of both, so that paths share some
 * links and differ in others, as operators share the dispatcher's frames. */
static inline link_fn next_link(int level, unsigned path) {
    return links[(path * 2654435761u + (unsigned)level * 40503u) % FUNCTIONS];
}

/* One link of a chain: noinline, a distinct body each, and not a tail call (the add after
 * it), so that every level is a real frame with its own return address. */
#define LINK(n)                                                                        \
    __attribute__((noinline)) static void link##n(int level, unsigned path, size_t size) { \
        if (level <= 0)                                                                \
            allocate(size);                                                            \
        else                                                                           \
            next_link(level, path)(level - 1, path, size);                             \
        sink += n;                                                                     \
    }
#define LINK8(n) LINK(n##0) LINK(n##1) LINK(n##2) LINK(n##3) LINK(n##4) LINK(n##5) LINK(n##6) LINK(n##7)
#define LINK64(n) LINK8(n##0) LINK8(n##1) LINK8(n##2) LINK8(n##3) LINK8(n##4) LINK8(n##5) LINK8(n##6) LINK8(n##7)
LINK64(1)
LINK64(2)
LINK64(3)
LINK64(4)
#define REF(n) link##n,
#define REF8(n) REF(n##0) REF(n##1) REF(n##2) REF(n##3) REF(n##4) REF(n##5) REF(n##6) REF(n##7)
#define REF64(n) REF8(n##0) REF8(n##1) REF8(n##2) REF8(n##3) REF8(n##4) REF8(n##5) REF8(n##6) REF8(n##7)
static const link_fn all_links[FUNCTIONS] = {REF64(1) REF64(2) REF64(3) REF64(4)};

static unsigned paths = 450;

static void run_path(unsigned path) {
    int depth = MIN_INNER + (int)(path % INNER_SPREAD);
    next_link(depth, path)(depth - 1, path, sizes[(path * 7919u) % N_SIZES]);
}

__attribute__((noinline)) static double timed_loop(long iterations) {
    double start = now_ns();
    for (long i = 0; i < iterations; i++) run_path((unsigned)(next_random() % paths));
    return (now_ns() - start) / iterations;
}

__attribute__((noinline)) static double count_loop(long unused) {
    (void)unused;
    counting = 1;
    for (unsigned p = 0; p < paths; p++) run_path(p);
    counting = 0;
    return 0;
}

/* Not a tail call (the add after it), so every level is a real frame on the stack. */
__attribute__((noinline)) static double nested(int depth, double (*loop)(long), long iterations) {
    if (depth <= 0) return loop(iterations);
    double r = nested(depth - 1, loop, iterations);
    sink += depth;
    return r;
}

int main(int argc, char **argv) {
    long iterations = argc > 1 ? atol(argv[1]) : 100000;
    int outer = argc > 2 ? atoi(argv[2]) : 30;
    paths = argc > 3 ? (unsigned)atoi(argv[3]) : 450;
    if (paths < 1 || paths > MAX_PATHS) fail("paths (1..4096)");
    for (int i = 0; i < FUNCTIONS; i++) links[i] = all_links[i];
    fill_sizes();
    nested(outer, count_loop, 0);
    double frames = (double)frames_seen / paths;
    nested(outer, timed_loop, 20000); /* warm-up: first-use set-up of the runtime and memsnap */
    double best = 1e18;
    for (int run = 0; run < 5; run++) {
        double ns = nested(outer, timed_loop, iterations);
        if (ns < best) best = ns;
    }
    for (int i = 0; i < WINDOW; i++) {
        if (live[i]) {
            if (cudaFreeAsync(live[i], 0) != cudaSuccess) fail("cudaFreeAsync");
            calls++;
        }
    }
    printf("%.1f %ld %.0f\n", best, calls, frames);
    return 0;
}
