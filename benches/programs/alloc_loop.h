/* alloc_loop.h: what the C allocation benchmarks (hook_cost.c, step_shape.c) share: the
 * deterministic pseudo-random sequence, the size table, the clock and the failure exit.
 * Each program defines BENCH_NAME before including it. */
#ifndef ALLOC_LOOP_H
#define ALLOC_LOOP_H
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define N_SIZES 256

static size_t sizes[N_SIZES];
static uint64_t rng = 0x9E3779B97F4A7C15ull;

static inline uint64_t next_random(void) { /* xorshift64* */
    rng ^= rng >> 12;
    rng ^= rng << 25;
    rng ^= rng >> 27;
    return rng * 0x2545F4914F6CDD1Dull;
}

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

static void fail(const char *what) {
    fprintf(stderr, BENCH_NAME ": %s failed\n", what);
    exit(1);
}

/* 256 sizes from 512 B to 64 MiB, spread log-uniformly, multiples of 512. */
static void fill_sizes(void) {
    for (int i = 0; i < N_SIZES; i++) {
        double bytes = 512.0;
        for (int k = 0; k < i; k++) bytes *= 1.0472; /* 1.0472^255 ~ 2^17 */
        sizes[i] = ((size_t)bytes + 511) / 512 * 512;
    }
}
#endif
