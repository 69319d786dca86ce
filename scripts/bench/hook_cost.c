/* hook_cost.c: what a recorded allocation costs. N cudaMallocAsync + cudaFreeAsync pairs on
 * the simulated driver (runtime compiled in, like nvcc's default), called from DEPTH nested
 * native frames; prints the best-of-5 nanoseconds per pair. Run with and without
 * libmemsnap.so preloaded: the difference / 2 is memsnap's cost per event.
 *
 *   hook_cost [pairs=200000] [depth=26]
 */
#include "../../tests/fake_cuda/cuda_fake.h"
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static volatile long sink;

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

__attribute__((noinline)) static double timed_pairs(long pairs) {
    void *p = NULL;
    double start = now_ns();
    for (long i = 0; i < pairs; i++) {
        if (cudaMallocAsync(&p, 4096, 0) != cudaSuccess || cudaFreeAsync(p, 0) != cudaSuccess) {
            fprintf(stderr, "hook_cost: allocation failed\n");
            exit(1);
        }
    }
    return (now_ns() - start) / pairs;
}

/* Not a tail call (the add after it), so every level is a real frame on the stack. */
__attribute__((noinline)) static double nested(int depth, long pairs) {
    if (depth <= 0) return timed_pairs(pairs);
    double r = nested(depth - 1, pairs);
    sink += depth;
    return r;
}

int main(int argc, char **argv) {
    long pairs = argc > 1 ? atol(argv[1]) : 200000;
    int depth = argc > 2 ? atoi(argv[2]) : 26;
    nested(depth, 20000); /* warm-up: first-use set-up of the runtime and of memsnap */
    double best = 1e18;
    for (int run = 0; run < 5; run++) {
        double ns = nested(depth, pairs);
        if (ns < best) best = ns;
    }
    printf("%.1f\n", best);
    return 0;
}
