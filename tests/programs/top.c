/* top.c (static runtime): a long-running process for `memsnap top`. Allocates from two sites
 * that memsnap's site rules tell apart: top_weights (3 MiB, twice) and top_cache (5 MiB), plus
 * a 1 MiB buffer freed at once; prints its own count of live bytes per site, then
 * "result ready=1" (flushed), and waits on stdin. Each line "grow" read there allocates
 * 2 MiB more from top_cache, ends a step (memsnap_step) and prints the counts again with
 * "result ready=N". At end of file it prints the fake driver's truth and exits 0. An alarm
 * ends it after 120 s if nobody closes stdin. */
#include "prog_common.h"

#include <unistd.h>

#define NOINLINE __attribute__((noinline))
#define MIB (1ull << 20)

static unsigned long long weights_bytes, cache_bytes;

NOINLINE void *top_weights(unsigned long long bytes) {
    void *p = NULL;
    CHECK_RT(cudaMalloc(&p, bytes));
    weights_bytes += bytes;
    return p;
}

NOINLINE void *top_cache(unsigned long long bytes) {
    void *p = NULL;
    CHECK_RT(cudaMalloc(&p, bytes));
    cache_bytes += bytes;
    return p;
}

static void report(int ready) {
    printf("result live_bytes=%llu\n", weights_bytes + cache_bytes);
    printf("result weights_bytes=%llu\n", weights_bytes);
    printf("result cache_bytes=%llu\n", cache_bytes);
    printf("result ready=%d\n", ready);
    fflush(stdout);
}

int main(void) {
    alarm(120);
    (void)top_weights(3 * MIB);
    (void)top_weights(3 * MIB);
    (void)top_cache(5 * MIB);
    void *scratch = NULL;
    CHECK_RT(cudaMalloc(&scratch, 1 * MIB));
    CHECK_RT(cudaFree(scratch));
    int ready = 1;
    report(ready);
    char line[64];
    while (fgets(line, sizeof line, stdin)) {
        if (strncmp(line, "grow", 4) == 0) {
            (void)top_cache(2 * MIB);
            step_marker();
            report(++ready);
        }
    }
    print_truth();
    return 0;
}
