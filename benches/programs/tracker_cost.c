/* tracker_cost.c: what memsnap's PyTorch trace tracker costs per trace entry, on the PyTorch
 * 2.11 stand-in (tests/fake_torch, built by scripts/build-fake-cuda.sh), for
 * benches/hook-instructions.sh (callgrind counts the tracker's instructions).
 *
 *   tracker_cost ROUNDS DEPTH [LIBC10_CUDA [EVICT_BYTES]]
 *
 * One cudaMalloc + cudaFree first (a preloaded memsnap starts on it), then the stand-in is
 * loaded and initialized (one device). Each round, under DEPTH nested native frames, from
 * one of SITES call sites in rotation:
 *   - BATCH blocks allocated (standin_malloc: one ALLOC entry each; the first round also
 *     makes the segments),
 *   - each recorded on a side stream (standin_record_stream: no entry),
 *   - each freed (standin_free: FREE_REQUESTED only, the side stream keeps it pending),
 *   - all completed (standin_process_events: one FREE_COMPLETED each).
 * So each phase is one C entry point of the stand-in, which callgrind can collect alone
 * (--toggle-collect=standin_malloc, ...).
 *
 * With EVICT_BYTES > 0, WARM_ROUNDS rounds run first as above (the segments, each site's
 * first walks), then ROUNDS rounds in cold_rounds, which write that many bytes (one store per
 * 64-byte line) before each standin_malloc call, outside it: the work a real step does
 * between two allocations, which pushes the tracker's lines out of the nearer caches (the
 * route "tracker-cache" of benches/hook-instructions.sh collects cold_rounds alone and
 * counts the lines the tracker misses). The counts printed are then cold_rounds' own.
 *
 * Prints one line: "<tracker calls under standin_malloc> <under standin_free> <under
 * standin_process_events> <native frames at the call site>". */
#define _GNU_SOURCE
#include "../../tests/fake_cuda/cuda_fake.h"
#include "../../tests/fake_torch/standin_api.h"

#include <dlfcn.h>
#include <execinfo.h>
#include <stdio.h>
#include <stdlib.h>

#define SITES 6
#define BATCH 64
#define SIDE_STREAM ((uintptr_t)0x7001)
#define WARM_ROUNDS 2

static standin_malloc_fn s_malloc;
static standin_free_fn s_free;
static standin_record_stream_fn s_record_stream;
static standin_process_events_fn s_process_events;
static standin_count_fn s_tracker_calls;
static unsigned long long calls_malloc, calls_free, calls_complete;
static void *blocks[BATCH];
static volatile long sink;
static volatile uint64_t *evict_buffer;
static long evict_words; /* 0: no eviction */

static void *must(void *lib, const char *name) {
    void *fn = dlsym(lib, name);
    if (!fn) {
        fprintf(stderr, "tracker_cost: the stand-in has no %s\n", name);
        exit(1);
    }
    return fn;
}

#define SITE(n)                                                                    \
    __attribute__((noinline)) static void *alloc##n(size_t size) {                 \
        unsigned long long before = s_tracker_calls();                             \
        void *p = s_malloc(size, 0, 0);                                            \
        calls_malloc += s_tracker_calls() - before;                                \
        sink += n;                                                                 \
        return p;                                                                  \
    }                                                                              \
    __attribute__((noinline)) static void free##n(void *p) {                       \
        unsigned long long before = s_tracker_calls();                             \
        s_free(p);                                                                 \
        calls_free += s_tracker_calls() - before;                                  \
        sink += n;                                                                 \
    }
SITE(0)
SITE(1)
SITE(2)
SITE(3)
SITE(4)
SITE(5)
static void *(*const alloc_at[SITES])(size_t) = {alloc0, alloc1, alloc2, alloc3, alloc4, alloc5};
static void (*const free_at[SITES])(void *) = {free0, free1, free2, free3, free4, free5};

__attribute__((noinline)) static void rounds(long n) {
    for (long r = 0; r < n; r++) {
        for (int i = 0; i < BATCH; i++) {
            for (long w = 0; w < evict_words; w += 8) evict_buffer[w] += (uint64_t)i;
            blocks[i] = alloc_at[i % SITES](512 + (size_t)(i * 7 % 32) * 512);
            if (!blocks[i]) {
                fprintf(stderr, "tracker_cost: standin_malloc failed\n");
                exit(1);
            }
        }
        for (int i = 0; i < BATCH; i++) s_record_stream(blocks[i], SIDE_STREAM);
        for (int i = 0; i < BATCH; i++) free_at[i % SITES](blocks[i]);
        unsigned long long before = s_tracker_calls();
        s_process_events();
        calls_complete += s_tracker_calls() - before;
    }
}

/* rounds() with the eviction on, after the warm-up (collected alone by callgrind). */
__attribute__((noinline)) static void cold_rounds(long n) {
    rounds(n);
    sink += n;
}

__attribute__((noinline)) static int nested(int depth, long n) {
    if (depth <= 0) {
        if (evict_words > 0) {
            long words = evict_words;
            evict_words = 0;
            rounds(WARM_ROUNDS);
            calls_malloc = calls_free = calls_complete = 0;
            evict_words = words;
            cold_rounds(n);
        } else {
            rounds(n);
        }
        void *frames[256];
        /* backtrace here stands where alloc<n> stands, + 1 for standin_malloc */
        return backtrace(frames, 256) + 1;
    }
    int r = nested(depth - 1, n);
    sink += depth;
    return r;
}

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 200;
    int depth = argc > 2 ? atoi(argv[2]) : 26;
    void *first = NULL;
    if (cudaMalloc(&first, 4096) != cudaSuccess || cudaFree(first) != cudaSuccess) {
        fprintf(stderr, "tracker_cost: cudaMalloc failed\n");
        return 1;
    }
    const char *path = argc > 3 ? argv[3] : getenv("STANDIN_LIB");
    void *lib = path ? dlopen(path, RTLD_NOW | RTLD_LOCAL) : NULL;
    if (!lib) {
        fprintf(stderr, "tracker_cost: cannot load the stand-in (argv[3] or $STANDIN_LIB): %s\n",
                path ? dlerror() : "not given");
        return 1;
    }
    long evict_bytes = argc > 4 ? atol(argv[4]) : 0;
    if (evict_bytes > 0) {
        evict_words = evict_bytes / 8;
        evict_buffer = calloc((size_t)evict_words, 8);
        if (!evict_buffer) {
            fprintf(stderr, "tracker_cost: calloc failed\n");
            return 1;
        }
    }
    standin_init_fn init = (standin_init_fn)must(lib, "standin_init");
    s_malloc = (standin_malloc_fn)must(lib, "standin_malloc");
    s_free = (standin_free_fn)must(lib, "standin_free");
    s_record_stream = (standin_record_stream_fn)must(lib, "standin_record_stream");
    s_process_events = (standin_process_events_fn)must(lib, "standin_process_events");
    s_tracker_calls = (standin_count_fn)must(lib, "standin_tracker_calls");
    init(1);
    int frames = nested(depth, n);
    printf("%llu %llu %llu %d\n", calls_malloc, calls_free, calls_complete, frames);
    return 0;
}
